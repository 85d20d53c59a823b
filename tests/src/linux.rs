//! Linux guests under the hypervisor, seen from the shell: waiting for the
//! Linux fixture's agent to come up in named VMs, running commands through
//! it (guests/linux/README.md's protocol: `run <id> <command>`, answered by
//! the output and `tidal-guest: done <id> rc=<rc>`), and reading the
//! progress lines that background loops in the guests print.

use std::time::Duration;

use regex::Regex;

use crate::session::{HarnessError, Session};

/// How long the shell and a VM's console take to answer a keystroke.
const ANSWER: Duration = Duration::from_secs(20);

/// What a command run by the agent printed and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentReply {
    /// The exit status from `tidal-guest: done <id> rc=<rc>`.
    pub rc: u32,
    /// The VM's console lines between the request and the `done` line,
    /// without the `[<vm>] ` prefix and without the echoed request. Other
    /// output of the VM (kernel messages, background jobs) is included.
    pub lines: Vec<String>,
}

/// Waits until every VM in `vms` has printed `tidal-guest: ready` and then
/// `tidal-guest: agent listening`, in any order between the VMs, in the
/// output from `since` (a [`Session::mark`] taken before the VMs started;
/// lines the session has matched past since then count too). Input typed
/// before the agent opens the console is dropped by the guest's start-up,
/// hence the wait for `agent listening`. A VM that stops on the way fails
/// the wait at once, unless the guest reset it (it starts again).
pub fn wait_for_agents(
    s: &mut Session,
    vms: &[&str],
    since: usize,
    timeout: Duration,
) -> Result<(), HarnessError> {
    for vm in vms {
        let vm_re = regex::escape(vm);
        let mut at = since;
        for line in ["tidal-guest: ready", "tidal-guest: agent listening"] {
            // The guest's line, or the hypervisor's (`tidal: ` first) saying it stopped.
            let either =
                format!(r"(?m)^(?:\[{vm_re}\] ({line})|tidal: \[{vm_re}\] (VM stopped: [^\r\n]*))");
            loop {
                let found = s.expect_since(&mut at, &either, timeout)?;
                if found[1] == line {
                    break;
                }
                if !found[2].starts_with("VM stopped: reset by the guest") {
                    return Err(s.unexpected(format!(
                        "tidal: [{vm}] {} while waiting for `{line}`",
                        found[2]
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Gives the keyboard to `vm`'s console (the shell's `console <vm>`).
pub fn enter_console(s: &mut Session, vm: &str) -> Result<(), HarnessError> {
    s.send_line(&format!("console {vm}"))?;
    s.expect(
        &format!(r"Connected to {}'s console", regex::escape(vm)),
        ANSWER,
    )?;
    Ok(())
}

/// Ctrl-] back to the shell. The prompt drawn after it is not waited for:
/// a guest line may take its place at once (it is drawn again below), and
/// [`Session::run`] finds the prompt its command was typed at.
pub fn leave_console(s: &mut Session) -> Result<(), HarnessError> {
    s.send(&[0x1d])?;
    s.expect(r"\[back to the shell\]\r?\n", ANSWER)?;
    Ok(())
}

/// The longest piece of a request typed at once, with the continuation
/// backslash and the carriage return. The hypervisor queues what the
/// guest's 32-byte receive FIFO cannot hold yet (4 KiB), so a request of any
/// length the guest's tty takes (4095 bytes) arrives whole; longer ones are
/// continued over several lines.
const PIECE: usize = 1024;

/// `request` cut into the lines typed for it: every line but the last ends
/// in the agent's continuation backslash, and each with its line end fits
/// in [`PIECE`] bytes. The request must be ASCII (one byte a character)
/// and must not end in a backslash (the agent would wait for more).
fn request_pieces(request: &str) -> Vec<String> {
    assert!(
        request.is_ascii() && !request.ends_with('\\'),
        "cannot type {request:?} to the agent"
    );
    let chars: Vec<char> = request.chars().collect();
    if chars.len() < PIECE {
        return vec![request.to_string()];
    }
    let mut pieces: Vec<String> = chars
        .chunks(PIECE - 2)
        .map(|c| c.iter().collect::<String>() + "\\")
        .collect();
    let last = pieces.last_mut().expect("at least one piece");
    last.pop();
    pieces
}

/// Runs `command` in `vm` through its agent (request `id`, which must be
/// unique in the session for that VM) and comes back to the shell.
///
/// A request longer than one piece (`PIECE`, 1024 bytes) is typed piece by piece,
/// each after the guest has echoed the one before, so the guest must not
/// print anything else meanwhile (an echo cut by other output is not
/// recognised and times out). A one-piece request is typed at once and its
/// echo is not waited for: background jobs may print during it.
/// Everything the VM prints between the request and its `done` line is
/// returned.
pub fn agent_run(
    s: &mut Session,
    vm: &str,
    id: u32,
    command: &str,
    timeout: Duration,
) -> Result<AgentReply, HarnessError> {
    enter_console(s, vm)?;
    let vm_re = regex::escape(vm);
    let pieces = request_pieces(&format!("run {id} {command}"));
    let multi = pieces.len() > 1;
    for piece in &pieces {
        s.send_line(piece)?;
        if multi {
            let echo = format!(r"\[{vm_re}\] {}\r?\n", regex::escape(piece));
            s.expect(&echo, timeout)?;
        }
    }
    let done = format!(r"(?s)(.*?)\[{vm_re}\] tidal-guest: done {id} rc=(\d+)");
    let found = s.expect(&done, timeout)?;
    leave_console(s)?;
    let prefix = format!("[{vm}] ");
    let echo = format!("run {id} ");
    let lines = found[1]
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix(&prefix))
        .filter(|l| multi || !l.starts_with(&echo))
        .map(str::to_string)
        .collect();
    Ok(AgentReply {
        rc: found[2].parse().expect("the regex matched digits"),
        lines,
    })
}

/// One `progress <n> <uptime>` line of a guest's background loop (see
/// `progress_loop`): the iteration number and the guest's /proc/uptime in
/// seconds, with the line's byte offset in the console output.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    pub at: usize,
    pub n: u64,
    pub uptime: f64,
}

/// Every `[<vm>] progress <n> <uptime>` line in `output`, in order (a line
/// may start with the shell's prompt, which ends without a line break).
pub fn progress_lines(output: &str, vm: &str) -> Vec<Progress> {
    let re = Regex::new(&format!(
        r"(?m)\[{}\] progress (\d+) (\d+\.\d+)\r?$",
        regex::escape(vm)
    ))
    .expect("valid regex");
    re.captures_iter(output)
        .map(|c| Progress {
            at: c.get(0).expect("group 0").start(),
            n: c[1].parse().expect("digits"),
            uptime: c[2].parse().expect("a decimal"),
        })
        .collect()
}

/// A shell command for the agent that starts `body` as a background loop
/// printing `progress <n> <uptime>` to the console after each iteration,
/// until /tmp/stop exists or after `iterations` (so it always ends). The
/// agent's request returns at once: the loop is a separate `sh` whose
/// output goes to /dev/console, not to the agent's pipe (a `( ... ) &`
/// subshell would keep a saved copy of the pipe open, and the agent would
/// wait for the loop). Kept short: every byte is typed into the guest's
/// console. `body` must not contain a single quote.
pub fn progress_loop(body: &str, iterations: u32) -> String {
    assert!(!body.contains('\''), "the loop is quoted with ' ': {body}");
    format!(
        "rm -f /tmp/stop;sh -c 'n=0;while [ ! -e /tmp/stop -a $n -lt {iterations} ];do {body};\
         n=$((n+1));read u x </proc/uptime;echo progress $n $u;done' </dev/null >/dev/console 2>&1 &"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_requests_are_typed_in_pieces_the_tty_takes() {
        assert_eq!(request_pieces("run 1 true"), ["run 1 true"]);
        let short = "x".repeat(PIECE - 1);
        assert_eq!(request_pieces(&short), [short]);
        let long = format!("run 12 echo {}", "z".repeat(PIECE));
        let pieces = request_pieces(&long);
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].len(), PIECE - 1);
        for p in &pieces {
            assert!(p.len() < PIECE, "{p:?} and a line end fit");
        }
        let joined: String = pieces.iter().map(|p| p.trim_end_matches('\\')).collect();
        assert_eq!(joined, long);
        let exact = "y".repeat(2 * (PIECE - 2));
        assert_eq!(request_pieces(&exact).len(), 2);
        assert!(!request_pieces(&exact)[1].ends_with('\\'));
    }

    #[test]
    #[should_panic(expected = "cannot type")]
    fn a_request_ending_in_a_backslash_is_refused() {
        request_pieces("run 1 echo \\");
    }

    #[test]
    fn progress_lines_of_one_vm_in_order() {
        let out = "[a] progress 1 10.50\r\n[b] progress 1 3.00\r\n[a] run 2 x\r\n\
                   tidal> [a] progress 2 10.75\r\n[a] progress 3 1x.0\r\n[a] progress 4 11.25\n";
        let a = progress_lines(out, "a");
        let got: Vec<(u64, f64)> = a.iter().map(|p| (p.n, p.uptime)).collect();
        assert_eq!(got, [(1, 10.5), (2, 10.75), (4, 11.25)]);
        assert_eq!(&out[a[1].at..a[1].at + 14], "[a] progress 2");
        assert!(progress_lines("[a] progress 5 1.00 more", "a").is_empty());
        assert_eq!(progress_lines(out, "b").len(), 1);
        assert!(progress_lines(out, "c").is_empty());
    }

    #[test]
    fn progress_loop_is_one_background_command() {
        let cmd = progress_loop("usleep 100000", 60);
        assert!(cmd.starts_with("rm -f /tmp/stop;sh -c '"), "{cmd}");
        assert!(cmd.ends_with(">/dev/console 2>&1 &"), "{cmd}");
        assert!(
            cmd.contains("$n -lt 60 ];do usleep 100000;n=$((n+1));"),
            "{cmd}"
        );
        assert_eq!(cmd.matches('\'').count(), 2, "{cmd}");
    }

    #[test]
    #[should_panic(expected = "quoted")]
    fn progress_loop_refuses_a_quote() {
        progress_loop("echo 'x'", 1);
    }
}

use std::time::Instant;

/// How many processes the kernel of `vm` killed for lack of memory, from
/// its console lines in `output`: lines with `Killed process` (the OOM
/// killer's `Out of memory: Killed process <pid> (<name>) ...`, at error
/// level, so shown under `quiet`) or, if more, `oom-kill:` summary lines
/// (info level, one per kill).
pub fn oom_kills(output: &str, vm: &str) -> usize {
    let prefix = format!("[{vm}] ");
    let (mut killed, mut summaries) = (0, 0);
    for line in output.lines() {
        let line = line.strip_prefix(crate::PROMPT).unwrap_or(line);
        let Some(text) = line.strip_prefix(&prefix) else {
            continue;
        };
        killed += usize::from(text.contains("Killed process"));
        summaries += usize::from(text.contains("oom-kill:"));
    }
    killed.max(summaries)
}

/// Runs the shell's `mm raw` and parses it ([`crate::console::parse_mm_raw`]).
pub fn mm_raw(
    s: &mut Session,
    timeout: Duration,
) -> Result<crate::console::MmReport, HarnessError> {
    let out = s.run("mm raw", timeout)?;
    crate::console::parse_mm_raw(&out).map_err(|e| s.unexpected(format!("`mm raw`: {e}:\n{out}")))
}

/// A shell command for the agent that starts a silent background loop
/// making memory come and go: write `mib` MiB of zeros to
/// `/tmp/s<tag>` (tmpfs, so shmem pages, not reclaimable cache) and delete
/// it, until `/tmp/q<tag>` exists or after `iterations`, counting finished
/// iterations in `/tmp/n<tag>`. It prints nothing, so requests typed in
/// pieces to the same VM are not cut by its output; the agent's request
/// returns at once (see [`progress_loop`]). Stop it with [`churn_stop`].
pub fn churn_loop(tag: u32, mib: u64, iterations: u32) -> String {
    format!(
        "sh -c 'n=0;while [ ! -e /tmp/q{tag} -a $n -lt {iterations} ];do \
         dd if=/dev/zero of=/tmp/s{tag} bs=1M count={mib} 2>/dev/null;rm -f /tmp/s{tag};\
         n=$((n+1));echo $n >/tmp/n{tag};done' </dev/null >/dev/null 2>&1 &"
    )
}

/// The agent command that stops [`churn_loop`] `tag` after its current
/// iteration and prints how many iterations it has finished (nothing if
/// none).
pub fn churn_stop(tag: u32) -> String {
    format!("touch /tmp/q{tag};cat /tmp/n{tag} 2>/dev/null")
}

/// One phase of a memory demand scenario ([`hog_phase`]): `tidal-mem hog`
/// in one VM while [`churn_loop`]s run in others, with the hypervisor's
/// `mm raw` sampled all along.
#[derive(Debug, Clone)]
pub struct HogPhase<'a> {
    /// The VM that runs `tidal-mem hog <hog_mib> <hold_s>`.
    pub vm: &'a str,
    /// The VMs that churn meanwhile (their agents must be idle).
    pub churn_vms: &'a [&'a str],
    pub hog_mib: u64,
    /// How long the hog holds its memory once touched.
    pub hold_s: u64,
    /// MiB each churn iteration writes and deletes.
    pub churn_mib: u64,
    /// The phase's agent request ids are `id` (churn start), `id + 1` (the
    /// hog) and `id + 2` (churn stop); also the churn loops' tag.
    pub id: u32,
    pub sample_every: Duration,
    /// From sending the hog's request until its `done` line, at most.
    pub timeout: Duration,
    /// How long sampling goes on after the hog ended, while its memory
    /// goes back.
    pub settle: Duration,
    /// Time zero of the samples' `t_s`.
    pub origin: Instant,
}

/// `mm raw` at a moment of a scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct MmSample {
    /// Seconds from [`HogPhase::origin`] to the command's answer.
    pub t_s: f64,
    pub report: crate::console::MmReport,
}

/// What one [`hog_phase`] saw.
#[derive(Debug, Clone, PartialEq)]
pub struct HogOutcome {
    /// When the hog's request was sent, from [`HogPhase::origin`].
    pub start_s: f64,
    /// When the phase ended (churn stopped, last sample), from the origin.
    pub end_s: f64,
    /// From sending the hog's request until `hog: touched` arrived: the
    /// demand met. `None` if it never was.
    pub demand_met_s: Option<f64>,
    /// The hog's exit status (137: killed); `None` if no `done` line came
    /// within the timeout.
    pub rc: Option<u32>,
    /// The hog printed `hog: released`.
    pub released: bool,
    /// The hog's VM stopped.
    pub stopped: bool,
    /// Per churning VM, the iterations its loop finished.
    pub churn_iterations: Vec<(String, u64)>,
    /// Every sample, the first before the churn started, the last after it
    /// stopped.
    pub samples: Vec<MmSample>,
}

impl HogOutcome {
    /// The hog touched all its memory and exited with 0.
    pub fn completed(&self) -> bool {
        self.demand_met_s.is_some() && self.rc == Some(0)
    }

    /// Pages the manager moved during the phase: over every VM, the growth
    /// of its `reclaimed` and `given` counters from the first sample to the
    /// last.
    pub fn pages_moved(&self) -> u64 {
        self.growth(|v| v.reclaimed) + self.growth(|v| v.given)
    }

    /// The longest wait for a frame that ended during the phase, in µs,
    /// when it was the longest its VM had had (`mm raw`'s
    /// `wait_longest_us` grew); `None` when no VM's grew: every wait of
    /// the phase was shorter than one before it, and
    /// `growth(|v| v.waits_slow)` says whether any took over 100 ms.
    pub fn longest_new_wait_us(&self) -> Option<u64> {
        let (first, last) = (self.samples.first()?, self.samples.last()?);
        last.report
            .vms
            .iter()
            .filter(|vm| {
                let before = first.report.vm(&vm.name).map_or(0, |v| v.wait_longest_us);
                vm.wait_longest_us > before
            })
            .map(|vm| vm.wait_longest_us)
            .max()
    }

    /// Over every VM, how much `counter` grew from the phase's first sample
    /// to its last (a VM the first did not list counts from 0).
    pub fn growth(&self, counter: impl Fn(&crate::console::MmVm) -> u64) -> u64 {
        let (Some(first), Some(last)) = (self.samples.first(), self.samples.last()) else {
            return 0;
        };
        last.report
            .vms
            .iter()
            .map(|vm| counter(vm).saturating_sub(first.report.vm(&vm.name).map_or(0, &counter)))
            .sum()
    }
}

/// Runs one phase: a sample; a [`churn_loop`] started in each of
/// `churn_vms`; `tidal-mem hog` started in `vm` from its console, the
/// shell back at once; `mm raw` sampled every `sample_every` until the
/// hog's `done` line (or its VM stopping, or the timeout), then for
/// `settle`; the churn stopped; a last sample. A hog that fails, is killed
/// or does not finish is reported in the outcome, not as an error; an error
/// is the harness's (a command that did not answer, `mm raw` unreadable).
pub fn hog_phase(s: &mut Session, phase: &HogPhase<'_>) -> Result<HogOutcome, HarnessError> {
    let since = |at: Instant| at.saturating_duration_since(phase.origin).as_secs_f64();
    // A guest's line printed while the shell prints one of its own can cut
    // it: a report that does not parse is asked for again, twice.
    let sample = |s: &mut Session| -> Result<MmSample, HarnessError> {
        let mut tries = 0;
        loop {
            tries += 1;
            match mm_raw(s, ANSWER) {
                Ok(report) => {
                    return Ok(MmSample {
                        t_s: since(Instant::now()),
                        report,
                    })
                }
                Err(e) if e.kind == crate::ErrorKind::Unexpected && tries < 3 => {}
                Err(e) => return Err(e),
            }
        }
    };
    let mut samples = vec![sample(s)?];
    for vm in phase.churn_vms {
        let cmd = churn_loop(phase.id, phase.churn_mib, 100_000);
        let reply = agent_run(s, vm, phase.id, &cmd, phase.timeout)?;
        if reply.rc != 0 {
            return Err(s.unexpected(format!(
                "[{vm}] churn loop did not start (rc={}): {:?}",
                reply.rc, reply.lines
            )));
        }
    }

    let vm_re = regex::escape(phase.vm);
    let hog_id = phase.id + 1;
    let events = format!(
        r"\[{vm_re}\] (?:hog: (touched|released) \d+ MiB|tidal-guest: done {hog_id} rc=(\d+))|tidal: \[{vm_re}\] (VM stopped)"
    );
    let mut at = s.mark();
    enter_console(s, phase.vm)?;
    let pieces = request_pieces(&format!(
        "run {hog_id} tidal-mem hog {} {}",
        phase.hog_mib, phase.hold_s
    ));
    for piece in &pieces {
        s.send_line(piece)?;
        if pieces.len() > 1 {
            s.expect(
                &format!(r"\[{vm_re}\] {}\r?\n", regex::escape(piece)),
                ANSWER,
            )?;
        }
    }
    let sent = Instant::now();
    leave_console(s)?;

    let mut outcome = HogOutcome {
        start_s: since(sent),
        end_s: 0.0,
        demand_met_s: None,
        rc: None,
        released: false,
        stopped: false,
        churn_iterations: Vec::new(),
        samples: Vec::new(),
    };
    let deadline = sent + phase.timeout;
    let mut next_sample = Instant::now();
    // When the latest sample's answer came: an event its command's output
    // passed over arrived before then.
    let mut answered = Instant::now();
    let mut ended = None;
    while ended.is_none() {
        let now = Instant::now();
        if now >= next_sample {
            samples.push(sample(s)?);
            answered = Instant::now();
            next_sample = answered + phase.sample_every;
            continue;
        }
        if now >= deadline {
            break;
        }
        let before = s.mark();
        let found = match s.expect_since(&mut at, &events, next_sample.min(deadline) - now) {
            Ok(found) => found,
            Err(e) if e.kind == crate::ErrorKind::Timeout => continue,
            Err(e) => return Err(e),
        };
        let when = if at > before {
            s.matched_at().unwrap_or_else(Instant::now)
        } else {
            answered
        };
        match (found[1].as_str(), found[2].as_str(), found[3].is_empty()) {
            ("touched", _, _) => {
                outcome.demand_met_s = Some(when.saturating_duration_since(sent).as_secs_f64())
            }
            ("released", _, _) => outcome.released = true,
            (_, "", false) => {
                outcome.stopped = true;
                ended = Some(when);
            }
            (_, rc, _) => {
                outcome.rc = rc.parse().ok();
                ended = Some(when);
            }
        }
    }

    if let Some(ended) = ended {
        while ended.elapsed() < phase.settle {
            let wait = next_sample.saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            samples.push(sample(s)?);
            next_sample = Instant::now() + phase.sample_every;
        }
    }
    for vm in phase.churn_vms {
        let reply = agent_run(s, vm, phase.id + 2, &churn_stop(phase.id), phase.timeout)?;
        let iterations = reply
            .lines
            .iter()
            .find_map(|l| l.trim().parse().ok())
            .unwrap_or(0);
        outcome.churn_iterations.push((vm.to_string(), iterations));
    }
    samples.push(sample(s)?);
    outcome.end_s = since(Instant::now());
    outcome.samples = samples;
    Ok(outcome)
}

#[cfg(test)]
mod scenario_tests {
    use super::*;
    use crate::console::{MmPool, MmReport, MmVm};

    #[test]
    fn oom_kills_are_counted_per_vm() {
        let out = "[vma] [   12.5] tidal-mem invoked oom-killer: gfp_mask=0x140dca\r\n\
                   [vma] [   12.6] Out of memory: Killed process 93 (tidal-mem) total-vm:716812kB\r\n\
                   tidal> [vmb] Out of memory: Killed process 7 (sh)\n\
                   [vmc] oom-kill:constraint=CONSTRAINT_NONE,task=dd,pid=5\n\
                   [vmc] Memory cgroup out of memory: Killed process 5 (dd)\n\
                   [vmc] oom-kill:constraint=CONSTRAINT_NONE,task=dd,pid=6\n\
                   tidal: [vmd] VM stopped: Killed process\n";
        assert_eq!(oom_kills(out, "vma"), 1);
        assert_eq!(oom_kills(out, "vmb"), 1, "after the prompt");
        assert_eq!(oom_kills(out, "vmc"), 2, "the summaries when more");
        assert_eq!(
            oom_kills(out, "vmd"),
            0,
            "hypervisor lines are not the guest's"
        );
    }

    #[test]
    fn churn_commands() {
        let start = churn_loop(21, 150, 500);
        assert!(start.starts_with("sh -c 'n=0;while [ ! -e /tmp/q21 -a $n -lt 500 ];do "));
        assert!(start.contains("of=/tmp/s21 bs=1M count=150 "), "{start}");
        assert!(start.ends_with("' </dev/null >/dev/null 2>&1 &"), "{start}");
        assert_eq!(start.matches('\'').count(), 2, "{start}");
        assert_eq!(request_pieces(&format!("run 21 {start}")).len(), 1);
        assert_eq!(churn_stop(21), "touch /tmp/q21;cat /tmp/n21 2>/dev/null");
    }

    #[test]
    fn pages_moved_sums_both_counters_over_the_phase() {
        let report = |counters: &[(&str, u64, u64)]| MmReport {
            pool: MmPool::default(),
            vms: counters
                .iter()
                .map(|&(name, reclaimed, given)| MmVm {
                    name: name.into(),
                    state: "running".into(),
                    size: 0,
                    backed: 0,
                    balloon: 0,
                    target: 0,
                    returned: 0,
                    min: 0,
                    low: 0,
                    max: 0,
                    weight: 100,
                    congested: false,
                    pressure: false,
                    reclaimed,
                    given,
                    fenced: 0,
                    given_back: 0,
                    withdrawn: 0,
                    waits_slow: 0,
                    wait_longest_us: 0,
                })
                .collect(),
        };
        let sample = |t_s, counters: &[(&str, u64, u64)]| MmSample {
            t_s,
            report: report(counters),
        };
        let mut outcome = HogOutcome {
            start_s: 1.0,
            end_s: 9.0,
            demand_met_s: Some(4.0),
            rc: Some(0),
            released: true,
            stopped: false,
            churn_iterations: vec![],
            samples: vec![
                sample(0.5, &[("a", 10, 0), ("b", 0, 5)]),
                sample(5.0, &[("a", 500, 0), ("b", 0, 5)]),
                sample(9.0, &[("a", 110, 0), ("b", 100, 25), ("c", 7, 0)]),
            ],
        };
        // a: 100 reclaimed; b: 100 + 20; c (new): 7. Only ends count.
        assert_eq!(outcome.pages_moved(), 227);
        assert_eq!(outcome.growth(|v| v.reclaimed), 207);
        assert_eq!(outcome.growth(|v| v.given), 20);
        assert!(outcome.completed());
        outcome.rc = Some(137);
        assert!(!outcome.completed());
        outcome.samples.clear();
        assert_eq!(outcome.pages_moved(), 0);
    }
}

/// The overcommit scenario of issue 12 (guests/tests/overcommit.toml), as
/// `tests/tests/overcommit.rs` and `cargo xtask bench policy` both run it.
pub mod overcommit {
    use std::time::Duration;

    /// The Linux VMs, in the order the hog visits them.
    pub const LINUX: [&str; 3] = ["vma", "vmb", "vmc"];
    /// The bare-metal test guest beside them.
    pub const BETA: &str = "beta";
    pub const HOG_MIB: u64 = 700;
    /// How long the hog holds its memory once touched.
    pub const HOLD_S: u64 = 5;
    /// MiB each churn iteration writes to tmpfs and deletes.
    pub const CHURN_MIB: u64 = 150;
    /// Three Linux guests booting at once on 2 host cores under TCG.
    pub const BOOT: Duration = Duration::from_secs(420);
    /// From the hog's request to its `done` line, at most.
    pub const PHASE: Duration = Duration::from_secs(180);
    /// Sampling after the hog ended, while its memory goes back.
    pub const SETTLE: Duration = Duration::from_secs(10);

    /// An agent command that fills a guest's page cache, what free page
    /// reporting cannot return: an 80 MiB file on an ext2 file system on a
    /// loop device (its image in tmpfs), read once.
    pub const CACHE_SETUP: &str =
        "dd if=/dev/zero of=/tmp/disk bs=1M count=100 2>/dev/null && losetup /dev/loop0 /tmp/disk \
         && mke2fs -q /dev/loop0 && mkdir -p /mnt && mount /dev/loop0 /mnt \
         && dd if=/dev/urandom of=/mnt/f bs=1M count=80 2>/dev/null && sync && cat /mnt/f >/dev/null";
}
