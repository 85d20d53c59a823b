//! The virtio devices the hypervisor drives itself (the board's disk,
//! [`crate::disk`], and its network card, `net.rs`): finding one behind
//! the board's virtio-mmio slots ([`find_device`]), and their DMA memory,
//! the virtio-drivers crate's [`Hal`] over the frame table on the EL2
//! identity map. Target only (the frame table behind `run::frames`).

use core::ptr::NonNull;

use virtio_drivers::transport::mmio::{MmioTransport, VirtIOHeader};
use virtio_drivers::transport::{DeviceType, Transport};
use virtio_drivers::{BufferDirection, Hal};

use crate::addr::PhysAddr;
use crate::mm::frames::FrameUse;
use crate::run::frames;

const PAGE: usize = 4096;

/// DMA memory from the frame table, on the EL2 identity map.
pub struct FrameHal;

// SAFETY: `dma_alloc` hands out zeroed, page-aligned frames taken from the
// frame table for the hypervisor's own use, which nothing else references
// until `dma_dealloc` returns them; EL2 runs on an identity map, so a
// buffer's physical address is its address, and the `virt` board's
// virtio-mmio DMA is coherent (`dma-coherent` in its tree), so sharing
// needs no cache maintenance and no copy.
unsafe impl Hal for FrameHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (u64, NonNull<u8>) {
        let Some(pa) = frames().alloc(pages, 1, FrameUse::Allocated) else {
            // The crate turns a zero address into its DMA error.
            return (0, NonNull::dangling());
        };
        let Some(ptr) = NonNull::new(pa.raw() as *mut u8) else {
            return (0, NonNull::dangling());
        };
        // SAFETY: `pages` frames at `pa` were just taken for us alone, and
        // are identity-mapped normal memory.
        unsafe { core::ptr::write_bytes(ptr.as_ptr(), 0, pages * PAGE) };
        (pa.raw(), ptr)
    }

    unsafe fn dma_dealloc(paddr: u64, _vaddr: NonNull<u8>, pages: usize) -> i32 {
        match frames().free(PhysAddr::new(paddr), pages, FrameUse::Allocated) {
            Ok(()) => 0,
            Err(_) => -1,
        }
    }

    unsafe fn mmio_phys_to_virt(paddr: u64, _size: usize) -> NonNull<u8> {
        // Only the PCI transport asks; the identity map covers all MMIO.
        NonNull::new(paddr as *mut u8).unwrap_or(NonNull::dangling())
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> u64 {
        buffer.as_ptr() as *mut u8 as u64
    }

    unsafe fn unshare(_paddr: u64, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}

/// The first of the board's virtio-mmio slots (but `skip`) with a device
/// of `kind` behind it: its transport and registers. Called at boot,
/// before any VM runs; the slots looked at and passed over stay untouched.
pub fn find_device(
    slots: &[platform::VirtioMmioSlot],
    skip: Option<platform::PhysRange>,
    kind: DeviceType,
) -> Option<(MmioTransport<'static>, platform::PhysRange)> {
    for slot in slots.iter().filter(|s| Some(s.regs) != skip) {
        let Ok(size) = usize::try_from(slot.regs.size()) else {
            continue;
        };
        let Some(header) = NonNull::new(slot.regs.start as *mut VirtIOHeader) else {
            continue;
        };
        // SAFETY: the slot's registers come from the board's device tree,
        // are identity-mapped as device memory, and nothing else in the
        // hypervisor (nor any guest) maps or touches them (a slot already
        // taken is `skip`); the transport is the only user from here on
        // (it is dropped, not used, when the device is another kind).
        let Ok(transport) = (unsafe { MmioTransport::new(header, size) }) else {
            continue;
        };
        if transport.device_type() == kind {
            return Some((transport, slot.regs));
        }
    }
    None
}
