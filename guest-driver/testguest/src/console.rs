//! The PL011 console: polled, transmit only.
//!
//! Every register access is one 32-bit `ldr`/`str` with a plain base register,
//! so that a hypervisor trapping the access gets a valid syndrome (ISV set).

use core::fmt::{self, Write};
use core::sync::atomic::{AtomicUsize, Ordering};

/// UARTDR: data register.
const DR: usize = 0x00;
/// UARTFR: flag register.
const FR: usize = 0x18;
/// FR.TXFF: transmit FIFO full.
const FR_TXFF: u32 = 1 << 5;

/// The PL011's base address: QEMU virt's and the Tidal board's until the
/// device tree says otherwise.
static BASE: AtomicUsize = AtomicUsize::new(0x0900_0000);

/// Uses the PL011 at `base` from now on.
pub fn init(base: usize) {
    BASE.store(base, Ordering::Relaxed);
}

fn putc(byte: u8) {
    let base = BASE.load(Ordering::Relaxed);
    // SAFETY: `base` is the PL011 from the device tree (or the board's fixed
    // one), mapped as device memory by the boot page table.
    unsafe {
        while crate::arch::mmio_read32(base + FR) & FR_TXFF != 0 {}
        crate::arch::mmio_write32(base + DR, u32::from(byte));
    }
}

/// Writes text to the console, turning `\n` into `\r\n`.
pub struct Console;

impl Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            if b == b'\n' {
                putc(b'\r');
            }
            putc(b);
        }
        Ok(())
    }
}

/// Prints one line starting with `testguest: `.
pub fn print_line(args: fmt::Arguments) {
    let _ = Console.write_fmt(format_args!("testguest: {args}\n"));
}

/// `println!` for the test guest: one line, prefixed with `testguest: `.
macro_rules! println {
    ($($arg:tt)*) => {
        $crate::console::print_line(format_args!($($arg)*))
    };
}
