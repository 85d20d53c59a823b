//! The GICv3 face of [`VDistributor`]: the distributor's 64 KiB register
//! frame, one redistributor (RD and SGI frames, 128 KiB) per vCPU, and the
//! SGIs a guest sends by writing ICC_SGI1R_EL1 (trapped by HCR_EL2.IMO).
//! The interrupt state underneath is the same as for GICv2.
//!
//! # The guest's GICv3
//!
//! What KVM shows a guest: one security state (GICD_CTLR.DS reads 1),
//! affinity routing always on (ARE reads 1), no LPIs, no ITS, no
//! message-based SPIs, no extended ranges. GICD_CTLR keeps EnableGrp0 (bit
//! 0) and EnableGrp1 (bit 1); Linux sets every interrupt to group 1 and
//! writes bits 0, 1 and 4.
//!
//! - With affinity routing, the distributor's SGI/PPI parts (the first
//!   word of each bit array, the first 32 priority bytes, the first two
//!   ICFGR words) read as zero and ignore writes, as do ITARGETSR, SGIR
//!   and the SGI pending-source registers: the redistributors own INTIDs
//!   0..32.
//! - `GICD_IROUTER<n>` (0x6000 + 8n) takes 32- and 64-bit accesses. An SPI
//!   goes to the vCPU whose affinity it names (vCPU *v* has MPIDR Aff0 =
//!   *v*, Aff1..3 = 0, as VMPIDR_EL2 says); Interrupt_Routing_Mode 1 (any
//!   vCPU) delivers to the lowest-numbered one; a route that names no vCPU
//!   leaves the SPI undelivered until it is rerouted.
//! - A redistributor's GICR_TYPER gives its affinity, its processor number
//!   (the vCPU index) and, for the last one, Last. GICR_WAKER.ProcessorSleep
//!   resets to 1 and ChildrenAsleep follows it at once; Linux clears it and
//!   waits for ChildrenAsleep to clear.
//! - SGIs have no source CPU in GICv3: a vCPU's SGI is pending or not (the
//!   model keeps it in source bit 0) and is listed without a source.
//!   ISPENDR0/ICPENDR0 of the SGI frame set and clear it.
//!
//! Accesses are 32-bit (bytes also for IPRIORITYR, 64-bit also for IROUTER
//! and GICR_TYPER); anything else is a [`VgicError`]. Offsets with no
//! register read as zero and ignore writes, counted.

use super::regs::{decode, Reg};
use super::{
    VDistributor, VgicEffect, VgicError, VgicVersion, CTLR_ENABLE_GRP0, CTLR_ENABLE_GRP1,
    GICD_CTLR, GICD_ID_VALUES, GICD_IIDR, GICD_TYPER, IIDR_VALUE, PRIORITY_MASK, SGI_END, SPI_BASE,
};
use crate::hw::sgi::ICC_SGI1R_EL1;
use crate::register_access::check_access;
use tock_registers::LocalRegisterCopy;

/// Size of the distributor's register frame.
pub const GICV3_DIST_WINDOW: u64 = 0x1_0000;
/// Size of one redistributor (RD_base and SGI_base frames).
pub const GICR_STRIDE: u64 = 0x2_0000;
/// Offset of the SGI_base frame in a redistributor.
pub const GICR_SGI_BASE: u64 = 0x1_0000;

const GICD_TYPER2: u64 = 0x00c;
const GICD_STATUSR: u64 = 0x010;
/// GICD_IROUTER<n> is at this + 8n, for SPIs n = 32..1020.
const GICD_IROUTER: u64 = 0x6000;
/// The identification registers sit at the end of each 64 KiB frame.
const ID_BASE: u64 = 0xffd0;
/// The ID block's PIDR2 is its seventh word: ArchRev 3 (GICv3).
const PIDR2_INDEX: usize = 6;
const PIDR2_V3: u32 = 0x3b;

/// GICD_CTLR.ARE (affinity routing; RAO/WI here).
const CTLR_ARE: u32 = 1 << 4;
/// GICD_CTLR.DS (one security state; RAO/WI here).
const CTLR_DS: u32 = 1 << 6;

const GICR_CTLR: u64 = 0x0000;
const GICR_IIDR: u64 = 0x0004;
/// Redistributor Type Register (64-bit).
pub const GICR_TYPER: u64 = 0x0008;
const GICR_STATUSR: u64 = 0x0010;
/// Redistributor Wake Register.
pub const GICR_WAKER: u64 = 0x0014;
const WAKER_PROCESSOR_SLEEP: u32 = 1 << 1;
const WAKER_CHILDREN_ASLEEP: u32 = 1 << 2;
/// GICR_TYPER.Last: the last redistributor of the region.
const TYPER_LAST: u64 = 1 << 4;

/// IROUTER.Interrupt_Routing_Mode: any participating vCPU.
const IROUTER_IRM: u64 = 1 << 31;
/// The IROUTER fields that exist: Aff3, IRM, Aff2, Aff1, Aff0.
pub(super) const IROUTER_MASK: u64 = 0xff_8000_0000 | 0xff_ffff;

/// The trapped SGI generation registers (op0, op1, CRn, CRm, op2).
pub const ICC_SGI1R_EL1: (u8, u8, u8, u8, u8) = (3, 0, 12, 11, 5);
pub const ICC_ASGI1R_EL1: (u8, u8, u8, u8, u8) = (3, 1, 12, 11, 6);
pub const ICC_SGI0R_EL1: (u8, u8, u8, u8, u8) = (3, 2, 12, 11, 7);

/// A decoded GICv3 register access: which part of the state it names.
enum V3Reg {
    Ctlr,
    Read(u64),
    /// A GICv2-layout register (bit arrays, priorities, ICFGR) over the
    /// bank of `bank`.
    Shared(Reg),
    Irouter(u32),
    RedistWaker,
    Reserved,
}

fn id_value(offset: u64) -> u32 {
    let index = ((offset - ID_BASE) / 4) as usize;
    if index == PIDR2_INDEX {
        PIDR2_V3
    } else {
        GICD_ID_VALUES.get(index).copied().unwrap_or(0)
    }
}

impl VDistributor {
    fn v3_check(
        &mut self,
        vcpu: usize,
        offset: u64,
        width: u8,
        window: u64,
        wide_ok: bool,
        byte_ok: bool,
    ) -> Result<(), VgicError> {
        let result = (|| {
            self.check_vcpu(vcpu)?;
            if self.version != VgicVersion::V3 || offset >= window {
                return Err(VgicError::OutOfWindow { offset });
            }
            let widths: &[u8] = match (wide_ok, byte_ok) {
                (true, true) => &[1, 4, 8],
                (true, false) => &[4, 8],
                (false, true) => &[1, 4],
                (false, false) => &[4],
            };
            check_access(offset, width, widths)
                .map_err(|fault| VgicError::refused(fault, offset, width))
        })();
        if result.is_err() {
            self.counters.rejected += 1;
        }
        result
    }

    /// Which register a distributor offset names (GICv3 layout).
    fn decode_dist_v3(&self, offset: u64) -> V3Reg {
        match offset {
            GICD_CTLR => V3Reg::Ctlr,
            GICD_TYPER => V3Reg::Read(u64::from(self.typer())),
            GICD_IIDR => V3Reg::Read(u64::from(IIDR_VALUE)),
            GICD_TYPER2 | GICD_STATUSR => V3Reg::Reserved,
            o if (GICD_IROUTER..ID_BASE).contains(&o) => {
                let intid = ((o - GICD_IROUTER) / 8) as u32;
                if (SPI_BASE..self.irq_end()).contains(&intid) {
                    V3Reg::Irouter(intid)
                } else {
                    V3Reg::Reserved
                }
            }
            o if o >= ID_BASE => V3Reg::Read(u64::from(id_value(o & !3))),
            o if o < 0x1000 => match decode(o) {
                // The redistributors own INTIDs 0..32 under affinity routing.
                r @ (Reg::Bits(_, first) | Reg::Config(first) | Reg::Priority(first))
                    if first >= SPI_BASE =>
                {
                    V3Reg::Shared(r)
                }
                _ => V3Reg::Reserved,
            },
            _ => V3Reg::Reserved,
        }
    }

    /// A guest read of `width` bytes (1, 4 or 8) at `offset` into the GICv3
    /// distributor frame, by vCPU `vcpu`.
    pub fn read_dist_v3(&mut self, vcpu: usize, offset: u64, width: u8) -> Result<u64, VgicError> {
        let wide = (GICD_IROUTER..ID_BASE).contains(&offset);
        let bytes = (0x400..0x800).contains(&offset);
        self.v3_check(vcpu, offset, width, GICV3_DIST_WINDOW, wide, bytes)?;
        Ok(match self.decode_dist_v3(offset) {
            V3Reg::Ctlr => u64::from(self.ctlr | CTLR_ARE | CTLR_DS),
            V3Reg::Read(value) => value,
            V3Reg::Shared(reg) => u64::from(self.read_shared(vcpu, reg, width)),
            V3Reg::Irouter(intid) => {
                let value = self.irouter[(intid - SPI_BASE) as usize];
                if width == 4 && offset & 4 != 0 {
                    value >> 32
                } else if width == 4 {
                    value & 0xffff_ffff
                } else {
                    value
                }
            }
            V3Reg::RedistWaker | V3Reg::Reserved => {
                self.counters.reserved_reads += 1;
                0
            }
        })
    }

    /// A guest write of `width` bytes (1, 4 or 8) at `offset` into the
    /// GICv3 distributor frame, by vCPU `vcpu`.
    pub fn write_dist_v3(
        &mut self,
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<VgicEffect, VgicError> {
        let wide = (GICD_IROUTER..ID_BASE).contains(&offset);
        let bytes = (0x400..0x800).contains(&offset);
        self.v3_check(vcpu, offset, width, GICV3_DIST_WINDOW, wide, bytes)?;
        let kick = match self.decode_dist_v3(offset) {
            V3Reg::Ctlr => {
                let old = self.ctlr;
                self.ctlr = value as u32 & (CTLR_ENABLE_GRP0 | CTLR_ENABLE_GRP1);
                if self.ctlr & !old != 0 {
                    self.pending_vcpus()
                } else {
                    0
                }
            }
            V3Reg::Read(_) => {
                self.counters.read_only_writes += 1;
                0
            }
            V3Reg::Shared(reg) => self.write_shared(vcpu, reg, width, value as u32),
            V3Reg::Irouter(intid) => {
                let index = (intid - SPI_BASE) as usize;
                let old = self.irouter[index];
                let new = match (width, offset & 4 != 0) {
                    (8, _) => value,
                    (_, false) => (old & !0xffff_ffff) | (value & 0xffff_ffff),
                    (_, true) => (old & 0xffff_ffff) | (value << 32),
                } & IROUTER_MASK;
                self.irouter[index] = new;
                let targets = self.route_targets(new);
                self.track(vcpu, intid, |d| {
                    if let Some(irq) = d.irq_mut(0, intid) {
                        irq.targets = targets;
                    }
                })
            }
            V3Reg::RedistWaker | V3Reg::Reserved => {
                self.counters.reserved_writes += 1;
                0
            }
        };
        Ok(VgicEffect { kick })
    }

    /// The vCPU mask an IROUTER value routes to (see the module docs).
    pub(super) fn route_targets(&self, irouter: u64) -> u8 {
        if irouter & IROUTER_IRM != 0 {
            return self.vcpu_mask() as u8;
        }
        let aff0 = (irouter & 0xff) as usize;
        let upper = irouter & (0xff_0000_0000 | 0xff_ff00);
        if upper == 0 && aff0 < self.vcpus {
            1 << aff0
        } else {
            0
        }
    }

    /// Which register an offset into redistributor `redist` names.
    fn decode_redist(&self, redist: usize, offset: u64) -> V3Reg {
        if offset >= GICR_SGI_BASE {
            let o = offset - GICR_SGI_BASE;
            if o >= ID_BASE {
                // The SGI frame has no ID block of its own.
                return V3Reg::Reserved;
            }
            return match o {
                0..0x1000 => match decode(o) {
                    r @ (Reg::Bits(_, first) | Reg::Config(first) | Reg::Priority(first))
                        if first < SPI_BASE =>
                    {
                        V3Reg::Shared(r)
                    }
                    _ => V3Reg::Reserved,
                },
                _ => V3Reg::Reserved,
            };
        }
        match offset {
            GICR_CTLR | GICR_STATUSR => V3Reg::Reserved,
            GICR_IIDR => V3Reg::Read(u64::from(IIDR_VALUE)),
            o if o & !7 == GICR_TYPER => {
                let last = if redist + 1 == self.vcpus {
                    TYPER_LAST
                } else {
                    0
                };
                V3Reg::Read(((redist as u64) << 32) | ((redist as u64) << 8) | last)
            }
            GICR_WAKER => V3Reg::RedistWaker,
            o if o >= ID_BASE => V3Reg::Read(u64::from(id_value(o & !3))),
            _ => V3Reg::Reserved,
        }
    }

    fn check_redist(&mut self, redist: usize) -> Result<(), VgicError> {
        if redist < self.vcpus {
            Ok(())
        } else {
            self.counters.rejected += 1;
            Err(VgicError::BadVcpu { vcpu: redist })
        }
    }

    /// A guest read of `width` bytes at `offset` into the redistributor of
    /// vCPU `redist`, by vCPU `vcpu`.
    pub fn read_redist(
        &mut self,
        vcpu: usize,
        redist: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, VgicError> {
        self.check_redist(redist)?;
        let wide = offset & !7 == GICR_TYPER;
        let bytes = (GICR_SGI_BASE + 0x400..GICR_SGI_BASE + 0x420).contains(&offset);
        self.v3_check(vcpu, offset, width, GICR_STRIDE, wide, bytes)?;
        Ok(match self.decode_redist(redist, offset) {
            V3Reg::Read(value) if width == 4 && offset & 4 != 0 => value >> 32,
            V3Reg::Read(value) if width == 4 => value & 0xffff_ffff,
            V3Reg::Read(value) => value,
            V3Reg::Shared(reg) => u64::from(self.read_shared(redist, reg, width)),
            V3Reg::RedistWaker => {
                if self.asleep[redist] {
                    u64::from(WAKER_PROCESSOR_SLEEP | WAKER_CHILDREN_ASLEEP)
                } else {
                    0
                }
            }
            V3Reg::Ctlr | V3Reg::Irouter(_) | V3Reg::Reserved => {
                self.counters.reserved_reads += 1;
                0
            }
        })
    }

    /// A guest write of `width` bytes at `offset` into the redistributor of
    /// vCPU `redist`, by vCPU `vcpu`.
    pub fn write_redist(
        &mut self,
        vcpu: usize,
        redist: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<VgicEffect, VgicError> {
        self.check_redist(redist)?;
        let wide = offset & !7 == GICR_TYPER;
        let bytes = (GICR_SGI_BASE + 0x400..GICR_SGI_BASE + 0x420).contains(&offset);
        self.v3_check(vcpu, offset, width, GICR_STRIDE, wide, bytes)?;
        let kick = match self.decode_redist(redist, offset) {
            V3Reg::Read(_) => {
                self.counters.read_only_writes += 1;
                0
            }
            V3Reg::Shared(reg) => self.write_shared(redist, reg, width, value as u32),
            V3Reg::RedistWaker => {
                self.asleep[redist] = value as u32 & WAKER_PROCESSOR_SLEEP != 0;
                0
            }
            V3Reg::Ctlr | V3Reg::Irouter(_) | V3Reg::Reserved => {
                self.counters.reserved_writes += 1;
                0
            }
        };
        Ok(VgicEffect { kick })
    }

    /// A bit-array, priority or configuration register read through `bank`.
    fn read_shared(&self, bank: usize, reg: Reg, width: u8) -> u32 {
        match reg {
            Reg::Bits(kind, first) => self.read_bits(bank, kind, first),
            Reg::Config(first) => self.read_config(bank, first),
            Reg::Priority(first) => self.read_bytes(first, u32::from(width), |d, intid| {
                d.irq(bank, intid).map(|i| i.priority)
            }),
            _ => 0,
        }
    }

    fn write_shared(&mut self, bank: usize, reg: Reg, width: u8, value: u32) -> u32 {
        match reg {
            Reg::Bits(kind, first) => {
                let mut kick = self.write_bits(bank, kind, first, value);
                if first == 0 {
                    kick |= self.write_sgi_pending(bank, kind, value);
                }
                kick
            }
            Reg::Config(first) => self.write_config(bank, first, value),
            Reg::Priority(first) => {
                self.write_bytes(bank, first, u32::from(width), value, |irq, byte| {
                    irq.priority = byte & PRIORITY_MASK
                })
            }
            _ => 0,
        }
    }

    /// GICR_ISPENDR0/ICPENDR0 bits of SGIs (which GICv2's ISPENDR ignores).
    fn write_sgi_pending(&mut self, bank: usize, kind: super::BitReg, value: u32) -> u32 {
        let set = match kind {
            super::BitReg::SetPending => true,
            super::BitReg::ClearPending => false,
            _ => return 0,
        };
        let mut kick = 0;
        for sgi in (0..SGI_END).filter(|s| value & (1 << s) != 0) {
            kick |= self.track(bank, sgi, |d| {
                d.private[bank].sgi_sources[sgi as usize] = u8::from(set);
            });
        }
        kick
    }

    /// A guest write of `value` to ICC_SGI1R_EL1 (or ICC_ASGI1R_EL1 /
    /// ICC_SGI0R_EL1, which this one-security-state GIC treats alike) by
    /// vCPU `vcpu`: the SGI becomes pending on every vCPU it names.
    pub fn send_sgi_v3(&mut self, vcpu: usize, value: u64) -> Result<VgicEffect, VgicError> {
        self.check_vcpu(vcpu)?;
        let value = LocalRegisterCopy::<u64, ICC_SGI1R_EL1::Register>::new(value);
        let sgi = value.read(ICC_SGI1R_EL1::INTID) as u32;
        let targets: u32 = if value.is_set(ICC_SGI1R_EL1::IRM) {
            self.vcpu_mask() & !(1 << vcpu)
        } else if value.read(ICC_SGI1R_EL1::Aff3) != 0
            || value.read(ICC_SGI1R_EL1::Aff2) != 0
            || value.read(ICC_SGI1R_EL1::Aff1) != 0
        {
            // Aff3.Aff2.Aff1 must name our cluster (all zero).
            0
        } else {
            // Aff0 is RS * 16 + the TargetList bit.
            let range_selector = value.read(ICC_SGI1R_EL1::RS) as usize;
            let list = value.read(ICC_SGI1R_EL1::TargetList);
            (0..16)
                .filter(|bit| list & (1 << bit) != 0)
                .map(|bit| range_selector * 16 + bit)
                .filter(|&aff0| aff0 < self.vcpus)
                .fold(0, |mask, aff0| mask | 1 << aff0)
        };
        let mut kick = 0;
        for target in (0..self.vcpus).filter(|t| targets & (1 << t) != 0) {
            self.counters.sgis += 1;
            kick |= self.track(target, sgi, |d| {
                d.private[target].sgi_sources[sgi as usize] = 1;
            });
        }
        Ok(VgicEffect { kick })
    }
}
