//! `debug hog`: frames taken from the pool on purpose, so that the
//! fault-injection tests can make a VM's next fault-in find no memory.
//! The frames are the hypervisor's (`FrameUse::Allocated`) while held and
//! go back to the pool with `debug unhog`. Target only (the frame table
//! behind `run::frames`).

use spin::Mutex;

use crate::addr::PhysAddr;
use crate::mm::frames::FrameUse;
use crate::run::frames;

/// Runs of pages `(address, pages)` held; bounded, so a hog of the whole
/// pool needs no heap (runs are taken largest first).
static HELD: Mutex<heapless::Vec<(PhysAddr, usize), 4096>> = Mutex::new(heapless::Vec::new());

/// Run sizes tried, largest first.
const RUNS: [usize; 4] = [512, 64, 8, 1];

/// Take `pages` pages from the pool (`None`: all of it); returns how many
/// were taken (fewer when the pool has less, or the run list is full).
pub fn hog(pages: Option<u64>) -> u64 {
    let mut held = HELD.lock();
    let mut table = frames();
    let want = pages.unwrap_or(u64::MAX);
    let mut taken = 0u64;
    for run in RUNS {
        while taken < want && !held.is_full() {
            let n = (run as u64).min(want - taken) as usize;
            if n < run && run != 1 {
                break;
            }
            let Some(addr) = table.alloc(n, 1, FrameUse::Allocated) else {
                break;
            };
            // Not full: checked by the loop condition.
            let _ = held.push((addr, n));
            taken += n as u64;
        }
    }
    taken
}

/// Give every hogged page back to the pool; returns how many.
pub fn unhog() -> u64 {
    let mut held = HELD.lock();
    let mut table = frames();
    let mut freed = 0u64;
    for (addr, pages) in held.drain(..) {
        if table.free(addr, pages, FrameUse::Allocated).is_ok() {
            freed += pages as u64;
        }
    }
    freed
}

/// Pages held now.
pub fn held() -> u64 {
    HELD.lock().iter().map(|&(_, n)| n as u64).sum()
}
