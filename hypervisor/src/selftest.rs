//! The on-target self-checks' decisions (bundle flag `ON_TARGET_TESTS`,
//! docs/CONFIGURATION.md "On-target tests"), as plain data: which VM plays
//! which part, what each check's observations mean, the balloon round trip
//! as a state machine with its deadline, and the lines printed. The target
//! glue (`ontarget.rs`) reads the VM table and the CPUs, feeds what it saw
//! in here and does what comes back; everything here is host-tested.
//!
//! Every line starts with [`PREFIX`]: `ON-TARGET: ok <name>: ...`,
//! `ON-TARGET: FAILED <name>: ...`, `ON-TARGET: skipped <name>: ...`, and
//! last, exactly, `ON-TARGET: N passed, M failed` ([`Tally`]).

extern crate alloc;

use alloc::format;
use alloc::string::String;
use core::fmt::{self, Write};

use crate::balloon::hint::{HintOutcome, HintRun};

/// What every line of the on-target run starts with.
pub const PREFIX: &str = "ON-TARGET:";

/// The checks, in the order they run.
pub const CHECKS: [&str; 8] = [
    "cpus",
    "memory",
    "isolation",
    "balloon",
    "linux-balloon",
    "linux-reporting",
    "linux-hint",
    "final-check",
];

/// Deadlines, in microseconds.
pub mod deadline {
    /// The wild test guest's bad accesses all counted (it makes them as
    /// soon as it starts).
    pub const ISOLATION_US: u64 = 30_000_000;
    /// A bare-metal guest's balloon: there and back.
    pub const BALLOON_US: u64 = 30_000_000;
    /// Linux booting until its balloon driver is up (TCG on a loaded
    /// machine is the slow case), then there and back.
    pub const LINUX_DRIVER_US: u64 = 120_000_000;
    pub const LINUX_BALLOON_US: u64 = 60_000_000;
    /// Free page reporting's first report (Linux reports 2 s after its
    /// driver registers, and then as pages are freed).
    pub const REPORTING_US: u64 = 60_000_000;
    /// A hinting run, from the request to DONE.
    pub const HINT_US: u64 = 60_000_000;
}

/// The balloon target of the bare-metal round trip: 32 MiB.
pub const BALLOON_PAGES: u32 = 32 << 8;
/// The balloon target of the Linux round trip: 64 MiB.
pub const LINUX_BALLOON_PAGES: u32 = 64 << 8;

/// The part a VM plays in the checks, from its bundle entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The test guest in `wild` mode under the `abort` policy: stage-2
    /// isolation.
    Wild,
    /// The test guest in `pattern` mode with a balloon: the round trip.
    Pattern,
    /// Linux (a command line with `console=`, `root=` or `rdinit=`) with a
    /// balloon: its upstream driver.
    Linux,
    /// None of the above: left alone.
    Other,
}

/// The role of a VM with command line `cmdline`.
pub fn role(cmdline: Option<&str>, has_balloon: bool, abort_policy: bool) -> Role {
    let cmdline = cmdline.unwrap_or("");
    let first = cmdline.split_whitespace().next().unwrap_or("");
    let linux = cmdline.split_whitespace().any(|w| {
        ["console=", "root=", "rdinit="]
            .iter()
            .any(|p| w.starts_with(p))
    });
    match first {
        "wild" if abort_policy => Role::Wild,
        "pattern" if has_balloon => Role::Pattern,
        _ if linux && has_balloon => Role::Linux,
        _ => Role::Other,
    }
}

/// How a check ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Passed(String),
    Failed(String),
    Skipped(String),
}

impl Verdict {
    pub fn from_result(r: Result<String, String>) -> Verdict {
        match r {
            Ok(s) => Verdict::Passed(s),
            Err(s) => Verdict::Failed(s),
        }
    }
}

/// The counts, and the line for each check and the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: u32,
    pub failed: u32,
    pub skipped: u32,
}

impl Tally {
    /// Counts `verdict` and writes its line.
    pub fn record(&mut self, out: &mut impl Write, name: &str, verdict: &Verdict) -> fmt::Result {
        match verdict {
            Verdict::Passed(why) => {
                self.passed += 1;
                writeln!(out, "{PREFIX} ok {name}: {why}")
            }
            Verdict::Failed(why) => {
                self.failed += 1;
                writeln!(out, "{PREFIX} FAILED {name}: {why}")
            }
            Verdict::Skipped(why) => {
                self.skipped += 1;
                writeln!(out, "{PREFIX} skipped {name}: {why}")
            }
        }
    }

    /// The last line, exactly `ON-TARGET: N passed, M failed`.
    pub fn write_summary(&self, out: &mut impl Write) -> fmt::Result {
        writeln!(
            out,
            "{PREFIX} {} passed, {} failed",
            self.passed, self.failed
        )
    }
}

/// `cpus`: each CPU the device tree lists, by MPIDR, and whether it is
/// online (`None`: the hypervisor gave it no index, e.g. past its limit).
pub fn cpus(listed: &[(u64, Option<bool>)]) -> Result<String, String> {
    if listed.is_empty() {
        return Err("the device tree lists no CPU".into());
    }
    let online = listed.iter().filter(|(_, o)| *o == Some(true)).count();
    let mut missing = String::new();
    for (mpidr, o) in listed.iter().filter(|(_, o)| *o != Some(true)) {
        let why = if o.is_none() {
            "no index"
        } else {
            "not online"
        };
        let _ = write!(
            missing,
            "{}MPIDR {mpidr:#x} {why}",
            if missing.is_empty() { "" } else { ", " }
        );
    }
    if missing.is_empty() {
        Ok(format!(
            "{online} of {} CPUs the device tree lists are online",
            listed.len()
        ))
    } else {
        Err(format!(
            "{online} of {} CPUs online: {missing}",
            listed.len()
        ))
    }
}

/// `memory` and `final-check`: the frame table's total against the RAM,
/// and the first line `check` printed.
pub fn memory(accounted: u64, ram: u64, check: &str) -> Result<String, String> {
    let line = check.lines().next().unwrap_or("").trim();
    let check_ok = line.starts_with("check: ok");
    match (accounted == ram, check_ok) {
        (true, true) => Ok(format!("accounting = RAM ({ram} bytes); {line}")),
        (false, _) => Err(format!(
            "the frame table accounts for {accounted} bytes, RAM is {ram}; {line}"
        )),
        (true, false) => Err(check
            .trim_end()
            .lines()
            .collect::<alloc::vec::Vec<_>>()
            .join("; ")),
    }
}

/// Bad accesses the test guest's `wild` mode makes: three to its balloon's
/// registers (when it has one), one to the GIC distributor, and an unmapped
/// read, an unmapped write and a fetch outside RAM.
pub fn wild_accesses(has_balloon: bool) -> u64 {
    if has_balloon {
        7
    } else {
        4
    }
}

/// What the isolation check sees of the wild VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WildObs {
    pub running: bool,
    /// Exceptions injected for its bad accesses.
    pub injected: u64,
    /// Pages its stage-2 tables map, and its RAM in pages.
    pub mapped: u64,
    pub ram_pages: u64,
}

/// Whether to stop waiting on the wild VM: once it stopped or all its bad
/// accesses are counted.
pub fn wild_settled(obs: &WildObs, expected: u64) -> bool {
    !obs.running || obs.injected >= expected
}

/// `isolation`, once the wild VM settled or the deadline passed: it must
/// have had every bad access refused and counted and still run, having
/// mapped no more than its RAM; `others_down` names the other started VMs
/// no longer running; `check` is what `check` printed.
pub fn isolation(
    name: &str,
    obs: &WildObs,
    expected: u64,
    others_down: &str,
    check: &str,
) -> Result<String, String> {
    let line = check.lines().next().unwrap_or("").trim();
    if !obs.running {
        return Err(format!(
            "{name} stopped after {} of {expected} bad accesses",
            obs.injected
        ));
    }
    if obs.injected < expected {
        return Err(format!(
            "{name}: {} of {expected} bad accesses refused in time",
            obs.injected
        ));
    }
    if obs.mapped > obs.ram_pages {
        return Err(format!(
            "{name} maps {} pages, more than its {} pages of RAM",
            obs.mapped, obs.ram_pages
        ));
    }
    if !others_down.is_empty() {
        return Err(format!("other VMs not running: {others_down}"));
    }
    if !line.starts_with("check: ok") {
        return Err(format!("after {name}'s bad accesses: {line}"));
    }
    Ok(format!(
        "{name}: {} bad accesses refused with an abort, still running, {} of {} pages mapped; the other VMs run; check ok",
        obs.injected, obs.mapped, obs.ram_pages
    ))
}

/// What a balloon round trip sees of its VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BalloonObs {
    pub running: bool,
    /// The driver set DRIVER_OK and the device does not need a reset.
    pub driver: bool,
    pub actual: u32,
}

/// What the glue does next for a round trip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Set the balloon target to this many pages.
    Set(u32),
    /// Look again later.
    Wait,
    /// Finished.
    Done(Result<String, String>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Driver,
    Inflate,
    Deflate,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Phase::Driver => "waiting for the balloon driver",
            Phase::Inflate => "inflating",
            Phase::Deflate => "deflating",
        }
    }
}

/// A balloon round trip: wait for the driver (deadline `driver_us`), set
/// the target to `pages`, wait until `actual` reaches it, set 0, wait
/// until `actual` is 0 (deadline `balloon_us` for both moves), the VM
/// running throughout.
#[derive(Clone, Copy, Debug)]
pub struct RoundTrip {
    pages: u32,
    phase: Phase,
    since_us: u64,
    driver_us: u64,
    balloon_us: u64,
    driver_at_us: u64,
    inflated_at_us: u64,
}

impl RoundTrip {
    pub fn new(pages: u32, now_us: u64, driver_us: u64, balloon_us: u64) -> Self {
        RoundTrip {
            pages,
            phase: Phase::Driver,
            since_us: now_us,
            driver_us,
            balloon_us,
            driver_at_us: now_us,
            inflated_at_us: now_us,
        }
    }

    pub fn step(&mut self, obs: &BalloonObs, now_us: u64) -> Step {
        if !obs.running {
            return Step::Done(Err(format!(
                "the VM stopped while {} (actual {} pages)",
                self.phase.label(),
                obs.actual
            )));
        }
        let ms = |us: u64| us / 1000;
        match self.phase {
            Phase::Driver if obs.driver => {
                self.phase = Phase::Inflate;
                self.driver_at_us = now_us;
                return Step::Set(self.pages);
            }
            Phase::Driver if now_us.saturating_sub(self.since_us) >= self.driver_us => {
                return Step::Done(Err(format!(
                    "no balloon driver within {} s",
                    self.driver_us / 1_000_000
                )));
            }
            Phase::Inflate if obs.actual == self.pages => {
                self.phase = Phase::Deflate;
                self.inflated_at_us = now_us;
                return Step::Set(0);
            }
            Phase::Deflate if obs.actual == 0 => {
                return Step::Done(Ok(format!(
                    "target {} pages reached in {} ms, back to 0 in {} ms, still running",
                    self.pages,
                    ms(self.inflated_at_us - self.driver_at_us),
                    ms(now_us.saturating_sub(self.inflated_at_us))
                )));
            }
            Phase::Inflate | Phase::Deflate
                if now_us.saturating_sub(self.driver_at_us) >= self.balloon_us =>
            {
                let target = if self.phase == Phase::Inflate {
                    self.pages
                } else {
                    0
                };
                return Step::Done(Err(format!(
                    "{}: actual {} pages, target {target}, after {} s",
                    self.phase.label(),
                    obs.actual,
                    self.balloon_us / 1_000_000
                )));
            }
            _ => {}
        }
        Step::Wait
    }
}

/// Whether the Linux checks run, from whether its VM started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinuxStart {
    Run,
    Skip(String),
    Fail(String),
}

/// Room the hypervisor keeps for itself besides the guests' guarantees
/// (image, heap, frame table, stage-2 tables, the pool's floor).
pub const HYPERVISOR_RESERVE: u64 = 96 << 20;

/// The Linux VM `started` or not; `ram` the board's RAM, `guaranteed` what
/// every VM of the bundle is guaranteed together. A VM that did not start
/// on a board too small for the bundle is skipped with the figures; one
/// that did not start although the bundle fits failed.
pub fn linux_start(started: bool, ram: u64, guaranteed: u64) -> LinuxStart {
    const MIB: u64 = 1 << 20;
    let need = guaranteed + HYPERVISOR_RESERVE;
    match (started, ram >= need) {
        (true, _) => LinuxStart::Run,
        (false, false) => LinuxStart::Skip(format!(
            "the board has {} MiB of RAM; the bundle's VMs need {} MiB and the hypervisor about {} MiB",
            ram / MIB,
            guaranteed / MIB,
            HYPERVISOR_RESERVE / MIB
        )),
        (false, true) => LinuxStart::Fail(format!(
            "the Linux VM did not start although the board has {} MiB of RAM for {} MiB of guests",
            ram / MIB,
            guaranteed / MIB
        )),
    }
}

/// `linux-reporting`: the pages reported, from `before` to `now`.
pub fn reporting(before: u64, now: u64) -> Option<String> {
    (now > before).then(|| format!("pages reported grew from {before} to {now}"))
}

/// `linux-hint`: run `id` as the device has it (`None`: no run yet).
/// `None` while it is still going.
pub fn hint(id: u32, run: Option<&HintRun>) -> Option<Result<String, String>> {
    let run = run.filter(|r| r.id == id)?;
    match run.outcome {
        HintOutcome::Running => None,
        HintOutcome::Done => Some(Ok(format!("{run}"))),
        _ => Some(Err(format!("{run}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hint_waits_for_its_own_run_to_end() {
        let mut run = HintRun {
            id: 5,
            started_us: 0,
            answered_us: Some(10),
            ended_us: None,
            outcome: HintOutcome::Running,
            blocks: 3,
            pages_hinted: 1536,
            pages_reused: 0,
        };
        assert_eq!(hint(5, None), None);
        assert_eq!(hint(5, Some(&run)), None);
        assert_eq!(hint(6, Some(&run)), None);
        run.outcome = HintOutcome::Done;
        run.ended_us = Some(2_000_000);
        assert!(matches!(
            hint(5, Some(&run)),
            Some(Ok(s)) if s.starts_with("run 5 done: 1536 pages hinted in 3 blocks")
        ));
        run.outcome = HintOutcome::Reset;
        assert!(matches!(hint(5, Some(&run)), Some(Err(_))));
    }

    #[test]
    fn roles_from_the_command_line() {
        let linux = Some("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet");
        assert_eq!(role(Some("wild"), true, true), Role::Wild);
        assert_eq!(role(Some("wild"), true, false), Role::Other);
        assert_eq!(role(Some("pattern"), true, true), Role::Pattern);
        assert_eq!(role(Some("pattern"), false, true), Role::Other);
        assert_eq!(role(None, true, true), Role::Other);
        assert_eq!(role(linux, true, true), Role::Linux);
        assert_eq!(role(linux, false, true), Role::Other);
        assert_eq!(role(Some("root=/dev/vda"), true, false), Role::Linux);
        assert_eq!(role(Some("features"), true, true), Role::Other);
    }

    #[test]
    fn lines_and_summary() {
        let mut t = Tally::default();
        let mut out = String::new();
        t.record(&mut out, "cpus", &Verdict::Passed("4 of 4".into()))
            .unwrap();
        t.record(&mut out, "balloon", &Verdict::Failed("stuck".into()))
            .unwrap();
        t.record(&mut out, "linux-hint", &Verdict::Skipped("no RAM".into()))
            .unwrap();
        t.write_summary(&mut out).unwrap();
        assert_eq!(
            out,
            "ON-TARGET: ok cpus: 4 of 4\nON-TARGET: FAILED balloon: stuck\n\
             ON-TARGET: skipped linux-hint: no RAM\nON-TARGET: 1 passed, 1 failed\n"
        );
        assert_eq!(t.skipped, 1);
    }

    #[test]
    fn every_listed_cpu_must_be_online() {
        assert_eq!(
            cpus(&[(0, Some(true)), (1, Some(true))]),
            Ok("2 of 2 CPUs the device tree lists are online".into())
        );
        assert_eq!(
            cpus(&[(0, Some(true)), (1, Some(false)), (0x100, None)]),
            Err("1 of 3 CPUs online: MPIDR 0x1 not online, MPIDR 0x100 no index".into())
        );
        assert!(cpus(&[]).is_err());
    }

    #[test]
    fn memory_needs_both_the_sum_and_check() {
        let ok = "check: ok (RAM 10 pages = ...)\n";
        assert!(memory(40960, 40960, ok).unwrap().contains("check: ok"));
        assert!(memory(4096, 40960, ok).is_err());
        assert_eq!(
            memory(40960, 40960, "check: FAILED: a\ncheck: FAILED: b\n"),
            Err("check: FAILED: a; check: FAILED: b".into())
        );
    }

    #[test]
    fn isolation_verdicts() {
        let good = WildObs {
            running: true,
            injected: 7,
            mapped: 16384,
            ram_pages: 16384,
        };
        let ok = "check: ok (...)";
        assert!(wild_settled(&good, 7));
        assert!(!wild_settled(
            &WildObs {
                injected: 6,
                ..good
            },
            7
        ));
        assert!(wild_settled(
            &WildObs {
                running: false,
                ..good
            },
            7
        ));
        assert!(isolation("wild", &good, 7, "", ok).is_ok());
        let err = |o: WildObs, down: &str, check: &str| {
            isolation("wild", &o, 7, down, check).unwrap_err()
        };
        assert!(err(
            WildObs {
                injected: 3,
                ..good
            },
            "",
            ok
        )
        .contains("3 of 7"));
        assert!(err(
            WildObs {
                running: false,
                ..good
            },
            "",
            ok
        )
        .contains("stopped"));
        assert!(err(
            WildObs {
                mapped: 16385,
                ..good
            },
            "",
            ok
        )
        .contains("more than"));
        assert!(err(good, "beta", ok).contains("beta"));
        assert!(err(good, "", "check: FAILED: x").contains("FAILED"));
        assert_eq!(wild_accesses(true), 7);
        assert_eq!(wild_accesses(false), 4);
    }

    fn obs(running: bool, driver: bool, actual: u32) -> BalloonObs {
        BalloonObs {
            running,
            driver,
            actual,
        }
    }

    #[test]
    fn round_trip_there_and_back() {
        let mut rt = RoundTrip::new(100, 0, 1_000, 5_000);
        assert_eq!(rt.step(&obs(true, false, 0), 10), Step::Wait);
        assert_eq!(rt.step(&obs(true, true, 0), 20), Step::Set(100));
        assert_eq!(rt.step(&obs(true, true, 50), 1_020), Step::Wait);
        assert_eq!(rt.step(&obs(true, true, 100), 2_020), Step::Set(0));
        assert_eq!(rt.step(&obs(true, true, 40), 3_020), Step::Wait);
        match rt.step(&obs(true, true, 0), 4_020) {
            Step::Done(Ok(s)) => assert_eq!(
                s,
                "target 100 pages reached in 2 ms, back to 0 in 2 ms, still running"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn round_trip_deadlines_and_stops() {
        let mut rt = RoundTrip::new(100, 0, 1_000, 5_000);
        assert_eq!(
            rt.step(&obs(true, false, 0), 1_000),
            Step::Done(Err("no balloon driver within 0 s".into()))
        );
        let mut rt = RoundTrip::new(100, 0, 1_000, 5_000_000);
        assert_eq!(rt.step(&obs(true, true, 0), 10), Step::Set(100));
        assert_eq!(rt.step(&obs(true, true, 7), 4_000_000), Step::Wait);
        assert_eq!(
            rt.step(&obs(true, true, 7), 5_000_010),
            Step::Done(Err(
                "inflating: actual 7 pages, target 100, after 5 s".into()
            ))
        );
        let mut rt = RoundTrip::new(100, 0, 1_000, 5_000);
        assert!(matches!(
            rt.step(&obs(false, true, 0), 1),
            Step::Done(Err(e)) if e.contains("stopped while waiting")
        ));
    }

    #[test]
    fn linux_runs_skips_or_fails_by_ram() {
        const MIB: u64 = 1 << 20;
        assert_eq!(linux_start(true, 64 * MIB, 1024 * MIB), LinuxStart::Run);
        assert!(matches!(
            linux_start(false, 512 * MIB, 576 * MIB),
            LinuxStart::Skip(s) if s.starts_with("the board has 512 MiB of RAM; the bundle's VMs need 576 MiB")
        ));
        assert!(matches!(
            linux_start(false, 1984 * MIB, 576 * MIB),
            LinuxStart::Fail(_)
        ));
    }

    #[test]
    fn reporting_must_grow() {
        assert_eq!(reporting(0, 0), None);
        assert_eq!(
            reporting(0, 512),
            Some("pages reported grew from 0 to 512".into())
        );
    }
}
