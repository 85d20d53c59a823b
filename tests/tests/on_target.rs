//! The on-target test bundle (guests/tests/on-target.toml, the bundle
//! `cargo xtask sdcard --tests` puts on a Pi 4's SD card) under QEMU
//! raspi4b: the hypervisor runs its self-checks once the VMs have started
//! and every one of them passes, so the on-target suite is itself tested on
//! every change. QEMU raspi4b gives the hypervisor 1984 MiB, enough for the
//! Linux VM: none of the checks is skipped. The same bundle on a 512 MiB
//! virt board shows the other side: Linux cannot start, its three checks
//! are skipped with the reason, the other five pass.

use std::time::{Duration, Instant};

use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};
// The checks in the order the hypervisor runs them: its own list.
use hypervisor::selftest::CHECKS;

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// The `ON-TARGET:` lines of `s`'s output so far.
fn on_target_lines(s: &Session) -> Vec<String> {
    s.output()
        .lines()
        .filter_map(|l| l.find("ON-TARGET:").map(|i| l[i..].trim_end().to_string()))
        .collect()
}

#[test]
#[ignore = "boots QEMU: run cargo xtask test"]
fn too_little_ram_skips_linux_with_the_reason() {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(Board::VirtGicv2, &artifacts);
    opts.initrd = Some(target_dir().join("bundles").join("on-target.img"));
    opts.memory = Some("512M".into());
    let mut s = ok(Session::start(
        "virt-gicv2-on_target_512m",
        Board::VirtGicv2,
        &artifacts,
        &opts,
    ));
    s.set_deadline(Duration::from_secs(240));
    ok(s.expect(r"tidal: \[linux\] VM not started", Duration::from_secs(90)));
    let summary = ok(s.expect(
        r"ON-TARGET: (\d+) passed, (\d+) failed",
        Duration::from_secs(200),
    ));
    let lines = on_target_lines(&s);
    assert_eq!(
        (summary[1].as_str(), summary[2].as_str()),
        ("5", "0"),
        "{}",
        lines.join("\n")
    );
    for name in ["linux-balloon", "linux-reporting", "linux-hint"] {
        let line = format!(
            "ON-TARGET: skipped {name}: the board has 512 MiB of RAM; the bundle's VMs need 576 MiB"
        );
        assert!(
            lines.iter().any(|l| l.starts_with(&line)),
            "no `{line}` in:\n{}",
            lines.join("\n")
        );
    }
    ok(s.expect(
        "Type 'help' for the list of commands.",
        Duration::from_secs(20),
    ));
    s.assert_check();
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
    ok(s.expect(
        &format!(
            r"ON-TARGET: on-target checks start \({} of them",
            CHECKS.len()
        ),
        Duration::from_secs(90),
    ));
    let summary = ok(s.expect(
        r"ON-TARGET: (\d+) passed, (\d+) failed",
        Duration::from_secs(280),
    ));
    let took = Instant::now() - s.started();
    let lines = on_target_lines(&s);
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
    let verdicts: Vec<&String> = lines
        .iter()
        .filter(|l| !l.contains("checks start") && !l.contains(" passed, "))
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
