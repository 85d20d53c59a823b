//! `features` mode: the balloon with every feature the device offers, over a
//! heap the guest keeps busy.
//!
//! The heap is a contiguous run of pool pages (the pool's highest) under a
//! [`BitmapFrames`] allocator wrapped in guest-driver's [`Reporting`]: the
//! balloon inflates from it and deflates into it, free page reporting and
//! hinting give its free blocks back, statistics describe it, and when an
//! allocation fails the OOM hook deflates. The rest of the pool keeps its
//! checksummed patterns (checked at every balloon target and every 10 s). A
//! working set of heap pages is allocated (each filled with its own pattern)
//! and freed in turns, so that free blocks keep appearing and being reused;
//! every page the host gave back (reported, hinted, deflated) must read as
//! the poison value (0 without PAGE_POISON) when the guest reuses it.
//!
//! Lines: `features: ...` (set-up), `reported N blocks (P pages) in R
//! reports`, `hint run ID answered with N blocks (P pages)`, `OOM: deflated
//! N pages`, `page poison 0x...`, `stats sent: free F KiB of T KiB`,
//! `reused N given-back pages, all read 0x...`, `working set ok (N checks)`,
//! and the pattern mode's `balloon target=...`, `pattern ok`, `alive Ns`.

use crate::arch::{counter, counter_hz};
use crate::hal::GuestHal;
use crate::pool::{Carved, Pool};
use crate::wait::Waiter;
use core::cell::UnsafeCell;
use core::ptr::NonNull;
use guest_driver::virtio_drivers::transport::mmio::{MmioTransport, VirtIOHeader};
use guest_driver::virtio_drivers::transport::Transport;
use guest_driver::{
    features, Balloon, BitmapFrames, Error, FrameAllocator, Options, PageSource, Reporting,
    OOM_DEFLATE_PAGES,
};

const PAGE: u64 = 4096;
/// Largest heap: 64 MiB.
const MAX_HEAP_PAGES: usize = 16384;
/// Pages the working set grows by in one turn (4 MiB).
const WORK_PAGES: usize = 1024;
/// Blocks reported and hinted: 2 MiB and up, as Linux.
const BLOCK_ORDER: u32 = 9;
/// Reported blocks the wrapper remembers.
const REMEMBERED: usize = 64;
/// What free pages are filled with, as the guest tells the device (PAGE_POISON).
pub const POISON: u32 = 0x7e57_a11c;
/// Workload turns per second.
const TURNS_PER_S: u64 = 2;
/// Seconds between heartbeat lines and between full pattern checks.
const HEARTBEAT_S: u64 = 2;
const PATTERN_CHECK_S: u64 = 10;

/// Statically allocated bookkeeping for the heap.
struct Statics {
    bitmap: [u64; MAX_HEAP_PAGES / 64],
    /// Per heap page: the host gave it back since the guest last wrote it.
    given_back: [bool; MAX_HEAP_PAGES],
    /// The working set: allocated heap pages holding their pattern.
    work: [u64; WORK_PAGES],
}

struct StaticCell(UnsafeCell<Statics>);
// SAFETY: the guest is single-threaded; `take_statics` hands it out once.
unsafe impl Sync for StaticCell {}
static STATICS: StaticCell = StaticCell(UnsafeCell::new(Statics {
    bitmap: [0; MAX_HEAP_PAGES / 64],
    given_back: [false; MAX_HEAP_PAGES],
    work: [0; WORK_PAGES],
}));

/// The bookkeeping, once.
fn take_statics() -> &'static mut Statics {
    use core::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    assert!(!TAKEN.swap(true, Ordering::Relaxed), "statics taken twice");
    // SAFETY: handed out once (checked above); single-threaded guest.
    unsafe { &mut *STATICS.0.get() }
}

/// The heap allocator: a bitmap allocator that also records which free
/// pages the host gave back. A page freed by the balloon (deflate) is given
/// back; one the working set frees is not (the guest wrote it).
struct Heap {
    frames: BitmapFrames<&'static mut [u64]>,
    given_back: &'static mut [bool],
    base: u64,
}

impl Heap {
    fn index(&self, addr: u64) -> usize {
        ((addr - self.base) / PAGE) as usize
    }

    /// Frees a page the guest wrote.
    fn free_written(&mut self, addr: u64) {
        self.frames.free_page(addr);
        let i = self.index(addr);
        self.given_back[i] = false;
    }

    /// Marks 2^order pages from `addr` as given back (reported or hinted).
    fn mark_given_back(&mut self, addr: u64, order: u32) {
        let i = self.index(addr);
        self.given_back[i..i + (1 << order)].fill(true);
    }
}

impl FrameAllocator for Heap {
    fn alloc_page(&mut self) -> Option<u64> {
        self.frames.alloc_page()
    }
    fn free_page(&mut self, addr: u64) {
        // Only the balloon frees through here: a deflated page.
        self.frames.free_page(addr);
        let i = self.index(addr);
        self.given_back[i] = true;
    }
    fn free_blocks(&mut self, min_order: u32, visit: &mut dyn FnMut(u64, u32) -> bool) {
        self.frames.free_blocks(min_order, visit);
    }
    fn free_pages(&self) -> u64 {
        self.frames.free_pages()
    }
    fn total_pages(&self) -> u64 {
        self.frames.total_pages()
    }
}

type Frames = Reporting<Heap, REMEMBERED>;

/// The value of word `i` of working-set page `addr` in turn `turn`.
fn work_word(addr: u64, turn: u64, i: u64) -> u64 {
    ((addr + 8 * i) ^ (turn << 40)).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0xa5a5_0f0f_5a5a_f0f0
}

/// Moves up to `n` contiguous pages from the top of the pool into a heap.
fn carve_heap(pool: &mut Pool, n: usize) -> Option<(u64, u64)> {
    let mut lowest = pool.take_page()?;
    let mut got = 1;
    while got < n {
        let Some(addr) = pool.take_page() else { break };
        if addr + PAGE != lowest {
            // Not contiguous: back it goes (refilled with its pattern).
            pool.return_page(addr);
            break;
        }
        lowest = addr;
        got += 1;
    }
    Some((lowest, got as u64))
}

/// Runs `features` mode for ever.
pub fn run(
    mut pool: Pool,
    carved: Carved,
    slot: Option<(u64, u64)>,
    mut waiter: Waiter,
    boot: u64,
    hold_stats: bool,
) -> ! {
    let statics = take_statics();
    let heap_pages = (pool.len() / 2).min(MAX_HEAP_PAGES);
    let Some((base, pages)) = carve_heap(&mut pool, heap_pages) else {
        println!("features: no pages for a heap");
        crate::arch::system_off();
    };
    let mut heap = Heap {
        frames: BitmapFrames::new(base, pages, &mut statics.bitmap[..]),
        given_back: &mut statics.given_back[..pages as usize],
        base,
    };
    for i in 0..pages {
        heap.free_written(base + i * PAGE);
    }
    let mut frames: Frames = Reporting::new(heap, BLOCK_ORDER);
    println!(
        "features: heap 0x{:x}..0x{:x} ({} pages), {} pages keep their pattern",
        base,
        base + pages * PAGE,
        pages,
        pool.len()
    );

    let Some((slot_base, slot_size)) = slot else {
        println!("features: no balloon device");
        crate::arch::system_off();
    };
    let header = NonNull::new(slot_base as *mut VirtIOHeader).expect("slot at 0");
    // SAFETY: a virtio-mmio slot from the device tree, mapped as device
    // memory, used by nothing else in this guest.
    let transport = match unsafe { MmioTransport::new(header, slot_size as usize) } {
        Ok(t) => t,
        Err(e) => {
            println!("balloon at 0x{slot_base:x}: {e}");
            crate::arch::system_off();
        }
    };
    let options = Options {
        features: features::SUPPORTED,
        poison_val: POISON,
    };
    let storage = carved.balloon_storage;
    let room = (pages as usize).min(storage.len());
    let mut balloon =
        match Balloon::<GuestHal, _, _>::with_options(transport, &mut storage[..room], options) {
            Ok(b) => b,
            Err(e) => {
                println!("balloon at 0x{slot_base:x}: {e}");
                crate::arch::system_off();
            }
        };
    println!(
        "balloon at 0x{:x}: features 0x{:x}, room for {} pages",
        slot_base,
        balloon.features(),
        room
    );
    let fill = if balloon.has(features::PAGE_POISON) {
        println!("page poison 0x{:x}", balloon.poison_val());
        balloon.poison_val()
    } else {
        println!("page poison off: given-back pages must read 0");
        0
    };
    let fill_word = u64::from(fill) << 32 | u64::from(fill);

    let hz = counter_hz();
    let mut next_beat = boot + HEARTBEAT_S * hz;
    let mut next_turn = counter();
    let mut next_check = counter() + PATTERN_CHECK_S * hz;
    let mut turn: u64 = 0;
    let mut work_len = 0usize;
    let mut stats_sent: u64 = 0;
    let mut work_checks: u64 = 0;
    loop {
        let now = counter();
        if now >= next_beat {
            println!("alive {}s", (now - boot) / hz);
            while next_beat <= now {
                next_beat += HEARTBEAT_S * hz;
            }
        }
        if now >= next_check {
            pool.check_and_report();
            println!("working set ok ({work_checks} checks)");
            next_check = now + PATTERN_CHECK_S * hz;
        }

        let result = (|| -> Result<(), Error> {
            // Inflate or deflate towards the target.
            let p = balloon.poll_with(&mut frames, &mut waiter)?;
            if p.moved() > 0 && p.at_target() {
                println!("balloon target={} actual={} pages", p.target, p.actual);
                pool.check_and_report();
            }
            if let Some(a) = balloon.answer_hint(&mut frames, BLOCK_ORDER, &mut waiter)? {
                // The first `a.blocks` free blocks went: the host may have
                // dropped them.
                let mut hinted = [(0u64, 0u32); guest_driver::HINT_MAX_BLOCKS];
                let mut n = 0;
                frames.free_blocks(BLOCK_ORDER, &mut |addr, order| {
                    hinted[n] = (addr, order);
                    n += 1;
                    n < a.blocks as usize
                });
                for &(addr, order) in &hinted[..n.min(a.blocks as usize)] {
                    frames.inner_mut().mark_given_back(addr, order);
                }
                println!(
                    "hint run {} answered with {} blocks ({} pages){}",
                    a.id,
                    a.blocks,
                    a.pages,
                    if a.stopped_by_host {
                        ", stopped by the host"
                    } else {
                        ""
                    }
                );
            }
            // Held: after the first buffer, the device never gets one back.
            if !(hold_stats && stats_sent > 0) && balloon.answer_stats(&mut frames)? {
                stats_sent += 1;
                println!(
                    "stats sent: free {} KiB of {} KiB (#{stats_sent})",
                    frames.free_pages() * 4,
                    frames.total_pages() * 4
                );
            }
            if counter() >= next_turn {
                next_turn = counter() + hz / TURNS_PER_S;
                turn += 1;
                if work_len == 0 {
                    work_len = grow(
                        &mut balloon,
                        &mut frames,
                        &mut statics.work,
                        turn,
                        fill_word,
                        &mut waiter,
                    )?;
                } else {
                    if check_work(&statics.work[..work_len], turn - 1) {
                        work_checks += 1;
                    }
                    for &addr in &statics.work[..work_len] {
                        frames.inner_mut().free_written(addr);
                    }
                    work_len = 0;
                    let r = balloon.report_free(&mut frames, &mut waiter)?;
                    if r.blocks > 0 {
                        let reported = frames.reported().len();
                        for i in 0..reported {
                            let (addr, order) = frames.reported()[i];
                            frames.inner_mut().mark_given_back(addr, order);
                        }
                        println!(
                            "reported {} blocks ({} pages) in {} reports",
                            r.blocks, r.pages, r.reports
                        );
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            println!("balloon error: {e}");
            if e == Error::Broken || matches!(e, Error::DeviceNeedsReset | Error::Timeout) {
                println!("features: balloon broken, only the heartbeat runs");
                loop {
                    waiter.sleep_until(next_beat, |w| guest_driver::Wait::wait(w, &mut || {}));
                    let now = counter();
                    if now >= next_beat {
                        println!("alive {}s", (now - boot) / hz);
                        next_beat += HEARTBEAT_S * hz;
                    }
                }
            }
        }
        let deadline = next_beat.min(next_turn);
        if counter() < deadline {
            waiter.sleep_until(deadline, |w| {
                balloon.idle(w);
            });
        }
    }
}

/// Allocates the working set for `turn`: checks every page the host gave
/// back reads `fill_word`, then writes the page's pattern. On an empty heap
/// the OOM hook deflates the balloon. Returns the pages allocated.
fn grow<T: Transport, S: AsMut<[u32]>>(
    balloon: &mut Balloon<GuestHal, T, S>,
    frames: &mut Frames,
    work: &mut [u64; WORK_PAGES],
    turn: u64,
    fill_word: u64,
    waiter: &mut Waiter,
) -> Result<usize, Error> {
    let mut n = 0;
    let mut reused = 0u64;
    let mut bad: Option<(u64, u64)> = None;
    while n < WORK_PAGES {
        let addr = match frames.alloc_page() {
            Some(a) => a,
            None => {
                let got = balloon.deflate_on_oom(frames, OOM_DEFLATE_PAGES, waiter)?;
                if got == 0 {
                    println!("out of memory, the balloon gave nothing back ({n} pages in the working set)");
                    break;
                }
                println!("OOM: deflated {got} pages");
                continue;
            }
        };
        let heap = frames.inner_mut();
        let i = heap.index(addr);
        let p = addr as *mut u64;
        if heap.given_back[i] {
            reused += 1;
            for w in 0..PAGE / 8 {
                // SAFETY: a heap page just allocated: RAM the guest owns.
                let found = unsafe { p.add(w as usize).read_volatile() };
                if found != fill_word && bad.is_none() {
                    bad = Some((addr + 8 * w, found));
                }
            }
            heap.given_back[i] = false;
        }
        for w in 0..PAGE / 8 {
            // SAFETY: as above.
            unsafe { p.add(w as usize).write_volatile(work_word(addr, turn, w)) };
        }
        work[n] = addr;
        n += 1;
    }
    match bad {
        Some((addr, found)) => println!(
            "REUSED PAGE NOT FILLED at 0x{addr:x} (found 0x{found:x}, expected 0x{fill_word:x})"
        ),
        None if reused > 0 => {
            println!("reused {reused} given-back pages, all read 0x{fill_word:x}")
        }
        None => {}
    }
    Ok(n)
}

/// Checks the working set still holds its patterns; says so only on a mismatch.
fn check_work(work: &[u64], turn: u64) -> bool {
    for &addr in work {
        let p = addr as *const u64;
        for w in 0..PAGE / 8 {
            // SAFETY: a working-set page: allocated, RAM the guest owns.
            let found = unsafe { p.add(w as usize).read_volatile() };
            if found != work_word(addr, turn, w) {
                println!(
                    "WORKING SET MISMATCH at 0x{:x} (found 0x{found:x})",
                    addr + 8 * w
                );
                return false;
            }
        }
    }
    true
}
