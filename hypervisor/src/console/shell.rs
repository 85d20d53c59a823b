//! The operator shell: the command table, parsing, and help. Running a
//! command touches the hardware, so that part lives in `crate::boot`; what
//! the commands print is formatted by `crate::report`.

pub use crate::vm::state::InjectedFailure;

/// A parsed command line; names are the VM names the operator typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command<'a> {
    Help,
    Mem,
    /// Check the memory invariants over the frame table and every VM.
    Check,
    Cpus,
    Vms,
    /// The snapshots on the board's disk.
    Snapshots,
    /// Save a running VM into a snapshot (`name`: or the first free
    /// `<vm>-<n>`).
    Snapshot {
        vm: &'a str,
        name: Option<&'a str>,
        /// `--no-hint`: no hinting run first (what hinting saves is
        /// measured against it).
        hint: bool,
    },
    /// Start a stopped VM (the snapshot's, or `into`) from a snapshot.
    Restore {
        name: &'a str,
        into: Option<&'a str>,
    },
    /// Delete a snapshot from the board's disk.
    Delete {
        name: &'a str,
    },
    /// The board's network card: address, MAC, link, counters.
    Net,
    /// ICMP echo requests to `to`, `count` of them, one at a time (each
    /// answered or given up after a second).
    Ping {
        to: [u8; 4],
        count: u32,
    },
    /// Set the balloon of a VM to this many bytes (rounded down to pages).
    Balloon {
        vm: &'a str,
        bytes: u64,
    },
    /// Hand a VM's balloon back to the memory manager.
    BalloonAuto {
        vm: &'a str,
    },
    InfoBalloon {
        vm: Option<&'a str>,
    },
    /// A VM's exit profile (`reset`: start it over instead).
    InfoExits {
        vm: &'a str,
        reset: bool,
    },
    /// The memory manager: the pool, its watermarks, every VM's memory and
    /// limits, and the manager's counters (`raw`: in pages, for scripts).
    Mm {
        raw: bool,
    },
    /// Who sets the balloon targets: the manager, or a baseline.
    MmPolicy {
        policy: crate::mm::manager::Policy,
    },
    /// Change a VM's memory limit (`value` in bytes, or the weight).
    SetLimit {
        vm: &'a str,
        field: crate::vm::manage::LimitField,
        value: u64,
    },
    /// Poll a VM's balloon statistics every `seconds` (0: stop polling).
    BalloonStats {
        vm: &'a str,
        seconds: u32,
    },
    /// Ask a VM's guest for fresh balloon statistics now.
    StatsNow {
        vm: &'a str,
    },
    /// Start a free page hinting run on a VM.
    Hint {
        vm: &'a str,
    },
    /// Set what a VM gets for a bad access.
    OnBadAccess {
        vm: &'a str,
        policy: crate::vm::fault::OnBadAccess,
    },
    Stop {
        vm: &'a str,
    },
    /// Give the keyboard to a VM's console until Ctrl-].
    Console {
        vm: &'a str,
    },
    Start {
        vm: &'a str,
    },
    PowerOff,
    DebugFault,
    DebugPanic,
    /// Inject a hypervisor failure in a VM's path at its next exit.
    DebugFail {
        vm: &'a str,
        kind: InjectedFailure,
    },
    /// Inject a hypervisor failure into a board service.
    DebugFailBoard {
        service: BoardService,
    },
    /// Inject a hypervisor failure into the memory manager's reading of a
    /// VM's input.
    DebugFailInput {
        vm: &'a str,
    },
    /// Take this many bytes (None: all) from the pool on purpose.
    DebugHog {
        bytes: Option<u64>,
    },
    DebugUnhog,
}

/// A board service `debug fail-board` fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoardService {
    Manager,
    Zeroing,
    Shell,
}

pub struct CommandInfo {
    pub usage: &'static str,
    pub summary: &'static str,
}

pub const COMMANDS: &[CommandInfo] = &[
    CommandInfo {
        usage: "help",
        summary: "this list",
    },
    CommandInfo {
        usage: "mem",
        summary: "RAM banks, and where every byte of RAM is accounted",
    },
    CommandInfo {
        usage: "check",
        summary: "check the frame table, every VM's stage-2 mappings and the accounting (one line)",
    },
    CommandInfo {
        usage: "cpus",
        summary: "the CPUs, how each was started, and its state",
    },
    CommandInfo {
        usage: "vms",
        summary: "the VMs: state, CPU, RAM, pages mapped and ballooned, bad accesses",
    },
    CommandInfo {
        usage: "on-bad-access <vm> <abort|stop>",
        summary: "what a VM gets for a bad access: an injected abort (default) or a stop",
    },
    CommandInfo {
        usage: "balloon <vm> <size>",
        summary: "set a VM's balloon to <size> (K, M or G suffix; 0 gives all back); the memory manager leaves it alone then",
    },
    CommandInfo {
        usage: "balloon <vm> auto",
        summary: "hand a VM's balloon back to the memory manager",
    },
    CommandInfo {
        usage: "mm [raw]",
        summary: "the memory manager: pool and watermarks, each VM's backed, ballooned and returned memory, limits, decisions",
    },
    CommandInfo {
        usage: "mm policy <manager|naive|none>",
        summary: "who sets balloon targets: the manager (default), the naive baseline, or nobody (reporting and hinting alone)",
    },
    CommandInfo {
        usage: "set <vm> <min|low|max|weight> <value>",
        summary: "change a VM's memory limit (e.g. set linux max 768M; weight 1-10000, default 100)",
    },
    CommandInfo {
        usage: "info balloon [vm]",
        summary: "balloon target, actual, features, counters, guest statistics, hinting and exits",
    },
    CommandInfo {
        usage: "info exits <vm>",
        summary: "a VM's exits by kind (device, fault, sysreg, HVC, WFI, IRQ source): count, share, per second, EL2 instructions",
    },
    CommandInfo {
        usage: "info exits <vm> reset",
        summary: "start a VM's exit profile over (it also starts over when the VM starts)",
    },
    CommandInfo {
        usage: "balloon-stats <vm> <seconds|now>",
        summary: "ask a VM's guest for memory statistics every <seconds> (0 stops; default 2), or once now",
    },
    CommandInfo {
        usage: "hint <vm>",
        summary: "ask a VM's guest to hint its free pages, which go back to the pool",
    },
    CommandInfo {
        usage: "console <vm>",
        summary: "type into a VM's console; Ctrl-] comes back here",
    },
    CommandInfo {
        usage: "stop <vm>",
        summary: "stop a VM and return all its pages to the pool",
    },
    CommandInfo {
        usage: "start <vm>",
        summary: "start a stopped VM again from the bundle",
    },
    CommandInfo {
        usage: "snapshots",
        summary: "the snapshots on the board's disk: name, VM, size, when by the guest's clock, board",
    },
    CommandInfo {
        usage: "snapshot <vm> [name] [--no-hint]",
        summary: "save a running VM to the board's disk (free pages it hints, ballooned and zero pages are not written; --no-hint: no hinting run first); it is paused for the copy, then goes on",
    },
    CommandInfo {
        usage: "restore <name> [as <vm>]",
        summary: "start a stopped VM from a snapshot instead of booting it (the snapshot's VM, or another of the same configuration)",
    },
    CommandInfo {
        usage: "delete <name>",
        summary: "delete a snapshot from the board's disk",
    },
    CommandInfo {
        usage: "net",
        summary: "the board's network card (not the guests'): its address, MAC, link, packets and bytes in and out, errors",
    },
    CommandInfo {
        usage: "ping <address> [count]",
        summary: "ICMP echo from the board's address to another (e.g. ping 10.0.0.2 3; count 1 to 100, default 4): each reply with its time, or a timeout after 1 s; the shell goes on meanwhile",
    },
    CommandInfo {
        usage: "poweroff",
        summary: "power the board off",
    },
    CommandInfo {
        usage: "debug fault",
        summary: "take a deliberate data abort on this CPU (shows the crash report)",
    },
    CommandInfo {
        usage: "debug panic",
        summary: "panic on purpose (shows the panic report)",
    },
    CommandInfo {
        usage: "debug fail <vm> [abort|frames]",
        summary: "panic (a data abort; a panic mid-update of the frame table) in a VM's path at its next exit, locks held: only that VM stops (frames: the board stops)",
    },
    CommandInfo {
        usage: "debug fail-board <mm|zeroing|shell>",
        summary: "fail in a board service: it turns off (the shell: the command is abandoned), every VM goes on",
    },
    CommandInfo {
        usage: "debug fail-input <vm>",
        summary: "fail while the memory manager reads a VM's input: that VM stops, not the one whose CPU ticked",
    },
    CommandInfo {
        usage: "debug hog <size|all>",
        summary: "take memory from the pool on purpose (a guest's next fault-in finds none)",
    },
    CommandInfo {
        usage: "debug unhog",
        summary: "give what 'debug hog' took back to the pool",
    },
];

const INFO_USAGE: &str = "info balloon [vm] | info exits <vm> [reset]";

const INFO_EXITS_USAGE: &str = "info exits <vm> [reset]";

const MM_POLICY_USAGE: &str = "mm policy <manager|naive|none>";
const SET_USAGE: &str = "set <vm> <min|low|max|weight> <value> (e.g. set linux max 768M)";

const DEBUG_USAGE: &str = "debug fault | debug panic | debug fail <vm> [abort|frames] | debug fail-board <mm|zeroing|shell> | debug fail-input <vm> | debug hog <size|all> | debug unhog";

/// Why a line is not a command, worded for the operator.
#[derive(Debug, PartialEq, Eq)]
pub enum ParseError<'a> {
    Unknown(&'a str),
    Usage(&'static str),
    BadSize(&'a str),
    BadSeconds(&'a str),
    BadWeight(&'a str),
    BadAddress(&'a str),
}

impl core::fmt::Display for ParseError<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ParseError::Unknown(word) => {
                write!(
                    f,
                    "unknown command '{word}'; type 'help' for the list of commands"
                )
            }
            ParseError::Usage(usage) => write!(f, "usage: {usage}"),
            ParseError::BadSize(text) => write!(
                f,
                "'{text}' is not a size: write bytes, or a number with K, M or G (e.g. 128M)"
            ),
            ParseError::BadWeight(text) => write!(
                f,
                "'{text}' is not a weight: write a whole number from 1 to 10000 (default 100)"
            ),
            ParseError::BadAddress(text) => write!(
                f,
                "'{text}' is not an IPv4 address: write a dotted quad (e.g. 10.0.0.2)"
            ),
            ParseError::BadSeconds(text) => write!(
                f,
                "'{text}' is not a number of seconds: write a whole number (e.g. 2), 0 to stop polling, or now"
            ),
        }
    }
}

const SNAPSHOT_USAGE: &str = "snapshot <vm> [name] [--no-hint]";

/// Parse one line; `Ok(None)` for a blank line.
pub fn parse(line: &str) -> Result<Option<Command<'_>>, ParseError<'_>> {
    let mut words = line.split_ascii_whitespace();
    let Some(first) = words.next() else {
        return Ok(None);
    };
    let rest = words.next();
    let no_args = |cmd: Command<'static>, usage: &'static str| match rest {
        None => Ok(Some(cmd)),
        Some(_) => Err(ParseError::Usage(usage)),
    };
    match first {
        "help" | "?" => no_args(Command::Help, "help"),
        "mem" => no_args(Command::Mem, "mem"),
        "check" => no_args(Command::Check, "check"),
        "cpus" => no_args(Command::Cpus, "cpus"),
        "poweroff" => no_args(Command::PowerOff, "poweroff"),
        "vms" => no_args(Command::Vms, "vms"),
        "snapshots" => no_args(Command::Snapshots, "snapshots"),
        "snapshot" => {
            let mut args = [rest, words.next(), words.next(), words.next()];
            let no_hint = args.iter().position(|a| *a == Some("--no-hint"));
            if let Some(i) = no_hint {
                args[i..].rotate_left(1);
                args[3] = None;
            }
            match args {
                [Some(vm), name, None, None] => Ok(Some(Command::Snapshot {
                    vm,
                    name,
                    hint: no_hint.is_none(),
                })),
                _ => Err(ParseError::Usage(SNAPSHOT_USAGE)),
            }
        }
        "restore" => match (rest, words.next(), words.next(), words.next()) {
            (Some(name), None, ..) => Ok(Some(Command::Restore { name, into: None })),
            (Some(name), Some("as"), Some(vm), None) => Ok(Some(Command::Restore {
                name,
                into: Some(vm),
            })),
            _ => Err(ParseError::Usage("restore <name> [as <vm>]")),
        },
        "net" => no_args(Command::Net, "net"),
        "ping" => match (rest, words.next(), words.next()) {
            (Some(to), count, None) => {
                let to = parse_ipv4(to).ok_or(ParseError::BadAddress(to))?;
                let count = match count {
                    None => DEFAULT_PINGS,
                    Some(c) => parse_seconds(c)
                        .filter(|n| (1..=MAX_PINGS).contains(n))
                        .ok_or(ParseError::Usage(PING_USAGE))?,
                };
                Ok(Some(Command::Ping { to, count }))
            }
            _ => Err(ParseError::Usage(PING_USAGE)),
        },
        "delete" => {
            one_vm("delete <name>", rest, words.next()).map(|name| Some(Command::Delete { name }))
        }
        "stop" => one_vm("stop <vm>", rest, words.next()).map(|vm| Some(Command::Stop { vm })),
        "start" => one_vm("start <vm>", rest, words.next()).map(|vm| Some(Command::Start { vm })),
        "console" => {
            one_vm("console <vm>", rest, words.next()).map(|vm| Some(Command::Console { vm }))
        }
        "balloon" => match (rest, words.next(), words.next()) {
            (Some(vm), Some("auto"), None) => Ok(Some(Command::BalloonAuto { vm })),
            (Some(vm), Some(size), None) => {
                let bytes = parse_size(size).ok_or(ParseError::BadSize(size))?;
                Ok(Some(Command::Balloon { vm, bytes }))
            }
            _ => Err(ParseError::Usage("balloon <vm> <size|auto>")),
        },
        "balloon-stats" => match (rest, words.next(), words.next()) {
            (Some(vm), Some("now"), None) => Ok(Some(Command::StatsNow { vm })),
            (Some(vm), Some(secs), None) => {
                let seconds = parse_seconds(secs).ok_or(ParseError::BadSeconds(secs))?;
                Ok(Some(Command::BalloonStats { vm, seconds }))
            }
            _ => Err(ParseError::Usage("balloon-stats <vm> <seconds|now>")),
        },
        "hint" => one_vm("hint <vm>", rest, words.next()).map(|vm| Some(Command::Hint { vm })),
        "on-bad-access" => match (rest, words.next(), words.next()) {
            (Some(vm), Some(word), None) => match crate::vm::fault::OnBadAccess::parse(word) {
                Some(policy) => Ok(Some(Command::OnBadAccess { vm, policy })),
                None => Err(ParseError::Usage("on-bad-access <vm> <abort|stop>")),
            },
            _ => Err(ParseError::Usage("on-bad-access <vm> <abort|stop>")),
        },
        "mm" | "memory" => match (rest, words.next(), words.next()) {
            (None, ..) => Ok(Some(Command::Mm { raw: false })),
            (Some("raw"), None, _) => Ok(Some(Command::Mm { raw: true })),
            (Some("policy"), Some(name), None) => crate::mm::manager::Policy::from_name(name)
                .map(|policy| Some(Command::MmPolicy { policy }))
                .ok_or(ParseError::Usage(MM_POLICY_USAGE)),
            (Some("policy"), ..) => Err(ParseError::Usage(MM_POLICY_USAGE)),
            _ => Err(ParseError::Usage("mm [raw]")),
        },
        "set" => match (rest, words.next(), words.next(), words.next()) {
            (Some(vm), Some(word), Some(value), None) => {
                let field = crate::vm::manage::LimitField::parse(word)
                    .ok_or(ParseError::Usage(SET_USAGE))?;
                let value = match field {
                    crate::vm::manage::LimitField::Weight => {
                        u64::from(parse_seconds(value).ok_or(ParseError::BadWeight(value))?)
                    }
                    _ => parse_size(value).ok_or(ParseError::BadSize(value))?,
                };
                Ok(Some(Command::SetLimit { vm, field, value }))
            }
            _ => Err(ParseError::Usage(SET_USAGE)),
        },
        "info" => match (rest, words.next(), words.next()) {
            (Some("balloon"), vm, None) => Ok(Some(Command::InfoBalloon { vm })),
            (Some("exits"), Some(vm), None) => Ok(Some(Command::InfoExits { vm, reset: false })),
            (Some("exits"), Some(vm), Some("reset")) if words.next().is_none() => {
                Ok(Some(Command::InfoExits { vm, reset: true }))
            }
            (Some("balloon"), _, _) => Err(ParseError::Usage("info balloon [vm]")),
            (Some("exits"), _, _) => Err(ParseError::Usage(INFO_EXITS_USAGE)),
            _ => Err(ParseError::Usage(INFO_USAGE)),
        },
        "debug" => match (rest, words.next(), words.next()) {
            (Some("fault"), None, _) => Ok(Some(Command::DebugFault)),
            (Some("panic"), None, _) => Ok(Some(Command::DebugPanic)),
            (Some("fail"), Some(vm), None) => Ok(Some(Command::DebugFail {
                vm,
                kind: InjectedFailure::Panic,
            })),
            (Some("fail"), Some(vm), Some(how)) if words.next().is_none() => {
                let kind = match how {
                    "abort" => InjectedFailure::Abort,
                    "frames" => InjectedFailure::BrokenFrames,
                    _ => return Err(ParseError::Usage(DEBUG_USAGE)),
                };
                Ok(Some(Command::DebugFail { vm, kind }))
            }
            (Some("fail-board"), Some(service), None) => {
                let service = match service {
                    "mm" => BoardService::Manager,
                    "zeroing" => BoardService::Zeroing,
                    "shell" => BoardService::Shell,
                    _ => return Err(ParseError::Usage(DEBUG_USAGE)),
                };
                Ok(Some(Command::DebugFailBoard { service }))
            }
            (Some("fail-input"), Some(vm), None) => Ok(Some(Command::DebugFailInput { vm })),
            (Some("hog"), Some("all"), None) => Ok(Some(Command::DebugHog { bytes: None })),
            (Some("hog"), Some(size), None) => {
                let bytes = parse_size(size).ok_or(ParseError::BadSize(size))?;
                Ok(Some(Command::DebugHog { bytes: Some(bytes) }))
            }
            (Some("unhog"), None, _) => Ok(Some(Command::DebugUnhog)),
            _ => Err(ParseError::Usage(DEBUG_USAGE)),
        },
        other => Err(ParseError::Unknown(other)),
    }
}

/// The single VM name a command takes.
fn one_vm<'a>(
    usage: &'static str,
    name: Option<&'a str>,
    more: Option<&'a str>,
) -> Result<&'a str, ParseError<'a>> {
    match (name, more) {
        (Some(vm), None) => Ok(vm),
        _ => Err(ParseError::Usage(usage)),
    }
}

const PING_USAGE: &str = "ping <address> [count] (count 1 to 100)";
/// Echo requests `ping` sends without a count, and at most.
pub const DEFAULT_PINGS: u32 = 4;
pub const MAX_PINGS: u32 = 100;

/// A dotted quad: four decimal numbers 0 to 255, nothing else.
pub fn parse_ipv4(text: &str) -> Option<[u8; 4]> {
    let mut octets = [0u8; 4];
    let mut parts = text.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *octet = part.parse().ok()?;
    }
    parts.next().is_none().then_some(octets)
}

/// Whole seconds: decimal digits only, at most `u32::MAX`.
pub fn parse_seconds(text: &str) -> Option<u32> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A size: decimal bytes, or with a K, M or G suffix (powers of 1024).
pub fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'k' | b'K' => (&text[..text.len() - 1], 10),
        b'm' | b'M' => (&text[..text.len() - 1], 20),
        b'g' | b'G' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The `help` text.
pub fn write_help(out: &mut impl core::fmt::Write) -> core::fmt::Result {
    writeln!(out, "Commands:")?;
    let width = COMMANDS.iter().map(|c| c.usage.len()).max().unwrap_or(0);
    for c in COMMANDS {
        writeln!(out, "  {:<width$} {}", c.usage, c.summary)?;
    }
    writeln!(out, "QEMU: Ctrl-A X quits, Ctrl-A C opens QEMU's monitor.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_listed_command() {
        for c in COMMANDS {
            // The usage with its placeholders filled in must parse.
            let line = c
                .usage
                .replace("<vm>", "alpha")
                .replace("<name>", "before-upgrade")
                .replace("[name]", "first")
                .replace("[--no-hint]", "--no-hint")
                .replace("[as alpha]", "as beta")
                .replace("<size>", "64M")
                .replace("<seconds>", "5")
                .replace("<seconds|now>", "now")
                .replace("<size|all>", "all")
                .replace("[abort|frames]", "abort")
                .replace("<mm|zeroing|shell>", "mm")
                .replace("<abort|stop>", "stop")
                .replace("[vm]", "beta")
                .replace("[raw]", "raw")
                .replace("<manager|naive|none>", "naive")
                .replace("<min|low|max|weight> <value>", "max 768M")
                .replace("<address>", "10.0.0.2")
                .replace("[count]", "3");
            assert!(matches!(parse(&line), Ok(Some(_))), "{line}");
        }
        assert_eq!(
            parse("ping 10.0.0.2"),
            Ok(Some(Command::Ping {
                to: [10, 0, 0, 2],
                count: DEFAULT_PINGS
            }))
        );
        assert_eq!(
            parse("ping 192.168.1.200 100"),
            Ok(Some(Command::Ping {
                to: [192, 168, 1, 200],
                count: 100
            }))
        );
        assert_eq!(parse("net"), Ok(Some(Command::Net)));
        assert!(parse("net x").is_err());
        for bad in [
            "10.0.0",
            "10.0.0.256",
            "10.0.0.2.1",
            "a.b.c.d",
            "10..0.2",
            "10.0.0.-1",
            "10.0.0.0002",
        ] {
            assert_eq!(
                parse(&format!("ping {bad}")),
                Err(ParseError::BadAddress(bad)),
                "{bad}"
            );
        }
        for bad in [
            "ping",
            "ping 10.0.0.2 0",
            "ping 10.0.0.2 101",
            "ping 10.0.0.2 x",
            "ping 10.0.0.2 3 4",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse("restore s1 as beta"),
            Ok(Some(Command::Restore {
                name: "s1",
                into: Some("beta")
            }))
        );
        assert_eq!(
            parse("snapshot alpha"),
            Ok(Some(Command::Snapshot {
                vm: "alpha",
                name: None,
                hint: true
            }))
        );
        assert_eq!(
            parse("snapshot alpha --no-hint"),
            Ok(Some(Command::Snapshot {
                vm: "alpha",
                name: None,
                hint: false
            }))
        );
        assert_eq!(
            parse("snapshot alpha s2 --no-hint"),
            parse("snapshot alpha --no-hint s2")
        );
        assert!(parse("snapshot alpha a b").is_err());
        assert!(parse("restore s1 into beta").is_err());
        assert!(parse("snapshot").is_err());
        assert!(parse("delete").is_err());
        use crate::vm::manage::LimitField;
        assert_eq!(
            parse("set linux max 768M"),
            Ok(Some(Command::SetLimit {
                vm: "linux",
                field: LimitField::Max,
                value: 768 << 20
            }))
        );
        assert_eq!(
            parse("set linux weight 200"),
            Ok(Some(Command::SetLimit {
                vm: "linux",
                field: LimitField::Weight,
                value: 200
            }))
        );
        assert_eq!(
            parse("set linux weight 2M"),
            Err(ParseError::BadWeight("2M"))
        );
        assert_eq!(
            parse("set linux max lots"),
            Err(ParseError::BadSize("lots"))
        );
        assert_eq!(
            parse("set linux colour 1"),
            Err(ParseError::Usage(SET_USAGE))
        );
        assert_eq!(parse("set linux max"), Err(ParseError::Usage(SET_USAGE)));
        assert_eq!(parse("mm"), Ok(Some(Command::Mm { raw: false })));
        use crate::mm::manager::Policy;
        assert_eq!(
            parse("mm policy none"),
            Ok(Some(Command::MmPolicy {
                policy: Policy::NoController
            }))
        );
        for bad in ["mm policy", "mm policy off", "mm policy naive now"] {
            assert_eq!(parse(bad), Err(ParseError::Usage(MM_POLICY_USAGE)), "{bad}");
        }
        assert_eq!(parse("memory raw"), Ok(Some(Command::Mm { raw: true })));
        assert_eq!(parse("mm now"), Err(ParseError::Usage("mm [raw]")));
        assert_eq!(
            parse("balloon linux auto"),
            Ok(Some(Command::BalloonAuto { vm: "linux" }))
        );
        assert_eq!(parse("  mem  "), Ok(Some(Command::Mem)));
        assert_eq!(parse("check"), Ok(Some(Command::Check)));
        assert_eq!(parse("check all").unwrap_err().to_string(), "usage: check");
        assert_eq!(
            parse("balloon-stats linux now"),
            Ok(Some(Command::StatsNow { vm: "linux" }))
        );
        assert_eq!(parse(""), Ok(None));
        assert_eq!(parse("debug panic"), Ok(Some(Command::DebugPanic)));
        assert_eq!(
            parse("debug fail beta"),
            Ok(Some(Command::DebugFail {
                vm: "beta",
                kind: InjectedFailure::Panic
            }))
        );
        assert_eq!(
            parse("debug fail beta abort"),
            Ok(Some(Command::DebugFail {
                vm: "beta",
                kind: InjectedFailure::Abort
            }))
        );
        assert_eq!(
            parse("debug fail beta frames"),
            Ok(Some(Command::DebugFail {
                vm: "beta",
                kind: InjectedFailure::BrokenFrames
            }))
        );
        assert_eq!(
            parse("debug fail-board mm"),
            Ok(Some(Command::DebugFailBoard {
                service: BoardService::Manager
            }))
        );
        assert_eq!(
            parse("debug fail-board shell"),
            Ok(Some(Command::DebugFailBoard {
                service: BoardService::Shell
            }))
        );
        assert_eq!(
            parse("debug fail-input beta"),
            Ok(Some(Command::DebugFailInput { vm: "beta" }))
        );
        assert_eq!(
            parse("debug fail-board kswapd").unwrap_err(),
            ParseError::Usage(DEBUG_USAGE)
        );
        assert_eq!(
            parse("debug fail beta sideways").unwrap_err(),
            ParseError::Usage(DEBUG_USAGE)
        );
        assert_eq!(
            parse("debug fail beta abort now").unwrap_err(),
            ParseError::Usage(DEBUG_USAGE)
        );
        assert_eq!(
            parse("debug fail").unwrap_err(),
            ParseError::Usage(DEBUG_USAGE)
        );
        assert_eq!(
            parse("debug hog 64M"),
            Ok(Some(Command::DebugHog {
                bytes: Some(64 << 20)
            }))
        );
        assert_eq!(
            parse("debug hog all"),
            Ok(Some(Command::DebugHog { bytes: None }))
        );
        assert_eq!(parse("debug unhog"), Ok(Some(Command::DebugUnhog)));
        assert_eq!(
            parse("debug hog lots").unwrap_err(),
            ParseError::BadSize("lots")
        );
        assert_eq!(
            parse("balloon-stats linux 0"),
            Ok(Some(Command::BalloonStats {
                vm: "linux",
                seconds: 0
            }))
        );
        assert_eq!(
            parse("balloon-stats linux 10"),
            Ok(Some(Command::BalloonStats {
                vm: "linux",
                seconds: 10
            }))
        );
        assert_eq!(parse("hint linux"), Ok(Some(Command::Hint { vm: "linux" })));
        assert_eq!(
            parse("on-bad-access linux abort"),
            Ok(Some(Command::OnBadAccess {
                vm: "linux",
                policy: crate::vm::fault::OnBadAccess::Abort
            }))
        );
        assert_eq!(
            parse("info exits linux"),
            Ok(Some(Command::InfoExits {
                vm: "linux",
                reset: false
            }))
        );
        assert_eq!(
            parse("info  exits linux  reset "),
            Ok(Some(Command::InfoExits {
                vm: "linux",
                reset: true
            }))
        );
        for bad in [
            "info exits",
            "info exits linux now",
            "info exits linux reset now",
        ] {
            assert_eq!(
                parse(bad).unwrap_err().to_string(),
                "usage: info exits <vm> [reset]",
                "{bad}"
            );
        }
        assert_eq!(
            parse("info balloon"),
            Ok(Some(Command::InfoBalloon { vm: None }))
        );
        assert_eq!(
            parse("info balloon linux"),
            Ok(Some(Command::InfoBalloon { vm: Some("linux") }))
        );
        assert_eq!(
            parse("info balloon linux more").unwrap_err(),
            ParseError::Usage("info balloon [vm]")
        );
        assert_eq!(parse("info").unwrap_err(), ParseError::Usage(INFO_USAGE));
        assert_eq!(
            parse("on-bad-access linux ignore"),
            Err(ParseError::Usage("on-bad-access <vm> <abort|stop>"))
        );
    }

    #[test]
    fn balloon_stats_and_hint_errors_say_what_to_type() {
        for bad in ["2s", "-1", "1.5", "", "4294967296", "two"] {
            let line = format!("balloon-stats linux {bad}");
            let e = parse(&line).unwrap_err();
            if bad.is_empty() {
                assert_eq!(e, ParseError::Usage("balloon-stats <vm> <seconds|now>"));
            } else {
                assert_eq!(
                    e.to_string(),
                    format!(
                        "'{bad}' is not a number of seconds: write a whole number (e.g. 2), 0 to stop polling, or now"
                    )
                );
            }
        }
        assert_eq!(
            parse("balloon-stats linux").unwrap_err().to_string(),
            "usage: balloon-stats <vm> <seconds|now>"
        );
        assert_eq!(
            parse("balloon-stats linux 2 3").unwrap_err().to_string(),
            "usage: balloon-stats <vm> <seconds|now>"
        );
        assert_eq!(parse("hint").unwrap_err().to_string(), "usage: hint <vm>");
        assert_eq!(
            parse("hint linux now").unwrap_err().to_string(),
            "usage: hint <vm>"
        );
        assert_eq!(parse_seconds("4294967295"), Some(u32::MAX));
    }

    #[test]
    fn errors_tell_what_to_type() {
        let e = parse("frobnicate now").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown command 'frobnicate'; type 'help' for the list of commands"
        );
        assert_eq!(parse("mem all").unwrap_err().to_string(), "usage: mem");
        assert_eq!(parse("debug").unwrap_err(), ParseError::Usage(DEBUG_USAGE));
    }

    #[test]
    fn help_lists_all() {
        let mut s = String::new();
        write_help(&mut s).unwrap();
        for c in COMMANDS {
            assert!(s.contains(c.usage));
        }
        // Summaries line up after the longest usage.
        let column = |usage: &str, summary: &str| {
            let line = s
                .lines()
                .find(|l| l.starts_with(&format!("  {usage} ")))
                .unwrap();
            assert!(line.contains(summary), "{line}");
            line.find(summary).unwrap()
        };
        let width = COMMANDS.iter().map(|c| c.usage.len()).max().unwrap();
        assert_eq!(
            column("balloon-stats <vm> <seconds|now>", "ask a VM's guest"),
            width + 3
        );
        assert_eq!(column("hint <vm>", "ask a VM's guest to hint"), width + 3);
    }
}
