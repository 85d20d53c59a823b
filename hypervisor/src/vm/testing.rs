//! Test helpers (host tests and the fuzz targets, feature `testing`): a host
//! for [`GuestRam`](super::memory::GuestRam) over a real [`FrameTable`],
//! with page contents and stage-2 tables kept in vectors indexed by frame.

extern crate alloc;

use alloc::boxed::Box;
use alloc::vec;
use alloc::vec::Vec;

use platform::PhysRange;

use super::memory::HostMemory;
use crate::mm::frames::{FrameError, FrameTable, FrameUse, PAGE_SIZE};
use crate::mm::stage2::TableMemory;

/// Physical address of the fake RAM.
const RAM_BASE: u64 = 0x8000_0000;

/// A host with `pages` pages of fake RAM at 0x8000_0000 and a real frame
/// table. Frames given back to the pool are filled with 0xdd, so a VM that
/// could still reach one would read garbage a test notices.
pub struct FakeHost {
    pub frames: FrameTable<'static>,
    /// Per frame: its contents as a stage-2 table, or as a guest page.
    tables: Vec<Option<Box<[u64; 512]>>>,
    data: Vec<Option<Box<[u8; 4096]>>>,
    /// TLB invalidations asked for.
    pub flushes: u64,
    /// Whether guest page contents are kept (off for a large guest whose
    /// contents a test does not read: nothing is allocated per page).
    keep_data: bool,
}

impl FakeHost {
    pub fn new(pages: u64) -> Self {
        let ram = [PhysRange::from_base_size(RAM_BASE, pages * PAGE_SIZE)];
        // Leaked once per host: a test or a fuzz run makes few.
        let storage = vec![0u8; FrameTable::entries_needed(&ram)].leak();
        let frames = FrameTable::new(&ram, storage).expect("frame table over fake RAM");
        let frames_n = usize::try_from(pages).expect("fake RAM fits usize");
        Self {
            frames,
            tables: (0..frames_n).map(|_| None).collect(),
            data: (0..frames_n).map(|_| None).collect(),
            flushes: 0,
            keep_data: true,
        }
    }

    /// Like [`FakeHost::new`], but guest pages keep no contents (they read
    /// as zero): for tests of large guests that must not allocate per page.
    pub fn without_data(pages: u64) -> Self {
        Self {
            keep_data: false,
            ..Self::new(pages)
        }
    }

    /// The index of the frame holding `pa` (which must be fake RAM).
    fn frame(pa: u64) -> usize {
        usize::try_from((pa - RAM_BASE) / PAGE_SIZE).expect("frame index fits usize")
    }
}

impl TableMemory for FakeHost {
    fn alloc_table(&mut self) -> Option<u64> {
        let pa = self.frames.alloc(1, 1, FrameUse::PageTables)?;
        self.tables[Self::frame(pa)] = Some(Box::new([0; 512]));
        Some(pa)
    }
    fn free_table(&mut self, pa: u64) -> Result<(), FrameError> {
        self.frames.free(pa, 1, FrameUse::PageTables)?;
        self.tables[Self::frame(pa)].take().expect("table");
        Ok(())
    }
    fn table(&mut self, pa: u64) -> &mut [u64; 512] {
        self.tables[Self::frame(pa)].as_mut().expect("table")
    }
}

impl HostMemory for FakeHost {
    fn alloc_frame(&mut self, vm: usize) -> Option<u64> {
        let pa = self.frames.alloc_guest(vm)?;
        if self.keep_data {
            self.data[Self::frame(pa)] = Some(Box::new([0; 4096]));
        }
        Some(pa)
    }
    fn free_frame(&mut self, vm: usize, pa: u64) -> Result<(), FrameError> {
        self.frames.free_guest(vm, pa)?;
        if self.keep_data {
            // Poison what the pool gets back: a VM must never see it again.
            self.data[Self::frame(pa)] = Some(Box::new([0xdd; 4096]));
        }
        Ok(())
    }
    fn read(&mut self, pa: u64, buf: &mut [u8]) {
        if !self.keep_data {
            return buf.fill(0);
        }
        let page = self.data[Self::frame(pa)].as_ref().expect("guest page");
        let off = (pa & 0xfff) as usize;
        buf.copy_from_slice(&page[off..off + buf.len()]);
    }
    fn write(&mut self, pa: u64, data: &[u8]) {
        if !self.keep_data {
            return;
        }
        let page = self.data[Self::frame(pa)].as_mut().expect("guest page");
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
