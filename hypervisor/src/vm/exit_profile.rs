//! A VM's exit profile: per kind of exit ([`ExitKind`]: the device a data
//! abort was for, a stage-2 fault backing RAM, a system register, HVC, SMC,
//! WFI, WFE, a physical interrupt by source, anything else), how many exits
//! and the hypervisor (EL2) instructions they cost, world switch included.
//! `handle::after_exit` records every exit ([`ExitProfile::record`]: an
//! index and two adds), `handle::fast_exit` those of the fast paths (each
//! from the previous record to its own: unlock, world switch and trap
//! included; an interrupt exit from its vector on, see `crate::run`);
//! `info exits <vm>` prints the table
//! ([`ExitProfile::write_table`]), `info exits <vm> reset` starts it over.
//! It starts over when the VM starts, too.

use core::fmt;

use super::fault::Device;

/// What an exit was, for the profile (finer than `VcpuExit`: a data abort
/// is split by the device it addresses, a physical interrupt by its source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitKind {
    /// A load or store (with a full syndrome) to the virtio-mmio window,
    /// other than a notify.
    MmioVirtio,
    /// A store to the virtio-mmio window's QueueNotify: the device's work
    /// on the queue is in it (a notify with nothing queued costs the trap
    /// and the look at the ring).
    VirtioNotify,
    /// ... to the GIC distributor.
    MmioGicd,
    /// ... to a GICv3 redistributor.
    MmioGicr,
    /// ... to the PL011.
    MmioUart,
    /// A data abort or instruction fetch that is no device access and no
    /// RAM to back: an unmapped address, a device access without a
    /// syndrome, a permission fault on RAM (a bad access, as `vm::fault`
    /// counts them, or the VM stopped by its policy).
    BadAccess,
    /// A translation fault on RAM not backed (yet, or any more): backed.
    Stage2Fault,
    /// A trapped system register access (the GICv3 SGI registers).
    SysReg,
    Hvc,
    Smc,
    Wfi,
    Wfe,
    /// A physical interrupt while the guest ran: the hypervisor's kick SGI
    /// (another CPU wants this vCPU to sync its list registers, or to stop).
    IrqKick,
    /// ... the GIC maintenance interrupt (list registers drained).
    IrqMaintenance,
    /// ... the guest's virtual timer, passed on to it.
    VTimer,
    /// ... the hypervisor's EL2 timer.
    El2Timer,
    /// ... any other INTID, or none pending any more (spurious).
    IrqOther,
    /// An exit the hypervisor does not handle (unknown syndrome).
    Other,
}

/// How many kinds there are.
pub const KINDS: usize = ExitKind::ALL.len();

impl ExitKind {
    /// Every kind, in the order of the table.
    pub const ALL: [ExitKind; 18] = [
        ExitKind::MmioVirtio,
        ExitKind::VirtioNotify,
        ExitKind::MmioGicd,
        ExitKind::MmioGicr,
        ExitKind::MmioUart,
        ExitKind::BadAccess,
        ExitKind::Stage2Fault,
        ExitKind::SysReg,
        ExitKind::Hvc,
        ExitKind::Smc,
        ExitKind::Wfi,
        ExitKind::Wfe,
        ExitKind::IrqKick,
        ExitKind::IrqMaintenance,
        ExitKind::VTimer,
        ExitKind::El2Timer,
        ExitKind::IrqOther,
        ExitKind::Other,
    ];

    /// Its name in the table (one word: scripts split the rows on spaces).
    pub fn label(self) -> &'static str {
        match self {
            ExitKind::MmioVirtio => "mmio-virtio",
            ExitKind::VirtioNotify => "virtio-notify",
            ExitKind::MmioGicd => "mmio-gicd",
            ExitKind::MmioGicr => "mmio-gicr",
            ExitKind::MmioUart => "mmio-uart",
            ExitKind::BadAccess => "bad-access",
            ExitKind::Stage2Fault => "stage2-fault",
            ExitKind::SysReg => "sysreg",
            ExitKind::Hvc => "hvc",
            ExitKind::Smc => "smc",
            ExitKind::Wfi => "wfi",
            ExitKind::Wfe => "wfe",
            ExitKind::IrqKick => "irq-kick",
            ExitKind::IrqMaintenance => "irq-maint",
            ExitKind::VTimer => "irq-vtimer",
            ExitKind::El2Timer => "irq-el2timer",
            ExitKind::IrqOther => "irq-other",
            ExitKind::Other => "other",
        }
    }

    /// A load or store with a syndrome to `device`'s window, or to no
    /// device at all (`None`: a bad access).
    #[inline]
    pub fn mmio(device: Option<Device>) -> ExitKind {
        match device {
            Some(Device::Virtio) => ExitKind::MmioVirtio,
            Some(Device::GicDistributor) => ExitKind::MmioGicd,
            Some(Device::GicRedistributor) => ExitKind::MmioGicr,
            Some(Device::Uart) => ExitKind::MmioUart,
            None => ExitKind::BadAccess,
        }
    }

    /// Whether it is a data abort on a device window (the `MMIO` of
    /// `info balloon`'s exit line).
    pub fn is_mmio(self) -> bool {
        matches!(
            self,
            ExitKind::MmioVirtio
                | ExitKind::VirtioNotify
                | ExitKind::MmioGicd
                | ExitKind::MmioGicr
                | ExitKind::MmioUart
        )
    }
}

/// One kind's exits and what they cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub count: u64,
    /// EL2 instructions (0 where the PMU does not count them).
    pub instructions: u64,
}

/// Per kind of exit, the exits and their EL2 instructions since
/// `since_us` (the VM's start, or the last reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitProfile {
    tallies: [Tally; KINDS],
    /// Uptime (µs) when it started counting.
    pub since_us: u64,
    /// Uptime when the VM stopped, if it did since: rates are up to then.
    pub until_us: Option<u64>,
}

impl Default for ExitProfile {
    fn default() -> Self {
        Self::new(0)
    }
}

impl ExitProfile {
    /// An empty profile counting from `now_us`.
    pub const fn new(now_us: u64) -> Self {
        Self {
            tallies: [Tally {
                count: 0,
                instructions: 0,
            }; KINDS],
            since_us: now_us,
            until_us: None,
        }
    }

    /// One exit of `kind` that cost `instructions`. On every exit's path:
    /// an index (no bounds check: `kind` is below [`KINDS`]) and two adds,
    /// wrapping (64 bits do not wrap in any run) so there is no overflow
    /// check either.
    #[inline(always)]
    pub fn record(&mut self, kind: ExitKind, instructions: u64) {
        let tally = &mut self.tallies[kind as usize];
        tally.count = tally.count.wrapping_add(1);
        tally.instructions = tally.instructions.wrapping_add(instructions);
    }

    /// Start over at `now_us`.
    pub fn reset(&mut self, now_us: u64) {
        *self = Self::new(now_us);
    }

    /// The VM stopped at `now_us`: rates are up to then.
    pub fn stopped(&mut self, now_us: u64) {
        self.until_us = Some(now_us);
    }

    pub fn get(&self, kind: ExitKind) -> Tally {
        self.tallies[kind as usize]
    }

    /// All kinds together.
    pub fn total(&self) -> Tally {
        self.tallies.iter().fold(Tally::default(), |t, k| Tally {
            count: t.count + k.count,
            instructions: t.instructions + k.instructions,
        })
    }

    /// The exits of the kinds `pick` selects.
    pub fn count_where(&self, pick: impl Fn(ExitKind) -> bool) -> u64 {
        ExitKind::ALL
            .iter()
            .filter(|&&k| pick(k))
            .map(|&k| self.get(k).count)
            .sum()
    }

    /// Microseconds counted over, at `now_us`.
    pub fn elapsed_us(&self, now_us: u64) -> u64 {
        self.until_us
            .unwrap_or(now_us)
            .saturating_sub(self.since_us)
    }

    /// The `info exits` table of VM `name` at `now_us`: per kind the
    /// exits, their share of all exits, exits per second, EL2 instructions
    /// in all and per exit (`-` for both where the PMU does not count
    /// `instructions`), then the total.
    pub fn write_table(
        &self,
        name: &str,
        now_us: u64,
        instructions: bool,
        out: &mut impl fmt::Write,
    ) -> fmt::Result {
        let elapsed = self.elapsed_us(now_us);
        let total = self.total();
        writeln!(
            out,
            "{name}: {} exits in {} s{}",
            total.count,
            Fixed(u128::from(elapsed), 1_000_000, 3),
            if self.until_us.is_some() {
                " (until the VM stopped)"
            } else {
                ""
            }
        )?;
        writeln!(
            out,
            "  {:<12} {:>10} {:>6} {:>9} {:>14} {:>10}",
            "kind", "exits", "share", "per s", "EL2 instr", "instr/exit"
        )?;
        let row = |out: &mut dyn fmt::Write, label: &str, t: Tally| {
            let share = Fixed(u128::from(t.count) * 100, u128::from(total.count.max(1)), 1);
            let rate = Fixed(
                u128::from(t.count) * 1_000_000,
                u128::from(elapsed.max(1)),
                1,
            );
            let (insns, each) = match (instructions, t.count) {
                (false, _) => (Cell::Dash, Cell::Dash),
                (true, 0) => (Cell::Num(t.instructions), Cell::Dash),
                (true, n) => (Cell::Num(t.instructions), Cell::Num(t.instructions / n)),
            };
            writeln!(
                out,
                "  {label:<12} {:>10} {:>5}% {:>9} {:>14} {:>10}",
                t.count, share, rate, insns, each
            )
        };
        for kind in ExitKind::ALL {
            row(out, kind.label(), self.get(kind))?;
        }
        row(out, "total", total)
    }
}

/// `num / den` with `decimals` decimals, rounded down.
struct Fixed(u128, u128, u32);

impl fmt::Display for Fixed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Fixed(num, den, decimals) = *self;
        let scale = 10u128.pow(decimals);
        let scaled = num * scale / den.max(1);
        let text = FixedText::new(scaled / scale, scaled % scale, decimals as usize);
        f.pad(text.as_str())
    }
}

/// A fixed-point number rendered to a small buffer, so `Fixed` can pad it.
struct FixedText {
    buf: [u8; 48],
    len: usize,
}

impl FixedText {
    fn new(whole: u128, frac: u128, decimals: usize) -> Self {
        let mut t = FixedText {
            buf: [0; 48],
            len: 0,
        };
        let _ = fmt::Write::write_fmt(&mut t, format_args!("{whole}"));
        if decimals > 0 {
            let _ = fmt::Write::write_fmt(&mut t, format_args!(".{frac:0decimals$}"));
        }
        t
    }

    fn as_str(&self) -> &str {
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("?")
    }
}

impl fmt::Write for FixedText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let dst = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        dst.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// A number, or `-` where there is none.
enum Cell {
    Num(u64),
    Dash,
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cell::Num(n) => fmt::Display::fmt(n, f),
            Cell::Dash => f.pad("-"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_index_their_slots() {
        for (i, kind) in ExitKind::ALL.iter().enumerate() {
            assert_eq!(*kind as usize, i, "{kind:?}");
            assert!(!kind.label().contains(' '));
        }
        assert_eq!(KINDS, 18);
        assert!(ExitKind::VirtioNotify.is_mmio());
        assert_eq!(ExitKind::mmio(None), ExitKind::BadAccess);
        assert_eq!(ExitKind::mmio(Some(Device::Uart)), ExitKind::MmioUart);
        assert!(ExitKind::MmioGicr.is_mmio() && !ExitKind::BadAccess.is_mmio());
    }

    #[test]
    fn records_resets_and_formats() {
        let mut p = ExitProfile::new(1_000_000);
        for _ in 0..3 {
            p.record(ExitKind::Wfi, 1000);
        }
        p.record(ExitKind::MmioUart, 2500);
        assert_eq!(
            p.get(ExitKind::Wfi),
            Tally {
                count: 3,
                instructions: 3000
            }
        );
        assert_eq!(p.total().count, 4);
        assert_eq!(p.count_where(ExitKind::is_mmio), 1);
        let mut s = String::new();
        p.write_table("linux", 3_000_000, true, &mut s).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "linux: 4 exits in 2.000 s");
        assert_eq!(
            lines[1],
            "  kind              exits  share     per s      EL2 instr instr/exit"
        );
        assert_eq!(
            lines[1 + 5],
            "  mmio-uart             1  25.0%       0.5           2500       2500"
        );
        assert_eq!(
            lines[1 + 11],
            "  wfi                   3  75.0%       1.5           3000       1000"
        );
        assert_eq!(
            lines[1 + 1],
            "  mmio-virtio           0   0.0%       0.0              0          -"
        );
        assert_eq!(
            *lines.last().unwrap(),
            "  total                 4 100.0%       2.0           5500       1375"
        );
        assert_eq!(lines.len(), 2 + KINDS + 1);

        // Without the PMU: no instruction columns. Stopped: rates up to then.
        p.stopped(2_000_000);
        let mut s = String::new();
        p.write_table("linux", 9_000_000, false, &mut s).unwrap();
        assert!(s.starts_with("linux: 4 exits in 1.000 s (until the VM stopped)\n"));
        assert!(
            s.contains("\n  wfi                   3  75.0%       3.0              -          -\n")
        );

        p.reset(5_000_000);
        assert_eq!(p, ExitProfile::new(5_000_000));
        let mut s = String::new();
        p.write_table("linux", 5_000_000, true, &mut s).unwrap();
        assert!(s.starts_with("linux: 0 exits in 0.000 s\n"));
        assert!(
            s.ends_with("\n  total                 0   0.0%       0.0              0          -\n")
        );
    }

    #[test]
    fn fixed_point() {
        assert_eq!(format!("{}", Fixed(1, 3, 3)), "0.333");
        assert_eq!(format!("{:>7}", Fixed(2, 1, 1)), "    2.0");
        assert_eq!(format!("{}", Fixed(5, 0, 0)), "5");
        assert_eq!(
            format!("{}", Fixed(u128::from(u64::MAX) * 100, 1, 1)),
            "1844674407370955161500.0"
        );
    }
}
