//! The virtio console (`virtio_console.rs`) behind the virtio-mmio transport, as
//! `vm/bus.rs` wires it: a driver probes it as Linux's virtio_console does,
//! queues transmit chains and receive buffers (well formed, or raw: any
//! address, in RAM or wild, any length and direction), notifies, acks,
//! writes any register but the queue layout; the host types input and
//! asks the device to deliver it; the guest scribbles over a scratch area.
//! Invariants: the device writes only the used rings and buffers the
//! driver posted writable on the receive queue; what it shows is exactly
//! the bytes of the transmit chains notified, in order, each chain
//! returned with length 0; the receive buffers get the typed input in
//! order, never more than they hold, and input leaves the VM's queue only
//! as it is delivered; the counters agree with all of it; a chain it
//! refuses (wrong direction, outside RAM, empty, too long) sets
//! DEVICE_NEEDS_RESET, and until a new probe nothing more is checked than
//! where it writes.
#![no_main]

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use arbitrary::Arbitrary;
use hypervisor::addr::GuestAddr;
use hypervisor::virtio::mmio::{self, MmioTransport};
use hypervisor::virtio::testing::{driver_ok, handshake, DriverQueue, VecMemory};
use hypervisor::virtio::{GuestMemError, GuestMemory, VIRTIO_F_VERSION_1};
use hypervisor::virtio_console::{
    ConsoleIo, VirtioConsole, MAX_TX_CHAIN, QUEUE_SIZE, RECEIVEQ, TRANSMITQ,
};
use libfuzzer_sys::fuzz_target;

const BASE: u64 = 0x4000_0000;
const RAM_BYTES: u64 = 1 << 20;
const RAM_END: u64 = BASE + RAM_BYTES;
/// Well-formed buffers, each fresh (never reused, never overlapping).
const ALLOC: Range<u64> = BASE + 0x1_0000..BASE + 0x8_0000;
/// The scratch area raw chains point into and the guest scribbles over.
const SCRATCH: Range<u64> = BASE + 0x8_0000..RAM_END;

struct Env {
    mem: VecMemory,
    out: Vec<u8>,
    input: VecDeque<u8>,
}

impl GuestMemory for Env {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        self.mem.read(ipa, buf)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        self.mem.write(ipa, data)
    }
}

impl ConsoleIo for Env {
    fn output(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }
    fn input_waiting(&self) -> bool {
        !self.input.is_empty()
    }
    fn peek_input(&self, skip: usize, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for (slot, &b) in buf.iter_mut().zip(self.input.iter().skip(skip)) {
            *slot = b;
            n += 1;
        }
        n
    }
    fn consume_input(&mut self, count: usize) {
        assert!(count <= self.input.len(), "consumed more input than waits");
        self.input.drain(..count);
    }
}

#[derive(Arbitrary, Debug)]
struct RawBuf {
    /// In the scratch area (offset), or anywhere outside RAM.
    wild: bool,
    at: u64,
    len: u16,
    writable: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Reset and probe again (new rings).
    Probe,
    /// A well-formed transmit chain of these parts.
    Tx(Vec<Vec<u8>>),
    /// A well-formed receive chain of buffers of these lengths.
    Rx(Vec<u16>),
    Raw {
        receive: bool,
        bufs: Vec<RawBuf>,
    },
    Notify(u8),
    Type(Vec<u8>),
    /// The host has queued input: the VM asks the device to deliver it.
    ReceiveWork,
    Ack,
    Read {
        offset: u8,
        width: u8,
    },
    Write {
        offset: u8,
        width: u8,
        value: u32,
    },
    Scribble {
        at: u32,
        bytes: Vec<u8>,
    },
}

/// A chain's buffers as the test driver adds them: `(ipa, len, writable)`.
type Chain = Vec<(u64, u32, bool)>;

struct Rig {
    t: MmioTransport<VirtioConsole>,
    env: Env,
    qs: Vec<DriverQueue>,
    next: u64,
    /// Checks of content on: probed, no error, no raw status write since.
    tracking: bool,
    /// Where the device may write: the used rings, every writable buffer
    /// posted on a receive queue.
    allowed: Vec<Range<u64>>,
    /// Receive chains by head: their buffers if well formed (`None`: raw).
    rx: HashMap<u16, Option<Vec<(u64, u32)>>>,
    /// Transmit chains queued since the last notify: their buffers.
    tx: Vec<(u16, Chain)>,
    typed: Vec<u8>,
    delivered: usize,
    /// Descriptors added per queue since the probe: past the queue size
    /// the test driver reuses descriptors still in flight.
    posted: [usize; 2],
}

fn queues(epoch: u64) -> Vec<DriverQueue> {
    // Rings alternate between two layouts so a new probe uses fresh ones.
    (0..2u64)
        .map(|q| {
            let at = BASE + (epoch % 2) * 0x8000 + q * 0x1000;
            DriverQueue::new(QUEUE_SIZE, at, at + 0x400, at + 0x800)
        })
        .collect()
}

impl Rig {
    fn probe(&mut self, epoch: u64) {
        self.qs = queues(epoch);
        for q in &self.qs {
            self.allowed.push(q.used_area());
            // Fresh rings, as a driver allocates them: zeroed (the layout
            // is reused every other probe).
            self.env.mem.poke(q.desc, &[0; 0x1000]);
        }
        let status = handshake(&mut self.t, &mut self.env, VIRTIO_F_VERSION_1, &self.qs);
        assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
        driver_ok(&mut self.t, &mut self.env);
        assert!(!self.t.needs_reset());
        self.tracking = true;
        self.posted = [0; 2];
        self.delivered = self.t.device().stats().bytes_in as usize;
        self.rx.clear();
        self.tx.clear();
    }

    fn alloc(&mut self, len: u32) -> Option<u64> {
        let at = self.next;
        let end = (at + u64::from(len) + 7) & !7;
        (end <= ALLOC.end).then(|| {
            self.next = end;
            at
        })
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut r = Rig {
        t: MmioTransport::new(VirtioConsole::new()),
        env: Env {
            mem: VecMemory::new(BASE, RAM_BYTES as usize),
            out: Vec::new(),
            input: VecDeque::new(),
        },
        qs: Vec::new(),
        next: ALLOC.start,
        tracking: false,
        allowed: Vec::new(),
        rx: HashMap::new(),
        tx: Vec::new(),
        typed: Vec::new(),
        delivered: 0,
        posted: [0; 2],
    };
    let mut epoch = 0;
    r.probe(epoch);
    for op in ops.iter().take(128) {
        let out_before = r.env.out.len();
        let mut transmitted = false;
        match op {
            Op::Probe => {
                epoch += 1;
                r.probe(epoch);
            }
            Op::Tx(parts) => {
                let mut bufs = Vec::new();
                for p in parts.iter().take(8) {
                    let Some(at) = r.alloc(p.len() as u32) else {
                        break;
                    };
                    r.env.mem.poke(at, p);
                    bufs.push((at, p.len() as u32, false));
                }
                if !bufs.is_empty() {
                    r.posted[TRANSMITQ] += bufs.len();
                    let head = r.qs[TRANSMITQ].add(&mut r.env.mem, &bufs);
                    r.tx.push((head, bufs));
                }
            }
            Op::Rx(lens) => {
                let mut bufs = Vec::new();
                for &len in lens.iter().take(8) {
                    let len = u32::from(len % 512);
                    let Some(at) = r.alloc(len) else { break };
                    bufs.push((at, len));
                }
                if !bufs.is_empty() {
                    r.allowed
                        .extend(bufs.iter().map(|&(a, l)| a..a + u64::from(l)));
                    let descs: Vec<_> = bufs.iter().map(|&(a, l)| (a, l, true)).collect();
                    r.posted[RECEIVEQ] += descs.len();
                    let head = r.qs[RECEIVEQ].add(&mut r.env.mem, &descs);
                    r.rx.insert(head, Some(bufs));
                }
            }
            Op::Raw { receive, bufs } => {
                let bufs: Vec<(u64, u32, bool)> = bufs
                    .iter()
                    .take(8)
                    .map(|b| {
                        let len = u32::from(b.len);
                        let at = if b.wild {
                            // Outside RAM (a range that starts there).
                            if (BASE..RAM_END).contains(&b.at) {
                                RAM_END + b.at
                            } else {
                                b.at
                            }
                        } else {
                            let room = SCRATCH.end - SCRATCH.start - u64::from(len);
                            SCRATCH.start + b.at % (room + 1)
                        };
                        (at, len, b.writable)
                    })
                    .collect();
                if !bufs.is_empty() {
                    let q = if *receive { RECEIVEQ } else { TRANSMITQ };
                    if *receive {
                        for &(a, l, w) in &bufs {
                            if w {
                                r.allowed.push(a..a.saturating_add(u64::from(l)));
                            }
                        }
                    }
                    r.posted[q] += bufs.len();
                    let head = r.qs[q].add(&mut r.env.mem, &bufs);
                    if *receive {
                        r.rx.insert(head, None);
                    } else {
                        r.tx.push((head, bufs));
                    }
                }
            }
            Op::Notify(q) => {
                let q = usize::from(q % 2);
                let _ = r.t.write(mmio::QUEUE_NOTIFY, 4, q as u32, &mut r.env);
                transmitted = q == TRANSMITQ;
            }
            Op::Type(bytes) => {
                r.env.input.extend(bytes.iter().copied());
                r.typed.extend_from_slice(bytes);
            }
            Op::ReceiveWork => {
                r.t.device_work(&mut r.env, |d, q, e| d.receive(q, e));
            }
            Op::Ack => {
                let status = r.t.interrupt_status();
                let _ = r.t.write(mmio::INTERRUPT_ACK, 4, status, &mut r.env);
                assert!(!r.t.interrupt_pending());
            }
            Op::Read { offset, width } => {
                if let Ok(v) = r.t.read(u64::from(*offset) * 2, *width) {
                    if *width < 4 {
                        assert!(u64::from(v) < 1 << (8 * u32::from(*width)));
                    }
                }
            }
            Op::Write {
                offset,
                width,
                value,
            } => {
                let offset = u64::from(*offset) * 2;
                let layout = matches!(
                    offset & !3,
                    mmio::QUEUE_NUM
                        | mmio::QUEUE_READY
                        | mmio::QUEUE_DESC_LOW
                        | mmio::QUEUE_DESC_HIGH
                        | mmio::QUEUE_DRIVER_LOW
                        | mmio::QUEUE_DRIVER_HIGH
                        | mmio::QUEUE_DEVICE_LOW
                        | mmio::QUEUE_DEVICE_HIGH
                );
                if !layout {
                    if offset & !3 == mmio::STATUS {
                        r.tracking = false;
                    }
                    let ok = r.t.write(offset, *width, *value, &mut r.env).is_ok();
                    transmitted = ok && offset == mmio::QUEUE_NOTIFY && *value == TRANSMITQ as u32;
                }
            }
            Op::Scribble { at, bytes } => {
                let len = bytes.len().min(4096) as u64;
                let room = SCRATCH.end - SCRATCH.start - len;
                let at = SCRATCH.start + u64::from(*at) % (room + 1);
                r.env.mem.poke(at, &bytes[..len as usize]);
            }
        }

        // Where the device wrote.
        if transmitted {
            // A pass stops at its bound (64 chains or 64 KiB) and the
            // memory tick resumes it: do as the tick does until nothing is
            // left, each pass bounded like the first.
            let mut passes = 0;
            while r.t.device().has_more() {
                passes += 1;
                assert!(passes <= 1 + usize::from(QUEUE_SIZE), "the passes end");
                let _ = r.t.device_work(&mut r.env, |d, q, e| d.resume(q, e));
            }
        }
        for &(at, len) in r.env.mem.writes() {
            let end = at + len as u64;
            assert!(
                r.allowed.iter().any(|a| a.start <= at && end <= a.end),
                "device wrote {len} bytes at {at:#x}, outside the used rings and receive buffers"
            );
        }
        r.env.mem.clear_log();

        let stats = *r.t.device().stats();
        assert_eq!(stats.bytes_out, r.env.out.len() as u64);
        assert_eq!(
            stats.bytes_in as usize,
            r.typed.len() - r.env.input.len(),
            "input leaves its queue only as it is delivered"
        );
        if r.t.needs_reset() || r.posted.iter().any(|&n| n > usize::from(QUEUE_SIZE)) {
            r.tracking = false;
        }
        if !transmitted {
            assert_eq!(
                r.env.out.len(),
                out_before,
                "output only on a transmit notify"
            );
        }
        if !r.tracking {
            r.tx.clear();
            continue;
        }

        // What was shown: the chains notified, in order.
        if transmitted {
            let mut expected = Vec::new();
            for (_, bufs) in &r.tx {
                for &(at, len, _) in bufs {
                    let mut b = vec![0u8; len as usize];
                    r.env
                        .mem
                        .read(GuestAddr::new(at), &mut b)
                        .expect("checked below");
                    expected.extend_from_slice(&b);
                }
            }
            assert_eq!(&r.env.out[out_before..], &expected[..], "transmitted bytes");
            let used = r.qs[TRANSMITQ].take_used(&mut r.env.mem);
            let heads: Vec<(u32, u32)> = r.tx.iter().map(|(h, _)| (u32::from(*h), 0)).collect();
            assert_eq!(used, heads, "every transmit chain returned, length 0");
            r.tx.clear();
        }
        // A raw transmit chain the device would refuse: stop tracking
        // before a notify (the check above needs readable, in-RAM,
        // bounded chains).
        for (_, bufs) in &r.tx {
            let total: u64 = bufs.iter().map(|&(_, l, _)| u64::from(l)).sum();
            let bad = bufs
                .iter()
                .any(|&(a, l, w)| w || a < BASE || a.saturating_add(u64::from(l)) > RAM_END);
            if bad || total > u64::from(MAX_TX_CHAIN) {
                r.tracking = false;
            }
        }

        // What was received: the typed input, in order.
        for (head, len) in r.qs[RECEIVEQ].take_used(&mut r.env.mem) {
            let chain = r.rx.get(&(head as u16)).expect("a head the driver posted");
            if let Some(bufs) = chain {
                let room: u32 = bufs.iter().map(|&(_, l)| l).sum();
                assert!(len <= room, "used length {len} beyond the chain's {room}");
                assert!(len > 0, "an empty buffer returned");
                let mut got = Vec::new();
                let mut left = len as usize;
                for &(at, l) in bufs {
                    let n = left.min(l as usize);
                    let start = (at - BASE) as usize;
                    got.extend_from_slice(&r.env.mem.bytes[start..start + n]);
                    left -= n;
                }
                assert_eq!(
                    got,
                    r.typed[r.delivered..r.delivered + len as usize],
                    "input delivered in order"
                );
            }
            r.delivered += len as usize;
        }
        assert_eq!(r.delivered as u64, stats.bytes_in);
    }
});
