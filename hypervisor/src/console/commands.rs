//! What each shell command does: one small function per command the
//! parser ([`super::shell::parse`]) gives, over a [`Board`] (the board's
//! VMs, its frame table, the memory manager and its services) and a text
//! to write to. The hypervisor's board is `run.rs`'s, and boot.rs prints
//! the text once the command is done; the host tests run the same
//! commands over VMs started on the fake CPU.
//!
//! A command writes its answer to `out`, which the caller prints in one
//! piece after every lock the command took is released (a guest's line
//! printed meanwhile cannot land inside it). What a VM's own path has to
//! say goes through its outbox, as after an exit, and the board prints it
//! as it releases that VM. What only the hypervisor itself can do (wait
//! for a VM to stop, power off, take a fault on purpose) comes back as a
//! [`Then`].

extern crate alloc;

use alloc::string::String;
use core::fmt::Write;

pub use super::board::{names, Board, ManagerFacts};
use super::shell::{self, BoardService, Command};
use crate::domain::{InjectInto, Service};
use crate::limits::MAX_GUESTS;
use crate::mm::frames::{FrameUse, PAGE_SIZE};
use crate::mm::manager::Policy;
use crate::report::Size;
use crate::snapshot::store::{Disk, Store, SECTOR};
use crate::vm::fault::OnBadAccess;
use crate::vm::manage::{self, LimitField, PoolView, VmRow};
use crate::vm::state::{InjectedFailure, Vm, VmState};
use crate::vm::{balloon_ctl, balloon_info, irq, lifecycle};

/// What the caller does after a command (what needs the hypervisor's own
/// hands: a wait, a power-off, a fault).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Then {
    Prompt,
    /// `stop`: wait up to a second for the VM to stop, and say if it did not.
    AwaitStop(heapless::String<32>),
    /// `balloon-stats <vm> now`: show the sample the VM sends after
    /// `asked` (microseconds since boot), or say none came within 2 s.
    AwaitStats {
        vm: heapless::String<32>,
        asked: u64,
    },
    PowerOff,
    /// `debug fault`: read an unmapped address, outside any recovery point.
    DebugFault,
    /// `debug panic`: panic outside any recovery point.
    DebugPanic,
    /// `debug fail-board shell`: fail in the shell's own failure domain
    /// (the command is abandoned, the shell goes on).
    FailShell,
    /// `snapshot <vm> [name]`: begin the job
    /// (`snapshot_cmds::begin`) unless one is being taken, and drive it
    /// from the shell's looks (`snapshot_cmds::step`).
    Snapshot {
        vm: heapless::String<32>,
        name: Option<crate::snapshot::store::Name>,
        hint: bool,
    },
    /// `restore`: the board's clock must first pass the guest's; the
    /// shell's looks do it when it is due.
    RestoreLater(super::snapshot_cmds::PendingRestore),
    /// `net`: the board's network card, which only the hypervisor drives.
    Net,
    /// `ping <address> [count]`: begin the echo job, driven from the
    /// shell's looks.
    Ping {
        to: [u8; 4],
        count: u32,
    },
}

/// Run `cmd`: its answer into `out`, and what the caller does next.
pub fn run(cmd: Command<'_>, board: &mut impl Board, out: &mut String) -> Then {
    match cmd {
        Command::Help => {
            let _ = shell::write_help(out);
        }
        Command::Mem => mem(board, out),
        Command::Check => board.check(out),
        Command::Cpus => board.write_cpus(out),
        Command::Vms => vms(board, out),
        Command::Snapshots => snapshots(board, out),
        Command::Snapshot { vm, name, hint } => {
            let mut v = heapless::String::new();
            let mut n = crate::snapshot::store::Name::new();
            if v.push_str(vm).is_err() || name.is_some_and(|name| n.push_str(name).is_err()) {
                let _ = writeln!(out, "snapshot: a name is at most 32 characters");
                return Then::Prompt;
            }
            return Then::Snapshot {
                vm: v,
                name: name.map(|_| n),
                hint,
            };
        }
        Command::Restore { name, into } => {
            if let Some(later) = super::snapshot_cmds::restore(board, out, name, into) {
                return Then::RestoreLater(later);
            }
        }
        Command::Delete { name } => super::snapshot_cmds::delete(board, out, name),
        Command::Net => return Then::Net,
        Command::Ping { to, count } => return Then::Ping { to, count },
        Command::OnBadAccess { vm, policy } => on_bad_access(board, out, vm, policy),
        Command::Balloon { vm, bytes } => balloon(board, out, vm, bytes),
        Command::BalloonAuto { vm } => balloon_auto(board, out, vm),
        Command::Mm { raw } => mm(board, out, raw),
        Command::MmPolicy { policy } => mm_policy(board, out, policy),
        Command::SetLimit { vm, field, value } => set_limit(board, out, vm, field, value),
        Command::InfoBalloon { vm } => info_balloon(board, out, vm),
        Command::InfoExits { vm, reset } => info_exits(board, out, vm, reset),
        Command::BalloonStats { vm, seconds } => balloon_stats(board, out, vm, seconds),
        Command::StatsNow { vm } => return stats_now(board, out, vm),
        Command::Hint { vm } => hint(board, out, vm),
        Command::Stop { vm } => return stop(board, out, vm),
        Command::Console { vm } => console(board, out, vm),
        Command::Start { vm } => start(board, out, vm),
        Command::PowerOff => {
            let _ = writeln!(out, "Powering off.");
            return Then::PowerOff;
        }
        Command::DebugFault => return Then::DebugFault,
        Command::DebugPanic => return Then::DebugPanic,
        Command::DebugFailBoard {
            service: BoardService::Shell,
        } => return Then::FailShell,
        Command::DebugFailBoard { service } => debug_fail_board(board, out, service),
        Command::DebugFailInput { vm } => debug_fail_input(board, out, vm),
        Command::DebugFail { vm, kind } => debug_fail(board, out, vm, kind),
        Command::DebugHog { bytes } => {
            let (taken, held) = board.hog(bytes.map(|b| b / PAGE_SIZE));
            let _ = writeln!(
                out,
                "debug hog: took {taken} pages ({} KiB) from the pool; {held} pages held; 'debug unhog' gives them back",
                taken.saturating_mul(4)
            );
        }
        Command::DebugUnhog => {
            let freed = board.unhog();
            let _ = writeln!(out, "debug unhog: {freed} pages back in the pool");
        }
    }
    Then::Prompt
}

/// `snapshots`: what the store on the board's disk lists (a new disk is
/// formatted on first use).
fn snapshots(board: &mut impl Board, out: &mut String) {
    let listed = board.with_disk(|disk| {
        let bytes = disk.sectors().saturating_mul(SECTOR as u64);
        Store::open(disk).map(|store| (bytes, store.list().to_vec()))
    });
    match listed {
        None => {
            let _ = writeln!(
                out,
                "snapshots: the board has no disk (on QEMU virt, `cargo xtask run` attaches target/board-disk.img, or the file --disk names)"
            );
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "snapshots: {e}");
        }
        Some(Ok((bytes, entries))) if entries.is_empty() => {
            let _ = writeln!(out, "no snapshots on the board's disk ({})", Size(bytes));
        }
        Some(Ok((bytes, entries))) => {
            let _ = writeln!(
                out,
                "{:<24} {:<16} {:>10} {:>14}  board",
                "name", "vm", "size", "taken at"
            );
            let mut used = 0u64;
            for e in &entries {
                used = used.saturating_add(e.len);
                let _ = writeln!(
                    out,
                    "{:<24} {:<16} {:>10} {:>12} s  {:#010x}",
                    e.name.as_str(),
                    e.vm.as_str(),
                    Size(e.len),
                    e.taken_us / 1_000_000,
                    e.board
                );
            }
            let _ = writeln!(
                out,
                "{} snapshots, {} of the disk's {}",
                entries.len(),
                Size(used),
                Size(bytes)
            );
        }
    }
}

fn no_such_vm(board: &mut impl Board, out: &mut String, name: &str) {
    let _ = writeln!(
        out,
        "no VM called '{name}'; the VMs are: {} (type 'vms')",
        names(board)
    );
}

/// `mem`: the memory map, the frame table's accounting, each VM's share,
/// the pool, the invariants.
fn mem(board: &mut impl Board, out: &mut String) {
    board.write_memory_map(out);
    let (acc, check, (zeroed, zeroed_taken)) =
        board.with_frames(|f| (f.accounting(), f.check_invariants(), f.zeroed_pages()));
    let ram = board.ram_bytes();
    let _ = crate::report::write_accounting(out, &acc, ram);
    let _ = writeln!(
        out,
        "Free frames zeroed ahead of time by idle CPUs: {zeroed} ({}); {zeroed_taken} given to guests so far",
        Size(zeroed.saturating_mul(PAGE_SIZE))
    );
    let _ = writeln!(out, "Guests (their frames are in \"guest RAM\" above):");
    board.for_each_vm(|vm| {
        let (mapped, tables) = vm
            .ram()
            .map_or((0, 0), |r| (r.mapped_pages(), r.table_pages()));
        let _ = writeln!(
            out,
            "  {:<12} {:<9} {:>12} bytes of RAM backed, {} of stage-2 tables",
            vm.name(),
            vm.state().label(),
            mapped.saturating_mul(PAGE_SIZE),
            Size(tables.saturating_mul(PAGE_SIZE))
        );
    });
    let _ = manage::write_pool(out, &pool_view(board));
    match check {
        Ok(()) => {
            let _ = writeln!(out, "frame table invariants: ok");
        }
        Err(e) => {
            let _ = writeln!(out, "frame table invariants: VIOLATED: {e}");
        }
    }
}

/// `vms`: a row per VM, its memory and limits, the exceptions it got.
fn vms(board: &mut impl Board, out: &mut String) {
    let _ = writeln!(
        out,
        "name         state     cpu  RAM         backed    ballooned  bad access  aborts  starts"
    );
    board.for_each_vm(|vm| {
        let mapped = vm.ram().map_or(0, |r| r.mapped_pages());
        let ballooned = vm.balloon().map_or(0, |b| b.device().ballooned_pages());
        let _ = writeln!(
            out,
            "{:<12} {:<9} {:<4} {:<11} {:<9} {:<10} {:<11} {:<7} {}",
            vm.name(),
            vm.state().label(),
            vm.cpu(),
            Size(vm.ram_size()),
            mapped,
            ballooned,
            vm.on_bad_access().label(),
            vm.bad_access().injected,
            vm.starts()
        );
    });
    for (name, row) in mm_rows(board).iter() {
        let _ = manage::write_vm_memory(out, name, row);
    }
    board.for_each_vm(|vm| {
        if vm.bad_access().injected > 0 {
            let _ = writeln!(
                out,
                "  {}: exceptions injected: {}",
                vm.name(),
                vm.bad_access()
            );
        }
    });
}

fn on_bad_access(board: &mut impl Board, out: &mut String, name: &str, policy: OnBadAccess) {
    match board.with_vm(name, |vm, _| vm.set_on_bad_access(policy)) {
        None => no_such_vm(board, out, name),
        Some(()) => {
            let _ = writeln!(
                out,
                "{name}: a bad access now gets {}",
                match policy {
                    OnBadAccess::Abort => "an exception injected into the guest",
                    OnBadAccess::Stop => "the VM stopped",
                }
            );
        }
    }
}

/// `balloon <vm> <size>`: a target the manager then leaves alone.
fn balloon(board: &mut impl Board, out: &mut String, name: &str, bytes: u64) {
    let pages = bytes / PAGE_SIZE;
    let set = board.with_vm(name, |vm, cpu| {
        balloon_ctl::set_target(vm, cpu, pages).map(|()| {
            vm.set_manual(true);
        })
    });
    let _ = match set {
        None => return no_such_vm(board, out, name),
        Some(Err(e)) => writeln!(out, "{name}: cannot set the balloon: {e}"),
        Some(Ok(())) => writeln!(
            out,
            "{name}: balloon target {pages} pages ({}); the guest moves towards it; the memory manager leaves this balloon alone until 'balloon {name} auto'",
            Size(pages.saturating_mul(PAGE_SIZE))
        ),
    };
}

fn balloon_auto(board: &mut impl Board, out: &mut String, name: &str) {
    match board.with_vm(name, |vm, _| vm.set_manual(false)) {
        None => no_such_vm(board, out, name),
        Some(_) => {
            let _ = writeln!(
                out,
                "{name}: the memory manager moves this balloon again ('mm' shows its decisions)"
            );
        }
    }
}

/// `mm [raw]`: the services a failure turned off, the pool, every VM.
fn mm(board: &mut impl Board, out: &mut String, raw: bool) {
    let pool = pool_view(board);
    let rows = mm_rows(board);
    let rows: heapless::Vec<(&str, VmRow), MAX_GUESTS> =
        rows.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    write_services(board, out, raw);
    let _ = if raw {
        manage::write_mm_raw(out, &pool, &rows)
    } else {
        let stats = board.manager().map(|m| m.stats).unwrap_or_default();
        manage::write_mm(out, &pool, &stats, &rows)
    };
}

/// The board services a failure turned off, for `mm`: one line each
/// (`mm raw`: `mm-service name=... state=on|off`, every service).
fn write_services(board: &impl Board, out: &mut String, raw: bool) {
    for service in [Service::Manager, Service::Zeroing] {
        let off = board.service_off(service);
        if raw {
            let key = if service == Service::Manager {
                "manager"
            } else {
                "zeroing"
            };
            let on = if off.is_none() { "on" } else { "off" };
            let _ = writeln!(out, "mm-service name={key} state={on}");
        } else if let Some(why) = off {
            let _ = writeln!(
                out,
                "{}: OFF since a hypervisor failure: {why}; {} (the figures below are from before)",
                service.name(),
                service.after_failure()
            );
        }
    }
}

fn mm_policy(board: &mut impl Board, out: &mut String, policy: Policy) {
    if !board.set_policy(policy) {
        let _ = writeln!(out, "mm policy: the memory manager is not running");
        return;
    }
    let _ = writeln!(
        out,
        "mm policy: balloon targets are now set by {}",
        match policy {
            Policy::Manager => "the memory manager (the default)",
            Policy::Naive =>
                "the naive baseline controller (proportional reclaim whenever the pool is below low)",
            Policy::NoController =>
                "nobody: only free page reporting and hinting return memory; balloons stay where they are",
        }
    );
}

fn set_limit(board: &mut impl Board, out: &mut String, name: &str, field: LimitField, value: u64) {
    let _ = match board.with_vm(name, |vm, cpu| manage::set_limit(vm, cpu, field, value)) {
        None => return no_such_vm(board, out, name),
        Some(Err(e)) => writeln!(
            out,
            "{name}: cannot set memory {}: {e}; type 'mm' to see its limits",
            field.name()
        ),
        Some(Ok(l)) => writeln!(
            out,
            "{name}: memory min {}, low {}, max {}, weight {}; the memory manager applies them at its next tick",
            Size(l.min.saturating_mul(PAGE_SIZE)),
            Size(l.low.saturating_mul(PAGE_SIZE)),
            Size(l.max.saturating_mul(PAGE_SIZE)),
            l.weight
        ),
    };
}

/// `info balloon [<vm>]`: one VM's block, or every VM's.
fn info_balloon(board: &mut impl Board, out: &mut String, name: Option<&str>) {
    let now = board.now_us();
    let info = |vm: &mut Vm| {
        let mut text = String::new();
        let _ = balloon_info::write_info(vm, now, &mut text);
        text
    };
    match name {
        Some(name) => match board.with_vm(name, |vm, _| info(vm)) {
            Some(text) => out.push_str(&text),
            None => no_such_vm(board, out, name),
        },
        None => board.for_each_vm(|vm| out.push_str(&info(vm))),
    }
}

/// `info exits <vm> [reset]`: the VM's exit profile, copied under its lock
/// and formatted after it; or started over.
fn info_exits(board: &mut impl Board, out: &mut String, name: &str, reset: bool) {
    let now = board.now_us();
    let copied = board.with_vm(name, |vm, _| {
        let profile = *vm.profile();
        if reset {
            vm.reset_profile(now);
        }
        let vconsole = vm.vconsole().map(|c| {
            (
                *c.device().stats(),
                irq::vconsole_takes_input(vm),
                c.stats().notifications,
                c.stats().interrupts,
            )
        });
        (
            profile,
            vm.uart_mirror().stats,
            vm.uart_mirror().is_mapped(),
            vconsole,
        )
    });
    let Some((profile, mirror, shown, vconsole)) = copied else {
        return no_such_vm(board, out, name);
    };
    if reset {
        let _ = writeln!(
            out,
            "{name}: exit profile started over (it had {} exits over {} ms)",
            profile.total().count,
            profile.elapsed_us(now) / 1000
        );
        return;
    }
    let _ = profile.write_table(name, now, board.counts_instructions(), out);
    // Since the VM was created, not reset with the profile.
    let _ = writeln!(
        out,
        "{name}: PL011 mirror page {} now (loads do not exit while shown); shown {} times, withdrawn {} (input, stops), {} register words rewritten",
        if shown { "shown" } else { "not shown" },
        mirror.shown,
        mirror.withdrawn,
        mirror.words_written
    );
    if let Some((c, takes_input, notifies, interrupts)) = vconsole {
        let _ = writeln!(
            out,
            "{name}: virtio console {}; {} bytes out in {} writes, {} bytes in in {} buffers, {} notifications, {} interrupts",
            if takes_input {
                "ready (typed input goes to it)"
            } else {
                "not ready (typed input goes to the PL011)"
            },
            c.bytes_out,
            c.chains_out,
            c.bytes_in,
            c.buffers_in,
            notifies,
            interrupts
        );
        if c.passes_cut != 0 {
            // A guest publishing faster than one exit may take.
            let _ = writeln!(
                out,
                "{name}: virtio console passes cut at their bound ({} chains, {} KiB): {}",
                crate::virtio_console::CHAINS_PER_PASS,
                crate::virtio_console::TX_BYTES_PER_PASS / 1024,
                c.passes_cut
            );
        }
    }
}

fn balloon_stats(board: &mut impl Board, out: &mut String, name: &str, seconds: u32) {
    let set = board.with_vm(name, |vm, cpu| {
        balloon_ctl::set_stats_interval(vm, cpu, seconds)
    });
    let _ = match set {
        None => return no_such_vm(board, out, name),
        Some(None) => writeln!(out, "{name}: it has no balloon device"),
        Some(Some(())) if seconds == 0 => writeln!(out, "{name}: balloon statistics polling off"),
        Some(Some(())) => writeln!(out, "{name}: balloon statistics every {seconds} s"),
    };
}

/// `balloon-stats <vm> now`: ask the guest for a fresh sample; the caller
/// waits for it ([`Then::AwaitStats`], [`stats_arrived`]).
fn stats_now(board: &mut impl Board, out: &mut String, name: &str) -> Then {
    let asked = board.now_us();
    match board.with_vm(name, balloon_ctl::request_stats) {
        None => no_such_vm(board, out, name),
        Some(Err(e)) => {
            let _ = writeln!(out, "{name}: cannot ask for statistics: {e}");
        }
        Some(Ok(())) => {
            let mut vm = heapless::String::new();
            let _ = vm.push_str(name);
            return Then::AwaitStats { vm, asked };
        }
    }
    Then::Prompt
}

/// How long `balloon-stats <vm> now` waits for the guest's sample.
pub const STATS_WAIT_US: u64 = 2_000_000;

/// A look at what `balloon-stats <vm> now` waits for ([`Then::AwaitStats`]):
/// true once it is done (the sample shown, or the wait given up), false
/// while it should look again.
pub fn stats_arrived(board: &mut impl Board, out: &mut String, name: &str, asked: u64) -> bool {
    let now = board.now_us();
    let fresh = |vm: &mut Vm| balloon_ctl::stats_arrived_us(vm).is_some_and(|t| t >= asked);
    match board.with_vm(name, |vm, _| fresh(vm)) {
        Some(true) => info_balloon(board, out, Some(name)),
        Some(false) if now.saturating_sub(asked) < STATS_WAIT_US => return false,
        _ => {
            let _ = writeln!(
                out,
                "{name}: no statistics from the guest within 2 s (is its balloon driver running?)"
            );
        }
    }
    true
}

fn hint(board: &mut impl Board, out: &mut String, name: &str) {
    let _ = match board.with_vm(name, balloon_ctl::start_hint) {
        None => return no_such_vm(board, out, name),
        Some(Err(e)) => writeln!(out, "{name}: cannot start free page hinting: {e}"),
        Some(Ok(id)) => writeln!(
            out,
            "{name}: free page hinting run {id} started; the driver hints its free blocks (info balloon {name} shows the run)"
        ),
    };
}

/// `stop <vm>`: asked; the caller waits for it ([`Then::AwaitStop`]).
fn stop(board: &mut impl Board, out: &mut String, name: &str) -> Then {
    match board.with_vm(name, lifecycle::request_stop) {
        None => no_such_vm(board, out, name),
        Some(Err(e)) => {
            let _ = writeln!(out, "{name}: cannot stop: {e}");
        }
        Some(Ok(())) => {
            let mut vm = heapless::String::new();
            let _ = vm.push_str(name);
            return Then::AwaitStop(vm);
        }
    }
    Then::Prompt
}

/// Whether VM `name` has stopped (or is gone): what [`Then::AwaitStop`]
/// waits for.
pub fn stopped(board: &mut impl Board, name: &str) -> bool {
    board
        .with_vm(name, |vm, _| vm.state() == VmState::Stopped)
        .unwrap_or(true)
}

/// What `stop` says when the VM did not stop within its wait.
pub fn write_not_stopped(out: &mut String, name: &str) {
    let _ = writeln!(
        out,
        "{name}: stop requested; it stops at its next exit (it has not trapped for 1 s)"
    );
}

fn console(board: &mut impl Board, out: &mut String, name: &str) {
    if board.with_vm(name, |_, _| ()).is_none() {
        return no_such_vm(board, out, name);
    }
    let _ = writeln!(
        out,
        "Connected to {name}'s console; Ctrl-] comes back to the shell."
    );
    if !board.focus(name) {
        no_such_vm(board, out, name);
    }
}

fn start(board: &mut impl Board, out: &mut String, name: &str) {
    let _ = match board.with_vm(name, lifecycle::start) {
        None => return no_such_vm(board, out, name),
        Some(Err(e)) => writeln!(out, "{name}: cannot start: {e}"),
        Some(Ok(())) => writeln!(out, "{name}: started"),
    };
}

fn debug_fail_board(board: &mut impl Board, out: &mut String, service: BoardService) {
    let _ = match service {
        // Not here: the shell's failure is the caller's ([`Then::FailShell`]).
        BoardService::Shell => return,
        BoardService::Manager => {
            board.inject(InjectInto::Manager);
            writeln!(
                out,
                "debug: a hypervisor failure is injected into the memory manager's next tick"
            )
        }
        BoardService::Zeroing => {
            board.inject(InjectInto::Zeroing);
            writeln!(
                out,
                "debug: a hypervisor failure is injected into zeroing ahead's next decision"
            )
        }
    };
}

fn debug_fail_input(board: &mut impl Board, out: &mut String, name: &str) {
    match board.with_vm(name, |vm, _| vm.id()) {
        None => no_such_vm(board, out, name),
        Some(id) => {
            board.inject(InjectInto::Input(id));
            let _ = writeln!(
                out,
                "{name}: a hypervisor failure is injected into the memory manager's next reading of its input"
            );
        }
    }
}

fn debug_fail(board: &mut impl Board, out: &mut String, name: &str, kind: InjectedFailure) {
    let _ = match board.with_vm(name, |vm, cpu| lifecycle::inject_failure(vm, cpu, kind)) {
        None => return no_such_vm(board, out, name),
        Some(Err(e)) => writeln!(out, "{name}: cannot inject a failure: {e}"),
        Some(Ok(())) => writeln!(
            out,
            "{name}: a hypervisor failure is injected at its next exit, with its lock and the frame table held"
        ),
    };
}

/// The pool as `mm` and `mem` show it.
pub fn pool_view(board: &mut impl Board) -> PoolView {
    let manager = board.manager().unwrap_or_default();
    let (total, free, reserved, backed) = board.with_frames(|f| {
        (
            f.total_pages(),
            f.free_pages(),
            f.reserved(),
            f.pages(FrameUse::Guest),
        )
    });
    let (mut committed, mut committed_running) = (0u64, 0u64);
    board.for_each_vm(|vm| {
        committed = committed.saturating_add(vm.ram_size() / PAGE_SIZE);
        if vm.ram().is_some() {
            committed_running = committed_running.saturating_add(vm.ram_size() / PAGE_SIZE);
        }
    });
    PoolView {
        physical_bytes: board.ram_bytes(),
        total,
        free,
        reserved,
        committed,
        committed_running,
        backed,
        watermarks: manager.watermarks,
        stop_lowest: manager.stop_lowest,
        exhausted_stops: manager.exhausted_stops,
        policy: manager.policy,
    }
}

/// Every VM's `mm` row, in table order.
pub fn mm_rows(board: &mut impl Board) -> heapless::Vec<(heapless::String<32>, VmRow), MAX_GUESTS> {
    let stats = board.manager().map(|m| m.vms).unwrap_or_default();
    let mut rows = heapless::Vec::new();
    board.for_each_vm(|vm| {
        let _ = rows.push((
            vm.name().clone(),
            manage::row(vm, stats[vm.id() % MAX_GUESTS]),
        ));
    });
    rows
}

#[cfg(test)]
mod tests {
    use alloc::vec::Vec;

    use guest_bundle::{BundleBuilder, VmMemory, VmSpec};

    use super::*;
    use crate::domain::REASON_BYTES;
    use crate::mm::frames::FrameTable;
    use crate::snapshot::testing::RamDisk;
    use crate::vm::check::{self, FrameFacts, RamFacts, VmFacts};
    use crate::vm::outbox::Notice;
    use crate::vm::state::GuestGic;
    use crate::vm::testing::FakeCpu;

    /// RAM of the fake board, in pages (16 MiB).
    const BOARD_PAGES: u64 = 4096;

    /// A board of two VMs over the fake CPU: `alpha` (8 MiB, a balloon,
    /// started) and `beta` (4 MiB, no balloon, stopped).
    pub(super) struct FakeBoard {
        vms: Vec<Vm>,
        cpu: FakeCpu,
        manager: Option<ManagerFacts>,
        off: Option<Service>,
        /// What the VMs' outboxes printed, line by line.
        printed: Vec<alloc::string::String>,
        focused: Option<alloc::string::String>,
        injected: Vec<InjectInto>,
        hogged: u64,
        /// The board's disk, as sectors in memory.
        pub(super) disk: Option<RamDisk>,
    }

    fn kernel() -> Vec<u8> {
        let mut k = alloc::vec![0u8; 8192];
        k[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
        k[16..24].copy_from_slice(&(1u64 << 20).to_le_bytes());
        k[56..60].copy_from_slice(b"ARM\x64");
        k
    }

    fn spec(name: &str, ram_size: u64, cpu: u32, devices: u64) -> VmSpec {
        VmSpec {
            name: name.into(),
            ram_size,
            vcpus: 1,
            cpu_affinity: 1 << cpu,
            kernel: kernel(),
            initrd: None,
            cmdline: Some("console=ttyAMA0".into()),
            balloon_features: if devices & guest_bundle::devices::BALLOON != 0 {
                crate::balloon::F_VERSION_1
            } else {
                0
            },
            devices,
            on_bad_access: 0,
            restore: None,
        }
    }

    impl FakeBoard {
        pub(super) fn new() -> Self {
            let bytes = BundleBuilder::new()
                .add_vm_with_memory(
                    spec("alpha", 8 << 20, 1, guest_bundle::devices::BALLOON),
                    VmMemory::default(),
                )
                .expect("valid VM")
                .add_vm_with_memory(spec("beta", 4 << 20, 2, 0), VmMemory::default())
                .expect("valid VM")
                .build();
            let bytes: &'static [u8] = alloc::boxed::Box::leak(bytes.into_boxed_slice());
            let bundle = guest_bundle::parse(bytes).expect("a bundle the builder made");
            let vms: Vec<Vm> = bundle
                .vms()
                .enumerate()
                .map(|(id, spec)| Vm::new(id, spec, GuestGic::V3))
                .collect();
            let mut board = FakeBoard {
                vms,
                cpu: FakeCpu::new(BOARD_PAGES),
                manager: None,
                off: None,
                printed: Vec::new(),
                focused: None,
                injected: Vec::new(),
                hogged: 0,
                disk: None,
            };
            lifecycle::start(&mut board.vms[0], &mut board.cpu).expect("alpha starts");
            board
        }

        /// `line` parsed and run: its answer, and what comes next.
        pub(super) fn type_line(&mut self, line: &str) -> (alloc::string::String, Then) {
            let cmd = shell::parse(line).expect("parses").expect("a command");
            let mut out = alloc::string::String::new();
            let then = run(cmd, self, &mut out);
            (out, then)
        }

        pub(super) fn answer(&mut self, line: &str) -> alloc::string::String {
            let (out, then) = self.type_line(line);
            assert_eq!(then, Then::Prompt, "{line}");
            out
        }

        pub(super) fn vm(&self, name: &str) -> &Vm {
            self.vms
                .iter()
                .find(|v| v.name().as_str() == name)
                .expect("a VM")
        }

        fn drain(printed: &mut Vec<alloc::string::String>, vm: &mut Vm) {
            let (notices, _) = vm.out().take();
            for notice in notices {
                if let Notice::Line(line) = notice {
                    printed.push(line);
                }
            }
        }
    }

    impl Board for FakeBoard {
        type Cpu = FakeCpu;

        fn with_vm<R>(
            &mut self,
            name: &str,
            f: impl FnOnce(&mut Vm, &mut FakeCpu) -> R,
        ) -> Option<R> {
            let vm = self.vms.iter_mut().find(|v| v.name().as_str() == name)?;
            let result = f(vm, &mut self.cpu);
            Self::drain(&mut self.printed, vm);
            Some(result)
        }

        fn for_each_vm(&mut self, mut f: impl FnMut(&mut Vm)) {
            for vm in self.vms.iter_mut() {
                f(vm);
                Self::drain(&mut self.printed, vm);
            }
        }

        fn with_frames<R>(&mut self, f: impl FnOnce(&FrameTable<'_>) -> R) -> R {
            f(&self.cpu.host.frames)
        }

        fn manager(&mut self) -> Option<ManagerFacts> {
            self.manager
        }

        fn set_policy(&mut self, policy: Policy) -> bool {
            self.manager.as_mut().map(|m| m.policy = policy).is_some()
        }

        fn service_off(&self, service: Service) -> Option<heapless::String<REASON_BYTES>> {
            (self.off == Some(service)).then(|| heapless::String::try_from("injected").unwrap())
        }

        fn ram_bytes(&self) -> u64 {
            BOARD_PAGES * PAGE_SIZE
        }

        fn now_us(&self) -> u64 {
            self.cpu.now_us
        }

        fn counts_instructions(&self) -> bool {
            true
        }

        fn check(&mut self, out: &mut String) {
            let facts = FrameFacts::of(&self.cpu.host.frames, self.ram_bytes());
            let host = &mut self.cpu.host;
            let vms: Vec<VmFacts<'_>> = self
                .vms
                .iter()
                .map(|vm| VmFacts {
                    id: vm.id(),
                    name: vm.name(),
                    stopped: vm.state() == VmState::Stopped,
                    ram: vm.ram().map(|r| RamFacts::of(r, host)),
                })
                .collect();
            let _ = check::write_result(out, &check::check(&facts, &vms));
        }

        fn write_memory_map(&self, out: &mut String) {
            out.push_str("(the memory map)\n");
        }

        fn write_cpus(&self, out: &mut String) {
            out.push_str("(the cpus)\n");
        }

        fn focus(&mut self, name: &str) -> bool {
            let found = self.vms.iter().any(|v| v.name().as_str() == name);
            if found {
                self.focused = Some(name.into());
            }
            found
        }

        fn inject(&mut self, into: InjectInto) {
            self.injected.push(into);
        }

        fn hog(&mut self, pages: Option<u64>) -> (u64, u64) {
            let taken = pages.unwrap_or(100);
            self.hogged += taken;
            (taken, self.hogged)
        }

        fn unhog(&mut self) -> u64 {
            core::mem::take(&mut self.hogged)
        }

        fn with_disk<R>(&mut self, f: impl FnOnce(&mut dyn Disk) -> R) -> Option<R> {
            self.disk.as_mut().map(|d| f(d))
        }

        fn with_vm_and_disk<R>(
            &mut self,
            name: &str,
            f: impl FnOnce(&mut Vm, &mut FakeCpu, Option<&mut dyn Disk>) -> R,
        ) -> Option<R> {
            let vm = self.vms.iter_mut().find(|v| v.name().as_str() == name)?;
            let disk = self.disk.as_mut().map(|d| d as &mut dyn Disk);
            let result = f(vm, &mut self.cpu, disk);
            Self::drain(&mut self.printed, vm);
            Some(result)
        }

        fn snapshot_board(&self) -> crate::vm::snapshot::BoardId {
            crate::vm::snapshot::BoardId {
                tag: 0x0001_0003,
                midr: 0x410f_d083,
                counter_hz: 62_500_000,
                counter_may_lead: true,
            }
        }

        fn counter_now(&self) -> u64 {
            self.cpu.now_us.saturating_mul(62) + self.cpu.now_us / 2
        }
    }

    #[test]
    fn snapshots_lists_the_store_or_says_why_not() {
        let mut board = FakeBoard::new();
        assert!(board
            .answer("snapshots")
            .starts_with("snapshots: the board has no disk"));
        // A new disk is formatted and empty.
        board.disk = Some(RamDisk::new(2048));
        assert_eq!(
            board.answer("snapshots"),
            "no snapshots on the board's disk (1 MiB)\n"
        );
        // One snapshot written through the store is listed.
        let disk = board.disk.as_mut().unwrap();
        let mut store = Store::open(disk).unwrap();
        let mut w = store.begin("before-upgrade", "alpha").unwrap();
        w.write(&[7u8; 3000]).unwrap();
        w.commit(90_000_000, 0x0001_0002).unwrap();
        let out = board.answer("snapshots");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(lines[1].starts_with("before-upgrade"), "{out}");
        assert!(
            lines[1].contains("alpha") && lines[1].contains(" 90 s"),
            "{out}"
        );
        assert!(lines[1].ends_with("0x00010002"), "{out}");
        assert!(lines[2].starts_with("1 snapshots,"), "{out}");
        // A disk that holds something else is left alone, and said so.
        board.disk = Some(RamDisk::from_bytes(alloc::vec![0xee; 2048 * SECTOR]));
        assert!(board
            .answer("snapshots")
            .starts_with("snapshots: the disk holds something else"));
        assert!(board
            .disk
            .as_ref()
            .unwrap()
            .bytes
            .iter()
            .all(|&b| b == 0xee));
    }

    #[test]
    fn an_unknown_vm_is_named_with_the_vms_there_are() {
        let mut board = FakeBoard::new();
        for line in [
            "balloon ghost 1M",
            "balloon ghost auto",
            "start ghost",
            "stop ghost",
            "console ghost",
            "info balloon ghost",
            "info exits ghost",
            "hint ghost",
            "balloon-stats ghost 2",
            "balloon-stats ghost now",
            "on-bad-access ghost stop",
            "set ghost max 4M",
            "debug fail ghost",
            "debug fail-input ghost",
        ] {
            assert_eq!(
                board.answer(line),
                "no VM called 'ghost'; the VMs are: alpha, beta (type 'vms')\n",
                "{line}"
            );
        }
        assert!(board.focused.is_none() && board.injected.is_empty());
    }

    #[test]
    fn balloon_sets_the_target_and_takes_it_from_the_manager_until_auto() {
        let mut board = FakeBoard::new();
        let out = board.answer("balloon alpha 2M");
        assert!(
            out.starts_with("alpha: balloon target 512 pages (2 MiB); the guest moves towards it;"),
            "{out}"
        );
        let vm = board.vm("alpha");
        assert!(vm.managed().manual());
        assert_eq!(vm.balloon().unwrap().device().target(), 512);
        assert!(board
            .answer("balloon alpha auto")
            .contains("moves this balloon again"));
        assert!(!board.vm("alpha").managed().manual());
        // Refused: stays manual-free, says why.
        assert_eq!(
            board.answer("balloon beta 1M"),
            "beta: cannot set the balloon: it is not running (type 'start <vm>' first)\n"
        );
        assert!(!board.vm("beta").managed().manual());
        assert_eq!(
            board.answer("balloon alpha 9M"),
            "alpha: cannot set the balloon: that is more than its RAM\n"
        );
    }

    #[test]
    fn start_and_stop_go_through_the_lifecycle() {
        let mut board = FakeBoard::new();
        assert_eq!(board.answer("start beta"), "beta: started\n");
        assert_eq!(board.vm("beta").state(), VmState::Running);
        assert_eq!(
            board.answer("start beta"),
            "beta: cannot start: it is already running\n"
        );
        let (out, then) = board.type_line("stop beta");
        assert_eq!(out, "");
        assert_eq!(then, Then::AwaitStop("beta".try_into().unwrap()));
        // No vCPU of it is inside its run loop: it stops at once.
        assert!(stopped(&mut board, "beta"));
        assert_eq!(board.vm("beta").state(), VmState::Stopped);
        assert_eq!(
            board.answer("stop beta"),
            "beta: cannot stop: it is not running\n"
        );
        assert!(
            stopped(&mut board, "ghost"),
            "a VM that is gone is not waited for"
        );
        let mut out = String::new();
        write_not_stopped(&mut out, "beta");
        assert!(out.starts_with("beta: stop requested; it stops at its next exit"));
    }

    #[test]
    fn vms_and_mem_show_every_vm() {
        let mut board = FakeBoard::new();
        let out = board.answer("vms");
        let rows: Vec<&str> = out.lines().collect();
        assert!(rows[0].starts_with("name         state"), "{out}");
        assert!(rows[1].starts_with("alpha        running"), "{out}");
        assert!(rows[2].starts_with("beta         stopped"), "{out}");
        let mem = board.answer("mem");
        assert!(mem.starts_with("(the memory map)\n"), "{mem}");
        assert!(mem.contains("  alpha        running"), "{mem}");
        assert!(mem.contains("  beta         stopped"), "{mem}");
        assert!(mem.ends_with("frame table invariants: ok\n"), "{mem}");
        let check = board.answer("check");
        assert!(check.contains("ok"), "{check}");
    }

    #[test]
    fn mm_says_which_services_are_off_and_policy_needs_a_manager() {
        let mut board = FakeBoard::new();
        assert_eq!(
            board.answer("mm policy naive"),
            "mm policy: the memory manager is not running\n"
        );
        board.manager = Some(ManagerFacts::default());
        assert!(board
            .answer("mm policy naive")
            .starts_with("mm policy: balloon targets are now set by the naive baseline"));
        assert_eq!(board.manager.unwrap().policy, Policy::Naive);
        let raw = board.answer("mm raw");
        assert!(
            raw.starts_with("mm-service name=manager state=on\nmm-service name=zeroing state=on\n"),
            "{raw}"
        );
        assert!(!board.answer("mm").contains("OFF since"));
        board.off = Some(Service::Zeroing);
        let raw = board.answer("mm raw");
        assert!(raw.contains("mm-service name=zeroing state=off"), "{raw}");
        let mm = board.answer("mm");
        assert!(
            mm.starts_with("zeroing ahead: OFF since a hypervisor failure: injected; frames are zeroed when a guest takes them"),
            "{mm}"
        );
    }

    #[test]
    fn stats_now_waits_for_a_sample_newer_than_the_question_for_two_seconds() {
        let mut board = FakeBoard::new();
        assert!(board
            .answer("balloon-stats beta now")
            .starts_with("beta: cannot ask for statistics: it is not running"));
        // A driver that did not take the statistics queue is not asked.
        assert!(board
            .answer("balloon-stats alpha now")
            .starts_with("alpha: cannot ask for statistics: its guest did not accept STATS_VQ"));
        let asked = board.cpu.now_us;
        let mut out = String::new();
        assert!(!stats_arrived(&mut board, &mut out, "alpha", asked));
        board.cpu.now_us += STATS_WAIT_US - 1;
        assert!(!stats_arrived(&mut board, &mut out, "alpha", asked));
        assert_eq!(out, "");
        board.cpu.now_us += 1;
        assert!(stats_arrived(&mut board, &mut out, "alpha", asked));
        assert!(
            out.starts_with("alpha: no statistics from the guest within 2 s"),
            "{out}"
        );
        let mut out = String::new();
        assert!(
            stats_arrived(&mut board, &mut out, "ghost", asked),
            "a VM that is gone is not waited for"
        );
    }

    #[test]
    fn debug_commands_reach_the_board() {
        let mut board = FakeBoard::new();
        assert!(board
            .answer("debug fail-board mm")
            .contains("memory manager's next tick"));
        assert!(board
            .answer("debug fail-board zeroing")
            .contains("zeroing ahead's next decision"));
        assert!(board
            .answer("debug fail-input beta")
            .starts_with("beta: a hypervisor failure"));
        assert_eq!(
            board.injected,
            [
                InjectInto::Manager,
                InjectInto::Zeroing,
                InjectInto::Input(1)
            ]
        );
        assert!(board
            .answer("debug fail alpha")
            .starts_with("alpha: a hypervisor failure is injected"));
        assert_eq!(
            board.vm("alpha").inject_failure(),
            Some(InjectedFailure::Panic)
        );
        assert!(board
            .answer("debug fail beta")
            .starts_with("beta: cannot inject a failure: "));
        assert!(board
            .answer("debug hog 1M")
            .starts_with("debug hog: took 256 pages (1024 KiB)"));
        assert_eq!(
            board.answer("debug unhog"),
            "debug unhog: 256 pages back in the pool\n"
        );
        assert_eq!(board.type_line("debug panic").1, Then::DebugPanic);
        assert_eq!(board.type_line("debug fault").1, Then::DebugFault);
        let (out, then) = board.type_line("poweroff");
        assert_eq!((out.as_str(), then), ("Powering off.\n", Then::PowerOff));
    }

    #[test]
    fn a_failure_injected_into_the_shell_is_the_shells_own() {
        let mut board = FakeBoard::new();
        assert_eq!(
            board.type_line("debug fail-board shell"),
            (String::new(), Then::FailShell)
        );
        assert!(board.injected.is_empty());
    }

    #[test]
    fn console_info_and_settings() {
        let mut board = FakeBoard::new();
        assert!(board
            .answer("console beta")
            .starts_with("Connected to beta's console"));
        assert_eq!(board.focused.as_deref(), Some("beta"));
        assert_eq!(
            board.answer("on-bad-access alpha stop"),
            "alpha: a bad access now gets the VM stopped\n"
        );
        assert_eq!(board.vm("alpha").on_bad_access(), OnBadAccess::Stop);
        let all = board.answer("info balloon");
        let one = board.answer("info balloon alpha");
        assert!(all.contains(&one) && all.len() > one.len(), "{all}");
        assert!(board
            .answer("info exits alpha")
            .contains("alpha: PL011 mirror page"));
        assert!(board
            .answer("info exits alpha reset")
            .starts_with("alpha: exit profile started over"));
        assert_eq!(
            board.answer("balloon-stats alpha 5"),
            "alpha: balloon statistics every 5 s\n"
        );
        assert_eq!(
            board.answer("balloon-stats beta 5"),
            "beta: it has no balloon device\n"
        );
        assert!(board
            .answer("set alpha max 6M")
            .starts_with("alpha: memory min"));
        assert!(board
            .answer("set alpha min 9M")
            .starts_with("alpha: cannot set memory min: "));
        assert!(board
            .answer("hint alpha")
            .starts_with("alpha: cannot start free page hinting: "));
        assert!(board.answer("help").contains("balloon"));
    }
}

#[cfg(test)]
mod snapshot_command_tests {
    //! `snapshot`, `restore` and `delete` through the shell over the fake
    //! board: the job's steps, what the console says, and that a failed
    //! snapshot leaves the VM running and nothing listed.

    use super::tests::FakeBoard;
    use super::*;
    use crate::console::snapshot_cmds::{self, SnapshotJob};
    use crate::hw::context::{El1State, VirtualInterface};
    use crate::snapshot::testing::RamDisk;
    use crate::vm::pause;
    use crate::vm::vcpu_state::{Running, VcpuState};
    use crate::vm::vcpus::Power;

    /// `line` typed: the job it begins (its answer in `out`).
    fn begin(board: &mut FakeBoard, line: &str, out: &mut String) -> Option<SnapshotJob> {
        let (text, then) = board.type_line(line);
        out.push_str(&text);
        let Then::Snapshot { vm, name, hint } = then else {
            return None;
        };
        snapshot_cmds::begin(board, out, &vm, name.as_deref(), hint)
    }

    /// alpha's vCPU 0 inside its loop: it saves its state when paused.
    fn enter_alpha(board: &mut FakeBoard) {
        board.with_vm("alpha", |vm, _| {
            lifecycle::enter(vm, 0).expect("enters");
        });
    }

    fn capture_alpha(board: &mut FakeBoard) {
        board.with_vm("alpha", |vm, _| {
            assert!(pause::pause_due(vm, 0));
            let mut ctx = crate::vm::cpu::GuestContext::new(0x4020_0000, 0);
            ctx.x[3] = 33;
            pause::captured(
                vm,
                0,
                VcpuState {
                    power: Power::On,
                    running: Some(Running {
                        ctx,
                        el1: El1State::reset(),
                        vif: VirtualInterface {
                            count: 4,
                            ..VirtualInterface::default()
                        },
                        listed: [None; crate::limits::MAX_LRS],
                    }),
                },
            );
        });
    }

    #[test]
    fn a_snapshot_is_taken_listed_restored_and_deleted() {
        let mut board = FakeBoard::new();
        board.disk = Some(RamDisk::new(64 << 11));
        enter_alpha(&mut board);
        let mut out = String::new();
        let mut job = begin(&mut board, "snapshot alpha", &mut out).expect("a job");
        assert!(out.contains("alpha does not hint its free pages"), "{out}");
        assert_eq!(job.name.as_str(), "alpha-1", "the first free name");
        // Its vCPU has not paused yet: the job waits.
        let mut out = String::new();
        assert!(!snapshot_cmds::step(&mut board, &mut out, &mut job));
        assert!(out.is_empty(), "{out}");
        capture_alpha(&mut board);
        // Paused: said, then written at the next step.
        assert!(!snapshot_cmds::step(&mut board, &mut out, &mut job));
        assert!(
            out.contains("snapshot alpha-1: alpha paused; writing it"),
            "{out}"
        );
        assert!(board.vm("alpha").pause_requested(), "still paused");
        assert!(snapshot_cmds::step(&mut board, &mut out, &mut job));
        assert!(out.contains("snapshot alpha-1: alpha saved"), "{out}");
        assert!(out.contains("pages: "), "{out}");
        assert!(!board.vm("alpha").pause_requested(), "it goes on");
        assert!(board.answer("snapshots").contains("alpha-1"));
        // A name that exists, and a second job is refused at once.
        let mut out = String::new();
        assert!(begin(&mut board, "snapshot alpha alpha-1", &mut out).is_none());
        assert!(out.contains("exists"), "{out}");

        // Restore into the running VM: refused, it runs on.
        let out = board.answer("restore alpha-1");
        assert!(out.contains("already running"), "{out}");
        board.type_line("stop alpha");
        // Its vCPU leaves at its next exit.
        board.with_vm("alpha", |vm, cpu| lifecycle::leave(vm, cpu, 0, true));
        assert!(stopped(&mut board, "alpha"));
        let out = board.answer("restore alpha-1");
        assert!(
            out.contains("restore: alpha runs again from 'alpha-1'"),
            "{out}"
        );
        assert_eq!(board.vm("alpha").state(), VmState::Running);
        let ctx = board.with_vm("alpha", |vm, _| lifecycle::take_restored(vm, 0));
        assert_eq!(ctx.flatten().map(|r| r.ctx.x[3]), Some(33));
        // Into another VM of another configuration: refused.
        let out = board.answer("restore alpha-1 as beta");
        assert!(out.contains("restore: beta not started"), "{out}");
        assert_eq!(
            board.answer("delete alpha-1"),
            "snapshot 'alpha-1' deleted\n"
        );
        assert!(board
            .answer("restore alpha-1")
            .contains("no snapshot called"));
        assert!(board.answer("delete alpha-1").contains("no snapshot"));
        assert!(
            board.answer("check").contains("ok"),
            "{}",
            board.answer("check")
        );
    }

    #[test]
    fn a_full_disk_leaves_the_vm_running_and_nothing_listed() {
        let mut board = FakeBoard::new();
        // Room for the directory and a few sectors of data only.
        board.disk = Some(RamDisk::new(75));
        enter_alpha(&mut board);
        let mut out = String::new();
        let mut job = begin(&mut board, "snapshot alpha big", &mut out).expect("a job");
        capture_alpha(&mut board);
        let mut out = String::new();
        assert!(!snapshot_cmds::step(&mut board, &mut out, &mut job));
        assert!(snapshot_cmds::step(&mut board, &mut out, &mut job));
        assert!(
            out.contains("snapshot big: not taken: the disk is full"),
            "{out}"
        );
        assert!(out.contains("alpha goes on running"), "{out}");
        assert!(!board.vm("alpha").pause_requested());
        assert_eq!(board.vm("alpha").state(), VmState::Running);
        assert!(board.answer("snapshots").starts_with("no snapshots"));
    }

    #[test]
    fn without_a_disk_or_a_running_vm_nothing_begins() {
        let mut board = FakeBoard::new();
        let mut out = String::new();
        assert!(begin(&mut board, "snapshot alpha", &mut out).is_none());
        assert!(out.contains("the board has no disk"), "{out}");
        board.disk = Some(RamDisk::new(4096));
        let mut out = String::new();
        assert!(begin(&mut board, "snapshot beta", &mut out).is_none());
        assert!(out.contains("beta is not running"), "{out}");
        let mut out = String::new();
        assert!(begin(&mut board, "snapshot ghost", &mut out).is_none());
        assert!(out.contains("no VM called 'ghost'"), "{out}");
        assert!(board
            .answer("restore nothing")
            .contains("no snapshot called"));
    }
}
