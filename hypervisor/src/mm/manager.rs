//! The memory manager's policy (issue 12, its first, portable step): which
//! balloon target each VM should have, decided once per tick from plain data.
//!
//! It owns only its own bookkeeping: the per-VM history it needs to see
//! progress and pressure (last balloon actual and target, since when it has
//! owed its target, the guest's cumulative counters at the previous tick,
//! when it was last under pressure), the
//! congestion marks, and the counters of every decision ([`ManagerStats`],
//! [`VmStats`]). It owns no page, no balloon and no VM: the caller (the VM
//! loop, not yet wired) fills one [`VmInput`] per VM, passes the pool's free
//! page count, and applies the [`Decisions`] by setting balloon targets. It
//! never waits for anything; a VM that does not answer is marked congested
//! and skipped.
//!
//! # Policy, in order, each [`Manager::tick`]
//!
//! 1. **Observe.** A VM whose balloon `actual` changed made progress. A VM
//!    with an outstanding target (`target != actual`) is *stalled* once its
//!    actual has not moved for [`Tunables::progress_window_us`] since it
//!    began to owe the target (raising the target again does not restart
//!    the clock): its outstanding pages stop counting as in flight and it
//!    gets no new reclaim. After
//!    [`Tunables::congestion_deadline_us`] (at once without a driver) it is
//!    marked *congested* (counted, shown). Both clear when actual moves
//!    again, or when nothing is outstanding.
//! 2. **Limits.** A target always lies in `size - max ..= size - min`: the
//!    guest never has more than `max` pages (the target rises instead) and
//!    never fewer than `min`.
//! 3. **Pressure relief first.** A VM under pressure (deflate-on-OOM, new
//!    OOM kills or allocation stalls, major faults over a threshold, stage-2
//!    fault-ins fast enough to exhaust its available memory within
//!    [`Tunables::fault_in_horizon_us`], or available memory under
//!    [`Tunables::comfort_permille`] of what it has) gets its balloon lowered
//!    from the pool, down to the pool's `min` watermark, up to its `max`,
//!    shared by want and weight when the pool is short, less what it was
//!    given and has not deflated yet. Pages the guest deflated on OOM are
//!    accepted (the target follows), so the driver never re-inflates them;
//!    and a VM is not reclaimed from for [`Tunables::pressure_hold_us`]
//!    after its last pressure signal.
//! 4. **Reclaim, only what is needed.** Reclaim starts when the pool falls
//!    below `low` and goes on until it is back at `high` (kswapd's
//!    hysteresis). What is needed is `high - (pool + in flight)`, where in
//!    flight counts only VMs making progress; pages given are not reclaimed
//!    for in advance (the guest takes them from the pool only as it touches
//!    them). If nothing is needed the tick is a bail-out. The need is
//!    spread over VMs not held by pressure, not stalled, with a driver: first
//!    what guests report
//!    free or as caches above their `low` (less a comfort reserve, and only
//!    pages a frame backs), then, for VMs without statistics, the rest
//!    above `low`; only in an emergency (the pool below its `min`) and
//!    when no VM has anything left above its `low`, what lies between
//!    `min` and `low`. Within each stage a VM's share is proportional to
//!    its room divided by its weight (the most reclaimable first; weight
//!    is cgroup's share of the resource, so a heavier VM gives less), and
//!    at most [`Tunables::reclaim_step_permille`] of its size per tick.
//! 5. **Trim.** Once the pool is at or above `high`, outstanding inflation
//!    of VMs making progress is cancelled (targets lowered toward actual,
//!    largest first): no over-reclaim when several demands overlap.
//!
//! The simulation in `manager/sim_tests.rs` checks the claims
//! against a naive controller (`cargo test -p hypervisor manager --
//! --nocapture` prints the figures).
//!
//! Everything is integer arithmetic and deterministic; `alloc` only for the
//! per-VM vectors.
//!
//! # Guest numbers
//!
//! Most of a [`VmInput`] is the guest's word (its balloon's `actual`, its
//! statistics) or counts a guest drives (fault-ins, OOM deflates). The
//! caller bounds them at intake (`vm::manage::input`), and
//! [`Manager::tick`] bounds them again ([`VmInput::bounded`]): `actual`,
//! `backed`, fault-ins and OOM deflates to the VM's size, byte statistics
//! to its size in bytes. Every product is computed wide ([`mul_div`]),
//! every sum saturates: no input, however absurd, panics a tick (a panic
//! there would stop the VM whose CPU ran it, not the one that lied) or
//! moves a target out of its limits.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

use crate::addr::PAGE_SIZE;

/// Pages of RAM as a `u64`.
pub type Pages = u64;

/// A configuration value the manager refuses, with what to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigError {
    /// Watermarks out of order: they must satisfy `min <= low <= high`.
    WatermarksOrder,
    /// The `high` watermark is not below the RAM size.
    WatermarkAboveRam,
    /// A VM's `min` exceeds its `max`.
    MinAboveMax,
    /// A VM's `low` exceeds its `max`.
    LowAboveMax,
    /// A VM's `min` exceeds its `low`.
    MinAboveLow,
    /// A VM's `max` exceeds its RAM size.
    MaxAboveSize,
    /// A VM's `weight` is outside `1..=10000`.
    Weight,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::WatermarksOrder => {
                "pool watermarks must satisfy min <= low <= high: raise low or high, or lower min"
            }
            Self::WatermarkAboveRam => "pool watermark high must be below the RAM size: lower it",
            Self::MinAboveMax => "memory min is above memory max: lower min or raise max",
            Self::LowAboveMax => "memory low is above memory max: lower low or raise max",
            Self::MinAboveLow => "memory min is above memory low: raise low to at least min",
            Self::MaxAboveSize => {
                "memory max is above the VM's RAM size: lower max or raise the VM's memory"
            }
            Self::Weight => "memory weight must be 1 to 10000 (default 100)",
        })
    }
}

/// The pool's watermarks, in pages: below `low` reclaim starts, it stops at
/// `high`; `min` is the reserve pressure relief never gives away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watermarks {
    /// The reserve: memory given to VMs under pressure never takes the pool
    /// below it.
    pub min: Pages,
    /// Reclaim starts when the pool falls below it.
    pub low: Pages,
    /// Reclaim stops when the pool is back at it; in-flight inflation beyond
    /// it is trimmed.
    pub high: Pages,
}

/// 1 MiB in pages: the smallest step between watermarks.
const WATERMARK_FLOOR: Pages = (1 << 20) / PAGE_SIZE;

impl Watermarks {
    /// The defaults for a pool of `total_pages` of RAM: `min` 1%, `low` 3%,
    /// `high` 5% (oVirt MOM's host-free thresholds are 20%/5%; a hypervisor
    /// that owns all RAM can run closer, like Linux's zone watermarks), each
    /// at least 1 MiB above the one before (so a small board still has a
    /// band between them), and `high` kept below the RAM size.
    pub fn for_ram(total_pages: Pages) -> Self {
        let min = (total_pages / 100).max(WATERMARK_FLOOR);
        let low = (total_pages * 3 / 100).max(min + WATERMARK_FLOOR);
        let high = (total_pages * 5 / 100).max(low + WATERMARK_FLOOR);
        Self { min, low, high }
    }

    /// Checks `min <= low <= high < total_pages`.
    pub fn validate(&self, total_pages: Pages) -> Result<(), ConfigError> {
        if self.min > self.low || self.low > self.high {
            return Err(ConfigError::WatermarksOrder);
        }
        if self.high >= total_pages {
            return Err(ConfigError::WatermarkAboveRam);
        }
        Ok(())
    }
}

/// Default weight (cgroup v2's).
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest weight (cgroup v2's).
pub const MAX_WEIGHT: u32 = 10_000;

/// A VM's memory limits in pages, with cgroup v2's meaning, applied to the
/// pages the guest has (its size minus its balloon).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Never reclaimed below, whatever the pool's state.
    pub min: Pages,
    /// Reclaimed below only when no VM is above its own `low`.
    pub low: Pages,
    /// Never given more: the balloon target rises instead.
    pub max: Pages,
    /// Share of memory (1..=10000, default 100): a VM's part of a reclaim is
    /// inversely proportional to it.
    pub weight: u32,
}

impl Default for Limits {
    /// [`Limits::unlimited`] for a VM of no size (an empty input).
    fn default() -> Self {
        Self::unlimited(0)
    }
}

impl Limits {
    /// No protection and no cap: `min = low = 0`, `max = size`, weight 100.
    pub fn unlimited(size: Pages) -> Self {
        Self {
            min: 0,
            low: 0,
            max: size,
            weight: DEFAULT_WEIGHT,
        }
    }

    /// Checks the limits against a VM of `size` pages.
    pub fn validate(&self, size: Pages) -> Result<(), ConfigError> {
        if self.min > self.max {
            return Err(ConfigError::MinAboveMax);
        }
        if self.low > self.max {
            return Err(ConfigError::LowAboveMax);
        }
        if self.min > self.low {
            return Err(ConfigError::MinAboveLow);
        }
        if self.max > size {
            return Err(ConfigError::MaxAboveSize);
        }
        if self.weight == 0 || self.weight > MAX_WEIGHT {
            return Err(ConfigError::Weight);
        }
        Ok(())
    }
}

/// The guest's latest balloon statistics (virtio-balloon tags), as it
/// reported them: memory in bytes, counters cumulative since its boot.
/// `None` for a tag the guest does not offer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuestStats {
    /// `VIRTIO_BALLOON_S_AVAIL`, bytes.
    pub available: Option<u64>,
    /// `VIRTIO_BALLOON_S_MEMFREE`, bytes.
    pub free: Option<u64>,
    /// `VIRTIO_BALLOON_S_CACHES` (disk caches), bytes.
    pub caches: Option<u64>,
    /// `VIRTIO_BALLOON_S_MAJFLT`, cumulative.
    pub major_faults: Option<u64>,
    /// `VIRTIO_BALLOON_S_OOM_KILL`, cumulative.
    pub oom_kills: Option<u64>,
    /// `VIRTIO_BALLOON_S_ALLOC_STALL`, cumulative.
    pub alloc_stalls: Option<u64>,
}

impl GuestStats {
    /// The statistics with every memory figure (available, free, caches)
    /// at most `max_bytes`; the cumulative counters are only compared and
    /// subtracted with saturation, so they stay as sent.
    pub fn bounded(self, max_bytes: u64) -> Self {
        let b = |v: Option<u64>| v.map(|v| v.min(max_bytes));
        Self {
            available: b(self.available),
            free: b(self.free),
            caches: b(self.caches),
            ..self
        }
    }
}

/// What the caller tells the manager about one VM each tick. The VM's
/// identity is its index in the slice passed to [`Manager::tick`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmInput {
    /// The VM's RAM size.
    pub size: Pages,
    /// Pages of its RAM backed by pool frames now.
    pub backed: Pages,
    /// Its balloon's target.
    pub target: Pages,
    /// Its balloon's actual size (pages the guest has handed back).
    pub actual: Pages,
    /// Its limits.
    pub limits: Limits,
    /// The guest's latest statistics, if it ever sent any.
    pub stats: Option<GuestStats>,
    /// Stage-2 fault-ins (pages newly backed) since the previous tick.
    pub fault_ins: Pages,
    /// Pages the guest deflated on OOM since the previous tick.
    pub deflate_on_oom: Pages,
    /// Whether a balloon driver runs (the device is live).
    pub driver: bool,
    /// Whether a vCPU waits for a frame (the pool at its floor): pressure.
    pub waiting: bool,
}

impl VmInput {
    /// The input with every value the guest drives bounded by the VM's
    /// size: `backed`, `actual`, `fault_ins` and `deflate_on_oom` at most
    /// `size` pages, the statistics' memory figures at most `size` pages in
    /// bytes. `size`, `target` and the limits are the host's and stay.
    pub fn bounded(self) -> Self {
        let size = self.size;
        Self {
            backed: self.backed.min(size),
            actual: self.actual.min(size),
            fault_ins: self.fault_ins.min(size),
            deflate_on_oom: self.deflate_on_oom.min(size),
            stats: self
                .stats
                .map(|s| s.bounded(size.saturating_mul(PAGE_SIZE))),
            ..self
        }
    }

    /// How many of the values [`bounded`](Self::bounded) bounds were out of
    /// bounds.
    pub fn out_of_bounds(&self) -> u32 {
        let b = self.bounded();
        let stats = match (self.stats, b.stats) {
            (Some(s), Some(t)) => {
                u32::from(s.available != t.available)
                    + u32::from(s.free != t.free)
                    + u32::from(s.caches != t.caches)
            }
            _ => 0,
        };
        u32::from(self.backed != b.backed)
            + u32::from(self.actual != b.actual)
            + u32::from(self.fault_ins != b.fault_ins)
            + u32::from(self.deflate_on_oom != b.deflate_on_oom)
            + stats
    }
}

/// `x * num / den` computed in 128 bits, saturated to `u64` (0 when `den`
/// is 0): the manager's products of a guest-driven count and a host
/// factor cannot overflow.
pub fn mul_div(x: u64, num: u64, den: u64) -> u64 {
    u128::from(x)
        .checked_mul(u128::from(num))
        .and_then(|p| p.checked_div(u128::from(den)))
        .map_or(0, |q| u64::try_from(q).unwrap_or(u64::MAX))
}

/// `x` per mille `p`, as [`mul_div`].
fn permille(x: u64, p: u64) -> u64 {
    mul_div(x, p, 1000)
}

/// A saturating sum.
fn sat_sum(it: impl IntoIterator<Item = u64>) -> u64 {
    it.into_iter().fold(0, u64::saturating_add)
}

/// The manager's knobs. [`Tunables::default`] documents each default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tunables {
    /// No progress on an outstanding target for this long: congested
    /// (default 2 s).
    pub congestion_deadline_us: u64,
    /// No progress for this long: the outstanding pages are no longer
    /// counted as in flight and the VM gets no new reclaim (default 500 ms;
    /// a working driver moves 64 MiB/s).
    pub progress_window_us: u64,
    /// Most pages a reclaim raises one VM's target by in one tick, per mille
    /// of its size (default 50: oVirt MOM's 5% per step; at a 100 ms tick
    /// half a VM within 1 s).
    pub reclaim_step_permille: u64,
    /// Most pages pressure relief gives one VM in one tick, per mille of its
    /// size (default 100), beyond what it deflated on OOM.
    pub give_step_permille: u64,
    /// A guest reporting less available memory than this, per mille of the
    /// pages it has, is under pressure (default 50).
    pub comfort_permille: u64,
    /// Major faults in one tick from which a VM is under pressure (default
    /// 64).
    pub major_faults_per_tick: u64,
    /// Stage-2 fault-ins in one tick from which a VM whose fault-in count is
    /// rising is under pressure (default 256, 1 MiB).
    pub fault_ins_per_tick: u64,
    /// How far ahead pressure relief gives at the observed fault-in rate,
    /// and how soon a VM faulting at its rate must run out of available
    /// memory to be under pressure (default 1 s).
    pub fault_in_horizon_us: u64,
    /// A VM is not reclaimed from for this long after its last pressure
    /// signal, so that what it was given or deflated on OOM is not taken
    /// back at once (default 10 s).
    pub pressure_hold_us: u64,
}

impl Default for Tunables {
    fn default() -> Self {
        Self {
            congestion_deadline_us: 2_000_000,
            progress_window_us: 500_000,
            reclaim_step_permille: 50,
            give_step_permille: 100,
            comfort_permille: 50,
            major_faults_per_tick: 64,
            fault_ins_per_tick: 256,
            fault_in_horizon_us: 1_000_000,
            pressure_hold_us: 10_000_000,
        }
    }
}

/// The manager's counters, all VMs together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ManagerStats {
    /// Ticks run.
    pub ticks: u64,
    /// Balloon targets changed.
    pub targets_set: u64,
    /// Pages asked back from guests (target raises, `max` enforcement
    /// included).
    pub pages_reclaimed: u64,
    /// Pages given to guests (target lowered by relief, `min` enforcement,
    /// accepted deflate-on-OOM).
    pub pages_given: u64,
    /// Outstanding inflation cancelled because the pool was back above high.
    pub pages_trimmed: u64,
    /// Ticks below high on which no reclaim was issued because what is in
    /// flight already covers the need.
    pub bailouts: u64,
    /// Times a VM was marked congested.
    pub congested_marks: u64,
    /// Times a reclaim passed over a stalled or congested VM instead of
    /// waiting for it.
    pub congested_skips: u64,
}

/// One VM's counters and state, for the shell.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmStats {
    /// Balloon targets changed.
    pub targets_set: u64,
    /// Pages asked back.
    pub pages_reclaimed: u64,
    /// Pages given.
    pub pages_given: u64,
    /// Outstanding inflation cancelled.
    pub pages_trimmed: u64,
    /// Times marked congested.
    pub congested_marks: u64,
    /// Congested now.
    pub congested: bool,
    /// Under pressure at the last tick.
    pub under_pressure: bool,
}

/// A tick's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decisions {
    /// Per VM (same index as the input): the new balloon target, or `None`
    /// to leave it.
    pub targets: Vec<Option<Pages>>,
    /// Pages still needed to reach `high` after this tick's decisions were
    /// counted as in flight (0 unless reclaim ran out of candidates).
    pub unmet: Pages,
}

/// The manager's memory of one VM.
#[derive(Debug, Clone, Copy, Default)]
struct VmState {
    seen: bool,
    last_actual: Pages,
    last_target: Pages,
    /// Since when the VM owes its target without its balloon having moved:
    /// since the target became outstanding or actual last moved. Raising
    /// an outstanding target again does not restart it.
    waiting_since: Option<u64>,
    prev_major: u64,
    prev_oom: u64,
    prev_stalls: u64,
    prev_fault_ins: Pages,
    /// When the VM was last under pressure.
    last_pressure_us: Option<u64>,
    stats: VmStats,
}

/// What one tick works on per VM.
#[derive(Debug, Clone, Copy)]
struct Work {
    target: Pages,
    /// Lowest target: `size - max`.
    floor: Pages,
    /// Highest target: `size - min`.
    ceiling: Pages,
    /// Highest target above `low`: `size - low`.
    low_ceiling: Pages,
    /// Outstanding pages count as in flight.
    progressing: bool,
    congested: bool,
    pressure: bool,
    /// Under pressure within the hold: not reclaimed from.
    held: bool,
    /// Pages pressure relief wants to give.
    want: Pages,
    /// With statistics: what a reclaim can take from the VM without putting
    /// it under pressure or inflating pages no frame backs (see `observe`);
    /// `None` without statistics.
    reclaimable: Option<Pages>,
    /// The target this tick started from.
    start: Pages,
    /// Most pages this tick's reclaim may add.
    step: Pages,
    weight: u32,
}

/// What reclaim stage `stage` (see `Manager::reclaim`) may still take from
/// a VM this tick, within its step if `stepped`.
fn room(w: &Work, stage: u32, stepped: bool) -> Pages {
    if w.held || w.congested {
        return 0;
    }
    let above_low = w.low_ceiling.saturating_sub(w.target);
    // Raised already this tick.
    let claimed = w.target.saturating_sub(w.start);
    let r = match (stage, w.reclaimable) {
        (0, Some(r)) | (1, Some(r)) => above_low.min(r.saturating_sub(claimed)),
        (0, None) => 0,
        (1, None) => above_low,
        _ => w.ceiling.saturating_sub(w.target),
    };
    match stepped {
        true => r.min(w.start.saturating_add(w.step).saturating_sub(w.target)),
        false => r,
    }
}

/// How [`spread`] weighs VMs.
#[derive(Debug, Clone, Copy)]
enum Share {
    /// A heavier VM gives less.
    Reclaim,
    /// A heavier VM gets more.
    Relief,
}

/// The memory manager: call [`Manager::tick`] on every timer tick and pool
/// event.
#[derive(Debug, Clone)]
pub struct Manager {
    watermarks: Watermarks,
    tunables: Tunables,
    vms: Vec<VmState>,
    /// Reclaiming: set below `low`, cleared at `high`.
    reclaiming: bool,
    last_tick_us: Option<u64>,
    stats: ManagerStats,
}

impl Manager {
    /// A manager for a pool with these watermarks (validate them first).
    pub fn new(watermarks: Watermarks, tunables: Tunables) -> Self {
        Self {
            watermarks,
            tunables,
            vms: Vec::new(),
            reclaiming: false,
            last_tick_us: None,
            stats: ManagerStats::default(),
        }
    }

    /// The watermarks in use.
    pub fn watermarks(&self) -> Watermarks {
        self.watermarks
    }

    /// The counters of all VMs together.
    pub fn stats(&self) -> ManagerStats {
        self.stats
    }

    /// VM `index`'s counters and state (zero before its first tick).
    pub fn vm_stats(&self, index: usize) -> VmStats {
        self.vms.get(index).map(|v| v.stats).unwrap_or_default()
    }

    /// Forgets VM `index` (it stopped; a new VM may take its slot).
    pub fn forget(&mut self, index: usize) {
        if let Some(v) = self.vms.get_mut(index) {
            *v = VmState::default();
        }
    }

    /// One decision round at `now_us`, with `pool_free` pages free in the
    /// pool and one input per VM (index = VM slot).
    pub fn tick(&mut self, now_us: u64, pool_free: Pages, vms: &[VmInput]) -> Decisions {
        // Bounded again here: the manager never trusts its caller to have.
        let vms: Vec<VmInput> = vms.iter().map(|v| v.bounded()).collect();
        let vms = &vms[..];
        self.stats.ticks = self.stats.ticks.saturating_add(1);
        let dt = self
            .last_tick_us
            .map_or(0, |t| now_us.saturating_sub(t))
            .max(1);
        self.last_tick_us = Some(now_us);
        if self.vms.len() < vms.len() {
            self.vms.resize(vms.len(), VmState::default());
        }
        let mut work: Vec<Work> = Vec::with_capacity(vms.len());
        for (i, vm) in vms.iter().enumerate() {
            let w = self.observe(i, now_us, dt, vm);
            work.push(w);
        }

        // Limits: size - max <= target <= size - min.
        for (w, vm) in work.iter_mut().zip(vms) {
            // `ceiling >= floor` (see `observe`): `clamp` would not panic,
            // but the limits are the shell's, not checked here again.
            w.target = w.target.max(w.floor).min(w.ceiling);
            // Accept what the guest deflated on OOM: the driver must not
            // re-inflate it.
            if vm.deflate_on_oom > 0 && w.target > vm.actual {
                w.target = vm.actual.max(w.floor);
            }
        }

        // Pressure relief from the pool, down to `min`.
        let pending_gives = |work: &[Work]| -> Pages {
            sat_sum(
                work.iter()
                    .zip(vms)
                    .filter(|(w, _)| !w.congested)
                    .map(|(w, vm)| vm.actual.saturating_sub(w.target)),
            )
        };
        let budget = pool_free
            .saturating_sub(self.watermarks.min)
            .saturating_sub(pending_gives(&work));
        // Shared by what each wants, times its weight, when the pool is
        // short.
        let room: Vec<Pages> = work
            .iter()
            .zip(vms)
            .map(|(w, vm)| match w.pressure && !w.congested {
                // Less what it was given and has not deflated yet.
                true => w
                    .want
                    .saturating_sub(vm.actual.saturating_sub(w.target))
                    .min(w.target.saturating_sub(w.floor)),
                false => 0,
            })
            .collect();
        let given = spread(budget, &room, &work, Share::Relief);
        for (w, give) in work.iter_mut().zip(given) {
            // `give <= room <= target - floor`.
            w.target = w.target.saturating_sub(give);
        }

        // Reclaim: below low start, at high stop; count what is in flight.
        let in_flight: Pages = sat_sum(
            work.iter()
                .zip(vms)
                .filter(|(w, _)| w.progressing)
                .map(|(w, vm)| w.target.saturating_sub(vm.actual)),
        );
        // Reclaim follows the pool itself: what was given is taken from it
        // only as the guest touches it (and may never be), so pending gives
        // are not reclaimed for in advance.
        let projected = pool_free;
        let effective = projected.saturating_add(in_flight);
        if projected < self.watermarks.low {
            self.reclaiming = true;
        }
        let mut unmet = 0;
        if projected >= self.watermarks.high {
            self.reclaiming = false;
            let excess = effective.saturating_sub(self.watermarks.high);
            self.trim(&mut work, vms, excess.min(in_flight));
        } else if self.reclaiming {
            if effective >= self.watermarks.high {
                self.stats.bailouts += 1;
            } else {
                unmet = self.reclaim(&mut work, self.watermarks.high - effective, pool_free);
            }
        }

        // Apply and count.
        let mut targets = Vec::with_capacity(vms.len());
        for (i, (w, vm)) in work.iter().zip(vms).enumerate() {
            let st = &mut self.vms[i];
            if w.target == vm.target {
                targets.push(None);
                continue;
            }
            st.stats.targets_set = st.stats.targets_set.saturating_add(1);
            self.stats.targets_set = self.stats.targets_set.saturating_add(1);
            if w.target > vm.target {
                let up = w.target - vm.target;
                st.stats.pages_reclaimed = st.stats.pages_reclaimed.saturating_add(up);
                self.stats.pages_reclaimed = self.stats.pages_reclaimed.saturating_add(up);
            } else {
                let down = vm.target - w.target;
                st.stats.pages_given = st.stats.pages_given.saturating_add(down);
                self.stats.pages_given = self.stats.pages_given.saturating_add(down);
            }
            st.last_target = w.target;
            if vm.target == vm.actual {
                st.waiting_since = Some(now_us);
            }
            targets.push(Some(w.target));
        }
        Decisions { targets, unmet }
    }

    /// Updates VM `i`'s history from its input and says what this tick may
    /// do with it.
    fn observe(&mut self, i: usize, now_us: u64, dt: u64, vm: &VmInput) -> Work {
        let t = self.tunables;
        let st = &mut self.vms[i];
        let stats = vm.stats.unwrap_or_default();
        let major = stats.major_faults.unwrap_or(0);
        let oom = stats.oom_kills.unwrap_or(0);
        let stalls = stats.alloc_stalls.unwrap_or(0);
        if !st.seen {
            *st = VmState {
                seen: true,
                last_actual: vm.actual,
                last_target: vm.target,
                waiting_since: None,
                prev_major: major,
                prev_oom: oom,
                prev_stalls: stalls,
                prev_fault_ins: 0,
                last_pressure_us: None,
                stats: st.stats,
            };
        }
        let outstanding = vm.target != vm.actual;
        if !outstanding {
            st.waiting_since = None;
        } else if vm.actual != st.last_actual || st.waiting_since.is_none() {
            st.waiting_since = Some(now_us);
        }
        if !outstanding || vm.actual != st.last_actual {
            st.stats.congested = false;
        }
        let idle_for = st.waiting_since.map_or(0, |w| now_us.saturating_sub(w));
        if outstanding
            && !st.stats.congested
            && (!vm.driver || idle_for >= t.congestion_deadline_us)
        {
            st.stats.congested = true;
            st.stats.congested_marks = st.stats.congested_marks.saturating_add(1);
            self.stats.congested_marks = self.stats.congested_marks.saturating_add(1);
        }
        let progressing =
            outstanding && vm.driver && !st.stats.congested && idle_for < t.progress_window_us;
        st.last_actual = vm.actual;
        st.last_target = vm.target;

        // Pressure, from every signal the guest and stage 2 give.
        let has = vm.size.saturating_sub(vm.target.max(vm.actual));
        let comfort_pages = permille(has, t.comfort_permille);
        let low_available = stats
            .available
            .is_some_and(|a| a / PAGE_SIZE < comfort_pages);
        // Faulting in fast enough to run out of available memory within
        // the horizon (or, without statistics, faulting in more and more).
        let ahead = mul_div(vm.fault_ins, t.fault_in_horizon_us, dt);
        let runs_out = match stats.available {
            Some(a) => ahead > a / PAGE_SIZE,
            None => vm.fault_ins > st.prev_fault_ins,
        };
        let faulting = vm.fault_ins >= t.fault_ins_per_tick && runs_out;
        let pressure = vm.deflate_on_oom > 0
            || vm.waiting
            || oom > st.prev_oom
            || stalls > st.prev_stalls
            || major.saturating_sub(st.prev_major) >= t.major_faults_per_tick
            || faulting
            || low_available;
        if pressure {
            st.last_pressure_us = Some(now_us);
        }
        let held = st
            .last_pressure_us
            .is_some_and(|p| now_us.saturating_sub(p) < t.pressure_hold_us);
        st.prev_major = major;
        st.prev_oom = oom;
        st.prev_stalls = stalls;
        st.prev_fault_ins = vm.fault_ins;
        st.stats.under_pressure = pressure;
        let want = if pressure {
            let step = permille(vm.size, t.give_step_permille);
            let comfort =
                comfort_pages.saturating_sub(stats.available.unwrap_or(u64::MAX) / PAGE_SIZE);
            let most = step.saturating_mul(2);
            step.max(ahead.min(most)).max(comfort.min(most))
        } else {
            0
        };
        // What the guest reports free or as caches, no more than its backed
        // pages not in use (inflating a page no frame backs gives the pool
        // nothing), less the comfort reserve and what the balloon is already
        // due to take.
        let reclaimable = match (stats.free, stats.caches) {
            (None, None) => None,
            (f, c) => {
                // Each at most the VM's size (`VmInput::bounded`), and
                // added in pages, saturating: 2^64-1 twice is no panic.
                let spare = (f.unwrap_or(0) / PAGE_SIZE).saturating_add(c.unwrap_or(0) / PAGE_SIZE);
                let used = vm.size.saturating_sub(vm.actual).saturating_sub(spare);
                let backed_spare = vm.backed.saturating_sub(used);
                Some(
                    spare
                        .min(backed_spare)
                        .saturating_sub(comfort_pages)
                        .saturating_sub(vm.target.saturating_sub(vm.actual)),
                )
            }
        };
        let l = vm.limits;
        let floor = vm.size.saturating_sub(l.max);
        Work {
            target: vm.target,
            floor,
            // Not below the floor even with limits that were never
            // validated (`min > max`).
            ceiling: vm.size.saturating_sub(l.min).max(floor),
            low_ceiling: vm.size.saturating_sub(l.low.max(l.min)),
            progressing,
            congested: st.stats.congested || (outstanding && !progressing),
            pressure,
            held,
            want,
            reclaimable,
            start: vm.target,
            step: permille(vm.size, t.reclaim_step_permille).max(1),
            weight: l.weight.clamp(1, MAX_WEIGHT),
        }
    }

    /// Spreads `need` pages of reclaim; returns what could not be placed.
    fn reclaim(&mut self, work: &mut [Work], mut need: Pages, pool_free: Pages) -> Pages {
        let skipped = work.iter().filter(|w| w.congested && !w.held).count();
        self.stats.congested_skips = self.stats.congested_skips.saturating_add(skipped as u64);
        // Stage 0: free and caches above low (VMs with statistics); 1: the
        // rest above low (VMs without); 2: above min, only in an emergency
        // (the pool below its min) and once no VM has anything left above
        // its low. Short of an emergency, reclaiming what a guest needs
        // would only put it under pressure and have relief give it back.
        for stage in 0..3 {
            if need == 0 {
                break;
            }
            if stage == 2
                && (pool_free >= self.watermarks.min || work.iter().any(|w| room(w, 1, false) > 0))
            {
                // Some VM still has pages above its low (its step limits it
                // this tick): nobody is reclaimed below low yet.
                break;
            }
            let rooms: Vec<Pages> = work.iter().map(|w| room(w, stage, true)).collect();
            let taken = spread(need, &rooms, work, Share::Reclaim);
            for (w, t) in work.iter_mut().zip(&taken) {
                // `t <= room <= ceiling - target`, and the parts sum to at
                // most `need`.
                w.target = w.target.saturating_add(*t);
                need = need.saturating_sub(*t);
            }
        }
        need
    }

    /// Cancels up to `excess` pages of outstanding inflation, largest
    /// outstanding first.
    fn trim(&mut self, work: &mut [Work], vms: &[VmInput], mut excess: Pages) {
        let mut order: Vec<usize> = (0..work.len())
            .filter(|&i| work[i].progressing && work[i].target > vms[i].actual)
            .collect();
        order.sort_by_key(|&i| core::cmp::Reverse(work[i].target - vms[i].actual));
        for i in order {
            if excess == 0 {
                break;
            }
            let lowest = vms[i].actual.max(work[i].floor);
            let cut = excess.min(work[i].target.saturating_sub(lowest));
            work[i].target -= cut;
            excess -= cut;
            let st = &mut self.vms[i].stats;
            st.pages_trimmed = st.pages_trimmed.saturating_add(cut);
            self.stats.pages_trimmed = self.stats.pages_trimmed.saturating_add(cut);
        }
    }
}

/// Water-filling: `need` pages spread over VMs in proportion to
/// `room / weight` for a reclaim (`Share::Reclaim`), `room * weight` for
/// relief (`Share::Relief`), none above its room. Returns each VM's part; the sum is
/// `min(need, total room)`. Deterministic: remainders go by index.
fn spread(need: Pages, room: &[Pages], work: &[Work], share: Share) -> Vec<Pages> {
    let mut taken = alloc::vec![0; room.len()];
    let mut left = need.min(sat_sum(room.iter().copied()));
    while left > 0 {
        let mut keys: Vec<u128> = (0..room.len())
            .map(|i| {
                let r = room[i] - taken[i];
                let w = u128::from(work[i].weight.max(1));
                match share {
                    Share::Reclaim => u128::from(r) * u128::from(MAX_WEIGHT) / w,
                    Share::Relief => u128::from(r) * w,
                }
            })
            .collect();
        // Each key is below 2^78 (a room below 2^64 times a weight up to
        // 10000); scaled down until their total fits 64 bits, so that
        // `round * key` below fits 128. Only the proportions matter.
        let wide: u128 = keys.iter().fold(0u128, |a, &k| a.saturating_add(k));
        let shift = (128 - wide.leading_zeros()).saturating_sub(64);
        if shift > 0 {
            keys.iter_mut().for_each(|k| *k >>= shift);
        }
        let total: u128 = keys.iter().sum();
        if total == 0 {
            break;
        }
        let round = left;
        let mut given = 0;
        for (i, key) in keys.iter().enumerate() {
            let share = (u128::from(round) * key / total) as Pages;
            let share = share.min(room[i] - taken[i]).min(left);
            taken[i] += share;
            left -= share;
            given += share;
        }
        if given == 0 {
            // Rounding left a few pages: one each, in index order.
            for i in 0..room.len() {
                if left > 0 && taken[i] < room[i] {
                    taken[i] += 1;
                    left -= 1;
                }
            }
        }
    }
    taken
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod sim_tests;
