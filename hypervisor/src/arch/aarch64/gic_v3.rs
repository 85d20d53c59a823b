//! The physical GICv3 as the hypervisor uses it at EL2: the distributor
//! (affinity routing on), this CPU's redistributor for its SGI and PPIs, the
//! ICC_* system-register CPU interface, and the ICH_* hypervisor interface
//! whose list registers deliver virtual interrupts to the guest running on
//! this CPU. The guest reaches its CPU interface through the same ICC_*
//! names, which the hardware redirects to the virtual interface while
//! HCR_EL2.IMO/FMO are set; only SGI generation traps (see vm/handle.rs).
//!
//! As with GICv2, EOImode is 1: EOIR drops priority only, so the virtual
//! timer, handed to the guest through a hardware-linked list register, stays
//! active until the guest deactivates it.

use core::sync::atomic::{AtomicU64, Ordering};

use aarch64_cpu::asm::barrier;
use aarch64_cpu::registers::{
    ReadWriteable, Readable, Writeable, ICC_SRE_EL2, ICH_AP0R0_EL2, ICH_AP1R0_EL2, ICH_HCR_EL2,
    ICH_LR0_EL2, ICH_LR10_EL2, ICH_LR11_EL2, ICH_LR12_EL2, ICH_LR13_EL2, ICH_LR14_EL2,
    ICH_LR15_EL2, ICH_LR1_EL2, ICH_LR2_EL2, ICH_LR3_EL2, ICH_LR4_EL2, ICH_LR5_EL2, ICH_LR6_EL2,
    ICH_LR7_EL2, ICH_LR8_EL2, ICH_LR9_EL2, ICH_VMCR_EL2, ICH_VTR_EL2,
};

use tock_registers::registers::{ReadOnly, ReadWrite};
use tock_registers::{register_bitfields, register_structs};

use super::sysreg::{
    ICC_BPR1_EL1, ICC_CTLR_EL1, ICC_DIR_EL1, ICC_EOIR1_EL1, ICC_IAR1_EL1, ICC_IGRPEN1_EL1,
    ICC_INTID, ICC_PMR_EL1, ICC_SGI1R_EL1,
};
use crate::hw::context::VirtualInterface;
use crate::hw::gic_lr::MAX_LIST_REGISTERS as MAX_LRS;

use crate::hw::gic_lr::{lr_value_v3, parse_lr_v3, LrState, PendingIrq};

static GICD: AtomicU64 = AtomicU64::new(0);
static GICR: AtomicU64 = AtomicU64::new(0);
static GICR_SIZE: AtomicU64 = AtomicU64::new(0);

register_bitfields! {u32,
    GICD_CTLR [
        /// Register write pending: the last CTLR write has not taken effect.
        RWP OFFSET(31) NUMBITS(1) [],
        /// ARE in the one-security-state view, ARE_NS in the non-secure one.
        ARE OFFSET(4) NUMBITS(1) [],
        /// EnableGrp1 (one security state) or EnableGrp1A (non-secure view).
        EnableGrp1 OFFSET(1) NUMBITS(1) [],
        /// EnableGrp0 (one security state) or EnableGrp1(NS) (non-secure view).
        EnableGrp0 OFFSET(0) NUMBITS(1) []
    ],
    GICR_WAKER [
        ChildrenAsleep OFFSET(2) NUMBITS(1) [],
        ProcessorSleep OFFSET(1) NUMBITS(1) []
    ]
}

register_bitfields! {u64,
    GICR_TYPER [
        /// Aff3.Aff2.Aff1.Aff0 of the CPU this redistributor serves.
        Affinity OFFSET(32) NUMBITS(32) [],
        /// The last redistributor of the region.
        Last OFFSET(4) NUMBITS(1) [],
        /// Virtual LPIs: the frame has two more 64 KiB pages.
        VLPIS OFFSET(1) NUMBITS(1) []
    ]
}

register_structs! {
    /// The GICv3 distributor, as far as the hypervisor uses it.
    Distributor {
        (0x0000 => ctlr: ReadWrite<u32, GICD_CTLR::Register>),
        (0x0004 => _reserved0),
        (0x0080 => igroupr: [ReadWrite<u32>; 32]),
        (0x0100 => isenabler: [ReadWrite<u32>; 32]),
        (0x0180 => _reserved1),
        (0x0400 => ipriorityr: [ReadWrite<u32>; 255]),
        (0x07fc => _reserved2),
        /// One per INTID; those of SGIs and PPIs (0-31) are reserved.
        (0x6000 => irouter: [ReadWrite<u64>; 1020]),
        (0x7fe0 => @END),
    },
    /// One redistributor frame: RD_base, then SGI_base 64 KiB on.
    Redistributor {
        (0x0_0000 => _reserved0),
        (0x0_0008 => typer: ReadOnly<u64, GICR_TYPER::Register>),
        (0x0_0010 => _reserved1),
        (0x0_0014 => waker: ReadWrite<u32, GICR_WAKER::Register>),
        (0x0_0018 => _reserved2),
        /// SGIs and PPIs: group 1 when set.
        (0x1_0080 => igroupr0: ReadWrite<u32>),
        (0x1_0084 => _reserved3),
        (0x1_0100 => isenabler0: ReadWrite<u32>),
        (0x1_0104 => _reserved4),
        /// Set-active bits of the SGIs and PPIs.
        (0x1_0300 => isactiver0: ReadWrite<u32>),
        (0x1_0304 => _reserved5),
        /// One priority byte per SGI/PPI, four to a word.
        (0x1_0400 => ipriorityr: [ReadWrite<u32>; 8]),
        (0x1_0420 => @END),
    }
}

fn gicd() -> &'static Distributor {
    // SAFETY: GICD holds the distributor's base once the version is 3, in
    // the GIC regions the device tree gave, mapped as device memory by the
    // EL2 identity map for good.
    unsafe { super::mmio_block(GICD.load(Ordering::Relaxed)) }
}

fn isb() {
    barrier::isb(barrier::SY);
}

/// Record the register bases and enable the distributor (boot CPU, once).
pub fn init_distributor(gicd: u64, gicr: u64, gicr_size: u64) {
    GICD.store(gicd, Ordering::Relaxed);
    GICR.store(gicr, Ordering::Relaxed);
    GICR_SIZE.store(gicr_size, Ordering::Relaxed);
    let gicd = self::gicd();
    gicd.ctlr.set(0);
    wait_rwp(gicd);
    // Group 1 forwarded, affinity routing (whichever security view).
    gicd.ctlr
        .write(GICD_CTLR::EnableGrp0::SET + GICD_CTLR::EnableGrp1::SET + GICD_CTLR::ARE::SET);
    wait_rwp(gicd);
}

/// Route SPI `intid` (32..1020) to the CPU with affinity `mpidr`, group 1,
/// at `priority`, and enable it.
pub fn route_spi(intid: u32, mpidr: u64, priority: u8) {
    let gicd = self::gicd();
    let i = intid as usize;
    // Aff3 (bits 39:32) and Aff2.Aff1.Aff0 (23:0); routing mode 0: this CPU.
    gicd.irouter[i].set(mpidr & 0xff_00ff_ffff);
    let shift = (intid % 4) * 8;
    let priorities = &gicd.ipriorityr[i / 4];
    priorities.set(priorities.get() & !(0xff << shift) | (u32::from(priority) << shift));
    let group = &gicd.igroupr[i / 32];
    group.set(group.get() | 1 << (intid % 32));
    gicd.isenabler[i / 32].set(1 << (intid % 32));
    wait_rwp(gicd);
}

fn wait_rwp(gicd: &Distributor) {
    for _ in 0..1_000_000 {
        if !gicd.ctlr.is_set(GICD_CTLR::RWP) {
            return;
        }
        core::hint::spin_loop();
    }
}

/// This CPU's redistributor: the frame whose GICR_TYPER affinity is ours.
fn own_redistributor() -> Option<&'static Redistributor> {
    let mpidr = super::mpidr();
    let affinity = ((mpidr >> 32) & 0xff) << 24 | (mpidr & 0xff_ffff);
    let base = GICR.load(Ordering::Relaxed);
    let end = base + GICR_SIZE.load(Ordering::Relaxed);
    let mut frame = base;
    while frame < end {
        // SAFETY: `frame` starts a redistributor frame inside the region:
        // the first, or the one after a frame whose TYPER said it was not
        // the last.
        let rd: &'static Redistributor = unsafe { super::mmio_block(frame) };
        let typer = rd.typer.extract();
        if typer.read(GICR_TYPER::Affinity) == affinity {
            return Some(rd);
        }
        if typer.is_set(GICR_TYPER::Last) {
            return None;
        }
        frame += if typer.is_set(GICR_TYPER::VLPIS) {
            0x4_0000
        } else {
            0x2_0000
        };
    }
    None
}

/// Per-CPU set-up: the system-register interface on (also for EL1, so the
/// guest's ICC_SRE_EL1 reads SRE = 1), this CPU's redistributor awake with
/// our SGI and PPIs in group 1, the CPU interface on with EOImode 1, the
/// virtual interface on. False if no redistributor matches this CPU.
pub fn init_cpu(intids: &[u32], priority: u8) -> bool {
    // The system-register interface, IRQ/FIQ bypass off, and EL1 may use
    // ICC_SRE_EL1.
    ICC_SRE_EL2.write(
        ICC_SRE_EL2::SRE::SET
            + ICC_SRE_EL2::DFB::SET
            + ICC_SRE_EL2::DIB::SET
            + ICC_SRE_EL2::ENABLE::SET,
    );
    isb();
    let Some(rd) = own_redistributor() else {
        return false;
    };
    rd.waker.modify(GICR_WAKER::ProcessorSleep::CLEAR);
    for _ in 0..1_000_000 {
        if !rd.waker.is_set(GICR_WAKER::ChildrenAsleep) {
            break;
        }
        core::hint::spin_loop();
    }
    let mut group = rd.igroupr0.get();
    for &intid in intids {
        group |= 1 << intid;
        let priorities = &rd.ipriorityr[intid as usize / 4];
        let shift = (intid % 4) * 8;
        priorities.set(priorities.get() & !(0xff << shift) | (u32::from(priority) << shift));
    }
    rd.igroupr0.set(group);
    let enable = intids.iter().fold(0u32, |m, &i| m | 1 << i);
    rd.isenabler0.set(enable);
    // Every priority passes; no subpriority; EOImode 1; group 1 on.
    ICC_PMR_EL1.write(ICC_PMR_EL1::Priority.val(0xff));
    ICC_BPR1_EL1.write(ICC_BPR1_EL1::BinaryPoint.val(0));
    ICC_CTLR_EL1.write(ICC_CTLR_EL1::EOImode::SET);
    ICC_IGRPEN1_EL1.write(ICC_IGRPEN1_EL1::Enable::SET);
    isb();
    reset_virtual_interface();
    true
}

/// Clear every list register and the active priorities; enable ICH.
pub fn reset_virtual_interface() {
    for i in 0..list_registers() {
        write_lr_raw(i, 0);
    }
    ICH_AP0R0_EL2.set(0);
    ICH_AP1R0_EL2.set(0);
    ICH_VMCR_EL2.set(0);
    enable_virtual_interface(false);
}

/// The virtual interface on, with the underflow maintenance interrupt (at
/// most one list register valid) when `underflow`.
pub fn enable_virtual_interface(underflow: bool) {
    let uie = if underflow {
        ICH_HCR_EL2::UIE::SET
    } else {
        ICH_HCR_EL2::UIE::CLEAR
    };
    ICH_HCR_EL2.write(ICH_HCR_EL2::En::SET + uie);
    isb();
}

/// This CPU's virtual interface as the guest left it.
pub fn save_virtual_interface() -> VirtualInterface {
    let count = list_registers().min(MAX_LRS);
    let mut lrs = [0; MAX_LRS];
    for (i, lr) in lrs.iter_mut().enumerate().take(count) {
        *lr = read_lr_raw(i);
    }
    VirtualInterface {
        count: count as u8,
        lrs,
        vmcr: ICH_VMCR_EL2.get() as u32,
        apr: [ICH_AP0R0_EL2.get() as u32, ICH_AP1R0_EL2.get() as u32],
    }
}

/// Load a saved virtual interface (checked by its reader) into this CPU's.
pub fn load_virtual_interface(vif: &VirtualInterface) {
    for i in 0..list_registers().min(MAX_LRS) {
        write_lr_raw(i, vif.lrs[i]);
    }
    ICH_AP0R0_EL2.set(u64::from(vif.apr[0]));
    ICH_AP1R0_EL2.set(u64::from(vif.apr[1]));
    ICH_VMCR_EL2.set(u64::from(vif.vmcr));
    isb();
}

/// Make PPI `intid` (0-31) active on this CPU, as if taken and not yet
/// deactivated.
pub fn activate_private(intid: u32) {
    if let Some(rd) = own_redistributor() {
        rd.isactiver0.set(1 << (intid % 32));
    }
}

/// Number of list registers (ICH_VTR_EL2.ListRegs + 1).
pub fn list_registers() -> usize {
    (ICH_VTR_EL2.read(ICH_VTR_EL2::ListRegs) + 1) as usize
}

/// Acknowledge the highest pending group-1 interrupt: (INTID, IAR value).
pub fn acknowledge() -> (u32, u32) {
    let iar = ICC_IAR1_EL1.get();
    (ICC_INTID::INTID.read(iar) as u32, iar as u32)
}

/// Priority drop (EOImode 1).
pub fn end_of_interrupt(iar: u32) {
    ICC_EOIR1_EL1.set(u64::from(iar));
    isb();
}

/// Deactivate an interrupt.
pub fn deactivate(iar: u32) {
    ICC_DIR_EL1.set(u64::from(iar));
    isb();
}

/// Send SGI `sgi` to the CPU with this MPIDR.
pub fn send_sgi(mpidr: u64, sgi: u32) {
    use aarch64_cpu::registers::MPIDR_EL1::{Aff0, Aff1, Aff2, Aff3};
    use ICC_SGI1R_EL1 as SGI1R;
    let aff0 = Aff0.read(mpidr);
    // Earlier stores are visible before the SGI is.
    barrier::dsb(barrier::ISHST);
    ICC_SGI1R_EL1.write(
        SGI1R::Aff3.val(Aff3.read(mpidr))
            + SGI1R::Aff2.val(Aff2.read(mpidr))
            + SGI1R::Aff1.val(Aff1.read(mpidr))
            + SGI1R::RS.val(aff0 / 16)
            + SGI1R::INTID.val(u64::from(sgi))
            + SGI1R::TargetList.val(1 << (aff0 % 16)),
    );
    isb();
}

/// List register `$i` (0-15) as `$reg` in `$body`; `$default` for others.
/// aarch64-cpu has one unit type per list register, hence a match.
macro_rules! with_lr {
    ($i:expr, $reg:ident => $body:expr, $default:expr) => {
        match $i {
            0 => {
                let $reg = ICH_LR0_EL2;
                $body
            }
            1 => {
                let $reg = ICH_LR1_EL2;
                $body
            }
            2 => {
                let $reg = ICH_LR2_EL2;
                $body
            }
            3 => {
                let $reg = ICH_LR3_EL2;
                $body
            }
            4 => {
                let $reg = ICH_LR4_EL2;
                $body
            }
            5 => {
                let $reg = ICH_LR5_EL2;
                $body
            }
            6 => {
                let $reg = ICH_LR6_EL2;
                $body
            }
            7 => {
                let $reg = ICH_LR7_EL2;
                $body
            }
            8 => {
                let $reg = ICH_LR8_EL2;
                $body
            }
            9 => {
                let $reg = ICH_LR9_EL2;
                $body
            }
            10 => {
                let $reg = ICH_LR10_EL2;
                $body
            }
            11 => {
                let $reg = ICH_LR11_EL2;
                $body
            }
            12 => {
                let $reg = ICH_LR12_EL2;
                $body
            }
            13 => {
                let $reg = ICH_LR13_EL2;
                $body
            }
            14 => {
                let $reg = ICH_LR14_EL2;
                $body
            }
            15 => {
                let $reg = ICH_LR15_EL2;
                $body
            }
            _ => $default,
        }
    };
}

/// The raw value of list register `i` (its encoding is `crate::hw::gic_lr`'s).
fn read_lr_raw(i: usize) -> u64 {
    with_lr!(i, lr => lr.get(), 0)
}

fn write_lr_raw(i: usize, value: u64) {
    with_lr!(i, lr => lr.set(value), ())
}

pub fn read_lr(i: usize) -> LrState {
    parse_lr_v3(read_lr_raw(i))
}

pub fn write_lr(i: usize, irq: &PendingIrq, hw: Option<u32>) {
    write_lr_raw(i, lr_value_v3(irq, hw));
}

pub fn clear_lr(i: usize) {
    write_lr_raw(i, 0);
}
