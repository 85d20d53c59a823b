//! The virtio-drivers HAL: DMA pages from a static arena in .bss. The guest
//! runs identity-mapped, so physical and virtual addresses are the same.

use core::cell::UnsafeCell;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering};
use guest_driver::virtio_drivers::{BufferDirection, Hal, PhysAddr, PAGE_SIZE};

/// Pages of DMA memory: the balloon's two basic queues need at most four;
/// with every feature (five queues and the statistics buffer) eleven; the
/// hostile mode needs a few more for its own rings.
const ARENA_PAGES: usize = 16;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; ARENA_PAGES * PAGE_SIZE]>);

// SAFETY: pages of the arena are handed out once each (see `dma_pages`).
unsafe impl Sync for Arena {}

static ARENA: Arena = Arena(UnsafeCell::new([0; ARENA_PAGES * PAGE_SIZE]));
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Takes `pages` zeroed, page-aligned pages from the arena for good (the
/// arena never frees), or `None` when it is used up.
pub fn dma_pages(pages: usize) -> Option<NonNull<u8>> {
    let first = NEXT.fetch_add(pages, Ordering::Relaxed);
    if pages == 0 || first + pages > ARENA_PAGES {
        return None;
    }
    // SAFETY: in bounds of the arena (checked above).
    let ptr = unsafe { ARENA.0.get().cast::<u8>().add(first * PAGE_SIZE) };
    // SAFETY: these pages were handed out to nobody before; zero them (a
    // hostile run may reuse none, but be explicit).
    unsafe { ptr.write_bytes(0, pages * PAGE_SIZE) };
    NonNull::new(ptr)
}

/// The HAL for `guest_driver::Balloon`.
pub struct GuestHal;

// SAFETY: `dma_alloc` gives out zeroed, page-aligned arena pages that nobody
// else uses; addresses are identity-mapped, so sharing is the identity.
unsafe impl Hal for GuestHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        match dma_pages(pages) {
            Some(ptr) => (ptr.as_ptr() as PhysAddr, ptr),
            None => (0, NonNull::dangling()),
        }
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, _vaddr: NonNull<u8>, _pages: usize) -> i32 {
        // The arena never frees; the balloon lives for ever anyway.
        0
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        NonNull::new(paddr as *mut u8).expect("MMIO at address 0")
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> PhysAddr {
        buffer.as_ptr().cast::<u8>() as PhysAddr
    }

    unsafe fn unshare(_paddr: PhysAddr, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}
