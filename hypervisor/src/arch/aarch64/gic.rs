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

use core::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use tock_registers::interfaces::{Readable, Writeable};
use tock_registers::registers::{ReadOnly, ReadWrite, WriteOnly};
use tock_registers::{register_bitfields, register_structs};

use super::gic_v3 as v3;
use crate::hw::context::VirtualInterface;
use crate::hw::gic_lr::MAX_LIST_REGISTERS as MAX_LRS;
use crate::hw::gic_lr::{lr_value, parse_lr, LrState, PendingIrq};

/// 0: no GIC we drive; 2 or 3: the architecture version in use.
static VERSION: AtomicU8 = AtomicU8::new(0);

/// Register bases, set once at boot from the device tree.
static GICD: AtomicU64 = AtomicU64::new(0);
static GICC: AtomicU64 = AtomicU64::new(0);
static GICH: AtomicU64 = AtomicU64::new(0);
/// Each logical CPU's GIC CPU-interface mask (GICD_ITARGETSR0 read on it).
static CPU_IF: [core::sync::atomic::AtomicU8; super::MAX_CPUS] =
    [const { core::sync::atomic::AtomicU8::new(0) }; super::MAX_CPUS];

register_bitfields! {u32,
    GICD_CTLR [
        /// Group 0 (no security extensions) or, in the non-secure view,
        /// group 1: either way, forwarding on.
        Enable OFFSET(0) NUMBITS(1) []
    ],
    GICD_SGIR [
        CPUTargetList OFFSET(16) NUMBITS(8) [],
        SGIINTID OFFSET(0) NUMBITS(4) []
    ],
    GICC_CTLR [
        /// EOImode (non-secure): EOIR drops priority only, DIR deactivates.
        EOImodeNS OFFSET(9) NUMBITS(1) [],
        Enable OFFSET(0) NUMBITS(1) []
    ],
    GICC_PMR [
        Priority OFFSET(0) NUMBITS(8) []
    ],
    GICC_IAR [
        InterruptID OFFSET(0) NUMBITS(10) []
    ],
    GICH_HCR [
        /// Underflow maintenance interrupt: at most one list register valid.
        UIE OFFSET(1) NUMBITS(1) [],
        En OFFSET(0) NUMBITS(1) []
    ],
    GICH_VTR [
        /// Number of list registers minus one.
        ListRegs OFFSET(0) NUMBITS(6) []
    ]
}

register_structs! {
    /// The GICv2 distributor, as far as the hypervisor uses it.
    Distributor {
        (0x000 => ctlr: ReadWrite<u32, GICD_CTLR::Register>),
        (0x004 => _reserved0),
        /// Set-enable bits; word 0 (SGIs and PPIs) is banked per CPU.
        (0x100 => isenabler: [ReadWrite<u32>; 32]),
        (0x180 => _reserved1),
        /// Set-active bits; word 0 is banked per CPU.
        (0x300 => isactiver: [ReadWrite<u32>; 32]),
        (0x380 => _reserved4),
        /// One priority byte per interrupt, four to a word.
        (0x400 => ipriorityr: [ReadWrite<u32>; 255]),
        (0x7fc => _reserved2),
        /// Words 0-7 read as the reading CPU's own interface bit per byte.
        (0x800 => itargetsr: [ReadWrite<u32>; 255]),
        (0xbfc => _reserved3),
        (0xf00 => sgir: WriteOnly<u32, GICD_SGIR::Register>),
        (0xf04 => @END),
    },
    /// The GICv2 CPU interface.
    CpuInterface {
        (0x0000 => ctlr: ReadWrite<u32, GICC_CTLR::Register>),
        (0x0004 => pmr: ReadWrite<u32, GICC_PMR::Register>),
        (0x0008 => _reserved0),
        (0x000c => iar: ReadOnly<u32, GICC_IAR::Register>),
        (0x0010 => eoir: WriteOnly<u32>),
        (0x0014 => _reserved1),
        (0x1000 => dir: WriteOnly<u32>),
        (0x1004 => @END),
    },
    /// The GICv2 virtual interface control (GICH).
    HypervisorInterface {
        (0x000 => hcr: ReadWrite<u32, GICH_HCR::Register>),
        (0x004 => vtr: ReadOnly<u32, GICH_VTR::Register>),
        (0x008 => vmcr: ReadWrite<u32>),
        (0x00c => _reserved0),
        (0x0f0 => apr: ReadWrite<u32>),
        (0x0f4 => _reserved1),
        (0x100 => lr: [ReadWrite<u32>; 64]),
        (0x200 => @END),
    }
}

pub use crate::hw::intid::{HYP_TIMER_PPI, KICK_SGI, MAINTENANCE_PPI, SPURIOUS, VTIMER_PPI};

fn gicd() -> &'static Distributor {
    // SAFETY: GICD holds the distributor's base once the version is 2: set
    // (once, at boot) from the device tree's GIC node, mapped as device
    // memory by the EL2 identity map for good. Likewise below.
    unsafe { super::mmio_block(GICD.load(Ordering::Relaxed)) }
}

fn gicc() -> &'static CpuInterface {
    // SAFETY: GICC holds the CPU interface's base once the version is 2.
    unsafe { super::mmio_block(GICC.load(Ordering::Relaxed)) }
}

fn gich() -> &'static HypervisorInterface {
    // SAFETY: GICH holds the virtual interface control's base once the
    // version is 2.
    unsafe { super::mmio_block(GICH.load(Ordering::Relaxed)) }
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
    self::gicd().ctlr.write(GICD_CTLR::Enable::SET);
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
        slot.store(gicd().itargetsr[0].get() as u8, Ordering::Relaxed);
    }
    for intid in OWN_INTIDS {
        // Priority 0xa0 (bytes of IPRIORITYR), enable (banked per CPU).
        let priority = &gicd().ipriorityr[intid as usize / 4];
        let shift = (intid % 4) * 8;
        priority.set(priority.get() & !(0xff << shift) | (0xa0 << shift));
        gicd().isenabler[0].set(1 << intid);
    }
    gicc().pmr.write(GICC_PMR::Priority.val(0xff));
    gicc()
        .ctlr
        .write(GICC_CTLR::Enable::SET + GICC_CTLR::EOImodeNS::SET);
    reset_virtual_interface();
    true
}

/// Route shared peripheral interrupt `intid` (32 or more; level, as the
/// console UART's) to the calling CPU alone and enable it, at the priority
/// of our own interrupts; false for an INTID that is no SPI or without a
/// GIC. The interrupt then only wakes this CPU from WFI: [`super::idle_wait`]
/// acknowledges whatever woke it and the device is read by polling.
pub fn route_spi_here(intid: u32) -> bool {
    if !present() || !(32..1020).contains(&intid) {
        return false;
    }
    if is_v3() {
        v3::route_spi(intid, super::mpidr(), 0xa0);
        return true;
    }
    let target = CPU_IF
        .get(super::cpu_index())
        .map_or(0, |c| c.load(Ordering::Relaxed));
    let i = intid as usize;
    let shift = (intid % 4) * 8;
    let priority = &gicd().ipriorityr[i / 4];
    priority.set(priority.get() & !(0xff << shift) | (0xa0 << shift));
    let targets = &gicd().itargetsr[i / 4];
    targets.set(targets.get() & !(0xff << shift) | (u32::from(target) << shift));
    gicd().isenabler[i / 32].set(1 << (intid % 32));
    true
}

/// Clear every list register and the active priorities; enable GICH.
pub fn reset_virtual_interface() {
    if is_v3() {
        v3::reset_virtual_interface();
    } else {
        for i in 0..list_registers() {
            clear_lr(i);
        }
        gich().apr.set(0);
        gich().vmcr.set(0);
        gich().hcr.write(GICH_HCR::En::SET);
    }
    set_hcr_shadow(HCR_ENABLED);
}

/// This CPU's virtual interface as the guest left it (its vCPU paused).
pub fn save_virtual_interface() -> VirtualInterface {
    if is_v3() {
        return v3::save_virtual_interface();
    }
    let count = list_registers().min(MAX_LRS);
    let mut lrs = [0; MAX_LRS];
    for (i, lr) in lrs.iter_mut().enumerate().take(count) {
        *lr = u64::from(gich().lr[i].get());
    }
    VirtualInterface {
        count: count as u8,
        lrs,
        vmcr: gich().vmcr.get(),
        apr: [gich().apr.get(), 0],
    }
}

/// Load a saved virtual interface (checked by its reader) into this CPU's.
pub fn load_virtual_interface(vif: &VirtualInterface) {
    if is_v3() {
        return v3::load_virtual_interface(vif);
    }
    for i in 0..list_registers().min(MAX_LRS) {
        gich().lr[i].set(vif.lrs[i] as u32);
    }
    gich().apr.set(vif.apr[0]);
    gich().vmcr.set(vif.vmcr);
}

/// Make SGI or PPI `intid` active on this CPU, as if taken and not yet
/// deactivated: a restored list register linked to it (the virtual
/// timer's) then deactivates it when the guest is done.
pub fn activate_private(intid: u32) {
    if is_v3() {
        return v3::activate_private(intid);
    }
    gicd().isactiver[0].set(1 << (intid % 32));
}

/// The number of list registers, read once (every CPU has the same).
static LIST_REGS: AtomicU8 = AtomicU8::new(0);

/// Number of list registers (GICH_VTR.ListRegs + 1).
pub fn list_registers() -> usize {
    // Read on every exit's list-register sync: under QEMU each GICv2
    // register access is a trip through its device model and lock.
    let cached = LIST_REGS.load(Ordering::Relaxed);
    if cached != 0 {
        return usize::from(cached);
    }
    let count = if is_v3() {
        v3::list_registers()
    } else {
        (gich().vtr.read(GICH_VTR::ListRegs) + 1) as usize
    };
    LIST_REGS.store(count as u8, Ordering::Relaxed);
    count
}

/// What this CPU last wrote to GICH_HCR / ICH_HCR_EL2 through
/// [`enable_virtual_interface`] or [`reset_virtual_interface`] (nothing
/// else writes it): [`HCR_UNKNOWN`], [`HCR_ENABLED`] or [`HCR_UNDERFLOW`].
static HCR_SHADOW: [AtomicU8; super::MAX_CPUS] =
    [const { AtomicU8::new(HCR_UNKNOWN) }; super::MAX_CPUS];
const HCR_UNKNOWN: u8 = 0;
const HCR_ENABLED: u8 = 1;
const HCR_UNDERFLOW: u8 = 2;

fn set_hcr_shadow(value: u8) {
    if let Some(shadow) = HCR_SHADOW.get(super::cpu_index()) {
        shadow.store(value, Ordering::Relaxed);
    }
}

/// Acknowledge the highest pending interrupt: its INTID (1023: none) and
/// the raw IAR value to give back to `end_of_interrupt`.
pub fn acknowledge() -> (u32, u32) {
    if is_v3() {
        return v3::acknowledge();
    }
    let iar = gicc().iar.extract();
    (iar.read(GICC_IAR::InterruptID), iar.get())
}

/// Priority drop (EOImode 1): the interrupt stays active.
pub fn end_of_interrupt(iar: u32) {
    if is_v3() {
        return v3::end_of_interrupt(iar);
    }
    gicc().eoir.set(iar);
}

/// Deactivate an interrupt the hypervisor handled itself.
pub fn deactivate(iar: u32) {
    if is_v3() {
        return v3::deactivate(iar);
    }
    gicc().dir.set(iar);
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
        gicd().sgir.write(
            GICD_SGIR::CPUTargetList.val(u32::from(mask)) + GICD_SGIR::SGIINTID.val(KICK_SGI),
        );
    }
}

/// List register `i` of this CPU, decoded.
pub fn read_lr(i: usize) -> LrState {
    if is_v3() {
        return v3::read_lr(i);
    }
    parse_lr(gich().lr[i].get())
}

/// Make `irq` pending in list register `i`; with `hw`, linked to that
/// physical INTID (the guest's deactivation deactivates it).
pub fn write_lr(i: usize, irq: &PendingIrq, hw: Option<u32>) {
    if is_v3() {
        return v3::write_lr(i, irq, hw);
    }
    gich().lr[i].set(lr_value(irq, hw));
}

/// Empty list register `i`.
pub fn clear_lr(i: usize) {
    if is_v3() {
        return v3::clear_lr(i);
    }
    gich().lr[i].set(0);
}

/// The virtual interface on, with the underflow maintenance interrupt
/// (at most one list register valid) when `underflow`.
pub fn enable_virtual_interface(underflow: bool) {
    // Called after every exit's sync, nearly always with what is already
    // there: the write is skipped then (see `list_registers`).
    let want = if underflow {
        HCR_UNDERFLOW
    } else {
        HCR_ENABLED
    };
    let shadow = HCR_SHADOW.get(super::cpu_index());
    if shadow.is_some_and(|s| s.load(Ordering::Relaxed) == want) {
        return;
    }
    if is_v3() {
        v3::enable_virtual_interface(underflow);
    } else {
        let uie = if underflow {
            GICH_HCR::UIE::SET
        } else {
            GICH_HCR::UIE::CLEAR
        };
        gich().hcr.write(GICH_HCR::En::SET + uie);
    }
    if let Some(shadow) = shadow {
        shadow.store(want, Ordering::Relaxed);
    }
}
