//! A guest's console output, line by line: the emulated PL011 hands bytes
//! here and complete lines go to the physical console prefixed with the VM's
//! name, so several guests can share one terminal. The VM that has the
//! keyboard (`console <vm>`) is shown live instead ([`ConsoleLine::push_live`]):
//! a prompt without a newline appears at once and echoed backspaces erase.

/// Longest line kept; a longer one is emitted in pieces.
pub const LINE_MAX: usize = 160;

pub struct ConsoleLine {
    buf: [u8; LINE_MAX],
    len: usize,
    /// How much of the current line [`ConsoleLine::push_live`] has handed
    /// out for display.
    shown: usize,
    /// Inside an escape sequence (ESC, then CSI parameters up to a final
    /// letter): terminal control, not text, so it is dropped whole.
    escape: Escape,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    Esc,
    Csi,
}

impl Default for ConsoleLine {
    fn default() -> Self {
        Self::new()
    }
}

impl ConsoleLine {
    pub const fn new() -> Self {
        Self {
            buf: [0; LINE_MAX],
            len: 0,
            shown: 0,
            escape: Escape::None,
        }
    }

    /// Add one byte; returns a complete line (without its newline) when the
    /// byte ends one or the buffer is full. Carriage returns and other
    /// control bytes are dropped; non-ASCII bytes become '?'.
    pub fn push(&mut self, byte: u8) -> Option<&str> {
        match (self.escape, byte) {
            (_, 0x1b) => {
                self.escape = Escape::Esc;
                return None;
            }
            (Escape::Esc, b'[') => {
                self.escape = Escape::Csi;
                return None;
            }
            (Escape::Esc, _) => {
                self.escape = Escape::None;
                return None;
            }
            (Escape::Csi, 0x40..=0x7e) => {
                self.escape = Escape::None;
                return None;
            }
            (Escape::Csi, _) => return None,
            (Escape::None, _) => {}
        }
        match byte {
            b'\n' => return Some(self.take()),
            b'\t' | 0x20..=0x7e => self.buf[self.len] = byte,
            0x80..=0xff => self.buf[self.len] = b'?',
            _ => return None,
        }
        self.len += 1;
        if self.len == LINE_MAX {
            return Some(self.take());
        }
        None
    }

    /// Add one byte of a VM whose output is shown live: what to show now.
    /// Backspace and DEL erase the last character, as an echoing shell
    /// means them (busybox erases with "\b \b").
    pub fn push_live(&mut self, byte: u8) -> LiveOutput<'_> {
        if self.escape == Escape::None && matches!(byte, 0x08 | 0x7f) {
            self.len = self.len.saturating_sub(1);
            if self.shown > self.len {
                self.shown = self.len;
                return LiveOutput::Erase;
            }
            return LiveOutput::Nothing;
        }
        let shown = core::mem::take(&mut self.shown);
        let before = self.len;
        if self.push(byte).is_some() {
            // `take` emptied the buffer; the line is still in it.
            let len = if byte == b'\n' { before } else { LINE_MAX };
            let text = core::str::from_utf8(&self.buf[..len]).unwrap_or("");
            return LiveOutput::Line { text, shown };
        }
        self.shown = self.len;
        if self.len == shown {
            return LiveOutput::Nothing;
        }
        LiveOutput::Partial {
            text: core::str::from_utf8(&self.buf[..self.len]).unwrap_or(""),
            shown,
        }
    }

    fn take(&mut self) -> &str {
        self.shown = 0;
        let len = core::mem::take(&mut self.len);
        // Only ASCII is stored.
        core::str::from_utf8(&self.buf[..len]).unwrap_or("")
    }

    /// Whatever is buffered without a newline yet (for a VM that stops).
    pub fn flush(&mut self) -> Option<&str> {
        (self.len > 0).then(|| self.take())
    }
}

/// What a live console shows after a byte.
#[derive(Debug, PartialEq, Eq)]
pub enum LiveOutput<'a> {
    Nothing,
    /// The line so far; its first `shown` bytes were handed out before.
    Partial {
        text: &'a str,
        shown: usize,
    },
    /// A complete line (without its newline); `shown` bytes were handed
    /// out before.
    Line {
        text: &'a str,
        shown: usize,
    },
    /// The last character handed out was erased.
    Erase,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_output_shows_prompts_and_erases() {
        let mut c = ConsoleLine::new();
        let mut shown = Vec::new();
        for &b in b"/ # \x1b[6nls\x08 \x08\x08 \x08cat\r\n" {
            match c.push_live(b) {
                LiveOutput::Nothing => {}
                LiveOutput::Partial { text, shown: s } => shown.push(text[s..].to_string()),
                LiveOutput::Line { text, shown: s } => shown.push(format!("{}|", &text[s..])),
                LiveOutput::Erase => shown.push("<".into()),
            }
        }
        assert_eq!(
            shown,
            ["/", " ", "#", " ", "l", "s", "<", " ", "<", "<", " ", "<", "c", "a", "t", "|"]
        );
        // The line the erasing left behind is what a line-mode reader gets.
        let mut d = ConsoleLine::new();
        let mut line = String::new();
        for &b in b"ab\x08c\n" {
            if let LiveOutput::Line { text, .. } = d.push_live(b) {
                line = text.to_string();
            }
        }
        assert_eq!(line, "ac");
    }

    #[test]
    fn lines_and_control_bytes() {
        let mut c = ConsoleLine::new();
        let mut out = Vec::new();
        for &b in b"hello\r\nw\x1bZ\xffrld\n" {
            if let Some(l) = c.push(b) {
                out.push(l.to_string());
            }
        }
        assert_eq!(out, ["hello", "w?rld"]);
        // Terminal control sequences vanish whole (busybox's cursor query).
        let mut d = ConsoleLine::new();
        let lines: Vec<String> = b"/ # \x1b[6ncat\x1b7\n"
            .iter()
            .filter_map(|&b| d.push(b).map(str::to_string))
            .collect();
        assert_eq!(lines, ["/ # cat"]);
        for &b in b"tail" {
            assert!(c.push(b).is_none());
        }
        assert_eq!(c.flush(), Some("tail"));
        assert_eq!(c.flush(), None);
        let long: Vec<_> = (0..LINE_MAX + 3)
            .filter_map(|_| c.push(b'x').map(str::len))
            .collect();
        assert_eq!(long, [LINE_MAX]);
    }
}
