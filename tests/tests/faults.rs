//! Fault injection under QEMU: a VM stopped in the middle of an inflate, the
//! pool running out during a fault-in, a vCPU spinning with interrupts
//! masked that the shell must still stop, a guest writing its console in a
//! tight loop while the shell is used, a statistics buffer never given back,
//! and a Linux guest reset while reporting and while hinting. In every case
//! the hypervisor and the other VMs keep running, and `check` (frame table
//! invariants, every VM's stage-2 tables map only frames it owns, a stopped
//! VM's pages are all back in the pool) passes afterwards.
//!
//! Hypervisor lines may carry a `tidal: ` prefix before `[vm]`; the patterns
//! below are unanchored so they match either way.

use std::time::{Duration, Instant};

use harness::linux::{agent_run, enter_console, leave_console, wait_for_agents};
use harness::{console::first_number, Board, HarnessError, Session};

const STEP: Duration = Duration::from_secs(90);
const BOOT: Duration = Duration::from_secs(240);
const COMMAND: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn start(board: Board, bundle: &str, scenario: &str) -> Session {
    let s = ok(Session::start_bundle(board, bundle, scenario));
    s.set_deadline(Duration::from_secs(600));
    s
}

/// Waits until every bare-metal VM in `vms` has its balloon set up.
fn wait_balloons(s: &mut Session, vms: &[&str]) {
    ok(s.await_test_guests(vms, STEP));
}

fn category(s: &mut Session, name: &str) -> u64 {
    s.mem_category(name, COMMAND)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Stops `vm` from the shell; the number of pages it gave back.
fn stop(s: &mut Session, vm: &str) -> u64 {
    let out = ok(s.run(&format!("stop {vm}"), COMMAND));
    let stopped = format!(r"\[{vm}\] VM stopped: stopped from the shell; (\d+) pages returned");
    match first_number(&out, &stopped) {
        Some(n) => n,
        None => ok(s.expect(&stopped, STEP))[1].parse().unwrap(),
    }
}

fn assert_alive(s: &mut Session, vm: &str) {
    ok(s.expect(&format!(r"\[{vm}\] testguest: alive \d+s"), STEP));
}

/// `stop` while the balloon is inflating: exactly the VM's pages go back
/// (those still mapped, and the ones the inflate had already returned), its
/// tables are freed, and it starts again whole.
fn stop_in_the_middle_of_an_inflate(board: Board) {
    let mut s = start(board, "pair", "faults_stop_mid_inflate");
    wait_balloons(&mut s, &["alpha", "beta"]);
    let guest0 = category(&mut s, "guest RAM");
    assert_eq!(guest0, 384 * MIB);
    // alpha has 256 MiB: inflate 200 MiB and stop it as soon as the first
    // pages have moved.
    ok(s.run("balloon alpha 200M", COMMAND));
    let moved = ok(s.poll_command("info balloon alpha", r"ballooned (\d+) pages", 1, STEP));
    let returned = stop(&mut s, "alpha");
    assert!(
        returned < 65536,
        "alpha had ballooned {moved} pages before the stop, yet returned all {returned}"
    );
    assert_eq!(category(&mut s, "guest RAM"), 128 * MIB, "only beta's RAM");
    s.assert_check();
    assert_alive(&mut s, "beta");
    // alpha starts again with all its RAM and a fresh balloon.
    // Its lines may come before the command's own reply.
    let mut since = s.mark();
    ok(s.run("start alpha", COMMAND));
    ok(s.expect_since(&mut since, r"\[alpha\] testguest: balloon at ", STEP));
    assert_eq!(category(&mut s, "guest RAM"), guest0);
    ok(s.balloon_test_guest("alpha", 64, STEP));
    s.assert_check();
}

/// The pool runs out while a guest faults its deflated pages back in: only
/// that guest's vCPU waits (the console says so after a second), the other
/// VM keeps running, and when frames come back the guest carries on with
/// its memory intact and everything accounted. Both balloons are set by
/// hand, so the memory manager has no VM to reclaim from.
fn pool_runs_out_during_a_fault_in(board: Board) {
    let mut s = start(board, "pair", "faults_pool_runs_out");
    wait_balloons(&mut s, &["alpha", "beta"]);
    ok(s.run("balloon beta 0", COMMAND));
    ok(s.run("balloon alpha 64M", COMMAND));
    ok(s.expect(
        r"\[alpha\] testguest: balloon target=16384 actual=16384 pages",
        STEP,
    ));
    let hog = ok(s.run("debug hog all", COMMAND));
    assert!(hog.contains("debug hog: took"), "{hog}");
    assert_eq!(category(&mut s, "free"), 0, "the pool is empty");
    // alpha deflates and touches its pages again: no frame to back them.
    let mut since = s.mark();
    ok(s.run("balloon alpha 0", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"tidal: \[alpha\] vCPU 0 waits for memory: the pool is at its min watermark",
        STEP,
    ));
    assert_alive(&mut s, "beta");
    assert_alive(&mut s, "beta");
    let mm = ok(s.run("mm raw", COMMAND));
    assert!(
        mm.lines()
            .any(|l| l.starts_with("mm-vm name=alpha state=running") && !l.contains(" waits=0")),
        "{mm}"
    );
    assert!(!s.output().contains("VM stopped"), "{}", s.output());
    let unhog = ok(s.run("debug unhog", COMMAND));
    assert!(unhog.contains("pages back in the pool"), "{unhog}");
    ok(s.expect_since(
        &mut since,
        r"tidal: \[alpha\] vCPU 0 got memory after waiting \d+ ms",
        STEP,
    ));
    ok(s.expect_since(
        &mut since,
        r"\[alpha\] testguest: balloon target=0 actual=0 pages",
        STEP,
    ));
    ok(s.expect_since(&mut since, r"\[alpha\] testguest: pattern ok", STEP));
    assert_eq!(category(&mut s, "guest RAM"), 384 * MIB, "both VMs whole");
    s.assert_check();
}

/// Three misbehaving guests at once: `flooder` writes its console without
/// pause while the shell is used; `holder` keeps the statistics buffer;
/// `spinner` spins with interrupts masked and is stopped from the shell.
fn spin_flood_and_held_stats(board: Board) {
    let mut s = start(board, "faults", "faults_spin_flood_stats");
    // The three guests come up in parallel: their first lines may come in
    // any order, so each is looked for from the start.
    for first in [
        r"\[spinner\] testguest: spin: interrupts masked",
        r"\[flooder\] testguest: flood: \d+ lines",
        r"\[holder\] testguest: stats sent",
    ] {
        ok(s.expect_since(&mut 0, first, STEP));
    }
    // The shell answers while the flood goes on.
    for command in ["help", "vms", "mem", "cpus", "info balloon holder"] {
        let began = Instant::now();
        ok(s.run(command, COMMAND));
        eprintln!(
            "`{command}` answered in {:.2}s during the flood",
            began.elapsed().as_secs_f64()
        );
    }
    // The device returns the statistics buffer to ask for fresh figures;
    // the guest never gives it back. The shell says so and moves on, twice.
    for _ in 0..2 {
        let out = ok(s.run("balloon-stats holder now", COMMAND));
        assert!(
            out.contains("no statistics from the guest within 2 s")
                || out.contains("cannot ask for statistics"),
            "{out}"
        );
    }
    assert_alive(&mut s, "holder");
    // The spinner never traps: only the stop's kick takes its CPU back.
    let returned = stop(&mut s, "spinner");
    assert_eq!(returned, 16384, "spinner's 64 MiB");
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines()
            .any(|l| l.starts_with("spinner") && l.contains("stopped")),
        "{vms}"
    );
    ok(s.expect(r"\[flooder\] testguest: flood: \d+ lines", STEP));
    s.assert_check();
    assert_eq!(stop(&mut s, "flooder"), 16384, "flooder's 64 MiB");
    assert_alive(&mut s, "holder");
    s.assert_check();
    // The spinner can be started again and stopped again. Its first line
    // may come before the command's own reply: looked for from before it.
    let mut since = s.mark();
    ok(s.run("start spinner", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"\[spinner\] testguest: spin: interrupts masked",
        STEP,
    ));
    assert_eq!(stop(&mut s, "spinner"), 16384);
    assert_eq!(stop(&mut s, "holder"), 32768);
    assert_eq!(category(&mut s, "guest RAM"), 0);
    s.assert_check();
}

fn agent(s: &mut Session, id: u32, cmd: &str) -> Vec<String> {
    let reply = ok(agent_run(s, "linux", id, cmd, STEP));
    assert_eq!(reply.rc, 0, "`{cmd}` failed:\n{:?}", reply.lines);
    reply.lines
}

fn reported_pages(s: &mut Session) -> u64 {
    let info = ok(s.run("info balloon linux", COMMAND));
    first_number(&info, r"(\d+) pages reported").unwrap_or(0)
}

/// Linux resets itself (`reboot -f`) while free page reporting is busy and
/// again during a hinting run: it comes back, the device starts clean, the
/// bare-metal neighbour never notices, and every page is accounted.
fn linux_reset_while_reporting_and_hinting(board: Board) {
    let mut s = start(board, "linux-resets", "faults_linux_resets");
    // Both VMs start with all their RAM backed; looked at as soon as the
    // shell is up, before Linux's boot-time free page reporting gives some
    // back.
    ok(s.expect(&regex::escape(harness::PROMPT), BOOT));
    let guest0 = category(&mut s, "guest RAM");
    assert_eq!(guest0, 640 * MIB);
    ok(wait_for_agents(&mut s, &["linux"], 0, BOOT));
    wait_balloons(&mut s, &["beta"]);

    // Reporting: allocate and free 64 MiB in a loop, so free blocks are
    // reported over and over, and reset while that goes on.
    agent(
        &mut s,
        1,
        "(while true; do tidal-mem hog 64; done) >/dev/null 2>&1 &",
    );
    // Linux reports its free memory soon after boot: wait until the loop's
    // frees are being reported too.
    let boot_reports = reported_pages(&mut s);
    let began = Instant::now();
    while reported_pages(&mut s) <= boot_reports {
        assert!(began.elapsed() < STEP, "nothing reported");
        std::thread::sleep(Duration::from_millis(500));
    }
    let before_reset = s.mark();
    ok(enter_console(&mut s, "linux"));
    ok(s.send_line("run 2 reboot -f"));
    ok(s.expect(
        r"\[linux\] VM stopped: reset by the guest \(PSCI SYSTEM_RESET\); \d+ pages returned",
        STEP,
    ));
    ok(leave_console(&mut s));
    // The VM starts again at once with all its RAM backed; looked at before
    // the new kernel's free page reporting (2 s after its driver is up) can
    // give pages back again.
    assert_eq!(
        category(&mut s, "guest RAM"),
        guest0,
        "every page backed again"
    );
    ok(wait_for_agents(&mut s, &["linux"], before_reset, BOOT));
    s.assert_check();
    assert_alive(&mut s, "beta");

    // Hinting: start a run and reset at once.
    let started = ok(s.run("hint linux", COMMAND));
    assert!(started.contains("started"), "{started}");
    let before_reset = s.mark();
    ok(enter_console(&mut s, "linux"));
    ok(s.send_line("run 3 reboot -f"));
    ok(s.expect(
        r"\[linux\] VM stopped: reset by the guest \(PSCI SYSTEM_RESET\); \d+ pages returned",
        STEP,
    ));
    ok(leave_console(&mut s));
    assert_eq!(
        category(&mut s, "guest RAM"),
        guest0,
        "every page backed again"
    );
    ok(wait_for_agents(&mut s, &["linux"], before_reset, BOOT));
    s.assert_check();
    // The new boot's device hints again from scratch.
    let mut since = s.mark();
    let again = ok(s.run("hint linux", COMMAND));
    let id = first_number(&again, r"hinting run (\d+) started").expect(&again);
    ok(s.expect_since(
        &mut since,
        &format!(r"\[linux\] balloon: free page hint run {id} done: \d+ pages hinted"),
        STEP,
    ));
    let out = agent(&mut s, 4, "echo still here");
    assert!(out.iter().any(|l| l == "still here"), "{out:?}");
    assert_alive(&mut s, "beta");
    s.assert_check();
}

mod virt_gicv2 {
    use harness::Board::VirtGicv2 as B;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn stop_in_the_middle_of_an_inflate() {
        super::stop_in_the_middle_of_an_inflate(B);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn pool_runs_out_during_a_fault_in() {
        super::pool_runs_out_during_a_fault_in(B);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn spin_flood_and_held_stats() {
        super::spin_flood_and_held_stats(B);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn linux_reset_while_reporting_and_hinting() {
        super::linux_reset_while_reporting_and_hinting(B);
    }
}

mod virt_gicv3 {
    use harness::Board::VirtGicv3 as B;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn stop_in_the_middle_of_an_inflate() {
        super::stop_in_the_middle_of_an_inflate(B);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn spin_flood_and_held_stats() {
        super::spin_flood_and_held_stats(B);
    }
}

mod raspi4b {
    use harness::Board::Raspi4b as B;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn spin_flood_and_held_stats() {
        super::spin_flood_and_held_stats(B);
    }
}
