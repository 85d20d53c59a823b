//! The physical GIC as the hypervisor uses it at EL2, GICv2 here and GICv3
//! in [`super::gic_v3`], behind one interface (the version is chosen once
//! at boot from the device tree).
//!
//! GICv2: the distributor and
//! CPU interface for its own interrupts (the maintenance interrupt, the
//! guests' virtual timer, SGIs that kick a CPU out of its guest), and the
//! hypervisor control interface (GICH) whose list registers deliver virtual
//! interrupts to the guest running on this CPU. The guest's CPU interface is
//! the hardware GICV page, mapped into its stage 2.
//!
//! The CPU interface runs with EOImode 1: writing EOIR only drops priority,
//! so an interrupt handed to a guest through a hardware-linked list register
//! (the virtual timer) stays active until the guest's own EOI deactivates it.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use super::gic_v3 as v3;
use crate::vgic::{lr_value, parse_lr, LrState, PendingIrq, LR_EOI, LR_HW};

/// 0: no GIC we drive; 2 or 3: the architecture version in use.
static VERSION: AtomicU8 = AtomicU8::new(0);

/// Register bases, set once at boot from the device tree.
static GICD: AtomicU64 = AtomicU64::new(0);
static GICC: AtomicU64 = AtomicU64::new(0);
static GICH: AtomicU64 = AtomicU64::new(0);
/// Each logical CPU's GIC CPU-interface mask (GICD_ITARGETSR0 read on it).
static CPU_IF: [core::sync::atomic::AtomicU8; super::MAX_CPUS] =
    [const { core::sync::atomic::AtomicU8::new(0) }; super::MAX_CPUS];

const GICD_CTLR: u64 = 0x000;
const GICD_ISENABLER: u64 = 0x100;
const GICD_IPRIORITYR: u64 = 0x400;
const GICD_ITARGETSR: u64 = 0x800;
const GICD_SGIR: u64 = 0xf00;

const GICC_CTLR: u64 = 0x00;
const GICC_PMR: u64 = 0x04;
const GICC_IAR: u64 = 0x0c;
const GICC_EOIR: u64 = 0x10;
const GICC_DIR: u64 = 0x1000;

const GICH_HCR: u64 = 0x00;
const GICH_VTR: u64 = 0x04;
const GICH_VMCR: u64 = 0x08;
const GICH_APR: u64 = 0xf0;
const GICH_LR0: u64 = 0x100;

/// GICH_HCR bits: enable, underflow (at most one LR valid) and
/// no-pending maintenance interrupts.
const HCR_EN: u32 = 1 << 0;
const HCR_UIE: u32 = 1 << 1;

/// The SGI the hypervisor sends to make a CPU leave its guest.
pub const KICK_SGI: u32 = 0;
/// PPIs the hypervisor takes: the maintenance interrupt and the EL1 virtual
/// timer (handed to the guest).
pub const MAINTENANCE_PPI: u32 = 25;
/// The EL2 physical timer, which bounds how long a CPU sleeps for a guest.
pub const HYP_TIMER_PPI: u32 = 26;
pub const VTIMER_PPI: u32 = 27;
/// Spurious interrupt ID.
pub const SPURIOUS: u32 = 1023;

fn reg(base: &AtomicU64, off: u64) -> *mut u32 {
    (base.load(Ordering::Relaxed) + off) as *mut u32
}

fn rd(base: &AtomicU64, off: u64) -> u32 {
    // SAFETY: the base came from the device tree's GIC node and is mapped
    // as device memory by the EL2 identity map; GIC registers are 32-bit.
    unsafe { read_volatile(reg(base, off)) }
}

fn wr(base: &AtomicU64, off: u64, v: u32) {
    // SAFETY: as in `rd`.
    unsafe { write_volatile(reg(base, off), v) }
}

/// Whether the board's GIC gives us a hypervisor interface to use.
pub fn present() -> bool {
    VERSION.load(Ordering::Relaxed) != 0
}

fn is_v3() -> bool {
    VERSION.load(Ordering::Relaxed) == 3
}

/// GICv3: record the distributor and redistributor region and enable the
/// distributor (boot CPU, once).
pub fn init_v3(gicd: u64, gicr: u64, gicr_size: u64) {
    v3::init_distributor(gicd, gicr, gicr_size);
    VERSION.store(3, Ordering::Relaxed);
}

/// GICv2: record the register bases and enable the distributor (boot CPU,
/// once).
pub fn init_distributor(gicd: u64, gicc: u64, gich: u64) {
    VERSION.store(2, Ordering::Relaxed);
    GICD.store(gicd, Ordering::Relaxed);
    GICC.store(gicc, Ordering::Relaxed);
    GICH.store(gich, Ordering::Relaxed);
    // Group 0 (no security extensions) or the non-secure group 1 view:
    // bit 0 enables forwarding either way.
    wr(&GICD, GICD_CTLR, 1);
}

/// The interrupts the hypervisor takes on every CPU.
const OWN_INTIDS: [u32; 4] = [KICK_SGI, MAINTENANCE_PPI, HYP_TIMER_PPI, VTIMER_PPI];

/// Per-CPU set-up: our PPIs and SGI enabled, the CPU interface on with
/// EOImode 1, the virtual interface on. False if this CPU has no GIC
/// interface we can find (GICv3: no redistributor with its affinity).
pub fn init_cpu(cpu: usize) -> bool {
    if !present() {
        return false;
    }
    if is_v3() {
        return v3::init_cpu(&OWN_INTIDS, 0xa0);
    }
    // Reads of ITARGETSR0..7 return the reading CPU's own interface bit.
    if let Some(slot) = CPU_IF.get(cpu) {
        slot.store(rd(&GICD, GICD_ITARGETSR) as u8, Ordering::Relaxed);
    }
    for intid in OWN_INTIDS {
        // Priority 0xa0 (bytes of IPRIORITYR), enable (banked per CPU).
        let off = GICD_IPRIORITYR + (intid as u64 & !3);
        let shift = (intid % 4) * 8;
        let v = rd(&GICD, off) & !(0xff << shift);
        wr(&GICD, off, v | (0xa0 << shift));
        wr(&GICD, GICD_ISENABLER, 1 << intid);
    }
    wr(&GICC, GICC_PMR, 0xff);
    // Enable (group 0 / non-secure group 1) and EOImode(NS) = 1.
    wr(&GICC, GICC_CTLR, 1 | (1 << 9));
    reset_virtual_interface();
    true
}

/// Clear every list register and the active priorities; enable GICH.
pub fn reset_virtual_interface() {
    if is_v3() {
        return v3::reset_virtual_interface();
    }
    for i in 0..list_registers() {
        wr(&GICH, GICH_LR0 + 4 * i as u64, 0);
    }
    wr(&GICH, GICH_APR, 0);
    wr(&GICH, GICH_VMCR, 0);
    wr(&GICH, GICH_HCR, HCR_EN);
}

/// Number of list registers (GICH_VTR.ListRegs + 1).
pub fn list_registers() -> usize {
    if is_v3() {
        return v3::list_registers();
    }
    ((rd(&GICH, GICH_VTR) & 0x3f) + 1) as usize
}

/// Acknowledge the highest pending interrupt: its INTID (1023: none) and
/// the raw IAR value to give back to `end_of_interrupt`.
pub fn acknowledge() -> (u32, u32) {
    if is_v3() {
        return v3::acknowledge();
    }
    let iar = rd(&GICC, GICC_IAR);
    (iar & 0x3ff, iar)
}

/// Priority drop (EOImode 1): the interrupt stays active.
pub fn end_of_interrupt(iar: u32) {
    if is_v3() {
        return v3::end_of_interrupt(iar);
    }
    wr(&GICC, GICC_EOIR, iar);
}

/// Deactivate an interrupt the hypervisor handled itself.
pub fn deactivate(iar: u32) {
    if is_v3() {
        return v3::deactivate(iar);
    }
    wr(&GICC, GICC_DIR, iar);
}

/// Send SGI `KICK_SGI` to logical CPU `cpu` so it leaves its guest.
pub fn kick(cpu: usize) {
    if is_v3() {
        if let Some(mpidr) = super::smp::cpu_mpidr(cpu) {
            v3::send_sgi(mpidr, KICK_SGI);
        }
        return;
    }
    let mask = CPU_IF.get(cpu).map_or(0, |m| m.load(Ordering::Relaxed));
    if present() && mask != 0 {
        wr(&GICD, GICD_SGIR, (u32::from(mask) << 16) | KICK_SGI);
    }
}

/// List register `i` of this CPU, decoded.
pub fn read_lr(i: usize) -> LrState {
    if is_v3() {
        return v3::read_lr(i);
    }
    parse_lr(rd(&GICH, GICH_LR0 + 4 * i as u64))
}

/// Make `irq` pending in list register `i`; with `hw`, linked to that
/// physical INTID (the guest's deactivation deactivates it).
pub fn write_lr(i: usize, irq: &PendingIrq, hw: Option<u32>) {
    if is_v3() {
        return v3::write_lr(i, irq, hw);
    }
    let mut value = lr_value(irq);
    if let Some(physical) = hw {
        // PhysicalID in bits 19:10, which also hold EOI and the source.
        value = (value & !(LR_EOI | (0x3ff << 10))) | LR_HW | ((physical & 0x3ff) << 10);
    }
    wr(&GICH, GICH_LR0 + 4 * i as u64, value);
}

/// Empty list register `i`.
pub fn clear_lr(i: usize) {
    if is_v3() {
        return v3::clear_lr(i);
    }
    wr(&GICH, GICH_LR0 + 4 * i as u64, 0);
}

/// The virtual interface on, with the underflow maintenance interrupt
/// (at most one list register valid) when `underflow`.
pub fn enable_virtual_interface(underflow: bool) {
    if is_v3() {
        return v3::enable_virtual_interface(underflow);
    }
    let uie = if underflow { HCR_UIE } else { 0 };
    wr(&GICH, GICH_HCR, HCR_EN | uie);
}
