//! Trace events: compact defmt frames sent to the trace UART when the board
//! has one (see `platform::BoardInfo::trace_uart`), dropped otherwise; never
//! mixed into the console. The host decodes them with the ELF (`cargo xtask
//! run` and `cargo xtask trace` write them to `target/trace-<board>.log`; the
//! tests read them).
//!
//! Only the target has a defmt logger, so only target-only code may call the
//! defmt macros itself. Portable code (tested on the host) traces through
//! `trace_event!`, which is `defmt::trace!` on the target in a build with
//! the `trace` feature, and nothing otherwise (its arguments are still type
//! checked, inside an `if false`, and never evaluated).
//!
//! # Levels
//!
//! - `info` and `debug`, at boot (target code, `crate::boot`): the trace
//!   starting, the memory map, each CPU coming online, each shell command.
//!   The normal build (`cargo xtask build`, `DEFMT_LOG=debug`) has them.
//! - `trace`, on the hot paths: the events below. They exist only in the
//!   trace build (`cargo xtask trace`: the `trace` feature and
//!   `DEFMT_LOG=trace`, in `target/trace-build/`); the normal build has no
//!   code for them at all, so it runs exactly as fast as without them.
//!
//! # Hot-path events (level `trace`)
//!
//! Each message starts with its name; `vm` is the VM's index in the bundle.
//!
//! - `exit vm vcpu KIND pc`: a vCPU left its guest ([`crate::vm::handle`],
//!   before the exit is handled). KIND is [`crate::vm::exit::ExitKind`], as
//!   handled: a load or store to a RAM page without a frame, which the
//!   syndrome describes as MMIO, is an `Abort`. pc is the guest's ELR_EL2.
//! - `mmio vm read|write ipa width device = value`: a device register
//!   access emulated ([`crate::vm::handle`], once the device accepted it:
//!   refused accesses are bad accesses, seen as their exit only). device is
//!   the [`crate::vm::fault::Device`] the address falls in; value is what
//!   the guest read or wrote.
//! - `inflate vm pages pfns first..=last runs released`: one inflate
//!   request applied ([`crate::vm::bus`], the balloon backend): the pages
//!   accepted, the lowest and highest PFN, how many runs of consecutive
//!   PFNs, how many frames went back to the pool (pages already given back
//!   by reporting or hinting have none).
//! - `deflate vm pages pfns first..=last runs released`: one deflate
//!   request (or a batch of a device reset's deflate); released is 0:
//!   nothing is mapped until the guest touches a page (see `fault-in`).
//! - `report vm blocks pages released`: one free page report applied.
//! - `hint vm blocks pages released`: one buffer of hinted blocks applied.
//! - `fault-in vm ipa fresh fill`: a stage-2 translation fault on RAM
//!   backed ([`crate::vm::handle`]): fresh is true when a new frame was
//!   mapped (false: the page had been backed meanwhile, e.g. by another
//!   vCPU); the frame is zeroed, then filled with fill when not 0 (the
//!   guest's poison value).
//! - `tlb flush vm vmid pages`: one TLB invalidation after unmapping a
//!   batch of pages ([`crate::vm::memory`]); its scope is always the whole
//!   VMID (TLBI VMALLS12E1IS), pages says how many were unmapped.

/// A `trace`-level event of a hot path: `defmt::trace!` in the trace build
/// on the target, nothing otherwise (see the module doc). Takes a defmt
/// format string and its arguments.
#[cfg(all(target_os = "none", feature = "trace"))]
macro_rules! trace_event {
    ($fmt:literal $(, $arg:expr)* $(,)?) => {
        defmt::trace!($fmt $(, $arg)*)
    };
}

/// A `trace`-level event of a hot path; this build has none: the arguments
/// are type checked but never evaluated (see the module doc).
#[cfg(not(all(target_os = "none", feature = "trace")))]
macro_rules! trace_event {
    ($fmt:literal $(, $arg:expr)* $(,)?) => {
        if false {
            let _: &str = $fmt;
            $(let _ = &$arg;)*
        }
    };
}

pub(crate) use trace_event;

/// How many runs of consecutive values `pfns` (ascending) holds: what an
/// inflate or deflate event says about a request's shape.
pub fn runs(pfns: &[crate::addr::GuestPfn]) -> usize {
    let breaks = pfns.windows(2).filter(|w| w[1] != w[0] + 1).count();
    if pfns.is_empty() {
        0
    } else {
        breaks + 1
    }
}

#[cfg(target_os = "none")]
mod logger {
    use core::ptr::addr_of_mut;
    use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use platform::uart::Pl011;

    /// Base address of the trace PL011, 0 while there is none.
    static TRACE_UART: AtomicUsize = AtomicUsize::new(0);
    static TAKEN: AtomicBool = AtomicBool::new(false);
    static mut ENCODER: defmt::Encoder = defmt::Encoder::new();

    /// Send trace frames to the PL011 at `base` from now on.
    ///
    /// # Safety
    /// `base` must be a mapped PL011 used for nothing else.
    pub unsafe fn init(base: usize) {
        // SAFETY: the caller guarantees the PL011 at `base` is ours.
        unsafe { Pl011::new(base) }.init();
        TRACE_UART.store(base, Ordering::Release);
    }

    fn emit(bytes: &[u8]) {
        let base = TRACE_UART.load(Ordering::Acquire);
        if base == 0 {
            return;
        }
        // SAFETY: `init` was given this PL011 for the trace alone, and the
        // TAKEN flag serialises the writers.
        let mut uart = unsafe { Pl011::new(base) };
        for &b in bytes {
            uart.put_byte(b);
        }
    }

    #[defmt::global_logger]
    struct Logger;

    // SAFETY: acquire/release bracket every frame and TAKEN makes them
    // exclusive across CPUs; interrupts are masked at EL2, so no handler on
    // this CPU can re-enter.
    unsafe impl defmt::Logger for Logger {
        fn acquire() {
            while TAKEN.swap(true, Ordering::Acquire) {
                core::hint::spin_loop();
            }
            // SAFETY: we hold TAKEN, so we are the encoder's only user.
            unsafe { (*addr_of_mut!(ENCODER)).start_frame(emit) };
        }

        unsafe fn flush() {}

        unsafe fn release() {
            // SAFETY: the caller holds TAKEN (acquire was called).
            unsafe { (*addr_of_mut!(ENCODER)).end_frame(emit) };
            TAKEN.store(false, Ordering::Release);
        }

        unsafe fn write(bytes: &[u8]) {
            // SAFETY: the caller holds TAKEN (acquire was called).
            unsafe { (*addr_of_mut!(ENCODER)).write(bytes, emit) };
        }
    }

    defmt::timestamp!("{=u64:us}", crate::arch::aarch64::uptime_us());
}

#[cfg(target_os = "none")]
pub use logger::init;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_consecutive_pfns() {
        let pfns = |raw: &[u64]| -> Vec<crate::addr::GuestPfn> {
            raw.iter().map(|&p| crate::addr::GuestPfn::new(p)).collect()
        };
        assert_eq!(runs(&pfns(&[])), 0);
        assert_eq!(runs(&pfns(&[7])), 1);
        assert_eq!(runs(&pfns(&[7, 8, 9])), 1);
        assert_eq!(runs(&pfns(&[7, 8, 10, 11, 20])), 3);
    }

    #[test]
    fn events_compile_to_nothing_on_the_host() {
        let mut evaluated = false;
        let mut touch = || {
            evaluated = true;
            1u32
        };
        trace_event!("x {=u32}", touch());
        assert!(!evaluated, "an event's arguments are never evaluated here");
    }
}
