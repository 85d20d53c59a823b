//! A guest's console output, line by line: the emulated PL011 hands bytes
//! here and complete lines go to the physical console prefixed with the VM's
//! name, so several guests can share one terminal. Control bytes are shown
//! escaped in those lines (`^[`, `^M`, `^H`, ...): a guest cannot move the
//! cursor over its `[name] ` prefix to fake a hypervisor line (those start
//! with `tidal: `). The VM that has the keyboard (`console <vm>`) is shown
//! live instead ([`ConsoleLine::push_live`]): the user handed it the
//! terminal, so a prompt without a newline appears at once and echoed
//! backspaces erase.

/// Longest line kept whole (Linux's printk record is at most 1024 bytes);
/// a longer one is emitted in pieces of this size.
pub const LINE_MAX: usize = 1024;
/// Most bytes one guest byte becomes in a line (a held CR and an escape).
const ITEM_MAX: usize = 4;

pub struct ConsoleLine {
    /// Room for one item past [`LINE_MAX`]: a line is emitted once it reaches it.
    buf: [u8; LINE_MAX + ITEM_MAX],
    len: usize,
    /// How much of the current line [`ConsoleLine::push_live`] has handed
    /// out for display.
    shown: usize,
    /// Inside an escape sequence (ESC, then CSI parameters up to a final
    /// letter): terminal control, not text, so it is dropped whole.
    escape: Escape,
    /// A carriage return was the last byte of a line-mode guest: dropped if
    /// a newline follows (CRLF), shown as `^M` otherwise.
    cr_held: bool,
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
            buf: [0; LINE_MAX + ITEM_MAX],
            len: 0,
            shown: 0,
            escape: Escape::None,
            cr_held: false,
        }
    }

    /// Add one byte of line-mode output; returns a complete line (without
    /// its newline) when the byte ends one or the line is full. Control
    /// bytes are shown in caret notation (`^[` for ESC, `^?` for DEL; a CR
    /// right before the newline is dropped), non-ASCII bytes become '?'.
    pub fn push(&mut self, byte: u8) -> Option<&str> {
        let cr = core::mem::take(&mut self.cr_held);
        if byte == b'\n' {
            return Some(self.take());
        }
        if cr {
            self.put(b"^M");
        }
        match byte {
            b'\r' => self.cr_held = true,
            b'\t' | 0x20..=0x7e => self.put(&[byte]),
            0x7f => self.put(b"^?"),
            0x00..=0x1f => self.put(&[b'^', byte + 0x40]),
            0x80..=0xff => self.put(b"?"),
        }
        if self.len >= LINE_MAX {
            return Some(self.take());
        }
        None
    }

    fn put(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = b;
                self.len += 1;
            }
        }
    }

    /// Add one byte of live output: terminal escape sequences are dropped
    /// whole, carriage returns and other control bytes dropped, non-ASCII
    /// bytes become '?'. True when the byte ended the line (a newline, or
    /// the line is full): the buffer is empty then, the line still in it.
    fn push_filtered(&mut self, byte: u8) -> bool {
        match (self.escape, byte) {
            (_, 0x1b) => {
                self.escape = Escape::Esc;
                return false;
            }
            (Escape::Esc, b'[') => {
                self.escape = Escape::Csi;
                return false;
            }
            (Escape::Esc, _) => {
                self.escape = Escape::None;
                return false;
            }
            (Escape::Csi, 0x40..=0x7e) => {
                self.escape = Escape::None;
                return false;
            }
            (Escape::Csi, _) => return false,
            (Escape::None, _) => {}
        }
        match byte {
            b'\n' => {
                self.end_line();
                return true;
            }
            b'\t' | 0x20..=0x7e => self.buf[self.len] = byte,
            0x80..=0xff => self.buf[self.len] = b'?',
            _ => return false,
        }
        self.len += 1;
        if self.len == LINE_MAX {
            self.end_line();
            return true;
        }
        false
    }

    /// Add one byte of a VM whose output is shown live: what to show now.
    /// Backspace and DEL erase the last character, as an echoing shell
    /// means them (busybox erases with "\b \b").
    pub fn push_live(&mut self, byte: u8) -> LiveOutput<'_> {
        let step = self.step_live(byte);
        self.live_output(step)
    }

    /// [`ConsoleLine::push_live`] for several bytes at once (a virtio
    /// console's write): what to show, with the partial steps between two
    /// line ends merged into one output, so a write of any length makes at
    /// most one output per line it ends, one per erase, and one for the
    /// line it leaves open.
    pub fn push_live_bytes(&mut self, bytes: &[u8], mut show: impl FnMut(LiveOutput<'_>)) {
        // `shown` of the first partial step not handed out yet.
        let mut pending: Option<usize> = None;
        for &byte in bytes {
            let erases = self.escape == Escape::None && matches!(byte, 0x08 | 0x7f);
            if erases {
                if let Some(shown) = pending.take() {
                    show(self.live_output(LiveStep::Partial { shown }));
                }
            }
            match self.step_live(byte) {
                LiveStep::Nothing => {}
                LiveStep::Partial { shown } => {
                    pending.get_or_insert(shown);
                }
                LiveStep::Line { len, shown } => {
                    let shown = pending.take().unwrap_or(shown);
                    show(self.live_output(LiveStep::Line { len, shown }));
                }
                LiveStep::Erase => show(LiveOutput::Erase),
            }
        }
        if let Some(shown) = pending {
            show(self.live_output(LiveStep::Partial { shown }));
        }
    }

    /// [`ConsoleLine::push_live`] as an [`Echo`] of what the byte shows;
    /// the whole [`LiveOutput`] when that does not fit one. The line so far
    /// is not looked at (it is not validated as a `str` on every byte).
    pub fn push_live_echo(&mut self, byte: u8) -> Result<Echo, LiveOutput<'_>> {
        // The common case, what `step_live` would do for it: a character
        // added to a line shown so far, which it neither ends nor fills.
        if self.escape == Escape::None
            && self.shown == self.len
            && self.len + 1 < LINE_MAX
            && matches!(byte, b'\t' | 0x20..=0x7e)
        {
            let starts_line = self.len == 0;
            self.buf[self.len] = byte;
            self.len += 1;
            self.shown = self.len;
            return Ok(Echo::character(byte, starts_line));
        }
        let step = self.step_live(byte);
        let (kind, new, starts_line) = match step {
            LiveStep::Nothing => (EchoKind::Nothing, &[][..], false),
            LiveStep::Erase => (EchoKind::Erase, &[][..], false),
            LiveStep::Partial { shown } => {
                (EchoKind::Partial, &self.buf[shown..self.len], shown == 0)
            }
            LiveStep::Line { len, shown } => (EchoKind::Line, &self.buf[shown..len], shown == 0),
        };
        Echo::new(kind, new, starts_line).ok_or_else(|| self.live_output(step))
    }

    /// What one live byte did to the line (positions in `buf`).
    fn step_live(&mut self, byte: u8) -> LiveStep {
        if self.escape == Escape::None && matches!(byte, 0x08 | 0x7f) {
            self.len = self.len.saturating_sub(1);
            if self.shown > self.len {
                self.shown = self.len;
                return LiveStep::Erase;
            }
            return LiveStep::Nothing;
        }
        let shown = core::mem::take(&mut self.shown);
        let before = self.len;
        if self.push_filtered(byte) {
            // The buffer is empty; the line is still in it.
            let len = if byte == b'\n' { before } else { LINE_MAX };
            return LiveStep::Line { len, shown };
        }
        self.shown = self.len;
        if self.len == shown {
            return LiveStep::Nothing;
        }
        LiveStep::Partial { shown }
    }

    fn live_output(&self, step: LiveStep) -> LiveOutput<'_> {
        // Only ASCII is stored.
        let text = |len: usize| core::str::from_utf8(&self.buf[..len]).unwrap_or("");
        match step {
            LiveStep::Nothing => LiveOutput::Nothing,
            LiveStep::Erase => LiveOutput::Erase,
            LiveStep::Partial { shown } => LiveOutput::Partial {
                text: text(self.len),
                shown,
            },
            LiveStep::Line { len, shown } => LiveOutput::Line {
                text: text(len),
                shown,
            },
        }
    }

    /// The line is over: the buffer starts again (what it held stays there
    /// until overwritten).
    fn end_line(&mut self) {
        self.shown = 0;
        self.len = 0;
    }

    fn take(&mut self) -> &str {
        self.shown = 0;
        let len = core::mem::take(&mut self.len);
        // Only ASCII is stored.
        core::str::from_utf8(&self.buf[..len]).unwrap_or("")
    }

    /// The VM gets the keyboard: the line it started (a shell's prompt,
    /// held until now for its newline) is shown at once.
    pub fn begin_live(&mut self) -> LiveOutput<'_> {
        if self.len == 0 {
            return LiveOutput::Nothing;
        }
        self.shown = self.len;
        LiveOutput::Partial {
            text: core::str::from_utf8(&self.buf[..self.len]).unwrap_or(""),
            shown: 0,
        }
    }

    /// The VM lost the keyboard: what live output showed of the current
    /// line is on the terminal already, so it is not kept for the next
    /// whole line (which would print it a second time).
    pub fn end_live(&mut self) {
        let shown = core::mem::take(&mut self.shown).min(self.len);
        self.buf.copy_within(shown..self.len, 0);
        self.len -= shown;
        self.escape = Escape::None;
    }

    /// Whatever is buffered without a newline yet (for a VM that stops).
    pub fn flush(&mut self) -> Option<&str> {
        if core::mem::take(&mut self.cr_held) {
            self.put(b"^M");
        }
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

/// [`ConsoleLine::step_live`]'s result: a [`LiveOutput`] as positions in
/// the line's buffer.
#[derive(Clone, Copy)]
enum LiveStep {
    Nothing,
    Erase,
    /// The line so far is `buf[..len]`, of which `shown` bytes were shown.
    Partial {
        shown: usize,
    },
    /// The line `buf[..len]` ended.
    Line {
        len: usize,
        shown: usize,
    },
}

/// Most new text an [`Echo`] carries: one guest byte shows at most one
/// character live ([`ConsoleLine::push_live`]); more goes through the
/// outbox.
pub const ECHO_MAX: usize = 8;

/// What one byte showed live, owned and small (`Copy`): it leaves the VM's
/// lock by value (the vCPU loop copies it out of `Vm::echo` and prints it
/// after unlocking) without the outbox's heap copy of the line. It carries
/// only the text not shown before, not the line so far: the terminal shows
/// that already (copying it on every byte cost about 300 EL2 instructions
/// per byte). The line's start is needed only by a terminal that no longer
/// shows it (the keyboard moved away and back while the byte was on its
/// way): that terminal starts a new line with the new text.
///
/// Aligned to 8 (16 bytes in all): the target's strict alignment made
/// each move of its 11 bytes a call to memcpy, two per byte printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(align(8))]
pub struct Echo {
    kind: EchoKind,
    /// The line starts with this text (nothing of it was shown before).
    starts_line: bool,
    len: u8,
    new: [u8; ECHO_MAX],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EchoKind {
    Nothing,
    Partial,
    Line,
    Erase,
}

impl Echo {
    /// What `output` shows now; `None` when that is more than [`ECHO_MAX`]
    /// bytes.
    pub fn of(output: &LiveOutput<'_>) -> Option<Echo> {
        let (kind, new, starts_line) = match *output {
            LiveOutput::Nothing => (EchoKind::Nothing, "", false),
            LiveOutput::Erase => (EchoKind::Erase, "", false),
            LiveOutput::Partial { text, shown } => {
                (EchoKind::Partial, text.get(shown..)?, shown == 0)
            }
            LiveOutput::Line { text, shown } => (EchoKind::Line, text.get(shown..)?, shown == 0),
        };
        Echo::new(kind, new.as_bytes(), starts_line)
    }

    /// One character (ASCII) added to the line.
    fn character(byte: u8, starts_line: bool) -> Echo {
        let mut new = [0; ECHO_MAX];
        new[0] = byte;
        Echo {
            kind: EchoKind::Partial,
            starts_line,
            len: 1,
            new,
        }
    }

    /// `new` (ASCII) kept; `None` when longer than [`ECHO_MAX`].
    fn new(kind: EchoKind, new: &[u8], starts_line: bool) -> Option<Echo> {
        let mut echo = Echo {
            kind,
            starts_line,
            len: 0,
            new: [0; ECHO_MAX],
        };
        echo.new.get_mut(..new.len())?.copy_from_slice(new);
        echo.len = new.len() as u8;
        Some(echo)
    }

    /// The live output it carries: its new text as a whole line so far
    /// (`shown` 0), which the terminal that shows the line appends.
    pub fn output(&self) -> LiveOutput<'_> {
        // Only whole characters of a `str` are copied in.
        let text = core::str::from_utf8(&self.new[..usize::from(self.len)]).unwrap_or("");
        match self.kind {
            EchoKind::Nothing => LiveOutput::Nothing,
            EchoKind::Erase => LiveOutput::Erase,
            EchoKind::Partial => LiveOutput::Partial { text, shown: 0 },
            EchoKind::Line => LiveOutput::Line { text, shown: 0 },
        }
    }

    /// Whether the line starts with its text (see [`Echo`]).
    pub fn starts_line(&self) -> bool {
        self.starts_line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_carries_what_a_byte_shows_and_whether_it_starts_the_line() {
        let mut line = ConsoleLine::new();
        for &b in b"$ lx\x08s\n" {
            let output = line.push_live(b);
            let echo = Echo::of(&output).expect("one byte shows one character");
            let (new, starts_line) = match output {
                LiveOutput::Partial { text, shown } | LiveOutput::Line { text, shown } => {
                    (&text[shown..], shown == 0)
                }
                _ => ("", false),
            };
            let carried = match echo.output() {
                LiveOutput::Partial { text, shown: 0 } | LiveOutput::Line { text, shown: 0 } => {
                    text
                }
                LiveOutput::Nothing | LiveOutput::Erase => "",
                other => panic!("{other:?}"),
            };
            assert_eq!(carried, new);
            assert_eq!(echo.starts_line(), starts_line);
            assert_eq!(
                core::mem::discriminant(&echo.output()),
                core::mem::discriminant(&output)
            );
        }
        // A long line is carried a byte at a time.
        for &b in &[b'a'; LINE_MAX / 2] {
            assert!(Echo::of(&line.push_live(b)).is_some());
        }
        // More new text than an echo holds (a prompt shown on focus) is not.
        let begun = LiveOutput::Partial {
            text: "root@guest:~# ",
            shown: 0,
        };
        assert_eq!(Echo::of(&begun), None);
        let small = Echo::of(&LiveOutput::Partial {
            text: "root@guest:~# ",
            shown: 12,
        });
        assert_eq!(small.map(|e| e.starts_line()), Some(false));
    }

    /// A line of printable characters up to and past its end: the byte
    /// that fills it ends it on both paths.
    #[test]
    fn push_live_echo_ends_a_full_line_as_push_live_does() {
        let mut full = ConsoleLine::new();
        let mut fast = ConsoleLine::new();
        for i in 0..2 * LINE_MAX + 3 {
            let b = b'a' + (i % 26) as u8;
            let output = full.push_live(b);
            let expected = Echo::of(&output).ok_or_else(|| format!("{output:?}"));
            assert_eq!(
                fast.push_live_echo(b).map_err(|o| format!("{o:?}")),
                expected,
                "byte {i}"
            );
        }
    }

    proptest::proptest! {
        /// The fast path's echo of a byte is what the full path's live
        /// output of it shows, whatever the guest prints (escapes, erases,
        /// non-ASCII, lines longer than a console line), also after bytes
        /// printed while the VM was not shown live and after it got the
        /// keyboard back (a line partly shown).
        #[test]
        fn push_live_echo_shows_what_push_live_shows(
            steps in proptest::collection::vec(
                (
                    proptest::sample::select(vec![0u8, 0, 0, 0, 0, 0, 1, 2]),
                    proptest::prop_oneof![
                        proptest::sample::select(b"\n\r\x08\x7f\x1b[Ax".to_vec()),
                        proptest::num::u8::ANY,
                    ],
                ),
                0..2200,
            )
        ) {
            let mut full = ConsoleLine::new();
            let mut fast = ConsoleLine::new();
            for &(op, b) in &steps {
                match op {
                    // Printed while another VM has the keyboard.
                    1 => {
                        let expected = full.push(b).map(str::to_owned);
                        proptest::prop_assert_eq!(fast.push(b).map(str::to_owned), expected);
                    }
                    // The VM gets the keyboard (again).
                    2 => {
                        let expected = format!("{:?}", full.begin_live());
                        proptest::prop_assert_eq!(format!("{:?}", fast.begin_live()), expected);
                    }
                    _ => {
                        let output = full.push_live(b);
                        let expected = Echo::of(&output).ok_or_else(|| format!("{output:?}"));
                        let got = fast.push_live_echo(b).map_err(|o| format!("{o:?}"));
                        proptest::prop_assert_eq!(got, expected);
                    }
                }
            }
        }
    }

    /// What a terminal shows after these live outputs.
    fn screen(outputs: &[(String, bool, usize, bool)]) -> String {
        let mut screen = String::new();
        for (text, line, shown, erase) in outputs {
            if *erase {
                screen.pop();
                continue;
            }
            screen.push_str(&text[*shown..]);
            if *line {
                screen.push('\n');
            }
        }
        screen
    }

    fn owned(output: LiveOutput<'_>) -> Option<(String, bool, usize, bool)> {
        match output {
            LiveOutput::Nothing => None,
            LiveOutput::Partial { text, shown } => Some((text.into(), false, shown, false)),
            LiveOutput::Line { text, shown } => Some((text.into(), true, shown, false)),
            LiveOutput::Erase => Some((String::new(), false, 0, true)),
        }
    }

    proptest::proptest! {
        /// A write taken whole (a virtio console's) shows on a terminal what
        /// the same bytes taken one at a time (the PL011's) show, in at
        /// most one output per line end, two per erase, and one for the rest.
        #[test]
        fn push_live_bytes_shows_what_push_live_shows(
            writes in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::prop_oneof![
                        proptest::sample::select(b"\n\r\x08\x7f\x1b[Axy ".to_vec()),
                        proptest::num::u8::ANY,
                    ],
                    0..300,
                ),
                0..12,
            )
        ) {
            let mut single = ConsoleLine::new();
            let mut batched = ConsoleLine::new();
            let mut one = Vec::new();
            let mut many = Vec::new();
            for write in &writes {
                for &b in write {
                    one.extend(owned(single.push_live(b)));
                }
                let before = many.len();
                batched.push_live_bytes(write, |o| many.extend(owned(o)));
                let lines = write.iter().filter(|&&b| b == b'\n').count();
                let erases = write.iter().filter(|&&b| matches!(b, 0x08 | 0x7f)).count();
                // An erase may first show the text before it.
                let bound = lines + 2 * erases + 1 + write.len() / LINE_MAX;
                proptest::prop_assert!(many.len() - before <= bound);
                proptest::prop_assert_eq!(screen(&many), screen(&one));
            }
        }
    }

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
        assert_eq!(out, ["hello", "w^[Z?rld"]);
        // Terminal control is shown, not obeyed: a guest cannot return to
        // the start of the line, erase it or back over its prefix.
        let mut d = ConsoleLine::new();
        let lines: Vec<String> =
            b"/ # \x1b[6ncat\x1b7\n\rtidal: [x] fake\r\x1b[2K\x08\x08\x7f\x00\x1f\r\n"
                .iter()
                .filter_map(|&b| d.push(b).map(str::to_string))
                .collect();
        assert_eq!(
            lines,
            ["/ # ^[[6ncat^[7", "^Mtidal: [x] fake^M^[[2K^H^H^?^@^_"]
        );
        // A held CR at the end of the output is shown too.
        for &b in b"x\r" {
            assert!(d.push(b).is_none());
        }
        assert_eq!(d.flush(), Some("x^M"));
        for &b in b"tail" {
            assert!(c.push(b).is_none());
        }
        assert_eq!(c.flush(), Some("tail"));
        assert_eq!(c.flush(), None);
        let long: Vec<_> = (0..LINE_MAX + 3)
            .filter_map(|_| c.push(b'x').map(str::len))
            .collect();
        assert_eq!(long, [LINE_MAX]);
        // An escape at the end of a full line is not cut in half.
        let mut e = ConsoleLine::new();
        let pieces: Vec<String> = core::iter::repeat_n(b'x', LINE_MAX - 1)
            .chain([0x1b, b'y', b'\n'])
            .filter_map(|b| e.push(b).map(str::to_string))
            .collect();
        assert_eq!(pieces.len(), 2);
        assert!(pieces[0].ends_with("x^["), "{}", pieces[0]);
        assert_eq!(pieces[0].len(), LINE_MAX + 1);
        assert_eq!(pieces[1], "y");
    }

    #[test]
    fn a_prompt_shows_on_focus_and_is_not_repeated_after_it() {
        let mut c = ConsoleLine::new();
        for &b in b"~ # " {
            assert_eq!(c.push(b), None);
        }
        assert_eq!(
            c.begin_live(),
            LiveOutput::Partial {
                text: "~ # ",
                shown: 0
            }
        );
        assert_eq!(
            c.push_live(b'l'),
            LiveOutput::Partial {
                text: "~ # l",
                shown: 4
            }
        );
        c.end_live();
        let mut line = None;
        for &b in b"s\n" {
            line = c.push(b).map(String::from);
        }
        assert_eq!(
            line.as_deref(),
            Some("s"),
            "what was shown live is not kept"
        );
        assert_eq!(c.begin_live(), LiveOutput::Nothing);
    }
}
