//! Trace events: compact defmt frames sent to the trace UART when the board
//! has one (see `platform::BoardInfo::trace_uart`), dropped otherwise; never
//! mixed into the console. The host decodes them with the ELF (`cargo xtask
//! run` writes them to `target/trace-<board>.log`; the tests read them).
//!
//! Only the target has a defmt logger, so only target-only code may log.

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
