//! Every balloon feature with the bare-metal test guest through guest-driver
//! (guests/tests/gd-features.toml: the guest in `features` mode, all six
//! features offered). The guest keeps a heap under guest-driver's reporting
//! frame-allocator wrapper and a working set it allocates and frees in turns;
//! the rest of its RAM holds checksummed patterns.
//!
//! Scenario 5 of the balloon issue, on each board:
//! (a) reporting: the guest's free high-order blocks are reported, the
//!     hypervisor counts them and takes them out of the guest's RAM; reusing
//!     them works;
//! (b) hinting: `hint gdf` starts a run, the guest answers with its free
//!     blocks, the hypervisor ends the run with pages hinted, and the guest
//!     keeps running, reusing them;
//! (c) poisoning: poison_val is the guest's, and every page the hypervisor
//!     backs again reads as it;
//! (d) deflate-on-OOM: with the heap ballooned, the guest's allocator runs
//!     out and its OOM hook deflates; the hypervisor counts it;
//! (e) statistics: the guest's allocator figures reach `info balloon`.
//!
//! Throughout: the pattern and working-set checks pass and no page the
//! guest reuses reads anything but the poison value.

use std::time::Duration;

use harness::{Board, HarnessError, Session};

const STEP: Duration = Duration::from_secs(90);
const COMMAND: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;
/// The poison value the test guest writes (testguest/src/features.rs).
const POISON: &str = "0x7e57a11c";
const VM_RAM: u64 = 128 * MIB;

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn number(text: &str, pattern: &str) -> Option<u64> {
    harness::console::first_number(text, pattern)
}

fn info(s: &mut Session) -> String {
    ok(s.run("info balloon gdf", COMMAND))
}

/// `info balloon` until `pattern`'s first group is at least `min`; that number.
fn wait_info(s: &mut Session, pattern: &str, min: u64, within: Duration) -> u64 {
    ok(s.poll_command("info balloon gdf", pattern, min, within))
}

fn mem(s: &mut Session, category: &str) -> u64 {
    s.mem_category(category, COMMAND)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Nothing went wrong in the guest or the hypervisor so far.
fn assert_clean(s: &Session) {
    let out = s.output();
    for bad in [
        "PATTERN MISMATCH",
        "WORKING SET MISMATCH",
        "REUSED PAGE NOT FILLED",
        "balloon error",
        "stopping the VM",
        "abort injected",
        "DEVICE_NEEDS_RESET",
    ] {
        assert!(!out.contains(bad), "`{bad}` in the output:\n{out}");
    }
}

fn boot(board: Board, bundle: &str) -> Session {
    let s = ok(Session::start_bundle(board, bundle, bundle));
    s.set_deadline(Duration::from_secs(480));
    s
}

/// The features `info balloon` says were negotiated, sorted.
fn negotiated(s: &mut Session) -> Vec<String> {
    let out = info(s);
    let line = out
        .lines()
        .find_map(|l| l.split_once("negotiated: ").map(|(_, n)| n.to_string()))
        .unwrap_or_else(|| panic!("no negotiated features:\n{out}"));
    let mut got: Vec<String> = line.split_whitespace().map(String::from).collect();
    got.sort_unstable();
    got
}

fn scenarios(board: Board) {
    let mut s = boot(board, "gd-features");
    let heap = ok(s.expect(
        r"\[gdf\] testguest: features: heap 0x[0-9a-f]+\.\.0x[0-9a-f]+ \((\d+) pages\)",
        STEP,
    ));
    let heap_pages: u64 = heap[1].parse().unwrap();
    assert!(heap_pages > 8192, "heap of {heap_pages} pages");
    ok(s.expect(r"\[gdf\] testguest: balloon at ", STEP));
    // (c) The guest told its poison value before DRIVER_OK.
    ok(s.expect(&format!(r"\[gdf\] testguest: page poison {POISON}"), STEP));
    assert_eq!(
        negotiated(&mut s),
        [
            "DEFLATE_ON_OOM",
            "FREE_PAGE_HINT",
            "MUST_TELL_HOST",
            "PAGE_POISON",
            "PAGE_REPORTING",
            "STATS_VQ",
            "VERSION_1"
        ]
    );
    let out = info(&mut s);
    assert!(
        out.contains(&format!("page poison: {POISON}; pages backed again")),
        "{out}"
    );
    let mut since = s.mark();

    // (e) Statistics: the allocator's figures, refreshed every 2 s.
    let sent = ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: stats sent: free (\d+) KiB of (\d+) KiB \(#(\d+)\)",
        STEP,
    ));
    let total_kib: u64 = sent[2].parse().unwrap();
    assert_eq!(total_kib, heap_pages * 4);
    let total = wait_info(&mut s, r"total_memory\s+([\d.]+) MiB", 1, STEP);
    assert_eq!(total, heap_pages * 4 / 1024, "total_memory in MiB");
    let out = info(&mut s);
    for tag in ["free_memory", "available_memory"] {
        assert!(out.contains(tag), "{tag} missing:\n{out}");
    }
    // A second sample arrives when the device asks again.
    let next = sent[3].parse::<u64>().unwrap() + 1;
    let mut since_stats = since;
    ok(s.expect_since(
        &mut since_stats,
        &format!(r"\[gdf\] testguest: stats sent: .* \(#{next}\)"),
        STEP,
    ));

    // (a) Reporting: most of the idle heap goes back to the hypervisor.
    let reported = ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: reported (\d+) blocks \((\d+) pages\) in (\d+) reports",
        STEP,
    ));
    let guest_pages: u64 = reported[2].parse().unwrap();
    assert!(guest_pages >= 512, "{reported:?}");
    let host_pages = wait_info(
        &mut s,
        r"free page reporting: \d+ reports, \d+ blocks, (\d+) pages",
        guest_pages,
        STEP,
    );
    assert!(host_pages >= guest_pages);
    // The reported memory left the guest's RAM: at least half of the heap
    // (the working set and small blocks stay).
    let guest_ram = mem(&mut s, "guest RAM");
    assert!(
        guest_ram + heap_pages * 4096 / 2 <= VM_RAM,
        "guest RAM {} MiB with a {} MiB heap mostly reported",
        guest_ram / MIB,
        heap_pages * 4 / 1024
    );
    // (a)+(c) The guest reuses reported pages: each reads the poison value.
    ok(s.expect_since(
        &mut since,
        &format!(r"\[gdf\] testguest: reused \d+ given-back pages, all read {POISON}7e57a11c"),
        STEP,
    ));
    assert_clean(&s);

    // (b) Hinting.
    // From before the command: a run can end (in 2 ms) before the shell
    // has printed that it started, inside the command's output.
    let mut since = s.mark();
    let started = ok(s.run("hint gdf", COMMAND));
    let id = number(&started, r"hinting run (\d+) started").expect(&started);
    // The hypervisor's line and the guest's come in either order.
    let mut since_done = since;
    let answered = ok(s.expect_since(
        &mut since,
        &format!(r"\[gdf\] testguest: hint run {id} answered with (\d+) blocks \((\d+) pages\)"),
        STEP,
    ));
    let hinted_guest: u64 = answered[2].parse().unwrap();
    assert!(hinted_guest > 0, "{answered:?}");
    let done = ok(s.expect_since(
        &mut since_done,
        &format!(r"tidal: \[gdf\] balloon: free page hint run {id} done: (\d+) pages hinted"),
        STEP,
    ));
    let hinted_host: u64 = done[1].parse().unwrap();
    assert_eq!(hinted_host, hinted_guest, "every hinted page counted once");
    // The guest keeps running and reuses hinted memory, reading the poison.
    ok(s.expect_since(
        &mut since,
        &format!(r"\[gdf\] testguest: reused \d+ given-back pages, all read {POISON}7e57a11c"),
        STEP,
    ));
    ok(s.expect_since(&mut since, r"\[gdf\] testguest: alive \d+s", STEP));
    assert_clean(&s);

    // (d) Deflate on OOM: balloon (nearly) the whole heap; the working set
    // then finds the allocator empty.
    let free0 = mem(&mut s, "free");
    let target_mib = heap_pages * 4 / 1024;
    ok(s.run(&format!("balloon gdf {target_mib}M"), COMMAND));
    let mut since = s.mark();
    let oom = ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: OOM: deflated (\d+) pages",
        STEP,
    ));
    assert!(oom[1].parse::<u64>().unwrap() > 0);
    let counted = wait_info(&mut s, r"deflated on OOM: (\d+) pages", 1, STEP);
    assert!(counted > 0);
    // The balloon holds most of the heap: the pool holds its pages (some
    // of which reporting had already given back).
    let ballooned = number(&info(&mut s), r"ballooned (\d+) pages").expect("ballooned");
    assert!(ballooned > heap_pages / 2, "ballooned {ballooned} pages");
    let free1 = mem(&mut s, "free");
    assert!(free1 + 8 * MIB >= free0, "pool {free0} -> {free1}");
    // The guest keeps working after the OOM, its checks intact.
    ok(s.expect_since(&mut since, r"\[gdf\] testguest: alive \d+s", STEP));
    ok(s.expect_since(&mut since, r"\[gdf\] testguest: working set ok", STEP));

    // Everything back.
    ok(s.run("balloon gdf 0", COMMAND));
    ok(s.expect(r"\[gdf\] testguest: balloon target=0 actual=0 pages", STEP));
    ok(s.expect(r"\[gdf\] testguest: pattern ok", STEP));
    let out = info(&mut s);
    assert!(out.contains("ballooned 0 pages"), "{out}");
    assert_clean(&s);
    s.assert_check();
}

/// (a)-(c) without PAGE_POISON (guests/tests/gd-features-nopoison.toml):
/// nothing is written to poison_val, and reported and hinted pages the guest
/// reuses read zero.
fn given_back_pages_read_zero_without_poison(board: Board) {
    let mut s = boot(board, "gd-features-nopoison");
    ok(s.expect(r"\[gdf\] testguest: balloon at ", STEP));
    ok(s.expect(
        r"\[gdf\] testguest: page poison off: given-back pages must read 0",
        STEP,
    ));
    assert_eq!(
        negotiated(&mut s),
        [
            "DEFLATE_ON_OOM",
            "FREE_PAGE_HINT",
            "MUST_TELL_HOST",
            "PAGE_REPORTING",
            "STATS_VQ",
            "VERSION_1"
        ]
    );
    let out = info(&mut s);
    assert!(!out.contains("page poison:"), "{out}");
    let mut since = s.mark();
    let reported = ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: reported \d+ blocks \((\d+) pages\)",
        STEP,
    ));
    let pages: u64 = reported[1].parse().unwrap();
    wait_info(
        &mut s,
        r"free page reporting: \d+ reports, \d+ blocks, (\d+) pages",
        pages,
        STEP,
    );
    ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: reused \d+ given-back pages, all read 0x0\b",
        STEP,
    ));
    let mut since = s.mark();
    let started = ok(s.run("hint gdf", COMMAND));
    let id = number(&started, r"hinting run (\d+) started").expect(&started);
    ok(s.expect_since(
        &mut since,
        &format!(r"\[gdf\] testguest: hint run {id} answered with [1-9]\d* blocks"),
        STEP,
    ));
    ok(s.expect_since(
        &mut since,
        r"\[gdf\] testguest: reused \d+ given-back pages, all read 0x0\b",
        STEP,
    ));
    ok(s.expect_since(&mut since, r"\[gdf\] testguest: alive \d+s", STEP));
    assert_clean(&s);
    s.assert_check();
}

macro_rules! boards {
    ($($board:ident => $b:expr;)*) => {$(
        mod $board {
            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn all_scenarios() { super::scenarios($b) }
            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn given_back_pages_read_zero_without_poison() {
                super::given_back_pages_read_zero_without_poison($b)
            }
        }
    )*};
}

boards! {
    virt_gicv2 => harness::Board::VirtGicv2;
    virt_gicv3 => harness::Board::VirtGicv3;
    raspi4b => harness::Board::Raspi4b;
}
