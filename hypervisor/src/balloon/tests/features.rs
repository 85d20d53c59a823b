//! Tests of the optional features: statistics, deflate on OOM, free page
//! reporting, page poisoning and free page hinting, each with hostile
//! drivers.

use super::*;

const ALL: u64 = F_MUST_TELL_HOST
    | F_STATS_VQ
    | F_DEFLATE_ON_OOM
    | F_FREE_PAGE_HINT
    | F_PAGE_POISON
    | F_PAGE_REPORTING;
const SECOND: u64 = 1_000_000;
/// Where the tests put free blocks: the upper MiB of the test RAM.
const FREE: u64 = BASE + (1 << 20);

impl Rig {
    fn qi(&self, kind: QueueKind) -> usize {
        self.balloon().queue_index(kind).expect("queue offered")
    }

    fn stats_buffer(entries: &[(u16, u64)]) -> Vec<u8> {
        entries
            .iter()
            .flat_map(|&(tag, val)| {
                let mut e = tag.to_le_bytes().to_vec();
                e.extend_from_slice(&val.to_le_bytes());
                e
            })
            .collect()
    }

    fn send_stats(&mut self, entries: &[(u16, u64)]) -> TransportEvent {
        let at = self.buffer();
        let bytes = Rig::stats_buffer(entries);
        self.env.mem.poke(at, &bytes);
        let q = self.qi(QueueKind::Stats);
        self.send_raw(q, &[(at, bytes.len() as u32, false)])
    }

    fn send_cmd_id(&mut self, id: u32) -> TransportEvent {
        let at = self.buffer();
        self.env.mem.poke(at, &id.to_le_bytes());
        let q = self.qi(QueueKind::FreePageHint);
        self.send_raw(q, &[(at, 4, false)])
    }

    fn ack(&mut self) -> u32 {
        let status = read_reg(&mut self.t, mmio::INTERRUPT_STATUS);
        write_reg(&mut self.t, &mut self.env, mmio::INTERRUPT_ACK, status);
        status
    }

    fn poll(&mut self, now: u64) -> TransportEvent {
        self.env.backend.now = now;
        self.t.poll_balloon(&mut self.env, now)
    }

    fn info(&self) -> String {
        let mut text = String::new();
        crate::vm::balloon_info::write_feature_lines(
            &mut text,
            self.balloon(),
            self.env.backend.now,
        )
        .unwrap();
        text
    }
}

fn pages(ipa: u64, n: u64) -> Range<u64> {
    ipa >> 12..(ipa >> 12) + n
}

// ---- Statistics -----------------------------------------------------------

#[test]
fn stat_table_matches_linux() {
    // Names and order of VIRTIO_BALLOON_S_NAMES (with '_' for '-').
    let linux = [
        "swap-in",
        "swap-out",
        "major-faults",
        "minor-faults",
        "free-memory",
        "total-memory",
        "available-memory",
        "disk-caches",
        "hugetlb-allocations",
        "hugetlb-failures",
        "oom-kills",
        "alloc-stalls",
        "async-scans",
        "direct-scans",
        "async-reclaims",
        "direct-reclaims",
    ];
    for (i, (t, name)) in STAT_TABLE.iter().zip(linux).enumerate() {
        assert_eq!(usize::from(t.tag), i);
        assert_eq!(t.name.replace('_', "-"), name);
    }
    let counts: Vec<u16> = STAT_TABLE
        .iter()
        .filter(|t| t.unit == StatUnit::Count)
        .map(|t| t.tag)
        .collect();
    assert_eq!(counts, vec![2, 3, 8, 9, 10, 11]);
}

#[test]
fn stats_buffer_is_held_parsed_and_returned_on_time() {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let q = r.qi(QueueKind::Stats);
    assert_eq!(q, 2);
    r.env.backend.now = 5 * SECOND;
    // Linux primes the queue with one buffer of real statistics.
    assert_eq!(
        r.send_stats(&[(4, 1 << 20), (5, 2 << 20), (2, 17), (99, 1), (6, 3 << 19)]),
        TransportEvent::None
    );
    assert!(r.used(q).is_empty(), "the first buffer is kept");
    let s = *r.balloon().stats_sample().expect("sample");
    assert_eq!(s.arrived_us, 5 * SECOND);
    assert_eq!(s.by_name("free_memory"), Some(1 << 20));
    assert_eq!(s.get(5), Some(2 << 20));
    assert_eq!(s.get(2), Some(17));
    assert_eq!(s.get(0), None);
    assert_eq!(s.unknown_tags, 1);
    assert_eq!(r.balloon().stats().stats_unknown_tags, 1);
    assert_eq!(r.balloon().next_stats_poll_us(), Some(7 * SECOND));

    // A second buffer while one is held comes back at once, unread.
    assert_eq!(r.send_stats(&[(4, 1)]), TransportEvent::Interrupt);
    assert_eq!(r.used(q).len(), 1);
    assert_eq!(r.balloon().stats().stats_buffers_extra, 1);
    assert_eq!(r.balloon().stats_sample().unwrap().get(4), Some(1 << 20));
    r.ack();

    // Not due before the 2 s default interval.
    assert_eq!(r.poll(6 * SECOND), TransportEvent::None);
    assert!(r.used(q).is_empty());
    assert_eq!(r.poll(7 * SECOND), TransportEvent::Interrupt);
    assert_eq!(r.used(q), vec![(0, 0)]);
    assert_eq!(r.t.interrupt_status(), mmio::INT_USED_BUFFER);
    assert_eq!(r.balloon().stats().stats_refreshes, 1);
    // Nothing held: nothing to poll.
    assert_eq!(r.poll(20 * SECOND), TransportEvent::None);
    assert_eq!(r.balloon().next_stats_poll_us(), None);

    // The driver refills it: a new sample replaces the old one whole.
    r.env.backend.now = 21 * SECOND;
    r.send_stats(&[(4, 1 << 19)]);
    let s = r.balloon().stats_sample().unwrap();
    assert_eq!(
        (s.get(4), s.get(5), s.arrived_us),
        (Some(1 << 19), None, 21 * SECOND)
    );
    assert!(r.used(q).is_empty());
    assert_eq!(r.balloon().stats().stats_buffers_held, 2);
    assert!(!r.t.needs_reset());
}

#[test]
fn stats_interval_and_requests() {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let q = r.qi(QueueKind::Stats);
    r.send_stats(&[(4, 1)]);
    // Off: never due by time, but a request still refreshes.
    r.t.device_mut().set_stats_interval(0);
    assert_eq!(r.balloon().stats_interval_us(), 0);
    assert_eq!(r.poll(1000 * SECOND), TransportEvent::None);
    assert_eq!(r.balloon().next_stats_poll_us(), None);
    assert_eq!(
        r.t.request_balloon_stats(&mut r.env, 1000 * SECOND),
        TransportEvent::Interrupt
    );
    assert_eq!(r.used(q).len(), 1);
    // A request with no buffer held waits for the refill; the refill is
    // the fresh sample, and is then held normally.
    r.t.device_mut().request_stats();
    r.env.backend.now = 1001 * SECOND;
    r.send_stats(&[(4, 2)]);
    assert_eq!(r.balloon().stats_sample().unwrap().get(4), Some(2));
    assert_eq!(
        r.poll(1001 * SECOND),
        TransportEvent::Interrupt,
        "still requested"
    );
    assert_eq!(r.used(q).len(), 1);
    r.send_stats(&[(4, 3)]);
    assert_eq!(r.poll(1002 * SECOND), TransportEvent::None);
    // 10 s interval.
    r.t.device_mut().set_stats_interval(10);
    assert_eq!(r.balloon().next_stats_poll_us(), Some(1011 * SECOND));
    assert_eq!(r.poll(1010 * SECOND), TransportEvent::None);
    assert_eq!(r.poll(1011 * SECOND), TransportEvent::Interrupt);
}

#[test]
fn stats_with_a_backend_without_clock() {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let q = r.qi(QueueKind::Stats);
    r.env.backend.clock = false;
    r.send_stats(&[(4, 1)]);
    assert_eq!(r.balloon().stats_sample().unwrap().arrived_us, 0);
    assert_eq!(r.poll(3 * SECOND), TransportEvent::Interrupt);
    assert_eq!(r.used(q).len(), 1);
    // The refill is stamped with the poll that asked for it, and is not due
    // again before the interval: no ping-pong.
    r.env.backend.now = 4 * SECOND;
    r.send_stats(&[(4, 2)]);
    assert_eq!(r.balloon().stats_sample().unwrap().arrived_us, 3 * SECOND);
    assert_eq!(r.poll(4 * SECOND), TransportEvent::None);
    assert_eq!(r.poll(5 * SECOND), TransportEvent::Interrupt);
    // Time never goes backwards for the device.
    r.send_stats(&[(4, 3)]);
    assert_eq!(r.poll(SECOND), TransportEvent::None);
    assert_eq!(r.balloon().stats_sample().unwrap().arrived_us, 5 * SECOND);
}

#[test]
fn stats_without_the_feature_never_poll() {
    // Offered, not accepted: the queue exists but the device does not poll.
    let mut r = Rig::live(F_STATS_VQ, 0);
    assert_eq!(r.poll(100 * SECOND), TransportEvent::None);
    assert_eq!(
        r.t.request_balloon_stats(&mut r.env, 0),
        TransportEvent::None
    );
    // Not offered: no statistics queue at all.
    let r = Rig::live(F_FREE_PAGE_HINT, F_FREE_PAGE_HINT);
    assert_eq!(r.balloon().queue_index(QueueKind::Stats), None);
    assert_eq!(r.balloon().queue_index(QueueKind::FreePageHint), Some(2));
}

/// A malformed statistics buffer: NEEDS_RESET, returned, no sample taken.
fn bad_stats(bufs: &[(u64, u32, bool)], reason: &str) {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let q = r.qi(QueueKind::Stats);
    let ev = r.send_raw(q, bufs);
    assert_eq!(
        format!("{ev}"),
        format!("virtio-balloon needs reset: statsq: {reason}")
    );
    assert_eq!(r.used(q).len(), 1);
    assert!(r.balloon().stats_sample().is_none());
    assert_eq!(r.poll(100 * SECOND), TransportEvent::None);
}

#[test]
fn stats_hostile_buffers() {
    bad_stats(
        &[(BUFS, MAX_STATS_BYTES_FOR_TESTS + 10, false)],
        "buffer of 650 bytes is longer than the 640 bytes accepted per request",
    );
    // Padded 16-byte entries, as one guest crate declares them.
    bad_stats(
        &[(BUFS, 16 * 3, false)],
        "buffer of 48 bytes is not a multiple of 10 bytes",
    );
    bad_stats(
        &[(BUFS, 10, false), (BUFS + 10, 10, true)],
        "descriptor 1 is device-writable, but this queue takes only driver-written buffers",
    );
    bad_stats(
        &[(0x8000_0000, 10, false)],
        "descriptor 0 points outside guest RAM (IPA 0x8000_0000, 10 bytes)",
    );
}

const MAX_STATS_BYTES_FOR_TESTS: u32 = stats::MAX_STATS_BYTES;

#[test]
fn stats_buffer_stays_with_a_stopped_device_and_goes_with_a_reset() {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let q = r.qi(QueueKind::Stats);
    r.send_stats(&[(4, 1)]);
    // A guest error elsewhere stops the device: no more polling.
    r.send_raw(0, &[(BUFS, 6, false)]);
    assert!(r.t.needs_reset());
    r.used(0);
    assert_eq!(
        r.t.request_balloon_stats(&mut r.env, 100 * SECOND),
        TransportEvent::None
    );
    assert!(r.used(q).is_empty());
    // The reset forgets the held buffer (the rings are gone); the sample
    // stays for `info balloon`.
    write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0);
    assert_eq!(r.balloon().next_stats_poll_us(), None);
    assert_eq!(r.balloon().stats_sample().unwrap().get(4), Some(1));
    assert_eq!(r.balloon().stats_interval_us(), DEFAULT_STATS_INTERVAL_US);
}

#[test]
fn stats_lines_for_info_balloon() {
    let sample_text = |s: &StatsSample, now, interval| {
        let mut text = String::new();
        crate::vm::balloon_info::write_stats_sample(&mut text, s, now, interval).unwrap();
        text
    };
    let mut s = StatsSample::new(10 * SECOND);
    s.add_entries(&Rig::stats_buffer(&[
        (0, 0),
        (2, 12),
        (4, 512 << 20),
        (5, 1 << 30),
        (10, 1),
        (15, 3 << 10),
        (16, 5),
    ]));
    assert_eq!(
        sample_text(&s, 12_500_000, 2 * SECOND),
        "  guest statistics, 2.5 s old (polled every 2.0 s; 1 unknown tags ignored):\n\
         \x20   swap_in              0 bytes\n\
         \x20   major_faults         12\n\
         \x20   free_memory          512 MiB\n\
         \x20   total_memory         1024 MiB\n\
         \x20   oom_kills            1\n\
         \x20   direct_reclaims      3 KiB\n"
    );
    let empty = StatsSample::new(0);
    assert_eq!(
        sample_text(&empty, 0, 0),
        "  guest statistics, 0.0 s old (polling off):\n"
    );
}

#[test]
fn stats_of_2_64_minus_1_are_clamped_at_intake() {
    // Issue 36: a guest reported free_memory and disk_caches of 2^64-1
    // bytes; the manager added them and panicked. A memory figure is at
    // most the VM's RAM, a cumulative value at most 2^62.
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    let all: Vec<(u16, u64)> = (0..16).map(|tag| (tag, u64::MAX)).collect();
    r.send_stats(&all);
    let s = *r.balloon().stats_sample().expect("sample");
    for tag in 4..=7 {
        assert_eq!(s.get(tag), Some(RAM_BYTES as u64), "tag {tag}");
    }
    for tag in (0..4).chain(8..16) {
        assert_eq!(s.get(tag), Some(1 << 62), "tag {tag}");
    }
    assert_eq!(s.clamped, 16);
    assert_eq!(r.balloon().stats().stats_values_clamped, 16);
    let info = r.info();
    assert!(
        info.contains("guest values clamped at intake: 16 statistics values, 0 writes of actual"),
        "{info}"
    );
    assert!(info.contains("; 16 values clamped):"), "{info}");
    assert!(info.contains("free_memory          2 MiB"), "{info}");
    // Values within the bounds are kept as sent.
    r.t.device_mut().request_stats();
    r.poll(SECOND);
    let ram = RAM_BYTES as u64;
    r.send_stats(&[(4, ram), (7, ram - 1), (2, (1 << 62) - 1), (0, 0)]);
    let s = *r.balloon().stats_sample().expect("sample");
    assert_eq!(
        [s.get(4), s.get(7), s.get(2), s.get(0)],
        [Some(ram), Some(ram - 1), Some((1 << 62) - 1), Some(0)]
    );
}

#[test]
fn actual_above_the_ram_is_clamped_at_intake() {
    let mut r = Rig::live(0, 0);
    let pages = (RAM_END - RAM_START) as u32;
    // `actual` is config bytes 4..8, the driver's to write.
    write_reg(&mut r.t, &mut r.env, mmio::CONFIG + 4, u32::MAX);
    assert_eq!(r.balloon().actual(), pages);
    assert_eq!(r.balloon().stats().actual_writes_clamped, 1);
    write_reg(&mut r.t, &mut r.env, mmio::CONFIG + 4, pages);
    assert_eq!(r.balloon().actual(), pages);
    assert_eq!(r.balloon().stats().actual_writes_clamped, 1);
}

// ---- Deflate on OOM -------------------------------------------------------

#[test]
fn deflates_below_the_target_count_as_oom() {
    let mut r = Rig::live(F_DEFLATE_ON_OOM, F_DEFLATE_ON_OOM);
    r.t.set_balloon_target(100);
    r.send(0, &pfns(RAM_START..RAM_START + 100));
    // The OOM notifier takes 10 pages back although the target is 100.
    r.send(1, &pfns(RAM_START..RAM_START + 10));
    assert_eq!(r.used(1).len(), 1);
    assert_eq!(r.balloon().stats().pages_deflated_on_oom, 10);
    assert_eq!(r.balloon().ballooned_pages(), 90);
    // The host lowers the target to 50: deflating to it is not OOM.
    r.t.set_balloon_target(50);
    r.send(1, &pfns(RAM_START + 10..RAM_START + 50));
    assert_eq!(r.balloon().stats().pages_deflated_on_oom, 10);
    // 5 over and 5 below the target in one request: 5 count.
    r.t.set_balloon_target(45);
    r.send(1, &pfns(RAM_START + 50..RAM_START + 60));
    assert_eq!(r.balloon().ballooned_pages(), 40);
    assert_eq!(r.balloon().stats().pages_deflated_on_oom, 15);
    r.check();
    assert!(r.info().contains("  deflated on OOM: 15 pages (60 KiB)\n"));
    assert!(format!("{}", r.balloon().stats()).contains("(+0 on reset, 15 on OOM)"));
}

#[test]
fn without_deflate_on_oom_a_deflate_below_the_target_is_a_migration() {
    // Linux migrating a balloon page gives the old one back around taking
    // the new one: below the target for a moment, but not the OOM path.
    let mut r = Rig::live(F_MUST_TELL_HOST, F_MUST_TELL_HOST);
    r.t.set_balloon_target(100);
    r.send(0, &pfns(RAM_START..RAM_START + 100));
    r.send(1, &pfns(RAM_START..RAM_START + 1));
    r.send(0, &pfns(RAM_START + 100..RAM_START + 101));
    assert_eq!(r.balloon().ballooned_pages(), 100);
    assert_eq!(r.balloon().stats().pages_deflated_on_oom, 0);
    assert!(!r.info().contains("deflated on OOM"));
    r.check();
}

// ---- Free page reporting --------------------------------------------------

#[test]
fn reporting_queue_is_big_enough_for_linux() {
    let mut r = Rig::new(F_PAGE_REPORTING);
    let q = r.balloon().queue_index(QueueKind::Reporting).unwrap();
    write_reg(&mut r.t, &mut r.env, mmio::QUEUE_SEL, q as u32);
    assert!(read_reg(&mut r.t, mmio::QUEUE_NUM_MAX) >= 32);
}

#[test]
fn reports_give_blocks_back() {
    let mut r = Rig::live(F_PAGE_REPORTING, F_PAGE_REPORTING);
    let q = r.qi(QueueKind::Reporting);
    assert_eq!(q, 2);
    // Linux: up to 32 blocks of 2 MiB; the test RAM has room for 64 KiB ones.
    let ev = r.send_raw(
        q,
        &[
            (FREE + 0x20000, 0x10000, true),
            (FREE, 0x10000, true),
            (FREE + 0x40000, 0x1000, true),
        ],
    );
    assert_eq!(ev, TransportEvent::Interrupt);
    assert_eq!(r.used(q), vec![(0, 0)]);
    assert_eq!(
        r.env.backend.reports,
        vec![vec![
            pages(FREE, 16),
            pages(FREE + 0x20000, 16),
            pages(FREE + 0x40000, 1)
        ]]
    );
    let s = *r.balloon().stats();
    assert_eq!((s.reports, s.report_blocks, s.pages_reported), (1, 3, 33));
    // Pages reported earlier may be reported again (the guest used them).
    r.send_raw(q, &[(FREE, 0x10000, true)]);
    assert_eq!(r.env.backend.reports.len(), 2);
    assert!(r
        .info()
        .contains("  free page reporting: 2 reports, 4 blocks, 49 pages (196 KiB) given back\n"));
    assert!(!r.t.needs_reset());
}

#[test]
fn a_report_as_long_as_the_queue() {
    let mut r = Rig::live(F_PAGE_REPORTING, F_PAGE_REPORTING);
    let q = r.qi(QueueKind::Reporting);
    // Every descriptor of the queue in one chain, in descending order.
    let chain: Vec<(u64, u32, bool)> = (0..u64::from(QSIZE))
        .rev()
        .map(|i| (FREE + i * 0x2000, 0x1000, true))
        .collect();
    r.send_raw(q, &chain);
    assert_eq!(r.used(q).len(), 1);
    let want: Vec<Range<u64>> = (0..u64::from(QSIZE))
        .map(|i| pages(FREE + i * 0x2000, 1))
        .collect();
    assert_eq!(r.env.backend.reports, vec![want]);
    assert_eq!(r.balloon().stats().blocks_rejected(), 0);
    assert!(!r.t.needs_reset());
}

#[test]
fn report_blocks_hostile() {
    let mut r = Rig::live(F_PAGE_REPORTING, F_PAGE_REPORTING);
    let q = r.qi(QueueKind::Reporting);
    // Balloon one page in the middle of a would-be block.
    r.send(0, &[(FREE >> 12) as u32 + 0x50]);
    let end = BASE + RAM_BYTES as u64;
    r.send_raw(
        q,
        &[
            (0x8000_0000, 0x1000, true),       // outside RAM
            (BASE - 0x1000, 0x2000, true),     // starts below RAM
            (end - 0x1000, 0x2000, true),      // runs past the end
            (FREE + 0x800, 0x1000, true),      // unaligned address
            (FREE + 0x1000, 0x1800, true),     // unaligned length
            (FREE + 0x3000, 0, true),          // empty
            (FREE + 0x4f000, 0x2000, true),    // holds a ballooned page
            (FREE + 0x10000, 0x4000, true),    // good
            (FREE + 0x12000, 0x4000, true),    // overlaps the good one
            (FREE + 0x10000, 0x1000, true),    // repeats part of it
            (end - 0x1000, 0x1000, true),      // good: the last page
            (u64::MAX - 0x1fff, 0x1000, true), // near the top of the address space
        ],
    );
    assert_eq!(r.used(q).len(), 1, "the report comes back");
    assert_eq!(
        r.env.backend.reports,
        vec![vec![pages(FREE + 0x10000, 4), pages(end - 0x1000, 1)]]
    );
    let s = *r.balloon().stats();
    assert_eq!(s.blocks_rejected_outside_ram, 4);
    assert_eq!(s.blocks_rejected_unaligned, 3);
    assert_eq!(s.blocks_rejected_ballooned, 1);
    assert_eq!(s.blocks_rejected_overlapping, 2);
    assert_eq!(s.pages_reported, 5);
    assert!(r.info().contains(
        "  free blocks rejected: 4 outside RAM, 3 unaligned, 1 ballooned, 2 overlapping\n"
    ));
    // Nothing valid: no backend call, the buffer still comes back.
    r.send_raw(q, &[(FREE + 1, 0x1000, true)]);
    assert_eq!(r.used(q).len(), 1);
    assert_eq!(r.env.backend.reports.len(), 1);
    assert!(!r.t.needs_reset());
    r.check();
    // A driver-written descriptor is a device error.
    let ev = r.send_raw(q, &[(FREE, 0x1000, false)]);
    assert_eq!(
        format!("{ev}"),
        "virtio-balloon needs reset: reporting_vq: descriptor 13 is driver-written, but this \
         queue takes only device-writable buffers"
    );
    assert_eq!(r.used(q).len(), 1);
}

// ---- Page poisoning -------------------------------------------------------

#[test]
fn poison_value_fills_pages_and_freezes_at_driver_ok() {
    let mut r = Rig::new(F_PAGE_POISON | F_PAGE_REPORTING);
    assert_eq!(r.balloon().config_size(), 16);
    let status = handshake(
        &mut r.t,
        &mut r.env,
        F_PAGE_POISON | F_PAGE_REPORTING | F_VERSION_1,
        &r.qs.clone(),
    );
    assert_ne!(status & mmio::STATUS_FEATURES_OK, 0);
    // Linux writes poison_val before DRIVER_OK.
    r.t.write(mmio::CONFIG + 12, 4, 0xaaaa_aaaa, &mut r.env)
        .unwrap();
    assert_eq!(
        r.balloon().page_fill(),
        0,
        "not negotiated before DRIVER_OK"
    );
    driver_ok(&mut r.t, &mut r.env);
    assert_eq!(r.balloon().page_fill(), 0xaaaa_aaaa);
    // Frozen from DRIVER_OK on.
    r.t.write(mmio::CONFIG + 12, 4, 0x5555_5555, &mut r.env)
        .unwrap();
    r.t.write(mmio::CONFIG + 13, 1, 0, &mut r.env).unwrap();
    assert_eq!(r.balloon().poison_val(), 0xaaaa_aaaa);
    assert_eq!(r.read_config(12, 4), 0xaaaa_aaaa);
    assert_eq!(r.balloon().stats().poison_writes_ignored, 2);
    // actual is still writable.
    r.t.write(mmio::CONFIG + 4, 4, 3, &mut r.env).unwrap();
    assert_eq!(r.balloon().actual(), 3);
    assert!(r
        .info()
        .contains("  page poison: 0xaaaaaaaa; pages backed again are filled with it\n"));
    // Reset: zero-filled again until the next driver says otherwise.
    write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0);
    assert_eq!(r.balloon().page_fill(), 0);
    r.t.write(mmio::CONFIG + 12, 4, 0x1234_5678, &mut r.env)
        .unwrap();
    assert_eq!(r.balloon().poison_val(), 0x1234_5678);
}

#[test]
fn poison_offered_but_declined_fills_with_zero() {
    let mut r = Rig::new(F_PAGE_POISON);
    handshake(&mut r.t, &mut r.env, F_VERSION_1, &r.qs.clone());
    r.t.write(mmio::CONFIG + 12, 4, 0xaaaa_aaaa, &mut r.env)
        .unwrap();
    driver_ok(&mut r.t, &mut r.env);
    assert_eq!(r.balloon().page_fill(), 0);
}

// ---- Free page hinting ----------------------------------------------------

fn hint_rig() -> Rig {
    let mut r = Rig::live(ALL, ALL);
    r.ack();
    r
}

#[test]
fn hint_run_start_to_done() {
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    assert_eq!(q, 3);
    assert_eq!(r.read_config(8, 4), 0, "STOP before any run");
    assert!(r
        .info()
        .contains("free page hinting: idle, cmd id 0; no run yet"));

    r.env.backend.now = 100 * SECOND;
    let id = r.t.start_free_page_hint(100 * SECOND).unwrap();
    assert!(id >= 2);
    assert_eq!(r.read_config(8, 4), id);
    assert_eq!(r.ack(), mmio::INT_CONFIG_CHANGE);
    assert_eq!(r.balloon().hint_state(), HintState::Requested);

    // The driver answers with the id, then hints free blocks one by one.
    r.send_cmd_id(id);
    assert_eq!(r.balloon().hint_state(), HintState::Started);
    assert_eq!(r.read_config(8, 4), id, "the id stays while the run goes");
    for i in 0..3 {
        r.send_raw(q, &[(FREE + i * 0x10000, 0x10000, true)]);
    }
    assert_eq!(r.used(q).len(), 4);
    assert_eq!(r.env.backend.hints.len(), 3);
    assert_eq!(r.env.backend.hints[1], vec![pages(FREE + 0x10000, 16)]);
    assert_eq!(r.env.backend.discarded.len(), 48);

    // The guest takes two hinted pages back before DONE; other faults and a
    // second fault on the same page do not count.
    assert!(r.t.device_mut().page_refaulted(GuestPfn::new(FREE >> 12)));
    assert!(!r.t.device_mut().page_refaulted(GuestPfn::new(FREE >> 12)));
    assert!(r
        .t
        .device_mut()
        .page_refaulted(GuestPfn::new((FREE >> 12) + 47)));
    assert!(!r
        .t
        .device_mut()
        .page_refaulted(GuestPfn::new((FREE >> 12) + 48)));
    assert!(!r.t.device_mut().page_refaulted(GuestPfn::new(0)));
    r.ack();

    // STOP from the driver: the device sets DONE and tells the driver.
    r.env.backend.now = 103 * SECOND;
    assert_eq!(r.send_cmd_id(0), TransportEvent::Interrupt);
    assert_eq!(r.balloon().hint_state(), HintState::Done);
    assert_eq!(r.read_config(8, 4), 1);
    assert_eq!(r.ack(), mmio::INT_USED_BUFFER | mmio::INT_CONFIG_CHANGE);
    let run = *r.balloon().hint_run().unwrap();
    assert_eq!(run.outcome, HintOutcome::Done);
    assert_eq!((run.blocks, run.pages_hinted, run.pages_reused), (3, 48, 2));
    assert_eq!(run.elapsed_us(1000 * SECOND), 3 * SECOND);
    assert_eq!(run.answered_us, Some(100 * SECOND));
    // After DONE the guest reuses the pages freely: not counted.
    assert!(!r
        .t
        .device_mut()
        .page_refaulted(GuestPfn::new((FREE >> 12) + 1)));
    let s = *r.balloon().stats();
    assert_eq!(
        (
            s.hint_runs,
            s.hint_blocks,
            s.pages_hinted,
            s.hint_pages_reused
        ),
        (1, 3, 48, 2)
    );
    assert!(r.info().contains(&format!(
        "  free page hinting: done, cmd id 1; last run {id} done: 48 pages hinted in 3 blocks, \
         2 reused before DONE, 3.0 s\n"
    )));

    // The next run gets a fresh id.
    let id2 = r.t.start_free_page_hint(200 * SECOND).unwrap();
    assert_eq!(id2, id + 1);
    assert!(!r.t.needs_reset());
}

#[test]
fn hint_ids_are_fresh_and_never_stop_or_done() {
    assert_eq!(hint::next_id(0), 2);
    assert_eq!(hint::next_id(2), 3);
    assert_eq!(hint::next_id(u32::MAX), 2);
    let mut r = hint_rig();
    let a = r.t.start_free_page_hint(0).unwrap();
    // Superseded before the driver answered.
    let b = r.t.start_free_page_hint(1).unwrap();
    assert_ne!(a, b);
    assert_eq!(
        r.balloon().hint_run().map(|run| run.id),
        Some(b),
        "the latest run"
    );
    // The stale answer to the first id is ignored, hints after it too.
    r.send_cmd_id(a);
    assert_eq!(r.balloon().hint_state(), HintState::Requested);
    let q = r.qi(QueueKind::FreePageHint);
    r.send_raw(q, &[(FREE, 0x10000, true)]);
    assert!(r.env.backend.hints.is_empty());
    assert_eq!(r.used(q).len(), 2);
    let s = *r.balloon().stats();
    assert_eq!((s.hint_ids_stale, s.hint_buffers_stale), (1, 1));
    // A stale STOP of an earlier run does not end this one.
    r.send_cmd_id(0);
    assert_eq!(r.balloon().hint_state(), HintState::Requested);
    // A started run must end before another starts.
    r.send_cmd_id(b);
    assert_eq!(
        r.t.start_free_page_hint(2),
        Err(HintError::InProgress { id: b })
    );
    // Answering twice changes nothing.
    r.send_cmd_id(b);
    assert_eq!(r.balloon().hint_state(), HintState::Started);
    assert_eq!(r.balloon().stats().hint_ids_stale, 3);
}

#[test]
fn hint_host_stop() {
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    let id = r.t.start_free_page_hint(0).unwrap();
    r.send_cmd_id(id);
    r.send_raw(q, &[(FREE, 0x1000, true)]);
    r.ack();
    // The host asks the driver to stop: the config shows STOP.
    assert!(r.t.stop_free_page_hint(1));
    assert_eq!(r.read_config(8, 4), 0);
    assert_eq!(r.ack(), mmio::INT_CONFIG_CHANGE);
    assert_eq!(r.balloon().hint_state(), HintState::HostStopped);
    // Hints still in flight are ignored from now on.
    r.send_raw(q, &[(FREE + 0x1000, 0x1000, true)]);
    assert_eq!(r.env.backend.hints.len(), 1);
    // The driver's STOP ends the run with DONE.
    r.send_cmd_id(0);
    assert_eq!(r.read_config(8, 4), 1);
    assert_eq!(r.balloon().hint_run().unwrap().outcome, HintOutcome::Done);
    assert!(!r.t.stop_free_page_hint(2), "nothing left to stop");
    // A run the driver never answered stops at once.
    let id = r.t.start_free_page_hint(3).unwrap();
    assert!(r.t.stop_free_page_hint(4));
    assert_eq!(r.read_config(8, 4), 1);
    let run = *r.balloon().hint_run().unwrap();
    assert_eq!((run.id, run.answered_us), (id, None));
    assert!(r.info().contains("(the driver never answered)"));
}

#[test]
fn hint_refused_when_not_possible() {
    let mut r = Rig::live(F_STATS_VQ, F_STATS_VQ);
    assert_eq!(r.t.start_free_page_hint(0), Err(HintError::NotOffered));
    let mut r = Rig::live(F_FREE_PAGE_HINT, 0);
    assert_eq!(r.t.start_free_page_hint(0), Err(HintError::NotNegotiated));
    let mut r = Rig::new(F_FREE_PAGE_HINT);
    assert_eq!(r.t.start_free_page_hint(0), Err(HintError::NotNegotiated));
    assert_eq!(
        format!("{}", HintError::NotOffered),
        "its balloon does not offer FREE_PAGE_HINT (enable the feature in the VM's configuration)"
    );
    // A stopped device.
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    let ev = r.send_raw(q, &[(BUFS, 8, false)]);
    assert_eq!(
        format!("{ev}"),
        "virtio-balloon needs reset: free_page_vq: buffer of 8 bytes, but this queue takes \
         buffers of exactly 4 bytes"
    );
    assert_eq!(r.used(q).len(), 1);
    assert_eq!(r.t.start_free_page_hint(0), Err(HintError::DeviceStopped));
}

#[test]
fn hint_blocks_hostile() {
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    r.send(0, &[(FREE >> 12) as u32]);
    let id = r.t.start_free_page_hint(0).unwrap();
    r.send_cmd_id(id);
    r.send_raw(
        q,
        &[
            (FREE, 0x2000, true),          // holds a ballooned page
            (FREE + 0x2001, 0x1000, true), // unaligned
            (0x8000_0000, 0x1000, true),   // outside RAM
            (FREE + 0x4000, 0x4000, true), // good
            (FREE + 0x6000, 0x1000, true), // overlaps it
        ],
    );
    assert_eq!(r.env.backend.hints, vec![vec![pages(FREE + 0x4000, 4)]]);
    // Hinting the same pages again (the guest's shrinker gave them back and
    // the driver took them again) does not count them twice.
    r.send_raw(q, &[(FREE + 0x4000, 0x8000, true)]);
    assert_eq!(r.balloon().hint_run().unwrap().pages_hinted, 8);
    assert_eq!(r.balloon().stats().blocks_rejected(), 4);
    // Inflating a hinted page takes it out of the run.
    r.send(0, &[(FREE >> 12) as u32 + 4]);
    assert!(!r
        .t
        .device_mut()
        .page_refaulted(GuestPfn::new((FREE >> 12) + 4)));
    assert!(r
        .t
        .device_mut()
        .page_refaulted(GuestPfn::new((FREE >> 12) + 5)));
    r.check();
    assert!(!r.t.needs_reset());
}

#[test]
fn reset_abandons_the_hint_run_and_keeps_ids_fresh() {
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    let id = r.t.start_free_page_hint(0).unwrap();
    r.send_cmd_id(id);
    r.send_raw(q, &[(FREE, 0x1000, true)]);
    r.env.backend.now = 7;
    write_reg(&mut r.t, &mut r.env, mmio::STATUS, 0);
    assert_eq!(r.balloon().hint_state(), HintState::Idle);
    let run = *r.balloon().hint_run().unwrap();
    assert_eq!((run.outcome, run.ended_us), (HintOutcome::Reset, Some(7)));
    assert!(!r.t.device_mut().page_refaulted(GuestPfn::new(FREE >> 12)));
    assert_eq!(r.read_config(8, 4), 0);
    // A new driver gets a new id, never the one before.
    for q in &r.qs {
        r.env.mem.poke(q.used, &[0; 4]);
        r.env.mem.poke(q.avail, &[0; 4]);
    }
    r.qs = (0..r.qs.len() as u64)
        .map(|q| {
            let at = BASE + q * 0x1000;
            DriverQueue::new(QSIZE, at, at + 0x400, at + 0x800)
        })
        .collect();
    handshake(&mut r.t, &mut r.env, ALL | F_VERSION_1, &r.qs.clone());
    driver_ok(&mut r.t, &mut r.env);
    assert_eq!(r.t.start_free_page_hint(10), Ok(id + 1));
}

#[test]
fn all_features_together_keep_their_queues_apart() {
    let mut r = hint_rig();
    // inflateq 0, deflateq 1, statsq 2, free_page_vq 3, reporting_vq 4.
    let order: Vec<QueueKind> = (0..5).map(|i| r.balloon().queue_kind(i).unwrap()).collect();
    assert_eq!(
        order,
        vec![
            QueueKind::Inflate,
            QueueKind::Deflate,
            QueueKind::Stats,
            QueueKind::FreePageHint,
            QueueKind::Reporting
        ]
    );
    r.send_stats(&[(4, 7)]);
    r.send_raw(4, &[(FREE, 0x1000, true)]);
    r.send_cmd_id(5); // stale: no run
    assert_eq!(r.balloon().stats_sample().unwrap().get(4), Some(7));
    assert_eq!(r.env.backend.reports.len(), 1);
    assert_eq!(r.balloon().stats().hint_ids_stale, 1);
    assert!(!r.t.needs_reset());
    // The statistics buffer is the only one kept.
    for (i, q) in r.t.queues().iter().enumerate() {
        assert_eq!(q.in_flight(), u32::from(i == 2), "queue {i}");
    }
}

/// The balloon's saved state, as restored: every byte it saves.
fn resaved(b: &Balloon) -> Result<Vec<u8>, crate::savestate::StateError> {
    let back: Balloon = crate::savestate::from_bytes(&crate::savestate::to_bytes(b))?;
    Ok(crate::savestate::to_bytes(&back))
}

#[test]
fn a_saved_balloon_comes_back_with_its_pages_hints_and_run() {
    let mut r = hint_rig();
    let q = r.qi(QueueKind::FreePageHint);
    r.env.backend.now = 100 * SECOND;
    let id = r.t.start_free_page_hint(100 * SECOND).unwrap();
    r.send_cmd_id(id);
    for i in 0..3 {
        r.send_raw(q, &[(FREE + i * 0x10000, 0x10000, true)]);
    }
    r.send(0, &pfns(RAM_START + 16..RAM_START + 80));
    let b = r.balloon();
    assert_eq!((b.ballooned_pages(), b.hinted_count), (64, 48));
    let saved = crate::savestate::to_bytes(b);
    let back: Balloon = crate::savestate::from_bytes(&saved).expect("restores");
    assert_eq!(back.ballooned_pages(), 64);
    assert_eq!(back.hinted_count, 48);
    assert_eq!(back.hint_run(), b.hint_run());
    assert_eq!(back.hint_state(), HintState::Started);
    assert_eq!(back.stats(), b.stats());
    assert_eq!(resaved(b).expect("restores"), saved);
    // A hinted page touched again is counted on the restored device too.
    let mut back = back;
    assert!(back.page_refaulted(GuestPfn::new(FREE >> 12)));

    // Offsets: version 0, offered 1..9, RAM 9..25, negotiated 25..33,
    // live 33, then the ballooned bitmap (a word per 64 pages), the
    // hinted bitmap, and the two counts.
    let words = (RAM_END - RAM_START).div_ceil(64) as usize;
    let ballooned = 34;
    let hinted = ballooned + 8 * words;
    let counts = hinted + 8 * words;
    let with = |at: usize, bytes: &[u8]| {
        let mut bad = saved.clone();
        bad[at..at + bytes.len()].copy_from_slice(bytes);
        crate::savestate::from_bytes::<Balloon>(&bad)
            .err()
            .expect("refused")
    };
    use crate::savestate::StateError::Invalid;
    assert_eq!(with(25, &[0xff; 8]), Invalid("balloon features negotiated"));
    assert_eq!(with(1, &[0xff; 8]), Invalid("balloon features offered"));
    assert_eq!(with(counts, &[65]), Invalid("balloon page counts"));
    // Page 16 (bit 0 of the word's third byte) is ballooned: hinting it
    // too is a state no driver reaches.
    assert_eq!(
        with(hinted + 2, &[1]),
        Invalid("a page both ballooned and hinted")
    );
    // A page past the RAM's end.
    if !(RAM_END - RAM_START).is_multiple_of(64) {
        assert_eq!(with(hinted - 1, &[0x80]), Invalid("balloon bitmap"));
    }
    assert_eq!(
        with(0, &[7]),
        crate::savestate::StateError::Version {
            device: "balloon",
            found: 7
        }
    );
}
