//! Balloon tests: a small driver over `VecMemory` talks to the balloon through
//! the virtio-mmio registers; a recording backend checks that it only ever
//! sees valid, distinct, state-consistent PFNs and blocks (the contracts of
//! [`BalloonBackend`]), and the device's bitmap is compared with the
//! backend's set after every step.

extern crate alloc;

use alloc::format;
use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use proptest::prelude::*;

use super::testing::FakeBackend;
use super::*;
use crate::savestate::{StateReader, StateWriter};
use crate::virtio::mmio::{self, TransportEvent};
use crate::virtio::testing::{driver_ok, handshake, read_reg, write_reg, DriverQueue, VecMemory};
use crate::virtio::{GuestMemError, QueueError};

const BASE: u64 = 0x4000_0000;
const RAM_BYTES: usize = 2 << 20;
const RAM_START: u64 = BASE >> 12;
const RAM_END: u64 = RAM_START + (RAM_BYTES as u64 >> 12);
const QSIZE: u16 = 16;
/// Where the test driver puts request buffers.
const BUFS: u64 = BASE + 0x10000;

/// A PFN range of the test's literals, as the balloon takes it.
fn typed(r: Range<u64>) -> Range<GuestPfn> {
    GuestPfn::new(r.start)..GuestPfn::new(r.end)
}

struct TestEnv {
    mem: VecMemory,
    backend: FakeBackend,
}

impl GuestMemory for TestEnv {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        self.mem.read(ipa, buf)
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        self.mem.write(ipa, data)
    }
}

impl BalloonBackend for TestEnv {
    fn ram_pfns(&self) -> Range<GuestPfn> {
        self.backend.ram_pfns()
    }
    fn now_us(&self) -> Option<u64> {
        self.backend.clock.then_some(self.backend.now)
    }
    fn report(&mut self, blocks: &[Range<GuestPfn>]) {
        self.backend.report(blocks);
    }
    fn hint(&mut self, blocks: &[Range<GuestPfn>]) {
        self.backend.hint(blocks);
    }
    fn inflate(&mut self, pfns: &[GuestPfn]) {
        self.backend.inflate(pfns);
    }
    fn deflate(&mut self, pfns: &[GuestPfn]) {
        self.backend.deflate(pfns);
    }
}

struct Rig {
    t: MmioTransport<Balloon>,
    env: TestEnv,
    qs: Vec<DriverQueue>,
    next_buf: u64,
}

impl Rig {
    fn new(offered: u64) -> Rig {
        let ram = RAM_START..RAM_END;
        let balloon = Balloon::new(offered, typed(ram.clone())).expect("balloon");
        let t = MmioTransport::new(balloon);
        let qs = (0..t.queues().len() as u64)
            .map(|q| {
                let at = BASE + q * 0x1000;
                DriverQueue::new(QSIZE, at, at + 0x400, at + 0x800)
            })
            .collect();
        let env = TestEnv {
            mem: VecMemory::new(BASE, RAM_BYTES),
            backend: FakeBackend::new(ram),
        };
        Rig {
            t,
            env,
            qs,
            next_buf: 0,
        }
    }

    /// Probe as Linux does, accepting `accept`, up to DRIVER_OK.
    fn live(offered: u64, accept: u64) -> Rig {
        let mut r = Rig::new(offered);
        let status = handshake(&mut r.t, &mut r.env, accept | F_VERSION_1, &r.qs);
        assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
        assert!(matches!(
            driver_ok(&mut r.t, &mut r.env),
            TransportEvent::Activated { .. }
        ));
        r
    }

    fn buffer(&mut self) -> u64 {
        // 16 KiB + 4 per buffer, cycling through 8 slots.
        let at = BUFS + (self.next_buf % 8) * 0x5000;
        self.next_buf += 1;
        at
    }

    /// Send one buffer of `pfns` on queue `q` and notify.
    fn send(&mut self, q: usize, pfns: &[u32]) -> TransportEvent {
        let at = self.buffer();
        let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
        self.env.mem.poke(at, &bytes);
        self.send_raw(q, &[(at, bytes.len() as u32, false)])
    }

    fn send_raw(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> TransportEvent {
        self.qs[q].add(&mut self.env.mem, bufs);
        write_reg(&mut self.t, &mut self.env, mmio::QUEUE_NOTIFY, q as u32)
    }

    fn used(&mut self, q: usize) -> Vec<(u32, u32)> {
        self.qs[q].take_used(&mut self.env.mem)
    }

    fn balloon(&self) -> &Balloon {
        self.t.device()
    }

    /// The device's bitmap is exactly the backend's set.
    fn check(&self) {
        let b = self.balloon();
        assert_eq!(b.ballooned_pages(), self.env.backend.held.len() as u64);
        for pfn in RAM_START..RAM_END {
            assert_eq!(
                b.is_ballooned(GuestPfn::new(pfn)),
                self.env.backend.held.contains(&pfn),
                "PFN {pfn:#x}"
            );
        }
    }

    fn read_config(&mut self, offset: u64, width: u8) -> u32 {
        self.t
            .read(mmio::CONFIG + offset, width)
            .expect("config read")
    }
}

fn pfns(range: Range<u64>) -> Vec<u32> {
    range.map(|p| p as u32).collect()
}

#[test]
fn inflate_then_deflate_256_pages() {
    let mut r = Rig::live(
        F_MUST_TELL_HOST | F_STATS_VQ | F_DEFLATE_ON_OOM,
        F_MUST_TELL_HOST | F_DEFLATE_ON_OOM,
    );
    assert_eq!(
        r.balloon().negotiated_features(),
        F_MUST_TELL_HOST | F_DEFLATE_ON_OOM | F_VERSION_1
    );
    assert_eq!(
        format!("{}", feature_names(r.balloon().negotiated_features())),
        "MUST_TELL_HOST DEFLATE_ON_OOM VERSION_1"
    );

    // The host asks for 256 pages.
    assert!(r.t.set_balloon_target(256));
    assert_eq!(read_reg(&mut r.t, mmio::CONFIG_GENERATION), 1);
    assert_eq!(
        read_reg(&mut r.t, mmio::INTERRUPT_STATUS),
        mmio::INT_CONFIG_CHANGE
    );
    assert_eq!(r.read_config(0, 4), 256);
    write_reg(
        &mut r.t,
        &mut r.env,
        mmio::INTERRUPT_ACK,
        mmio::INT_CONFIG_CHANGE,
    );

    // Linux sends the PFNs in one 1 KiB buffer, in descending order.
    let mut list = pfns(RAM_START + 100..RAM_START + 356);
    list.reverse();
    assert_eq!(r.send(0, &list), TransportEvent::Interrupt);
    let used = r.used(0);
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].1, 0);
    assert_eq!(
        r.env.backend.inflates,
        vec![(RAM_START + 100..RAM_START + 356).collect::<Vec<_>>()]
    );
    assert_eq!(r.balloon().ballooned_pages(), 256);
    assert!(r.t.interrupt_pending());
    r.check();
    // The driver reports it.
    write_reg(&mut r.t, &mut r.env, mmio::CONFIG + 4, 256);
    assert_eq!(r.balloon().actual(), 256);
    assert_eq!(r.read_config(4, 4), 256);

    // Deflate 100 of them.
    assert_eq!(
        r.send(1, &pfns(RAM_START + 100..RAM_START + 200)),
        TransportEvent::Interrupt
    );
    assert_eq!(r.used(1).len(), 1);
    assert_eq!(
        r.env.backend.deflates,
        vec![(RAM_START + 100..RAM_START + 200).collect::<Vec<_>>()]
    );
    assert_eq!(r.balloon().ballooned_pages(), 156);
    r.check();

    let s = *r.balloon().stats();
    assert_eq!(s.inflate_requests, 1);
    assert_eq!(s.deflate_requests, 1);
    assert_eq!(s.pages_inflated, 256);
    assert_eq!(s.pages_deflated, 100);
    assert_eq!(
        s.rejected_out_of_range
            + s.rejected_duplicate
            + s.rejected_already_ballooned
            + s.rejected_not_ballooned,
        0
    );
    assert_eq!(s.device_errors, 0);
}

#[test]
fn every_rejection_reason() {
    let mut r = Rig::live(F_MUST_TELL_HOST, F_MUST_TELL_HOST);
    let a = RAM_START as u32;
    let list = [
        a - 1,          // below RAM
        RAM_END as u32, // just past the end
        0x0a000,        // the virtio-mmio window (IPA 0x0a00_0000)
        0xffff_ffff,    // would be a huge PFN if sign-extended
        a + 5,          // valid
        a + 5,          // duplicate
        a + 6,          // valid
        a + 6,          // duplicate
        a + 6,          // duplicate
    ];
    r.send(0, &list);
    assert_eq!(r.used(0).len(), 1);
    assert_eq!(
        r.env.backend.inflates,
        vec![vec![RAM_START + 5, RAM_START + 6]]
    );
    let s = *r.balloon().stats();
    assert_eq!(s.rejected_out_of_range, 4);
    assert_eq!(s.rejected_duplicate, 3);
    assert_eq!(s.pages_inflated, 2);

    // Inflating a ballooned page again; one new page goes through.
    r.send(0, &[a + 5, a + 7]);
    assert_eq!(r.balloon().stats().rejected_already_ballooned, 1);
    assert_eq!(r.env.backend.inflates.last(), Some(&vec![RAM_START + 7]));

    // Deflating pages that are not ballooned; a request with nothing valid
    // still comes back, without a backend call.
    r.send(1, &[a + 100, a + 101]);
    assert_eq!(r.used(1).len(), 1);
    assert_eq!(r.balloon().stats().rejected_not_ballooned, 2);
    assert!(r.env.backend.deflates.is_empty());
    // An empty request is fine too.
    r.send(1, &[]);
    assert_eq!(r.used(1).len(), 1);
    assert_eq!(r.balloon().ballooned_pages(), 3);
    assert!(!r.t.needs_reset());
    r.check();
}

#[test]
fn deflate_without_must_tell_host_is_processed() {
    let mut r = Rig::live(F_MUST_TELL_HOST, 0);
    assert_eq!(r.balloon().negotiated_features(), F_VERSION_1);
    r.send(0, &pfns(RAM_START..RAM_START + 4));
    r.send(1, &pfns(RAM_START..RAM_START + 4));
    assert_eq!(r.env.backend.deflates.len(), 1);
    assert_eq!(r.balloon().ballooned_pages(), 0);
    r.check();
}

/// Sends a malformed inflate request and checks: NEEDS_RESET with `reason`,
/// the buffer returned, nothing applied, further kicks ignored, reset recovers.
fn malformed(bufs: &[(u64, u32, bool)], reason: &str) {
    let mut r = Rig::live(F_MUST_TELL_HOST, F_MUST_TELL_HOST);
    r.send(0, &[RAM_START as u32]);
    r.used(0);
    let ev = r.send_raw(0, bufs);
    assert_eq!(
        format!("{ev}"),
        format!("virtio-balloon needs reset: inflateq: {reason}")
    );
    assert!(r.t.needs_reset());
    assert_eq!(r.used(0).len(), 1, "the bad buffer is returned");
    assert_eq!(
        read_reg(&mut r.t, mmio::INTERRUPT_STATUS),
        mmio::INT_USED_BUFFER | mmio::INT_CONFIG_CHANGE
    );
    assert_eq!(r.balloon().stats().device_errors, 1);
    assert_eq!(r.env.backend.inflates.len(), 1);
    r.check();
    // Stopped: a good request is not processed.
    assert_eq!(r.send(0, &[RAM_START as u32 + 1]), TransportEvent::None);
    assert!(r.used(0).is_empty());
    // The driver resets: everything is given back, the device works again.
    assert_eq!(
        write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0),
        TransportEvent::Reset
    );
    assert_eq!(r.balloon().ballooned_pages(), 0);
    r.check();
    r.qs = (0..2u64)
        .map(|q| {
            DriverQueue::new(
                QSIZE,
                BASE + q * 0x1000,
                BASE + q * 0x1000 + 0x400,
                BASE + q * 0x1000 + 0x800,
            )
        })
        .collect();
    for q in 0..2 {
        // Fresh rings, as a new driver instance allocates them.
        r.env.mem.poke(r.qs[q].used, &[0; 4]);
        r.env.mem.poke(r.qs[q].avail, &[0; 4]);
    }
    handshake(
        &mut r.t,
        &mut r.env,
        F_MUST_TELL_HOST | F_VERSION_1,
        &r.qs.clone(),
    );
    driver_ok(&mut r.t, &mut r.env);
    assert!(!r.t.needs_reset());
    assert_eq!(
        r.send(0, &[RAM_START as u32 + 2]),
        TransportEvent::Interrupt
    );
    assert_eq!(r.balloon().ballooned_pages(), 1);
    r.check();
}

#[test]
fn malformed_writable_descriptor() {
    malformed(
        &[(BUFS, 8, false), (BUFS + 8, 8, true)],
        "descriptor 2 is device-writable, but this queue takes only driver-written buffers",
    );
}

#[test]
fn malformed_length() {
    malformed(
        &[(BUFS, 6, false)],
        "buffer of 6 bytes is not a multiple of 4 bytes",
    );
}

#[test]
fn malformed_too_long() {
    malformed(
        &[(BUFS, MAX_REQUEST_BYTES + 4, false)],
        "buffer of 16388 bytes is longer than the 16384 bytes accepted per request",
    );
}

#[test]
fn malformed_outside_ram() {
    malformed(
        &[(0x8000_0000, 4096, false)],
        "descriptor 1 points outside guest RAM (IPA 0x8000_0000, 4096 bytes)",
    );
}

#[test]
fn malformed_runs_past_the_end_of_ram() {
    // Starts in RAM, ends past it: nothing of it is applied.
    let last = BASE + RAM_BYTES as u64 - 8;
    malformed(
        &[(last, 16, false)],
        "descriptor 1 points outside guest RAM (IPA 0x401f_fff8, 16 bytes)",
    );
}

#[test]
fn request_split_over_descriptors() {
    let mut r = Rig::live(0, 0);
    // Three PFNs, 12 bytes, split 5 + 7 across two descriptors.
    let bytes: Vec<u8> = [RAM_START + 1, RAM_START + 2, RAM_START + 3]
        .iter()
        .flat_map(|&p| (p as u32).to_le_bytes())
        .collect();
    r.env.mem.poke(BUFS, &bytes[..5]);
    r.env.mem.poke(BUFS + 0x100, &bytes[5..]);
    r.send_raw(0, &[(BUFS, 5, false), (BUFS + 0x100, 7, false)]);
    assert_eq!(
        r.env.backend.inflates,
        vec![vec![RAM_START + 1, RAM_START + 2, RAM_START + 3]]
    );
    r.check();
}

#[test]
fn reset_deflates_everything() {
    let mut r = Rig::live(F_MUST_TELL_HOST, F_MUST_TELL_HOST);
    r.t.set_balloon_target(300);
    r.send(0, &pfns(RAM_START..RAM_START + 200));
    r.send(0, &pfns(RAM_START + 400..RAM_START + 500));
    write_reg(&mut r.t, &mut r.env, mmio::CONFIG + 4, 300);
    assert_eq!(r.balloon().ballooned_pages(), 300);
    assert_eq!(
        write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0),
        TransportEvent::Reset
    );
    // Batches of 256, ascending.
    let sizes: Vec<usize> = r.env.backend.deflates.iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![256, 44]);
    assert!(r.env.backend.held.is_empty());
    assert_eq!(r.balloon().ballooned_pages(), 0);
    assert_eq!(r.balloon().stats().pages_deflated_on_reset, 300);
    assert_eq!(r.balloon().actual(), 0);
    assert_eq!(r.balloon().negotiated_features(), 0);
    // The target is the host's and stays.
    assert_eq!(r.balloon().target(), 300);
    r.check();
}

#[test]
fn queue_index_mapping_for_all_feature_combinations() {
    use QueueKind::*;
    for combo in 0..8u64 {
        let offered = if combo & 1 != 0 { F_STATS_VQ } else { 0 }
            | if combo & 2 != 0 { F_FREE_PAGE_HINT } else { 0 }
            | if combo & 4 != 0 { F_PAGE_REPORTING } else { 0 };
        let b = Balloon::new(offered, typed(RAM_START..RAM_END)).unwrap();
        let mut want = vec![Inflate, Deflate];
        if combo & 1 != 0 {
            want.push(Stats);
        }
        if combo & 2 != 0 {
            want.push(FreePageHint);
        }
        if combo & 4 != 0 {
            want.push(Reporting);
        }
        let got: Vec<QueueKind> = (0..8).map_while(|i| b.queue_kind(i)).collect();
        assert_eq!(got, want, "features {}", feature_names(offered));
        assert_eq!(b.queue_count(), want.len());
        for (i, k) in want.iter().enumerate() {
            assert_eq!(b.queue_name(i), k.name());
        }
    }
}

#[test]
fn config_space() {
    // Size 8 without hint or poison, 12 with hint, 16 with poison.
    for (offered, size) in [
        (0, 8),
        (F_FREE_PAGE_HINT, 12),
        (F_PAGE_POISON, 16),
        (F_FREE_PAGE_HINT | F_PAGE_POISON, 16),
    ] {
        assert_eq!(
            Balloon::new(offered, typed(RAM_START..RAM_END))
                .unwrap()
                .config_size(),
            size
        );
    }
    let mut r = Rig::new(F_PAGE_POISON);
    r.t.set_balloon_target(0x1234_5678);
    assert_eq!(r.read_config(0, 4), 0x1234_5678);
    assert_eq!(r.read_config(0, 2), 0x5678);
    assert_eq!(r.read_config(2, 2), 0x1234);
    assert_eq!(r.read_config(1, 1), 0x56);
    assert_eq!(r.read_config(3, 1), 0x12);
    // The driver cannot write num_pages.
    r.t.write(mmio::CONFIG, 4, 7, &mut r.env).unwrap();
    r.t.write(mmio::CONFIG + 1, 1, 7, &mut r.env).unwrap();
    assert_eq!(r.read_config(0, 4), 0x1234_5678);
    // actual: byte, half and word writes (the test RAM is 512 pages).
    r.t.write(mmio::CONFIG + 4, 4, 0x0000_01dd, &mut r.env)
        .unwrap();
    r.t.write(mmio::CONFIG + 6, 2, 0, &mut r.env).unwrap();
    r.t.write(mmio::CONFIG + 4, 1, 0x33, &mut r.env).unwrap();
    assert_eq!(r.balloon().actual(), 0x133);
    assert_eq!(r.read_config(4, 4), 0x133);
    assert_eq!(r.balloon().stats().actual_writes_clamped, 0);
    // More pages than the VM has: kept at its RAM, counted.
    r.t.write(mmio::CONFIG + 6, 2, 0x1122, &mut r.env).unwrap();
    assert_eq!(r.balloon().actual(), 512);
    assert_eq!(r.read_config(4, 4), 512);
    assert_eq!(r.balloon().stats().actual_writes_clamped, 1);
    // free_page_hint_cmd_id is the device's; poison_val the driver's.
    r.t.write(mmio::CONFIG + 8, 4, 9, &mut r.env).unwrap();
    assert_eq!(r.read_config(8, 4), 0);
    r.t.write(mmio::CONFIG + 12, 4, 0xdead_beef, &mut r.env)
        .unwrap();
    assert_eq!(r.balloon().poison_val(), 0xdead_beef);
    assert_eq!(r.read_config(12, 4), 0xdead_beef);
    // Past the config: reads zero, writes ignored.
    r.t.write(mmio::CONFIG + 16, 4, 5, &mut r.env).unwrap();
    assert_eq!(r.read_config(16, 4), 0);
    // Without PAGE_POISON, poison_val is past the config.
    let mut r = Rig::new(0);
    r.t.write(mmio::CONFIG + 12, 4, 0xdead_beef, &mut r.env)
        .unwrap();
    assert_eq!(r.balloon().poison_val(), 0);
    assert_eq!(r.read_config(12, 4), 0);
}

#[test]
fn target_changes_bump_the_generation() {
    let mut r = Rig::new(0);
    // Before DRIVER_OK: the generation moves, no interrupt.
    assert!(r.t.set_balloon_target(10));
    assert_eq!(r.t.config_generation(), 1);
    assert!(!r.t.interrupt_pending());
    // Same value: nothing.
    assert!(!r.t.set_balloon_target(10));
    assert_eq!(r.t.config_generation(), 1);
    let status = handshake(&mut r.t, &mut r.env, F_VERSION_1, &r.qs.clone());
    assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
    driver_ok(&mut r.t, &mut r.env);
    assert!(r.t.set_balloon_target(20));
    assert_eq!(r.t.config_generation(), 2);
    assert_eq!(r.t.interrupt_status(), mmio::INT_CONFIG_CHANGE);
    assert_eq!(r.balloon().target(), 20);
}

#[test]
fn constructor() {
    assert_eq!(
        Balloon::new(1 << 7, typed(RAM_START..RAM_END)).err(),
        Some(BalloonError::UnknownFeatures { bits: 1 << 7 })
    );
    let b = Balloon::new(F_MUST_TELL_HOST, typed(RAM_START..RAM_END)).unwrap();
    assert_eq!(b.offered_features(), F_MUST_TELL_HOST | F_VERSION_1);
    assert_eq!(b.device_id(), 5);
    // No RAM at all, or RAM beyond what a 32-bit PFN names.
    #[allow(clippy::reversed_empty_ranges)] // an inverted range from a backend
    let b = Balloon::new(0, typed(10..5)).unwrap();
    assert_eq!(b.ram_pfns(), typed(5..5));
    let b = Balloon::new(0, typed((1 << 32) - 4..(1 << 33))).unwrap();
    assert_eq!(b.ram_pfns(), typed((1 << 32) - 4..1 << 32));
    assert_eq!(format!("{}", feature_names(0)), "none");
    assert_eq!(
        format!("{}", feature_names(F_PAGE_REPORTING | 1 << 40)),
        "PAGE_REPORTING bit 40"
    );
}

#[test]
fn queue_errors_are_reported_with_the_queue() {
    let mut r = Rig::live(0, 0);
    // A head index outside the queue: nothing can be returned.
    r.qs[1].publish(&mut r.env.mem, 99);
    let ev = write_reg(&mut r.t, &mut r.env, mmio::QUEUE_NOTIFY, 1);
    let TransportEvent::NeedsReset { error, .. } = ev else {
        panic!("{ev:?}")
    };
    assert_eq!(
        error.kind,
        DeviceErrorKind::Queue(QueueError::HeadOutOfRange {
            head: 99,
            size: QSIZE
        })
    );
    assert_eq!(error.queue.map(|q| q.name), Some("deflateq"));
    assert!(r.used(1).is_empty());
    assert_eq!(r.balloon().stats().device_errors, 1);
}

/// A PFN a guest might send: mostly near RAM, sometimes anything.
fn any_pfn() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => (RAM_START as u32)..(RAM_END as u32),
        1 => (RAM_START as u32 - 8)..(RAM_START as u32 + 8),
        1 => (RAM_END as u32 - 8)..(RAM_END as u32 + 8),
        1 => any::<u32>(),
    ]
}

/// A request's PFNs: scattered, or runs of consecutive PFNs (what the
/// device checks a bitmap word at a time), overlapping and repeated.
fn any_request() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        proptest::collection::vec(any_pfn(), 0..300),
        proptest::collection::vec((any_pfn(), 1u32..130), 0..6).prop_map(|runs| {
            runs.into_iter()
                .flat_map(|(start, len)| (0..len).map_while(move |i| start.checked_add(i)))
                .collect()
        }),
    ]
}

proptest! {
    /// Random inflate/deflate sequences: every buffer comes back exactly once,
    /// every PFN is accepted or rejected for exactly one reason, the backend
    /// only sees valid calls (the fake asserts) and the bitmap equals its set.
    #[test]
    fn random_pfn_requests(ops in proptest::collection::vec((any::<bool>(), any_request()), 1..12)) {
        let mut r = Rig::live(F_MUST_TELL_HOST, F_MUST_TELL_HOST);
        r.env.mem.clear_log();
        let mut sent = 0u64;
        for (inflate, list) in &ops {
            let q = if *inflate { 0 } else { 1 };
            r.send(q, list);
            prop_assert_eq!(r.used(q).len(), 1);
            sent += list.len() as u64;
            let s = *r.balloon().stats();
            prop_assert_eq!(
                s.pages_inflated + s.pages_deflated + s.rejected_out_of_range + s.rejected_duplicate
                    + s.rejected_already_ballooned + s.rejected_not_ballooned,
                sent
            );
            r.check();
        }
        prop_assert!(!r.t.needs_reset());
        prop_assert!(r.env.mem.refused().is_empty());
        // The device wrote nothing but its used rings.
        let used = [r.qs[0].used_area(), r.qs[1].used_area()];
        for &(ipa, len) in r.env.mem.writes() {
            prop_assert!(used.iter().any(|u| u.start <= ipa && ipa + len as u64 <= u.end), "write at {:#x}+{}", ipa, len);
        }
    }

    /// Random register traffic over random ring contents, optionally after a
    /// correct handshake, mixed with the host's calls (statistics polls,
    /// hinting runs, refaults): no panic, no access outside RAM goes
    /// through, no chain is left in flight unless the device stopped (or
    /// keeps a statistics buffer), the backend only sees calls within its
    /// contracts (the fake asserts), and the bitmap always equals the
    /// backend's set.
    #[test]
    fn random_register_traffic(
        handshake_first in any::<bool>(),
        garbage in proptest::collection::vec(any::<u8>(), 0x3000),
        writes in proptest::collection::vec((0u64..0x210, prop_oneof![Just(4u8), Just(1), Just(2), any::<u8>()], prop_oneof![
            0u32..20,
            Just(mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER | mmio::STATUS_FEATURES_OK | mmio::STATUS_DRIVER_OK),
            (0u32..0x3000).prop_map(|o| BASE as u32 + o),
            any::<u32>(),
        ], any::<bool>()), 1..60),
    ) {
        let all = F_MUST_TELL_HOST | F_STATS_VQ | F_DEFLATE_ON_OOM | F_FREE_PAGE_HINT | F_PAGE_POISON | F_PAGE_REPORTING;
        let mut r = Rig::new(all);
        if handshake_first {
            handshake(&mut r.t, &mut r.env, all | F_VERSION_1, &r.qs.clone());
            driver_ok(&mut r.t, &mut r.env);
        }
        // Random rings (and PFN lists in them) over the queues' memory.
        r.env.mem.poke(BASE, &garbage);
        for (offset, width, value, snap) in writes {
            // Mostly real registers, so the state machine moves.
            let offset = if snap { mmio::WRITABLE_REGISTERS[offset as usize % mmio::WRITABLE_REGISTERS.len()] } else { offset };
            r.env.mem.clear_log();
            let _ = r.t.write(offset, width, value, &mut r.env);
            let _ = r.t.read(offset, width);
            r.env.backend.now += u64::from(value % 4_000_000);
            let now = r.env.backend.now;
            match value % 13 {
                0 => { let _ = r.t.poll_balloon(&mut r.env, now); }
                1 => { let _ = r.t.start_free_page_hint(now); }
                2 => { let _ = r.t.stop_free_page_hint(now); }
                3 => { r.t.device_mut().page_refaulted(GuestPfn::new(RAM_START + u64::from(value >> 4) % 1024)); }
                4 => { let _ = r.t.request_balloon_stats(&mut r.env, now); }
                _ => {}
            }
            // Every state the traffic reaches is saved and restored as it
            // is (the restored transport saves the same bytes).
            let mut w = StateWriter::default();
            r.t.save(&mut w);
            let saved = w.into_bytes();
            let mut rd = StateReader::new(&saved);
            let back = MmioTransport::<Balloon>::restore(&mut rd)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(rd.finish(), Ok(()));
            let mut w = StateWriter::default();
            back.save(&mut w);
            prop_assert!(w.into_bytes() == saved, "the restored balloon saves other bytes");
            // The config always shows STOP, DONE or the latest run's id.
            let id = r.t.device().free_page_hint_cmd_id();
            prop_assert!(id <= 1 || Some(id) == r.t.device().hint_run().map(|run| run.id));
            // Memory outside RAM is never touched: the access is refused, and
            // a refused access always stops the device.
            prop_assert!(r.env.mem.refused().is_empty() || r.t.needs_reset(), "refused {:?}", r.env.mem.refused());
            r.check();
            if !r.t.needs_reset() {
                for (i, q) in r.t.queues().iter().enumerate() {
                    let allowed = u32::from(r.t.device().queue_kind(i) == Some(QueueKind::Stats));
                    prop_assert!(q.in_flight() <= allowed, "queue {} has {} in flight", i, q.in_flight());
                }
            }
        }
        // A reset always gives everything back.
        let _ = r.t.write(mmio::STATUS, 4, 0, &mut r.env);
        prop_assert!(r.env.backend.held.is_empty());
        r.check();
    }
}

mod features;
