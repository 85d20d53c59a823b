//! Guests under the hypervisor, on every board: two bare-metal test guests
//! run at once, one is ballooned by half its RAM and given it back while the
//! other keeps running, patterns stay intact, the pool moves by exactly the
//! ballooned pages; stop and start return every page; a guest's bad
//! accesses (malformed device register accesses, a load pair on a device,
//! addresses outside RAM and every device, a fetch outside RAM) get an
//! abort it handles, or stop it under the "stop" policy; a hostile guest's
//! attacks on the balloon are refused and reported, and its statistics of
//! 2^64-1 are clamped and stop nobody; a hypervisor failure
//! in one VM's path ends only that VM, one in a board service turns only
//! that service off, and one that breaks the frame table stops the board.
//! Every test that keeps the board running ends with `check`. The
//! bundles come from guests/ and guests/tests/ (built by `cargo xtask`).

use std::time::Duration;

use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};

const STEP: Duration = Duration::from_secs(90);
const COMMAND: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// Boot `board` with the bundle `bundle` (None: the demo bundle) and wait
/// until every VM in `ready` has set up its balloon.
fn boot(board: Board, scenario: &str, bundle: Option<&str>, ready: &[&str]) -> Session {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    if let Some(name) = bundle {
        opts.initrd = Some(target_dir().join("bundles").join(format!("{name}.img")));
    }
    let mut s = ok(Session::start(
        &format!("{}-{scenario}", board.name()),
        board,
        &artifacts,
        &opts,
    ));
    s.set_deadline(Duration::from_secs(420));
    ok(s.await_test_guests(ready, STEP));
    s
}

/// Bytes in a category of `mem`; checks the sum and invariants.
fn mem_category(s: &mut Session, category: &str) -> u64 {
    s.mem_category(category, COMMAND)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn balloon_half_and_back(board: Board) {
    let mut s = boot(board, "balloon_half_and_back", None, &["alpha", "beta"]);
    let free0 = mem_category(&mut s, "free");
    // alpha has 256 MiB: balloon half of it.
    ok(s.balloon_test_guest("alpha", 128, STEP));
    // beta kept running meanwhile.
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    let free1 = mem_category(&mut s, "free");
    assert_eq!(
        free1 - free0,
        128 * MIB,
        "the pool grows by exactly the ballooned pages"
    );
    let info = ok(s.run("info balloon alpha", COMMAND));
    assert!(info.contains("ballooned 32768 pages"), "{info}");
    assert!(
        info.contains("negotiated: MUST_TELL_HOST VERSION_1"),
        "{info}"
    );

    ok(s.balloon_test_guest("alpha", 0, STEP));
    ok(s.expect(r"\[alpha\] testguest: deflated pages read zero", STEP));
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    exit_profile_counts_and_resets(&mut s, board);
    // The guest touched every page it got back: all are backed again.
    assert_eq!(
        mem_category(&mut s, "free"),
        free0,
        "deflate gives every page back"
    );
    let out = s.output();
    for bad in [
        "MISMATCH",
        "NOT ZERO",
        "EXCEPTION",
        "VM stopped",
        "injected",
    ] {
        assert!(!out.contains(bad), "'{bad}' in the console:\n{out}");
    }
    s.assert_check();
}

/// A row of `info exits`: the kind's exits.
fn exits_of(table: &str, kind: &str) -> u64 {
    harness::console::first_number(table, &format!(r"(?m)^  {kind} +(\d+) "))
        .unwrap_or_else(|| panic!("no {kind} row in:\n{table}"))
}

/// alpha's exit profile after its balloon round trip: the balloon's MMIO
/// is there, the rows add up to the total, and a reset starts it over.
fn exit_profile_counts_and_resets(s: &mut Session, board: Board) {
    let table = ok(s.run("info exits alpha", COMMAND));
    let total = exits_of(&table, "total");
    assert!(exits_of(&table, "mmio-virtio") > 0, "{table}");
    assert!(exits_of(&table, "mmio-uart") > 0, "{table}");
    // GICv3's CPU interface is system registers the hardware serves
    // without a trap; its redistributor is MMIO we emulate.
    let gic = if board == Board::VirtGicv3 {
        "mmio-gicr"
    } else {
        "mmio-gicd"
    };
    assert!(exits_of(&table, gic) > 0, "{gic}: {table}");
    let rows: u64 = table
        .lines()
        .filter(|l| l.starts_with("  ") && !l.contains(" kind ") && !l.contains(" total "))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(rows, total, "{table}");
    let reset = ok(s.run("info exits alpha reset", COMMAND));
    assert!(
        reset.contains("alpha: exit profile started over (it had "),
        "{reset}"
    );
    let again = ok(s.run("info exits alpha", COMMAND));
    assert!(exits_of(&again, "total") < total, "{again}");
    let err = ok(s.run("info exits nosuchvm", COMMAND));
    assert!(err.contains("no VM called 'nosuchvm'"), "{err}");
}

fn stop_and_start(board: Board) {
    let mut s = boot(board, "stop_and_start", None, &["alpha", "beta"]);
    let guest0 = mem_category(&mut s, "guest RAM");
    assert_eq!(guest0, 384 * MIB, "alpha 256 MiB + beta 128 MiB");
    let tables0 = mem_category(&mut s, "page tables");
    let out = ok(s.run("stop beta", COMMAND));
    let stopped = r"tidal: \[beta\] VM stopped: stopped from the shell; 32768 pages returned";
    // The shell waits for the stop, so the line usually comes before the prompt.
    if !regex::Regex::new(stopped).unwrap().is_match(&out) {
        ok(s.expect(stopped, STEP));
    }
    assert_eq!(mem_category(&mut s, "guest RAM"), 256 * MIB);
    assert!(
        mem_category(&mut s, "page tables") < tables0,
        "beta's stage-2 tables are freed"
    );
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines()
            .any(|l| l.starts_with("beta") && l.contains("stopped")),
        "{vms}"
    );
    ok(s.expect(r"\[alpha\] testguest: alive \d+s", STEP));
    // Its lines may come before the command's own reply.
    let mut since = s.mark();
    ok(s.run("start beta", COMMAND));
    ok(s.expect_since(&mut since, r"\[beta\] testguest: balloon at ", STEP));
    assert_eq!(mem_category(&mut s, "guest RAM"), guest0);
    assert_eq!(mem_category(&mut s, "page tables"), tables0);
    let out = ok(s.run("start beta", COMMAND));
    assert!(out.contains("cannot start: it is already running"), "{out}");
    let out = ok(s.run("stop gamma", COMMAND));
    assert!(
        out.contains("no VM called 'gamma'; the VMs are: alpha, beta"),
        "{out}"
    );
    s.assert_check();
}

/// The wild guest's probes: its name for each, what the hypervisor says it
/// injected, and the exception class the guest's handler must see (0x25:
/// data abort from EL1, 0x21: instruction abort from EL1) with WnR.
const PROBES: [(&str, &str, &str); 7] = [
    (
        "virtio config 2-byte read at offset 1",
        r"data abort injected: an access the virtio-mmio device does not accept \(2-byte config access at offset 0x101 is not aligned to its width\): 2-byte read at IPA 0xa000101, PC 0x[0-9a-f]+",
        "EC 0x25 FSC 0x10 WnR 0",
    ),
    (
        "virtio status 2-byte read",
        r"data abort injected: an access the virtio-mmio device does not accept \(2-byte access at offset 0x70: registers below 0x100 take aligned 32-bit accesses only\): 2-byte read at IPA 0xa000070, ",
        "EC 0x25 FSC 0x10 WnR 0",
    ),
    (
        "virtio config ldp",
        r"data abort injected: an access the hypervisor cannot emulate \(no instruction syndrome: a load/store pair, writeback or SIMD form\) to the virtio-mmio device: at IPA 0xa000100, ",
        "EC 0x25 FSC 0x10 WnR 0",
    ),
    (
        "GIC distributor 2-byte read",
        r"data abort injected: an access the GIC distributor does not accept: 2-byte read at IPA 0x8000000, ",
        "EC 0x25 FSC 0x10 WnR 0",
    ),
    (
        "unmapped read",
        r"data abort injected: an access to an address that is neither its RAM nor a device: 4-byte read at IPA 0x30000000, ",
        "EC 0x25 FSC 0x10 WnR 0",
    ),
    (
        "unmapped write",
        r"data abort injected: an access to an address that is neither its RAM nor a device: 4-byte write at IPA 0x30000000, ",
        "EC 0x25 FSC 0x10 WnR 1",
    ),
    (
        "fetch outside RAM",
        r"instruction abort injected: an instruction fetch outside its RAM: at IPA 0x30000000, ",
        "EC 0x21 FSC 0x10 WnR 0",
    ),
];

fn wild_guest_gets_aborts(board: Board) {
    let mut s = boot(board, "wild_guest_gets_aborts", Some("wild"), &[]);
    let start = s.mark();
    let mut since = start;
    for (probe, injected, seen) in PROBES {
        ok(s.expect_since(&mut since, &format!(r"tidal: \[wild\] {injected}"), STEP));
        ok(s.expect_since(
            &mut since,
            &format!(
                r"\[wild\] testguest: wild: {}: {seen} FAR 0x[0-9a-f]+ \(FAR and ELR right\)",
                regex::escape(probe)
            ),
            STEP,
        ));
    }
    // It handled every abort and carries on as a pattern guest.
    ok(s.expect_since(
        &mut since,
        r"\[wild\] testguest: wild: done, carrying on",
        STEP,
    ));
    ok(s.expect_since(&mut since, r"\[wild\] testguest: balloon at ", STEP));
    // The same guest under on_bad_access = "stop" ends at its first one.
    let mut strict = start;
    ok(s.expect_since(
        &mut strict,
        r#"tidal: \[strict\] stopping the VM \(on_bad_access = "stop"\): an access the virtio-mmio device does not accept \(.*\): 2-byte read at IPA 0xa000101, PC 0x"#,
        STEP,
    ));
    ok(s.expect_since(
        &mut strict,
        r"tidal: \[strict\] VM stopped: a device register access the device refuses; \d+ pages returned to the pool",
        STEP,
    ));
    // beta's heartbeat goes on (two beats: it is not stale output).
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.expect(r"\[wild\] testguest: alive \d+s", STEP));
    assert_eq!(
        mem_category(&mut s, "guest RAM"),
        (128 + 64) * MIB,
        "beta's and wild's RAM are in use, strict's is back"
    );
    let vms = ok(s.run("vms", COMMAND));
    let row = |vm: &str| {
        vms.lines()
            .find(|l| l.split_whitespace().next() == Some(vm))
            .unwrap_or_else(|| panic!("no {vm} in:\n{vms}"))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // name state cpu RAM(2 words) mapped ballooned policy aborts starts
    let wild = row("wild");
    assert_eq!(
        (&wild[1][..], &wild[7][..], &wild[8][..]),
        ("running", "abort", "7"),
        "{vms}"
    );
    let strict = row("strict");
    assert_eq!(
        (&strict[1][..], &strict[7][..], &strict[8][..]),
        ("stopped", "stop", "0"),
        "{vms}"
    );
    assert!(
        vms.contains(
            "wild: exceptions injected: 7 (3 bad device register, 1 no syndrome, 2 not RAM or device, 1 fetch outside RAM"
        ),
        "{vms}"
    );
    let out = s.output();
    assert!(!out.contains("WRONG"), "{out}");
    assert!(!out.contains("no exception"), "{out}");
    assert!(!out.contains("*** "), "the hypervisor crashed:\n{out}");
    s.assert_check();
}

fn hostile_guest_is_contained(board: Board) {
    let mut s = boot(board, "hostile_guest_is_contained", Some("hostile"), &[]);
    // The device's reports and the guest's lines, each followed in order.
    let mut reports = s.mark();
    let mut guest = reports;
    // Each attack: the device refuses it and the console says why.
    for (attack, report) in [
        (
            "descriptor-loop",
            r"is longer than the queue size .* \(a loop\?\)",
        ),
        ("descriptor-outside-ram", r"points outside guest RAM"),
        (
            "descriptor-huge-length",
            r"is longer than the 16384 bytes accepted",
        ),
        (
            "avail-index-ahead",
            r"available index 1000 is more than the queue size",
        ),
        ("pfn-past-ram", r"rejected PFNs: [1-9]\d* outside guest RAM"),
        ("pfn-mmio", r"rejected PFNs: [1-9]\d* outside guest RAM"),
        (
            "pfn-duplicate",
            r"rejected PFNs: 0 outside guest RAM, 1 duplicated",
        ),
        ("pfn-already-ballooned", r"1 already ballooned"),
        ("deflate-never-inflated", r"1 not ballooned"),
        (
            "indirect-descriptor",
            r"is indirect, but VIRTIO_F_INDIRECT_DESC is not offered",
        ),
        // The 11th device error within a second: past the rate limit's
        // burst of 10, so it may be held back and only counted (said when
        // the VM stops, if no later error line says it first).
        (
            "misaligned-queue",
            r"(?:balloon: .*is not 16-byte aligned|\d+ similar messages suppressed)",
        ),
    ] {
        ok(s.expect_since(
            &mut reports,
            &format!(r"tidal: \[hostile\] (?:balloon: .*)?{report}"),
            STEP,
        ));
        ok(s.expect_since(
            &mut guest,
            &format!(r"\[hostile\] testguest: hostile: {attack} -> status"),
            STEP,
        ));
    }
    ok(s.expect_since(&mut guest, r"\[hostile\] testguest: hostile: done", STEP));
    ok(s.expect_since(
        &mut guest,
        r"tidal: \[hostile\] VM stopped: powered off by the guest",
        STEP,
    ));
    // The other guest was never disturbed, and the hypervisor still answers.
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.balloon_test_guest("beta", 64, STEP));
    assert_eq!(mem_category(&mut s, "guest RAM"), 64 * MIB);
    let out = s.output();
    assert!(!out.contains("*** "), "the hypervisor crashed:\n{out}");
    s.assert_check();
}

/// `manager: N ticks` from `mm`.
fn manager_ticks(mm: &str) -> u64 {
    harness::console::first_number(mm, r"manager: (\d+) ticks;")
        .unwrap_or_else(|| panic!("no tick count in:\n{mm}"))
}

/// Issue 36, end to end: a guest whose balloon statistics are all 2^64-1
/// (free memory, disk caches, total and available memory, faults, OOM
/// kills, every tag Linux sends) stops nobody. Before the fix the memory
/// manager's sum of free memory and disk caches overflowed in whichever
/// CPU ran its tick, and the VM stopped for it was that CPU's (or the
/// shell died). Now the device clamps every value at intake and counts
/// it, the manager reads only sane figures, and both guests, the manager
/// and the shell go on.
fn hostile_statistics_stop_nobody(board: Board) {
    let mut s = boot(
        board,
        "hostile_statistics_stop_nobody",
        Some("hostile-stats"),
        &["hostile", "beta"],
    );
    let mut guest = 0;
    ok(s.expect_since(
        &mut guest,
        r"\[hostile\] testguest: hostile-stats: buffer #1 posted",
        STEP,
    ));
    let out = ok(s.run("balloon-stats hostile 1", COMMAND));
    assert!(
        out.contains("hostile: balloon statistics every 1 s"),
        "{out}"
    );
    let ticks0 = manager_ticks(&ok(s.run("mm", COMMAND)));
    // A fresh hostile buffer every second: each a sample the manager
    // reads at its next tick (every 100 ms).
    ok(s.expect_since(
        &mut guest,
        r"\[hostile\] testguest: hostile-stats: buffer #4 posted",
        STEP,
    ));
    // Asked for at once too: the sample comes back clamped.
    let now = ok(s.run("balloon-stats hostile now", COMMAND));
    assert!(now.contains("; 16 values clamped):"), "{now}");
    assert!(
        regex::Regex::new(r"free_memory +128 MiB")
            .unwrap()
            .is_match(&now),
        "{now}"
    );
    ok(s.expect_since(
        &mut guest,
        r"\[hostile\] testguest: hostile-stats: buffer #6 posted",
        STEP,
    ));
    // Both beat on (two beats each from here: not stale output).
    for vm in ["beta", "hostile", "beta", "hostile"] {
        ok(s.expect(&format!(r"\[{vm}\] testguest: alive \d+s"), STEP));
    }

    let info = ok(s.run("info balloon hostile", COMMAND));
    assert!(
        info.contains("negotiated: MUST_TELL_HOST STATS_VQ"),
        "{info}"
    );
    // Every value of every buffer clamped where it entered: memory figures
    // at the VM's 128 MiB, cumulative ones at 2^62.
    let clamped = harness::console::first_number(
        &info,
        r"guest values clamped at intake: (\d+) statistics values, 0 writes of actual",
    )
    .unwrap_or_else(|| panic!("no clamp counter in:\n{info}"));
    assert!(
        clamped >= 6 * 16 && clamped.is_multiple_of(16),
        "16 values clamped per buffer, at least 6 buffers: {clamped}\n{info}"
    );
    assert!(info.contains("; 16 values clamped):"), "{info}");
    for (name, value) in [
        ("free_memory", "128 MiB"),
        ("total_memory", "128 MiB"),
        ("available_memory", "128 MiB"),
        ("disk_caches", "128 MiB"),
        ("major_faults", "4611686018427387904"),
        ("oom_kills", "4611686018427387904"),
    ] {
        let line = format!(r"(?m)^    {name} +{value}$");
        assert!(
            regex::Regex::new(&line).unwrap().is_match(&info),
            "{name} should read {value}:\n{info}"
        );
    }
    // Clamped at intake, the figures the manager reads are within the
    // VM's size already: it has nothing left to bound.
    assert!(!info.contains("memory manager inputs clamped"), "{info}");

    // The manager is on and kept ticking through all of it.
    let mm = ok(s.run("mm", COMMAND));
    assert!(!mm.contains("OFF"), "the manager stays on:\n{mm}");
    assert!(
        manager_ticks(&mm) > ticks0 + 20,
        "the manager ticked on (from {ticks0}):\n{mm}"
    );
    let raw = ok(s.run("mm raw", COMMAND));
    assert!(raw.contains("mm-service name=manager state=on"), "{raw}");
    for vm in ["hostile", "beta"] {
        assert!(
            raw.contains(&format!("mm-vm name={vm} state=running ")),
            "{vm} is managed and running:\n{raw}"
        );
    }
    // The baselines `cargo xtask bench policy` runs (`mm policy`) read the
    // same hostile figures: neither stops anybody, and the tick goes on.
    for (policy, note) in [
        ("naive", "targets set by the naive controller"),
        ("none", "no controller sets targets"),
    ] {
        let out = ok(s.run(&format!("mm policy {policy}"), COMMAND));
        assert!(out.contains("balloon targets are now set by"), "{out}");
        let ticks = manager_ticks(&ok(s.run("mm", COMMAND)));
        ok(s.expect(r"\[hostile\] testguest: alive \d+s", STEP));
        let mm = ok(s.run("mm", COMMAND));
        assert!(mm.contains(note), "{mm}");
        assert!(manager_ticks(&mm) > ticks, "ticks on under {policy}:\n{mm}");
        let raw = ok(s.run("mm raw", COMMAND));
        assert!(raw.contains(&format!(" policy={policy}")), "{raw}");
    }
    let out = ok(s.run("mm policy manager", COMMAND));
    assert!(out.contains("set by the memory manager"), "{out}");
    let vms = ok(s.run("vms", COMMAND));
    for vm in ["hostile", "beta"] {
        assert!(
            vms.lines()
                .any(|l| l.split_whitespace().next() == Some(vm) && l.contains("running")),
            "{vm} runs:\n{vms}"
        );
    }
    let out = s.output();
    for bad in [
        "hypervisor failure",
        "*** ",
        "VM stopped",
        "MISMATCH",
        "balloon error",
    ] {
        assert!(!out.contains(bad), "'{bad}' in the console:\n{out}");
    }
    s.assert_check();
}

/// A hypervisor failure in one VM's path (`debug fail`: a panic with the
/// VM's lock and the frame table held) ends that VM only: it is reported,
/// its pages go back to the pool, the other VM keeps beating, the shell
/// answers, `check` passes, and the VM starts again. Then the same for a
/// data abort at EL2 (`debug fail beta abort`).
fn failure_in_one_vm_ends_only_it(board: Board) {
    let mut s = boot(
        board,
        "failure_in_one_vm_ends_only_it",
        None,
        &["alpha", "beta"],
    );
    let guest0 = mem_category(&mut s, "guest RAM");
    let free0 = mem_category(&mut s, "free");
    // The failure may be reported before the shell's own answer.
    let mut since = s.mark();
    let out = ok(s.run("debug fail alpha", COMMAND));
    assert!(out.contains("a hypervisor failure is injected"), "{out}");
    ok(s.expect_since(
        &mut since,
        r"tidal: \[alpha\] hypervisor failure in this VM's path: injected failure \('debug fail alpha'\) at hypervisor/src/run\.rs:\d+; the VM is stopped",
        STEP,
    ));
    ok(s.expect_since(
        &mut since,
        r"\[alpha\] VM stopped: a hypervisor failure in this VM's path; 65536 pages returned to the pool",
        STEP,
    ));
    // beta beats on (two beats after the failure: not stale output).
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines()
            .any(|l| l.starts_with("alpha") && l.contains("stopped")),
        "{vms}"
    );
    assert_eq!(mem_category(&mut s, "guest RAM"), guest0 - 256 * MIB);
    assert!(
        mem_category(&mut s, "free") >= free0 + 256 * MIB,
        "alpha's RAM and tables are back in the pool"
    );
    s.assert_check();
    // Its lines may come before the command's own reply.
    let mut since = s.mark();
    ok(s.run("start alpha", COMMAND));
    ok(s.expect_since(&mut since, r"\[alpha\] testguest: balloon at ", STEP));
    assert_eq!(mem_category(&mut s, "guest RAM"), guest0);
    // The new alpha works: its balloon moves and its memory is intact.
    ok(s.balloon_test_guest("alpha", 64, STEP));
    s.assert_check();
    // An EL2 exception (a data abort in the hypervisor) in beta's path is
    // contained the same way.
    let mut since = s.mark();
    ok(s.run("debug fail beta abort", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"tidal: \[beta\] hypervisor failure in this VM's path: synchronous from EL2 with SP_EL2 exception, ESR_EL2 0x[0-9a-f]+ \(data abort, same EL\), FAR_EL2 0x[0-9a-f]+, at ELR_EL2 0x[0-9a-f]+ \(image offset 0x[0-9a-f]+\); the VM is stopped",
        STEP,
    ));
    ok(s.expect_since(
        &mut since,
        r"\[beta\] VM stopped: a hypervisor failure in this VM's path; 32768 pages returned to the pool",
        STEP,
    ));
    ok(s.expect(r"\[alpha\] testguest: alive \d+s", STEP));
    ok(s.expect(r"\[alpha\] testguest: alive \d+s", STEP));
    // alpha alone, 64 MiB of it ballooned.
    assert_eq!(mem_category(&mut s, "guest RAM"), 192 * MIB);
    let out = s.output();
    assert!(!out.contains("*** "), "the hypervisor crashed:\n{out}");
    s.assert_check();
}

/// Work done for the whole board fails alone: a failure in the memory
/// manager's reading of one VM's input stops that VM (whatever CPU ran the
/// tick), a failure in the manager itself or in zeroing ahead turns that
/// service off with one line and every VM goes on, a failure in a shell
/// command abandons the command and the shell answers the next one.
fn board_services_fail_alone(board: Board) {
    let mut s = boot(board, "board_services_fail_alone", None, &["alpha", "beta"]);
    let mut since = s.mark();
    ok(s.run("debug fail-input alpha", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"tidal: \[alpha\] hypervisor failure in the memory manager handling this VM's input: injected failure \('debug fail-input alpha'\) at hypervisor/src/run\.rs:\d+; the VM is stopped",
        STEP,
    ));
    ok(s.expect_since(
        &mut since,
        r"\[alpha\] VM stopped: a hypervisor failure handling its input to the memory manager; 65536 pages returned to the pool",
        STEP,
    ));
    // beta beats on (two beats after the failure: not stale output).
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    let mm = ok(s.run("mm", COMMAND));
    assert!(!mm.contains("OFF"), "the manager stays on:\n{mm}");
    s.assert_check();

    let mut since = s.mark();
    ok(s.run("debug fail-board mm", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"tidal: memory manager stopped: injected failure \('debug fail-board mm'\) at hypervisor/src/run\.rs:\d+; balloons left as they are",
        STEP,
    ));
    let mm = ok(s.run("mm", COMMAND));
    assert!(
        mm.contains("memory manager: OFF since a hypervisor failure: injected failure ('debug fail-board mm')"),
        "{mm}"
    );
    let raw = ok(s.run("mm raw", COMMAND));
    assert!(raw.contains("mm-service name=manager state=off"), "{raw}");

    let mut since = s.mark();
    ok(s.run("debug fail-board zeroing", COMMAND));
    ok(s.expect_since(
        &mut since,
        r"tidal: zeroing ahead stopped: injected failure \('debug fail-board zeroing'\) at hypervisor/src/run\.rs:\d+; frames are zeroed when a guest takes them",
        STEP,
    ));
    let mut since = s.mark();
    ok(s.send_line("debug fail-board shell"));
    ok(s.expect_since(
        &mut since,
        r"tidal: shell command failed: injected failure \('debug fail-board shell'\) at hypervisor/src/boot\.rs:\d+; the command is abandoned, the shell goes on",
        COMMAND,
    ));
    // The shell answers, beta beats on and balloons both ways, alpha
    // starts again.
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines()
            .any(|l| l.starts_with("beta") && l.contains("running")),
        "{vms}"
    );
    ok(s.expect(r"\[beta\] testguest: alive \d+s", STEP));
    ok(s.balloon_test_guest("beta", 32, STEP));
    let mut since = s.mark();
    ok(s.run("start alpha", COMMAND));
    ok(s.expect_since(&mut since, r"\[alpha\] testguest: balloon at ", STEP));
    let out = s.output();
    assert!(!out.contains("*** "), "the hypervisor crashed:\n{out}");
    s.assert_check();
}

/// A failure that leaves the frame table half-updated stops the board with
/// one FATAL: line; no VM goes on with a broken table.
fn broken_frame_table_stops_the_board(board: Board) {
    let mut s = boot(
        board,
        "broken_frame_table_stops_the_board",
        None,
        &["alpha", "beta"],
    );
    s.assert_check();
    ok(s.send_line("debug fail beta frames"));
    ok(s.expect(
        r"FATAL: the frame table is inconsistent after a hypervisor failure that held it \(injected failure \('debug fail beta'\) at hypervisor/src/run\.rs:\d+\): .*; the board stops rather than run VMs on it",
        STEP,
    ));
    ok(s.wait_exit(STEP));
}

macro_rules! vm_tests {
    ($($module:ident => $board:expr;)*) => {$(
        mod $module {
            use super::*;

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn balloon_half_and_back() {
                super::balloon_half_and_back($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn stop_and_start() {
                super::stop_and_start($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn wild_guest_gets_aborts() {
                super::wild_guest_gets_aborts($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn hostile_guest_is_contained() {
                super::hostile_guest_is_contained($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn hostile_statistics_stop_nobody() {
                super::hostile_statistics_stop_nobody($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn failure_in_one_vm_ends_only_it() {
                super::failure_in_one_vm_ends_only_it($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn board_services_fail_alone() {
                super::board_services_fail_alone($board);
            }

            #[test]
            #[ignore = "boots QEMU: run cargo xtask test"]
            fn broken_frame_table_stops_the_board() {
                super::broken_frame_table_stops_the_board($board);
            }
        }
    )*};
}

vm_tests! {
    virt_gicv2 => Board::VirtGicv2;
    virt_gicv3 => Board::VirtGicv3;
    raspi4b => Board::Raspi4b;
}
