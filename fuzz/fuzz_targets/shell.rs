//! The operator shell's input (`console/line.rs` `LineEditor`,
//! `console/shell.rs` `parse`): any bytes typed at the console, and any
//! text given to the parser directly.
//!
//! Invariants: the line editor hands out only printable ASCII lines of at
//! most `MAX_LINE` characters; `parse` never panics and is deterministic;
//! a blank line (ASCII whitespace only) and only it parses to nothing; a
//! parsed command's first word is one the shell lists, and every VM name
//! or word a command or an error quotes is one of the line's own words
//! (the same bytes, at a word boundary), never more; sizes are the digits
//! times their suffix's power of 1024, exactly, or refused; a command
//! written back in its canonical form parses to the same command; an
//! error's message is printable when the line is.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::console::line::{Event, LineEditor, MAX_LINE};
use hypervisor::console::shell::{
    parse, parse_ipv4, parse_seconds, parse_size, BoardService, Command, InjectedFailure,
    ParseError, COMMANDS,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Typed(Vec<u8>),
    Text(String),
    /// Words joined by one space: closer to real commands.
    Words(Vec<String>),
}

/// Whether `s` is one of `words` (same bytes, same place).
fn is_word(s: &str, words: &[&str]) -> bool {
    words
        .iter()
        .any(|w| w.as_ptr() == s.as_ptr() && w.len() == s.len())
}

fn check_size(word: &str, value: u64) {
    let (digits, shift) = match word.as_bytes().last() {
        Some(b'k' | b'K') => (&word[..word.len() - 1], 10),
        Some(b'm' | b'M') => (&word[..word.len() - 1], 20),
        Some(b'g' | b'G') => (&word[..word.len() - 1], 30),
        _ => (word, 0),
    };
    assert!(!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()));
    let n: u128 = digits.parse().expect("decimal digits");
    assert_eq!(u128::from(value), n << shift, "size {word}");
}

/// The canonical text of a command.
fn render(c: &Command<'_>) -> String {
    match *c {
        Command::Help => "help".into(),
        Command::Mem => "mem".into(),
        Command::Check => "check".into(),
        Command::Cpus => "cpus".into(),
        Command::Vms => "vms".into(),
        Command::Snapshots => "snapshots".into(),
        Command::Snapshot { vm, name, hint } => format!(
            "snapshot {vm}{}{}",
            name.map(|n| format!(" {n}")).unwrap_or_default(),
            if hint { "" } else { " --no-hint" }
        ),
        Command::Restore { name, into } => match into {
            Some(vm) => format!("restore {name} as {vm}"),
            None => format!("restore {name}"),
        },
        Command::Delete { name } => format!("delete {name}"),
        Command::Net => "net".into(),
        Command::Ping {
            to: [a, b, c, d],
            count,
        } => format!("ping {a}.{b}.{c}.{d} {count}"),
        Command::Balloon { vm, bytes } => format!("balloon {vm} {bytes}"),
        Command::BalloonAuto { vm } => format!("balloon {vm} auto"),
        Command::InfoBalloon { vm } => match vm {
            Some(vm) => format!("info balloon {vm}"),
            None => "info balloon".into(),
        },
        Command::InfoExits { vm, reset } => {
            format!("info exits {vm}{}", if reset { " reset" } else { "" })
        }
        Command::Mm { raw } => format!("mm{}", if raw { " raw" } else { "" }),
        Command::MmPolicy { policy } => format!("mm policy {}", policy.name()),
        Command::SetLimit { vm, field, value } => format!("set {vm} {} {value}", field.name()),
        Command::BalloonStats { vm, seconds } => format!("balloon-stats {vm} {seconds}"),
        Command::StatsNow { vm } => format!("balloon-stats {vm} now"),
        Command::Hint { vm } => format!("hint {vm}"),
        Command::OnBadAccess { vm, policy } => format!("on-bad-access {vm} {}", policy.label()),
        Command::Stop { vm } => format!("stop {vm}"),
        Command::Console { vm } => format!("console {vm}"),
        Command::Start { vm } => format!("start {vm}"),
        Command::PowerOff => "poweroff".into(),
        Command::DebugFault => "debug fault".into(),
        Command::DebugPanic => "debug panic".into(),
        Command::DebugFail { vm, kind } => format!(
            "debug fail {vm}{}",
            match kind {
                InjectedFailure::Panic => "",
                InjectedFailure::Abort => " abort",
                InjectedFailure::BrokenFrames => " frames",
            }
        ),
        Command::DebugFailBoard { service } => format!(
            "debug fail-board {}",
            match service {
                BoardService::Manager => "mm",
                BoardService::Zeroing => "zeroing",
                BoardService::Shell => "shell",
            }
        ),
        Command::DebugFailInput { vm } => format!("debug fail-input {vm}"),
        Command::DebugHog { bytes } => match bytes {
            Some(b) => format!("debug hog {b}"),
            None => "debug hog all".into(),
        },
        Command::DebugUnhog => "debug unhog".into(),
    }
}

/// The names a command quotes from its line.
fn quoted<'a>(c: &Command<'a>) -> Vec<&'a str> {
    match *c {
        Command::Balloon { vm, .. }
        | Command::BalloonAuto { vm }
        | Command::InfoExits { vm, .. }
        | Command::SetLimit { vm, .. }
        | Command::BalloonStats { vm, .. }
        | Command::StatsNow { vm }
        | Command::Hint { vm }
        | Command::OnBadAccess { vm, .. }
        | Command::Stop { vm }
        | Command::Console { vm }
        | Command::Start { vm }
        | Command::DebugFail { vm, .. }
        | Command::DebugFailInput { vm } => vec![vm],
        Command::InfoBalloon { vm } => vm.into_iter().collect(),
        Command::Snapshot { vm, name, .. } => [Some(vm), name].into_iter().flatten().collect(),
        Command::Restore { name, into } => [Some(name), into].into_iter().flatten().collect(),
        Command::Delete { name } => vec![name],
        _ => Vec::new(),
    }
}

fn check_line(line: &str) {
    let words: Vec<&str> = line.split_ascii_whitespace().collect();
    let result = parse(line);
    assert_eq!(result, parse(line), "parse is deterministic");
    match result {
        Ok(None) => assert!(words.is_empty(), "{line:?} parsed to nothing"),
        Ok(Some(cmd)) => {
            let first = words[0];
            let listed = COMMANDS
                .iter()
                .any(|c| c.usage.split(' ').next() == Some(first))
                || ["?", "memory"].contains(&first);
            assert!(listed, "command {first:?} not in the list");
            for q in quoted(&cmd) {
                assert!(is_word(q, &words), "{q:?} is not a word of {line:?}");
                assert_ne!(q.as_ptr(), first.as_ptr(), "the command word as a name");
            }
            match cmd {
                Command::Balloon { bytes, .. } => check_size(words[2], bytes),
                Command::DebugHog { bytes: Some(b) } => check_size(words[2], b),
                Command::SetLimit { value, field, .. } => match field.name() {
                    "weight" => assert_eq!(parse_seconds(words[3]).map(u64::from), Some(value)),
                    _ => check_size(words[3], value),
                },
                Command::BalloonStats { seconds, .. } => {
                    assert_eq!(words[2].parse::<u32>().ok(), Some(seconds));
                }
                _ => {}
            }
            let canonical = render(&cmd);
            assert_eq!(
                parse(&canonical),
                Ok(Some(cmd)),
                "{line:?} written back as {canonical:?}"
            );
        }
        Err(e) => {
            match e {
                ParseError::Unknown(w) => {
                    assert!(is_word(w, &words));
                    assert_eq!(w.as_ptr(), words[0].as_ptr(), "the first word is unknown");
                }
                ParseError::BadSize(w) => {
                    assert!(is_word(w, &words));
                    assert_eq!(parse_size(w), None);
                }
                ParseError::BadSeconds(w) | ParseError::BadWeight(w) => {
                    assert!(is_word(w, &words));
                    assert_eq!(parse_seconds(w), None);
                }
                ParseError::BadAddress(w) => {
                    assert!(is_word(w, &words));
                    assert_eq!(parse_ipv4(w), None);
                }
                ParseError::Usage(u) => assert!(!u.is_empty()),
            }
            let message = e.to_string();
            if line.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                assert!(message.bytes().all(|b| (0x20..0x7f).contains(&b)));
            }
        }
    }
}

fuzz_target!(|input: Input| {
    match input {
        Input::Typed(bytes) => {
            let mut ed = LineEditor::new();
            for &b in bytes.iter().take(4096) {
                if let Event::Line(line) = ed.feed(b) {
                    assert!(line.len() <= MAX_LINE);
                    assert!(line.bytes().all(|b| (0x20..0x7f).contains(&b)), "{line:?}");
                    let line = line.to_string();
                    check_line(&line);
                }
                assert!(ed.text().len() <= MAX_LINE);
            }
        }
        Input::Text(text) => check_line(&text),
        Input::Words(words) => check_line(&words.join(" ")),
    }
});
