//! Test helpers (host tests and the fuzz targets, feature `testing`): a
//! recording [`BalloonBackend`](super::BalloonBackend) side that panics on
//! any call the device must never make. It takes the backend's typed
//! [`GuestPfn`]s and records them as plain numbers, so tests compare them
//! with literals.

extern crate alloc;

use alloc::collections::BTreeSet;
use alloc::vec::Vec;
use core::ops::Range;

use super::QUEUE_SIZE;
use crate::addr::GuestPfn;

fn raw(pfns: &[GuestPfn]) -> Vec<u64> {
    pfns.iter().map(|p| p.raw()).collect()
}

fn raw_blocks(blocks: &[Range<GuestPfn>]) -> Vec<Range<u64>> {
    blocks.iter().map(|b| b.start.raw()..b.end.raw()).collect()
}

/// Records backend calls and panics (fails the test, crashes the fuzz
/// target) on any call that breaks the contracts of
/// [`BalloonBackend`](super::BalloonBackend). An environment's backend
/// methods call [`inflate`](Self::inflate) etc. before acting.
#[derive(Default)]
pub struct FakeBackend {
    pub ram: Range<u64>,
    /// Ballooned pages.
    pub held: BTreeSet<u64>,
    /// Pages given back by a report or hint and not backed again since.
    pub discarded: BTreeSet<u64>,
    pub inflates: Vec<Vec<u64>>,
    pub deflates: Vec<Vec<u64>>,
    pub reports: Vec<Vec<Range<u64>>>,
    pub hints: Vec<Vec<Range<u64>>>,
    pub now: u64,
    /// Whether `now_us` answers (else the device uses the owner's times).
    pub clock: bool,
}

impl FakeBackend {
    /// A backend for RAM `ram` (PFNs) with a clock at 0.
    pub fn new(ram: Range<u64>) -> Self {
        FakeBackend {
            ram,
            clock: true,
            ..FakeBackend::default()
        }
    }

    /// The contract of `inflate` and `deflate`: non-empty, distinct,
    /// ascending PFNs in RAM.
    pub fn check_call(&self, pfns: &[u64]) {
        assert!(!pfns.is_empty(), "empty backend call");
        assert!(
            pfns.windows(2).all(|w| w[0] < w[1]),
            "PFNs not distinct and ascending: {pfns:?}"
        );
        for p in pfns {
            assert!(self.ram.contains(p), "PFN {p:#x} outside RAM");
        }
    }

    /// The contract of `report` and `hint`: non-empty blocks, ascending,
    /// disjoint, in RAM, no ballooned page.
    pub fn check_blocks(&self, blocks: &[Range<u64>]) {
        assert!(!blocks.is_empty(), "empty block list");
        assert!(blocks.len() <= usize::from(QUEUE_SIZE));
        for (i, b) in blocks.iter().enumerate() {
            assert!(b.start < b.end, "empty block {b:?}");
            assert!(
                self.ram.start <= b.start && b.end <= self.ram.end,
                "block {b:?} outside RAM {:?}",
                self.ram
            );
            if i > 0 {
                assert!(blocks[i - 1].end <= b.start, "blocks {blocks:?} overlap");
            }
            assert!(
                !b.clone().any(|p| self.held.contains(&p)),
                "block {b:?} holds a ballooned page"
            );
        }
    }

    fn discard(&mut self, blocks: &[Range<u64>]) {
        for b in blocks {
            self.discarded.extend(b.clone());
        }
    }

    /// RAM as [`BalloonBackend::ram_pfns`](super::BalloonBackend::ram_pfns)
    /// answers it.
    pub fn ram_pfns(&self) -> Range<GuestPfn> {
        GuestPfn::new(self.ram.start)..GuestPfn::new(self.ram.end)
    }

    /// Check and record an `inflate` call.
    pub fn inflate(&mut self, pfns: &[GuestPfn]) {
        let pfns = &raw(pfns)[..];
        self.check_call(pfns);
        for p in pfns {
            assert!(
                self.held.insert(*p),
                "inflate of already ballooned PFN {p:#x}"
            );
        }
        self.inflates.push(pfns.to_vec());
    }

    /// Check and record a `deflate` call.
    pub fn deflate(&mut self, pfns: &[GuestPfn]) {
        let pfns = &raw(pfns)[..];
        self.check_call(pfns);
        for p in pfns {
            assert!(
                self.held.remove(p),
                "deflate of PFN {p:#x} that is not ballooned"
            );
        }
        self.deflates.push(pfns.to_vec());
    }

    /// Check and record a `report` call.
    pub fn report(&mut self, blocks: &[Range<GuestPfn>]) {
        let blocks = &raw_blocks(blocks)[..];
        self.check_blocks(blocks);
        self.discard(blocks);
        self.reports.push(blocks.to_vec());
    }

    /// Check and record a `hint` call.
    pub fn hint(&mut self, blocks: &[Range<GuestPfn>]) {
        let blocks = &raw_blocks(blocks)[..];
        self.check_blocks(blocks);
        self.discard(blocks);
        self.hints.push(blocks.to_vec());
    }
}
