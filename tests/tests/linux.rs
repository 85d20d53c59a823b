//! An unmodified Debian arm64 Linux guest (kernel and busybox initramfs from
//! Debian's packages, built by `cargo xtask` into target/fixtures/linux/)
//! under the hypervisor on every board: it boots to its agent, the
//! upstream virtio_balloon driver inflates 128 MiB and deflates it, and the
//! guest's /proc/vmstat and MemTotal, and the hypervisor's accounting, agree
//! to the page; a read of an address that is neither RAM nor a device is a
//! SIGBUS for the process, not a VM stop. The agent protocol is guests/linux/README.md's: `run <id>
//! <command>` answered by the output and `tidal-guest: done <id> rc=<rc>`.

use std::time::Duration;

use harness::linux::{agent_run, enter_console, leave_console, wait_for_agents};
use harness::{Board, HarnessError, Session};

const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(60);
const COMMAND: Duration = Duration::from_secs(20);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn boot(board: Board, scenario: &str) -> Session {
    let mut s = ok(Session::start_bundle(board, "linux", scenario));
    s.set_deadline(Duration::from_secs(600));
    ok(wait_for_agents(&mut s, &["linux"], 0, BOOT));
    s
}

/// Run `cmd` in the guest through its console; its output lines.
fn agent(s: &mut Session, id: u32, cmd: &str) -> Vec<String> {
    let reply = ok(agent_run(s, "linux", id, cmd, STEP));
    assert_eq!(reply.rc, 0, "`{cmd}` failed:\n{:?}", reply.lines);
    reply.lines
}

/// A `key value` line's value, from /proc/meminfo or /proc/vmstat output.
fn value(lines: &[String], key: &str) -> u64 {
    harness::console::key_value(lines, key).unwrap_or_else(|| panic!("no {key} in {lines:?}"))
}

/// The guest's MemTotal in kB (agent request `id`).
fn mem_total(s: &mut Session, id: u32) -> u64 {
    value(&agent(s, id, "grep MemTotal /proc/meminfo"), "MemTotal:")
}

fn free_bytes(s: &mut Session) -> u64 {
    s.mem_category("free", COMMAND)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A row of `info exits`: the kind's exits.
fn exits_of(table: &str, kind: &str) -> u64 {
    harness::console::first_number(table, &format!(r"(?m)^  {kind} +(\d+) "))
        .unwrap_or_else(|| panic!("no {kind} row in:\n{table}"))
}

/// Linux's console output through the PL011's read-only mirror page: the
/// flag register it reads before each byte is a plain load, so a byte sent
/// is one exit (the DR store), not two. Counted over a 4-5 KB answer.
fn console_output_costs_one_exit_a_byte(s: &mut Session) {
    let reset = ok(s.run("info exits linux reset", COMMAND));
    assert!(reset.contains("exit profile started over"), "{reset}");
    let lines = agent(s, 90, "cat /proc/vmstat");
    let table = ok(s.run("info exits linux", COMMAND));
    // What the guest printed: the lines with their CR LF, the echoed
    // request and the agent's `done` line.
    let bytes: usize = lines.iter().map(|l| l.len() + 2).sum::<usize>() + 64;
    let uart = exits_of(&table, "mmio-uart");
    assert!(bytes > 3000, "{lines:?}");
    assert!(
        uart >= lines.len() as u64 && uart < bytes as u64 * 5 / 4,
        "{uart} PL011 exits for about {bytes} bytes printed:\n{table}"
    );
    assert!(
        table.contains("linux: PL011 mirror page shown now"),
        "{table}"
    );
}

fn upstream_balloon_driver(board: Board) {
    let mut s = boot(board, "linux_balloon");
    let cpus = agent(&mut s, 1, "grep -c ^processor /proc/cpuinfo");
    assert_eq!(cpus, ["2"], "both vCPUs online");
    let mods = agent(&mut s, 2, "cat /proc/modules");
    assert!(
        mods.iter().any(|l| l.starts_with("virtio_balloon ")),
        "{mods:?}"
    );
    console_output_costs_one_exit_a_byte(&mut s);
    let total0 = mem_total(&mut s, 3);
    let free0 = free_bytes(&mut s);

    ok(s.send_line("balloon linux 128M"));
    ok(s.expect(
        r"tidal: \[linux\] balloon: reached 32768 pages: 32768 pages inflated",
        STEP,
    ));
    let vmstat = agent(&mut s, 4, "grep ^balloon_ /proc/vmstat");
    assert_eq!(value(&vmstat, "balloon_inflate"), 32768, "{vmstat:?}");
    let total1 = mem_total(&mut s, 5);
    assert_eq!(
        total0 - total1,
        128 * 1024,
        "MemTotal shrinks by 128 MiB (in kB)"
    );
    assert_eq!(
        free_bytes(&mut s) - free0,
        128 << 20,
        "the pool grows by exactly 128 MiB"
    );
    let info = ok(s.run("info balloon linux", COMMAND));
    assert!(info.contains("ballooned 32768 pages"), "{info}");
    assert!(
        info.contains("negotiated: MUST_TELL_HOST VERSION_1"),
        "{info}"
    );

    ok(s.send_line("balloon linux 0"));
    ok(s.expect(
        r"tidal: \[linux\] balloon: reached 0 pages: 32768 pages deflated",
        STEP,
    ));
    let vmstat = agent(&mut s, 6, "grep ^balloon_ /proc/vmstat");
    assert_eq!(value(&vmstat, "balloon_deflate"), 32768, "{vmstat:?}");
    let total2 = mem_total(&mut s, 7);
    assert_eq!(total2, total0, "MemTotal back");
    let out = s.output();
    assert!(!out.contains("VM stopped"), "{out}");
    s.assert_check();
}

/// `reboot -f` restarts only that VM (PSCI SYSTEM_RESET); `poweroff -f`
/// stops it (SYSTEM_OFF) and every page goes back to the pool; started
/// again and busy, `stop` from the shell stops it.
fn reboot_and_poweroff(board: Board) {
    let mut s = boot(board, "linux_reboot_and_poweroff");
    ok(enter_console(&mut s, "linux"));
    ok(s.send_line("run 1 reboot -f"));
    ok(s.expect(
        r"tidal: \[linux\] VM stopped: reset by the guest \(PSCI SYSTEM_RESET\); 131072 pages returned",
        STEP,
    ));
    ok(s.expect(r"\[linux\] tidal-guest: agent listening", BOOT));
    ok(s.send_line("run 2 poweroff -f"));
    ok(s.expect(r"tidal: \[linux\] VM stopped: powered off by the guest \(PSCI SYSTEM_OFF\); 131072 pages returned", STEP));
    ok(leave_console(&mut s));
    let guest = s
        .mem_category("guest RAM", COMMAND)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(guest, 0, "no guest frames left");
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.lines().any(|l| l.starts_with("linux")
            && l.contains("stopped")
            && l.trim_end().ends_with('2')),
        "{vms}"
    );
    s.assert_check();
    // Started again from the shell, it computes on both vCPUs, vCPU 0 on
    // the shell's CPU: the shell still answers and stops it at once.
    ok(s.send_line("start linux"));
    ok(s.expect(r"\[linux\] tidal-guest: agent listening", BOOT));
    ok(enter_console(&mut s, "linux"));
    // Detached from the agent's output, which it reads to the end.
    ok(s.send_line(
        "run 3 sh -c 'for i in 1 2; do (while :; do :; done) </dev/null >/dev/null 2>&1 & done'",
    ));
    ok(s.expect(r"tidal-guest: done 3 rc=0", STEP));
    ok(leave_console(&mut s));
    let vms = ok(s.run("vms", COMMAND));
    assert!(vms.contains("running"), "{vms}");
    ok(s.send_line("stop linux"));
    ok(s.expect(
        r"tidal: \[linux\] VM stopped: stopped from the shell; 131072 pages returned",
        STEP,
    ));
    s.assert_check();
}

/// A read of an address that is neither RAM nor a device (busybox
/// `devmem`, through /dev/mem) gets the synchronous external abort a board
/// would raise: Linux sends the process SIGBUS and carries on.
fn bad_access_is_a_sigbus(board: Board) {
    let mut s = boot(board, "linux_bad_access");
    let mut since = s.mark();
    let reply = ok(agent_run(&mut s, "linux", 1, "devmem 0x30000000 32", STEP));
    assert_eq!(reply.rc, 128 + 7, "killed by SIGBUS: {:?}", reply.lines);
    ok(s.expect_since(
        &mut since,
        r"tidal: \[linux\] data abort injected: an access to an address that is neither its RAM nor a device: 4-byte read at IPA 0x30000000, PC 0x",
        STEP,
    ));
    assert_eq!(agent(&mut s, 2, "echo still here"), ["still here"]);
    // A line typed at once, far longer than the PL011's 32-byte receive
    // FIFO, reaches the guest whole; its 600-character output line comes
    // back as one console line.
    let long: String = (0..600u32)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    assert_eq!(agent(&mut s, 3, &format!("echo {long}")), [long]);
    let vms = ok(s.run("vms", COMMAND));
    assert!(
        vms.contains("linux: exceptions injected: 1 (1 not RAM or device)"),
        "{vms}"
    );
    assert!(!s.output().contains("VM stopped"), "{}", s.output());
}

/// A VM with `console = "virtio"`: the kernel boots on the PL011, the
/// agent answers over /dev/hvc0 (Linux's virtio_console), a long answer
/// arrives whole with almost no PL011 exits, a long request is typed at
/// once, and the busybox shell runs on hvc0 too.
fn virtio_console(board: Board) {
    let mut s = ok(Session::start_bundle(
        board,
        "linux-vconsole",
        "linux_virtio_console",
    ));
    s.set_deadline(Duration::from_secs(600));
    ok(wait_for_agents(&mut s, &["linux"], 0, BOOT));
    let mods = agent(&mut s, 1, "cat /proc/modules");
    assert!(
        mods.iter().any(|l| l.starts_with("virtio_console ")),
        "{mods:?}"
    );
    assert_eq!(agent(&mut s, 2, "cat /sys/class/tty/hvc0/dev"), ["229:0"]);

    let reset = ok(s.run("info exits linux reset", COMMAND));
    assert!(reset.contains("exit profile started over"), "{reset}");
    let lines = agent(&mut s, 3, "cat /proc/vmstat");
    let table = ok(s.run("info exits linux", COMMAND));
    let bytes: usize = lines.iter().map(|l| l.len() + 2).sum();
    assert!(bytes > 3000 && lines.len() > 100, "{lines:?}");
    assert!(
        lines.iter().any(|l| l.starts_with("nr_free_pages ")),
        "{lines:?}"
    );
    let uart = exits_of(&table, "mmio-uart");
    let notify = exits_of(&table, "virtio-notify");
    assert!(
        // A write per line and per line end (n_tty writes CR LF apart),
        // against a PL011 exit per byte.
        uart < 20 && notify > 0 && notify < bytes as u64 / 4,
        "{uart} PL011 exits and {notify} notifies for {bytes} bytes:\n{table}"
    );
    assert!(
        table.contains("linux: virtio console ready (typed input goes to it)"),
        "{table}"
    );
    assert!(!s.output().contains("console lines lost"), "{}", s.output());

    // A request longer than the PL011's FIFO, typed at once.
    let long: String = (0..600u32)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    assert_eq!(agent(&mut s, 4, &format!("echo {long}")), [long]);

    // The shell instead of the agent, on hvc0 too, and back.
    ok(enter_console(&mut s, "linux"));
    ok(s.send_line("shell"));
    ok(s.expect(r"\[linux\] tidal-guest: shell", STEP));
    // Its prompt first: a line typed before the shell sets up its line
    // editing is dropped with the tty's input.
    ok(s.expect(r"/ # ", STEP));
    ok(s.send_line("echo hvc-$((6*7)) $(tty)"));
    ok(s.expect(r"hvc-42 /dev/hvc0", STEP));
    ok(s.send_line("exit"));
    ok(s.expect(r"tidal-guest: agent listening", STEP));
    ok(leave_console(&mut s));
    assert_eq!(agent(&mut s, 5, "echo back"), ["back"]);
    assert!(!s.output().contains("VM stopped"), "{}", s.output());
    s.assert_check();
}

mod virt_gicv2 {
    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn virtio_console() {
        super::virtio_console(harness::Board::VirtGicv2);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn bad_access_is_a_sigbus() {
        super::bad_access_is_a_sigbus(harness::Board::VirtGicv2);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn upstream_balloon_driver() {
        super::upstream_balloon_driver(harness::Board::VirtGicv2);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn reboot_and_poweroff() {
        super::reboot_and_poweroff(harness::Board::VirtGicv2);
    }
}

mod raspi4b {
    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn bad_access_is_a_sigbus() {
        super::bad_access_is_a_sigbus(harness::Board::Raspi4b);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn upstream_balloon_driver() {
        super::upstream_balloon_driver(harness::Board::Raspi4b);
    }
}

mod virt_gicv3 {
    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn virtio_console() {
        super::virtio_console(harness::Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn bad_access_is_a_sigbus() {
        super::bad_access_is_a_sigbus(harness::Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn upstream_balloon_driver() {
        super::upstream_balloon_driver(harness::Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn reboot_and_poweroff() {
        super::reboot_and_poweroff(harness::Board::VirtGicv3);
    }
}
