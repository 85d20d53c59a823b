//! AArch64 at EL2: boot entry, exception vectors, the EL2 MMU, CPU bring-up
//! (PSCI and spin table), PSCI calls and small system-register helpers.

pub mod entry;
pub mod exceptions;
pub mod gic;
pub mod gic_v3;
pub mod mmu;
pub mod pmu;
pub mod psci;
pub mod recovery;
pub mod smp;
pub mod vcpu;

use core::arch::asm;

pub use platform::MAX_CPUS;

/// Bytes of stack per CPU.
pub const STACK_SIZE: usize = 64 * 1024;

/// The logical index of the calling CPU (kept in TPIDR_EL2 since boot).
pub fn cpu_index() -> usize {
    let v: u64;
    // SAFETY: reading TPIDR_EL2 has no side effects.
    unsafe { asm!("mrs {}, TPIDR_EL2", out(reg) v, options(nomem, nostack)) };
    v as usize
}

/// MPIDR_EL1 affinity fields (Aff3..Aff0), as device trees write them.
pub fn mpidr() -> u64 {
    let v: u64;
    // SAFETY: reading MPIDR_EL1 has no side effects.
    unsafe { asm!("mrs {}, MPIDR_EL1", out(reg) v, options(nomem, nostack)) };
    v & 0xff_00ff_ffff
}

/// The physical counter (CNTPCT_EL0) and its frequency in Hz.
pub fn counter() -> (u64, u64) {
    let (count, freq): (u64, u64);
    // SAFETY: reading the architected counter has no side effects.
    unsafe {
        asm!("isb", "mrs {}, CNTPCT_EL0", out(reg) count, options(nomem, nostack));
        asm!("mrs {}, CNTFRQ_EL0", out(reg) freq, options(nomem, nostack));
    }
    (count, freq)
}

/// Microseconds since the counter started (board power-on).
pub fn uptime_us() -> u64 {
    let (count, freq) = counter();
    if freq == 0 {
        return 0;
    }
    (count as u128 * 1_000_000 / freq as u128) as u64
}

/// The smallest data cache line of this CPU, in bytes (CTR_EL0.DminLine):
/// cache maintenance by VA must step by it or it skips lines.
fn dcache_line() -> usize {
    let ctr: u64;
    // SAFETY: reading CTR_EL0 has no side effects.
    unsafe { asm!("mrs {}, CTR_EL0", out(reg) ctr, options(nomem, nostack)) };
    4 << ((ctr >> 16) & 0xf)
}

/// Clean the data cache lines covering `[addr, addr + len)` to the point of
/// coherency, so that a CPU with its caches off reads what we wrote. The
/// point of coherency is beyond the point of unification, so this also
/// does what DC CVAU would for instruction fetches (see
/// [`invalidate_icache_all`]).
pub fn clean_dcache_range(addr: usize, len: usize) {
    let line_size = dcache_line();
    let mut line = addr & !(line_size - 1);
    while line < addr + len {
        // SAFETY: DC CVAC on a mapped address only writes back cache contents.
        unsafe { asm!("dc cvac, {}", in(reg) line, options(nostack)) };
        line += line_size;
    }
    // SAFETY: a barrier has no memory-safety effect.
    unsafe { asm!("dsb sy", options(nostack)) };
}

/// Invalidate every instruction cache to the point of unification on every
/// CPU of the inner shareable domain, then make this CPU fetch afresh. Call
/// it after code was written through the data side and cleaned
/// ([`clean_dcache_range`]), before it runs; and after frames leave a VM,
/// so that no stale instruction lines of one VM's frame reach the next.
pub fn invalidate_icache_all() {
    // SAFETY: invalidating instruction caches only drops cached copies;
    // the barriers order it after the cleaning and before later fetches.
    unsafe { asm!("dsb ish", "ic ialluis", "dsb ish", "isb", options(nostack)) };
}

/// The idle wait of a CPU with nothing to do: until an interrupt (a kick)
/// or about `micros` pass. WFI, not WFE: QEMU's TCG treats WFE as a mere
/// yield, so a CPU idling in WFE spins its host thread at 100%, while WFI
/// halts it. Whatever woke the CPU is acknowledged and ended here (the CPU
/// runs no guest that could own it). Without a GIC we drive, WFE on the
/// event stream.
pub fn idle_wait(micros: u64) {
    if !gic::present() {
        wait_for_event();
        return;
    }
    wait_for_interrupt_or(micros);
    for _ in 0..8 {
        let (intid, iar) = gic::acknowledge();
        if intid >= 1020 {
            break;
        }
        gic::end_of_interrupt(iar);
        gic::deactivate(iar);
    }
}

/// Wait for an event (WFE).
pub fn wait_for_event() {
    // SAFETY: WFE only waits.
    unsafe { asm!("wfe", options(nomem, nostack)) };
}

/// Wake this CPU from WFE about every millisecond: the physical counter's
/// event stream (CNTHCTL_EL2.EVNTEN) on bit 15 (with the counter at 25-100
/// MHz, one event per 0.3-1.3 ms). Only for CPUs that never run a guest.
pub fn enable_event_stream() {
    const EVNTEN: u64 = 1 << 2;
    const EVNTI_BIT15: u64 = 15 << 4;
    // SAFETY: the event stream only generates wake-up events.
    unsafe {
        asm!(
            "mrs {t}, CNTHCTL_EL2",
            "orr {t}, {t}, {bits}",
            "msr CNTHCTL_EL2, {t}",
            "isb",
            t = out(reg) _,
            bits = in(reg) EVNTEN | EVNTI_BIT15,
            options(nostack)
        );
    }
}

/// Sleep in WFI until an interrupt is pending or about `micros` pass (the
/// EL2 physical timer bounds the wait, so a wake-up that raced with the
/// sleep costs at most that long).
pub fn wait_for_interrupt_or(micros: u64) {
    let (_, freq) = counter();
    let ticks = (freq * micros / 1_000_000).max(1);
    // SAFETY: the EL2 timer is the hypervisor's own; WFI only waits.
    unsafe {
        asm!(
            "msr CNTHP_TVAL_EL2, {ticks}",
            "msr CNTHP_CTL_EL2, {on}",
            "isb",
            "wfi",
            "msr CNTHP_CTL_EL2, xzr",
            "isb",
            ticks = in(reg) ticks,
            on = in(reg) 1u64,
            options(nomem, nostack)
        );
    }
}

/// Stop the calling CPU for good, interrupts masked.
pub fn park() -> ! {
    // SAFETY: park_forever never returns and touches no memory.
    unsafe { entry::park_forever() }
}
