//! The on-target test bundle (guests/tests/on-target.toml, the bundle
//! `cargo xtask sdcard --tests` puts on a Pi 4's SD card) under QEMU
//! raspi4b: the hypervisor runs its self-checks once the VMs have started
//! and every one of them passes, so the on-target suite is itself tested on
//! every change. QEMU raspi4b gives the hypervisor 1984 MiB, enough for the
//! Linux VM: none of the checks is skipped.

use std::time::{Duration, Instant};

use harness::{Board, HarnessError, Session};

/// The checks, in the order the hypervisor runs them (hypervisor/src/selftest.rs `CHECKS`).
const CHECKS: [&str; 8] = [
    "cpus",
    "memory",
    "isolation",
    "balloon",
    "linux-balloon",
    "linux-reporting",
    "linux-hint",
    "final-check",
];

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[ignore = "boots QEMU: run cargo xtask test"]
fn on_target_suite_passes_on_raspi4b() {
    let mut s = ok(Session::start_bundle(
        Board::Raspi4b,
        "on-target",
        "on_target",
    ));
    s.set_deadline(Duration::from_secs(300));
    let since = s.mark();
    ok(s.expect(
        r"ON-TARGET: on-target checks start \(8 of them",
        Duration::from_secs(90),
    ));
    let summary = ok(s.expect(
        r"ON-TARGET: (\d+) passed, (\d+) failed",
        Duration::from_secs(280),
    ));
    let took = Instant::now() - s.started();
    let out = s.output();
    let lines: Vec<&str> = out[since.min(out.len())..]
        .lines()
        .filter_map(|l| l.find("ON-TARGET:").map(|i| l[i..].trim_end()))
        .collect();
    eprintln!(
        "on-target run: summary after {:.1} s:\n{}",
        took.as_secs_f64(),
        lines.join("\n")
    );
    assert_eq!(
        (summary[1].as_str(), summary[2].as_str()),
        ("8", "0"),
        "{}",
        lines.join("\n")
    );
    // One `ok` line per check, in order, and nothing skipped or failed.
    let verdicts: Vec<&str> = lines
        .iter()
        .filter(|l| !l.contains("checks start") && !l.contains(" passed, "))
        .copied()
        .collect();
    assert_eq!(verdicts.len(), CHECKS.len(), "{verdicts:#?}");
    for (line, name) in verdicts.iter().zip(CHECKS) {
        assert!(
            line.starts_with(&format!("ON-TARGET: ok {name}: ")),
            "{line} (expected check {name})"
        );
    }
    // The shell comes up as usual after the checks.
    ok(s.expect(
        "Type 'help' for the list of commands.",
        Duration::from_secs(20),
    ));
    s.assert_check();
}
