//! The PMU as an instruction counter for the hypervisor's own work: event
//! counter 0 counts instructions retired at EL2 only, so the balloon can say
//! how many hypervisor instructions a page costs. Under QEMU the event exists
//! only with `-icount` (which `cargo xtask bench` uses); elsewhere the
//! counter may not count and reports say so.

use aarch64_cpu::asm::barrier;
use aarch64_cpu::registers::{ReadWriteable, Readable, Writeable};

use super::sysreg::{
    PMCEID0_EL0, PMCNTENSET_EL0, PMCR_EL0, PMEVCNTR0_EL0, PMSELR_EL0, PMXEVTYPER_EL0,
};

/// Set up counter 0 on this CPU: instructions retired at EL2 only.
pub fn init() {
    PMSELR_EL0.write(PMSELR_EL0::SEL.val(0));
    barrier::isb(barrier::SY);
    PMXEVTYPER_EL0.write(
        PMXEVTYPER_EL0::evtCount::InstRetired
            + PMXEVTYPER_EL0::P::SET
            + PMXEVTYPER_EL0::U::SET
            + PMXEVTYPER_EL0::NSH::SET,
    );
    PMCNTENSET_EL0.write(PMCNTENSET_EL0::P0::SET);
    PMCR_EL0.modify(PMCR_EL0::E::SET);
    barrier::isb(barrier::SY);
}

/// Whether the PMU implements the instructions-retired event.
pub fn counts_instructions() -> bool {
    PMCEID0_EL0.is_set(PMCEID0_EL0::INST_RETIRED)
}

/// Instructions retired at EL2 on this CPU (a 32-bit counter: use wrapping
/// differences over short intervals).
#[inline]
pub fn instructions() -> u32 {
    PMEVCNTR0_EL0.get() as u32
}
