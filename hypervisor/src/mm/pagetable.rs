//! The hypervisor's own EL2 stage-1 identity map, as plain data.
//!
//! A 4 KiB-granule, 3-level table (level 1 root, 39-bit / 512 GiB address
//! space) built in a fixed pool of tables. [`IdentityMap::map`] maps a range
//! with the largest blocks its alignment allows and splits an existing block
//! into a next-level table when a later range covers only part of it, so a
//! caller can lay down "everything is device memory" and then overlay the RAM
//! banks as normal memory. Table addresses are computed from the pool's base
//! physical address, so the same code builds real tables on the target and
//! checkable ones on the host.

use platform::PhysRange;

pub const ENTRIES: usize = 512;
/// The address space the map covers: 2^39 bytes (TCR_EL2.T0SZ = 25).
pub const VA_LIMIT: u64 = 1 << 39;

const VALID: u64 = 1 << 0;
const TABLE_OR_PAGE: u64 = 1 << 1;
const AF: u64 = 1 << 10;
/// AP[1] is RES1 in the EL2 translation regime.
const AP1_RES1: u64 = 1 << 6;
const SH_INNER: u64 = 3 << 8;
const XN: u64 = 1 << 54;
const ADDR_MASK: u64 = 0x0000_ffff_ffff_f000;

/// Memory types, as MAIR_EL2 attribute indexes (see `arch::aarch64::entry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemType {
    /// Normal write-back cacheable, inner shareable, executable.
    Normal,
    /// Device-nGnRE, never executable.
    Device,
}

impl MemType {
    fn leaf_bits(self) -> u64 {
        match self {
            MemType::Normal => AF | AP1_RES1 | SH_INNER,
            MemType::Device => AF | AP1_RES1 | (1 << 2) | XN,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapError {
    /// The range is not 4 KiB aligned or lies outside the 512 GiB map.
    BadRange(PhysRange),
    /// The table pool is used up.
    OutOfTables,
}

/// A 4 KiB translation table.
#[repr(C, align(4096))]
#[derive(Clone)]
pub struct Table(pub [u64; ENTRIES]);

impl Table {
    pub const EMPTY: Table = Table([0; ENTRIES]);
}

/// An identity map under construction in `pool`, whose first table is the root.
pub struct IdentityMap<'a> {
    pool: &'a mut [Table],
    pool_phys: u64,
    used: usize,
}

/// Bytes covered by one entry at `level` (1, 2 or 3).
const fn entry_span(level: usize) -> u64 {
    1 << (12 + 9 * (3 - level))
}

impl<'a> IdentityMap<'a> {
    /// `pool_phys` is the physical (= virtual) address of `pool[0]`.
    pub fn new(pool: &'a mut [Table], pool_phys: u64) -> Self {
        assert!(
            !pool.is_empty(),
            "identity map needs at least its root table"
        );
        pool[0] = Table::EMPTY;
        Self {
            pool,
            pool_phys,
            used: 1,
        }
    }

    /// Physical address of the root table, for TTBR0_EL2.
    pub fn root(&self) -> u64 {
        self.pool_phys
    }

    pub fn tables_used(&self) -> usize {
        self.used
    }

    /// Map `range` to itself as `ty`, replacing whatever mapped it before.
    pub fn map(&mut self, range: PhysRange, ty: MemType) -> Result<(), MapError> {
        if !range.start.is_multiple_of(4096)
            || !range.end.is_multiple_of(4096)
            || range.end > VA_LIMIT
        {
            return Err(MapError::BadRange(range));
        }
        let mut addr = range.start;
        while addr < range.end {
            addr = self.map_one(addr, range.end, ty)?;
        }
        Ok(())
    }

    /// Map the largest block that starts at `addr` and fits before `end`;
    /// returns the address after it.
    fn map_one(&mut self, addr: u64, end: u64, ty: MemType) -> Result<u64, MapError> {
        let mut table = 0;
        for level in 1..=3 {
            let span = entry_span(level);
            let index = ((addr / span) % ENTRIES as u64) as usize;
            let fits = addr.is_multiple_of(span) && end - addr >= span;
            // Level 1 and 2 entries may be blocks; level 3 entries are pages.
            if fits {
                let kind = if level == 3 { TABLE_OR_PAGE } else { 0 };
                self.pool[table].0[index] = addr | ty.leaf_bits() | kind | VALID;
                return Ok(addr + span);
            }
            table = self.next_table(table, index, level)?;
        }
        unreachable!("a level-3 page always fits a 4 KiB-aligned range")
    }

    /// The table that entry `index` of `table` points to, creating it (and
    /// filling it with the equivalent smaller blocks if the entry was a block).
    fn next_table(&mut self, table: usize, index: usize, level: usize) -> Result<usize, MapError> {
        let entry = self.pool[table].0[index];
        if entry & VALID != 0 && entry & TABLE_OR_PAGE != 0 {
            let phys = entry & ADDR_MASK;
            return Ok(((phys - self.pool_phys) / 4096) as usize);
        }
        if self.used == self.pool.len() {
            return Err(MapError::OutOfTables);
        }
        let new = self.used;
        self.used += 1;
        let child_span = entry_span(level + 1);
        let child_kind = if level + 1 == 3 { TABLE_OR_PAGE } else { 0 };
        for (i, slot) in self.pool[new].0.iter_mut().enumerate() {
            *slot = if entry & VALID != 0 {
                // Split: same attributes, smaller blocks.
                let attrs = entry & !ADDR_MASK & !TABLE_OR_PAGE;
                ((entry & ADDR_MASK) + i as u64 * child_span) | attrs | child_kind
            } else {
                0
            };
        }
        self.pool[table].0[index] = (self.pool_phys + new as u64 * 4096) | TABLE_OR_PAGE | VALID;
        Ok(new)
    }

    /// Walk the map: the memory type `addr` is mapped with, if any.
    pub fn lookup(&self, addr: u64) -> Option<MemType> {
        if addr >= VA_LIMIT {
            return None;
        }
        let mut table = 0;
        for level in 1..=3 {
            let index = ((addr / entry_span(level)) % ENTRIES as u64) as usize;
            let entry = self.pool[table].0[index];
            if entry & VALID == 0 {
                return None;
            }
            let is_table = entry & TABLE_OR_PAGE != 0 && level < 3;
            if !is_table {
                let base = entry & ADDR_MASK;
                debug_assert_eq!(base, addr & !(entry_span(level) - 1), "identity map");
                return Some(if entry & XN != 0 {
                    MemType::Device
                } else {
                    MemType::Normal
                });
            }
            table = (((entry & ADDR_MASK) - self.pool_phys) / 4096) as usize;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn pool(n: usize) -> Vec<Table> {
        vec![Table::EMPTY; n]
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
}
