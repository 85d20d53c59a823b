//! A minimal GIC driver for one CPU: enough to take the balloon's interrupt
//! and the virtual timer's with PSTATE.I masked (WFI, acknowledge, EOI).
//!
//! GICv2: distributor and memory-mapped CPU interface (GICC), interrupts in
//! group 0, which without the Security Extensions (QEMU virt, the Tidal vGIC)
//! is signalled as IRQ. GICv3: distributor with affinity routing, the
//! redistributor whose GICR_TYPER affinity matches MPIDR_EL1 (woken through
//! GICR_WAKER), and the ICC system registers; interrupts in group 1. No LPIs,
//! no SGIs, no other CPUs.

use crate::arch::{mmio_read32, mmio_write32};
use crate::board::{GicInfo, Irq};
use core::arch::asm;

// Distributor registers (both versions).
const GICD_CTLR: u64 = 0x000;
const GICD_IGROUPR: u64 = 0x080;
const GICD_ISENABLER: u64 = 0x100;
const GICD_IPRIORITYR: u64 = 0x400;
const GICD_ITARGETSR: u64 = 0x800;
const GICD_ICFGR: u64 = 0xc00;
const GICD_IROUTER: u64 = 0x6000;
/// GICv3 GICD_CTLR: register write pending (CTLR and ICENABLER changes).
const GICD_CTLR_RWP: u32 = 1 << 31;
/// GICv3 GICD_CTLR: ARE (ARE_NS in the non-secure view) at bit 4, and the
/// two group enables (EnableGrp0/EnableGrp1, or EnableGrp1NS/EnableGrp1A):
/// the value Linux writes, right in either view.
const GICD_CTLR_ARE: u32 = 1 << 4;
const GICD_CTLR_GROUPS: u32 = 0b11;

// GICv2 CPU interface.
const GICC_CTLR: u64 = 0x00;
const GICC_PMR: u64 = 0x04;
const GICC_IAR: u64 = 0x0c;
const GICC_EOIR: u64 = 0x10;

// GICv3 redistributor: RD frame, then the SGI frame 64 KiB on.
const GICR_TYPER: u64 = 0x0008;
const GICR_WAKER: u64 = 0x0014;
const GICR_SGI_FRAME: u64 = 0x1_0000;
const GICR_FRAME_STRIDE: u64 = 0x2_0000;
/// GICR_TYPER: the last redistributor of its region; VLPIS (two more frames).
const TYPER_LAST: u64 = 1 << 4;
const TYPER_VLPIS: u64 = 1 << 1;
const WAKER_PROCESSOR_SLEEP: u32 = 1 << 1;
const WAKER_CHILDREN_ASLEEP: u32 = 1 << 2;

/// The priority of every interrupt this guest enables (the mask lets all pass).
const PRIORITY: u8 = 0xa0;
const PRIORITY_MASK: u32 = 0xff;
/// INTIDs 1020..=1023 are special: nothing (more) to acknowledge.
const SPURIOUS: u32 = 1020;
/// Iterations of a register-write-pending or wake-up wait before giving up.
const POLL_LIMIT: u32 = 1_000_000;

/// Which GIC, and where.
pub enum Gic {
    V2 { dist: u64, cpu: u64 },
    V3 { dist: u64, rd: u64 },
}

/// An acknowledged interrupt: the INTID, and the raw IAR value EOI needs.
#[derive(Clone, Copy)]
pub struct Acked {
    pub intid: u32,
    raw: u32,
}

fn read(addr: u64) -> u32 {
    // SAFETY: only called with addresses of the GIC's registers from the
    // device tree, which the boot page table maps as device memory.
    unsafe { mmio_read32(addr as usize) }
}

fn write(addr: u64, value: u32) {
    // SAFETY: as in `read`; this guest owns its (virtual) GIC.
    unsafe { mmio_write32(addr as usize, value) }
}

fn read64(addr: u64) -> u64 {
    u64::from(read(addr)) | u64::from(read(addr + 4)) << 32
}

/// Sets byte `n` of a byte-per-interrupt register bank with 32-bit accesses.
fn write_byte(bank: u64, n: u32, value: u8) {
    let word = bank + u64::from(n / 4) * 4;
    let shift = 8 * (n % 4);
    write(
        word,
        read(word) & !(0xff << shift) | u32::from(value) << shift,
    );
}

fn set_bit(bank: u64, n: u32) {
    let word = bank + u64::from(n / 32) * 4;
    write(word, read(word) | 1 << (n % 32));
}

/// Edge (Int_config bit 1 set) or level, for SPIs and PPIs.
fn set_trigger(icfgr: u64, n: u32, edge: bool) {
    let word = icfgr + u64::from(n / 16) * 4;
    let bit = 1 << (2 * (n % 16) + 1);
    let old = read(word);
    write(word, if edge { old | bit } else { old & !bit });
}

fn wait_rwp(ctlr: u64) -> Result<(), &'static str> {
    for _ in 0..POLL_LIMIT {
        if read(ctlr) & GICD_CTLR_RWP == 0 {
            return Ok(());
        }
    }
    Err("register write never completed (RWP)")
}

fn mpidr_affinity() -> u64 {
    let mpidr: u64;
    // SAFETY: reading MPIDR_EL1 has no side effects.
    unsafe { asm!("mrs {}, mpidr_el1", out(reg) mpidr, options(nostack, nomem)) };
    (mpidr & 0xff_ffff) | (mpidr >> 32 & 0xff) << 24
}

/// Turns on the ICC system-register interface and lets every priority through
/// in group 1.
fn icc_enable() {
    // SAFETY: ICC_SRE_EL1.SRE (with DFB, DIB) selects the system-register
    // interface, ICC_PMR_EL1 / ICC_BPR1_EL1 / ICC_IGRPEN1_EL1 only change
    // which interrupts reach this CPU; PSTATE.I stays masked throughout.
    unsafe {
        asm!(
            "mrs {t}, S3_0_C12_C12_5",
            "orr {t}, {t}, #7",
            "msr S3_0_C12_C12_5, {t}",
            "isb",
            "msr S3_0_C4_C6_0, {pmr}",
            "msr S3_0_C12_C12_3, xzr",
            "mov {t}, #1",
            "msr S3_0_C12_C12_7, {t}",
            "isb",
            t = out(reg) _,
            pmr = in(reg) u64::from(PRIORITY_MASK),
            options(nostack, nomem),
        );
    }
}

fn icc_iar1() -> u32 {
    let iar: u64;
    // SAFETY: reading ICC_IAR1_EL1 acknowledges the highest-priority pending
    // group-1 interrupt; the caller ends it with `icc_eoir1`.
    unsafe { asm!("mrs {}, S3_0_C12_C12_0", out(reg) iar, options(nostack)) };
    iar as u32
}

fn icc_eoir1(raw: u32) {
    // SAFETY: ends an interrupt this CPU acknowledged (EOImode 0: drop
    // priority and deactivate).
    unsafe { asm!("msr S3_0_C12_C12_1, {}", "isb", in(reg) u64::from(raw), options(nostack)) };
}

/// Masks IRQs at the CPU (PSTATE.I): interrupts only wake WFI, they are
/// taken by reading the IAR, never through the vector table.
pub fn mask_irqs() {
    // SAFETY: masking interrupts has no effect on memory.
    unsafe { asm!("msr daifset, #2", "isb", options(nostack, nomem)) };
}

/// Sleeps until an interrupt is pending at this CPU (also with PSTATE.I set)
/// or some other wake-up event.
pub fn wait_for_interrupt() {
    // SAFETY: WFI only waits; the DSB completes earlier device writes first.
    unsafe { asm!("dsb sy", "wfi", options(nostack, preserves_flags)) };
}

impl Gic {
    /// Enables the GIC for this CPU, with no interrupt enabled yet.
    pub fn init(info: GicInfo) -> Result<Gic, &'static str> {
        mask_irqs();
        match info {
            GicInfo::V2 {
                distributor,
                cpu_interface,
            } => {
                write(distributor + GICD_CTLR, 1);
                write(cpu_interface + GICC_PMR, PRIORITY_MASK);
                write(cpu_interface + GICC_CTLR, 1);
                Ok(Gic::V2 {
                    dist: distributor,
                    cpu: cpu_interface,
                })
            }
            GicInfo::V3 {
                distributor,
                redistributors,
                redistributors_size,
            } => {
                let rd = find_redistributor(redistributors, redistributors_size)?;
                write(
                    rd + GICR_WAKER,
                    read(rd + GICR_WAKER) & !WAKER_PROCESSOR_SLEEP,
                );
                let mut awake = false;
                for _ in 0..POLL_LIMIT {
                    if read(rd + GICR_WAKER) & WAKER_CHILDREN_ASLEEP == 0 {
                        awake = true;
                        break;
                    }
                }
                if !awake {
                    return Err("redistributor stays asleep (GICR_WAKER.ChildrenAsleep)");
                }
                // ARE first, with the groups off, then the group enables.
                let ctlr = distributor + GICD_CTLR;
                if read(ctlr) & GICD_CTLR_ARE == 0 {
                    write(ctlr, 0);
                    wait_rwp(ctlr)?;
                    write(ctlr, GICD_CTLR_ARE);
                    wait_rwp(ctlr)?;
                }
                write(ctlr, GICD_CTLR_ARE | GICD_CTLR_GROUPS);
                wait_rwp(ctlr)?;
                icc_enable();
                Ok(Gic::V3 {
                    dist: distributor,
                    rd,
                })
            }
        }
    }

    /// Enables `irq` (an SPI or a PPI) at this CPU with [`PRIORITY`], routed
    /// here, in the group the CPU interface signals, with the trigger the
    /// device tree gives (SPIs only; a PPI's is left as it is).
    pub fn enable(&self, irq: Irq) {
        let n = irq.intid;
        let spi = n >= 32;
        match *self {
            Gic::V2 { dist, .. } => {
                write_byte(dist + GICD_IPRIORITYR, n, PRIORITY);
                if spi {
                    // The CPU interface number: ITARGETSR0..7 read as this
                    // CPU's bit (or 0 on a uniprocessor GIC).
                    let me = (read(dist + GICD_ITARGETSR) & 0xff) as u8;
                    write_byte(dist + GICD_ITARGETSR, n, if me == 0 { 1 } else { me });
                    set_trigger(dist + GICD_ICFGR, n, irq.edge);
                }
                set_bit(dist + GICD_ISENABLER, n);
            }
            Gic::V3 { dist, rd } => {
                if spi {
                    set_bit(dist + GICD_IGROUPR, n);
                    write_byte(dist + GICD_IPRIORITYR, n, PRIORITY);
                    set_trigger(dist + GICD_ICFGR, n, irq.edge);
                    let router = dist + GICD_IROUTER + 8 * u64::from(n);
                    let affinity = mpidr_affinity();
                    write(router, affinity as u32 & 0x00ff_ffff);
                    write(router + 4, (affinity >> 24) as u32);
                    set_bit(dist + GICD_ISENABLER, n);
                } else {
                    // The SGI frame has the distributor's layout for INTIDs 0..32.
                    let sgi = rd + GICR_SGI_FRAME;
                    set_bit(sgi + GICD_IGROUPR, n);
                    write_byte(sgi + GICD_IPRIORITYR, n, PRIORITY);
                    set_bit(sgi + GICD_ISENABLER, n);
                }
            }
        }
    }

    /// Acknowledges the highest-priority pending interrupt, or `None` if
    /// there is none (a spurious INTID).
    pub fn acknowledge(&self) -> Option<Acked> {
        let raw = match *self {
            Gic::V2 { cpu, .. } => read(cpu + GICC_IAR),
            Gic::V3 { .. } => icc_iar1(),
        };
        let intid = match self {
            Gic::V2 { .. } => raw & 0x3ff,
            Gic::V3 { .. } => raw & 0xff_ffff,
        };
        (intid < SPURIOUS).then_some(Acked { intid, raw })
    }

    /// Ends (drops the priority of and deactivates) an acknowledged interrupt.
    pub fn end(&self, acked: Acked) {
        match *self {
            Gic::V2 { cpu, .. } => write(cpu + GICC_EOIR, acked.raw),
            Gic::V3 { .. } => icc_eoir1(acked.raw),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Gic::V2 { .. } => "GICv2",
            Gic::V3 { .. } => "GICv3",
        }
    }
}

/// The redistributor of this CPU: the frame whose GICR_TYPER affinity is
/// MPIDR_EL1's, walking the region until GICR_TYPER.Last.
fn find_redistributor(base: u64, size: u64) -> Result<u64, &'static str> {
    let me = mpidr_affinity();
    let mut frame = base;
    while frame + GICR_FRAME_STRIDE <= base + size {
        let typer = read64(frame + GICR_TYPER);
        if typer >> 32 == me {
            return Ok(frame);
        }
        if typer & TYPER_LAST != 0 {
            break;
        }
        frame += if typer & TYPER_VLPIS != 0 {
            2 * GICR_FRAME_STRIDE
        } else {
            GICR_FRAME_STRIDE
        };
    }
    Err("no redistributor for this CPU's affinity")
}
