//! Powering a board off where there is no PSCI: the BCM2835/BCM2711
//! power-management watchdog (the Raspberry Pi 4 without TF-A).

use core::ptr::{read_volatile, write_volatile};

const PM_PASSWORD: u32 = 0x5a00_0000;
const PM_RSTC: usize = 0x1c;
const PM_RSTS: usize = 0x20;
const PM_WDOG: usize = 0x24;
const PM_RSTC_WRCFG_CLR: u32 = 0xffff_ffcf;
const PM_RSTC_WRCFG_FULL_RESET: u32 = 0x20;
/// Boot partition 63 in PM_RSTS tells the firmware to halt instead of booting.
const PM_RSTS_PARTITION_HALT: u32 = 0x555;

/// Halt the board: select the firmware's "halt" partition, then let the
/// watchdog reset the chip (the firmware then stays halted; QEMU with
/// `-no-reboot` exits).
///
/// # Safety
/// `base` must be the mapped base of the PM watchdog register block.
pub unsafe fn bcm2835_watchdog_halt(base: u64) {
    let reg = |off: usize| (base as usize + off) as *mut u32;
    // SAFETY: the caller guarantees the register block is mapped; these are
    // 32-bit device registers.
    unsafe {
        let rsts = read_volatile(reg(PM_RSTS)) & !0xfff;
        write_volatile(reg(PM_RSTS), PM_PASSWORD | rsts | PM_RSTS_PARTITION_HALT);
        write_volatile(reg(PM_WDOG), PM_PASSWORD | 10);
        let rstc = read_volatile(reg(PM_RSTC)) & PM_RSTC_WRCFG_CLR;
        write_volatile(reg(PM_RSTC), PM_PASSWORD | rstc | PM_RSTC_WRCFG_FULL_RESET);
    }
}
