//! A VM as the memory manager ([`crate::mm::manager`]) sees and changes
//! it: the [`VmInput`] read from its RAM and balloon each tick, the
//! balloon targets the manager sets, the limits the shell changes, and the
//! vCPUs that wait for a frame when the pool is at its floor. The manager
//! itself, its lock and its tick are the target's (`crate::run`).
//!
//! A VM the manager must leave alone (stopped, without a balloon, or
//! ballooned by hand from the shell) gives an empty input: size 0, so no
//! decision can touch it.
//!
//! Guest numbers: the balloon bounds `actual` and the statistics where
//! they enter (`balloon::stats`); [`input`] bounds the whole input again
//! against the VM's size ([`VmInput::bounded`]) and counts what it had to
//! bound in `Managed::inputs_clamped` (`info balloon`). The shell's
//! reports convert pages to bytes and MiB with saturation.

use core::fmt;

use super::balloon_ctl;
use super::cpu::PhysCpu;
use super::memory::HostMemory as _;
pub use super::state::{FrameWait, Managed};
use super::state::{Vm, VmState};
use crate::balloon::stats::StatsSample;
use crate::mm::frames::PAGE_SIZE;
use crate::mm::manager::{
    GuestStats, Limits, ManagerStats, Pages, Policy, VmInput, VmStats, Watermarks,
};
use crate::virtio::mmio::STATUS_DRIVER_OK;

/// How long a vCPU waits for a frame before the console says so.
pub const WAIT_ANNOUNCE_US: u64 = 1_000_000;

/// The bound on a vCPU's wait for a frame: past it, the board's
/// escalation (`when_exhausted`) applies. Long enough for the squeeze to
/// have a guest's own kernel reclaim or kill (a balloon moves 64 MiB/s or
/// more), well short of a guest's soft-lockup watchdog (20 s).
pub const WAIT_BOUND_US: u64 = 5_000_000;

/// Whether the board's escalation is due at `now_us`: a vCPU has waited
/// [`WAIT_BOUND_US`] for a frame, and the last VM the escalation stopped
/// (if any) was stopped at least that long ago: its memory needs a moment
/// to reach the vCPUs that waited for it, so one stop never cascades.
pub fn escalation_due(now_us: u64, longest_wait_us: u64, last_stop_us: Option<u64>) -> bool {
    longest_wait_us >= WAIT_BOUND_US
        && last_stop_us.is_none_or(|t| now_us.saturating_sub(t) >= WAIT_BOUND_US)
}

/// A running VM as `stop-lowest` weighs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopCandidate {
    pub weight: u32,
    /// Pages backed: what stopping it frees.
    pub backed: Pages,
    /// Its `low` limit in pages: what its configuration protects.
    pub low: Pages,
}

/// `stop-lowest`'s victim among the running VMs (by VM slot, `None` for a
/// slot not running), in the order of weight and `low` the fence and the
/// squeeze follow: the lowest weight; among equals the one furthest above
/// its `low` (the least of it protected, and it frees the most); the lowest
/// slot among those.
pub fn lowest_weight(running: &[Option<StopCandidate>]) -> Option<usize> {
    running
        .iter()
        .enumerate()
        .filter_map(|(id, c)| c.map(|c| (id, c)))
        .min_by_key(|&(id, c)| {
            (
                c.weight,
                core::cmp::Reverse(c.backed.saturating_sub(c.low)),
                id,
            )
        })
        .map(|(id, _)| id)
}

/// The end of `mm`'s manager line: nothing for the manager itself, else
/// who sets the targets instead (`mm policy`).
fn policy_note(policy: Policy) -> &'static str {
    match policy {
        Policy::Manager => "",
        Policy::Naive => "; targets set by the naive controller ('mm policy naive'), not the manager",
        Policy::NoController => {
            "; no controller sets targets ('mm policy none'): only reporting and hinting return memory"
        }
    }
}

/// What `when_exhausted` does, as the console and `mm` say it.
pub fn exhausted_policy(stop_lowest: bool) -> &'static str {
    match stop_lowest {
        true => "a vCPU that waits 5 s for a frame stops the lowest-weight VM",
        false => "the faulting vCPU waits without bound (when_exhausted = \"wait\")",
    }
}

/// Whether the manager may move VM `vm`'s balloon.
pub fn is_managed(vm: &Vm) -> bool {
    vm.state == VmState::Running
        && !vm.managed.manual
        && vm.memory.ram.is_some()
        && vm.devices.balloon.is_some()
}

/// The guest's statistics as the manager reads them.
fn guest_stats(sample: &StatsSample) -> GuestStats {
    let v = |tag: usize| sample.values[tag];
    GuestStats {
        free: v(4),
        available: v(6),
        caches: v(7),
        major_faults: v(2),
        oom_kills: v(10),
        alloc_stalls: v(11),
    }
}

/// This tick's input for VM `vm` (empty if the manager leaves it alone);
/// the fault-in and deflate-on-OOM counts are since the previous call.
/// Every value is bounded by the VM's size; those that were not are
/// counted.
pub fn input(vm: &mut Vm) -> VmInput {
    let managed = is_managed(vm);
    let (Some(ram), Some(balloon)) = (vm.memory.ram.as_ref(), vm.devices.balloon.as_ref()) else {
        return VmInput::default();
    };
    let faults = ram.stats.faults_backed;
    let counters = balloon.device().stats();
    let deflated = counters.pages_deflated_on_oom;
    let returned_total = counters
        .pages_reported
        .saturating_add(counters.pages_hinted);
    let fault_ins = faults.saturating_sub(vm.managed.faults_seen);
    let deflate_on_oom = deflated.saturating_sub(vm.managed.oom_deflated_seen);
    let returned = returned_total.saturating_sub(vm.managed.returned_seen);
    vm.managed.faults_seen = faults;
    vm.managed.oom_deflated_seen = deflated;
    vm.managed.returned_seen = returned_total;
    if !managed {
        return VmInput::default();
    }
    let device = balloon.device();
    let raw = VmInput {
        size: ram.pages(),
        backed: ram.mapped_pages(),
        target: u64::from(device.target()),
        actual: u64::from(device.actual()),
        limits: vm.managed.limits,
        stats: device.stats_sample().map(guest_stats),
        fault_ins,
        returned,
        deflate_on_oom,
        driver: balloon.status() & STATUS_DRIVER_OK != 0 && !balloon.needs_reset(),
        waiting: vm.managed.waiting(),
    };
    let clamped = raw.out_of_bounds();
    if clamped != 0 {
        vm.managed.inputs_clamped = vm.managed.inputs_clamped.saturating_add(u64::from(clamped));
    }
    raw.bounded()
}

/// How old the guest's statistics may be when the manager needs them (the
/// pool below `low`): older, it asks the driver for fresh ones at once
/// instead of waiting for the next poll (every 2 s by default).
pub const STATS_FRESH_US: u64 = 250_000;

/// The manager needs VM `vm`'s statistics now (the pool is short): if its
/// balloon's latest sample is older than [`STATS_FRESH_US`] (or there is
/// none yet), ask the driver for fresh ones. True if it asked.
pub fn want_fresh_stats(vm: &mut Vm, now_us: u64) -> bool {
    if !is_managed(vm) {
        return false;
    }
    let Some(balloon) = vm.devices.balloon.as_mut() else {
        return false;
    };
    let stale = balloon
        .device()
        .stats_sample()
        .is_none_or(|s| now_us.saturating_sub(s.arrived_us) > STATS_FRESH_US);
    if stale {
        balloon.device_mut().request_stats();
    }
    stale
}

/// Set the balloon target the manager decided (quietly: the console gets
/// no line per move; `mm` counts them).
pub fn apply(vm: &mut Vm, cpu: &mut impl PhysCpu, target: Pages) {
    if is_managed(vm) {
        let _ = balloon_ctl::set_target_by(vm, cpu, target, balloon_ctl::SetBy::Manager);
    }
}

/// A limit the shell's `set <vm> <limit> <value>` changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitField {
    Min,
    Low,
    Max,
    Weight,
}

impl LimitField {
    pub fn parse(word: &str) -> Option<Self> {
        match word {
            "min" => Some(Self::Min),
            "low" => Some(Self::Low),
            "max" => Some(Self::Max),
            "weight" => Some(Self::Weight),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Min => "min",
            Self::Low => "low",
            Self::Max => "max",
            Self::Weight => "weight",
        }
    }
}

/// Why `set` refused a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitError {
    /// A size that is not a multiple of 4 KiB.
    NotPages,
    /// The limits would contradict each other or the VM's size.
    Config(crate::mm::manager::ConfigError),
    /// Raising `min` needs frames the pool does not have free.
    CannotGuarantee { needed: Pages, available: Pages },
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotPages => f.write_str("a size must be a multiple of 4K (e.g. 768M)"),
            Self::Config(e) => write!(f, "{e}"),
            Self::CannotGuarantee { needed, available } => write!(
                f,
                "the pool cannot guarantee {} more ({} free beside the other guarantees and the pool's min reserve)",
                size(*needed),
                size(*available)
            ),
        }
    }
}

/// The limits `vm` would have with `field` set to `value` (bytes, or the
/// weight), checked against each other and its size.
pub fn with_limit(vm: &Vm, field: LimitField, value: u64) -> Result<Limits, LimitError> {
    let mut l = vm.managed.limits;
    let pages = || {
        if !value.is_multiple_of(PAGE_SIZE) {
            Err(LimitError::NotPages)
        } else {
            Ok(value / PAGE_SIZE)
        }
    };
    match field {
        LimitField::Min => {
            l.min = pages()?;
            // low defaults to min: raising min raises low with it.
            l.low = l.low.max(l.min);
        }
        LimitField::Low => l.low = pages()?,
        LimitField::Max => l.max = pages()?,
        LimitField::Weight => l.weight = u32::try_from(value).unwrap_or(u32::MAX),
    }
    l.validate(vm.memory.size / PAGE_SIZE)
        .map_err(LimitError::Config)?;
    Ok(l)
}

/// Pages VM `vm` is guaranteed with limits `l`: all of its RAM with
/// prealloc, else its `min`.
pub fn guaranteed(vm: &Vm, l: &Limits) -> Pages {
    if vm.spec.prealloc() {
        vm.memory.size / PAGE_SIZE
    } else {
        l.min
    }
}

/// vCPU `vcpu` found no frame for a fault (the pool at its floor): it
/// waits, retrying the access; after [`WAIT_ANNOUNCE_US`] the console says
/// which VM and why, once per wait.
pub fn frame_wait(vm: &mut Vm, vcpu: usize, now_us: u64, pool_free: Pages) {
    if wait_announced(vm, vcpu, now_us, false).is_some() {
        vm.console.out.line(format_args!(
            "tidal: [{}] vCPU {vcpu} waits for memory: the pool is at its min watermark ({} free) and no VM has given any back yet; the memory manager is reclaiming ('mm' shows it)",
            vm.name,
            size(pool_free)
        ));
    }
}

/// vCPU `vcpu` touched a page its VM may not have: the VM has `max` pages
/// backed already (its balloon has not made room, or it has no working
/// balloon). It waits, retrying the access, as for the pool: the console
/// says so after [`WAIT_ANNOUNCE_US`]; after [`WAIT_BOUND_US`] the answer
/// is true and the caller stops the VM (the limit is its own: no other VM
/// gives way for it).
pub fn max_wait(vm: &mut Vm, vcpu: usize, now_us: u64) -> bool {
    let waited = wait_announced(vm, vcpu, now_us, true);
    if waited.is_some() {
        vm.console.out.line(format_args!(
            "tidal: [{}] vCPU {vcpu} waits for memory: the VM has its memory max ({}) backed and its balloon has not made room; at {} s the VM is stopped",
            vm.name,
            size(vm.managed.limits.max),
            WAIT_BOUND_US / 1_000_000
        ));
    }
    vm.managed
        .waits
        .get(vcpu)
        .copied()
        .flatten()
        .is_some_and(|w| now_us.saturating_sub(w.since_us) >= WAIT_BOUND_US)
}

/// Records vCPU `vcpu`'s wait (begun now if it was not waiting; `at_max`
/// says which kind); `Some(waited)` the one time the console is due to
/// hear of it, after [`WAIT_ANNOUNCE_US`].
fn wait_announced(vm: &mut Vm, vcpu: usize, now_us: u64, at_max: bool) -> Option<u64> {
    let slot = vm.managed.waits.get_mut(vcpu)?;
    let wait = slot.get_or_insert_with(|| {
        vm.managed.waits_begun += 1;
        FrameWait {
            since_us: now_us,
            announced: false,
            at_max,
        }
    });
    wait.at_max = at_max;
    let waited = now_us.saturating_sub(wait.since_us);
    if wait.announced || waited < WAIT_ANNOUNCE_US {
        return None;
    }
    wait.announced = true;
    vm.managed.waits_long += 1;
    Some(waited)
}

/// A wait for a frame longer than this is slow (`mm raw`'s `waits_slow`):
/// where reclaim can cover the demand, the manager's goal is that none is.
pub const SLOW_WAIT_US: u64 = 100_000;

/// vCPU `vcpu`'s fault was served: its wait, if any, is over.
#[inline]
pub fn frame_served(vm: &mut Vm, vcpu: usize, now_us: u64) {
    let Some(wait) = vm.managed.waits.get_mut(vcpu).and_then(Option::take) else {
        return;
    };
    let waited = now_us.saturating_sub(wait.since_us);
    let m = &mut vm.managed;
    m.wait_longest_us = m.wait_longest_us.max(waited);
    if waited > SLOW_WAIT_US {
        m.waits_slow = m.waits_slow.saturating_add(1);
    }
    if wait.announced {
        vm.console.out.line(format_args!(
            "tidal: [{}] vCPU {vcpu} got memory after waiting {} ms",
            vm.name,
            waited / 1000
        ));
    }
}

/// How long VM `vm`'s longest current wait for a frame from the pool has
/// lasted (a wait at its own `max` is not the board's).
pub fn longest_wait_us(vm: &Vm, now_us: u64) -> Option<u64> {
    // A VM that stopped while a vCPU waited waits no more.
    if vm.state != VmState::Running {
        return None;
    }
    vm.managed
        .waits
        .iter()
        .flatten()
        .filter(|w| !w.at_max)
        .map(|w| now_us.saturating_sub(w.since_us))
        .max()
}

// ----------------------------------------------------------------- the shell

/// The board's side of `mm`, `mem` and `vms`, in pages unless named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolView {
    /// RAM of the board, bytes.
    pub physical_bytes: u64,
    /// Pages the frame table manages, and those free.
    pub total: Pages,
    pub free: Pages,
    /// Free pages held for guarantees.
    pub reserved: Pages,
    /// RAM of every VM of the bundle, and of the running ones.
    pub committed: Pages,
    pub committed_running: Pages,
    /// Guest pages backed by frames now.
    pub backed: Pages,
    pub watermarks: Watermarks,
    pub stop_lowest: bool,
    /// Who sets the balloon targets (`mm policy`).
    pub policy: Policy,
    /// VMs the manager stopped because the pool was exhausted.
    pub exhausted_stops: u64,
}

/// One VM's line of `mm`, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmRow {
    pub state: &'static str,
    pub size: Pages,
    pub backed: Pages,
    /// Balloon actual and target (0 without a balloon).
    pub balloon: Pages,
    pub target: Pages,
    /// Pages the guest gave back by free page reporting and hinting.
    pub returned: Pages,
    pub limits: Limits,
    pub manual: bool,
    pub has_balloon: bool,
    pub waits: u64,
    /// Waits longer than [`SLOW_WAIT_US`], and the longest that ended (µs).
    pub waits_slow: u64,
    pub wait_longest_us: u64,
    pub stats: VmStats,
}

/// VM `vm`'s row, with the manager's counters for it.
pub fn row(vm: &Vm, stats: VmStats) -> VmRow {
    let device = vm.devices.balloon.as_ref().map(|b| b.device());
    let counters = device
        .map(|d| *d.stats())
        .or(vm.counters.last_balloon_stats);
    VmRow {
        state: vm.state.label(),
        size: vm.memory.size / PAGE_SIZE,
        backed: vm.memory.ram.as_ref().map_or(0, |r| r.mapped_pages()),
        balloon: device.map_or(0, |d| u64::from(d.actual())),
        target: device.map_or(0, |d| u64::from(d.target())),
        returned: counters.map_or(0, |c| c.pages_reported.saturating_add(c.pages_hinted)),
        limits: vm.managed.limits,
        manual: vm.managed.manual,
        has_balloon: vm.spec.has_balloon(),
        waits: vm.managed.waits_begun,
        waits_slow: vm.managed.waits_slow,
        wait_longest_us: vm.managed.wait_longest_us,
        stats,
    }
}

/// Pages as whole MiB (rounded down), for tables; no overflow for any
/// count of pages.
fn mib(pages: Pages) -> u64 {
    pages / ((1 << 20) / PAGE_SIZE)
}

/// Pages as a [`crate::size::Size`], saturated at 2^64-1 bytes.
fn size(pages: Pages) -> crate::size::Size {
    crate::size::Size(pages.saturating_mul(PAGE_SIZE))
}

/// What the manager does with a VM's balloon, in a word or two.
fn mode(r: &VmRow) -> &'static str {
    match (
        r.has_balloon,
        r.manual,
        r.stats.congested,
        r.stats.under_pressure,
    ) {
        (false, ..) => "no balloon",
        (true, true, ..) => "manual",
        (true, false, true, _) => "congested",
        (true, false, false, true) => "pressure",
        (true, false, false, false) => "managed",
    }
}

/// The board line shared by `mm` and `mem`.
pub fn write_pool(out: &mut impl fmt::Write, pool: &PoolView) -> fmt::Result {
    let w = pool.watermarks;
    writeln!(
        out,
        "pool: {} physical, {} committed to VMs ({} running), {} backed, {} free ({} held for guarantees); watermarks min {}, low {}, high {}",
        crate::size::Size(pool.physical_bytes),
        size(pool.committed),
        size(pool.committed_running),
        size(pool.backed),
        size(pool.free),
        size(pool.reserved),
        size(w.min),
        size(w.low),
        size(w.high)
    )
}

/// The `mm` command.
pub fn write_mm(
    out: &mut impl fmt::Write,
    pool: &PoolView,
    stats: &ManagerStats,
    rows: &[(&str, VmRow)],
) -> fmt::Result {
    write_pool(out, pool)?;
    writeln!(
        out,
        "manager: {} ticks; {} targets set; {} reclaimed ({} fenced, {} squeezed from VMs under pressure), {} given, {} given back, {} trimmed, {} withdrawn from stuck balloons; {} bail-outs, {} ticks short; {} congestion marks ({} VMs skipped); when exhausted: {} ({} VMs stopped){}",
        stats.ticks,
        stats.targets_set,
        size(stats.pages_reclaimed),
        size(stats.pages_fenced),
        size(stats.pages_squeezed),
        size(stats.pages_given),
        size(stats.pages_given_back),
        size(stats.pages_trimmed),
        size(stats.pages_withdrawn),
        stats.bailouts,
        stats.short_ticks,
        stats.congested_marks,
        stats.congested_skips,
        exhausted_policy(pool.stop_lowest),
        pool.exhausted_stops,
        policy_note(pool.policy)
    )?;
    writeln!(
        out,
        "{:<12} {:<8} {:>6} {:>6} {:>7} {:>8} {:>5} {:>5} {:>6} {:>6} {:>9} {:>6} {:>5}  balloon",
        "(MiB)",
        "state",
        "size",
        "backed",
        "balloon",
        "returned",
        "min",
        "low",
        "max",
        "weight",
        "reclaimed",
        "given",
        "waits"
    )?;
    for (name, r) in rows {
        writeln!(
            out,
            "{:<12} {:<8} {:>6} {:>6} {:>7} {:>8} {:>5} {:>5} {:>6} {:>6} {:>9} {:>6} {:>5}  {}",
            name,
            r.state,
            mib(r.size),
            mib(r.backed),
            mib(r.balloon),
            mib(r.returned),
            mib(r.limits.min),
            mib(r.limits.low),
            mib(r.limits.max),
            r.limits.weight,
            mib(r.stats.pages_reclaimed),
            mib(r.stats.pages_given),
            r.waits,
            mode(r)
        )?;
    }
    Ok(())
}

/// `mm raw`: the same in pages, one `key=value` line per item, for scripts
/// and the policy benchmark.
pub fn write_mm_raw(
    out: &mut impl fmt::Write,
    pool: &PoolView,
    rows: &[(&str, VmRow)],
) -> fmt::Result {
    let w = pool.watermarks;
    let waits: u64 = rows.iter().map(|(_, r)| r.waits).sum();
    writeln!(
        out,
        "mm-pool total={} free={} reserved={} committed={} backed={} min={} low={} high={} waits={} stopped={} policy={}",
        pool.total, pool.free, pool.reserved, pool.committed, pool.backed, w.min, w.low, w.high, waits, pool.exhausted_stops, pool.policy.name()
    )?;
    for (name, r) in rows {
        writeln!(
            out,
            "mm-vm name={name} state={} size={} backed={} balloon={} target={} returned={} min={} low={} max={} weight={} congested={} pressure={} reclaimed={} given={} manual={} waits={} squeezed={} given_back={} withdrawn={} fenced={} waits_slow={} wait_longest_us={} hungry={}",
            r.state,
            r.size,
            r.backed,
            r.balloon,
            r.target,
            r.returned,
            r.limits.min,
            r.limits.low,
            r.limits.max,
            r.limits.weight,
            u8::from(r.stats.congested),
            u8::from(r.stats.under_pressure),
            r.stats.pages_reclaimed,
            r.stats.pages_given,
            u8::from(r.manual),
            r.waits,
            r.stats.pages_squeezed,
            r.stats.pages_given_back,
            r.stats.pages_withdrawn,
            r.stats.pages_fenced,
            r.waits_slow,
            r.wait_longest_us,
            u8::from(r.stats.hungry)
        )?;
    }
    writeln!(out, "mm-end")
}

/// The memory line `vms` prints under a VM's row.
pub fn write_vm_memory(out: &mut impl fmt::Write, name: &str, r: &VmRow) -> fmt::Result {
    let l = r.limits;
    writeln!(
        out,
        "  {name}: memory {}: {} backed, {} ballooned, {} returned by reporting/hinting; min {}, low {}, max {}, weight {}; balloon {}",
        size(r.size),
        size(r.backed),
        size(r.balloon),
        size(r.returned),
        size(l.min),
        size(l.low),
        size(l.max),
        l.weight,
        mode(r)
    )
}

/// `set <vm> <field> <value>`: change a VM's limit. Raising `min` of a
/// running VM holds the frames for it first (refused if the pool cannot);
/// the manager applies the rest at its next tick.
pub fn set_limit(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    field: LimitField,
    value: u64,
) -> Result<Limits, LimitError> {
    let limits = with_limit(vm, field, value)?;
    if vm.memory.ram.is_some() {
        cpu.memory()
            .guarantee(vm.id, guaranteed(vm, &limits))
            .map_err(|s| LimitError::CannotGuarantee {
                needed: s.needed,
                available: s.available,
            })?;
    }
    vm.managed.limits = limits;
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shell's reports convert pages to MiB and bytes: a row of
    /// 2^64-1 everywhere (counters of a long-lived board, values a guest
    /// drove) must print, not overflow.
    #[test]
    fn reports_of_extreme_pages_do_not_overflow() {
        let max = u64::MAX;
        let row = VmRow {
            state: "running",
            size: max,
            backed: max,
            balloon: max,
            target: max,
            returned: max,
            limits: Limits {
                min: max,
                low: max,
                max,
                weight: u32::MAX,
            },
            manual: false,
            has_balloon: true,
            waits: max,
            waits_slow: max,
            wait_longest_us: max,
            stats: VmStats {
                pages_reclaimed: max,
                pages_given: max,
                ..VmStats::default()
            },
        };
        let pool = PoolView {
            physical_bytes: max,
            total: max,
            free: max,
            reserved: max,
            committed: max,
            committed_running: max,
            backed: max,
            watermarks: Watermarks {
                min: max,
                low: max,
                high: max,
            },
            stop_lowest: false,
            exhausted_stops: max,
            policy: Policy::Naive,
        };
        let stats = ManagerStats {
            pages_reclaimed: max,
            pages_given: max,
            pages_trimmed: max,
            ..ManagerStats::default()
        };
        let mut out = String::new();
        write_mm(&mut out, &pool, &stats, &[("hostile", row)]).unwrap();
        write_mm_raw(&mut out, &pool, &[("hostile", row)]).unwrap();
        write_vm_memory(&mut out, "hostile", &row).unwrap();
        write_pool(&mut out, &pool).unwrap();
        // 2^64-1 pages are 2^56 MiB, rounded down.
        assert!(out.contains(&format!(" {} ", max >> 8)), "{out}");
        let e = LimitError::CannotGuarantee {
            needed: max,
            available: max,
        };
        assert!(e.to_string().contains("cannot guarantee"));
    }

    #[test]
    fn escalation_waits_for_the_bound_and_never_cascades() {
        let b = WAIT_BOUND_US;
        assert!(!escalation_due(b, b - 1, None));
        assert!(escalation_due(b, b, None));
        // A stop a moment ago: the next waits its own bound.
        assert!(!escalation_due(10 * b, 3 * b, Some(10 * b - 1)));
        assert!(escalation_due(11 * b, 3 * b, Some(10 * b)));
        assert!(escalation_due(u64::MAX, u64::MAX, Some(0)), "no overflow");
    }

    #[test]
    fn stop_lowest_picks_the_lowest_weight_then_the_furthest_above_low() {
        let c = |weight, backed, low| {
            Some(StopCandidate {
                weight,
                backed,
                low,
            })
        };
        assert_eq!(lowest_weight(&[]), None);
        assert_eq!(lowest_weight(&[None, None]), None);
        let running = [c(100, 10, 0), None, c(50, 1, 0), c(50, 7, 0), c(50, 7, 0)];
        assert_eq!(lowest_weight(&running), Some(3));
        assert_eq!(lowest_weight(&running[..3]), Some(2));
        assert_eq!(lowest_weight(&[c(100, 1, 0), c(100, 2, 0)]), Some(1));
        // Equal weights: the most backed is spared when its `low` protects
        // more of it than the other's does.
        assert_eq!(lowest_weight(&[c(100, 900, 800), c(100, 500, 0)]), Some(1));
        // A `low` above what it has backed counts as nothing above it.
        assert_eq!(lowest_weight(&[c(100, 100, 800), c(100, 1, 0)]), Some(1));
    }
}
