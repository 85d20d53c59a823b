//! Powering a board off where there is no PSCI: the BCM2835/BCM2711
//! power-management watchdog (the Raspberry Pi 4 without TF-A).

use tock_registers::interfaces::{Readable, Writeable};
use tock_registers::registers::ReadWrite;
use tock_registers::{register_bitfields, register_structs};

register_bitfields! {u32,
    /// The password every write must carry in its top byte.
    PM_PASSWD [
        PASSWD OFFSET(24) NUMBITS(8) [
            Password = 0x5a
        ]
    ],
    PM_RSTC [
        /// What the watchdog does when it expires.
        WRCFG OFFSET(4) NUMBITS(2) [
            FullReset = 0b10
        ]
    ],
    PM_RSTS [
        /// The boot partition the firmware starts next, its six bits in the
        /// even bit positions; partition 63 (0x555) tells it to halt
        /// instead of booting.
        PARTITION OFFSET(0) NUMBITS(12) [
            Halt = 0x555
        ]
    ],
    PM_WDOG [
        /// Watchdog ticks (about 16 us each) until it expires.
        TIME OFFSET(0) NUMBITS(20) []
    ]
}

register_structs! {
    /// The watchdog registers of the power-management block.
    PmRegs {
        (0x00 => _reserved0),
        (0x1c => rstc: ReadWrite<u32, PM_RSTC::Register>),
        (0x20 => rsts: ReadWrite<u32, PM_RSTS::Register>),
        (0x24 => wdog: ReadWrite<u32, PM_WDOG::Register>),
        (0x28 => @END),
    }
}

/// Halt the board: select the firmware's "halt" partition, then let the
/// watchdog reset the chip (the firmware then stays halted; QEMU with
/// `-no-reboot` exits).
///
/// # Safety
/// `base` must be the mapped base of the PM watchdog register block.
pub unsafe fn bcm2835_watchdog_halt(base: u64) {
    // SAFETY: the caller guarantees the register block is mapped; its
    // registers are only accessed through volatile 32-bit reads and writes.
    let pm = unsafe { &*(base as usize as *const PmRegs) };
    let password = PM_PASSWD::PASSWD::Password.value;
    let rsts = PM_RSTS::PARTITION::Halt.modify(pm.rsts.get());
    pm.rsts.set(password | rsts);
    pm.wdog.set(password | PM_WDOG::TIME.val(10).value);
    let rstc = PM_RSTC::WRCFG::FullReset.modify(pm.rstc.get());
    pm.rstc.set(password | rstc);
}
