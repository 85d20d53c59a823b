//! Host tests of the snapshot format: round trips, every damage a disk can
//! do to a small snapshot (each bit position, each length), hand-built
//! streams that no writer makes, and a snapshot through the store.

use core::ops::Range;

use proptest::prelude::*;

use super::format::*;
use super::store::{Store, StoreError};
use super::testing::{
    read_all as read, OwnedPage as Owned, RamDisk, ReadAll, SECTION_KINDS as KINDS,
};
use crate::bundle_crc::crc32;
use crate::test_rng::XorShift;

fn data(seed: u64) -> Owned {
    let mut rng = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut page = Box::new([0u8; PAGE]);
    page.copy_from_slice(&rng.bytes(PAGE));
    Owned::Data(page)
}

/// Pages of the kinds given (0 not backed, 1 zero, 2 data), data pages
/// each different.
fn pages_of(kinds: &[u8]) -> Vec<Owned> {
    kinds
        .iter()
        .enumerate()
        .map(|(i, k)| match k {
            0 => Owned::NotBacked,
            1 => Owned::Zero,
            _ => data(i as u64 + 1),
        })
        .collect()
}

fn header(ram_pages: u64) -> Header {
    Header {
        board: 0x5649_5232,
        gic: 2,
        midr: 0x410f_d083,
        vcpus: 2,
        counter_hz: 62_500_000,
        guest_counter: 0x1234_5678_9abc,
        ram_base: 0x4000_0000,
        ram_pages,
    }
}

fn sections() -> [Vec<u8>; 3] {
    [b"name = alpha".to_vec(), vec![7; 300], Vec::new()]
}

fn write(header: &Header, sections: &[Vec<u8>; 3], pages: &[Owned]) -> (Vec<u8>, Totals) {
    let mut w = SnapshotWriter::new(Vec::new(), header).unwrap();
    for (kind, bytes) in KINDS.iter().zip(sections) {
        w.section(*kind, bytes).unwrap();
    }
    for p in pages {
        w.page(p.page()).unwrap();
    }
    let totals = w.totals();
    let (bytes, finished) = w.finish().unwrap();
    assert_eq!(totals, finished);
    (bytes, totals)
}

fn totals_of(pages: &[Owned]) -> Totals {
    let mut t = Totals::default();
    for p in pages {
        match p {
            Owned::NotBacked => t.not_backed += 1,
            Owned::Zero => t.zero += 1,
            Owned::Data(_) => t.data += 1,
        }
    }
    t
}

fn round_trip(kinds: &[u8]) {
    let header = header(kinds.len() as u64);
    let pages = pages_of(kinds);
    let (bytes, totals) = write(&header, &sections(), &pages);
    assert_eq!(totals, totals_of(&pages));
    let out = read(&bytes);
    assert_eq!(out.result, Ok(totals));
    assert_eq!(out.header, Some(header));
    assert_eq!(out.sections, sections());
    let (pfns, back): (Vec<u64>, Vec<Owned>) = out.pages.into_iter().unzip();
    assert_eq!(pfns, (0..kinds.len() as u64).collect::<Vec<_>>());
    assert!(back == pages, "the pages read back differ");
}

#[test]
fn a_snapshot_reads_back_as_it_was_written() {
    round_trip(&[2]);
    round_trip(&[1]);
    round_trip(&[0]);
    // Not a multiple of the chunk, a multiple, and one over.
    let mixed: Vec<u8> = (0..200u32).map(|i| (i * 7 % 5 % 3) as u8).collect();
    round_trip(&mixed);
    round_trip(&mixed[..128]);
    round_trip(&mixed[..65]);
    round_trip(&[0; 130]);
}

#[test]
fn the_bytes_are_laid_out_as_documented() {
    // docs/SNAPSHOT.md, built by hand: a VM of 5 pages, one section
    // byte, the pages not backed, zero, data, data, zero.
    let h = Header {
        board: 0x0102_0304,
        gic: 3,
        midr: 0x1122_3344_5566_7788,
        vcpus: 4,
        counter_hz: 1_000_000,
        guest_counter: 42,
        ram_base: 0x8000_0000,
        ram_pages: 5,
    };
    let pages = pages_of(&[0, 1, 2, 2, 1]);
    let (bytes, _) = write(&h, &[vec![0xAB], Vec::new(), vec![1, 2]], &pages);
    let mut want = Vec::new();
    want.extend_from_slice(b"TIDALVM\0");
    want.extend_from_slice(&1u16.to_le_bytes());
    want.extend_from_slice(&[3, 4]);
    want.extend_from_slice(&0x0102_0304u32.to_le_bytes());
    for v in [0x1122_3344_5566_7788u64, 1_000_000, 42, 0x8000_0000, 5] {
        want.extend_from_slice(&v.to_le_bytes());
    }
    want.extend_from_slice(&crc32(&want).to_le_bytes());
    assert_eq!(want.len(), HEADER_LEN);
    for (kind, body) in [(1u32, &[0xABu8][..]), (2, &[]), (3, &[1, 2])] {
        let from = want.len();
        want.extend_from_slice(&kind.to_le_bytes());
        want.extend_from_slice(&(body.len() as u32).to_le_bytes());
        want.extend_from_slice(body);
        let crc = crc32(&want[from..]);
        want.extend_from_slice(&crc.to_le_bytes());
    }
    let data: Vec<&[u8; PAGE]> = pages
        .iter()
        .filter_map(|p| match p {
            Owned::Data(d) => Some(&**d),
            _ => None,
        })
        .collect();
    // Kinds 0, 1, 2, 2 in the first byte (page 0 in its low bits), 1 in
    // the second.
    want.extend_from_slice(&raw_chunk(0, 5, &[0b10_10_01_00, 0b01], &data));
    want.extend_from_slice(&raw_end(1, 2, 2));
    assert_eq!(bytes.len(), want.len());
    assert!(bytes == want, "the layout differs from the documented one");
}

/// A chunk as docs/SNAPSHOT.md says, sealed.
fn raw_chunk(first: u64, count: u16, kinds: &[u8], data: &[&[u8; PAGE]]) -> Vec<u8> {
    let mut c = Vec::new();
    c.extend_from_slice(&CHUNK_TAG.to_le_bytes());
    c.extend_from_slice(&first.to_le_bytes());
    c.extend_from_slice(&count.to_le_bytes());
    c.extend_from_slice(kinds);
    for d in data {
        c.extend_from_slice(&d[..]);
    }
    let crc = crc32(&c);
    c.extend_from_slice(&crc.to_le_bytes());
    c
}

fn raw_end(not_backed: u64, zero: u64, data: u64) -> Vec<u8> {
    let mut e = END_TAG.to_le_bytes().to_vec();
    for v in [not_backed, zero, data] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    let crc = crc32(&e);
    e.extend_from_slice(&crc.to_le_bytes());
    e
}

/// The header and the three sections of a snapshot of `ram_pages`, as
/// the writer writes them: what hand-built memory goes after.
fn start(ram_pages: u64) -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut w = SnapshotWriter::new(&mut bytes, &header(ram_pages)).unwrap();
    for (kind, body) in KINDS.iter().zip(sections()) {
        w.section(*kind, &body).unwrap();
    }
    drop(w);
    bytes
}

/// Where each chunk of a snapshot written by `write` lies: its bytes and
/// its pages.
fn chunk_spans(kinds: &[u8]) -> Vec<(Range<usize>, Range<u64>)> {
    let mut at = start(kinds.len() as u64).len();
    let mut spans = Vec::new();
    for (i, chunk) in kinds.chunks(CHUNK_PAGES).enumerate() {
        let data = chunk.iter().filter(|k| **k == 2).count();
        let len = 14 + chunk.len().div_ceil(4) + data * PAGE + 4;
        let first = (i * CHUNK_PAGES) as u64;
        spans.push((at..at + len, first..first + chunk.len() as u64));
        at += len;
    }
    spans
}

/// Two chunks (64 pages and 6), three data pages.
fn small() -> (Vec<u8>, Vec<u8>) {
    let mut kinds = vec![0u8; 70];
    kinds[1] = 1;
    kinds[3] = 2;
    kinds[63] = 2;
    kinds[64] = 1;
    kinds[69] = 2;
    let (bytes, _) = write(&header(70), &sections(), &pages_of(&kinds));
    (kinds, bytes)
}

#[test]
fn every_single_bit_flip_is_refused_and_no_damaged_chunk_is_delivered() {
    let (kinds, bytes) = small();
    let pages = pages_of(&kinds);
    let spans = chunk_spans(&kinds);
    assert_eq!(spans.last().unwrap().0.end + END_LEN, bytes.len());
    let mut damaged = bytes.clone();
    for at in 0..bytes.len() {
        let bit = 1 << (at % 8);
        damaged[at] ^= bit;
        let out = read(&damaged);
        assert!(out.result.is_err(), "a flip at byte {at} was not noticed");
        for (pfn, page) in &out.pages {
            assert!(
                *page == pages[*pfn as usize],
                "a flip at byte {at}: page {pfn} differs"
            );
        }
        if let Some((_, hit)) = spans.iter().find(|(b, _)| b.contains(&at)) {
            assert!(
                out.pages.iter().all(|(pfn, _)| !hit.contains(pfn)),
                "a flip at byte {at}: pages of its chunk were delivered"
            );
        }
        if at < spans[0].0.start {
            assert!(out.pages.is_empty(), "a flip at byte {at}");
        }
        damaged[at] ^= bit;
    }
}

#[test]
fn a_snapshot_cut_short_anywhere_is_refused() {
    let (kinds, bytes) = small();
    let spans = chunk_spans(&kinds);
    for len in 0..bytes.len() {
        let out = read(&bytes[..len]);
        assert!(out.result.is_err(), "cut at {len}");
        // Only whole chunks are delivered.
        let whole = spans.iter().filter(|(b, _)| b.end <= len).count();
        let delivered = spans
            .iter()
            .filter(|(_, p)| out.pages.iter().any(|(pfn, _)| p.contains(pfn)))
            .count();
        assert!(delivered <= whole, "cut at {len}");
    }
    assert_eq!(
        read(&bytes[..10]).result,
        Err(FormatError::Store(StoreError::Truncated))
    );
}

#[test]
fn the_header_is_checked() {
    let (_, bytes) = small();
    let mut other = bytes.clone();
    other[0] = b'X';
    assert_eq!(read(&other).result, Err(FormatError::NotASnapshot));
    // Another version, whatever follows.
    let mut other = bytes[..10].to_vec();
    other[8] = 2;
    assert_eq!(read(&other).result, Err(FormatError::Version(2)));
    assert!(FormatError::Version(2)
        .to_string()
        .contains("format version 2; this build reads version 1 only"));
    let mut other = bytes.clone();
    other[20] ^= 1;
    assert_eq!(read(&other).result, Err(FormatError::Checksum("header")));
    // Fields out of range, sealed: refused by the reader and the writer.
    let bad: [fn(&mut Header); 9] = [
        |h| h.gic = 1,
        |h| h.gic = 4,
        |h| h.vcpus = 0,
        |h| h.vcpus = crate::limits::MAX_VCPUS as u8 + 1,
        |h| h.counter_hz = 0,
        |h| h.ram_base = 0x4000_0800,
        |h| h.ram_pages = 0,
        |h| h.ram_pages = MAX_RAM_PAGES + 1,
        |h| h.ram_base = !0xfff,
    ];
    for change in bad {
        let mut h = header(1);
        change(&mut h);
        assert!(
            matches!(
                SnapshotWriter::new(Vec::new(), &h),
                Err(FormatError::Invalid(_))
            ),
            "{h:?}"
        );
        let mut sealed = bytes[..HEADER_LEN].to_vec();
        sealed[10] = h.gic;
        sealed[11] = h.vcpus;
        sealed[24..32].copy_from_slice(&h.counter_hz.to_le_bytes());
        sealed[40..48].copy_from_slice(&h.ram_base.to_le_bytes());
        sealed[48..56].copy_from_slice(&h.ram_pages.to_le_bytes());
        let crc = crc32(&sealed[..HEADER_LEN - 4]);
        sealed[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        assert!(
            matches!(read(&sealed).result, Err(FormatError::Invalid(_))),
            "{h:?}"
        );
    }
    // The largest RAM is fine.
    let mut h = header(MAX_RAM_PAGES);
    h.ram_base = 0;
    SnapshotWriter::new(Vec::new(), &h).unwrap();
}

#[test]
fn sections_out_of_order_are_refused() {
    // The vCPU section where the configuration belongs.
    let mut bytes = Vec::new();
    drop(SnapshotWriter::new(&mut bytes, &header(1)).unwrap());
    let from = bytes.len();
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    let crc = crc32(&bytes[from..]);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let out = read(&bytes);
    assert!(
        matches!(out.result, Err(FormatError::Invalid(why)) if why.contains("configuration")),
        "{:?}",
        out.result
    );
    // A reader asked out of order.
    let (_, bytes) = small();
    let (mut r, _) = SnapshotReader::open(&bytes[..]).unwrap();
    assert!(matches!(
        r.section(SectionKind::Vcpus),
        Err(FormatError::Invalid(_))
    ));
    assert!(matches!(
        r.pages(|_, _| Ok::<_, FormatError>(())),
        Err(FormatError::Invalid(_))
    ));
    r.section(SectionKind::Config).unwrap();
    assert!(matches!(
        r.section(SectionKind::Config),
        Err(FormatError::Invalid(_))
    ));
    // A section damaged: its checksum names it.
    let mut damaged = bytes.clone();
    damaged[HEADER_LEN + 8 + 12 + 4 + 8 + 5] ^= 0x10;
    assert_eq!(
        read(&damaged).result,
        Err(FormatError::Checksum("vCPU section"))
    );
}

/// A source that records the longest read asked of it.
struct Recording<'a> {
    bytes: &'a [u8],
    longest: usize,
}

impl Source for Recording<'_> {
    fn read(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        self.longest = self.longest.max(buf.len());
        self.bytes.read(buf)
    }
}

#[test]
fn a_section_longer_than_the_limit_is_refused_before_it_is_read() {
    for len in [MAX_SECTION as u32 + 1, u32::MAX] {
        let mut bytes = Vec::new();
        drop(SnapshotWriter::new(&mut bytes, &header(1)).unwrap());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&[0; 64]);
        let mut source = Recording {
            bytes: &bytes,
            longest: 0,
        };
        let (mut r, _) = SnapshotReader::open(&mut source).unwrap();
        assert!(matches!(
            r.section(SectionKind::Config),
            Err(FormatError::Invalid(_))
        ));
        drop(r);
        assert!(source.longest <= HEADER_LEN, "read {}", source.longest);
    }
    // The limit itself is fine, in both directions.
    let big = [vec![0x5A; MAX_SECTION], Vec::new(), Vec::new()];
    let (bytes, _) = write(&header(1), &big, &pages_of(&[1]));
    assert_eq!(read(&bytes).sections[0].len(), MAX_SECTION);
    let mut w = SnapshotWriter::new(Vec::new(), &header(1)).unwrap();
    assert!(matches!(
        w.section(SectionKind::Config, &vec![0; MAX_SECTION + 1]),
        Err(FormatError::Invalid(_))
    ));
}

/// `memory` after the start of a snapshot of `ram_pages`, read.
fn read_memory(ram_pages: u64, memory: &[&[u8]]) -> ReadAll {
    let mut bytes = start(ram_pages);
    for part in memory {
        bytes.extend_from_slice(part);
    }
    read(&bytes)
}

fn bad_chunk(out: &ReadAll) -> &'static str {
    match out.result {
        Err(FormatError::BadChunk { why, .. }) => why,
        ref other => panic!("not a bad chunk: {other:?}"),
    }
}

#[test]
fn chunks_no_writer_writes_are_refused() {
    let page = [3u8; PAGE];
    // A count of 0 and of 65.
    let none = raw_chunk(0, 0, &[], &[]);
    assert!(bad_chunk(&read_memory(1, &[&none])).contains("no page"));
    let kinds = [0x55u8; 17];
    let over = raw_chunk(0, 65, &kinds, &[]);
    assert!(bad_chunk(&read_memory(100, &[&over])).contains("more than 64"));
    // Not from page 0; then a gap and an overlap after a first chunk.
    let late = raw_chunk(1, 1, &[1], &[]);
    let out = read_memory(4, &[&late]);
    assert!(bad_chunk(&out).contains("not the one after"));
    let first = raw_chunk(0, 2, &[0b0101], &[]);
    for at in [1, 3] {
        let next = raw_chunk(at, 2, &[0b0101], &[]);
        let out = read_memory(4, &[&first, &next, &raw_end(0, 4, 0)]);
        assert!(bad_chunk(&out).contains("not the one after"), "{at}");
        // The first chunk was fine and delivered.
        assert_eq!(out.pages.len(), 2);
    }
    // Past the end of RAM.
    let long = raw_chunk(0, 3, &[0b010101], &[]);
    assert!(bad_chunk(&read_memory(2, &[&long])).contains("past the end"));
    // A kind of 3, and bits after the last page's kind.
    let three = raw_chunk(0, 2, &[0b1101], &[]);
    assert!(bad_chunk(&read_memory(2, &[&three])).contains("kind is 3"));
    let padded = raw_chunk(0, 1, &[0b0100_0010], &[&page]);
    assert!(bad_chunk(&read_memory(1, &[&padded])).contains("after its last"));
    // A tag that is neither.
    let mut odd = raw_chunk(0, 1, &[1], &[]);
    odd[0] ^= 0xff;
    assert!(bad_chunk(&read_memory(1, &[&odd])).contains("neither"));
    // The same chunk whole is fine.
    let good = raw_chunk(0, 1, &[2], &[&page]);
    let out = read_memory(1, &[&good, &raw_end(0, 0, 1)]);
    assert_eq!(out.result.map(|t| t.data), Ok(1));
    assert_eq!(out.pages[0].1, Owned::Data(Box::new(page)));
}

#[test]
fn the_end_marker_is_checked() {
    let chunk = raw_chunk(0, 3, &[0b010100], &[]);
    // Totals that are not what was read.
    for end in [raw_end(1, 1, 1), raw_end(0, 3, 0), raw_end(1, 2, 1)] {
        let out = read_memory(3, &[&chunk, &end]);
        assert!(
            matches!(out.result, Err(FormatError::Invalid(why)) if why.contains("page counts")),
            "{:?}",
            out.result
        );
    }
    let fine = raw_end(1, 2, 0);
    assert_eq!(
        read_memory(3, &[&chunk, &fine]).result,
        Ok(Totals {
            not_backed: 1,
            zero: 2,
            data: 0
        })
    );
    // Anything after it.
    let out = read_memory(3, &[&chunk, &fine, &[0]]);
    assert_eq!(
        out.result,
        Err(FormatError::Invalid("bytes follow the end marker"))
    );
    // Before the last page.
    let out = read_memory(4, &[&chunk, &fine]);
    assert!(bad_chunk(&out).contains("ends before its last page"));
    // Damaged.
    let mut damaged = fine.clone();
    damaged[5] ^= 1;
    let out = read_memory(3, &[&chunk, &damaged]);
    assert_eq!(out.result, Err(FormatError::Checksum("end marker")));
    assert_eq!(
        FormatError::ChunkChecksum { pfn: 64 }.to_string(),
        "the snapshot's memory chunk at page 64 fails its checksum: it is damaged"
    );
}

#[test]
fn the_writer_refuses_what_a_reader_would() {
    let page = [1u8; PAGE];
    let mut w = SnapshotWriter::new(Vec::new(), &header(2)).unwrap();
    // Pages, or a later section, before the sections.
    assert!(matches!(w.page(Page::Zero), Err(FormatError::Invalid(_))));
    assert!(matches!(
        w.section(SectionKind::Vcpus, &[]),
        Err(FormatError::Invalid(_))
    ));
    w.section(SectionKind::Config, &[1]).unwrap();
    assert!(matches!(
        w.section(SectionKind::Config, &[1]),
        Err(FormatError::Invalid(_))
    ));
    w.section(SectionKind::Vcpus, &[]).unwrap();
    w.section(SectionKind::Devices, &[]).unwrap();
    assert!(matches!(
        w.section(SectionKind::Devices, &[]),
        Err(FormatError::Invalid(_))
    ));
    w.page(Page::Data(&page)).unwrap();
    let Err(FormatError::Invalid(_)) = w.finish() else {
        panic!("finished with a page missing")
    };
    let mut w = SnapshotWriter::new(Vec::new(), &header(1)).unwrap();
    for kind in KINDS {
        w.section(kind, &[]).unwrap();
    }
    w.page(Page::NotBacked).unwrap();
    assert!(matches!(w.page(Page::Zero), Err(FormatError::Invalid(_))));
    assert_eq!(
        w.totals(),
        Totals {
            not_backed: 1,
            ..Totals::default()
        }
    );
    let (bytes, totals) = w.finish().unwrap();
    assert_eq!(read(&bytes).result, Ok(totals));
    // Finished before the sections.
    let w = SnapshotWriter::new(Vec::new(), &header(1)).unwrap();
    assert!(matches!(w.finish(), Err(FormatError::Invalid(_))));
}

/// A sink that fails its `n`th write.
struct Failing {
    writes: usize,
    fail_at: usize,
}

impl Sink for Failing {
    fn write(&mut self, _: &[u8]) -> Result<(), StoreError> {
        self.writes += 1;
        if self.writes == self.fail_at {
            return Err(StoreError::Truncated);
        }
        Ok(())
    }
}

#[test]
fn a_sink_that_fails_stops_the_writer() {
    let sink = Failing {
        writes: 0,
        // The header, then the configuration section's head.
        fail_at: 2,
    };
    let mut w = SnapshotWriter::new(sink, &header(1)).unwrap();
    assert_eq!(
        w.section(SectionKind::Config, &[1]),
        Err(FormatError::Store(StoreError::Truncated))
    );
    // Where the stream is is lost: nothing more is written.
    assert!(matches!(
        w.section(SectionKind::Config, &[1]),
        Err(FormatError::Invalid(_))
    ));
}

#[derive(Debug, PartialEq)]
enum Restore {
    Format(FormatError),
    Full(u64),
}

impl From<FormatError> for Restore {
    fn from(e: FormatError) -> Self {
        Restore::Format(e)
    }
}

#[test]
fn an_error_of_the_callers_stops_the_read_as_it_is() {
    let (_, bytes) = small();
    let (mut r, _) = SnapshotReader::open(&bytes[..]).unwrap();
    for kind in KINDS {
        r.section(kind).unwrap();
    }
    let mut seen = 0;
    let result = r.pages(|pfn, _| {
        seen += 1;
        if pfn == 5 {
            return Err(Restore::Full(pfn));
        }
        Ok(())
    });
    assert_eq!(result, Err(Restore::Full(5)));
    assert_eq!(seen, 6);
    // And the reader is done with.
    assert!(matches!(
        r.pages(|_, _| Ok::<_, Restore>(())),
        Err(Restore::Format(FormatError::Invalid(_)))
    ));
}

#[test]
fn a_snapshot_goes_through_the_store() {
    let mut store = Store::open(RamDisk::new(4000)).unwrap();
    let kinds: Vec<u8> = (0..300u32).map(|i| (i % 3) as u8).collect();
    let pages = pages_of(&kinds);
    let h = header(kinds.len() as u64);
    let mut w = store.begin("before-upgrade", "alpha").unwrap();
    let mut snap = SnapshotWriter::new(&mut w, &h).unwrap();
    for (kind, body) in KINDS.iter().zip(sections()) {
        snap.section(*kind, &body).unwrap();
    }
    for p in &pages {
        snap.page(p.page()).unwrap();
    }
    let (_, totals) = snap.finish().unwrap();
    let len = w.len();
    let entry = w.commit(99, h.board).unwrap();
    assert_eq!(entry.len, len);
    store.verify("before-upgrade").unwrap();

    let mut store = Store::open(store.into_disk()).unwrap();
    let reader = store.open_reader("before-upgrade").unwrap();
    assert_eq!(reader.len(), len);
    let (mut r, back) = SnapshotReader::open(reader).unwrap();
    assert_eq!(back, h);
    for (kind, body) in KINDS.iter().zip(sections()) {
        assert_eq!(r.section(*kind).unwrap(), body);
    }
    let mut read = Vec::new();
    let got = r
        .pages(|pfn, page| {
            read.push((pfn, Owned::of(page)));
            Ok::<_, FormatError>(())
        })
        .unwrap();
    assert_eq!(got, totals);
    assert!(read.into_iter().map(|(_, p)| p).eq(pages));

    // An entry cut short: the reader says so.
    let mut w = store.begin("short", "alpha").unwrap();
    let mut snap = SnapshotWriter::new(&mut w, &header(1)).unwrap();
    snap.section(SectionKind::Config, &[1, 2, 3]).unwrap();
    drop(snap);
    w.commit(1, 2).unwrap();
    let (mut r, _) = SnapshotReader::open(store.open_reader("short").unwrap()).unwrap();
    r.section(SectionKind::Config).unwrap();
    assert_eq!(
        r.section(SectionKind::Vcpus),
        Err(FormatError::Store(StoreError::Truncated))
    );
}

proptest! {
    /// Any pages, any sections, read back as written.
    #[test]
    fn random_pages_read_back(
        kinds in proptest::collection::vec(0u8..3, 1..300),
        config in proptest::collection::vec(any::<u8>(), 0..100),
    ) {
        let h = header(kinds.len() as u64);
        let pages = pages_of(&kinds);
        let body = [config, Vec::new(), vec![9; 3]];
        let (bytes, totals) = write(&h, &body, &pages);
        prop_assert_eq!(totals, totals_of(&pages));
        let out = read(&bytes);
        prop_assert_eq!(out.result, Ok(totals));
        prop_assert_eq!(&out.sections[..], &body[..]);
        prop_assert!(out.pages.iter().enumerate().all(|(i, (pfn, _))| *pfn == i as u64));
        prop_assert!(out.pages.into_iter().map(|(_, p)| p).eq(pages));
    }
}
