//! The trace build's hot-path events (hypervisor/src/trace.rs) under QEMU:
//! the bare-metal test guests are ballooned and given their memory back, and
//! the decoded trace must hold every event kind with figures that agree with
//! what the guest did; the guest-driver features guest adds free page
//! reporting and hinting. They boot the trace build (`cargo xtask build`
//! makes it; `HV_TRACE_IMAGE` and `HV_TRACE_ELF` name it, else
//! `target/trace-build/`), so they are ignored by plain `cargo test`.

use std::path::PathBuf;
use std::time::Duration;

use harness::{
    decode_trace, log_dir, target_dir, Artifacts, Board, HarnessError, QemuOptions, Session,
};
use regex::Regex;

const STEP: Duration = Duration::from_secs(90);
const COMMAND: Duration = Duration::from_secs(20);
const POWEROFF: Duration = Duration::from_secs(30);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// Boot the trace build on virt (GICv2) with `target/bundles/<bundle>.img`,
/// the trace UART going to a file of the test logs; that file.
fn boot(bundle: &str, scenario: &str) -> (Session, PathBuf) {
    let board = Board::VirtGicv2;
    let artifacts = Artifacts::locate_trace();
    let trace = log_dir().join(format!("{}-{scenario}.defmt", board.name()));
    let _ = std::fs::remove_file(&trace);
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.initrd = Some(target_dir().join("bundles").join(format!("{bundle}.img")));
    opts.trace = Some(trace.clone());
    let s = ok(Session::start(
        &format!("{}-{scenario}", board.name()),
        board,
        &artifacts,
        &opts,
    ));
    s.set_deadline(Duration::from_secs(420));
    (s, trace)
}

/// Power off, then the decoded trace, one event a line.
fn finish(mut s: Session, trace: &PathBuf) -> Vec<String> {
    s.assert_check();
    ok(s.send_line("poweroff"));
    assert!(ok(s.wait_exit(POWEROFF)).success());
    let bytes = std::fs::read(trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
    let lines =
        decode_trace(&Artifacts::locate_trace().elf, &bytes).unwrap_or_else(|e| panic!("{e}"));
    let text = trace.with_extension("log");
    let _ = std::fs::write(&text, lines.join("\n") + "\n");
    println!("{} trace events in {}", lines.len(), text.display());
    lines
}

/// The trace events matching `pattern` (on the message after the level):
/// their captures.
fn events<'a>(lines: &'a [String], pattern: &str) -> Vec<regex::Captures<'a>> {
    let re = Regex::new(&format!(r"TRACE {pattern}")).unwrap();
    lines.iter().filter_map(|l| re.captures(l)).collect()
}

/// The sum of capture group 1 (a decimal number) over `events`.
fn sum(events: &[regex::Captures]) -> u64 {
    events.iter().map(|c| c[1].parse::<u64>().unwrap()).sum()
}

/// alpha (VM 0 of the pair) ballooned by 16 MiB and back: exits, MMIO to the
/// balloon and the console, one inflate and one deflate event per request
/// adding up to the 4096 pages, a TLB flush for every page unmapped, and a
/// zeroed frame for every page deflated when the guest touches it: by the
/// fault, or by a fault on a neighbour (fault-around).
#[test]
#[ignore = "boots QEMU: run cargo xtask test"]
fn virt_gicv2_trace_balloon_events() {
    let (mut s, trace) = boot("pair", "trace_balloon_events");
    // The guests come up in either order.
    ok(s.await_test_guests(&["alpha", "beta"], STEP));
    ok(s.balloon_test_guest("alpha", 16, STEP));
    ok(s.run("balloon alpha 0", COMMAND));
    ok(s.expect(
        r"\[alpha\] testguest: balloon target=0 actual=0 pages",
        STEP,
    ));
    ok(s.expect(r"\[alpha\] testguest: deflated pages read zero", STEP));
    let lines = finish(s, &trace);

    let exits = events(&lines, r"exit vm0 vcpu0 (\w+) pc=0x[0-9a-f]+");
    for kind in ["MmioRead", "MmioWrite"] {
        assert!(
            exits.iter().any(|c| &c[1] == kind),
            "no {kind} exit of alpha in {} exits",
            exits.len()
        );
    }
    for device in ["Virtio", "Uart"] {
        let pattern = format!(r"mmio vm0 (read|write) 0x[0-9a-f]+ [1248]B Some\({device}\) = ");
        assert!(
            !events(&lines, &pattern).is_empty(),
            "no MMIO access to alpha's {device}"
        );
    }
    let inflates = events(
        &lines,
        r"inflate vm0 pages=(\d+) pfns 0x[0-9a-f]+..=0x[0-9a-f]+ runs=\d+ released=(\d+)",
    );
    let deflates = events(
        &lines,
        r"deflate vm0 pages=(\d+) pfns 0x[0-9a-f]+..=0x[0-9a-f]+ runs=\d+ released=0",
    );
    assert_eq!(sum(&inflates), 4096, "pages inflated");
    let released: u64 = inflates.iter().map(|c| c[2].parse::<u64>().unwrap()).sum();
    assert_eq!(released, 4096, "frames given back by the inflates");
    assert_eq!(sum(&deflates), 4096, "pages deflated");
    let flushed = sum(&events(
        &lines,
        r"tlb flush vm0 vmid=\d+ whole VMID, (\d+) pages unmapped",
    ));
    assert_eq!(flushed, released, "every page unmapped is flushed");
    let fresh = events(
        &lines,
        r"fault-in vm0 0x[0-9a-f]+ fresh=true fill=0x0 around=(\d+)",
    );
    let around = sum(&fresh);
    assert_eq!(
        fresh.len() as u64 + around,
        4096,
        "a fresh frame for every page deflated ({} faulted in, {around} around them)",
        fresh.len()
    );
    assert!(
        fresh.len() as u64 <= 4096 / 8,
        "fault-around serves most first touches: {} faults",
        fresh.len()
    );
    // Each fault-in comes from an abort exit (a load or store to a page
    // without a frame is one, though its syndrome looks like MMIO).
    let aborts = exits.iter().filter(|c| &c[1] == "Abort").count();
    assert!(aborts >= fresh.len(), "{aborts} abort exits");
    // beta was left alone.
    assert!(events(&lines, r"(inflate|deflate|fault-in) vm1 ").is_empty());
}

/// Free page reporting and a hinting run with the bare-metal guest-driver
/// guest (all features offered, guests/tests/gd-features.toml): each report
/// and hint buffer is an event whose pages add up to what `info balloon`
/// counts.
#[test]
#[ignore = "boots QEMU: run cargo xtask test"]
fn virt_gicv2_trace_report_and_hint_events() {
    let (mut s, trace) = boot("gd-features", "trace_report_and_hint_events");
    ok(s.expect(r"\[gdf\] testguest: reported \d+ blocks", STEP));
    // From before the command: the run can end inside its output.
    let mut since = s.mark();
    let started = ok(s.run("hint gdf", COMMAND));
    let id =
        harness::console::first_number(&started, r"hinting run (\d+) started").expect(&started);
    let done = ok(s.expect_since(
        &mut since,
        &format!(r"tidal: \[gdf\] balloon: free page hint run {id} done: (\d+) pages hinted"),
        STEP,
    ));
    let hinted: u64 = done[1].parse().unwrap();
    let info = ok(s.run("info balloon gdf", COMMAND));
    let reported = harness::console::first_number(
        &info,
        r"free page reporting: \d+ reports, \d+ blocks, (\d+) pages",
    )
    .expect(&info);
    let lines = finish(s, &trace);

    let reports = events(&lines, r"report vm0 blocks=\d+ pages=(\d+) released=\d+");
    assert!(!reports.is_empty(), "no report event");
    // Reports may go on after `info balloon` was read, never fewer.
    assert!(
        sum(&reports) >= reported,
        "report events vs {reported} pages"
    );
    let hints = events(&lines, r"hint vm0 blocks=\d+ pages=(\d+) released=\d+");
    assert!(!hints.is_empty(), "no hint event");
    assert!(sum(&hints) >= hinted, "hint events vs {hinted} pages");
}
