//! A Linux guest with every balloon feature (linux-full.toml: two vCPUs,
//! statistics, deflate-on-OOM, free page hinting, page poisoning, free
//! page reporting) saved with `snapshot`, stopped and restored (issue
//! 39): a process started before the snapshot keeps counting, a file in
//! its tmpfs is intact, the agent answers, its uptime moves on from where
//! it was, and its balloon driver still works (inflate, deflate, a hinting
//! run). A second snapshot is taken while the balloon inflates, and the
//! inflation completes after its restore. Ignored by plain `cargo test`;
//! `cargo xtask test` runs them.

use std::time::Duration;

use harness::linux::{agent_run, wait_for_agents};
use harness::{disk_image, Artifacts, Board, HarnessError, QemuOptions, Session};

const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(60);
const SAVE: Duration = Duration::from_secs(180);
const COMMAND: Duration = Duration::from_secs(20);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn agent(s: &mut Session, id: u32, cmd: &str) -> Vec<String> {
    let reply = ok(agent_run(s, "linux", id, cmd, STEP));
    assert_eq!(reply.rc, 0, "`{cmd}` failed:\n{:?}", reply.lines);
    reply.lines
}

/// The first number of the first line of `lines` that starts with `key`.
fn number_after(lines: &[String], key: &str) -> f64 {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no `{key}` line in {lines:?}"))
}

/// `snapshot linux <name>`: waits for its `saved` line; the line and the
/// pages line after it.
fn snapshot(s: &mut Session, name: &str) -> (String, String) {
    ok(s.run(&format!("snapshot linux {name}"), COMMAND));
    let saved = ok(s.expect(
        &format!(r"snapshot {name}: (linux saved, [^\r\n]*|not taken: [^\r\n]*)"),
        SAVE,
    ));
    assert!(saved[1].starts_with("linux saved"), "{}", saved[1]);
    let pages = ok(s.expect(r"  pages: [^\r\n]*", COMMAND));
    eprintln!("snapshot {name}: {}\n{}", saved[1], pages[0]);
    (saved[1].clone(), pages[0].clone())
}

/// `stop linux`, then `restore <name>`; waits until it is done (later,
/// if the board's clock must first pass the guest's).
fn stop_and_restore(s: &mut Session, name: &str) {
    ok(s.run("stop linux", COMMAND));
    let out = ok(s.run(&format!("restore {name}"), SAVE));
    let done = format!("restore: linux runs again from '{name}'");
    if !out.contains(&done) {
        assert!(
            out.contains(&format!("restore: linux starts from '{name}' in")),
            "{out}"
        );
        ok(s.expect(&regex::escape(&done), STEP));
    }
}

/// Polls `info balloon linux` until it shows `what` (60 s at most).
fn wait_info(s: &mut Session, what: &str) {
    for _ in 0..60 {
        let info = ok(s.run("info balloon linux", COMMAND));
        if info.contains(what) {
            return;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let info = ok(s.run("info balloon linux", COMMAND));
    panic!("`info balloon linux` never showed `{what}`:\n{info}");
}

fn saved_and_restored(board: Board) {
    let name = format!("{}-linux-snapshot", board.name());
    let disk = disk_image(&name, 2048);
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.initrd = Some(harness::target_dir().join("bundles").join("linux-full.img"));
    opts.disk = Some(disk.clone());
    let mut s = ok(Session::start(&name, board, &artifacts, &opts));
    s.set_deadline(Duration::from_secs(900));
    ok(wait_for_agents(&mut s, &["linux"], 0, BOOT));

    // A counter in the background, a file in tmpfs, the clock.
    agent(
        &mut s,
        1,
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &",
    );
    agent(
        &mut s,
        2,
        "dd if=/dev/urandom of=/tmp/data bs=1M count=24 2>/dev/null; md5sum /tmp/data > /tmp/data.md5",
    );
    let sum = agent(&mut s, 3, "cat /tmp/data.md5");
    let count_before = number_after(&agent(&mut s, 4, "echo count $(cat /tmp/count)"), "count ");
    let uptime_before = number_after(
        &agent(&mut s, 5, "echo up $(cut -d' ' -f1 /proc/uptime)"),
        "up ",
    );
    assert!(count_before >= 1.0);

    let (saved, pages) = snapshot(&mut s, "s1");
    assert!(saved.contains("written; paused"), "{saved}");
    let hinted = harness::console::first_number(&pages, r"the guest hinted (\d+) pages free")
        .unwrap_or_else(|| panic!("{pages}"));
    assert!(
        hinted > 0,
        "the guest hinted nothing before the snapshot: {pages}"
    );
    // It goes on after the snapshot.
    agent(&mut s, 6, "true");

    stop_and_restore(&mut s, "s1");
    let sum_after = agent(&mut s, 7, "md5sum -c /tmp/data.md5 && cat /tmp/data.md5");
    assert!(
        sum_after.iter().any(|l| l.ends_with(": OK")),
        "{sum_after:?}"
    );
    assert!(
        sum_after.iter().any(|l| sum.contains(l)),
        "{sum_after:?} vs {sum:?}"
    );
    let count_1 = number_after(&agent(&mut s, 8, "echo count $(cat /tmp/count)"), "count ");
    std::thread::sleep(Duration::from_secs(2));
    let count_2 = number_after(&agent(&mut s, 9, "echo count $(cat /tmp/count)"), "count ");
    assert!(
        count_1 >= count_before && count_2 > count_1,
        "the counter started before the snapshot: {count_before}, then {count_1}, {count_2}"
    );
    let uptime_after = number_after(
        &agent(&mut s, 10, "echo up $(cut -d' ' -f1 /proc/uptime)"),
        "up ",
    );
    assert!(
        uptime_after >= uptime_before,
        "uptime went back from {uptime_before} to {uptime_after}"
    );

    // The balloon driver still works: free page reporting gives back what
    // a process freed, inflate, deflate, a hinting run.
    let reported = |s: &mut Session| {
        let info = ok(s.run("info balloon linux", COMMAND));
        harness::console::first_number(
            &info,
            r"free page reporting: \d+ reports, \d+ blocks, (\d+) pages",
        )
        .unwrap_or_else(|| panic!("{info}"))
    };
    let before = reported(&mut s);
    agent(&mut s, 12, "tidal-mem hog 96");
    let mut grew = false;
    for _ in 0..30 {
        if reported(&mut s) >= before + 8192 {
            grew = true;
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(
        grew,
        "free page reporting gave back less than 32 MiB of 96 after the restore"
    );
    ok(s.run("balloon linux 96M", COMMAND));
    ok(s.expect(r"tidal: \[linux\] balloon: reached 24576 pages", STEP));
    ok(s.run("balloon linux 0", COMMAND));
    ok(s.expect(r"tidal: \[linux\] balloon: reached 0 pages", STEP));
    let out = ok(s.run("hint linux", COMMAND));
    let id = harness::console::first_number(&out, r"hinting run (\d+) started")
        .unwrap_or_else(|| panic!("{out}"));
    wait_info(&mut s, &format!("last run {id} done"));
    s.assert_check();

    // A snapshot taken while the balloon inflates: after its restore the
    // driver carries on to the target.
    ok(s.run("balloon linux 128M", COMMAND));
    snapshot(&mut s, "s2");
    stop_and_restore(&mut s, "s2");
    wait_info(&mut s, "actual 32768 pages");
    agent(&mut s, 11, "md5sum -c /tmp/data.md5");
    s.assert_check();
    drop(s);
    // Kept only when the test failed.
    let _ = std::fs::remove_file(&disk);
}

mod virt_gicv3 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn saved_and_restored() {
        super::saved_and_restored(Board::VirtGicv3);
    }
}

mod virt_gicv2 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn saved_and_restored() {
        super::saved_and_restored(Board::VirtGicv2);
    }
}
