//! The snapshot format's reader (`snapshot/format.rs`) over any bytes (a
//! disk can be damaged or swapped): either the input's bytes as they are,
//! or a valid small snapshot written by `SnapshotWriter` from the input
//! (header fields, sections, up to 150 pages of any kinds) and then edited
//! (bytes put into a part, bits flipped, cut, inserted, removed), its parts'
//! checksums sealed again when the input asks, so that the fuzzer reaches
//! the checks behind them. Each is read as a restore reads it: the header,
//! the three sections, the pages. Invariants: nothing panics; the snapshot
//! written reads back exactly as written; a header that opens is one the
//! writer takes; sections at most `MAX_SECTION`; pages arrive in order from
//! page 0, within `ram_pages`, never more than `ram_pages`; a read that
//! succeeds delivered every page and its totals are the pages delivered,
//! and what it delivered, written again, is a snapshot; a single bit flip
//! is always refused.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::snapshot::format::{
    Header, SnapshotWriter, Totals, CHUNK_PAGES, END_LEN, HEADER_LEN, MAX_RAM_PAGES, MAX_SECTION,
    PAGE,
};
use hypervisor::snapshot::testing::{read_all, OwnedPage, ReadAll, SECTION_KINDS as KINDS};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Valid {
    board: u32,
    gic: u8,
    midr: u64,
    vcpus: u8,
    counter_hz: u64,
    guest_counter: u64,
    /// In pages.
    ram_base: u32,
    ram_pages: u8,
    sections: [Vec<u8>; 3],
    /// Page kinds, two bits each (3 is read as zero), repeated over RAM.
    kinds: Vec<u8>,
    fill: u8,
}

#[derive(Arbitrary, Debug)]
enum Edit {
    /// `bytes` over part `part` of the snapshot as written (the header, a
    /// section, a chunk or the end marker, modulo their number) from byte
    /// `offset`, cut at the snapshot's end.
    Put {
        part: u8,
        offset: u16,
        bytes: Vec<u8>,
    },
    Flip {
        at: u32,
        bit: u8,
    },
    Truncate {
        len: u32,
    },
    Insert {
        at: u32,
        bytes: Vec<u8>,
    },
    Remove {
        at: u32,
        len: u16,
    },
}

#[derive(Arbitrary, Debug)]
enum Input {
    Raw(Vec<u8>),
    Edited {
        valid: Valid,
        edits: Vec<Edit>,
        /// Seal every part of the snapshot as written again (a CRC-32 of
        /// its bytes in its last four) after the edits.
        reseal: bool,
    },
}

/// What a reader got from `bytes`, checked: a header the writer takes,
/// sections within their bound, pages in order from 0 and within RAM, and
/// on success every page there and the totals what was delivered.
fn read(bytes: &[u8]) -> ReadAll {
    let out = read_all(bytes);
    let Some(header) = out.header.as_ref() else {
        return out;
    };
    assert!(
        SnapshotWriter::new(Vec::new(), header).is_ok(),
        "the reader took a header the writer refuses: {header:?}"
    );
    let ram_pages = header.ram_pages;
    assert!((1..=MAX_RAM_PAGES).contains(&ram_pages));
    assert!(out.sections.iter().all(|s| s.len() <= MAX_SECTION));
    let mut counted = Totals::default();
    for (i, (pfn, page)) in out.pages.iter().enumerate() {
        assert_eq!(*pfn, i as u64, "a page out of order");
        assert!(*pfn < ram_pages, "page {pfn} past the RAM's {ram_pages}");
        match page {
            OwnedPage::NotBacked => counted.not_backed += 1,
            OwnedPage::Zero => counted.zero += 1,
            OwnedPage::Data(_) => counted.data += 1,
        }
    }
    if let Ok(totals) = out.result {
        assert_eq!(totals, counted, "the totals are not the pages delivered");
        assert_eq!(out.pages.len() as u64, ram_pages, "a page missing");
    }
    out
}

/// A snapshot of what was read, written again.
fn rewrite(read: &ReadAll) -> Vec<u8> {
    let header = read.header.as_ref().expect("read whole");
    let mut w = SnapshotWriter::new(Vec::new(), header).expect("its header");
    for (kind, bytes) in KINDS.iter().zip(&read.sections) {
        w.section(*kind, bytes).expect("a section read");
    }
    for (_, page) in &read.pages {
        w.page(page.page()).expect("a page read");
    }
    let (bytes, totals) = w.finish().expect("every page read");
    assert_eq!(Ok(totals), read.result);
    bytes
}

/// The valid snapshot `v` describes, what it holds, and where its parts
/// lie.
fn build(v: &Valid) -> (Vec<u8>, ReadAll, Vec<(usize, usize)>) {
    let header = Header {
        board: v.board,
        gic: [0, 2, 3][usize::from(v.gic % 3)],
        midr: v.midr,
        vcpus: 1 + v.vcpus % hypervisor::limits::MAX_VCPUS as u8,
        counter_hz: v.counter_hz.max(1),
        guest_counter: v.guest_counter,
        ram_base: u64::from(v.ram_base) * PAGE as u64,
        ram_pages: 1 + u64::from(v.ram_pages % 150),
    };
    let sections: Vec<Vec<u8>> = v
        .sections
        .iter()
        .map(|s| s[..s.len().min(64)].to_vec())
        .collect();
    let mut data = 0;
    let pages: Vec<OwnedPage> = (0..header.ram_pages as usize)
        .map(|i| {
            let byte = v.kinds.get(i / 4 % v.kinds.len().max(1)).copied();
            match byte.map_or(0, |b| (b >> (2 * (i % 4))) & 3) {
                0 => OwnedPage::NotBacked,
                2 if data < 4 => {
                    data += 1;
                    let mut page = Box::new([v.fill; PAGE]);
                    page[..8].copy_from_slice(&(i as u64).to_le_bytes());
                    OwnedPage::Data(page)
                }
                _ => OwnedPage::Zero,
            }
        })
        .collect();
    let mut w = SnapshotWriter::new(Vec::new(), &header).expect("a header in range");
    for (kind, bytes) in KINDS.iter().zip(&sections) {
        w.section(*kind, bytes).expect("a section");
    }
    for page in &pages {
        w.page(page.page()).expect("a page");
    }
    let (bytes, totals) = w.finish().expect("every page");
    // The parts: header, sections, chunks, end marker.
    let mut parts = vec![(0, HEADER_LEN)];
    let mut at = HEADER_LEN;
    for s in &sections {
        parts.push((at, at + 12 + s.len()));
        at += 12 + s.len();
    }
    for chunk in pages.chunks(CHUNK_PAGES) {
        let data = chunk
            .iter()
            .filter(|p| matches!(p, OwnedPage::Data(_)))
            .count();
        let len = 14 + chunk.len().div_ceil(4) + data * PAGE + 4;
        parts.push((at, at + len));
        at += len;
    }
    parts.push((at, at + END_LEN));
    assert_eq!(
        at + END_LEN,
        bytes.len(),
        "the parts are not where they were thought"
    );
    let written = ReadAll {
        header: Some(header),
        sections,
        pages: (0..).zip(pages).collect(),
        result: Ok(totals),
    };
    (bytes, written, parts)
}

fn edit(bytes: &mut Vec<u8>, parts: &[(usize, usize)], e: &Edit) {
    let len = bytes.len();
    match e {
        Edit::Put {
            part,
            offset,
            bytes: put,
        } => {
            let (start, _) = parts[usize::from(*part) % parts.len()];
            let at = start + usize::from(*offset);
            for (i, b) in put.iter().take(8).enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        Edit::Flip { at, bit } => {
            if len > 0 {
                bytes[*at as usize % len] ^= 1 << (bit % 8);
            }
        }
        Edit::Truncate { len: to } => bytes.truncate(*to as usize % (len + 1)),
        Edit::Insert { at, bytes: more } => {
            let at = *at as usize % (len + 1);
            bytes.splice(at..at, more.iter().take(64).copied());
        }
        Edit::Remove { at, len: n } => {
            let at = *at as usize % (len + 1);
            let end = (at + usize::from(*n)).min(len);
            bytes.drain(at..end);
        }
    }
}

fn reseal(bytes: &mut [u8], parts: &[(usize, usize)]) {
    for &(start, end) in parts {
        if end <= bytes.len() {
            let mut crc = guest_bundle::Crc32::new();
            crc.update(&bytes[start..end - 4]);
            bytes[end - 4..end].copy_from_slice(&crc.finish().to_le_bytes());
        }
    }
}

fn check(bytes: &[u8]) -> ReadAll {
    let out = read(bytes);
    if out.result.is_ok() {
        let again = rewrite(&out);
        let back = read(&again);
        assert_eq!(back.header, out.header);
        assert_eq!(back.sections, out.sections);
        assert!(back.pages == out.pages, "a rewrite reads back other pages");
    }
    out
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw(bytes) => {
            check(&bytes);
        }
        Input::Edited {
            valid,
            edits,
            reseal: seal,
        } => {
            let (mut bytes, written, parts) = build(&valid);
            let back = read(&bytes);
            assert_eq!(
                back.result, written.result,
                "a snapshot written does not read"
            );
            assert_eq!(back.header, written.header);
            assert_eq!(back.sections, written.sections);
            assert!(back.pages == written.pages, "the pages read back differ");
            for e in edits.iter().take(8) {
                edit(&mut bytes, &parts, e);
            }
            if seal {
                reseal(&mut bytes, &parts);
            }
            let out = check(&bytes);
            if let ([Edit::Flip { .. }], false) = (&edits[..], seal) {
                assert!(out.result.is_err(), "a single bit flip was not noticed");
            }
        }
    }
});
