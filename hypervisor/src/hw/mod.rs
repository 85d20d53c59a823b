//! Architectural encodings that both the arch drivers and the portable VM
//! core use, as plain data: list-register values and the INTIDs the
//! hypervisor gives a meaning to (GIC), the guest register context of the
//! world switch, the EL2 controls a guest runs under, the exception
//! syndrome (ESR/ISS, HPFAR), the registers of an injected exception and
//! the generic timer's ticks in microseconds.
//!
//! Everything here is host-tested and imports nothing above `mm` and
//! `addr`: `arch/` and `vm/`/`vgic/` both build on it, so neither reaches
//! into the other for an encoding.

pub mod context;
pub mod controls;
pub mod gic_lr;
pub mod inject;
pub mod intid;
pub mod sgi;
pub mod syndrome;
pub mod timer;
