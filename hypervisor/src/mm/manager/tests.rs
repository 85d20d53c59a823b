//! The policy's edge cases, one tick or a few at a time.

use super::*;

const WM: Watermarks = Watermarks {
    min: 100,
    low: 300,
    high: 500,
};
const SIZE: Pages = 10_000;
const TICK: u64 = 100_000;

fn manager() -> Manager {
    Manager::new(WM, Tunables::default())
}

/// A VM of `SIZE` pages with a working driver and no limits.
fn vm(target: Pages, actual: Pages) -> VmInput {
    VmInput {
        size: SIZE,
        backed: SIZE - actual,
        target,
        actual,
        limits: Limits::unlimited(SIZE),
        stats: None,
        fault_ins: 0,
        returned: 0,
        deflate_on_oom: 0,
        driver: true,
        waiting: false,
    }
}

/// Statistics of a guest with `free` and `caches` pages.
fn guest(free: Pages, caches: Pages) -> Option<GuestStats> {
    Some(GuestStats {
        available: Some((free + caches) * PAGE_SIZE),
        free: Some(free * PAGE_SIZE),
        caches: Some(caches * PAGE_SIZE),
        major_faults: Some(0),
        oom_kills: Some(0),
        alloc_stalls: Some(0),
    })
}

fn raised(d: &Decisions, vms: &[VmInput]) -> Vec<Pages> {
    d.targets
        .iter()
        .zip(vms)
        .map(|(t, v)| t.map_or(0, |t| t.saturating_sub(v.target)))
        .collect()
}

/// Applies the decisions to the inputs (the balloons have not moved).
fn apply(d: &Decisions, vms: &mut [VmInput]) {
    for (t, v) in d.targets.iter().zip(vms) {
        if let Some(t) = t {
            v.target = *t;
        }
    }
}

#[test]
fn watermark_defaults_and_validation() {
    // 1 GiB: 1%, 3%, 5%.
    let w = Watermarks::for_ram(262_144);
    assert_eq!((w.min, w.low, w.high), (2621, 7864, 13107));
    assert_eq!(w.validate(262_144), Ok(()));
    // A small pool keeps 1 MiB between watermarks.
    let w = Watermarks::for_ram(4096);
    assert_eq!((w.min, w.low, w.high), (256, 512, 768));
    let bad = Watermarks {
        min: 10,
        low: 5,
        high: 20,
    };
    let e = bad.validate(1000).unwrap_err();
    assert_eq!(e, ConfigError::WatermarksOrder);
    assert!(e.to_string().contains("min <= low <= high"));
    assert_eq!(WM.validate(500), Err(ConfigError::WatermarkAboveRam));
}

#[test]
fn limits_validation_says_what_to_change() {
    let ok = Limits {
        min: 10,
        low: 20,
        max: 100,
        weight: 100,
    };
    assert_eq!(ok.validate(100), Ok(()));
    let cases = [
        (
            Limits { min: 200, ..ok },
            ConfigError::MinAboveMax,
            "lower min",
        ),
        (
            Limits { low: 200, ..ok },
            ConfigError::LowAboveMax,
            "lower low",
        ),
        (
            Limits { min: 30, ..ok },
            ConfigError::MinAboveLow,
            "raise low",
        ),
        (
            Limits { weight: 0, ..ok },
            ConfigError::Weight,
            "1 to 10000",
        ),
        (
            Limits {
                weight: 10_001,
                ..ok
            },
            ConfigError::Weight,
            "1 to 10000",
        ),
    ];
    for (l, err, hint) in cases {
        assert_eq!(l.validate(100), Err(err), "{l:?}");
        assert!(err.to_string().contains(hint), "{err}");
    }
    assert_eq!(ok.validate(50), Err(ConfigError::MaxAboveSize));
    assert_eq!(Limits::unlimited(SIZE).validate(SIZE), Ok(()));
}

#[test]
fn reclaims_only_up_to_high_and_bails_out_while_in_flight() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    let d = m.tick(0, 200, &vms);
    // high 500 - pool 200.
    assert_eq!(raised(&d, &vms).iter().sum::<Pages>(), 300);
    apply(&d, &mut vms);
    // The balloons move a little: what is left in flight still covers it.
    vms[0].actual += 10;
    vms[1].actual += 10;
    let d = m.tick(TICK, 220, &vms);
    assert_eq!(d.targets, [None, None]);
    assert_eq!(m.stats().bailouts, 1);
    assert_eq!(m.stats().pages_reclaimed, 300);
}

#[test]
fn no_reclaim_above_low_unless_already_reclaiming() {
    let mut m = manager();
    let vms = [vm(0, 0)];
    // Between low and high, not reclaiming: nothing.
    assert_eq!(m.tick(0, 400, &vms).targets, [None]);
    // Below low: reclaim to high; then between low and high it goes on.
    let d = m.tick(TICK, 250, &vms);
    assert_eq!(d.targets, [Some(250)]);
    let vms = [vm(250, 250)];
    let d = m.tick(2 * TICK, 400, &vms);
    assert_eq!(d.targets, [Some(350)]);
}

#[test]
fn reclaim_is_inversely_proportional_to_weight() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    vms[1].limits.weight = 200;
    let d = m.tick(0, 0, &vms);
    let r = raised(&d, &vms);
    assert_eq!(r.iter().sum::<Pages>(), 500);
    // Twice the weight, half the reclaim (within rounding).
    assert!(r[0].abs_diff(2 * r[1]) <= 2, "{r:?}");
}

#[test]
fn free_and_caches_are_reclaimed_first() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    // The first reports 800 pages free or cached (300 above its comfort
    // reserve of 5%), the second nothing
    // (but enough available not to be under pressure).
    vms[0].stats = guest(300, 500);
    vms[0].stats.as_mut().unwrap().available = Some(SIZE * PAGE_SIZE);
    vms[1].stats = guest(0, 0);
    vms[1].stats.as_mut().unwrap().available = Some(SIZE * PAGE_SIZE);
    let d = m.tick(0, 200, &vms);
    assert_eq!(raised(&d, &vms), [300, 0]);
}

#[test]
fn low_protects_until_nobody_is_above_low() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    // The first VM may give only 50 pages above its low.
    vms[0].limits = Limits {
        min: 1000,
        low: SIZE - 50,
        max: SIZE,
        weight: 100,
    };
    let d = m.tick(0, 0, &vms);
    let r = raised(&d, &vms);
    assert!(r[0] <= 50, "{r:?}");
    assert_eq!(r.iter().sum::<Pages>(), 500);

    // Both at their low: now below low, never below min.
    let mut m = manager();
    for v in &mut vms {
        v.limits = Limits {
            min: SIZE - 100,
            low: SIZE,
            max: SIZE,
            weight: 100,
        };
    }
    let d = m.tick(0, 0, &vms);
    assert_eq!(raised(&d, &vms), [100, 100]);
    assert_eq!(d.unmet, 300);
}

#[test]
fn no_vm_starves_below_min_under_extreme_pressure() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0), vm(0, 0)];
    for (i, v) in vms.iter_mut().enumerate() {
        v.limits.min = 2000 * (i as Pages + 1);
    }
    for tick in 0..200 {
        let d = m.tick(tick * TICK, 0, &vms);
        apply(&d, &mut vms);
        for v in &mut vms {
            v.actual = v.target;
        }
    }
    for v in &vms {
        assert_eq!(v.target, SIZE - v.limits.min, "{v:?}");
    }
}

#[test]
fn max_raises_the_target() {
    let mut m = manager();
    let mut vms = [vm(0, 0)];
    vms[0].limits.max = SIZE - 700;
    let d = m.tick(0, 10_000, &vms);
    assert_eq!(d.targets, [Some(700)]);
    // And pressure relief never gives beyond max.
    let mut vms = [vm(700, 700)];
    vms[0].limits.max = SIZE - 700;
    vms[0].deflate_on_oom = 100;
    let d = m.tick(TICK, 10_000, &vms);
    assert_eq!(d.targets, [None]);
}

#[test]
fn pressure_relief_comes_before_reclaim() {
    let mut m = manager();
    let mut vms = [vm(3000, 3000), vm(0, 0)];
    vms[0].stats = guest(5000, 0);
    vms[1].stats = guest(5000, 0);
    m.tick(0, 1000, &vms);
    // The first VM reports an OOM kill: it gets memory from the pool (down
    // to min), and only the other one is reclaimed from.
    vms = [vm(3000, 3000), vm(0, 0)];
    vms[0].stats = guest(0, 0);
    vms[0].stats.as_mut().unwrap().oom_kills = Some(1);
    vms[1].stats = guest(5000, 0);
    let d = m.tick(TICK, 250, &vms);
    assert_eq!(d.targets[0], Some(3000 - 150), "pool 250 - min 100");
    let r = raised(&d, &vms);
    // Reclaim follows the pool, not the pending give (the guest may never
    // touch all of it).
    assert_eq!(r[1], 500 - 250);
    assert!(m.vm_stats(0).under_pressure);
    assert_eq!(m.vm_stats(0).pages_given, 150);
}

#[test]
fn deflate_on_oom_is_accepted_not_reinflated() {
    let mut m = manager();
    let mut vms = [vm(3000, 3000)];
    m.tick(0, 10_000, &vms);
    // The guest deflated 256 pages on OOM: the target follows at once.
    vms[0].actual = 2744;
    vms[0].deflate_on_oom = 256;
    let d = m.tick(TICK, 10_000, &vms);
    let t = d.targets[0].unwrap();
    assert!(t <= 2744, "{t}");
}

#[test]
fn congestion_is_marked_skipped_and_cleared() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    let mut now = 0;
    let d = m.tick(now, 0, &vms);
    apply(&d, &mut vms);
    let hung_target = vms[1].target;
    assert!(hung_target > 0);
    // The first balloon moves at once, the second never does.
    vms[0].actual = vms[0].target;
    let mut first_skip = None;
    while now < 3_000_000 {
        now += TICK;
        // The pool gains what the first balloon gave back.
        let d = m.tick(now, vms[0].actual, &vms);
        if first_skip.is_none() && d.targets[0].is_some() {
            first_skip = Some(now);
        }
        apply(&d, &mut vms);
        vms[0].actual = vms[0].target;
    }
    // Its in-flight stopped counting after the progress window, and the
    // other VM took over the need; never waited for the deadline.
    assert_eq!(first_skip, Some(500_000));
    assert_eq!(vms[0].target, 500);
    assert_eq!(m.stats().congested_marks, 1);
    assert!(m.stats().congested_skips > 0);
    // Marked congested at the deadline, its raised target was withdrawn
    // (the congestion clears with nothing outstanding) ...
    assert_eq!(m.vm_stats(1).pages_withdrawn, hung_target);
    assert_eq!(vms[1].target, 0);
    assert!(!m.vm_stats(1).congested);
    // ... and it is not asked again within the backoff, however short the
    // pool.
    let mut t = now;
    // (Withdrawn at the deadline, 2 s in; `now` is 3 s.)
    while t < now + Tunables::default().withdraw_backoff_us - 1_000_000 - TICK {
        t += TICK;
        let d = m.tick(t, 0, &vms);
        assert_eq!(d.targets[1], None, "asked again at {t}");
        apply(&d, &mut vms);
        vms[0].actual = vms[0].target;
    }
}

#[test]
fn no_driver_is_congested_at_once_and_never_picked() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(100, 0)];
    vms[1].driver = false;
    let d = m.tick(0, 0, &vms);
    assert!(m.vm_stats(1).congested);
    assert_eq!(raised(&d, &vms), [500, 0]);
}

#[test]
fn in_flight_is_trimmed_once_above_high() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    let d = m.tick(0, 0, &vms);
    apply(&d, &mut vms);
    // Another VM freed memory: the pool is above high with 500 in flight;
    // all the outstanding inflation beyond high goes.
    vms[0].actual = 100;
    let d = m.tick(TICK, 600, &vms);
    apply(&d, &mut vms);
    assert_eq!(vms[0].target, 100);
    assert_eq!(vms[1].target, 0);
    assert_eq!(m.stats().pages_trimmed, 400);
    // Between low and high while reclaiming: what is in flight and needed
    // to reach high stays.
    let mut m = manager();
    let mut vms = [vm(0, 0)];
    let d = m.tick(0, 0, &vms);
    apply(&d, &mut vms);
    vms[0].actual = 400;
    let d = m.tick(TICK, 400, &vms);
    assert_eq!(d.targets, [None]);
    assert_eq!(m.stats().pages_trimmed, 0);
}

#[test]
fn reclaim_overshooting_a_demand_that_stopped_is_cancelled() {
    // The pool ran dry: 500 pages asked of a VM.
    let mut m = manager();
    let mut vms = [vm(0, 0)];
    let d = m.tick(0, 0, &vms);
    apply(&d, &mut vms);
    assert_eq!(vms[0].target, 500);
    // The demand stopped; 100 inflated so far, and the pool is back at
    // 400 (between low and high): 400 more in flight would take it to
    // 800, 300 beyond high. That is cancelled, once.
    vms[0].actual = 100;
    let d = m.tick(TICK, 400, &vms);
    assert_eq!(d.targets, [Some(200)]);
    assert_eq!(m.stats().pages_trimmed, 300);
    apply(&d, &mut vms);
    // Reclaim has stopped: nothing is asked again above low.
    for tick in 2..20 {
        assert_eq!(m.tick(tick * TICK, 400, &vms).targets, [None]);
    }
    // A VM touching new memory fast keeps the reclaim going meanwhile.
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    let d = m.tick(0, 0, &vms);
    apply(&d, &mut vms);
    vms[0].actual = 100;
    vms[1].actual = 100;
    vms[1].fault_ins = 10_000;
    let d = m.tick(2 * TICK, 400, &vms);
    assert_eq!(m.stats().pages_trimmed, 0, "{d:?}");
}

#[test]
fn decisions_are_deterministic() {
    let run = || {
        let mut m = manager();
        let mut vms = [vm(0, 0), vm(0, 0), vm(0, 0)];
        vms[1].stats = guest(700, 300);
        vms[2].limits.weight = 300;
        let mut out = Vec::new();
        for t in 0..20 {
            let d = m.tick(t * TICK, 50 * t, &vms);
            apply(&d, &mut vms);
            for v in &mut vms {
                v.actual = (v.actual + 37).min(v.target);
            }
            out.push(d);
        }
        (out, m.stats())
    };
    assert_eq!(run(), run());
}

#[test]
fn raising_an_unanswered_target_does_not_restart_the_deadline() {
    let mut m = manager();
    let mut vms = [vm(0, 0)];
    let mut congested_at = None;
    for tick in 0..30 {
        // Someone keeps raising the target; the balloon never moves.
        vms[0].target += 10;
        m.tick(tick * TICK, 10_000, &vms);
        if congested_at.is_none() && m.vm_stats(0).congested {
            congested_at = Some(tick * TICK);
        }
    }
    assert_eq!(congested_at, Some(2_000_000));
}

// ------------------------------------------------- guest numbers (issue 36)

/// Every decision lies in `size - max ..= size - min` (and so within the
/// VM's size).
fn assert_within_limits(d: &Decisions, vms: &[VmInput]) {
    for (t, v) in d.targets.iter().zip(vms) {
        let Some(t) = *t else { continue };
        let floor = v.size.saturating_sub(v.limits.max);
        let ceiling = v.size.saturating_sub(v.limits.min);
        assert!(
            (floor..=ceiling).contains(&t),
            "target {t} outside {floor}..={ceiling} for {v:?}"
        );
    }
}

/// Statistics a hostile guest can send: every value at its largest.
fn hostile_stats() -> Option<GuestStats> {
    Some(GuestStats {
        available: Some(u64::MAX),
        free: Some(u64::MAX),
        caches: Some(u64::MAX),
        major_faults: Some(u64::MAX),
        oom_kills: Some(u64::MAX),
        alloc_stalls: Some(u64::MAX),
    })
}

#[test]
fn free_and_caches_of_2_64_minus_1_do_not_panic() {
    // The bug of issue 36: free + caches overflowed in `observe` and the
    // panic stopped whichever VM's CPU ran the tick.
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    vms[0].stats = hostile_stats();
    vms[1].stats = guest(2000, 1000);
    for tick in 0..5 {
        let d = m.tick(tick * TICK, 0, &vms);
        assert_within_limits(&d, &vms);
        apply(&d, &mut vms);
    }
}

#[test]
fn extreme_fault_ins_actual_and_deflates_do_not_panic() {
    let mut m = manager();
    let mut a = vm(0, 0);
    a.fault_ins = u64::MAX;
    a.stats = Some(GuestStats {
        available: Some(0),
        ..GuestStats::default()
    });
    // The guest writes `actual` (a u32 on the wire, any u64 here).
    let mut b = vm(5000, 0);
    b.actual = u64::MAX;
    b.deflate_on_oom = u64::MAX;
    b.waiting = true;
    let mut c = vm(u64::MAX, 3);
    c.backed = u64::MAX;
    c.stats = hostile_stats();
    let mut vms = [a, b, c];
    for tick in 0..5 {
        // The first tick with dt = 1 us: the largest fault-in rate.
        let d = m.tick(tick * TICK, tick * 100, &vms);
        assert_within_limits(&d, &vms);
        apply(&d, &mut vms);
    }
}

/// A value from `rng` that is often at an edge: 0, 1, around the VM's
/// size, around 2^32 (the wire's u32), around 2^64.
fn extreme(rng: &mut crate::test_rng::XorShift, size: u64) -> u64 {
    match rng.below(8) {
        0 => 0,
        1 => u64::MAX - rng.below(2),
        2 => size.saturating_add(rng.below(3)).saturating_sub(1),
        3 => u64::from(u32::MAX) + rng.below(2),
        4 => 1 << rng.below(64),
        5 => rng.next(),
        _ => rng.below(size.saturating_add(1).max(1)),
    }
}

#[test]
fn random_extreme_inputs_never_panic_and_stay_within_limits() {
    let mut rng = crate::test_rng::XorShift(0x36_36_36_36);
    for round in 0..300 {
        let mut m = Manager::new(WM, Tunables::default());
        m.set_policy(Policy::ALL[round % Policy::ALL.len()]);
        let n = 1 + rng.below(4) as usize;
        let mut now = 0u64;
        let sizes: Vec<Pages> = (0..n)
            .map(|_| match rng.below(4) {
                0 => u64::MAX,
                1 => 1 << 40,
                _ => rng.range(1, 1 << 20),
            })
            .collect();
        let mut vms: Vec<VmInput> = sizes
            .iter()
            .map(|&size| {
                let max = rng.below(size.saturating_add(1).max(1)).max(size / 2);
                let min = rng.below(max / 2 + 1);
                VmInput {
                    size,
                    limits: Limits {
                        min,
                        low: min,
                        max,
                        weight: rng.range(1, u64::from(MAX_WEIGHT)) as u32,
                    },
                    ..VmInput::default()
                }
            })
            .collect();
        for _ in 0..6 {
            for v in vms.iter_mut() {
                let size = v.size;
                v.backed = extreme(&mut rng, size);
                v.actual = extreme(&mut rng, size);
                v.fault_ins = extreme(&mut rng, size);
                v.deflate_on_oom = extreme(&mut rng, size);
                v.driver = rng.below(4) != 0;
                v.waiting = rng.below(4) == 0;
                let mut s = || {
                    let x = extreme(&mut rng, size.saturating_mul(PAGE_SIZE));
                    (!x.is_multiple_of(5)).then_some(x)
                };
                v.stats = Some(GuestStats {
                    available: s(),
                    free: s(),
                    caches: s(),
                    major_faults: s(),
                    oom_kills: s(),
                    alloc_stalls: s(),
                });
            }
            now = now.saturating_add(extreme(&mut rng, TICK));
            let pool = extreme(&mut rng, 1 << 20);
            let d = m.tick(now, pool, &vms);
            assert_eq!(d.targets.len(), vms.len(), "round {round}");
            assert_within_limits(&d, &vms);
            apply(&d, &mut vms);
        }
    }
}

#[test]
fn pressure_thresholds_are_per_second_whatever_the_tick() {
    // 100 major faults each 100 ms (1000/s, above 640/s) seen in ticks of
    // 10 ms: 10 a tick, far below what a per-tick threshold of 64 would
    // need. Half the rate stays below.
    for (per_100ms, pressured) in [(100, true), (50, false)] {
        let mut m = manager();
        let mut v = vm(0, 0);
        v.stats = guest(5000, 0);
        let mut faults = 0;
        let mut seen = false;
        for tick in 0..50 {
            faults += per_100ms / 10;
            v.stats.as_mut().unwrap().major_faults = Some(faults);
            m.tick(tick * 10_000, 10_000, &[v]);
            seen |= m.vm_stats(0).under_pressure;
        }
        assert_eq!(seen, pressured, "{per_100ms} major faults per 100 ms");
    }
}

/// A VM faulting in 512 pages each 100 ms (20 MiB/s: hungry) with
/// `unbacked` pages it never touched.
fn hungry(unbacked: Pages) -> VmInput {
    let mut v = vm(0, 0);
    v.backed = SIZE - unbacked;
    v.fault_ins = 512;
    v
}

#[test]
fn the_fence_takes_what_hungry_guests_could_touch_beyond_the_pool() {
    let mut m = manager();
    // Two hungry VMs with 3000 untouched pages each, a pool of 1100 (1000
    // above min): 5000 cannot be backed. The lighter VM is fenced first,
    // all it could touch; what its kernel will then reclaim or kill (its
    // 500 backed pages) counts, and the heavier one is fenced the rest.
    let mut light = vm(6500, 6500);
    light.backed = 500;
    light.fault_ins = 512;
    light.limits.weight = 50;
    let mut vms = [light, hungry(3000)];
    m.tick(0, 1100, &vms);
    let d = m.tick(TICK, 1100, &vms);
    let r = raised(&d, &vms);
    assert_eq!(r, [3000, 1500], "{d:?}");
    assert_eq!(m.stats().pages_fenced, 4500);
    // With more of it backed, the lighter VM's kernel covers it all.
    let mut m = manager();
    let mut both = [hungry(3000), hungry(3000)];
    both[0].limits.weight = 50;
    m.tick(0, 1100, &both);
    let d = m.tick(TICK, 1100, &both);
    assert_eq!(raised(&d, &both), [3000, 0], "{d:?}");
    // Fenced pages free no frame: nothing is counted in flight for them,
    // and no trim cancels them once the pool is above high.
    apply(&d, &mut vms);
    let d = m.tick(2 * TICK, 10_000, &vms);
    assert_eq!(d.targets, [None, None], "{d:?}");
    // A VM that is not hungry is never fenced, however much it never
    // touched.
    let mut m = manager();
    let idle = {
        let mut v = vm(0, 0);
        v.backed = 1000;
        v
    };
    m.tick(0, 1100, &[idle]);
    assert_eq!(m.tick(TICK, 1100, &[idle]).targets, [None]);
}

#[test]
fn the_fence_looks_further_ahead_by_a_slow_drivers_latency() {
    // A driver began an earlier raise `answer_after` after it was asked,
    // its vCPU first parked for `parked` (time that is not the driver's).
    // Then the VM faults in 280 pages a tick (2800 a second) with 8000 it
    // never touched, and the pool holds 6000 above min: at that rate,
    // more than two horizons (5600) but less than two plus a 1.5 s
    // latency (9800). Only the slow driver's VM is fenced.
    let run = |parked: u64, answer_after: u64| {
        let mut m = manager();
        let mut v = vm(0, 0);
        v.backed = 1000;
        let pool = WM.min + 6000;
        let mut now = 0;
        m.tick(now, pool, &[v]);
        v.target = 1000;
        v.waiting = true;
        for _ in 0..parked / TICK {
            now += TICK;
            m.tick(now, pool, &[v]);
        }
        v.waiting = false;
        for _ in 0..answer_after / TICK {
            now += TICK;
            m.tick(now, pool, &[v]);
        }
        v.actual = 1000;
        v.backed = SIZE - 1000 - 8000;
        v.fault_ins = 280;
        now += TICK;
        m.tick(now, pool, &[v]);
        now += TICK;
        let d = m.tick(now, pool, &[v]);
        raised(&d, &[v])[0]
    };
    assert_eq!(run(0, 0), 0, "fenced without a latency");
    assert_eq!(run(3_000_000, 0), 0, "time parked counted as latency");
    assert!(
        run(0, 1_500_000) > 0,
        "a slow driver's VM not fenced in time"
    );
}

#[test]
fn faulting_back_what_reporting_returned_is_not_hunger() {
    // Two VMs with 3000 untouched pages each fault in 512 pages a tick; the
    // second reported as many meanwhile (a file written and deleted over
    // and over, its pages reported in between): only the first is hungry,
    // and only it is fenced.
    let mut m = manager();
    let mut churner = hungry(3000);
    churner.returned = 512;
    // Nothing to spare beyond what it never touched.
    churner.stats = guest(0, 0);
    let vms = [hungry(3000), churner];
    m.tick(0, 1100, &vms);
    let d = m.tick(TICK, 1100, &vms);
    let r = raised(&d, &vms);
    assert!(r[0] > 0 && r[1] == 0, "{d:?}");
    // Reporting less than it takes, it is hungry for the rest.
    let mut m = manager();
    let mut taker = hungry(3000);
    taker.fault_ins = 4096;
    taker.returned = 512;
    m.tick(0, 1100, &[taker]);
    let d = m.tick(TICK, 1100, &[taker]);
    assert!(d.targets[0].is_some(), "{d:?} {:?}", m.vm_stats(0));
}

#[test]
fn a_guest_taking_back_what_it_reports_is_not_hungry_once_its_window_shows_it() {
    // 512 pages faulted in every 100 ms, reported in a batch a second,
    // from 2 s on (a file written and deleted over and over; Linux reports
    // in batches, 2 s after the pages were freed).
    let mut m = manager();
    let mut v = hungry(3000);
    let mut hungry_at = Vec::new();
    for tick in 0..150u64 {
        v.returned = if tick >= 20 && tick % 10 == 0 {
            5120
        } else {
            0
        };
        m.tick(tick * TICK, 100_000, &[v]);
        if tick % 10 == 9 {
            hungry_at.push(m.vm_stats(0).hungry);
        }
    }
    // Its first window (6 s) counts it hungry; once its hunger hold after
    // the second has passed, it is not.
    let window = (CHURN_WINDOW_US / TICK / 10) as usize;
    let hold = (Tunables::default().hungry_hold_us / TICK / 10) as usize;
    assert!(hungry_at[..window].iter().all(|&h| h), "{hungry_at:?}");
    assert!(
        hungry_at[window + hold + 1..].iter().all(|&h| !h),
        "{hungry_at:?}"
    );
    // Without reporting it stays hungry throughout.
    let mut m = manager();
    let v = hungry(3000);
    for tick in 0..150u64 {
        m.tick(tick * TICK, 100_000, &[v]);
    }
    assert!(m.vm_stats(0).hungry);
}

#[test]
fn memory_is_given_back_after_the_pool_stays_above_high() {
    let mut m = manager();
    // The manager had inflated 2000 pages; the pool is far above high.
    let mut vms = [vm(2000, 2000)];
    vms[0].stats = guest(1000, 0);
    let wait = Tunables::default().give_back_after_us;
    let mut now = 0;
    while now < wait {
        assert_eq!(m.tick(now, 9000, &vms).targets, [None], "at {now}");
        now += TICK;
    }
    // Then step by step (10% of the VM a tick at most), never below what
    // its max requires.
    vms[0].limits.max = SIZE - 500;
    let mut steps = 0;
    loop {
        let d = m.tick(now, 9000, &vms);
        let Some(t) = d.targets[0] else { break };
        assert!(vms[0].target - t <= SIZE / 10);
        vms[0].target = t;
        vms[0].actual = t;
        steps += 1;
        now += TICK;
    }
    assert_eq!(vms[0].target, 500);
    assert_eq!(steps, 2);
    assert_eq!(m.stats().pages_given_back, 1500);
    // Below high again the clock starts over.
    let mut vms = [vm(2000, 2000)];
    let mut m = manager();
    m.tick(0, 9000, &vms);
    m.tick(wait / 2, 400, &vms);
    vms[0].stats = guest(1000, 0);
    assert_eq!(m.tick(wait + TICK, 9000, &vms).targets, [None]);
}

#[test]
fn nothing_is_given_back_that_a_hungry_vm_would_touch_soon() {
    // VM 0's balloon holds 2000 pages the manager inflated; VM 1 touches
    // 500 new pages a tick (5000 a second). The pool, 9000 above nothing,
    // would last under four horizons at that rate: VM 0 gets nothing back.
    let mut m = manager();
    let mut vms = [vm(2000, 2000), vm(0, 0)];
    vms[0].stats = guest(1000, 0);
    vms[1].backed = 0;
    let mut now = 0;
    let mut backed = 0;
    while now < 2 * Tunables::default().give_back_after_us {
        vms[1].fault_ins = 500;
        backed += 500;
        vms[1].backed = backed;
        let d = m.tick(now, 9000, &vms);
        assert_eq!(d.targets[0], None, "given back at {now}: {d:?}");
        now += TICK;
    }
    // Once VM 1 has stopped (and its hunger hold has passed), it is.
    vms[1].fault_ins = 0;
    let stop = now;
    let mut given = false;
    while now < stop + 2 * Tunables::default().give_back_after_us {
        given |= m.tick(now, 9000, &vms).targets[0].is_some();
        now += TICK;
    }
    assert!(given, "never given back");
}

#[test]
fn only_the_vm_giving_back_may_dip_into_the_reserve() {
    let mut m = manager();
    // VM 0 is asked to inflate (reclaim: its free pages), VM 1 is hungry
    // and fenced: only VM 0 may take frames below the floor.
    let mut giver = vm(0, 0);
    giver.stats = guest(3000, 0);
    let vms = [giver, hungry(3000)];
    m.tick(0, 200, &vms);
    let d = m.tick(TICK, 200, &vms);
    assert!(d.targets[0].is_some() && d.targets[1].is_some(), "{d:?}");
    assert!(m.may_dip(0));
    assert!(!m.may_dip(1));
    assert!(!m.may_dip(7), "no such VM");
}

#[test]
fn policies_are_named_for_the_shell() {
    for p in Policy::ALL {
        assert_eq!(Policy::from_name(p.name()), Some(p));
    }
    assert_eq!(Policy::from_name("none"), Some(Policy::NoController));
    assert_eq!(Policy::from_name("Manager"), None);
    assert_eq!(manager().policy(), Policy::Manager);
}

#[test]
fn without_a_controller_no_target_moves_whatever_the_pool() {
    let mut m = manager();
    m.set_policy(Policy::NoController);
    let mut vms = [vm(0, 0), vm(0, 0)];
    vms[0].waiting = true;
    vms[1].limits.max = SIZE / 2;
    for tick in 0..50 {
        let d = m.tick(tick * TICK, 0, &vms);
        assert_eq!(d.targets, [None, None]);
        assert!(d.exhausted);
        assert!(!m.may_dip(0) && !m.may_dip(1));
    }
    assert_eq!(m.stats().ticks, 50);
    assert_eq!(m.stats().targets_set, 0);
}

#[test]
fn the_naive_controller_takes_high_minus_pool_by_weight_then_waits() {
    let mut m = manager();
    m.set_policy(Policy::Naive);
    let mut vms = [vm(0, 0), vm(0, 0)];
    vms[1].limits.weight = 300;
    // Below low: high - pool = 400 pages, a quarter from the first VM and
    // three quarters from the heavier one (naively: weight as a share).
    let d = m.tick(0, 100, &vms);
    assert_eq!(d.targets, [Some(100), Some(300)]);
    assert_eq!(m.stats().pages_reclaimed, 400);
    apply(&d, &mut vms);
    // Nothing counted in flight: it waits for the balloons, up to 2 s,
    // whatever the pool does meanwhile.
    for tick in 1..20 {
        assert_eq!(m.tick(tick * TICK, 0, &vms).targets, [None, None]);
    }
    // Past the wait it asks again, for all of high - pool once more.
    let d = m.tick(20 * TICK, 0, &vms);
    assert_eq!(d.targets, [Some(100 + 125), Some(300 + 375)]);
    // Its limits hold: never below min.
    vms[0].limits.min = SIZE - 150;
    apply(&d, &mut vms);
    for v in &mut vms {
        v.actual = v.target;
    }
    let d = m.tick(21 * TICK, 0, &vms);
    assert_eq!(d.targets[0], Some(150));
}

#[test]
fn the_naive_controller_gives_a_starving_guest_5_percent() {
    let mut m = manager();
    m.set_policy(Policy::Naive);
    let mut vms = [vm(2_000, 2_000)];
    // 100 pages available of the 8,000 it has: under 5%.
    vms[0].stats = guest(50, 50);
    let d = m.tick(0, 10_000, &vms);
    assert_eq!(d.targets, [Some(2_000 - SIZE / 20)]);
    assert_eq!(m.stats().pages_given, SIZE / 20);
}

#[test]
fn an_escalation_cancels_inflation_and_ends_backoffs() {
    let mut m = manager();
    let mut vms = [vm(0, 0), vm(0, 0)];
    let mut now = 0;
    let d = m.tick(now, 0, &vms);
    apply(&d, &mut vms);
    assert!(vms[0].target > 0 && vms[1].target > 0);
    // Both vCPUs wait for frames, so neither balloon moves: past the
    // deadline both raised targets are withdrawn, and neither VM is asked
    // again within the backoff.
    for v in &mut vms {
        v.waiting = true;
    }
    while now < Tunables::default().congestion_deadline_us + TICK {
        now += TICK;
        let d = m.tick(now, 0, &vms);
        apply(&d, &mut vms);
    }
    assert!(m.vm_stats(0).pages_withdrawn > 0 && m.vm_stats(1).pages_withdrawn > 0);
    now += TICK;
    let d = m.tick(now, 0, &vms);
    assert_eq!(d.targets, [None, None], "asked again within the backoff");
    // A third VM is stopped by the board's escalation: the parked VMs'
    // drivers were never stuck, and they may be asked at once. Inflation
    // still outstanding from the shortage is cancelled first.
    for v in &mut vms {
        v.waiting = false;
    }
    vms[1].target = vms[1].actual + 50;
    m.escalated();
    now += TICK;
    let d = m.tick(now, 0, &vms);
    assert_eq!(
        d.targets[1],
        Some(vms[1].actual),
        "outstanding inflation kept"
    );
    assert!(
        d.targets[0].is_some_and(|t| t > vms[0].actual),
        "not asked again after the escalation: {d:?}"
    );
}
