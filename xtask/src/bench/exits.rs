//! The Tidal side's exit profiles in the Linux bench ([`mod@super::linux`]):
//! the shell's `info exits linux` once the guest is ready (the profile
//! starts with the VM, so that is its boot), then `info exits linux reset`,
//! 10 s of the idle guest, and `info exits linux` again. Per kind of exit
//! (device of a data abort, stage-2 fault, sysreg, HVC, WFI, interrupt
//! source...) the exits and the hypervisor's EL2 instructions, parsed from
//! the shell's table: in linux.json (each Tidal run's `exit_profile`) and
//! a table of the medians over the rounds.

use std::time::Duration;

use harness::Session;
use serde::Serialize;

use super::linux::median;
use crate::json;

/// How long the guest is left idle for the idle profile.
pub(super) const IDLE: Duration = Duration::from_secs(10);

/// One kind's exits and their EL2 instructions (`None`: the PMU did not
/// count them).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(super) struct Tally {
    pub(super) count: u64,
    pub(super) instructions: Option<u64>,
}

/// One `info exits` table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(super) struct Profile {
    /// What it covers, by the hypervisor's clock.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    pub(super) seconds: f64,
    /// The `total` row.
    pub(super) total: Tally,
    /// Per kind, in the table's order, by the shell's label.
    #[serde(serialize_with = "json::ordered_map")]
    pub(super) kinds: Vec<(String, Tally)>,
}

/// A Tidal run's two profiles.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(super) struct Profiles {
    /// From the VM's start to the guest's agent listening.
    pub(super) boot: Profile,
    /// [`IDLE`] of the idle guest.
    pub(super) idle: Profile,
}

/// Captures both profiles of VM `vm` from Tidal's shell (which must have
/// the keyboard); takes [`IDLE`] and a little more.
pub(super) fn capture(s: &mut Session, vm: &str, timeout: Duration) -> Result<Profiles, String> {
    let mut run = |command: String| s.run(&command, timeout).map_err(|e| e.to_string());
    let boot = parse(&run(format!("info exits {vm}"))?)?;
    let reset = run(format!("info exits {vm} reset"))?;
    if !reset.contains("exit profile started over") {
        return Err(format!("`info exits {vm} reset` answered: {reset}"));
    }
    std::thread::sleep(IDLE);
    let idle = parse(&run(format!("info exits {vm}"))?)?;
    Ok(Profiles { boot, idle })
}

/// The profile in `info exits` output: the `<vm>: <n> exits in <s> s`
/// line, then a row per kind `label exits share% per-s instructions
/// instr/exit` and the `total` row. Other lines (a guest's console lines
/// printed meanwhile) are skipped.
pub(super) fn parse(text: &str) -> Result<Profile, String> {
    let mut seconds = None;
    let mut kinds = Vec::new();
    let mut total = None;
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let [_, exits, "exits", "in", secs, "s", ..] = words[..] {
            if line.starts_with(|c: char| !c.is_whitespace()) && exits.parse::<u64>().is_ok() {
                seconds = Some(
                    secs.parse::<f64>()
                        .map_err(|e| format!("bad time '{secs}' in {line:?}: {e}"))?,
                );
                continue;
            }
        }
        let [label, count, share, _rate, instructions, _each] = words[..] else {
            continue;
        };
        if !line.starts_with("  ") || !share.ends_with('%') {
            continue;
        }
        let Ok(count) = count.parse::<u64>() else {
            continue;
        };
        let instructions = match instructions {
            "-" => None,
            n => Some(
                n.parse::<u64>()
                    .map_err(|e| format!("bad instruction count in {line:?}: {e}"))?,
            ),
        };
        let tally = Tally {
            count,
            instructions,
        };
        if label == "total" {
            total = Some(tally);
        } else {
            kinds.push((label.to_string(), tally));
        }
    }
    let (Some(seconds), Some(total)) = (seconds, total) else {
        return Err(format!("no `info exits` table in:\n{text}"));
    };
    let sum: u64 = kinds.iter().map(|(_, t)| t.count).sum();
    if sum != total.count {
        return Err(format!(
            "`info exits`: the kinds add up to {sum} exits, the total says {}:\n{text}",
            total.count
        ));
    }
    Ok(Profile {
        seconds,
        total,
        kinds,
    })
}

impl Profile {
    fn get(&self, label: &str) -> Tally {
        self.kinds.iter().find(|(l, _)| l == label).map_or(
            Tally {
                count: 0,
                instructions: Some(0),
            },
            |(_, t)| *t,
        )
    }
}

/// Instructions per exit (`None` without exits or without the PMU).
fn per_exit(t: Tally) -> Option<f64> {
    let insns = t.instructions?;
    (t.count > 0).then(|| insns as f64 / t.count as f64)
}

/// The median over the runs of `f`, leaving out runs where it is `None`;
/// `None` if all are.
fn median_of(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = values.flatten().collect();
    (!v.is_empty()).then(|| median(&v))
}

/// The table of the Tidal runs' profiles: per kind the boot's exits and
/// the idle guest's exits per second, medians over `runs`; and the EL2
/// instructions per exit of each, from `icount` (a run under `-icount`,
/// where QEMU's PMU counts them) if given, else medians over the runs that
/// counted them.
pub(super) fn table(runs: &[&Profiles], icount: Option<&Profiles>) -> Vec<String> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let counted: Vec<&Profiles> = match icount {
        Some(p) => vec![p],
        None => runs.to_vec(),
    };
    let mut lines = vec![
        format!(
            "Exits under Tidal by kind: the boot (VM start to the agent listening) and {} s of the idle guest;",
            IDLE.as_secs()
        ),
        format!("exits: median of {} rounds above; instr: the hypervisor's EL2 instructions per exit, world", runs.len()),
        match icount {
            Some(_) => "switch included (irq-*: from the vector on), from one more boot under -icount shift=0 (PMU counts only then)",
            None => "switch included (irq-*: from the vector on; medians of the rounds that counted them)",
        }
        .to_string(),
        format!(
            "{:<14} {:>10} {:>12} {:>12} {:>12}",
            "kind", "boot exits", "boot instr", "idle exits/s", "idle instr"
        ),
    ];
    let labels = first
        .boot
        .kinds
        .iter()
        .map(|(l, _)| l.as_str())
        .chain(["total"]);
    for label in labels {
        let tally = |p: &Profile| {
            if label == "total" {
                p.total
            } else {
                p.get(label)
            }
        };
        let boot = median_of(runs.iter().map(|r| Some(tally(&r.boot).count as f64)));
        let boot_each = median_of(counted.iter().map(|r| per_exit(tally(&r.boot))));
        let idle_rate = median_of(
            runs.iter()
                .map(|r| Some(tally(&r.idle).count as f64 / r.idle.seconds.max(1e-9))),
        );
        let idle_each = median_of(counted.iter().map(|r| per_exit(tally(&r.idle))));
        let cell = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |v| format!("{v:.d$}"));
        lines.push(format!(
            "{label:<14} {:>10} {:>12} {:>12} {:>12}",
            cell(boot, 0),
            cell(boot_each, 0),
            cell(idle_rate, 1),
            cell(idle_each, 0)
        ));
    }
    lines
}

/// An inflate and a deflate by kind of exit, under `heading`: the kinds
/// either had, with their exits and EL2 instructions per exit.
pub(super) fn move_table(heading: &[&str], inflate: &Profile, deflate: &Profile) -> Vec<String> {
    let cell = |t: Tally| {
        let each = per_exit(t).map_or("-".to_string(), |v| format!("{v:.0}"));
        format!("{:>8} {:>11}", t.count, each)
    };
    let mut lines: Vec<String> = heading.iter().map(|l| l.to_string()).collect();
    lines.push(format!(
        "{:<14} {:>8} {:>11}   {:>8} {:>11}",
        "kind", "inflate", "instr/exit", "deflate", "instr/exit"
    ));
    for (label, _) in &inflate.kinds {
        let (i, d) = (inflate.get(label), deflate.get(label));
        if i.count + d.count > 0 {
            lines.push(format!("{label:<14} {}   {}", cell(i), cell(d)));
        }
    }
    lines.push(format!(
        "{:<14} {}   {}",
        "total",
        cell(inflate.total),
        cell(deflate.total)
    ));
    lines
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `info exits linux` as Tidal printed it after 10 s of the idle Linux
    /// guest under `-icount shift=0` (the PMU counting), with a guest's
    /// console line put in the middle, as can happen.
    pub(in crate::bench) const SAMPLE: &str = "\
linux: 2242 exits in 10.167 s
  kind              exits  share     per s      EL2 instr instr/exit
  mmio-virtio          22   0.9%       2.1       10363614     471073
  mmio-gicd            13   0.5%       1.2         335363      25797
  mmio-gicr             0   0.0%       0.0              0          -
  mmio-uart             0   0.0%       0.0              0          -
  bad-access            0   0.0%       0.0              0          -
  stage2-fault          0   0.0%       0.0              0          -
  sysreg                0   0.0%       0.0              0          -
  hvc                   0   0.0%       0.0              0          -
  smc                   0   0.0%       0.0              0          -
  wfi                2088  93.1%     205.3        1496590        716
[linux] a console line printed meanwhile
  wfe                   0   0.0%       0.0              0          -
  irq-kick             14   0.6%       1.3         147691      10549
  irq-maint             0   0.0%       0.0              0          -
  irq-vtimer          105   4.6%      10.3         133897       1275
  irq-el2timer          0   0.0%       0.0              0          -
  irq-other             0   0.0%       0.0              0          -
  other                 0   0.0%       0.0              0          -
  total              2242 100.0%     220.5       12477155       5565
";

    /// The same without -icount: QEMU's PMU does not count instructions.
    pub(in crate::bench) const SAMPLE_NO_PMU: &str = "\
linux: 2236 exits in 10.501 s
  kind              exits  share     per s      EL2 instr instr/exit
  mmio-virtio          15   0.6%       1.4              -          -
  mmio-gicd             1   0.0%       0.0              -          -
  mmio-gicr             0   0.0%       0.0              -          -
  mmio-uart             0   0.0%       0.0              -          -
  bad-access            0   0.0%       0.0              -          -
  stage2-fault          0   0.0%       0.0              -          -
  sysreg                0   0.0%       0.0              -          -
  hvc                   0   0.0%       0.0              -          -
  smc                   0   0.0%       0.0              -          -
  wfi                2131  95.3%     202.9              -          -
  wfe                   0   0.0%       0.0              -          -
  irq-kick              1   0.0%       0.0              -          -
  irq-maint             0   0.0%       0.0              -          -
  irq-vtimer           88   3.9%       8.3              -          -
  irq-el2timer          0   0.0%       0.0              -          -
  irq-other             0   0.0%       0.0              -          -
  other                 0   0.0%       0.0              -          -
  total              2236 100.0%     212.9              -          -
";

    #[test]
    fn move_table_shows_the_kinds_either_move_had() {
        let inflate = parse(SAMPLE).unwrap();
        let deflate = parse(SAMPLE_NO_PMU).unwrap();
        let lines = move_table(&["Round 3's moves"], &inflate, &deflate);
        assert_eq!(lines[0], "Round 3's moves");
        let row = |label: &str| {
            lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(label))
                .cloned()
        };
        assert_eq!(
            row("mmio-virtio")
                .unwrap()
                .split_whitespace()
                .collect::<Vec<_>>(),
            ["mmio-virtio", "22", "471073", "15", "-"]
        );
        assert_eq!(row("mmio-gicr"), None, "no exits in either move");
        assert_eq!(
            row("total").unwrap().split_whitespace().collect::<Vec<_>>(),
            ["total", "2242", "5565", "2236", "-"]
        );
    }

    #[test]
    fn parses_the_shell_table() {
        let p = parse(SAMPLE).unwrap();
        assert_eq!(p.seconds, 10.167);
        assert_eq!(p.kinds.len(), 17);
        assert_eq!(
            p.total,
            Tally {
                count: 2242,
                instructions: Some(12_477_155)
            }
        );
        assert_eq!(
            p.get("irq-vtimer"),
            Tally {
                count: 105,
                instructions: Some(133_897)
            }
        );
        assert_eq!(p.kinds[0].0, "mmio-virtio");
        assert_eq!(p.kinds[16].0, "other");
        // Without the PMU the instruction columns are dashes.
        let no_pmu = parse(SAMPLE_NO_PMU).unwrap();
        assert_eq!(
            no_pmu.get("wfi"),
            Tally {
                count: 2131,
                instructions: None
            }
        );
        assert_eq!(no_pmu.seconds, 10.501);
        assert_eq!(no_pmu.total.count, 2236);
    }

    #[test]
    fn refuses_what_is_no_table() {
        assert!(parse("no VM called 'linux'; the VMs are: alpha").is_err());
        assert!(parse("usage: info exits <vm> [reset]").is_err());
        let short = SAMPLE.replace("  wfi                2088", "  wfi                2089");
        assert!(parse(&short).unwrap_err().contains("add up to 2243"));
    }

    #[test]
    fn table_gives_medians() {
        let p = parse(SAMPLE).unwrap();
        let mut busier = p.clone();
        // Twice the WFIs for the same instructions.
        busier.kinds[9].1.count *= 2;
        busier.total.count += 2088;
        let a = Profiles {
            boot: p.clone(),
            idle: p.clone(),
        };
        let b = Profiles {
            boot: busier.clone(),
            idle: busier,
        };
        let lines = table(&[&a, &b, &a], None);
        assert_eq!(lines.len(), 4 + 17 + 1);
        let row = |lines: &[String], label: &str| {
            lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(label))
                .unwrap()
                .clone()
        };
        assert_eq!(
            row(&lines, "wfi"),
            "wfi                  2088          717        205.4          717"
        );
        assert_eq!(
            row(&lines, "mmio-gicr"),
            "mmio-gicr               0            -          0.0            -"
        );
        assert_eq!(
            row(&lines, "total"),
            "total                2242         5565        220.5         5565"
        );
        assert!(table(&[], None).is_empty());
        // Counts from the rounds, instructions from a run under -icount.
        let no_pmu = parse(SAMPLE_NO_PMU).unwrap();
        let rounds = Profiles {
            boot: no_pmu.clone(),
            idle: no_pmu,
        };
        let lines = table(&[&rounds], Some(&b));
        assert!(lines[2].contains("-icount"), "{}", lines[2]);
        assert_eq!(
            row(&lines, "wfi"),
            "wfi                  2131          358        202.9          358"
        );
        // Without either, dashes.
        let lines = table(&[&rounds], None);
        assert_eq!(
            row(&lines, "wfi"),
            "wfi                  2131            -        202.9            -"
        );
    }

    #[test]
    fn serialises_per_kind() {
        let p = parse(SAMPLE).unwrap();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["seconds"], 10.167);
        assert_eq!(
            v["total"],
            serde_json::json!({"count": 2242, "instructions": 12477155})
        );
        assert_eq!(
            v["kinds"]["irq-kick"],
            serde_json::json!({"count": 14, "instructions": 147691})
        );
        assert_eq!(v["kinds"].as_object().unwrap().len(), 17);
        let v = serde_json::to_value(parse(SAMPLE_NO_PMU).unwrap()).unwrap();
        assert_eq!(
            v["kinds"]["wfi"],
            serde_json::json!({"count": 2131, "instructions": null})
        );
    }
}
