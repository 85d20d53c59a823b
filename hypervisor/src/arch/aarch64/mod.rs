//! AArch64 at EL2: boot entry, exception vectors, the EL2 MMU, CPU bring-up
//! (PSCI and spin table), PSCI calls and small system-register helpers.
//!
//! System registers are read and written through aarch64-cpu's
//! `registers::*` (and [`sysreg`] for those it lacks), fields by name.
//! WFI, WFE and SEV are its `asm::*` helpers. Instructions it has no
//! helper for (cache and TLB maintenance) are small functions with their
//! own `asm!` here and in [`vcpu`]; the
//! entry, vector, world-switch and recovery code stays in `global_asm!`
//! because it runs without a Rust stack or with the guest's registers live.

pub mod entry;
pub mod exceptions;
pub mod gic;
pub mod gic_v3;
pub mod mmu;
pub mod pmu;
pub mod psci;
pub mod recovery;
pub mod smp;
pub mod sysreg;
pub mod vcpu;

use core::arch::asm;
use core::sync::atomic::{AtomicU32, Ordering};

use aarch64_cpu::asm::barrier;
use aarch64_cpu::registers::{
    Readable, Writeable, CNTFRQ_EL0, CNTHCTL_EL2, CNTHP_CTL_EL2, CNTPCT_EL0, MPIDR_EL1, TPIDR_EL2,
};

use sysreg::{
    CNTHCTL_EL2_EVENT_STREAM, CNTHP_CVAL_EL2, CNTHP_TVAL_EL2, CTR_EL0, DCZID_EL0, ISR_EL1,
};

pub use platform::MAX_CPUS;

/// Bytes of stack per CPU.
pub const STACK_SIZE: usize = 64 * 1024;

/// The logical index of the calling CPU (kept in TPIDR_EL2 since boot).
pub fn cpu_index() -> usize {
    TPIDR_EL2.get() as usize
}

/// MPIDR_EL1 affinity fields (Aff3..Aff0), as device trees write them.
/// This CPU's MIDR_EL1 (implementer, part, variant, revision).
pub fn midr() -> u64 {
    aarch64_cpu::registers::MIDR_EL1.get()
}

pub fn mpidr() -> u64 {
    use aarch64_cpu::registers::MPIDR_EL1::{Aff0, Aff1, Aff2, Aff3};
    let v = MPIDR_EL1.extract();
    (v.read(Aff3) << 32) | (v.read(Aff2) << 16) | (v.read(Aff1) << 8) | v.read(Aff0)
}

/// The physical counter (CNTPCT_EL0) and its frequency in Hz.
pub fn counter() -> (u64, u64) {
    // The ISB keeps the counter read from happening early.
    barrier::isb(barrier::SY);
    (CNTPCT_EL0.get(), CNTFRQ_EL0.get())
}

/// The counter's frequency in Hz, without reading the counter (under
/// QEMU a counter read takes the global lock; the frequency is a plain
/// register).
pub fn counter_frequency() -> u64 {
    CNTFRQ_EL0.get()
}

/// Microseconds since the counter started (board power-on).
pub fn uptime_us() -> u64 {
    let (count, freq) = counter();
    crate::hw::timer::ticks_to_us(count, freq)
}

/// Zero the 4 KiB frame at `pa` (identity-mapped normal memory) with
/// `DC ZVA`, one cache-line-sized block per instruction (64 per frame on a
/// Cortex-A72), instead of 256 16-byte stores; plain stores where DCZID_EL0
/// prohibits it. The caller cleans the frame to the point of coherency if a
/// non-cacheable reader may see it.
pub fn zero_frame(pa: usize) {
    let start = pa & !(FRAME - 1);
    match zva_block() {
        // SAFETY: DC ZVA zeroes `block` bytes of the caller's frame at a
        // time (`block` divides the frame size), identity-mapped normal memory.
        Some(block) => unsafe { frame_lines!(start, block, "dc zva, {p}") },
        // SAFETY: the caller's frame, identity-mapped and writable.
        None => unsafe { core::ptr::write_bytes(start as *mut u8, 0, FRAME) },
    }
}

const FRAME: usize = 4096;

/// The largest line [`frame_lines`] steps by: eight of them fill a frame.
const MAX_LINE: usize = FRAME / 8;

/// The block `DC ZVA` zeroes, if it is allowed and at most [`MAX_LINE`]
/// (the architecture allows up to 2 KiB; cores have 64 or 128 bytes).
fn zva_block() -> Option<usize> {
    let dczid = DCZID_EL0.extract();
    let block = 4usize << dczid.read(DCZID_EL0::BS);
    (!dczid.is_set(DCZID_EL0::DZP) && block <= MAX_LINE).then_some(block)
}

/// Run the cache instruction(s) `op` (with `{p}` the line's address) on
/// every `step` bytes of the 4 KiB frame at `start`, as one assembly loop
/// eight lines a turn (a frame is 64 lines of 64 bytes on a Cortex-A72):
/// about one instruction a line beside the maintenance itself, where a
/// Rust loop with its overflow checks took three. `step` must be a power
/// of two of at most [`MAX_LINE`], so that eight lines divide the frame.
macro_rules! frame_lines {
    ($start:expr, $step:expr, $op:literal) => {{
        let (start, step): (usize, usize) = ($start, $step);
        let end = start + FRAME;
        debug_assert!(step.is_power_of_two() && step <= MAX_LINE);
        asm!(
            "2:",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            $op, "add {p}, {p}, {step}",
            "cmp {p}, {end}",
            "b.lo 2b",
            p = inout(reg) start => _,
            step = in(reg) step,
            end = in(reg) end,
            options(nostack),
        );
    }};
}
use frame_lines;

/// Zero the 4 KiB frame at `pa` (see [`zero_frame`]) and clean it to the
/// point of coherency (see [`clean_dcache_range`]): a frame about to be
/// handed to a guest, which may read it with its caches off. Where the
/// `DC ZVA` block is the cache line (a Cortex-A72: both 64 bytes), each
/// line is zeroed and cleaned in one pass: a cache maintenance instruction
/// by address is ordered after the stores to that address before it in
/// program order, and `DC ZVA` counts as such a store.
pub fn zero_and_clean_frame(pa: usize) {
    zero_and_clean_frames(core::iter::once(pa));
}

/// [`zero_and_clean_frame`] for each frame of `frames`: the cache geometry
/// read once, and one barrier after the last frame (a batch a stage-2
/// fault backs: fault-around).
pub fn zero_and_clean_frames(frames: impl Iterator<Item = usize>) {
    let line = dcache_line();
    let zva = zva_block();
    for pa in frames {
        let start = pa & !(FRAME - 1);
        match zva {
            // SAFETY: as in `zero_frame`; DC CVAC only writes back cache
            // contents of the same frame.
            Some(block) if block == line => unsafe {
                frame_lines!(start, line, "dc zva, {p}\n dc cvac, {p}")
            },
            _ => {
                zero_frame(start);
                if line > MAX_LINE {
                    clean_dcache_range(start, FRAME);
                    continue;
                }
                // SAFETY: DC CVAC on a mapped address only writes back cache contents.
                unsafe { frame_lines!(start, line, "dc cvac, {p}") }
            }
        }
    }
    barrier::dsb(barrier::SY);
}

/// The smallest data cache line of this CPU, in bytes (CTR_EL0.DminLine):
/// cache maintenance by VA must step by it or it skips lines.
fn dcache_line() -> usize {
    4 << CTR_EL0.read(CTR_EL0::DminLine)
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
    barrier::dsb(barrier::SY);
}

/// Invalidate every instruction cache to the point of unification on every
/// CPU of the inner shareable domain, then make this CPU fetch afresh. Call
/// it after code was written through the data side and cleaned
/// ([`clean_dcache_range`]), before it runs; and before frames that left
/// a VM are mapped into another (when the frame table reports them stale),
/// so that no stale instruction lines of one VM's frame reach the next.
pub fn invalidate_icache_all() {
    // SAFETY: invalidating instruction caches only drops cached copies;
    // the barriers order it after the cleaning and before later fetches.
    unsafe { asm!("dsb ish", "ic ialluis", "dsb ish", "isb", options(nostack)) };
}

/// The MMIO register block (a tock-registers `register_structs!` type) at
/// `addr`.
///
/// # Safety
///
/// `addr` must be the base of a `T` block that the EL2 identity map maps
/// as device memory for the rest of the hypervisor's life.
pub unsafe fn mmio_block<T>(addr: u64) -> &'static T {
    // SAFETY: forwarded to our caller; the registers are only accessed
    // through volatile reads and writes of their own width.
    unsafe { &*(addr as *const T) }
}

/// Invalidate every EL2 TLB entry of this CPU and wait for it to finish
/// (after the EL2 translation tables changed).
pub fn invalidate_el2_tlb() {
    // SAFETY: dropping TLB entries only makes the next walks read the
    // tables; the barriers order it before later accesses.
    unsafe { asm!("tlbi alle2", "dsb ish", "isb", options(nostack)) };
}

/// Whether an IRQ or FIQ is pending at this CPU (masked at EL2 or not):
/// work that fills idle time stops for it.
#[inline]
pub fn interrupt_pending() -> bool {
    let isr = ISR_EL1.extract();
    isr.is_set(ISR_EL1::I) || isr.is_set(ISR_EL1::F)
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
    aarch64_cpu::asm::wfe();
}

/// Signal an event to every CPU (SEV): wakes those waiting in WFE.
pub fn send_event() {
    aarch64_cpu::asm::sev();
}

/// Wake this CPU from WFE about every millisecond: the physical counter's
/// event stream (CNTHCTL_EL2.EVNTEN) on bit 15 (with the counter at 25-100
/// MHz, one event per 0.3-1.3 ms). Only for CPUs that never run a guest.
pub fn enable_event_stream() {
    use CNTHCTL_EL2_EVENT_STREAM::{EVNTEN, EVNTI};
    let event_stream = EVNTEN::SET + EVNTI.val(15);
    CNTHCTL_EL2.set(event_stream.modify(CNTHCTL_EL2.get()));
    barrier::isb(barrier::SY);
}

/// Sleep in WFI until an interrupt is pending or about `micros` pass (the
/// EL2 physical timer bounds the wait, so a wake-up that raced with the
/// sleep costs at most that long). A deadline the timer already held (the
/// shell's next look, on its CPU) ends the sleep if it comes first and is
/// armed again after it: a lock nap or an idle wait never loses it.
pub fn wait_for_interrupt_or(micros: u64) {
    let held = CNTHP_CTL_EL2
        .is_set(CNTHP_CTL_EL2::ENABLE)
        .then(|| CNTHP_CVAL_EL2.get());
    match held {
        None => arm_el2_timer(crate::hw::timer::us_to_ticks(micros, counter_frequency())),
        Some(deadline) => {
            let (now, freq) = counter();
            let nap_end = now.saturating_add(crate::hw::timer::us_to_ticks(micros, freq));
            CNTHP_CVAL_EL2.set(nap_end.min(deadline));
            barrier::isb(barrier::SY);
        }
    }
    wait_for_interrupt();
    match held {
        None => disarm_el2_timer(),
        Some(deadline) => {
            // Still enabled: only the compare value changed.
            CNTHP_CVAL_EL2.set(deadline);
            barrier::isb(barrier::SY);
        }
    }
}

/// Make the EL2 timer (the hypervisor's own) interrupt this CPU in `ticks`
/// counter ticks: it ends a WFI at EL2, and while a guest runs it is an
/// exit. Its line stays asserted until the timer is armed again or
/// disarmed.
pub fn arm_el2_timer(ticks: u64) {
    CNTHP_TVAL_EL2.set(ticks);
    CNTHP_CTL_EL2.write(CNTHP_CTL_EL2::ENABLE::SET);
    barrier::isb(barrier::SY);
}

pub fn disarm_el2_timer() {
    CNTHP_CTL_EL2.set(0);
    barrier::isb(barrier::SY);
}

/// How a CPU waits for a VM's lock: it spins, and every
/// [`SPINS_PER_NAP`]th turn sleeps in WFI for [`NAP_US`] instead. On a board
/// a holder keeps the lock for microseconds and the spin takes it. Under
/// QEMU each emulated CPU is a host thread: a holder its host preempted
/// keeps the lock for a host time slice (milliseconds), and a waiter that
/// only spins keeps one of the host's cores from it meanwhile; WFI halts the
/// waiter's thread (QEMU treats WFE as a no-op), which gives the core back.
///
/// A nap costs far more than its [`NAP_US`] under QEMU: the thread sleeps
/// and is woken by QEMU's timer thread, two host context switches or more.
/// So it comes only after a wait longer than the lock's usual holds: a
/// VM's exits take its lock often enough that with 64 turns between naps
/// a Linux guest's vCPUs napped 111 times per agent request (12,306 times
/// in its boot); with 1,024, 6 times (1,052 in the boot).
pub struct SpinThenNap;

/// Turns of [`SpinThenNap`] between two naps.
const SPINS_PER_NAP: u32 = 1024;
/// A nap of [`SpinThenNap`], in microseconds.
const NAP_US: u64 = 20;

/// [`SpinThenNap`]'s turns, per CPU (never reset: the first nap of a
/// wait comes within [`SPINS_PER_NAP`] turns).
static SPINS: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];

impl spin::RelaxStrategy for SpinThenNap {
    fn relax() {
        let turn = SPINS[cpu_index()].fetch_add(1, Ordering::Relaxed);
        // Without a GIC we drive, the EL2 timer might not wake WFI.
        if turn % SPINS_PER_NAP == SPINS_PER_NAP - 1 && gic::present() {
            wait_for_interrupt_or(NAP_US);
        } else {
            core::hint::spin_loop();
        }
    }
}

/// Wait for an interrupt (WFI).
fn wait_for_interrupt() {
    aarch64_cpu::asm::wfi();
}

/// Stop the calling CPU for good, interrupts masked.
pub fn park() -> ! {
    // SAFETY: park_forever never returns and touches no memory.
    unsafe { entry::park_forever() }
}
