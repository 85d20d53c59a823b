//! The console: the board's console UART behind one lock, the `print!`
//! macros, and the operator shell ([`shell`]). Human-readable text only:
//! the binary trace stream goes to its own UART (see `crate::trace`).

pub mod line;
pub mod shell;

#[cfg(target_os = "none")]
mod uart_console {
    use core::fmt::{self, Write};
    use core::sync::atomic::{AtomicUsize, Ordering};

    use crate::vm::console::LiveOutput;

    use platform::uart::ConsoleUart;
    use spin::Mutex;

    static CONSOLE: Mutex<Option<ConsoleUart>> = Mutex::new(None);
    /// 1 + the id of the VM whose unfinished line is on the terminal (its
    /// console is shown live), or 0. Other output starts a new line first.
    static OPEN_LINE: AtomicUsize = AtomicUsize::new(0);

    fn close_open_line(uart: &mut ConsoleUart) {
        if OPEN_LINE.swap(0, Ordering::Relaxed) != 0 {
            let _ = uart.write_str("\n");
        }
    }

    /// Show live output of VM `id` (named `name`): the unfinished line
    /// continues where it stopped if nothing else was printed since, and is
    /// shown again whole, prefixed, if something was.
    pub fn guest_live_output(id: usize, name: &str, output: LiveOutput<'_>) {
        let mut guard = CONSOLE.lock();
        let Some(uart) = guard.as_mut() else { return };
        let ours = OPEN_LINE.load(Ordering::Relaxed) == id + 1;
        let (text, shown, complete) = match output {
            LiveOutput::Nothing => return,
            LiveOutput::Erase => {
                if ours {
                    let _ = uart.write_str("\x08");
                }
                return;
            }
            LiveOutput::Partial { text, shown } => (text, shown, false),
            LiveOutput::Line { text, shown } => (text, shown, true),
        };
        if ours {
            let _ = uart.write_str(text.get(shown..).unwrap_or(""));
        } else {
            close_open_line(uart);
            let _ = write!(uart, "[{name}] {text}");
        }
        if complete {
            let _ = uart.write_str("\n");
            OPEN_LINE.store(0, Ordering::Relaxed);
        } else {
            OPEN_LINE.store(id + 1, Ordering::Relaxed);
        }
    }

    /// Install the console UART; until then output is dropped.
    pub fn init(mut uart: ConsoleUart) {
        uart.init();
        *CONSOLE.lock() = Some(uart);
    }

    pub fn is_ready() -> bool {
        CONSOLE.lock().is_some()
    }

    pub fn write_fmt(args: fmt::Arguments) {
        if let Some(uart) = CONSOLE.lock().as_mut() {
            close_open_line(uart);
            let _ = uart.write_fmt(args);
        }
    }

    /// Print even if another CPU holds the console lock (it may have crashed
    /// holding it): used only for crash reports.
    pub fn write_fmt_forced(args: fmt::Arguments) {
        let mut guard = None;
        for _ in 0..1_000_000 {
            if let Some(g) = CONSOLE.try_lock() {
                guard = Some(g);
                break;
            }
            core::hint::spin_loop();
        }
        match guard {
            Some(mut g) => {
                if let Some(uart) = g.as_mut() {
                    let _ = uart.write_fmt(args);
                }
            }
            None => {
                // SAFETY: the holder has not released the lock for a long
                // time; a crash report matters more than interleaved output.
                unsafe { CONSOLE.force_unlock() };
                write_fmt(args);
            }
        }
    }

    pub fn try_read_byte() -> Option<u8> {
        CONSOLE.lock().as_mut().and_then(|u| u.try_get_byte())
    }
}

#[cfg(target_os = "none")]
pub use uart_console::*;

/// Host builds (unit tests) print to stdout.
#[cfg(not(target_os = "none"))]
pub fn write_fmt(args: core::fmt::Arguments) {
    extern crate std;
    std::print!("{args}");
}

#[macro_export]
macro_rules! print {
    ($($arg:tt)*) => { $crate::console::write_fmt(format_args!($($arg)*)) };
}

#[macro_export]
macro_rules! println {
    () => { $crate::print!("\n") };
    ($($arg:tt)*) => { $crate::console::write_fmt(format_args!("{}\n", format_args!($($arg)*))) };
}
