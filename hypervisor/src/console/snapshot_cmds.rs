//! The shell's snapshot commands: `snapshot <vm> [name]`, `restore <name>
//! [as <vm>]` and `delete <name>`.
//!
//! A snapshot is a job the shell drives from its looks ([`step`]), never a
//! wait: the VM being saved may run on the shell's own CPU, and it must
//! answer a hinting request and reach an exit to pause. The job asks the
//! guest to hint its free pages first (when its balloon offers it), then
//! pauses the VM (`vm::pause`), writes it (`vm::snapshot::save`) and
//! resumes it, whatever happened.

extern crate alloc;

use alloc::string::String;
use core::fmt::Write as _;

use super::board::{names, Board};
use crate::balloon::hint::HintOutcome;
use crate::report::Size;
use crate::snapshot::store::{valid_name, Name, Store, StoreError};
use crate::vm::balloon_ctl::{self, HintStartError};
use crate::vm::pause;
use crate::vm::snapshot::{self, SnapError};

/// How long a snapshot waits for the guest's hinting run to end.
pub const HINT_WAIT_US: u64 = 10_000_000;
/// How long it waits for every vCPU to pause.
pub const PAUSE_WAIT_US: u64 = 2_000_000;

/// A snapshot being taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotJob {
    pub vm: Name,
    pub name: Name,
    phase: Phase,
    /// When the pause was asked for (microseconds since boot).
    pause_asked_us: u64,
    /// Pages the guest hinted free in the run the snapshot asked for.
    hinted: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The guest hints its free pages (run `id`) until `until_us`.
    Hinting { id: u32, until_us: u64 },
    /// The vCPUs pause, until `until_us`.
    Pausing { until_us: u64 },
    /// Paused after `pausing_ms`, said so: written at the next look.
    Writing { pausing_ms: u64 },
}

fn name_of(s: &str) -> Name {
    let mut n = Name::new();
    let _ = n.push_str(s);
    n
}

/// `snapshot <vm> [name] [--no-hint]`: the job, or why there is none (in
/// `out`). `hint`: ask the guest to hint its free pages first.
pub fn begin(
    board: &mut impl Board,
    out: &mut String,
    vm: &str,
    name: Option<&str>,
    hint: bool,
) -> Option<SnapshotJob> {
    if let Some(n) = name.filter(|n| !valid_name(n)) {
        let _ = writeln!(out, "snapshot: '{n}': {}", StoreError::BadName);
        return None;
    }
    let listed = board.with_disk(|disk| Store::open(disk).map(|s| s.list().to_vec()));
    let entries = match listed {
        None => {
            let _ = writeln!(out, "snapshot: {}", NO_DISK);
            return None;
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "snapshot: {e}");
            return None;
        }
        Some(Ok(entries)) => entries,
    };
    let name = match name {
        Some(n) if entries.iter().any(|e| e.name.as_str() == n) => {
            let _ = writeln!(out, "snapshot: '{n}': {}", StoreError::Exists);
            return None;
        }
        Some(n) => name_of(n),
        None => {
            let free = (1..=entries.len() + 1).find_map(|i| {
                let mut n = Name::new();
                write!(n, "{vm}-{i}").ok()?;
                entries.iter().all(|e| e.name != n).then_some(n)
            });
            match free {
                Some(n) => n,
                None => {
                    let _ = writeln!(
                        out,
                        "snapshot: '{vm}' is too long a name to number; give the snapshot a name"
                    );
                    return None;
                }
            }
        }
    };
    let running = board.with_vm(vm, |v, _| v.state() == crate::vm::state::VmState::Running);
    match running {
        None => {
            let _ = writeln!(
                out,
                "no VM called '{vm}'; the VMs are: {} (type 'vms')",
                names(board)
            );
            return None;
        }
        Some(false) => {
            let _ = writeln!(out, "snapshot: {vm} is not running ('start {vm}' first)");
            return None;
        }
        Some(true) => {}
    }
    let now = board.now_us();
    let mut job = SnapshotJob {
        vm: name_of(vm),
        name,
        phase: Phase::Pausing { until_us: 0 },
        pause_asked_us: 0,
        hinted: 0,
    };
    let started = if hint {
        board.with_vm(vm, balloon_ctl::start_hint)
    } else {
        let _ = writeln!(
            out,
            "snapshot {}: no hinting run first (--no-hint)",
            job.name
        );
        if !ask_pause(board, out, &mut job, now) {
            return None;
        }
        return Some(job);
    };
    match started {
        Some(Ok(id)) => {
            let _ = writeln!(
                out,
                "snapshot {}: {vm}'s guest hints its free pages first (run {id}), so that they are not written",
                job.name
            );
            job.phase = Phase::Hinting {
                id,
                until_us: now.saturating_add(HINT_WAIT_US),
            };
        }
        Some(Err(HintStartError::NoBalloon)) | Some(Err(HintStartError::Device(_))) | None => {
            let _ = writeln!(
                out,
                "snapshot {}: {vm} does not hint its free pages (no FREE_PAGE_HINT): pages it freed are written unless reported",
                job.name
            );
            if !ask_pause(board, out, &mut job, now) {
                return None;
            }
        }
        Some(Err(HintStartError::NotRunning)) => {
            let _ = writeln!(out, "snapshot: {vm} is not running");
            return None;
        }
    }
    Some(job)
}

/// Ask the VM to pause; false (and why in `out`) if it cannot.
fn ask_pause(board: &mut impl Board, out: &mut String, job: &mut SnapshotJob, now: u64) -> bool {
    match board.with_vm(&job.vm, pause::request_pause) {
        Some(Ok(())) => {
            job.pause_asked_us = now;
            job.phase = Phase::Pausing {
                until_us: now.saturating_add(PAUSE_WAIT_US),
            };
            true
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "snapshot {}: cannot pause {}: {e}", job.name, job.vm);
            false
        }
        None => {
            let _ = writeln!(out, "snapshot {}: {} is gone", job.name, job.vm);
            false
        }
    }
}

const NO_DISK: &str = "the board has no disk (on QEMU virt, `cargo xtask run` attaches target/board-disk.img, or the file --disk names)";

/// One look at a snapshot being taken: true when it is over (what
/// happened is in `out`).
pub fn step(board: &mut impl Board, out: &mut String, job: &mut SnapshotJob) -> bool {
    let now = board.now_us();
    match job.phase {
        Phase::Hinting { id, until_us } => {
            let ended = board.with_vm(&job.vm, |vm, _| {
                let run = vm
                    .balloon()
                    .and_then(|b| b.device().hint_run())
                    .filter(|r| r.id == id);
                (
                    run.is_none_or(|r| r.outcome != HintOutcome::Running),
                    run.map_or(0, |r| r.pages_hinted),
                )
            });
            if let Some((_, hinted)) = ended {
                job.hinted = hinted;
            }
            let ended = ended.map(|(ended, _)| ended);
            match ended {
                None => {
                    let _ = writeln!(out, "snapshot {}: {} is gone", job.name, job.vm);
                    true
                }
                Some(false) if now < until_us => false,
                Some(ended) => {
                    if !ended {
                        let _ = writeln!(
                            out,
                            "snapshot {}: {}'s guest did not finish hinting within {} s; going on without the rest",
                            job.name,
                            job.vm,
                            HINT_WAIT_US / 1_000_000
                        );
                    }
                    !ask_pause(board, out, job, now)
                }
            }
        }
        Phase::Pausing { until_us } => {
            let paused = board.with_vm(&job.vm, |vm, _| pause::paused(vm));
            match paused {
                None => {
                    let _ = writeln!(out, "snapshot {}: {} is gone", job.name, job.vm);
                    true
                }
                Some(true) => {
                    // Said before the write, which may take seconds: the
                    // shell answers nothing meanwhile.
                    let pausing_ms = now.saturating_sub(job.pause_asked_us) / 1_000;
                    let backed = board
                        .with_vm(&job.vm, |vm, _| vm.ram().map_or(0, |r| r.mapped_pages()))
                        .unwrap_or(0);
                    let _ = writeln!(
                        out,
                        "snapshot {}: {} paused; writing it ({} backed, zero pages not written)...",
                        job.name,
                        job.vm,
                        Size(backed.saturating_mul(crate::mm::frames::PAGE_SIZE))
                    );
                    job.phase = Phase::Writing { pausing_ms };
                    false
                }
                Some(false) if now < until_us => false,
                Some(false) => {
                    resume(board, &job.vm);
                    let _ = writeln!(
                        out,
                        "snapshot {}: {}'s vCPUs did not pause within {} s (is it stopping?); it goes on, nothing was written",
                        job.name,
                        job.vm,
                        PAUSE_WAIT_US / 1_000_000
                    );
                    true
                }
            }
        }
        Phase::Writing { pausing_ms } => {
            copy(board, out, job, pausing_ms);
            true
        }
    }
}

fn resume(board: &mut impl Board, vm: &str) {
    board.with_vm(vm, |vm, _| pause::resume(vm));
}

/// Write the paused VM into the store, then resume it.
fn copy(board: &mut impl Board, out: &mut String, job: &SnapshotJob, pausing_ms: u64) {
    let id = board.snapshot_board();
    let copy_began = board.now_us();
    let counter = board.counter_now();
    let name = job.name.clone();
    let done = board.with_vm_and_disk(&job.vm, |vm, cpu, disk| {
        let result = (|| -> Result<_, String> {
            let disk = disk.ok_or_else(|| String::from(NO_DISK))?;
            let mut store = Store::open(disk).map_err(|e| alloc::format!("{e}"))?;
            let writer = store
                .begin(&name, vm.name())
                .map_err(|e| alloc::format!("{e}"))?;
            let (writer, report) =
                snapshot::save(vm, cpu, id, counter, writer).map_err(|e| alloc::format!("{e}"))?;
            let guest_us = crate::hw::timer::ticks_to_us(
                counter.wrapping_sub(vm.counter_offset()),
                id.counter_hz,
            );
            let entry = writer
                .commit(guest_us, id.tag)
                .map_err(|e| alloc::format!("{e}"))?;
            Ok((entry.len, report))
        })();
        // Whatever happened, the VM goes on as it was.
        pause::resume(vm);
        result
    });
    let now = board.now_us();
    let paused_ms = now.saturating_sub(job.pause_asked_us) / 1_000;
    let write_ms = now.saturating_sub(copy_began) / 1_000;
    match done {
        None => {
            let _ = writeln!(out, "snapshot {}: {} is gone", job.name, job.vm);
        }
        Some(Err(e)) => {
            let _ = writeln!(
                out,
                "snapshot {}: not taken: {e}; {} goes on running (paused {paused_ms} ms), nothing was listed",
                job.name, job.vm
            );
        }
        Some(Ok((bytes, r))) => {
            let not_backed = r.totals.not_backed;
            let _ = writeln!(
                out,
                "snapshot {}: {} saved, {} written; paused {paused_ms} ms ({pausing_ms} ms for its vCPUs to stop, {write_ms} ms to write)",
                job.name,
                job.vm,
                Size(bytes)
            );
            let _ = writeln!(
                out,
                "  pages: {} data, {} zero (a bit each), {not_backed} not written: {} ballooned, {} freed (hinted, reported) or never touched; the guest hinted {} pages free for it",
                r.totals.data,
                r.totals.zero,
                r.ballooned,
                r.hinted.saturating_add(r.other_unbacked),
                job.hinted
            );
        }
    }
}

/// A restore that waits for the board's clock to pass the guest's
/// (`snapshot::SnapError::ClockBehind`): done by the shell's looks once
/// `due_us` (microseconds since boot) has come.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingRestore {
    pub name: Name,
    pub vm: Name,
    pub due_us: u64,
}

/// `restore <name> [as <vm>]`, or a VM's `restore = "<name>"` at boot: a
/// restore to do later if the board's clock must first pass the guest's.
pub fn restore(
    board: &mut impl Board,
    out: &mut String,
    name: &str,
    into: Option<&str>,
) -> Option<PendingRestore> {
    let found = board.with_disk(|disk| Store::open(disk).map(|s| s.find(name).cloned()));
    let entry = match found {
        None => {
            let _ = writeln!(out, "restore: {NO_DISK}");
            return None;
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "restore: {e}");
            return None;
        }
        Some(Ok(None)) => {
            let _ = writeln!(
                out,
                "restore: no snapshot called '{name}' ('snapshots' lists them)"
            );
            return None;
        }
        Some(Ok(Some(entry))) => entry,
    };
    let vm_name = into.unwrap_or(entry.vm.as_str());
    let id = board.snapshot_board();
    let counter = board.counter_now();
    let began = board.now_us();
    let done = board.with_vm_and_disk(vm_name, |vm, cpu, disk| {
        let disk = disk.ok_or(SnapError::Refused(String::from(NO_DISK)))?;
        let mut store = Store::open(disk).map_err(|e| SnapError::Refused(alloc::format!("{e}")))?;
        let reader = store
            .open_reader(name)
            .map_err(|e| SnapError::Refused(alloc::format!("{e}")))?;
        snapshot::restore(vm, cpu, id, counter, reader)
    });
    let ms = board.now_us().saturating_sub(began) / 1_000;
    match done {
        None => {
            let _ = writeln!(
                out,
                "restore: no VM called '{vm_name}'; the VMs are: {} (type 'vms')",
                names(board)
            );
        }
        Some(Err(SnapError::ClockBehind {
            board_s,
            guest_s,
            wait_s,
        })) => {
            let _ = writeln!(
                out,
                "restore: {vm_name} starts from '{name}' in {wait_s} s: the board's clock ({board_s} s since boot) must first pass the guest's ({guest_s} s), as QEMU's timer cannot run a guest ahead of the board"
            );
            return Some(PendingRestore {
                name: name_of(name),
                vm: name_of(vm_name),
                due_us: began.saturating_add(wait_s.saturating_mul(1_000_000)),
            });
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "restore: {vm_name} not started from '{name}': {e}");
        }
        Some(Ok(r)) => {
            let _ = writeln!(
                out,
                "restore: {vm_name} runs again from '{name}' (its clock at {}.{:03} s) in {ms} ms: {} data pages read, {} zero, {} not backed",
                r.guest_us / 1_000_000,
                (r.guest_us / 1_000) % 1_000,
                r.totals.data,
                r.totals.zero,
                r.totals.not_backed
            );
        }
    }
    None
}

/// `delete <name>`.
pub fn delete(board: &mut impl Board, out: &mut String, name: &str) {
    let done = board.with_disk(|disk| Store::open(disk).and_then(|mut s| s.delete(name)));
    let _ = match done {
        None => writeln!(out, "delete: {NO_DISK}"),
        Some(Err(e)) => writeln!(out, "delete: '{name}': {e}"),
        Some(Ok(())) => writeln!(out, "snapshot '{name}' deleted"),
    };
}
