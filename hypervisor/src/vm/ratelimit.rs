//! A token bucket for console lines a guest can trigger: a burst of
//! [`BURST`] lines, then about one per [`REFILL_US`]; what it holds back is
//! counted, and the next line that gets through says how many were
//! suppressed. A VM has one bucket per kind of line ([`GuestLines`]), so a
//! flood of one kind does not hide the first lines of another. Plain data,
//! tested on the host.

use super::outbox::Outbox;

/// Lines that may come at once.
pub const BURST: u32 = 10;
/// One more line may come after this long (microseconds).
pub const REFILL_US: u64 = 1_000_000;

#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    tokens: u32,
    /// When the last token was added (or the bucket was created).
    refilled_us: u64,
    /// Lines held back since the last one that got through.
    suppressed: u64,
}

/// The verdict for one line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permit {
    /// Print it; `suppressed` lines were held back before it.
    Print { suppressed: u64 },
    /// Hold it back (counted).
    Suppress,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl RateLimit {
    pub const fn new() -> Self {
        Self {
            tokens: BURST,
            refilled_us: 0,
            suppressed: 0,
        }
    }

    /// Whether a line may be printed at `now_us` (a monotonic clock).
    pub fn check(&mut self, now_us: u64) -> Permit {
        let elapsed = now_us.saturating_sub(self.refilled_us);
        let earned = elapsed / REFILL_US;
        if earned > 0 {
            let room = u64::from(BURST - self.tokens);
            self.tokens += earned.min(room) as u32;
            self.refilled_us = if self.tokens == BURST {
                now_us
            } else {
                self.refilled_us + earned * REFILL_US
            };
        }
        if self.tokens == 0 {
            self.suppressed = self.suppressed.saturating_add(1);
            return Permit::Suppress;
        }
        self.tokens -= 1;
        Permit::Print {
            suppressed: core::mem::take(&mut self.suppressed),
        }
    }

    /// Lines held back and not reported yet.
    pub fn pending_suppressed(&self) -> u64 {
        self.suppressed
    }

    /// Take the count of lines held back (to report it now).
    pub fn take_suppressed(&mut self) -> u64 {
        core::mem::take(&mut self.suppressed)
    }
}

/// The kinds of hypervisor line a guest can trigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineKind {
    /// An exception injected for a bad access.
    Abort,
    /// A device error: NEEDS_RESET and its reason, rejected PFNs.
    DeviceError,
    /// A device event: reset by the driver, driver ready.
    DeviceEvent,
}

/// One VM's buckets, one per [`LineKind`].
#[derive(Clone, Copy, Debug, Default)]
pub struct GuestLines {
    buckets: [RateLimit; 3],
}

impl GuestLines {
    pub const fn new() -> Self {
        Self {
            buckets: [RateLimit::new(); 3],
        }
    }

    /// Whether a line of `kind` may be printed at `now_us`.
    pub fn check(&mut self, kind: LineKind, now_us: u64) -> Permit {
        let slot = match kind {
            LineKind::Abort => 0,
            LineKind::DeviceError => 1,
            LineKind::DeviceEvent => 2,
        };
        self.buckets[slot].check(now_us)
    }

    /// Lines held back in every bucket and not reported yet, taken (a VM
    /// that stops says how many it never got to show).
    pub fn take_suppressed(&mut self) -> u64 {
        self.buckets
            .iter_mut()
            .map(RateLimit::take_suppressed)
            .sum()
    }
}

/// The console lines of one VM that its guest can trigger: said within
/// the VM's rate limit.
pub struct Lines<'a> {
    pub lines: &'a mut GuestLines,
    pub out: &'a mut Outbox,
    pub name: &'a str,
    pub now_us: u64,
}

impl Lines<'_> {
    /// Keep `tidal: [name] <args>` for the console, within the VM's rate
    /// limit; the first line after a quiet spell says how many were held
    /// back.
    pub fn say(&mut self, kind: LineKind, args: core::fmt::Arguments<'_>) {
        match self.lines.check(kind, self.now_us) {
            Permit::Suppress => {}
            Permit::Print { suppressed } => {
                if suppressed > 0 {
                    self.out.line(format_args!(
                        "tidal: [{}] {suppressed} similar messages suppressed",
                        self.name
                    ));
                }
                self.out.line(format_args!("tidal: [{}] {args}", self.name));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_have_their_own_buckets() {
        let mut lines = GuestLines::new();
        for _ in 0..BURST + 5 {
            lines.check(LineKind::DeviceEvent, 0);
        }
        assert_eq!(lines.check(LineKind::DeviceEvent, 0), Permit::Suppress);
        assert_eq!(
            lines.check(LineKind::DeviceError, 0),
            Permit::Print { suppressed: 0 }
        );
        assert_eq!(
            lines.check(LineKind::Abort, 0),
            Permit::Print { suppressed: 0 }
        );
        assert_eq!(lines.take_suppressed(), 6);
        assert_eq!(lines.take_suppressed(), 0);
    }

    #[test]
    fn burst_then_one_per_second_with_a_count() {
        let mut r = RateLimit::new();
        let t0 = 5_000_000;
        for _ in 0..BURST {
            assert_eq!(r.check(t0), Permit::Print { suppressed: 0 });
        }
        for _ in 0..100 {
            assert_eq!(r.check(t0 + 10), Permit::Suppress);
        }
        assert_eq!(r.pending_suppressed(), 100);
        // Not a whole second yet.
        assert_eq!(r.check(t0 + REFILL_US - 1), Permit::Suppress);
        assert_eq!(r.check(t0 + REFILL_US), Permit::Print { suppressed: 101 });
        assert_eq!(r.check(t0 + REFILL_US + 1), Permit::Suppress);
        assert_eq!(r.check(t0 + 2 * REFILL_US), Permit::Print { suppressed: 1 });
    }

    #[test]
    fn a_quiet_spell_refills_up_to_the_burst_only() {
        let mut r = RateLimit::new();
        for _ in 0..BURST {
            r.check(0);
        }
        let later = 3600 * REFILL_US;
        for _ in 0..BURST {
            assert!(matches!(r.check(later), Permit::Print { .. }));
        }
        assert_eq!(r.check(later), Permit::Suppress);
        // A clock that goes backwards earns nothing and does not panic.
        assert_eq!(r.check(0), Permit::Suppress);
    }

    #[test]
    fn a_steady_flood_gets_one_line_a_second() {
        let mut r = RateLimit::new();
        let printed = (0..100_000u64)
            .filter(|i| matches!(r.check(i * 1000), Permit::Print { .. }))
            .count();
        // 100 s of a line every millisecond: the burst plus one a second.
        assert_eq!(printed, BURST as usize + 99);
    }
}
