//! The hypervisor's own EL2 stage-1 identity map, built with the
//! `aarch64-paging` crate from a fixed pool of tables.
//!
//! A 4 KiB-granule map with a level-1 root (39-bit / 512 GiB address space,
//! TCR_EL2.T0SZ = 25). [`IdentityMap::map`] maps a range with the largest
//! blocks its alignment allows, and a later range that covers only part of
//! a block splits it (the crate does that), so a caller can lay down
//! "everything is device memory" and then overlay the RAM banks as normal
//! memory. What is ours: the table pool ([`TablePool`], as the crate's
//! `Translation`: tables come from a static array, not a heap, because the
//! map is built before the heap exists) and the two memory types. Table
//! addresses are computed from the pool's base physical address, so the same
//! code builds real tables on the target and checkable ones on the host.

use core::marker::PhantomData;
use core::ptr::NonNull;

use aarch64_paging::descriptor::{El23Attributes, PhysicalAddress};
use aarch64_paging::paging::{Constraints, El2, MemoryRegion, PageTable, Translation};
use aarch64_paging::Mapping;
use platform::PhysRange;

pub const ENTRIES: usize = 512;
/// The address space the map covers: 2^39 bytes (TCR_EL2.T0SZ = 25).
pub const VA_LIMIT: u64 = 1 << 39;
/// The root table's level: one level-1 table covers [`VA_LIMIT`].
const ROOT_LEVEL: usize = 1;
/// The most tables one [`IdentityMap::map`] call can add: a level-2 and a
/// level-3 table at each end of the range that is not block aligned.
const TABLES_PER_RANGE: usize = 4;

/// Memory types, as MAIR_EL2 attribute indexes (see `arch::aarch64::entry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemType {
    /// Normal write-back cacheable, inner shareable, executable.
    Normal,
    /// Device-nGnRE, never executable.
    Device,
}

impl MemType {
    /// The descriptor attributes: accessed, AP[1] (RES1 at EL2), the MAIR
    /// index and shareability or execute-never.
    fn attributes(self) -> El23Attributes {
        let common = El23Attributes::VALID | El23Attributes::ACCESSED | El23Attributes::USER_RES1;
        match self {
            MemType::Normal => {
                common | El23Attributes::ATTRIBUTE_INDEX_0 | El23Attributes::INNER_SHAREABLE
            }
            MemType::Device => common | El23Attributes::ATTRIBUTE_INDEX_1 | El23Attributes::XN,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapError {
    /// The range is not 4 KiB aligned or lies outside the 512 GiB map.
    BadRange(PhysRange),
    /// The table pool could not hold the tables one more range may need.
    OutOfTables,
    /// `aarch64-paging` refused the mapping.
    Paging,
}

/// A 4 KiB translation table, as `aarch64-paging` lays it out.
pub type Table = PageTable<El23Attributes>;

/// Tables for the map from a fixed array, identity-mapped (a table's
/// address is its physical address). Tables are never given back: the map
/// is built once.
pub struct TablePool<'a> {
    base: NonNull<Table>,
    len: usize,
    base_phys: u64,
    used: usize,
    _pool: PhantomData<&'a mut [Table]>,
}

impl<'a> TablePool<'a> {
    /// `base_phys` is the physical address of `pool[0]`.
    pub fn new(pool: &'a mut [Table], base_phys: u64) -> Self {
        Self {
            len: pool.len(),
            // A pointer, not the slice: the crate keeps pointers to tables
            // already handed out while later ones are taken.
            base: NonNull::from(pool).cast(),
            base_phys,
            used: 0,
            _pool: PhantomData,
        }
    }

    fn left(&self) -> usize {
        self.len - self.used
    }
}

impl Translation<El23Attributes> for TablePool<'_> {
    fn allocate_table(&mut self) -> (NonNull<Table>, PhysicalAddress) {
        // The crate's allocation cannot fail: IdentityMap::map checks that
        // enough tables are left before every range it maps.
        assert!(self.used < self.len, "EL2 table pool used up");
        // SAFETY: `used < len`, so the table is inside the pool this value
        // borrows mutably, and no table past `used` was handed out before.
        let table = unsafe { self.base.add(self.used) };
        // SAFETY: as above; the table is exclusively ours until returned.
        unsafe { table.write(Table::EMPTY) };
        let phys = self.base_phys + self.used as u64 * 4096;
        self.used += 1;
        (table, PhysicalAddress(phys as usize))
    }

    unsafe fn deallocate_table(&mut self, _table: NonNull<Table>) {
        // Kept: a table replaced by a block while the map is built stays
        // used (never happens for the device-then-RAM order boot uses).
    }

    fn physical_to_virtual(&self, pa: PhysicalAddress) -> NonNull<Table> {
        let index = (pa.0 as u64).wrapping_sub(self.base_phys) / 4096;
        assert!(
            index < self.used as u64,
            "not a table of this pool: {:#x}",
            pa.0
        );
        // SAFETY: `index < used <= len`: a table of the pool.
        unsafe { self.base.add(index as usize) }
    }
}

/// The identity map under construction, in a [`TablePool`].
pub struct IdentityMap<'a> {
    mapping: Mapping<TablePool<'a>, El2>,
}

impl<'a> IdentityMap<'a> {
    /// A map with an empty root table, the first of `pool`; `pool_phys` is
    /// the physical (= virtual) address of `pool[0]`.
    pub fn new(pool: &'a mut [Table], pool_phys: u64) -> Self {
        assert!(
            !pool.is_empty(),
            "identity map needs at least its root table"
        );
        Self {
            mapping: Mapping::new(TablePool::new(pool, pool_phys), ROOT_LEVEL, El2),
        }
    }

    /// Physical address of the root table, for TTBR0_EL2.
    pub fn root(&self) -> u64 {
        self.mapping.root_address().0 as u64
    }

    pub fn tables_used(&self) -> usize {
        self.mapping.translation().used
    }

    /// Map `range` to itself as `ty`, replacing whatever mapped it before.
    pub fn map(&mut self, range: PhysRange, ty: MemType) -> Result<(), MapError> {
        if !range.start.is_multiple_of(4096)
            || !range.end.is_multiple_of(4096)
            || range.end > VA_LIMIT
            || range.start >= range.end
        {
            return Err(MapError::BadRange(range));
        }
        if self.mapping.translation().left() < TABLES_PER_RANGE {
            return Err(MapError::OutOfTables);
        }
        let region = MemoryRegion::new(range.start as usize, range.end as usize);
        // No contiguous hint: the map is plain blocks and pages.
        self.mapping
            .map_range(
                &region,
                PhysicalAddress(range.start as usize),
                ty.attributes(),
                Constraints::NO_CONTIGUOUS_HINT,
            )
            .map_err(|_| MapError::Paging)
    }

    /// Walk the map: the memory type `addr` is mapped with, if any.
    pub fn lookup(&self, addr: u64) -> Option<MemType> {
        if addr >= VA_LIMIT {
            return None;
        }
        let page = addr & !4095;
        let mut found = None;
        let region = MemoryRegion::new(page as usize, page as usize + 4096);
        let _ = self.mapping.walk_range(&region, &mut |mr, desc, level| {
            let leaf = level == 3 || !desc.is_table_or_page();
            if desc.is_valid() && leaf {
                let span = 1u64 << (12 + 9 * (3 - level));
                debug_assert_eq!(
                    desc.output_address().0 as u64,
                    (mr.start().0 as u64) & !(span - 1),
                    "identity map"
                );
                found = Some(if desc.flags().contains(El23Attributes::XN) {
                    MemType::Device
                } else {
                    MemType::Normal
                });
            }
            Ok(())
        });
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn pool(n: usize) -> Vec<Table> {
        (0..n).map(|_| Table::EMPTY).collect()
    }

    #[test]
    fn device_everywhere_then_ram_overlay() {
        let mut p = pool(16);
        let mut map = IdentityMap::new(&mut p, 0x4000_0000);
        map.map(PhysRange::new(0, VA_LIMIT), MemType::Device)
            .unwrap();
        assert_eq!(
            map.tables_used(),
            1,
            "512 GiB of 1 GiB blocks needs only the root"
        );
        // A Pi-like bank that is not 1 GiB aligned at its end.
        map.map(PhysRange::new(0, 0x3b40_0000), MemType::Normal)
            .unwrap();
        map.map(PhysRange::new(0x4000_0000, 0x8000_0000), MemType::Normal)
            .unwrap();
        assert_eq!(map.lookup(0), Some(MemType::Normal));
        assert_eq!(map.lookup(0x3b3f_f000), Some(MemType::Normal));
        assert_eq!(map.lookup(0x3b40_0000), Some(MemType::Device));
        assert_eq!(map.lookup(0x3fff_f000), Some(MemType::Device));
        assert_eq!(map.lookup(0x4000_0000), Some(MemType::Normal));
        assert_eq!(map.lookup(0xfe20_1000), Some(MemType::Device));
        assert_eq!(map.lookup(VA_LIMIT), None);
        // 0x3b40_0000 is 2 MiB aligned: one level-2 table is enough.
        assert_eq!(map.tables_used(), 2);
    }

    #[test]
    fn page_granular_edges_split_down_to_level_3() {
        let mut p = pool(16);
        let mut map = IdentityMap::new(&mut p, 0);
        map.map(PhysRange::new(0, 4 * GIB), MemType::Device)
            .unwrap();
        map.map(
            PhysRange::new(GIB + 4096, GIB + 3 * MIB + 8192),
            MemType::Normal,
        )
        .unwrap();
        assert_eq!(map.lookup(GIB), Some(MemType::Device));
        assert_eq!(map.lookup(GIB + 4096), Some(MemType::Normal));
        assert_eq!(map.lookup(GIB + 2 * MIB), Some(MemType::Normal));
        assert_eq!(map.lookup(GIB + 3 * MIB + 4096), Some(MemType::Normal));
        assert_eq!(map.lookup(GIB + 3 * MIB + 8192), Some(MemType::Device));
        assert_eq!(map.lookup(GIB + 4 * MIB), Some(MemType::Device));
        // root, one level 2, two level 3 (the two unaligned 2 MiB blocks).
        assert_eq!(map.tables_used(), 4);
    }

    #[test]
    fn errors() {
        let mut p = pool(1);
        let mut map = IdentityMap::new(&mut p, 0);
        assert!(matches!(
            map.map(PhysRange::new(1, 4096), MemType::Normal),
            Err(MapError::BadRange(_))
        ));
        assert!(matches!(
            map.map(PhysRange::new(0, VA_LIMIT + 4096), MemType::Normal),
            Err(MapError::BadRange(_))
        ));
        assert_eq!(
            map.map(PhysRange::new(0, 4096), MemType::Normal),
            Err(MapError::OutOfTables)
        );
    }

    /// The raw descriptors, as the MMU reads them.
    fn raw(table: &Table) -> [u64; ENTRIES] {
        // SAFETY: a table is 512 64-bit descriptors (repr(C), 4 KiB), and
        // no map that could change it is alive in the callers.
        unsafe { core::ptr::read(table as *const Table as *const [u64; ENTRIES]) }
    }

    /// The descriptor bits the MMU sees: the values of the hand-written
    /// map this replaced (AF, AP[1], MAIR index, shareability, XN).
    #[test]
    fn descriptors_have_the_attributes_the_mair_and_tcr_expect() {
        let mut p = pool(8);
        let base = p.as_ptr() as u64;
        let mut map = IdentityMap::new(&mut p, base);
        map.map(PhysRange::new(0, 4 * GIB), MemType::Device)
            .unwrap();
        map.map(PhysRange::new(GIB, GIB + 2 * MIB + 4096), MemType::Normal)
            .unwrap();
        drop(map);
        let root = raw(&p[0]);
        let (af, ap1, inner, xn, page) = (1 << 10, 1 << 6, 3 << 8, 1 << 54, 0b11);
        assert_eq!(root[0], af | ap1 | (1 << 2) | xn | 1, "1 GiB device block");
        assert_eq!(root[1] & 0b11, 0b11, "a table for the split GiB");
        let level2 = raw(&p[1]);
        assert_eq!(level2[0], GIB | af | ap1 | inner | 1, "2 MiB normal block");
        let level3 = raw(&p[2]);
        assert_eq!(level3[0], (GIB + 2 * MIB) | af | ap1 | inner | page);
        assert_eq!(
            level3[1],
            (GIB + 2 * MIB + 4096) | af | ap1 | (1 << 2) | xn | page,
            "the split block's rest keeps its device attributes"
        );
    }

    proptest::proptest! {
        /// Any sequence of overlays: every address has the type of the last
        /// range that covered it, checked at every range edge and around it.
        #[test]
        fn lookup_matches_the_last_overlay(
            ranges in proptest::collection::vec(
                (0u64..4096, 1u64..2048, proptest::bool::ANY),
                1..8,
            ),
        ) {
            // Pages of 2 MiB granules and 4 KiB offsets in the first 8 GiB.
            let to_addr = |n: u64| (n * 512 + (n % 7) * 3) * 4096 % (8 * GIB);
            let mut p = pool(64);
            let mut map = IdentityMap::new(&mut p, 0x8000_0000);
            let mut applied = Vec::new();
            for (start, len, normal) in ranges {
                let start = to_addr(start);
                let end = (start + len * 4096 * 37).min(8 * GIB);
                let ty = if normal { MemType::Normal } else { MemType::Device };
                if map.map(PhysRange::new(start, end), ty).is_ok() {
                    applied.push((start, end, ty));
                }
            }
            let model = |a: u64| applied.iter().rev().find(|r| r.0 <= a && a < r.1).map(|r| r.2);
            for &(start, end, _) in &applied {
                for a in [start, end - 4096, end, start.saturating_sub(4096), start + 4096] {
                    proptest::prop_assert_eq!(map.lookup(a), model(a), "at {:#x}", a);
                }
            }
        }
    }
}
