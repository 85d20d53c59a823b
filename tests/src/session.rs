//! A running QEMU: starts it, captures its console into a buffer and a log
//! file, matches expected output, sends input, and guarantees that QEMU ends
//! (hard deadline, kill on drop). Also owns [`HarnessError`].

use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use regex::bytes::Regex;

use crate::console::{crash_image_offset, MemReport, PROMPT};
use crate::qemu::{
    log_dir, qemu_command, qemu_command_line, render_command, Artifacts, Board, NetLink,
    QemuOptions,
};
use crate::symbols::symbolize;

/// QEMU is killed this long after it started unless [`Session::set_deadline`]
/// says otherwise.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(180);

/// How many console lines an error shows.
const TAIL_LINES: usize = 40;

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// QEMU or an artifact is missing, or QEMU could not be started.
    Setup,
    /// Expected output or exit did not come in time.
    Timeout,
    /// QEMU ended before the expected output appeared, or stdin was closed.
    Exited,
    /// A bad regex or another misuse of the harness.
    Usage,
    /// The output rules out what was waited for (e.g. the VM stopped).
    Unexpected,
}

/// A failure, with the evidence: the end of the console and, if the
/// hypervisor printed a crash dump, the symbolized crash site.
#[derive(Debug, Clone)]
pub struct HarnessError {
    pub kind: ErrorKind,
    pub message: String,
    /// The last lines of console output, if QEMU ran.
    pub console_tail: Option<String>,
    /// `function at file:line` of the last `image offset 0x...` on the console.
    pub crash_site: Option<String>,
    /// The full console log.
    pub log: Option<PathBuf>,
}

impl HarnessError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        HarnessError {
            kind,
            message: message.into(),
            console_tail: None,
            crash_site: None,
            log: None,
        }
    }
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message)?;
        if let Some(site) = &self.crash_site {
            write!(f, "\nhypervisor crashed in {site}")?;
        }
        if let Some(tail) = &self.console_tail {
            write!(f, "\n--- last {TAIL_LINES} console lines ---\n{tail}\n---")?;
        }
        if let Some(log) = &self.log {
            write!(f, "\nfull console log: {}", log.display())?;
        }
        Ok(())
    }
}

impl std::error::Error for HarnessError {}

/// Output captured so far, shared with the reader threads.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    /// For each chunk read or noted: the length of `bytes` after it, and
    /// when it arrived (for [`Session::matched_at`]).
    arrivals: Vec<(usize, Instant)>,
    open_streams: usize,
    /// Each erased line, in order: where it started and whether it was the
    /// shell's prompt. A position taken while that line was there and past
    /// its start now points into what came after it, so it moves back to
    /// the start.
    erasures: Vec<Erasure>,
}

/// A line the hypervisor erased (to print other lines above it and draw it
/// again below).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Erasure {
    at: usize,
    prompt: bool,
}

impl Captured {
    fn append(&mut self, chunk: &[u8]) {
        append_as_terminal(&mut self.bytes, chunk, &mut self.erasures);
        self.arrivals.push((self.bytes.len(), Instant::now()));
    }
}

struct Shared {
    captured: Mutex<Captured>,
    grew: Condvar,
    child: Mutex<Child>,
    started: Instant,
    deadline: Mutex<Instant>,
    log: Mutex<File>,
    dropped: Mutex<bool>,
}

impl Shared {
    fn captured(&self) -> MutexGuard<'_, Captured> {
        self.captured.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a harness note to the buffer and the log.
    fn note(&self, text: &str) {
        let line = format!("\n[harness] {text}\n");
        self.captured().append(line.as_bytes());
        let _ = self.log.lock().map(|mut f| f.write_all(line.as_bytes()));
        self.grew.notify_all();
    }
}

/// A running QEMU with its console captured. Dropping it kills QEMU.
/// How long the console must be quiet before a match that ends at the end of
/// the output so far is taken as complete.
const SETTLE: Duration = Duration::from_millis(150);

pub struct Session {
    name: String,
    elf: PathBuf,
    log_path: PathBuf,
    shared: Arc<Shared>,
    stdin: Option<ChildStdin>,
    /// Start of the output not yet consumed by a match.
    cursor: usize,
    /// How many of [`Captured::erasures`] `cursor` has been moved back for.
    erasures_seen: usize,
    threads: Vec<JoinHandle<()>>,
}

impl Session {
    /// Starts `board` under QEMU; `name` names the log file
    /// (`target/test-logs/<name>.log`, which starts with the command line).
    pub fn start(
        name: &str,
        board: Board,
        artifacts: &Artifacts,
        opts: &QemuOptions,
    ) -> Result<Session, HarnessError> {
        let mut needed = vec![("hypervisor image (HV_IMAGE)", &artifacts.image)];
        needed.extend(opts.initrd.iter().map(|p| ("initrd (HV_BUNDLE)", p)));
        needed.extend(opts.dtb.iter().map(|p| ("device tree (HV_PI4_DTB)", p)));
        for (what, path) in needed {
            if !path.is_file() {
                return Err(HarnessError::new(
                    ErrorKind::Setup,
                    format!(
                        "{what} {} not found: build it with `cargo xtask`",
                        path.display()
                    ),
                ));
            }
        }

        let command_line = qemu_command_line(board, artifacts, opts);
        Self::spawn(
            name,
            qemu_command(board, artifacts, opts),
            &command_line,
            &artifacts.elf,
        )
    }

    /// Starts `command` (any QEMU command line, e.g. a guest run directly
    /// under QEMU without the hypervisor) as a session like [`Session::start`]
    /// does; its stdio is set here. `elf` symbolizes hypervisor crash dumps.
    pub fn start_command(
        name: &str,
        command: Command,
        elf: &Path,
    ) -> Result<Session, HarnessError> {
        let command_line = render_command(&command);
        Self::spawn(name, command, &command_line, elf)
    }

    fn spawn(
        name: &str,
        mut command: Command,
        command_line: &str,
        elf: &Path,
    ) -> Result<Session, HarnessError> {
        let log_path = log_dir().join(format!("{name}.log"));
        let mut log = File::create(&log_path).map_err(|e| {
            HarnessError::new(
                ErrorKind::Setup,
                format!("cannot create {}: {e}", log_path.display()),
            )
        })?;
        let _ = writeln!(log, "$ {command_line}");

        let program = command.get_program().to_string_lossy().into_owned();
        let started = Instant::now();
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                let hint = if e.kind() == std::io::ErrorKind::NotFound {
                    " (is QEMU 10 installed and on PATH?)"
                } else {
                    ""
                };
                HarnessError::new(
                    ErrorKind::Setup,
                    format!("cannot start {program}: {e}{hint}"),
                )
            })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");

        let shared = Arc::new(Shared {
            captured: Mutex::new(Captured {
                bytes: Vec::new(),
                arrivals: Vec::new(),
                open_streams: 2,
                erasures: Vec::new(),
            }),
            grew: Condvar::new(),
            child: Mutex::new(child),
            started,
            deadline: Mutex::new(started + DEFAULT_DEADLINE),
            log: Mutex::new(log),
            dropped: Mutex::new(false),
        });
        let threads = vec![
            spawn_reader(stdout, shared.clone()),
            spawn_reader(stderr, shared.clone()),
            spawn_watchdog(shared.clone()),
        ];
        Ok(Session {
            name: name.to_string(),
            elf: elf.to_path_buf(),
            log_path,
            shared,
            stdin,
            cursor: 0,
            erasures_seen: 0,
            threads,
        })
    }

    /// When QEMU was started (just before the process was spawned).
    pub fn started(&self) -> Instant {
        self.shared.started
    }

    /// When the output that completed the latest match arrived from QEMU:
    /// unlike the time `expect` returns, this does not include the wait for
    /// the console to settle or the matching itself. `None` before any match.
    pub fn matched_at(&self) -> Option<Instant> {
        if self.cursor == 0 {
            return None;
        }
        let captured = self.shared.captured();
        let i = captured
            .arrivals
            .partition_point(|&(end, _)| end < self.cursor);
        captured.arrivals.get(i).map(|&(_, at)| at)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Kills QEMU once `limit` has passed since it started.
    pub fn set_deadline(&self, limit: Duration) {
        *self.shared.deadline.lock().unwrap() = self.shared.started + limit;
    }

    /// Waits until `pattern` (a regex; `(?m)` for line anchors) matches the
    /// output after the previous match. Returns the match and its groups
    /// (unmatched groups as empty strings) and moves past the match.
    pub fn expect(
        &mut self,
        pattern: &str,
        timeout: Duration,
    ) -> Result<Vec<String>, HarnessError> {
        self.expect_span(pattern, timeout).map(|(groups, _)| groups)
    }

    /// Where the output not yet consumed by a match starts; for
    /// [`Session::expect_since`].
    /// Runs `command` (a shell command) until `pattern`'s first group in
    /// its output is a number of at least `min` (see
    /// [`crate::console::first_number`]); that number. An error names the
    /// last output if `within` passes first.
    pub fn poll_command(
        &mut self,
        command: &str,
        pattern: &str,
        min: u64,
        within: Duration,
    ) -> Result<u64, HarnessError> {
        let until = Instant::now() + within;
        loop {
            let out = self.run(command, within)?;
            match crate::console::first_number(&out, pattern) {
                Some(n) if n >= min => return Ok(n),
                _ if Instant::now() >= until => {
                    return Err(self.error(
                        ErrorKind::Timeout,
                        format!(
                        "{}: `{command}` did not show /{pattern}/ >= {min} within {:.1}s:\n{out}",
                        self.name,
                        within.as_secs_f64()
                    ),
                    ))
                }
                _ => thread::sleep(Duration::from_millis(500)),
            }
        }
    }

    /// Starts QEMU on `board` with the bundle `target/bundles/<bundle>.img`
    /// (built by `cargo xtask build` from `guests/tests/<bundle>.toml`); the
    /// log is `<board>-<name>.log`.
    pub fn start_bundle(board: Board, bundle: &str, name: &str) -> Result<Session, HarnessError> {
        let artifacts = Artifacts::locate();
        let mut opts = QemuOptions::for_board(board, &artifacts);
        opts.initrd = Some(
            crate::target_dir()
                .join("bundles")
                .join(format!("{bundle}.img")),
        );
        Session::start(
            &format!("{}-{name}", board.name()),
            board,
            &artifacts,
            &opts,
        )
    }

    /// Two boards on one network: QEMU `board` twice, each with the bundle
    /// `bundle` given its own address (`addresses`, e.g. `["10.0.0.1/24",
    /// "10.0.0.2/24"]`; copies under the test logs), their network cards
    /// joined by a TCP stream on a free port of 127.0.0.1. The first
    /// listens and is started first; the second connects. Logs
    /// `<name>-a.log` and `<name>-b.log`.
    pub fn start_pair(
        board: Board,
        bundle: &Path,
        name: &str,
        addresses: [&str; 2],
    ) -> Result<(Session, Session), HarnessError> {
        let setup = |e: String| HarnessError::new(ErrorKind::Setup, e);
        // A port the system just gave out and took back: free unless
        // another process takes it in between.
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| setup(format!("no free TCP port: {e}")))?
            .port();
        let artifacts = Artifacts::locate();
        let links = [
            NetLink::Listen(port),
            NetLink::Connect("127.0.0.1".into(), port),
        ];
        let mut sessions = Vec::new();
        for ((side, address), link) in ["a", "b"].iter().zip(addresses).zip(links) {
            let copy = crate::log_dir().join(format!("{name}-{side}.img"));
            crate::bundle_with_address(bundle, address, &copy).map_err(setup)?;
            let mut opts = QemuOptions::for_board(board, &artifacts);
            opts.initrd = Some(copy);
            opts.net = Some(link);
            sessions.push(Session::start(
                &format!("{name}-{side}"),
                board,
                &artifacts,
                &opts,
            )?);
        }
        let b = sessions.pop();
        match (sessions.pop(), b) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(setup("two sessions were not started".into())),
        }
    }

    /// The position to look from later ([`Session::expect_since`]). In the
    /// line still open at the bottom (the prompt, or a guest line still
    /// arriving) it is that line's start, as the line may be erased and
    /// drawn again.
    pub fn mark(&self) -> usize {
        let captured = self.shared.captured();
        let bytes = &captured.bytes[..self.cursor.min(captured.bytes.len())];
        if captured.bytes[bytes.len()..].contains(&b'\n') {
            return self.cursor;
        }
        bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)
    }

    /// Like [`Session::expect`], but looks from `*since` (an earlier
    /// [`Session::mark`]), so it also finds output that later matches have
    /// already passed over (a VM that came up while the test talked to
    /// another). Moves `*since` past the match; the session's own position
    /// moves past it too unless it is already further.
    pub fn expect_since(
        &mut self,
        since: &mut usize,
        pattern: &str,
        timeout: Duration,
    ) -> Result<Vec<String>, HarnessError> {
        let saved = self.cursor;
        self.cursor = *since;
        let result = self.expect_span(pattern, timeout);
        *since = self.cursor;
        self.cursor = self.cursor.max(saved);
        result.map(|(groups, _)| groups)
    }

    /// An [`ErrorKind::Unexpected`] error with the console's tail, for a
    /// caller that saw output ruling out what it waited for.
    pub fn unexpected(&self, message: String) -> HarnessError {
        self.error(ErrorKind::Unexpected, format!("{}: {message}", self.name))
    }

    /// Waits until every bare-metal test guest in `vms` has said its balloon
    /// is set up (`testguest: balloon at`), in whatever order they come up:
    /// looking from the start of the output, so a guest that came up while
    /// the test waited for another is found too.
    pub fn await_test_guests(
        &mut self,
        vms: &[&str],
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let mut waiting: Vec<&str> = vms.to_vec();
        let mut since = 0;
        while !waiting.is_empty() {
            let any = format!(r"\[({})\] testguest: balloon at ", waiting.join("|"));
            let name = self.expect_since(&mut since, &any, timeout)?[1].clone();
            waiting.retain(|vm| *vm != name);
        }
        Ok(())
    }

    /// Moves a bare-metal test guest's balloon to `mib` MiB (`balloon <vm>
    /// <mib>M`) and waits until the guest says it reached that target and its
    /// memory pattern is intact.
    pub fn balloon_test_guest(
        &mut self,
        vm: &str,
        mib: u64,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        self.run(&format!("balloon {vm} {mib}M"), timeout)?;
        let pages = mib * 256;
        self.expect(
            &format!(r"\[{vm}\] testguest: balloon target={pages} actual={pages} pages"),
            timeout,
        )?;
        self.expect(&format!(r"\[{vm}\] testguest: pattern ok"), timeout)?;
        Ok(())
    }

    /// Sends `command`, waits for its echo on the shell's line and then for
    /// the next prompt, and returns what the command printed, without `\r`.
    /// Guest lines that arrive while the command is typed are drawn above
    /// the shell's line, so the echo is one line however they fall; those
    /// that arrive after its output, above the prompt drawn again, are left
    /// for later matches, as the prompt that ended the output was erased
    /// where they begin.
    pub fn run(&mut self, command: &str, timeout: Duration) -> Result<String, HarnessError> {
        // The prompt the echo follows may have been matched already (by
        // an `expect` of the first prompt): look from the start of its line.
        {
            let captured = self.shared.captured();
            let cursor = self.cursor.min(captured.bytes.len());
            self.cursor = captured.bytes[..cursor]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
        }
        let erased_before = self.shared.captured().erasures.len();
        self.send_line(command)?;
        let echo = format!(
            r"(?m)^{}{}\r?\n",
            regex::escape(PROMPT),
            regex::escape(command)
        );
        self.expect_span(&echo, timeout)?;
        let from = self.cursor;
        let (_, start) = self.expect_span(&regex::escape(PROMPT), timeout)?;
        let captured = self.shared.captured();
        // The first prompt after the output, if it was erased since.
        let end = captured.erasures[erased_before..]
            .iter()
            .find(|e| e.prompt && e.at >= from)
            .map_or(start, |e| e.at)
            .min(start);
        self.cursor = end;
        Ok(String::from_utf8_lossy(&captured.bytes[from.min(end)..end]).replace('\r', ""))
    }

    fn expect_span(
        &mut self,
        pattern: &str,
        timeout: Duration,
    ) -> Result<(Vec<String>, usize), HarnessError> {
        let re = Regex::new(pattern).map_err(|e| {
            HarnessError::new(ErrorKind::Usage, format!("bad regex /{pattern}/: {e}"))
        })?;
        let until = Instant::now() + timeout;
        let mut captured = self.shared.captured();
        loop {
            // An erased line may have taken back bytes past the cursor.
            for e in &captured.erasures[self.erasures_seen..] {
                self.cursor = self.cursor.min(e.at);
            }
            self.erasures_seen = captured.erasures.len();
            self.cursor = self.cursor.min(captured.bytes.len());
            let found = re.captures(&captured.bytes[self.cursor..]);
            // A match that runs to the end of what has arrived may be cut
            // short (`\w*` over a line still arriving): accept it only once
            // the console has been quiet for a moment, else look again.
            let at_end = found.as_ref().is_some_and(|c| {
                self.cursor + c.get(0).expect("group 0").end() == captured.bytes.len()
            });
            if at_end && captured.open_streams > 0 {
                let len = captured.bytes.len();
                let (next, _) = self.shared.grew.wait_timeout(captured, SETTLE).unwrap();
                captured = next;
                if captured.bytes.len() != len {
                    continue;
                }
            }
            if let Some(c) = re.captures(&captured.bytes[self.cursor..]) {
                let whole = c.get(0).expect("group 0");
                let groups = c
                    .iter()
                    .map(|g| {
                        g.map_or(String::new(), |m| {
                            String::from_utf8_lossy(m.as_bytes()).into()
                        })
                    })
                    .collect();
                let start = self.cursor + whole.start();
                self.cursor += whole.end();
                return Ok((groups, start));
            }
            let now = Instant::now();
            if captured.open_streams == 0 || now >= until {
                let (kind, why) = if captured.open_streams == 0 {
                    (ErrorKind::Exited, "QEMU exited")
                } else {
                    (ErrorKind::Timeout, "timed out")
                };
                drop(captured);
                return Err(self.error(
                    kind,
                    format!(
                        "{}: {why} after {:.1}s waiting for /{pattern}/",
                        self.name,
                        timeout.as_secs_f64()
                    ),
                ));
            }
            captured = self
                .shared
                .grew
                .wait_timeout(captured, until - now)
                .unwrap()
                .0;
        }
    }

    /// Runs `mem` and returns the bytes in accounting category `category`
    /// (e.g. "free", "guest RAM"), after checking that the categories sum
    /// to the RAM size and that the frame table's invariant check passed.
    pub fn mem_category(&mut self, category: &str, timeout: Duration) -> Result<u64, String> {
        let report = self.mem_report(timeout)?;
        report
            .category(category)
            .ok_or_else(|| format!("no '{category}' in the accounting: {:?}", report.categories))
    }

    /// Runs `mem` and parses it, after checking that the categories sum to
    /// the RAM size and that the frame table's invariant check passed.
    pub fn mem_report(&mut self, timeout: Duration) -> Result<MemReport, String> {
        let out = self.run("mem", timeout).map_err(|e| e.to_string())?;
        let report = crate::parse_mem(&out).map_err(|e| format!("{e}:\n{out}"))?;
        if report.total != report.ram_bytes {
            return Err(format!("the accounting does not add up to RAM:\n{out}"));
        }
        if !out.contains("frame table invariants: ok") {
            return Err(format!("the frame table check did not pass:\n{out}"));
        }
        Ok(report)
    }

    /// Runs `check` (the frame table's invariants, every VM's stage-2
    /// tables mapping only its own frames, stopped VMs owning nothing, the
    /// accounting summing to RAM) and returns its `check: ok (…)` line; an
    /// error with the whole output if it printed anything else. Every QEMU
    /// test ends with it while the board is up.
    pub fn check(&mut self, timeout: Duration) -> Result<String, String> {
        let out = self.run("check", timeout).map_err(|e| e.to_string())?;
        let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
        match lines.iter().find(|l| l.starts_with("check: ")) {
            Some(line) if line.starts_with("check: ok (") && !out.contains("check: FAILED") => {
                Ok(line.to_string())
            }
            _ => Err(format!("{}: check did not pass:\n{out}", self.name)),
        }
    }

    /// [`Self::check`] for a test: panics with the console output (the
    /// test fails) unless it passes within 30 s.
    pub fn assert_check(&mut self) {
        if let Err(e) = self.check(Duration::from_secs(30)) {
            panic!("{e}");
        }
    }

    /// Writes `line` and a carriage return to the console.
    pub fn send_line(&mut self, line: &str) -> Result<(), HarnessError> {
        self.send(format!("{line}\r").as_bytes())
    }

    /// Writes raw bytes to the console.
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), HarnessError> {
        let result = match self.stdin.as_mut() {
            Some(stdin) => stdin.write_all(bytes).and_then(|()| stdin.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        result.map_err(|e| {
            self.error(
                ErrorKind::Exited,
                format!("{}: cannot write to QEMU: {e}", self.name),
            )
        })
    }

    /// Waits for QEMU to exit by itself and for its output to be read.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, HarnessError> {
        let until = Instant::now() + timeout;
        loop {
            let exited = self.shared.child.lock().unwrap().try_wait();
            if let Ok(Some(status)) = exited {
                // Let the readers drain the pipes (bounded: QEMU is gone).
                let mut captured = self.shared.captured();
                let drain_until = Instant::now() + Duration::from_secs(2);
                while captured.open_streams > 0 && Instant::now() < drain_until {
                    captured = self
                        .shared
                        .grew
                        .wait_timeout(captured, Duration::from_millis(50))
                        .unwrap()
                        .0;
                }
                return Ok(status);
            }
            if Instant::now() >= until {
                return Err(self.error(
                    ErrorKind::Timeout,
                    format!(
                        "{}: QEMU still running after {:.1}s",
                        self.name,
                        timeout.as_secs_f64()
                    ),
                ));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything QEMU printed so far (console and QEMU's own messages).
    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.shared.captured().bytes).into_owned()
    }

    /// An error carrying the console tail and the symbolized crash site.
    fn error(&self, kind: ErrorKind, message: String) -> HarnessError {
        let output = self.output();
        let lines: Vec<&str> = output.lines().map(|l| l.trim_end_matches('\r')).collect();
        let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
        let crash_site = crash_image_offset(&output).map(|offset| {
            let site = symbolize(&self.elf, offset).unwrap_or_else(|| "?? (no debug info)".into());
            format!("{site} (image offset {offset:#x})")
        });
        HarnessError {
            kind,
            message,
            console_tail: Some(tail),
            crash_site,
            log: Some(self.log_path.clone()),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        *self
            .shared
            .dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = true;
        self.stdin = None;
        if let Ok(mut child) = self.shared.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn spawn_reader(mut pipe: impl Read + Send + 'static, shared: Arc<Shared>) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    shared.captured().append(&buf[..n]);
                    let _ = shared.log.lock().map(|mut f| f.write_all(&buf[..n]));
                    shared.grew.notify_all();
                }
            }
        }
        shared.captured().open_streams -= 1;
        shared.grew.notify_all();
    })
}

/// The hypervisor's "erase this line" (carriage return, then VT100 erase
/// line): it redraws the live console's unfinished line below other output.
const ERASE_LINE: &[u8] = b"\r\x1b[2K";

/// Append console bytes as a terminal shows them: an erased line vanishes
/// from the capture, so matching sees each line once, in its final form
/// (the raw bytes still go to the log).
fn append_as_terminal(captured: &mut Vec<u8>, new: &[u8], erasures: &mut Vec<Erasure>) {
    for &byte in new {
        captured.push(byte);
        if captured.ends_with(ERASE_LINE) {
            let end = captured.len() - ERASE_LINE.len();
            let start = captured[..end]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            erasures.push(Erasure {
                at: start,
                prompt: captured[start..].starts_with(PROMPT.as_bytes()),
            });
            captured.truncate(start);
        }
    }
}

/// Kills QEMU at the deadline; ends when QEMU exits or the session is dropped.
fn spawn_watchdog(shared: Arc<Shared>) -> JoinHandle<()> {
    thread::spawn(move || loop {
        if *shared.dropped.lock().unwrap_or_else(|e| e.into_inner()) {
            return;
        }
        {
            let mut child = shared.child.lock().unwrap_or_else(|e| e.into_inner());
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            if Instant::now() >= *shared.deadline.lock().unwrap() {
                let _ = child.kill();
                drop(child);
                shared.note("session deadline reached: QEMU killed");
                return;
            }
        }
        thread::sleep(Duration::from_millis(50));
    })
}

#[cfg(test)]
mod terminal_tests {
    #[test]
    fn erased_lines_vanish_from_the_capture() {
        let (mut c, mut erasures) = (Vec::new(), Vec::new());
        for chunk in [
            &b"[a] x\n[b] pro"[..],
            b"mpt\r",
            b"\x1b[2K[a] y\n[b] prompt ls\n",
        ] {
            super::append_as_terminal(&mut c, chunk, &mut erasures);
        }
        assert_eq!(c, b"[a] x\n[a] y\n[b] prompt ls\n");
        assert_eq!(
            erasures,
            [super::Erasure {
                at: 6,
                prompt: false
            }],
            "where the erased line started"
        );
    }
}
