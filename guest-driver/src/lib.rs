//! A `no_std` virtio balloon driver for bare-metal Rust guests.
//!
//! It gives a small Rust kernel what Linux's `virtio_balloon` driver gives Linux:
//! the host sets a target balloon size in the device's config space, and the
//! driver takes pages from the guest's page allocator and hands their frame
//! numbers to the host (inflate), or takes frame numbers back from the host and
//! returns the pages to the allocator (deflate).
//!
//! The driver sits on [`virtio-drivers`](virtio_drivers) 0.13: any
//! [`Transport`] (in a guest of the Tidal virtual board, an
//! [`MmioTransport`](virtio_drivers::transport::mmio::MmioTransport)) and up
//! to five split [`VirtQueue`]s (one per negotiated queue). It needs no heap (virtio-drivers is used without its
//! `alloc` feature), no interrupts (the guest calls [`Balloon::poll`] now and
//! then) and no timer.
//!
//! # What the guest provides
//!
//! * a [`Hal`] that gives out zeroed, page-aligned DMA memory for the
//!   queues and the statistics buffer (four pages for the two basic queues, at
//!   most eleven with all five queues) and turns a buffer address into a
//!   guest-physical address (the identity in an identity-mapped guest);
//! * a [`PageSource`]: its page allocator, from which the driver takes pages to
//!   inflate and to which it returns them on deflate;
//! * storage for the frame numbers of the pages in the balloon, one `u32` per
//!   page: the driver must remember which pages it gave away and cannot keep
//!   that list in the pages themselves (the host takes them away), and it does
//!   not allocate. The length of this storage is the most the balloon can hold:
//!   size it for all of RAM (4 bytes per 4 KiB page, 0.1% of RAM) or less to cap
//!   the balloon.
//!
//! # Example
//!
//! ```no_run
//! use core::ptr::NonNull;
//! use guest_driver::{Balloon, PageSource};
//! use virtio_drivers::transport::mmio::{MmioTransport, VirtIOHeader};
//! # use virtio_drivers::{BufferDirection, Hal, PhysAddr};
//! # struct MyHal;
//! # unsafe impl Hal for MyHal {
//! #     fn dma_alloc(_: usize, _: BufferDirection) -> (PhysAddr, NonNull<u8>) { unimplemented!() }
//! #     unsafe fn dma_dealloc(_: PhysAddr, _: NonNull<u8>, _: usize) -> i32 { 0 }
//! #     unsafe fn mmio_phys_to_virt(p: PhysAddr, _: usize) -> NonNull<u8> { NonNull::new(p as *mut u8).unwrap() }
//! #     unsafe fn share(b: NonNull<[u8]>, _: BufferDirection) -> PhysAddr { b.as_ptr() as *mut u8 as PhysAddr }
//! #     unsafe fn unshare(_: PhysAddr, _: NonNull<[u8]>, _: BufferDirection) {}
//! # }
//! # struct MyAllocator;
//! # impl PageSource for MyAllocator {
//! #     fn take_page(&mut self) -> Option<u64> { None }
//! #     fn return_page(&mut self, _addr: u64) {}
//! # }
//! # fn example(allocator: &mut MyAllocator, ballooned: &'static mut [u32]) -> Result<(), guest_driver::Error> {
//! // The virtio-mmio slot whose DeviceID register reads 5 (found in the device tree).
//! let header = NonNull::new(0x0a00_0000 as *mut VirtIOHeader).unwrap();
//! // SAFETY: the slot is mapped as device memory and nothing else uses it.
//! let transport = unsafe { MmioTransport::new(header, 0x200) }.unwrap();
//! // `ballooned` holds one u32 per page the balloon may take (here: all of RAM).
//! let mut balloon = Balloon::<MyHal, _, _>::new(transport, ballooned)?;
//! loop {
//!     let progress = balloon.poll(allocator)?;
//!     if progress.moved() > 0 && progress.at_target() {
//!         // The balloon reached the host's target: actual == target.
//!     }
//!     if progress.moved() == 0 {
//!         // Nothing to do (or nothing possible): do other work, then poll again.
//!     }
//! }
//! # }
//! ```
//!
//! # Waiting
//!
//! After each request the driver must wait until the device has used the
//! buffer. [`Balloon::poll`] spins on the used ring; [`Balloon::poll_with`]
//! takes a [`Wait`] instead, and [`Balloon::idle`] waits once for the device
//! to say something (a config change: a new target). A guest that sleeps
//! implements [`Wait::wait`] over its interrupt controller, the common
//! bare-metal way:
//!
//! ```text
//! keep PSTATE.I masked; WFI (it wakes on a pending interrupt even so);
//! read the interrupt controller's acknowledge register (IAR);
//! if it names the balloon's interrupt: call `acknowledge` (the driver reads
//!     the device's InterruptStatus and writes InterruptACK until it reads 0);
//! write the end-of-interrupt register (EOI); return.
//! ```
//!
//! The driver rechecks the used ring (or the target) after every wait, so a
//! wait may end for any reason (a timer, a spurious wake-up); a used buffer
//! that arrived before the wait leaves its interrupt pending at the interrupt
//! controller and ends the wait at once. Acknowledging until InterruptStatus
//! reads 0 drops the device's line, so an edge-triggered controller sees the
//! next event as a new edge.
//!
//! # Protocol details
//!
//! * Features: [`Balloon::new`] accepts `VIRTIO_F_VERSION_1` and
//!   `VIRTIO_BALLOON_F_MUST_TELL_HOST` when offered and nothing else;
//!   [`Balloon::with_options`] accepts what the caller wants of the six
//!   balloon features, when offered ([`negotiate`]). The driver checks that
//!   the device keeps `FEATURES_OK`.
//! * Queues: inflateq is queue 0 and deflateq queue 1; statsq,
//!   free_page_vq and reporting_vq follow, each present only if its feature
//!   was negotiated ([`queue_index`]); every present queue is set up.
//! * PAGE_POISON: `poison_val` is written before `DRIVER_OK`.
//! * STATS_VQ: one statistics buffer (a DMA page), primed by the first
//!   [`Balloon::answer_stats`] and resent each time the device returns it.
//! * PAGE_REPORTING: [`Balloon::report_free`] sends the free blocks a
//!   [`Reporting`] frame-allocator wrapper has not reported yet, as chains of
//!   device-writable descriptors, and the wrapper remembers them until a page
//!   of them is allocated.
//! * FREE_PAGE_HINT: [`Balloon::answer_hint`] answers a new command id with
//!   the id, the allocator's free blocks (device-writable, one per buffer) and
//!   STOP.
//! * DEFLATE_ON_OOM: [`Balloon::deflate_on_oom`] deflates below the target
//!   when the guest's allocator is out, then holds off inflating until the
//!   target changes.
//! * Each request carries at most [`PFNS_PER_REQUEST`] (256) little-endian `u32`
//!   frame numbers in 4 KiB units, in one device-readable buffer. The driver
//!   waits for the device to use it before it touches the pages again: after
//!   inflate it updates `actual`; after deflate (required by MUST_TELL_HOST, and
//!   done always) it returns the pages to the [`PageSource`].
//! * A device that sets `DEVICE_NEEDS_RESET` while the driver waits, or does not
//!   answer within the optional [`Balloon::set_wait_limit`], is reset and the
//!   driver refuses further work ([`Error::Broken`]). The pages of that request
//!   are not returned to the page source (the device may already have taken
//!   them); [`Balloon::stranded_pages`] counts them. The driver reads the
//!   device status after a wait that saw a config-change interrupt (the
//!   spec's signal for `DEVICE_NEEDS_RESET`) and every 1024 waits.
#![cfg_attr(not(test), no_std)]
#![deny(clippy::undocumented_unsafe_blocks)]

use core::fmt;
use core::hint::spin_loop;
use core::marker::PhantomData;
use core::ptr::NonNull;

pub use virtio_drivers;
use virtio_drivers::queue::VirtQueue;
pub use virtio_drivers::transport::InterruptStatus;
use virtio_drivers::transport::{DeviceStatus, DeviceType, Transport};
pub use virtio_drivers::{Hal, PhysAddr};

/// Size of a balloon page, whatever the guest's own page size.
pub const BALLOON_PAGE_SIZE: u64 = 4096;

/// Most frame numbers sent in one inflate or deflate request (as Linux does).
pub const PFNS_PER_REQUEST: usize = 256;

/// Descriptors per virtqueue. The driver has one buffer (one chain) in flight
/// per queue at a time; a free page report is one chain of up to this many
/// blocks. A device must offer at least this many (QEMU and Tidal offer 128).
pub const QUEUE_SIZE: usize = 16;

/// Most blocks in one free page report (one descriptor each).
pub const REPORT_BATCH: usize = QUEUE_SIZE;

/// Most free blocks sent in one free page hinting run.
pub const HINT_MAX_BLOCKS: usize = 64;

/// Largest block order (2^order 4 KiB pages) the driver reports or hints:
/// 1 GiB, so that a block's length fits a descriptor's `u32`.
pub const MAX_BLOCK_ORDER: u32 = 18;

/// Pages deflated per out-of-memory call when the caller does not say (as
/// Linux's OOM notifier).
pub const OOM_DEFLATE_PAGES: u32 = 256;

/// Feature bits of the balloon device and the transport bits this driver knows.
pub mod features {
    /// Do not reuse deflated pages before the device has used the deflate buffer.
    pub const MUST_TELL_HOST: u64 = 1 << 0;
    /// A statistics queue exists.
    pub const STATS_VQ: u64 = 1 << 1;
    /// The guest may deflate on its own when it runs out of memory.
    pub const DEFLATE_ON_OOM: u64 = 1 << 2;
    /// Free page hinting queue and command id.
    pub const FREE_PAGE_HINT: u64 = 1 << 3;
    /// `poison_val` in config.
    pub const PAGE_POISON: u64 = 1 << 4;
    /// Free page reporting queue.
    pub const PAGE_REPORTING: u64 = 1 << 5;
    /// Modern virtio (little-endian config, no legacy layout).
    pub const VERSION_1: u64 = 1 << 32;
    /// Everything this driver implements.
    pub const SUPPORTED: u64 = MUST_TELL_HOST
        | STATS_VQ
        | DEFLATE_ON_OOM
        | FREE_PAGE_HINT
        | PAGE_POISON
        | PAGE_REPORTING
        | VERSION_1;
    /// What [`Balloon::new`](crate::Balloon::new) asks for: the basic balloon.
    pub const BASIC: u64 = MUST_TELL_HOST | VERSION_1;
}

/// Offset of `num_pages` (the device's target) in the config space.
const CONFIG_NUM_PAGES: usize = 0;
/// Offset of `actual` (written by the driver) in the config space.
const CONFIG_ACTUAL: usize = 4;
/// Offset of `free_page_hint_cmd_id` (the device's) in the config space.
const CONFIG_HINT_CMD_ID: usize = 8;
/// Offset of `poison_val` (the driver's, before DRIVER_OK) in the config space.
const CONFIG_POISON_VAL: usize = 12;

/// Free page hinting command id STOP (device: stop; driver: no more hints).
pub const HINT_CMD_ID_STOP: u32 = 0;
/// Free page hinting command id DONE (device: the guest may reuse hinted pages).
pub const HINT_CMD_ID_DONE: u32 = 1;

/// The guest kernel's page allocator, as seen by the balloon.
pub trait PageSource {
    /// Takes a free 4 KiB page out of the allocator for the balloon and returns
    /// its guest-physical address (4 KiB aligned, below 16 TiB so that its frame
    /// number fits in a `u32`), or `None` if there is no page to spare.
    ///
    /// After this the guest must not touch the page until [`Self::return_page`]
    /// gives it back: the host may unmap or discard it.
    fn take_page(&mut self) -> Option<u64>;

    /// Gives a page back to the allocator: a page that came back from the host
    /// on deflate (its contents are whatever the host says: zero on Tidal and
    /// usually on QEMU), or a page taken but never sent to the host.
    fn return_page(&mut self, addr: u64);
}

/// Memory statistics tags (virtio 1.2 section 5.5.6.3; Linux sends 0-15).
pub mod stat {
    /// Bytes swapped in.
    pub const SWAP_IN: u16 = 0;
    /// Bytes swapped out.
    pub const SWAP_OUT: u16 = 1;
    /// Major page faults.
    pub const MAJOR_FAULTS: u16 = 2;
    /// Minor page faults.
    pub const MINOR_FAULTS: u16 = 3;
    /// Bytes of memory nothing uses.
    pub const FREE_MEMORY: u16 = 4;
    /// Bytes of memory the guest can use.
    pub const TOTAL_MEMORY: u16 = 5;
    /// Bytes the guest could give out without swapping.
    pub const AVAILABLE_MEMORY: u16 = 6;
    /// Bytes of caches the guest can drop.
    pub const DISK_CACHES: u16 = 7;
}

/// Most statistics in one statistics buffer.
pub const MAX_STATS: usize = 16;

/// Bytes of one statistics entry: `le16 tag, le64 value`, packed.
pub const STAT_ENTRY_BYTES: usize = 10;

/// The statistics a guest sends in one buffer: up to [`MAX_STATS`] tags.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct MemoryStats {
    entries: [(u16, u64); MAX_STATS],
    len: usize,
}

impl MemoryStats {
    /// Sets `tag` to `value` (replacing an earlier value of the same tag).
    /// Returns false if the buffer already holds [`MAX_STATS`] other tags.
    pub fn set(&mut self, tag: u16, value: u64) -> bool {
        if let Some(e) = self.entries[..self.len].iter_mut().find(|e| e.0 == tag) {
            e.1 = value;
            return true;
        }
        if self.len == MAX_STATS {
            return false;
        }
        self.entries[self.len] = (tag, value);
        self.len += 1;
        true
    }

    /// The statistics set so far, in the order first set.
    pub fn entries(&self) -> &[(u16, u64)] {
        &self.entries[..self.len]
    }

    /// Writes the entries in the device's format and returns the length.
    pub fn encode(&self, out: &mut [u8; MAX_STATS * STAT_ENTRY_BYTES]) -> usize {
        for (chunk, &(tag, value)) in out.chunks_exact_mut(STAT_ENTRY_BYTES).zip(self.entries()) {
            chunk[..2].copy_from_slice(&tag.to_le_bytes());
            chunk[2..].copy_from_slice(&value.to_le_bytes());
        }
        self.len * STAT_ENTRY_BYTES
    }
}

/// Where the statistics the driver sends come from (STATS_VQ).
pub trait StatsSource {
    /// Fills in the guest's current statistics.
    fn memory_stats(&mut self, stats: &mut MemoryStats);
}

/// A guest frame allocator that can list its free blocks: what free page
/// reporting, free page hinting and the statistics need.
///
/// Addresses are guest-physical and, as for the queues, the driver reaches a
/// block at the same address (an identity-mapped guest) and passes it through
/// [`Hal::share`].
pub trait FrameAllocator {
    /// Allocates one 4 KiB page, or `None` if none is free.
    fn alloc_page(&mut self) -> Option<u64>;
    /// Frees a page [`Self::alloc_page`] gave out.
    fn free_page(&mut self, addr: u64);
    /// Calls `visit(addr, order)` for free blocks of 2^order pages, `order >=
    /// min_order`, each aligned to its size and wholly free, none overlapping
    /// another; stops when `visit` returns false.
    fn free_blocks(&mut self, min_order: u32, visit: &mut dyn FnMut(u64, u32) -> bool);
    /// Pages free now.
    fn free_pages(&self) -> u64;
    /// Pages the allocator manages, free or not.
    fn total_pages(&self) -> u64;
}

/// A frame allocator wrapper for free page reporting: it remembers up to `N`
/// blocks it reported (so that each free block is reported once) and forgets
/// a block as soon as any page of it is allocated again.
///
/// It is also the balloon's [`PageSource`] (pages taken for the balloon are
/// allocations like any other) and a [`StatsSource`] (free, total and
/// available memory from the allocator).
pub struct Reporting<A: FrameAllocator, const N: usize> {
    inner: A,
    min_order: u32,
    reported: [(u64, u32); N],
    count: usize,
}

impl<A: FrameAllocator, const N: usize> Reporting<A, N> {
    /// Wraps `inner`; only free blocks of at least 2^`min_order` pages are
    /// reported (Linux reports 2 MiB blocks, order 9). `min_order` is capped
    /// at [`MAX_BLOCK_ORDER`].
    pub fn new(inner: A, min_order: u32) -> Self {
        Reporting {
            inner,
            min_order: min_order.min(MAX_BLOCK_ORDER),
            reported: [(0, 0); N],
            count: 0,
        }
    }

    /// The smallest order reported.
    pub fn min_order(&self) -> u32 {
        self.min_order
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The wrapped allocator, e.g. for allocations that need no bookkeeping
    /// here. Allocating through it bypasses the forgetting: use
    /// [`FrameAllocator::alloc_page`] on the wrapper.
    pub fn inner_mut(&mut self) -> &mut A {
        &mut self.inner
    }

    /// The blocks reported and not allocated since, as `(addr, order)`.
    pub fn reported(&self) -> &[(u64, u32)] {
        &self.reported[..self.count]
    }

    /// Whether the page at `addr` lies in a block reported and not
    /// allocated since (its contents are the host's fill, not the guest's).
    pub fn is_reported(&self, addr: u64) -> bool {
        self.reported().iter().any(|&b| block_contains(b, addr))
    }

    /// Free blocks not reported yet, at most `out.len()` and at most as many
    /// as there is room to remember; returns how many it wrote.
    pub fn unreported(&mut self, out: &mut [(u64, u32)]) -> usize {
        let room = out.len().min(N - self.count);
        let mut n = 0;
        let reported = &self.reported[..self.count];
        let max = MAX_BLOCK_ORDER;
        self.inner.free_blocks(self.min_order, &mut |addr, order| {
            if n == room {
                return false;
            }
            if order <= max && !reported.contains(&(addr, order)) {
                out[n] = (addr, order);
                n += 1;
            }
            n < room
        });
        n
    }

    /// Remembers that `blocks` were reported; a remembered block inside one
    /// of them (the allocator merged it into a larger free block) is dropped.
    pub fn remember(&mut self, blocks: &[(u64, u32)]) {
        for &block in blocks {
            let mut i = 0;
            while i < self.count {
                if block_contains(block, self.reported[i].0) {
                    self.forget_at(i);
                } else {
                    i += 1;
                }
            }
            if self.count < N {
                self.reported[self.count] = block;
                self.count += 1;
            }
        }
    }

    /// Forgets every reported block that holds `addr`.
    fn forget(&mut self, addr: u64) {
        let mut i = 0;
        while i < self.count {
            if block_contains(self.reported[i], addr) {
                self.forget_at(i);
            } else {
                i += 1;
            }
        }
    }

    fn forget_at(&mut self, i: usize) {
        self.count -= 1;
        self.reported[i] = self.reported[self.count];
    }
}

fn block_contains((start, order): (u64, u32), addr: u64) -> bool {
    addr >= start && addr - start < BALLOON_PAGE_SIZE << order
}

impl<A: FrameAllocator, const N: usize> FrameAllocator for Reporting<A, N> {
    fn alloc_page(&mut self) -> Option<u64> {
        let addr = self.inner.alloc_page()?;
        self.forget(addr);
        Some(addr)
    }
    fn free_page(&mut self, addr: u64) {
        self.inner.free_page(addr);
    }
    fn free_blocks(&mut self, min_order: u32, visit: &mut dyn FnMut(u64, u32) -> bool) {
        self.inner.free_blocks(min_order, visit);
    }
    fn free_pages(&self) -> u64 {
        self.inner.free_pages()
    }
    fn total_pages(&self) -> u64 {
        self.inner.total_pages()
    }
}

impl<A: FrameAllocator, const N: usize> PageSource for Reporting<A, N> {
    fn take_page(&mut self) -> Option<u64> {
        self.alloc_page()
    }
    fn return_page(&mut self, addr: u64) {
        self.free_page(addr);
    }
}

impl<A: FrameAllocator, const N: usize> StatsSource for Reporting<A, N> {
    fn memory_stats(&mut self, stats: &mut MemoryStats) {
        let free = self.inner.free_pages() * BALLOON_PAGE_SIZE;
        stats.set(stat::FREE_MEMORY, free);
        stats.set(
            stat::TOTAL_MEMORY,
            self.inner.total_pages() * BALLOON_PAGE_SIZE,
        );
        // No caches to drop: what is free is what is available.
        stats.set(stat::AVAILABLE_MEMORY, free);
    }
}

/// A simple [`FrameAllocator`]: one bit per 4 KiB page of a contiguous
/// range (set = free), lowest free page first, so that high addresses stay in
/// large free blocks. The bitmap is the caller's (no heap): one `u64` per 64
/// pages.
pub struct BitmapFrames<B: AsMut<[u64]> + AsRef<[u64]>> {
    base: u64,
    pages: u64,
    map: B,
    free: u64,
    /// No free page below this index.
    lowest_free: u64,
}

impl<B: AsMut<[u64]> + AsRef<[u64]>> BitmapFrames<B> {
    /// An allocator over `pages` pages from `base` (4 KiB aligned), all in use
    /// until freed. `map` must hold at least `pages.div_ceil(64)` words.
    pub fn new(base: u64, pages: u64, mut map: B) -> Self {
        assert!(
            base.is_multiple_of(BALLOON_PAGE_SIZE),
            "base not 4 KiB aligned"
        );
        assert!(
            map.as_ref().len() as u64 >= pages.div_ceil(64),
            "bitmap too small"
        );
        map.as_mut().iter_mut().for_each(|w| *w = 0);
        BitmapFrames {
            base,
            pages,
            map,
            free: 0,
            lowest_free: pages,
        }
    }

    /// Whether the page at `addr` is in range and free.
    pub fn is_free(&self, addr: u64) -> bool {
        self.index(addr).is_some_and(|i| self.bit(i))
    }

    /// The range managed: `(base, pages)`.
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.pages)
    }

    fn index(&self, addr: u64) -> Option<u64> {
        let off = addr.checked_sub(self.base)?;
        (off.is_multiple_of(BALLOON_PAGE_SIZE) && off / BALLOON_PAGE_SIZE < self.pages)
            .then_some(off / BALLOON_PAGE_SIZE)
    }

    fn bit(&self, i: u64) -> bool {
        self.map.as_ref()[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// Whether pages `i..i + n` are all free.
    fn all_free(&self, i: u64, n: u64) -> bool {
        (i..i + n).all(|j| self.bit(j))
    }
}

impl<B: AsMut<[u64]> + AsRef<[u64]>> FrameAllocator for BitmapFrames<B> {
    fn alloc_page(&mut self) -> Option<u64> {
        let map = self.map.as_ref();
        let mut word = (self.lowest_free / 64) as usize;
        while word < map.len() && map[word] == 0 {
            word += 1;
        }
        let i = word as u64 * 64 + u64::from(map.get(word)?.trailing_zeros());
        if i >= self.pages {
            return None;
        }
        self.map.as_mut()[word] &= !(1 << (i % 64));
        self.free -= 1;
        self.lowest_free = i + 1;
        Some(self.base + i * BALLOON_PAGE_SIZE)
    }

    fn free_page(&mut self, addr: u64) {
        let i = self.index(addr).expect("freed page outside the allocator");
        assert!(!self.bit(i), "page {addr:#x} freed twice");
        self.map.as_mut()[(i / 64) as usize] |= 1 << (i % 64);
        self.free += 1;
        self.lowest_free = self.lowest_free.min(i);
    }

    fn free_blocks(&mut self, min_order: u32, visit: &mut dyn FnMut(u64, u32) -> bool) {
        let min_order = min_order.min(MAX_BLOCK_ORDER);
        let mut i = self.lowest_free;
        while i < self.pages {
            if !self.bit(i) {
                i += 1;
                continue;
            }
            // The largest aligned, wholly free block starting at `i`.
            let mut order = 0;
            while order < MAX_BLOCK_ORDER
                && i.is_multiple_of(2 << order)
                && i + (2 << order) <= self.pages
                && self.all_free(i + (1 << order), 1 << order)
            {
                order += 1;
            }
            if order >= min_order && !visit(self.base + i * BALLOON_PAGE_SIZE, order) {
                return;
            }
            i += 1 << order;
        }
    }

    fn free_pages(&self) -> u64 {
        self.free
    }

    fn total_pages(&self) -> u64 {
        self.pages
    }
}

/// What the driver asks of the device beyond the basic balloon.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Options {
    /// Features wanted (see [`features`]); only those the device offers are
    /// used.
    pub features: u64,
    /// The value the guest fills free pages with (PAGE_POISON): written to
    /// `poison_val` before DRIVER_OK, so pages the host backs again read as
    /// it.
    pub poison_val: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            features: features::BASIC,
            poison_val: 0,
        }
    }
}

/// One answered free page hinting run.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct HintAnswer {
    /// The run's command id.
    pub id: u32,
    /// Free blocks hinted.
    pub blocks: u32,
    /// 4 KiB pages in them.
    pub pages: u64,
    /// The host stopped the run before the driver had sent every block.
    pub stopped_by_host: bool,
}

/// What one call of [`Balloon::report_free`] reported.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Reported {
    /// Reports (buffers) sent.
    pub reports: u32,
    /// Blocks in them.
    pub blocks: u32,
    /// 4 KiB pages in them.
    pub pages: u64,
}

/// How the driver waits for the device (see [Waiting](crate#waiting)).
pub trait Wait {
    /// Waits once, until the device's interrupt may have arrived or the guest
    /// woke for some other reason (a timer, a spurious wake-up); the driver
    /// rechecks what it waits for after every call.
    ///
    /// If the device's interrupt is what woke it, the implementation calls
    /// `acknowledge` before it ends the interrupt at the interrupt controller:
    /// `acknowledge` clears the device's InterruptStatus, so that its level
    /// interrupt line is low by the end of the interrupt. An implementation
    /// that does not use interrupts ([`Spin`]) need not call it.
    fn wait(&mut self, acknowledge: &mut dyn FnMut());
}

/// Waiting without interrupts: every wait is one spin-loop hint, and the
/// driver polls the used ring in between.
#[derive(Clone, Copy, Debug, Default)]
pub struct Spin;

impl Wait for Spin {
    fn wait(&mut self, _acknowledge: &mut dyn FnMut()) {
        spin_loop();
    }
}

/// Most rounds of reading InterruptStatus and writing it back to
/// InterruptACK in one acknowledgement: a device that keeps raising new bits
/// cannot hold the driver for ever.
const ACK_ROUNDS: usize = 16;

/// Acknowledges every interrupt the device reports, until InterruptStatus
/// reads 0 (so that its interrupt line has dropped), and returns them all.
///
/// Reading once and acknowledging what was read can leave a bit that the
/// device set in between; the line then stays high and an edge-triggered
/// interrupt controller never sees another edge.
pub fn acknowledge_all(transport: &mut impl Transport) -> InterruptStatus {
    let mut seen = InterruptStatus::empty();
    for _ in 0..ACK_ROUNDS {
        let status = transport.ack_interrupt();
        if status.is_empty() {
            break;
        }
        seen |= status;
    }
    seen
}

/// The virtqueues of the balloon device.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Queue {
    /// Pages given to the host.
    Inflate,
    /// Pages taken back from the host.
    Deflate,
    /// Memory statistics (with `STATS_VQ`).
    Stats,
    /// Free page hints (with `FREE_PAGE_HINT`).
    FreePageHint,
    /// Free page reports (with `PAGE_REPORTING`).
    Reporting,
}

/// The index of `queue` given the negotiated features, or `None` if the queue
/// does not exist. Queues are numbered in the order the spec lists them, and a
/// queue whose feature was not negotiated takes no index: with only
/// `PAGE_REPORTING` negotiated, reporting_vq is queue 2, not 4.
pub fn queue_index(negotiated: u64, queue: Queue) -> Option<u16> {
    let present = |bit: u64| negotiated & bit != 0;
    let mut index = 2;
    for (q, bit) in [
        (Queue::Stats, features::STATS_VQ),
        (Queue::FreePageHint, features::FREE_PAGE_HINT),
        (Queue::Reporting, features::PAGE_REPORTING),
    ] {
        if q == queue {
            return present(bit).then_some(index);
        }
        if present(bit) {
            index += 1;
        }
    }
    match queue {
        Queue::Inflate => Some(0),
        Queue::Deflate => Some(1),
        _ => unreachable!(),
    }
}

/// The features the driver accepts: those the device offers, the caller
/// wants and the driver implements. `VERSION_1` is always accepted when
/// offered (a modern device needs it).
pub fn negotiate(offered: u64, wanted: u64) -> u64 {
    offered & (wanted | features::VERSION_1) & features::SUPPORTED
}

/// What one call of [`Balloon::poll`] will do.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Step {
    /// `actual == target`.
    Idle,
    /// Take this many pages (1..=256) and inflate them.
    Inflate(u32),
    /// Deflate this many pages (1..=256).
    Deflate(u32),
    /// `actual < target`, but the balloon's storage is full.
    Full,
}

/// Decides the next step from the device's target, the balloon's size and the
/// number of pages the balloon can hold.
pub fn plan(target: u32, actual: u32, capacity: u32) -> Step {
    let batch = PFNS_PER_REQUEST as u32;
    if actual < target {
        let room = capacity.saturating_sub(actual);
        match (target - actual).min(room).min(batch) {
            0 => Step::Full,
            n => Step::Inflate(n),
        }
    } else if actual > target {
        Step::Deflate((actual - target).min(batch))
    } else {
        Step::Idle
    }
}

/// The frame number of a page address, if it is 4 KiB aligned and fits in a `u32`.
pub fn pfn_of(addr: u64) -> Option<u32> {
    if !addr.is_multiple_of(BALLOON_PAGE_SIZE) {
        return None;
    }
    u32::try_from(addr / BALLOON_PAGE_SIZE).ok()
}

/// Writes `pfns` as the little-endian payload of one request and returns its length.
pub fn encode_pfns(pfns: &[u32], out: &mut [u8; PFNS_PER_REQUEST * 4]) -> usize {
    assert!(pfns.len() <= PFNS_PER_REQUEST);
    for (chunk, pfn) in out.chunks_exact_mut(4).zip(pfns) {
        chunk.copy_from_slice(&pfn.to_le_bytes());
    }
    pfns.len() * 4
}

/// What a call of [`Balloon::poll`] did.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Progress {
    /// Pages given to the host by this call.
    pub inflated: u32,
    /// Pages taken back from the host (and returned to the page source) by this call.
    pub deflated: u32,
    /// The device's target, in 4 KiB pages, as read by this call.
    pub target: u32,
    /// The balloon's size after this call, in 4 KiB pages.
    pub actual: u32,
}

impl Progress {
    /// Pages moved by this call, in either direction.
    pub fn moved(&self) -> u32 {
        self.inflated + self.deflated
    }

    /// Whether the balloon is at the device's target.
    pub fn at_target(&self) -> bool {
        self.actual == self.target
    }
}

/// Errors of the balloon driver.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Error {
    /// The transport is not a memory balloon.
    WrongDeviceType(DeviceType),
    /// The device did not keep `FEATURES_OK` after feature negotiation.
    FeaturesRejected {
        /// Features the device offered.
        offered: u64,
        /// Features the driver wrote.
        accepted: u64,
    },
    /// virtio-drivers reported an error (queue set-up, full queue, wrong token, ...).
    Virtio(virtio_drivers::Error),
    /// The page source gave an address that is not 4 KiB aligned or is above
    /// 16 TiB. It was given back, with the other pages of the request.
    BadPage(u64),
    /// The device set `DEVICE_NEEDS_RESET` while the driver waited for a buffer.
    DeviceNeedsReset,
    /// The device did not use a buffer within the wait limit.
    Timeout,
    /// An earlier error reset the device: the driver does nothing more.
    Broken,
}

impl From<virtio_drivers::Error> for Error {
    fn from(e: virtio_drivers::Error) -> Self {
        Error::Virtio(e)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::WrongDeviceType(t) => write!(f, "not a balloon device: {t:?}"),
            Error::FeaturesRejected { offered, accepted } => write!(
                f,
                "device refused features {accepted:#x} (offered {offered:#x})"
            ),
            Error::Virtio(e) => write!(f, "virtio: {e}"),
            Error::BadPage(a) => write!(f, "page source gave unusable page {a:#x}"),
            Error::DeviceNeedsReset => write!(f, "device needs reset"),
            Error::Timeout => write!(f, "device did not use the buffer in time"),
            Error::Broken => write!(f, "balloon device was reset after an error"),
        }
    }
}

/// A virtio balloon driver.
///
/// `S` holds the frame numbers of the ballooned pages, one `u32` per page (see
/// the crate documentation).
pub struct Balloon<H: Hal, T: Transport, S: AsMut<[u32]> = &'static mut [u32]> {
    transport: T,
    inflateq: VirtQueue<H, QUEUE_SIZE>,
    deflateq: VirtQueue<H, QUEUE_SIZE>,
    statsq: Option<VirtQueue<H, QUEUE_SIZE>>,
    hintq: Option<VirtQueue<H, QUEUE_SIZE>>,
    reportq: Option<VirtQueue<H, QUEUE_SIZE>>,
    /// The statistics buffer: one DMA page, so that it stays put while the
    /// device holds it (the `Balloon` itself may move).
    stats_page: Option<(PhysAddr, NonNull<u8>)>,
    /// The token and length of the statistics buffer while the device holds it.
    stats_held: Option<(u16, usize)>,
    features: u64,
    poison_val: u32,
    ballooned: S,
    actual: u32,
    stranded: u32,
    /// The last hinting command id answered.
    hint_answered: u32,
    /// The target when the balloon last deflated on OOM: no inflating until
    /// the host sets another (as Linux, which re-inflates only on a config
    /// change).
    oom_target: Option<u32>,
    oom_deflated: u64,
    wait_limit: Option<u64>,
    broken: bool,
    _hal: PhantomData<H>,
}

impl<H: Hal, T: Transport, S: AsMut<[u32]>> Balloon<H, T, S> {
    /// Initialises the balloon device behind `transport` with the basic
    /// features ([`features::BASIC`]): resets it, negotiates features, sets up
    /// inflateq (0) and deflateq (1), sets `DRIVER_OK` and writes `actual = 0`.
    ///
    /// `ballooned` is the storage for the frame numbers of ballooned pages; its
    /// length is the most pages the balloon will take.
    pub fn new(transport: T, ballooned: S) -> Result<Self, Error> {
        Self::with_options(transport, ballooned, Options::default())
    }

    /// [`Self::new`] asking for `options.features`: every queue of a
    /// negotiated feature is set up, and with PAGE_POISON `poison_val` is
    /// written before `DRIVER_OK`.
    pub fn with_options(mut transport: T, ballooned: S, options: Options) -> Result<Self, Error> {
        let device_type = transport.device_type();
        if device_type != DeviceType::MemoryBalloon {
            return Err(Error::WrongDeviceType(device_type));
        }
        transport.set_status(DeviceStatus::empty());
        transport.set_status(DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER);
        let offered = transport.read_device_features();
        let accepted = negotiate(offered, options.features);
        transport.write_driver_features(accepted);
        let status = DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER | DeviceStatus::FEATURES_OK;
        transport.set_status(status);
        if !transport.get_status().contains(DeviceStatus::FEATURES_OK) {
            transport.set_status(status | DeviceStatus::FAILED);
            return Err(Error::FeaturesRejected { offered, accepted });
        }
        // Only a legacy transport uses it; harmless on a modern one.
        transport.set_guest_page_size(BALLOON_PAGE_SIZE as u32);

        let fail = |transport: &mut T, e: Error| {
            transport.set_status(status | DeviceStatus::FAILED);
            e
        };
        let queue = |transport: &mut T, q: Queue| -> Result<_, Error> {
            match queue_index(accepted, q) {
                Some(index) => Ok(Some(VirtQueue::new(transport, index, false, false)?)),
                None => Ok(None),
            }
        };
        let mut queues = [None, None, None, None, None];
        for (slot, q) in queues.iter_mut().zip([
            Queue::Inflate,
            Queue::Deflate,
            Queue::Stats,
            Queue::FreePageHint,
            Queue::Reporting,
        ]) {
            *slot = queue(&mut transport, q).map_err(|e| fail(&mut transport, e))?;
        }
        let [Some(inflateq), Some(deflateq), statsq, hintq, reportq] = queues else {
            unreachable!("inflateq and deflateq always exist");
        };
        let poison_val = if accepted & features::PAGE_POISON != 0 {
            // Before DRIVER_OK: the device freezes it then.
            if let Err(e) =
                transport.write_config_space(CONFIG_POISON_VAL, options.poison_val.to_le())
            {
                return Err(fail(&mut transport, e.into()));
            }
            options.poison_val
        } else {
            0
        };
        let stats_page = statsq
            .is_some()
            .then(|| H::dma_alloc(1, virtio_drivers::BufferDirection::DriverToDevice));
        transport.set_status(status | DeviceStatus::DRIVER_OK);

        let mut balloon = Balloon {
            transport,
            inflateq,
            deflateq,
            statsq,
            hintq,
            reportq,
            stats_page,
            stats_held: None,
            features: accepted,
            poison_val,
            ballooned,
            actual: 0,
            stranded: 0,
            hint_answered: HINT_CMD_ID_STOP,
            oom_target: None,
            oom_deflated: 0,
            wait_limit: None,
            broken: false,
            _hal: PhantomData,
        };
        balloon.write_actual()?;
        Ok(balloon)
    }

    /// The features negotiated with the device.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Whether `feature` (a bit of [`features`]) was negotiated.
    pub fn has(&self, feature: u64) -> bool {
        self.features & feature == feature
    }

    /// The value written to `poison_val` (0 without PAGE_POISON): what pages
    /// the host backs again read as.
    pub fn poison_val(&self) -> u32 {
        self.poison_val
    }

    /// The device's target balloon size in 4 KiB pages (`num_pages` in config).
    pub fn target_pages(&self) -> Result<u32, Error> {
        let raw: u32 = self.transport.read_config_space(CONFIG_NUM_PAGES)?;
        Ok(u32::from_le(raw))
    }

    /// The device's free page hinting command id (0 without FREE_PAGE_HINT).
    pub fn hint_cmd_id(&self) -> Result<u32, Error> {
        if !self.has(features::FREE_PAGE_HINT) {
            return Ok(HINT_CMD_ID_STOP);
        }
        let raw: u32 = self.transport.read_config_space(CONFIG_HINT_CMD_ID)?;
        Ok(u32::from_le(raw))
    }

    /// The balloon's size in 4 KiB pages (what the driver last wrote to `actual`).
    pub fn actual_pages(&self) -> u32 {
        self.actual
    }

    /// Pages deflated on out-of-memory calls so far.
    pub fn oom_deflated_pages(&self) -> u64 {
        self.oom_deflated
    }

    /// The most pages this balloon can hold (the length of its storage).
    pub fn capacity(&mut self) -> u32 {
        u32::try_from(self.ballooned.as_mut().len()).unwrap_or(u32::MAX)
    }

    /// The frame numbers of the pages in the balloon, oldest first.
    pub fn ballooned_pfns(&mut self) -> &[u32] {
        let actual = self.actual as usize;
        &self.ballooned.as_mut()[..actual]
    }

    /// Pages lost in a request that failed while the device held it.
    pub fn stranded_pages(&self) -> u32 {
        self.stranded
    }

    /// Bounds how long the driver waits for the device to use a buffer, in
    /// waits (with [`Spin`]: polls of the used ring; with an interrupt-driven
    /// [`Wait`]: wake-ups); `None` (the default) waits for ever, as Linux does.
    pub fn set_wait_limit(&mut self, spins: Option<u64>) {
        self.wait_limit = spins;
    }

    /// The transport, e.g. to acknowledge interrupts.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Acknowledges the device's interrupts (until InterruptStatus reads 0)
    /// and returns what it reported: for a guest's own interrupt handler.
    pub fn acknowledge_interrupt(&mut self) -> InterruptStatus {
        acknowledge_all(&mut self.transport)
    }

    /// Waits once for the device through `wait` (for a new target, a hinting
    /// run or the statistics buffer while the balloon has nothing to do) and
    /// returns the interrupts the device reported meanwhile:
    /// `DEVICE_CONFIGURATION_INTERRUPT` when the config changed,
    /// `QUEUE_INTERRUPT` when it used a buffer; empty if the wait ended for
    /// another reason.
    pub fn idle(&mut self, wait: &mut impl Wait) -> InterruptStatus {
        let transport = &mut self.transport;
        let mut seen = InterruptStatus::empty();
        wait.wait(&mut || seen |= acknowledge_all(transport));
        seen
    }

    /// Moves the balloon at most one request (256 pages) towards the device's
    /// target and says what it did, spinning on the used ring while the device
    /// works ([`Self::poll_with`] and [`Spin`]). Call it again until `moved()`
    /// is 0.
    ///
    /// When the page source runs dry, or the storage is full, fewer pages (or
    /// none) move and `at_target()` stays false. After [`Self::deflate_on_oom`]
    /// the balloon does not inflate again until the target changes.
    pub fn poll(&mut self, pages: &mut impl PageSource) -> Result<Progress, Error> {
        self.poll_with(pages, &mut Spin)
    }

    /// [`Self::poll`], waiting for the device through `wait`.
    pub fn poll_with(
        &mut self,
        pages: &mut impl PageSource,
        wait: &mut impl Wait,
    ) -> Result<Progress, Error> {
        if self.broken {
            return Err(Error::Broken);
        }
        let target = self.target_pages()?;
        if self.oom_target.is_some_and(|t| t != target) {
            self.oom_target = None;
        }
        let capacity = self.capacity();
        let mut progress = Progress {
            target,
            actual: self.actual,
            ..Progress::default()
        };
        match plan(target, self.actual, capacity) {
            Step::Idle | Step::Full => {}
            Step::Inflate(_) if self.oom_target.is_some() => {}
            Step::Inflate(n) => progress.inflated = self.inflate(n as usize, pages, wait)?,
            Step::Deflate(n) => progress.deflated = self.deflate(n as usize, pages, wait)?,
        }
        progress.actual = self.actual;
        Ok(progress)
    }

    /// The guest's allocator ran out: with DEFLATE_ON_OOM, deflates up to `n`
    /// pages (at most 256, at most the balloon's size) below the target and
    /// returns them to `pages`; returns how many. Without the feature (or
    /// with an empty balloon) it deflates nothing. The balloon then holds off
    /// inflating until the host sets a new target.
    pub fn deflate_on_oom(
        &mut self,
        pages: &mut impl PageSource,
        n: u32,
        wait: &mut impl Wait,
    ) -> Result<u32, Error> {
        if self.broken {
            return Err(Error::Broken);
        }
        if !self.has(features::DEFLATE_ON_OOM) {
            return Ok(0);
        }
        let n = n.min(self.actual).min(PFNS_PER_REQUEST as u32);
        if n == 0 {
            return Ok(0);
        }
        let target = self.target_pages()?;
        let done = self.deflate(n as usize, pages, wait)?;
        self.oom_target = Some(target);
        self.oom_deflated += u64::from(done);
        Ok(done)
    }

    /// Answers the statistics queue (STATS_VQ): the first call primes it
    /// with `source`'s statistics; later calls refill and resend the buffer
    /// once the device has returned it (its way of asking for fresh
    /// figures). Returns whether it sent statistics. Never waits.
    pub fn answer_stats(&mut self, source: &mut impl StatsSource) -> Result<bool, Error> {
        if self.broken {
            return Err(Error::Broken);
        }
        let (Some(q), Some((_, page))) = (self.statsq.as_mut(), self.stats_page) else {
            return Ok(false);
        };
        let index = queue_index(self.features, Queue::Stats).expect("statsq exists");
        if let Some((token, len)) = self.stats_held {
            if !q.can_pop() {
                return Ok(false);
            }
            // SAFETY: the DMA page lives as long as the driver; `len` is what
            // was added with this token.
            let buf = unsafe { core::slice::from_raw_parts(page.as_ptr(), len) };
            // SAFETY: the same buffer as given to `add` for this token.
            let used = unsafe { q.pop_used(token, &[buf], &mut []) };
            self.stats_held = None;
            if let Err(e) = used {
                self.transport.set_status(DeviceStatus::empty());
                self.broken = true;
                return Err(e.into());
            }
        }
        let mut stats = MemoryStats::default();
        source.memory_stats(&mut stats);
        let mut bytes = [0u8; MAX_STATS * STAT_ENTRY_BYTES];
        // A buffer must not be empty: an empty source sends free memory 0.
        if stats.entries().is_empty() {
            stats.set(stat::FREE_MEMORY, 0);
        }
        let len = stats.encode(&mut bytes);
        // SAFETY: the DMA page is at least 4 KiB, owned by the driver, and
        // the device does not hold it (no buffer in flight).
        let buf = unsafe { core::slice::from_raw_parts_mut(page.as_ptr(), len) };
        buf.copy_from_slice(&bytes[..len]);
        let buf = &*buf;
        // SAFETY: the DMA page stays valid until the device returns it or
        // is reset (`Drop`), and the driver does not touch it meanwhile.
        let token = unsafe { q.add(&[buf], &mut []) }?;
        self.stats_held = Some((token, len));
        if q.should_notify() {
            self.transport.notify(index);
        }
        Ok(true)
    }

    /// Answers a free page hinting run (FREE_PAGE_HINT) if the device shows a
    /// new command id: sends the id, then `frames`' free blocks of at least
    /// 2^`min_order` pages (at most [`HINT_MAX_BLOCKS`]) one buffer each,
    /// then STOP; stops early if the device's id changes (the host stopped
    /// the run). Returns `None` if there was no new run.
    ///
    /// The host may discard hinted pages at once: the guest keeps using its
    /// allocator as usual, and a hinted page it reuses reads as zero (or
    /// the poison value).
    pub fn answer_hint(
        &mut self,
        frames: &mut impl FrameAllocator,
        min_order: u32,
        wait: &mut impl Wait,
    ) -> Result<Option<HintAnswer>, Error> {
        if self.broken {
            return Err(Error::Broken);
        }
        if self.hintq.is_none() {
            return Ok(None);
        }
        let id = self.hint_cmd_id()?;
        if id <= HINT_CMD_ID_DONE || id == self.hint_answered {
            return Ok(None);
        }
        self.hint_answered = id;
        let mut answer = HintAnswer {
            id,
            ..HintAnswer::default()
        };
        let id_bytes = id.to_le_bytes();
        self.transfer(Queue::FreePageHint, &[&id_bytes], &mut [], wait)?;
        let mut blocks = [(0u64, 0u32); HINT_MAX_BLOCKS];
        let mut n = 0;
        frames.free_blocks(min_order.min(MAX_BLOCK_ORDER), &mut |addr, order| {
            if order <= MAX_BLOCK_ORDER {
                blocks[n] = (addr, order);
                n += 1;
            }
            n < HINT_MAX_BLOCKS
        });
        for &(addr, order) in &blocks[..n] {
            if self.hint_cmd_id()? != id {
                answer.stopped_by_host = true;
                break;
            }
            // SAFETY: a free block of `frames`, which is borrowed mutably
            // for the whole call, so nothing allocates or touches it; the
            // device may overwrite or discard it, which a free block allows.
            let block = unsafe { block_slice(addr, order) };
            self.transfer(Queue::FreePageHint, &[], &mut [block], wait)?;
            answer.blocks += 1;
            answer.pages += 1 << order;
        }
        let stop = HINT_CMD_ID_STOP.to_le_bytes();
        self.transfer(Queue::FreePageHint, &[&stop], &mut [], wait)?;
        Ok(Some(answer))
    }

    /// Reports the free blocks of `frames` not reported yet (PAGE_REPORTING),
    /// [`REPORT_BATCH`] per report, until none is left or `frames` cannot
    /// remember more; the host takes their memory back, and a page of them
    /// reads as zero (or the poison value) when the guest uses it again.
    pub fn report_free<A: FrameAllocator, const N: usize>(
        &mut self,
        frames: &mut Reporting<A, N>,
        wait: &mut impl Wait,
    ) -> Result<Reported, Error> {
        if self.broken {
            return Err(Error::Broken);
        }
        let mut done = Reported::default();
        if self.reportq.is_none() {
            return Ok(done);
        }
        loop {
            let mut blocks = [(0u64, 0u32); REPORT_BATCH];
            let n = frames.unreported(&mut blocks);
            if n == 0 {
                return Ok(done);
            }
            let mut slices: [&mut [u8]; REPORT_BATCH] = Default::default();
            for (slice, &(addr, order)) in slices.iter_mut().zip(&blocks[..n]) {
                // SAFETY: distinct free blocks of `frames`, which is borrowed
                // mutably for the whole call, so nothing allocates or touches
                // them while the device holds them.
                *slice = unsafe { block_slice(addr, order) };
            }
            self.transfer(Queue::Reporting, &[], &mut slices[..n], wait)?;
            frames.remember(&blocks[..n]);
            done.reports += 1;
            done.blocks += n as u32;
            done.pages += blocks[..n].iter().map(|&(_, o)| 1u64 << o).sum::<u64>();
        }
    }

    fn inflate(
        &mut self,
        n: usize,
        pages: &mut impl PageSource,
        wait: &mut impl Wait,
    ) -> Result<u32, Error> {
        let mut pfns = [0u32; PFNS_PER_REQUEST];
        let mut got = 0;
        while got < n {
            let Some(addr) = pages.take_page() else { break };
            match pfn_of(addr) {
                Some(pfn) => {
                    pfns[got] = pfn;
                    got += 1;
                }
                None => {
                    pages.return_page(addr);
                    for &pfn in &pfns[..got] {
                        pages.return_page(u64::from(pfn) * BALLOON_PAGE_SIZE);
                    }
                    return Err(Error::BadPage(addr));
                }
            }
        }
        if got == 0 {
            return Ok(0);
        }
        if let Err(e) = self.send(Queue::Inflate, &pfns[..got], wait) {
            self.stranded += got as u32;
            return Err(e);
        }
        let start = self.actual as usize;
        self.ballooned.as_mut()[start..start + got].copy_from_slice(&pfns[..got]);
        self.actual += got as u32;
        self.write_actual()?;
        Ok(got as u32)
    }

    fn deflate(
        &mut self,
        n: usize,
        pages: &mut impl PageSource,
        wait: &mut impl Wait,
    ) -> Result<u32, Error> {
        let end = self.actual as usize;
        let mut pfns = [0u32; PFNS_PER_REQUEST];
        pfns[..n].copy_from_slice(&self.ballooned.as_mut()[end - n..end]);
        // On failure the pages are still the host's: they stay in the balloon.
        self.send(Queue::Deflate, &pfns[..n], wait)?;
        // The device has used the buffer: only now may the guest reuse the pages.
        self.actual -= n as u32;
        self.write_actual()?;
        for &pfn in &pfns[..n] {
            pages.return_page(u64::from(pfn) * BALLOON_PAGE_SIZE);
        }
        Ok(n as u32)
    }

    /// Sends one inflate or deflate request and waits until the device has used it.
    fn send(&mut self, queue: Queue, pfns: &[u32], wait: &mut impl Wait) -> Result<(), Error> {
        let mut buf = [0u8; PFNS_PER_REQUEST * 4];
        let len = encode_pfns(pfns, &mut buf);
        self.transfer(queue, &[&buf[..len]], &mut [], wait)
    }

    /// Adds one chain to `queue`, notifies, and waits until the device has
    /// used it. On a device failure the device is reset and the driver is
    /// broken.
    fn transfer<'a>(
        &mut self,
        queue: Queue,
        inputs: &'a [&'a [u8]],
        outputs: &'a mut [&'a mut [u8]],
        wait: &mut impl Wait,
    ) -> Result<(), Error> {
        let index = queue_index(self.features, queue).expect("only negotiated queues are used");
        let q = match queue {
            Queue::Inflate => &mut self.inflateq,
            Queue::Deflate => &mut self.deflateq,
            Queue::FreePageHint => self.hintq.as_mut().expect("hintq exists"),
            Queue::Reporting => self.reportq.as_mut().expect("reportq exists"),
            Queue::Stats => unreachable!("the statistics buffer is never waited for"),
        };
        let transport = &mut self.transport;
        // SAFETY: the buffers live until this function returns, and it does not
        // return before `pop_used` has taken them back, or the device has been
        // reset (after which it no longer reads or writes them).
        let token = unsafe { q.add(inputs, &mut *outputs) }?;
        if q.should_notify() {
            transport.notify(index);
        }
        let mut waits: u64 = 0;
        while !q.can_pop() {
            let mut seen = InterruptStatus::empty();
            wait.wait(&mut || seen |= acknowledge_all(transport));
            waits += 1;
            // A device that needs a reset says so with a config-change
            // interrupt; a spinning driver looks now and then.
            let check_status = seen.contains(InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT)
                || waits.is_multiple_of(1024);
            let failure = if check_status
                && transport
                    .get_status()
                    .contains(DeviceStatus::DEVICE_NEEDS_RESET)
            {
                Some(Error::DeviceNeedsReset)
            } else if self.wait_limit.is_some_and(|limit| waits >= limit) {
                Some(Error::Timeout)
            } else {
                None
            };
            if let Some(e) = failure {
                // Reset the device so that it stops using the buffers and rings.
                transport.set_status(DeviceStatus::empty());
                self.broken = true;
                return Err(e);
            }
        }
        // SAFETY: the same buffers as given to `add` for this token.
        let used = unsafe { q.pop_used(token, inputs, outputs) };
        if let Err(e) = used {
            transport.set_status(DeviceStatus::empty());
            self.broken = true;
            return Err(e.into());
        }
        Ok(())
    }

    fn write_actual(&mut self) -> Result<(), Error> {
        self.transport
            .write_config_space(CONFIG_ACTUAL, self.actual.to_le())?;
        Ok(())
    }
}

impl<H: Hal, T: Transport, S: AsMut<[u32]>> Drop for Balloon<H, T, S> {
    fn drop(&mut self) {
        if let Some((paddr, vaddr)) = self.stats_page.take() {
            if self.stats_held.is_some() {
                // The device holds the statistics buffer: reset it first.
                self.transport.set_status(DeviceStatus::empty());
            }
            // SAFETY: allocated by `H::dma_alloc(1, ..)` in `with_options`;
            // the device no longer holds it.
            unsafe { H::dma_dealloc(paddr, vaddr, 1) };
        }
    }
}

/// The memory of a free block as a byte slice.
///
/// # Safety
///
/// `addr` must be the identity-mapped address of 2^`order` 4 KiB pages that
/// nothing else references while the slice lives.
unsafe fn block_slice<'a>(addr: u64, order: u32) -> &'a mut [u8] {
    let len = (BALLOON_PAGE_SIZE << order) as usize;
    // SAFETY: the caller's promise.
    unsafe { core::slice::from_raw_parts_mut(addr as usize as *mut u8, len) }
}

#[cfg(test)]
mod tests;
