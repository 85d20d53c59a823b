//! The balloon features' part of `cargo xtask bench`: what free page
//! reporting costs and gives, and how fast a free page hinting run goes,
//! with the fixture Linux guest (512 MiB, 2 vCPUs) under Tidal.
//!
//! Wall time (no -icount: Linux under icount is very slow) on a shared
//! machine, so each round boots every configuration once, the reporting
//! off/on pair in alternating order, and the table gives median [min-max]:
//! 1. page faults: `tidal-mem pagefault 64 10` (like will-it-scale's
//!    page_fault1: map 64 MiB, write a byte per page, unmap, for 10 s),
//!    with reporting off (guests/tests/linux.toml) and on
//!    (linux-reporting.toml), each after the same settling time and a 2 s
//!    warm-up; the overhead is the drop in pages/s with reporting on, as a
//!    share of the pages/s without it (the upstream series measured
//!    0.8-1.7% on real hardware); and, as boots differ with the host's
//!    load, also within the reporting boot: pairs of shorter runs with the
//!    guest's page_reporting_order set so that nothing is reported, and
//!    back;
//! 2. free to pool (reporting on, same boot): the guest holds 256 MiB
//!    (`tidal-mem hog 256 <hold>`), the pool is read (`mem`), the guest
//!    frees it; from the console line saying so until `mem` (polled) shows
//!    at least 90% of it back in the hypervisor's pool;
//! 3. hinting (linux-hint.toml, idle guest after settling): from sending
//!    `hint linux` until the hypervisor's `hint run <id> done` line, the
//!    pages hinted, and pages/s; besides, the run's time by the
//!    hypervisor's own counter.
//!
//! Results: a table on stdout and target/bench/features.json.

use std::path::Path;
use std::time::{Duration, Instant};

use harness::linux::{agent_run, enter_console, leave_console, wait_for_agents};
use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};
use serde::Serialize;

use super::linux::{spread, Spread};
use crate::json;

const ROUNDS: usize = 3;
const VM: &str = "linux";
const PAGE_SIZE: u64 = 4096;
const MIB: u64 = 1 << 20;

const BOOT: Duration = Duration::from_secs(240);
const STEP: Duration = Duration::from_secs(120);
const COMMAND: Duration = Duration::from_secs(30);
/// Whole-session limit: QEMU is killed after this whatever happens.
const SESSION: Duration = Duration::from_secs(900);

/// Idle time after the agent is up, before anything is measured: the
/// guest's boot-time work (and, with reporting, its first reports of all
/// its free memory, which Linux sends 2 s after pages are freed) is over.
const SETTLE: Duration = Duration::from_secs(15);

const FAULT_MIB: u64 = 64;
const FAULT_SECONDS: u64 = 10;
const WARMUP_SECONDS: u64 = 2;

/// The same-boot comparison: pairs of runs of this many seconds with
/// reporting switched off and on through the kernel's page_reporting_order
/// (linked to [`ORDER_LINK`] in the guest, as its path is too long to type
/// in one piece): no order reaches [`ORDER_OFF`] (MAX_ORDER in Linux 6.1),
/// so nothing is reported while it is set.
const PAIRS: usize = 4;
const PAIR_SECONDS: u64 = 5;
const ORDER_PARAM: &str = "/sys/module/page_reporting/parameters/page_reporting_order";
const ORDER_LINK: &str = "/o";
const ORDER_OFF: u32 = 11;

const HOG_MIB: u64 = 256;
/// How long the hog holds its memory: long enough for the pool to be read
/// (one `mem`) before it frees it.
const HOG_HOLD_S: u64 = 8;
/// How long after the free the pool may take to get 90% back.
const POOL_WITHIN: Duration = Duration::from_secs(60);
const POOL_POLL: Duration = Duration::from_millis(100);

/// The three bundles: reporting off, reporting on, hinting only.
const OFF: &str = "linux.img";
const ON: &str = "linux-reporting.img";
const HINT: &str = "linux-hint.img";

fn harness(e: HarnessError) -> String {
    e.to_string()
}

/// A booted guest under Tidal, its agent listening.
struct Guest {
    session: Session,
    next_id: u32,
    /// The QEMU process, whose CPU time is read around the page-fault runs.
    qemu_pid: u32,
}

impl Guest {
    fn boot(artifacts: &Artifacts, bundle: &str, round: usize) -> Result<Guest, String> {
        let board = Board::VirtGicv2;
        let mut opts = QemuOptions::for_board(board, artifacts);
        opts.initrd = Some(target_dir().join("bundles").join(bundle));
        let stem = bundle.trim_end_matches(".img");
        // A name no other QEMU on the machine has, to find this one's pid.
        let name = format!("tidal-bench-{}-{stem}-{round}", std::process::id());
        opts.extra = vec!["-name".into(), name.clone()];
        let mut session = Session::start(
            &format!("bench-features-{stem}-{round}"),
            board,
            artifacts,
            &opts,
        )
        .map_err(harness)?;
        session.set_deadline(SESSION);
        let qemu_pid = find_qemu(&name)?;
        wait_for_agents(&mut session, &[VM], 0, BOOT).map_err(harness)?;
        std::thread::sleep(SETTLE);
        Ok(Guest {
            session,
            next_id: 1,
            qemu_pid,
        })
    }

    fn id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Runs `command` through the agent; its output lines (rc 0 required).
    fn agent(&mut self, command: &str, timeout: Duration) -> Result<Vec<String>, String> {
        let id = self.id();
        let reply = agent_run(&mut self.session, VM, id, command, timeout).map_err(harness)?;
        if reply.rc != 0 {
            return Err(format!(
                "`{command}` failed (rc={}):\n{}",
                reply.rc,
                reply.lines.join("\n")
            ));
        }
        Ok(reply.lines)
    }

    /// Runs `tidal-mem pagefault <FAULT_MIB> <seconds>` after `before` (a
    /// shell command, or nothing): its pages/s, and its pages per second of
    /// CPU time QEMU spent meanwhile (all its threads: both vCPUs, so work
    /// the run causes elsewhere in the guest or in the hypervisor counts,
    /// and time the host gives to other processes does not).
    fn pagefault(&mut self, before: &str, seconds: u64) -> Result<Sample, String> {
        let cpu_before = qemu_cpu_ns(self.qemu_pid)?;
        let lines = self.agent(
            &format!("{before}tidal-mem pagefault {FAULT_MIB} {seconds}"),
            STEP,
        )?;
        let cpu_s = qemu_cpu_ns(self.qemu_pid)?.saturating_sub(cpu_before) as f64 / 1e9;
        let (pages, rate) = lines
            .iter()
            .find_map(|l| pagefault_result(l))
            .ok_or_else(|| format!("no pagefault result in {lines:?}"))?;
        Ok(Sample {
            pages_per_s: rate as f64,
            pages_per_cpu_s: pages as f64 / cpu_s,
        })
    }

    /// Pages given back by free page reporting so far (`info balloon`).
    fn reported_pages(&mut self) -> Result<u64, String> {
        let out = self
            .session
            .run(&format!("info balloon {VM}"), COMMAND)
            .map_err(harness)?;
        reporting_pages(&out).ok_or_else(|| format!("no free page reporting line in:\n{out}"))
    }
}

/// The pages and pages/s of a `pagefault: <i> iterations, <p> pages in
/// <t> ms: <r> pages/s` line.
fn pagefault_result(line: &str) -> Option<(u64, u64)> {
    let (counts, rate) = line.strip_prefix("pagefault: ")?.rsplit_once(": ")?;
    let (_, pages) = counts.split_once(" iterations, ")?;
    let pages = pages.split_once(" pages in ")?.0.parse().ok()?;
    Some((pages, rate.strip_suffix(" pages/s")?.parse().ok()?))
}

/// The pid of the QEMU started with `-name <name>`, waiting up to
/// [`COMMAND`] for it: until the spawned child has exec'd QEMU, its command
/// line is still the parent's.
fn find_qemu(name: &str) -> Result<u32, String> {
    let until = Instant::now() + COMMAND;
    loop {
        match find_qemu_now(name)? {
            Some(pid) => return Ok(pid),
            None if Instant::now() >= until => {
                return Err(format!("no QEMU named {name} in /proc"))
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The pid of the QEMU started with `-name <name>`, if it runs.
fn find_qemu_now(name: &str) -> Result<Option<u32>, String> {
    let wanted = format!("\0-name\0{name}\0");
    let dir = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        // A process may end between the listing and the read.
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(&wanted) {
            return Ok(Some(pid));
        }
    }
    Ok(None)
}

/// CPU time of all of process `pid`'s threads so far, in ns (the first
/// field of each thread's schedstat).
fn qemu_cpu_ns(pid: u32) -> Result<u64, String> {
    let tasks = format!("/proc/{pid}/task");
    let dir = std::fs::read_dir(&tasks).map_err(|e| format!("{tasks}: {e}"))?;
    let mut total = 0;
    for entry in dir.flatten() {
        // A thread may end between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("schedstat")) else {
            continue;
        };
        total += stat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .ok_or_else(|| format!("{tasks}: bad schedstat {stat:?}"))?;
    }
    Ok(total)
}

/// The pages of `info balloon`'s `free page reporting: <n> reports, <b>
/// blocks, <p> pages (...) given back`.
fn reporting_pages(info: &str) -> Option<u64> {
    let (_, rest) = info.split_once("free page reporting: ")?;
    let words: Vec<&str> = rest.split_whitespace().take(6).collect();
    match words.as_slice() {
        [_, "reports,", _, "blocks,", pages, "pages"] => pages.parse().ok(),
        _ => None,
    }
}

/// MemFree in KiB from /proc/meminfo lines.
fn mem_free_kib(lines: &[String]) -> Option<u64> {
    lines.iter().find_map(|l| {
        l.strip_prefix("MemFree:")?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    })
}

/// One page-fault run: pages/s, and (reporting on) the pages reported
/// during it.
struct Faults {
    sample: Sample,
    reported_pages: Option<u64>,
}

/// One page-fault run's throughput: by wall time, and by QEMU's CPU time.
#[derive(Clone, Copy, Debug, Serialize)]
struct Sample {
    #[serde(serialize_with = "json::whole")]
    pages_per_s: f64,
    #[serde(serialize_with = "json::whole")]
    pages_per_cpu_s: f64,
}

/// `tidal-mem pagefault` after a warm-up; with `reporting`, the pages the
/// guest reported meanwhile too.
fn page_faults(guest: &mut Guest, reporting: bool) -> Result<Faults, String> {
    guest.pagefault("", WARMUP_SECONDS)?;
    let before = if reporting {
        Some(guest.reported_pages()?)
    } else {
        None
    };
    let sample = guest.pagefault("", FAULT_SECONDS)?;
    let reported_pages = match before {
        Some(before) => Some(guest.reported_pages()?.saturating_sub(before)),
        None => None,
    };
    Ok(Faults {
        sample,
        reported_pages,
    })
}

/// Reporting switched off and on in the same boot, [`PAIRS`] times (the
/// order within a pair alternating): the overhead of each pair, in %, and
/// the pages/s off and on, and the pages reported during the off runs
/// (none, unless a report was under way when the order changed).
fn toggled_pairs(guest: &mut Guest) -> Result<(Vec<(Sample, Sample)>, u64), String> {
    guest.agent(&format!("ln -sf {ORDER_PARAM} {ORDER_LINK}"), STEP)?;
    let order = guest.agent(&format!("cat {ORDER_LINK}"), STEP)?;
    let on_order: u32 = order
        .iter()
        .find_map(|l| l.trim().parse().ok())
        .ok_or_else(|| format!("no page_reporting_order in {order:?}"))?;
    if on_order >= ORDER_OFF {
        return Err(format!(
            "page_reporting_order is {on_order}: reporting is off"
        ));
    }
    let mut pairs = Vec::new();
    let mut reported_off = 0;
    for pair in 0..PAIRS {
        let mut run = |order: u32| -> Result<Sample, String> {
            // The second lets a report under way when the order changed end.
            guest.agent(&format!("echo {order} >{ORDER_LINK};sleep 1"), STEP)?;
            let before = guest.reported_pages()?;
            let sample = guest.pagefault("", PAIR_SECONDS)?;
            if order == ORDER_OFF {
                reported_off += guest.reported_pages()?.saturating_sub(before);
            }
            Ok(sample)
        };
        let (off, on) = if pair % 2 == 0 {
            let off = run(ORDER_OFF)?;
            (off, run(on_order)?)
        } else {
            let on = run(on_order)?;
            (run(ORDER_OFF)?, on)
        };
        pairs.push((off, on));
    }
    // Leave reporting on for what follows.
    guest.agent(&format!("echo {on_order} >{ORDER_LINK}"), STEP)?;
    Ok((pairs, reported_off))
}

/// Free to pool: seconds from the guest's free until 90% of it is back,
/// and the MiB back then.
fn free_to_pool(guest: &mut Guest) -> Result<(f64, u64), String> {
    let id = guest.id();
    let s = &mut guest.session;
    enter_console(s, VM).map_err(harness)?;
    // `mem` below consumes output up to its prompt: the hog's later lines
    // are looked for from here.
    let start = s.mark();
    // One line, short enough for the guest's receive FIFO.
    s.send_line(&format!("run {id} tidal-mem hog {HOG_MIB} {HOG_HOLD_S}"))
        .map_err(harness)?;
    s.expect(&format!(r"\[{VM}\] hog: touched {HOG_MIB} MiB"), STEP)
        .map_err(harness)?;
    leave_console(s).map_err(harness)?;
    let held = s.mem_category("free", COMMAND)?;
    let read = s.mark();
    let mut at = start;
    s.expect_since(
        &mut at,
        &format!(r"\[{VM}\] hog: released {HOG_MIB} MiB"),
        STEP,
    )
    .map_err(harness)?;
    if at <= read {
        return Err(format!(
            "the hog freed its memory before the pool was read: hold longer than {HOG_HOLD_S} s"
        ));
    }
    // The session's position is now the released line's end.
    let freed = s.matched_at().expect("just matched");
    let want = HOG_MIB * MIB * 9 / 10;
    loop {
        let now = s.mem_category("free", COMMAND)?;
        let back = now.saturating_sub(held);
        if back >= want {
            let seconds = freed.elapsed().as_secs_f64();
            s.expect_since(
                &mut at,
                &format!(r"\[{VM}\] tidal-guest: done {id} rc=0"),
                STEP,
            )
            .map_err(harness)?;
            return Ok((seconds, back / MIB));
        }
        if freed.elapsed() > POOL_WITHIN {
            return Err(format!(
                "only {} MiB of {HOG_MIB} back in the pool {} s after the free",
                back / MIB,
                POOL_WITHIN.as_secs()
            ));
        }
        std::thread::sleep(POOL_POLL);
    }
}

/// One hinting run on the idle guest.
struct Hint {
    /// From sending `hint` until the `done` line arrived.
    wall_s: f64,
    /// The hypervisor's own time for the run.
    device_s: f64,
    pages: u64,
    /// The guest's MemFree before the run, in pages.
    guest_free_pages: u64,
}

fn hinting_run(guest: &mut Guest) -> Result<Hint, String> {
    let meminfo = guest.agent("grep MemFree /proc/meminfo", STEP)?;
    let free_kib = mem_free_kib(&meminfo).ok_or_else(|| format!("no MemFree in {meminfo:?}"))?;
    let s = &mut guest.session;
    let sent = Instant::now();
    s.send_line(&format!("hint {VM}")).map_err(harness)?;
    let started = s
        .expect(r"hinting run (\d+) started[^\n]*\n", COMMAND)
        .map_err(harness)?;
    let after_started = s.mark();
    let id = &started[1];
    // `expect` keeps the position in order, so the match time is this line's
    // even if the shell's prompt came later.
    let done = s
        .expect(
            &format!(
                r"tidal: \[{VM}\] balloon: free page hint run {id} done: (\d+) pages hinted[^\n]*\((\d+) ms\)"
            ),
            STEP,
        )
        .map_err(harness)?;
    let arrived = s.matched_at().expect("just matched");
    // The prompt after `hint` (before or after the done line) is consumed,
    // so the next command waits for its own.
    s.expect_since(&mut after_started.clone(), r"tidal> ", COMMAND)
        .map_err(harness)?;
    let number = |i: usize| {
        done[i]
            .parse::<u64>()
            .map_err(|e| format!("bad number '{}': {e}", done[i]))
    };
    Ok(Hint {
        wall_s: (arrived - sent).as_secs_f64(),
        device_s: number(2)? as f64 / 1000.0,
        pages: number(1)?,
        guest_free_pages: free_kib * 1024 / PAGE_SIZE,
    })
}

/// Everything measured in one round.
struct Round {
    off: Faults,
    on: Faults,
    /// Same boot, reporting toggled: (off, on) per pair.
    toggled: Vec<(Sample, Sample)>,
    /// Pages reported during the toggled pairs' off runs.
    toggled_reported_off: u64,
    free_to_pool_s: f64,
    pool_back_mib: u64,
    hint: Hint,
}

fn round(artifacts: &Artifacts, round: usize) -> Result<Round, String> {
    // Odd rounds boot reporting off first, even rounds on first.
    let order: [bool; 2] = if round % 2 == 1 {
        [false, true]
    } else {
        [true, false]
    };
    let (mut off, mut on, mut pool) = (None, None, None);
    let mut toggled = Vec::new();
    let mut toggled_reported_off = 0;
    for reporting in order {
        let bundle = if reporting { ON } else { OFF };
        eprintln!("bench: features round {round}/{ROUNDS}: {bundle} ...");
        let mut guest = Guest::boot(artifacts, bundle, round)?;
        let faults = page_faults(&mut guest, reporting)
            .map_err(|e| format!("page faults, {bundle}, round {round}: {e}"))?;
        eprintln!("bench: {bundle}: {:?}", faults.sample);
        if reporting {
            let (seconds, mib) = free_to_pool(&mut guest)
                .map_err(|e| format!("free to pool, round {round}: {e}"))?;
            eprintln!("bench: {mib} MiB back in the pool {seconds:.2} s after the free");
            pool = Some((seconds, mib));
            let (pairs, reported_off) = toggled_pairs(&mut guest)
                .map_err(|e| format!("reporting toggled, round {round}: {e}"))?;
            eprintln!("bench: reporting toggled (off, on): {pairs:?}");
            toggled = pairs;
            toggled_reported_off = reported_off;
            on = Some(faults);
        } else {
            off = Some(faults);
        }
        // Dropping the session kills QEMU: nothing in the guest needs saving.
    }
    eprintln!("bench: features round {round}/{ROUNDS}: {HINT} ...");
    let mut guest = Guest::boot(artifacts, HINT, round)?;
    let hint = hinting_run(&mut guest).map_err(|e| format!("hinting run, round {round}: {e}"))?;
    eprintln!(
        "bench: hinting: {} pages in {:.2} s",
        hint.pages, hint.wall_s
    );
    let (free_to_pool_s, pool_back_mib) = pool.expect("the reporting side ran");
    Ok(Round {
        off: off.expect("the off side ran"),
        on: on.expect("the on side ran"),
        toggled,
        toggled_reported_off,
        free_to_pool_s,
        pool_back_mib,
        hint,
    })
}

pub fn run(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    let load = load_average();
    let mut rounds = Vec::new();
    for r in 1..=ROUNDS {
        rounds.push(round(artifacts, r)?);
    }
    report(root, &rounds, &load, &load_average())
}

/// /proc/loadavg's first three fields (the machine is shared).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Slowdown of `on` against `off`, in percent of `off`.
fn overhead_percent(off: f64, on: f64) -> f64 {
    100.0 * (off - on) / off
}

/// target/bench/features.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    board: &'static str,
    icount: bool,
    rounds: usize,
    pagefault_mib: u64,
    pagefault_seconds: u64,
    toggled_pairs_per_boot: usize,
    toggled_seconds: u64,
    hog_mib: u64,
    load_average_before: &'a str,
    load_average_after: &'a str,
    /// Per table row key, then the overheads of the medians.
    #[serde(serialize_with = "json::ordered_map")]
    summary: Vec<(String, SummaryValue)>,
    rounds_measured: Vec<RoundReport<'a>>,
}

/// A summary entry: a row's spread over the rounds, or an overhead of
/// medians in percent.
#[derive(Serialize)]
#[serde(untagged)]
enum SummaryValue {
    Spread(Spread),
    Percent(#[serde(serialize_with = "json::decimals::<3, _>")] f64),
}

/// One round's measurements.
#[derive(Serialize)]
struct RoundReport<'a> {
    round: usize,
    pagefault_off: Sample,
    pagefault_on: Sample,
    pages_reported_during_run: u64,
    /// (off, on) per pair.
    toggled_off_on: &'a [(Sample, Sample)],
    toggled_pages_reported_off: u64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    free_to_pool_s: f64,
    pool_back_mib: u64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    hint_wall_s: f64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    hint_device_s: f64,
    hint_pages: u64,
    guest_free_pages: u64,
}

impl<'a> RoundReport<'a> {
    /// Round `round` (from 1).
    fn new(round: usize, r: &'a Round) -> Self {
        RoundReport {
            round,
            pagefault_off: r.off.sample,
            pagefault_on: r.on.sample,
            pages_reported_during_run: r.on.reported_pages.unwrap_or(0),
            toggled_off_on: &r.toggled,
            toggled_pages_reported_off: r.toggled_reported_off,
            free_to_pool_s: r.free_to_pool_s,
            pool_back_mib: r.pool_back_mib,
            hint_wall_s: r.hint.wall_s,
            hint_device_s: r.hint.device_s,
            hint_pages: r.hint.pages,
            guest_free_pages: r.hint.guest_free_pages,
        }
    }
}

impl<'a> Report<'a> {
    fn new(
        summary: Vec<(String, SummaryValue)>,
        rounds: &'a [Round],
        load_before: &'a str,
        load_after: &'a str,
    ) -> Self {
        Report {
            benchmark: "balloon-features-linux",
            board: "virt-gicv2",
            icount: false,
            rounds: ROUNDS,
            pagefault_mib: FAULT_MIB,
            pagefault_seconds: FAULT_SECONDS,
            toggled_pairs_per_boot: PAIRS,
            toggled_seconds: PAIR_SECONDS,
            hog_mib: HOG_MIB,
            load_average_before: load_before,
            load_average_after: load_after,
            summary,
            rounds_measured: rounds
                .iter()
                .enumerate()
                .map(|(i, r)| RoundReport::new(i + 1, r))
                .collect(),
        }
    }
}

fn report(
    root: &Path,
    rounds: &[Round],
    load_before: &str,
    load_after: &str,
) -> Result<(), String> {
    let of = |values: Vec<f64>| spread(&values);
    let col = |f: &dyn Fn(&Round) -> f64| of(rounds.iter().map(f).collect());
    let cell = |s: &Spread, d: usize| format!("{:.d$} [{:.d$}-{:.d$}]", s.median, s.min, s.max);
    let pairs: Vec<(Sample, Sample)> = rounds.iter().flat_map(|r| r.toggled.clone()).collect();
    let pair_col = |f: &dyn Fn(&(Sample, Sample)) -> f64| of(pairs.iter().map(f).collect());

    // (label, JSON key, spread, decimals)
    let mut rows: Vec<(String, String, Spread, usize)> = Vec::new();
    let mut medians_overhead = Vec::new();
    for (measure, key, unit, value) in [
        (
            "wall",
            "per_s",
            "pages/s",
            (|s: &Sample| s.pages_per_s) as fn(&Sample) -> f64,
        ),
        ("CPU", "per_cpu_s", "pages/QEMU CPU-s", |s: &Sample| {
            s.pages_per_cpu_s
        }),
    ] {
        let off = col(&|r| value(&r.off.sample));
        let on = col(&|r| value(&r.on.sample));
        medians_overhead.push((measure, key, overhead_percent(off.median, on.median)));
        rows.push((
            format!("page faults, reporting off ({unit})"),
            format!("pagefault_off_{key}"),
            off,
            0,
        ));
        rows.push((
            format!("page faults, reporting on ({unit})"),
            format!("pagefault_on_{key}"),
            on,
            0,
        ));
        rows.push((
            format!("  overhead per round, {measure} (%)"),
            format!("overhead_percent_per_round_{key}"),
            col(&|r| overhead_percent(value(&r.off.sample), value(&r.on.sample))),
            1,
        ));
    }
    rows.push((
        "  pages reported during the 10 s run".into(),
        "pages_reported_during_run".into(),
        col(&|r| r.on.reported_pages.unwrap_or(0) as f64),
        0,
    ));
    for (measure, key, unit, value) in [
        (
            "wall",
            "per_s",
            "pages/s",
            (|s: &Sample| s.pages_per_s) as fn(&Sample) -> f64,
        ),
        ("CPU", "per_cpu_s", "pages/QEMU CPU-s", |s: &Sample| {
            s.pages_per_cpu_s
        }),
    ] {
        rows.push((
            format!("toggled [1]: off ({unit})"),
            format!("toggled_off_{key}"),
            pair_col(&|p| value(&p.0)),
            0,
        ));
        rows.push((
            format!("toggled [1]: on ({unit})"),
            format!("toggled_on_{key}"),
            pair_col(&|p| value(&p.1)),
            0,
        ));
        rows.push((
            format!("  overhead per pair, {measure} (%)"),
            format!("toggled_overhead_percent_per_pair_{key}"),
            pair_col(&|p| overhead_percent(value(&p.0), value(&p.1))),
            1,
        ));
    }
    rows.push((
        "  pages reported in the off runs, per boot".into(),
        "toggled_pages_reported_off".into(),
        col(&|r| r.toggled_reported_off as f64),
        0,
    ));
    rows.push((
        "free to 90% back in the pool (s) [2]".into(),
        "free_to_pool_s".into(),
        col(&|r| r.free_to_pool_s),
        2,
    ));
    rows.push((
        "  MiB back in the pool then".into(),
        "pool_back_mib".into(),
        col(&|r| r.pool_back_mib as f64),
        0,
    ));
    rows.push((
        "hinting run, host's view (s) [3]".into(),
        "hint_wall_s".into(),
        col(&|r| r.hint.wall_s),
        2,
    ));
    rows.push((
        "hinting run, hypervisor's counter (s)".into(),
        "hint_device_s".into(),
        col(&|r| r.hint.device_s),
        2,
    ));
    rows.push((
        "  pages hinted".into(),
        "hint_pages".into(),
        col(&|r| r.hint.pages as f64),
        0,
    ));
    rows.push((
        "  pages/s (host's view)".into(),
        "hint_pages_per_s".into(),
        col(&|r| r.hint.pages as f64 / r.hint.wall_s),
        0,
    ));
    rows.push((
        "  share of the guest's MemFree hinted (%)".into(),
        "hint_share_of_memfree_percent".into(),
        col(&|r| 100.0 * r.hint.pages as f64 / r.hint.guest_free_pages as f64),
        0,
    ));

    println!();
    println!(
        "Balloon features, Linux guest under Tidal (QEMU virt GICv2), 512 MiB, 2 vCPUs; wall time,"
    );
    println!("no -icount, {ROUNDS} rounds (reporting off/on booted in alternating order); median [min-max]");
    println!("{:<50} {:>30}", "metric", "value");
    for (label, _, spread, decimals) in &rows {
        println!("{label:<50} {:>30}", cell(spread, *decimals));
    }
    for (measure, _, overhead) in &medians_overhead {
        println!(
            "{:<50} {:>30}",
            format!("reporting overhead, of medians, {measure} (%)"),
            format!("{overhead:.1}")
        );
    }
    for line in [
        "Page faults: `tidal-mem pagefault 64 10` (map 64 MiB, write a byte per page, unmap; for 10 s)",
        "after 15 s idle and a 2 s warm-up, one run per boot: linux.img (reporting off) against",
        "linux-reporting.img (on). Overhead: (off - on) / off; upstream measured 0.8-1.7% on hardware.",
        "Every guest exit here is emulated by TCG on a shared host, so wall figures move with the host's",
        "load; per QEMU CPU-s divides the pages by the CPU time of all QEMU's threads during the run",
        "(both vCPUs: the guest's reporting work and the hypervisor's count; other processes' not).",
        "[1] in the linux-reporting.img boot: 4 pairs of `tidal-mem pagefault 64 5` with the guest's",
        "    page_reporting_order set to 11 (nothing reported) and back to its own, order alternating.",
        "[2] reporting on: `tidal-mem hog 256 8` frees 256 MiB; from its `released` line on the console",
        "    until the hypervisor's `mem` (polled back to back, ~100 ms apart) shows >= 90% in the pool.",
        "[3] linux-hint.img, idle guest: from sending `hint linux` to the `hint run <id> done` line.",
    ] {
        println!("{line}");
    }
    println!("load average (1/5/15 min): {load_before} before, {load_after} after");

    let mut summary: Vec<(String, SummaryValue)> = rows
        .into_iter()
        .map(|(_, key, spread, _)| (key, SummaryValue::Spread(spread)))
        .collect();
    for (_, key, overhead) in medians_overhead {
        summary.push((
            format!("overhead_percent_of_medians_{key}"),
            SummaryValue::Percent(overhead),
        ));
    }
    let path = root.join("target").join("bench").join("features.json");
    json::write(
        &path,
        &Report::new(summary, rounds, load_before, load_after),
    )?;
    println!("written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overhead_is_the_share_lost() {
        assert!((overhead_percent(1000.0, 990.0) - 1.0).abs() < 1e-9);
        assert!((overhead_percent(1000.0, 1010.0) + 1.0).abs() < 1e-9);
    }

    #[test]
    fn report_keeps_its_fields() {
        let sample = |pages_per_s, pages_per_cpu_s| Sample {
            pages_per_s,
            pages_per_cpu_s,
        };
        let rounds = [Round {
            off: Faults {
                sample: sample(19652.4, 9001.6),
                reported_pages: None,
            },
            on: Faults {
                sample: sample(19400.5, 8800.49),
                reported_pages: Some(49),
            },
            toggled: vec![(sample(100.0, 50.0), sample(99.0, 49.5))],
            toggled_reported_off: 3,
            free_to_pool_s: 1.23456,
            pool_back_mib: 240,
            hint: Hint {
                wall_s: 2.5,
                device_s: 2.125,
                pages: 90000,
                guest_free_pages: 100000,
            },
        }];
        let summary = vec![
            (
                "free_to_pool_s".to_string(),
                SummaryValue::Spread(spread(&[1.23456])),
            ),
            (
                "overhead_percent_of_medians_per_s".to_string(),
                SummaryValue::Percent(1.28184),
            ),
        ];
        let value =
            serde_json::to_value(Report::new(summary, &rounds, "1.00 2.00 3.00", "1.50")).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "benchmark": "balloon-features-linux",
                "board": "virt-gicv2",
                "icount": false,
                "rounds": 3,
                "pagefault_mib": 64,
                "pagefault_seconds": 10,
                "toggled_pairs_per_boot": 4,
                "toggled_seconds": 5,
                "hog_mib": 256,
                "load_average_before": "1.00 2.00 3.00",
                "load_average_after": "1.50",
                "summary": {
                    "free_to_pool_s": {"median": 1.2346, "min": 1.2346, "max": 1.2346},
                    "overhead_percent_of_medians_per_s": 1.282
                },
                "rounds_measured": [{
                    "round": 1,
                    "pagefault_off": {"pages_per_s": 19652, "pages_per_cpu_s": 9002},
                    "pagefault_on": {"pages_per_s": 19400, "pages_per_cpu_s": 8800},
                    "pages_reported_during_run": 49,
                    "toggled_off_on": [[
                        {"pages_per_s": 100, "pages_per_cpu_s": 50},
                        {"pages_per_s": 99, "pages_per_cpu_s": 50}
                    ]],
                    "toggled_pages_reported_off": 3,
                    "free_to_pool_s": 1.235,
                    "pool_back_mib": 240,
                    "hint_wall_s": 2.5,
                    "hint_device_s": 2.125,
                    "hint_pages": 90000,
                    "guest_free_pages": 100000
                }]
            })
        );
    }

    #[test]
    fn numbers_are_parsed() {
        let line = "pagefault: 12 iterations, 196608 pages in 10004 ms: 19652 pages/s";
        assert_eq!(pagefault_result(line), Some((196608, 19652)));
        assert_eq!(pagefault_result("hog: touched 64 MiB"), None);
        let info = "  free page reporting: 2 reports, 4 blocks, 49 pages (196 KiB) given back\n";
        assert_eq!(reporting_pages(info), Some(49));
        assert_eq!(reporting_pages("free page reporting: off"), None);
        let meminfo = ["MemFree:          401234 kB".to_string()];
        assert_eq!(mem_free_kib(&meminfo), Some(401234));
        assert_eq!(mem_free_kib(&["MemTotal: 1 kB".to_string()]), None);
    }

    #[test]
    fn this_process_has_cpu_time_and_is_found_by_nothing_else() {
        assert!(qemu_cpu_ns(std::process::id()).unwrap() > 0);
        assert_eq!(find_qemu_now("no-such-qemu-name"), Ok(None));
    }
}
