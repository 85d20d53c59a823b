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
//! [`MmioTransport`](virtio_drivers::transport::mmio::MmioTransport)) and two
//! split [`VirtQueue`]s. It needs no heap (virtio-drivers is used without its
//! `alloc` feature), no interrupts (the guest calls [`Balloon::poll`] now and
//! then) and no timer.
//!
//! # What the guest provides
//!
//! * a [`Hal`] that gives out zeroed, page-aligned DMA memory for the two
//!   queues (four pages at most) and turns a buffer address into a
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
//! * Features: the driver accepts `VIRTIO_F_VERSION_1` and
//!   `VIRTIO_BALLOON_F_MUST_TELL_HOST` when offered and nothing else, whatever
//!   else the device offers; it checks that the device keeps `FEATURES_OK`.
//! * Queues: inflateq is queue 0 and deflateq queue 1; statsq,
//!   free_page_vq and reporting_vq would follow, each present only if its
//!   feature was negotiated ([`queue_index`]). This driver sets up only the first
//!   two.
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

pub use virtio_drivers;
use virtio_drivers::queue::VirtQueue;
pub use virtio_drivers::transport::InterruptStatus;
use virtio_drivers::transport::{DeviceStatus, DeviceType, Transport};
pub use virtio_drivers::Hal;

/// Size of a balloon page, whatever the guest's own page size.
pub const BALLOON_PAGE_SIZE: u64 = 4096;

/// Most frame numbers sent in one inflate or deflate request (as Linux does).
pub const PFNS_PER_REQUEST: usize = 256;

/// Descriptors per virtqueue. The driver has one buffer in flight at a time;
/// a device must offer at least this many (QEMU offers 128).
pub const QUEUE_SIZE: usize = 4;

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
    /// Everything this driver accepts when the device offers it.
    pub const SUPPORTED: u64 = MUST_TELL_HOST | VERSION_1;
}

/// Offset of `num_pages` (the device's target) in the config space.
const CONFIG_NUM_PAGES: usize = 0;
/// Offset of `actual` (written by the driver) in the config space.
const CONFIG_ACTUAL: usize = 4;

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

/// The features the driver accepts from those the device offers.
pub fn negotiate(offered: u64) -> u64 {
    offered & features::SUPPORTED
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
    features: u64,
    ballooned: S,
    actual: u32,
    stranded: u32,
    wait_limit: Option<u64>,
    broken: bool,
    _hal: PhantomData<H>,
}

impl<H: Hal, T: Transport, S: AsMut<[u32]>> Balloon<H, T, S> {
    /// Initialises the balloon device behind `transport`: resets it, negotiates
    /// features, sets up inflateq (0) and deflateq (1), sets `DRIVER_OK` and
    /// writes `actual = 0`.
    ///
    /// `ballooned` is the storage for the frame numbers of ballooned pages; its
    /// length is the most pages the balloon will take.
    pub fn new(mut transport: T, ballooned: S) -> Result<Self, Error> {
        let device_type = transport.device_type();
        if device_type != DeviceType::MemoryBalloon {
            return Err(Error::WrongDeviceType(device_type));
        }
        transport.set_status(DeviceStatus::empty());
        transport.set_status(DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER);
        let offered = transport.read_device_features();
        let accepted = negotiate(offered);
        transport.write_driver_features(accepted);
        let status = DeviceStatus::ACKNOWLEDGE | DeviceStatus::DRIVER | DeviceStatus::FEATURES_OK;
        transport.set_status(status);
        if !transport.get_status().contains(DeviceStatus::FEATURES_OK) {
            transport.set_status(status | DeviceStatus::FAILED);
            return Err(Error::FeaturesRejected { offered, accepted });
        }
        // Only a legacy transport uses it; harmless on a modern one.
        transport.set_guest_page_size(BALLOON_PAGE_SIZE as u32);

        let queues = queue_index(accepted, Queue::Inflate)
            .zip(queue_index(accepted, Queue::Deflate))
            .expect("inflateq and deflateq always exist");
        let inflateq = VirtQueue::new(&mut transport, queues.0, false, false);
        let deflateq = VirtQueue::new(&mut transport, queues.1, false, false);
        let (inflateq, deflateq) = match (inflateq, deflateq) {
            (Ok(i), Ok(d)) => (i, d),
            (Err(e), _) | (_, Err(e)) => {
                transport.set_status(status | DeviceStatus::FAILED);
                return Err(e.into());
            }
        };
        transport.set_status(status | DeviceStatus::DRIVER_OK);

        let mut balloon = Balloon {
            transport,
            inflateq,
            deflateq,
            features: accepted,
            ballooned,
            actual: 0,
            stranded: 0,
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

    /// The device's target balloon size in 4 KiB pages (`num_pages` in config).
    pub fn target_pages(&self) -> Result<u32, Error> {
        let raw: u32 = self.transport.read_config_space(CONFIG_NUM_PAGES)?;
        Ok(u32::from_le(raw))
    }

    /// The balloon's size in 4 KiB pages (what the driver last wrote to `actual`).
    pub fn actual_pages(&self) -> u32 {
        self.actual
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

    /// Waits once for the device through `wait` (for a new target while the
    /// balloon has nothing to do) and returns the interrupts the device
    /// reported meanwhile: `DEVICE_CONFIGURATION_INTERRUPT` when the config
    /// (the target) changed; empty if the wait ended for another reason.
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
    /// none) move and `at_target()` stays false.
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
        let capacity = self.capacity();
        let mut progress = Progress {
            target,
            actual: self.actual,
            ..Progress::default()
        };
        match plan(target, self.actual, capacity) {
            Step::Idle | Step::Full => {}
            Step::Inflate(n) => progress.inflated = self.inflate(n as usize, pages, wait)?,
            Step::Deflate(n) => progress.deflated = self.deflate(n as usize, pages, wait)?,
        }
        progress.actual = self.actual;
        Ok(progress)
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

    /// Sends one request and waits until the device has used it.
    fn send(&mut self, queue: Queue, pfns: &[u32], wait: &mut impl Wait) -> Result<(), Error> {
        let mut buf = [0u8; PFNS_PER_REQUEST * 4];
        let len = encode_pfns(pfns, &mut buf);
        let index = queue_index(self.features, queue).expect("inflateq and deflateq exist");
        let q = match queue {
            Queue::Inflate => &mut self.inflateq,
            _ => &mut self.deflateq,
        };
        let transport = &mut self.transport;
        let inputs = [&buf[..len]];
        // SAFETY: `buf` lives until this function returns, and it does not return
        // before `pop_used` has taken the buffer back, or the device has been
        // reset (after which it no longer reads the buffer).
        let token = unsafe { q.add(&inputs, &mut []) }?;
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
                // Reset the device so that it stops reading `buf` and the ring.
                transport.set_status(DeviceStatus::empty());
                self.broken = true;
                return Err(e);
            }
        }
        // SAFETY: the same buffers as given to `add` for this token.
        let used = unsafe { q.pop_used(token, &inputs, &mut []) };
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

#[cfg(test)]
mod tests;
