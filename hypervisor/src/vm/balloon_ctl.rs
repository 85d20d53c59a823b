//! The host's side of a VM's balloon: targets set from the shell,
//! statistics requests and hinting runs, time-driven polling, the cost of
//! each balloon change and its console lines (`info balloon` is
//! `vm::balloon_info`).

use core::fmt::{self, Write as _};

use super::cpu::PhysCpu;
use super::device_memory::DeviceView;
use super::irq;
use super::outbox::Outbox;
use super::ratelimit::{LineKind, Lines};
pub use super::state::SetBy;
use super::state::{BalloonChange, Vm, VmState};
use crate::balloon::{BalloonStats, HintError, HintRun, F_STATS_VQ};
use crate::mm::frames::PAGE_SIZE;
use crate::vgic::VgicEffect;
use crate::virtio::mmio::TransportEvent;

/// Why `hint <vm>` did not start a run.
pub enum HintStartError {
    NotRunning,
    NoBalloon,
    Device(HintError),
}

impl fmt::Display for HintStartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HintStartError::NotRunning => {
                f.write_str("it is not running (type 'start <vm>' first)")
            }
            HintStartError::NoBalloon => f.write_str("it has no balloon device"),
            HintStartError::Device(e) => write!(f, "{e}"),
        }
    }
}

/// Time-driven balloon work (statistics requests), from vCPU 0's exits:
/// while polling is scheduled, vCPU 0's WFI traps and its sleep is bounded
/// (10 ms), so it exits at least that often (`handle::traps_wfi`).
pub fn poll(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    let (Some(balloon), Some(ram)) = (vm.devices.balloon.as_mut(), vm.memory.ram.as_mut()) else {
        return;
    };
    // The clock only when a poll is scheduled: under QEMU a counter read
    // takes the global lock, and this runs after every full exit.
    let Some(due) = balloon.device().next_stats_poll_us() else {
        return;
    };
    let now = cpu.uptime_us();
    if due > now {
        return;
    }
    let mut view = DeviceView {
        ram,
        mem: cpu.memory(),
        now_us: now,
    };
    let event = balloon.poll_balloon(&mut view, now);
    if let Some(msg) = event.message() {
        let kind = event_kind(msg);
        vm.lines_at(now).say(kind, format_args!("balloon: {msg}"));
    }
    irq::update_virtio(vm, cpu);
}

/// Poll the guest's statistics every `seconds` (0: stop); `None` when the
/// VM has no balloon device. vCPU 0 is kicked: asleep in WFI with polling
/// off, it would not see the change before its next exit.
pub fn set_stats_interval(vm: &mut Vm, cpu: &mut impl PhysCpu, seconds: u32) -> Option<()> {
    vm.devices
        .balloon
        .as_mut()?
        .device_mut()
        .set_stats_interval(seconds);
    irq::apply_effect(vm, cpu, VgicEffect { kick: 1 });
    Some(())
}

/// Ask VM `vm`'s guest for fresh statistics now (`balloon-stats <vm> now`);
/// the sample arrives a moment later ([`stats_arrived_us`]).
pub fn request_stats(vm: &mut Vm, cpu: &mut impl PhysCpu) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running (type 'start <vm>' first)");
    }
    let Some(balloon) = vm.devices.balloon.as_mut() else {
        return Err("it has no balloon device");
    };
    if balloon.negotiated_features() & F_STATS_VQ == 0 {
        return Err("its guest did not accept STATS_VQ (is it offered in the VM's configuration?)");
    }
    balloon.device_mut().request_stats();
    poll(vm, cpu);
    // vCPU 0 may sleep in WFI: make it look at its interrupts.
    irq::apply_effect(vm, cpu, VgicEffect { kick: 1 });
    Ok(())
}

/// When the guest's latest statistics sample arrived (uptime, us).
pub fn stats_arrived_us(vm: &mut Vm) -> Option<u64> {
    Some(
        vm.devices
            .balloon
            .as_ref()?
            .device()
            .stats_sample()?
            .arrived_us,
    )
}

/// Start a free page hinting run in VM `vm` (shell `hint`): its command id.
pub fn start_hint(vm: &mut Vm, cpu: &mut impl PhysCpu) -> Result<u32, HintStartError> {
    if vm.state != VmState::Running {
        return Err(HintStartError::NotRunning);
    }
    let Some(balloon) = vm.devices.balloon.as_mut() else {
        return Err(HintStartError::NoBalloon);
    };
    let id = balloon
        .start_free_page_hint(cpu.uptime_us())
        .map_err(HintStartError::Device)?;
    irq::update_virtio(vm, cpu);
    Ok(id)
}

/// Set the balloon target of a VM, in 4 KiB pages, and tell the driver.
pub fn set_target(vm: &mut Vm, cpu: &mut impl PhysCpu, pages: u64) -> Result<(), &'static str> {
    set_target_by(vm, cpu, pages, SetBy::Shell)
}

/// [`set_target`], saying who set it.
pub fn set_target_by(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    pages: u64,
    by: SetBy,
) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running (type 'start <vm>' first)");
    }
    let ram_pages = vm.memory.size / PAGE_SIZE;
    let Some(balloon) = vm.devices.balloon.as_mut() else {
        return Err("it has no balloon device");
    };
    if pages > ram_pages {
        return Err("that is more than its RAM");
    }
    let from = balloon.device().actual();
    balloon.device_mut().set_target(pages as u32);
    balloon.config_changed();
    irq::update_virtio(vm, cpu);
    vm.counters.change = Some(BalloonChange {
        from,
        to: pages as u32,
        started: cpu.counter().0,
        ended: 0,
        instructions: 0,
        exits: 0,
        icache_at_start: icache_invalidations(vm),
        by,
    });
    Ok(())
}

/// When the driver reports the target reached, close the change and say
/// what it cost.
pub fn finish_change(vm: &mut Vm, cpu: &impl PhysCpu) {
    let (Some(change), Some(balloon)) = (vm.counters.change.as_mut(), vm.devices.balloon.as_ref())
    else {
        return;
    };
    if balloon.device().actual() != change.to || balloon.device().target() != change.to {
        return;
    }
    let (now, freq) = cpu.counter();
    change.ended = now;
    let change = *change;
    vm.counters.change = None;
    vm.counters.last_change = Some(change);
    if change.by == SetBy::Manager {
        return;
    }
    let micros = (change.ended - change.started) as u128 * 1_000_000 / freq.max(1) as u128;
    let pages = change.pages();
    let rate = (pages as u128 * 1_000_000).checked_div(micros).unwrap_or(0);
    let verb = if change.to >= change.from {
        "inflated"
    } else {
        "deflated"
    };
    let mut cost: heapless::String<96> = heapless::String::new();
    if cpu.counts_instructions() && pages > 0 {
        let per_page = change.instructions as f64 / pages as f64;
        let _ = write!(
            cost,
            "{per_page:.1} hypervisor instructions per page ({} in {} exits)",
            change.instructions, change.exits
        );
    } else {
        let _ = cost.push_str("hypervisor instructions: not counted (no PMU instruction event)");
    }
    let icache = icache_invalidations(vm).saturating_sub(change.icache_at_start);
    vm.console.out.line(format_args!(
        "tidal: [{}] balloon: reached {} pages: {pages} pages {verb} in {micros} us ({rate} pages/s), {cost}, {icache} I-cache invalidations",
        vm.name, change.to
    ));
}

/// Invalidations of every CPU's instruction cache this VM's memory asked
/// for so far.
fn icache_invalidations(vm: &Vm) -> u64 {
    vm.memory
        .ram
        .as_ref()
        .map_or(0, |r| r.stats.icache_invalidations)
}

/// Which rate limit a virtio transport event's line goes through.
pub fn event_kind(event: &TransportEvent) -> LineKind {
    match event {
        TransportEvent::NeedsReset { .. } => LineKind::DeviceError,
        _ => LineKind::DeviceEvent,
    }
}

/// Say which PFNs a balloon request had rejected, and why.
pub fn report_rejections(lines: &mut Lines<'_>, before: &BalloonStats, after: &BalloonStats) {
    let range = after.rejected_out_of_range - before.rejected_out_of_range;
    let dup = after.rejected_duplicate - before.rejected_duplicate;
    let already = after.rejected_already_ballooned - before.rejected_already_ballooned;
    let not = after.rejected_not_ballooned - before.rejected_not_ballooned;
    if range + dup + already + not > 0 {
        lines.say(
            LineKind::DeviceError,
            format_args!(
                "balloon: rejected PFNs: {range} outside guest RAM, {dup} duplicated, \
                 {already} already ballooned, {not} not ballooned (buffers returned, nothing unmapped)"
            ),
        );
    }
}

/// Say so when a hinting run ends (the driver's STOP made it DONE).
pub fn report_hint_end(
    out: &mut Outbox,
    name: &str,
    before: Option<HintRun>,
    after: Option<&HintRun>,
) {
    let Some(run) = after else { return };
    let was_running = before.is_some_and(|b| b.id == run.id && b.ended_us.is_none());
    if let (true, Some(ended)) = (was_running, run.ended_us) {
        out.line(format_args!(
            "tidal: [{name}] balloon: free page hint {run}; {} ({} ms)",
            crate::size::Size(run.pages_hinted.saturating_mul(PAGE_SIZE)),
            ended.saturating_sub(run.started_us) / 1000
        ));
    }
}
