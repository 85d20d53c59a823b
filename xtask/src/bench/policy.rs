//! `cargo xtask bench policy [--rounds N]`: the memory manager under
//! overcommit against its baselines. Three 1 GiB Linux VMs and the
//! bare-metal `beta` on a 2 GiB virt board (guests/tests/overcommit-full.toml:
//! over 3 GiB committed, the demo's balloon features on), page cache in
//! every Linux guest (an 80 MiB file read through an ext2 loop mount), and a
//! 700 MiB `tidal-mem hog` that moves from `vma` to `vmb` to `vmc` while the
//! other two churn memory ([`harness::linux::hog_phase`], the driver
//! tests/tests/overcommit.rs uses too). The same workload runs under:
//!
//! - `manager`: the memory manager;
//! - `reporting-only`: no controller (`mm policy none`), free page
//!   reporting and hinting alone;
//! - `naive`: the simulation's naive controller (`mm policy naive`);
//! - `static`: static partitions that fit (overcommit-static.toml: 3 × 600
//!   MiB, `mm policy none`: no balloon moves), where the hog cannot get its
//!   memory.
//!
//! Each [`ROUNDS`] times (`--rounds N`), the configurations taking turns, so
//! that the host's drift falls on all of them. Per phase: whether it
//! completed (the hog touched all its memory and exited with 0), the time
//! from sending the hog's request to its `hog: touched` line (the demand
//! met), the pages moved (growth of every VM's `reclaimed` and `given` in
//! `mm raw`, and what the guests returned by reporting and hinting), the
//! vCPU waits for a frame over 100 ms and the longest, and the guests' OOM
//! kills. Wall time under QEMU TCG.
//!
//! Results: a table per run and a summary over the rounds (median and
//! spread) on stdout; target/bench/policy.json (every run, with every `mm
//! raw` sample, and the summary); a plot per run,
//! target/bench/policy-CONFIG-ROUND.svg (each VM's backed memory and the
//! free pool over time, phases marked).

use std::path::Path;
use std::time::{Duration, Instant};

use harness::linux::{
    agent_run, hog_phase, mm_raw, oom_kills, wait_for_agents, HogOutcome, HogPhase,
};
use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};
use serde::Serialize;

use super::svg::{line_chart, Chart, Series};
use crate::json;
use harness::linux::overcommit::{
    BETA, BOOT, CACHE_SETUP, CHURN_MIB, HOG_MIB, HOLD_S, LINUX, PHASE, SETTLE,
};

const SAMPLE_EVERY: Duration = Duration::from_millis(500);
const COMMAND: Duration = Duration::from_secs(30);
/// Whole-session limit: QEMU is killed after this whatever happens.
const SESSION: Duration = Duration::from_secs(2400);
const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;
/// Runs of each configuration (`--rounds N`).
pub const ROUNDS: usize = 3;
/// A wait for a frame longer than this misses the manager's goal (the
/// hypervisor's `vm::manage::SLOW_WAIT_US`).
const SLOW_WAIT_MS: u64 = 100;

/// One configuration: JSON name, bundle (`guests/tests/<bundle>.toml`),
/// the `mm policy` set after boot, and each
/// Linux VM's RAM and beta's, in MiB.
struct Config {
    name: &'static str,
    bundle: &'static str,
    policy: &'static str,
    linux_mib: u64,
    beta_mib: u64,
}

const MANAGER: Config = Config {
    name: "manager",
    bundle: "overcommit-full",
    policy: "manager",
    linux_mib: 1024,
    beta_mib: 128,
};
const REPORTING_ONLY: Config = Config {
    name: "reporting-only",
    policy: "none",
    ..MANAGER
};
const NAIVE: Config = Config {
    name: "naive",
    policy: "naive",
    ..MANAGER
};
const STATIC: Config = Config {
    name: "static",
    bundle: "overcommit-static",
    policy: "none",
    linux_mib: 600,
    beta_mib: 64,
};
/// The manager first, then its baselines.
const CONFIGS: [&Config; 4] = [&MANAGER, &REPORTING_ONLY, &NAIVE, &STATIC];

/// One phase; an entry of a run's `phases`.
#[derive(Serialize)]
struct PhaseReport {
    phase: usize,
    hog_vm: &'static str,
    completed: bool,
    /// The hog's exit status; `null`: no `done` line within the timeout.
    rc: Option<u32>,
    /// From the hog's request to `hog: touched`; `null`: never.
    demand_met_s: Option<f64>,
    pages_moved: u64,
    /// Pages the guests gave back by free page reporting and hinting, and
    /// pages the manager asked back through the balloons (of them, fenced:
    /// untouched pages the board could not have backed), over the phase.
    pages_returned_by_guests: u64,
    pages_reclaimed_by_manager: u64,
    pages_fenced: u64,
    /// vCPU waits for a frame over 100 ms that ended in the phase.
    waits_over_100ms: u64,
    /// The longest wait that ended in the phase when it was the longest
    /// its VM had had (exact); `null`: every wait was shorter than an
    /// earlier one (`waits_over_100ms` says whether any was slow).
    longest_new_wait_ms: Option<f64>,
    /// OOM kills in the Linux guests during the phase.
    oom_kills: usize,
    /// When the hog's request was sent and when the phase ended, from the
    /// first phase's start.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    start_s: f64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    end_s: f64,
    #[serde(serialize_with = "json::ordered_map")]
    churn_iterations: Vec<(String, u64)>,
    /// The harness could not drive the phase (the run ends there).
    error: Option<String>,
}

impl PhaseReport {
    fn new(phase: usize, hog_vm: &'static str, outcome: &HogOutcome, oom_kills: usize) -> Self {
        PhaseReport {
            phase,
            hog_vm,
            completed: outcome.completed(),
            rc: outcome.rc,
            demand_met_s: outcome.demand_met_s.map(|s| json::rounded(s, 3)),
            pages_moved: outcome.pages_moved(),
            pages_returned_by_guests: outcome.growth(|v| v.returned),
            pages_reclaimed_by_manager: outcome.growth(|v| v.reclaimed),
            pages_fenced: outcome.growth(|v| v.fenced),
            waits_over_100ms: outcome.growth(|v| v.waits_slow),
            longest_new_wait_ms: outcome
                .longest_new_wait_us()
                .map(|us| json::rounded(us as f64 / 1000.0, 1)),
            oom_kills,
            start_s: outcome.start_s,
            end_s: outcome.end_s,
            churn_iterations: outcome.churn_iterations.clone(),
            error: None,
        }
    }

    fn failed(phase: usize, hog_vm: &'static str, error: String) -> Self {
        PhaseReport {
            phase,
            hog_vm,
            completed: false,
            rc: None,
            demand_met_s: None,
            pages_moved: 0,
            pages_returned_by_guests: 0,
            pages_reclaimed_by_manager: 0,
            pages_fenced: 0,
            waits_over_100ms: 0,
            longest_new_wait_ms: None,
            oom_kills: 0,
            start_s: f64::NAN,
            end_s: f64::NAN,
            churn_iterations: Vec::new(),
            error: Some(error),
        }
    }
}

/// One guest over a whole run.
#[derive(Serialize)]
struct GuestReport {
    name: &'static str,
    oom_kills: usize,
    stopped: bool,
    /// Its longest wait for a frame over the run (`mm raw`).
    #[serde(serialize_with = "json::decimals::<1, _>")]
    longest_wait_ms: f64,
}

/// One `mm raw` sample, in pages.
#[derive(Serialize)]
struct SampleReport {
    #[serde(serialize_with = "json::decimals::<3, _>")]
    t_s: f64,
    pool_free_pages: u64,
    #[serde(serialize_with = "json::ordered_map")]
    backed_pages: Vec<(String, u64)>,
    /// Per VM, its balloon's target and actual size.
    #[serde(serialize_with = "json::ordered_map")]
    target_pages: Vec<(String, u64)>,
    #[serde(serialize_with = "json::ordered_map")]
    balloon_pages: Vec<(String, u64)>,
}

impl SampleReport {
    fn of(sample: &harness::linux::MmSample) -> Self {
        let per_vm = |f: fn(&harness::console::MmVm) -> u64| {
            sample
                .report
                .vms
                .iter()
                .map(|v| (v.name.clone(), f(v)))
                .collect()
        };
        SampleReport {
            t_s: sample.t_s,
            pool_free_pages: sample.report.pool.free,
            backed_pages: per_vm(|v| v.backed),
            target_pages: per_vm(|v| v.target),
            balloon_pages: per_vm(|v| v.balloon),
        }
    }
}

/// One boot of one configuration.
#[derive(Serialize)]
struct RunReport {
    config: &'static str,
    /// 1-based.
    round: usize,
    bundle: String,
    /// The `mm policy` in force.
    policy: &'static str,
    /// From the first `mm raw`: the pages the frame table manages, and
    /// all VMs' RAM together.
    total_pages: u64,
    committed_pages: u64,
    phases: Vec<PhaseReport>,
    guests: Vec<GuestReport>,
    samples: Vec<SampleReport>,
    /// The run could not boot, or a phase could not be driven.
    error: Option<String>,
}

/// Median, lowest and highest of a figure over the rounds that have it.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
struct Spread {
    #[serde(serialize_with = "json::decimals::<3, _>")]
    median: f64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    min: f64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// One configuration's phase over every round.
#[derive(Serialize)]
struct SummaryRow {
    config: &'static str,
    phase: usize,
    hog_vm: &'static str,
    rounds: usize,
    completed: usize,
    /// Over the rounds where the demand was met.
    demand_met_s: Option<Spread>,
    pages_moved: Option<Spread>,
    waits_over_100ms: u64,
    /// The longest exact wait any round saw in this phase.
    longest_new_wait_ms: Option<f64>,
    oom_kills: usize,
}

/// Every configuration's phases over the rounds, in the order of [`CONFIGS`].
fn summarise(runs: &[RunReport]) -> Vec<SummaryRow> {
    let mut rows = Vec::new();
    for config in CONFIGS {
        let mine: Vec<&RunReport> = runs.iter().filter(|r| r.config == config.name).collect();
        for (i, &hog_vm) in LINUX.iter().enumerate() {
            let phases: Vec<&PhaseReport> = mine
                .iter()
                .filter_map(|r| r.phases.iter().find(|p| p.phase == i + 1))
                .collect();
            let met: Vec<f64> = phases.iter().filter_map(|p| p.demand_met_s).collect();
            let moved: Vec<f64> = phases.iter().map(|p| p.pages_moved as f64).collect();
            rows.push(SummaryRow {
                config: config.name,
                phase: i + 1,
                hog_vm,
                rounds: mine.len(),
                completed: phases.iter().filter(|p| p.completed).count(),
                demand_met_s: Spread::of(&met),
                pages_moved: Spread::of(&moved),
                waits_over_100ms: phases.iter().map(|p| p.waits_over_100ms).sum(),
                longest_new_wait_ms: phases
                    .iter()
                    .filter_map(|p| p.longest_new_wait_ms)
                    .reduce(f64::max),
                oom_kills: phases.iter().map(|p| p.oom_kills).sum(),
            });
        }
    }
    rows
}

/// The goal, phase by phase: the manager completed every round, no vCPU
/// waited over 100 ms, and its median time until the demand was met beats
/// every baseline's (one that never met it is beaten). One line each.
fn verdicts(summary: &[SummaryRow]) -> Vec<String> {
    let mut lines = Vec::new();
    for row in summary.iter().filter(|r| r.config == MANAGER.name) {
        let mine = row.demand_met_s.map(|s| s.median);
        let mut beaten = Vec::new();
        let mut not_beaten = Vec::new();
        for other in summary
            .iter()
            .filter(|o| o.phase == row.phase && o.config != MANAGER.name)
        {
            let theirs = other.demand_met_s.map(|s| s.median);
            // A baseline that missed the demand in some round is behind.
            let ahead = match (mine, theirs) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(m), Some(t)) => m < t || other.completed < other.rounds,
            };
            match ahead {
                true => beaten.push(other.config),
                false => not_beaten.push(other.config),
            }
        }
        let all_done = row.completed == row.rounds && row.rounds > 0;
        let ok = all_done && row.waits_over_100ms == 0 && not_beaten.is_empty();
        lines.push(format!(
            "goal, phase {} (hog in {}): {}: completed {}/{}, waits over {SLOW_WAIT_MS} ms {}, ahead of {} {}",
            row.phase,
            row.hog_vm,
            if ok { "met" } else { "NOT met" },
            row.completed,
            row.rounds,
            row.waits_over_100ms,
            if beaten.is_empty() { "none".to_string() } else { beaten.join(", ") },
            if not_beaten.is_empty() {
                String::new()
            } else {
                format!("(not of {})", not_beaten.join(", "))
            }
        ));
    }
    lines
}

/// The victim of guests/tests/stuck-balloon.toml (a 700 MiB hog in `vma`
/// that needs memory the pool does not have) beside a balloon that never
/// answers, and beside the same guest with a working balloon
/// (stuck-balloon-control.toml): JSON name and bundle.
const STUCK_PAIR: [(&str, &str); 2] = [
    ("stuck", "stuck-balloon"),
    ("working", "stuck-balloon-control"),
];
/// The victim beside a stuck balloon may take this much of its time beside
/// a working one (issue 37).
const STUCK_GOAL: f64 = 1.1;

/// One boot of a [`STUCK_PAIR`] bundle.
#[derive(Serialize)]
struct StuckRun {
    /// `stuck` or `working`.
    neighbour: &'static str,
    round: usize,
    completed: bool,
    demand_met_s: Option<f64>,
    /// Pages of raised targets the manager withdrew (the stuck balloon's).
    pages_withdrawn: u64,
    error: Option<String>,
}

/// The victim's time until its demand was met beside each neighbour, over
/// the rounds, and the ratio of the medians.
#[derive(Serialize, Debug, PartialEq)]
struct StuckSummary {
    stuck_s: Option<Spread>,
    working_s: Option<Spread>,
    /// Rounded to 3 decimals.
    ratio: Option<f64>,
}

fn summarise_stuck(runs: &[StuckRun]) -> StuckSummary {
    let times = |who: &str| -> Vec<f64> {
        runs.iter()
            .filter(|r| r.neighbour == who && r.completed)
            .filter_map(|r| r.demand_met_s)
            .collect()
    };
    let stuck_s = Spread::of(&times(STUCK_PAIR[0].0));
    let working_s = Spread::of(&times(STUCK_PAIR[1].0));
    let ratio = match (stuck_s, working_s) {
        (Some(a), Some(b)) if b.median > 0.0 => Some(json::rounded(a.median / b.median, 3)),
        _ => None,
    };
    StuckSummary {
        stuck_s,
        working_s,
        ratio,
    }
}

fn stuck_verdict(s: &StuckSummary, runs: &[StuckRun]) -> String {
    let all = runs.iter().all(|r| r.completed) && !runs.is_empty();
    let met = all && s.ratio.is_some_and(|r| r <= STUCK_GOAL);
    format!(
        "goal, stuck balloon: {}: the victim's demand met in {} s beside a balloon that never answers, {} s beside a working one ({}; at most {STUCK_GOAL}x)",
        if met { "met" } else { "NOT met" },
        s.stuck_s.map_or("-".into(), |s| format!("{:.2}", s.median)),
        s.working_s.map_or("-".into(), |s| format!("{:.2}", s.median)),
        s.ratio.map_or("no ratio".into(), |r| format!("{r:.2}x"))
    )
}

/// target/bench/policy.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    board: &'static str,
    hog_mib: u64,
    hold_s: u64,
    churn_mib: u64,
    sample_every_s: f64,
    rounds: usize,
    runs: &'a [RunReport],
    summary: Vec<SummaryRow>,
    stuck_runs: &'a [StuckRun],
    stuck: StuckSummary,
    goal: Vec<String>,
}

impl<'a> Report<'a> {
    fn new(runs: &'a [RunReport], stuck_runs: &'a [StuckRun], rounds: usize) -> Self {
        let summary = summarise(runs);
        let stuck = summarise_stuck(stuck_runs);
        let mut goal = verdicts(&summary);
        goal.push(stuck_verdict(&stuck, stuck_runs));
        Report {
            benchmark: "memory-policy",
            board: "virt-gicv2",
            hog_mib: HOG_MIB,
            hold_s: HOLD_S,
            churn_mib: CHURN_MIB,
            sample_every_s: SAMPLE_EVERY.as_secs_f64(),
            rounds,
            runs,
            summary,
            stuck_runs,
            stuck,
            goal,
        }
    }
}

/// `--rounds N` (default [`ROUNDS`]).
pub fn rounds_arg(args: &[String]) -> Result<usize, String> {
    match args {
        [] => Ok(ROUNDS),
        [flag, n] if flag == "--rounds" => n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("--rounds {n}: not a positive number")),
        _ => Err(format!(
            "usage: cargo xtask bench policy [--rounds N] (default {ROUNDS}); got {args:?}"
        )),
    }
}

pub fn run(root: &Path, artifacts: &Artifacts, rounds: usize) -> Result<(), String> {
    for config in CONFIGS {
        check_config(root, config)?;
    }
    let dir = root.join("target").join("bench");
    let mut runs = Vec::new();
    for round in 1..=rounds {
        for config in CONFIGS {
            eprintln!(
                "bench: policy, {} round {round}/{rounds} ({}.img) ...",
                config.name, config.bundle
            );
            let run = run_config(artifacts, config, round);
            if let Some(e) = &run.error {
                eprintln!("bench: policy, {} round {round}: {e}", config.name);
            }
            let svg = dir.join(format!("policy-{}-{round}.svg", config.name));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            std::fs::write(&svg, line_chart(&chart(&run)))
                .map_err(|e| format!("writing {}: {e}", svg.display()))?;
            runs.push(run);
        }
    }
    let mut stuck_runs = Vec::new();
    for round in 1..=rounds {
        for (neighbour, bundle) in STUCK_PAIR {
            eprintln!("bench: policy, the victim beside a {neighbour} balloon, round {round}/{rounds} ({bundle}.img) ...");
            let run = run_stuck(artifacts, neighbour, bundle, round);
            eprintln!(
                "bench: victim beside a {neighbour} balloon, round {round}: demand met {}{}",
                run.demand_met_s
                    .map_or("never".into(), |t| format!("after {t:.2} s")),
                run.error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" ({e})"))
            );
            stuck_runs.push(run);
        }
    }
    print_table(&runs);
    let report = Report::new(&runs, &stuck_runs, rounds);
    print_summary(&report.summary);
    for line in &report.goal {
        println!("{line}");
    }
    let path = dir.join("policy.json");
    json::write(&path, &report)?;
    println!("written to {}", path.display());
    println!("plots: {}", dir.join("policy-CONFIG-ROUND.svg").display());

    let errors: Vec<String> = runs
        .iter()
        .filter_map(|r| {
            r.error
                .as_ref()
                .map(|e| format!("{} round {}: {e}", r.config, r.round))
        })
        .chain(stuck_runs.iter().filter_map(|r| {
            r.error
                .as_ref()
                .map(|e| format!("beside a {} balloon, round {}: {e}", r.neighbour, r.round))
        }))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("bench policy incomplete: {}", errors.join("; ")))
    }
}

/// Every Linux guest's OOM kills in `output`.
fn all_oom_kills(output: &str) -> usize {
    LINUX.iter().map(|vm| oom_kills(output, vm)).sum()
}

/// Boots `config`, fills the guests' page cache, sets its policy and runs
/// the three phases; what could not be done is the run's `error`, with the
/// phases done so far.
fn run_config(artifacts: &Artifacts, config: &Config, round: usize) -> RunReport {
    let mut report = RunReport {
        config: config.name,
        round,
        bundle: format!("{}.img", config.bundle),
        policy: config.policy,
        total_pages: 0,
        committed_pages: 0,
        phases: Vec::new(),
        guests: Vec::new(),
        samples: Vec::new(),
        error: None,
    };
    let mut s = match boot(artifacts, config) {
        Ok(s) => s,
        Err(e) => {
            report.error = Some(e);
            return report;
        }
    };
    if let Err(e) = prepare(&mut s, config) {
        report.error = Some(e);
        return report;
    }
    let origin = Instant::now();
    match mm_raw(&mut s, COMMAND) {
        Ok(first) => {
            report.total_pages = first.pool.total;
            report.committed_pages = first.pool.committed;
        }
        Err(e) => {
            eprintln!("{e}");
            report.error = Some(e.message);
            return report;
        }
    }
    let mut samples = Vec::new();
    for (i, &vm) in LINUX.iter().enumerate() {
        let churn: Vec<&str> = LINUX.iter().copied().filter(|&v| v != vm).collect();
        let phase = HogPhase {
            vm,
            churn_vms: &churn,
            hog_mib: HOG_MIB,
            hold_s: HOLD_S,
            churn_mib: CHURN_MIB,
            id: 10 * (i as u32 + 1),
            sample_every: SAMPLE_EVERY,
            timeout: PHASE,
            settle: SETTLE,
            origin,
        };
        let kills_before = all_oom_kills(&s.output());
        match hog_phase(&mut s, &phase) {
            Ok(outcome) => {
                let kills = all_oom_kills(&s.output()).saturating_sub(kills_before);
                let phase = PhaseReport::new(i + 1, vm, &outcome, kills);
                eprintln!(
                    "bench: {} round {round} phase {}: hog in {vm}: {}, demand met {}, {} pages moved, {} waits over {SLOW_WAIT_MS} ms",
                    config.name,
                    i + 1,
                    if phase.completed {
                        "completed"
                    } else {
                        "not completed"
                    },
                    outcome
                        .demand_met_s
                        .map_or("never".into(), |t| format!("after {t:.1} s")),
                    phase.pages_moved,
                    phase.waits_over_100ms
                );
                samples.extend(outcome.samples);
                report.phases.push(phase);
            }
            Err(e) => {
                eprintln!("{e}");
                report
                    .phases
                    .push(PhaseReport::failed(i + 1, vm, e.message.clone()));
                report.error = Some(format!("phase {} (hog in {vm}): {}", i + 1, e.message));
                break;
            }
        }
    }
    let last = samples.last().map(|s| s.report.clone());
    let out = s.output();
    for name in LINUX.into_iter().chain([BETA]) {
        let stopped_line = out.contains(&format!("tidal: [{name}] VM stopped"));
        let vm = last.as_ref().and_then(|r| r.vm(name));
        report.guests.push(GuestReport {
            name,
            oom_kills: oom_kills(&out, name),
            stopped: stopped_line || vm.is_some_and(|v| v.state != "running"),
            longest_wait_ms: vm.map_or(0.0, |v| v.wait_longest_us as f64 / 1000.0),
        });
    }
    report.samples = samples.iter().map(SampleReport::of).collect();
    report
}

/// Boots a [`STUCK_PAIR`] bundle on virt GICv2 with 4 CPUs, waits for the
/// victim's agent and both test guests, and times its hog.
fn run_stuck(
    artifacts: &Artifacts,
    neighbour: &'static str,
    bundle: &str,
    round: usize,
) -> StuckRun {
    let mut run = StuckRun {
        neighbour,
        round,
        completed: false,
        demand_met_s: None,
        pages_withdrawn: 0,
        error: None,
    };
    let result = (|| -> Result<HogOutcome, String> {
        let mut s = start_session(artifacts, &format!("bench-policy-{neighbour}"), bundle, 4)?;
        wait_for_agents(&mut s, &["vma"], 0, BOOT).map_err(harness)?;
        let ready = match neighbour {
            "stuck" => r"\[stuck\] testguest: balloon stuck: ",
            _ => r"\[stuck\] testguest: balloon at ",
        };
        for line in [ready, r"\[donor\] testguest: balloon at "] {
            s.expect_since(&mut 0, line, BOOT).map_err(harness)?;
        }
        let phase = HogPhase {
            vm: "vma",
            churn_vms: &[],
            hog_mib: HOG_MIB,
            hold_s: HOLD_S,
            churn_mib: CHURN_MIB,
            id: 10,
            sample_every: SAMPLE_EVERY,
            timeout: PHASE,
            settle: Duration::from_secs(2),
            origin: Instant::now(),
        };
        hog_phase(&mut s, &phase).map_err(|e| e.message)
    })();
    match result {
        Ok(outcome) => {
            run.completed = outcome.completed();
            run.demand_met_s = outcome.demand_met_s.map(|t| json::rounded(t, 3));
            run.pages_withdrawn = outcome.growth(|v| v.withdrawn);
        }
        Err(e) => run.error = Some(e),
    }
    run
}

/// Page cache in every Linux guest, then the configuration's policy.
fn prepare(s: &mut Session, config: &Config) -> Result<(), String> {
    for (i, vm) in LINUX.iter().enumerate() {
        let reply = agent_run(s, vm, 50 + i as u32, CACHE_SETUP, COMMAND * 4).map_err(harness)?;
        if reply.rc != 0 {
            return Err(format!(
                "{vm}: filling the page cache failed (rc {}): {}",
                reply.rc,
                reply.lines.join(" / ")
            ));
        }
    }
    let policy = config.policy;
    let answer = s
        .run(&format!("mm policy {policy}"), COMMAND)
        .map_err(harness)?;
    if !answer.contains("balloon targets are now set by") {
        return Err(format!("`mm policy {policy}` answered: {answer}"));
    }
    Ok(())
}

/// Boots `config` on virt GICv2 with 5 CPUs (the shell on CPU 0, the VMs
/// on 1-4) and waits for the three agents and the test guest.
fn boot(artifacts: &Artifacts, config: &Config) -> Result<Session, String> {
    let mut s = start_session(
        artifacts,
        &format!("bench-policy-{}", config.name),
        config.bundle,
        5,
    )?;
    wait_for_agents(&mut s, &LINUX, 0, BOOT).map_err(harness)?;
    let mut from_start = 0;
    s.expect_since(
        &mut from_start,
        &format!(r"\[{BETA}\] testguest: balloon at "),
        BOOT,
    )
    .map_err(harness)?;
    Ok(s)
}

/// QEMU virt GICv2 with `smp` CPUs booting `target/bundles/<bundle>.img`,
/// under the whole-session limit.
fn start_session(
    artifacts: &Artifacts,
    name: &str,
    bundle: &str,
    smp: u32,
) -> Result<Session, String> {
    let board = Board::VirtGicv2;
    let mut opts = QemuOptions::for_board(board, artifacts);
    opts.initrd = Some(target_dir().join("bundles").join(format!("{bundle}.img")));
    opts.smp = Some(smp);
    let s = Session::start(name, board, artifacts, &opts).map_err(harness)?;
    s.set_deadline(SESSION);
    Ok(s)
}

fn harness(e: HarnessError) -> String {
    e.to_string()
}

/// Pages in MiB.
fn mib(pages: u64) -> f64 {
    (pages * PAGE) as f64 / MIB as f64
}

/// The plot of `run`: each VM's backed memory (solid) and, where it ever
/// held any, its balloon (dashed, the same colour), and the free pool, in
/// MiB, with a dashed line where each phase's hog started and where the
/// last phase ended: what the manager took and what it gave back.
fn chart(run: &RunReport) -> Chart {
    let mut names: Vec<&str> = Vec::new();
    for sample in &run.samples {
        for (name, _) in &sample.backed_pages {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let per_vm = |name: &str, of: fn(&SampleReport) -> &[(String, u64)]| -> Vec<(f64, f64)> {
        run.samples
            .iter()
            .filter_map(|s| {
                let (_, pages) = of(s).iter().find(|(n, _)| n == name)?;
                Some((s.t_s, mib(*pages)))
            })
            .collect()
    };
    let mut series = Vec::new();
    for (i, &name) in names.iter().enumerate() {
        series.push(Series {
            color: Some(i),
            ..Series::new(format!("{name} backed"), per_vm(name, |s| &s.backed_pages))
        });
        let balloon = per_vm(name, |s| &s.balloon_pages);
        if balloon.iter().any(|&(_, m)| m > 0.0) {
            series.push(Series {
                dashed: true,
                color: Some(i),
                ..Series::new(format!("{name} balloon"), balloon)
            });
        }
    }
    series.push(Series {
        color: Some(names.len()),
        ..Series::new(
            "pool free",
            run.samples
                .iter()
                .map(|s| (s.t_s, mib(s.pool_free_pages)))
                .collect(),
        )
    });
    let mut markers: Vec<(f64, String)> = run
        .phases
        .iter()
        .map(|p| (p.start_s, format!("{} hog", p.hog_vm)))
        .collect();
    if let Some(last) = run.phases.iter().rev().find(|p| p.end_s.is_finite()) {
        markers.push((last.end_s, "end".into()));
    }
    Chart {
        title: format!(
            "Tidal {} (round {}): {} MiB committed on {} MiB, {HOG_MIB} MiB hog moving",
            run.config,
            run.round,
            mib(run.committed_pages).round(),
            mib(run.total_pages).round()
        ),
        x_label: "time (s)".into(),
        y_label: "MiB".into(),
        series,
        markers,
    }
}

fn print_table(runs: &[RunReport]) {
    println!();
    println!(
        "Memory policy: three Linux VMs and beta on QEMU virt GICv2 (2 GiB, -smp 5), page cache in each;"
    );
    println!(
        "a {HOG_MIB} MiB hog in vma, then vmb, then vmc, holding {HOLD_S} s, while the other two write and delete"
    );
    println!("{CHURN_MIB} MiB in tmpfs; wall time under TCG");
    println!(
        "{:<15} {:>5} {:>15} {:>6} {:<4} {:<10} {:>4} {:>13} {:>12} {:>10} {:>9} {:>12} {:>4}",
        "run",
        "round",
        "committed MiB",
        "phase",
        "hog",
        "completed",
        "rc",
        "demand met s",
        "pages moved",
        "MiB moved",
        "waits>100",
        "new longest",
        "OOM"
    );
    for run in runs {
        let committed = format!(
            "{:.0}/{:.0}",
            mib(run.committed_pages),
            mib(run.total_pages)
        );
        if run.phases.is_empty() {
            println!(
                "{:<15} {:>5} {committed:>15} (no phase ran)",
                run.config, run.round
            );
        }
        for p in &run.phases {
            println!(
                "{:<15} {:>5} {committed:>15} {:>6} {:<4} {:<10} {:>4} {:>13} {:>12} {:>10.1} {:>9} {:>12} {:>4}",
                run.config,
                run.round,
                p.phase,
                p.hog_vm,
                if p.completed { "yes" } else { "no" },
                p.rc.map_or("-".into(), |rc| rc.to_string()),
                p.demand_met_s.map_or("-".into(), |t| format!("{t:.2}")),
                p.pages_moved,
                mib(p.pages_moved),
                p.waits_over_100ms,
                p.longest_new_wait_ms
                    .map_or("-".into(), |ms| format!("{ms:.1} ms")),
                p.oom_kills
            );
        }
    }
    println!(
        "{:<15} {:>5} {:<6} {:>9} {:>8} {:>15}",
        "run", "round", "guest", "OOM kills", "stopped", "longest wait"
    );
    for run in runs {
        for g in &run.guests {
            println!(
                "{:<15} {:>5} {:<6} {:>9} {:>8} {:>12.1} ms",
                run.config,
                run.round,
                g.name,
                g.oom_kills,
                if g.stopped { "yes" } else { "no" },
                g.longest_wait_ms
            );
        }
    }
    println!("committed MiB: all VMs' RAM / the memory the hypervisor's frame table manages.");
    println!(
        "Demand met: from sending the hog's request to its `hog: touched` line on the console."
    );
    println!(
        "Pages moved: growth of every VM's `reclaimed` and `given` in `mm raw` over the phase."
    );
    println!(
        "waits>100: vCPU waits for a frame over {SLOW_WAIT_MS} ms; new longest: the phase's longest wait when it was its VM's longest yet."
    );
}

/// The summary over the rounds: per configuration and phase, the rounds
/// completed and the median [min-max] of the time until the demand was met.
fn print_summary(summary: &[SummaryRow]) {
    println!();
    println!(
        "{:<15} {:>6} {:<4} {:>9} {:>26} {:>22} {:>9} {:>12} {:>4}",
        "config",
        "phase",
        "hog",
        "completed",
        "demand met s, median [range]",
        "MiB moved, median",
        "waits>100",
        "new longest",
        "OOM"
    );
    let spread = |s: Option<Spread>, scale: f64| {
        s.map_or("-".into(), |s| {
            format!(
                "{:.2} [{:.2}-{:.2}]",
                s.median * scale,
                s.min * scale,
                s.max * scale
            )
        })
    };
    for r in summary {
        println!(
            "{:<15} {:>6} {:<4} {:>9} {:>26} {:>22} {:>9} {:>12} {:>4}",
            r.config,
            r.phase,
            r.hog_vm,
            format!("{}/{}", r.completed, r.rounds),
            spread(r.demand_met_s, 1.0),
            spread(r.pages_moved, PAGE as f64 / MIB as f64),
            r.waits_over_100ms,
            r.longest_new_wait_ms
                .map_or("-".into(), |ms| format!("{ms:.1} ms")),
            r.oom_kills
        );
    }
}

/// `guests/tests/<bundle>.toml` holds the VMs this bench drives: the three
/// Linux VMs and beta, with `config`'s RAM sizes, on CPUs 1 to 4.
fn check_config(root: &Path, config: &Config) -> Result<(), String> {
    let path = root
        .join("guests")
        .join("tests")
        .join(format!("{}.toml", config.bundle));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let vms = table
        .get("vm")
        .and_then(|v| v.as_array())
        .ok_or_else(|| format!("{}: no [[vm]]", path.display()))?;
    let expected = LINUX
        .iter()
        .map(|&name| (name, config.linux_mib))
        .chain([(BETA, config.beta_mib)]);
    let got: Vec<(String, String, String)> = vms
        .iter()
        .map(|vm| {
            let field = |key: &str| match vm.get(key) {
                Some(toml::Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            (field("name"), field("ram"), field("cpus"))
        })
        .collect();
    let want: Vec<(String, String, String)> = expected
        .enumerate()
        .map(|(i, (name, ram))| {
            let ram = if ram % 1024 == 0 {
                format!("{}G", ram / 1024)
            } else {
                format!("{ram}M")
            };
            (name.to_string(), ram, format!("[{}]", i + 1))
        })
        .collect();
    if got != want {
        return Err(format!(
            "{}: the VMs (name, ram, cpus) are {got:?}, but the bench drives {want:?}",
            path.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness::console::{MmPool, MmReport, MmVm};
    use harness::linux::MmSample;
    use serde_json::json;

    fn sample(t_s: f64, free: u64, backed: &[(&str, u64)]) -> MmSample {
        MmSample {
            t_s,
            report: MmReport {
                pool: MmPool {
                    total: 470_000,
                    free,
                    committed: 819_200,
                    ..MmPool::default()
                },
                vms: backed
                    .iter()
                    .map(|&(name, backed)| MmVm {
                        name: name.into(),
                        state: "running".into(),
                        size: 262_144,
                        backed,
                        balloon: 0,
                        target: 0,
                        returned: 0,
                        min: 0,
                        low: 0,
                        max: 262_144,
                        weight: 100,
                        congested: false,
                        pressure: false,
                        reclaimed: 0,
                        given: 0,
                        fenced: 0,
                        given_back: 0,
                        withdrawn: 0,
                        waits_slow: 0,
                        wait_longest_us: 0,
                    })
                    .collect(),
            },
        }
    }

    fn synthetic_run() -> RunReport {
        let mut samples = [
            sample(
                0.0,
                300_000,
                &[("vma", 30_000), ("vmb", 30_000), ("beta", 32_768)],
            ),
            sample(
                0.5,
                200_000,
                &[("vma", 130_000), ("vmb", 31_000), ("beta", 32_768)],
            ),
            sample(
                1.0,
                120_000,
                &[("vma", 210_000), ("vmb", 31_000), ("beta", 32_768)],
            ),
        ];
        // One wait of vma's over 100 ms, its longest yet, in the phase.
        samples[2].report.vms[0].waits_slow = 1;
        samples[2].report.vms[0].wait_longest_us = 250_000;
        let outcome = HogOutcome {
            start_s: 0.25,
            end_s: 1.0,
            demand_met_s: Some(0.71234),
            rc: Some(0),
            released: true,
            stopped: false,
            churn_iterations: vec![("vmb".into(), 3)],
            samples: samples.to_vec(),
        };
        RunReport {
            config: "manager",
            round: 1,
            bundle: "overcommit-full.img".into(),
            policy: "manager",
            total_pages: 470_000,
            committed_pages: 819_200,
            phases: vec![
                PhaseReport::new(1, "vma", &outcome, 2),
                PhaseReport::failed(2, "vmb", "timed out".into()),
            ],
            guests: vec![GuestReport {
                name: "vma",
                oom_kills: 0,
                stopped: false,
                longest_wait_ms: 12.5,
            }],
            samples: samples.iter().map(SampleReport::of).collect(),
            error: Some("phase 2 (hog in vmb): timed out".into()),
        }
    }

    #[test]
    fn report_keeps_its_fields() {
        let runs = [synthetic_run()];
        let value = serde_json::to_value(Report::new(&runs, &[], 1)).unwrap();
        assert_eq!(value["benchmark"], "memory-policy");
        assert_eq!(value["hog_mib"], 700);
        assert_eq!(value["sample_every_s"], 0.5);
        let run = &value["runs"][0];
        assert_eq!(run["committed_pages"], 819_200);
        assert_eq!(
            (run["round"].clone(), run["policy"].clone()),
            (json!(1), json!("manager"))
        );
        assert_eq!(
            run["phases"][0],
            json!({"phase": 1, "hog_vm": "vma", "completed": true, "rc": 0,
                   "demand_met_s": 0.712, "pages_moved": 0, "pages_returned_by_guests": 0,
                   "pages_reclaimed_by_manager": 0, "pages_fenced": 0,
                   "waits_over_100ms": 1, "longest_new_wait_ms": 250.0, "oom_kills": 2,
                   "start_s": 0.25, "end_s": 1.0,
                   "churn_iterations": {"vmb": 3}, "error": null})
        );
        assert_eq!(
            run["phases"][1],
            json!({"phase": 2, "hog_vm": "vmb", "completed": false, "rc": null,
                   "demand_met_s": null, "pages_moved": 0, "pages_returned_by_guests": 0,
                   "pages_reclaimed_by_manager": 0, "pages_fenced": 0,
                   "waits_over_100ms": 0, "longest_new_wait_ms": null, "oom_kills": 0,
                   "start_s": null, "end_s": null,
                   "churn_iterations": {}, "error": "timed out"})
        );
        assert_eq!(
            run["guests"][0],
            json!({"name": "vma", "oom_kills": 0, "stopped": false, "longest_wait_ms": 12.5})
        );
        assert_eq!(
            run["samples"][1],
            json!({"t_s": 0.5, "pool_free_pages": 200_000,
                   "backed_pages": {"vma": 130_000, "vmb": 31_000, "beta": 32_768},
                   "target_pages": {"vma": 0, "vmb": 0, "beta": 0},
                   "balloon_pages": {"vma": 0, "vmb": 0, "beta": 0}})
        );
    }

    #[test]
    fn the_plot_has_a_line_per_vm_and_the_pool() {
        let svg = line_chart(&chart(&synthetic_run()));
        assert!(svg.starts_with("<svg"), "{svg}");
        // vma, vmb, beta and the pool.
        assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        for label in ["vma backed", "beta backed", "pool free", "vma hog", "end"] {
            assert!(svg.contains(&format!(">{label}</text>")), "{label}: {svg}");
        }
        // The failed phase has no start: no marker for it.
        assert!(!svg.contains(">vmb hog</text>"), "{svg}");
        assert!(
            svg.contains("Tidal manager (round 1): 3200 MiB committed on 1836 MiB"),
            "{svg}"
        );
    }

    #[test]
    fn a_balloon_that_moved_gets_its_dashed_line() {
        let mut run = synthetic_run();
        // vmb's balloon inflates to 100 MiB, then goes back to 0.
        for (s, pages) in run.samples.iter_mut().zip([0, 25_600, 0]) {
            for (name, b) in &mut s.balloon_pages {
                if name == "vmb" {
                    *b = pages;
                }
            }
        }
        let svg = line_chart(&chart(&run));
        assert_eq!(svg.matches("<polyline").count(), 5, "{svg}");
        assert!(svg.contains(">vmb balloon</text>"), "{svg}");
        assert!(
            !svg.contains(">vma balloon</text>"),
            "never ballooned: {svg}"
        );
        let line = svg
            .lines()
            .find(|l| l.starts_with("<polyline") && l.contains("dasharray"))
            .unwrap();
        assert!(
            line.contains(",") && line.split_whitespace().count() > 3,
            "{line}"
        );
    }

    #[test]
    fn the_configs_hold_the_driven_vms() {
        let root = crate::root();
        for config in CONFIGS {
            check_config(&root, config).unwrap();
        }
        let wrong = Config {
            linux_mib: 512,
            ..MANAGER
        };
        let err = check_config(&root, &wrong).unwrap_err();
        assert!(err.contains("512M"), "{err}");
    }

    /// A run of `config` whose phases met the demand after these seconds
    /// (`None`: not met), with `slow` waits over 100 ms in each.
    fn run_of(config: &'static str, round: usize, met: [Option<f64>; 3], slow: u64) -> RunReport {
        RunReport {
            config,
            round,
            bundle: String::new(),
            policy: "manager",
            total_pages: 0,
            committed_pages: 0,
            phases: met
                .iter()
                .enumerate()
                .map(|(i, &m)| {
                    let mut p = PhaseReport::failed(i + 1, LINUX[i], String::new());
                    p.error = None;
                    p.demand_met_s = m;
                    p.completed = m.is_some();
                    p.waits_over_100ms = slow;
                    p.pages_moved = 256 * 100;
                    p
                })
                .collect(),
            guests: Vec::new(),
            samples: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn the_summary_takes_medians_over_rounds_and_judges_the_goal() {
        let runs = vec![
            run_of("manager", 1, [Some(3.0), Some(4.0), Some(9.0)], 0),
            run_of("manager", 2, [Some(5.0), Some(4.5), Some(8.0)], 0),
            run_of("manager", 3, [Some(4.0), Some(4.2), Some(7.0)], 0),
            run_of("reporting-only", 1, [Some(6.0), None, Some(6.0)], 0),
            run_of("naive", 1, [Some(8.0), Some(9.0), Some(10.0)], 2),
            run_of("static", 1, [None, None, None], 0),
        ];
        let summary = summarise(&runs);
        assert_eq!(summary.len(), CONFIGS.len() * 3);
        let first = &summary[0];
        assert_eq!(
            (first.config, first.phase, first.rounds, first.completed),
            ("manager", 1, 3, 3)
        );
        assert_eq!(
            first.demand_met_s,
            Some(Spread {
                median: 4.0,
                min: 3.0,
                max: 5.0
            })
        );
        let naive = summary
            .iter()
            .find(|r| r.config == "naive" && r.phase == 1)
            .unwrap();
        assert_eq!(naive.waits_over_100ms, 2);
        let stat = summary.iter().find(|r| r.config == "static").unwrap();
        assert_eq!((stat.completed, stat.demand_met_s), (0, None));

        let goal = verdicts(&summary);
        assert_eq!(goal.len(), 3);
        // Phase 1: ahead of every baseline.
        assert!(goal[0].contains(": met:"), "{}", goal[0]);
        // Phase 2: reporting-only missed it in its round: still behind.
        assert!(goal[1].contains(": met:"), "{}", goal[1]);
        // Phase 3: reporting-only met it faster (6.0 against 8.0).
        assert!(
            goal[2].contains("NOT met") && goal[2].contains("(not of reporting-only)"),
            "{}",
            goal[2]
        );
        // A slow wait of the manager's misses the goal however fast it is.
        let slow = vec![run_of("manager", 1, [Some(1.0); 3], 1)];
        assert!(verdicts(&summarise(&slow))[0].contains("NOT met"));
    }

    #[test]
    fn the_victim_beside_a_stuck_balloon_is_judged_by_the_ratio_of_medians() {
        let run = |neighbour, round, t: Option<f64>| StuckRun {
            neighbour,
            round,
            completed: t.is_some(),
            demand_met_s: t,
            pages_withdrawn: 0,
            error: None,
        };
        let runs = [
            run("stuck", 1, Some(4.3)),
            run("working", 1, Some(4.0)),
            run("stuck", 2, Some(4.2)),
            run("working", 2, Some(4.1)),
            run("stuck", 3, Some(9.0)),
            run("working", 3, Some(3.9)),
        ];
        let s = summarise_stuck(&runs);
        assert_eq!(s.ratio, Some(1.075));
        assert!(stuck_verdict(&s, &runs).contains(": met:"));
        // Slower than 1.1x, or a round that never met its demand: not met.
        let slow = [run("stuck", 1, Some(4.5)), run("working", 1, Some(4.0))];
        assert!(stuck_verdict(&summarise_stuck(&slow), &slow).contains("NOT met"));
        let never = [run("stuck", 1, None), run("working", 1, Some(4.0))];
        let s = summarise_stuck(&never);
        assert_eq!(s.ratio, None);
        assert!(stuck_verdict(&s, &never).contains("NOT met"));
    }

    #[test]
    fn rounds_come_from_the_command_line() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(rounds_arg(&[]), Ok(ROUNDS));
        assert_eq!(rounds_arg(&args(&["--rounds", "5"])), Ok(5));
        assert!(rounds_arg(&args(&["--rounds", "0"])).is_err());
        assert!(rounds_arg(&args(&["--round", "2"])).is_err());
    }
}
