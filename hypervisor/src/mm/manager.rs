//! The memory manager's policy: which balloon target each VM should have,
//! decided once per tick from plain data.
//!
//! It owns only its own bookkeeping: the per-VM history it needs to see
//! progress and pressure (last balloon actual and target, since when it has
//! owed its target, the guest's cumulative counters and fault rates, when it
//! was last under pressure, squeezed or withdrawn from), the congestion
//! marks, and the counters of every decision ([`ManagerStats`],
//! [`VmStats`]). It owns no page, no balloon and no VM: the caller
//! (`crate::run`'s tick, through `vm::manage`) fills one [`VmInput`] per
//! VM, passes the pool's free page count, and applies the [`Decisions`] by
//! setting balloon targets. It never waits for anything; a VM that does not
//! answer is marked congested and skipped.
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
//!    again, or when nothing is outstanding. Rates (major faults, stage-2
//!    fault-ins) are per second, measured over windows of at least
//!    [`RATE_WINDOW_US`] however often the manager ticks.
//! 2. **Limits.** A target always lies in `size - max ..= size - min`: the
//!    guest never has more than `max` pages (the target rises instead) and
//!    never fewer than `min`. A raised target a congested balloon never
//!    moved towards is *withdrawn* (its share goes to other donors) and the
//!    VM is not asked again for [`Tunables::withdraw_backoff_us`], or
//!    until the board's escalation stops a VM ([`Manager::escalated`]): a
//!    balloon that did not move while its vCPU was parked at stage 2 had
//!    no stuck driver, and what was asked during the shortage is cancelled
//!    (done after it, it would take memory from guests that need it now).
//! 3. **The fence.** When exhaustion is near (at the rates of the *hungry*
//!    VMs, those faulting in [`Tunables::fault_ins_per_s`] or more, net of
//!    what free page reporting and hinting gave back meanwhile, or with
//!    a vCPU waiting, within [`Tunables::hungry_hold_us`], the pool above
//!    `min` lasts less than twice [`Tunables::fault_in_horizon_us`] plus
//!    the *latency* of the slowest hungry VM's driver: how long it takes
//!    to begin moving towards a raise, measured on its earlier answers, and
//!    at least as long as a raise has gone unanswered; seconds on a board
//!    whose guests get little CPU), the
//!    pages hungry VMs believe free but no frame backs, beyond what the
//!    board can back (the pool above `min`, inflation in flight, and what
//!    VMs that are not hungry can spare), are taken into their balloons,
//!    one VM after the other in the order of weight and `low`. Inflating them frees nothing
//!    and costs the guest nothing it had: it keeps a guest from touching
//!    memory the board cannot give (its vCPU would wait at stage 2 inside
//!    its kernel, where it can neither reclaim nor run its balloon driver),
//!    so its own kernel reclaims its caches or kills instead.
//! 4. **Pressure relief.** A VM under pressure (deflate-on-OOM, new OOM
//!    kills or allocation stalls, major faults fast, stage-2 fault-ins fast
//!    enough to exhaust its available memory within
//!    [`Tunables::fault_in_horizon_us`], available memory under
//!    [`Tunables::comfort_permille`] of what it has, or a vCPU waiting)
//!    gets its balloon lowered from the pool, down to the pool's `min`
//!    watermark and a margin short of the fence, up to its `max`, shared
//!    by want and weight, less what it was given and has not deflated yet.
//!    Pages the guest deflated on OOM are accepted (the target follows),
//!    so the driver never re-inflates them.
//! 5. **Reclaim, only what is needed.** Reclaim starts when the pool falls
//!    below `low` (or a vCPU waits) and goes on until it is back at `high`
//!    (kswapd's hysteresis). What is needed is `high - (pool + in
//!    flight)`, where in flight counts only VMs making progress and only
//!    beyond their pages no frame backs. Stages, each inversely to weight
//!    and at most [`Tunables::reclaim_step_permille`] of a VM per tick:
//!    free pages and caches above `low` of VMs not under pressure (within
//!    [`Tunables::pressure_hold_us`] of a signal), less a comfort reserve;
//!    the rest above `low` of those without statistics; free pages and
//!    caches of VMs under pressure; then, only with the board exhausted (a
//!    vCPU waits or the pool is at `min`) and nothing of the earlier
//!    stages left, between `min` and `low` of VMs not under pressure, and
//!    the *squeeze*: one VM under pressure, the lowest weight first (the
//!    one already squeezed among equals), inflated towards its `low` and
//!    `min` so that its own kernel reclaims or kills. A VM that deflated on
//!    OOM within the hold is neither fenced nor squeezed (it refuses; the
//!    board's escalation applies to it).
//! 6. **Trim and give back.** Once the pool is at or above `high`,
//!    outstanding inflation that would free frames is cancelled (largest
//!    first). Before that, once no VM touches new memory fast and the pool
//!    is back above `low`, inflation of VMs not hungry that would take the
//!    pool more than the margin past `high` is cancelled and reclaim stops
//!    (it counted only inflation beyond pages no frame backs as in flight,
//!    and so overshoots a demand that has stopped). Once the pool has
//!    stayed at or above `high` [`Tunables::give_back_after_us`],
//!    balloons above what the limits require are lowered step by step,
//!    VMs under pressure and with the least available memory first, never
//!    taking the pool below `high` (reclaim starts only below `low`: no
//!    oscillation), nor below what hungry VMs will touch within four
//!    horizons at their rates (the fence acts below two: what is given
//!    back is not fenced again).
//!
//! [`Manager::may_dip`] says which VMs may take frames below the pool's
//! floor (half of it): those giving memory back (owing inflation, not
//! hungry themselves, or squeezed). A guest that zeroes what it allocates
//! touches each page it inflates.
//!
//! The simulation in `manager/sim_tests.rs` checks the claims against a
//! naive controller (`cargo test -p hypervisor manager -- --nocapture`
//! prints the figures).
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

use alloc::vec;
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
    /// Pages the guest gave back by free page reporting and hinting since
    /// the previous tick. Fault-ins that only take such pages back (a guest
    /// writing and deleting a file, its freed pages reported in between)
    /// are not new demand: rates are counted net of them.
    pub returned: Pages,
    /// Pages the guest deflated on OOM since the previous tick.
    pub deflate_on_oom: Pages,
    /// Whether a balloon driver runs (the device is live).
    pub driver: bool,
    /// Whether a vCPU waits for a frame (the pool at its floor): pressure.
    pub waiting: bool,
}

impl VmInput {
    /// The input with every value the guest drives bounded by the VM's
    /// size: `backed`, `actual`, `fault_ins`, `returned` and `deflate_on_oom` at most
    /// `size` pages, the statistics' memory figures at most `size` pages in
    /// bytes. `size`, `target` and the limits are the host's and stay.
    pub fn bounded(self) -> Self {
        let size = self.size;
        Self {
            backed: self.backed.min(size),
            actual: self.actual.min(size),
            fault_ins: self.fault_ins.min(size),
            returned: self.returned.min(size),
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
            + u32::from(self.returned != b.returned)
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
    /// Major faults per second from which a VM is under pressure (default
    /// 640).
    pub major_faults_per_s: u64,
    /// Stage-2 fault-ins per second from which a VM whose fault-in count is
    /// rising is under pressure (default 2560 pages, 10 MiB/s).
    pub fault_ins_per_s: u64,
    /// How far ahead pressure relief gives at the observed fault-in rate,
    /// and how soon a VM faulting at its rate must run out of available
    /// memory to be under pressure (default 1 s).
    pub fault_in_horizon_us: u64,
    /// A VM is not reclaimed from for this long after its last pressure
    /// signal, so that what it was given or deflated on OOM is not taken
    /// back at once (default 10 s), unless the board is exhausted.
    pub pressure_hold_us: u64,
    /// The pool at or above `high` for this long before balloons the
    /// manager inflated are given back (default 3 s).
    pub give_back_after_us: u64,
    /// A balloon whose raised target was withdrawn because it never moved
    /// is not asked again for this long (default 30 s).
    pub withdraw_backoff_us: u64,
    /// A VM stays hungry (fenced, never given back to) this long after it
    /// last faulted in fast or waited (default 2 s), so that a guest
    /// whose demand comes in bursts is not fenced and relieved in turn.
    pub hungry_hold_us: u64,
    /// The naive controller ([`Policy::Naive`]) waits this long for every
    /// VM to reach the targets it set before it acts again (default 2 s; 0:
    /// it acts every tick).
    pub naive_wait_us: u64,
}

/// The span over which fault-ins are weighed against what free page
/// reporting and hinting gave back: longer than a guest's reporting delay.
pub const CHURN_WINDOW_US: u64 = 6_000_000;

/// The shortest span a rate (faults per second) is measured over: ticks
/// can come on almost every exit below `low`, and a rate over a few
/// microseconds says nothing.
pub const RATE_WINDOW_US: u64 = 100_000;

impl Default for Tunables {
    fn default() -> Self {
        Self {
            congestion_deadline_us: 2_000_000,
            progress_window_us: 500_000,
            reclaim_step_permille: 50,
            give_step_permille: 100,
            comfort_permille: 50,
            major_faults_per_s: 640,
            fault_ins_per_s: 2560,
            fault_in_horizon_us: 1_000_000,
            pressure_hold_us: 10_000_000,
            give_back_after_us: 3_000_000,
            withdraw_backoff_us: 30_000_000,
            hungry_hold_us: 2_000_000,
            naive_wait_us: 2_000_000,
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
    /// Pages asked of VMs under pressure because the board was exhausted
    /// (squeezed towards their `low`, then `min`).
    pub pages_squeezed: u64,
    /// Pages given back to balloons the manager had inflated, once the
    /// pool stayed above high.
    pub pages_given_back: u64,
    /// Pages of raised targets withdrawn from balloons that never moved.
    pub pages_withdrawn: u64,
    /// Pages fenced: free in a guest, backed by no frame, taken into its
    /// balloon because the pool could not back them (the fence, see
    /// [`Manager::tick`]).
    pub pages_fenced: u64,
    /// Ticks that ended with reclaim short of its need (`Decisions::unmet`).
    pub short_ticks: u64,
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
    /// Hungry at the last tick: touching new memory fast, net of what it
    /// gives back by reporting and hinting, or a vCPU waiting for a frame
    /// (within [`Tunables::hungry_hold_us`]).
    pub hungry: bool,
    /// Pages asked of it while under pressure, the board exhausted.
    pub pages_squeezed: u64,
    /// Pages given back to its balloon.
    pub pages_given_back: u64,
    /// Pages of its raised target withdrawn (its balloon never moved).
    pub pages_withdrawn: u64,
    /// Pages fenced: free in the guest, never backed, taken into its
    /// balloon because the pool could not back them.
    pub pages_fenced: u64,
    /// May take frames below the pool's floor while its balloon inflates
    /// ([`Manager::may_dip`]).
    pub may_dip: bool,
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
    /// The board is exhausted: a vCPU waits for a frame or the pool is at
    /// its `min`. With `unmet` the caller's escalation applies to waits
    /// that outlast its bound.
    pub exhausted: bool,
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
    /// When the VM was last observed.
    last_seen_us: u64,
    /// Since when its balloon owes a raise it has not begun to move
    /// towards, and how long of that a vCPU waited for a frame.
    asked_us: Option<u64>,
    asked_parked_us: u64,
    /// How long its driver takes to begin a raise (not counting time
    /// parked at stage 2), averaged over its answers: on a board whose
    /// guests get little CPU, seconds. The fence looks that much further
    /// ahead.
    latency_us: u64,
    /// Raises it has begun to move towards.
    answers: u32,
    prev_major: u64,
    prev_oom: u64,
    prev_stalls: u64,
    /// The current rate window: since when, fault-ins so far, and the
    /// major fault count at its start.
    window_start_us: u64,
    window_fault_ins: Pages,
    window_major: u64,
    /// Fault-ins of the last complete window, and what it found: fault-ins
    /// over the horizon at its rate, faulting fast, major faults fast.
    prev_window_fault_ins: Pages,
    ahead: Pages,
    faulting: bool,
    /// Faulting in at least `fault_ins_per_s`, whatever it has left.
    fast_faults: bool,
    /// The churn window ([`CHURN_WINDOW_US`]): since when, and the
    /// fault-ins and pages returned by reporting and hinting in it.
    churn_start_us: u64,
    churn_fault_ins: Pages,
    churn_returned: Pages,
    /// Its last churn window gave back by reporting and hinting at least
    /// half of what it faulted in, and its net rate was below
    /// `fault_ins_per_s`: it takes back what it gives, and is not hungry
    /// however fast it faults.
    churning: bool,
    /// When it was last hungry (fast fault-ins or a vCPU waiting).
    last_hungry_us: Option<u64>,
    major_fast: bool,
    /// When the VM was last under pressure.
    last_pressure_us: Option<u64>,
    /// When it last deflated on OOM: it refuses to give pages under
    /// pressure, so squeezing it again only churns its balloon.
    last_oom_deflate_us: Option<u64>,
    /// When it was last squeezed (inflated under pressure, the board
    /// exhausted): it is the one giving way, and gets no relief meanwhile.
    squeezed_us: Option<u64>,
    /// When a raised target it never moved towards was withdrawn.
    withdrawn_us: Option<u64>,
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
    /// Under pressure within the hold: not reclaimed from unless the board
    /// is exhausted.
    held: bool,
    /// Deflated on OOM within the hold: never squeezed.
    refuses: bool,
    /// Touching new pages fast (`fault_ins_per_s`), or waiting for a
    /// frame: its pages no frame backs will be wanted soon.
    hungry: bool,
    /// Touching new pages fast in the last rate window, or waiting for a
    /// frame, now (no hold).
    demanding: bool,
    /// Fault-ins expected within the horizon at its last window's rate.
    ahead: Pages,
    /// How long its driver takes to begin a raise.
    latency_us: u64,
    /// Squeezed within the hold: gets no relief.
    squeezed: bool,
    /// A raised target was withdrawn within the backoff: not asked.
    backoff: bool,
    /// Available memory per mille of what it has (`u64::MAX` without
    /// statistics): the lower, the more it needs what is given back.
    available_permille: u64,
    /// Its size and the pages of it backed by frames.
    size: Pages,
    backed: Pages,
    /// Pages of its RAM neither in its balloon nor backed by a frame: free
    /// in the guest, never touched or given back. Inflation is counted as
    /// freeing frames only beyond them (the guest's allocator may hand the
    /// balloon these first).
    unbacked: Pages,
    /// Pages pressure relief wants to give.
    want: Pages,
    /// With statistics: what a reclaim can take from the VM without putting
    /// it under pressure or inflating pages no frame backs (see `observe`);
    /// `None` without statistics.
    reclaimable: Option<Pages>,
    /// The target this tick started from, and the balloon's actual size.
    start: Pages,
    actual: Pages,
    /// Most pages this tick's reclaim may add.
    step: Pages,
    weight: u32,
}

/// Reclaim stages, in the order [`Manager::reclaim`] tries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Free memory and caches above `low`, from VMs with statistics not
    /// under pressure.
    Spare,
    /// The rest above `low`, from VMs without statistics not under
    /// pressure.
    AboveLow,
    /// Free memory and caches above `low` of VMs under pressure, once
    /// those not under pressure have none: their caches go before any vCPU
    /// waits for a frame, and before anyone's working set.
    HeldSpare,
    /// Exhausted only, once no VM not under pressure has anything above
    /// its `low`: between `min` and `low`, from VMs not under pressure.
    AboveMin,
    /// Exhausted only: one VM under pressure at a time, lowest weight
    /// first, is inflated towards its `low` and then its `min`, so that its
    /// own kernel reclaims or its own OOM killer picks a process.
    Squeeze,
}

const STAGES: [Stage; 5] = [
    Stage::Spare,
    Stage::AboveLow,
    Stage::HeldSpare,
    Stage::AboveMin,
    Stage::Squeeze,
];

/// Pages the guest will believe free that no frame backs once its balloon
/// reaches its target.
fn uncovered(w: &Work) -> Pages {
    w.unbacked
        .saturating_add(w.actual.saturating_sub(w.target))
        .saturating_sub(w.target.saturating_sub(w.actual))
}

/// What reclaim stage `stage` may still take from a VM this tick, within
/// its step if `stepped`.
fn room(w: &Work, stage: Stage, stepped: bool) -> Pages {
    if w.congested || w.backoff {
        return 0;
    }
    let above_low = w.low_ceiling.saturating_sub(w.target);
    // Raised already this tick.
    let claimed = w.target.saturating_sub(w.start);
    let spare = |r: Pages| above_low.min(r.saturating_sub(claimed));
    let r = match (stage, w.held, w.reclaimable) {
        (Stage::Spare, false, Some(r)) => spare(r),
        (Stage::AboveLow, false, None) => above_low,
        // Free pages and caches even of a VM that deflated on OOM: only
        // its working set is spared.
        (Stage::HeldSpare, true, Some(r)) => spare(r),
        (Stage::AboveMin, false, _) => w.ceiling.saturating_sub(w.target),
        (Stage::Squeeze, true, _) if !w.refuses => w.ceiling.saturating_sub(w.target),
        _ => 0,
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

/// Which controller sets the balloon targets (`mm policy`): the manager,
/// or one of the baselines `cargo xtask bench policy` measures it against
/// (docs/PERFORMANCE.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    /// The memory manager (the module docs give its steps).
    #[default]
    Manager,
    /// A naive controller, oVirt MOM-like: a guest with less than 5% of
    /// its memory available gets 5% of its size; whenever the pool is
    /// below `low`, `high - pool` pages are reclaimed from every VM in
    /// proportion to its weight, nothing counted as in flight; then it
    /// waits until every VM reached its target, up to
    /// [`Tunables::naive_wait_us`]. Limits hold; nothing else the manager
    /// does (the fence, the stages, give-back, withdrawal) happens.
    Naive,
    /// No controller: targets stay where they are, and only the guests'
    /// free page reporting and hinting return memory.
    NoController,
}

impl Policy {
    /// Every policy, in the order `mm policy` lists them.
    pub const ALL: [Policy; 3] = [Policy::Manager, Policy::Naive, Policy::NoController];

    /// The name `mm policy` takes and `mm` shows.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Manager => "manager",
            Policy::Naive => "naive",
            Policy::NoController => "none",
        }
    }

    /// The policy called `name`.
    pub fn from_name(name: &str) -> Option<Policy> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// The memory manager: call [`Manager::tick`] on every timer tick and pool
/// event.
#[derive(Debug, Clone)]
pub struct Manager {
    watermarks: Watermarks,
    tunables: Tunables,
    policy: Policy,
    /// [`Policy::Naive`]: since when it waits for its last targets.
    naive_waiting_since: Option<u64>,
    vms: Vec<VmState>,
    /// Reclaiming: set below `low`, cleared at `high`.
    reclaiming: bool,
    /// Since when the pool has been at or above `high` (give-back waits
    /// [`Tunables::give_back_after_us`]).
    above_high_since: Option<u64>,
    /// The board's escalation stopped a VM since the last tick.
    escalated: bool,
    stats: ManagerStats,
}

impl Manager {
    /// A manager for a pool with these watermarks (validate them first).
    pub fn new(watermarks: Watermarks, tunables: Tunables) -> Self {
        Self {
            watermarks,
            tunables,
            policy: Policy::Manager,
            naive_waiting_since: None,
            vms: Vec::new(),
            reclaiming: false,
            above_high_since: None,
            escalated: false,
            stats: ManagerStats::default(),
        }
    }

    /// The watermarks in use.
    pub fn watermarks(&self) -> Watermarks {
        self.watermarks
    }

    /// The controller in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Hands the targets to `policy` from the next tick. What each VM's
    /// balloon holds stays; counters go on.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
        self.naive_waiting_since = None;
    }

    /// The counters of all VMs together.
    pub fn stats(&self) -> ManagerStats {
        self.stats
    }

    /// VM `index`'s counters and state (zero before its first tick).
    pub fn vm_stats(&self, index: usize) -> VmStats {
        self.vms.get(index).map(|v| v.stats).unwrap_or_default()
    }

    /// Whether VM `index` may take frames below the pool's floor (the
    /// caller's frame table allows it half the reserve): its balloon owes
    /// inflation and it is not itself touching new memory fast, or it is
    /// the VM squeezed to give way. A guest inflating its balloon touches
    /// each page it inflates (a kernel that zeroes what it allocates), and
    /// parked at the floor it could give nothing back; a hungry VM would
    /// spend the reserve on its own demand, so only the giver gets it.
    pub fn may_dip(&self, index: usize) -> bool {
        self.vms.get(index).is_some_and(|v| v.stats.may_dip)
    }

    /// The board's escalation stopped a VM: the shortage it was for is
    /// over, and the next tick cancels all outstanding inflation. What was
    /// asked during the shortage, of guests whose vCPUs were parked, would
    /// be done after it, by guests that need their memory now.
    pub fn escalated(&mut self) {
        self.escalated = true;
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
        if self.vms.len() < vms.len() {
            self.vms.resize(vms.len(), VmState::default());
        }
        let mut work: Vec<Work> = Vec::with_capacity(vms.len());
        for (i, vm) in vms.iter().enumerate() {
            let w = self.observe(i, now_us, vm);
            work.push(w);
        }
        let exhausted = pool_free <= self.watermarks.min || vms.iter().any(|v| v.waiting);
        for v in &mut self.vms {
            v.stats.may_dip &= self.policy == Policy::Manager;
        }
        match self.policy {
            Policy::Manager => {}
            Policy::Naive => {
                self.naive(&mut work, vms, pool_free, now_us);
                return Decisions {
                    targets: self.apply(&work, vms, now_us),
                    unmet: 0,
                    exhausted,
                };
            }
            Policy::NoController => {
                return Decisions {
                    targets: vec![None; vms.len()],
                    unmet: 0,
                    exhausted,
                };
            }
        }

        // Limits: size - max <= target <= size - min.
        for (i, (w, vm)) in work.iter_mut().zip(vms).enumerate() {
            // `ceiling >= floor` (see `observe`): `clamp` would not panic,
            // but the limits are the shell's, not checked here again.
            w.target = w.target.max(w.floor).min(w.ceiling);
            // Accept what the guest deflated on OOM: the driver must not
            // re-inflate it.
            if vm.deflate_on_oom > 0 && w.target > vm.actual {
                w.target = vm.actual.max(w.floor);
            }
            // A balloon that never moved towards its raised target: the
            // target is withdrawn (its share goes to other donors from the
            // next tick) and the VM is not asked again for a while.
            if self.vms[i].stats.congested && vm.driver && w.target > vm.actual.max(w.floor) {
                let withdrawn = w.target - vm.actual.max(w.floor);
                w.target -= withdrawn;
                w.start = w.target;
                w.backoff = true;
                let st = &mut self.vms[i];
                st.withdrawn_us = Some(now_us);
                st.stats.pages_withdrawn = st.stats.pages_withdrawn.saturating_add(withdrawn);
                self.stats.pages_withdrawn = self.stats.pages_withdrawn.saturating_add(withdrawn);
            }
        }

        if core::mem::take(&mut self.escalated) {
            for (i, (w, vm)) in work.iter_mut().zip(vms).enumerate() {
                // Withdrawn while its vCPU was parked, its driver was not
                // stuck: it may be asked again at once.
                self.vms[i].withdrawn_us = None;
                w.backoff = false;
                let keep = vm.actual.max(w.floor);
                if w.target > keep {
                    let cut = w.target - keep;
                    w.target = keep;
                    w.start = keep;
                    let st = &mut self.vms[i].stats;
                    st.pages_trimmed = st.pages_trimmed.saturating_add(cut);
                    self.stats.pages_trimmed = self.stats.pages_trimmed.saturating_add(cut);
                }
            }
        }

        // The fence, before relief: what hungry VMs could touch beyond what
        // the pool can back.
        self.fence(&mut work, pool_free);
        // Relief leaves a margin (high - low) below the fence's trigger, so
        // that the two never take turns on the same pages.
        let slack = self
            .backable(&work, pool_free)
            .saturating_sub(sat_sum(work.iter().filter(|w| w.hungry).map(uncovered)))
            .saturating_sub(self.watermarks.high.saturating_sub(self.watermarks.low));

        // Pressure relief from the pool, down to `min`, and no more than
        // hungry VMs leave uncovered (else the fence takes it back).
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
            .saturating_sub(pending_gives(&work))
            .min(slack);
        // Shared by what each wants, times its weight, when the pool is
        // short; nothing to the VM giving way.
        let room: Vec<Pages> = work
            .iter()
            .zip(vms)
            .map(|(w, vm)| match w.pressure && !w.congested && !w.squeezed {
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

        // Reclaim: below low start, at high stop; count what is in flight:
        // the frames outstanding inflation will free, beyond the pages no
        // frame backs.
        let in_flight: Pages = sat_sum(work.iter().zip(vms).filter(|(w, _)| w.progressing).map(
            |(w, vm)| {
                w.target
                    .saturating_sub(vm.actual)
                    .saturating_sub(w.unbacked)
            },
        ));
        // Reclaim follows the pool itself: what was given is taken from it
        // only as the guest touches it (and may never be), so pending gives
        // are not reclaimed for in advance.
        let projected = pool_free;
        let effective = projected.saturating_add(in_flight);
        if projected < self.watermarks.low || exhausted {
            self.reclaiming = true;
        }
        let mut unmet = 0;
        if projected >= self.watermarks.high && !exhausted {
            self.reclaiming = false;
            let excess = effective.saturating_sub(self.watermarks.high);
            self.trim(&mut work, vms, excess.min(in_flight));
            // Give back once the pool has stayed at high a while: what is
            // above high, less what was given and not yet deflated.
            let since = *self.above_high_since.get_or_insert(now_us);
            if now_us.saturating_sub(since) >= self.tunables.give_back_after_us {
                // Hysteresis against the fence: what hungry VMs will touch
                // within four horizons at their rates stays in the pool
                // (the fence acts below two), so that what is given back
                // is not fenced again at the next burst.
                let reserve =
                    sat_sum(work.iter().filter(|w| w.hungry).map(|w| w.ahead)).saturating_mul(4);
                let budget = pool_free
                    .saturating_sub(self.watermarks.high)
                    .saturating_sub(pending_gives(&work))
                    .saturating_sub(reserve);
                self.give_back(&mut work, vms, budget);
            }
        } else {
            self.above_high_since = None;
            // Reclaim overshoots once the demand stops: each tick asked for
            // what the pool lacked, counting as in flight only inflation
            // beyond pages no frame backs (the guest may hand those to its
            // balloon first). With nobody touching new memory and the pool
            // back above `low`, outstanding inflation of VMs that are not
            // hungry, counted whole, beyond `high` and its margin is
            // cancelled, and reclaim stops until the pool is below `low`
            // again (else the next tick would ask for it again).
            let outstanding: Pages = sat_sum(
                work.iter()
                    .zip(vms)
                    .filter(|(w, _)| w.progressing && !w.hungry)
                    .map(|(w, vm)| w.target.saturating_sub(vm.actual)),
            );
            let margin = self.watermarks.high.saturating_sub(self.watermarks.low);
            let overshoot = pool_free
                .saturating_add(outstanding)
                .saturating_sub(self.watermarks.high);
            let settled = self.reclaiming
                && !exhausted
                && pool_free >= self.watermarks.low
                && !work.iter().any(|w| w.demanding)
                && overshoot > margin;
            if settled {
                self.reclaiming = false;
                self.settle(&mut work, vms, overshoot);
            } else if self.reclaiming {
                if effective >= self.watermarks.high {
                    self.stats.bailouts = self.stats.bailouts.saturating_add(1);
                } else {
                    unmet = self.reclaim(
                        &mut work,
                        self.watermarks.high - effective,
                        exhausted,
                        now_us,
                    );
                }
            }
        }
        if unmet > 0 {
            self.stats.short_ticks = self.stats.short_ticks.saturating_add(1);
        }

        let targets = self.apply(&work, vms, now_us);
        for (i, w) in work.iter().enumerate() {
            self.vms[i].stats.may_dip = w.target > w.actual && (!w.hungry || w.squeezed);
        }
        Decisions {
            targets,
            unmet,
            exhausted,
        }
    }

    /// The targets `work` decided, counted; `None` where a VM's stays.
    fn apply(&mut self, work: &[Work], vms: &[VmInput], now_us: u64) -> Vec<Option<Pages>> {
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
        targets
    }

    /// [`Policy::Naive`]'s round: sets `work`'s targets within the limits.
    fn naive(&mut self, work: &mut [Work], vms: &[VmInput], pool_free: Pages, now_us: u64) {
        if let Some(since) = self.naive_waiting_since {
            let behind = vms.iter().any(|v| v.size > 0 && v.target != v.actual);
            if behind && now_us.saturating_sub(since) < self.tunables.naive_wait_us {
                return;
            }
            self.naive_waiting_since = None;
        }
        // An unmanaged VM's input is all zero: it has no share.
        let managed = |(_, vm): &(&mut Work, &VmInput)| vm.size > 0;
        for (w, vm) in work.iter_mut().zip(vms).filter(managed) {
            w.target = w.target.max(w.floor).min(w.ceiling);
            let has = vm.size.saturating_sub(vm.target);
            let available = vm
                .stats
                .and_then(|s| s.available)
                .map_or(u64::MAX, |a| a / PAGE_SIZE);
            if available < has / 20 {
                w.target = w.target.saturating_sub(vm.size / 20).max(w.floor);
            }
        }
        if pool_free < self.watermarks.low {
            let deficit = self.watermarks.high.saturating_sub(pool_free);
            let total = sat_sum(
                vms.iter()
                    .filter(|v| v.size > 0)
                    .map(|v| u64::from(v.limits.weight)),
            );
            for (w, vm) in work.iter_mut().zip(vms).filter(managed) {
                let share = mul_div(deficit, u64::from(vm.limits.weight), total);
                w.target = w.target.saturating_add(share).min(w.ceiling);
            }
        }
        if work.iter().zip(vms).any(|(w, vm)| w.target != vm.target) {
            self.naive_waiting_since = Some(now_us);
        }
    }

    /// Updates VM `i`'s history from its input and says what this tick may
    /// do with it.
    fn observe(&mut self, i: usize, now_us: u64, vm: &VmInput) -> Work {
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
                prev_major: major,
                prev_oom: oom,
                prev_stalls: stalls,
                window_start_us: now_us,
                churn_start_us: now_us,
                last_seen_us: now_us,
                window_major: major,
                stats: st.stats,
                ..VmState::default()
            };
        }
        let outstanding = vm.target != vm.actual;
        let since_last = now_us.saturating_sub(st.last_seen_us);
        st.last_seen_us = now_us;
        if !outstanding {
            st.waiting_since = None;
        } else if vm.actual != st.last_actual || st.waiting_since.is_none() {
            st.waiting_since = Some(now_us);
        }
        // The driver's latency: from a raise to the balloon's first move
        // up, less time parked; a raise cancelled first gives no sample.
        let raised = vm.target > vm.actual;
        match st.asked_us {
            Some(at) if vm.actual > st.last_actual => {
                let sample = now_us
                    .saturating_sub(at)
                    .saturating_sub(st.asked_parked_us)
                    .min(t.congestion_deadline_us);
                st.latency_us = match st.answers {
                    0 => sample,
                    _ => st.latency_us.saturating_add(sample) / 2,
                };
                st.answers = st.answers.saturating_add(1);
                st.asked_us = raised.then_some(now_us);
                st.asked_parked_us = 0;
            }
            // Cancelled unanswered: the driver takes at least as long as
            // it has been asked.
            Some(at) if !raised => {
                let unanswered = now_us
                    .saturating_sub(at)
                    .saturating_sub(st.asked_parked_us)
                    .min(t.congestion_deadline_us);
                st.latency_us = st.latency_us.max(unanswered);
                st.asked_us = None;
            }
            Some(_) if vm.waiting => {
                st.asked_parked_us = st.asked_parked_us.saturating_add(since_last)
            }
            Some(_) => {}
            None if raised => {
                st.asked_us = Some(now_us);
                st.asked_parked_us = 0;
            }
            None => {}
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

        // Rates per second, over a window of at least RATE_WINDOW_US
        // however often the manager ticks; a window's verdict holds until
        // the next one closes.
        let has = vm.size.saturating_sub(vm.target.max(vm.actual));
        let comfort_pages = permille(has, t.comfort_permille);
        // Net of what reporting and hinting gave back meanwhile.
        let fault_ins = vm.fault_ins.saturating_sub(vm.returned);
        // A guest reports a page freed a couple of seconds after it freed
        // it (Linux: 2 s), so a file written and deleted over and over
        // faults fast in every 100 ms window; over a longer one it takes
        // back what it gave.
        st.churn_fault_ins = st.churn_fault_ins.saturating_add(vm.fault_ins);
        st.churn_returned = st.churn_returned.saturating_add(vm.returned);
        let churn_span = now_us.saturating_sub(st.churn_start_us);
        if churn_span >= CHURN_WINDOW_US {
            let net = st.churn_fault_ins.saturating_sub(st.churn_returned);
            st.churning = st.churn_returned.saturating_mul(2) >= st.churn_fault_ins
                && st.churn_fault_ins > 0
                && mul_div(net, 1_000_000, churn_span) < t.fault_ins_per_s;
            st.churn_fault_ins = 0;
            st.churn_returned = 0;
            st.churn_start_us = now_us;
        }
        st.window_fault_ins = st.window_fault_ins.saturating_add(fault_ins);
        let span = now_us.saturating_sub(st.window_start_us);
        if span >= RATE_WINDOW_US {
            let n = st.window_fault_ins;
            st.ahead = mul_div(n, t.fault_in_horizon_us, span);
            // Faulting in fast enough to run out of available memory within
            // the horizon (or, without statistics, faulting in more and
            // more).
            let runs_out = match stats.available {
                Some(a) => st.ahead > a / PAGE_SIZE,
                None => n > st.prev_window_fault_ins,
            };
            st.fast_faults = mul_div(n, 1_000_000, span) >= t.fault_ins_per_s;
            st.faulting = st.fast_faults && runs_out;
            st.major_fast = mul_div(major.saturating_sub(st.window_major), 1_000_000, span)
                >= t.major_faults_per_s;
            st.prev_window_fault_ins = n;
            st.window_fault_ins = 0;
            st.window_major = major;
            st.window_start_us = now_us;
        }
        let low_available = stats
            .available
            .is_some_and(|a| a / PAGE_SIZE < comfort_pages);
        if vm.deflate_on_oom > 0 {
            st.last_oom_deflate_us = Some(now_us);
        }
        let pressure = vm.deflate_on_oom > 0
            || vm.waiting
            || oom > st.prev_oom
            || stalls > st.prev_stalls
            || st.major_fast
            || st.faulting
            || low_available;
        if pressure {
            st.last_pressure_us = Some(now_us);
        }
        if (st.fast_faults && !st.churning) || vm.waiting {
            st.last_hungry_us = Some(now_us);
        }
        let within =
            |at: Option<u64>, span: u64| at.is_some_and(|p| now_us.saturating_sub(p) < span);
        let held = within(st.last_pressure_us, t.pressure_hold_us);
        st.prev_major = major;
        st.prev_oom = oom;
        st.prev_stalls = stalls;
        st.stats.under_pressure = pressure;
        st.stats.hungry = within(st.last_hungry_us, t.hungry_hold_us);
        let want = if pressure {
            let step = permille(vm.size, t.give_step_permille);
            let comfort =
                comfort_pages.saturating_sub(stats.available.unwrap_or(u64::MAX) / PAGE_SIZE);
            let most = step.saturating_mul(2);
            step.max(st.ahead.min(most)).max(comfort.min(most))
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
            refuses: within(st.last_oom_deflate_us, t.pressure_hold_us),
            hungry: within(st.last_hungry_us, t.hungry_hold_us),
            demanding: (st.fast_faults && !st.churning) || vm.waiting,
            ahead: st.ahead,
            // Asked and not answered yet: at least that long.
            latency_us: st.latency_us.max(st.asked_us.map_or(0, |at| {
                now_us
                    .saturating_sub(at)
                    .saturating_sub(st.asked_parked_us)
                    .min(t.congestion_deadline_us)
            })),
            squeezed: within(st.squeezed_us, t.pressure_hold_us),
            backoff: within(st.withdrawn_us, t.withdraw_backoff_us),
            available_permille: stats
                .available
                .map_or(u64::MAX, |a| mul_div(a / PAGE_SIZE, 1000, has.max(1))),
            size: vm.size,
            backed: vm.backed,
            unbacked: vm.size.saturating_sub(vm.actual).saturating_sub(vm.backed),
            want,
            reclaimable,
            start: vm.target,
            actual: vm.actual,
            step: permille(vm.size, t.reclaim_step_permille).max(1),
            weight: l.weight.clamp(1, MAX_WEIGHT),
        }
    }

    /// Spreads `need` pages of reclaim over the stages in order; returns
    /// what could not be placed. `exhausted`: a vCPU waits for a frame or
    /// the pool is at its `min`.
    fn reclaim(
        &mut self,
        work: &mut [Work],
        mut need: Pages,
        exhausted: bool,
        now_us: u64,
    ) -> Pages {
        let skipped = work.iter().filter(|w| w.congested && !w.held).count();
        self.stats.congested_skips = self.stats.congested_skips.saturating_add(skipped as u64);
        for stage in STAGES {
            if need == 0 {
                break;
            }
            match stage {
                // Caches of VMs under pressure go before any vCPU waits.
                Stage::Spare | Stage::AboveLow | Stage::HeldSpare => {}
                // Short of exhaustion, reclaiming what a guest needs would
                // only put it under pressure and have relief give it back.
                _ if !exhausted => break,
                // Some VM still has spare pages or, not under pressure,
                // pages above its low (its step limits it this tick): nobody
                // goes below low yet.
                Stage::AboveMin | Stage::Squeeze
                    if work.iter().any(|w| {
                        [Stage::Spare, Stage::AboveLow, Stage::HeldSpare]
                            .into_iter()
                            .any(|stage| room(w, stage, false) > 0)
                    }) =>
                {
                    break
                }
                _ => {}
            }
            if stage == Stage::Squeeze {
                need = self.squeeze(work, need, now_us);
                continue;
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

    /// The squeeze: one VM under pressure gives way, the one with the
    /// lowest weight (among equals: the one already giving way, then the
    /// one furthest above its `low`, then the lowest index), up to its step
    /// this tick. Returns what is still needed.
    fn squeeze(&mut self, work: &mut [Work], need: Pages, now_us: u64) -> Pages {
        let victim = (0..work.len())
            .filter(|&i| room(&work[i], Stage::Squeeze, true) > 0)
            .min_by_key(|&i| {
                let w = &work[i];
                (
                    w.weight,
                    !w.squeezed,
                    core::cmp::Reverse(w.low_ceiling.saturating_sub(w.target)),
                    i,
                )
            });
        let Some(i) = victim else { return need };
        let w = &mut work[i];
        let take = need.min(room(w, Stage::Squeeze, true));
        w.target = w.target.saturating_add(take);
        w.squeezed = true;
        let st = &mut self.vms[i];
        st.squeezed_us = Some(now_us);
        st.stats.pages_squeezed = st.stats.pages_squeezed.saturating_add(take);
        self.stats.pages_squeezed = self.stats.pages_squeezed.saturating_add(take);
        need - take
    }

    /// What the board can back for hungry VMs: the pool above `min`, what
    /// inflation in flight will free, and what reclaim can still take from
    /// VMs that are not hungry without putting them under pressure (their
    /// spare pages, or all above their `low` without statistics).
    fn backable(&self, work: &[Work], pool_free: Pages) -> Pages {
        let others = work
            .iter()
            .filter(|w| !w.hungry && !w.congested && !w.backoff);
        let spare = sat_sum(others.map(|w| match w.reclaimable {
            Some(r) => r,
            None => w.low_ceiling.saturating_sub(w.target),
        }));
        let in_flight = sat_sum(
            work.iter()
                .filter(|w| w.progressing)
                .map(|w| w.target.saturating_sub(w.actual).saturating_sub(w.unbacked)),
        );
        pool_free
            .saturating_sub(self.watermarks.min)
            .saturating_add(spare)
            .saturating_add(in_flight)
    }

    /// The fence: the pages hungry VMs believe free that no frame backs,
    /// beyond what the board can back ([`Self::backable`]), are taken into
    /// their balloons, whatever their pressure: one VM after the other, in
    /// the order of weight and `low`, so that one gives way rather than all. Inflating them frees no
    /// frame and takes nothing the guest had; it stops a guest from touching
    /// memory the board cannot give, so that its own kernel reclaims its
    /// caches or kills instead of its vCPU waiting at stage 2, where it can
    /// do neither (a vCPU parked inside its kernel cannot run the balloon
    /// driver either). Given back with the rest once the pool stays above
    /// high.
    fn fence(&mut self, work: &mut [Work], pool_free: Pages) {
        // Only when exhaustion is near: at the hungry VMs' rates the pool
        // above `min` lasts less than twice the horizon. Far from it,
        // reclaim keeps up and fencing would only churn balloons (a
        // fenced page is touched once as the guest inflates it).
        // Looking further ahead by the time the slowest hungry driver takes
        // to begin: what it is asked must be asked that much earlier.
        let horizon = self.tunables.fault_in_horizon_us.max(1);
        let lead = work
            .iter()
            .filter(|w| w.hungry)
            .map(|w| w.latency_us)
            .max()
            .unwrap_or(0);
        let span = horizon.saturating_mul(2).saturating_add(lead);
        let within_span = |ahead: Pages| mul_div(ahead, span, horizon);
        let ahead = sat_sum(work.iter().filter(|w| w.hungry).map(|w| w.ahead));
        if pool_free.saturating_sub(self.watermarks.min) >= within_span(ahead) {
            return;
        }
        let backable = self.backable(work, pool_free);
        // What each hungry VM may touch within the same two horizons, no
        // more than it could touch at all: a VM writing a file over and
        // over touches its working set, not all it never touched, and a
        // hog starting beside a full pool is not throttled by its own
        // balloon (fenced pages go back only as it presses for them).
        let expected = |w: &Work| uncovered(w).min(within_span(w.ahead));
        let mut need =
            sat_sum(work.iter().filter(|w| w.hungry).map(expected)).saturating_sub(backable);
        let rooms: Vec<Pages> = work
            .iter()
            .map(
                |w| match w.hungry && !w.congested && !w.backoff && !w.refuses {
                    true => uncovered(w).min(w.ceiling.saturating_sub(w.target)),
                    false => 0,
                },
            )
            .collect();
        // One VM after the other: the lowest weight first, among equals the
        // one touching new pages slowest (it loses least), then the one
        // furthest above its `low`. What each can still give counts
        // before the next is fenced: its free pages and caches, and, once
        // it has nothing left to touch unbacked, the working set its own
        // kernel will reclaim or kill.
        let mut order: Vec<usize> = (0..work.len()).filter(|&i| rooms[i] > 0).collect();
        order.sort_by_key(|&i| {
            let w = &work[i];
            (
                w.weight,
                w.ahead,
                core::cmp::Reverse(w.low_ceiling.saturating_sub(w.target)),
                i,
            )
        });
        for i in order {
            if need == 0 {
                break;
            }
            let t = need.min(rooms[i]);
            let w = &mut work[i];
            w.target = w.target.saturating_add(t);
            // Left nothing it could touch unbacked, a hungry guest's kernel
            // reclaims, then kills: what it has backed above its `min` is
            // what the board can count on from it.
            let killed = match t == rooms[i] {
                true => w.backed.saturating_sub(w.size.saturating_sub(w.ceiling)),
                false => 0,
            };
            need = need
                .saturating_sub(t)
                .saturating_sub(w.reclaimable.unwrap_or(0))
                .saturating_sub(killed);
            let st = &mut self.vms[i].stats;
            st.pages_fenced = st.pages_fenced.saturating_add(t);
            self.stats.pages_fenced = self.stats.pages_fenced.saturating_add(t);
        }
    }

    /// Gives back up to `budget` pages to balloons above what the VMs'
    /// limits require, those under pressure first, then the least
    /// available memory; each by at most its give step.
    fn give_back(&mut self, work: &mut [Work], vms: &[VmInput], mut budget: Pages) {
        let mut order: Vec<usize> = (0..work.len())
            .filter(|&i| {
                let w = &work[i];
                vms[i].driver
                    && !w.hungry
                    && !w.congested
                    && !w.backoff
                    && !w.squeezed
                    && w.target <= vms[i].actual
                    && w.target > w.floor
            })
            .collect();
        order.sort_by_key(|&i| (!work[i].pressure, work[i].available_permille, i));
        for i in order {
            if budget == 0 {
                break;
            }
            let w = &mut work[i];
            let step = permille(vms[i].size, self.tunables.give_step_permille).max(1);
            let give = budget.min(step).min(w.target - w.floor);
            w.target -= give;
            budget -= give;
            let st = &mut self.vms[i].stats;
            st.pages_given_back = st.pages_given_back.saturating_add(give);
            self.stats.pages_given_back = self.stats.pages_given_back.saturating_add(give);
        }
    }

    /// Cancels up to `excess` pages of the outstanding inflation of VMs
    /// that are not hungry, largest first, down to their balloons' actual
    /// size.
    fn settle(&mut self, work: &mut [Work], vms: &[VmInput], excess: Pages) {
        let lowest = |_: &Work, vm: &VmInput| vm.actual;
        self.cancel(work, vms, excess, |w| !w.hungry, lowest);
    }

    /// Cancels up to `excess` pages of outstanding inflation, largest
    /// outstanding first: only inflation that frees frames (the fence over
    /// pages no frame backs stays).
    fn trim(&mut self, work: &mut [Work], vms: &[VmInput], excess: Pages) {
        let lowest = |w: &Work, vm: &VmInput| vm.actual.saturating_add(w.unbacked);
        self.cancel(work, vms, excess, |_| true, lowest);
    }

    /// Lowers the targets of the VMs `may` allows that owe inflation,
    /// largest outstanding first, each to `lowest` at most (never below its
    /// floor), until `excess` pages are cancelled; counted as trimmed.
    fn cancel(
        &mut self,
        work: &mut [Work],
        vms: &[VmInput],
        mut excess: Pages,
        may: impl Fn(&Work) -> bool,
        lowest: impl Fn(&Work, &VmInput) -> Pages,
    ) {
        let mut order: Vec<usize> = (0..work.len())
            .filter(|&i| work[i].progressing && may(&work[i]) && work[i].target > vms[i].actual)
            .collect();
        order.sort_by_key(|&i| core::cmp::Reverse(work[i].target - vms[i].actual));
        for i in order {
            if excess == 0 {
                break;
            }
            let lowest = lowest(&work[i], &vms[i]).max(work[i].floor);
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
