//! A deterministic simulation of the manager (issue 12, item 4): virtual
//! time in 100 ms ticks, a pool, simulated guests with scripted demand and a
//! balloon driver moving 64 MiB/s, backing on first touch (a stage-2
//! fault-in takes a pool page), and deflate-on-OOM. The claims of the Linux
//! work the manager borrows from are asserted as ratios against the naive
//! controller ([`Policy::Naive`]: proportional reclaim from every VM by weight
//! whenever the pool is below low, no in-flight accounting, and a step that
//! blocks until every VM reached its previous target, up to a timeout).
//! `cargo test -- --nocapture` prints the figures; with `SIM_TRACE=1` set,
//! each run also prints the pool and every guest twice a simulated second
//! (backed, anonymous, cache and never-touched MiB, balloon actual/target,
//! W waiting for a frame, S stopped, K its hog killed).

use super::*;

const TICK_US: u64 = 100_000;
/// 1 MiB in pages.
const MIB: Pages = 256;
/// A guest balloon driver's speed: 64 MiB/s.
const BALLOON_PER_TICK: Pages = 64 * MIB / 10;
/// What Linux deflates per OOM notification (`VIRTIO_BALLOON_OOM_NR_PAGES`).
const OOM_DEFLATE: Pages = 256;

#[derive(Clone, Copy, Debug)]
enum Demand {
    /// Nothing changes.
    Idle,
    /// Reads files: fills free memory with page cache, `rate` pages a tick.
    Streaming { rate: Pages },
    /// Anonymous memory grows to `goal` pages from `start_us`, `rate` a tick.
    Hog {
        start_us: u64,
        goal: Pages,
        rate: Pages,
    },
}

/// A simulated guest. Its pages: `actual` in the balloon, `anon`, `cache`,
/// `free_backed` (free, still backed by a pool frame) and the rest free and
/// not backed.
#[derive(Clone, Debug)]
struct Guest {
    size: Pages,
    limits: Limits,
    target: Pages,
    actual: Pages,
    anon: Pages,
    cache: Pages,
    free_backed: Pages,
    demand: Demand,
    /// Balloon pages moved per tick; 0: the balloon never answers.
    driver_rate: Pages,
    /// How long an idle driver takes to act on a new target (its work
    /// item waits for the guest's CPU; a busy one picks a new target up
    /// at once), the target it acts on, and since when a newer one waits.
    driver_lag_us: u64,
    driven: Pages,
    pending_since: Option<u64>,
    deflate_on_oom: bool,
    oom_kills: u64,
    alloc_stalls: u64,
    fault_ins: Pages,
    /// Pages reported since the last input.
    returned: Pages,
    oom_deflated: Pages,
    // Totals over the run.
    inflated: Pages,
    deflated_on_oom: Pages,
    /// The balloon has deflated (on OOM or to a lower target).
    has_deflated: bool,
    /// Pages inflated after the balloon had deflated: churn.
    reinflated: Pages,
    done_us: Option<u64>,
    /// Anonymous memory before the hog (what an OOM kill leaves).
    base_anon: Pages,
    /// The hog frees its memory this long after it has it all.
    release_after_us: Option<u64>,
    /// Its own kernel killed the hog.
    killed: bool,
    /// A vCPU waits for a frame (stage 2, the pool at its floor) since.
    waiting_since: Option<u64>,
    longest_wait_us: u64,
    /// Stopped by the board's escalation (`stop-lowest`).
    stopped: bool,
    /// Free page reporting: its free backed pages go back to the pool
    /// each tick.
    reporting: bool,
    /// Pages returned by reporting.
    reported: Pages,
}

impl Guest {
    fn new(size: Pages, demand: Demand) -> Self {
        Self {
            size,
            limits: Limits::unlimited(size),
            target: 0,
            actual: 0,
            anon: 0,
            cache: 0,
            free_backed: 0,
            demand,
            driver_rate: BALLOON_PER_TICK,
            driver_lag_us: 0,
            driven: 0,
            pending_since: None,
            deflate_on_oom: true,
            oom_kills: 0,
            alloc_stalls: 0,
            fault_ins: 0,
            returned: 0,
            oom_deflated: 0,
            inflated: 0,
            deflated_on_oom: 0,
            has_deflated: false,
            reinflated: 0,
            done_us: None,
            base_anon: 0,
            release_after_us: None,
            killed: false,
            waiting_since: None,
            longest_wait_us: 0,
            stopped: false,
            reporting: false,
            reported: 0,
        }
    }

    /// Starts with this balloon and anonymous memory, every other page
    /// backed: as cache if `cached`, else free.
    fn with(mut self, balloon: Pages, anon: Pages, cached: bool) -> Self {
        self.target = balloon;
        self.actual = balloon;
        self.driven = balloon;
        self.anon = anon;
        self.base_anon = anon;
        let rest = self.size - balloon - anon;
        if cached {
            self.cache = rest;
        } else {
            self.free_backed = rest;
        }
        self
    }

    fn free_unbacked(&self) -> Pages {
        self.size - self.actual - self.anon - self.cache - self.free_backed
    }

    fn backed(&self) -> Pages {
        self.anon + self.cache + self.free_backed
    }

    /// Takes up to `n` free pages for the guest's own use, backing them on
    /// first touch from the pool down to `floor`; evicts cache if `evict`.
    /// Returns the pages taken and whether the vCPU now waits (it touched a
    /// page no frame backs and the pool is at its floor).
    fn alloc(&mut self, n: Pages, pool: &mut Pages, evict: bool, floor: Pages) -> (Pages, bool) {
        let unbacked = self.free_unbacked();
        let a = n.min(self.free_backed);
        self.free_backed -= a;
        let wanted = (n - a).min(unbacked);
        let b = wanted.min(pool.saturating_sub(floor));
        *pool -= b;
        self.fault_ins += b;
        if b < wanted {
            return (a + b, true);
        }
        let c = if evict {
            let c = (n - a - b).min(self.cache);
            self.cache -= c;
            c
        } else {
            0
        };
        (a + b + c, false)
    }

    /// The balloon driver's move toward the target it knows of.
    fn drive(&mut self, now: u64, pool: &mut Pages) {
        if self.target != self.driven {
            if self.driven != self.actual {
                self.driven = self.target;
            } else {
                let since = *self.pending_since.get_or_insert(now);
                if now - since >= self.driver_lag_us {
                    self.driven = self.target;
                    self.pending_since = None;
                }
            }
        }
        if self.driven > self.actual {
            let mut n = (self.driven - self.actual).min(self.driver_rate);
            // Free pages first (backed ones return a frame), then cache;
            // never anonymous memory.
            let unbacked = self.free_unbacked();
            let a = n.min(self.free_backed);
            self.free_backed -= a;
            n -= a;
            let b = n.min(unbacked);
            n -= b;
            let c = n.min(self.cache);
            self.cache -= c;
            *pool += a + c;
            let moved = a + b + c;
            self.actual += moved;
            self.inflated += moved;
            if self.has_deflated {
                self.reinflated += moved;
            }
        } else {
            let n = (self.actual - self.driven).min(self.driver_rate);
            self.actual -= n;
            self.has_deflated |= n > 0;
        }
    }

    /// One tick of the guest on a board whose guest frames stop at `floor`
    /// (half of it if it may dip, as the frame table allows).
    fn run(&mut self, now: u64, pool: &mut Pages, floor: Pages, dip: bool) {
        if self.stopped {
            return;
        }
        let floor = match dip {
            true => floor / 2,
            false => floor,
        };
        // A vCPU parked at stage 2 runs nothing, its balloon driver
        // included, until a frame comes.
        let parked = self.waiting_since.is_some() && *pool <= floor;
        if !parked {
            self.drive(now, pool);
        }
        let mut blocked = parked;
        match self.demand {
            Demand::Idle => {}
            _ if parked => {}
            Demand::Streaming { rate } => {
                let (got, b) = self.alloc(rate, pool, false, floor);
                self.cache += got;
                blocked = b;
            }
            Demand::Hog {
                start_us,
                goal,
                rate,
            } => {
                if now >= start_us && self.anon < goal {
                    let want = rate.min(goal - self.anon);
                    let (got, b) = self.alloc(want, pool, true, floor);
                    self.anon += got;
                    blocked = b;
                    if got < want && !b {
                        self.alloc_stalls += 1;
                        if self.free_unbacked() == 0 && self.free_backed == 0 {
                            // Out of memory in the guest.
                            if self.deflate_on_oom && self.actual > 0 {
                                let k = OOM_DEFLATE.min(self.actual);
                                self.actual -= k;
                                self.oom_deflated += k;
                                self.deflated_on_oom += k;
                                self.has_deflated = true;
                            } else {
                                self.oom_kills += 1;
                                if self.release_after_us.is_some() {
                                    // The hog is killed: its memory is free.
                                    self.free_backed += self.anon - self.base_anon;
                                    self.anon = self.base_anon;
                                    self.killed = true;
                                    self.demand = Demand::Idle;
                                }
                            }
                        }
                    }
                }
                if self.anon >= goal && self.done_us.is_none() {
                    self.done_us = Some(now);
                }
                if let (Some(done), Some(after)) = (self.done_us, self.release_after_us) {
                    if now >= done + after {
                        self.free_backed += self.anon - self.base_anon;
                        self.anon = self.base_anon;
                        self.demand = Demand::Idle;
                    }
                }
            }
        }
        if self.reporting && !parked {
            *pool += self.free_backed;
            self.reported += self.free_backed;
            self.returned += self.free_backed;
            self.free_backed = 0;
        }
        match (blocked, self.waiting_since) {
            (true, None) => self.waiting_since = Some(now),
            (true, Some(_)) => {}
            (false, Some(since)) => {
                self.longest_wait_us = self.longest_wait_us.max(now - since);
                self.waiting_since = None;
            }
            (false, None) => {}
        }
    }

    /// The longest wait for a frame so far, the current one included.
    fn longest_wait(&self, now: u64) -> u64 {
        self.waiting_since
            .map_or(self.longest_wait_us, |s| self.longest_wait_us.max(now - s))
    }

    /// What the VM loop would pass the manager; counters since the last
    /// input are reset.
    fn input(&mut self) -> VmInput {
        if self.stopped {
            return VmInput::default();
        }
        let free = self.free_backed + self.free_unbacked();
        let input = VmInput {
            size: self.size,
            backed: self.backed(),
            target: self.target,
            actual: self.actual,
            limits: self.limits,
            stats: Some(GuestStats {
                available: Some((free + self.cache) * PAGE_SIZE),
                free: Some(free * PAGE_SIZE),
                caches: Some(self.cache * PAGE_SIZE),
                major_faults: Some(0),
                oom_kills: Some(self.oom_kills),
                alloc_stalls: Some(self.alloc_stalls),
            }),
            fault_ins: self.fault_ins,
            returned: self.returned,
            deflate_on_oom: self.oom_deflated,
            driver: true,
            waiting: self.waiting_since.is_some(),
        };
        self.fault_ins = 0;
        self.returned = 0;
        self.oom_deflated = 0;
        input
    }
}

/// A controller under test.
trait Controller {
    fn tick(&mut self, now: u64, pool: Pages, vms: &[VmInput]) -> Vec<Option<Pages>>;

    /// Whether VM `i` may take frames below the floor, down to half of it.
    fn may_dip(&self, _i: usize) -> bool {
        false
    }

    /// The board's escalation stopped a VM.
    fn escalated(&mut self) {}
}

impl Controller for Manager {
    fn tick(&mut self, now: u64, pool: Pages, vms: &[VmInput]) -> Vec<Option<Pages>> {
        Manager::tick(self, now, pool, vms).targets
    }

    fn may_dip(&self, i: usize) -> bool {
        Manager::may_dip(self, i)
    }

    fn escalated(&mut self) {
        Manager::escalated(self)
    }
}

/// One run's outcome.
#[derive(Debug)]
struct Outcome {
    guests: Vec<Guest>,
    pool_start: Pages,
    pool_end: Pages,
    /// Lowest pool seen.
    pool_low: Pages,
}

impl Outcome {
    fn inflated(&self) -> Pages {
        self.guests.iter().map(|g| g.inflated).sum()
    }
}

/// Runs `guests` for `seconds` of virtual time with `pool` free pages and
/// no floor (the host took memory below it).
fn simulate(ctl: &mut dyn Controller, guests: Vec<Guest>, pool: Pages, seconds: u64) -> Outcome {
    simulate_board(ctl, guests, pool, seconds, Board::default())
}

/// What the board does beside the controller.
#[derive(Clone, Copy, Debug, Default)]
struct Board {
    /// Guest frames stop here (the `min` watermark; half of it for a VM
    /// whose balloon owes inflation).
    floor: Pages,
    /// `when_exhausted = "stop-lowest"`: a vCPU that waited this long for
    /// a frame stops the running VM with the lowest weight (the furthest
    /// above its `low` among equals, `vm::manage::lowest_weight`).
    stop_lowest_after_us: Option<u64>,
}

/// Runs `guests` for `seconds` of virtual time on `board`.
fn simulate_board(
    ctl: &mut dyn Controller,
    mut guests: Vec<Guest>,
    mut pool: Pages,
    seconds: u64,
    board: Board,
) -> Outcome {
    let pool_start = pool;
    let mut pool_low = pool;
    for tick in 0..seconds * 1_000_000 / TICK_US {
        let now = tick * TICK_US;
        for (i, g) in guests.iter_mut().enumerate() {
            g.run(now, &mut pool, board.floor, ctl.may_dip(i));
        }
        if let Some(bound) = board.stop_lowest_after_us {
            let waited = guests
                .iter()
                .any(|g| g.waiting_since.is_some_and(|s| now - s >= bound));
            let victim = guests
                .iter()
                .enumerate()
                .filter(|(_, g)| !g.stopped)
                .min_by_key(|(_, g)| {
                    let above_low = g.backed().saturating_sub(g.limits.low);
                    (g.limits.weight, core::cmp::Reverse(above_low))
                })
                .map(|(i, _)| i);
            if let (true, Some(i)) = (waited, victim) {
                let g = &mut guests[i];
                pool += g.backed();
                g.stopped = true;
                g.longest_wait_us = g.longest_wait(now);
                g.waiting_since = None;
                ctl.escalated();
            }
        }
        pool_low = pool_low.min(pool);
        if std::env::var_os("SIM_TRACE").is_some() && tick % 5 == 0 {
            let mut line = format!("{:5.1} s pool {:4}:", now as f64 / 1e6, pool / MIB);
            for g in &guests {
                line += &format!(
                    " [b{} a{} c{} u{} bal {}/{}{}{}{}]",
                    g.backed() / MIB,
                    g.anon / MIB,
                    g.cache / MIB,
                    g.free_unbacked() / MIB,
                    g.actual / MIB,
                    g.target / MIB,
                    if g.waiting_since.is_some() { " W" } else { "" },
                    if g.stopped { " S" } else { "" },
                    if g.killed { " K" } else { "" },
                );
            }
            println!("{line}");
        }
        let inputs: Vec<VmInput> = guests.iter_mut().map(Guest::input).collect();
        for (g, t) in guests.iter_mut().zip(ctl.tick(now, pool, &inputs)) {
            if let Some(t) = t {
                g.target = t;
            }
        }
    }
    Outcome {
        guests,
        pool_start,
        pool_end: pool,
        pool_low,
    }
}

fn manager(wm: Watermarks) -> Manager {
    Manager::new(wm, Tunables::default())
}

/// The naive controller ([`Policy::Naive`]), waiting up to 2 s for its
/// targets to be reached.
fn naive(wm: Watermarks) -> Manager {
    let mut m = Manager::new(wm, Tunables::default());
    m.set_policy(Policy::Naive);
    m
}

/// The naive controller acting every tick, which shows the cost of not
/// counting what is in flight.
fn naive_no_wait(wm: Watermarks) -> Manager {
    let tunables = Tunables {
        naive_wait_us: 0,
        ..Tunables::default()
    };
    let mut m = Manager::new(wm, tunables);
    m.set_policy(Policy::Naive);
    m
}

const SIZE: Pages = 256 * MIB;

/// Two hogs with half their memory ballooned, an idle VM and a streaming
/// one; the pool about 16 MiB above high. Returns them, the pool, the
/// watermarks and the pages that must come from other VMs.
fn two_hogs() -> (Vec<Guest>, Pages, Watermarks, Pages) {
    let hog = |start| {
        Guest::new(
            SIZE,
            Demand::Hog {
                start_us: start,
                goal: 200 * MIB,
                rate: 4 * MIB,
            },
        )
        .with(128 * MIB, 96 * MIB, false)
    };
    let guests = vec![
        hog(1_000_000),
        hog(1_000_000),
        Guest::new(SIZE, Demand::Idle).with(0, 32 * MIB, false),
        Guest::new(SIZE, Demand::Streaming { rate: 2 * MIB }).with(0, 32 * MIB, true),
    ];
    let backed: Pages = guests.iter().map(Guest::backed).sum();
    let wm = Watermarks::for_ram(backed + backed / 10);
    let pool = wm.high + 16 * MIB;
    let wm = Watermarks::for_ram(backed + pool);
    // What must come from other VMs for the pool to end at high: the hogs'
    // growth beyond their backed free pages, less the pool above high.
    let growth: Pages = guests
        .iter()
        .map(|g| match g.demand {
            Demand::Hog { goal, .. } => goal - g.anon - g.free_backed,
            _ => 0,
        })
        .sum();
    (guests, pool, wm, growth - (pool - wm.high))
}

#[test]
fn concurrent_demand_reclaims_close_to_what_is_needed() {
    let (guests, pool, wm, needed) = two_hogs();
    let m = simulate(&mut manager(wm), guests.clone(), pool, 20);
    let n = simulate(&mut naive(wm), guests.clone(), pool, 20);
    let nw = simulate(&mut naive_no_wait(wm), guests, pool, 20);
    let ratio = |o: &Outcome| o.inflated() as f64 / needed as f64;
    println!(
        "two hogs at once: needed {needed} pages; manager reclaimed {} ({:.2}x), \
         naive {} ({:.2}x), naive without waits {} ({:.2}x); \
         pool start {} end {} / {} (high {}), lowest {} / {}",
        m.inflated(),
        ratio(&m),
        n.inflated(),
        ratio(&n),
        nw.inflated(),
        ratio(&nw),
        m.pool_start,
        m.pool_end,
        n.pool_end,
        wm.high,
        m.pool_low,
        n.pool_low,
    );
    for o in [&m, &n] {
        for g in &o.guests {
            println!(
                "  done {:?} inflated {} oom-deflated {} oom kills {} stalls {}",
                g.done_us, g.inflated, g.deflated_on_oom, g.oom_kills, g.alloc_stalls
            );
        }
    }
    // Both hogs got their memory under the manager no more than 1 s later
    // than their own pace allows (104 MiB at 4 MiB a tick from 1 s).
    for g in &m.guests[..2] {
        let done = g.done_us.expect("hog done");
        assert!(done <= 1_000_000 + 26 * TICK_US + 1_000_000, "{done}");
    }
    assert!(m.inflated() * 10 <= needed * 11, "manager over-reclaims");
    assert!(m.pool_end >= wm.low, "{} below low", m.pool_end);
    // The naive controller breaks the bound: the assertion can fail.
    assert!(n.inflated() * 10 > needed * 11, "naive within the bound");
}

/// A hog that needs its ballooned memory back from 1 s, faster (60 MiB/s)
/// than the pool alone can cover, an idle donor, and optionally a VM whose
/// balloon never answers (it reports plenty free, so it looks like the best
/// donor). The pool starts at high. Returns when the hog was done.
fn victim_run(ctl: &mut dyn Controller, congested: bool) -> Option<u64> {
    let mut guests = vec![
        Guest::new(
            SIZE,
            Demand::Hog {
                start_us: 1_000_000,
                goal: 240 * MIB,
                rate: 6 * MIB,
            },
        )
        .with(128 * MIB, 96 * MIB, false),
        Guest::new(SIZE, Demand::Idle).with(0, 32 * MIB, false),
    ];
    if congested {
        let mut hung = Guest::new(SIZE, Demand::Idle).with(0, 16 * MIB, false);
        hung.driver_rate = 0;
        guests.push(hung);
    }
    let wm = Watermarks::for_ram(4 * SIZE);
    let out = simulate(ctl, guests, wm.high, 60);
    out.guests[0].done_us
}

#[test]
fn a_congested_vm_does_not_delay_a_victim() {
    let wm = Watermarks::for_ram(4 * SIZE);
    let mut with = manager(wm);
    let m_alone = victim_run(&mut manager(wm), false);
    let m_with = victim_run(&mut with, true);
    let n_alone = victim_run(&mut naive(wm), false);
    let n_with = victim_run(&mut naive(wm), true);
    let ms = |t: Option<u64>| t.map_or("never (60 s)".into(), |t| format!("{} ms", t / 1000));
    println!(
        "victim beside a congested VM: manager done at {} alone, {} with; \
         naive {} alone, {} with; congested marks {}",
        ms(m_alone),
        ms(m_with),
        ms(n_alone),
        ms(n_with),
        with.stats().congested_marks,
    );
    assert!(with.vm_stats(2).congested_marks > 0);
    assert!(with.vm_stats(2).pages_withdrawn > 0, "its target withdrawn");
    assert!(with.stats().congested_skips > 0);
    let (m_alone, m_with) = (m_alone.unwrap(), m_with.unwrap());
    let n_alone = n_alone.expect("naive, alone");
    let n_with = n_with.unwrap_or(u64::MAX);
    // The same manager counting the hung VM's inflation as in flight until
    // the congestion deadline: the scenario is sensitive to it.
    let late = Tunables {
        progress_window_us: Tunables::default().congestion_deadline_us,
        ..Tunables::default()
    };
    let late_alone = victim_run(&mut Manager::new(wm, late), false).unwrap();
    let late_with = victim_run(&mut Manager::new(wm, late), true).unwrap();
    println!(
        "  with / alone: manager {:.2}, naive {:.2}, manager counting it until the deadline {:.2}",
        m_with as f64 / m_alone as f64,
        n_with as f64 / n_alone as f64,
        late_with as f64 / late_alone as f64,
    );
    assert!(
        m_with * 10 <= m_alone * 11,
        "manager delayed by the hung VM"
    );
    // The naive controller waits on it: the bound fails for it.
    assert!(n_with / 11 > n_alone / 10, "naive not delayed");
    assert!(
        late_with / 11 > late_alone / 10,
        "the scenario does not test it"
    );
}

/// A VM reading files (all its free memory is cache) whose own anonymous
/// memory grows while the host needs memory back, with deflate-on-OOM,
/// beside a small idle donor; the pool starts below min (the host took
/// memory).
fn cache_pressure_run(ctl: &mut dyn Controller, wm: Watermarks) -> Outcome {
    let streaming = Guest::new(
        SIZE,
        Demand::Hog {
            start_us: 500_000,
            goal: 200 * MIB,
            rate: 2 * MIB,
        },
    )
    .with(0, 96 * MIB, true);
    let donor = Guest::new(64 * MIB, Demand::Idle).with(0, 16 * MIB, false);
    simulate(ctl, vec![streaming, donor], wm.min / 2, 30)
}

#[test]
fn inflation_under_cache_pressure_does_not_churn() {
    // The host needs 160 MiB back: more than the cache the VM can spare
    // once its anonymous memory has grown.
    let wm = Watermarks {
        min: 8 * MIB,
        low: 96 * MIB,
        high: 160 * MIB,
    };
    let m = cache_pressure_run(&mut manager(wm), wm);
    let n = cache_pressure_run(&mut naive(wm), wm);
    for (name, o) in [("manager", &m), ("naive", &n)] {
        let g = &o.guests[0];
        println!(
            "cache pressure, {name}: balloon {} / target {}, inflated {}, \
             deflated on OOM {}, re-inflated after a deflation {} (donor {}), \
             anon done {:?}, pool {} -> {} (high {})",
            g.actual,
            g.target,
            g.inflated,
            g.deflated_on_oom,
            g.reinflated,
            o.guests[1].reinflated,
            g.done_us,
            o.pool_start,
            o.pool_end,
            wm.high
        );
    }
    let g = &m.guests[0];
    // It reaches its target and stays there, and never takes back what
    // the guest deflated on OOM.
    assert_eq!(g.actual, g.target);
    assert_eq!(g.reinflated, 0);
    assert_eq!(g.deflated_on_oom, 0);
    assert_eq!(m.guests[1].reinflated, 0);
    assert!(g.done_us.is_some());
    // The naive controller churns: it re-inflates what the guest gave
    // back on OOM.
    assert!(n.guests[0].reinflated > 4 * OOM_DEFLATE);
}

/// Three guests of [`SIZE`] with 32 MiB of anonymous memory, 96 MiB of
/// page cache and the rest free and never touched, whose hogs all start at
/// 1 s and each want 200 MiB more, at 8 MiB a tick: 600 MiB asked of a
/// board with `pool` free and 288 MiB of caches. The hogs free their
/// memory 5 s after they have it all; `weights` per guest.
fn everyone_hungry(
    pool_mib: Pages,
    deflate_on_oom: bool,
    weights: [u32; 3],
) -> (Vec<Guest>, Pages, Watermarks) {
    let guests: Vec<Guest> = weights
        .iter()
        .map(|&weight| {
            let mut g = Guest::new(
                SIZE,
                Demand::Hog {
                    start_us: 1_000_000,
                    goal: 232 * MIB,
                    rate: 8 * MIB,
                },
            );
            g.anon = 32 * MIB;
            g.base_anon = 32 * MIB;
            g.cache = 96 * MIB;
            g.deflate_on_oom = deflate_on_oom;
            g.release_after_us = Some(5_000_000);
            g.limits.weight = weight;
            g.limits.min = 64 * MIB;
            g.limits.low = 64 * MIB;
            g
        })
        .collect();
    let backed: Pages = guests.iter().map(Guest::backed).sum();
    let wm = Watermarks::for_ram(backed + pool_mib * MIB);
    (guests, pool_mib * MIB, wm)
}

/// The board as Tidal runs it: guest frames stop at `min` (half of it for
/// a VM giving back), and a vCPU that waited the bound stops the
/// lowest-weight VM.
fn tidal_board(wm: Watermarks) -> Board {
    Board {
        floor: wm.min,
        stop_lowest_after_us: Some(WAIT_BOUND_US),
    }
}

const WAIT_BOUND_US: u64 = crate::vm::manage::WAIT_BOUND_US;

fn report(name: &str, o: &Outcome, end_us: u64) {
    for (i, g) in o.guests.iter().enumerate() {
        println!(
            "  {name} guest {i}: done {:?} killed {} stopped {} longest wait {} ms, \
             balloon {} MiB (target {}), inflated {} MiB, oom-deflated {} MiB",
            g.done_us.map(|t| t / 1000),
            g.killed,
            g.stopped,
            g.longest_wait(end_us) / 1000,
            g.actual / MIB,
            g.target / MIB,
            g.inflated / MIB,
            g.deflated_on_oom / MIB
        );
    }
}

#[test]
fn everyone_hungry_at_once_within_what_caches_cover() {
    // 360 MiB free and 288 MiB of caches for 600 MiB of demand, 384 MiB
    // of it on pages never touched.
    let (guests, pool, wm) = everyone_hungry(360, true, [100; 3]);
    let seconds = 30;
    let m = simulate_board(
        &mut manager(wm),
        guests.clone(),
        pool,
        seconds,
        tidal_board(wm),
    );
    let n = simulate_board(&mut naive(wm), guests, pool, seconds, tidal_board(wm));
    println!("everyone hungry, caches cover the demand:");
    report("manager", &m, seconds * 1_000_000);
    report("naive", &n, seconds * 1_000_000);
    for g in &m.guests {
        assert!(g.done_us.is_some(), "a hog did not complete: {g:?}");
        assert!(!g.stopped && !g.killed && g.oom_kills == 0, "{g:?}");
        assert!(g.longest_wait(seconds * 1_000_000) < 1_000_000, "{g:?}");
        assert!(g.inflated > 0, "no cache reclaimed from it");
    }
}

#[test]
fn everyone_hungry_beyond_ram_the_lowest_weight_gives_way() {
    // 160 MiB free and 288 MiB of caches for 600 MiB of demand; the third
    // guest has the lowest weight. It gives way: its own kernel kills its
    // hog, or (a guest that deflates on OOM instead, or one its kernel
    // cannot run for) the board's escalation stops it once a vCPU has
    // waited the bound. The two heavier guests complete, and no wait
    // outlasts the bound by more than a tick.
    let end = 40 * 1_000_000;
    for deflate_on_oom in [false, true] {
        let (guests, pool, wm) = everyone_hungry(160, deflate_on_oom, [200, 200, 50]);
        let m = simulate_board(&mut manager(wm), guests, pool, 40, tidal_board(wm));
        println!("everyone hungry beyond RAM, deflate-on-OOM {deflate_on_oom}:");
        report("manager", &m, end);
        for g in &m.guests {
            assert!(g.longest_wait(end) <= WAIT_BOUND_US + TICK_US, "{g:?}");
        }
        for g in &m.guests[..2] {
            assert!(g.done_us.is_some() && !g.killed && !g.stopped, "{g:?}");
        }
        let victim = &m.guests[2];
        assert!(victim.killed || victim.stopped, "{victim:?}");
    }
}

/// `guests/tests/overcommit-full.toml` at a quarter of its size: three
/// guests of 256 MiB with 18 MiB of their own and 56 MiB of page cache,
/// each starting a hog of 175 MiB at once at 22 MiB/s, on a board with
/// 479 MiB for guests. Beyond RAM: one must give way, and after it has,
/// the two others fit only once their balloons took some of their caches.
/// On a slow board (`slow` > 1) every balloon driver moves `slow` times
/// slower and acts on a new target only `(slow - 1) / 2` s after it was
/// set (its work item waits for the guest's CPU), while the hogs, once
/// given frames, run as fast as before; the manager's clocks (progress
/// window, congestion deadline, backoffs) run in real time.
fn everyone_hungry_full(slow: u64, deflate_on_oom: bool) -> (Vec<Guest>, Pages, Watermarks) {
    let guests: Vec<Guest> = (0..3)
        .map(|_| {
            let mut g = Guest::new(
                SIZE,
                Demand::Hog {
                    start_us: 1_000_000,
                    goal: (18 + 175) * MIB,
                    rate: 22 * MIB / 10,
                },
            );
            g.anon = 18 * MIB;
            g.base_anon = 18 * MIB;
            g.cache = 56 * MIB;
            g.deflate_on_oom = deflate_on_oom;
            g.driver_rate /= slow;
            g.driver_lag_us = (slow - 1) * 500_000;
            g.limits.min = 16 * MIB;
            // Held to the end of the run: its own kernel's OOM kill frees it.
            g.release_after_us = Some(1_000_000_000);
            g
        })
        .collect();
    let backed: Pages = guests.iter().map(Guest::backed).sum();
    let ram = 479 * MIB;
    (guests, ram - backed, Watermarks::for_ram(ram))
}

#[test]
fn everyone_hungry_beyond_ram_on_a_slow_board_one_gives_way() {
    // A driver that moves slowly is not a stuck one: one VM gives way,
    // once, and the two others complete, their caches taken by their
    // balloons, whose targets the manager keeps asking for.
    for slow in [1, 4, 8] {
        for deflate_on_oom in [false, true] {
            let (guests, pool, wm) = everyone_hungry_full(slow, deflate_on_oom);
            let seconds = 60;
            let end = seconds * 1_000_000;
            let mut mgr = manager(wm);
            let m = simulate_board(&mut mgr, guests, pool, seconds, tidal_board(wm));
            println!(
                "slow board x{slow}, deflate-on-OOM {deflate_on_oom}: {:?}",
                mgr.stats()
            );
            report("manager", &m, end);
            let gave_way = m.guests.iter().filter(|g| g.stopped || g.killed).count();
            assert_eq!(gave_way, 1, "slow x{slow}, deflate-on-OOM {deflate_on_oom}");
            for g in m.guests.iter().filter(|g| !g.stopped && !g.killed) {
                assert!(g.done_us.is_some(), "slow x{slow}: {g:?}");
            }
        }
    }
}

#[test]
fn memory_is_given_back_once_the_pressure_is_gone() {
    // Everyone hungry within what caches cover, with free page reporting:
    // the hogs' memory comes back by reporting once they free it, and what
    // the manager inflated goes back to the guests step by step, without
    // any target rising again.
    let (mut guests, pool, wm) = everyone_hungry(360, true, [100; 3]);
    for g in &mut guests {
        g.reporting = true;
    }
    let mut m = manager(wm);
    let mut o = simulate_board(&mut m, guests, pool, 12, tidal_board(wm));
    let inflated = m.stats().pages_reclaimed;
    assert!(inflated > 0, "the scenario inflates nothing");
    // From here nothing wants memory: 30 s more.
    let targets = |o: &Outcome| o.guests.iter().map(|g| g.target).collect::<Vec<_>>();
    let mut last = targets(&o);
    for second in 12..42 {
        let now_us = second * 1_000_000;
        let mut next = Vec::new();
        for tick in 0..10 {
            let now = now_us + tick * TICK_US;
            let mut pool = o.pool_end;
            for (i, g) in o.guests.iter_mut().enumerate() {
                g.run(now, &mut pool, wm.min, m.may_dip(i));
            }
            let inputs: Vec<VmInput> = o.guests.iter_mut().map(Guest::input).collect();
            for (g, t) in o.guests.iter_mut().zip(m.tick(now, pool, &inputs).targets) {
                if let Some(t) = t {
                    g.target = t;
                }
            }
            o.pool_end = pool;
            next = targets(&o);
            for (a, b) in last.iter().zip(&next) {
                assert!(
                    b <= a,
                    "a target rose again at {now} us: {last:?} -> {next:?}"
                );
            }
            last = next.clone();
        }
        let _ = next;
    }
    println!(
        "given back: {} MiB of {} MiB inflated; reported {} MiB; pool end {} MiB (high {} MiB)",
        m.stats().pages_given_back / MIB,
        inflated / MIB,
        o.guests.iter().map(|g| g.reported).sum::<Pages>() / MIB,
        o.pool_end / MIB,
        wm.high / MIB
    );
    report("manager", &o, 42_000_000);
    assert!(m.stats().pages_given_back > 0);
    // Every balloon is back at what its limits allow (no max: empty), and
    // the pool at or above high.
    for g in &o.guests {
        assert_eq!((g.target, g.actual), (0, 0), "{g:?}");
    }
    assert!(o.pool_end >= wm.high);
}

/// The overcommit scenario of the QEMU tests: three 1 GiB guests with 40
/// MiB of their own and 20 of cache, a 700 MiB hog at 160 MiB/s in each in
/// turn (at 1 s, 20 s and 40 s), freed 5 s after it has it all; 1528 MiB
/// free of 1836 (`wm` for that). The first two fit; the third needs what the first two
/// freed, through their balloons.
fn hog_moving(ctl: &mut dyn Controller, wm: Watermarks) -> (Outcome, Pages) {
    let hog = |start_us| {
        let mut g = Guest::new(
            1024 * MIB,
            Demand::Hog {
                start_us,
                goal: 740 * MIB,
                rate: 16 * MIB,
            },
        );
        g.anon = 40 * MIB;
        g.base_anon = 40 * MIB;
        g.cache = 20 * MIB;
        g.release_after_us = Some(5_000_000);
        g.limits.min = 64 * MIB;
        g.limits.low = 64 * MIB;
        g
    };
    let guests = vec![hog(1_000_000), hog(20_000_000), hog(40_000_000)];
    let pool = 1528 * MIB;
    // What the third hog needs from the others: all of it, less what the
    // pool holds above high once the first two have run.
    let needed = 700 * MIB - (pool - 2 * 700 * MIB - wm.high);
    let board = Board {
        floor: wm.min,
        stop_lowest_after_us: None,
    };
    (simulate_board(ctl, guests, pool, 60, board), needed)
}

#[test]
fn a_hog_moving_between_guests_moves_little_more_than_it_needs() {
    let wm = Watermarks::for_ram(1836 * MIB);
    let mut m = manager(wm);
    let (o, needed) = hog_moving(&mut m, wm);
    let (n, _) = hog_moving(&mut naive(wm), wm);
    let inflated = |o: &Outcome| o.guests.iter().map(|g| g.inflated).sum::<Pages>();
    let s = m.stats();
    println!(
        "hog moving: needed {} MiB; manager inflated {} MiB (targets up {} MiB, down {} MiB, \
         {} trimmed, {} given back), pool at the end {} MiB; naive inflated {} MiB",
        needed / MIB,
        inflated(&o) / MIB,
        s.pages_reclaimed / MIB,
        s.pages_given / MIB,
        s.pages_trimmed / MIB,
        s.pages_given_back / MIB,
        o.pool_end / MIB,
        inflated(&n) / MIB
    );
    for g in &o.guests {
        assert!(g.done_us.is_some(), "{g:?}");
        // The third hog outruns two balloon drivers (160 MiB/s against
        // 2 x 64): its vCPU gets frames as they come, which this model of
        // a tick counts as one wait.
        assert!(g.longest_wait(60_000_000) < WAIT_BOUND_US, "{g:?}");
        assert_eq!(g.reinflated, 0, "{g:?}");
    }
    // What the balloons took is what the hog needed, not what the pool
    // lacked each tick summed up while the drivers caught up.
    assert!(inflated(&o) * 10 <= needed * 12, "{o:?}");
    assert!(o.pool_end >= wm.low, "{o:?}");
}
