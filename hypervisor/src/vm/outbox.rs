//! Console text a VM's path produces while its lock is held: kept here and
//! printed by whoever took the lock once it is released (`crate::run`), so no
//! CPU writes to the UART while other CPUs wait for that VM.

extern crate alloc;

use alloc::collections::VecDeque;
use alloc::string::String;
use core::fmt::{self, Write as _};

use super::console_line::{LiveOutput, LINE_MAX};

/// Longest line kept (a guest line of up to [`LINE_MAX`] characters with
/// its `[name] ` prefix, or a hypervisor message); longer ones are cut with
/// a `...`.
pub const NOTICE_MAX: usize = LINE_MAX + 64;
/// Notices kept between two drains (one exit, or one shell command): a
/// virtio console's write of a page can end dozens of lines in one exit.
/// They are on the heap, so a drain moves a pointer, not the notices.
pub const CAPACITY: usize = 96;

/// One thing to show on the console. The text is on the heap, as long as
/// it is: a short line costs a short allocation, and moving the box out to
/// print it copies no text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A whole line (without its newline).
    Line(String),
    /// Output of the VM whose console has the keyboard, shown as it comes
    /// (see [`LiveOutput`]).
    Live {
        text: String,
        shown: usize,
        complete: bool,
    },
    /// The last character shown live was erased.
    Erase,
}

impl Notice {
    /// The live output this notice carries, for the console.
    pub fn live(&self) -> Option<LiveOutput<'_>> {
        match self {
            Notice::Line(_) => None,
            Notice::Live {
                text,
                shown,
                complete: false,
            } => Some(LiveOutput::Partial {
                text,
                shown: *shown,
            }),
            Notice::Live { text, shown, .. } => Some(LiveOutput::Line {
                text,
                shown: *shown,
            }),
            Notice::Erase => Some(LiveOutput::Erase),
        }
    }
}

/// The notices waiting to be printed, oldest first.
#[derive(Default)]
pub struct Outbox {
    notices: VecDeque<Notice>,
    /// Notices dropped because the box was full or the heap was (said by
    /// the next drain).
    dropped: u64,
}

impl Outbox {
    pub const fn new() -> Self {
        Self {
            notices: VecDeque::new(),
            dropped: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.notices.is_empty() && self.dropped == 0
    }

    /// Keep a line (`format_args!`), cut to [`NOTICE_MAX`] bytes.
    pub fn line(&mut self, args: fmt::Arguments<'_>) {
        if self.is_full() {
            self.dropped += 1;
            return;
        }
        let mut line = Cut::default();
        if line.write_fmt(args).is_err() {
            // The heap had no room for it.
            self.dropped += 1;
            return;
        }
        let Cut { mut text, cut } = line;
        if cut {
            while text.len() + 3 > NOTICE_MAX {
                text.pop();
            }
            text.push_str("...");
        }
        self.push(Notice::Line(text));
    }

    /// Keep what a live console shows after a byte.
    pub fn live(&mut self, output: LiveOutput<'_>) {
        let (text, shown, complete) = match output {
            LiveOutput::Nothing => return,
            LiveOutput::Erase => return self.push(Notice::Erase),
            LiveOutput::Partial { text, shown } => (text, shown, false),
            LiveOutput::Line { text, shown } => (text, shown, true),
        };
        let mut kept = String::new();
        if self.is_full() || kept.try_reserve_exact(text.len()).is_err() {
            self.dropped += 1;
            return;
        }
        kept.push_str(text);
        self.push(Notice::Live {
            text: kept,
            shown,
            complete,
        });
    }

    fn push(&mut self, notice: Notice) {
        if self.is_full() || self.notices.try_reserve(1).is_err() {
            self.dropped += 1;
            return;
        }
        self.notices.push_back(notice);
    }

    fn is_full(&self) -> bool {
        self.notices.len() >= CAPACITY
    }

    /// Take everything kept (the box is empty after), and how many notices
    /// did not fit.
    pub fn take(&mut self) -> (VecDeque<Notice>, u64) {
        let dropped = core::mem::take(&mut self.dropped);
        (core::mem::take(&mut self.notices), dropped)
    }
}

/// A `fmt::Write` into a heap string of at most [`NOTICE_MAX`] bytes that
/// notes when it had to cut; an allocation failure is an error.
#[derive(Default)]
struct Cut {
    text: String,
    cut: bool,
}

impl fmt::Write for Cut {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = NOTICE_MAX - self.text.len();
        let mut end = s.len().min(room);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        if end < s.len() {
            self.cut = true;
        }
        self.text.try_reserve(end).map_err(|_| fmt::Error)?;
        self.text.push_str(&s[..end]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_kept_in_order_and_cut_when_long() {
        let mut out = Outbox::new();
        out.line(format_args!("one {}", 1));
        out.line(format_args!("{}", "x".repeat(NOTICE_MAX + 100)));
        let (notices, dropped) = out.take();
        assert_eq!(dropped, 0);
        let lines: Vec<_> = notices
            .iter()
            .map(|n| match n {
                Notice::Line(l) => l.clone(),
                _ => panic!("not a line"),
            })
            .collect();
        assert_eq!(lines[0], "one 1");
        assert_eq!(lines[1].len(), NOTICE_MAX);
        assert!(lines[1].ends_with("..."));
        assert!(out.is_empty());
    }

    #[test]
    fn a_full_box_counts_what_it_drops() {
        let mut out = Outbox::new();
        for i in 0..CAPACITY + 5 {
            out.line(format_args!("{i}"));
        }
        let (notices, dropped) = out.take();
        assert_eq!(notices.len(), CAPACITY);
        assert_eq!(dropped, 5);
    }

    #[test]
    fn live_output_round_trips() {
        let mut out = Outbox::new();
        out.live(LiveOutput::Partial {
            text: "/ # ls",
            shown: 4,
        });
        out.live(LiveOutput::Nothing);
        out.live(LiveOutput::Erase);
        let (notices, _) = out.take();
        let notices: Vec<_> = notices.iter().cloned().collect();
        assert_eq!(notices.len(), 2);
        assert_eq!(
            notices[0].live(),
            Some(LiveOutput::Partial {
                text: "/ # ls",
                shown: 4
            })
        );
        assert_eq!(notices[1].live(), Some(LiveOutput::Erase));
    }
}
