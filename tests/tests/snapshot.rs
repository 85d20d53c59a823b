//! Snapshots under QEMU (issue 39): the bare-metal test guest saved with
//! `snapshot`, stopped, and started again with `restore`: its heartbeat
//! goes on from where it was and its memory pattern verifies; the
//! snapshot survives QEMU's exit and restores into a fresh boot of the
//! board (a VM configured with `restore = "s1"`, pair-restore.toml);
//! a damaged one is refused with nothing started. Ignored by plain
//! `cargo test`; `cargo xtask test` runs them.

use std::path::Path;
use std::time::Duration;

use harness::{disk_image, Artifacts, Board, HarnessError, QemuOptions, Session, PROMPT};

const BOOT: Duration = Duration::from_secs(60);
const COMMAND: Duration = Duration::from_secs(10);
/// A snapshot of a 128 MiB guest whose pattern fills its free memory,
/// written through QEMU's emulated disk.
const SAVE: Duration = Duration::from_secs(120);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// Boots `bundle` (target/bundles/<bundle>.img) with `disk` attached.
fn boot(board: Board, bundle: &str, name: &str, disk: &Path) -> Session {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.initrd = Some(
        harness::target_dir()
            .join("bundles")
            .join(format!("{bundle}.img")),
    );
    opts.disk = Some(disk.to_path_buf());
    let mut s = ok(Session::start(name, board, &artifacts, &opts));
    ok(s.expect(&regex::escape(PROMPT), BOOT));
    s
}

/// The latest heartbeat (`alive Ns`) of `vm` printed so far.
fn last_beat(s: &Session, vm: &str) -> u64 {
    let re = regex::Regex::new(&format!(r"\[{vm}\] testguest: alive (\d+)s")).unwrap();
    re.captures_iter(&s.output())
        .last()
        .map_or(0, |c| c[1].parse().unwrap())
}

/// Waits for `vm`'s restore from `name` to be done (now, or later if
/// the board's clock had to pass the guest's first); the restore's line.
fn restored(s: &mut Session, answer: &str, vm: &str, name: &str) -> String {
    let done = format!(
        r"restore: {vm} (runs again from '{name}'[^\r\n]*|not started from '{name}'[^\r\n]*)"
    );
    if let Some(m) = regex::Regex::new(&done).unwrap().find(answer) {
        return m.as_str().to_string();
    }
    // From the start of the output: a restore at boot may have been done
    // before the prompt.
    ok(s.expect_since(&mut 0, &done, BOOT))[0].clone()
}

/// `stop <vm>`, then `restore <name>`: the restore's line.
fn stop_and_restore(s: &mut Session, vm: &str, name: &str) -> String {
    // `stop` waits until the VM has stopped (its vCPU is not on the
    // shell's CPU).
    ok(s.run(&format!("stop {vm}"), COMMAND));
    let answer = ok(s.run(&format!("restore {name}"), SAVE));
    restored(s, &answer, vm, name)
}

fn saved_restored_and_refused_when_damaged(board: Board) {
    let name = format!("{}-snapshot", board.name());
    let path = disk_image(&name, 1024);
    let mut s = boot(board, "pair", &name, &path);
    ok(s.await_test_guests(&["alpha", "beta"], BOOT));
    // Its pattern is set and verified once before the snapshot.
    ok(s.balloon_test_guest("beta", 16, SAVE));
    ok(s.expect(r"\[beta\] testguest: alive \d+s", COMMAND));
    let before = last_beat(&s, "beta");

    ok(s.run("snapshot beta s1", COMMAND));
    let saved = ok(s.expect(
        r"snapshot s1: beta saved, ([0-9.]+ [KMG]iB) written; paused (\d+) ms",
        SAVE,
    ));
    let pages = ok(s.expect(
        r"pages: (\d+) data, (\d+) zero \(a bit each\), (\d+) not written: (\d+) ballooned",
        COMMAND,
    ));
    eprintln!(
        "snapshot: {} written, paused {} ms; {} data, {} zero, {} not written ({} ballooned)",
        saved[1], saved[2], pages[1], pages[2], pages[3], pages[4]
    );
    assert_eq!(pages[4], "4096", "the 16 MiB balloon is not written");
    // It goes on running after the snapshot.
    ok(s.expect(r"\[beta\] testguest: alive \d+s", COMMAND));
    let out = ok(s.run("snapshots", COMMAND));
    assert!(out.contains("s1") && out.contains("beta"), "{out}");

    // Stopped and restored: the heartbeat goes on from the snapshot's
    // count (not from 0, as a boot would), and its pattern verifies.
    let out = stop_and_restore(&mut s, "beta", "s1");
    assert!(out.contains("runs again from 's1'"), "{out}");
    let beat = ok(s.expect(r"\[beta\] testguest: alive (\d+)s", COMMAND));
    let after: u64 = beat[1].parse().unwrap();
    assert!(
        after >= before,
        "the restored guest's clock went back: alive {after}s after alive {before}s"
    );
    ok(s.balloon_test_guest("beta", 8, SAVE));
    s.assert_check();
    let out = ok(s.run("snapshot beta s1", COMMAND));
    assert!(out.contains("exists"), "{out}");
    drop(s);

    // The disk survives QEMU's exit: a fresh boot of a configuration
    // that says `restore = "s1"` for beta starts it from the snapshot.
    let mut s = boot(board, "pair-restore", &format!("{name}-again"), &path);
    let line = restored(&mut s, "", "beta", "s1");
    assert!(line.contains("runs again"), "{line}");
    let beat = ok(s.expect(r"\[beta\] testguest: alive (\d+)s", COMMAND));
    assert!(beat[1].parse::<u64>().unwrap() >= before);
    ok(s.balloon_test_guest("beta", 4, SAVE));
    s.assert_check();
    drop(s);

    // A damaged snapshot: a byte of its data flipped on the image.
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .read(true)
            .open(&path)
            .unwrap();
        // Well inside the first snapshot's pages (its data starts at
        // sector 72).
        let at = 72 * 512 + (8 << 20);
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, at).unwrap();
        file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
    }
    let mut s = boot(board, "pair-restore", &format!("{name}-damaged"), &path);
    let out = restored(&mut s, "", "beta", "s1");
    assert!(out.contains("not started from 's1'"), "{out}");
    assert!(out.contains("checksum"), "{out}");
    ok(s.await_test_guests(&["alpha"], BOOT));
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines()
            .any(|l| l.contains("beta") && l.contains("stopped")),
        "{vms}"
    );
    s.assert_check();
    // The other VM was never disturbed.
    ok(s.balloon_test_guest("alpha", 8, SAVE));
    drop(s);
    // Kept only when the test failed.
    let _ = std::fs::remove_file(&path);
}

mod virt_gicv2 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn saved_restored_and_refused_when_damaged() {
        super::saved_restored_and_refused_when_damaged(Board::VirtGicv2);
    }
}

mod virt_gicv3 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn saved_restored_and_refused_when_damaged() {
        super::saved_restored_and_refused_when_damaged(Board::VirtGicv3);
    }
}
