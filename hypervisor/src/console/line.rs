//! The shell's line editor: turns console bytes into command lines, with
//! echo, backspace and Ctrl-U, independent of any UART.

/// Longest command line kept; further characters are refused with a bell.
pub const MAX_LINE: usize = 128;

/// What the caller must do after feeding one byte.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<'a> {
    /// Nothing yet.
    None,
    /// Write these bytes back to the terminal.
    Echo(&'a [u8]),
    /// A complete line (without its terminator); the terminal needs a newline.
    Line(&'a str),
}

pub struct LineEditor {
    buf: [u8; MAX_LINE],
    len: usize,
    /// The previous byte was CR, so a following LF is part of the same
    /// line break, not an empty line.
    after_cr: bool,
    out: [u8; 3],
    done: bool,
}

impl Default for LineEditor {
    fn default() -> Self {
        Self::new()
    }
}

impl LineEditor {
    pub const fn new() -> Self {
        Self {
            buf: [0; MAX_LINE],
            len: 0,
            after_cr: false,
            out: [0; 3],
            done: false,
        }
    }

    /// The line typed so far (empty right after a complete line).
    pub fn text(&self) -> &str {
        let len = if self.done { 0 } else { self.len };
        // Only printable ASCII is ever stored.
        core::str::from_utf8(&self.buf[..len]).unwrap_or("")
    }

    pub fn feed(&mut self, byte: u8) -> Event<'_> {
        if self.done {
            self.len = 0;
            self.done = false;
        }
        let after_cr = core::mem::replace(&mut self.after_cr, byte == b'\r');
        match byte {
            b'\n' if after_cr => Event::None,
            b'\r' | b'\n' => {
                self.done = true;
                // Only printable ASCII is ever stored, so this cannot fail.
                Event::Line(core::str::from_utf8(&self.buf[..self.len]).unwrap_or(""))
            }
            0x08 | 0x7f => {
                if self.len == 0 {
                    return Event::None;
                }
                self.len -= 1;
                self.out = [0x08, b' ', 0x08];
                Event::Echo(&self.out)
            }
            0x15 => {
                // Ctrl-U: erase the line; the caller redraws the prompt.
                self.len = 0;
                self.out = [b'\r', 0x1b, b'K'];
                Event::Echo(&self.out)
            }
            0x20..=0x7e if self.len < MAX_LINE => {
                self.buf[self.len] = byte;
                self.len += 1;
                self.out[0] = byte;
                Event::Echo(&self.out[..1])
            }
            0x20..=0x7e => {
                self.out[0] = 0x07;
                Event::Echo(&self.out[..1])
            }
            _ => Event::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8]) -> Vec<String> {
        let mut ed = LineEditor::new();
        let mut out = Vec::new();
        for &b in input {
            if let Event::Line(l) = ed.feed(b) {
                out.push(l.to_string());
            }
        }
        out
    }

    #[test]
    fn cr_lf_and_crlf_each_end_one_line() {
        assert_eq!(
            lines(b"mem\rcpus\nhelp\r\nx\n\n"),
            ["mem", "cpus", "help", "x", ""]
        );
    }

    #[test]
    fn backspace_and_kill() {
        assert_eq!(lines(b"memx\x7f\r"), ["mem"]);
        assert_eq!(lines(b"\x08\x08m\r"), ["m"]);
        assert_eq!(lines(b"garbage\x15cpus\r"), ["cpus"]);
    }

    #[test]
    fn control_bytes_ignored_and_overlong_refused() {
        assert_eq!(lines(b"\x1b[Ahelp\r"), ["[Ahelp"]);
        let long = vec![b'a'; MAX_LINE + 10];
        let mut input = long.clone();
        input.push(b'\r');
        assert_eq!(
            lines(&input),
            [String::from_utf8(long[..MAX_LINE].to_vec()).unwrap()]
        );
    }
}
