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

/// Ctrl-] back to the shell; also consumes the prompt after it, so that
/// the next [`Session::run`] waits for a new one.
pub fn leave_console(s: &mut Session) -> Result<(), HarnessError> {
    s.send(&[0x1d])?;
    s.expect(r"\[back to the shell\]\r?\ntidal> ", ANSWER)?;
    Ok(())
}

/// The longest piece of a request typed at once, with the continuation
/// backslash and the carriage return: the guest's PL011 receive FIFO holds
/// 32 bytes, and the hypervisor drops a byte that finds it full while the
/// guest reads nothing for five seconds (a vCPU held up that long is
/// possible on a loaded TCG host), so no more is typed than the FIFO holds
/// before the guest has read it.
const PIECE: usize = 30;

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
/// A request longer than one piece ([`PIECE`]) is typed piece by piece,
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
    fn requests_are_typed_in_pieces_that_fit_the_fifo() {
        assert_eq!(request_pieces("run 1 true"), ["run 1 true"]);
        let short = "x".repeat(PIECE - 1);
        assert_eq!(request_pieces(&short), [short]);
        let long = "run 12 grep -c ^processor /proc/cpuinfo";
        let pieces = request_pieces(long);
        assert_eq!(pieces, ["run 12 grep -c ^processor /p\\", "roc/cpuinfo"]);
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
