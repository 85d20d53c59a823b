//! Stage-2 translation tables of one VM, as plain data: guest-physical
//! pages ([`GuestAddr`]) to host frames ([`PhysAddr`]), 4 KiB pages only (so any single page can be
//! ballooned away), 34-bit (16 GiB) IPA space starting at level 2 with 16
//! concatenated root tables (VTCR_EL2.T0SZ = 30, SL0 = 0): a walk reads two
//! descriptors, not three. Under QEMU's TCG every guest TLB refill walks
//! stage 2 again, and the refills of a fork-and-exec workload are where
//! most of the host time beyond QEMU's own goes (docs/PERFORMANCE.md).
//! Table memory comes from a [`TableMemory`], which on the target is the
//! frame table plus the identity map and in tests is a plain vector, so the
//! walker runs on the host unchanged.
//!
//! This module changes descriptors only; the caller invalidates the TLB for
//! the VM's VMID once per batch of unmaps (`vm::memory::GuestRam::release`).

use tock_registers::fields::FieldValue;
use tock_registers::{register_bitfields, LocalRegisterCopy};

use crate::addr::{GuestAddr, PhysAddr};
use crate::mm::frames::FrameError;

/// IPA bits covered (T0SZ = 64 - 34): 16 GiB, the 1 GiB of devices below
/// guest RAM included.
pub const IPA_BITS: u32 = 34;
/// The root: one level-2 table per GiB of IPA space, contiguous and
/// aligned to their total size (concatenated, as the architecture requires
/// of a stage-2 walk that starts at level 2 with more than 30 bits).
pub const ROOT_TABLES: u64 = 1 << (IPA_BITS - 30);
// `Stage2::used_gib` has a bit per root table.
const _: () = assert!(ROOT_TABLES <= 16);
/// The first IPA past the space (where [`Stage2::unmap_some`] ends).
pub const IPA_LIMIT: GuestAddr = GuestAddr::new(1 << IPA_BITS);
const PAGE: u64 = 4096;

register_bitfields! [u64,
    /// A stage-2 descriptor: a table descriptor at level 2, a page
    /// descriptor at level 3 (no blocks are used).
    pub S2_DESC [
        VALID OFFSET(0) NUMBITS(1) [],
        /// 1: a table (level 2) or a page (level 3).
        TYPE OFFSET(1) NUMBITS(1) [
            TableOrPage = 1
        ],
        /// Memory type (with FWB clear).
        MEMATTR OFFSET(2) NUMBITS(4) [
            DeviceNGnRE = 0b0001,
            NormalWriteBack = 0b1111
        ],
        /// Stage-2 access permissions.
        S2AP OFFSET(6) NUMBITS(2) [
            ReadOnly = 0b01,
            ReadWrite = 0b11
        ],
        SH OFFSET(8) NUMBITS(2) [
            Inner = 0b11
        ],
        /// Access flag (set: no access-flag fault).
        AF OFFSET(10) NUMBITS(1) [],
        /// Output address bits 47:12 (a frame or the next table).
        OUTPUT_ADDR OFFSET(12) NUMBITS(36) [],
        /// Execute-never (XN[1]).
        XN OFFSET(54) NUMBITS(1) []
    ]
];

type Descriptor = LocalRegisterCopy<u64, S2_DESC::Register>;

fn is_valid(entry: u64) -> bool {
    Descriptor::new(entry).is_set(S2_DESC::VALID)
}

/// The frame or table a descriptor points to.
fn output_address(entry: u64) -> PhysAddr {
    PhysAddr::new(Descriptor::new(entry).read(S2_DESC::OUTPUT_ADDR) << 12)
}

fn address(pa: PhysAddr) -> FieldValue<u64, S2_DESC::Register> {
    S2_DESC::OUTPUT_ADDR.val(pa.raw() >> 12)
}

/// A table descriptor pointing to the table at `pa`.
fn table_descriptor(pa: PhysAddr) -> u64 {
    (address(pa) + S2_DESC::TYPE::TableOrPage + S2_DESC::VALID::SET).value
}

/// A leaf descriptor passing a device page at `pa` through (the GICV page).
pub fn device_page(pa: PhysAddr) -> u64 {
    (address(pa)
        + S2_DESC::AF::SET
        + S2_DESC::S2AP::ReadWrite
        + S2_DESC::MEMATTR::DeviceNGnRE
        + S2_DESC::XN::SET
        + S2_DESC::TYPE::TableOrPage
        + S2_DESC::VALID::SET)
        .value
}

/// A leaf descriptor showing the page at `pa` read-only, as device
/// memory: a store to it is a permission fault, taken to EL2 with its
/// syndrome like a store to an unmapped page (the PL011's mirror page).
pub fn read_only_device_page(pa: PhysAddr) -> u64 {
    (address(pa)
        + S2_DESC::AF::SET
        + S2_DESC::S2AP::ReadOnly
        + S2_DESC::MEMATTR::DeviceNGnRE
        + S2_DESC::XN::SET
        + S2_DESC::TYPE::TableOrPage
        + S2_DESC::VALID::SET)
        .value
}

fn is_ram(entry: u64) -> bool {
    Descriptor::new(entry).matches_all(S2_DESC::MEMATTR::NormalWriteBack)
}

/// A leaf descriptor mapping guest RAM at `pa`.
pub fn ram_page(pa: PhysAddr) -> u64 {
    (address(pa)
        + S2_DESC::AF::SET
        + S2_DESC::SH::Inner
        + S2_DESC::S2AP::ReadWrite
        + S2_DESC::MEMATTR::NormalWriteBack
        + S2_DESC::TYPE::TableOrPage
        + S2_DESC::VALID::SET)
        .value
}

/// Where translation tables live.
pub trait TableMemory {
    /// A zeroed 4 KiB table; its physical address.
    fn alloc_table(&mut self) -> Option<PhysAddr>;
    /// [`ROOT_TABLES`] zeroed tables, contiguous and aligned to their
    /// total size; the first one's address. Each is given back with
    /// [`TableMemory::free_table`].
    fn alloc_root(&mut self) -> Option<PhysAddr>;
    /// Give a table back; an error (a hypervisor bug: the frame table does
    /// not know it as a table) leaves the frame where it was.
    fn free_table(&mut self, pa: PhysAddr) -> Result<(), FrameError>;
    /// The table at `pa` (returned by `alloc_table`).
    fn table(&mut self, pa: PhysAddr) -> &mut [u64; 512];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage2Error {
    /// The IPA is not page aligned or beyond the IPA space.
    BadIpa(GuestAddr),
    /// No memory for a translation table.
    OutOfTables,
    /// The IPA is already mapped (to the frame given).
    AlreadyMapped { ipa: GuestAddr, pa: PhysAddr },
}

impl core::fmt::Display for Stage2Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Stage2Error::BadIpa(ipa) => {
                write!(f, "IPA {ipa:#x} is unaligned or beyond {IPA_BITS} bits")
            }
            Stage2Error::OutOfTables => write!(f, "no free frame for a stage-2 table"),
            Stage2Error::AlreadyMapped { ipa, pa } => {
                write!(f, "IPA {ipa:#x} is already mapped to {pa:#x}")
            }
        }
    }
}

/// One VM's stage-2 tables.
pub struct Stage2 {
    root: PhysAddr,
    mapped: u64,
    tables: u64,
    /// Bit `g`: the root's level-2 table for GiB `g` of IPA space holds a
    /// level-3 table. Walks over every mapping (`check`, teardown) skip the
    /// others: a VM's RAM and devices span 2 of the 16 GiB.
    used_gib: u16,
    /// The level-3 table [`Self::lookup`] last walked to: device reads of
    /// the same rings (a virtqueue's indexes, a notify after a notify) skip
    /// the walk. Never stale: tables are freed only by [`Self::destroy`].
    lookup_walk: WalkCache,
}

/// The level-3 table a batch of stage-2 operations last walked to, and its
/// 2 MiB region (IPA >> 21): ascending pages of one request share it, so
/// one walk serves up to 512 of them. Fresh (empty) for each batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct WalkCache {
    last: Option<(u64, PhysAddr)>,
}

fn index(ipa: GuestAddr, level: u32) -> usize {
    ((ipa.raw() >> (12 + 9 * (3 - level))) & 511) as usize
}

/// The root's level-2 table for the GiB `gib` of IPA space (below
/// [`ROOT_TABLES`]).
fn root_table(root: PhysAddr, gib: u64) -> PhysAddr {
    root + gib * PAGE
}

/// The host address of `ipa` per its level-3 table `table`, if that maps
/// it as RAM.
#[inline]
fn ram_at(mem: &mut impl TableMemory, table: PhysAddr, ipa: GuestAddr) -> Option<PhysAddr> {
    let entry = mem.table(table)[index(ipa, 3)];
    (is_valid(entry) && is_ram(entry)).then_some(PhysAddr::new(
        output_address(entry).raw() | ipa.page_offset(),
    ))
}

impl Stage2 {
    pub fn new(mem: &mut impl TableMemory) -> Result<Self, Stage2Error> {
        let root = mem.alloc_root().ok_or(Stage2Error::OutOfTables)?;
        Ok(Self {
            root,
            mapped: 0,
            tables: ROOT_TABLES,
            used_gib: 0,
            lookup_walk: WalkCache::default(),
        })
    }

    /// Physical address of the root table, for VTTBR_EL2.
    pub fn root(&self) -> PhysAddr {
        self.root
    }

    /// Pages mapped now.
    pub fn mapped_pages(&self) -> u64 {
        self.mapped
    }

    /// Tables in use, the root included.
    pub fn tables(&self) -> u64 {
        self.tables
    }

    /// Whether GiB `gib` of IPA space has a level-3 table.
    fn uses_gib(&self, gib: u64) -> bool {
        gib < 16 && self.used_gib & (1 << gib) != 0
    }

    fn check(ipa: GuestAddr) -> Result<(), Stage2Error> {
        if !ipa.is_page_aligned() || ipa >= IPA_LIMIT {
            return Err(Stage2Error::BadIpa(ipa));
        }
        Ok(())
    }

    /// The level-3 table covering `ipa` (below [`IPA_LIMIT`]), creating it
    /// if `create`.
    fn leaf_table(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        create: bool,
    ) -> Result<Option<PhysAddr>, Stage2Error> {
        if ipa >= IPA_LIMIT {
            return Err(Stage2Error::BadIpa(ipa));
        }
        let level2 = root_table(self.root, ipa.raw() >> 30);
        let i = index(ipa, 2);
        let entry = mem.table(level2)[i];
        if is_valid(entry) {
            return Ok(Some(output_address(entry)));
        }
        if !create {
            return Ok(None);
        }
        let new = mem.alloc_table().ok_or(Stage2Error::OutOfTables)?;
        self.tables += 1;
        self.used_gib |= 1 << (ipa.raw() >> 30);
        mem.table(level2)[i] = table_descriptor(new);
        Ok(Some(new))
    }

    /// [`Self::leaf_table`] without creating, through `cache`: the walk is
    /// skipped while `ipa` stays in the 2 MiB region the cache last walked
    /// to. Only tables found are cached (tables are freed only by
    /// [`Self::destroy`], which takes the whole `Stage2`), so a cached table
    /// is never stale.
    fn leaf_table_cached(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        create: bool,
        cache: &mut WalkCache,
    ) -> Result<Option<PhysAddr>, Stage2Error> {
        let region = ipa.raw() >> 21;
        if let Some((r, table)) = cache.last {
            if r == region {
                return Ok(Some(table));
            }
        }
        let table = self.leaf_table(mem, ipa, create)?;
        if let Some(t) = table {
            cache.last = Some((region, t));
        }
        Ok(table)
    }

    /// Pass the device page at `pa` through at `ipa`. Device pages are not
    /// guest RAM: they are not counted, reported or freed as frames.
    pub fn map_device(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
    ) -> Result<(), Stage2Error> {
        self.set_leaf(mem, ipa, device_page(pa))
    }

    /// Show the page at `pa` read-only at `ipa`, as device memory (not
    /// RAM: not counted, reported or freed as a frame).
    pub fn map_read_only_device(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
    ) -> Result<(), Stage2Error> {
        self.set_leaf(mem, ipa, read_only_device_page(pa))
    }

    /// Remove the device page at `ipa` (RAM is left alone); the page it
    /// showed, if any. The caller invalidates the TLB.
    pub fn unmap_device(&mut self, mem: &mut impl TableMemory, ipa: GuestAddr) -> Option<PhysAddr> {
        Self::check(ipa).ok()?;
        let table = self.leaf_table(mem, ipa, false).ok()??;
        let slot = &mut mem.table(table)[index(ipa, 3)];
        if !is_valid(*slot) || is_ram(*slot) {
            return None;
        }
        let pa = output_address(*slot);
        *slot = 0;
        Some(pa)
    }

    /// Map the page at `ipa` to the frame at `pa` as guest RAM.
    pub fn map(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
    ) -> Result<(), Stage2Error> {
        self.set_leaf(mem, ipa, ram_page(pa))?;
        self.mapped += 1;
        Ok(())
    }

    /// [`Self::map`] for the pages of a batch, walking only when `ipa`
    /// leaves the 2 MiB region `cache` holds.
    pub fn map_cached(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
        cache: &mut WalkCache,
    ) -> Result<(), Stage2Error> {
        self.set_leaf_cached(mem, ipa, ram_page(pa), cache)?;
        self.mapped += 1;
        Ok(())
    }

    /// Install a leaf descriptor where nothing is mapped yet.
    fn set_leaf(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        descriptor: u64,
    ) -> Result<(), Stage2Error> {
        self.set_leaf_cached(mem, ipa, descriptor, &mut WalkCache::default())
    }

    fn set_leaf_cached(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        descriptor: u64,
        cache: &mut WalkCache,
    ) -> Result<(), Stage2Error> {
        Self::check(ipa)?;
        let table = self
            .leaf_table_cached(mem, ipa, true, cache)?
            .ok_or(Stage2Error::OutOfTables)?;
        let slot = &mut mem.table(table)[index(ipa, 3)];
        if is_valid(*slot) {
            return Err(Stage2Error::AlreadyMapped {
                ipa,
                pa: output_address(*slot),
            });
        }
        *slot = descriptor;
        Ok(())
    }

    /// Unmap the page at `ipa`; the frame it mapped, if any. The caller
    /// invalidates the TLB before the frame is reused.
    pub fn unmap(&mut self, mem: &mut impl TableMemory, ipa: GuestAddr) -> Option<PhysAddr> {
        self.unmap_cached(mem, ipa, &mut WalkCache::default())
    }

    /// [`Self::unmap`] for the pages of a batch, walking only when `ipa`
    /// leaves the 2 MiB region `cache` holds.
    pub fn unmap_cached(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        cache: &mut WalkCache,
    ) -> Option<PhysAddr> {
        Self::check(ipa).ok()?;
        let table = self.leaf_table_cached(mem, ipa, false, cache).ok()??;
        let slot = &mut mem.table(table)[index(ipa, 3)];
        if !is_valid(*slot) || !is_ram(*slot) {
            return None;
        }
        let pa = output_address(*slot);
        *slot = 0;
        self.mapped -= 1;
        Some(pa)
    }

    /// Unmap the `pages` pages from `ipa` (page-aligned, all in one 2 MiB
    /// region), pushing the frames of those mapped as RAM to `out` (which
    /// must have room for `pages`): one walk for the run. The caller
    /// invalidates the TLB before the frames are reused.
    pub fn unmap_run<const N: usize>(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        pages: usize,
        out: &mut heapless::Vec<PhysAddr, N>,
    ) {
        let first = index(ipa, 3);
        if Self::check(ipa).is_err() || first + pages > 512 || pages > out.capacity() - out.len() {
            return;
        }
        let Ok(Some(table)) = self.leaf_table(mem, ipa, false) else {
            return;
        };
        let mut unmapped = 0;
        for slot in &mut mem.table(table)[first..first + pages] {
            if is_valid(*slot) && is_ram(*slot) {
                // Cannot fail: room for `pages` was checked above.
                let _ = out.push(output_address(*slot));
                *slot = 0;
                unmapped += 1;
            }
        }
        self.mapped -= unmapped;
    }

    /// The frame `ipa` maps to, if any.
    #[inline]
    pub fn lookup(&mut self, mem: &mut impl TableMemory, ipa: GuestAddr) -> Option<PhysAddr> {
        // The common case, the level-3 table of the last lookup, in line:
        // one table read (the notify fast path looks at one ring index).
        if let Some((region, table)) = self.lookup_walk.last {
            if ipa < IPA_LIMIT && ipa.raw() >> 21 == region {
                return ram_at(mem, table, ipa);
            }
        }
        let mut walk = self.lookup_walk;
        let pa = self.lookup_cached(mem, ipa, &mut walk);
        self.lookup_walk = walk;
        pa
    }

    /// [`Self::lookup`] for the pages of a batch, walking only when `ipa`
    /// leaves the 2 MiB region `cache` holds.
    pub fn lookup_cached(
        &mut self,
        mem: &mut impl TableMemory,
        ipa: GuestAddr,
        cache: &mut WalkCache,
    ) -> Option<PhysAddr> {
        if ipa >= IPA_LIMIT {
            return None;
        }
        let table = self
            .leaf_table_cached(mem, ipa.page_base(), false, cache)
            .ok()??;
        ram_at(mem, table, ipa)
    }

    /// Call `f(mem, ipa, pa)` for every mapped page, in IPA order (`mem`
    /// is lent to `f` between table reads, e.g. to ask who owns `pa`).
    pub fn for_each_mapped<M: TableMemory>(
        &self,
        mem: &mut M,
        mut f: impl FnMut(&mut M, GuestAddr, PhysAddr),
    ) {
        for i1 in (0..ROOT_TABLES).filter(|&g| self.uses_gib(g)) {
            let level2 = root_table(self.root, i1);
            for i2 in 0..512u64 {
                let e2 = mem.table(level2)[i2 as usize];
                if !is_valid(e2) {
                    continue;
                }
                for i3 in 0..512u64 {
                    let e3 = mem.table(output_address(e2))[i3 as usize];
                    if is_valid(e3) && is_ram(e3) {
                        f(
                            mem,
                            GuestAddr::new((i1 << 30) | (i2 << 21) | (i3 << 12)),
                            output_address(e3),
                        );
                    }
                }
            }
        }
    }

    /// Unmap RAM pages at or above `*cursor`, in IPA order, pushing their
    /// frames to `out` until it is full; `*cursor` moves past the last page
    /// looked at ([`IPA_LIMIT`] when the walk is done, at once when no RAM
    /// page is left mapped). Lets a caller free a
    /// whole VM in fixed-size batches: no memory in proportion to its size.
    /// The caller invalidates the TLB before the frames are reused.
    pub fn unmap_some<const N: usize>(
        &mut self,
        mem: &mut impl TableMemory,
        cursor: &mut GuestAddr,
        out: &mut heapless::Vec<PhysAddr, N>,
    ) {
        const L2_SPAN: u64 = 1 << 21;
        let next = |ipa: GuestAddr, span: u64| GuestAddr::new((ipa.raw() & !(span - 1)) + span);
        while *cursor < IPA_LIMIT && !out.is_full() {
            if self.mapped == 0 {
                // No RAM page left: the rest of the 16 GiB walk finds none.
                *cursor = IPA_LIMIT;
                break;
            }
            let ipa = cursor.page_base();
            let e2 = mem.table(root_table(self.root, ipa.raw() >> 30))[index(ipa, 2)];
            if !is_valid(e2) {
                *cursor = next(ipa, L2_SPAN);
                continue;
            }
            let slot = &mut mem.table(output_address(e2))[index(ipa, 3)];
            if is_valid(*slot) && is_ram(*slot) {
                let pa = output_address(*slot);
                *slot = 0;
                self.mapped -= 1;
                // Cannot fail: the loop runs only while `out` has room.
                let _ = out.push(pa);
            }
            *cursor = ipa + PAGE;
        }
    }

    /// Give every table back (call [`Self::unmap_some`] until the walk is
    /// done first: RAM pages still mapped are counted, not freed). Returns
    /// the RAM pages that were still mapped, or the first table the frame
    /// table refused (the walk goes on: a refused table stays accounted).
    pub fn destroy<M: TableMemory>(self, mem: &mut M) -> Result<u64, FrameError> {
        let mut first_error = None;
        let mut still_mapped = 0;
        let mut free = |mem: &mut M, pa| {
            if let Err(e) = TableMemory::free_table(mem, pa) {
                first_error.get_or_insert(e);
            }
        };
        for i1 in 0..ROOT_TABLES {
            let level2 = root_table(self.root, i1);
            for i2 in (0..512).filter(|_| self.uses_gib(i1)) {
                let e2 = mem.table(level2)[i2];
                if !is_valid(e2) {
                    continue;
                }
                let leaf = mem.table(output_address(e2));
                still_mapped += leaf
                    .iter()
                    .filter(|&&e3| is_valid(e3) && is_ram(e3))
                    .count() as u64;
                free(mem, output_address(e2));
            }
            free(mem, level2);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(still_mapped),
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn g(ipa: u64) -> GuestAddr {
        GuestAddr::new(ipa)
    }

    fn p(pa: u64) -> PhysAddr {
        PhysAddr::new(pa)
    }

    /// Tables in a map keyed by fake physical addresses.
    #[derive(Default)]
    pub struct FakeTables {
        pub tables: BTreeMap<PhysAddr, Box<[u64; 512]>>,
        pub next: u64,
        pub limit: Option<usize>,
    }

    impl TableMemory for FakeTables {
        fn alloc_table(&mut self) -> Option<PhysAddr> {
            if self.limit.is_some_and(|l| self.tables.len() >= l) {
                return None;
            }
            self.next += 4096;
            let pa = p(0x1_0000_0000 + self.next);
            self.tables.insert(pa, Box::new([0; 512]));
            Some(pa)
        }
        fn alloc_root(&mut self) -> Option<PhysAddr> {
            if self
                .limit
                .is_some_and(|l| self.tables.len() + ROOT_TABLES as usize > l)
            {
                return None;
            }
            let span = ROOT_TABLES * 4096;
            self.next = (self.next + 4096).next_multiple_of(span);
            let root = p(0x1_0000_0000 + self.next);
            for t in 0..ROOT_TABLES {
                self.tables.insert(root + t * 4096, Box::new([0; 512]));
            }
            self.next += span - 4096;
            Some(root)
        }
        fn free_table(&mut self, pa: PhysAddr) -> Result<(), FrameError> {
            assert!(
                self.tables.remove(&pa).is_some(),
                "double free of table {pa:#x}"
            );
            Ok(())
        }
        fn table(&mut self, pa: PhysAddr) -> &mut [u64; 512] {
            self.tables.get_mut(&pa).expect("not a table")
        }
    }

    /// One cache carried across a batch that crosses 2 MiB regions, leaves
    /// holes, steps back and hits a region with no table yet: the same
    /// answers as the uncached walk, and tables made on the way are found.
    #[test]
    fn cached_walks_match_the_full_walk() {
        let mut mem = FakeTables::default();
        let mut s2 = Stage2::new(&mut mem).unwrap();
        let ipas: Vec<GuestAddr> = [0x4000_0000u64, 0x401f_f000, 0x4020_0000, 0x4000_1000]
            .into_iter()
            .chain((0..600).map(|i| 0x8000_0000 + i * 3 * PAGE))
            .chain([0x3_c000_0000, 0x3_ffff_f000, 0x4000_2000])
            .map(g)
            .collect();
        let mut cache = WalkCache::default();
        assert_eq!(s2.lookup_cached(&mut mem, ipas[0], &mut cache), None);
        for (i, &ipa) in ipas.iter().enumerate() {
            let pa = p(0x9000_0000 + i as u64 * PAGE);
            s2.map_cached(&mut mem, ipa, pa, &mut cache).unwrap();
            assert!(s2.map_cached(&mut mem, ipa, pa, &mut cache).is_err());
        }
        assert_eq!(s2.mapped_pages(), ipas.len() as u64);
        let mut cache = WalkCache::default();
        for (i, &ipa) in ipas.iter().enumerate() {
            let pa = p(0x9000_0000 + i as u64 * PAGE);
            assert_eq!(
                s2.lookup_cached(&mut mem, ipa + 8, &mut cache),
                Some(pa + 8)
            );
            assert_eq!(s2.lookup(&mut mem, ipa), Some(pa));
            assert_eq!(
                s2.lookup_cached(&mut mem, ipa + PAGE * 2, &mut cache),
                s2.lookup(&mut mem, ipa + PAGE * 2)
            );
        }
        let mut cache = WalkCache::default();
        for (i, &ipa) in ipas.iter().enumerate().rev() {
            let pa = p(0x9000_0000 + i as u64 * PAGE);
            assert_eq!(s2.unmap_cached(&mut mem, ipa, &mut cache), Some(pa));
            assert_eq!(s2.unmap_cached(&mut mem, ipa, &mut cache), None);
        }
        assert_eq!(s2.mapped_pages(), 0);
        assert_eq!(
            s2.unmap_cached(&mut mem, g(0x1_0000_0000), &mut cache),
            None
        );
    }

    #[test]
    fn map_lookup_unmap_destroy() {
        let mut mem = FakeTables::default();
        let mut s2 = Stage2::new(&mut mem).unwrap();
        let ram = g(0x4000_0000);
        for i in 0..1024 {
            s2.map(&mut mem, ram + i * PAGE, p(0x8000_0000 + i * PAGE))
                .unwrap();
        }
        assert_eq!(s2.mapped_pages(), 1024);
        assert_eq!(
            s2.tables(),
            ROOT_TABLES + 2,
            "the root's 16 level-2 tables, two level-3"
        );
        assert_eq!(s2.root().raw() % (ROOT_TABLES * PAGE), 0, "aligned root");
        assert_eq!(
            s2.lookup(&mut mem, ram + 5 * PAGE + 12),
            Some(p(0x8000_5000 + 12))
        );
        assert_eq!(
            s2.map(&mut mem, ram, p(0x9000_0000)),
            Err(Stage2Error::AlreadyMapped {
                ipa: ram,
                pa: p(0x8000_0000)
            })
        );
        assert_eq!(s2.unmap(&mut mem, ram + 5 * PAGE), Some(p(0x8000_5000)));
        assert_eq!(s2.unmap(&mut mem, ram + 5 * PAGE), None);
        assert_eq!(s2.lookup(&mut mem, ram + 5 * PAGE), None);
        assert_eq!(s2.lookup(&mut mem, g(0x0900_0000)), None);
        let mut seen = Vec::new();
        s2.for_each_mapped(&mut mem, |_, ipa, pa| seen.push((ipa, pa)));
        assert_eq!(seen.len(), 1023);
        assert!(seen
            .iter()
            .all(|&(ipa, pa)| pa.raw() - 0x8000_0000 == ipa.raw() - ram.raw()));
        // Unmapped in batches of 100, in IPA order, the same frames.
        let (mut cursor, mut batches) = (g(0), Vec::new());
        loop {
            let mut batch: heapless::Vec<PhysAddr, 100> = heapless::Vec::new();
            s2.unmap_some(&mut mem, &mut cursor, &mut batch);
            if batch.is_empty() {
                break;
            }
            batches.push(batch.len());
            for pa in batch {
                let (ipa, want) = seen.remove(0);
                assert_eq!(pa, want, "IPA {ipa:#x}");
            }
        }
        assert_eq!(cursor, IPA_LIMIT);
        assert_eq!(batches.len(), 11);
        assert!(seen.is_empty());
        assert_eq!(s2.mapped_pages(), 0);
        assert_eq!(s2.destroy(&mut mem), Ok(0));
        assert!(mem.tables.is_empty(), "every table returned");
    }

    #[test]
    fn walks_find_pages_in_every_gib_used_and_destroy_frees_every_table() {
        let mut mem = FakeTables::default();
        let mut s2 = Stage2::new(&mut mem).unwrap();
        let ipas = [
            g(0x0900_0000),
            g(0x4000_0000),
            g(0xC000_0000),
            g(IPA_LIMIT.raw() - PAGE),
        ];
        for (i, &ipa) in ipas.iter().enumerate() {
            s2.map(&mut mem, ipa, p(0x8000_0000 + i as u64 * PAGE))
                .unwrap();
        }
        assert_eq!(s2.used_gib, 1 | 1 << 1 | 1 << 3 | 1 << 15);
        let mut seen = Vec::new();
        s2.for_each_mapped(&mut mem, |_, ipa, _| seen.push(ipa));
        assert_eq!(seen, ipas);
        let tables = s2.tables();
        assert_eq!(tables, ROOT_TABLES + 4);
        // Still mapped at the teardown: counted; every table freed.
        assert_eq!(s2.destroy(&mut mem), Ok(4));
        assert!(mem.tables.is_empty(), "{} tables left", mem.tables.len());
    }

    #[test]
    fn bad_input_and_exhaustion() {
        let mut mem = FakeTables {
            limit: Some(ROOT_TABLES as usize),
            ..Default::default()
        };
        let mut s2 = Stage2::new(&mut mem).unwrap();
        assert_eq!(
            s2.map(&mut mem, g(0x4000_0001), p(0)),
            Err(Stage2Error::BadIpa(g(0x4000_0001)))
        );
        assert_eq!(
            s2.map(&mut mem, IPA_LIMIT, p(0)),
            Err(Stage2Error::BadIpa(IPA_LIMIT))
        );
        assert_eq!(
            s2.map(&mut mem, g(0x4000_0000), p(0x1000)),
            Err(Stage2Error::OutOfTables)
        );
        assert_eq!(s2.unmap(&mut mem, g(!0xfff)), None);
        assert_eq!(s2.lookup(&mut mem, g(u64::MAX)), None);
    }

    #[test]
    fn device_pages_are_not_ram() {
        let mut mem = FakeTables::default();
        let mut s2 = Stage2::new(&mut mem).unwrap();
        s2.map_device(&mut mem, g(0x0801_0000), p(0x0804_0000))
            .unwrap();
        s2.map(&mut mem, g(0x4000_0000), p(0x9000_0000)).unwrap();
        assert_eq!(s2.mapped_pages(), 1);
        assert_eq!(s2.lookup(&mut mem, g(0x0801_0000)), None, "not RAM");
        assert_eq!(
            s2.unmap(&mut mem, g(0x0801_0000)),
            None,
            "the balloon cannot take it"
        );
        assert!(s2.map(&mut mem, g(0x0801_0000), p(0x1000)).is_err());
        let mut seen = Vec::new();
        s2.for_each_mapped(&mut mem, |_, ipa, _| seen.push(ipa));
        assert_eq!(seen, [g(0x4000_0000)]);
        let mut frames: heapless::Vec<PhysAddr, 4> = heapless::Vec::new();
        s2.unmap_some(&mut mem, &mut g(0), &mut frames);
        assert_eq!(frames, [p(0x9000_0000)], "the device page is not RAM");
        assert_eq!(s2.destroy(&mut mem), Ok(0));
        let d = device_page(p(0x0804_0000));
        assert_eq!(
            d,
            0x0040_0000_0804_0000 | 1 << 10 | 0b11 << 6 | 0b0001 << 2 | 0b11
        );
        assert!(!is_ram(d));
    }

    #[test]
    fn a_read_only_device_page_comes_and_goes_leaving_ram_alone() {
        let mut mem = FakeTables::default();
        let mut s2 = Stage2::new(&mut mem).unwrap();
        s2.map(&mut mem, g(0x0900_1000), p(0x9000_0000)).unwrap();
        s2.map_read_only_device(&mut mem, g(0x0900_0000), p(0x8800_0000))
            .unwrap();
        assert_eq!(s2.mapped_pages(), 1, "not counted as RAM");
        assert!(s2
            .map_read_only_device(&mut mem, g(0x0900_0000), p(0x8800_1000))
            .is_err());
        assert_eq!(s2.unmap(&mut mem, g(0x0900_0000)), None, "not RAM");
        assert_eq!(s2.unmap_device(&mut mem, g(0x0900_1000)), None, "RAM");
        assert_eq!(
            s2.unmap_device(&mut mem, g(0x0900_0000)),
            Some(p(0x8800_0000))
        );
        assert_eq!(s2.unmap_device(&mut mem, g(0x0900_0000)), None, "gone");
        assert_eq!(s2.unmap_device(&mut mem, g(0x7000_0000_0000)), None);
        s2.map_read_only_device(&mut mem, g(0x0900_0000), p(0x8800_0000))
            .unwrap();
        let d = read_only_device_page(p(0x8800_0000));
        assert_eq!(
            d,
            0x0040_0000_8800_0000 | 1 << 10 | 0b01 << 6 | 0b0001 << 2 | 0b11,
            "read-only (S2AP 01), device nGnRE, execute-never"
        );
        assert_eq!(s2.destroy(&mut mem), Ok(1), "the RAM page only");
    }

    #[test]
    fn descriptor_bits() {
        let d = ram_page(p(0x1234_5000));
        assert_eq!(output_address(d), p(0x1234_5000));
        assert_eq!(d & 0b11, 0b11, "valid page");
        assert_eq!((d >> 2) & 0xf, 0xf, "normal write-back");
        assert_eq!((d >> 6) & 0b11, 0b11, "read-write");
        assert_ne!(d & (1 << 10), 0, "access flag");
    }
}
