//! The Linux half of `cargo xtask bench`: one unmodified Debian arm64 guest
//! (the fixture kernel and busybox initramfs, 512 MiB, 2 vCPUs) ballooned by
//! 256 MiB and back under Tidal, and the same kernel and initramfs directly
//! under QEMU with QEMU's own virtio-balloon-device, for comparison; each
//! with free page reporting off and on (the demo's configuration), the same
//! on both sides ([`Reporting`]).
//!
//! Both sides are wall time (no -icount: Linux under icount is very slow) on
//! a shared machine, so each round boots Tidal then QEMU (alternating, so
//! load changes hit both), and the table gives median, min and max per side
//! and the ratio of medians. One boot of each side to ready comes first and
//! is not measured: the first QEMU after an idle host is slow whichever side
//! it is (its host kernel zeroes fresh huge pages slowly then). Every figure is measured the same way on both
//! sides through the harness's [`Session`]:
//! - boot: from spawning QEMU until `tidal-guest: ready` arrives on the
//!   console;
//! - inflate/deflate: from sending the request (Tidal's shell `balloon linux
//!   256M` / `balloon linux 0`, QEMU's monitor `balloon 256` / `balloon 512`,
//!   whose argument is the RAM left to the guest) until a watcher in the
//!   guest, started through the agent beforehand, reports that
//!   `balloon_inflate` (`_deflate`) in /proc/vmstat has grown by all 65536
//!   pages;
//! - the agent's round trip on the idle guest (`grep ^ball /proc/vmstat`,
//!   the median of [`IDLE_POLLS`] requests sent back to back, and of
//!   [`SPACED_POLLS`] sent [`SPACING`] apart, which find the guest asleep),
//!   which is why the watcher runs in the guest rather than being polled
//!   from here;
//! - QEMU's CPU time (/proc, all its threads): from its start to `ready`,
//!   user and kernel apart (the kernel's share is mostly the host faulting
//!   in memory, and moves with what the host did before), and per idle
//!   round trip: whether a side is slower for work done or for waiting.
//!
//! After the rounds, the agent's round trip once more on paired live guests
//! ([`paired_round_trips`]): both sides booted and kept up together, taking
//! turns at bursts of requests, each Tidal burst over the QEMU burst beside
//! it. Boots in sequence let the host's drift in (on a shared 2-core host,
//! QEMU's own median moved by half within a run); a pair of bursts a second
//! apart meets the same host.
//!
//! Besides, each side's device view: the hypervisor's own `balloon: reached`
//! report (its counter, from setting the target to the driver reporting it
//! reached) and the first QEMU `info balloon` showing the target (polled
//! every 5 ms during the move).
//!
//! And Tidal's exit profiles ([`super::exits`]): `info exits linux` once
//! the guest is ready (its boot), then over 10 s of the idle guest, before
//! the balloon moves; and once more after the rounds in a Tidal boot under
//! `-icount shift=0`, the only way QEMU's PMU counts the hypervisor's
//! instructions, with free page reporting on; that boot also inflates and
//! deflates once, with each move's exit profile (where a move's hypervisor
//! instructions go: stage-2 faults of pages reported and taken back,
//! notifies, interrupts); then the agent's work in the guest, and
//! [`ICOUNT_ROUND_TRIPS`] agent requests with their exit profile (what one
//! request costs the hypervisor). On that boot and on one directly under
//! QEMU with `-icount shift=0`: the agent's round trip and a byte printed
//! by the guest's clock, in which an instruction is 1 ns (the hypervisor's
//! count as the guest's time), requests typed at once so that no wait for
//! the host falls between two readings ([`Guest::clocked_round_trips`]).
//!
//! Results: a table on stdout and target/bench/linux.json.
//!
//! [`mod@super::features`] boots its QEMU reference for free page reporting's
//! overhead through the same [`Guest::boot_qemu`] and [`check_config`].

use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use harness::{target_dir, Artifacts, Board, HarnessError, QemuOptions, Session};
use serde::Serialize;

use super::exits;
use crate::json;
use crate::linux::{build_initramfs, memtool_path, LinuxFixture, CMDLINE, READY};

const ROUNDS: usize = 3;
pub(super) const GUEST_MIB: u64 = 512;
pub(super) const VCPUS: u32 = 2;
const BALLOON_MIB: u64 = 256;
const PAGE_SIZE: u64 = 4096;
const PAGES: u64 = (BALLOON_MIB << 20) / PAGE_SIZE;
/// The bundle the Tidal side boots, and the configuration it was built from
/// (checked against the constants above so the two sides stay alike).
const VM: &str = "linux";

/// Free page reporting, off or on (the demo's configuration), the same on
/// both sides: Tidal's bundle offers it or not, QEMU's device has it on or
/// off. Each round runs both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reporting {
    Off,
    On,
}

impl Reporting {
    pub(super) const BOTH: [Reporting; 2] = [Reporting::Off, Reporting::On];

    pub(super) fn name(self) -> &'static str {
        match self {
            Reporting::Off => "off",
            Reporting::On => "on",
        }
    }

    /// Tidal's bundle (target/bundles/) and the configuration it is built from.
    pub(super) fn bundle(self) -> (&'static str, &'static str) {
        match self {
            Reporting::Off => ("bench-linux.img", "guests/tests/bench-linux.toml"),
            Reporting::On => (
                "bench-linux-reporting.img",
                "guests/tests/bench-linux-reporting.toml",
            ),
        }
    }

    /// QEMU's device with the same feature (its free-page-reporting
    /// property is off by default).
    pub(super) fn qemu_device(self) -> &'static str {
        match self {
            Reporting::Off => "virtio-balloon-device",
            Reporting::On => "virtio-balloon-device,free-page-reporting=on",
        }
    }
}

const BOOT: Duration = Duration::from_secs(240);
const STEP: Duration = Duration::from_secs(120);
const COMMAND: Duration = Duration::from_secs(30);
/// Whole-session limit: QEMU is killed after this whatever happens.
const SESSION: Duration = Duration::from_secs(900);

/// Agent requests timed on the idle guest before the first move (their
/// median is the round's figure: a single request varies by a third).
const IDLE_POLLS: usize = 20;
/// Agent requests timed after them, each [`SPACING`] after the last one's
/// answer: a user's requests, which find the guest asleep.
const SPACED_POLLS: usize = 10;
const SPACING: Duration = Duration::from_millis(50);
/// Paired round trips ([`paired_round_trips`]): boots of both sides kept
/// up together, per reporting mode.
const PAIRED_BOOTS: usize = 3;
/// Bursts each side runs per paired boot, taking turns.
const PAIRED_BURSTS: usize = 6;
/// [`VMSTAT`] requests back to back in one burst.
const PAIRED_BURST: usize = 8;
/// Agent requests sent back to back under -icount, profiled together: the
/// exits and EL2 instructions one request costs.
const ICOUNT_ROUND_TRIPS: u64 = 20;
const VMSTAT: &str = "grep ^ball /proc/vmstat";
/// A request like [`VMSTAT`] (one busybox applet reading /proc/vmstat)
/// that prints the file three times, about 13 KB: the difference of the
/// two medians, per byte more printed, is what the console path costs a
/// byte the guest prints. With 3,000 bytes QEMU's own difference (about 4
/// ms) was below the spread of its round trips, and one round read less
/// than nothing.
const BULK: &str = "cat /proc/vmstat /proc/vmstat /proc/vmstat";
/// Fewer bytes more than [`VMSTAT`] prints means [`BULK`] did not run as
/// meant.
const BULK_MIN_BYTES: usize = 6000;
/// Requests of [`BULK`] timed per boot, after the idle polls (the
/// round's figure is their median).
const BULK_POLLS: usize = 10;
/// The agent's work without the console: [`VMSTAT`] run this many times by
/// one shell inside the guest (a fork and an exec of busybox each), timed
/// by the guest's clock (`time`), which under -icount counts instructions.
const WORK_LOOPS: u32 = 100;
/// [`WORK_LOOPS`] under -icount: about 2.3 s of guest time, which `time`
/// gives to 10 ms (0.4%).
const ICOUNT_WORK_LOOPS: u32 = 1000;
/// Requests between two readings of the guest's clock in
/// [`Guest::clocked_round_trips`], and how many times each span is timed
/// (its median counts: free page reporting's worker runs now and then).
const CLOCKED_TRIPS: u32 = 10;
const CLOCKED_SPANS: usize = 5;
/// The guest's monotonic clock to the ns: the `now at <ns> nsecs` line at
/// the top of /proc/timer_list (/proc/uptime has only 10 ms).
const GUEST_CLOCK: &str = "head -3 /proc/timer_list";
/// The longest line (with its `\r`) typed to the agent at once: Tidal
/// queues what its PL011's 32-byte receive FIFO cannot hold yet (4 KiB) and
/// QEMU's PL011 holds the input back while its FIFO is full, so on both
/// sides a line this long arrives whole.
const MAX_INPUT_LINE: usize = 1024;
/// The watcher, written to [`WATCHER_PATH`] in the guest at boot; run as
/// `sh /w inflate|deflate <count>`, it returns once that /proc/vmstat
/// counter reads `<count>`, polling every 10 ms.
const WATCHER: &str = "echo watching;until grep -q \"_$1 $2$\" /proc/vmstat;do usleep 10000;done;grep ^ball /proc/vmstat";
const WATCHER_PATH: &str = "/w";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Tidal,
    Qemu,
}

impl Side {
    pub(super) fn name(self) -> &'static str {
        match self {
            Side::Tidal => "Tidal",
            Side::Qemu => "QEMU",
        }
    }
}

#[derive(Clone, Copy)]
enum Direction {
    Inflate,
    Deflate,
}

impl Direction {
    fn counter(self) -> &'static str {
        match self {
            Direction::Inflate => "balloon_inflate",
            Direction::Deflate => "balloon_deflate",
        }
    }
}

/// One balloon move, as seen from the host.
#[derive(Serialize)]
struct Move {
    /// From the request until the guest's watcher saw every page moved.
    #[serde(serialize_with = "json::decimals::<4, _>")]
    guest_s: f64,
    /// Tidal: the hypervisor's reported time; QEMU: the first `info balloon`
    /// showing the target, measured from the request.
    #[serde(serialize_with = "json::decimals::<4, _>")]
    device_s: f64,
}

/// One boot of one side.
#[derive(Serialize)]
struct Run {
    #[serde(serialize_with = "json::decimals::<3, _>")]
    ready_s: f64,
    /// QEMU's user CPU time from its start to `ready`, s.
    #[serde(serialize_with = "json::decimals::<2, _>")]
    ready_user_cpu_s: f64,
    /// QEMU's kernel CPU time from its start to `ready`, s.
    #[serde(serialize_with = "json::decimals::<2, _>")]
    ready_sys_cpu_s: f64,
    /// Median agent round trip of the vmstat polls before the first move.
    #[serde(rename = "agent_idle_s", serialize_with = "json::decimals::<4, _>")]
    idle_poll_s: f64,
    /// QEMU's CPU time (all threads, user and kernel) per vmstat poll, s.
    #[serde(rename = "agent_idle_cpu_s", serialize_with = "json::decimals::<4, _>")]
    idle_poll_cpu_s: f64,
    /// Median round trip of the polls sent [`SPACING`] apart.
    #[serde(rename = "agent_spaced_s", serialize_with = "json::decimals::<4, _>")]
    spaced_poll_s: f64,
    /// [`WORK_LOOPS`] polls inside the guest, by the guest's clock.
    #[serde(rename = "agent_work_s", serialize_with = "json::decimals::<3, _>")]
    work_s: f64,
    /// What one byte the guest prints costs the round trip
    /// ([`Guest::console_cost`]), in µs.
    #[serde(
        rename = "console_us_per_byte",
        serialize_with = "json::decimals::<2, _>"
    )]
    console_us_per_byte: f64,
    inflate: Move,
    deflate: Move,
    /// Tidal: the VM's exits by kind over the boot and 10 s idle.
    #[serde(rename = "exit_profile", skip_serializing_if = "Option::is_none")]
    exits: Option<exits::Profiles>,
}

/// QEMU's human monitor on a unix socket (plain QEMU side only).
struct Monitor {
    stream: UnixStream,
    path: PathBuf,
}

impl Monitor {
    fn connect(path: &Path, timeout: Duration) -> Result<Monitor, String> {
        let until = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= until => {
                    return Err(format!("QEMU monitor {}: {e}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(COMMAND))
            .map_err(|e| format!("QEMU monitor: {e}"))?;
        let mut monitor = Monitor {
            stream,
            path: path.to_path_buf(),
        };
        read_reply(&mut monitor.stream)?;
        Ok(monitor)
    }

    fn command(&mut self, command: &str) -> Result<String, String> {
        hmp(&mut self.stream, command)
    }
}

/// Runs `command` on QEMU's human monitor; its output without the echo and
/// terminal escapes.
fn hmp(stream: &mut UnixStream, command: &str) -> Result<String, String> {
    stream
        .write_all(format!("{command}\n").as_bytes())
        .map_err(|e| format!("QEMU monitor `{command}`: {e}"))?;
    let reply = read_reply(stream)?;
    Ok(reply.lines().skip(1).collect::<Vec<_>>().join("\n"))
}

/// Reads up to the monitor's next `(qemu) ` prompt (bounded by the
/// stream's read timeout).
fn read_reply(stream: &mut UnixStream) -> Result<String, String> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    while !data.ends_with(b"(qemu) ") {
        match stream.read(&mut buf) {
            Ok(0) => return Err("QEMU monitor closed".into()),
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == IoErrorKind::Interrupted => {}
            Err(e) => return Err(format!("QEMU monitor: {e}")),
        }
    }
    let text = strip_escapes(&String::from_utf8_lossy(&data)).replace('\r', "");
    Ok(text.trim_end_matches("(qemu) ").to_string())
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `text` without ANSI CSI sequences (HMP's line editor echoes with them).
fn strip_escapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// QEMU's options for the Tidal side of the Linux benches: virt (GICv2)
/// with `bundle`, sized to what the bundle uses: the guest's [`VCPUS`] on
/// CPUs 0 and 1 (`cpus = [0, 1]` in its configuration), CPU 0 shared with
/// the shell. Under TCG every broadcast TLB invalidation a guest issues
/// wakes the host thread of every emulated CPU, halted or not, to run the
/// flush: in a fork-exec loop an unused CPU's thread was woken about 2,500
/// times a second, which on a 2-core host preempts the guest's own vCPU
/// threads (a CPU for the shell alone cost the agent's round trip about
/// 1.5 ms in 25). On a board an idle core costs nothing, so the bench's
/// board has no CPU the configuration leaves unused, as QEMU's side has
/// none.
pub(super) fn tidal_board(artifacts: &Artifacts, bundle: &str) -> QemuOptions {
    let mut opts = QemuOptions::for_board(Board::VirtGicv2, artifacts);
    opts.initrd = Some(target_dir().join("bundles").join(bundle));
    opts.smp = Some(VCPUS);
    opts
}

/// A booted Linux guest on one side, with its agent listening.
pub(super) struct Guest {
    side: Side,
    session: Session,
    monitor: Option<Monitor>,
    next_id: u32,
    /// QEMU's process, for its CPU time.
    pub(super) qemu_pid: u32,
    /// QEMU's user and kernel CPU time (s) when `ready` arrived
    /// ([`Guest::wait_ready`]).
    ready_cpu_s: (f64, f64),
}

pub(super) fn harness(e: HarnessError) -> String {
    e.to_string()
}

impl Guest {
    /// Tidal with the Linux bundle; `name`: the session's (its log's).
    /// `icount`: under `-icount shift=0`, where QEMU's PMU counts the
    /// hypervisor's instructions (for the exit profile only).
    fn boot_tidal(
        artifacts: &Artifacts,
        name: &str,
        reporting: Reporting,
        icount: bool,
    ) -> Result<Guest, String> {
        let board = Board::VirtGicv2;
        let mut opts = tidal_board(artifacts, reporting.bundle().0);
        // A name no other QEMU on the machine has, to find this one's pid.
        let process = process_name(name);
        opts.extra = vec!["-name".into(), process.clone()];
        if icount {
            opts.extra.extend(["-icount".into(), "shift=0".into()]);
        }
        let session = Session::start(name, board, artifacts, &opts).map_err(harness)?;
        session.set_deadline(SESSION);
        Ok(Guest {
            side: Side::Tidal,
            session,
            monitor: None,
            next_id: 1,
            qemu_pid: find_qemu(&process)?,
            ready_cpu_s: (0.0, 0.0),
        })
    }

    /// The same kernel and initramfs directly under QEMU, with QEMU's own
    /// balloon and `mib` MiB of RAM ([`GUEST_MIB`] but for `bench
    /// snapshot`'s larger guest); `name`: the session's (its log's), and in
    /// [`process_name`] QEMU's `-name`.
    pub(super) fn boot_qemu(
        kernel: &Path,
        initramfs: &Path,
        elf: &Path,
        name: &str,
        reporting: Reporting,
        icount: bool,
        mib: u64,
    ) -> Result<Guest, String> {
        let process = process_name(name);
        let socket = std::env::temp_dir().join(format!("{process}.mon"));
        let _ = std::fs::remove_file(&socket);
        let mut cmd = Command::new(harness::QEMU);
        // No kaslr-seed or rng-seed in the device tree, as under Tidal:
        // with a seed Linux turns KASLR on and, on a CPU without E0PD, KPTI
        // with it, which halves the page-fault rate under TCG.
        cmd.args(["-M", "virt,gic-version=2,dtb-randomness=off"])
            .args(["-cpu", "cortex-a72"])
            .args(["-smp", &VCPUS.to_string(), "-m", &format!("{mib}M")])
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", CMDLINE])
            // Default features but reporting as asked: like Tidal's device
            // it offers no deflate-on-oom or free page hinting (QEMU always
            // adds the stats queue, which stays idle unless polled).
            .args(["-device", reporting.qemu_device()])
            .arg("-monitor")
            .arg(format!("unix:{},server=on,wait=off", socket.display()))
            .args(["-serial", "stdio", "-display", "none", "-no-reboot"])
            // No default NIC: its ROM needs ipxe-qemu, which setup does not install.
            .args(["-nic", "none"])
            .args(["-name", &process]);
        if icount {
            cmd.args(["-icount", "shift=0"]);
        }
        let session = Session::start_command(name, cmd, elf).map_err(harness)?;
        session.set_deadline(SESSION);
        let monitor = Monitor::connect(&socket, COMMAND)?;
        Ok(Guest {
            side: Side::Qemu,
            session,
            monitor: Some(monitor),
            next_id: 1,
            qemu_pid: find_qemu(&process)?,
            ready_cpu_s: (0.0, 0.0),
        })
    }

    /// Runs `command` on QEMU's human monitor (the QEMU side only): its
    /// output.
    pub(super) fn monitor(&mut self, command: &str) -> Result<String, String> {
        self.monitor
            .as_mut()
            .ok_or_else(|| format!("{}: no QEMU monitor", self.side.name()))?
            .command(command)
    }

    /// How the guest's console lines start on this side's console.
    fn prefix(&self) -> &'static str {
        match self.side {
            Side::Tidal => r"\[linux\] ",
            Side::Qemu => "",
        }
    }

    /// Waits for `tidal-guest: ready` and then for the agent; returns the
    /// time from QEMU's start to `ready`.
    pub(super) fn wait_ready(&mut self) -> Result<Duration, String> {
        let prefix = self.prefix();
        // `\s`: the match ends inside the line end, so it is taken at once.
        self.session
            .expect(&format!(r"{prefix}{READY}\s"), BOOT)
            .map_err(harness)?;
        let ready = self.session.matched_at().expect("just matched") - self.session.started();
        self.ready_cpu_s = qemu_user_sys_s(self.qemu_pid)?;
        // Input typed before the agent opens the console is dropped.
        self.session
            .expect(&format!(r"{prefix}tidal-guest: agent listening\s"), BOOT)
            .map_err(harness)?;
        Ok(ready)
    }

    /// Tidal: hands the keyboard to the guest's console.
    fn enter_console(&mut self) -> Result<(), String> {
        if self.side == Side::Tidal {
            self.session
                .send_line(&format!("console {VM}"))
                .map_err(harness)?;
            self.session
                .expect(&format!(r"Connected to {VM}'s console"), COMMAND)
                .map_err(harness)?;
        }
        Ok(())
    }

    /// Tidal: Ctrl-] back to the shell.
    fn leave_console(&mut self) -> Result<(), String> {
        if self.side == Side::Tidal {
            self.session.send(&[0x1d]).map_err(harness)?;
            self.session
                .expect(r"\[back to the shell\]\r?\n", COMMAND)
                .map_err(harness)?;
        }
        Ok(())
    }

    /// Sends `command` to the agent (the console must be the guest's) and
    /// waits for the tty's echo of it; returns the request's id and when it
    /// was sent.
    fn send_request(&mut self, command: &str) -> Result<(u32, Instant), String> {
        let id = self.next_id;
        self.next_id += 1;
        let request = crate::linux::agent_request(id, command)?;
        let request = request.trim_end();
        if request.len() + 1 > MAX_INPUT_LINE {
            return Err(format!(
                "agent request {request:?} is longer than {MAX_INPUT_LINE} bytes"
            ));
        }
        let sent = Instant::now();
        self.session.send_line(request).map_err(harness)?;
        let echo = format!(r"{}run {id} [^\n]*\n", self.prefix());
        // STEP: under Tidal the echo of a long line can take seconds.
        self.session.expect(&echo, STEP).map_err(harness)?;
        Ok((id, sent))
    }

    /// Waits for request `id`'s `done` line: the output lines before it
    /// (the prefix taken off), and when the line arrived.
    fn await_done(&mut self, id: u32, timeout: Duration) -> Result<(Vec<String>, Instant), String> {
        let prefix = self.prefix();
        let done = format!(r"(?s)(.*?){prefix}tidal-guest: done {id} rc=(-?\d+)\s");
        let c = self.session.expect(&done, timeout).map_err(harness)?;
        let arrived = self.session.matched_at().expect("just matched");
        if c[2] != "0" {
            return Err(format!(
                "{}: agent request {id} failed (rc={}):\n{}",
                self.side.name(),
                c[2],
                c[1]
            ));
        }
        let plain = prefix.replace('\\', "");
        let lines = c[1]
            .lines()
            .map(|l| l.trim_end_matches('\r'))
            .map(|l| l.strip_prefix(plain.as_str()).unwrap_or(l).to_string())
            .collect();
        Ok((lines, arrived))
    }

    /// Runs `command` through the agent (the console must be the guest's):
    /// its output lines, and when the request was sent and the `done` line
    /// arrived.
    pub(super) fn agent(
        &mut self,
        command: &str,
    ) -> Result<(Vec<String>, Instant, Instant), String> {
        let (id, sent) = self.send_request(command)?;
        let (lines, arrived) = self.await_done(id, STEP)?;
        Ok((lines, sent, arrived))
    }

    /// The guest's balloon counters, from the agent's vmstat answer, and
    /// when the answer arrived and how long it took.
    fn vmstat(&mut self) -> Result<(Counters, Instant, Duration), String> {
        let (lines, sent, arrived) = self.agent(VMSTAT)?;
        Ok((
            parse_counters(self.side.name(), &lines)?,
            arrived,
            arrived - sent,
        ))
    }

    /// `loops` agent polls run by one shell in the guest: the
    /// guest's `time` of them, in s. The shell has the keyboard before and
    /// after.
    fn work_loop(&mut self, loops: u32) -> Result<f64, String> {
        self.enter_console()?;
        let (lines, _, _) = self.agent(&work_command(loops))?;
        self.leave_console()?;
        busybox_real_s(&lines)
            .ok_or_else(|| format!("{}: no `real` time in {lines:?}", self.side.name()))
    }

    /// What a byte the guest prints costs the round trip, in µs: the median
    /// of [`BULK_POLLS`] requests of [`BULK`] less `idle_s` (the
    /// median [`VMSTAT`] round trip), over the difference of the bytes
    /// the guest printed (each line and its CR LF). The shell has the
    /// keyboard before and after.
    fn console_cost(&mut self, idle_s: f64, idle_lines: &[String]) -> Result<f64, String> {
        self.enter_console()?;
        let mut took = Vec::new();
        let mut bulk = 0;
        for _ in 0..BULK_POLLS {
            let (lines, sent, arrived) = self.agent(BULK)?;
            took.push((arrived - sent).as_secs_f64());
            bulk = printed_bytes(&lines);
        }
        self.leave_console()?;
        let extra = bulk.saturating_sub(printed_bytes(idle_lines));
        if extra < BULK_MIN_BYTES {
            return Err(format!(
                "{}: `{}` printed {bulk} bytes, {extra} more than `{VMSTAT}`",
                self.side.name(),
                BULK
            ));
        }
        Ok(1e6 * (median(&took) - idle_s) / extra as f64)
    }

    /// `count` requests of `command` typed at once between two readings of
    /// the guest's clock ([`GUEST_CLOCK`]), typed with them: the ns between
    /// the readings, and the bytes the guest printed in all (echoes and
    /// line ends included). Typed at once, the requests wait in the guest's
    /// tty for the agent, so no wait for the host falls between the
    /// readings (under -icount such a wait would count as real time). The
    /// echoes of later requests may fall between the lines of earlier
    /// answers, so only the markers are looked for. The console must be
    /// the guest's.
    fn clock_span(&mut self, command: &str, count: u32) -> Result<(u64, usize), String> {
        let first = self.next_id;
        let last = first + count + 1;
        let mut typed = String::new();
        for id in first..=last {
            let request = if id == first || id == last {
                GUEST_CLOCK
            } else {
                command
            };
            typed.push_str(crate::linux::agent_request(id, request)?.trim_end());
            typed.push('\r');
        }
        self.next_id = last + 1;
        self.session.send(typed.as_bytes()).map_err(harness)?;
        let c = self
            .session
            .expect(
                &format!(r"(?s)(.*?tidal-guest: done {last} rc=-?\d+)\D"),
                STEP * (count + 2),
            )
            .map_err(harness)?;
        let prefix = self.prefix().replace('\\', "");
        span_of_typed_requests(&c[1], first..=last, &prefix)
            .map_err(|e| format!("{}: {e}", self.side.name()))
    }

    /// The agent's round trip and a byte printed, by the guest's clock
    /// (under -icount: instructions, the hypervisor's included): spans of
    /// [`CLOCKED_TRIPS`] [`VMSTAT`] requests and of as many of [`BULK`],
    /// [`CLOCKED_SPANS`] of each, taking turns ([`Guest::clock_span`],
    /// [`ClockSpans`]). The shell has the keyboard before and after.
    fn clocked_round_trips(&mut self) -> Result<ClockedTrips, String> {
        self.enter_console()?;
        let mut spans = ClockSpans {
            count: CLOCKED_TRIPS,
            vmstat: Vec::new(),
            bulk: Vec::new(),
            extra_bytes: 0,
        };
        let (mut vmstat_bytes, mut bulk_bytes) = (0, 0);
        for _ in 0..CLOCKED_SPANS {
            let (ns, bytes) = self.clock_span(VMSTAT, CLOCKED_TRIPS)?;
            spans.vmstat.push(ns);
            vmstat_bytes += bytes;
            let (ns, bytes) = self.clock_span(BULK, CLOCKED_TRIPS)?;
            spans.bulk.push(ns);
            bulk_bytes += bytes;
        }
        self.leave_console()?;
        let requests = CLOCKED_SPANS * CLOCKED_TRIPS as usize;
        spans.extra_bytes = bulk_bytes.saturating_sub(vmstat_bytes) / requests;
        if spans.extra_bytes < BULK_MIN_BYTES {
            return Err(format!(
                "{}: `{BULK}` printed {} bytes more than `{VMSTAT}`",
                self.side.name(),
                spans.extra_bytes
            ));
        }
        spans
            .trips()
            .map_err(|e| format!("{}: {e}", self.side.name()))
    }

    /// `count` agent requests ([`VMSTAT`]) back to back; the shell has the
    /// keyboard before and after.
    fn round_trips(&mut self, count: u64) -> Result<(), String> {
        self.enter_console()?;
        for _ in 0..count {
            self.vmstat()?;
        }
        self.leave_console()
    }

    /// Writes `content` to `path` in the guest through the agent, in pieces
    /// short enough for [`MAX_INPUT_LINE`], and checks it (console: guest's).
    fn write_file(&mut self, path: &str, content: &str) -> Result<(), String> {
        if content.contains(['\'', '\n', '\r']) {
            return Err(format!("cannot type {content:?}"));
        }
        let mut rest = content;
        let mut redirect = ">";
        while !rest.is_empty() {
            let overhead = format!("run {} echo -n ''>>{path}\r", self.next_id).len();
            let room = MAX_INPUT_LINE.saturating_sub(overhead).max(1);
            let (piece, tail) = rest.split_at(room.min(rest.len()));
            self.agent(&format!("echo -n '{piece}'{redirect}{path}"))?;
            redirect = ">>";
            rest = tail;
        }
        let (lines, _, _) = self.agent(&format!("cat {path}"))?;
        if lines.concat() != content {
            return Err(format!(
                "{}: {path} in the guest reads {lines:?}, not {content:?}",
                self.side.name()
            ));
        }
        Ok(())
    }

    /// Sets the balloon to `balloon_mib` (0: empty); returns when the
    /// request was sent. Tidal: from the shell, left there.
    fn request(&mut self, balloon_mib: u64) -> Result<Instant, String> {
        match self.side {
            Side::Tidal => {
                let sent = Instant::now();
                // `run`, not an `expect` of the next prompt: lines the guest
                // prints meanwhile erase the prompt and draw it again below
                // them, and the next prompt left standing may come after the
                // watcher's `done` line, which must not be passed over.
                let command = format!("balloon {VM} {balloon_mib}M");
                let reply = self.session.run(&command, COMMAND).map_err(harness)?;
                let pages = (balloon_mib << 20) / PAGE_SIZE;
                if !reply.contains(&format!("{VM}: balloon target {pages} pages")) {
                    return Err(format!("Tidal: `{command}`: {}", reply.trim()));
                }
                Ok(sent)
            }
            Side::Qemu => {
                let monitor = self.monitor.as_mut().expect("QEMU side has a monitor");
                let sent = Instant::now();
                let out = monitor.command(&format!("balloon {}", GUEST_MIB - balloon_mib))?;
                if !out.trim().is_empty() {
                    return Err(format!("QEMU monitor `balloon`: {out}"));
                }
                Ok(sent)
            }
        }
    }

    /// Moves the balloon to `balloon_mib` and measures it; `before` is the
    /// guest's counters before, returned updated.
    ///
    /// A watcher in the guest, started through the agent before the
    /// request, polls /proc/vmstat until the counter has grown by every page
    /// and then ends its request: the time is from sending the request to the
    /// arrival of that `done` line. (Polling through the agent from here
    /// would add a console round trip per poll, which under Tidal is
    /// seconds; see the `agent round trip` row.)
    fn balloon(
        &mut self,
        direction: Direction,
        balloon_mib: u64,
        before: Counters,
    ) -> Result<(Move, Counters), String> {
        let side = self.side.name();
        let counter = direction.counter();
        let target = before.get(direction) + PAGES;
        let word = counter.trim_start_matches("balloon_");
        self.enter_console()?;
        let (id, _) = self.send_request(&format!("sh {WATCHER_PATH} {word} {target}"))?;
        let watching = format!(r"(?m)^{}watching\r?$", self.prefix());
        self.session.expect(&watching, STEP).map_err(harness)?;
        self.leave_console()?;

        let sent = self.request(balloon_mib)?;
        let stop = AtomicBool::new(false);
        let (done, device_s) = std::thread::scope(|scope| {
            // QEMU's view of the move: `info balloon` polled meanwhile.
            let poller = self
                .monitor
                .as_ref()
                .map(|m| m.stream.try_clone())
                .transpose()
                .map_err(|e| format!("QEMU monitor: {e}"))?
                .map(|stream| {
                    let stop = &stop;
                    let actual = format!("actual={}", GUEST_MIB - balloon_mib);
                    scope.spawn(move || watch_actual(stream, &actual, sent, stop))
                });
            let done = self.await_done(id, STEP);
            stop.store(true, Ordering::Relaxed);
            let device_s = match poller {
                Some(p) => p
                    .join()
                    .map_err(|_| "info balloon poller panicked".to_string())??,
                None => None,
            };
            Ok::<_, String>((done?, device_s))
        })?;
        let (lines, arrived) = done;
        let now = parse_counters(side, &lines)?;
        let moved = now.get(direction).saturating_sub(before.get(direction));
        if moved != PAGES {
            return Err(format!(
                "{side}: {counter} grew by {moved} pages, not {PAGES}"
            ));
        }
        let device_s = match self.side {
            Side::Tidal => self.reported_move(direction)?,
            Side::Qemu => device_s.ok_or_else(|| {
                format!("{side}: `info balloon` never showed the target during the move")
            })?,
        };
        Ok((
            Move {
                guest_s: (arrived - sent).as_secs_f64(),
                device_s,
            },
            now,
        ))
    }

    /// Tidal: the hypervisor's `balloon: reached` report of this move, in s.
    fn reported_move(&mut self, direction: Direction) -> Result<f64, String> {
        let (to, verb) = match direction {
            Direction::Inflate => (PAGES, "inflated"),
            Direction::Deflate => (0, "deflated"),
        };
        let line = format!("tidal: [{VM}] balloon: reached {to} pages: {PAGES} pages {verb} in ");
        // It may have come before the watcher's `done` line, already matched.
        let output = self.session.output();
        let micros = match output.find(&line) {
            Some(at) => output[at + line.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect(),
            None => {
                let pattern = format!(
                    r"tidal: \[{VM}\] balloon: reached {to} pages: {PAGES} pages {verb} in (\d+) us"
                );
                self.session.expect(&pattern, STEP).map_err(harness)?[1].clone()
            }
        };
        micros
            .parse::<u64>()
            .map(|us| us as f64 / 1e6)
            .map_err(|e| format!("bad time '{micros}': {e}"))
    }
}

impl Guest {
    /// Before the moves: [`IDLE_POLLS`] agent round trips reading the
    /// balloon counters (the last reading and every round trip returned),
    /// and the watcher script written; the shell has the keyboard again.
    fn prepare_moves(&mut self) -> Result<(Counters, IdlePolls), String> {
        self.enter_console()?;
        let mut round_trips = Vec::new();
        let mut start = None;
        let mut lines = Vec::new();
        let cpu_before = qemu_cpu_ns(self.qemu_pid)?;
        for _ in 0..IDLE_POLLS {
            let (output, sent, arrived) = self.agent(VMSTAT)?;
            start = Some(parse_counters(self.side.name(), &output)?);
            round_trips.push((arrived - sent).as_secs_f64());
            lines = output;
        }
        let cpu_ns = qemu_cpu_ns(self.qemu_pid)?.saturating_sub(cpu_before);
        let cpu_s_each = cpu_ns as f64 / 1e9 / IDLE_POLLS as f64;
        let mut spaced = Vec::new();
        for _ in 0..SPACED_POLLS {
            std::thread::sleep(SPACING);
            let (_, sent, arrived) = self.agent(VMSTAT)?;
            spaced.push((arrived - sent).as_secs_f64());
        }
        let start = start.expect("IDLE_POLLS > 0");
        self.write_file(WATCHER_PATH, WATCHER)?;
        self.leave_console()?;
        Ok((
            start,
            IdlePolls {
                round_trips,
                cpu_s_each,
                spaced,
                lines,
            },
        ))
    }

    /// Tidal: [`Guest::balloon`] with the VM's exit profile started over
    /// before the request and read once the move is done.
    fn profiled_move(
        &mut self,
        direction: Direction,
        balloon_mib: u64,
        before: Counters,
    ) -> Result<(exits::Profile, Counters), String> {
        let ((_, after), profile) = self.profiled(|g| g.balloon(direction, balloon_mib, before))?;
        Ok((profile, after))
    }

    /// Tidal: what `work` returns, and the VM's exit profile over it
    /// (started over before, read after; the shell has the keyboard).
    fn profiled<T>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<T, String>,
    ) -> Result<(T, exits::Profile), String> {
        let reset = self
            .session
            .run(&format!("info exits {VM} reset"), COMMAND)
            .map_err(harness)?;
        if !reset.contains("exit profile started over") {
            return Err(format!("`info exits {VM} reset` answered: {reset}"));
        }
        let value = work(self)?;
        let text = self
            .session
            .run(&format!("info exits {VM}"), COMMAND)
            .map_err(harness)?;
        Ok((value, exits::parse(&text)?))
    }
}

/// The balloon counters in /proc/vmstat lines.
fn parse_counters(side: &str, lines: &[String]) -> Result<Counters, String> {
    let value = |key: &str| {
        lines
            .iter()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
            .ok_or_else(|| format!("{side}: no {key} in {lines:?}"))
    };
    Ok(Counters {
        inflate: value("balloon_inflate")?,
        deflate: value("balloon_deflate")?,
    })
}

/// Polls QEMU's `info balloon` until it shows `actual` (e.g. `actual=256`)
/// or `stop` is set: the time from `sent` when it first did.
fn watch_actual(
    mut stream: UnixStream,
    actual: &str,
    sent: Instant,
    stop: &AtomicBool,
) -> Result<Option<f64>, String> {
    while !stop.load(Ordering::Relaxed) && sent.elapsed() < STEP {
        if hmp(&mut stream, "info balloon")?.contains(actual) {
            return Ok(Some(sent.elapsed().as_secs_f64()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(None)
}

/// The pid of the QEMU started with `-name <name>`, waiting up to
/// [`COMMAND`] for it: until the spawned child has exec'd QEMU, its command
/// line is still the parent's.
pub(super) fn find_qemu(name: &str) -> Result<u32, String> {
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
pub(super) fn qemu_cpu_ns(pid: u32) -> Result<u64, String> {
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

/// User and kernel CPU time of all of process `pid`'s threads so far, in
/// s.
fn qemu_user_sys_s(pid: u32) -> Result<(f64, f64), String> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    user_sys_s(&stat).ok_or_else(|| format!("{path}: bad stat {stat:?}"))
}

/// utime and stime of a `/proc/<pid>/stat` line, in s (the proc(5) ABI's
/// clock ticks, 100 a second). The command name before them is in
/// parentheses and may hold spaces and parentheses: the fields are counted
/// from the last `)`, state first, utime 12th and stime 13th.
fn user_sys_s(stat: &str) -> Option<(f64, f64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut ticks = || fields.next()?.parse::<u64>().ok();
    let (user, sys) = (ticks()?, ticks()?);
    Some((user as f64 / 100.0, sys as f64 / 100.0))
}

/// The idle guest's agent requests ([`Guest::prepare_moves`]).
struct IdlePolls {
    /// Each request's round trip, s.
    round_trips: Vec<f64>,
    /// QEMU's CPU time over the requests, per request, s.
    cpu_s_each: f64,
    /// Each spaced request's round trip, s.
    spaced: Vec<f64>,
    /// The last one's output.
    lines: Vec<String>,
}

#[derive(Clone, Copy)]
struct Counters {
    inflate: u64,
    deflate: u64,
}

impl Counters {
    fn get(self, direction: Direction) -> u64 {
        match direction {
            Direction::Inflate => self.inflate,
            Direction::Deflate => self.deflate,
        }
    }
}

/// Boots one side, inflates and deflates once, and stops it. Tidal: the
/// exit profiles of the boot and of the idle guest first.
fn run_once(mut guest: Guest) -> Result<Run, String> {
    let ready = guest.wait_ready()?;
    let (ready_user_cpu_s, ready_sys_cpu_s) = guest.ready_cpu_s;
    let exits = match guest.side {
        Side::Tidal => Some(exits::capture(&mut guest.session, VM, COMMAND)?),
        Side::Qemu => None,
    };
    let (start, idle) = guest.prepare_moves()?;
    let idle_poll_s = median(&idle.round_trips);
    let work_s = guest.work_loop(WORK_LOOPS)?;
    let console_us_per_byte = guest.console_cost(idle_poll_s, &idle.lines)?;
    let (inflate, after) = guest.balloon(Direction::Inflate, BALLOON_MIB, start)?;
    let (deflate, _) = guest.balloon(Direction::Deflate, 0, after)?;
    // Dropping the session kills QEMU: nothing in the guest needs saving.
    Ok(Run {
        ready_s: ready.as_secs_f64(),
        ready_user_cpu_s,
        ready_sys_cpu_s,
        idle_poll_s,
        idle_poll_cpu_s: idle.cpu_s_each,
        spaced_poll_s: median(&idle.spaced),
        work_s,
        console_us_per_byte,
        inflate,
        deflate,
        exits,
    })
}

/// The agent's round trip on paired live guests: both sides booted and
/// kept up together, taking turns at bursts of [`PAIRED_BURST`] requests
/// back to back, so that each Tidal burst and the QEMU burst beside it
/// meet the host in the same second. Boots in sequence (the rounds) let
/// the host's drift in: on a shared 2-core host QEMU's own per-boot
/// median moved from 24 to 39 ms within one run. An idle side costs the
/// host about 1% of a core.
#[derive(Serialize)]
struct Paired {
    boots: usize,
    bursts_per_boot: usize,
    requests_per_burst: usize,
    /// The medians of the bursts, ms.
    tidal_ms: Spread,
    qemu_ms: Spread,
    /// Each Tidal burst's median over the QEMU burst's beside it.
    ratio: Spread,
}

/// [`Paired`] for one reporting mode.
fn paired_round_trips(
    reporting: Reporting,
    artifacts: &Artifacts,
    fixture: &LinuxFixture,
) -> Result<Paired, String> {
    let mut tidal_ms = Vec::new();
    let mut qemu_ms = Vec::new();
    for boot_no in 1..=PAIRED_BOOTS {
        let name = format!("paired-{}-{boot_no}", reporting.name());
        let mut tidal = boot(Side::Tidal, reporting, &name, artifacts, fixture)?;
        tidal.wait_ready()?;
        let mut qemu = boot(Side::Qemu, reporting, &name, artifacts, fixture)?;
        qemu.wait_ready()?;
        tidal.enter_console()?;
        for burst in 0..PAIRED_BURSTS {
            // Who goes first alternates, so neither side always follows
            // the other.
            let first_tidal = burst % 2 == 0;
            for tidal_turn in [first_tidal, !first_tidal] {
                let (guest, out) = if tidal_turn {
                    (&mut tidal, &mut tidal_ms)
                } else {
                    (&mut qemu, &mut qemu_ms)
                };
                let mut took = Vec::new();
                for _ in 0..PAIRED_BURST {
                    took.push(guest.vmstat()?.2.as_secs_f64() * 1000.0);
                }
                out.push(median(&took));
            }
        }
        // Dropping the sessions kills both QEMUs.
    }
    Ok(Paired {
        boots: PAIRED_BOOTS,
        bursts_per_boot: PAIRED_BURSTS,
        requests_per_burst: PAIRED_BURST,
        ratio: spread(&burst_ratios(&tidal_ms, &qemu_ms)),
        tidal_ms: spread(&tidal_ms),
        qemu_ms: spread(&qemu_ms),
    })
}

/// Each Tidal burst's median over the QEMU burst's run beside it.
fn burst_ratios(tidal_ms: &[f64], qemu_ms: &[f64]) -> Vec<f64> {
    tidal_ms.iter().zip(qemu_ms).map(|(t, q)| t / q).collect()
}

/// QEMU's `-name` (and the monitor socket's name) for the session `name`:
/// no other QEMU on the machine has it, so its pid can be found in /proc.
pub(super) fn process_name(name: &str) -> String {
    format!("tidal-bench-{}-{name}", std::process::id())
}

/// The median of `values` (the mean of the middle two for an even count).
pub(super) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Median, min and max.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Spread {
    #[serde(serialize_with = "json::decimals::<4, _>")]
    pub(super) median: f64,
    #[serde(serialize_with = "json::decimals::<4, _>")]
    pub(super) min: f64,
    #[serde(serialize_with = "json::decimals::<4, _>")]
    pub(super) max: f64,
}

pub(super) fn spread(values: &[f64]) -> Spread {
    Spread {
        median: median(values),
        min: values.iter().copied().fold(f64::INFINITY, f64::min),
        max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }
}

/// The Tidal bundle must hold the guest the QEMU side runs: same RAM
/// (`mib`), vCPU count, command line and fixture files, on the CPUs
/// [`tidal_board`] gives it.
pub(super) fn check_config(
    root: &Path,
    config: &str,
    kernel: &Path,
    initramfs: &Path,
    mib: u64,
) -> Result<(), String> {
    let path = root.join(config);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let vm = table
        .get("vm")
        .and_then(|v| v.as_array())
        .and_then(|vms| vms.first())
        .ok_or_else(|| format!("{}: no [[vm]]", path.display()))?;
    let field = |key: &str| match vm.get(key) {
        Some(toml::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    let ram =
        vmconfig::parse_size(&field("ram")).map_err(|e| format!("{}: ram: {e}", path.display()))?;
    if ram != mib << 20 {
        return Err(format!(
            "{}: ram = {} but the QEMU side runs {mib}M",
            path.display(),
            field("ram")
        ));
    }
    let expected = [
        ("name", VM.to_string()),
        ("vcpus", VCPUS.to_string()),
        ("cpus", format!("{:?}", (0..VCPUS).collect::<Vec<_>>())),
        ("cmdline", CMDLINE.to_string()),
    ];
    for (key, want) in expected {
        if field(key) != want {
            return Err(format!(
                "{}: {key} = {} but the QEMU side runs {want}",
                path.display(),
                field(key)
            ));
        }
    }
    for (key, file) in [("kernel", kernel), ("initrd", initramfs)] {
        let named = vm.get(key).and_then(|v| v.as_str()).unwrap_or_default();
        if root.join(named) != file {
            return Err(format!(
                "{}: {key} = {named:?}, not {}",
                path.display(),
                file.display()
            ));
        }
    }
    Ok(())
}

/// Boot `side` for the rounds (no -icount); `name` ends its session's name
/// (`bench-linux-tidal-<name>`, `bench-linux-qemu-<name>`).
fn boot(
    side: Side,
    reporting: Reporting,
    name: &str,
    artifacts: &Artifacts,
    fixture: &LinuxFixture,
) -> Result<Guest, String> {
    match side {
        Side::Tidal => Guest::boot_tidal(
            artifacts,
            &format!("bench-linux-tidal-{name}"),
            reporting,
            false,
        ),
        Side::Qemu => Guest::boot_qemu(
            &fixture.kernel,
            &fixture.initramfs,
            &artifacts.elf,
            &format!("bench-linux-qemu-{name}"),
            reporting,
            false,
            GUEST_MIB,
        ),
    }
}

pub fn run(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    let fixture = build_initramfs(root, &memtool_path(root))?;
    for reporting in Reporting::BOTH {
        check_config(
            root,
            reporting.bundle().1,
            &fixture.kernel,
            &fixture.initramfs,
            GUEST_MIB,
        )?;
    }
    // One boot of each side first, not measured: the first QEMU after an
    // idle host booted 1.3-2.2 s slower in 6 of 6 runs, whichever side it
    // was (in host kernel time, faulting in memory the host had given
    // back), and round 1 starts with Tidal.
    for side in [Side::Tidal, Side::Qemu] {
        eprintln!("bench: Linux warm-up: {}, not measured ...", side.name());
        let mut guest = boot(side, Reporting::Off, "warm-up", artifacts, &fixture)?;
        guest
            .wait_ready()
            .map_err(|e| format!("Linux balloon bench, warm-up boot, {}: {e}", side.name()))?;
    }
    let mut runs: Vec<(Reporting, Side, usize, Run)> = Vec::new();
    for round in 1..=ROUNDS {
        for reporting in Reporting::BOTH {
            for side in [Side::Tidal, Side::Qemu] {
                let what = format!("{}, reporting {}", side.name(), reporting.name());
                eprintln!("bench: Linux round {round}/{ROUNDS}: {what} ...");
                let name = format!("reporting-{}-{round}", reporting.name());
                let guest = boot(side, reporting, &name, artifacts, &fixture)?;
                let run = run_once(guest)
                    .map_err(|e| format!("Linux balloon bench, round {round}, {what}: {e}"))?;
                eprintln!(
                    "bench: {what}: ready {:.2} s, inflate {:.2} s, deflate {:.2} s",
                    run.ready_s, run.inflate.guest_s, run.deflate.guest_s
                );
                runs.push((reporting, side, round, run));
            }
        }
    }
    let mut paired = Vec::new();
    for reporting in Reporting::BOTH {
        eprintln!(
            "bench: Linux agent round trips on paired live guests, reporting {} ...",
            reporting.name()
        );
        let p = paired_round_trips(reporting, artifacts, &fixture).map_err(|e| {
            format!(
                "Linux paired round trips, reporting {}: {e}",
                reporting.name()
            )
        })?;
        paired.push((mode_key(reporting), p));
    }
    // The rounds run without -icount: QEMU's PMU counts no instructions.
    eprintln!("bench: Linux under Tidal with -icount shift=0, for the exits' EL2 instructions ...");
    let icount =
        icount_run(artifacts, &fixture).map_err(|e| format!("Linux under -icount: {e}"))?;
    report(root, &fixture, &runs, &paired, &icount)
}

/// The JSON key of a reporting mode's figures.
fn mode_key(reporting: Reporting) -> &'static str {
    match reporting {
        Reporting::Off => "reporting_off",
        Reporting::On => "reporting_on",
    }
}

/// Tidal's exit profiles under -icount, with EL2 instructions: the boot and
/// the idle guest, then one inflate and one deflate of [`BALLOON_MIB`].
#[derive(Serialize)]
struct IcountProfiles {
    #[serde(flatten)]
    profiles: exits::Profiles,
    inflate: exits::Profile,
    deflate: exits::Profile,
    agent_work: IcountWork,
}

/// [`ICOUNT_WORK_LOOPS`] agent polls in the guest under -icount on both sides:
/// guest time there is instructions (1 ns each), the hypervisor's included.
#[derive(Serialize)]
struct IcountWork {
    #[serde(serialize_with = "json::decimals::<3, _>")]
    tidal_guest_s: f64,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    qemu_guest_s: f64,
    /// Tidal's exits over the loop, with their EL2 instructions.
    tidal_exits: exits::Profile,
    /// Requests in [`IcountWork::round_trip_exits`].
    round_trips: u64,
    /// Tidal's exits over [`ICOUNT_ROUND_TRIPS`] agent requests.
    round_trip_exits: exits::Profile,
    /// The round trip and a byte printed by the guest's clock, each side.
    tidal_clocked: ClockedTrips,
    qemu_clocked: ClockedTrips,
}

/// One boot under -icount with free page reporting on (the demo's
/// configuration): where a move's hypervisor time goes, by kind of exit.
/// Then [`ICOUNT_WORK_LOOPS`] agent polls in the guest, on this boot and on the
/// same kernel directly under QEMU with -icount.
fn icount_run(
    artifacts: &Artifacts,
    fixture: &crate::linux::LinuxFixture,
) -> Result<IcountProfiles, String> {
    let mut guest = Guest::boot_tidal(artifacts, "bench-linux-tidal-icount", Reporting::On, true)?;
    guest.wait_ready()?;
    let profiles = exits::capture(&mut guest.session, VM, COMMAND)?;
    let (start, _) = guest.prepare_moves()?;
    let (inflate, after) = guest.profiled_move(Direction::Inflate, BALLOON_MIB, start)?;
    let (deflate, _) = guest.profiled_move(Direction::Deflate, 0, after)?;
    let (tidal_guest_s, tidal_exits) = guest.profiled(|g| g.work_loop(ICOUNT_WORK_LOOPS))?;
    let ((), round_trip_exits) = guest.profiled(|g| g.round_trips(ICOUNT_ROUND_TRIPS))?;
    let tidal_clocked = guest.clocked_round_trips()?;
    drop(guest);
    eprintln!("bench: Linux directly under QEMU with -icount shift=0, for the agent's work ...");
    let mut qemu = Guest::boot_qemu(
        &fixture.kernel,
        &fixture.initramfs,
        &artifacts.elf,
        "bench-linux-qemu-icount",
        Reporting::On,
        true,
        GUEST_MIB,
    )?;
    qemu.wait_ready()?;
    let qemu_guest_s = qemu.work_loop(ICOUNT_WORK_LOOPS)?;
    let qemu_clocked = qemu.clocked_round_trips()?;
    Ok(IcountProfiles {
        profiles,
        inflate,
        deflate,
        agent_work: IcountWork {
            tidal_guest_s,
            qemu_guest_s,
            tidal_exits,
            round_trips: ICOUNT_ROUND_TRIPS,
            round_trip_exits,
            tidal_clocked,
            qemu_clocked,
        },
    })
}

/// The command [`Guest::work_loop`] sends.
fn work_command(loops: u32) -> String {
    format!("time sh -c 'i=0; while [ $i -lt {loops} ]; do {VMSTAT} >/dev/null; i=$((i+1)); done'")
}

/// Busybox `time`'s `real` line (`real\t0m 1.10s`) in seconds.
fn busybox_real_s(lines: &[String]) -> Option<f64> {
    lines.iter().find_map(|line| {
        let rest = line.trim().strip_prefix("real")?.trim();
        let (minutes, seconds) = rest.split_once('m')?;
        let seconds = seconds.trim().strip_suffix('s')?;
        Some(minutes.trim().parse::<f64>().ok()? * 60.0 + seconds.parse::<f64>().ok()?)
    })
}

/// Bytes the guest printed in `lines`: each line and its CR LF.
fn printed_bytes(lines: &[String]) -> usize {
    lines.iter().map(|l| l.len() + 2).sum()
}

/// The ns of each `now at <ns> nsecs` in `text` ([`GUEST_CLOCK`]'s
/// output), in order; an echo may stand right before or after one.
fn timer_list_now_ns(text: &str) -> Vec<u64> {
    text.split("now at ")
        .skip(1)
        .filter_map(|rest| {
            let end = rest.find(|c: char| !c.is_ascii_digit())?;
            if !rest[end..].starts_with(" nsecs") {
                return None;
            }
            rest[..end].parse().ok()
        })
        .collect()
}

/// What the guest printed for requests `ids` typed at once
/// ([`Guest::clock_span`]), the first and last reading the clock: the ns
/// between the two readings and the bytes printed (without the
/// hypervisor's `prefix` at line starts, with a CR LF a line); an error
/// unless every request is done with status 0.
fn span_of_typed_requests(
    text: &str,
    ids: std::ops::RangeInclusive<u32>,
    prefix: &str,
) -> Result<(u64, usize), String> {
    for id in ids {
        let done = format!("tidal-guest: done {id} rc=");
        let Some(at) = text.find(&done) else {
            return Err(format!(
                "no `{done}` among the answers to requests typed at once"
            ));
        };
        let rc: String = text[at + done.len()..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '-')
            .collect();
        if rc != "0" {
            return Err(format!(
                "request {id} of those typed at once ended rc={rc}:\n{text}"
            ));
        }
    }
    let clock = timer_list_now_ns(text);
    let [start, end] = clock[..] else {
        return Err(format!("the two clock readings printed {clock:?}"));
    };
    if end <= start {
        return Err(format!("the guest's clock went from {start} to {end} ns"));
    }
    let bytes = text
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .map(|l| l.strip_prefix(prefix).unwrap_or(l).len() + 2)
        .sum();
    Ok((end - start, bytes))
}

/// The guest's clock over requests ([`Guest::clocked_round_trips`]): the
/// ns from one reading to the next, around `count` [`VMSTAT`] requests
/// (`vmstat`) and around `count` of [`BULK`] (`bulk`). Between two
/// readings lie, besides the requests, the end of one reading and the
/// start of the next: about one request more (a reading is a fork and an
/// exec of busybox too), the same in both spans.
struct ClockSpans {
    count: u32,
    vmstat: Vec<u64>,
    bulk: Vec<u64>,
    /// Bytes a [`BULK`] request printed more than a [`VMSTAT`] one.
    extra_bytes: usize,
}

impl ClockSpans {
    /// A [`VMSTAT`] request (the median span over `count + 1`), and a byte
    /// of those [`BULK`] prints more (the medians' difference,
    /// in which the readings cancel); an error if a span is not what
    /// requests can take (the clock going back wraps to a huge span).
    fn trips(&self) -> Result<ClockedTrips, String> {
        let extra = self.extra_bytes;
        let ns = |spans: &[u64]| median(&spans.iter().map(|&s| s as f64).collect::<Vec<_>>());
        let (vmstat, bulk) = (ns(&self.vmstat), ns(&self.bulk));
        let sane = |spans: &[u64]| !spans.is_empty() && spans.iter().all(|&s| s > 0 && s < 1 << 50);
        if !sane(&self.vmstat) || !sane(&self.bulk) || bulk <= vmstat || extra == 0 {
            return Err(format!(
                "the guest's clock took {:?} ns over {} `{VMSTAT}` and {:?} ns over as many \
                 `{BULK}`: not the spans of requests",
                self.vmstat, self.count, self.bulk
            ));
        }
        let n = f64::from(self.count);
        let per_request_ms = |span: u64| span as f64 / (n + 1.0) / 1e6;
        let spans = self.vmstat.iter().copied();
        Ok(ClockedTrips {
            round_trip_ms: vmstat / (n + 1.0) / 1e6,
            round_trip_min_ms: spans
                .clone()
                .map(per_request_ms)
                .fold(f64::INFINITY, f64::min),
            round_trip_max_ms: spans.map(per_request_ms).fold(0.0, f64::max),
            byte_ns: (bulk - vmstat) / n / extra as f64,
        })
    }
}

/// What [`ClockSpans::trips`] finds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
struct ClockedTrips {
    /// A [`VMSTAT`] request, ms of guest time: the median span's, and
    /// the least and most of a span.
    #[serde(serialize_with = "json::decimals::<4, _>")]
    round_trip_ms: f64,
    #[serde(serialize_with = "json::decimals::<4, _>")]
    round_trip_min_ms: f64,
    #[serde(serialize_with = "json::decimals::<4, _>")]
    round_trip_max_ms: f64,
    /// A byte more printed ([`BULK`] against [`VMSTAT`]), ns of guest time.
    #[serde(serialize_with = "json::decimals::<1, _>")]
    byte_ns: f64,
}

/// A table row: label, JSON key, value, whether a ratio is meaningful, and
/// the decimals shown.
struct Metric {
    label: &'static str,
    key: &'static str,
    value: fn(&Run) -> f64,
    ratio: bool,
    decimals: usize,
}

const METRICS: [Metric; 12] = [
    Metric {
        label: "boot to `tidal-guest: ready` (s)",
        key: "ready_s",
        value: |r| r.ready_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "boot, QEMU user CPU (s) [4]",
        key: "ready_user_cpu_s",
        value: |r| r.ready_user_cpu_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "boot, QEMU kernel CPU (s) [4]",
        key: "ready_sys_cpu_s",
        value: |r| r.ready_sys_cpu_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "inflate 256 MiB, guest watcher (s)",
        key: "inflate_s",
        value: |r| r.inflate.guest_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "deflate 256 MiB, guest watcher (s)",
        key: "deflate_s",
        value: |r| r.deflate.guest_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "inflate, device's view (s) [1]",
        key: "inflate_device_s",
        value: |r| r.inflate.device_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "deflate, device's view (s) [1]",
        key: "deflate_device_s",
        value: |r| r.deflate.device_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "agent round trip, idle (ms)",
        key: "agent_idle_ms",
        value: |r| 1000.0 * r.idle_poll_s,
        ratio: true,
        decimals: 0,
    },
    Metric {
        label: "agent round trip, 50 ms apart (ms)",
        key: "agent_spaced_ms",
        value: |r| 1000.0 * r.spaced_poll_s,
        ratio: true,
        decimals: 0,
    },
    Metric {
        label: "agent round trip, QEMU CPU (ms) [4]",
        key: "agent_idle_cpu_ms",
        value: |r| 1000.0 * r.idle_poll_cpu_s,
        ratio: true,
        decimals: 1,
    },
    Metric {
        label: "agent work, 100 polls in guest (s) [2]",
        key: "agent_work_s",
        value: |r| r.work_s,
        ratio: true,
        decimals: 2,
    },
    Metric {
        label: "console, a byte printed (us) [3]",
        key: "console_us_per_byte",
        value: |r| r.console_us_per_byte,
        ratio: true,
        decimals: 1,
    },
];

/// target/bench/linux.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    kernel: &'a str,
    busybox: &'a str,
    guest_mib: u64,
    vcpus: u32,
    balloon_mib: u64,
    pages: u64,
    rounds: usize,
    icount: bool,
    /// Per reporting mode (`reporting_off`, `reporting_on`), per
    /// [`METRICS`] key in the table's order.
    #[serde(serialize_with = "json::ordered_map")]
    summary: Vec<(&'static str, ModeSummary)>,
    runs: Vec<RunReport<'a>>,
    /// The agent's round trip on paired live guests, per reporting mode.
    #[serde(serialize_with = "json::ordered_map")]
    paired_round_trip: Vec<(&'static str, &'a Paired)>,
    /// Tidal's exit profiles under -icount, with EL2 instructions (the
    /// runs' `exit_profile` have none: the PMU counts only with -icount).
    #[serde(skip_serializing_if = "Option::is_none")]
    exit_profile_icount: Option<&'a IcountProfiles>,
}

/// One reporting mode's metrics, by [`METRICS`] key.
#[derive(Serialize)]
struct ModeSummary(
    #[serde(serialize_with = "json::ordered_map")] Vec<(&'static str, MetricSummary)>,
);

/// One metric, both sides.
#[derive(Serialize)]
struct MetricSummary {
    tidal: Spread,
    qemu: Spread,
    /// Tidal's median over QEMU's; `None` where a ratio means nothing.
    ratio_of_medians: Option<f64>,
}

/// One boot, named by side, free page reporting and round.
#[derive(Serialize)]
struct RunReport<'a> {
    side: &'static str,
    reporting: &'static str,
    round: usize,
    #[serde(flatten)]
    run: &'a Run,
}

impl<'a> Report<'a> {
    fn new(
        fixture: &'a crate::linux::LinuxFixture,
        summary: Vec<(&'static str, ModeSummary)>,
        runs: &'a [(Reporting, Side, usize, Run)],
        paired: &'a [(&'static str, Paired)],
        icount: Option<&'a IcountProfiles>,
    ) -> Self {
        Report {
            benchmark: "balloon-linux",
            kernel: &fixture.kernel_release,
            busybox: &fixture.busybox_version,
            guest_mib: GUEST_MIB,
            vcpus: VCPUS,
            balloon_mib: BALLOON_MIB,
            pages: PAGES,
            rounds: ROUNDS,
            icount: false,
            summary,
            runs: runs
                .iter()
                .map(|(reporting, side, round, run)| RunReport {
                    side: side.name(),
                    reporting: reporting.name(),
                    round: *round,
                    run,
                })
                .collect(),
            paired_round_trip: paired.iter().map(|(k, p)| (*k, p)).collect(),
            exit_profile_icount: icount,
        }
    }
}

fn report(
    root: &Path,
    fixture: &crate::linux::LinuxFixture,
    runs: &[(Reporting, Side, usize, Run)],
    paired: &[(&'static str, Paired)],
    icount: &IcountProfiles,
) -> Result<(), String> {
    let values = |reporting: Reporting, side: Side, metric: &Metric| -> Vec<f64> {
        runs.iter()
            .filter(|(m, s, _, _)| (*m, *s) == (reporting, side))
            .map(|(_, _, _, r)| (metric.value)(r))
            .collect()
    };
    let cell = |s: &Spread, d: usize| format!("{:.d$} [{:.d$}-{:.d$}]", s.median, s.min, s.max);

    println!();
    println!(
        "Balloon, Linux {} guest, {GUEST_MIB} MiB, {VCPUS} vCPUs, {BALLOON_MIB} MiB ({PAGES} pages) in and out;",
        fixture.kernel_release
    );
    println!(
        "wall time, no -icount, a warm-up boot of each side, then {ROUNDS} rounds alternating Tidal and plain QEMU, free page reporting off"
    );
    println!("and on in each round (the same on both sides); median [min-max]");
    let mut summary = Vec::new();
    for reporting in Reporting::BOTH {
        println!();
        println!(
            "{:<36} {:>24} {:>24} {:>11}",
            format!("reporting {}", reporting.name()),
            "Tidal",
            "QEMU",
            "Tidal/QEMU"
        );
        let mut metrics = Vec::new();
        for metric in &METRICS {
            let tidal = spread(&values(reporting, Side::Tidal, metric));
            let qemu = spread(&values(reporting, Side::Qemu, metric));
            let ratio = tidal.median / qemu.median;
            println!(
                "{:<36} {:>24} {:>24} {:>11}",
                metric.label,
                cell(&tidal, metric.decimals),
                cell(&qemu, metric.decimals),
                if metric.ratio {
                    format!("{ratio:.2}")
                } else {
                    "-".into()
                }
            );
            metrics.push((
                metric.key,
                MetricSummary {
                    tidal,
                    qemu,
                    ratio_of_medians: metric.ratio.then(|| json::rounded(ratio, 3)),
                },
            ));
        }
        summary.push((mode_key(reporting), ModeSummary(metrics)));
    }
    println!();
    for line in [
        "Tidal: the hypervisor on QEMU virt (GICv2, 2 cortex-a72 CPUs, 2 GiB), the guest on its CPUs 0-1",
        "(CPU 0 shared with the shell; no unused CPU: TCG wakes every CPU's thread for each broadcast TLBI);",
        "its balloon offers must-tell-host (reporting off: guests/tests/bench-linux.toml) or free page",
        "reporting (reporting on: guests/tests/bench-linux-reporting.toml); RAM backed on first touch.",
        "QEMU: the same kernel and initramfs on `-M virt,dtb-randomness=off -cpu cortex-a72 -smp 2 -m 512M`",
        "(no KASLR seed, as under Tidal), virtio-balloon-device (reporting on: free-page-reporting=on).",
        "Boot: from spawning QEMU to `tidal-guest: ready` on the console. Inflate/deflate: from sending the",
        "request (Tidal shell `balloon linux 256M`/`0`, QEMU monitor `balloon 256`/`512`) to the end of a",
        "guest watcher, started through the agent before, that reads /proc/vmstat every 10 ms until",
        "balloon_inflate/_deflate has grown by all 65536 pages. Agent round trip: `grep ^ball /proc/vmstat`",
        "through the agent on the idle guest, from typing the request to its `done` line (a round: the",
        "median of 20 requests sent back to back; then of 10 sent 50 ms after the last answer, which find",
        "the guest asleep, as a user's do).",
        "[1] Tidal: the hypervisor's own report (its counter, from setting the target to the driver reporting",
        "    it reached); QEMU: from the request until `info balloon`, polled every 5 ms, shows the target.",
        "[2] The poll run 100 times by one shell in the guest (a fork and exec of busybox grep each),",
        "    timed by the guest's `time`: the agent's work without the console.",
        "[3] The round trip of `cat /proc/vmstat /proc/vmstat /proc/vmstat` (median of 10) less the idle one,",
        "    per byte more the guest printed (lines and their CR LF): what the console path costs a byte.",
        "[4] CPU time of the whole QEMU process, all its threads (/proc): to `ready` split into user time",
        "    (emulation) and kernel time (mostly the host faulting in memory, which varies with what the",
        "    host did before); per request over the idle round trips, user and kernel together.",
    ] {
        println!("{line}");
    }
    println!();
    println!(
        "Agent round trip on paired live guests: both sides booted and kept up together, taking turns at"
    );
    println!(
        "bursts of {PAIRED_BURST} `{VMSTAT}` back to back ({PAIRED_BURSTS} bursts each per boot, {PAIRED_BOOTS} boots per mode),"
    );
    println!("so each pair of bursts meets the host at the same moment; median [min-max] over the bursts");
    println!(
        "{:<36} {:>24} {:>24} {:>18}",
        "", "Tidal (ms)", "QEMU (ms)", "Tidal/QEMU"
    );
    for (key, p) in paired {
        println!(
            "{:<36} {:>24} {:>24} {:>18}",
            key.replace('_', " "),
            cell(&p.tidal_ms, 1),
            cell(&p.qemu_ms, 1),
            cell(&p.ratio, 2)
        );
    }
    let work = &icount.agent_work;
    let total = &work.tidal_exits.total;
    println!();
    println!(
        "The agent's work under -icount (guest time = instructions, 1 ns each, timed to 10 ms), reporting"
    );
    println!(
        "on: {ICOUNT_WORK_LOOPS} polls in the guest took {:.2} s under Tidal, {:.2} s directly under QEMU (Tidal/QEMU {:.3});",
        work.tidal_guest_s,
        work.qemu_guest_s,
        work.tidal_guest_s / work.qemu_guest_s
    );
    match total.instructions {
        Some(instructions) => println!(
            "Tidal's {} exits over it ran {} EL2 instructions, {:.2}% of its {:.0} million.",
            total.count,
            instructions,
            100.0 * instructions as f64 / (work.tidal_guest_s * 1e9),
            work.tidal_guest_s * 1e3
        ),
        None => println!(
            "Tidal's {} exits over it (EL2 instructions not counted).",
            total.count
        ),
    }
    let trips = &work.round_trip_exits;
    let per = |n: u64| n as f64 / work.round_trips as f64;
    let uart = trips
        .kinds
        .iter()
        .find(|(kind, _)| kind == "mmio-uart")
        .map_or(0, |(_, tally)| tally.count);
    match trips.total.instructions {
        Some(instructions) => println!(
            "{} agent requests back to back: {:.0} exits each ({:.0} of them the UART's), {:.0} EL2 instructions each.",
            work.round_trips,
            per(trips.total.count),
            per(uart),
            per(instructions)
        ),
        None => println!(
            "{} agent requests back to back: {:.0} exits each ({:.0} of them the UART's).",
            work.round_trips,
            per(trips.total.count),
            per(uart)
        ),
    }
    let (tidal, qemu) = (&work.tidal_clocked, &work.qemu_clocked);
    println!();
    println!(
        "The agent's round trip under -icount, reporting on, by the guest's clock (`{GUEST_CLOCK}`: an"
    );
    println!(
        "instruction is 1 ns): {CLOCKED_TRIPS} `{VMSTAT}` typed at once between two readings, and {CLOCKED_TRIPS} `{BULK}`,"
    );
    println!(
        "{CLOCKED_SPANS} spans of each (a reading counts as a request; the harness's own turnaround is left out):"
    );
    println!(
        "{:<36} {:>24} {:>24} {:>18}",
        "", "Tidal", "QEMU", "Tidal/QEMU"
    );
    let range = |t: &ClockedTrips| {
        format!(
            "{:.3} [{:.3}-{:.3}]",
            t.round_trip_ms, t.round_trip_min_ms, t.round_trip_max_ms
        )
    };
    println!(
        "{:<36} {:>24} {:>24} {:>18.3}",
        "agent round trip (ms)",
        range(tidal),
        range(qemu),
        tidal.round_trip_ms / qemu.round_trip_ms
    );
    println!(
        "{:<36} {:>24.0} {:>24.0} {:>18.2}",
        "a byte more printed (ns)",
        tidal.byte_ns,
        qemu.byte_ns,
        tidal.byte_ns / qemu.byte_ns
    );
    let work_wall = summary
        .iter()
        .find(|(mode, _)| *mode == "reporting_on")
        .and_then(|(_, mode)| mode.0.iter().find(|(key, _)| *key == "agent_work_s"))
        .and_then(|(_, metric)| metric.ratio_of_medians);
    if let Some(ratio) = work_wall {
        println!(
            "In wall time the same polls took {ratio:.2} times QEMU's (agent work, reporting on): the part the"
        );
        println!(
            "instructions above do not explain is host time per guest instruction (TCG, stage 2 on), not work."
        );
    }
    let profiles: Vec<&exits::Profiles> = runs
        .iter()
        .filter(|(m, _, _, _)| *m == Reporting::On)
        .filter_map(|(_, _, _, r)| r.exits.as_ref())
        .collect();
    if !profiles.is_empty() {
        println!();
        println!("Free page reporting on (the demo's configuration):");
    }
    for line in exits::table(&profiles, Some(&icount.profiles)) {
        println!("{line}");
    }
    println!();
    let heading = [
        "The inflate and deflate under -icount (reporting on), by kind of exit (`info exits linux`,",
        "started over before each request, read once the guest's watcher saw every page moved)",
    ];
    for line in exits::move_table(&heading, &icount.inflate, &icount.deflate) {
        println!("{line}");
    }

    let path = root.join("target").join("bench").join("linux.json");
    let report = Report::new(fixture, summary, runs, paired, Some(icount));
    json::write(&path, &report)?;
    println!("written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time_and_is_found_by_nothing_else() {
        assert!(qemu_cpu_ns(std::process::id()).unwrap() > 0);
        assert!(qemu_user_sys_s(std::process::id()).is_ok());
        assert_eq!(find_qemu_now("no-such-qemu-name"), Ok(None));
    }

    #[test]
    fn user_and_kernel_ticks_are_read_past_the_command_name() {
        let stat = "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 9 0 0 0 250 37 0 0 20 0 5 0 1";
        assert_eq!(user_sys_s(stat), Some((2.5, 0.37)));
        assert_eq!(user_sys_s("4242 (qemu) S 1 2"), None);
        assert_eq!(user_sys_s("no parentheses"), None);
    }

    #[test]
    fn medians_and_spreads() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        let s = spread(&[2.0, 5.0, 1.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 5.0));
    }

    #[test]
    fn report_keeps_its_fields() {
        let run = |ready_s: f64| Run {
            work_s: 1.25,
            ready_s,
            ready_user_cpu_s: 2.3456,
            ready_sys_cpu_s: 0.25,
            idle_poll_s: 0.0123456,
            idle_poll_cpu_s: 0.0345678,
            spaced_poll_s: 0.0234567,
            console_us_per_byte: 12.345,
            inflate: Move {
                guest_s: 1.5,
                device_s: 1.23456,
            },
            deflate: Move {
                guest_s: 0.75,
                device_s: 0.654321,
            },
            exits: None,
        };
        let runs = [
            (Reporting::On, Side::Tidal, 1, run(3.21987)),
            (Reporting::On, Side::Qemu, 1, run(2.5)),
        ];
        let fixture = crate::linux::LinuxFixture {
            kernel: PathBuf::from("Image"),
            initramfs: PathBuf::from("initramfs.cpio"),
            kernel_release: "6.1.0-57-arm64".into(),
            busybox_version: "1:1.35.0-4+deb12u1+b1".into(),
        };
        let summary = vec![(
            "reporting_on",
            ModeSummary(vec![(
                "ready_s",
                MetricSummary {
                    tidal: spread(&[3.21987]),
                    qemu: spread(&[2.5]),
                    ratio_of_medians: Some(json::rounded(3.21987 / 2.5, 3)),
                },
            )]),
        )];
        let paired = [(
            "reporting_on",
            Paired {
                boots: 3,
                bursts_per_boot: 6,
                requests_per_burst: 8,
                tidal_ms: spread(&[33.0, 30.0]),
                qemu_ms: spread(&[30.0, 25.0]),
                ratio: spread(&burst_ratios(&[33.0, 30.0], &[30.0, 25.0])),
            },
        )];
        let value =
            serde_json::to_value(Report::new(&fixture, summary, &runs, &paired, None)).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "benchmark": "balloon-linux",
                "kernel": "6.1.0-57-arm64",
                "busybox": "1:1.35.0-4+deb12u1+b1",
                "guest_mib": 512,
                "vcpus": 2,
                "balloon_mib": 256,
                "pages": 65536,
                "rounds": 3,
                "icount": false,
                "summary": {
                    "reporting_on": {
                        "ready_s": {
                            "tidal": {"median": 3.2199, "min": 3.2199, "max": 3.2199},
                            "qemu": {"median": 2.5, "min": 2.5, "max": 2.5},
                            "ratio_of_medians": 1.288
                        }
                    }
                },
                "runs": [
                    {"side": "Tidal", "reporting": "on", "round": 1, "ready_s": 3.22,
                     "ready_user_cpu_s": 2.35, "ready_sys_cpu_s": 0.25,
                     "agent_idle_s": 0.0123, "agent_idle_cpu_s": 0.0346,
                     "agent_spaced_s": 0.0235, "agent_work_s": 1.25,
                     "console_us_per_byte": 12.35,
                     "inflate": {"guest_s": 1.5, "device_s": 1.2346},
                     "deflate": {"guest_s": 0.75, "device_s": 0.6543}},
                    {"side": "QEMU", "reporting": "on", "round": 1, "ready_s": 2.5,
                     "ready_user_cpu_s": 2.35, "ready_sys_cpu_s": 0.25,
                     "agent_idle_s": 0.0123, "agent_idle_cpu_s": 0.0346,
                     "agent_spaced_s": 0.0235, "agent_work_s": 1.25,
                     "console_us_per_byte": 12.35,
                     "inflate": {"guest_s": 1.5, "device_s": 1.2346},
                     "deflate": {"guest_s": 0.75, "device_s": 0.6543}}
                ],
                "paired_round_trip": {
                    "reporting_on": {
                        "boots": 3, "bursts_per_boot": 6, "requests_per_burst": 8,
                        "tidal_ms": {"median": 31.5, "min": 30.0, "max": 33.0},
                        "qemu_ms": {"median": 27.5, "min": 25.0, "max": 30.0},
                        "ratio": {"median": 1.15, "min": 1.1, "max": 1.2}
                    }
                }
            })
        );
    }

    #[test]
    fn tidal_runs_carry_their_exit_profiles() {
        let profile = exits::parse(exits::tests::SAMPLE).unwrap();
        let run = |exits| Run {
            ready_s: 1.0,
            ready_user_cpu_s: 1.0,
            ready_sys_cpu_s: 0.1,
            idle_poll_s: 0.01,
            idle_poll_cpu_s: 0.02,
            spaced_poll_s: 0.015,
            work_s: 1.0,
            console_us_per_byte: 10.0,
            inflate: Move {
                guest_s: 1.0,
                device_s: 1.0,
            },
            deflate: Move {
                guest_s: 1.0,
                device_s: 1.0,
            },
            exits,
        };
        let tidal = run(Some(exits::Profiles {
            boot: profile.clone(),
            idle: profile,
        }));
        let tidal = serde_json::to_value(RunReport {
            side: "Tidal",
            reporting: "on",
            round: 1,
            run: &tidal,
        })
        .unwrap();
        assert_eq!(
            tidal["exit_profile"]["idle"]["kinds"]["wfi"],
            serde_json::json!({"count": 2088, "instructions": 1496590})
        );
        assert_eq!(tidal["exit_profile"]["boot"]["seconds"], 10.167);
        let qemu = run(None);
        let qemu = serde_json::to_value(RunReport {
            side: "QEMU",
            reporting: "on",
            round: 1,
            run: &qemu,
        })
        .unwrap();
        assert!(qemu.get("exit_profile").is_none());
        let fixture = crate::linux::LinuxFixture {
            kernel: PathBuf::from("Image"),
            initramfs: PathBuf::from("initramfs.cpio"),
            kernel_release: "6.1.0-57-arm64".into(),
            busybox_version: "1".into(),
        };
        let icount = IcountProfiles {
            profiles: exits::Profiles {
                boot: exits::parse(exits::tests::SAMPLE).unwrap(),
                idle: exits::parse(exits::tests::SAMPLE).unwrap(),
            },
            inflate: exits::parse(exits::tests::SAMPLE).unwrap(),
            deflate: exits::parse(exits::tests::SAMPLE_NO_PMU).unwrap(),
            agent_work: IcountWork {
                tidal_guest_s: 1.1,
                qemu_guest_s: 1.0,
                tidal_exits: exits::parse(exits::tests::SAMPLE).unwrap(),
                round_trips: 20,
                round_trip_exits: exits::parse(exits::tests::SAMPLE).unwrap(),
                tidal_clocked: ClockedTrips {
                    round_trip_ms: 7.01234,
                    round_trip_min_ms: 7.0,
                    round_trip_max_ms: 7.1,
                    byte_ns: 2000.0,
                },
                qemu_clocked: ClockedTrips {
                    round_trip_ms: 6.8,
                    round_trip_min_ms: 6.7,
                    round_trip_max_ms: 6.9,
                    byte_ns: 900.0,
                },
            },
        };
        let report = Report::new(&fixture, Vec::new(), &[], &[], Some(&icount));
        let value = serde_json::to_value(report).unwrap();
        assert_eq!(
            value["exit_profile_icount"]["idle"]["total"],
            serde_json::json!({"count": 2242, "instructions": 12477155})
        );
        assert_eq!(
            value["exit_profile_icount"]["inflate"]["total"],
            serde_json::json!({"count": 2242, "instructions": 12477155})
        );
        assert_eq!(
            value["exit_profile_icount"]["deflate"]["total"],
            serde_json::json!({"count": 2236, "instructions": null})
        );
        assert_eq!(
            value["exit_profile_icount"]["agent_work"]["round_trips"],
            20
        );
        assert_eq!(
            value["exit_profile_icount"]["agent_work"]["tidal_clocked"],
            serde_json::json!({
                "round_trip_ms": 7.0123,
                "round_trip_min_ms": 7.0,
                "round_trip_max_ms": 7.1,
                "byte_ns": 2000.0
            })
        );
        assert_eq!(
            value["exit_profile_icount"]["agent_work"]["round_trip_exits"]["total"],
            serde_json::json!({"count": 2242, "instructions": 12477155})
        );
    }

    #[test]
    fn guest_clock_is_read() {
        let top = "Timer List Version: v0.9\r\nHRTIMER_MAX_CLOCK_BASES: 8\r\nnow at 81234567890 nsecs\r\n";
        assert_eq!(timer_list_now_ns(top), vec![81_234_567_890]);
        // An echo right before and right after; a bad number.
        let echoed = "run 9 grnow at 12 nsecsep ^ball\r\nnow at 12x nsecs\r\nnow at 15 nsecs";
        assert_eq!(timer_list_now_ns(echoed), vec![12, 15]);
        assert!(timer_list_now_ns("now at nsecs").is_empty());
    }

    #[test]
    fn typed_requests_give_a_span() {
        // Tidal's prefix; request 8's echo among request 7's answer.
        let text = "[linux] run 6 head -3 /proc/timer_list\r\n[linux] run 7 grep x\r\n\
                    [linux] now at 1000 nsecs\r\n[linux] tidal-guest: done 6 rc=0\r\n\
                    [linux] a 1\r\n[linux] run 8 head -3 /proc/timer_list\r\n\
                    [linux] tidal-guest: done 7 rc=0\r\n[linux] now at 5000 nsecs\r\n\
                    [linux] tidal-guest: done 8 rc=0";
        let (ns, bytes) = span_of_typed_requests(text, 6..=8, "[linux] ").unwrap();
        assert_eq!(ns, 4000);
        let plain: usize = text
            .lines()
            .map(|l| l.trim_end_matches('\r').len() - 8 + 2)
            .sum();
        assert_eq!(bytes, plain);
        // A request that failed, one missing, the clock read once.
        let failed = text.replace("done 7 rc=0", "done 7 rc=1");
        assert!(span_of_typed_requests(&failed, 6..=8, "[linux] ").is_err());
        assert!(span_of_typed_requests(text, 6..=9, "[linux] ").is_err());
        let once = text.replace("now at 5000", "then at 5000");
        assert!(span_of_typed_requests(&once, 6..=8, "[linux] ").is_err());
        let back = text.replace("now at 5000", "now at 500");
        assert!(span_of_typed_requests(&back, 6..=8, "[linux] ").is_err());
    }

    #[test]
    fn clock_spans_give_a_request_and_a_byte() {
        // 10 requests of 7 ms and a reading like one; BULK 27 ms for
        // 10,000 bytes more: 2,000 ns a byte. One span of each caught
        // free page reporting's worker.
        let ms = 1_000_000u64;
        let spans = |vmstat: Vec<u64>, bulk: Vec<u64>, extra_bytes| ClockSpans {
            count: 10,
            vmstat,
            bulk,
            extra_bytes,
        };
        let trips = spans(
            vec![77 * ms, 95 * ms, 77 * ms],
            vec![277 * ms, 277 * ms, 290 * ms],
            10_000,
        )
        .trips()
        .unwrap();
        assert!((trips.round_trip_ms - 7.0).abs() < 1e-9, "{trips:?}");
        assert!((trips.byte_ns - 2_000.0).abs() < 1e-6, "{trips:?}");
        assert!((trips.round_trip_min_ms - 7.0).abs() < 1e-9, "{trips:?}");
        assert!(
            (trips.round_trip_max_ms - 95.0 / 11.0).abs() < 1e-9,
            "{trips:?}"
        );
        // BULK no dearer than VMSTAT, a clock gone back, nothing timed,
        // no bytes more.
        assert!(spans(vec![77 * ms], vec![77 * ms], 10_000).trips().is_err());
        let back = 0u64.wrapping_sub(ms);
        assert!(spans(vec![back], vec![277 * ms], 10_000).trips().is_err());
        assert!(spans(vec![], vec![277 * ms], 10_000).trips().is_err());
        assert!(spans(vec![77 * ms], vec![277 * ms], 0).trips().is_err());
    }

    #[test]
    fn busybox_time_is_read() {
        let lines = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            busybox_real_s(&lines(&["real\t0m 1.10s", "user\t0m 0.40s"])),
            Some(1.1)
        );
        assert_eq!(busybox_real_s(&lines(&["real\t1m 2.50s"])), Some(62.5));
        assert_eq!(busybox_real_s(&lines(&["realm", "nothing"])), None);
        assert!(work_command(100).contains("-lt 100 ]"));
    }

    #[test]
    fn monitor_echo_escapes_are_stripped() {
        assert_eq!(
            strip_escapes("info balloon\x1b[K\x1b[D\r\nballoon: actual=256"),
            "info balloon\r\nballoon: actual=256"
        );
    }

    #[test]
    fn the_sides_run_the_same_guest() {
        let root = crate::root();
        let dir = root.join("target").join("fixtures").join("linux");
        for reporting in Reporting::BOTH {
            let config = reporting.bundle().1;
            check_config(
                &root,
                config,
                &dir.join("Image"),
                &dir.join("initramfs.cpio"),
                GUEST_MIB,
            )
            .unwrap();
        }
        let config = Reporting::On.bundle().1;
        let image = dir.join("Image");
        let err =
            check_config(&root, config, &image, Path::new("/other.cpio"), GUEST_MIB).unwrap_err();
        assert!(err.contains("initrd"), "{err}");
        let cpio = dir.join("initramfs.cpio");
        let err = check_config(&root, config, &image, &cpio, 2 * GUEST_MIB).unwrap_err();
        assert!(err.contains("ram"), "{err}");
    }
}
