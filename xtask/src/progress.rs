//! Progress of a long download when apt cannot show it: apt draws bytes
//! and rate only on a terminal, so in a CI log the first `cargo xtask run`
//! printed one `Get:` line and then nothing for minutes. While a command
//! runs, [`run_watching`] prints every few seconds how many bytes the
//! files under the watched directories have grown by, against the
//! expected total, and the rate.

use std::fs;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// How often a line is printed.
const EVERY: Duration = Duration::from_secs(5);

/// Runs `cmd`; unless stderr is a terminal (where apt shows its own),
/// prints `label`'s progress every [`EVERY`]: the bytes the regular files
/// under `dirs` have grown by since the start, out of `total` if known.
pub fn run_watching(
    cmd: &mut Command,
    label: &str,
    dirs: &[PathBuf],
    total: Option<u64>,
) -> Result<(), String> {
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{:?}: {e}", cmd.get_program()))?;
    let quiet = std::io::stderr().is_terminal();
    let base = bytes_under(dirs);
    let start = Instant::now();
    let mut next = start + EVERY;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("{label}: {e}"))? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(200));
        if !quiet && Instant::now() >= next {
            next += EVERY;
            let got = bytes_under(dirs).saturating_sub(base);
            eprintln!("{}", line(label, got, total, start.elapsed()));
        }
    };
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

/// One progress line: `label: 120.5 of 470.2 MiB (25%), 8.1 MiB/s`.
fn line(label: &str, got: u64, total: Option<u64>, elapsed: Duration) -> String {
    const MIB: f64 = (1 << 20) as f64;
    let secs = elapsed.as_secs_f64().max(0.001);
    let rate = got as f64 / MIB / secs;
    match total.filter(|&t| t > 0) {
        Some(t) => format!(
            "{label}: {:.1} of {:.1} MiB ({}%), {rate:.1} MiB/s",
            got as f64 / MIB,
            t as f64 / MIB,
            got.saturating_mul(100) / t
        ),
        None => format!("{label}: {:.1} MiB, {rate:.1} MiB/s", got as f64 / MIB),
    }
}

/// The sizes of the regular files under `dirs`, recursively (a directory
/// that vanishes or cannot be read counts as empty).
fn bytes_under(dirs: &[PathBuf]) -> u64 {
    dirs.iter().map(|d| bytes_in(d)).sum()
}

fn bytes_in(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_in(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_gives_bytes_share_and_rate() {
        let s = Duration::from_secs(10);
        assert_eq!(
            line("kernel", 100 << 20, Some(400 << 20), s),
            "kernel: 100.0 of 400.0 MiB (25%), 10.0 MiB/s"
        );
        assert_eq!(
            line("kernel", 5 << 20, None, s),
            "kernel: 5.0 MiB, 0.5 MiB/s"
        );
        assert_eq!(
            line("k", 0, Some(0), Duration::ZERO),
            "k: 0.0 MiB, 0.0 MiB/s"
        );
    }

    #[test]
    fn growth_is_counted_in_nested_directories() {
        let root = std::env::temp_dir().join(format!("xtask-progress-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("partial")).unwrap();
        fs::write(root.join("a.deb"), [0u8; 100]).unwrap();
        fs::write(root.join("partial/b.deb"), [0u8; 23]).unwrap();
        assert_eq!(bytes_under(&[root.clone(), root.join("missing")]), 123);
        // A command that writes while it is watched finishes normally.
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("head -c 4096 /dev/zero > {}/c", root.display()));
        run_watching(&mut cmd, "test", std::slice::from_ref(&root), Some(4096)).unwrap();
        assert_eq!(bytes_under(std::slice::from_ref(&root)), 123 + 4096);
        let mut fails = Command::new("false");
        assert!(run_watching(&mut fails, "test", std::slice::from_ref(&root), None).is_err());
        fs::remove_dir_all(&root).unwrap();
    }
}
