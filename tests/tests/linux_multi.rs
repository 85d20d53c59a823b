//! Two Linux guests and a bare-metal one at once (guests/tests/linux-multi.toml:
//! `linux2` with 2 vCPUs on CPUs 1-2, `linux1` with 1 vCPU on CPU 3, the test
//! guest `beta` on CPU 4), on the virt boards only (raspi4b has 4 CPUs, and
//! this needs 5):
//!
//! - `poweroff -f` in one Linux stops only that VM and gives back exactly its
//!   pages, `reboot -f` restarts only that VM, while the other Linux answers
//!   and `beta` keeps its heartbeat;
//! - one Linux touching memory in a tight loop while the other is ballooned
//!   by 128 MiB and back: neither stalls the other (see [`STALL_LIMIT_S`]).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use harness::linux::{
    agent_run, enter_console, leave_console, progress_lines, progress_loop, wait_for_agents,
    Progress,
};
use harness::{target_dir, Artifacts, Board, HarnessError, MemReport, QemuOptions, Session};
use regex::Regex;

const BOOT: Duration = Duration::from_secs(300);
const STEP: Duration = Duration::from_secs(90);
const COMMAND: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

/// The VMs of linux-multi.toml: name, RAM in MiB, vCPUs.
const LINUX2: (&str, u64, usize) = ("linux2", 512, 2);
const LINUX1: (&str, u64, usize) = ("linux1", 384, 1);
const BETA_MIB: u64 = 128;

/// The longest a guest may go without visible progress, in its own clock
/// (both Linux guests' /proc/uptime and the test guest's heartbeat count the
/// generic timer, which under QEMU TCG follows the host's clock, so a vCPU
/// held up by the hypervisor or by the host shows as a gap).
///
/// Measured on the 2-core development machine (virt-gicv2, -smp 5; gaps
/// between consecutive progress lines from the last line before the first
/// balloon command to the first after the last move), once idle CPUs wait
/// in WFI (under QEMU's TCG an idle CPU in WFE spun its host thread, which
/// had made the longest gaps 1-4 s on a quiet host and up to 6.7 s on a
/// loaded one): over 8 runs linux2's memory loop had gaps of 0.05-0.27 s, linux1's
/// 100 ms ticker 0.11-0.14 s, and both printed in every second.
///
/// So the issue's "each makes progress every second" is asserted as it
/// stands: a gap of a second or more fails, several times what was seen.
/// A stall of the kind this test is for (a vCPU kept from running while the
/// other guest's balloon moves) would be the length of the move or more.
const STALL_LIMIT_S: f64 = 1.0;

/// The test guest's heartbeat period (guest-driver/testguest: `alive <n>s`
/// every 2 s of its counter).
const HEARTBEAT_S: u64 = 2;

/// This file's QEMU tests run one at a time even under a parallel test
/// runner (`cargo xtask test` runs `cargo test` with its default threads):
/// the stall test measures time, and two 5-CPU QEMUs on a 2-core host would
/// mostly measure each other.
static ONE_QEMU_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_qemu_at_a_time() -> MutexGuard<'static, ()> {
    // A failed test poisons the lock; the next may still run.
    ONE_QEMU_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn mem(s: &mut Session) -> MemReport {
    s.mem_report(COMMAND).unwrap_or_else(|e| panic!("{e}"))
}

fn category(report: &MemReport, name: &str) -> u64 {
    report
        .category(name)
        .unwrap_or_else(|| panic!("no '{name}' in {:?}", report.categories))
}

/// Boots the three VMs on `board` with 5 CPUs and waits until both Linux
/// agents listen and the test guest has set up its balloon.
fn boot(board: Board, scenario: &str) -> Session {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.initrd = Some(target_dir().join("bundles").join("linux-multi.img"));
    // CPU 0 runs the shell, the VMs take CPUs 1-4.
    opts.smp = Some(5);
    let mut s = ok(Session::start(
        &format!("{}-{scenario}", board.name()),
        board,
        &artifacts,
        &opts,
    ));
    s.set_deadline(Duration::from_secs(900));
    ok(wait_for_agents(&mut s, &[LINUX2.0, LINUX1.0], 0, BOOT));
    let mut from_start = 0;
    ok(s.expect_since(&mut from_start, r"\[beta\] testguest: balloon at ", STEP));
    s
}

/// Runs `cmd` in `vm` and returns its output lines; it must succeed.
fn agent(s: &mut Session, vm: &str, id: u32, cmd: &str) -> Vec<String> {
    let reply = ok(agent_run(s, vm, id, cmd, STEP));
    assert_eq!(reply.rc, 0, "[{vm}] `{cmd}` failed: {:?}", reply.lines);
    reply.lines
}

/// `vm` answers through its agent, with `vcpus` processors online.
fn answers_with_cpus(s: &mut Session, vm: &str, id: u32, vcpus: usize) {
    let lines = agent(s, vm, id, "grep -c ^processor /proc/cpuinfo");
    assert_eq!(lines, [vcpus.to_string()], "[{vm}] processors online");
}

/// Two heartbeats of `beta` after this point: it is running now, not just
/// earlier.
fn beta_beats_on(s: &mut Session) {
    for _ in 0..2 {
        ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    }
}

/// Every heartbeat of `beta` in `output` follows the one before by at most
/// the period plus [`STALL_LIMIT_S`] of its own clock (the testguest prints
/// the whole seconds since its boot, so a held-up vCPU shows as a jump).
fn check_heartbeat(output: &str) -> usize {
    let re = Regex::new(r"\[beta\] testguest: alive (\d+)s").unwrap();
    let beats: Vec<u64> = re
        .captures_iter(output)
        .map(|c| c[1].parse().unwrap())
        .collect();
    let limit = HEARTBEAT_S + STALL_LIMIT_S.ceil() as u64;
    for pair in beats.windows(2) {
        assert!(
            pair[1] > pair[0] && pair[1] - pair[0] <= limit,
            "beta's heartbeat went from {}s to {}s (at most {limit}s apart): its vCPU was held up",
            pair[0],
            pair[1]
        );
    }
    beats.len()
}

/// `poweroff -f` and `reboot -f` in one Linux leave the other VMs running
/// and answering; the pages of exactly that VM go back to the pool, and come
/// back when it starts again.
fn poweroff_and_reboot_one_of_three(board: Board) {
    let mut s = boot(board, "linux_multi_poweroff_and_reboot");
    let all = mem(&mut s);
    let all_guests = (LINUX2.1 + LINUX1.1 + BETA_MIB) * MIB;
    assert_eq!(category(&all, "guest RAM"), all_guests);
    answers_with_cpus(&mut s, LINUX2.0, 1, LINUX2.2);
    answers_with_cpus(&mut s, LINUX1.0, 1, LINUX1.2);
    beta_beats_on(&mut s);

    // reboot -f in linux2: only linux2 stops, gives its pages back and
    // boots again; linux1 answers while it does.
    let before_reboot = s.mark();
    ok(enter_console(&mut s, LINUX2.0));
    ok(s.send_line("run 2 reboot -f"));
    ok(s.expect(
        &format!(
            r"tidal: \[linux2\] VM stopped: reset by the guest \(PSCI SYSTEM_RESET\); {} pages returned",
            LINUX2.1 * MIB / PAGE
        ),
        STEP,
    ));
    ok(leave_console(&mut s));
    answers_with_cpus(&mut s, LINUX1.0, 2, LINUX1.2);
    ok(wait_for_agents(&mut s, &[LINUX2.0], before_reboot, BOOT));
    answers_with_cpus(&mut s, LINUX2.0, 3, LINUX2.2);
    answers_with_cpus(&mut s, LINUX1.0, 3, LINUX1.2);
    beta_beats_on(&mut s);
    let rebooted = mem(&mut s);
    assert_eq!(
        rebooted.categories, all.categories,
        "after the reboot, every page is where it was"
    );

    // poweroff -f in linux1: it stops and exactly its RAM and its stage-2
    // tables go back to the free pool.
    ok(enter_console(&mut s, LINUX1.0));
    ok(s.send_line("run 4 poweroff -f"));
    ok(s.expect(
        &format!(
            r"tidal: \[linux1\] VM stopped: powered off by the guest \(PSCI SYSTEM_OFF\); {} pages returned",
            LINUX1.1 * MIB / PAGE
        ),
        STEP,
    ));
    ok(leave_console(&mut s));
    let off = mem(&mut s);
    let ram_back = category(&all, "guest RAM") - category(&off, "guest RAM");
    assert_eq!(ram_back, LINUX1.1 * MIB, "exactly linux1's RAM is returned");
    let tables_back = category(&all, "page tables") - category(&off, "page tables");
    assert!(tables_back > 0, "linux1's stage-2 tables are freed");
    assert_eq!(
        category(&off, "free") - category(&all, "free"),
        ram_back + tables_back,
        "the pool gets exactly linux1's RAM and tables"
    );
    let vms = ok(s.run("vms", COMMAND));
    let state = |vm: &str| {
        vms.lines()
            .find(|l| l.split_whitespace().next() == Some(vm))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or_else(|| panic!("no {vm} in:\n{vms}"))
            .to_string()
    };
    assert_eq!(state(LINUX1.0), "stopped", "{vms}");
    assert_eq!(state(LINUX2.0), "running", "{vms}");
    assert_eq!(state("beta"), "running", "{vms}");
    answers_with_cpus(&mut s, LINUX2.0, 5, LINUX2.2);
    beta_beats_on(&mut s);

    // Started again from the shell, linux1 takes the same pages again.
    let before_start = s.mark();
    let out = ok(s.run(&format!("start {}", LINUX1.0), COMMAND));
    assert!(out.contains("linux1: started"), "{out}");
    ok(wait_for_agents(&mut s, &[LINUX1.0], before_start, BOOT));
    answers_with_cpus(&mut s, LINUX1.0, 6, LINUX1.2);
    answers_with_cpus(&mut s, LINUX2.0, 7, LINUX2.2);
    beta_beats_on(&mut s);
    assert_eq!(mem(&mut s).categories, all.categories);

    let out = s.output();
    let beats = check_heartbeat(&out);
    assert!(beats >= 10, "{beats} heartbeats");
    for bad in ["*** ", "MISMATCH", "NOT ZERO", "tidal: [beta] VM stopped"] {
        assert!(!out.contains(bad), "'{bad}' in the console");
    }
    s.assert_check();
}

/// How one guest's progress lines cover a stretch of the console output.
#[derive(Debug, Clone, PartialEq)]
struct Coverage {
    /// Progress lines from the last one before the stretch to the first
    /// one after it.
    lines: usize,
    /// Guest seconds from the first to the last of them.
    span_s: f64,
    /// Every gap between consecutive lines, in guest seconds, in order.
    gaps_s: Vec<f64>,
    /// Of the whole seconds from the first line on (as many as fit before
    /// the last), how many saw a progress line.
    seconds_with_progress: usize,
}

impl Coverage {
    fn longest(&self) -> f64 {
        self.gaps_s.iter().copied().fold(0.0, f64::max)
    }

    /// Median, 90th percentile and longest gap, and in how many of the
    /// whole seconds spanned a line was printed, for the test's log.
    fn summary(&self) -> String {
        let mut sorted = self.gaps_s.clone();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
        format!(
            "{} progress lines over {:.2} s, in {} of its {} whole seconds; \
             gaps: median {:.2} s, 90% {:.2} s, longest {:.2} s",
            self.lines,
            self.span_s,
            self.seconds_with_progress,
            self.span_s.floor(),
            at(0.5),
            at(0.9),
            self.longest()
        )
    }
}

/// The progress lines that cover the console output from byte `from` to
/// byte `to`: the last line before `from`, every line in between and the
/// first one after `to`. They must come from one loop (numbers one apart),
/// so no line was lost in between.
fn coverage(lines: &[Progress], from: usize, to: usize) -> Result<Coverage, String> {
    let first = lines
        .iter()
        .rposition(|p| p.at < from)
        .ok_or("no progress line before the stretch")?;
    let last = lines
        .iter()
        .position(|p| p.at > to)
        .ok_or("no progress line after the stretch")?;
    let covering = &lines[first..=last];
    let mut gaps_s = Vec::new();
    for pair in covering.windows(2) {
        if pair[1].n != pair[0].n + 1 {
            return Err(format!(
                "progress {} is followed by {}: lines are missing",
                pair[0].n, pair[1].n
            ));
        }
        gaps_s.push(pair[1].uptime - pair[0].uptime);
    }
    let start = covering[0].uptime;
    let span_s = covering[covering.len() - 1].uptime - start;
    let seconds_with_progress = (0..span_s.floor() as u64)
        .filter(|&second| {
            let (from, to) = (start + second as f64, start + second as f64 + 1.0);
            covering.iter().any(|p| p.uptime > from && p.uptime <= to)
        })
        .count();
    Ok(Coverage {
        lines: covering.len(),
        span_s,
        gaps_s,
        seconds_with_progress,
    })
}

/// The guest that touches memory runs `dd` of 4 MiB into tmpfs and deletes
/// it, over and over (a few iterations a second under TCG); the ballooned
/// guest's own loop only sleeps 100 ms, so that its progress shows whether
/// its vCPU gets to run while its kernel inflates and deflates.
const TOUCH_MEMORY: &str = "dd if=/dev/zero of=/tmp/t bs=1M count=4 2>/dev/null;rm /tmp/t";
const TICK: &str = "usleep 100000";
/// The loops end by themselves after this many iterations (minutes), if the
/// test does not stop them.
const LOOP_ITERATIONS: u32 = 3000;
/// Inflate-deflate rounds.
const BALLOON_ROUNDS: usize = 2;

/// `linux2` touches memory in a tight loop while `linux1` is ballooned by
/// 128 MiB and back, twice: both keep making progress all along, the
/// balloon moves complete and the pool moves by exactly the ballooned pages.
fn memory_loop_and_balloon_do_not_stall(board: Board) {
    let (busy, ballooned) = (LINUX2.0, LINUX1.0);
    let mut s = boot(board, "linux_multi_no_stall");
    agent(
        &mut s,
        busy,
        1,
        &progress_loop(TOUCH_MEMORY, LOOP_ITERATIONS),
    );
    agent(&mut s, ballooned, 1, &progress_loop(TICK, LOOP_ITERATIONS));
    // Both loops run before the balloon moves start.
    let mut since = s.mark();
    for vm in [busy, ballooned] {
        let mut at = since;
        for _ in 0..3 {
            ok(s.expect_since(&mut at, &format!(r"\[{vm}\] progress \d+ "), STEP));
        }
    }

    let pages = 128 * MIB / PAGE;
    let free0 = category(&mem(&mut s), "free");
    // The stretch's ends are where the session has read to (`mark`), not
    // the end of what QEMU has printed so far: on a slow host the latter
    // can already hold the next second's progress lines, the loops are
    // stopped soon after, and no line would be left after the stretch.
    let balloon_from = s.mark();
    for round in 0..BALLOON_ROUNDS {
        ok(s.run(&format!("balloon {ballooned} 128M"), COMMAND));
        ok(s.expect(
            &format!(
                r"tidal: \[{ballooned}\] balloon: reached {pages} pages: {pages} pages inflated"
            ),
            STEP,
        ));
        // Deflated pages are backed again only when the guest touches them,
        // so only the first inflate is sure to free exactly 128 MiB.
        if round == 0 {
            assert_eq!(
                category(&mem(&mut s), "free") - free0,
                128 * MIB,
                "the pool grows by exactly the ballooned pages"
            );
        }
        ok(s.run(&format!("balloon {ballooned} 0"), COMMAND));
        ok(s.expect(
            &format!(r"tidal: \[{ballooned}\] balloon: reached 0 pages: {pages} pages deflated"),
            STEP,
        ));
    }
    let balloon_to = s.mark();
    // Two more progress lines from each after the last move.
    since = s.mark();
    for vm in [busy, ballooned] {
        let mut at = since;
        for _ in 0..2 {
            ok(s.expect_since(&mut at, &format!(r"\[{vm}\] progress \d+ "), STEP));
        }
    }
    for vm in [busy, ballooned] {
        agent(&mut s, vm, 2, "touch /tmp/stop");
    }

    let out = s.output();
    let moves: Vec<String> = Regex::new(&format!(
        r"tidal: \[{ballooned}\] balloon: reached [^\r\n]*"
    ))
    .unwrap()
    .find_iter(&out)
    .map(|m| m.as_str().to_string())
    .collect();
    println!("balloon moves:\n  {}", moves.join("\n  "));
    for vm in [busy, ballooned] {
        let covered = coverage(&progress_lines(&out, vm), balloon_from, balloon_to)
            .unwrap_or_else(|e| panic!("[{vm}] {e}"));
        println!(
            "[{vm}] while {ballooned} was ballooned: {}",
            covered.summary()
        );
        println!("[{vm}] gaps: {:.2?}", covered.gaps_s);
        assert!(
            covered.longest() <= STALL_LIMIT_S,
            "[{vm}] made no progress for {:.2} s while {ballooned} was ballooned (limit {STALL_LIMIT_S} s): {}",
            covered.longest(),
            covered.summary()
        );
    }
    check_heartbeat(&out);
    for bad in ["*** ", "VM stopped"] {
        assert!(!out.contains(bad), "'{bad}' in the console");
    }
    s.assert_check();
}

#[test]
fn coverage_takes_the_lines_around_the_stretch() {
    let p = |at, n, uptime| Progress { at, n, uptime };
    let lines = [
        p(10, 1, 5.0),
        p(20, 2, 5.5),
        p(30, 3, 6.25),
        p(40, 4, 9.0),
        p(50, 5, 9.5),
    ];
    let c = coverage(&lines, 25, 35).unwrap();
    assert_eq!(c.lines, 3);
    assert_eq!(c.gaps_s, [0.75, 2.75]);
    assert_eq!(c.span_s, 3.5);
    assert_eq!(c.longest(), 2.75);
    // Seconds (5.5, 6.5], (6.5, 7.5], (7.5, 8.5]: only the first has a line.
    assert_eq!(c.seconds_with_progress, 1);
    assert!(c.summary().contains("longest 2.75 s"), "{}", c.summary());
    assert!(
        c.summary().contains("in 1 of its 3 whole seconds"),
        "{}",
        c.summary()
    );
    assert!(coverage(&lines, 5, 35).unwrap_err().contains("before"));
    assert!(coverage(&lines, 25, 55).unwrap_err().contains("after"));
    let gap = [p(10, 1, 5.0), p(20, 3, 5.5), p(30, 4, 6.0)];
    assert!(coverage(&gap, 15, 25).unwrap_err().contains("missing"));
}

macro_rules! linux_multi_tests {
    ($($module:ident => $board:expr;)*) => {$(
        mod $module {
            use super::*;

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn poweroff_and_reboot_one_of_three() {
                let _one = one_qemu_at_a_time();
                super::poweroff_and_reboot_one_of_three($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn memory_loop_and_balloon_do_not_stall() {
                let _one = one_qemu_at_a_time();
                super::memory_loop_and_balloon_do_not_stall($board);
            }
        }
    )*};
}

linux_multi_tests! {
    virt_gicv2 => Board::VirtGicv2;
    virt_gicv3 => Board::VirtGicv3;
}
