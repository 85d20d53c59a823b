//! Console tests: a small driver over `VecMemory` talks to the console
//! through the virtio-mmio registers as Linux's virtio_console does without
//! MULTIPORT (one receiveq, one transmitq); a test VM collects what the guest
//! prints and holds typed input until the device takes it.

extern crate alloc;

use alloc::collections::VecDeque;
use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use super::*;
use crate::addr::GuestAddr;
use crate::test_rng::XorShift;
use crate::virtio::mmio::{self, TransportEvent};
use crate::virtio::testing::{driver_ok, handshake, read_reg, write_reg, DriverQueue, VecMemory};
use crate::virtio::{GuestMemError, MmioTransport, QueueError};

const BASE: u64 = 0x4000_0000;
const RAM_BYTES: usize = 1 << 20;
const RAM_END: u64 = BASE + RAM_BYTES as u64;
/// Where the test driver puts buffers (after the rings).
const BUFS: u64 = BASE + 0x10000;
/// Filler the driver puts in receive buffers, to see what the device wrote.
const FILL: u8 = 0xee;

/// The VM as the console sees it: RAM, the console output, the input queue.
struct TestEnv {
    mem: VecMemory,
    out: Vec<u8>,
    input: VecDeque<u8>,
    /// Largest `take_input` request seen.
    max_take: core::cell::Cell<usize>,
    /// An unmapped range inside `mem` (a hole in the VM's RAM): accesses
    /// touching it fail and are counted.
    hole: Option<Range<u64>>,
    hole_hits: u32,
    /// A hostile guest's second vCPU, publishing while the device works.
    storm: Option<Storm>,
}

/// A second vCPU that publishes chain `head` on its queue again each time
/// the device shows output (transmit) or consumes input (receive), `left`
/// more times: the device would never see its queue empty.
struct Storm {
    q: DriverQueue,
    head: u16,
    left: u32,
}

impl TestEnv {
    fn storm_step(&mut self) {
        if let Some(s) = self.storm.as_mut().filter(|s| s.left > 0) {
            s.left -= 1;
            s.q.publish(&mut self.mem, s.head);
        }
    }
}

impl TestEnv {
    fn in_hole(&mut self, ipa: GuestAddr, len: usize) -> bool {
        let Some(h) = &self.hole else {
            return false;
        };
        let (s, e) = (ipa.raw(), ipa.raw() + len as u64);
        if s < h.end && h.start < e {
            self.hole_hits += 1;
            true
        } else {
            false
        }
    }
}

impl GuestMemory for TestEnv {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        if self.in_hole(ipa, buf.len()) {
            return Err(GuestMemError {
                ipa,
                len: buf.len(),
            });
        }
        self.mem.read(ipa, buf)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        if self.in_hole(ipa, data.len()) {
            return Err(GuestMemError {
                ipa,
                len: data.len(),
            });
        }
        self.mem.write(ipa, data)
    }
}

impl ConsoleIo for TestEnv {
    fn output(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
        self.storm_step();
    }
    fn input_waiting(&self) -> bool {
        !self.input.is_empty()
    }
    fn peek_input(&self, skip: usize, buf: &mut [u8]) -> usize {
        self.max_take.set(self.max_take.get().max(buf.len()));
        let mut n = 0;
        for (slot, &b) in buf.iter_mut().zip(self.input.iter().skip(skip)) {
            *slot = b;
            n += 1;
        }
        n
    }
    fn consume_input(&mut self, count: usize) {
        self.input.drain(..count.min(self.input.len()));
        self.storm_step();
    }
}

/// A posted receive chain: its head and its writable buffers.
#[derive(Clone, Debug)]
struct RxChain {
    head: u16,
    bufs: Vec<(u64, u32)>,
}

struct Rig {
    t: MmioTransport<VirtioConsole>,
    env: TestEnv,
    qs: Vec<DriverQueue>,
    next_buf: u64,
}

fn driver_queues() -> Vec<DriverQueue> {
    (0..2u64)
        .map(|q| {
            let at = BASE + q * 0x1000;
            DriverQueue::new(QUEUE_SIZE, at, at + 0x400, at + 0x800)
        })
        .collect()
}

impl Rig {
    fn new() -> Rig {
        Rig {
            t: MmioTransport::new(VirtioConsole::new()),
            env: TestEnv {
                mem: VecMemory::new(BASE, RAM_BYTES),
                out: Vec::new(),
                input: VecDeque::new(),
                max_take: core::cell::Cell::new(0),
                hole: None,
                hole_hits: 0,
                storm: None,
            },
            qs: driver_queues(),
            next_buf: BUFS,
        }
    }

    /// Probe as Linux's virtio_console does (VERSION_1 only, two queues),
    /// then DRIVER_OK.
    fn live() -> Rig {
        let mut r = Rig::new();
        r.probe();
        r
    }

    fn probe(&mut self) {
        let status = handshake(&mut self.t, &mut self.env, VIRTIO_F_VERSION_1, &self.qs);
        assert_ne!(status & mmio::STATUS_FEATURES_OK, 0, "FEATURES_OK refused");
        assert_eq!(
            driver_ok(&mut self.t, &mut self.env),
            TransportEvent::Activated {
                features: VIRTIO_F_VERSION_1
            }
        );
        self.env.mem.clear_log();
    }

    /// A fresh buffer of `len` bytes (8-byte aligned, never reused).
    fn alloc(&mut self, len: u32) -> u64 {
        let at = self.next_buf;
        self.next_buf = (at + u64::from(len) + 7) & !7;
        assert!(self.next_buf <= RAM_END, "test ran out of buffer space");
        at
    }

    /// Queue one transmit chain of `parts` (one descriptor each), no notify.
    fn tx(&mut self, parts: &[&[u8]]) -> u16 {
        let bufs: Vec<(u64, u32, bool)> = parts
            .iter()
            .map(|p| {
                let at = self.alloc(p.len() as u32);
                self.env.mem.poke(at, p);
                (at, p.len() as u32, false)
            })
            .collect();
        self.qs[TRANSMITQ].add(&mut self.env.mem, &bufs)
    }

    /// Queue one receive chain of writable buffers of `lens` bytes, no notify.
    fn post_rx(&mut self, lens: &[u32]) -> RxChain {
        let bufs: Vec<(u64, u32)> = lens
            .iter()
            .map(|&len| {
                let at = self.alloc(len);
                self.env.mem.poke(at, &vec![FILL; len as usize]);
                (at, len)
            })
            .collect();
        let descs: Vec<(u64, u32, bool)> = bufs.iter().map(|&(a, l)| (a, l, true)).collect();
        let head = self.qs[RECEIVEQ].add(&mut self.env.mem, &descs);
        RxChain { head, bufs }
    }

    fn add_raw(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> u16 {
        self.qs[q].add(&mut self.env.mem, bufs)
    }

    fn notify(&mut self, q: usize) -> TransportEvent {
        write_reg(&mut self.t, &mut self.env, mmio::QUEUE_NOTIFY, q as u32)
    }

    /// The host has input for the guest: what the VM does after queueing it.
    fn receive_work(&mut self) -> TransportEvent {
        self.t.device_work(&mut self.env, |d, q, e| d.receive(q, e))
    }

    fn type_input(&mut self, bytes: &[u8]) {
        self.env.input.extend(bytes.iter().copied());
    }

    fn used(&mut self, q: usize) -> Vec<(u32, u32)> {
        self.qs[q].take_used(&mut self.env.mem)
    }

    /// Acknowledge every pending interrupt, as the driver's handler does.
    fn ack(&mut self) {
        let status = read_reg(&mut self.t, mmio::INTERRUPT_STATUS);
        write_reg(&mut self.t, &mut self.env, mmio::INTERRUPT_ACK, status);
        assert!(!self.t.interrupt_pending());
    }

    /// The first `len` bytes of the chain's buffers, as the driver reads
    /// them after the device returned it.
    fn read_back(&self, chain: &RxChain, len: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut left = len as usize;
        for &(at, l) in &chain.bufs {
            let n = left.min(l as usize);
            let start = (at - BASE) as usize;
            out.extend_from_slice(&self.env.mem.bytes[start..start + n]);
            left -= n;
        }
        assert_eq!(left, 0, "used length {len} longer than the chain");
        out
    }

    /// The bytes of the chain past `len` still hold the driver's filler.
    fn untouched_after(&self, chain: &RxChain, len: u32) -> bool {
        let mut skip = len as usize;
        for &(at, l) in &chain.bufs {
            let start = (at - BASE) as usize;
            let bytes = &self.env.mem.bytes[start..start + l as usize];
            let from = skip.min(bytes.len());
            if bytes[from..].iter().any(|&b| b != FILL) {
                return false;
            }
            skip -= from;
        }
        true
    }

    /// Every device write since the last log clear lies inside one of `allowed`.
    fn assert_writes_within(&self, allowed: &[Range<u64>]) {
        for &(at, len) in self.env.mem.writes() {
            let end = at + len as u64;
            assert!(
                allowed.iter().any(|r| r.start <= at && end <= r.end),
                "device wrote {len} bytes at {at:#x}, outside {allowed:x?}"
            );
        }
    }

    fn stats(&self) -> ConsoleStats {
        *self.t.device().stats()
    }
}

/// What `needs_reset` tests check after a guest error: the event names the
/// console and `kind`, the transport is stopped, the error is kept.
fn expect_needs_reset(r: &Rig, ev: &TransportEvent, queue: usize, kind: &DeviceErrorKind) {
    match ev {
        TransportEvent::NeedsReset { device, error } => {
            assert_eq!(*device, "virtio-console");
            assert_eq!(&error.kind, kind);
            assert_eq!(error.queue.map(|q| q.index), Some(queue));
        }
        other => panic!("expected NeedsReset, got {other:?}"),
    }
    assert!(r.t.needs_reset());
    assert_ne!(r.t.status() & mmio::STATUS_DEVICE_NEEDS_RESET, 0);
    assert_eq!(r.t.last_error().map(|e| &e.kind), Some(kind));
    assert_ne!(r.t.interrupt_status() & mmio::INT_CONFIG_CHANGE, 0);
}

/// The queue error for a descriptor of chain `head` (`index`) that
/// points at `len` bytes at `ipa`, not guest RAM.
fn not_ram(head: u16, index: u16, ipa: u64, len: u32) -> DeviceErrorKind {
    DeviceErrorKind::Queue(QueueError::DescriptorNotRam {
        head,
        index,
        ipa: GuestAddr::new(ipa),
        len,
    })
}

impl Rig {
    /// Typed `input`, then the device's receive work stops it with `kind`
    /// ([`expect_needs_reset`]).
    fn receive_fails(&mut self, input: &[u8], kind: &DeviceErrorKind) {
        self.type_input(input);
        let ev = self.receive_work();
        expect_needs_reset(self, &ev, RECEIVEQ, kind);
    }

    /// [`expect_needs_reset`], and the bad chain `head` alone came back,
    /// with length 0, so that a driver waiting for it is not stuck.
    fn expect_returned_bad(
        &mut self,
        ev: &TransportEvent,
        queue: usize,
        kind: &DeviceErrorKind,
        head: u16,
    ) {
        expect_needs_reset(self, ev, queue, kind);
        assert_eq!(self.used(queue), vec![(u32::from(head), 0)]);
    }
}

// ---------------------------------------------------------------------------
// 1. Probe

#[test]
fn probe_like_linux_virtio_console() {
    let mut r = Rig::new();
    assert_eq!(read_reg(&mut r.t, mmio::MAGIC_VALUE), mmio::MAGIC);
    assert_eq!(read_reg(&mut r.t, mmio::DEVICE_ID), 3);
    assert_eq!(DEVICE_ID, 3);

    // Offered features: exactly VERSION_1 (no SIZE, MULTIPORT, EMERG_WRITE).
    write_reg(&mut r.t, &mut r.env, mmio::DEVICE_FEATURES_SEL, 0);
    assert_eq!(read_reg(&mut r.t, mmio::DEVICE_FEATURES), 0);
    write_reg(&mut r.t, &mut r.env, mmio::DEVICE_FEATURES_SEL, 1);
    assert_eq!(read_reg(&mut r.t, mmio::DEVICE_FEATURES), 1);
    assert_eq!(r.t.offered_features(), VIRTIO_F_VERSION_1);

    // Two queues of QueueNumMax 64, then none.
    for (q, max) in [(0u32, 64u32), (1, 64), (2, 0)] {
        write_reg(&mut r.t, &mut r.env, mmio::QUEUE_SEL, q);
        assert_eq!(read_reg(&mut r.t, mmio::QUEUE_NUM_MAX), max, "queue {q}");
    }

    // Config space (cols, rows, max_nr_ports, emerg_wr) reads as zeros.
    for off in (0..12).step_by(4) {
        assert_eq!(r.t.read(mmio::CONFIG + off, 4), Ok(0), "config {off}");
    }

    // Linux asks for VERSION_1 and the console features; only VERSION_1 sticks.
    let linux_wants = VIRTIO_F_VERSION_1 | 0b111; // SIZE | MULTIPORT | EMERG_WRITE
    let status = handshake(&mut r.t, &mut r.env, linux_wants, &r.qs);
    assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
    assert_eq!(r.t.negotiated_features(), VIRTIO_F_VERSION_1);
    assert_eq!(
        driver_ok(&mut r.t, &mut r.env),
        TransportEvent::Activated {
            features: VIRTIO_F_VERSION_1
        }
    );
    assert!(r.t.queues().iter().all(|q| q.ready() && q.size() == 64));
    assert!(!r.t.needs_reset());
    assert!(!r.t.interrupt_pending());

    // The console is usable right away.
    r.tx(&[b"login: "]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.env.out, b"login: ");
}

#[test]
fn multiport_is_refused_at_features_ok() {
    let mut r = Rig::new();
    write_reg(&mut r.t, &mut r.env, mmio::STATUS, mmio::STATUS_ACKNOWLEDGE);
    write_reg(
        &mut r.t,
        &mut r.env,
        mmio::STATUS,
        mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER,
    );
    write_reg(&mut r.t, &mut r.env, mmio::DRIVER_FEATURES_SEL, 1);
    write_reg(&mut r.t, &mut r.env, mmio::DRIVER_FEATURES, 1);
    write_reg(&mut r.t, &mut r.env, mmio::DRIVER_FEATURES_SEL, 0);
    // VIRTIO_CONSOLE_F_MULTIPORT (bit 1), not offered.
    write_reg(&mut r.t, &mut r.env, mmio::DRIVER_FEATURES, 1 << 1);
    write_reg(
        &mut r.t,
        &mut r.env,
        mmio::STATUS,
        mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER | mmio::STATUS_FEATURES_OK,
    );
    assert_eq!(
        read_reg(&mut r.t, mmio::STATUS) & mmio::STATUS_FEATURES_OK,
        0
    );
}

#[test]
fn receive_buffers_kicked_before_driver_ok_are_filled_at_driver_ok() {
    let mut r = Rig::new();
    let status = handshake(&mut r.t, &mut r.env, VIRTIO_F_VERSION_1, &r.qs);
    assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
    r.type_input(b"early");
    let c = r.post_rx(&[16]);
    // Kicked before DRIVER_OK: remembered, nothing done yet.
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::None);
    assert!(r.used(RECEIVEQ).is_empty());
    assert_eq!(r.env.input.len(), 5);
    assert!(matches!(
        driver_ok(&mut r.t, &mut r.env),
        TransportEvent::Activated { .. }
    ));
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(c.head), 5)]);
    assert_eq!(r.read_back(&c, 5), b"early");
    assert!(r.t.interrupt_pending());
}

#[test]
fn device_work_before_driver_ok_does_nothing() {
    let mut r = Rig::new();
    handshake(&mut r.t, &mut r.env, VIRTIO_F_VERSION_1, &r.qs);
    r.post_rx(&[8]);
    r.type_input(b"x");
    assert_eq!(r.receive_work(), TransportEvent::None);
    assert_eq!(r.env.input.len(), 1);
    assert!(r.used(RECEIVEQ).is_empty());
}

// ---------------------------------------------------------------------------
// 2. Transmit

#[test]
fn transmit_chains_in_order() {
    let mut r = Rig::live();
    let h1 = r.tx(&[b"hello ", b"world\n"]);
    let h2 = r.tx(&[b"$ "]);
    let h3 = r.tx(&[b"a", b"b", b"c"]);
    assert!(!r.t.interrupt_pending());
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.env.out, b"hello world\n$ abc");
    // Deferred: Linux's writes poll the used ring. The signal goes out at
    // the next flush (the memory tick), once.
    assert!(!r.t.interrupt_pending());
    assert!(r.t.flush_deferred());
    assert!(r.t.interrupt_pending());
    assert!(!r.t.flush_deferred(), "nothing new");
    assert_eq!(
        r.used(TRANSMITQ),
        vec![(u32::from(h1), 0), (u32::from(h2), 0), (u32::from(h3), 0)]
    );
    assert!(r.t.interrupt_pending());
    assert_eq!(r.t.interrupt_status(), mmio::INT_USED_BUFFER);
    assert_eq!(
        r.stats(),
        ConsoleStats {
            bytes_out: 17,
            chains_out: 3,
            bytes_in: 0,
            buffers_in: 0,
            passes_cut: 0,
        }
    );
    // The device wrote only the transmitq's used ring.
    let used = r.qs[TRANSMITQ].used_area();
    r.assert_writes_within(&[used]);

    // A second batch after the interrupt was acknowledged.
    r.ack();
    let h4 = r.tx(&[b"ls\n"]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.env.out, b"hello world\n$ abcls\n");
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(h4), 0)]);
    assert_eq!(r.stats().chains_out, 4);
}

#[test]
fn transmit_longer_than_a_piece_arrives_intact() {
    let mut r = Rig::live();
    let mut rng = XorShift(0x1234_5678_9abc_def1);
    let page = rng.bytes(4096);
    let odd = rng.bytes(300);
    // 300 bytes split unevenly across three descriptors (none a piece multiple).
    let h1 = r.tx(&[&page]);
    let h2 = r.tx(&[&odd[..1], &odd[1..200], &odd[200..]]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    let mut want = page.clone();
    want.extend_from_slice(&odd);
    assert_eq!(r.env.out.len(), want.len());
    assert!(r.env.out == want, "output differs from what was queued");
    assert_eq!(
        r.used(TRANSMITQ),
        vec![(u32::from(h1), 0), (u32::from(h2), 0)]
    );
    assert_eq!(r.stats().bytes_out, 4396);
    assert_eq!(r.stats().chains_out, 2);
}

#[test]
fn transmit_of_exactly_max_chain_is_accepted() {
    let mut r = Rig::live();
    let mut rng = XorShift(99);
    let data = rng.bytes(MAX_TX_CHAIN as usize);
    let half = data.len() / 2;
    let h = r.tx(&[&data[..half], &data[half..]]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert!(r.env.out == data);
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(h), 0)]);
    assert_eq!(r.stats().bytes_out, u64::from(MAX_TX_CHAIN));
}

#[test]
fn empty_transmit_chain_is_returned() {
    let mut r = Rig::live();
    let h = r.tx(&[b""]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert!(r.env.out.is_empty());
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(h), 0)]);
    assert_eq!(r.stats().chains_out, 1);
    assert_eq!(r.stats().bytes_out, 0);
}

#[test]
fn empty_notify_is_quiet_only_on_the_transmitq() {
    let mut r = Rig::live();
    assert!(r.t.empty_notify(4, TRANSMITQ as u32, &mut r.env.mem));
    assert!(!r.t.empty_notify(4, RECEIVEQ as u32, &mut r.env.mem));
    r.tx(&[b"x"]);
    assert!(!r.t.empty_notify(4, TRANSMITQ as u32, &mut r.env.mem));
}

/// Chains a storm republishes: far more than one exit may take.
const STORM: u32 = 10_000;

#[test]
fn a_transmit_storm_is_handled_a_bounded_pass_at_a_time() {
    // Issue 36: a second vCPU publishing chains as fast as the device
    // returns them kept the notify's loop (and the VM lock) forever.
    let mut r = Rig::live();
    let head = r.tx(&[b"x"]);
    r.env.storm = Some(Storm {
        q: r.qs[TRANSMITQ].clone(),
        head,
        left: STORM,
    });
    r.notify(TRANSMITQ);
    let first = r.stats().chains_out;
    assert!(
        first <= u64::from(QUEUE_SIZE),
        "one notify handled {first} chains"
    );
    assert_eq!(first, CHAINS_PER_PASS as u64);
    assert!(r.t.device().has_more());
    assert_eq!(r.stats().passes_cut, 1);
    // Saved and restored mid-storm (as a snapshot would take it), the
    // device goes on where it was: the cut pass is resumed.
    let mut w = crate::savestate::StateWriter::default();
    r.t.save(&mut w);
    let saved = w.into_bytes();
    let mut rd = crate::savestate::StateReader::new(&saved);
    r.t = MmioTransport::restore(&mut rd).expect("restores");
    assert_eq!(rd.finish(), Ok(()));
    assert!(r.t.device().has_more());
    // The rest, a bounded pass at a time: the guest's next notifies and
    // the memory tick's resume (the guest need not notify again).
    let mut passes = 1;
    while r.t.device().has_more() {
        let before = r.stats().chains_out;
        if passes % 2 == 0 {
            r.notify(TRANSMITQ);
        } else {
            r.t.device_work(&mut r.env, |d, q, e| d.resume(q, e));
        }
        let took = r.stats().chains_out - before;
        assert!(took <= CHAINS_PER_PASS as u64, "a pass took {took}");
        passes += 1;
        assert!(passes < 1000, "the storm never ended");
    }
    assert_eq!(r.env.storm.as_ref().map(|s| s.left), Some(0));
    assert_eq!(r.stats().chains_out, u64::from(STORM) + 1);
    assert_eq!(r.env.out.len(), STORM as usize + 1);
    assert!(!r.t.needs_reset());
    // Once drained, a resume has nothing to do.
    r.t.device_work(&mut r.env, |d, q, e| d.resume(q, e));
    assert_eq!(r.stats().chains_out, u64::from(STORM) + 1);
}

#[test]
fn a_transmit_pass_starts_no_chain_past_its_byte_bound() {
    // Chains of 16 KiB: the fifth would pass 64 KiB.
    let mut r = Rig::live();
    let big = vec![b'y'; 16 * 1024];
    for _ in 0..6 {
        r.tx(&[&big]);
    }
    r.notify(TRANSMITQ);
    assert_eq!(r.stats().chains_out, 4);
    assert!(r.t.device().has_more());
    r.t.device_work(&mut r.env, |d, q, e| d.resume(q, e));
    assert_eq!(r.stats().chains_out, 6);
    assert!(!r.t.device().has_more());
    assert_eq!(r.env.out.len(), 6 * big.len());
}

// ---------------------------------------------------------------------------
// 3. Transmit errors

#[test]
fn writable_descriptor_on_transmitq_needs_reset() {
    let mut r = Rig::live();
    r.tx(&[b"ok\n"]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    r.used(TRANSMITQ);
    r.ack();
    r.env.mem.clear_log();

    let text = r.alloc(4);
    r.env.mem.poke(text, b"bad!");
    let sink = r.alloc(16);
    let bad = r.add_raw(TRANSMITQ, &[(text, 4, false), (sink, 16, true)]);
    // Queued after the bad chain, in the same batch: never processed.
    r.tx(&[b"after"]);
    let ev = r.notify(TRANSMITQ);
    let writable_desc = (bad + 1) % QUEUE_SIZE;
    expect_needs_reset(
        &r,
        &ev,
        TRANSMITQ,
        &DeviceErrorKind::UnexpectedWritable {
            desc: writable_desc,
        },
    );
    assert_eq!(r.t.last_error().and_then(|e| e.head), Some(bad));
    // The bad chain comes back with length 0, the next one does not.
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(bad), 0)]);
    assert_ne!(r.t.interrupt_status() & mmio::INT_USED_BUFFER, 0);
    assert_eq!(r.env.out, b"ok\n");
    assert_eq!(r.stats().chains_out, 1);
    // The device never wrote the writable buffer.
    let used = r.qs[TRANSMITQ].used_area();
    r.assert_writes_within(&[used]);

    // Stopped: further notifications do nothing.
    let ignored = r.t.stats().notifications_ignored;
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.t.stats().notifications_ignored, ignored + 1);
    assert_eq!(r.env.out, b"ok\n");
    assert!(r.used(TRANSMITQ).is_empty());
}

#[test]
fn transmit_chain_longer_than_max_is_too_long() {
    let mut r = Rig::live();
    let a = r.alloc(MAX_TX_CHAIN / 2);
    let b = r.alloc(MAX_TX_CHAIN / 2 + 1);
    let head = r.add_raw(
        TRANSMITQ,
        &[
            (a, MAX_TX_CHAIN / 2, false),
            (b, MAX_TX_CHAIN / 2 + 1, false),
        ],
    );
    let ev = r.notify(TRANSMITQ);
    expect_needs_reset(
        &r,
        &ev,
        TRANSMITQ,
        &DeviceErrorKind::TooLong {
            len: MAX_TX_CHAIN + 1,
            max: MAX_TX_CHAIN,
        },
    );
    assert!(r.env.out.is_empty(), "nothing of a refused chain is shown");
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(head), 0)]);
    assert_eq!(r.stats().chains_out, 0);
}

#[test]
fn transmit_descriptor_outside_ram() {
    for (ipa, len) in [
        (0x1000u64, 16u32), // below RAM
        (RAM_END, 1),       // just past the end
        (RAM_END - 4, 16),  // runs past the end
        (BASE - 8, 16),     // starts just below
    ] {
        let mut r = Rig::live();
        r.tx(&[b"first "]);
        let head = r.add_raw(TRANSMITQ, &[(ipa, len, false)]);
        r.tx(&[b"never"]);
        let ev = r.notify(TRANSMITQ);
        expect_needs_reset(&r, &ev, TRANSMITQ, &not_ram(head, head, ipa, len));
        assert_eq!(r.env.out, b"first ", "{ipa:#x}+{len}");
        assert!(!r.env.mem.refused().is_empty());
        assert!(
            r.env.mem.refused().iter().all(|&(at, _)| at == ipa),
            "{:x?}",
            r.env.mem.refused()
        );
        let used = r.qs[TRANSMITQ].used_area();
        r.assert_writes_within(&[used]);
        assert_eq!(
            r.used(TRANSMITQ),
            vec![(0, 0), (u32::from(head), 0)],
            "first chain then the bad one"
        );
    }
}

#[test]
fn transmit_descriptor_overflowing_the_address_space() {
    let mut r = Rig::live();
    let head = r.add_raw(TRANSMITQ, &[(u64::MAX - 2, 16, false)]);
    let ev = r.notify(TRANSMITQ);
    expect_needs_reset(
        &r,
        &ev,
        TRANSMITQ,
        &DeviceErrorKind::Queue(QueueError::DescriptorOverflow {
            head,
            index: head,
            ipa: GuestAddr::new(u64::MAX - 2),
            len: 16,
        }),
    );
    assert!(r.env.out.is_empty());
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(head), 0)]);
}

// ---------------------------------------------------------------------------
// 4. Receive

#[test]
fn receive_fills_buffers_in_order() {
    let mut r = Rig::live();
    let chains: Vec<RxChain> = (0..3).map(|_| r.post_rx(&[8])).collect();

    // Nothing typed: the notification takes no buffer and writes nothing.
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::None);
    assert!(r.used(RECEIVEQ).is_empty());
    assert!(!r.t.interrupt_pending());
    assert!(r.env.mem.writes().is_empty(), "{:x?}", r.env.mem.writes());
    assert_eq!(r.t.queues()[RECEIVEQ].in_flight(), 0);

    let typed: Vec<u8> = (b'a'..=b't').collect();
    assert_eq!(typed.len(), 20);
    r.type_input(&typed);
    assert_eq!(r.receive_work(), TransportEvent::Interrupt);
    let want: Vec<(u32, u32)> = chains
        .iter()
        .zip([8, 8, 4])
        .map(|(c, n)| (u32::from(c.head), n))
        .collect();
    assert_eq!(r.used(RECEIVEQ), want);
    assert_eq!(r.read_back(&chains[0], 8), b"abcdefgh");
    assert_eq!(r.read_back(&chains[1], 8), b"ijklmnop");
    assert_eq!(r.read_back(&chains[2], 4), b"qrst");
    assert!(r.untouched_after(&chains[2], 4));
    assert!(r.t.interrupt_pending());
    assert!(r.env.input.is_empty());
    assert_eq!(r.stats().bytes_in, 20);
    assert_eq!(r.stats().buffers_in, 3);

    // Every write is in a buffer or the receiveq's used ring.
    let mut allowed: Vec<Range<u64>> = chains
        .iter()
        .flat_map(|c| c.bufs.iter().map(|&(a, l)| a..a + u64::from(l)))
        .collect();
    allowed.push(r.qs[RECEIVEQ].used_area());
    r.assert_writes_within(&allowed);
}

#[test]
fn input_waits_for_buffers() {
    let mut r = Rig::live();
    let c1 = r.post_rx(&[8]);
    let c2 = r.post_rx(&[8]);
    r.type_input(b"0123456789abcdefXYZW");
    assert_eq!(r.receive_work(), TransportEvent::Interrupt);
    assert_eq!(
        r.used(RECEIVEQ),
        vec![(u32::from(c1.head), 8), (u32::from(c2.head), 8)]
    );
    assert_eq!(r.read_back(&c1, 8), b"01234567");
    assert_eq!(r.read_back(&c2, 8), b"89abcdef");
    // Four bytes left, no buffer: they wait.
    assert_eq!(r.env.input, b"XYZW".to_vec());
    r.ack();

    // More host work without new buffers changes nothing.
    assert_eq!(r.receive_work(), TransportEvent::None);
    assert_eq!(r.env.input.len(), 4);
    assert!(!r.t.interrupt_pending());

    // The driver posts a buffer and kicks: the rest goes out.
    let c3 = r.post_rx(&[8]);
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::Interrupt);
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(c3.head), 4)]);
    assert_eq!(r.read_back(&c3, 4), b"XYZW");
    assert!(r.untouched_after(&c3, 4));
    assert!(r.env.input.is_empty());
    assert_eq!(r.stats().buffers_in, 3);
    assert_eq!(r.stats().bytes_in, 20);
}

#[test]
fn receive_chain_of_several_descriptors() {
    let mut r = Rig::live();
    let c = r.post_rx(&[3, 5]);
    r.type_input(b"ABCDEFGHIJ");
    assert_eq!(r.receive_work(), TransportEvent::Interrupt);
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(c.head), 8)]);
    let (a, _) = c.bufs[0];
    let (b, _) = c.bufs[1];
    let at = |ipa: u64, n: usize| {
        let s = (ipa - BASE) as usize;
        r.env.mem.bytes[s..s + n].to_vec()
    };
    assert_eq!(at(a, 3), b"ABC");
    assert_eq!(at(b, 5), b"DEFGH");
    assert_eq!(r.env.input, b"IJ".to_vec());

    // A partial fill of a multi-descriptor chain stops inside the second one.
    let d = r.post_rx(&[1, 4, 2]);
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::Interrupt);
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(d.head), 2)]);
    assert_eq!(r.read_back(&d, 2), b"IJ");
    assert!(r.untouched_after(&d, 2));
}

#[test]
fn receive_large_input_in_pieces() {
    let mut r = Rig::live();
    let mut rng = XorShift(7);
    let typed = rng.bytes(1000);
    let c = r.post_rx(&[700, 1, 200]);
    let d = r.post_rx(&[4096]);
    r.type_input(&typed);
    assert_eq!(r.receive_work(), TransportEvent::Interrupt);
    assert_eq!(
        r.used(RECEIVEQ),
        vec![(u32::from(c.head), 901), (u32::from(d.head), 99)]
    );
    let mut got = r.read_back(&c, 901);
    got.extend(r.read_back(&d, 99));
    assert!(got == typed);
    assert!(r.untouched_after(&d, 99));
    // The device takes input at most a piece at a time.
    let most = r.env.max_take.get();
    assert!(most > 0 && most <= PIECE, "looked at {most} at once");
}

#[test]
fn a_receive_storm_is_handled_a_bounded_pass_at_a_time() {
    // One-byte receive buffers republished as fast as they are filled,
    // and more input than a pass may take.
    let mut r = Rig::live();
    let chain = r.post_rx(&[1]);
    r.env.storm = Some(Storm {
        q: r.qs[RECEIVEQ].clone(),
        head: chain.head,
        left: 1000,
    });
    r.type_input(&[b'z'; 500]);
    r.receive_work();
    assert_eq!(r.stats().buffers_in, CHAINS_PER_PASS as u64);
    assert!(r.t.device().has_more());
    while r.t.device().has_more() {
        let before = r.stats().buffers_in;
        r.t.device_work(&mut r.env, |d, q, e| d.resume(q, e));
        assert!(r.stats().buffers_in - before <= CHAINS_PER_PASS as u64);
    }
    assert_eq!((r.stats().bytes_in, r.stats().buffers_in), (500, 500));
    assert!(r.env.input.is_empty());
}

// ---------------------------------------------------------------------------
// 5. Receive errors

#[test]
fn readable_descriptor_on_receiveq_needs_reset() {
    let mut r = Rig::live();
    let buf = r.alloc(8);
    let head = r.add_raw(RECEIVEQ, &[(buf, 8, false)]);
    // Not looked at while nothing is typed.
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::None);
    assert!(!r.t.needs_reset());

    r.type_input(b"hello");
    let ev = r.receive_work();
    r.expect_returned_bad(
        &ev,
        RECEIVEQ,
        &DeviceErrorKind::UnexpectedReadable { desc: head },
        head,
    );
    // The input was not consumed by the refused chain.
    assert_eq!(r.env.input, b"hello".to_vec());
    assert_eq!(r.stats().buffers_in, 0);
    let used = r.qs[RECEIVEQ].used_area();
    r.assert_writes_within(&[used]);
}

#[test]
fn readable_then_writable_on_receiveq_needs_reset() {
    let mut r = Rig::live();
    let a = r.alloc(4);
    let b = r.alloc(8);
    let head = r.add_raw(RECEIVEQ, &[(a, 4, false), (b, 8, true)]);
    r.receive_fails(b"x", &DeviceErrorKind::UnexpectedReadable { desc: head });
    assert_eq!(r.env.input.len(), 1);
}

#[test]
fn zero_length_receive_chain_needs_reset() {
    let mut r = Rig::live();
    let buf = r.alloc(8);
    let good = r.post_rx(&[4]);
    let head = r.add_raw(RECEIVEQ, &[(buf, 0, true)]);
    let never = r.post_rx(&[4]);
    r.receive_fails(
        b"abcdefgh",
        &DeviceErrorKind::BadLength {
            len: 0,
            multiple_of: 1,
        },
    );
    assert_eq!(
        r.used(RECEIVEQ),
        vec![(u32::from(good.head), 4), (u32::from(head), 0)]
    );
    assert_eq!(r.read_back(&good, 4), b"abcd");
    assert!(r.untouched_after(&never, 0));
    assert_eq!(r.env.input, b"efgh".to_vec());
}

#[test]
fn receive_descriptor_outside_ram() {
    for (ipa, len) in [(0x1000u64, 8u32), (RAM_END - 4, 8), (RAM_END, 8)] {
        let mut r = Rig::live();
        let head = r.add_raw(RECEIVEQ, &[(ipa, len, true)]);
        r.receive_fails(b"abcdefgh", &not_ram(head, head, ipa, len));
        assert!(r.env.mem.refused().iter().any(|&(at, _)| at == ipa));
        let used = r.qs[RECEIVEQ].used_area();
        r.assert_writes_within(&[used]);
        assert_eq!(r.used(RECEIVEQ), vec![(u32::from(head), 0)]);
    }
}

/// Up to FEATURES_OK with VERSION_1, configuring no queue.
fn features_ok(r: &mut Rig) {
    let status = handshake(&mut r.t, &mut r.env, VIRTIO_F_VERSION_1, &[]);
    assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
}

/// Configure queue `index` from `r.qs[index]` and write QueueReady 1.
fn setup_queue(r: &mut Rig, index: usize) -> TransportEvent {
    let q = r.qs[index].clone();
    write_reg(&mut r.t, &mut r.env, mmio::QUEUE_SEL, index as u32);
    write_reg(&mut r.t, &mut r.env, mmio::QUEUE_NUM, u32::from(q.size));
    for (lo, ipa) in [
        (mmio::QUEUE_DESC_LOW, q.desc),
        (mmio::QUEUE_DRIVER_LOW, q.avail),
        (mmio::QUEUE_DEVICE_LOW, q.used),
    ] {
        write_reg(&mut r.t, &mut r.env, lo, ipa as u32);
        write_reg(&mut r.t, &mut r.env, lo + 4, (ipa >> 32) as u32);
    }
    write_reg(&mut r.t, &mut r.env, mmio::QUEUE_READY, 1)
}

/// Typed bytes are not lost when a receive chain cannot be filled or
/// returned: the chain comes back with length 0 or not at all (the guest got
/// nothing of it), so the bytes must still wait in the VM's input queue
/// (after the reset the VM sends them to the PL011), as they do when the
/// chain is readable or empty (`readable_descriptor_on_receiveq_needs_reset`,
/// `zero_length_receive_chain_needs_reset`).
#[test]
fn receive_failure_keeps_the_input() {
    let mut lost = Vec::new();

    // (a) One descriptor entirely outside RAM.
    let mut r = Rig::live();
    let head = r.add_raw(RECEIVEQ, &[(RAM_END, 8, true)]);
    r.type_input(b"abcdefgh");
    let ev = r.receive_work();
    r.expect_returned_bad(&ev, RECEIVEQ, &not_ram(head, head, RAM_END, 8), head);
    if r.env.input != b"abcdefgh".to_vec() {
        lost.push(("descriptor outside RAM", r.env.input.clone()));
    }

    // (b) A good descriptor, then one outside RAM.
    let mut r = Rig::live();
    let good = r.alloc(3);
    let head = r.add_raw(RECEIVEQ, &[(good, 3, true), (RAM_END, 5, true)]);
    r.type_input(b"abcdefgh");
    let ev = r.receive_work();
    r.expect_returned_bad(&ev, RECEIVEQ, &not_ram(head, head + 1, RAM_END, 5), head);
    if r.env.input != b"abcdefgh".to_vec() {
        lost.push(("second descriptor outside RAM", r.env.input.clone()));
    }

    // (c) The used element of the second chain falls in a hole of RAM: the
    // first chain ("ab") was returned, the second never is.
    let mut r = Rig::live();
    let slot1 = r.qs[RECEIVEQ].used + 4 + 8;
    r.env.hole = Some(slot1..slot1 + 8);
    let c0 = r.post_rx(&[2]);
    r.post_rx(&[2]);
    r.type_input(b"abcdefgh");
    assert!(matches!(
        r.receive_work(),
        TransportEvent::NeedsReset { .. }
    ));
    r.env.hole = None;
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(c0.head), 2)]);
    if r.env.input != b"cdefgh".to_vec() {
        lost.push(("used ring hole", r.env.input.clone()));
    }

    assert!(lost.is_empty(), "typed bytes lost: {lost:?}");
}

#[test]
fn receive_used_ring_outside_ram_is_refused_at_queue_ready() {
    let mut r = Rig::new();
    // The receiveq's used ring runs past the end of RAM.
    r.qs[RECEIVEQ].used = RAM_END - 0x100;
    features_ok(&mut r);
    let ev = setup_queue(&mut r, RECEIVEQ);
    match &ev {
        TransportEvent::NeedsReset { error, .. } => {
            assert!(
                matches!(
                    error.kind,
                    DeviceErrorKind::Queue(QueueError::RingNotRam {
                        area: crate::virtio::queue::Area::Used,
                        ..
                    })
                ),
                "{error:?}"
            );
        }
        other => panic!("expected NeedsReset, got {other:?}"),
    }
    assert!(r.t.needs_reset());
    assert_eq!(read_reg(&mut r.t, mmio::QUEUE_READY), 0);
    // The host's input work does nothing on a stopped device.
    r.type_input(b"x");
    assert_eq!(r.receive_work(), TransportEvent::None);
    assert_eq!(r.env.input.len(), 1);
}

#[test]
fn receiveq_left_unconfigured_is_not_an_error() {
    // A driver that only ever writes (the receiveq never made ready).
    let mut r = Rig::new();
    features_ok(&mut r);
    assert_eq!(setup_queue(&mut r, TRANSMITQ), TransportEvent::None);
    assert!(matches!(
        driver_ok(&mut r.t, &mut r.env),
        TransportEvent::Activated { .. }
    ));
    r.type_input(b"ignored until there is a receiveq");
    assert_eq!(r.receive_work(), TransportEvent::None);
    assert!(!r.t.needs_reset(), "{:?}", r.t.last_error());
    assert_eq!(r.env.input.len(), 33);
    let h = r.tx(&[b"still prints"]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(h), 0)]);
    assert_eq!(r.env.out, b"still prints");
}

#[test]
fn receive_used_ring_with_a_hole_needs_reset() {
    let mut r = Rig::live();
    // A hole in the middle of the receiveq's used ring (slot 2): enable only
    // probed its ends, so the device meets it when it returns the third buffer.
    let slot2 = r.qs[RECEIVEQ].used + 4 + 8 * 2;
    r.env.hole = Some(slot2..slot2 + 8);
    let chains: Vec<RxChain> = (0..4).map(|_| r.post_rx(&[2])).collect();
    r.type_input(b"abcdefgh");
    let ev = r.receive_work();
    match &ev {
        TransportEvent::NeedsReset { error, .. } => assert!(
            matches!(
                error.kind,
                DeviceErrorKind::Queue(QueueError::RingNotRam { .. })
            ),
            "{error:?}"
        ),
        other => panic!("expected NeedsReset, got {other:?}"),
    }
    assert!(r.t.needs_reset());
    assert!(r.env.hole_hits > 0);
    // The first two came back.
    r.env.hole = None;
    assert_eq!(
        r.used(RECEIVEQ),
        vec![
            (u32::from(chains[0].head), 2),
            (u32::from(chains[1].head), 2)
        ]
    );
    assert!(r.untouched_after(&chains[3], 0));
}

#[test]
fn receive_avail_ring_garbage_needs_reset() {
    // avail.idx far ahead of the device.
    let mut r = Rig::live();
    let avail = r.qs[RECEIVEQ].avail;
    r.env.mem.poke(avail + 2, &200u16.to_le_bytes());
    r.receive_fails(
        b"abc",
        &DeviceErrorKind::Queue(QueueError::AvailTooFarAhead {
            avail_idx: 200,
            last_avail_idx: 0,
            size: QUEUE_SIZE,
        }),
    );
    assert_eq!(r.env.input.len(), 3);

    // A head index outside the queue.
    let mut r = Rig::live();
    r.qs[RECEIVEQ].publish(&mut r.env.mem, 999);
    r.receive_fails(
        b"abc",
        &DeviceErrorKind::Queue(QueueError::HeadOutOfRange {
            head: 999,
            size: QUEUE_SIZE,
        }),
    );
    assert!(r.used(RECEIVEQ).is_empty());

    // A descriptor loop.
    let mut r = Rig::live();
    let buf = r.alloc(8);
    r.qs[RECEIVEQ].write_desc(
        &mut r.env.mem,
        0,
        buf,
        8,
        crate::virtio::queue::VIRTQ_DESC_F_WRITE | crate::virtio::queue::VIRTQ_DESC_F_NEXT,
        0,
    );
    r.qs[RECEIVEQ].publish(&mut r.env.mem, 0);
    r.receive_fails(
        b"abc",
        &DeviceErrorKind::Queue(QueueError::ChainTooLong {
            head: 0,
            size: QUEUE_SIZE,
        }),
    );
    assert_eq!(r.used(RECEIVEQ), vec![(0, 0)]);
}

// ---------------------------------------------------------------------------
// 6. Reset

#[test]
fn reset_then_new_handshake_delivers_again() {
    let mut r = Rig::live();
    r.tx(&[b"before\n"]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    let buf = r.alloc(8);
    r.add_raw(TRANSMITQ, &[(buf, 8, true)]);
    assert!(matches!(
        r.notify(TRANSMITQ),
        TransportEvent::NeedsReset { .. }
    ));
    // Input typed while the device is stopped waits.
    r.type_input(b"typed");
    r.post_rx(&[8]);
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::None);
    assert_eq!(r.env.input.len(), 5);

    assert_eq!(
        write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0),
        TransportEvent::Reset
    );
    assert!(!r.t.needs_reset());
    assert_eq!(r.t.status(), 0);
    assert!(!r.t.interrupt_pending());
    assert!(r.t.queues().iter().all(|q| !q.ready()));

    // The driver allocates fresh (zeroed) rings and probes again.
    for q in driver_queues() {
        r.env.mem.poke(q.desc, &[0; 0x1000]);
    }
    r.qs = driver_queues();
    r.probe();

    let c = r.post_rx(&[8]);
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::Interrupt);
    assert_eq!(r.used(RECEIVEQ), vec![(u32::from(c.head), 5)]);
    assert_eq!(r.read_back(&c, 5), b"typed");
    r.ack();

    let h = r.tx(&[b"after", b"\n"]);
    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
    assert_eq!(r.used(TRANSMITQ), vec![(u32::from(h), 0)]);
    assert_eq!(r.env.out, b"before\nafter\n");
    // The statistics count since the VM started, across resets.
    assert_eq!(r.stats().chains_out, 2);
    assert_eq!(r.stats().bytes_out, 13);
    assert_eq!(r.stats().bytes_in, 5);
}

#[test]
fn reset_of_a_live_device_then_reprobe() {
    let mut r = Rig::live();
    r.post_rx(&[8]);
    r.post_rx(&[8]);
    write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0);
    r.type_input(b"zz");
    // Old buffers are forgotten: no DRIVER_OK, nothing delivered.
    assert_eq!(r.receive_work(), TransportEvent::None);
    assert_eq!(r.env.input.len(), 2);
    for q in driver_queues() {
        r.env.mem.poke(q.desc, &[0; 0x1000]);
    }
    r.qs = driver_queues();
    r.probe();
    let c = r.post_rx(&[1]);
    let d = r.post_rx(&[1]);
    assert_eq!(r.notify(RECEIVEQ), TransportEvent::Interrupt);
    assert_eq!(
        r.used(RECEIVEQ),
        vec![(u32::from(c.head), 1), (u32::from(d.head), 1)]
    );
    assert_eq!(r.read_back(&c, 1), b"z");
    assert_eq!(r.read_back(&d, 1), b"z");
}

// ---------------------------------------------------------------------------
// 7. Randomized traffic

/// Split `data` into 1..=4 parts (some possibly empty) at random points.
fn random_split<'a>(rng: &mut XorShift, data: &'a [u8]) -> Vec<&'a [u8]> {
    let parts = rng.range(1, 4) as usize;
    let mut cuts: Vec<usize> = (1..parts)
        .map(|_| rng.range(0, data.len() as u64) as usize)
        .collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut start = 0;
    for c in cuts {
        out.push(&data[start..c]);
        start = c;
    }
    out.push(&data[start..]);
    out
}

#[test]
fn random_traffic() {
    for seed in 1..=24u64 {
        let mut rng = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut r = Rig::live();
        let mut sent = Vec::new();
        let mut typed = Vec::new();
        let mut received = Vec::new();
        let mut posted: VecDeque<RxChain> = VecDeque::new();
        let mut posted_descs = 0usize;
        let mut tx_chains = 0u64;
        let mut rx_buffers = 0u64;

        // Collect what the device returned on the receiveq, checking order.
        let collect = |r: &mut Rig,
                       posted: &mut VecDeque<RxChain>,
                       posted_descs: &mut usize,
                       received: &mut Vec<u8>,
                       rx_buffers: &mut u64| {
            for (id, len) in r.used(RECEIVEQ) {
                let c = posted.pop_front().expect("used a buffer never posted");
                assert_eq!(id, u32::from(c.head), "seed {seed}: out of order");
                let room: u32 = c.bufs.iter().map(|b| b.1).sum();
                assert!(
                    (1..=room).contains(&len),
                    "seed {seed}: len {len} of {room}"
                );
                received.extend(r.read_back(&c, len));
                assert!(r.untouched_after(&c, len), "seed {seed}");
                *posted_descs -= c.bufs.len();
                *rx_buffers += 1;
            }
        };

        for _ in 0..60 {
            match rng.range(0, 2) {
                0 => {
                    // Transmit a batch.
                    let n = rng.range(1, 4);
                    let mut heads = Vec::new();
                    for _ in 0..n {
                        let len = rng.range(0, 300) as usize;
                        let data = rng.bytes(len);
                        let parts = random_split(&mut rng, &data);
                        heads.push(r.tx(&parts));
                        sent.extend_from_slice(&data);
                    }
                    assert_eq!(r.notify(TRANSMITQ), TransportEvent::None);
                    let want: Vec<(u32, u32)> = heads.iter().map(|&h| (u32::from(h), 0)).collect();
                    assert_eq!(r.used(TRANSMITQ), want, "seed {seed}");
                    tx_chains += n;
                }
                1 => {
                    // Post receive buffers (within the queue size) and kick.
                    let n = rng.range(1, 4);
                    for _ in 0..n {
                        let descs = rng.range(1, 3) as usize;
                        if posted_descs + descs > usize::from(QUEUE_SIZE) {
                            break;
                        }
                        let lens: Vec<u32> = (0..descs).map(|_| rng.range(1, 40) as u32).collect();
                        posted.push_back(r.post_rx(&lens));
                        posted_descs += descs;
                    }
                    r.notify(RECEIVEQ);
                }
                _ => {
                    // The user types.
                    let len = rng.range(0, 100) as usize;
                    let data = rng.bytes(len);
                    r.type_input(&data);
                    typed.extend_from_slice(&data);
                    r.receive_work();
                }
            }
            assert!(!r.t.needs_reset(), "seed {seed}: {:?}", r.t.last_error());
            collect(
                &mut r,
                &mut posted,
                &mut posted_descs,
                &mut received,
                &mut rx_buffers,
            );
            r.ack();
            assert!(r.env.out == sent, "seed {seed}: output differs");
            assert_eq!(received[..], typed[..received.len()], "seed {seed}");
            // As much as possible was delivered: input waits only when no
            // buffer is posted.
            assert!(
                r.env.input.is_empty() || posted.is_empty(),
                "seed {seed}: {} bytes wait with {} buffers posted",
                r.env.input.len(),
                posted.len()
            );
            assert_eq!(received.len() + r.env.input.len(), typed.len());
        }

        // Drain what is still typed.
        while !r.env.input.is_empty() {
            posted.push_back(r.post_rx(&[64]));
            posted_descs += 1;
            assert_eq!(r.notify(RECEIVEQ), TransportEvent::Interrupt);
            collect(
                &mut r,
                &mut posted,
                &mut posted_descs,
                &mut received,
                &mut rx_buffers,
            );
        }
        assert!(received == typed, "seed {seed}: input differs");
        assert_eq!(
            r.stats(),
            ConsoleStats {
                bytes_out: sent.len() as u64,
                chains_out: tx_chains,
                bytes_in: typed.len() as u64,
                buffers_in: rx_buffers,
                passes_cut: 0,
            },
            "seed {seed}"
        );
    }
}
