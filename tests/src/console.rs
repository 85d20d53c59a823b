//! Parsers for what the hypervisor prints on its console: the `mem` and
//! `cpus` shell commands and the crash dumps. They follow the console
//! protocol in the crate documentation and accept `\r\n` line ends.

use regex::Regex;

/// The shell prompt (no newline follows it).
pub const PROMPT: &str = "tidal> ";

/// The output of the `mem` command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemReport {
    /// From `RAM: <N> bytes ...`.
    pub ram_bytes: u64,
    /// Accounting lines before `total`, in order: (label, bytes).
    pub categories: Vec<(String, u64)>,
    /// The `total` accounting line.
    pub total: u64,
}

impl MemReport {
    /// The bytes in accounting category `name` (e.g. "free", "guest RAM").
    pub fn category(&self, name: &str) -> Option<u64> {
        self.categories
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, bytes)| *bytes)
    }
}

/// Parses the output of `mem`.
pub fn parse_mem(text: &str) -> Result<MemReport, String> {
    let ram_re = Regex::new(r"^\s*RAM:\s+(\d+) bytes\b").unwrap();
    let cat_re = Regex::new(r"^\s+(\S.*?)\s+(\d+) bytes\b").unwrap();
    let number = |s: &str| {
        s.parse::<u64>()
            .map_err(|e| format!("bad number `{s}`: {e}"))
    };

    let mut ram_bytes = None;
    let mut categories = Vec::new();
    let mut in_accounting = false;
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        if !in_accounting {
            if let Some(c) = ram_re.captures(line) {
                ram_bytes = Some(number(&c[1])?);
            } else if line.trim_start().starts_with("Accounting") {
                in_accounting = true;
            }
            continue;
        }
        let Some(c) = cat_re.captures(line) else {
            continue;
        };
        let bytes = number(&c[2])?;
        if &c[1] == "total" {
            let ram_bytes = ram_bytes.ok_or("no `RAM: <N> bytes` line before the accounting")?;
            if categories.is_empty() {
                return Err("no accounting categories before `total`".into());
            }
            return Ok(MemReport {
                ram_bytes,
                categories,
                total: bytes,
            });
        }
        categories.push((c[1].to_string(), bytes));
    }
    Err(if in_accounting {
        "no `total` line in the accounting".into()
    } else {
        "no `Accounting (4 KiB pages):` section".into()
    })
}

/// One CPU line of the `cpus` command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuLine {
    pub index: usize,
    pub mpidr: u64,
    /// `psci`, `spin-table`, ...
    pub method: String,
    /// The state begins with `online`.
    pub online: bool,
    /// The whole state text (`online`, `offline (...)`, ...).
    pub state: String,
}

/// Parses the output of `cpus`: every line of the form
/// `<index> <mpidr hex> <enable-method> <state...>`; other lines (the header,
/// the echoed command) are skipped.
pub fn parse_cpus(text: &str) -> Vec<CpuLine> {
    let re = Regex::new(r"^\s*(\d+)\s+(?:0x)?([0-9a-fA-F]+)\s+(\S+)\s+(\S.*?)\s*$").unwrap();
    text.lines()
        .filter_map(|line| {
            let c = re.captures(line.trim_end_matches('\r'))?;
            let state = c[4].to_string();
            Some(CpuLine {
                index: c[1].parse().ok()?,
                mpidr: u64::from_str_radix(&c[2], 16).ok()?,
                method: c[3].to_string(),
                online: state.starts_with("online"),
                state,
            })
        })
        .collect()
}

/// The image offset of the last crash dump in `text`
/// (`ELR_EL2 0x... (image offset 0x...)`), if any.
pub fn crash_image_offset(text: &str) -> Option<u64> {
    let re = Regex::new(r"image offset 0x([0-9a-fA-F]+)").unwrap();
    let c = re.captures_iter(text).last()?;
    u64::from_str_radix(&c[1], 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEM: &str = "mem\r\n\
        RAM: 2147483648 bytes (2048 MiB) in 1 bank(s)\r\n\
        \x20 bank 0: 0x40000000..0xc0000000 (2048 MiB)\r\n\
        Accounting (4 KiB pages):\r\n\
        \x20 hypervisor image         1048576 bytes  (1.0 MiB)\r\n\
        \x20 page tables                 8192 bytes\r\n\
        \x20 guest bundle 2           4096 bytes  (4 KiB, 1 page)\r\n\
        \x20 free pool             2146422784 bytes  (2047 MiB)\r\n\
        \x20 total                 2147483648 bytes = RAM\r\n";

    #[test]
    fn mem_report() {
        let r = parse_mem(MEM).unwrap();
        assert_eq!(r.ram_bytes, 2 << 30);
        assert_eq!(r.total, 2 << 30);
        assert_eq!(
            r.categories,
            [
                ("hypervisor image".to_string(), 1048576),
                ("page tables".to_string(), 8192),
                ("guest bundle 2".to_string(), 4096),
                ("free pool".to_string(), 2146422784),
            ]
        );
        assert_eq!(r.category("page tables"), Some(8192));
        assert_eq!(r.category("free"), None, "whole labels only");
    }

    #[test]
    fn mem_errors() {
        assert!(parse_mem("").unwrap_err().contains("Accounting"));
        let no_total = MEM.replace("  total", "  sum");
        assert!(parse_mem(&no_total).unwrap_err().contains("total"));
        let no_ram = MEM.replace("RAM:", "Memory:");
        assert!(parse_mem(&no_ram).unwrap_err().contains("RAM"));
    }

    #[test]
    fn cpus() {
        let text = "cpus\r\nCPU MPIDR      METHOD     STATE\r\n\
            0   0x80000000 psci       online (boot)\r\n\
            1   80000001   spin-table offline (timeout)\r\n\
            \x20 2 0x2 psci online\r\ntidal> ";
        let cpus = parse_cpus(text);
        assert_eq!(cpus.len(), 3);
        assert_eq!(
            cpus[0],
            CpuLine {
                index: 0,
                mpidr: 0x8000_0000,
                method: "psci".into(),
                online: true,
                state: "online (boot)".into()
            }
        );
        assert!(!cpus[1].online && cpus[1].method == "spin-table" && cpus[1].mpidr == 0x8000_0001);
        assert!(cpus[2].online && cpus[2].index == 2);
    }

    #[test]
    fn crash_offset() {
        let dump = "*** EXCEPTION on CPU 0: data abort\r\n  ESR_EL2 0x96000004  FAR_EL2 0x0\r\n\
            \x20 ELR_EL2 0x40212a0c (image offset 0x12a0c)\r\n  x0  0x0 ...\r\nCPU 0 parked.\r\n";
        assert_eq!(crash_image_offset(dump), Some(0x12a0c));
        assert_eq!(crash_image_offset("no crash"), None);
    }
}

/// The first capture group of `pattern` in `text` as a whole number (a
/// fraction is cut off): a figure from a report line.
pub fn first_number(text: &str, pattern: &str) -> Option<u64> {
    let group = regex::Regex::new(pattern).ok()?.captures(text)?.get(1)?;
    group.as_str().split('.').next()?.parse().ok()
}

/// The number after `key` on the line that starts with it (`MemTotal:`,
/// `balloon_inflate`: /proc/meminfo and /proc/vmstat lines).
pub fn key_value(lines: &[String], key: &str) -> Option<u64> {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod number_tests {
    #[test]
    fn figures_from_report_lines() {
        let info = "  free_memory          447.9 MiB\n  free page reporting: 7 reports";
        assert_eq!(
            super::first_number(info, r"free_memory\s+([\d.]+)"),
            Some(447)
        );
        assert_eq!(super::first_number(info, r"(\d+) reports"), Some(7));
        assert_eq!(super::first_number(info, r"(\d+) hinted"), None);
        let lines = vec!["MemTotal:  508 kB".to_string(), "balloon_inflate 3".into()];
        assert_eq!(super::key_value(&lines, "balloon_inflate"), Some(3));
        assert_eq!(super::key_value(&lines, "MemFree:"), None);
    }
}

/// The pool line of `mm raw` (every figure in 4 KiB pages but `waits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MmPool {
    /// Pages the frame table manages.
    pub total: u64,
    pub free: u64,
    /// All VMs' RAM sizes together: above `total` when overcommitted.
    pub committed: u64,
    pub backed: u64,
    /// The watermarks.
    pub min: u64,
    pub low: u64,
    pub high: u64,
    pub waits: u64,
}

/// One `mm-vm` line of `mm raw` (sizes in 4 KiB pages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmVm {
    pub name: String,
    /// `running`, `stopped`, `stopping` or `failed`.
    pub state: String,
    pub size: u64,
    pub backed: u64,
    pub balloon: u64,
    pub target: u64,
    pub returned: u64,
    pub min: u64,
    pub low: u64,
    pub max: u64,
    pub weight: u64,
    pub congested: bool,
    pub pressure: bool,
    /// Pages the manager has asked back from this VM, ever.
    pub reclaimed: u64,
    /// Pages the manager has given this VM, ever.
    pub given: u64,
    /// Of `reclaimed`: pages fenced (untouched pages the board could not
    /// back); of `given`: pages given back once the pool stayed above high.
    /// 0 when the hypervisor does not say.
    pub fenced: u64,
    pub given_back: u64,
    /// Pages of raised targets withdrawn because its balloon never moved
    /// (0 when the hypervisor does not say).
    pub withdrawn: u64,
    /// Its vCPUs' waits for a frame that took over 100 ms, and the longest
    /// that ended, in µs (0 when the hypervisor does not say).
    pub waits_slow: u64,
    pub wait_longest_us: u64,
}

/// The output of the shell's `mm raw`: the pool, then one line per VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmReport {
    pub pool: MmPool,
    pub vms: Vec<MmVm>,
}

impl MmReport {
    /// The VM named `name`.
    pub fn vm(&self, name: &str) -> Option<&MmVm> {
        self.vms.iter().find(|v| v.name == name)
    }
}

/// Parses the output of `mm raw`: `mm-pool key=value ...`, one
/// `mm-vm key=value ...` per VM, then `mm-end`. Other lines (VMs' console
/// lines interleaved with the shell's) are skipped, and so are keys this
/// parser does not know; a missing key or a missing `mm-end` is an error.
pub fn parse_mm_raw(text: &str) -> Result<MmReport, String> {
    let mut pool = None;
    let mut vms = Vec::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        let line = line.strip_prefix(PROMPT).unwrap_or(line);
        let mut words = line.split_whitespace();
        let kind = words.next();
        if !matches!(kind, Some("mm-pool" | "mm-vm" | "mm-end")) {
            continue;
        }
        let fields: Vec<(&str, &str)> = words.filter_map(|w| w.split_once('=')).collect();
        let text = |key: &str| {
            fields
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| *v)
                .ok_or_else(|| format!("no {key}= in `{line}`"))
        };
        let num = |key: &str| {
            text(key)?
                .parse::<u64>()
                .map_err(|e| format!("{key}= in `{line}`: {e}"))
        };
        // A counter a hypervisor before it did not print: 0.
        let count = |key: &str| text(key).ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        let flag = |key: &str| match text(key)? {
            "0" => Ok(false),
            "1" => Ok(true),
            other => Err(format!("{key}={other} in `{line}`: not 0 or 1")),
        };
        match kind {
            Some("mm-pool") => {
                pool = Some(MmPool {
                    total: num("total")?,
                    free: num("free")?,
                    committed: num("committed")?,
                    backed: num("backed")?,
                    min: num("min")?,
                    low: num("low")?,
                    high: num("high")?,
                    waits: num("waits")?,
                })
            }
            Some("mm-vm") => vms.push(MmVm {
                name: text("name")?.to_string(),
                state: text("state")?.to_string(),
                size: num("size")?,
                backed: num("backed")?,
                balloon: num("balloon")?,
                target: num("target")?,
                returned: num("returned")?,
                min: num("min")?,
                low: num("low")?,
                max: num("max")?,
                weight: num("weight")?,
                congested: flag("congested")?,
                pressure: flag("pressure")?,
                reclaimed: num("reclaimed")?,
                given: num("given")?,
                fenced: count("fenced"),
                given_back: count("given_back"),
                withdrawn: count("withdrawn"),
                waits_slow: count("waits_slow"),
                wait_longest_us: count("wait_longest_us"),
            }),
            _ => {
                let pool = pool.ok_or("`mm-end` without an `mm-pool` line")?;
                return Ok(MmReport { pool, vms });
            }
        }
    }
    Err(if pool.is_some() {
        "no `mm-end` line: the output is cut short".into()
    } else {
        "no `mm-pool` line: is this the output of `mm raw`?".into()
    })
}

#[cfg(test)]
mod mm_tests {
    use super::*;

    const RAW: &str = "mm raw\r\n\
        mm-pool total=470000 free=120000 committed=819200 backed=340000 min=2048 low=8192 high=16384 waits=3\r\n\
        mm-vm name=vma state=running size=262144 backed=200000 balloon=1000 target=1200 returned=50 min=16384 low=16384 max=262144 weight=100 congested=0 pressure=1 reclaimed=4096 given=512\r\n\
        [vmb] progress 3 12.50\r\n\
        mm-vm name=beta state=stopped size=32768 backed=0 balloon=0 target=0 returned=0 min=0 low=0 max=32768 weight=100 congested=1 pressure=0 reclaimed=0 given=0 future=7\r\n\
        mm-end\r\n";

    #[test]
    fn mm_raw_report() {
        let r = parse_mm_raw(RAW).unwrap();
        assert_eq!(
            r.pool,
            MmPool {
                total: 470000,
                free: 120000,
                committed: 819200,
                backed: 340000,
                min: 2048,
                low: 8192,
                high: 16384,
                waits: 3
            }
        );
        assert_eq!(r.vms.len(), 2);
        let a = r.vm("vma").unwrap();
        assert_eq!(
            (a.state.as_str(), a.size, a.backed),
            ("running", 262144, 200000)
        );
        assert_eq!((a.balloon, a.target, a.returned), (1000, 1200, 50));
        assert_eq!((a.min, a.low, a.max, a.weight), (16384, 16384, 262144, 100));
        assert!(!a.congested && a.pressure);
        assert_eq!((a.reclaimed, a.given), (4096, 512));
        let beta = r.vm("beta").unwrap();
        assert_eq!(beta.state, "stopped");
        assert!(beta.congested);
        assert!(r.vm("vmb").is_none(), "console lines are not VMs");
    }

    #[test]
    fn mm_raw_errors() {
        let cut = RAW.replace("mm-end", "");
        assert!(parse_mm_raw(&cut).unwrap_err().contains("mm-end"));
        assert!(parse_mm_raw("unknown command 'mm'\r\n")
            .unwrap_err()
            .contains("mm-pool"));
        let missing = RAW.replace(" given=512", "");
        assert!(parse_mm_raw(&missing).unwrap_err().contains("no given="));
        let bad = RAW.replace("pressure=1", "pressure=yes");
        assert!(parse_mm_raw(&bad).unwrap_err().contains("pressure=yes"));
        let not_number = RAW.replace("free=120000", "free=lots");
        assert!(parse_mm_raw(&not_number).unwrap_err().contains("free="));
        let after_prompt = RAW.replace("mm-end", "tidal> mm-end");
        assert!(parse_mm_raw(&after_prompt).is_ok());
    }
}
