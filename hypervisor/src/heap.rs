//! The hypervisor's heap: a buddy allocator over frames the frame table gave it.

use buddy_system_allocator::LockedHeap;

#[global_allocator]
static HEAP: LockedHeap<32> = LockedHeap::empty();

/// Give the heap `[start, start + size)`.
///
/// # Safety
/// The range must be mapped normal memory owned by the heap alone, and this
/// must be called once.
pub unsafe fn init(start: usize, size: usize) {
    // SAFETY: the caller guarantees exclusive ownership of the range.
    unsafe { HEAP.lock().init(start, size) };
}
