//! Host tests: the pure parts, and the whole driver against a fake balloon
//! device that reads the real split virtqueues virtio-drivers builds.

use super::*;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ptr::NonNull;
use std::rc::Rc;
use virtio_drivers::transport::InterruptStatus;
use virtio_drivers::{BufferDirection, PhysAddr, PAGE_SIZE};
use zerocopy::{FromBytes, Immutable, IntoBytes};

// ---------------------------------------------------------------- pure parts

#[test]
fn plan_batches_by_256_and_respects_capacity() {
    assert_eq!(plan(0, 0, 1000), Step::Idle);
    assert_eq!(plan(5, 5, 1000), Step::Idle);
    assert_eq!(plan(600, 0, 1000), Step::Inflate(256));
    assert_eq!(plan(600, 512, 1000), Step::Inflate(88));
    assert_eq!(plan(600, 0, 100), Step::Inflate(100));
    assert_eq!(plan(600, 100, 100), Step::Full);
    // More in the balloon than it can hold (storage shrunk): nothing to do upwards.
    assert_eq!(plan(600, 200, 100), Step::Full);
    assert_eq!(plan(0, 600, 1000), Step::Deflate(256));
    assert_eq!(plan(500, 600, 1000), Step::Deflate(100));
    assert_eq!(plan(u32::MAX, 0, u32::MAX), Step::Inflate(256));
    assert_eq!(plan(0, u32::MAX, u32::MAX), Step::Deflate(256));
}

#[test]
fn pfns_are_4k_frames_that_fit_u32() {
    assert_eq!(pfn_of(0x4000_0000), Some(0x40000));
    assert_eq!(pfn_of(0x4000_0800), None);
    assert_eq!(pfn_of(0xfff_ffff_f000), Some(u32::MAX));
    assert_eq!(pfn_of(0x1000_0000_0000), None);
    // No sign extension anywhere: the top PFN stays unsigned.
    assert_eq!(
        u64::from(pfn_of(0x0800_0000_0000).unwrap()) * 4096,
        0x0800_0000_0000
    );
}

#[test]
fn encoding_is_little_endian_u32() {
    let mut buf = [0u8; 1024];
    assert_eq!(encode_pfns(&[0x12345678, 0x80000001], &mut buf), 8);
    assert_eq!(&buf[..8], &[0x78, 0x56, 0x34, 0x12, 0x01, 0, 0, 0x80]);
    let all = [7u32; 256];
    assert_eq!(encode_pfns(&all, &mut buf), 1024);
}

#[test]
fn queue_numbering_skips_absent_queues() {
    use features::*;
    assert_eq!(queue_index(0, Queue::Inflate), Some(0));
    assert_eq!(queue_index(0, Queue::Deflate), Some(1));
    assert_eq!(queue_index(0, Queue::Stats), None);
    assert_eq!(queue_index(0, Queue::Reporting), None);
    assert_eq!(queue_index(PAGE_REPORTING, Queue::Reporting), Some(2));
    assert_eq!(
        queue_index(STATS_VQ | PAGE_REPORTING, Queue::Reporting),
        Some(3)
    );
    assert_eq!(
        queue_index(FREE_PAGE_HINT | PAGE_REPORTING, Queue::FreePageHint),
        Some(2)
    );
    let all = STATS_VQ | FREE_PAGE_HINT | PAGE_REPORTING;
    assert_eq!(queue_index(all, Queue::Stats), Some(2));
    assert_eq!(queue_index(all, Queue::FreePageHint), Some(3));
    assert_eq!(queue_index(all, Queue::Reporting), Some(4));
}

#[test]
fn negotiation_keeps_only_what_the_driver_implements() {
    let offered = u64::MAX;
    assert_eq!(
        negotiate(offered, features::BASIC),
        features::VERSION_1 | features::MUST_TELL_HOST
    );
    assert_eq!(
        negotiate(features::STATS_VQ | 1 << 28 | 1 << 29, features::BASIC),
        0
    );
    assert_eq!(
        negotiate(features::VERSION_1, features::BASIC),
        features::VERSION_1
    );
    // Everything wanted: only the six balloon features and VERSION_1 are taken.
    assert_eq!(negotiate(offered, u64::MAX), features::SUPPORTED);
    // Wanted but not offered: not taken; VERSION_1 taken even if not asked for.
    assert_eq!(
        negotiate(
            features::VERSION_1 | features::STATS_VQ,
            features::PAGE_REPORTING
        ),
        features::VERSION_1
    );
}

#[test]
fn progress_helpers() {
    let p = Progress {
        inflated: 3,
        deflated: 0,
        target: 10,
        actual: 10,
    };
    assert_eq!(p.moved(), 3);
    assert!(p.at_target());
}

// ---------------------------------------------------------------- fake device

/// DMA from the host heap; "physical" addresses are host addresses.
struct TestHal;

// SAFETY: `dma_alloc` returns zeroed, page-aligned, unaliased memory from the
// global allocator; buffers are shared in place (the identity mapping).
unsafe impl Hal for TestHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        let layout = Layout::from_size_align(pages * PAGE_SIZE, PAGE_SIZE).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
        (ptr.as_ptr() as PhysAddr, ptr)
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, vaddr: NonNull<u8>, pages: usize) -> i32 {
        let layout = Layout::from_size_align(pages * PAGE_SIZE, PAGE_SIZE).unwrap();
        // SAFETY: allocated by `dma_alloc` with the same layout.
        unsafe { dealloc(vaddr.as_ptr(), layout) };
        0
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        NonNull::new(paddr as *mut u8).unwrap()
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> PhysAddr {
        buffer.as_ptr() as *mut u8 as PhysAddr
    }

    unsafe fn unshare(_paddr: PhysAddr, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}

#[derive(Default, Clone, Copy)]
struct FakeQueue {
    size: u32,
    desc: u64,
    avail: u64,
    used: u64,
    last_avail: u16,
}

/// How the fake device misbehaves.
#[derive(Default, Clone, Copy, PartialEq)]
enum Mode {
    #[default]
    Good,
    /// Clears FEATURES_OK unless the driver accepted everything offered.
    RejectPartialFeatures,
    /// Never uses a buffer and sets NEEDS_RESET on notify.
    NeedsReset,
    /// Never uses a buffer.
    Silent,
    /// Uses buffers only when the test says (`deliver`), as a device working
    /// while the guest sleeps.
    Deferred,
}

#[derive(Default)]
struct Device {
    mode: Mode,
    offered: u64,
    driver_features: u64,
    status: u32,
    queues: [FakeQueue; 5],
    queues_set: BTreeSet<u16>,
    num_pages: u32,
    actual: u32,
    /// Ballooned PFNs as the device sees them.
    inflated: BTreeSet<u32>,
    requests: Vec<(u16, Vec<u32>)>,
    notifies: u32,
    /// InterruptStatus: the device's interrupt line is high while it is not 0.
    interrupt_status: u32,
    /// Bits the device raises right after the driver's next read of
    /// InterruptStatus (an event between the read and the acknowledgement).
    raise_after_read: u32,
    /// InterruptACK does not clear anything (a broken or hostile device).
    stuck_interrupt: bool,
    /// Reads of InterruptStatus.
    status_reads: u32,
    /// Queues notified but not yet processed (`Mode::Deferred`).
    kicked: Vec<u16>,
    /// The guest's free pages: shared with `FakePages` to check MUST_TELL_HOST.
    guest_free: Rc<RefCell<BTreeSet<u64>>>,
    violations: Vec<String>,
    /// Every statistics buffer received, decoded.
    stats: Vec<Vec<(u16, u64)>>,
    /// The head of the statistics buffer the device holds.
    held_stats: Option<u16>,
    /// `free_page_hint_cmd_id` as shown in config.
    hint_cmd_id: u32,
    /// Command ids the driver sent on free_page_vq.
    hint_ids: Vec<u32>,
    /// Hinted blocks `(addr, len)` with the id shown when each arrived.
    hinted: Vec<(u64, u32, u32)>,
    /// Show STOP after this many hinted blocks (the host stops the run).
    stop_hint_after: Option<usize>,
    /// Each report's blocks `(addr, len)`.
    reports: Vec<Vec<(u64, u32)>>,
    /// `poison_val` and whether DRIVER_OK was set when it was written.
    poison: Option<(u32, bool)>,
    /// Mark the next used element with a head the driver never gave.
    bogus_used_head: bool,
    /// The config window's length when shorter than the full 16 bytes
    /// (accesses beyond it fail).
    short_config: Option<usize>,
    /// Show this new run id instead of STOP when `stop_hint_after` fires.
    next_hint_id: Option<u32>,
}

#[derive(Clone)]
struct FakeTransport(Rc<RefCell<Device>>);

/// Reads a `T` at a host address the driver gave the device.
///
/// # Safety
///
/// `addr` must point to a readable, initialised `T` (an address from the ring).
unsafe fn rd<T: Copy>(addr: u64) -> T {
    // SAFETY: the caller's promise; the rings are not necessarily aligned for T
    // in a hostile world, so read unaligned.
    unsafe { (addr as *const T).read_unaligned() }
}

/// One descriptor of a chain, as the device sees it.
#[derive(Clone, Copy, Debug)]
struct Desc {
    addr: u64,
    len: u32,
    writable: bool,
}

/// Follows the chain from `head` (NEXT = 1, WRITE = 2).
fn read_chain(q: &FakeQueue, head: u16) -> Vec<Desc> {
    let mut chain = vec![];
    let mut i = head;
    loop {
        assert!(
            u32::from(i) < q.size && chain.len() < q.size as usize,
            "broken chain"
        );
        let d = q.desc + 16 * u64::from(i);
        // SAFETY: within the descriptor table virtio-drivers allocated.
        let (addr, len, flags, next): (u64, u32, u16, u16) =
            unsafe { (rd(d), rd(d + 8), rd(d + 12), rd(d + 14)) };
        assert_eq!(flags & !3, 0, "no indirect descriptors");
        chain.push(Desc {
            addr,
            len,
            writable: flags & 2 != 0,
        });
        if flags & 1 == 0 {
            return chain;
        }
        i = next;
    }
}

impl Device {
    fn process(&mut self, queue: u16) {
        let q = self.queues[queue as usize];
        assert_ne!(q.size, 0, "notify on a queue that was never set up");
        // SAFETY: the ring addresses came from virtio-drivers' queue set-up,
        // which allocated them with `TestHal::dma_alloc` and keeps them alive.
        let avail_idx: u16 = unsafe { rd(q.avail + 2) };
        let mut last = q.last_avail;
        while last != avail_idx {
            let slot = u64::from(last % q.size as u16);
            // SAFETY: as above, within the avail ring.
            let head: u16 = unsafe { rd(q.avail + 4 + 2 * slot) };
            let chain = read_chain(&q, head);
            let kind = self.kind_of(queue);
            let hold = match kind {
                Queue::Inflate | Queue::Deflate => {
                    self.balloon_request(queue, kind, &chain);
                    false
                }
                Queue::Stats => self.stats_buffer(&chain),
                Queue::FreePageHint => {
                    self.hint_buffer(&chain);
                    false
                }
                Queue::Reporting => {
                    self.report_buffer(&chain);
                    false
                }
            };
            last = last.wrapping_add(1);
            if hold {
                self.held_stats = Some(head);
                continue;
            }
            self.push_used(queue, head);
        }
        self.queues[queue as usize].last_avail = last;
    }

    /// Puts `head` in the used ring of `queue` and raises the queue interrupt.
    fn push_used(&mut self, queue: u16, head: u16) {
        let q = self.queues[queue as usize];
        let head = if std::mem::take(&mut self.bogus_used_head) {
            head.wrapping_add(7) % q.size as u16
        } else {
            head
        };
        // SAFETY: within the used ring, set up like the other rings.
        let used_idx: u16 = unsafe { rd(q.used + 2) };
        let elem = q.used + 4 + 8 * u64::from(used_idx % q.size as u16);
        // SAFETY: within the used ring, which the device owns.
        unsafe {
            (elem as *mut u32).write_unaligned(u32::from(head));
            ((elem + 4) as *mut u32).write_unaligned(0);
            ((q.used + 2) as *mut u16).write_unaligned(used_idx.wrapping_add(1));
        }
        self.interrupt_status |= InterruptStatus::QUEUE_INTERRUPT.bits();
    }

    /// Which queue `index` is, given the negotiated features.
    fn kind_of(&self, index: u16) -> Queue {
        [
            Queue::Inflate,
            Queue::Deflate,
            Queue::Stats,
            Queue::FreePageHint,
            Queue::Reporting,
        ]
        .into_iter()
        .find(|&k| queue_index(self.driver_features, k) == Some(index))
        .expect("notify on a queue that does not exist")
    }

    fn balloon_request(&mut self, queue: u16, kind: Queue, chain: &[Desc]) {
        {
            assert_eq!(chain.len(), 1, "one descriptor per request");
            let Desc {
                addr,
                len,
                writable,
            } = chain[0];
            assert!(!writable, "inflate/deflate buffers are device-readable");
            assert!(len % 4 == 0 && len as usize <= PFNS_PER_REQUEST * 4);
            let pfns: Vec<u32> = (0..u64::from(len / 4))
                // SAFETY: the buffer the driver shared, `len` bytes long.
                .map(|i| u32::from_le(unsafe { rd(addr + 4 * i) }))
                .collect();
            for &pfn in &pfns {
                let page = u64::from(pfn) * 4096;
                if self.guest_free.borrow().contains(&page) {
                    self.violations.push(format!(
                        "queue {queue}: page {page:#x} still free in the guest"
                    ));
                }
                let fresh = match kind {
                    Queue::Inflate => self.inflated.insert(pfn),
                    _ => self.inflated.remove(&pfn),
                };
                if !fresh {
                    self.violations
                        .push(format!("queue {queue}: bad pfn {pfn:#x}"));
                }
            }
            self.requests.push((queue, pfns));
        }
    }

    /// A statistics buffer: decoded and held (returns true).
    fn stats_buffer(&mut self, chain: &[Desc]) -> bool {
        let mut bytes = vec![];
        for d in chain {
            assert!(!d.writable, "statistics are device-readable");
            // SAFETY: the buffer the driver shared, `len` bytes long.
            bytes.extend((0..u64::from(d.len)).map(|i| unsafe { rd::<u8>(d.addr + i) }));
        }
        assert_eq!(bytes.len() % 10, 0, "10-byte entries, packed");
        let entries = bytes
            .chunks_exact(10)
            .map(|e| {
                (
                    u16::from_le_bytes(e[..2].try_into().unwrap()),
                    u64::from_le_bytes(e[2..].try_into().unwrap()),
                )
            })
            .collect();
        self.stats.push(entries);
        if self.held_stats.is_some() {
            self.violations.push("a second statistics buffer".into());
        }
        true
    }

    /// The host asks for fresh statistics: returns the held buffer.
    fn return_stats(&mut self) {
        let head = self.held_stats.take().expect("no statistics buffer held");
        let index = queue_index(self.driver_features, Queue::Stats).unwrap();
        self.push_used(index, head);
    }

    /// A free page hinting buffer: an id, or one device-writable block.
    fn hint_buffer(&mut self, chain: &[Desc]) {
        assert_eq!(chain.len(), 1, "an id or one block per buffer");
        let Desc {
            addr,
            len,
            writable,
        } = chain[0];
        if writable {
            self.hinted.push((addr, len, self.hint_cmd_id));
            if self.hint_cmd_id < 2 {
                self.violations
                    .push(format!("block {addr:#x} hinted outside a run"));
            }
            if self.stop_hint_after == Some(self.hinted.len()) {
                self.hint_cmd_id = self.next_hint_id.unwrap_or(0);
                self.interrupt_status |= InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
            }
            return;
        }
        assert_eq!(len, 4, "command ids are 4 bytes");
        // SAFETY: the buffer the driver shared, 4 bytes long.
        let id = u32::from_le(unsafe { rd(addr) });
        self.hint_ids.push(id);
        if id == 0 {
            // The driver's STOP: the run is done.
            self.hint_cmd_id = 1;
            self.interrupt_status |= InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
        }
    }

    /// The host starts a free page hinting run.
    fn start_hint(&mut self, id: u32) {
        self.hint_cmd_id = id;
        self.interrupt_status |= InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
    }

    /// A free page report: device-writable blocks only.
    fn report_buffer(&mut self, chain: &[Desc]) {
        let mut blocks = vec![];
        for d in chain {
            if !d.writable {
                self.violations
                    .push(format!("report block {:#x} is device-readable", d.addr));
            }
            blocks.push((d.addr, d.len));
        }
        self.reports.push(blocks);
    }

    /// Processes the queues notified so far (`Mode::Deferred`).
    fn deliver(&mut self) {
        for queue in std::mem::take(&mut self.kicked) {
            self.process(queue);
        }
    }

    /// The host sets a new target: config change, with its interrupt.
    fn set_target(&mut self, pages: u32) {
        self.num_pages = pages;
        self.interrupt_status |= InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
    }
}

impl Transport for FakeTransport {
    fn device_type(&self) -> DeviceType {
        DeviceType::MemoryBalloon
    }
    fn read_device_features(&mut self) -> u64 {
        self.0.borrow().offered
    }
    fn write_driver_features(&mut self, driver_features: u64) {
        self.0.borrow_mut().driver_features = driver_features;
    }
    fn max_queue_size(&mut self, _queue: u16) -> u32 {
        128
    }
    fn notify(&mut self, queue: u16) {
        let mut d = self.0.borrow_mut();
        d.notifies += 1;
        match d.mode {
            Mode::Good | Mode::RejectPartialFeatures => d.process(queue),
            Mode::NeedsReset => {
                d.status |= DeviceStatus::DEVICE_NEEDS_RESET.bits();
                d.interrupt_status |= InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
            }
            Mode::Silent => {}
            Mode::Deferred => d.kicked.push(queue),
        }
    }
    fn get_status(&self) -> DeviceStatus {
        DeviceStatus::from_bits_retain(self.0.borrow().status)
    }
    fn set_status(&mut self, status: DeviceStatus) {
        let mut d = self.0.borrow_mut();
        let mut bits = status.bits();
        if bits & DeviceStatus::FEATURES_OK.bits() != 0
            && d.mode == Mode::RejectPartialFeatures
            && d.driver_features != d.offered
        {
            bits &= !DeviceStatus::FEATURES_OK.bits();
        }
        if bits == 0 {
            d.queues = Default::default();
        }
        d.status = bits;
    }
    fn set_guest_page_size(&mut self, guest_page_size: u32) {
        assert_eq!(guest_page_size, 4096);
    }
    fn requires_legacy_layout(&self) -> bool {
        false
    }
    fn queue_set(
        &mut self,
        queue: u16,
        size: u32,
        desc: PhysAddr,
        avail: PhysAddr,
        used: PhysAddr,
    ) {
        let mut d = self.0.borrow_mut();
        d.queues_set.insert(queue);
        d.queues[queue as usize] = FakeQueue {
            size,
            desc,
            avail,
            used,
            last_avail: 0,
        };
    }
    fn queue_unset(&mut self, queue: u16) {
        self.0.borrow_mut().queues[queue as usize] = FakeQueue::default();
    }
    fn queue_used(&mut self, queue: u16) -> bool {
        self.0.borrow().queues[queue as usize].size != 0
    }
    fn ack_interrupt(&mut self) -> InterruptStatus {
        let mut d = self.0.borrow_mut();
        d.status_reads += 1;
        let status = d.interrupt_status;
        d.interrupt_status |= std::mem::take(&mut d.raise_after_read);
        if !d.stuck_interrupt {
            d.interrupt_status &= !status;
        }
        InterruptStatus::from_bits_truncate(status)
    }
    fn read_config_generation(&self) -> u32 {
        0
    }
    fn read_config_space<T: FromBytes + IntoBytes>(
        &self,
        offset: usize,
    ) -> virtio_drivers::Result<T> {
        let d = self.0.borrow();
        let mut config = [0u8; 16];
        config[..4].copy_from_slice(&d.num_pages.to_le_bytes());
        config[4..8].copy_from_slice(&d.actual.to_le_bytes());
        config[8..12].copy_from_slice(&d.hint_cmd_id.to_le_bytes());
        let poison = d.poison.map_or(0, |p| p.0);
        config[12..].copy_from_slice(&poison.to_le_bytes());
        let config = &config[..d.short_config.unwrap_or(16)];
        let bytes = config
            .get(offset..offset + size_of::<T>())
            .ok_or(virtio_drivers::Error::ConfigSpaceTooSmall)?;
        Ok(T::read_from_bytes(bytes).unwrap())
    }
    fn write_config_space<T: IntoBytes + Immutable>(
        &mut self,
        offset: usize,
        value: T,
    ) -> virtio_drivers::Result<()> {
        let value = u32::from_le_bytes(value.as_bytes().try_into().unwrap());
        let mut d = self.0.borrow_mut();
        if offset + 4 > d.short_config.unwrap_or(16) {
            return Err(virtio_drivers::Error::ConfigSpaceTooSmall);
        }
        match offset {
            4 => d.actual = value,
            12 => {
                let late = d.status & DeviceStatus::DRIVER_OK.bits() != 0;
                d.poison = Some((value, late));
            }
            _ => panic!("the driver writes only `actual` and `poison_val`"),
        }
        Ok(())
    }
}

/// A page allocator over a made-up RAM range.
struct FakePages {
    free: Rc<RefCell<BTreeSet<u64>>>,
    returned: Vec<u64>,
}

impl FakePages {
    fn new(base: u64, pages: u64) -> Self {
        FakePages {
            free: Rc::new(RefCell::new((0..pages).map(|i| base + i * 4096).collect())),
            returned: Vec::new(),
        }
    }
    fn len(&self) -> usize {
        self.free.borrow().len()
    }
}

impl PageSource for FakePages {
    fn take_page(&mut self) -> Option<u64> {
        self.free.borrow_mut().pop_last()
    }
    fn return_page(&mut self, addr: u64) {
        assert!(
            self.free.borrow_mut().insert(addr),
            "page {addr:#x} returned twice"
        );
        self.returned.push(addr);
    }
}

const RAM: u64 = 0x4000_0000;

fn device(offered: u64, mode: Mode, pages: &FakePages) -> (FakeTransport, Rc<RefCell<Device>>) {
    let dev = Rc::new(RefCell::new(Device {
        offered,
        mode,
        guest_free: pages.free.clone(),
        ..Device::default()
    }));
    (FakeTransport(dev.clone()), dev)
}

/// Everything a greedy device might offer, including bits nobody implements.
const LOTS: u64 = features::VERSION_1
    | features::MUST_TELL_HOST
    | features::STATS_VQ
    | features::DEFLATE_ON_OOM
    | features::FREE_PAGE_HINT
    | features::PAGE_POISON
    | features::PAGE_REPORTING
    | 1 << 6
    | 1 << 28
    | 1 << 29
    | 1 << 33
    | 1 << 50;

#[test]
fn new_negotiates_and_sets_up_queues_0_and_1() {
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    let d = dev.borrow();
    assert_eq!(
        d.driver_features,
        features::VERSION_1 | features::MUST_TELL_HOST
    );
    assert_eq!(balloon.features(), d.driver_features);
    assert_eq!(d.queues_set, BTreeSet::from([0, 1]));
    let ok = DeviceStatus::ACKNOWLEDGE
        | DeviceStatus::DRIVER
        | DeviceStatus::FEATURES_OK
        | DeviceStatus::DRIVER_OK;
    assert_eq!(d.status, ok.bits());
}

#[test]
fn inflate_and_deflate_through_real_queues() {
    let mut pages = FakePages::new(RAM, 1024);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 1024]).unwrap();

    // Nothing to do at target 0.
    let p = balloon.poll(&mut pages).unwrap();
    assert_eq!(p, Progress::default());

    dev.borrow_mut().num_pages = 600;
    let mut moved = vec![];
    loop {
        let p = balloon.poll(&mut pages).unwrap();
        if p.moved() == 0 {
            assert!(p.at_target());
            break;
        }
        assert_eq!(
            dev.borrow().actual,
            p.actual,
            "actual written after each request"
        );
        moved.push(p.inflated);
    }
    assert_eq!(moved, [256, 256, 88]);
    assert_eq!(balloon.actual_pages(), 600);
    assert_eq!(balloon.target_pages().unwrap(), 600);
    assert_eq!(pages.len(), 1024 - 600);
    {
        let d = dev.borrow();
        assert_eq!(d.inflated.len(), 600);
        assert!(d.requests.iter().all(|(q, _)| *q == 0));
        assert_eq!(
            d.requests.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
            [256, 256, 88]
        );
        // The device's view equals the driver's, and no ballooned page is free.
        let mine: BTreeSet<u32> = balloon.ballooned_pfns().iter().copied().collect();
        assert_eq!(mine, d.inflated);
        assert!(d.violations.is_empty(), "{:?}", d.violations);
    }

    dev.borrow_mut().num_pages = 100;
    let mut moved = vec![];
    loop {
        let p = balloon.poll(&mut pages).unwrap();
        if p.moved() == 0 {
            break;
        }
        moved.push(p.deflated);
    }
    assert_eq!(moved, [256, 244]);
    assert_eq!(balloon.actual_pages(), 100);
    assert_eq!(dev.borrow().actual, 100);
    assert_eq!(pages.len(), 1024 - 100);
    assert_eq!(pages.returned.len(), 500);
    let d = dev.borrow();
    assert_eq!(d.inflated.len(), 100);
    // Deflate requests went to queue 1; the device saw each page while the
    // guest had not yet got it back (MUST_TELL_HOST).
    assert_eq!(d.requests.iter().filter(|(q, _)| *q == 1).count(), 2);
    assert!(d.violations.is_empty(), "{:?}", d.violations);
}

#[test]
fn legacy_device_without_features_works_too() {
    let mut pages = FakePages::new(RAM, 64);
    let (t, dev) = device(
        features::STATS_VQ | features::DEFLATE_ON_OOM,
        Mode::Good,
        &pages,
    );
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 64]).unwrap();
    assert_eq!(dev.borrow().driver_features, 0);
    assert_eq!(dev.borrow().queues_set, BTreeSet::from([0, 1]));
    dev.borrow_mut().num_pages = 10;
    assert_eq!(balloon.poll(&mut pages).unwrap().inflated, 10);
    dev.borrow_mut().num_pages = 0;
    assert_eq!(balloon.poll(&mut pages).unwrap().deflated, 10);
    assert_eq!(pages.len(), 64);
}

#[test]
fn stops_when_the_page_source_runs_dry() {
    let mut pages = FakePages::new(RAM, 10);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 100]).unwrap();
    dev.borrow_mut().num_pages = 100;
    let p = balloon.poll(&mut pages).unwrap();
    assert_eq!((p.inflated, p.actual, p.at_target()), (10, 10, false));
    let p = balloon.poll(&mut pages).unwrap();
    assert_eq!((p.moved(), p.actual), (0, 10));
    assert_eq!(dev.borrow().requests.len(), 1, "no empty requests");
}

#[test]
fn stops_when_the_storage_is_full() {
    let mut pages = FakePages::new(RAM, 100);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, [0u32; 50]).unwrap();
    assert_eq!(balloon.capacity(), 50);
    dev.borrow_mut().num_pages = 80;
    assert_eq!(balloon.poll(&mut pages).unwrap().inflated, 50);
    assert_eq!(balloon.poll(&mut pages).unwrap().moved(), 0);
    assert_eq!(pages.len(), 50);
}

#[test]
fn refused_features_fail_cleanly() {
    let pages = FakePages::new(RAM, 1);
    let (t, dev) = device(LOTS, Mode::RejectPartialFeatures, &pages);
    let err = Balloon::<TestHal, _, _>::new(t, vec![0u32; 1])
        .err()
        .unwrap();
    assert!(matches!(err, Error::FeaturesRejected { offered: LOTS, .. }));
    assert_ne!(dev.borrow().status & DeviceStatus::FAILED.bits(), 0);
}

#[test]
fn unaligned_page_is_refused_and_everything_given_back() {
    struct Odd(Vec<u64>, Vec<u64>);
    impl PageSource for Odd {
        fn take_page(&mut self) -> Option<u64> {
            self.0.pop()
        }
        fn return_page(&mut self, addr: u64) {
            self.1.push(addr);
        }
    }
    let pages = FakePages::new(RAM, 1);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 8]).unwrap();
    dev.borrow_mut().num_pages = 8;
    let mut odd = Odd(vec![0x4000_0800, 0x4000_2000, 0x4000_1000], vec![]);
    assert_eq!(balloon.poll(&mut odd), Err(Error::BadPage(0x4000_0800)));
    odd.1.sort();
    assert_eq!(odd.1, [0x4000_0800, 0x4000_1000, 0x4000_2000]);
    assert!(dev.borrow().requests.is_empty());
    assert_eq!(balloon.actual_pages(), 0);
}

#[test]
fn device_needing_reset_is_reset_and_pages_are_held_back() {
    let mut pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::NeedsReset, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    dev.borrow_mut().num_pages = 4;
    assert_eq!(balloon.poll(&mut pages), Err(Error::DeviceNeedsReset));
    assert_eq!(dev.borrow().status, 0, "device reset");
    assert_eq!(balloon.stranded_pages(), 4);
    assert_eq!(pages.len(), 12);
    assert_eq!(balloon.poll(&mut pages), Err(Error::Broken));
}

#[test]
fn silent_device_times_out_when_asked_to() {
    let mut pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Silent, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    balloon.set_wait_limit(Some(10_000));
    dev.borrow_mut().num_pages = 4;
    assert_eq!(balloon.poll(&mut pages), Err(Error::Timeout));
    assert_eq!(dev.borrow().status, 0);
    assert_eq!(dev.borrow().notifies, 1);
}

// ---------------------------------------------------------------- interrupts

/// An interrupt-driven wait over the fake device: the device does its work
/// while the guest "sleeps"; if its line is then high, the "interrupt
/// controller" has the interrupt, and the waiter acknowledges it as a guest's
/// handler would (acknowledge at the device, then EOI).
struct IrqWait {
    dev: Rc<RefCell<Device>>,
    waits: u32,
    interrupts: u32,
    /// Whether the line was still high at each EOI.
    high_at_eoi: Vec<bool>,
}

impl IrqWait {
    fn new(dev: &Rc<RefCell<Device>>) -> Self {
        IrqWait {
            dev: dev.clone(),
            waits: 0,
            interrupts: 0,
            high_at_eoi: Vec::new(),
        }
    }
}

impl Wait for IrqWait {
    fn wait(&mut self, acknowledge: &mut dyn FnMut()) {
        self.waits += 1;
        self.dev.borrow_mut().deliver();
        if self.dev.borrow().interrupt_status != 0 {
            self.interrupts += 1;
            acknowledge();
            let high = self.dev.borrow().interrupt_status != 0;
            self.high_at_eoi.push(high);
        }
    }
}

#[test]
fn interrupt_driven_requests_wait_once_each_and_leave_the_line_low() {
    let mut pages = FakePages::new(RAM, 1024);
    let (t, dev) = device(LOTS, Mode::Deferred, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 1024]).unwrap();
    let mut irq = IrqWait::new(&dev);
    dev.borrow_mut().set_target(600);
    let mut moved = vec![];
    loop {
        let p = balloon.poll_with(&mut pages, &mut irq).unwrap();
        if p.moved() == 0 {
            assert!(p.at_target());
            break;
        }
        moved.push(p.inflated);
    }
    assert_eq!(moved, [256, 256, 88]);
    // One sleep per request: the device answered each with one interrupt.
    assert_eq!((irq.waits, irq.interrupts), (3, 3));
    assert_eq!(irq.high_at_eoi, [false; 3], "line low before every EOI");
    assert_eq!(dev.borrow().interrupt_status, 0);

    dev.borrow_mut().set_target(0);
    while balloon.poll_with(&mut pages, &mut irq).unwrap().moved() > 0 {}
    assert_eq!(balloon.actual_pages(), 0);
    assert_eq!(pages.len(), 1024);
    assert_eq!(irq.waits, 6);
    assert!(dev.borrow().violations.is_empty());
}

#[test]
fn idle_reports_a_new_target_and_nothing_else() {
    let mut pages = FakePages::new(RAM, 64);
    let (t, dev) = device(LOTS, Mode::Deferred, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 64]).unwrap();
    let mut irq = IrqWait::new(&dev);
    // Woken by something else (a timer): nothing from the device.
    assert_eq!(balloon.idle(&mut irq).bits(), 0);
    assert_eq!(irq.interrupts, 0);
    dev.borrow_mut().set_target(10);
    assert_eq!(
        balloon.idle(&mut irq).bits(),
        InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits()
    );
    assert_eq!(dev.borrow().interrupt_status, 0);
    assert_eq!(
        balloon.poll_with(&mut pages, &mut irq).unwrap().inflated,
        10
    );
}

#[test]
fn acknowledging_drains_bits_raised_meanwhile() {
    let pages = FakePages::new(RAM, 1);
    let (mut t, dev) = device(LOTS, Mode::Good, &pages);
    {
        let mut d = dev.borrow_mut();
        d.interrupt_status = InterruptStatus::QUEUE_INTERRUPT.bits();
        d.raise_after_read = InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT.bits();
    }
    // One read-and-acknowledge would leave the config bit (and the line) up.
    assert_eq!(
        acknowledge_all(&mut t).bits(),
        (InterruptStatus::QUEUE_INTERRUPT | InterruptStatus::DEVICE_CONFIGURATION_INTERRUPT).bits()
    );
    let d = dev.borrow();
    assert_eq!(d.interrupt_status, 0);
    assert_eq!(d.status_reads, 3, "read, read again, read 0");
}

#[test]
fn acknowledging_a_stuck_device_gives_up() {
    let pages = FakePages::new(RAM, 1);
    let (mut t, dev) = device(LOTS, Mode::Good, &pages);
    {
        let mut d = dev.borrow_mut();
        d.interrupt_status = InterruptStatus::QUEUE_INTERRUPT.bits();
        d.stuck_interrupt = true;
    }
    assert_eq!(
        acknowledge_all(&mut t).bits(),
        InterruptStatus::QUEUE_INTERRUPT.bits()
    );
    assert_eq!(dev.borrow().status_reads, ACK_ROUNDS as u32);
}

#[test]
fn needs_reset_is_seen_at_the_first_config_interrupt() {
    let mut pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::NeedsReset, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    let mut irq = IrqWait::new(&dev);
    dev.borrow_mut().num_pages = 4;
    assert_eq!(
        balloon.poll_with(&mut pages, &mut irq),
        Err(Error::DeviceNeedsReset)
    );
    assert_eq!(irq.waits, 1, "no need to wait 1024 times");
    assert_eq!(dev.borrow().status, 0, "device reset");
    assert_eq!(balloon.stranded_pages(), 4);
}

#[test]
fn wait_limit_counts_wake_ups() {
    let mut pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Silent, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    let mut irq = IrqWait::new(&dev);
    balloon.set_wait_limit(Some(3));
    dev.borrow_mut().num_pages = 4;
    assert_eq!(balloon.poll_with(&mut pages, &mut irq), Err(Error::Timeout));
    assert_eq!(irq.waits, 3);
    assert_eq!(dev.borrow().status, 0);
}

// ---------------------------------------------------------------- features

/// Real memory for free blocks (the driver hands them to the device as
/// buffers): `pages` pages aligned to their total size.
struct Arena {
    ptr: *mut u8,
    layout: Layout,
}

impl Arena {
    fn new(pages: usize) -> Arena {
        let layout = Layout::from_size_align(pages * 4096, pages * 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Arena { ptr, layout }
    }
    fn base(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

/// A bitmap allocator over `arena`, every page free.
fn frames(arena: &Arena, pages: u64) -> BitmapFrames<Vec<u64>> {
    let mut f = BitmapFrames::new(arena.base(), pages, vec![0; pages.div_ceil(64) as usize]);
    for i in 0..pages {
        f.free_page(arena.base() + i * 4096);
    }
    f
}

fn blocks_of(f: &mut impl FrameAllocator, min_order: u32) -> Vec<(u64, u32)> {
    let mut v = vec![];
    f.free_blocks(min_order, &mut |a, o| {
        v.push((a, o));
        true
    });
    v
}

/// A driver wanting every feature (poison 0) on a fake device that offers
/// `offered` and behaves as `mode`.
fn featured(
    offered: u64,
    mode: Mode,
) -> (
    Balloon<TestHal, FakeTransport, Vec<u32>>,
    Rc<RefCell<Device>>,
) {
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(offered, mode, &pages);
    let balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(0)).unwrap();
    (balloon, dev)
}

fn all_features(poison_val: u32) -> Options {
    Options {
        features: features::SUPPORTED,
        poison_val,
    }
}

#[test]
fn bitmap_frames_allocate_low_and_list_aligned_free_blocks() {
    let arena = Arena::new(64);
    let b = arena.base();
    let mut f = frames(&arena, 64);
    assert_eq!((f.free_pages(), f.total_pages()), (64, 64));
    assert_eq!(blocks_of(&mut f, 0), [(b, 6)]);
    assert_eq!(f.alloc_page(), Some(b));
    assert_eq!(f.alloc_page(), Some(b + 4096));
    assert_eq!(f.alloc_page(), Some(b + 2 * 4096));
    // Pages 3.. free: 3 (order 0), 4-7 (2), 8-15 (3), 16-31 (4), 32-63 (5).
    assert_eq!(
        blocks_of(&mut f, 0),
        [
            (b + 3 * 4096, 0),
            (b + 4 * 4096, 2),
            (b + 8 * 4096, 3),
            (b + 16 * 4096, 4),
            (b + 32 * 4096, 5)
        ]
    );
    assert_eq!(
        blocks_of(&mut f, 4),
        [(b + 16 * 4096, 4), (b + 32 * 4096, 5)]
    );
    f.free_page(b + 4096);
    assert_eq!(f.alloc_page(), Some(b + 4096), "lowest free page first");
    // A visitor that stops after the first block.
    let mut seen = 0;
    f.free_blocks(0, &mut |_, _| {
        seen += 1;
        false
    });
    assert_eq!(seen, 1);
    for _ in 0..61 {
        assert!(f.alloc_page().is_some());
    }
    assert_eq!(f.alloc_page(), None);
    assert_eq!(f.free_pages(), 0);
    assert!(blocks_of(&mut f, 0).is_empty());
}

#[test]
#[should_panic(expected = "freed twice")]
fn bitmap_frames_refuse_a_double_free() {
    let arena = Arena::new(8);
    let mut f = frames(&arena, 8);
    f.free_page(arena.base());
}

#[test]
fn all_six_features_are_negotiated_and_every_queue_set_up() {
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(0xdead_beef))
            .unwrap();
    let d = dev.borrow();
    assert_eq!(d.driver_features, features::SUPPORTED);
    assert_eq!(d.queues_set, BTreeSet::from([0, 1, 2, 3, 4]));
    assert_eq!(
        d.poison,
        Some((0xdead_beef, false)),
        "written before DRIVER_OK"
    );
    assert_eq!(balloon.poison_val(), 0xdead_beef);
    assert!(balloon.has(features::DEFLATE_ON_OOM));
}

#[test]
fn only_offered_features_are_used_and_queues_shift_down() {
    let pages = FakePages::new(RAM, 16);
    let offered = features::VERSION_1 | features::PAGE_REPORTING | features::STATS_VQ;
    let (t, dev) = device(offered, Mode::Good, &pages);
    let balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(7)).unwrap();
    let d = dev.borrow();
    assert_eq!(d.driver_features, offered);
    assert_eq!(d.queues_set, BTreeSet::from([0, 1, 2, 3]));
    assert_eq!(d.poison, None, "no poison_val without PAGE_POISON");
    assert_eq!(balloon.poison_val(), 0);
}

#[test]
fn statistics_are_primed_then_resent_only_when_the_device_returns_them() {
    let arena = Arena::new(64);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 64), 9);
    let (mut balloon, dev) = featured(LOTS, Mode::Good);
    assert!(balloon.answer_stats(&mut frames).unwrap());
    assert!(
        !balloon.answer_stats(&mut frames).unwrap(),
        "held by the device"
    );
    for _ in 0..5 {
        frames.alloc_page().unwrap();
    }
    dev.borrow_mut().return_stats();
    assert!(balloon.answer_stats(&mut frames).unwrap());
    let d = dev.borrow();
    assert_eq!(d.stats.len(), 2);
    let expect = |free: u64| {
        vec![
            (stat::FREE_MEMORY, free * 4096),
            (stat::TOTAL_MEMORY, 64 * 4096),
            (stat::AVAILABLE_MEMORY, free * 4096),
        ]
    };
    assert_eq!(d.stats[0], expect(64));
    assert_eq!(d.stats[1], expect(59), "fresh figures");
    assert!(d.held_stats.is_some());
    assert!(d.violations.is_empty(), "{:?}", d.violations);
}

#[test]
fn statistics_without_the_feature_send_nothing() {
    let arena = Arena::new(8);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 8), 0);
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    assert!(!balloon.answer_stats(&mut frames).unwrap());
    assert!(dev.borrow().stats.is_empty());
}

#[test]
fn statistics_source_with_too_many_tags_is_capped() {
    let mut s = MemoryStats::default();
    for tag in 0..20 {
        assert_eq!(s.set(tag, 1), usize::from(tag) < MAX_STATS);
    }
    assert!(s.set(3, 42), "replacing a tag needs no room");
    assert_eq!(s.entries().len(), MAX_STATS);
    assert_eq!(s.entries()[3], (3, 42));
    let mut out = [0u8; MAX_STATS * STAT_ENTRY_BYTES];
    assert_eq!(s.encode(&mut out), 160);
    assert_eq!(&out[30..40], &[3, 0, 42, 0, 0, 0, 0, 0, 0, 0]);
}

#[test]
fn device_returning_a_foreign_statistics_head_breaks_the_driver() {
    let arena = Arena::new(8);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 8), 0);
    let (mut balloon, dev) = featured(LOTS, Mode::Good);
    assert!(balloon.answer_stats(&mut frames).unwrap());
    {
        let mut d = dev.borrow_mut();
        d.bogus_used_head = true;
        d.return_stats();
    }
    assert!(matches!(
        balloon.answer_stats(&mut frames),
        Err(Error::Virtio(_))
    ));
    assert_eq!(dev.borrow().status, 0, "device reset");
    assert_eq!(balloon.answer_stats(&mut frames), Err(Error::Broken));
}

#[test]
fn free_blocks_are_reported_once_and_forgotten_when_allocated() {
    let arena = Arena::new(64);
    let b = arena.base();
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 64), 3);
    for _ in 0..3 {
        frames.alloc_page().unwrap();
    }
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(0)).unwrap();
    let r = balloon.report_free(&mut frames, &mut Spin).unwrap();
    // Order >= 3 of pages 3..64: 8-15, 16-31, 32-63.
    assert_eq!((r.reports, r.blocks, r.pages), (1, 3, 56));
    assert_eq!(
        dev.borrow().reports,
        [vec![
            (b + 8 * 4096, 8 * 4096),
            (b + 16 * 4096, 16 * 4096),
            (b + 32 * 4096, 32 * 4096)
        ]]
    );
    assert!(frames.is_reported(b + 40 * 4096));
    assert!(!frames.is_reported(b + 4 * 4096));
    // Nothing new: nothing sent.
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin).unwrap(),
        Reported::default()
    );
    assert_eq!(dev.borrow().reports.len(), 1);
    // Allocating pages 3..=8 takes one page of the block at 8: it is forgotten,
    // and its free rest (9 (0), 10-11 (1), 12-15 (2)) is too small to report.
    for _ in 0..6 {
        frames.alloc_page().unwrap();
    }
    assert!(!frames.is_reported(b + 12 * 4096));
    assert_eq!(frames.reported().len(), 2);
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin).unwrap(),
        Reported::default()
    );
    // Freeing page 8 again makes 8-15 whole: reported anew.
    frames.free_page(b + 8 * 4096);
    let r = balloon.report_free(&mut frames, &mut Spin).unwrap();
    assert_eq!((r.blocks, r.pages), (1, 8));
    assert_eq!(dev.borrow().reports[1], [(b + 8 * 4096, 8 * 4096)]);
    assert!(dev.borrow().violations.is_empty());
}

#[test]
fn merged_blocks_replace_what_they_contain_and_memory_bounds_reports() {
    let arena = Arena::new(64);
    let b = arena.base();
    let mut f = frames(&arena, 64);
    // Hold pages 0-15 and page 32: free blocks 16-31 (4) and 33.. small ones.
    let held: Vec<u64> = (0..33).map(|_| f.alloc_page().unwrap()).collect();
    for &p in &held[16..32] {
        f.free_page(p);
    }
    let mut frames = Reporting::<_, 2>::new(f, 2);
    let (mut balloon, dev) = featured(LOTS, Mode::Good);
    // 16-31 (4), 36-39 (2), 40-47 (3), 48-63 (4): room for 2 only.
    let r = balloon.report_free(&mut frames, &mut Spin).unwrap();
    assert_eq!(r.blocks, 2);
    assert_eq!(frames.reported(), [(b + 16 * 4096, 4), (b + 36 * 4096, 2)]);
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin).unwrap().blocks,
        0,
        "no room to remember more"
    );
    // Freeing 0-15 merges with 16-31 into 0-31 (5): the new block replaces
    // the one it contains.
    for &p in &held[..16] {
        frames.free_page(p);
    }
    let mut reported = frames.reported().to_vec();
    reported.sort();
    assert_eq!(reported, [(b + 16 * 4096, 4), (b + 36 * 4096, 2)]);
    frames.remember(&[(b, 5)]);
    let mut reported = frames.reported().to_vec();
    reported.sort();
    assert_eq!(reported, [(b, 5), (b + 36 * 4096, 2)]);
    assert_eq!(dev.borrow().reports.len(), 1);
}

#[test]
fn reporting_without_the_feature_sends_nothing() {
    let arena = Arena::new(64);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 64), 0);
    let (mut balloon, dev) = featured(features::VERSION_1, Mode::Good);
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin).unwrap(),
        Reported::default()
    );
    assert!(dev.borrow().reports.is_empty());
    assert!(frames.reported().is_empty());
}

#[test]
fn reporting_to_a_device_that_needs_reset_fails_and_remembers_nothing() {
    let arena = Arena::new(64);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 64), 0);
    let (mut balloon, dev) = featured(LOTS, Mode::NeedsReset);
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin),
        Err(Error::DeviceNeedsReset)
    );
    assert!(frames.reported().is_empty());
    assert_eq!(dev.borrow().status, 0);
}

#[test]
fn a_hint_run_is_answered_with_free_blocks_then_stop() {
    let arena = Arena::new(64);
    let b = arena.base();
    let mut frames = frames(&arena, 64);
    for _ in 0..16 {
        frames.alloc_page().unwrap();
    }
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(0)).unwrap();
    // No run yet (config STOP).
    assert_eq!(
        balloon.answer_hint(&mut frames, 0, &mut Spin).unwrap(),
        None
    );
    dev.borrow_mut().start_hint(5);
    let a = balloon
        .answer_hint(&mut frames, 0, &mut Spin)
        .unwrap()
        .unwrap();
    assert_eq!(
        a,
        HintAnswer {
            id: 5,
            blocks: 2,
            pages: 48,
            stopped_by_host: false
        }
    );
    {
        let d = dev.borrow();
        assert_eq!(d.hint_ids, [5, 0]);
        assert_eq!(
            d.hinted,
            [(b + 16 * 4096, 16 * 4096, 5), (b + 32 * 4096, 32 * 4096, 5)]
        );
        assert_eq!(d.hint_cmd_id, 1, "DONE after the driver's STOP");
        assert!(d.violations.is_empty(), "{:?}", d.violations);
    }
    // DONE, and the same id again: nothing to answer.
    assert_eq!(
        balloon.answer_hint(&mut frames, 0, &mut Spin).unwrap(),
        None
    );
    dev.borrow_mut().start_hint(5);
    assert_eq!(
        balloon.answer_hint(&mut frames, 0, &mut Spin).unwrap(),
        None
    );
    // A new run with a minimum order leaves out smaller blocks.
    dev.borrow_mut().start_hint(6);
    let a = balloon
        .answer_hint(&mut frames, 5, &mut Spin)
        .unwrap()
        .unwrap();
    assert_eq!((a.id, a.blocks, a.pages), (6, 1, 32));
    assert_eq!(frames.free_pages(), 48, "hinting allocates nothing");
}

#[test]
fn the_host_can_stop_a_hint_run_midway() {
    let arena = Arena::new(64);
    let mut frames = frames(&arena, 64);
    for _ in 0..3 {
        frames.alloc_page().unwrap();
    }
    let (mut balloon, dev) = featured(LOTS, Mode::Good);
    {
        let mut d = dev.borrow_mut();
        d.stop_hint_after = Some(2);
        d.start_hint(9);
    }
    let a = balloon
        .answer_hint(&mut frames, 0, &mut Spin)
        .unwrap()
        .unwrap();
    assert_eq!((a.id, a.blocks, a.stopped_by_host), (9, 2, true));
    let d = dev.borrow();
    assert_eq!(d.hint_ids, [9, 0], "the driver still sends its STOP");
    assert_eq!(d.hinted.len(), 2);
}

#[test]
fn hinting_without_the_feature_ignores_the_config() {
    let arena = Arena::new(8);
    let mut frames = frames(&arena, 8);
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon = Balloon::<TestHal, _, _>::new(t, vec![0u32; 16]).unwrap();
    dev.borrow_mut().start_hint(5);
    assert_eq!(
        balloon.answer_hint(&mut frames, 0, &mut Spin).unwrap(),
        None
    );
    assert!(dev.borrow().hint_ids.is_empty());
}

#[test]
fn out_of_memory_deflates_below_target_and_holds_off_inflating() {
    let mut pages = FakePages::new(RAM, 1024);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    let mut balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 1024], all_features(0)).unwrap();
    dev.borrow_mut().num_pages = 300;
    while balloon.poll(&mut pages).unwrap().moved() > 0 {}
    assert_eq!(pages.len(), 724);
    assert_eq!(balloon.deflate_on_oom(&mut pages, 100, &mut Spin), Ok(100));
    assert_eq!(pages.len(), 824);
    assert_eq!(balloon.actual_pages(), 200);
    assert_eq!(dev.borrow().actual, 200);
    assert_eq!(dev.borrow().inflated.len(), 200);
    assert_eq!(balloon.oom_deflated_pages(), 100);
    // The target did not change: no re-inflating into the same shortage.
    let p = balloon.poll(&mut pages).unwrap();
    assert_eq!((p.moved(), p.actual, p.target), (0, 200, 300));
    // At most 256 at a time.
    assert_eq!(balloon.deflate_on_oom(&mut pages, 1000, &mut Spin), Ok(200));
    assert_eq!(balloon.deflate_on_oom(&mut pages, 1000, &mut Spin), Ok(0));
    // A new target: inflating resumes.
    dev.borrow_mut().num_pages = 50;
    assert_eq!(balloon.poll(&mut pages).unwrap().inflated, 50);
    assert!(dev.borrow().violations.is_empty());
}

#[test]
fn out_of_memory_without_the_feature_deflates_nothing() {
    let mut pages = FakePages::new(RAM, 64);
    let (t, dev) = device(
        features::VERSION_1 | features::MUST_TELL_HOST,
        Mode::Good,
        &pages,
    );
    let mut balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 64], all_features(0)).unwrap();
    dev.borrow_mut().num_pages = 10;
    balloon.poll(&mut pages).unwrap();
    assert_eq!(balloon.deflate_on_oom(&mut pages, 5, &mut Spin), Ok(0));
    assert_eq!(balloon.actual_pages(), 10);
}

#[test]
fn a_config_window_too_small_for_poison_val_fails_set_up() {
    let pages = FakePages::new(RAM, 16);
    let (t, dev) = device(LOTS, Mode::Good, &pages);
    dev.borrow_mut().short_config = Some(8);
    let err = Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(1))
        .err()
        .unwrap();
    assert_eq!(
        err,
        Error::Virtio(virtio_drivers::Error::ConfigSpaceTooSmall)
    );
    let d = dev.borrow();
    assert_ne!(d.status & DeviceStatus::FAILED.bits(), 0);
    assert_eq!(d.status & DeviceStatus::DRIVER_OK.bits(), 0);
}

#[test]
fn a_short_config_window_makes_hint_answers_fail() {
    // Without PAGE_POISON an 8-byte window is fine for the basic balloon,
    // but a device offering FREE_PAGE_HINT must show the command id.
    let arena = Arena::new(8);
    let mut frames = frames(&arena, 8);
    let pages = FakePages::new(RAM, 16);
    let offered = features::VERSION_1 | features::FREE_PAGE_HINT;
    let (t, dev) = device(offered, Mode::Good, &pages);
    dev.borrow_mut().short_config = Some(8);
    let mut balloon =
        Balloon::<TestHal, _, _>::with_options(t, vec![0u32; 16], all_features(0)).unwrap();
    assert_eq!(
        balloon.answer_hint(&mut frames, 0, &mut Spin),
        Err(Error::Virtio(virtio_drivers::Error::ConfigSpaceTooSmall))
    );
    assert!(dev.borrow().hint_ids.is_empty());
}

#[test]
fn a_new_run_id_mid_run_ends_the_old_run_and_is_answered_next() {
    let arena = Arena::new(64);
    let mut frames = frames(&arena, 64);
    for _ in 0..3 {
        frames.alloc_page().unwrap();
    }
    let (mut balloon, dev) = featured(LOTS, Mode::Good);
    {
        let mut d = dev.borrow_mut();
        d.stop_hint_after = Some(1);
        d.next_hint_id = Some(3);
        d.start_hint(2);
    }
    let a = balloon
        .answer_hint(&mut frames, 0, &mut Spin)
        .unwrap()
        .unwrap();
    assert_eq!((a.id, a.blocks, a.stopped_by_host), (2, 1, true));
    dev.borrow_mut().stop_hint_after = None;
    // The driver's STOP made the fake show DONE; the host starts run 3 again.
    dev.borrow_mut().start_hint(3);
    let a = balloon
        .answer_hint(&mut frames, 0, &mut Spin)
        .unwrap()
        .unwrap();
    assert_eq!((a.id, a.stopped_by_host), (3, false));
    assert_eq!(dev.borrow().hint_ids, [2, 0, 3, 0]);
}

#[test]
fn a_silent_device_times_out_a_report_and_nothing_is_remembered() {
    let arena = Arena::new(64);
    let mut frames = Reporting::<_, 8>::new(frames(&arena, 64), 0);
    let (mut balloon, dev) = featured(LOTS, Mode::Silent);
    balloon.set_wait_limit(Some(100));
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin),
        Err(Error::Timeout)
    );
    assert!(frames.reported().is_empty());
    assert_eq!(dev.borrow().status, 0, "reset so it drops the blocks");
    assert_eq!(
        balloon.report_free(&mut frames, &mut Spin),
        Err(Error::Broken)
    );
}
