//! The PMU as an instruction counter for the hypervisor's own work: event
//! counter 0 counts instructions retired at EL2 only, so the balloon can say
//! how many hypervisor instructions a page costs. Under QEMU the event exists
//! only with `-icount` (which `cargo xtask bench` uses); elsewhere the
//! counter may not count and reports say so.

use core::sync::atomic::{AtomicBool, Ordering};

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
    COUNTING.store(
        PMCEID0_EL0.is_set(PMCEID0_EL0::INST_RETIRED),
        Ordering::Relaxed,
    );
}

/// Whether the PMU implements the instructions-retired event (as `init`
/// found it). A byte, 1 or 0: the guest IRQ vector reads it too.
pub(super) static COUNTING: AtomicBool = AtomicBool::new(false);

/// Whether the PMU implements the instructions-retired event.
pub fn counts_instructions() -> bool {
    COUNTING.load(Ordering::Relaxed)
}

/// Instructions retired at EL2 on this CPU (a 32-bit counter: use wrapping
/// differences over short intervals); 0 where the PMU does not count them.
/// Read around every exit: without the event the counter is not read at
/// all, since under QEMU a PMU register access takes the global lock that
/// every emulated CPU's device accesses contend for.
#[inline]
pub fn instructions() -> u32 {
    if !COUNTING.load(Ordering::Relaxed) {
        return 0;
    }
    PMEVCNTR0_EL0.get() as u32
}
