//! Modes that misbehave without touching the balloon, for the hypervisor's
//! fault-injection tests (tests/tests/faults.rs): `spin` never traps again,
//! with interrupts masked; `flood` writes its console as fast as it can.

use crate::arch::{counter, counter_hz};

/// Masks every interrupt and spins without a trap: no WFI, no MMIO, no
/// hypercall. Only the hypervisor's own physical interrupts (routed to EL2
/// whatever the guest masks) can take the CPU back.
pub fn spin() -> ! {
    println!("spin: interrupts masked, spinning without a trap");
    // SAFETY: masking the guest's own interrupts at EL1 affects only this
    // guest; it never unmasks them.
    unsafe { core::arch::asm!("msr daifset, #0xf", options(nomem, nostack)) };
    loop {
        core::hint::spin_loop();
    }
}

/// Prints numbered lines in a tight loop, with a per-second summary so a
/// test can see it is still going.
pub fn flood() -> ! {
    let hz = counter_hz();
    let start = counter();
    let mut next_summary = start + hz;
    let mut line: u64 = 0;
    loop {
        println!("flood {line} the quick brown fox jumps over the lazy dog");
        line += 1;
        let now = counter();
        if now >= next_summary {
            println!("flood: {line} lines in {}s", (now - start) / hz);
            next_summary += hz;
        }
    }
}
