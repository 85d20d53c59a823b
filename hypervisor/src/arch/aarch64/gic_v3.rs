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

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{AtomicU64, Ordering};

use crate::vgic::{lr_value_v3, parse_lr_v3, LrState, PendingIrq};

static GICD: AtomicU64 = AtomicU64::new(0);
static GICR: AtomicU64 = AtomicU64::new(0);
static GICR_SIZE: AtomicU64 = AtomicU64::new(0);

const GICD_CTLR: u64 = 0x0000;
const CTLR_RWP: u32 = 1 << 31;
/// EnableGrp0, EnableGrp1 and ARE in the one-security-state view; in the
/// non-secure view of a two-state GIC the same bits are EnableGrp1(NS),
/// EnableGrp1A and ARE_NS. Either way: group 1 forwarded, affinity routing.
const CTLR_ENABLE: u32 = (1 << 0) | (1 << 1) | (1 << 4);

const GICR_TYPER: u64 = 0x0008;
const GICR_WAKER: u64 = 0x0014;
const TYPER_VLPIS: u64 = 1 << 1;
const TYPER_LAST: u64 = 1 << 4;
const WAKER_PROCESSOR_SLEEP: u32 = 1 << 1;
const WAKER_CHILDREN_ASLEEP: u32 = 1 << 2;
const GICR_SGI: u64 = 0x1_0000;
const GICR_IGROUPR0: u64 = GICR_SGI + 0x080;
const GICR_ISENABLER0: u64 = GICR_SGI + 0x100;
const GICR_IPRIORITYR: u64 = GICR_SGI + 0x400;

/// ICH_HCR_EL2 bits: En and UIE, at the same places as GICH_HCR's.
pub const HCR_EN: u64 = 1 << 0;
pub const HCR_UIE: u64 = 1 << 1;

fn mmio_read(addr: u64) -> u32 {
    // SAFETY: addresses are inside the GIC regions the device tree gave,
    // mapped as device memory by the EL2 identity map; registers are 32-bit.
    unsafe { read_volatile(addr as *const u32) }
}

fn mmio_read64(addr: u64) -> u64 {
    // SAFETY: as in `mmio_read`; GICR_TYPER takes 64-bit reads.
    unsafe { read_volatile(addr as *const u64) }
}

fn mmio_write(addr: u64, value: u32) {
    // SAFETY: as in `mmio_read`.
    unsafe { write_volatile(addr as *mut u32, value) }
}

macro_rules! sysreg_read {
    ($name:literal) => {{
        let value: u64;
        // SAFETY: reading a GIC system register at EL2 (ICC_SRE_EL2.SRE is
        // set before any of these is used) has no side effect beyond the
        // one named by the register (acknowledge for IAR).
        unsafe { asm!(concat!("mrs {}, ", $name), out(reg) value, options(nostack)) };
        value
    }};
}

macro_rules! sysreg_write {
    ($name:literal, $value:expr) => {{
        let value: u64 = $value;
        // SAFETY: writing a GIC system register at EL2 changes only the GIC
        // state of this CPU, which this module owns.
        unsafe { asm!(concat!("msr ", $name, ", {}"), in(reg) value, options(nostack)) };
    }};
}

fn isb() {
    // SAFETY: a barrier.
    unsafe { asm!("isb", options(nostack, nomem)) };
}

/// Record the register bases and enable the distributor (boot CPU, once).
pub fn init_distributor(gicd: u64, gicr: u64, gicr_size: u64) {
    GICD.store(gicd, Ordering::Relaxed);
    GICR.store(gicr, Ordering::Relaxed);
    GICR_SIZE.store(gicr_size, Ordering::Relaxed);
    mmio_write(gicd + GICD_CTLR, 0);
    wait_rwp(gicd);
    mmio_write(gicd + GICD_CTLR, CTLR_ENABLE);
    wait_rwp(gicd);
}

fn wait_rwp(gicd: u64) {
    for _ in 0..1_000_000 {
        if mmio_read(gicd + GICD_CTLR) & CTLR_RWP == 0 {
            return;
        }
        core::hint::spin_loop();
    }
}

/// This CPU's redistributor: the frame whose GICR_TYPER affinity is ours.
fn own_redistributor() -> Option<u64> {
    let mpidr = super::mpidr();
    let affinity = ((mpidr >> 32) & 0xff) << 24 | (mpidr & 0xff_ffff);
    let base = GICR.load(Ordering::Relaxed);
    let end = base + GICR_SIZE.load(Ordering::Relaxed);
    let mut frame = base;
    while frame < end {
        let typer = mmio_read64(frame + GICR_TYPER);
        if typer >> 32 == affinity {
            return Some(frame);
        }
        if typer & TYPER_LAST != 0 {
            return None;
        }
        frame += if typer & TYPER_VLPIS != 0 {
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
    // ICC_SRE_EL2: SRE, DFB, DIB, Enable (EL1 may use ICC_SRE_EL1).
    sysreg_write!("S3_4_C12_C9_5", 0xf);
    isb();
    let Some(rd) = own_redistributor() else {
        return false;
    };
    let waker = mmio_read(rd + GICR_WAKER);
    mmio_write(rd + GICR_WAKER, waker & !WAKER_PROCESSOR_SLEEP);
    for _ in 0..1_000_000 {
        if mmio_read(rd + GICR_WAKER) & WAKER_CHILDREN_ASLEEP == 0 {
            break;
        }
        core::hint::spin_loop();
    }
    let mut group = mmio_read(rd + GICR_IGROUPR0);
    for &intid in intids {
        group |= 1 << intid;
        let off = GICR_IPRIORITYR + u64::from(intid & !3);
        let shift = (intid % 4) * 8;
        let v = mmio_read(rd + off) & !(0xff << shift);
        mmio_write(rd + off, v | (u32::from(priority) << shift));
    }
    mmio_write(rd + GICR_IGROUPR0, group);
    let enable = intids.iter().fold(0u32, |m, &i| m | 1 << i);
    mmio_write(rd + GICR_ISENABLER0, enable);
    // ICC_PMR_EL1: everything passes; ICC_BPR1_EL1: no subpriority.
    sysreg_write!("S3_0_C4_C6_0", 0xff);
    sysreg_write!("S3_0_C12_C12_3", 0);
    // ICC_CTLR_EL1: EOImode 1.
    sysreg_write!("S3_0_C12_C12_4", 1 << 1);
    // ICC_IGRPEN1_EL1: group 1 on.
    sysreg_write!("S3_0_C12_C12_7", 1);
    isb();
    reset_virtual_interface();
    true
}

/// Clear every list register and the active priorities; enable ICH.
pub fn reset_virtual_interface() {
    for i in 0..list_registers() {
        write_lr_raw(i, 0);
    }
    sysreg_write!("S3_4_C12_C8_0", 0); // ICH_AP0R0_EL2
    sysreg_write!("S3_4_C12_C9_0", 0); // ICH_AP1R0_EL2
    sysreg_write!("S3_4_C12_C11_7", 0); // ICH_VMCR_EL2
    set_hcr(HCR_EN);
}

pub fn set_hcr(value: u64) {
    sysreg_write!("S3_4_C12_C11_0", value);
    isb();
}

/// Number of list registers (ICH_VTR_EL2.ListRegs + 1).
pub fn list_registers() -> usize {
    ((sysreg_read!("S3_4_C12_C11_1") & 0x1f) + 1) as usize
}

/// Acknowledge the highest pending group-1 interrupt: (INTID, IAR value).
pub fn acknowledge() -> (u32, u32) {
    let iar = sysreg_read!("S3_0_C12_C12_0") as u32;
    (iar & 0xff_ffff, iar)
}

/// Priority drop (EOImode 1).
pub fn end_of_interrupt(iar: u32) {
    sysreg_write!("S3_0_C12_C12_1", u64::from(iar));
    isb();
}

/// Deactivate an interrupt.
pub fn deactivate(iar: u32) {
    sysreg_write!("S3_0_C12_C11_1", u64::from(iar));
    isb();
}

/// Send SGI `sgi` to the CPU with this MPIDR.
pub fn send_sgi(mpidr: u64, sgi: u32) {
    let aff0 = mpidr & 0xff;
    let value = ((mpidr >> 32) & 0xff) << 48
        | ((mpidr >> 16) & 0xff) << 32
        | ((mpidr >> 8) & 0xff) << 16
        | (aff0 / 16) << 44
        | u64::from(sgi & 0xf) << 24
        | 1 << (aff0 % 16);
    // SAFETY: orders earlier stores before the SGI becomes visible.
    unsafe { asm!("dsb ishst", options(nostack)) };
    sysreg_write!("S3_0_C12_C11_5", value); // ICC_SGI1R_EL1
    isb();
}

macro_rules! lr_access {
    ($i:expr, $value:ident, $op:ident) => {
        match $i {
            0 => $op!("S3_4_C12_C12_0", $value),
            1 => $op!("S3_4_C12_C12_1", $value),
            2 => $op!("S3_4_C12_C12_2", $value),
            3 => $op!("S3_4_C12_C12_3", $value),
            4 => $op!("S3_4_C12_C12_4", $value),
            5 => $op!("S3_4_C12_C12_5", $value),
            6 => $op!("S3_4_C12_C12_6", $value),
            7 => $op!("S3_4_C12_C12_7", $value),
            8 => $op!("S3_4_C12_C13_0", $value),
            9 => $op!("S3_4_C12_C13_1", $value),
            10 => $op!("S3_4_C12_C13_2", $value),
            11 => $op!("S3_4_C12_C13_3", $value),
            12 => $op!("S3_4_C12_C13_4", $value),
            13 => $op!("S3_4_C12_C13_5", $value),
            14 => $op!("S3_4_C12_C13_6", $value),
            15 => $op!("S3_4_C12_C13_7", $value),
            _ => Default::default(),
        }
    };
}

macro_rules! lr_read_one {
    ($name:literal, $unused:ident) => {
        sysreg_read!($name)
    };
}

macro_rules! lr_write_one {
    ($name:literal, $value:ident) => {
        sysreg_write!($name, $value)
    };
}

fn read_lr_raw(i: usize) -> u64 {
    let unused = 0u64;
    let _ = unused;
    lr_access!(i, unused, lr_read_one)
}

fn write_lr_raw(i: usize, value: u64) {
    lr_access!(i, value, lr_write_one)
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
