//! Test helpers (host tests and the fuzz targets, feature `testing`): a host
//! for [`GuestRam`](super::memory::GuestRam) over a real [`FrameTable`],
//! with page contents and stage-2 tables kept in maps.

extern crate alloc;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::vec;

use platform::PhysRange;

use super::memory::HostMemory;
use crate::mm::frames::{FrameTable, FrameUse, PAGE_SIZE};
use crate::mm::stage2::TableMemory;

/// A host with `pages` pages of fake RAM at 0x8000_0000 and a real frame
/// table. Frames given back to the pool are filled with 0xdd, so a VM that
/// could still reach one would read garbage a test notices.
pub struct FakeHost {
    pub frames: FrameTable<'static>,
    tables: BTreeMap<u64, Box<[u64; 512]>>,
    data: BTreeMap<u64, Box<[u8; 4096]>>,
    /// TLB invalidations asked for.
    pub flushes: u64,
}

impl FakeHost {
    pub fn new(pages: u64) -> Self {
        let ram = [PhysRange::from_base_size(0x8000_0000, pages * PAGE_SIZE)];
        // Leaked once per host: a test or a fuzz run makes few.
        let storage = vec![0u8; FrameTable::entries_needed(&ram)].leak();
        let frames = FrameTable::new(&ram, storage).expect("frame table over fake RAM");
        Self {
            frames,
            tables: BTreeMap::new(),
            data: BTreeMap::new(),
            flushes: 0,
        }
    }
}

impl TableMemory for FakeHost {
    fn alloc_table(&mut self) -> Option<u64> {
        let pa = self.frames.alloc(1, 1, FrameUse::PageTables)?;
        self.tables.insert(pa, Box::new([0; 512]));
        Some(pa)
    }
    fn free_table(&mut self, pa: u64) {
        self.tables.remove(&pa).expect("table");
        self.frames.free(pa, 1, FrameUse::PageTables).unwrap();
    }
    fn table(&mut self, pa: u64) -> &mut [u64; 512] {
        self.tables.get_mut(&pa).expect("table")
    }
}

impl HostMemory for FakeHost {
    fn alloc_frame(&mut self, vm: usize) -> Option<u64> {
        let pa = self.frames.alloc_guest(vm)?;
        self.data.insert(pa, Box::new([0; 4096]));
        Some(pa)
    }
    fn free_frame(&mut self, vm: usize, pa: u64) {
        self.frames.free_guest(vm, pa).unwrap();
        // Poison what the pool gets back: a VM must never see it again.
        self.data.insert(pa, Box::new([0xdd; 4096]));
    }
    fn read(&mut self, pa: u64, buf: &mut [u8]) {
        let page = &self.data[&(pa & !0xfff)];
        let off = (pa & 0xfff) as usize;
        buf.copy_from_slice(&page[off..off + buf.len()]);
    }
    fn write(&mut self, pa: u64, data: &[u8]) {
        let page = self.data.get_mut(&(pa & !0xfff)).unwrap();
        let off = (pa & 0xfff) as usize;
        page[off..off + data.len()].copy_from_slice(data);
    }
    fn flush_tlb(&mut self, _vmid: u16) {
        self.flushes += 1;
    }
    fn frame_owner(&self, pa: u64) -> Option<usize> {
        self.frames.guest_owner(pa)
    }
    fn frames_owned(&self, vm: usize) -> u64 {
        self.frames.guest_pages(vm)
    }
}
