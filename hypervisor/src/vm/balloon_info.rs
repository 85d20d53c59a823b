//! The text of `info balloon`: a VM's balloon device, its optional
//! features, the guest's latest statistics and the VM's exit and memory
//! counters, formatted from the state and counters the device and the VM
//! keep (the device models print nothing themselves).

use core::fmt;

use super::exit_profile::ExitKind;
use super::state::Vm;
use crate::addr::PAGE_SIZE;
use crate::balloon::stats::{Seconds, StatUnit, StatsSample, STAT_TABLE};
use crate::balloon::{
    Balloon, HintOutcome, HintState, F_DEFLATE_ON_OOM, F_FREE_PAGE_HINT, F_PAGE_POISON,
    F_PAGE_REPORTING, F_STATS_VQ,
};
use crate::size::Size;

/// The transport's interrupt state, from the device to the vGIC, and each
/// ready queue's indices: what to look at when a driver stops answering.
fn write_transport_line(
    out: &mut impl fmt::Write,
    vm: &Vm,
    balloon: &crate::virtio::mmio::MmioTransport<Balloon>,
) -> fmt::Result {
    let intid = super::irq::VIRTIO_INTID;
    let (line, pending) = vm.devices.vgic.as_ref().map_or((None, false), |g| {
        (g.spi_line(intid), g.is_pending(0, intid))
    });
    let listed = vm
        .vcpus
        .listed(0)
        .is_some_and(|lrs| lrs.contains(&Some(intid)));
    writeln!(
        out,
        "  interrupt: status {:#x}, line {}, pending in the vGIC {}, in a list register {}",
        balloon.interrupt_status(),
        line.map_or("none", |l| if l { "high" } else { "low" }),
        if pending { "yes" } else { "no" },
        if listed { "yes" } else { "no" },
    )?;
    let mut sep = "  queues:";
    for (i, q) in balloon
        .queues()
        .iter()
        .enumerate()
        .filter(|(_, q)| q.ready())
    {
        write!(
            out,
            "{sep} {i}: next avail {}, used {}, {} in flight",
            q.last_avail_idx(),
            q.used_idx(),
            q.in_flight()
        )?;
        sep = ";";
    }
    match sep {
        ";" => writeln!(out),
        _ => writeln!(out, "  queues: none ready"),
    }
}

/// The `info balloon` block of one VM.
pub fn write_info(vm: &Vm, now_us: u64, out: &mut impl fmt::Write) -> fmt::Result {
    let Some(balloon) = vm.devices.balloon.as_ref() else {
        return match &vm.counters.last_balloon_stats {
            Some(stats) => writeln!(
                out,
                "{}: {}; {}; its balloon's last counters: {stats}",
                vm.name,
                vm.state.label(),
                vm.last_stop
            ),
            None => writeln!(out, "{}: no balloon device ({})", vm.name, vm.state.label()),
        };
    };
    let dev = balloon.device();
    let (target, actual) = (u64::from(dev.target()), u64::from(dev.actual()));
    writeln!(out, "{}: balloon ({})", vm.name, vm.state.label())?;
    writeln!(
        out,
        "  target {target} pages ({}), actual {actual} pages ({}), ballooned {} pages",
        Size(target * PAGE_SIZE),
        Size(actual * PAGE_SIZE),
        dev.ballooned_pages()
    )?;
    writeln!(
        out,
        "  features offered: {}; negotiated: {}",
        crate::balloon::feature_names(balloon.offered_features()),
        crate::balloon::feature_names(balloon.negotiated_features())
    )?;
    writeln!(out, "  {}", dev.stats())?;
    write_transport_line(out, vm, balloon)?;
    write_feature_lines(out, dev, now_us)?;
    if vm.managed.inputs_clamped != 0 {
        writeln!(
            out,
            "  memory manager inputs clamped to the VM's size: {}",
            vm.managed.inputs_clamped
        )?;
    }
    if let Some(e) = balloon.last_error() {
        writeln!(out, "  last device error: {e}")?;
    }
    // Since the VM started or `info exits <vm> reset` (`info exits` has
    // them by kind).
    let p = &vm.counters.profile;
    let total = p.total();
    writeln!(
        out,
        "  exits: {} ({} MMIO, {} HVC/SMC, {} WFI/WFE, {} faults), {} EL2 instructions each on average",
        total.count,
        p.count_where(ExitKind::is_mmio),
        p.count_where(|k| matches!(k, ExitKind::Hvc | ExitKind::Smc)),
        p.count_where(|k| matches!(k, ExitKind::Wfi | ExitKind::Wfe)),
        p.count_where(|k| matches!(k, ExitKind::Stage2Fault | ExitKind::BadAccess)),
        total.instructions / total.count.max(1)
    )?;
    if let Some(ram) = vm.memory.ram.as_ref() {
        writeln!(
            out,
            "  memory: {} pages mapped, {} backed again on fault, {} released, {} TLB flushes, {} I-cache invalidations",
            ram.mapped_pages(),
            ram.stats.faults_backed,
            ram.stats.pages_released,
            ram.stats.tlb_flushes,
            ram.stats.icache_invalidations
        )?;
    }
    Ok(())
}

/// What `info balloon <vm>` prints about the optional features at
/// `now_us`: OOM deflates, page poison, reporting, hinting (state and
/// latest run) and the latest guest statistics with their age. One line
/// per item, each starting with two spaces and ending with a newline;
/// features not negotiated are left out.
pub fn write_feature_lines(f: &mut impl fmt::Write, b: &Balloon, now_us: u64) -> fmt::Result {
    let s = b.stats();
    let has = |feature| b.negotiated_features() & feature != 0;
    if has(F_DEFLATE_ON_OOM) || s.pages_deflated_on_oom != 0 {
        writeln!(
            f,
            "  deflated on OOM: {} pages ({})",
            s.pages_deflated_on_oom,
            Size(s.pages_deflated_on_oom.saturating_mul(PAGE_SIZE))
        )?;
    }
    if has(F_PAGE_POISON) {
        writeln!(
            f,
            "  page poison: {:#010x}; pages backed again are filled with it",
            b.poison_val()
        )?;
    }
    if has(F_PAGE_REPORTING) {
        writeln!(
            f,
            "  free page reporting: {} reports, {} blocks, {} pages ({}) given back",
            s.reports,
            s.report_blocks,
            s.pages_reported,
            Size(s.pages_reported.saturating_mul(PAGE_SIZE))
        )?;
    }
    if has(F_FREE_PAGE_HINT) {
        let state = match b.hint_state() {
            HintState::Idle => "idle",
            HintState::Requested => "waiting for the driver",
            HintState::Started => "hinting",
            HintState::HostStopped => "stopping",
            HintState::Done => "done",
        };
        write!(
            f,
            "  free page hinting: {state}, cmd id {}",
            b.free_page_hint_cmd_id()
        )?;
        if s.hint_ids_stale + s.hint_buffers_stale != 0 {
            write!(
                f,
                " ({} stale ids, {} stale hint buffers ignored)",
                s.hint_ids_stale, s.hint_buffers_stale
            )?;
        }
        match b.hint_run() {
            Some(run) if run.outcome == HintOutcome::Running => {
                writeln!(f, "; {run} so far, {}", Seconds(run.elapsed_us(now_us)))?
            }
            Some(run) => writeln!(f, "; last {run}")?,
            None => writeln!(f, "; no run yet ('hint <vm>' starts one)")?,
        }
    }
    if s.blocks_rejected() != 0 {
        writeln!(
            f,
            "  free blocks rejected: {} outside RAM, {} unaligned, {} ballooned, {} overlapping",
            s.blocks_rejected_outside_ram,
            s.blocks_rejected_unaligned,
            s.blocks_rejected_ballooned,
            s.blocks_rejected_overlapping
        )?;
    }
    if s.stats_values_clamped + s.actual_writes_clamped != 0 {
        writeln!(
            f,
            "  guest values clamped at intake: {} statistics values, {} writes of actual",
            s.stats_values_clamped, s.actual_writes_clamped
        )?;
    }
    match b.stats_sample() {
        Some(sample) => write_stats_sample(f, sample, now_us, b.stats_interval_us())?,
        None if has(F_STATS_VQ) => writeln!(f, "  guest statistics: none received yet")?,
        None => {}
    }
    if s.stats_buffers_extra != 0 {
        writeln!(
            f,
            "  {} extra statistics buffers returned unread",
            s.stats_buffers_extra
        )?;
    }
    Ok(())
}

/// The lines for a statistics sample seen at `now_us`, when the device
/// polls every `interval_us` (0: polling off): a header with the sample's
/// age and the polling interval, then one line per statistic the guest
/// sent, in tag order, bytes as sizes, counts as numbers. Every line
/// starts with two spaces and ends with a newline.
pub fn write_stats_sample(
    f: &mut impl fmt::Write,
    sample: &StatsSample,
    now_us: u64,
    interval_us: u64,
) -> fmt::Result {
    let age = Seconds(now_us.saturating_sub(sample.arrived_us));
    write!(f, "  guest statistics, {age} old (")?;
    if interval_us == 0 {
        f.write_str("polling off")?;
    } else {
        write!(f, "polled every {}", Seconds(interval_us))?;
    }
    if sample.unknown_tags != 0 {
        write!(f, "; {} unknown tags ignored", sample.unknown_tags)?;
    }
    if sample.clamped != 0 {
        write!(f, "; {} values clamped", sample.clamped)?;
    }
    f.write_str("):\n")?;
    for t in &STAT_TABLE {
        let Some(v) = sample.get(t.tag) else {
            continue;
        };
        match t.unit {
            StatUnit::Bytes => writeln!(f, "    {:<20} {}", t.name, Size(v))?,
            StatUnit::Count => writeln!(f, "    {:<20} {v}", t.name)?,
        }
    }
    Ok(())
}
