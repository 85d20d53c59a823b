//! The balloon's saved state ([`SaveState`]): its configuration (features
//! offered, the RAM it covers), what the driver negotiated, the pages it
//! holds (the ballooned and hinted bitmaps), targets, the statistics buffer
//! it keeps and the last sample, the hinting run, and its counters. The
//! per-request scratch (PFNs, blocks) is not state: each request fills it
//! anew.
//!
//! Restoring checks what a driver could have brought the device to: known
//! features, negotiated among those offered, bitmaps of the RAM's size
//! with no page beyond it and counts that match them, no page both
//! ballooned and hinted, targets within the RAM, statistics within the
//! bounds intake keeps them to. Whether the VM's stage-2 tables agree with
//! the bitmaps is for the VM's restore to check.

use core::ops::Range;

use super::hint::{HintOutcome, HintRun, HintState};
use super::stats::{is_memory_figure, StatsSample, MAX_CUMULATIVE, MAX_MEMORY_BYTES, STAT_TAGS};
use super::{Balloon, BalloonStats};
use crate::addr::GuestPfn;
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};

/// The layout version of the balloon's saved state.
const VERSION: u8 = 1;

fn invalid(what: &'static str) -> StateError {
    StateError::Invalid(what)
}

fn save_opt_u64(w: &mut StateWriter, v: Option<u64>) {
    w.bool(v.is_some());
    w.u64(v.unwrap_or(0));
}

/// An optional time: at most [`crate::savestate::MAX_COUNT`].
fn restore_opt_u64(r: &mut StateReader<'_>, what: &'static str) -> Result<Option<u64>, StateError> {
    let some = r.bool(what)?;
    let v = r.count(what)?;
    // An absent value is written as 0: one state, one encoding.
    if !some && v != 0 {
        return Err(invalid(what));
    }
    Ok(some.then_some(v))
}

fn hint_state_code(s: HintState) -> u8 {
    match s {
        HintState::Idle => 0,
        HintState::Requested => 1,
        HintState::Started => 2,
        HintState::HostStopped => 3,
        HintState::Done => 4,
    }
}

fn outcome_code(o: HintOutcome) -> u8 {
    match o {
        HintOutcome::Running => 0,
        HintOutcome::Done => 1,
        HintOutcome::Superseded => 2,
        HintOutcome::Reset => 3,
    }
}

/// The counters, in their declaration order.
fn counters(s: &BalloonStats) -> [u64; 31] {
    [
        s.inflate_requests,
        s.deflate_requests,
        s.pages_inflated,
        s.pages_deflated,
        s.pages_deflated_on_reset,
        s.rejected_out_of_range,
        s.rejected_duplicate,
        s.rejected_already_ballooned,
        s.rejected_not_ballooned,
        s.pages_deflated_on_oom,
        s.stats_buffers_held,
        s.stats_buffers_extra,
        s.stats_refreshes,
        s.stats_unknown_tags,
        s.stats_values_clamped,
        s.actual_writes_clamped,
        s.poison_writes_ignored,
        s.reports,
        s.report_blocks,
        s.pages_reported,
        s.hint_runs,
        s.hint_blocks,
        s.pages_hinted,
        s.hint_pages_reused,
        s.hint_ids_stale,
        s.hint_buffers_stale,
        s.blocks_rejected_outside_ram,
        s.blocks_rejected_unaligned,
        s.blocks_rejected_ballooned,
        s.blocks_rejected_overlapping,
        s.device_errors,
    ]
}

fn restore_counters(r: &mut StateReader<'_>) -> Result<BalloonStats, StateError> {
    let mut v = [0u64; 31];
    for slot in v.iter_mut() {
        *slot = r.count("balloon counter")?;
    }
    let [inflate_requests, deflate_requests, pages_inflated, pages_deflated, pages_deflated_on_reset, rejected_out_of_range, rejected_duplicate, rejected_already_ballooned, rejected_not_ballooned, pages_deflated_on_oom, stats_buffers_held, stats_buffers_extra, stats_refreshes, stats_unknown_tags, stats_values_clamped, actual_writes_clamped, poison_writes_ignored, reports, report_blocks, pages_reported, hint_runs, hint_blocks, pages_hinted, hint_pages_reused, hint_ids_stale, hint_buffers_stale, blocks_rejected_outside_ram, blocks_rejected_unaligned, blocks_rejected_ballooned, blocks_rejected_overlapping, device_errors] =
        v;
    Ok(BalloonStats {
        inflate_requests,
        deflate_requests,
        pages_inflated,
        pages_deflated,
        pages_deflated_on_reset,
        rejected_out_of_range,
        rejected_duplicate,
        rejected_already_ballooned,
        rejected_not_ballooned,
        pages_deflated_on_oom,
        stats_buffers_held,
        stats_buffers_extra,
        stats_refreshes,
        stats_unknown_tags,
        stats_values_clamped,
        actual_writes_clamped,
        poison_writes_ignored,
        reports,
        report_blocks,
        pages_reported,
        hint_runs,
        hint_blocks,
        pages_hinted,
        hint_pages_reused,
        hint_ids_stale,
        hint_buffers_stale,
        blocks_rejected_outside_ram,
        blocks_rejected_unaligned,
        blocks_rejected_ballooned,
        blocks_rejected_overlapping,
        device_errors,
    })
}

/// A bitmap of `words` words whose set bits are pages below `pages`, and
/// the count of them.
fn restore_bitmap(
    r: &mut StateReader<'_>,
    into: &mut [u64],
    pages: u64,
    what: &'static str,
) -> Result<u64, StateError> {
    let mut count = 0u64;
    for (i, word) in into.iter_mut().enumerate() {
        let mut v = r.u64()?;
        let first = i as u64 * 64;
        if first.saturating_add(64) > pages {
            // The last word: no page past the RAM's end.
            let valid = pages.saturating_sub(first);
            let mask = if valid >= 64 {
                u64::MAX
            } else {
                (1u64 << valid) - 1
            };
            if v & !mask != 0 {
                return Err(invalid(what));
            }
            v &= mask;
        }
        *word = v;
        count += u64::from(v.count_ones());
    }
    Ok(count)
}

impl SaveState for Balloon {
    fn save(&self, w: &mut StateWriter) {
        w.u8(VERSION);
        w.u64(self.offered);
        w.u64(self.ram.start.raw());
        w.u64(self.ram.end.raw());
        w.u64(self.negotiated);
        w.bool(self.live);
        for &word in self.ballooned.iter().chain(&self.hinted) {
            w.u64(word);
        }
        w.u64(self.ballooned_count);
        w.u64(self.hinted_count);
        w.u32(self.target);
        w.u32(self.actual);
        w.u32(self.poison_val);
        w.bool(self.held_stats.is_some());
        w.u16(self.held_stats.unwrap_or(0));
        w.u64(self.held_since_us);
        w.u64(self.stats_interval_us);
        w.bool(self.stats_requested);
        w.bool(self.sample.is_some());
        if let Some(s) = &self.sample {
            for v in s.values {
                save_opt_u64(w, v);
            }
            w.u64(s.arrived_us);
            w.u32(s.unknown_tags);
            w.u32(s.clamped);
        }
        w.u8(hint_state_code(self.hint_state));
        w.u32(self.hint_id);
        w.bool(self.hint_run.is_some());
        if let Some(run) = &self.hint_run {
            w.u32(run.id);
            w.u64(run.started_us);
            save_opt_u64(w, run.answered_us);
            save_opt_u64(w, run.ended_us);
            w.u8(outcome_code(run.outcome));
            w.u64(run.blocks);
            w.u64(run.pages_hinted);
            w.u64(run.pages_reused);
        }
        w.bool(self.config_change);
        w.u64(self.clock_us);
        for n in counters(&self.stats) {
            w.u64(n);
        }
    }

    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        r.version("balloon", VERSION)?;
        let offered = r.u64()?;
        let ram: Range<GuestPfn> = GuestPfn::new(r.u64()?)..GuestPfn::new(r.u64()?);
        // Within the guest-physical space (and so a bitmap of at most
        // 512 KiB): a state's RAM is never larger than a VM's can be.
        let ipa_pages = crate::mm::stage2::IPA_LIMIT.pfn();
        if ram.start > ram.end || ram.end > ipa_pages {
            return Err(invalid("balloon RAM"));
        }
        let mut b = Balloon::new(offered & !super::F_VERSION_1, ram)
            .map_err(|_| invalid("balloon features offered"))?;
        if b.offered != offered {
            return Err(invalid("balloon features offered"));
        }
        b.negotiated = r.u64()?;
        if b.negotiated & !b.offered != 0 {
            return Err(invalid("balloon features negotiated"));
        }
        b.live = r.bool("balloon live")?;
        let pages = b.ram.end - b.ram.start;
        let ballooned = restore_bitmap(r, &mut b.ballooned, pages, "balloon bitmap")?;
        let hinted = restore_bitmap(r, &mut b.hinted, pages, "balloon hinted bitmap")?;
        if b.ballooned.iter().zip(&b.hinted).any(|(x, y)| x & y != 0) {
            return Err(invalid("a page both ballooned and hinted"));
        }
        b.ballooned_count = r.u64()?;
        b.hinted_count = r.u64()?;
        if b.ballooned_count != ballooned || b.hinted_count != hinted {
            return Err(invalid("balloon page counts"));
        }
        b.target = r.u32()?;
        b.actual = r.u32()?;
        if u64::from(b.target) > pages || u64::from(b.actual) > pages {
            return Err(invalid("balloon target or actual"));
        }
        b.poison_val = r.u32()?;
        let held = r.bool("balloon statistics buffer held")?;
        let head = r.u16()?;
        if !held && head != 0 {
            return Err(invalid("balloon statistics buffer held"));
        }
        b.held_stats = held.then_some(head);
        b.held_since_us = r.count("balloon statistics buffer held since")?;
        b.stats_interval_us = r.count("balloon statistics interval")?;
        b.stats_requested = r.bool("balloon statistics requested")?;
        if r.bool("balloon statistics sample")? {
            let memory_bound = b.ram_bytes().min(MAX_MEMORY_BYTES);
            let mut sample = StatsSample::new(0);
            for (tag, slot) in sample.values.iter_mut().enumerate() {
                let v = restore_opt_u64(r, "balloon statistic")?;
                let bound = match is_memory_figure(tag as u16) {
                    true => memory_bound,
                    false => MAX_CUMULATIVE,
                };
                if v.is_some_and(|v| v > bound) {
                    return Err(invalid("balloon statistic above its bound"));
                }
                *slot = v;
            }
            debug_assert_eq!(sample.values.len(), STAT_TAGS);
            sample.arrived_us = r.count("balloon statistics arrival")?;
            sample.unknown_tags = r.u32()?;
            sample.clamped = r.u32()?;
            b.sample = Some(sample);
        }
        b.hint_state = match r.u8()? {
            0 => HintState::Idle,
            1 => HintState::Requested,
            2 => HintState::Started,
            3 => HintState::HostStopped,
            4 => HintState::Done,
            _ => return Err(invalid("balloon hinting state")),
        };
        b.hint_id = r.u32()?;
        if r.bool("balloon hinting run")? {
            let id = r.u32()?;
            let started_us = r.count("hinting run start")?;
            let mut run = HintRun::new(id, started_us);
            run.answered_us = restore_opt_u64(r, "hinting run answered")?;
            run.ended_us = restore_opt_u64(r, "hinting run ended")?;
            run.outcome = match r.u8()? {
                0 => HintOutcome::Running,
                1 => HintOutcome::Done,
                2 => HintOutcome::Superseded,
                3 => HintOutcome::Reset,
                _ => return Err(invalid("hinting run outcome")),
            };
            run.blocks = r.count("hinting run counter")?;
            run.pages_hinted = r.count("hinting run counter")?;
            run.pages_reused = r.count("hinting run counter")?;
            b.hint_run = Some(run);
        }
        b.config_change = r.bool("balloon config change")?;
        b.clock_us = r.count("balloon clock")?;
        b.stats = restore_counters(r)?;
        Ok(b)
    }
}
