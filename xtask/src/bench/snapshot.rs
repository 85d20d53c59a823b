//! `cargo xtask bench snapshot`: what saving an idle Linux guest costs
//! under Tidal (`snapshot`, and `restore` against a boot), beside QEMU's own
//! save of the same kernel and initramfs (issue 39).
//!
//! The guest: the fixture kernel and initramfs with the other Linux
//! benches' command line, [`GUEST_MIB`] MiB and 2 vCPUs, that wrote
//! [`WRITE_MIB`] MiB of random data into a tmpfs of its own and removed it
//! ([`workload`]), then idled [`IDLE`]: most of its RAM is free pages that
//! still hold data. [`ROUNDS`] rounds, each booting in this order:
//! - Tidal in each [`Mode`] (free page reporting off, so that only a hinting
//!   run finds the freed pages; and the demo's balloon features), with a
//!   fresh sparse board disk of [`DISK_MIB`] MiB: `snapshot linux
//!   nohint-<round> --no-hint`, then `snapshot linux hint-<round>`. Per
//!   snapshot: the bytes written as the shell prints them (to 0.1 MiB), its
//!   pages by kind, the time from typing the command to its `saved` line
//!   (the hinting run included), and the pause the hypervisor reports. Then
//!   `stop linux` and `restore hint-<round>`, timed from typing it to the
//!   agent's answer to a request sent as soon as the VM runs again, against
//!   the same boot's cold start: from QEMU's start to the agent's first
//!   answer.
//! - The same kernel and initramfs directly under QEMU with its
//!   `virtio-balloon-device`, without free page hinting (QEMU 10.0.2 aborts
//!   at boot with `free-page-hint=on` under TCG), the same workload, then on
//!   its human monitor `stop` (a save of a paused guest, as Tidal's) and
//!   `migrate -d file:<path>` with the bandwidth cap lifted
//!   ([`QEMU_BANDWIDTH`]), with `info migrate` polled until it is
//!   completed: the file's bytes, QEMU's `total time`, and the wall time
//!   from `migrate` to the completed poll.
//!
//! Wall time on a shared machine, no -icount; the tables give median
//! [min-max] over the rounds. The goals: hinting cuts the bytes written by
//! at least 80% where only hinting can find the free pages; Tidal's
//! snapshot with hinting is no larger than QEMU's save; a restore reaches
//! the agent at least 10 times as fast as a boot. A snapshot not taken, a
//! restore that fails or a guest that does not answer ends its round as a
//! failure: the table and the JSON hold the rounds that completed and name
//! the failures (with the session's log), and the bench fails.
//!
//! Results: a table on stdout and target/bench/snapshot.json.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::console::first_number;
use harness::linux::{enter_console, leave_console, wait_for_agents};
use harness::{log_dir, Artifacts, Board, Session};
use serde::Serialize;

use super::linux::{self, harness, spread, Reporting, Spread};
use crate::json;
use crate::linux::{build_initramfs, memtool_path, LinuxFixture};

const ROUNDS: usize = 3;
const GUEST_MIB: u64 = 1024;
/// Random data the guest writes and removes before the snapshots.
const WRITE_MIB: u64 = 768;
/// The tmpfs it writes into: the initramfs's /tmp holds at most half of
/// RAM.
const TMPFS_MIB: u64 = 900;
/// Idle time after the workload, before the first snapshot.
const IDLE: Duration = Duration::from_secs(5);
/// The board's disk, sparse: room for both snapshots of a round.
const DISK_MIB: u64 = 4096;
const VM: &str = "linux";
const MIB: f64 = (1u64 << 20) as f64;

const BOOT: Duration = Duration::from_secs(240);
const STEP: Duration = Duration::from_secs(120);
/// The workload: 768 MiB from /dev/urandom took 13 s directly under QEMU.
const WORKLOAD: Duration = Duration::from_secs(900);
/// A snapshot or a save, its hinting run included.
const SAVE: Duration = Duration::from_secs(600);
const COMMAND: Duration = Duration::from_secs(30);
/// Whole-session limit: QEMU is killed after this whatever happens.
const SESSION: Duration = Duration::from_secs(2400);
/// QEMU's `max-bandwidth` for its save. Its default, 128 MiB/s, is a cap
/// for live migration over a network: with it every save of the guest
/// took 6.5 s (845 MiB at the cap), without it 0.4 s.
const QEMU_BANDWIDTH: &str = "100G";
/// How often `info migrate` is asked during QEMU's save.
const MIGRATE_POLL: Duration = Duration::from_millis(20);

/// Tidal's balloon in a round: which features its bundle offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Must-tell-host and free page hinting, no free page reporting: only a
    /// hinting run finds the pages the guest freed.
    HintOnly,
    /// The demo's Linux VM's features (guests/demo.toml), free page
    /// reporting among them.
    Demo,
}

impl Mode {
    const BOTH: [Mode; 2] = [Mode::HintOnly, Mode::Demo];

    /// The JSON key and the session names' part.
    fn key(self) -> &'static str {
        match self {
            Mode::HintOnly => "reporting_off",
            Mode::Demo => "demo",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mode::HintOnly => "reporting off",
            Mode::Demo => "demo's features",
        }
    }

    /// The bundle (target/bundles/) and the configuration it is built from.
    fn bundle(self) -> (&'static str, &'static str) {
        match self {
            Mode::HintOnly => ("bench-snapshot.img", "guests/tests/bench-snapshot.toml"),
            Mode::Demo => (
                "bench-snapshot-demo.img",
                "guests/tests/bench-snapshot-demo.toml",
            ),
        }
    }
}

/// The guest's work before the snapshots, as one agent request: a tmpfs
/// big enough, [`WRITE_MIB`] MiB of random data written (its size
/// checked: a short read from /dev/urandom would write less) and removed.
fn workload() -> String {
    let bytes = WRITE_MIB << 20;
    format!(
        "mkdir -p /mnt/big && mount -t tmpfs -o size={TMPFS_MIB}M big /mnt/big && \
         dd if=/dev/urandom of=/mnt/big/f bs=1M count={WRITE_MIB} iflag=fullblock 2>/dev/null && \
         [ $(stat -c %s /mnt/big/f) = {bytes} ] && rm /mnt/big/f"
    )
}

/// One `snapshot` under Tidal.
#[derive(Serialize)]
struct Snap {
    name: String,
    /// As the shell prints the size (0.1 MiB, rounded down).
    written_bytes: u64,
    data_pages: u64,
    zero_pages: u64,
    not_written_pages: u64,
    ballooned_pages: u64,
    /// Not written as freed (hinted, reported) or never touched.
    freed_pages: u64,
    /// Pages the guest hinted for the snapshot (0 with `--no-hint`).
    hinted_pages: u64,
    /// From typing the command to its `saved` line, hinting included.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    command_s: f64,
    /// The hypervisor's figures: the VM paused, of which its vCPUs took
    /// `stop_ms` to stop and the write `write_ms`.
    paused_ms: u64,
    stop_ms: u64,
    write_ms: u64,
}

/// One Tidal boot.
#[derive(Serialize)]
struct TidalRound {
    mode: &'static str,
    round: usize,
    /// From QEMU's start to the agent's first answer.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    boot_to_agent_s: f64,
    #[serde(serialize_with = "json::decimals::<2, _>")]
    workload_s: f64,
    no_hint: Snap,
    hint: Snap,
    /// From typing `restore` to the agent's answer.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    restore_to_agent_s: f64,
    /// The hypervisor's own time for the restore.
    restore_ms: u64,
    restore_data_pages: u64,
}

/// One QEMU boot.
#[derive(Serialize)]
struct QemuRound {
    round: usize,
    /// From QEMU's start to `tidal-guest: ready`.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    ready_s: f64,
    #[serde(serialize_with = "json::decimals::<2, _>")]
    workload_s: f64,
    /// The save file's size.
    written_bytes: u64,
    /// `info migrate`'s pages sent whole (`normal`) and as zero
    /// (`duplicate`).
    normal_pages: u64,
    zero_pages: u64,
    /// `info migrate`'s `total time`.
    total_ms: u64,
    /// From `migrate` to the `info migrate` that showed it completed.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    wall_s: f64,
}

/// A booted Tidal guest's agent, whose answers are timed.
struct Agent {
    next_id: u32,
}

impl Agent {
    /// Runs `command` in the guest (the shell has the keyboard before and
    /// after): its output lines, when it was typed, and when its `done` line
    /// arrived. An error unless it ended with status 0.
    fn run(
        &mut self,
        s: &mut Session,
        command: &str,
        timeout: Duration,
    ) -> Result<(Vec<String>, Instant, Instant), String> {
        let id = self.next_id;
        self.next_id += 1;
        enter_console(s, VM).map_err(harness)?;
        let sent = Instant::now();
        s.send_line(&format!("run {id} {command}"))
            .map_err(harness)?;
        let done = format!(r"(?s)(.*?)\[{VM}\] tidal-guest: done {id} rc=(\d+)");
        let c = s.expect(&done, timeout).map_err(harness)?;
        let arrived = s.matched_at().expect("just matched");
        leave_console(s).map_err(harness)?;
        if c[2] != "0" {
            return Err(format!(
                "`{command}` in the guest ended rc={}:\n{}",
                c[2],
                c[1].trim()
            ));
        }
        let prefix = format!("[{VM}] ");
        let lines = c[1]
            .lines()
            .filter_map(|l| l.trim_end_matches('\r').strip_prefix(&prefix))
            .map(str::to_string)
            .collect();
        Ok((lines, sent, arrived))
    }
}

/// Bytes of a size as the hypervisor prints it (`93.5 MiB`, `12 KiB`,
/// `512 bytes`).
fn parse_size(text: &str) -> Option<u64> {
    let (number, unit) = text.trim().split_once(' ')?;
    let scale = match unit {
        "MiB" => 1 << 20,
        "KiB" => 1 << 10,
        "bytes" => 1,
        _ => return None,
    };
    let (whole, tenths) = match number.split_once('.') {
        Some((w, t)) if t.len() == 1 => (w.parse::<u64>().ok()?, t.parse::<u64>().ok()?),
        Some(_) => return None,
        None => (number.parse().ok()?, 0),
    };
    Some(whole * scale + tenths * scale / 10)
}

/// `snapshot linux <name>` (with `--no-hint` unless `hint`): waits for its
/// last line; an error unless it was saved.
fn snapshot(s: &mut Session, name: &str, hint: bool) -> Result<Snap, String> {
    let command = if hint {
        format!("snapshot {VM} {name}")
    } else {
        format!("snapshot {VM} {name} --no-hint")
    };
    let typed = Instant::now();
    let out = s.run(&command, COMMAND).map_err(harness)?;
    // Both bundles offer hinting: the first line says which way it goes.
    let begun = if hint {
        "hints its free pages first (run "
    } else {
        "no hinting run first (--no-hint)"
    };
    if !out.contains(begun) {
        return Err(format!("`{command}`: {}", out.trim()));
    }
    // The saved line's figures, or (the last alternatives) a line that
    // ends the snapshot otherwise.
    let end = format!(
        r"snapshot {name}: (?:{VM} saved, ([\d.]+ (?:MiB|KiB|bytes)) written; paused (\d+) ms \((\d+) ms for its vCPUs to stop, (\d+) ms to write\)|({VM} saved, [^\r\n]*|[^\r\n]*(?:not taken|nothing was written|cannot pause|is gone)[^\r\n]*))"
    );
    let c = s.expect(&end, SAVE).map_err(harness)?;
    let arrived = s.matched_at().expect("just matched");
    if c[1].is_empty() {
        return Err(format!("`{command}`: snapshot {name}: {}", c[5]));
    }
    let pages = s
        .expect(
            r"  pages: (\d+) data, (\d+) zero \(a bit each\), (\d+) not written: (\d+) ballooned, (\d+) freed \(hinted, reported\) or never touched; the guest hinted (\d+) pages free for it",
            COMMAND,
        )
        .map_err(harness)?;
    let number = |groups: &[String], i: usize| {
        groups[i]
            .parse::<u64>()
            .map_err(|e| format!("`{command}`: bad number '{}': {e}", groups[i]))
    };
    Ok(Snap {
        name: name.to_string(),
        written_bytes: parse_size(&c[1]).ok_or_else(|| format!("bad size '{}'", c[1]))?,
        data_pages: number(&pages, 1)?,
        zero_pages: number(&pages, 2)?,
        not_written_pages: number(&pages, 3)?,
        ballooned_pages: number(&pages, 4)?,
        freed_pages: number(&pages, 5)?,
        hinted_pages: number(&pages, 6)?,
        command_s: (arrived - typed).as_secs_f64(),
        paused_ms: number(&c, 2)?,
        stop_ms: number(&c, 3)?,
        write_ms: number(&c, 4)?,
    })
}

/// `stop linux`, then `restore <name>`: the time from typing `restore` to
/// the agent's answer to a request sent once the VM runs again, the
/// hypervisor's time for the restore, and the data pages it read.
fn restore(s: &mut Session, agent: &mut Agent, name: &str) -> Result<(f64, u64, u64), String> {
    // A vCPU on the shell's CPU stops once the shell has returned to it:
    // the prompt may come first, the VM's own line says when.
    let out = s.run(&format!("stop {VM}"), STEP).map_err(harness)?;
    let stopped = format!("tidal: [{VM}] VM stopped: ");
    if out.contains("cannot stop") || out.contains("no VM called") {
        return Err(format!("`stop {VM}`: {}", out.trim()));
    } else if !out.contains(&stopped) {
        s.expect(&regex_escape(&stopped), STEP).map_err(harness)?;
    }
    // Typed and its line awaited without `Session::run`, whose waits for
    // a quiet console after the echo and after the prompt (150 ms each)
    // would count as the restore's. The match ends before the line's `\n`,
    // not at the end of the output, so it is taken at once.
    let command = format!("restore {name}");
    let typed = Instant::now();
    s.send_line(&command).map_err(harness)?;
    let said = s.expect(r"restore: ([^\r\n]*)\r", SAVE).map_err(harness)?[1].clone();
    let again = format!(
        r"{VM} runs again from '{name}' \(its clock at [\d.]+ s\) in (\d+) ms: (\d+) data pages read[^\r\n]*"
    );
    let text = if said.starts_with(&format!("{VM} runs again from '{name}'")) {
        said
    } else if said.starts_with(&format!("{VM} starts from '{name}' in")) {
        // Later, once the board's clock has passed the guest's.
        s.expect(&format!("restore: {again}"), SAVE)
            .map_err(harness)?[0]
            .clone()
    } else {
        return Err(format!("`{command}`: restore: {said}"));
    };
    let ms = first_number(&text, &again).ok_or_else(|| format!("`{command}`: {text}"))?;
    let data = first_number(&text, r"in \d+ ms: (\d+) data pages read")
        .ok_or_else(|| format!("`{command}`: {text}"))?;
    let (_, _, answered) = agent.run(s, "true", STEP)?;
    Ok(((answered - typed).as_secs_f64(), ms, data))
}

/// One Tidal boot in `mode`, with a fresh board disk (removed after).
fn tidal_round(
    root: &Path,
    artifacts: &Artifacts,
    mode: Mode,
    round: usize,
) -> Result<TidalRound, String> {
    let name = format!("bench-snapshot-tidal-{}-{round}", mode.key());
    let disk = bench_dir(root).join(format!("{name}.img"));
    std::fs::create_dir_all(bench_dir(root)).map_err(|e| format!("target/bench: {e}"))?;
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(DISK_MIB << 20))
        .map_err(|e| format!("{}: {e}", disk.display()))?;
    let mut opts = linux::tidal_board(artifacts, mode.bundle().0);
    opts.disk = Some(disk.clone());
    let result = Session::start(&name, Board::VirtGicv2, artifacts, &opts)
        .map_err(harness)
        .and_then(|mut s| {
            s.set_deadline(SESSION);
            let log = s.log_path().display().to_string();
            tidal_measure(&mut s, mode, round).map_err(|e| format!("{e} (log: {log})"))
        });
    let _ = std::fs::remove_file(&disk);
    result
}

fn tidal_measure(s: &mut Session, mode: Mode, round: usize) -> Result<TidalRound, String> {
    wait_for_agents(s, &[VM], 0, BOOT).map_err(harness)?;
    let mut agent = Agent { next_id: 1 };
    let (_, _, answered) = agent.run(s, "true", STEP)?;
    let boot_to_agent_s = (answered - s.started()).as_secs_f64();
    let (_, sent, done) = agent.run(s, &workload(), WORKLOAD)?;
    std::thread::sleep(IDLE);
    // Without hinting first: hinted pages are given back, and a snapshot
    // after them would not write them either.
    let no_hint = snapshot(s, &format!("nohint-{round}"), false)?;
    let hint = snapshot(s, &format!("hint-{round}"), true)?;
    let (restore_to_agent_s, restore_ms, restore_data_pages) = restore(s, &mut agent, &hint.name)?;
    Ok(TidalRound {
        mode: mode.key(),
        round,
        boot_to_agent_s,
        workload_s: (done - sent).as_secs_f64(),
        no_hint,
        hint,
        restore_to_agent_s,
        restore_ms,
        restore_data_pages,
    })
}

/// The value after `key` in `info migrate`'s output (`total time: 6532
/// ms`, `normal: 215228 pages`), its first word.
fn migrate_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix(':'))?
        .split_whitespace()
        .next()
}

/// One boot directly under QEMU: the workload, then a save of the stopped
/// guest to a file (removed after).
fn qemu_round(
    root: &Path,
    artifacts: &Artifacts,
    fixture: &LinuxFixture,
    round: usize,
) -> Result<QemuRound, String> {
    let name = format!("bench-snapshot-qemu-{round}");
    let log = log_dir().join(format!("{name}.log"));
    let file = bench_dir(root).join(format!("{name}.bin"));
    let result = qemu_measure(artifacts, fixture, round, &name, &file)
        .map_err(|e| format!("{e} (log: {})", log.display()));
    let _ = std::fs::remove_file(&file);
    result
}

fn qemu_measure(
    artifacts: &Artifacts,
    fixture: &LinuxFixture,
    round: usize,
    name: &str,
    file: &Path,
) -> Result<QemuRound, String> {
    let mut guest = linux::Guest::boot_qemu(
        &fixture.kernel,
        &fixture.initramfs,
        &artifacts.elf,
        name,
        Reporting::Off,
        false,
        GUEST_MIB,
    )?;
    let ready = guest.wait_ready()?;
    let (_, sent, done) = guest.agent(&workload())?;
    std::thread::sleep(IDLE);
    let _ = std::fs::remove_file(file);
    let quiet = |command: &str, out: String| {
        if out.trim().is_empty() {
            Ok(())
        } else {
            Err(format!("QEMU monitor `{command}`: {}", out.trim()))
        }
    };
    let cap = format!("migrate_set_parameter max-bandwidth {QEMU_BANDWIDTH}");
    quiet(&cap, guest.monitor(&cap)?)?;
    quiet("stop", guest.monitor("stop")?)?;
    let migrate = format!("migrate -d file:{}", file.display());
    let started = Instant::now();
    quiet(&migrate, guest.monitor(&migrate)?)?;
    let info = loop {
        let info = guest.monitor("info migrate")?;
        match migrate_field(&info, "Migration status") {
            Some("completed") => break info,
            Some("failed" | "cancelled") => return Err(format!("`{migrate}`: {info}")),
            _ if started.elapsed() > SAVE => {
                return Err(format!("`{migrate}` not completed within {SAVE:?}: {info}"))
            }
            _ => std::thread::sleep(MIGRATE_POLL),
        }
    };
    let wall_s = started.elapsed().as_secs_f64();
    let field = |key: &str| {
        migrate_field(&info, key)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("no `{key}` in `info migrate`:\n{info}"))
    };
    let written_bytes = std::fs::metadata(file)
        .map_err(|e| format!("{}: {e}", file.display()))?
        .len();
    Ok(QemuRound {
        round,
        ready_s: ready.as_secs_f64(),
        workload_s: (done - sent).as_secs_f64(),
        written_bytes,
        normal_pages: field("normal")?,
        zero_pages: field("duplicate")?,
        total_ms: field("total time")?,
        wall_s,
    })
}

/// `text` as a regex matching it literally (its `[`, `]` and `.`, the
/// only special characters in the lines matched here).
fn regex_escape(text: &str) -> String {
    text.replace('.', r"\.")
        .replace('[', r"\[")
        .replace(']', r"\]")
}

fn bench_dir(root: &Path) -> PathBuf {
    root.join("target").join("bench")
}

/// The `[[vm]]` called `linux` in configuration `config`.
fn linux_vm(root: &Path, config: &str) -> Result<toml::Table, String> {
    let path = root.join(config);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    table
        .get("vm")
        .and_then(|v| v.as_array())
        .and_then(|vms| {
            vms.iter()
                .find(|vm| vm.get("name").and_then(|n| n.as_str()) == Some(VM))
        })
        .and_then(|vm| vm.as_table().cloned())
        .ok_or_else(|| format!("{}: no [[vm]] called {VM}", path.display()))
}

/// A VM's balloon features and whether its RAM is preallocated.
fn balloon_of(vm: &toml::Table) -> (Vec<String>, bool) {
    let features = vm
        .get("balloon")
        .and_then(|b| b.get("features"))
        .and_then(|f| f.as_array())
        .map(|f| {
            f.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let prealloc = vm
        .get("memory")
        .and_then(|m| m.get("prealloc"))
        .and_then(|p| p.as_bool())
        .unwrap_or(false);
    (features, prealloc)
}

/// Each bundle holds the QEMU side's guest ([`linux::check_config`]) with
/// its mode's balloon: hinting without reporting, or exactly the demo's.
fn check_configs(root: &Path, fixture: &LinuxFixture) -> Result<(), String> {
    let (demo_features, demo_prealloc) = balloon_of(&linux_vm(root, "guests/demo.toml")?);
    for mode in Mode::BOTH {
        let config = mode.bundle().1;
        linux::check_config(root, config, &fixture.kernel, &fixture.initramfs, GUEST_MIB)?;
        let (features, prealloc) = balloon_of(&linux_vm(root, config)?);
        let want = match mode {
            Mode::HintOnly => (
                vec!["must-tell-host".into(), "free-page-hint".into()],
                false,
            ),
            Mode::Demo => (demo_features.clone(), demo_prealloc),
        };
        if (features.clone(), prealloc) != want {
            return Err(format!(
                "{config}: balloon features {features:?}, prealloc {prealloc}; the bench wants {:?}, prealloc {}",
                want.0, want.1
            ));
        }
    }
    Ok(())
}

/// Median, min and max of one figure over the rounds.
fn over<T>(rounds: &[&T], value: impl Fn(&T) -> f64) -> Spread {
    spread(&rounds.iter().map(|r| value(r)).collect::<Vec<_>>())
}

/// One kind of snapshot (or QEMU's save) over the rounds.
#[derive(Serialize)]
struct SaveSummary {
    rounds: usize,
    written_mib: Spread,
    /// Tidal: typing the command to `saved`; QEMU: `migrate` to completed.
    command_s: Spread,
    /// Tidal: the pause the hypervisor reports; QEMU: `info migrate`'s
    /// total time, all of it with the guest stopped.
    paused_ms: Spread,
    data_pages: Spread,
    zero_pages: Spread,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_written_pages: Option<Spread>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hinted_pages: Option<Spread>,
}

impl SaveSummary {
    fn tidal(rounds: &[&TidalRound], snap: fn(&TidalRound) -> &Snap) -> Self {
        SaveSummary {
            rounds: rounds.len(),
            written_mib: over(rounds, |r| snap(r).written_bytes as f64 / MIB),
            command_s: over(rounds, |r| snap(r).command_s),
            paused_ms: over(rounds, |r| snap(r).paused_ms as f64),
            data_pages: over(rounds, |r| snap(r).data_pages as f64),
            zero_pages: over(rounds, |r| snap(r).zero_pages as f64),
            not_written_pages: Some(over(rounds, |r| snap(r).not_written_pages as f64)),
            hinted_pages: Some(over(rounds, |r| snap(r).hinted_pages as f64)),
        }
    }

    fn qemu(rounds: &[&QemuRound]) -> Self {
        SaveSummary {
            rounds: rounds.len(),
            written_mib: over(rounds, |r| r.written_bytes as f64 / MIB),
            command_s: over(rounds, |r| r.wall_s),
            paused_ms: over(rounds, |r| r.total_ms as f64),
            data_pages: over(rounds, |r| r.normal_pages as f64),
            zero_pages: over(rounds, |r| r.zero_pages as f64),
            not_written_pages: None,
            hinted_pages: None,
        }
    }
}

/// Restore against boot, each to the agent's answer, over one mode's
/// rounds.
#[derive(Serialize)]
struct RestoreSummary {
    boot_to_agent_s: Spread,
    restore_to_agent_s: Spread,
    /// The medians' ratio, boot over restore.
    #[serde(serialize_with = "json::decimals::<2, _>")]
    boot_over_restore: f64,
    restore_ms: Spread,
}

/// One mode's figures.
#[derive(Serialize)]
struct ModeSummary {
    no_hint: SaveSummary,
    hint: SaveSummary,
    restore: RestoreSummary,
}

/// A goal of issue 39 and whether the medians meet it.
#[derive(Serialize)]
struct Goal {
    goal: String,
    #[serde(serialize_with = "json::decimals::<3, _>")]
    value: f64,
    met: bool,
}

impl Goal {
    /// `value` must be at most `bound` (`at_most`) or at least it; not met
    /// if it could not be measured.
    fn new(goal: String, value: f64, bound: f64, at_most: bool) -> Self {
        let met = value.is_finite()
            && if at_most {
                value <= bound
            } else {
                value >= bound
            };
        Goal { goal, value, met }
    }
}

/// target/bench/snapshot.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    kernel: &'a str,
    guest_mib: u64,
    vcpus: u32,
    written_and_removed_mib: u64,
    idle_s: u64,
    rounds: usize,
    /// Per Tidal mode (`reporting_off`, `demo`).
    #[serde(serialize_with = "json::ordered_map")]
    tidal: Vec<(&'static str, ModeSummary)>,
    /// Stopped, then `migrate file:` with `max-bandwidth` at
    /// `qemu_max_bandwidth`; no free page hinting.
    qemu: SaveSummary,
    qemu_max_bandwidth: &'static str,
    goals: &'a [Goal],
    tidal_runs: &'a [TidalRound],
    qemu_runs: &'a [QemuRound],
    /// Rounds that did not complete, with why and the session's log.
    failures: &'a [String],
}

pub fn run(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    let fixture = build_initramfs(root, &memtool_path(root))?;
    check_configs(root, &fixture)?;
    let mut tidal = Vec::new();
    let mut qemu = Vec::new();
    let mut failures = Vec::new();
    for round in 1..=ROUNDS {
        for mode in Mode::BOTH {
            eprintln!(
                "bench: snapshot round {round}/{ROUNDS}: Tidal, {} ...",
                mode.label()
            );
            match tidal_round(root, artifacts, mode, round) {
                Ok(r) => {
                    eprintln!(
                        "bench: {:.1} MiB written with --no-hint, {:.1} MiB with hinting; boot to agent {:.2} s, restore to agent {:.2} s",
                        r.no_hint.written_bytes as f64 / MIB,
                        r.hint.written_bytes as f64 / MIB,
                        r.boot_to_agent_s,
                        r.restore_to_agent_s
                    );
                    tidal.push(r);
                }
                Err(e) => {
                    let e = format!("round {round}, Tidal, {}: {e}", mode.label());
                    eprintln!("bench: snapshot {e}");
                    failures.push(e);
                }
            }
        }
        eprintln!("bench: snapshot round {round}/{ROUNDS}: QEMU ...");
        match qemu_round(root, artifacts, &fixture, round) {
            Ok(r) => {
                eprintln!(
                    "bench: QEMU saved {:.1} MiB in {} ms",
                    r.written_bytes as f64 / MIB,
                    r.total_ms
                );
                qemu.push(r);
            }
            Err(e) => {
                let e = format!("round {round}, QEMU: {e}");
                eprintln!("bench: snapshot {e}");
                failures.push(e);
            }
        }
    }
    report(root, &fixture, &tidal, &qemu, &failures)?;
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "bench snapshot: {} of {} boots failed:\n{}",
            failures.len(),
            ROUNDS * 3,
            failures.join("\n")
        ))
    }
}

/// `median [min-max]` with `d` decimals.
fn cell(s: &Spread, d: usize) -> String {
    format!("{:.d$} [{:.d$}-{:.d$}]", s.median, s.min, s.max)
}

fn report(
    root: &Path,
    fixture: &LinuxFixture,
    tidal: &[TidalRound],
    qemu: &[QemuRound],
    failures: &[String],
) -> Result<(), String> {
    let qemu_rounds: Vec<&QemuRound> = qemu.iter().collect();
    let qemu_summary = SaveSummary::qemu(&qemu_rounds);
    let mut modes = Vec::new();
    for mode in Mode::BOTH {
        let rounds: Vec<&TidalRound> = tidal.iter().filter(|r| r.mode == mode.key()).collect();
        let boot = over(&rounds, |r| r.boot_to_agent_s);
        let restore = over(&rounds, |r| r.restore_to_agent_s);
        modes.push((
            mode,
            ModeSummary {
                no_hint: SaveSummary::tidal(&rounds, |r| &r.no_hint),
                hint: SaveSummary::tidal(&rounds, |r| &r.hint),
                restore: RestoreSummary {
                    boot_to_agent_s: boot,
                    restore_to_agent_s: restore,
                    boot_over_restore: boot.median / restore.median,
                    restore_ms: over(&rounds, |r| r.restore_ms as f64),
                },
            },
        ));
    }

    println!();
    println!(
        "Snapshot, Linux {} guest, {GUEST_MIB} MiB, {} vCPUs, after {WRITE_MIB} MiB of random data written to a tmpfs and removed, {} s idle;",
        fixture.kernel_release,
        linux::VCPUS,
        IDLE.as_secs()
    );
    println!(
        "wall time, {ROUNDS} rounds (Tidal reporting off, Tidal with the demo's features, QEMU); median [min-max]. QEMU: stopped, then"
    );
    println!(
        "`migrate file:` with max-bandwidth {QEMU_BANDWIDTH} (its 128 MiB/s default lifted), its device without free page hinting"
    );
    println!("(QEMU 10.0.2 aborts at boot with free-page-hint=on under TCG)");
    println!();
    println!(
        "{:<38} {:>21} {:>20} {:>20} {:>8} {:>6} {:>8} {:>8}",
        "save (rounds)",
        "MiB written",
        "time (s) [1]",
        "paused (ms) [2]",
        "data",
        "zero",
        "not wr.",
        "hinted"
    );
    let mut rows: Vec<(String, &SaveSummary)> = Vec::new();
    for (mode, summary) in &modes {
        rows.push((
            format!("Tidal, {}, --no-hint", mode.label()),
            &summary.no_hint,
        ));
        rows.push((format!("Tidal, {}, hinting", mode.label()), &summary.hint));
    }
    rows.push(("QEMU, stop + migrate file:".to_string(), &qemu_summary));
    for (label, s) in &rows {
        let pages = |v: Option<&Spread>| v.map_or("n/a".into(), |v| format!("{:.0}", v.median));
        println!(
            "{:<38} {:>21} {:>20} {:>20} {:>8} {:>6} {:>8} {:>8}",
            format!("{label} ({})", s.rounds),
            cell(&s.written_mib, 1),
            cell(&s.command_s, 2),
            cell(&s.paused_ms, 0),
            pages(Some(&s.data_pages)),
            pages(Some(&s.zero_pages)),
            pages(s.not_written_pages.as_ref()),
            pages(s.hinted_pages.as_ref())
        );
    }
    for line in [
        "MiB written: Tidal's as the shell prints it (0.1 MiB, rounded down), QEMU's the file's size. Pages (medians):",
        "data and zero pages saved, pages not written (ballooned, freed or never touched), pages the guest hinted for it.",
        "[1] Tidal: from typing `snapshot` to its `saved` line, the hinting run included; QEMU: from `migrate` to the",
        "    `info migrate` (polled every 20 ms) that shows it completed.",
        "[2] Tidal: the pause the hypervisor reports (its vCPUs stopping, then the write); QEMU: `info migrate`'s total",
        "    time, the guest stopped throughout. QEMU's data pages are its `normal` pages, its zero pages `duplicate`",
        "    (a few bytes each in its file).",
    ] {
        println!("{line}");
    }
    println!();
    println!(
        "{:<34} {:>24} {:>24} {:>14} {:>24}",
        "to the agent's answer", "boot (s)", "restore (s)", "boot/restore", "restore itself (ms)"
    );
    for (mode, summary) in &modes {
        let r = &summary.restore;
        println!(
            "{:<34} {:>24} {:>24} {:>14} {:>24}",
            format!("Tidal, {}", mode.label()),
            cell(&r.boot_to_agent_s, 2),
            cell(&r.restore_to_agent_s, 2),
            format!("{:.1}", r.boot_over_restore),
            cell(&r.restore_ms, 0)
        );
    }
    println!(
        "boot: from QEMU's start to the agent's first answer; restore: from typing `restore` (after `stop`) to the"
    );
    println!("answer to a request sent once the VM runs again (same boot).");

    let mut goals = Vec::new();
    for (mode, summary) in &modes {
        let cut = summary.hint.written_mib.median / summary.no_hint.written_mib.median;
        // With free page reporting the freed pages are back before the
        // --no-hint snapshot: only reporting off measures what hinting cuts.
        if *mode == Mode::HintOnly {
            goals.push(Goal::new(
                format!(
                    "hinting cuts the bytes by 80% or more ({}: hinting / --no-hint <= 0.2)",
                    mode.label()
                ),
                cut,
                0.2,
                true,
            ));
        }
        goals.push(Goal::new(
            format!(
                "Tidal with hinting writes no more than QEMU ({}: Tidal / QEMU <= 1)",
                mode.label()
            ),
            summary.hint.written_mib.median / qemu_summary.written_mib.median,
            1.0,
            true,
        ));
        goals.push(Goal::new(
            format!(
                "a restore reaches the agent 10 times as fast as a boot ({}: boot / restore >= 10)",
                mode.label()
            ),
            summary.restore.boot_over_restore,
            10.0,
            false,
        ));
    }
    println!();
    for g in &goals {
        println!(
            "goal: {}: {:.3}, {}",
            g.goal,
            g.value,
            if g.met { "met" } else { "NOT met" }
        );
    }
    let (_, demo) = modes
        .iter()
        .find(|(m, _)| *m == Mode::Demo)
        .expect("both modes summed up");
    println!(
        "(with the demo's features, hinting / --no-hint: {:.3}: free page reporting gives freed pages back before any snapshot)",
        demo.hint.written_mib.median / demo.no_hint.written_mib.median
    );
    for f in failures {
        println!("FAILED: {f}");
    }

    let path = bench_dir(root).join("snapshot.json");
    json::write(
        &path,
        &Report {
            benchmark: "snapshot",
            kernel: &fixture.kernel_release,
            guest_mib: GUEST_MIB,
            vcpus: linux::VCPUS,
            written_and_removed_mib: WRITE_MIB,
            idle_s: IDLE.as_secs(),
            rounds: ROUNDS,
            tidal: modes.into_iter().map(|(m, s)| (m.key(), s)).collect(),
            qemu: qemu_summary,
            qemu_max_bandwidth: QEMU_BANDWIDTH,
            goals: &goals,
            tidal_runs: tidal,
            qemu_runs: qemu,
            failures,
        },
    )?;
    println!("written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_as_printed() {
        assert_eq!(parse_size("93.5 MiB"), Some(93 * (1 << 20) + (1 << 20) / 2));
        assert_eq!(parse_size("12 KiB"), Some(12 << 10));
        assert_eq!(parse_size("512 bytes"), Some(512));
        assert_eq!(parse_size("1.25 MiB"), None);
        assert_eq!(parse_size("3 GiB"), None);
    }

    #[test]
    fn info_migrate_fields_are_read() {
        let info = "Migration status: completed\ntotal time: 6532 ms\nduplicate: 79718 pages\nnormal: 215228 pages\nnormal bytes: 860912 kbytes";
        assert_eq!(migrate_field(info, "Migration status"), Some("completed"));
        assert_eq!(migrate_field(info, "total time"), Some("6532"));
        assert_eq!(migrate_field(info, "normal"), Some("215228"));
        assert_eq!(migrate_field(info, "duplicate"), Some("79718"));
        assert_eq!(migrate_field(info, "downtime"), None);
    }

    #[test]
    fn the_bundles_run_the_qemu_sides_guest_with_their_balloons() {
        let root = crate::root();
        let dir = root.join("target").join("fixtures").join("linux");
        let fixture = LinuxFixture {
            kernel: dir.join("Image"),
            initramfs: dir.join("initramfs.cpio"),
            kernel_release: String::new(),
            busybox_version: String::new(),
        };
        check_configs(&root, &fixture).unwrap();
    }

    #[test]
    fn the_workload_fits_in_one_typed_line() {
        assert!(workload().len() < 1000, "{}", workload());
        assert!(workload().contains(&format!("count={WRITE_MIB} ")));
    }

    #[test]
    fn goals_need_a_measured_value() {
        assert!(Goal::new(String::new(), 0.1, 0.2, true).met);
        assert!(!Goal::new(String::new(), 0.3, 0.2, true).met);
        assert!(Goal::new(String::new(), 12.0, 10.0, false).met);
        assert!(!Goal::new(String::new(), f64::NAN, 10.0, false).met);
    }
}
