//! `cargo xtask bench policy`: the memory manager under overcommit (issue
//! 12). Three 1 GiB Linux VMs and the bare-metal `beta` on a 2 GiB virt
//! board (guests/tests/overcommit.toml, over 3 GiB committed), and a 700
//! MiB `tidal-mem hog` that moves from `vma` to `vmb` to `vmc` while the
//! other two churn memory ([`harness::linux::hog_phase`], the driver
//! tests/tests/overcommit.rs uses too); then the same workload on static
//! partitions that fit (overcommit-static.toml: 3 × 600 MiB, each VM's
//! memory fixed), where the hog cannot get its memory.
//!
//! Per phase: whether it completed (the hog touched all its memory and
//! exited with 0), the time from sending the hog's request to its `hog:
//! touched` line (the demand met), and the pages the manager moved (growth
//! of every VM's `reclaimed` and `given` in `mm raw`); per guest: the OOM
//! kills on its console and whether it stopped. Wall time under QEMU TCG.
//!
//! Results: a table on stdout, target/bench/policy.json (both runs, with
//! every `mm raw` sample) and target/bench/policy.svg (the overcommit run:
//! each VM's backed memory and the free pool over time, phases marked).

use std::path::Path;
use std::time::{Duration, Instant};

use harness::linux::{hog_phase, mm_raw, oom_kills, wait_for_agents, HogOutcome, HogPhase};
use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};
use serde::Serialize;

use super::svg::{line_chart, Chart, Series};
use crate::json;
use harness::linux::overcommit::{BETA, BOOT, CHURN_MIB, HOG_MIB, HOLD_S, LINUX, PHASE, SETTLE};

const SAMPLE_EVERY: Duration = Duration::from_millis(500);
const COMMAND: Duration = Duration::from_secs(30);
/// Whole-session limit: QEMU is killed after this whatever happens.
const SESSION: Duration = Duration::from_secs(2400);
const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

/// The two runs: JSON name, bundle (`guests/tests/<bundle>.toml`), and each
/// Linux VM's RAM and beta's, in MiB.
struct Config {
    name: &'static str,
    bundle: &'static str,
    linux_mib: u64,
    beta_mib: u64,
}

const OVERCOMMIT: Config = Config {
    name: "overcommit",
    bundle: "overcommit",
    linux_mib: 1024,
    beta_mib: 128,
};
const STATIC: Config = Config {
    name: "static",
    bundle: "overcommit-static",
    linux_mib: 600,
    beta_mib: 64,
};

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
    fn new(phase: usize, hog_vm: &'static str, outcome: &HogOutcome) -> Self {
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
}

/// One `mm raw` sample, in pages.
#[derive(Serialize)]
struct SampleReport {
    #[serde(serialize_with = "json::decimals::<3, _>")]
    t_s: f64,
    pool_free_pages: u64,
    #[serde(serialize_with = "json::ordered_map")]
    backed_pages: Vec<(String, u64)>,
}

/// One boot of one configuration.
#[derive(Serialize)]
struct RunReport {
    config: &'static str,
    bundle: String,
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

/// target/bench/policy.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    board: &'static str,
    hog_mib: u64,
    hold_s: u64,
    churn_mib: u64,
    sample_every_s: f64,
    runs: &'a [RunReport],
}

impl<'a> Report<'a> {
    fn new(runs: &'a [RunReport]) -> Self {
        Report {
            benchmark: "memory-policy",
            board: "virt-gicv2",
            hog_mib: HOG_MIB,
            hold_s: HOLD_S,
            churn_mib: CHURN_MIB,
            sample_every_s: SAMPLE_EVERY.as_secs_f64(),
            runs,
        }
    }
}

pub fn run(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    for config in [&OVERCOMMIT, &STATIC] {
        check_config(root, config)?;
    }
    let mut runs = Vec::new();
    for config in [&OVERCOMMIT, &STATIC] {
        eprintln!("bench: policy, {} ({}.img) ...", config.name, config.bundle);
        let run = run_config(artifacts, config);
        if let Some(e) = &run.error {
            eprintln!("bench: policy, {}: {e}", config.name);
        }
        runs.push(run);
    }
    print_table(&runs);

    let dir = root.join("target").join("bench");
    let path = dir.join("policy.json");
    json::write(&path, &Report::new(&runs))?;
    println!("written to {}", path.display());
    let svg = dir.join("policy.svg");
    std::fs::write(&svg, line_chart(&chart(&runs[0])))
        .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    println!("plot of the overcommit run: {}", svg.display());

    let errors: Vec<String> = runs
        .iter()
        .filter_map(|r| r.error.as_ref().map(|e| format!("{}: {e}", r.config)))
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("bench policy incomplete: {}", errors.join("; ")))
    }
}

/// Boots `config` and runs the three phases; what could not be done is
/// the run's `error`, with the phases done so far.
fn run_config(artifacts: &Artifacts, config: &Config) -> RunReport {
    let mut report = RunReport {
        config: config.name,
        bundle: format!("{}.img", config.bundle),
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
        match hog_phase(&mut s, &phase) {
            Ok(outcome) => {
                let phase = PhaseReport::new(i + 1, vm, &outcome);
                eprintln!(
                    "bench: {} phase {}: hog in {vm}: {}, demand met {}, {} pages moved",
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
                    phase.pages_moved
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
        let state = last
            .as_ref()
            .and_then(|r| r.vm(name))
            .map(|v| v.state.as_str());
        report.guests.push(GuestReport {
            name,
            oom_kills: oom_kills(&out, name),
            stopped: stopped_line || state.is_some_and(|s| s != "running"),
        });
    }
    report.samples = samples
        .iter()
        .map(|sample| SampleReport {
            t_s: sample.t_s,
            pool_free_pages: sample.report.pool.free,
            backed_pages: sample
                .report
                .vms
                .iter()
                .map(|v| (v.name.clone(), v.backed))
                .collect(),
        })
        .collect();
    report
}

/// Boots `config` on virt GICv2 with 5 CPUs (the shell on CPU 0, the VMs
/// on 1-4) and waits for the three agents and the test guest.
fn boot(artifacts: &Artifacts, config: &Config) -> Result<Session, String> {
    let board = Board::VirtGicv2;
    let mut opts = QemuOptions::for_board(board, artifacts);
    opts.initrd = Some(
        target_dir()
            .join("bundles")
            .join(format!("{}.img", config.bundle)),
    );
    opts.smp = Some(5);
    let mut s = Session::start(
        &format!("bench-policy-{}", config.name),
        board,
        artifacts,
        &opts,
    )
    .map_err(harness)?;
    s.set_deadline(SESSION);
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

fn harness(e: HarnessError) -> String {
    e.to_string()
}

/// Pages in MiB.
fn mib(pages: u64) -> f64 {
    (pages * PAGE) as f64 / MIB as f64
}

/// The plot of `run`: each VM's backed memory and the free pool, in MiB,
/// with a dashed line where each phase's hog started and where the last
/// phase ended.
fn chart(run: &RunReport) -> Chart {
    let mut names: Vec<&str> = Vec::new();
    for sample in &run.samples {
        for (name, _) in &sample.backed_pages {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    let mut series: Vec<Series> = names
        .iter()
        .map(|&name| Series {
            name: format!("{name} backed"),
            points: run
                .samples
                .iter()
                .filter_map(|s| {
                    let (_, pages) = s.backed_pages.iter().find(|(n, _)| n == name)?;
                    Some((s.t_s, mib(*pages)))
                })
                .collect(),
        })
        .collect();
    series.push(Series {
        name: "pool free".into(),
        points: run
            .samples
            .iter()
            .map(|s| (s.t_s, mib(s.pool_free_pages)))
            .collect(),
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
            "Tidal overcommit: {} MiB committed on {} MiB, {HOG_MIB} MiB hog moving",
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
        "Memory policy: three Linux VMs and beta on QEMU virt GICv2 (2 GiB, -smp 5); a {HOG_MIB} MiB hog"
    );
    println!(
        "in vma, then vmb, then vmc, holding {HOLD_S} s, while the other two write and delete {CHURN_MIB} MiB in tmpfs;"
    );
    println!("wall time under TCG");
    println!(
        "{:<11} {:>15} {:>6} {:<4} {:<10} {:>4} {:>13} {:>12} {:>10}",
        "run",
        "committed MiB",
        "phase",
        "hog",
        "completed",
        "rc",
        "demand met s",
        "pages moved",
        "MiB moved"
    );
    for run in runs {
        let committed = format!(
            "{:.0}/{:.0}",
            mib(run.committed_pages),
            mib(run.total_pages)
        );
        if run.phases.is_empty() {
            println!("{:<11} {committed:>15} (no phase ran)", run.config);
        }
        for p in &run.phases {
            println!(
                "{:<11} {committed:>15} {:>6} {:<4} {:<10} {:>4} {:>13} {:>12} {:>10.1}",
                run.config,
                p.phase,
                p.hog_vm,
                if p.completed { "yes" } else { "no" },
                p.rc.map_or("-".into(), |rc| rc.to_string()),
                p.demand_met_s.map_or("-".into(), |t| format!("{t:.2}")),
                p.pages_moved,
                mib(p.pages_moved)
            );
        }
    }
    println!(
        "{:<11} {:<6} {:>9} {:>8}",
        "run", "guest", "OOM kills", "stopped"
    );
    for run in runs {
        for g in &run.guests {
            println!(
                "{:<11} {:<6} {:>9} {:>8}",
                run.config,
                g.name,
                g.oom_kills,
                if g.stopped { "yes" } else { "no" }
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
                    })
                    .collect(),
            },
        }
    }

    fn synthetic_run() -> RunReport {
        let samples = [
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
            config: "overcommit",
            bundle: "overcommit.img".into(),
            total_pages: 470_000,
            committed_pages: 819_200,
            phases: vec![
                PhaseReport::new(1, "vma", &outcome),
                PhaseReport::failed(2, "vmb", "timed out".into()),
            ],
            guests: vec![GuestReport {
                name: "vma",
                oom_kills: 0,
                stopped: false,
            }],
            samples: samples
                .iter()
                .map(|s| SampleReport {
                    t_s: s.t_s,
                    pool_free_pages: s.report.pool.free,
                    backed_pages: s
                        .report
                        .vms
                        .iter()
                        .map(|v| (v.name.clone(), v.backed))
                        .collect(),
                })
                .collect(),
            error: Some("phase 2 (hog in vmb): timed out".into()),
        }
    }

    #[test]
    fn report_keeps_its_fields() {
        let runs = [synthetic_run()];
        let value = serde_json::to_value(Report::new(&runs)).unwrap();
        assert_eq!(value["benchmark"], "memory-policy");
        assert_eq!(value["hog_mib"], 700);
        assert_eq!(value["sample_every_s"], 0.5);
        let run = &value["runs"][0];
        assert_eq!(run["committed_pages"], 819_200);
        assert_eq!(
            run["phases"][0],
            json!({"phase": 1, "hog_vm": "vma", "completed": true, "rc": 0,
                   "demand_met_s": 0.712, "pages_moved": 0, "pages_returned_by_guests": 0,
                   "pages_reclaimed_by_manager": 0, "pages_fenced": 0,
                   "start_s": 0.25, "end_s": 1.0,
                   "churn_iterations": {"vmb": 3}, "error": null})
        );
        assert_eq!(
            run["phases"][1],
            json!({"phase": 2, "hog_vm": "vmb", "completed": false, "rc": null,
                   "demand_met_s": null, "pages_moved": 0, "pages_returned_by_guests": 0,
                   "pages_reclaimed_by_manager": 0, "pages_fenced": 0, "start_s": null, "end_s": null,
                   "churn_iterations": {}, "error": "timed out"})
        );
        assert_eq!(
            run["guests"][0],
            json!({"name": "vma", "oom_kills": 0, "stopped": false})
        );
        assert_eq!(
            run["samples"][1],
            json!({"t_s": 0.5, "pool_free_pages": 200_000,
                   "backed_pages": {"vma": 130_000, "vmb": 31_000, "beta": 32_768}})
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
        assert!(svg.contains("3200 MiB committed on 1836 MiB"), "{svg}");
    }

    #[test]
    fn the_configs_hold_the_driven_vms() {
        let root = crate::root();
        check_config(&root, &OVERCOMMIT).unwrap();
        check_config(&root, &STATIC).unwrap();
        let wrong = Config {
            linux_mib: 512,
            ..OVERCOMMIT
        };
        let err = check_config(&root, &wrong).unwrap_err();
        assert!(err.contains("512M"), "{err}");
    }
}
