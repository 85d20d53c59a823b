//! A guest's console output on the shared terminal (`vm/console_line.rs`
//! `ConsoleLine`, `console/terminal.rs` `Terminal`): two guests print any
//! bytes, a byte at a time (the PL011) or a write at a time (the virtio
//! console), line by line or live (the one with the keyboard), take and
//! lose the keyboard, stop (flush); the shell redraws its prompt between
//! them. Everything written goes to a VT100 model (newline, carriage
//! return, backspace, erase-line).
//!
//! Invariants: what a guest's line holds has no control byte but tab, no
//! non-ASCII, at most `LINE_MAX` characters (plus the caret pair or `^M`
//! that may end a line-mode line: `LINE_MAX + 3`); the bytes written to
//! the terminal have no control byte but newline and tab besides the
//! terminal's own erase-line and backspace-space-backspace; on the screen,
//! every line starts with `[a] `, `[b] ` or the shell's prompt, so no line
//! a guest prints starts with `tidal:`, and the cursor is never inside a
//! guest's `[name] ` prefix (an erase cannot eat it).
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::console::terminal::{Terminal, ERASE_LINE};
use hypervisor::vm::console_line::{ConsoleLine, LiveOutput, LINE_MAX};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 2] = ["a", "b"];
/// What starts each guest's lines on the screen.
const PREFIXES: [&str; 2] = ["[a] ", "[b] "];
const PROMPT: &str = "tidal> ";
/// Longest line-mode line: a line is cut once it reaches `LINE_MAX`, and
/// the byte that reaches it may add up to four (a held `^M`, then a caret
/// pair).
const LINE_LONGEST: usize = LINE_MAX + 3;

#[derive(Arbitrary, Debug)]
enum Op {
    /// Guest `vm` prints one byte (PL011).
    Byte { vm: bool, byte: u8 },
    /// Guest `vm` writes these bytes at once (virtio console).
    Write { vm: bool, bytes: Vec<u8> },
    /// Guest `vm` prints one byte through the live fast path (an `Echo`).
    Echo { vm: bool, byte: u8 },
    /// Repeat a byte many times (long lines).
    Run { vm: bool, byte: u8, count: u16 },
    /// The keyboard goes to guest `vm`, or back to the shell.
    Focus(Option<bool>),
    /// Guest `vm` stops: what it printed without a newline is flushed.
    Flush { vm: bool },
    /// The shell's line becomes the prompt and this typed text (printable).
    Shell(Vec<u8>),
    /// Enter in the shell.
    Enter,
}

struct Guest {
    line: ConsoleLine,
}

fn check_text(text: &str, max: usize) {
    assert!(text.len() <= max, "line of {} chars", text.len());
    for b in text.bytes() {
        assert!(
            b == b'\t' || (0x20..0x7f).contains(&b),
            "byte {b:#x} in a guest's line {text:?}"
        );
    }
}

/// A live line's bytes are checked as they are handed out: a partial
/// line's first `shown` bytes passed here before, so only the rest is
/// read (a line typed a byte at a time is then checked in linear time,
/// not quadratic); a complete line is checked whole, once.
fn check_live(output: &LiveOutput<'_>) {
    match *output {
        LiveOutput::Partial { text, shown } => {
            assert!(text.len() <= LINE_MAX, "line of {} chars", text.len());
            assert!(shown <= text.len(), "shown {shown} of {}", text.len());
            check_text(&text[shown..], LINE_MAX);
        }
        LiveOutput::Line { text, shown } => {
            check_text(text, LINE_MAX);
            assert!(shown <= text.len(), "shown {shown} of {}", text.len());
        }
        LiveOutput::Nothing | LiveOutput::Erase => {}
    }
}

/// A VT100 as far as the terminal drives it.
struct Screen {
    lines: Vec<Vec<u8>>,
    col: usize,
}

impl Screen {
    fn feed(&mut self, out: &str) {
        let mut rest = out.as_bytes();
        let erase_line = ERASE_LINE.as_bytes();
        while let Some(&c) = rest.first() {
            // Only a carriage return (erase-line) or a backspace starts a
            // sequence: the prefix compares, which the fuzzer traces as
            // memcmp, run for those bytes alone.
            if c != erase_line[0] && c != 0x08 {
                rest = &rest[1..];
                self.put(c);
                continue;
            }
            if let Some(after) = rest.strip_prefix(erase_line) {
                self.lines.last_mut().unwrap().clear();
                self.col = 0;
                rest = after;
                continue;
            }
            if let Some(after) = rest.strip_prefix(b"\x08 \x08") {
                assert!(self.col > 0, "backspace at the start of a line");
                self.col -= 1;
                let line = self.lines.last_mut().unwrap();
                if self.col < line.len() {
                    line[self.col] = b' ';
                }
                rest = after;
                continue;
            }
            rest = &rest[1..];
            self.put(c);
        }
        // Whole lines scrolled off are checked once.
        while self.lines.len() > 1 {
            let line = self.lines.remove(0);
            check_screen_line(&line, None);
        }
        check_screen_line(&self.lines[0], Some(self.col));
    }
}

impl Screen {
    /// One byte that starts no sequence.
    fn put(&mut self, c: u8) {
        match c {
            b'\n' => {
                self.lines.push(Vec::new());
                self.col = 0;
            }
            b'\t' | 0x20..=0x7e => {
                let line = self.lines.last_mut().unwrap();
                if self.col < line.len() {
                    line[self.col] = c;
                } else {
                    line.push(c);
                }
                self.col += 1;
            }
            _ => panic!("raw control byte {c:#x} written to the terminal"),
        }
    }
}

/// Whose line this is, from its start: a guest's or the shell's.
fn check_screen_line(line: &[u8], cursor: Option<usize>) {
    if line.is_empty() {
        return;
    }
    assert!(
        !line.starts_with(b"tidal:"),
        "a guest line passes for the hypervisor's"
    );
    let prefix = PREFIXES.iter().find(|p| line.starts_with(p.as_bytes()));
    match prefix {
        Some(p) => {
            if let Some(col) = cursor {
                assert!(
                    col == 0 || col >= p.len(),
                    "cursor at {col}, inside the prefix {p:?}: {:?}",
                    String::from_utf8_lossy(line)
                );
            }
            assert!(
                line.len() <= p.len() + LINE_LONGEST,
                "screen line of {} chars",
                line.len()
            );
        }
        None => assert!(
            line.starts_with(PROMPT.as_bytes()),
            "a line of no one: {:?}",
            String::from_utf8_lossy(line)
        ),
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut guests = [
        Guest {
            line: ConsoleLine::new(),
        },
        Guest {
            line: ConsoleLine::new(),
        },
    ];
    let mut term = Terminal::new();
    let mut screen = Screen {
        lines: vec![Vec::new()],
        col: 0,
    };
    let mut focus: Option<usize> = None;
    let mut shell = String::new();
    for op in ops.iter().take(128) {
        let mut out = String::new();
        match op {
            Op::Byte { vm, byte } | Op::Echo { vm, byte } => {
                let id = usize::from(*vm);
                let name = NAMES[id];
                let g = &mut guests[id];
                if focus == Some(id) {
                    if matches!(op, Op::Echo { .. }) {
                        // As the vCPU loop prints a fast exit's echo
                        // (`run.rs` `show_live`), or the whole output when
                        // it does not fit one.
                        match g.line.push_live_echo(*byte) {
                            Ok(echo) => {
                                let o = echo.output();
                                check_live(&o);
                                term.guest_live(&mut out, id, name, o, true);
                            }
                            Err(o) => {
                                check_live(&o);
                                term.guest_live(&mut out, id, name, o, true);
                            }
                        }
                    } else {
                        let o = g.line.push_live(*byte);
                        check_live(&o);
                        term.guest_live(&mut out, id, name, o, true);
                    }
                } else if let Some(text) = g.line.push(*byte) {
                    check_text(text, LINE_LONGEST);
                    term.lines(&mut out, format_args!("[{name}] {text}\n"));
                }
            }
            Op::Write { vm, bytes } => {
                let id = usize::from(*vm);
                let name = NAMES[id];
                let g = &mut guests[id];
                if focus == Some(id) {
                    g.line.push_live_bytes(bytes, |o| {
                        check_live(&o);
                        term.guest_live(&mut out, id, name, o, true);
                    });
                } else {
                    for &b in bytes {
                        if let Some(text) = g.line.push(b) {
                            check_text(text, LINE_LONGEST);
                            term.lines(&mut out, format_args!("[{name}] {text}\n"));
                        }
                    }
                }
            }
            Op::Run { vm, byte, count } => {
                let id = usize::from(*vm);
                let name = NAMES[id];
                let g = &mut guests[id];
                for _ in 0..*count % 1100 {
                    if focus == Some(id) {
                        let o = g.line.push_live(*byte);
                        check_live(&o);
                        term.guest_live(&mut out, id, name, o, true);
                    } else if let Some(text) = g.line.push(*byte) {
                        check_text(text, LINE_LONGEST);
                        term.lines(&mut out, format_args!("[{name}] {text}\n"));
                    }
                }
            }
            Op::Focus(to) => {
                if let Some(old) = focus.take() {
                    guests[old].line.end_live();
                    term.end_live(&mut out);
                }
                match to {
                    Some(vm) => {
                        let id = usize::from(*vm);
                        focus = Some(id);
                        let o = guests[id].line.begin_live();
                        check_live(&o);
                        term.guest_live(&mut out, id, NAMES[id], o, true);
                    }
                    None => term.shell_line(&mut out, Some(&format!("{PROMPT}{shell}"))),
                }
            }
            Op::Flush { vm } => {
                let id = usize::from(*vm);
                if focus == Some(id) {
                    focus = None;
                    guests[id].line.end_live();
                    term.end_live(&mut out);
                }
                if let Some(text) = guests[id].line.flush() {
                    check_text(text, LINE_LONGEST);
                    term.lines(&mut out, format_args!("[{}] {text}\n", NAMES[id]));
                }
            }
            Op::Shell(typed) => {
                if focus.is_none() {
                    shell = typed
                        .iter()
                        .take(128)
                        .map(|&b| char::from(b % 95 + 0x20))
                        .collect();
                    term.shell_line(&mut out, Some(&format!("{PROMPT}{shell}")));
                }
            }
            Op::Enter => {
                if focus.is_none() {
                    term.shell_line(&mut out, None);
                    shell.clear();
                }
            }
        }
        screen.feed(&out);
    }
});
