//! The memory manager's policy (`mm/manager.rs`): several ticks of
//! `Manager::tick` over VMs whose inputs come from the guest (balloon
//! statistics, any u64 including 2^64-1; balloon actual; fault-in and
//! deflate-on-OOM counts) and from the pool (free pages, the time), with
//! watermarks and limits that pass the configuration's validation.
//! Invariants: no panic (overflow checks on); one decision per VM; every
//! target it sets within the VM's limits (`size - max ..= size - min`);
//! decisions deterministic (a clone of the manager fed the same tick
//! decides the same); `unmet` no more than what reclaim was asked for.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::mm::manager::{
    GuestStats, Limits, Manager, Pages, Policy, Tunables, VmInput, Watermarks, MAX_WEIGHT,
};
use libfuzzer_sys::fuzz_target;

/// What the guest and the host report about one VM for one tick.
#[derive(Arbitrary, Debug)]
struct VmTick {
    target: u64,
    actual: u64,
    backed: u64,
    stats: Option<Stats>,
    fault_ins: u64,
    returned: u64,
    deflate_on_oom: u64,
    driver: bool,
    waiting: bool,
}

#[derive(Arbitrary, Debug)]
struct Stats {
    available: Option<u64>,
    free: Option<u64>,
    caches: Option<u64>,
    major_faults: Option<u64>,
    oom_kills: Option<u64>,
    alloc_stalls: Option<u64>,
}

/// A VM's configuration: fixed over the run, as a VM's size is.
#[derive(Arbitrary, Debug)]
struct VmConfig {
    size: u64,
    min: u64,
    low: u64,
    max: u64,
    weight: u32,
}

#[derive(Arbitrary, Debug)]
struct Tick {
    /// Microseconds since the previous tick (time only moves forward,
    /// but a tick may come at the same time).
    advance: u32,
    pool_free: u64,
    vms: Vec<VmTick>,
    /// The board's escalation stopped a VM before this tick.
    escalated: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    ram: u64,
    watermarks: (u64, u64, u64),
    default_watermarks: bool,
    start_us: u64,
    vms: Vec<VmConfig>,
    ticks: Vec<Tick>,
    /// VMs forgotten (stopped) after a tick: a bit per VM slot.
    forget: Vec<u8>,
    /// Who sets the targets (`mm policy`): the manager or a baseline, all
    /// of them fed the same guest numbers.
    policy: u8,
}

/// Limits that pass `Limits::validate` for a VM of `size` pages, from any
/// numbers (sorted into min <= low <= max <= size).
fn limits(c: &VmConfig) -> Limits {
    let size = vm_size(c);
    let mut v = [c.min, c.low, c.max];
    for x in &mut v {
        *x %= size + 1;
    }
    v.sort_unstable();
    let l = Limits {
        min: v[0],
        low: v[1],
        max: v[2],
        weight: c.weight % MAX_WEIGHT + 1,
    };
    assert_eq!(l.validate(size), Ok(()));
    l
}

/// A VM's size in pages: configured, so at most what a board could hold
/// (2^36 pages, 256 TiB).
fn vm_size(c: &VmConfig) -> Pages {
    c.size % (1 << 36)
}

fn stats(s: &Stats) -> GuestStats {
    GuestStats {
        available: s.available,
        free: s.free,
        caches: s.caches,
        major_faults: s.major_faults,
        oom_kills: s.oom_kills,
        alloc_stalls: s.alloc_stalls,
    }
}

fuzz_target!(|input: Input| {
    // Up to 2^36 pages (256 TiB): `Watermarks::for_ram` takes a real
    // board's RAM size, not a guest's number.
    let ram = input.ram % (1 << 36) + 1;
    let watermarks = if input.default_watermarks {
        Watermarks::for_ram(ram)
    } else {
        let mut w = [input.watermarks.0, input.watermarks.1, input.watermarks.2];
        for x in &mut w {
            *x %= ram;
        }
        w.sort_unstable();
        Watermarks {
            min: w[0],
            low: w[1],
            high: w[2],
        }
    };
    if watermarks.validate(ram).is_err() {
        // `for_ram` on a tiny RAM: the configuration would be refused.
        return;
    }
    // The tunables the hypervisor ships (`run.rs` uses the defaults).
    let tunables = Tunables::default();
    let configs: Vec<(u64, Limits)> = input
        .vms
        .iter()
        .take(8)
        .map(|c| (vm_size(c), limits(c)))
        .collect();
    if configs.is_empty() {
        return;
    }
    let mut m = Manager::new(watermarks, tunables);
    m.set_policy(Policy::ALL[usize::from(input.policy) % Policy::ALL.len()]);
    let mut now = input.start_us;
    for (n, tick) in input.ticks.iter().take(32).enumerate() {
        now = now.saturating_add(u64::from(tick.advance));
        let vms: Vec<VmInput> = configs
            .iter()
            .zip(tick.vms.iter().chain(std::iter::repeat(&VmTick {
                target: 0,
                actual: 0,
                backed: 0,
                stats: None,
                fault_ins: 0,
                returned: 0,
                deflate_on_oom: 0,
                driver: true,
                waiting: false,
            })))
            .map(|(&(size, limits), t)| VmInput {
                size,
                backed: t.backed,
                target: t.target,
                actual: t.actual,
                limits,
                stats: t.stats.as_ref().map(stats),
                fault_ins: t.fault_ins,
                returned: t.returned,
                deflate_on_oom: t.deflate_on_oom,
                driver: t.driver,
                waiting: t.waiting,
            })
            .collect();
        if tick.escalated {
            m.escalated();
        }
        let mut twin = m.clone();
        let d = m.tick(now, tick.pool_free, &vms);
        let again = twin.tick(now, tick.pool_free, &vms);
        assert_eq!(d, again, "a tick is deterministic");
        assert_eq!(m.stats(), twin.stats());
        assert_eq!(d.targets.len(), vms.len(), "one decision per VM");
        for (i, (t, vm)) in d.targets.iter().zip(&vms).enumerate() {
            let Some(t) = *t else { continue };
            let floor: Pages = vm.size - vm.limits.max;
            let ceiling: Pages = vm.size - vm.limits.min;
            assert!(
                (floor..=ceiling).contains(&t),
                "VM {i}: target {t} outside {floor}..={ceiling} ({vm:?})"
            );
            assert_ne!(t, vm.target, "VM {i}: a decision changes the target");
        }
        assert!(
            d.unmet <= watermarks.high,
            "unmet {} beyond what reaching high needs",
            d.unmet
        );
        if let Some(&bits) = input.forget.get(n) {
            for i in 0..configs.len() {
                if bits & (1 << i) != 0 {
                    m.forget(i);
                }
            }
        }
    }
});
