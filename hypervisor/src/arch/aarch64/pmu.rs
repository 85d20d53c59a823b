//! The PMU as an instruction counter for the hypervisor's own work: event
//! counter 0 counts instructions retired at EL2 only, so the balloon can say
//! how many hypervisor instructions a page costs. Under QEMU the event exists
//! only with `-icount` (which `cargo xtask bench` uses); elsewhere the
//! counter may not count and reports say so.

use core::arch::asm;

const INST_RETIRED: u64 = 0x08;
/// PMEVTYPER: P (don't count EL1), U (don't count EL0), NSH (count EL2).
const FILTER_EL2_ONLY: u64 = (1 << 31) | (1 << 30) | (1 << 27);

/// Set up counter 0 on this CPU.
pub fn init() {
    // SAFETY: the PMU registers only affect performance counting.
    unsafe {
        asm!(
            "msr PMSELR_EL0, xzr",
            "isb",
            "msr PMXEVTYPER_EL0, {ty}",
            "msr PMCNTENSET_EL0, {one}",
            "mrs {tmp}, PMCR_EL0",
            "orr {tmp}, {tmp}, #1",
            "msr PMCR_EL0, {tmp}",
            "isb",
            ty = in(reg) INST_RETIRED | FILTER_EL2_ONLY,
            one = in(reg) 1u64,
            tmp = out(reg) _,
            options(nostack)
        );
    }
}

/// Whether the PMU implements the instructions-retired event.
pub fn counts_instructions() -> bool {
    let ceid: u64;
    // SAFETY: reading an ID register of the PMU has no side effects.
    unsafe { asm!("mrs {}, PMCEID0_EL0", out(reg) ceid, options(nomem, nostack)) };
    ceid & (1 << INST_RETIRED) != 0
}

/// Instructions retired at EL2 on this CPU (a 32-bit counter: use wrapping
/// differences over short intervals).
pub fn instructions() -> u32 {
    let v: u64;
    // SAFETY: reading event counter 0 has no side effects.
    unsafe { asm!("mrs {}, PMEVCNTR0_EL0", out(reg) v, options(nomem, nostack)) };
    v as u32
}
