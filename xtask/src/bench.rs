//! `cargo xtask bench`: balloon throughput and cost, measured by the
//! hypervisor itself under QEMU with `-icount shift=0` (guest time follows
//! the instruction count, so figures repeat run to run); then [`mod@linux`]: a
//! Linux guest ballooned under Tidal and directly under QEMU, side by side;
//! then [`mod@features`]: free page reporting's cost and return and free page
//! hinting's speed with the Linux guest under Tidal (wall time).
//!
//! One bare-metal test guest (guests/tests/bench.toml, 256 MiB) is ballooned
//! by 128 MiB and back, three rounds. For each move the hypervisor prints the
//! pages moved, the (virtual) time from setting the target to the driver
//! reporting it reached, and the EL2 instructions spent on the exits that
//! did the work (QEMU's PMU instruction event; with -icount QEMU counts
//! instructions of all CPUs while this one is at EL2, which is why the shell
//! and idle CPUs wait in WFE). Results: a table on stdout and
//! target/bench/balloon.json.
//!
//! Not part of that run: [`mod@policy`] (`cargo xtask bench policy`), the
//! memory manager under overcommit, plotted by [`svg`]; and
//! [`mod@snapshot`] (`cargo xtask bench snapshot`), a Linux guest's
//! snapshot and restore under Tidal beside QEMU's own save.

use std::path::Path;
use std::time::{Duration, Instant};

use harness::{target_dir, Artifacts, Board, QemuOptions, Session};
use serde::Serialize;

use crate::json;

mod exits;
mod features;
mod linux;
mod policy;
mod snapshot;
mod svg;

const ROUNDS: usize = 3;
const SIZE_MIB: u64 = 128;
const STEP: Duration = Duration::from_secs(300);

/// One balloon move; one entry of balloon.json's `moves`.
#[derive(Serialize)]
struct Move {
    round: usize,
    op: &'static str,
    pages: u64,
    virtual_us: u64,
    #[serde(rename = "pages_per_s_virtual")]
    pages_per_s: u64,
    /// As the hypervisor prints it (one decimal); `None` where it could not
    /// count.
    #[serde(rename = "el2_instructions_per_page")]
    insns_per_page: Option<f64>,
    exits: Option<u64>,
    /// Invalidations of every CPU's instruction cache the guest's memory
    /// asked for during the move; `None` from a hypervisor that does not
    /// say.
    icache_invalidations: Option<u64>,
    /// From sending the command until the hypervisor's report arrived.
    #[serde(serialize_with = "json::decimals::<3, _>")]
    wall_s: f64,
    /// `info exits bench`, started over just before the move and read once
    /// the guest has checked its memory after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    exit_profile: Option<exits::Profile>,
}

/// target/bench/balloon.json.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    board: &'static str,
    icount_shift: u32,
    size_mib: u64,
    moves: &'a [Move],
    /// The guest's notifies with nothing queued, at boot.
    #[serde(skip_serializing_if = "Option::is_none")]
    empty_notifies: Option<EmptyNotifies>,
}

/// The `virtio-notify` row of the boot's exit profile: the test guest's
/// notifies of an empty inflate queue (`empty-notifies` in its bootargs).
#[derive(Clone, Copy, Serialize)]
struct EmptyNotifies {
    count: u64,
    el2_instructions_per_notify: Option<u64>,
}

impl EmptyNotifies {
    fn from_profile(boot: &exits::Profile) -> Option<Self> {
        let (_, t) = boot.kinds.iter().find(|(l, _)| l == "virtio-notify")?;
        Some(EmptyNotifies {
            count: t.count,
            el2_instructions_per_notify: t.instructions.map(|i| i / t.count.max(1)),
        })
    }
}

impl<'a> Report<'a> {
    fn new(moves: &'a [Move], empty_notifies: Option<EmptyNotifies>) -> Self {
        Report {
            benchmark: "balloon-bare-metal",
            board: "virt-gicv2",
            icount_shift: 0,
            size_mib: SIZE_MIB,
            moves,
            empty_notifies,
        }
    }
}

/// The bare-metal bench, the Linux comparison, then the balloon features.
pub fn run(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    bare_metal(root, artifacts)?;
    linux::run(root, artifacts)?;
    features::run(root, artifacts)
}

/// The Linux comparison alone, with Tidal's exit profiles (`cargo xtask
/// bench linux`).
pub fn linux(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    linux::run(root, artifacts)
}

/// The balloon features alone (`cargo xtask bench features`).
pub fn features(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    features::run(root, artifacts)
}

/// The memory manager under overcommit, against static partitions
/// (`cargo xtask bench policy`).
pub fn policy(root: &Path, artifacts: &Artifacts, rounds: usize) -> Result<(), String> {
    policy::run(root, artifacts, rounds)
}

/// A Linux guest's snapshot and restore against QEMU's save and a boot
/// (`cargo xtask bench snapshot`).
pub fn snapshot(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    snapshot::run(root, artifacts)
}

/// `cargo xtask bench policy`'s own arguments (`--rounds N`).
pub fn policy_rounds(args: &[String]) -> Result<usize, String> {
    policy::rounds_arg(args)
}

/// The bare-metal part alone (`cargo xtask bench bare-metal`).
pub fn bare_metal(root: &Path, artifacts: &Artifacts) -> Result<(), String> {
    let board = Board::VirtGicv2;
    let mut opts = QemuOptions::for_board(board, artifacts);
    opts.initrd = Some(target_dir().join("bundles").join("bench.img"));
    opts.extra = vec!["-icount".into(), "shift=0".into()];
    let mut s =
        Session::start("bench-balloon", board, artifacts, &opts).map_err(|e| e.to_string())?;
    s.set_deadline(Duration::from_secs(1800));
    s.expect(
        r"\[bench\] testguest: \d+ empty notifies of the inflate queue done",
        STEP,
    )
    .map_err(|e| e.to_string())?;
    // The boot's profile: its virtio-notify row is the empty notifies
    // (the driver notifies no queue before the first move).
    let boot = s
        .run("info exits bench", STEP)
        .map_err(|e| e.to_string())
        .and_then(|text| exits::parse(&text))?;
    let empty_notifies = EmptyNotifies::from_profile(&boot);
    let mut moves = Vec::new();
    for round in 1..=ROUNDS {
        for (op, size) in [("inflate", SIZE_MIB), ("deflate", 0)] {
            let mut shell = |command: &str| s.run(command, STEP).map_err(|e| e.to_string());
            let reset = shell("info exits bench reset")?;
            if !reset.contains("exit profile started over") {
                return Err(format!("`info exits bench reset` answered: {reset}"));
            }
            let started = Instant::now();
            s.send_line(&format!("balloon bench {size}M"))
                .map_err(|e| e.to_string())?;
            let c = s
                .expect(
                    r"tidal: \[bench\] balloon: reached \d+ pages: (\d+) pages \w+ in (\d+) us \((\d+) pages/s\), (?:([\d.]+) hypervisor instructions per page \((\d+) in (\d+) exits\)|hypervisor instructions: not counted[^,]*), (\d+) I-cache invalidations",
                    STEP,
                )
                .map_err(|e| e.to_string())?;
            let wall_s = started.elapsed().as_secs_f64();
            let num = |i: usize| {
                c[i].parse::<u64>()
                    .map_err(|e| format!("bad number '{}': {e}", c[i]))
            };
            moves.push(Move {
                round,
                op,
                pages: num(1)?,
                virtual_us: num(2)?,
                pages_per_s: num(3)?,
                insns_per_page: c[4].parse().ok(),
                exits: c[6].parse().ok(),
                icache_invalidations: c.get(7).and_then(|v| v.parse().ok()),
                wall_s,
                exit_profile: None,
            });
            // The guest checks its memory after every move; wait for it.
            s.expect(r"\[bench\] testguest: pattern ok", STEP)
                .map_err(|e| e.to_string())?;
            let profile = s
                .run("info exits bench", STEP)
                .map_err(|e| e.to_string())
                .and_then(|text| exits::parse(&text))?;
            if let Some(m) = moves.last_mut() {
                m.exit_profile = Some(profile);
            }
        }
    }
    s.send_line("poweroff").map_err(|e| e.to_string())?;
    let _ = s.wait_exit(Duration::from_secs(30));

    println!();
    println!("Balloon, bare-metal guest, 128 MiB, QEMU virt GICv2, -icount shift=0 (virtual time: 1 ns per instruction)");
    println!(
        "round  op        pages   virtual ms   pages/s (virtual)   EL2 instr/page   exits   I-cache inv.   wall s"
    );
    for m in &moves {
        println!(
            "{:<6} {:<8} {:>6} {:>12.1} {:>19} {:>16} {:>7} {:>14} {:>8.2}",
            m.round,
            m.op,
            m.pages,
            m.virtual_us as f64 / 1000.0,
            m.pages_per_s,
            m.insns_per_page.map_or("n/a".into(), |v| format!("{v:.1}")),
            m.exits.map_or("n/a".into(), |v| v.to_string()),
            m.icache_invalidations
                .map_or("n/a".into(), |v| v.to_string()),
            m.wall_s
        );
    }
    for line in [
        "EL2 instructions cover every exit of the move, world switch included. A deflate's pages are",
        "backed with zeroed frames at the guest's first touch, 32 pages a fault (fault-around): the",
        "test guest writes every page it gets back before reporting the target reached. I-cache inv.:",
        "broadcast instruction cache invalidations (IC IALLUIS) the guest's memory asked for in the move.",
    ] {
        println!("{line}");
    }
    if let Some(e) = empty_notifies {
        println!(
            "A notify with nothing queued (the guest's {} at boot): {} EL2 instructions from trap to return",
            e.count,
            e.el2_instructions_per_notify
                .map_or("n/a".into(), |v| v.to_string())
        );
    }
    if let [.., inflate, deflate] = &moves[..] {
        if let (Some(i), Some(d)) = (&inflate.exit_profile, &deflate.exit_profile) {
            println!();
            let heading = [
                &format!(
                    "Round {}'s moves by kind of exit (`info exits bench`, started over before each move,",
                    inflate.round
                )[..],
                "read after the guest's check of its memory, whose console line is in mmio-uart)",
            ];
            for line in exits::move_table(&heading, i, d) {
                println!("{line}");
            }
        }
    }

    let path = root.join("target").join("bench").join("balloon.json");
    json::write(&path, &Report::new(&moves, empty_notifies))?;
    println!("written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn report_keeps_its_fields() {
        let moves = [
            Move {
                round: 1,
                op: "inflate",
                pages: 32768,
                virtual_us: 81234,
                pages_per_s: 403378,
                insns_per_page: Some(2345.6),
                exits: Some(64),
                icache_invalidations: Some(0),
                wall_s: 1.23456,
                exit_profile: None,
            },
            Move {
                round: 1,
                op: "deflate",
                pages: 32768,
                virtual_us: 90000,
                pages_per_s: 364088,
                insns_per_page: None,
                exits: None,
                icache_invalidations: None,
                wall_s: 0.5,
                exit_profile: None,
            },
        ];
        assert_eq!(
            serde_json::to_value(Report::new(
                &moves,
                Some(EmptyNotifies {
                    count: 64,
                    el2_instructions_per_notify: Some(431)
                })
            ))
            .unwrap(),
            json!({
                "benchmark": "balloon-bare-metal",
                "board": "virt-gicv2",
                "icount_shift": 0,
                "size_mib": 128,
                "moves": [
                    {"round": 1, "op": "inflate", "pages": 32768, "virtual_us": 81234,
                     "pages_per_s_virtual": 403378, "el2_instructions_per_page": 2345.6,
                     "exits": 64, "icache_invalidations": 0, "wall_s": 1.235},
                    {"round": 1, "op": "deflate", "pages": 32768, "virtual_us": 90000,
                     "pages_per_s_virtual": 364088, "el2_instructions_per_page": null,
                     "exits": null, "icache_invalidations": null, "wall_s": 0.5}
                ],
                "empty_notifies": {"count": 64, "el2_instructions_per_notify": 431}
            })
        );
    }
}
