//! `cargo xtask fuzz [TARGET...] [--time SECONDS | --runs N | --long]`:
//! builds the fuzz targets (fuzz/, libFuzzer through libfuzzer-sys) and
//! runs them one after another. `--long` is the documented long run: every
//! target to [`LONG_RUNS`] executions. `cargo xtask fuzz --table` writes
//! the table of target/fuzz/report.json into docs/TRUST.md (between
//! [`TABLE_BEGIN`] and [`TABLE_END`]) and prints it.
//!
//! The targets are built on the stable toolchain without cargo-fuzz: the
//! coverage instrumentation libFuzzer needs is LLVM's SanitizerCoverage,
//! switched on with stable `-C passes=sancov-module` and `-C llvm-args`
//! (what cargo-fuzz passes with `--sanitizer none`). No sanitizer runtime
//! (ASan needs nightly); the fuzz profile keeps overflow checks and debug
//! assertions on, so unchecked arithmetic on guest input is a crash. Only
//! the host target gets these flags (`--target <host>`), not build scripts.
//!
//! Each target runs over its committed seeds (fuzz/seeds/TARGET) and its
//! working corpus (target/fuzz/corpus/TARGET, kept between runs). A crash
//! input is saved as `target/fuzz/crashes/TARGET/crash-<sha1>` and the
//! command fails naming the target and the file. A slow unit (an input one
//! execution of which took over 10 s: `slow-unit-<sha1>` there) is shown
//! and reported, and is no failure: libFuzzer goes on. Per target it prints
//! executions, exec/s, wall time and coverage (libFuzzer's `cov`: covered
//! code edges; `ft`: features), and writes them all to
//! target/fuzz/report.json, with the commit the targets were built from
//! (`git rev-parse HEAD`) and whether the tree had changes beside it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::json;

/// Every target, in the order they run (fast ones first).
pub const TARGETS: [&str; 19] = [
    "exit_decode",
    "shell",
    "psci",
    "console_line",
    "manager",
    "bundle",
    "board_dtb",
    "pl011",
    "virtio_mmio",
    "virtqueue",
    "vconsole",
    "vgic_v2",
    "vgic_v3",
    "vm_config",
    "device_state",
    "snapshot_store",
    "snapshot_format",
    "exit_dispatch",
    "balloon",
];

/// [`TARGETS`] as owned names.
pub fn all_targets() -> Vec<String> {
    TARGETS.iter().map(|t| t.to_string()).collect()
}

/// Executions per target of the long run (`--long`).
pub const LONG_RUNS: u64 = 10_000_000;

/// The markers in docs/TRUST.md between which `--table` writes the table.
pub const TABLE_BEGIN: &str = "<!-- fuzz-table:begin (cargo xtask fuzz --table) -->";
pub const TABLE_END: &str = "<!-- fuzz-table:end -->";

/// How long each target runs; in the report `{"seconds": S}` or `{"runs": N}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    Seconds(u64),
    Runs(u64),
}

/// What one target's run did; one entry of the report's `targets`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub target: String,
    pub runs: u64,
    pub exec_per_sec: u64,
    #[serde(serialize_with = "json::decimals::<1, _>")]
    pub wall_seconds: f64,
    /// Covered edges (libFuzzer `cov`) and features (`ft`) at the end.
    pub coverage: u64,
    pub features: u64,
    pub corpus: u64,
    /// The test unit libFuzzer saved, if any: a crash (`crash-…`), or a
    /// slow unit (`slow-unit-…`: one execution took longer than
    /// libFuzzer's `-report_slow_units`, 10 s; the run goes on, and it is
    /// no failure).
    pub crash: Option<PathBuf>,
}

impl Outcome {
    /// Nothing run yet.
    pub fn new(target: &str) -> Self {
        Outcome {
            target: target.to_string(),
            runs: 0,
            exec_per_sec: 0,
            wall_seconds: 0.0,
            coverage: 0,
            features: 0,
            corpus: 0,
            crash: None,
        }
    }

    /// Whether the saved test unit is a crash (not a slow unit).
    pub fn crashed(&self) -> bool {
        self.crash.is_some() && self.slow_unit().is_none()
    }

    /// The saved test unit, if it is a slow unit.
    pub fn slow_unit(&self) -> Option<&Path> {
        let unit = self.crash.as_deref()?;
        let name = unit.file_name()?.to_str()?;
        name.starts_with("slow-unit-").then_some(unit)
    }
}

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--table") {
        if args.len() != 1 {
            return Err(format!("--table takes nothing else\n{}", usage()));
        }
        return write_table(root);
    }
    let (targets, budget) = parse_args(args)?;
    // Read before the build: the commit and tree the binaries come from.
    let source = Source::of(root)?;
    let bins = build(root, &targets)?;
    let mut outcomes = Vec::new();
    for (target, bin) in targets.iter().zip(&bins) {
        let outcome = run_target(root, target, bin, budget)?;
        println!("{}", summary(&outcome));
        outcomes.push(outcome);
        // Written after every target, so a long run shows its progress.
        write_report(root, &source, budget, &outcomes)?;
    }
    let crashed: Vec<String> = outcomes
        .iter()
        .filter(|o| o.crashed())
        .filter_map(|o| {
            o.crash
                .as_ref()
                .map(|c| format!("{} crashed: {}", o.target, c.display()))
        })
        .collect();
    if crashed.is_empty() {
        Ok(())
    } else {
        Err(crashed.join("; "))
    }
}

fn usage() -> String {
    format!(
        "usage: cargo xtask fuzz [TARGET...] [--time SECONDS | --runs N | --long]\n       \
         cargo xtask fuzz --table   (docs/TRUST.md's table from target/fuzz/report.json)\n  \
         targets: {}",
        TARGETS.join(" ")
    )
}

pub fn parse_args(args: &[String]) -> Result<(Vec<String>, Budget), String> {
    let mut targets = Vec::new();
    let mut budget = Budget::Seconds(60);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut number = |what: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{what} needs a positive number\n{}", usage()))
        };
        match arg.as_str() {
            "--time" => budget = Budget::Seconds(number("--time")?),
            "--runs" => budget = Budget::Runs(number("--runs")?),
            "--long" => budget = Budget::Runs(LONG_RUNS),
            t if TARGETS.contains(&t) => targets.push(t.to_string()),
            other => return Err(format!("unknown target or option '{other}'\n{}", usage())),
        }
    }
    if targets.is_empty() {
        targets = all_targets();
    }
    Ok((targets, budget))
}

fn host_triple() -> Result<String, String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| format!("cannot run rustc: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| "cannot read the host triple from rustc -vV".into())
}

/// SanitizerCoverage as libFuzzer wants it, on stable rustc.
const RUSTFLAGS: &str = "--cfg fuzzing -Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares";

/// Build the targets; returns their binaries.
pub fn build(root: &Path, targets: &[String]) -> Result<Vec<PathBuf>, String> {
    let host = host_triple()?;
    let target_dir = root.join("target").join("fuzz").join("build");
    let mut cmd = crate::cargo();
    cmd.args(["build", "--release", "--manifest-path"])
        .arg(root.join("fuzz").join("Cargo.toml"))
        .args(["--target", &host, "--target-dir"])
        .arg(&target_dir)
        .env("RUSTFLAGS", RUSTFLAGS);
    for t in targets {
        cmd.args(["--bin", t]);
    }
    eprintln!("xtask: building the fuzz targets");
    crate::run_cmd(&mut cmd)?;
    let bin_dir = target_dir.join(&host).join("release");
    Ok(targets.iter().map(|t| bin_dir.join(t)).collect())
}

pub fn run_target(
    root: &Path,
    target: &str,
    bin: &Path,
    budget: Budget,
) -> Result<Outcome, String> {
    let fuzz = root.join("target").join("fuzz");
    let corpus = fuzz.join("corpus").join(target);
    let crashes = fuzz.join("crashes").join(target);
    let seeds = root.join("fuzz").join("seeds").join(target);
    for dir in [&corpus, &crashes] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let mut cmd = Command::new(bin);
    match budget {
        Budget::Seconds(s) => cmd.arg(format!("-max_total_time={s}")),
        Budget::Runs(n) => cmd.arg(format!("-runs={n}")),
    };
    cmd.arg(format!("-artifact_prefix={}/", crashes.display()))
        .args(["-print_final_stats=1", "-timeout=10", "-rss_limit_mb=2048"])
        .arg(&corpus);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    eprintln!("xtask: fuzz {target}: {budget:?}");
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let mut outcome = Outcome::new(target);
    let mut tail: Vec<String> = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.map_err(|e| format!("reading {target}'s output: {e}"))?;
        parse_line(&line, &mut outcome);
        // Progress lines ("#N pulse/NEW/REDUCE ...") are many; keep the rest
        // (a crash report) to show.
        if !line.starts_with('#') {
            tail.push(line);
            if tail.len() > 200 {
                tail.remove(0);
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for {target}: {e}"))?;
    outcome.wall_seconds = start.elapsed().as_secs_f64();
    if !status.success() && outcome.crash.is_none() {
        return Err(format!(
            "fuzz target {target} failed ({status}) without saving a crash:\n{}",
            tail.join("\n")
        ));
    }
    if outcome.crash.is_some() {
        eprintln!("{}", tail.join("\n"));
    }
    Ok(outcome)
}

/// Take what a libFuzzer output line tells.
pub fn parse_line(line: &str, o: &mut Outcome) {
    if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
        o.runs = v.trim().parse().unwrap_or(o.runs);
    } else if let Some(v) = line.strip_prefix("stat::average_exec_per_sec:") {
        o.exec_per_sec = v.trim().parse().unwrap_or(o.exec_per_sec);
    } else if let Some(rest) = line.split("Test unit written to ").nth(1) {
        o.crash = Some(PathBuf::from(rest.trim()));
    } else if line.starts_with('#') {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            let slot = match w {
                "cov:" => &mut o.coverage,
                "ft:" => &mut o.features,
                "corp:" => &mut o.corpus,
                _ => continue,
            };
            if let Some(n) = words.next().and_then(|v| v.split('/').next()?.parse().ok()) {
                *slot = n;
            }
        }
    }
}

fn summary(o: &Outcome) -> String {
    format!(
        "fuzz {:<12} {:>11} runs {:>8} exec/s {:>8.1} s  cov {:>5}  ft {:>6}  corpus {:>5}  {}",
        o.target,
        o.runs,
        o.exec_per_sec,
        o.wall_seconds,
        o.coverage,
        o.features,
        o.corpus,
        match (&o.crash, o.slow_unit()) {
            (_, Some(slow)) => format!("ok, slow unit {}", slow.display()),
            (Some(c), None) => format!("CRASH {}", c.display()),
            (None, None) => "ok".into(),
        }
    )
}

/// The commit the targets are built from, and whether the work tree had
/// changes beside it (then the report is not of that commit alone).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Source {
    pub commit: String,
    pub dirty: bool,
}

impl Source {
    fn of(root: &Path) -> Result<Self, String> {
        let git = |args: &[&str]| -> Result<String, String> {
            let out = Command::new("git")
                .arg("-C")
                .arg(root)
                .args(args)
                .output()
                .map_err(|e| format!("cannot run git: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "git {} failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        Ok(Source {
            commit: git(&["rev-parse", "HEAD"])?,
            // Untracked files count too: a new target not yet committed.
            dirty: !git(&["status", "--porcelain"])?.is_empty(),
        })
    }
}

/// target/fuzz/report.json: what was fuzzed, the budget, and every target
/// run so far.
#[derive(Serialize, Deserialize)]
pub struct Report {
    pub source: Source,
    pub budget: Budget,
    pub targets: Vec<Outcome>,
}

fn report_path(root: &Path) -> PathBuf {
    root.join("target").join("fuzz").join("report.json")
}

fn write_report(
    root: &Path,
    source: &Source,
    budget: Budget,
    outcomes: &[Outcome],
) -> Result<(), String> {
    let path = report_path(root);
    let earlier = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str::<Report>(&text).ok());
    json::write(&path, &merged(earlier, source, budget, outcomes))
}

/// The report after a run of `outcomes`: an earlier report of the same
/// clean commit and budget keeps its other targets (a long run can be done
/// a few targets at a time, one run after another), in [`TARGETS`] order;
/// anything else is replaced.
pub fn merged(
    earlier: Option<Report>,
    source: &Source,
    budget: Budget,
    outcomes: &[Outcome],
) -> Report {
    let mut targets = outcomes.to_vec();
    if let Some(earlier) =
        earlier.filter(|r| r.source == *source && !source.dirty && r.budget == budget)
    {
        targets.extend(
            earlier
                .targets
                .into_iter()
                .filter(|o| !outcomes.iter().any(|n| n.target == o.target)),
        );
        let rank = |t: &str| {
            TARGETS
                .iter()
                .position(|&k| k == t)
                .unwrap_or(TARGETS.len())
        };
        targets.sort_by_key(|o| rank(&o.target));
    }
    Report {
        source: source.clone(),
        budget,
        targets,
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The report as docs/TRUST.md shows it: where it comes from, then one
/// row per target in the order they ran.
pub fn render_table(report: &Report) -> String {
    let commit: String = report.source.commit.chars().take(12).collect();
    let budget = match report.budget {
        Budget::Runs(n) => format!("`--runs {n}`"),
        Budget::Seconds(s) => format!("`--time {s}`"),
    };
    let mut out = format!(
        "Generated from target/fuzz/report.json by `cargo xtask fuzz --table`: \
         targets built from commit `{commit}`{}, {budget} each.\n\n",
        if report.source.dirty {
            " with uncommitted changes"
        } else {
            ""
        }
    );
    out.push_str("| target | executions | exec/s | wall time | cov | ft | crashes |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
    for o in &report.targets {
        let wall = if o.wall_seconds < 100.0 {
            format!("{:.1} s", o.wall_seconds)
        } else {
            format!("{} s", thousands(o.wall_seconds.round() as u64))
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            o.target,
            thousands(o.runs),
            thousands(o.exec_per_sec),
            wall,
            thousands(o.coverage),
            thousands(o.features),
            u8::from(o.crashed()),
        ));
    }
    let slow: Vec<String> = report
        .targets
        .iter()
        .filter_map(|o| {
            let name = o.slow_unit()?.file_name()?.to_string_lossy().into_owned();
            Some(format!("{} (`{name}`)", o.target))
        })
        .collect();
    if !slow.is_empty() {
        out.push_str(&format!(
            "\nSlow units (an execution over 10 s, saved by libFuzzer; not crashes): {}.\n",
            slow.join(", ")
        ));
    }
    out
}

/// `doc` with what lies between the table markers replaced by `table`.
pub fn splice_table(doc: &str, table: &str) -> Result<String, String> {
    let begin = doc
        .find(TABLE_BEGIN)
        .ok_or_else(|| format!("no {TABLE_BEGIN} marker"))?;
    let after = begin + TABLE_BEGIN.len();
    let end = doc[after..]
        .find(TABLE_END)
        .map(|e| after + e)
        .ok_or_else(|| format!("no {TABLE_END} marker after {TABLE_BEGIN}"))?;
    Ok(format!("{}\n{}{}", &doc[..after], table, &doc[end..]))
}

/// `--table`: docs/TRUST.md's fuzzing table from target/fuzz/report.json.
fn write_table(root: &Path) -> Result<(), String> {
    let path = report_path(root);
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let report: Report =
        serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))?;
    let table = render_table(&report);
    let doc_path = root.join("docs").join("TRUST.md");
    let doc = std::fs::read_to_string(&doc_path)
        .map_err(|e| format!("reading {}: {e}", doc_path.display()))?;
    let doc = splice_table(&doc, &table).map_err(|e| format!("{}: {e}", doc_path.display()))?;
    std::fs::write(&doc_path, doc).map_err(|e| format!("writing {}: {e}", doc_path.display()))?;
    print!("{table}");
    eprintln!("xtask: wrote the table into {}", doc_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_output() {
        let mut o = Outcome::new("t");
        for line in [
            "#1192671\tDONE   cov: 165 ft: 842 corp: 403/101Kb lim: 4096 exec/s: 91743 rss: 28Mb",
            "stat::number_of_executed_units: 1192671",
            "stat::average_exec_per_sec:     91743",
        ] {
            parse_line(line, &mut o);
        }
        assert_eq!(
            (o.runs, o.exec_per_sec, o.coverage, o.features, o.corpus),
            (1192671, 91743, 165, 842, 403)
        );
        assert!(o.crash.is_none());
        parse_line(
            "artifact_prefix='x/'; Test unit written to x/crash-d197baba",
            &mut o,
        );
        assert_eq!(o.crash, Some(PathBuf::from("x/crash-d197baba")));
    }

    #[test]
    fn report_keeps_its_fields() {
        let mut ok = Outcome::new("exit_decode");
        (ok.runs, ok.exec_per_sec, ok.wall_seconds) = (1192671, 91743, 13.04999);
        (ok.coverage, ok.features, ok.corpus) = (165, 842, 403);
        let mut crashed = Outcome::new("bundle");
        crashed.crash = Some(PathBuf::from("target/fuzz/crashes/bundle/crash-d197baba"));
        let source = Source {
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            dirty: true,
        };
        let report = |budget| {
            serde_json::to_value(Report {
                source: source.clone(),
                budget,
                targets: vec![ok.clone(), crashed.clone()],
            })
            .unwrap()
        };
        let value = report(Budget::Seconds(3));
        assert_eq!(
            value["source"],
            serde_json::json!({"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": true})
        );
        assert_eq!(value["budget"], serde_json::json!({"seconds": 3}));
        assert_eq!(
            value["targets"],
            serde_json::json!([
                {"target": "exit_decode", "runs": 1192671, "exec_per_sec": 91743,
                 "wall_seconds": 13.0, "coverage": 165, "features": 842, "corpus": 403,
                 "crash": null},
                {"target": "bundle", "runs": 0, "exec_per_sec": 0, "wall_seconds": 0.0,
                 "coverage": 0, "features": 0, "corpus": 0,
                 "crash": "target/fuzz/crashes/bundle/crash-d197baba"}
            ])
        );
        assert_eq!(
            report(Budget::Runs(1000))["budget"],
            serde_json::json!({"runs": 1000})
        );
    }

    #[test]
    fn arguments() {
        let args = |a: &[&str]| parse_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let (t, b) = args(&[]).unwrap();
        assert_eq!(t.len(), TARGETS.len());
        assert!(matches!(b, Budget::Seconds(60)));
        let (t, b) = args(&["pl011", "--runs", "1000"]).unwrap();
        assert_eq!(t, ["pl011"]);
        assert!(matches!(b, Budget::Runs(1000)));
        assert!(args(&["nosuch"]).is_err());
        assert!(args(&["--time"]).is_err());
        assert!(args(&["--time", "0"]).is_err());
        let (_, b) = args(&["manager", "--long"]).unwrap();
        assert!(matches!(b, Budget::Runs(LONG_RUNS)));
    }

    #[test]
    fn the_table_says_what_it_is_from() {
        let text = r#"{
          "source": {"commit": "69d1aa9d2c3e4f5a6b7c8d9e0f1a2b3c4d5e6f70", "dirty": false},
          "budget": {"runs": 10000000},
          "targets": [
            {"target": "exit_decode", "runs": 10000000, "exec_per_sec": 833333,
             "wall_seconds": 12.94, "coverage": 71, "features": 72, "corpus": 24,
             "crash": null},
            {"target": "balloon", "runs": 10000000, "exec_per_sec": 2069,
             "wall_seconds": 4834.4, "coverage": 1440, "features": 8025, "corpus": 900,
             "crash": "target/fuzz/crashes/balloon/crash-1"}
          ]
        }"#;
        let report: Report = serde_json::from_str(text).unwrap();
        let table = render_table(&report);
        assert_eq!(
            table,
            "Generated from target/fuzz/report.json by `cargo xtask fuzz --table`: \
             targets built from commit `69d1aa9d2c3e`, `--runs 10000000` each.\n\n\
             | target | executions | exec/s | wall time | cov | ft | crashes |\n\
             |---|---:|---:|---:|---:|---:|---:|\n\
             | exit_decode | 10,000,000 | 833,333 | 12.9 s | 71 | 72 | 0 |\n\
             | balloon | 10,000,000 | 2,069 | 4,834 s | 1,440 | 8,025 | 1 |\n"
        );
        let dirty = Report {
            source: Source {
                dirty: true,
                ..report.source.clone()
            },
            ..report
        };
        assert!(render_table(&dirty).contains("`69d1aa9d2c3e` with uncommitted changes"));
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
    }

    #[test]
    fn a_slow_unit_is_no_crash() {
        let mut o = Outcome::new("exit_dispatch");
        parse_line(
            "artifact_prefix='x/'; Test unit written to x/slow-unit-a82b82dd",
            &mut o,
        );
        assert_eq!(o.slow_unit(), Some(Path::new("x/slow-unit-a82b82dd")));
        assert!(!o.crashed());
        assert!(summary(&o).ends_with("ok, slow unit x/slow-unit-a82b82dd"));
        let mut c = Outcome::new("bundle");
        parse_line("Test unit written to x/crash-d197baba", &mut c);
        assert!(c.crashed() && c.slow_unit().is_none());
        let report = Report {
            source: Source {
                commit: "0123456789abcdef0123456789abcdef01234567".into(),
                dirty: false,
            },
            budget: Budget::Runs(10),
            targets: vec![o, c],
        };
        let table = render_table(&report);
        assert!(
            table.contains("| exit_dispatch | 0 | 0 | 0.0 s | 0 | 0 | 0 |"),
            "{table}"
        );
        assert!(
            table.contains("| bundle | 0 | 0 | 0.0 s | 0 | 0 | 1 |"),
            "{table}"
        );
        assert!(
            table.contains("not crashes): exit_dispatch (`slow-unit-a82b82dd`)."),
            "{table}"
        );
    }

    #[test]
    fn a_long_run_in_parts_adds_up_for_one_commit() {
        let source = |commit: &str, dirty| Source {
            commit: commit.into(),
            dirty,
        };
        let ran = |t: &str, runs| Outcome {
            runs,
            ..Outcome::new(t)
        };
        let long = Budget::Runs(LONG_RUNS);
        let first = merged(None, &source("abc", false), long, &[ran("balloon", 1)]);
        // Same commit and budget: the earlier target stays, in run order.
        let both = merged(
            Some(first),
            &source("abc", false),
            long,
            &[ran("exit_decode", 2)],
        );
        let names: Vec<_> = both.targets.iter().map(|o| o.target.as_str()).collect();
        assert_eq!(names, ["exit_decode", "balloon"]);
        // Run again: the new figures replace the old.
        let again = merged(
            Some(both),
            &source("abc", false),
            long,
            &[ran("balloon", 3)],
        );
        assert_eq!(again.targets.len(), 2);
        assert_eq!(again.targets[1].runs, 3);
        // Another commit, a dirty tree or another budget start over.
        for (src, budget) in [
            (source("def", false), long),
            (source("abc", true), long),
            (source("abc", false), Budget::Seconds(3)),
        ] {
            let earlier = merged(None, &source("abc", false), long, &[ran("balloon", 1)]);
            let r = merged(Some(earlier), &src, budget, &[ran("psci", 1)]);
            assert_eq!(r.targets.len(), 1, "{src:?} {budget:?}");
        }
    }

    #[test]
    fn the_table_goes_between_its_markers() {
        let doc = format!("# T\n\nbefore\n{TABLE_BEGIN}\nold table\n{TABLE_END}\nafter\n");
        let spliced = splice_table(&doc, "| new |\n").unwrap();
        assert_eq!(
            spliced,
            format!("# T\n\nbefore\n{TABLE_BEGIN}\n| new |\n{TABLE_END}\nafter\n")
        );
        // Again: the same document (idempotent).
        assert_eq!(splice_table(&spliced, "| new |\n").unwrap(), spliced);
        assert!(splice_table("no markers", "x").is_err());
        assert!(splice_table(TABLE_BEGIN, "x").is_err());
    }
}
