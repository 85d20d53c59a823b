//! The virtual distributor's saved state ([`SaveState`]): its version and
//! size, GICD_CTLR, every interrupt's configuration and state (enable,
//! pending latch, active, group, edge or level, line, priority, targets),
//! each SGI's sources, GICv3's IROUTER and redistributor sleep, and the
//! counters. The pending bitmaps are derived: recomputed on restore.
//!
//! Restoring checks what a guest could have written: a size the
//! constructors accept, CTLR's two enable bits, priorities in their
//! implemented bits, SGIs edge-triggered, SGI sources and SPI targets
//! among the vCPUs, IROUTER within its writable bits (a GICv3 SPI's
//! targets are what its IROUTER routes to).

use super::{
    Irq, PrivateBank, VDistributor, VgicCounters, VgicVersion, CTLR_ENABLE_GRP0, CTLR_ENABLE_GRP1,
    MAX_SPIS, MAX_VCPUS, PRIORITY_MASK, SGI_END, SPI_BASE,
};
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};

/// The layout version of the distributor's saved state.
const VERSION: u8 = 1;

fn invalid(what: &'static str) -> StateError {
    StateError::Invalid(what)
}

fn save_irq(w: &mut StateWriter, irq: &Irq) {
    let flags = [
        irq.enabled,
        irq.latch,
        irq.active,
        irq.group1,
        irq.edge,
        irq.line,
    ]
    .iter()
    .enumerate()
    .fold(0u8, |f, (i, &b)| f | u8::from(b) << i);
    w.u8(flags);
    w.u8(irq.priority);
    w.u8(irq.targets);
}

fn restore_irq(r: &mut StateReader<'_>) -> Result<Irq, StateError> {
    let flags = r.u8()?;
    if flags >> 6 != 0 {
        return Err(invalid("vGIC interrupt flags"));
    }
    let bit = |i: u8| flags & (1 << i) != 0;
    let irq = Irq {
        enabled: bit(0),
        latch: bit(1),
        active: bit(2),
        group1: bit(3),
        edge: bit(4),
        line: bit(5),
        priority: r.u8()?,
        targets: r.u8()?,
    };
    if irq.priority & !PRIORITY_MASK != 0 {
        return Err(invalid("vGIC interrupt priority"));
    }
    Ok(irq)
}

impl SaveState for VDistributor {
    fn save(&self, w: &mut StateWriter) {
        w.u8(VERSION);
        w.u8(match self.version {
            VgicVersion::V2 => 2,
            VgicVersion::V3 => 3,
        });
        w.u64(self.vcpus as u64);
        w.u32(self.spis);
        w.u32(self.ctlr);
        for bank in &self.private {
            for irq in &bank.irqs {
                save_irq(w, irq);
            }
            w.bytes(&bank.sgi_sources);
        }
        for irq in &self.spi {
            save_irq(w, irq);
        }
        for &route in &self.irouter {
            w.u64(route);
        }
        for &asleep in &self.asleep {
            w.bool(asleep);
        }
        let c = &self.counters;
        for n in [
            c.reserved_reads,
            c.reserved_writes,
            c.read_only_writes,
            c.write_only_reads,
            c.sgir_reserved,
            c.rejected,
            c.sgis,
        ] {
            w.u64(n);
        }
    }

    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        r.version("vGIC distributor", VERSION)?;
        let version = match r.u8()? {
            2 => VgicVersion::V2,
            3 => VgicVersion::V3,
            _ => return Err(invalid("vGIC version")),
        };
        let vcpus = r.at_most(MAX_VCPUS as u64, "vGIC vCPU count")? as usize;
        let spis = r.u32()?;
        if vcpus == 0 || spis > MAX_SPIS {
            return Err(invalid("vGIC size"));
        }
        let mut d =
            VDistributor::with_version(version, vcpus, spis).map_err(|_| invalid("vGIC size"))?;
        d.ctlr = r.masked_u32(CTLR_ENABLE_GRP0 | CTLR_ENABLE_GRP1, "vGIC CTLR")?;
        let vcpu_mask = d.vcpu_mask() as u8;
        for b in 0..vcpus {
            let mut bank = PrivateBank::reset();
            for (intid, irq) in bank.irqs.iter_mut().enumerate() {
                *irq = restore_irq(r)?;
                if (intid as u32) < SGI_END && !irq.edge {
                    return Err(invalid("a vGIC SGI not edge-triggered"));
                }
            }
            bank.sgi_sources = r.array()?;
            if bank.sgi_sources.iter().any(|&s| s & !vcpu_mask != 0) {
                return Err(invalid("vGIC SGI source"));
            }
            d.private[b] = bank;
        }
        for i in 0..spis as usize {
            let irq = restore_irq(r)?;
            if irq.targets & !vcpu_mask != 0 {
                return Err(invalid("vGIC SPI targets"));
            }
            d.spi[i] = irq;
        }
        for i in 0..spis as usize {
            let route = r.u64()?;
            let never_written = version == VgicVersion::V2 && route != 0;
            if route & !super::v3::IROUTER_MASK != 0 || never_written {
                return Err(invalid("vGIC IROUTER"));
            }
            if version == VgicVersion::V3 && d.spi[i].targets != d.route_targets(route) {
                return Err(invalid("vGIC SPI targets"));
            }
            d.irouter[i] = route;
        }
        for b in 0..vcpus {
            d.asleep[b] = r.bool("vGIC redistributor asleep")?;
        }
        d.counters = VgicCounters {
            reserved_reads: r.count("vGIC counter")?,
            reserved_writes: r.count("vGIC counter")?,
            read_only_writes: r.count("vGIC counter")?,
            write_only_reads: r.count("vGIC counter")?,
            sgir_reserved: r.count("vGIC counter")?,
            rejected: r.count("vGIC counter")?,
            sgis: r.count("vGIC counter")?,
        };
        for bank in 0..vcpus {
            for intid in 0..SPI_BASE {
                d.refresh_pending(bank, intid);
            }
        }
        for intid in SPI_BASE..d.irq_end() {
            d.refresh_pending(0, intid);
        }
        Ok(d)
    }
}
