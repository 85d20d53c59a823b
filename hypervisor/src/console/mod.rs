//! The console: the board's console UART behind one lock, the `print!`
//! macros, and the operator shell ([`shell`]). Human-readable text only:
//! the binary trace stream goes to its own UART (see `crate::trace`).

pub mod board;
pub mod commands;
pub mod line;
pub mod shell;
pub mod snapshot_cmds;
pub mod terminal;

#[cfg(target_os = "none")]
mod uart_console {
    use core::fmt::{self, Write};

    use super::terminal::Terminal;
    use crate::vm::console_line::LiveOutput;

    use crate::arch::aarch64::SpinThenNap;
    use crate::held::{self, Tracked};
    use platform::uart::ConsoleUart;
    use spin::mutex::{SpinMutex, SpinMutexGuard};
    use spin::{Mutex, MutexGuard};

    /// Every CPU prints, the shell reads input here: a waiter naps rather
    /// than keep a host core from a preempted holder under QEMU (see
    /// [`SpinThenNap`]).
    static CONSOLE: SpinMutex<Option<ConsoleUart>, SpinThenNap> = SpinMutex::new(None);

    /// The console UART, locked and marked held by this CPU (`crate::held`).
    fn console() -> Tracked<SpinMutexGuard<'static, Option<ConsoleUart>, SpinThenNap>> {
        Tracked::new(CONSOLE.lock(), held::CONSOLE)
    }

    /// The open line; take it only under [`console`].
    fn open_line() -> Tracked<MutexGuard<'static, Terminal>> {
        Tracked::new(OPEN_LINE.lock(), held::OPEN_LINE)
    }

    /// Release the console locks in `held` (the calling CPU's, per
    /// `crate::held`) after a failure abandoned their guards.
    ///
    /// # Safety
    ///
    /// Only for locks this CPU holds and whose guards will never be used.
    pub unsafe fn release_held(held: u32) {
        if held & held::OPEN_LINE != 0 {
            // SAFETY: this CPU holds it (the caller's contract).
            unsafe { OPEN_LINE.force_unlock() };
        }
        if held & held::CONSOLE != 0 {
            // SAFETY: as above.
            unsafe { CONSOLE.force_unlock() };
        }
    }
    /// What the terminal shows at its bottom line (see [`Terminal`]).
    /// Locked only while holding `CONSOLE`.
    static OPEN_LINE: Mutex<Terminal> = Mutex::new(Terminal::new());

    /// The shell's line (prompt and what is typed) is now `text`; `None`:
    /// the line is finished (see [`Terminal::shell_line`]).
    pub fn shell_line(text: Option<&str>) {
        let mut guard = console();
        let Some(uart) = guard.as_mut() else { return };
        open_line().shell_line(uart, text);
    }

    /// Ring the terminal's bell (the shell refused a character).
    pub fn bell() {
        if let Some(uart) = console().as_mut() {
            let _ = uart.write_str("\x07");
        }
    }

    /// Show live output of VM `id` (named `name`) at the bottom of the
    /// terminal (see [`Terminal::guest_live`]). `still_live` is asked under
    /// the console lock: a VM that lost the keyboard meanwhile
    /// ([`end_live_output`]) gets complete lines only.
    pub fn guest_live_output(
        id: usize,
        name: &str,
        output: LiveOutput<'_>,
        still_live: impl FnOnce() -> bool,
    ) {
        let mut guard = console();
        let Some(uart) = guard.as_mut() else { return };
        let mut open = open_line();
        open.guest_live(uart, id, name, output, still_live());
    }

    /// The live console loses the keyboard: its unfinished line stays on
    /// the terminal as it is and later output starts below it.
    ///
    /// Call it after the keyboard's owner changed, so that output racing
    /// with the change sees the new owner (see [`guest_live_output`]).
    pub fn end_live_output() {
        let mut guard = console();
        let Some(uart) = guard.as_mut() else { return };
        open_line().end_live(uart);
    }

    /// Install the console UART; until then output is dropped.
    pub fn init(mut uart: ConsoleUart) {
        uart.init();
        *console() = Some(uart);
    }

    pub fn is_ready() -> bool {
        console().is_some()
    }

    /// Print whole lines above the open line (see [`Terminal::lines`]).
    pub fn write_fmt(args: fmt::Arguments) {
        if let Some(uart) = console().as_mut() {
            open_line().lines(uart, args);
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
        console().as_mut().and_then(|u| u.try_get_byte())
    }

    /// Turns the console UART's receive interrupt on; false without one.
    pub fn enable_rx_interrupt() -> bool {
        console()
            .as_mut()
            .map(|u| u.enable_rx_interrupt())
            .is_some()
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
