//! `hostile`: attacks on the balloon device through hand-made virtqueues.
//!
//! virtio-drivers is not used here: the guest programs the virtio-mmio
//! registers (legacy version 1 or modern version 2 layout) and writes its own
//! descriptors and rings, so that it can write what no well-behaved driver
//! would. Before each attack the device is reset and initialised afresh (queues
//! 0 and 1, size 8); after it the guest prints the device status
//! (`DEVICE_NEEDS_RESET` is 0x40). Pages used as attack PFNs come from the
//! pool and are never touched again.

use crate::arch::{self, counter, counter_hz};
use crate::board::Board;
use crate::hal::dma_pages;
use crate::pool::Pool;
use guest_driver::PageSource;

// virtio-mmio registers.
const VERSION: usize = 0x004;
const DEVICE_FEATURES: usize = 0x010;
const DEVICE_FEATURES_SEL: usize = 0x014;
const DRIVER_FEATURES: usize = 0x020;
const DRIVER_FEATURES_SEL: usize = 0x024;
const GUEST_PAGE_SIZE: usize = 0x028;
const QUEUE_SEL: usize = 0x030;
const QUEUE_NUM_MAX: usize = 0x034;
const QUEUE_NUM: usize = 0x038;
const QUEUE_ALIGN: usize = 0x03c;
const QUEUE_PFN: usize = 0x040;
const QUEUE_READY: usize = 0x044;
const QUEUE_NOTIFY: usize = 0x050;
const INTERRUPT_STATUS: usize = 0x060;
const INTERRUPT_ACK: usize = 0x064;
const STATUS: usize = 0x070;
const QUEUE_DESC: usize = 0x080;
const QUEUE_DRIVER: usize = 0x090;
const QUEUE_DEVICE: usize = 0x0a0;

// Device status bits.
const ACKNOWLEDGE: u32 = 1;
const DRIVER: u32 = 2;
const DRIVER_OK: u32 = 4;
const FEATURES_OK: u32 = 8;

// Descriptor flags.
const F_NEXT: u16 = 1;
const F_INDIRECT: u16 = 4;

/// Queue size used for both queues.
const QSIZE: u16 = 8;
const PAGE: u64 = 4096;

const INFLATEQ: u16 = 0;
const DEFLATEQ: u16 = 1;

/// The balloon's virtio-mmio registers.
struct Dev {
    base: usize,
    legacy: bool,
}

impl Dev {
    fn read(&self, offset: usize) -> u32 {
        // SAFETY: a register of the balloon's virtio-mmio slot (device memory).
        unsafe { arch::mmio_read32(self.base + offset) }
    }

    fn write(&self, offset: usize, value: u32) {
        // SAFETY: as in `read`; this mode owns the device.
        unsafe { arch::mmio_write32(self.base + offset, value) }
    }

    fn write64(&self, offset: usize, value: u64) {
        self.write(offset, value as u32);
        self.write(offset + 4, (value >> 32) as u32);
    }

    fn status(&self) -> u32 {
        self.read(STATUS)
    }

    fn notify(&self, queue: u16) {
        arch::dsb();
        self.write(QUEUE_NOTIFY, u32::from(queue));
    }

    /// Writes status 0 and waits (at most 100 ms) until it reads back 0.
    fn reset(&self) {
        self.write(STATUS, 0);
        let end = counter() + counter_hz() / 10;
        while self.status() != 0 && counter() < end {}
        let isr = self.read(INTERRUPT_STATUS);
        self.write(INTERRUPT_ACK, isr);
    }
}

// Byte-wise volatile access to ring memory: the misaligned-queue attack puts
// the rings at odd addresses.
fn wr(addr: u64, value: u64, bytes: usize) {
    for i in 0..bytes {
        // SAFETY: `addr` is in the ring or buffer pages this mode took from the
        // DMA arena (RAM it owns).
        unsafe { ((addr + i as u64) as *mut u8).write_volatile((value >> (8 * i)) as u8) };
    }
}

fn rd(addr: u64, bytes: usize) -> u64 {
    (0..bytes).fold(0, |v, i| {
        // SAFETY: as in `wr`.
        v | u64::from(unsafe { ((addr + i as u64) as *const u8).read_volatile() }) << (8 * i)
    })
}

/// One split virtqueue in guest memory.
struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
}

impl Ring {
    fn set_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * u64::from(index);
        wr(d, addr, 8);
        wr(d + 8, u64::from(len), 4);
        wr(d + 12, u64::from(flags), 2);
        wr(d + 14, u64::from(next), 2);
    }

    /// Puts `head` in the next avail slot and publishes the new avail.idx.
    fn push(&mut self, head: u16) {
        let slot = u64::from(self.next_avail % QSIZE);
        wr(self.avail + 4 + 2 * slot, u64::from(head), 2);
        self.next_avail = self.next_avail.wrapping_add(1);
        self.set_avail_idx(self.next_avail);
    }

    fn set_avail_idx(&self, idx: u16) {
        arch::dsb();
        wr(self.avail + 2, u64::from(idx), 2);
    }

    fn used_idx(&self) -> u16 {
        rd(self.used + 2, 2) as u16
    }

    /// Waits (at most 100 ms) until the device has used `count` buffers in all.
    fn wait_used(&self, count: u16) -> u16 {
        let end = counter() + counter_hz() / 10;
        while self.used_idx() < count && counter() < end {}
        self.used_idx()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Normal,
    /// Descriptor table, avail ring and used ring at misaligned addresses
    /// (legacy: a QueueAlign that is not a power of two).
    Misaligned,
}

/// Ring and buffer memory, taken once from the DMA arena.
struct Memory {
    /// Two contiguous pages per queue.
    queue: [u64; 2],
    /// Request buffers: list A at +0, list B at +0x400, indirect table at +0x800.
    data: u64,
}

/// Resets the device and sets it up afresh: features, queues 0 and 1, DRIVER_OK.
fn init(dev: &Dev, mem: &Memory, layout: Layout) -> [Ring; 2] {
    dev.reset();
    dev.write(STATUS, ACKNOWLEDGE | DRIVER);
    dev.write(DEVICE_FEATURES_SEL, 0);
    let low = dev.read(DEVICE_FEATURES);
    dev.write(DEVICE_FEATURES_SEL, 1);
    let high = dev.read(DEVICE_FEATURES);
    let offered = u64::from(high) << 32 | u64::from(low);
    let accepted = guest_driver::negotiate(offered, guest_driver::features::BASIC);
    dev.write(DRIVER_FEATURES_SEL, 0);
    dev.write(DRIVER_FEATURES, accepted as u32);
    dev.write(DRIVER_FEATURES_SEL, 1);
    dev.write(DRIVER_FEATURES, (accepted >> 32) as u32);
    dev.write(STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    if dev.legacy {
        dev.write(GUEST_PAGE_SIZE, PAGE as u32);
    }
    let rings = [0u16, 1].map(|q| {
        let base = mem.queue[q as usize];
        // SAFETY: two pages of the DMA arena owned by this mode.
        unsafe { (base as *mut u8).write_bytes(0, 2 * PAGE as usize) };
        let skew = if layout == Layout::Misaligned && !dev.legacy {
            (8, 1, 2)
        } else {
            (0, 0, 0)
        };
        let desc = base + skew.0;
        let avail = desc + 16 * u64::from(QSIZE) + skew.1;
        let mut used = base + PAGE + skew.2;
        dev.write(QUEUE_SEL, u32::from(q));
        let max = dev.read(QUEUE_NUM_MAX);
        if max < u32::from(QSIZE) {
            println!("hostile: queue {q} offers only {max} entries");
        }
        dev.write(QUEUE_NUM, u32::from(QSIZE));
        if dev.legacy {
            let align: u64 = if layout == Layout::Misaligned {
                3
            } else {
                PAGE
            };
            // Where a legacy device puts the used ring: after the avail ring,
            // rounded up to QueueAlign (done the way QEMU does it, also for
            // an alignment that is not a power of two).
            used = (avail + 4 + 2 * u64::from(QSIZE)).div_ceil(align) * align;
            dev.write(QUEUE_ALIGN, align as u32);
            dev.write(QUEUE_PFN, (desc / PAGE) as u32);
        } else {
            dev.write64(QUEUE_DESC, desc);
            dev.write64(QUEUE_DRIVER, avail);
            dev.write64(QUEUE_DEVICE, used);
            dev.write(QUEUE_READY, 1);
        }
        Ring {
            desc,
            avail,
            used,
            next_avail: 0,
        }
    });
    dev.write(STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
    rings
}

/// Writes PFNs as a request buffer at `addr` and returns its length.
fn pfns(addr: u64, list: &[u32]) -> u32 {
    for (i, &pfn) in list.iter().enumerate() {
        wr(addr + 4 * i as u64, u64::from(pfn), 4);
    }
    (list.len() * 4) as u32
}

/// Sends one well-formed request of `list` on `queue` (descriptor 0, buffer
/// A) and returns the used index reached.
fn request(dev: &Dev, ring: &mut Ring, queue: u16, buf: u64, list: &[u32]) -> u16 {
    let len = pfns(buf, list);
    ring.set_desc(0, buf, len, 0, 0);
    ring.push(0);
    dev.notify(queue);
    ring.wait_used(ring.next_avail)
}

fn verdict(dev: &Dev, name: &str, used: u16, posted: u16) {
    println!("hostile: {name} -> status 0x{:x}", dev.status());
    println!("hostile: {name}: {used} of {posted} buffers used");
}

/// Runs every attack against the balloon at `slot`.
pub fn run(slot: (u64, u64), board: &Board, pool: &mut Pool) {
    let dev = Dev {
        base: slot.0 as usize,
        legacy: false,
    };
    let dev = Dev {
        legacy: dev.read(VERSION) == 1,
        ..dev
    };
    let (Some(q0), Some(q1), Some(data)) = (dma_pages(2), dma_pages(2), dma_pages(1)) else {
        println!("hostile: out of DMA memory");
        return;
    };
    let mem = Memory {
        queue: [q0.as_ptr() as u64, q1.as_ptr() as u64],
        data: data.as_ptr() as u64,
    };
    let (buf_a, buf_b, table) = (mem.data, mem.data + 0x400, mem.data + 0x800);
    // Sacrificial pages: inflated (or deflated) by the attacks, never touched again.
    let mut victims = [0u32; 12];
    for v in victims.iter_mut() {
        *v = (pool.take_page().expect("pool has pages") / PAGE) as u32;
    }
    let ram_end_pfn = (board.ram.end / PAGE) as u32;
    println!(
        "hostile: balloon at 0x{:x}, virtio-mmio version {}, victim pages 0x{:x}..",
        slot.0,
        dev.read(VERSION),
        u64::from(victims[11]) * PAGE
    );

    // (0) A well-formed request, for comparison.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let used = request(&dev, &mut inflate, INFLATEQ, buf_a, &[victims[0]]);
    verdict(&dev, "control", used, 1);

    // (1) A descriptor chain that loops: descriptor 0 chains to itself.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let len = pfns(buf_a, &[victims[1]]);
    inflate.set_desc(0, buf_a, len, F_NEXT, 0);
    inflate.push(0);
    dev.notify(INFLATEQ);
    verdict(&dev, "descriptor-loop", inflate.wait_used(1), 1);

    // (2) A descriptor whose buffer lies outside RAM.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    inflate.set_desc(0, board.ram.end + 0x1000_0000, 4, 0, 0);
    inflate.push(0);
    dev.notify(INFLATEQ);
    verdict(&dev, "descriptor-outside-ram", inflate.wait_used(1), 1);

    // (3) A descriptor 0xffff_fff0 bytes long.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    pfns(buf_a, &[victims[2]]);
    inflate.set_desc(0, buf_a, 0xffff_fff0, 0, 0);
    inflate.push(0);
    dev.notify(INFLATEQ);
    verdict(&dev, "descriptor-huge-length", inflate.wait_used(1), 1);

    // (4) avail.idx far ahead of the one buffer really posted.
    let [inflate, _] = init(&dev, &mem, Layout::Normal);
    let len = pfns(buf_a, &[victims[3]]);
    inflate.set_desc(0, buf_a, len, 0, 0);
    wr(inflate.avail + 4, 0, 2);
    inflate.set_avail_idx(1000);
    dev.notify(INFLATEQ);
    verdict(&dev, "avail-index-ahead", inflate.wait_used(1), 1);

    // (5) PFNs past the end of RAM (and the largest PFN).
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let used = request(
        &dev,
        &mut inflate,
        INFLATEQ,
        buf_a,
        &[ram_end_pfn, ram_end_pfn + 0x10000, u32::MAX],
    );
    verdict(&dev, "pfn-past-ram", used, 1);

    // (6) PFNs of MMIO: the virtio-mmio window and the console UART.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let used = request(&dev, &mut inflate, INFLATEQ, buf_a, &[0x0a000, 0x09000]);
    verdict(&dev, "pfn-mmio", used, 1);

    // (7) The same PFN twice in one request.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let used = request(
        &dev,
        &mut inflate,
        INFLATEQ,
        buf_a,
        &[victims[4], victims[4]],
    );
    verdict(&dev, "pfn-duplicate", used, 1);

    // (8) A PFN inflated again in a second request.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    request(&dev, &mut inflate, INFLATEQ, buf_a, &[victims[5]]);
    let used = request(&dev, &mut inflate, INFLATEQ, buf_b, &[victims[5]]);
    verdict(&dev, "pfn-already-ballooned", used, 2);

    // (9) Deflate of a PFN never inflated.
    let [_, mut deflate] = init(&dev, &mem, Layout::Normal);
    let used = request(&dev, &mut deflate, DEFLATEQ, buf_a, &[victims[6]]);
    verdict(&dev, "deflate-never-inflated", used, 1);

    // (10) One request, then 10000 notifications.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let len = pfns(buf_a, &[victims[7]]);
    inflate.set_desc(0, buf_a, len, 0, 0);
    inflate.push(0);
    for _ in 0..10_000 {
        dev.notify(INFLATEQ);
    }
    verdict(&dev, "notify-storm", inflate.wait_used(1), 1);

    // (11) An indirect descriptor (VIRTIO_F_INDIRECT_DESC is never negotiated).
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let len = pfns(buf_b, &[victims[8]]);
    wr(table, buf_b, 8);
    wr(table + 8, u64::from(len), 4);
    wr(table + 12, 0, 4);
    inflate.set_desc(0, table, 16, F_INDIRECT, 0);
    inflate.push(0);
    dev.notify(INFLATEQ);
    verdict(&dev, "indirect-descriptor", inflate.wait_used(1), 1);

    // (12) Misaligned queue addresses, then a well-formed request on them.
    let [mut inflate, _] = init(&dev, &mem, Layout::Misaligned);
    let status = dev.status();
    let used = request(&dev, &mut inflate, INFLATEQ, buf_a, &[victims[9]]);
    println!("hostile: misaligned-queue: status 0x{status:x} after set-up");
    verdict(&dev, "misaligned-queue", used, 1);

    // After all that, a reset device must work again.
    let [mut inflate, _] = init(&dev, &mem, Layout::Normal);
    let used = request(&dev, &mut inflate, INFLATEQ, buf_a, &[victims[10]]);
    verdict(&dev, "control-after-reset", used, 1);
    dev.reset();
}
