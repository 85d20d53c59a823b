//! What the shared terminal shows, and what to write to it so that output
//! from the shell, the hypervisor and several guests never mixes inside a
//! line. At most one line is open at the bottom: the shell's prompt with
//! what is being typed, or the unfinished live output of the VM that has
//! the keyboard. Everything else is printed as whole lines: the open line
//! is erased first and drawn again below them. Plain Rust over a
//! `fmt::Write`, so the host tests replay interleavings against a small
//! terminal model.

use core::fmt::{self, Write};

use crate::vm::console_line::{LiveOutput, LINE_MAX};

/// A live guest line with its `[name] ` prefix, or the prompt and the
/// longest command line.
const OPEN_LINE_MAX: usize = LINE_MAX + 64;
/// Carriage return, then erase the whole line (VT100).
pub const ERASE_LINE: &str = "\r\x1b[2K";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// The shell's prompt and the command being typed.
    Shell,
    /// The live output of VM `id`.
    Vm(usize),
}

/// The open line, as it stands on the terminal (prefix included).
pub struct Terminal {
    owner: Option<Owner>,
    text: [u8; OPEN_LINE_MAX],
    len: usize,
}

impl Default for Terminal {
    fn default() -> Self {
        Self::new()
    }
}

impl Terminal {
    pub const fn new() -> Self {
        Self {
            owner: None,
            text: [0; OPEN_LINE_MAX],
            len: 0,
        }
    }

    fn as_str(&self) -> &str {
        // Only whole `str`s are pushed and cuts are at char boundaries.
        core::str::from_utf8(&self.text[..self.len]).unwrap_or("")
    }

    fn push_str(&mut self, s: &str) {
        let mut end = s.len().min(OPEN_LINE_MAX - self.len);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        // Byte by byte: mostly one character (a guest's live byte), which
        // a copy_from_slice would hand to a memcpy call.
        for &b in &s.as_bytes()[..end] {
            self.text[self.len] = b;
            self.len += 1;
        }
    }

    fn clear(&mut self) {
        self.owner = None;
        self.len = 0;
    }

    /// Print `args` as whole lines: the open line (if any) is erased first
    /// and drawn again below them. Output that does not end its line gets a
    /// newline then, so the open line never continues someone else's text.
    pub fn lines(&mut self, out: &mut impl Write, args: fmt::Arguments<'_>) {
        if self.owner.is_none() {
            let _ = out.write_fmt(args);
            return;
        }
        let _ = out.write_str(ERASE_LINE);
        let mut last = LastByte { out, last: b'\n' };
        let _ = last.write_fmt(args);
        if last.last != b'\n' {
            let _ = last.out.write_str("\n");
        }
        let _ = out.write_str(self.as_str());
    }

    /// The shell's line (prompt and what is typed) is now `text`; `None`:
    /// the line is finished (Enter), the cursor moves below it. Only what
    /// changed is written: typed characters, backspaces, or the whole line
    /// again after anything else.
    pub fn shell_line(&mut self, out: &mut impl Write, text: Option<&str>) {
        let Some(text) = text else {
            if self.owner == Some(Owner::Shell) {
                let _ = out.write_str("\n");
                self.clear();
            }
            return;
        };
        match self.owner {
            Some(Owner::Shell) => {
                let old = self.len;
                let same = self
                    .as_str()
                    .bytes()
                    .zip(text.bytes())
                    .take_while(|(a, b)| a == b)
                    .count();
                if same == old {
                    let new = text.get(old..).unwrap_or("");
                    let _ = out.write_str(new);
                    self.push_str(new);
                    return;
                }
                if same == text.len() {
                    for _ in same..old {
                        let _ = out.write_str("\x08 \x08");
                    }
                    self.len = same;
                    return;
                }
                let _ = out.write_str(ERASE_LINE);
            }
            Some(Owner::Vm(_)) => {
                let _ = out.write_str("\n");
            }
            None => {}
        }
        self.clear();
        self.owner = Some(Owner::Shell);
        let _ = out.write_str(text);
        self.push_str(text);
    }

    /// Show live output of VM `id` (named `name`) at the bottom of the
    /// terminal: a prompt appears without waiting for its newline. `live`
    /// says whether the VM still has the keyboard: one that lost it
    /// meanwhile ([`Terminal::end_live`]) gets complete lines only.
    pub fn guest_live(
        &mut self,
        out: &mut impl Write,
        id: usize,
        name: &str,
        output: LiveOutput<'_>,
        live: bool,
    ) {
        if !live {
            if let LiveOutput::Line { text, .. } = output {
                self.lines(out, format_args!("[{name}] {text}\n"));
            }
            return;
        }
        let me = Some(Owner::Vm(id));
        let (text, shown, complete) = match output {
            LiveOutput::Nothing => return,
            LiveOutput::Erase => {
                if self.owner == me && self.len > 0 {
                    self.len -= 1;
                    let _ = out.write_str("\x08 \x08");
                }
                return;
            }
            LiveOutput::Partial { text, shown } => (text, shown, false),
            LiveOutput::Line { text, shown } => (text, shown, true),
        };
        if self.owner == me {
            let new = text.get(shown..).unwrap_or("");
            let _ = out.write_str(new);
            self.push_str(new);
        } else {
            match self.owner {
                Some(Owner::Shell) => {
                    let _ = out.write_str(ERASE_LINE);
                }
                Some(Owner::Vm(_)) => {
                    let _ = out.write_str("\n");
                }
                None => {}
            }
            self.clear();
            self.owner = me;
            let _ = write!(out, "[{name}] {text}");
            self.push_str("[");
            self.push_str(name);
            self.push_str("] ");
            self.push_str(text);
        }
        if complete {
            let _ = out.write_str("\n");
            self.clear();
        }
    }

    /// The live console lost the keyboard: its unfinished line stays on
    /// the terminal as it is and later output starts below it.
    pub fn end_live(&mut self, out: &mut impl Write) {
        if matches!(self.owner, Some(Owner::Vm(_))) {
            let _ = out.write_str("\n");
            self.clear();
        }
    }
}

/// A writer that remembers the last byte it wrote.
struct LastByte<'a, W: Write> {
    out: &'a mut W,
    last: u8,
}

impl<W: Write> Write for LastByte<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if let Some(&b) = s.as_bytes().last() {
            self.last = b;
        }
        self.out.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::String;
    use std::vec::Vec;

    use super::*;

    /// The screen a VT100 shows for `bytes`: the lines, the last one the
    /// cursor's (carriage return, erase line, backspace and newline only).
    fn screen(bytes: &str) -> Vec<String> {
        let mut lines = vec![String::new()];
        let mut col: usize = 0;
        let mut rest = bytes;
        while let Some(c) = rest.chars().next() {
            if let Some(after) = rest.strip_prefix("\x1b[2K") {
                lines.last_mut().unwrap().clear();
                rest = after;
                continue;
            }
            rest = &rest[c.len_utf8()..];
            let line = lines.last_mut().unwrap();
            match c {
                '\n' => {
                    lines.push(String::new());
                    col = 0;
                }
                '\r' => col = 0,
                '\x08' => col = col.saturating_sub(1),
                c => {
                    let mut chars: Vec<char> = line.chars().collect();
                    if col < chars.len() {
                        chars[col] = c;
                    } else {
                        chars.push(c);
                    }
                    *line = chars.into_iter().collect();
                    col += 1;
                }
            }
        }
        lines.iter().map(|l| l.trim_end().to_string()).collect()
    }

    fn partial(text: &str, shown: usize) -> LiveOutput<'_> {
        LiveOutput::Partial { text, shown }
    }

    #[test]
    fn guest_lines_go_above_the_line_being_typed() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        t.shell_line(&mut out, Some("tidal> "));
        t.shell_line(&mut out, Some("tidal> cp"));
        t.lines(&mut out, format_args!("[alpha] testguest: up\n"));
        t.shell_line(&mut out, Some("tidal> cpus"));
        t.shell_line(&mut out, Some("tidal> cpu"));
        t.shell_line(&mut out, Some("tidal> cpus"));
        t.shell_line(&mut out, None);
        t.lines(&mut out, format_args!("cpu  MPIDR\n"));
        assert_eq!(
            screen(&out),
            ["[alpha] testguest: up", "tidal> cpus", "cpu  MPIDR", ""]
        );
    }

    #[test]
    fn output_without_newline_does_not_join_the_open_line() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        t.shell_line(&mut out, Some("tidal> x"));
        t.lines(&mut out, format_args!("half a line"));
        assert_eq!(screen(&out), ["half a line", "tidal> x"]);
    }

    #[test]
    fn ctrl_u_and_a_new_prompt_redraw_only_what_changed() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        t.shell_line(&mut out, Some("tidal> mem"));
        t.shell_line(&mut out, Some("tidal> "));
        t.shell_line(&mut out, Some("tidal> vms"));
        assert_eq!(screen(&out), ["tidal> vms"]);
        assert_eq!(out, "tidal> mem\x08 \x08\x08 \x08\x08 \x08vms");
    }

    #[test]
    fn live_output_keeps_its_prompt_at_the_bottom() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        t.guest_live(&mut out, 1, "linux", partial("~ # ", 0), true);
        t.guest_live(&mut out, 1, "linux", partial("~ # ls", 4), true);
        t.lines(&mut out, format_args!("[beta] tick\n"));
        t.guest_live(&mut out, 1, "linux", LiveOutput::Erase, true);
        t.guest_live(
            &mut out,
            1,
            "linux",
            LiveOutput::Line {
                text: "~ # l",
                shown: 5,
            },
            true,
        );
        assert_eq!(screen(&out), ["[beta] tick", "[linux] ~ # l", ""]);
    }

    #[test]
    fn a_console_that_lost_the_keyboard_prints_whole_lines_above_the_prompt() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        t.guest_live(&mut out, 1, "linux", partial("~ # ", 0), true);
        t.end_live(&mut out);
        t.shell_line(&mut out, Some("tidal> v"));
        let line = LiveOutput::Line {
            text: "late",
            shown: 0,
        };
        t.guest_live(&mut out, 1, "linux", line, false);
        assert_eq!(screen(&out), ["[linux] ~ #", "[linux] late", "tidal> v"]);
    }

    #[test]
    fn a_long_open_line_is_kept_whole_up_to_its_room() {
        let (mut t, mut out) = (Terminal::new(), String::new());
        let long = "x".repeat(OPEN_LINE_MAX + 10);
        t.shell_line(&mut out, Some(&long));
        assert_eq!(t.len, OPEN_LINE_MAX);
        t.shell_line(&mut out, Some("é"));
        assert_eq!(t.as_str(), "é");
    }
}
