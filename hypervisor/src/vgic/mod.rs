//! The virtual GICv2 distributor of one VM, as a portable state machine.
//!
//! On the guest board (docs/GUEST-BOARD.md) the distributor sits at IPA
//! `0x0800_0000` and is emulated here; the CPU interface at `0x0801_0000` is
//! the hardware GICV page, so priority masking, acknowledge and EOI happen
//! in hardware on the list registers. This module owns everything else:
//!
//! - the guest's view of the distributor registers ([`VDistributor::read`],
//!   [`VDistributor::write`]), with banked SGI/PPI state per vCPU;
//! - the input side, for devices and the timer ([`VDistributor::set_level`],
//!   [`VDistributor::set_ppi_level`], [`VDistributor::pend_edge`],
//!   [`VDistributor::pend_ppi`]);
//! - the delivery side, for the arch code that fills the list registers
//!   ([`VDistributor::next_pending`], [`VDistributor::on_listed`],
//!   [`VDistributor::on_eoi`]) and a model of the list registers themselves
//!   ([`lr_value`], [`parse_lr`]).
//!
//! # The guest's GIC
//!
//! A GICv2 without the Security Extensions (TYPER.SecurityExtn = 0), so the
//! guest owns both groups: GICD_CTLR has EnableGrp0 (bit 0, the bit Linux
//! sets) and EnableGrp1 (bit 1); IGROUPR is read/write and resets to group
//! 0. Linux never writes IGROUPR on GICv2 and enables only group 0, which
//! the virtual CPU interface signals as vIRQ (GICV_CTLR.FIQEn = 0).
//! Priorities keep their top 5 bits (the list register's priority field is
//! 5 bits wide; KVM does the same). SGIs are always edge; PPIs and SPIs take
//! ICFGR writes (Int_config bit 1; bit 0 is reserved in GICv2). SPI targets
//! reset to CPU 0 (a real GIC resets them to 0; this lets a bare-metal
//! guest that never programs ITARGETSR get its interrupts) and keep only
//! bits of existing vCPUs. An SPI naming several targets is delivered to
//! the lowest-numbered one only, as KVM does, so a level interrupt is never
//! in two vCPUs' list registers at once.
//!
//! # Pending state, edge and level, and EOI
//!
//! Each interrupt has a *latch* (set by an edge, by ISPENDR, by
//! [`VDistributor::pend_edge`]; cleared by ICPENDR and when the interrupt is
//! listed) and, for level-sensitive ones, an input *line*. An interrupt is
//! pending when its latch is set or it is level-sensitive with its line
//! high; an SGI is pending on a vCPU while any source CPU has it pending.
//! An edge-configured interrupt's latch is set on a rising edge of its line.
//!
//! Delivery follows the model of KVM's and Bao's vGICs:
//!
//! 1. [`VDistributor::next_pending`] picks the highest-priority (lowest
//!    value; ties to the lowest INTID) interrupt that is enabled, pending,
//!    not active in the distributor, in an enabled group and targeted at
//!    the vCPU, skipping those the caller says are already in a list
//!    register.
//! 2. The caller writes [`lr_value`] into a free list register and calls
//!    [`VDistributor::on_listed`]: the latch is cleared (for an SGI, the
//!    listed source's bit). From then on the list register tracks
//!    pending/active. A level interrupt whose line is still high *stays
//!    pending* in the distributor; the caller's `already_listed` keeps it
//!    from being listed twice.
//! 3. Level interrupts are listed with the EOI bit, so the guest's
//!    deactivation raises a maintenance interrupt (GICH_EISR names the
//!    list register). The caller then calls [`VDistributor::on_eoi`], which
//!    re-samples the line: if it is still high the interrupt is pending
//!    again, and the returned effect says the vCPU has something to list.
//!    Edge interrupts need no maintenance: once listed they are the guest's.
//!
//! While an interrupt sits in a list register, a new edge for it stays
//! latched here and `next_pending` (with `already_listed` true for it) does
//! not offer it; it is offered once the list register is free. A caller
//! that wants it sooner can set GICH_HCR.UIE/NPIE, or upgrade the list
//! register itself. The same holds for an SGI pending from a second source
//! CPU: one list register per SGI at a time. A caller that finds a pending
//! list register for a level interrupt whose line has dropped
//! ([`VDistributor::is_pending`] false) may retire it.
//!
//! The distributor's active bits are only what the guest writes with
//! ISACTIVER/ICACTIVER; list-register active state is not folded back.
//!
//! # Effects
//!
//! Every change returns a [`VgicEffect`] naming the vCPUs for which an
//! interrupt became deliverable (including, possibly, the accessing vCPU):
//! the owner kicks the others out of the guest or out of WFI. A spurious
//! kick is harmless; a missing one would stall a guest, so kicks err on
//! the generous side.
//!
//! Guest accesses are untrusted: out-of-range INTIDs, vCPUs and offsets never
//! panic. Accesses at offsets without a register read as zero and ignore
//! writes (counted in [`VgicCounters`]); accesses of the wrong width or
//! alignment are a [`VgicError`] for the hypervisor to turn into an abort.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

use crate::register_access::{check_access, AccessFault, UP_TO_WORD};

mod regs;
mod state;
#[cfg(test)]
mod tests;
mod v3;
#[cfg(test)]
mod v3_tests;

pub use crate::hw::gic_lr::{
    lr_value, lr_value_v3, parse_lr, parse_lr_v3, LrState, LrStatus, PendingIrq, LR_ACTIVE,
    LR_CPUID_SHIFT, LR_EOI, LR_GRP1, LR_HW, LR_PENDING, LR_PRIORITY_SHIFT, LR_VIRTUAL_ID_MASK,
};
pub use crate::hw::intid;
pub use regs::*;
pub use v3::{
    GICR_SGI_BASE, GICR_STRIDE, GICR_TYPER, GICR_WAKER, GICV3_DIST_WINDOW, ICC_ASGI1R_EL1,
    ICC_SGI0R_EL1, ICC_SGI1R_EL1,
};

use regs::{decode, BitReg, Reg};

/// Most vCPUs a GICv2 can address (TYPER.CPUNumber is 3 bits).
pub const MAX_VCPUS: usize = 8;
/// Most SPIs a GICv2 can have (INTIDs 32..1020).
pub const MAX_SPIS: u32 = 1020 - 32;
/// SGIs are INTIDs 0..16.
pub const SGI_END: u32 = 16;
/// PPIs are INTIDs 16..32; SPIs start here.
pub const SPI_BASE: u32 = 32;
/// Priority bits the model keeps (the list register's 5-bit field).
pub const PRIORITY_MASK: u8 = 0xf8;
/// GICD_IIDR: ProductID 'T' (Tidal), variant and revision 0, implementer
/// JEP106 0x43b (Arm), following KVM's convention for its emulated GIC.
pub const IIDR_VALUE: u32 = (0x54 << 24) | 0x43b;

/// A configuration or access the distributor does not accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VgicError {
    /// `vcpus` must be 1..=8 and `spis` at most 988.
    BadConfig { vcpus: usize, spis: u32 },
    /// No such vCPU in this VM.
    BadVcpu { vcpu: usize },
    /// The INTID is not one this call accepts (kind or range).
    BadIntid { intid: u32 },
    /// Width not accepted by the register at this offset.
    BadWidth { offset: u64, width: u8 },
    /// Offset not aligned to the access width.
    Unaligned { offset: u64, width: u8 },
    /// Offset outside the distributor's 64 KiB window.
    OutOfWindow { offset: u64 },
}

impl VgicError {
    /// The error for an access [`check_access`] refused.
    fn refused(fault: AccessFault, offset: u64, width: u8) -> Self {
        match fault {
            AccessFault::BadWidth => VgicError::BadWidth { offset, width },
            AccessFault::Unaligned => VgicError::Unaligned { offset, width },
        }
    }
}

impl fmt::Display for VgicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            VgicError::BadConfig { vcpus, spis } => write!(
                f,
                "vGIC with {vcpus} vCPUs and {spis} SPIs: GICv2 allows 1..=8 vCPUs and at most {MAX_SPIS} SPIs"
            ),
            VgicError::BadVcpu { vcpu } => write!(f, "no vCPU {vcpu} in this VM"),
            VgicError::BadIntid { intid } => write!(f, "INTID {intid} is not valid here"),
            VgicError::BadWidth { offset, width } => write!(
                f,
                "{width}-byte access to GICD offset {offset:#x}: this register takes 32-bit accesses{}",
                if regs::decode(offset & 0xfff).byte_accessible() { " or bytes" } else { " only" }
            ),
            VgicError::Unaligned { offset, width } => {
                write!(f, "{width}-byte access to GICD offset {offset:#x} is not aligned")
            }
            VgicError::OutOfWindow { offset } => {
                write!(f, "GICD offset {offset:#x} is outside the distributor window")
            }
        }
    }
}

/// What a change did that the owner must act on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VgicEffect {
    /// Bit n: vCPU n has a newly deliverable interrupt; kick it (out of
    /// the guest or out of WFI) so its list registers are refilled.
    pub kick: u32,
}

impl VgicEffect {
    /// Nothing to do.
    pub const NONE: VgicEffect = VgicEffect { kick: 0 };

    /// Whether vCPU `vcpu` is to be kicked.
    pub fn kicks(&self, vcpu: usize) -> bool {
        vcpu < 32 && self.kick & (1 << vcpu) != 0
    }
}

/// Counters of guest accesses the model ignored or rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VgicCounters {
    /// Reads of offsets with no register (including RAZ blocks).
    pub reserved_reads: u64,
    /// Writes to offsets with no register (including WI blocks).
    pub reserved_writes: u64,
    /// Writes to read-only registers (TYPER, IIDR, the ID registers).
    pub read_only_writes: u64,
    /// Reads of GICD_SGIR (write-only).
    pub write_only_reads: u64,
    /// GICD_SGIR writes with the reserved TargetListFilter 3.
    pub sgir_reserved: u64,
    /// Accesses refused with a [`VgicError`].
    pub rejected: u64,
    /// SGIs made pending through GICD_SGIR (one per target).
    pub sgis: u64,
}

/// The state of one interrupt (for SGIs the pending part lives in
/// [`PrivateBank::sgi_sources`]).
#[derive(Clone, Copy, Debug, Default)]
struct Irq {
    enabled: bool,
    latch: bool,
    active: bool,
    group1: bool,
    edge: bool,
    line: bool,
    priority: u8,
    /// ITARGETSR byte (SPIs only).
    targets: u8,
}

/// The banked SGI and PPI state of one vCPU.
#[derive(Clone, Copy, Debug)]
struct PrivateBank {
    irqs: [Irq; 32],
    /// For each SGI, a bit per source CPU that has it pending here.
    sgi_sources: [u8; 16],
}

impl PrivateBank {
    fn reset() -> Self {
        let mut irqs = [Irq::default(); 32];
        for irq in irqs.iter_mut().take(SGI_END as usize) {
            // SGIs are edge-triggered and, as on GIC-400 and in KVM,
            // enabled out of reset.
            irq.edge = true;
            irq.enabled = true;
        }
        PrivateBank {
            irqs,
            sgi_sources: [0; 16],
        }
    }
}

/// The set bits of `word`, lowest first.
fn bits(mut word: u32) -> impl Iterator<Item = u32> {
    core::iter::from_fn(move || {
        (word != 0).then(|| {
            let bit = word.trailing_zeros();
            word &= word - 1;
            bit
        })
    })
}

/// Which GIC architecture the guest sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VgicVersion {
    /// A GICv2 distributor; the CPU interface is the hardware GICV page.
    V2,
    /// A GICv3 distributor (affinity routing always on, one security
    /// state) and one redistributor per vCPU; the CPU interface is the
    /// hardware's virtual ICC_* system registers. See `vgic/v3.rs`.
    V3,
}

/// The virtual distributor of one VM (and, for GICv3, its redistributors).
#[derive(Clone, Debug)]
pub struct VDistributor {
    version: VgicVersion,
    vcpus: usize,
    spis: u32,
    ctlr: u32,
    private: Vec<PrivateBank>,
    spi: Vec<Irq>,
    /// GICv3: GICD_IROUTER of each SPI as the guest wrote it.
    irouter: Vec<u64>,
    /// GICv3: GICR_WAKER.ProcessorSleep of each redistributor.
    asleep: Vec<bool>,
    /// Bit n of word w: INTID 32w + n is pending (latched, line high, or an
    /// SGI with a source), per vCPU for INTIDs 0..32 and shared for SPIs
    /// (bit i = INTID 32 + i). Kept by `track`, so that `next_pending`, run
    /// before every guest entry, looks only at pending interrupts.
    private_pending: Vec<u32>,
    spi_pending: Vec<u32>,
    counters: VgicCounters,
}

impl VDistributor {
    /// A distributor in its reset state for `vcpus` vCPUs (1..=8) and `spis`
    /// SPIs (INTIDs 32..32 + spis, at most 988).
    pub fn new(vcpus: usize, spis: u32) -> Result<Self, VgicError> {
        Self::with_version(VgicVersion::V2, vcpus, spis)
    }

    /// A GICv3 distributor with `vcpus` redistributors (1..=8) in its reset
    /// state.
    pub fn new_v3(vcpus: usize, spis: u32) -> Result<Self, VgicError> {
        Self::with_version(VgicVersion::V3, vcpus, spis)
    }

    fn with_version(version: VgicVersion, vcpus: usize, spis: u32) -> Result<Self, VgicError> {
        if !(1..=MAX_VCPUS).contains(&vcpus) || spis > MAX_SPIS {
            return Err(VgicError::BadConfig { vcpus, spis });
        }
        let mut dist = VDistributor {
            version,
            vcpus,
            spis,
            ctlr: 0,
            private: Vec::new(),
            spi: Vec::new(),
            irouter: Vec::new(),
            asleep: Vec::new(),
            private_pending: Vec::new(),
            spi_pending: Vec::new(),
            counters: VgicCounters::default(),
        };
        dist.reset();
        Ok(dist)
    }

    /// Back to the reset state (input line levels are forgotten too: the
    /// owner re-asserts lines of devices that are still raising them).
    pub fn reset(&mut self) {
        self.ctlr = 0;
        self.private.clear();
        self.private.resize(self.vcpus, PrivateBank::reset());
        self.spi.clear();
        self.spi.resize(
            self.spis as usize,
            Irq {
                targets: 1,
                ..Irq::default()
            },
        );
        self.irouter.clear();
        self.irouter.resize(self.spis as usize, 0);
        self.asleep.clear();
        self.asleep.resize(self.vcpus, true);
        self.private_pending.clear();
        self.private_pending.resize(self.vcpus, 0);
        self.spi_pending.clear();
        self.spi_pending.resize(self.spis.div_ceil(32) as usize, 0);
    }

    /// Recompute the pending-bitmap bit of `intid` (banked as `bank`).
    fn refresh_pending(&mut self, bank: usize, intid: u32) {
        let pending = self.pending_in(bank, intid);
        let (word, bit) = if intid < SPI_BASE {
            (self.private_pending.get_mut(bank), intid)
        } else {
            let i = intid - SPI_BASE;
            (self.spi_pending.get_mut((i / 32) as usize), i % 32)
        };
        if let Some(word) = word {
            if pending {
                *word |= 1 << bit;
            } else {
                *word &= !(1 << bit);
            }
        }
    }

    /// The INTIDs pending for `vcpu` (its SGIs and PPIs, and every SPI), in
    /// ascending order.
    fn pending_intids(&self, vcpu: usize) -> impl Iterator<Item = u32> + '_ {
        let private = self.private_pending.get(vcpu).copied().unwrap_or(0);
        let spis = self
            .spi_pending
            .iter()
            .enumerate()
            .flat_map(|(w, &word)| bits(word).map(move |b| SPI_BASE + 32 * w as u32 + b));
        bits(private).chain(spis)
    }

    pub fn version(&self) -> VgicVersion {
        self.version
    }

    pub fn vcpus(&self) -> usize {
        self.vcpus
    }

    pub fn spis(&self) -> u32 {
        self.spis
    }

    /// One past the highest implemented INTID.
    pub fn irq_end(&self) -> u32 {
        SPI_BASE + self.spis
    }

    pub fn counters(&self) -> &VgicCounters {
        &self.counters
    }

    /// GICD_CTLR as the guest last wrote it.
    pub fn ctlr(&self) -> u32 {
        self.ctlr
    }

    fn vcpu_mask(&self) -> u32 {
        (1u32 << self.vcpus) - 1
    }

    fn check_vcpu(&self, vcpu: usize) -> Result<(), VgicError> {
        if vcpu < self.vcpus {
            Ok(())
        } else {
            Err(VgicError::BadVcpu { vcpu })
        }
    }

    /// The state of `intid` as seen by vCPU `bank` (banked for INTIDs < 32).
    /// `bank` must be a valid vCPU.
    fn irq(&self, bank: usize, intid: u32) -> Option<&Irq> {
        if intid < SPI_BASE {
            self.private.get(bank)?.irqs.get(intid as usize)
        } else {
            self.spi.get((intid - SPI_BASE) as usize)
        }
    }

    fn irq_mut(&mut self, bank: usize, intid: u32) -> Option<&mut Irq> {
        if intid < SPI_BASE {
            self.private.get_mut(bank)?.irqs.get_mut(intid as usize)
        } else {
            self.spi.get_mut((intid - SPI_BASE) as usize)
        }
    }

    fn sgi_sources(&self, bank: usize, intid: u32) -> u8 {
        self.private
            .get(bank)
            .and_then(|b| b.sgi_sources.get(intid as usize))
            .copied()
            .unwrap_or(0)
    }

    fn pending_in(&self, bank: usize, intid: u32) -> bool {
        if intid < SGI_END {
            return self.sgi_sources(bank, intid) != 0;
        }
        match self.irq(bank, intid) {
            Some(irq) => irq.latch || (!irq.edge && irq.line),
            None => false,
        }
    }

    fn group_enabled(&self, group1: bool) -> bool {
        let bit = if group1 {
            CTLR_ENABLE_GRP1
        } else {
            CTLR_ENABLE_GRP0
        };
        self.ctlr & bit != 0
    }

    /// The vCPU an SPI is delivered to: the lowest-numbered existing target.
    fn spi_target(&self, irq: &Irq) -> Option<usize> {
        let targets = u32::from(irq.targets) & self.vcpu_mask();
        (targets != 0).then(|| targets.trailing_zeros() as usize)
    }

    /// Whether `intid` would be offered to `vcpu` by `next_pending` (ignoring
    /// list registers).
    fn deliverable_to(&self, vcpu: usize, intid: u32) -> bool {
        let Some(irq) = self.irq(vcpu, intid) else {
            return false;
        };
        irq.enabled
            && !irq.active
            && self.group_enabled(irq.group1)
            && self.pending_in(vcpu, intid)
            && (intid < SPI_BASE || self.spi_target(irq) == Some(vcpu))
    }

    /// The vCPUs (as a bitmap) to which `intid`, seen through `bank` for
    /// private INTIDs, is deliverable.
    fn deliverable_mask(&self, bank: usize, intid: u32) -> u32 {
        if intid < SPI_BASE {
            u32::from(self.deliverable_to(bank, intid)) << bank
        } else {
            match self.irq(bank, intid).and_then(|irq| self.spi_target(irq)) {
                Some(target) if self.deliverable_to(target, intid) => 1 << target,
                _ => 0,
            }
        }
    }

    /// The vCPUs that have at least one deliverable interrupt.
    pub fn pending_vcpus(&self) -> u32 {
        (0..self.vcpus)
            .filter(|&vcpu| self.has_pending(vcpu))
            .fold(0, |mask, vcpu| mask | 1 << vcpu)
    }

    /// Whether `vcpu` has a deliverable interrupt (list registers ignored):
    /// the test for waking it from WFI.
    pub fn has_pending(&self, vcpu: usize) -> bool {
        self.next_pending(vcpu, |_| false).is_some()
    }

    /// The input line of SPI `intid` as last driven ([`Self::set_level`]);
    /// `None` for anything that is no SPI of this distributor.
    #[inline]
    pub fn spi_line(&self, intid: u32) -> Option<bool> {
        self.check_spi(intid).ok()?;
        self.irq(0, intid).map(|irq| irq.line)
    }

    /// Whether SPI `intid` is configured edge-triggered (GICD_ICFGR);
    /// `None` for anything that is no SPI of this distributor.
    pub fn spi_is_edge(&self, intid: u32) -> Option<bool> {
        self.check_spi(intid).ok()?;
        self.irq(0, intid).map(|irq| irq.edge)
    }

    /// Whether `intid` is pending for `vcpu` in the distributor (for a
    /// level interrupt: latched or its line high). False for anything out
    /// of range.
    pub fn is_pending(&self, vcpu: usize, intid: u32) -> bool {
        vcpu < self.vcpus && intid < self.irq_end() && self.pending_in(vcpu, intid)
    }

    /// Runs `change` on `intid` (banked as `bank`) and returns the vCPUs for
    /// which it became deliverable.
    fn track(&mut self, bank: usize, intid: u32, change: impl FnOnce(&mut Self)) -> u32 {
        let before = self.deliverable_mask(bank, intid);
        change(self);
        self.refresh_pending(bank, intid);
        self.deliverable_mask(bank, intid) & !before
    }

    // ---- MMIO ----------------------------------------------------------

    fn check_access(&mut self, vcpu: usize, offset: u64, width: u8) -> Result<Reg, VgicError> {
        let result = (|| {
            self.check_vcpu(vcpu)?;
            if offset >= GICD_WINDOW {
                return Err(VgicError::OutOfWindow { offset });
            }
            check_access(offset, width, UP_TO_WORD)
                .map_err(|fault| VgicError::refused(fault, offset, width))?;
            if offset >= GICD_SIZE {
                return Ok(Reg::Reserved);
            }
            let reg = decode(offset);
            let width_ok = match reg {
                Reg::Reserved => true,
                r if r.byte_accessible() => width == 1 || width == 4,
                _ => width == 4,
            };
            if width_ok {
                Ok(reg)
            } else {
                Err(VgicError::BadWidth { offset, width })
            }
        })();
        if result.is_err() {
            self.counters.rejected += 1;
        }
        result
    }

    /// A guest read of `width` bytes (1, 2 or 4) at `offset` into the
    /// distributor window, by vCPU `vcpu`.
    pub fn read(&mut self, vcpu: usize, offset: u64, width: u8) -> Result<u32, VgicError> {
        let reg = self.check_access(vcpu, offset, width)?;
        let bytes = u32::from(width);
        Ok(match reg {
            Reg::Ctlr => self.ctlr,
            Reg::Typer => self.typer(),
            Reg::Iidr => IIDR_VALUE,
            Reg::Id(value) => value,
            Reg::Bits(kind, first) => self.read_bits(vcpu, kind, first),
            Reg::Config(first) => self.read_config(vcpu, first),
            Reg::Priority(first) => self.read_bytes(first, bytes, |d, intid| {
                d.irq(vcpu, intid).map(|i| i.priority)
            }),
            Reg::Targets(first) => self.read_bytes(first, bytes, |d, intid| {
                if intid < SPI_BASE {
                    Some(1 << vcpu)
                } else {
                    d.irq(vcpu, intid).map(|i| i.targets)
                }
            }),
            Reg::ClearPendingSgi(first) | Reg::SetPendingSgi(first) => {
                self.read_bytes(first, bytes, |d, sgi| Some(d.sgi_sources(vcpu, sgi)))
            }
            Reg::Sgir => {
                self.counters.write_only_reads += 1;
                0
            }
            Reg::Reserved => {
                self.counters.reserved_reads += 1;
                0
            }
        })
    }

    /// A guest write of `width` bytes (1, 2 or 4) at `offset` into the
    /// distributor window, by vCPU `vcpu`.
    pub fn write(
        &mut self,
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u32,
    ) -> Result<VgicEffect, VgicError> {
        let reg = self.check_access(vcpu, offset, width)?;
        let bytes = u32::from(width);
        let kick = match reg {
            Reg::Ctlr => {
                let old = self.ctlr;
                self.ctlr = value & (CTLR_ENABLE_GRP0 | CTLR_ENABLE_GRP1);
                if self.ctlr & !old != 0 {
                    self.pending_vcpus()
                } else {
                    0
                }
            }
            Reg::Typer | Reg::Iidr | Reg::Id(_) => {
                self.counters.read_only_writes += 1;
                0
            }
            Reg::Bits(kind, first) => self.write_bits(vcpu, kind, first, value),
            Reg::Config(first) => self.write_config(vcpu, first, value),
            Reg::Priority(first) => self.write_bytes(vcpu, first, bytes, value, |irq, byte| {
                irq.priority = byte & PRIORITY_MASK
            }),
            Reg::Targets(first) => {
                // Read-only for SGIs and PPIs; only existing vCPUs for SPIs.
                let mask = self.vcpu_mask() as u8;
                let first_spi = first.max(SPI_BASE);
                let skip = first_spi - first;
                if skip >= bytes {
                    0
                } else {
                    self.write_bytes(
                        vcpu,
                        first_spi,
                        bytes - skip,
                        value >> (8 * skip),
                        |irq, byte| irq.targets = byte & mask,
                    )
                }
            }
            Reg::Sgir => self.write_sgir(vcpu, value),
            Reg::ClearPendingSgi(first) | Reg::SetPendingSgi(first) => {
                let set = matches!(reg, Reg::SetPendingSgi(_));
                let mask = self.vcpu_mask() as u8;
                let mut kick = 0;
                for i in 0..bytes {
                    let sgi = first + i;
                    let byte = (value >> (8 * i)) as u8 & mask;
                    kick |= self.track(vcpu, sgi, |d| {
                        if let Some(sources) = d.private[vcpu].sgi_sources.get_mut(sgi as usize) {
                            if set {
                                *sources |= byte;
                            } else {
                                *sources &= !byte;
                            }
                        }
                    });
                }
                kick
            }
            Reg::Reserved => {
                self.counters.reserved_writes += 1;
                0
            }
        };
        Ok(VgicEffect { kick })
    }

    /// GICD_TYPER, for either version: the interrupt lines, the vCPUs
    /// (at most 8, the field's reach) and, for a GICv3, 10 INTID bits.
    pub(super) fn typer(&self) -> u32 {
        let mut typer = regs::TYPER::ITLinesNumber.val(self.irq_end().div_ceil(32) - 1)
            + regs::TYPER::CPUNumber.val(self.vcpus.clamp(1, 8) as u32 - 1);
        if self.version == VgicVersion::V3 {
            typer += regs::TYPER::IDbits.val(9);
        }
        typer.value
    }

    fn read_bits(&self, vcpu: usize, kind: BitReg, first: u32) -> u32 {
        let mut value = 0;
        for i in 0..32 {
            let intid = first + i;
            let Some(irq) = self.irq(vcpu, intid) else {
                break;
            };
            let bit = match kind {
                BitReg::Group => irq.group1,
                BitReg::SetEnable | BitReg::ClearEnable => irq.enabled,
                BitReg::SetPending | BitReg::ClearPending => self.pending_in(vcpu, intid),
                BitReg::SetActive | BitReg::ClearActive => irq.active,
            };
            value |= u32::from(bit) << i;
        }
        value
    }

    fn write_bits(&mut self, vcpu: usize, kind: BitReg, first: u32, value: u32) -> u32 {
        let mut kick = 0;
        for i in 0..32 {
            let intid = first + i;
            if intid >= self.irq_end() {
                break;
            }
            let bit = value & (1 << i) != 0;
            // Set/clear registers ignore zero bits; IGROUPR is plain RW.
            if !bit && kind != BitReg::Group {
                continue;
            }
            // ISPENDR/ICPENDR bits of SGIs are WI in GICv2 (SPENDSGIR and
            // CPENDSGIR handle those).
            if intid < SGI_END && matches!(kind, BitReg::SetPending | BitReg::ClearPending) {
                continue;
            }
            kick |= self.track(vcpu, intid, |d| {
                if let Some(irq) = d.irq_mut(vcpu, intid) {
                    match kind {
                        BitReg::Group => irq.group1 = bit,
                        BitReg::SetEnable => irq.enabled = true,
                        BitReg::ClearEnable => irq.enabled = false,
                        BitReg::SetPending => irq.latch = true,
                        BitReg::ClearPending => irq.latch = false,
                        BitReg::SetActive => irq.active = true,
                        BitReg::ClearActive => irq.active = false,
                    }
                }
            });
        }
        kick
    }

    fn read_config(&self, vcpu: usize, first: u32) -> u32 {
        let mut value = 0;
        for i in 0..16 {
            match self.irq(vcpu, first + i) {
                Some(irq) => value |= u32::from(irq.edge) << (2 * i + 1),
                None => break,
            }
        }
        value
    }

    fn write_config(&mut self, vcpu: usize, first: u32, value: u32) -> u32 {
        let mut kick = 0;
        for i in 0..16 {
            let intid = first + i;
            if intid < SGI_END {
                continue; // SGIs are always edge-triggered.
            }
            if intid >= self.irq_end() {
                break;
            }
            let edge = value & (1 << (2 * i + 1)) != 0;
            kick |= self.track(vcpu, intid, |d| {
                if let Some(irq) = d.irq_mut(vcpu, intid) {
                    irq.edge = edge;
                }
            });
        }
        kick
    }

    fn read_bytes(&self, first: u32, bytes: u32, byte: impl Fn(&Self, u32) -> Option<u8>) -> u32 {
        (0..bytes).fold(0, |value, i| {
            value | u32::from(byte(self, first + i).unwrap_or(0)) << (8 * i)
        })
    }

    fn write_bytes(
        &mut self,
        vcpu: usize,
        first: u32,
        bytes: u32,
        value: u32,
        set: impl Fn(&mut Irq, u8),
    ) -> u32 {
        let mut kick = 0;
        for i in 0..bytes {
            let intid = first + i;
            if intid >= self.irq_end() {
                break;
            }
            let byte = (value >> (8 * i)) as u8;
            kick |= self.track(vcpu, intid, |d| {
                if let Some(irq) = d.irq_mut(vcpu, intid) {
                    set(irq, byte);
                }
            });
        }
        kick
    }

    /// The vCPUs (bit n: vCPU n) a GICD_SGIR write of `value` by vCPU
    /// `vcpu` sends its SGI to; `None` for the reserved TargetListFilter 3,
    /// which sends nothing.
    pub fn sgir_targets(&self, vcpu: usize, value: u32) -> Option<u32> {
        let list = (value >> 16) & 0xff;
        match (value >> 24) & 3 {
            0 => Some(list & self.vcpu_mask()),
            1 => Some(self.vcpu_mask() & !(1 << vcpu)),
            2 => Some(1 << vcpu),
            _ => None,
        }
    }

    fn write_sgir(&mut self, vcpu: usize, value: u32) -> u32 {
        let sgi = value & 0xf;
        let Some(targets) = self.sgir_targets(vcpu, value) else {
            self.counters.sgir_reserved += 1;
            return 0;
        };
        let mut kick = 0;
        for target in (0..self.vcpus).filter(|t| targets & (1 << t) != 0) {
            self.counters.sgis += 1;
            kick |= self.track(target, sgi, |d| {
                d.private[target].sgi_sources[sgi as usize] |= 1 << vcpu;
            });
        }
        kick
    }

    // ---- injection -----------------------------------------------------

    /// Sets an interrupt's input line; returns the vCPUs to kick.
    fn set_line(&mut self, bank: usize, intid: u32, level: bool) -> u32 {
        // The line as it was: nothing changes (a device re-asserting its
        // level after every register access is the common case).
        if self.irq(bank, intid).is_some_and(|irq| irq.line == level) {
            return 0;
        }
        self.track(bank, intid, |d| {
            if let Some(irq) = d.irq_mut(bank, intid) {
                if irq.edge && level && !irq.line {
                    irq.latch = true;
                }
                irq.line = level;
            }
        })
    }

    fn check_spi(&self, intid: u32) -> Result<(), VgicError> {
        if (SPI_BASE..self.irq_end()).contains(&intid) {
            Ok(())
        } else {
            Err(VgicError::BadIntid { intid })
        }
    }

    fn check_ppi(&self, vcpu: usize, intid: u32) -> Result<(), VgicError> {
        self.check_vcpu(vcpu)?;
        if (SGI_END..SPI_BASE).contains(&intid) {
            Ok(())
        } else {
            Err(VgicError::BadIntid { intid })
        }
    }

    /// Drives the input line of SPI `intid` (a device's interrupt output).
    /// For a level-sensitive SPI the interrupt is pending while the line is
    /// high; for an edge-configured one a rising edge latches it.
    pub fn set_level(&mut self, intid: u32, level: bool) -> Result<VgicEffect, VgicError> {
        self.check_spi(intid)?;
        Ok(VgicEffect {
            kick: self.set_line(0, intid, level),
        })
    }

    /// Drives the input line of PPI `intid` (16..32) of `vcpu` (the timer).
    pub fn set_ppi_level(
        &mut self,
        vcpu: usize,
        intid: u32,
        level: bool,
    ) -> Result<VgicEffect, VgicError> {
        self.check_ppi(vcpu, intid)?;
        Ok(VgicEffect {
            kick: self.set_line(vcpu, intid, level),
        })
    }

    /// Makes SPI `intid` pending, as an edge would (also for a level-
    /// configured SPI, where it acts like a write to ISPENDR).
    pub fn pend_edge(&mut self, intid: u32) -> Result<VgicEffect, VgicError> {
        self.check_spi(intid)?;
        Ok(VgicEffect {
            kick: self.track(0, intid, |d| {
                if let Some(irq) = d.irq_mut(0, intid) {
                    irq.latch = true;
                }
            }),
        })
    }

    /// Makes PPI `intid` of `vcpu` pending, as an edge would.
    pub fn pend_ppi(&mut self, vcpu: usize, intid: u32) -> Result<VgicEffect, VgicError> {
        self.check_ppi(vcpu, intid)?;
        Ok(VgicEffect {
            kick: self.track(vcpu, intid, |d| {
                if let Some(irq) = d.irq_mut(vcpu, intid) {
                    irq.latch = true;
                }
            }),
        })
    }

    // ---- delivery ------------------------------------------------------

    /// The highest-priority interrupt deliverable to `vcpu` (distributor
    /// and group enabled, interrupt enabled, pending, not active, targeted
    /// at `vcpu`) that `already_listed` does not claim. Ties go to the
    /// lowest INTID. For an SGI, the lowest pending source CPU.
    pub fn next_pending(
        &self,
        vcpu: usize,
        already_listed: impl Fn(u32) -> bool,
    ) -> Option<PendingIrq> {
        if vcpu >= self.vcpus || self.ctlr == 0 {
            return None;
        }
        // Nothing pending at all (the common case at every guest entry):
        // no scan.
        if self.private_pending.get(vcpu).is_none_or(|&w| w == 0)
            && self.spi_pending.iter().all(|&w| w == 0)
        {
            return None;
        }
        let mut best: Option<(u8, u32)> = None;
        for intid in self.pending_intids(vcpu) {
            if !self.deliverable_to(vcpu, intid) {
                continue;
            }
            let priority = self.irq(vcpu, intid)?.priority;
            if best.is_some_and(|(p, _)| p <= priority) || already_listed(intid) {
                continue;
            }
            best = Some((priority, intid));
        }
        let (priority, intid) = best?;
        let irq = self.irq(vcpu, intid)?;
        Some(PendingIrq {
            intid,
            priority,
            source_cpu: (intid < SGI_END)
                .then(|| self.sgi_sources(vcpu, intid).trailing_zeros() as u8),
            is_level: !irq.edge,
            group1: irq.group1,
        })
    }

    /// `irq` (from [`Self::next_pending`]) was written into a list register
    /// of `vcpu`: its latched pending state (for an SGI, that source's) now
    /// lives in the list register. A level interrupt stays pending here
    /// while its line is high; see the module documentation.
    pub fn on_listed(&mut self, vcpu: usize, irq: &PendingIrq) {
        if vcpu >= self.vcpus {
            return;
        }
        let intid = irq.intid;
        if intid < SGI_END {
            if let Some(source) = irq.source_cpu.filter(|&s| s < 8) {
                self.private[vcpu].sgi_sources[intid as usize] &= !(1 << source);
            }
            self.refresh_pending(vcpu, intid);
        } else if intid < self.irq_end() {
            if let Some(state) = self.irq_mut(vcpu, intid) {
                state.latch = false;
            }
            self.refresh_pending(vcpu, intid);
        }
    }

    /// The guest deactivated `intid`, which was listed with the EOI bit
    /// (the maintenance interrupt's GICH_EISR). Re-samples a level
    /// interrupt: if its line is still high it is pending again and the
    /// effect asks for `vcpu` to be kicked (to list it again).
    pub fn on_eoi(&mut self, vcpu: usize, intid: u32) -> VgicEffect {
        if vcpu >= self.vcpus || !self.deliverable_to(vcpu, intid) {
            return VgicEffect::NONE;
        }
        VgicEffect { kick: 1 << vcpu }
    }
}
