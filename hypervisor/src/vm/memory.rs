//! A VM's RAM: which guest pages ([`GuestAddr`], [`GuestPfn`]) are backed
//! by which host frames ([`PhysAddr`]), through its stage-2 tables. Frames come from and go back to the frame table (through
//! [`HostMemory`]); a guest page without a frame (ballooned, or never
//! touched) is backed again, zeroed, on its next access. Unmapping is
//! batched: one TLB invalidation per call, never per page. Instruction
//! caches are invalidated where frames change owner, not where they are
//! given back: once per allocation batch the frame table reports stale,
//! before any of its frames is mapped.
//!
//! Nothing here allocates on the heap in proportion to the guest's size:
//! requests and the final teardown work in fixed-size batches on the stack.
//! A frame the frame table refuses to take back is a hypervisor bug, not a
//! panic: it is counted as leaked, recorded in [`GuestRam::frame_error`],
//! and the VM's run loop ends the VM with a report.
//!
//! Plain data over the [`HostMemory`] trait, so the host tests run random
//! inflate / deflate / fault / stop sequences against a real `FrameTable`
//! and check that no frame is mapped into two VMs and that a VM maps only
//! frames it owns.

use crate::addr::{GuestAddr, GuestPfn, PhysAddr};
use crate::mm::frames::{FrameError, Shortfall, StaleIcache, PAGE_SIZE};
use crate::mm::stage2::{Stage2, Stage2Error, TableMemory, WalkCache};
use crate::trace::trace_event;

/// What a VM's memory needs from the host.
///
/// A frame handed to a guest comes with the frame table's instruction
/// cache report ([`StaleIcache`], see `mm::frames`): `Some` if frames freed
/// from a guest since the last invalidation may be among those handed out.
/// [`GuestRam`] then has [`Self::invalidate_icache`] done before it maps
/// any of them; giving frames back never invalidates.
pub trait HostMemory: TableMemory {
    /// A zeroed frame owned by VM `vm`, and the instruction cache report.
    fn alloc_frame(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)>;
    /// A frame owned by VM `vm` that the caller writes whole before it maps
    /// it, so its old contents never reach the guest: the target skips the
    /// zeroing ([`Self::alloc_frame`] by default).
    fn alloc_frame_to_overwrite(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        self.alloc_frame(vm)
    }
    /// Zeroed frames owned by VM `vm` into `out`, as many as the pool gives
    /// (one lock of the frame table on the target): how many, and one
    /// instruction cache report for them all.
    fn alloc_frames(&mut self, vm: usize, out: &mut [PhysAddr]) -> (usize, Option<StaleIcache>) {
        let mut stale = None;
        for (n, slot) in out.iter_mut().enumerate() {
            match self.alloc_frame(vm) {
                Some((pa, s)) => {
                    *slot = pa;
                    stale = stale.max(s);
                }
                None => return (n, stale),
            }
        }
        (out.len(), stale)
    }
    /// A zeroed frame for the hypervisor's own use (frame table use
    /// `Allocated`), kept for good: a VM's PL011 mirror page.
    fn alloc_hypervisor_page(&mut self) -> Option<PhysAddr>;
    /// Give VM `vm`'s frame back to the pool (after the TLB flush); an
    /// error if the frame table does not record it as VM `vm`'s.
    fn free_frame(&mut self, vm: usize, pa: PhysAddr) -> Result<(), FrameError>;
    /// [`Self::free_frame`] for a batch (one lock of the frame table on
    /// the target): `on_error` gets each refusal.
    fn free_frames(
        &mut self,
        vm: usize,
        pas: &[PhysAddr],
        on_error: &mut dyn FnMut(FrameError),
    ) -> u64 {
        let mut freed = 0;
        for &pa in pas {
            match self.free_frame(vm, pa) {
                Ok(()) => freed += 1,
                Err(e) => on_error(e),
            }
        }
        freed
    }
    fn read(&mut self, pa: PhysAddr, buf: &mut [u8]);
    /// The little-endian `u16` at the even address `pa`, in one load.
    fn read_u16(&mut self, pa: PhysAddr) -> u16 {
        let mut b = [0u8; 2];
        self.read(pa, &mut b);
        u16::from_le_bytes(b)
    }
    fn write(&mut self, pa: PhysAddr, data: &[u8]);
    /// The little-endian `u32` at the 4-aligned address `pa`, in one
    /// store (a CPU reading it meanwhile sees the old or the new value).
    fn write_u32(&mut self, pa: PhysAddr, value: u32) {
        self.write(pa, &value.to_le_bytes());
    }
    /// Invalidate the TLBs of VMID `vmid` on every CPU.
    fn flush_tlb(&mut self, vmid: u16);
    /// Invalidate every CPU's instruction cache to the point of
    /// unification (`IC IALLUIS` on the target; a broadcast, so its
    /// callers count it in [`RamStats::icache_invalidations`]), then tell
    /// the frame table (`FrameTable::icache_invalidated`): the frames
    /// `stale` came with may be mapped now.
    fn invalidate_icache(&mut self, stale: StaleIcache);
    /// The VM owning the frame at `pa`, per the frame table.
    fn frame_owner(&self, pa: PhysAddr) -> Option<usize>;
    /// Frames VM `vm` owns, per the frame table.
    fn frames_owned(&self, vm: usize) -> u64;
    /// Free frames the pool can give (not held for a VM's guarantee).
    fn pool_free(&self) -> u64;
    /// Whether the pool is below its low watermark (the memory manager is
    /// reclaiming): a fault then backs only its own page.
    fn pool_low(&self) -> bool;
    /// Guarantee VM `vm` `pages` frames (0: none); refused, naming the
    /// shortfall, if the pool cannot hold them for it.
    fn guarantee(&mut self, vm: usize, pages: u64) -> Result<(), Shortfall>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RamError {
    /// No free frame left to back a guest page.
    OutOfMemory {
        ipa: GuestAddr,
    },
    Stage2(Stage2Error),
    /// The IPA is not this VM's RAM.
    NotRam {
        ipa: GuestAddr,
    },
    /// The page at `ipa` has no frame now (a read that may not back it).
    NotMapped {
        ipa: GuestAddr,
    },
}

impl core::fmt::Display for RamError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RamError::OutOfMemory { ipa } => write!(f, "no free frame to back guest page {ipa:#x}"),
            RamError::Stage2(e) => write!(f, "stage 2: {e}"),
            RamError::NotRam { ipa } => write!(f, "IPA {ipa:#x} is not guest RAM"),
            RamError::NotMapped { ipa } => write!(f, "guest page {ipa:#x} has no frame"),
        }
    }
}

/// Counters shown by `vms` and `info`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RamStats {
    /// Pages backed on a stage-2 fault (first touch, or after the pool
    /// took the page back by reporting or hinting), with their neighbours
    /// backed by the same fault ([`GuestRam::back_around`]).
    pub faults_backed: u64,
    /// Pages unmapped and returned to the pool.
    pub pages_released: u64,
    /// TLB invalidations (one per batch).
    pub tlb_flushes: u64,
    /// Invalidations of every CPU's instruction cache done before frames
    /// given to this VM were mapped, because they might still hold another
    /// guest's instruction lines (at most one per allocation batch; giving
    /// frames back does none).
    pub icache_invalidations: u64,
    /// Frames unmapped that the frame table refused to take back: they
    /// stay recorded as this VM's (a hypervisor bug; `check` shows them).
    pub frames_leaked: u64,
}

/// Frames and tables handed back per batch when a VM's RAM is freed: one
/// TLB invalidation per batch, 2 KiB of stack, whatever the guest's size.
pub const FREE_BATCH: usize = 256;

/// What freeing a VM's RAM ([`GuestRam::destroy`]) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Teardown {
    /// Guest frames returned to the pool.
    pub freed: u64,
    /// Guest frames and tables the frame table refused (stay accounted).
    pub leaked: u64,
    /// The first refusal, if any.
    pub error: Option<FrameError>,
}

pub struct GuestRam {
    pub vm: usize,
    pub vmid: u16,
    /// IPA of the first byte of RAM, and its size; both page multiples.
    pub base: GuestAddr,
    pub size: u64,
    stage2: Stage2,
    pub stats: RamStats,
    /// What a page backed again on a fault is filled with (32-bit, little
    /// endian, repeated): 0, or the balloon's poison_val.
    page_fill: u32,
    /// The first time the frame table refused a frame of this VM back: a
    /// broken invariant, so the VM must be ended (its run loop checks).
    pub frame_error: Option<FrameError>,
}

impl GuestRam {
    pub fn new(
        mem: &mut impl HostMemory,
        vm: usize,
        vmid: u16,
        base: GuestAddr,
        size: u64,
    ) -> Result<Self, RamError> {
        let stage2 = Stage2::new(mem).map_err(RamError::Stage2)?;
        Ok(Self {
            vm,
            vmid,
            base,
            size,
            stage2,
            stats: RamStats::default(),
            page_fill: 0,
            frame_error: None,
        })
    }

    pub fn stage2_root(&self) -> PhysAddr {
        self.stage2.root()
    }

    pub fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    pub fn mapped_pages(&self) -> u64 {
        self.stage2.mapped_pages()
    }

    pub fn table_pages(&self) -> u64 {
        self.stage2.tables()
    }

    pub fn contains(&self, ipa: GuestAddr) -> bool {
        ipa.offset_from(self.base)
            .is_some_and(|off| off < self.size)
    }

    /// Guest page frame numbers of RAM: `[base / 4 KiB, end / 4 KiB)`.
    pub fn pfns(&self) -> core::ops::Range<GuestPfn> {
        self.base.pfn()..(self.base + self.size).pfn()
    }

    /// Pass a device page through at `ipa` (not RAM: never a frame of ours).
    pub fn map_device(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
    ) -> Result<(), RamError> {
        self.stage2
            .map_device(mem, ipa, pa)
            .map_err(RamError::Stage2)
    }

    /// Show the page at `pa` read-only at `ipa`, as device memory (its
    /// stores trap). Mapping where nothing was needs no TLB maintenance.
    /// Its one caller is the PL011's mirror (`vm::uart_mirror`): a store
    /// that found a read-only page is placed in that page, HPFAR_EL2 being
    /// UNKNOWN for it. A second read-only page needs FAR translated.
    pub fn map_read_only_device(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        pa: PhysAddr,
    ) -> Result<(), RamError> {
        self.stage2
            .map_read_only_device(mem, ipa, pa)
            .map_err(RamError::Stage2)
    }

    /// Remove the device page at `ipa` and invalidate the VM's TLBs on
    /// every CPU: once this returns, no vCPU reads the page any more (its
    /// next access traps). Whether a page was there.
    pub fn unmap_device(&mut self, mem: &mut impl HostMemory, ipa: GuestAddr) -> bool {
        let removed = self.stage2.unmap_device(mem, ipa).is_some();
        if removed {
            mem.flush_tlb(self.vmid);
        }
        removed
    }

    /// Back every page of RAM (at VM start).
    pub fn populate(&mut self, mem: &mut impl HostMemory) -> Result<(), RamError> {
        for page in 0..self.pages() {
            let ipa = self.base + page * PAGE_SIZE;
            if self.stage2.lookup(mem, ipa).is_none() {
                self.map_new(mem, ipa)?;
            }
        }
        Ok(())
    }

    fn map_new(&mut self, mem: &mut impl HostMemory, ipa: GuestAddr) -> Result<PhysAddr, RamError> {
        let (pa, stale) = mem
            .alloc_frame(self.vm)
            .ok_or(RamError::OutOfMemory { ipa })?;
        self.invalidate_icache(mem, stale);
        if let Err(e) = self.stage2.map(mem, ipa, pa) {
            self.free_frame(mem, pa);
            return Err(RamError::Stage2(e));
        }
        Ok(pa)
    }

    /// The frame behind `ipa` (page offset kept), backing the page with a
    /// zeroed frame first if it has none: what a guest access does.
    pub fn translate_or_back(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
    ) -> Result<PhysAddr, RamError> {
        if !self.contains(ipa) {
            return Err(RamError::NotRam { ipa });
        }
        if let Some(pa) = self.stage2.lookup(mem, ipa) {
            return Ok(pa);
        }
        let pa = self.map_filled(mem, ipa.page_base())?;
        self.stats.faults_backed += 1;
        Ok(PhysAddr::new(pa.raw() | ipa.page_offset()))
    }

    /// Back the pages of these PFNs that are in RAM without a frame, as
    /// their first access would, `most` of them at most (the VM's `max`):
    /// the neighbours of a page a fault backs (fault-around). Frames come
    /// from the pool in batches. Stops when the pool gives no more; returns
    /// how many pages were backed (counted with the faults' pages).
    pub fn back_around(&mut self, mem: &mut impl HostMemory, pfns: &[GuestPfn], most: u64) -> u64 {
        const BATCH: usize = 64;
        let mut backed = 0;
        let mut walk = WalkCache::default();
        for chunk in pfns.chunks(BATCH) {
            let mut ipas: heapless::Vec<GuestAddr, BATCH> = heapless::Vec::new();
            for &pfn in chunk {
                let Some(ipa) = pfn.addr().filter(|&a| self.contains(a)) else {
                    continue;
                };
                if backed + ipas.len() as u64 >= most {
                    break;
                }
                if self.stage2.lookup_cached(mem, ipa, &mut walk).is_none() {
                    // Cannot overflow: at most BATCH per chunk.
                    let _ = ipas.push(ipa);
                }
            }
            let mut frames = [PhysAddr::new(0); BATCH];
            let (n, stale) = mem.alloc_frames(self.vm, &mut frames[..ipas.len()]);
            self.invalidate_icache(mem, stale);
            let mut unused: heapless::Vec<PhysAddr, BATCH> = heapless::Vec::new();
            for (&ipa, &pa) in ipas.iter().zip(&frames[..n]) {
                if self.stage2.map_cached(mem, ipa, pa, &mut walk).is_err() {
                    let _ = unused.push(pa);
                    continue;
                }
                self.fill(mem, pa);
                backed += 1;
            }
            if !unused.is_empty() {
                // Never mapped (a table could not be made): no TLB entry
                // can reach them.
                let (leaked, error) = (&mut self.stats.frames_leaked, &mut self.frame_error);
                mem.free_frames(self.vm, &unused, &mut |e| {
                    *leaked += 1;
                    error.get_or_insert(e);
                });
            }
            if n < ipas.len() {
                break;
            }
        }
        self.stats.faults_backed += backed;
        backed
    }

    /// Fill a fresh frame with the page fill (frames come zeroed).
    fn fill(&self, mem: &mut impl HostMemory, pa: PhysAddr) {
        if self.page_fill != 0 {
            let chunk: [u8; 256] = core::array::from_fn(|i| self.page_fill.to_le_bytes()[i % 4]);
            for off in (0..PAGE_SIZE).step_by(chunk.len()) {
                mem.write(pa + off, &chunk);
            }
        }
    }

    /// A fresh frame mapped at `ipa` (page-aligned), filled with the page
    /// fill: frames come zeroed, a poisoning guest expects its poison.
    fn map_filled(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
    ) -> Result<PhysAddr, RamError> {
        let pa = self.map_new(mem, ipa)?;
        self.fill(mem, pa);
        Ok(pa)
    }

    /// Unmap the pages of these guest PFNs (those in RAM and backed), flush
    /// the TLB once, and give their frames back. Returns how many were freed.
    pub fn release(&mut self, mem: &mut impl HostMemory, pfns: &[GuestPfn]) -> u64 {
        let mut frames: heapless::Vec<PhysAddr, 256> = heapless::Vec::new();
        let mut released = 0;
        for chunk in pfns.chunks(256) {
            // Runs of consecutive PFNs in one 2 MiB region: one stage-2
            // walk each (a request's PFNs are mostly such runs).
            let mut rest = chunk;
            while let Some((&first, _)) = rest.split_first() {
                let region_left = 512 - (first.raw() & 511) as usize;
                let run = 1 + rest
                    .windows(2)
                    .take(region_left - 1)
                    .take_while(|w| w[0].raw().checked_add(1) == Some(w[1].raw()))
                    .count();
                let (run_pfns, next) = rest.split_at(run);
                rest = next;
                // A PFN whose address does not fit 64 bits is not RAM (a
                // wrapped product could alias a real page). RAM is one
                // range: a run whose ends are in it is in it.
                let last = run_pfns[run - 1];
                match (first.addr(), last.addr()) {
                    (Some(a), Some(b)) if self.contains(a) && self.contains(b) => {
                        // Room: at most 256 per chunk, and `frames` is
                        // emptied after each chunk.
                        self.stage2.unmap_run(mem, a, run, &mut frames);
                        continue;
                    }
                    _ => {}
                }
                for &pfn in run_pfns {
                    let Some(ipa) = pfn.addr().filter(|&a| self.contains(a)) else {
                        continue;
                    };
                    if let Some(pa) = self.stage2.unmap(mem, ipa) {
                        let _ = frames.push(pa);
                    }
                }
            }
            if frames.is_empty() {
                continue;
            }
            // The frames must not be reused before no CPU can reach them.
            // Their instruction lines, if any, stay: the frame table
            // remembers, and whoever gets them next invalidates once.
            mem.flush_tlb(self.vmid);
            self.stats.tlb_flushes += 1;
            self.trace_flush(frames.len());
            let (leaked, error) = (&mut self.stats.frames_leaked, &mut self.frame_error);
            released += mem.free_frames(self.vm, &frames, &mut |e| {
                *leaked += 1;
                error.get_or_insert(e);
            });
            frames.clear();
        }
        self.stats.pages_released += released;
        released
    }

    /// The `tlb flush` trace event: `pages` unmapped, the whole VMID
    /// invalidated.
    fn trace_flush(&self, pages: usize) {
        trace_event!(
            "tlb flush vm{=usize} vmid={=u16} whole VMID, {=usize} pages unmapped",
            self.vm,
            self.vmid,
            pages
        );
    }

    /// Before frames just allocated are mapped: invalidate every CPU's
    /// instruction cache if the allocation reported that some frame may
    /// hold another guest's instruction lines; counted.
    fn invalidate_icache(&mut self, mem: &mut impl HostMemory, stale: Option<StaleIcache>) {
        if let Some(stale) = stale {
            mem.invalidate_icache(stale);
            self.stats.icache_invalidations += 1;
        }
    }

    /// Give one unmapped frame back; false (and the frame counted as
    /// leaked, the error kept) if the frame table refuses it.
    fn free_frame(&mut self, mem: &mut impl HostMemory, pa: PhysAddr) -> bool {
        match mem.free_frame(self.vm, pa) {
            Ok(()) => true,
            Err(e) => {
                self.stats.frames_leaked += 1;
                self.frame_error.get_or_insert(e);
                false
            }
        }
    }

    /// [`Self::release`] for every page of these PFN ranges.
    pub fn release_blocks(
        &mut self,
        mem: &mut impl HostMemory,
        blocks: &[core::ops::Range<GuestPfn>],
    ) -> u64 {
        let mut pfns: heapless::Vec<GuestPfn, 256> = heapless::Vec::new();
        let mut released = 0;
        for pfn in blocks.iter().flat_map(|b| GuestPfn::iter(b.clone())) {
            if pfns.push(pfn).is_err() {
                released += self.release(mem, &pfns);
                pfns.clear();
                let _ = pfns.push(pfn);
            }
        }
        released + self.release(mem, &pfns)
    }

    /// Fill pages backed again on a fault with `value` (see `page_fill`).
    pub fn set_page_fill(&mut self, value: u32) {
        self.page_fill = value;
    }

    /// Copy guest memory at `ipa` into `buf` (backing pages as needed).
    pub fn read(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        buf: &mut [u8],
    ) -> Result<(), RamError> {
        self.for_each_page(mem, ipa, buf.len(), |mem, pa, span| {
            mem.read(pa, &mut buf[span])
        })
    }

    /// Copy guest memory at `ipa` into `buf` if every page of it is mapped
    /// now: never backs a page (an unmapped one is
    /// [`RamError::NotMapped`]). For the notify fast path's look at a ring.
    pub fn read_mapped(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        buf: &mut [u8],
    ) -> Result<(), RamError> {
        self.check_span(ipa, buf.len())?;
        let mut done = 0;
        while done < buf.len() {
            let at = ipa + done as u64;
            let n = (PAGE_SIZE - at.page_offset()).min((buf.len() - done) as u64) as usize;
            let pa = self
                .stage2
                .lookup(mem, at)
                .ok_or(RamError::NotMapped { ipa: at })?;
            mem.read(pa, &mut buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// [`Self::read_mapped`] of a little-endian `u16`: one aligned load
    /// (a ring index, which the driver may be writing), no copy loop.
    #[inline]
    pub fn read_u16_mapped(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
    ) -> Result<u16, RamError> {
        if !ipa.raw().is_multiple_of(2) {
            // Unaligned (a ring the transport accepted is not): may cross
            // a page, so the general path.
            let mut b = [0u8; 2];
            self.read_mapped(mem, ipa, &mut b)?;
            return Ok(u16::from_le_bytes(b));
        }
        self.check_span(ipa, 2)?;
        let pa = self
            .stage2
            .lookup(mem, ipa)
            .ok_or(RamError::NotMapped { ipa })?;
        Ok(mem.read_u16(pa))
    }

    /// Copy `data` into guest memory at `ipa` (backing pages as needed).
    /// A whole page not backed yet (the kernel and initrd a VM starts with)
    /// gets a frame that is written first and mapped after, without the
    /// zeroing a first touch needs: the copy overwrites all of it, and no
    /// vCPU can see the frame before it holds the data.
    pub fn write(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        data: &[u8],
    ) -> Result<(), RamError> {
        self.check_span(ipa, data.len())?;
        let mut done = 0;
        while done < data.len() {
            let at = ipa + done as u64;
            let n = page_piece(at, data.len() - done);
            let piece = &data[done..done + n];
            if n as u64 == PAGE_SIZE && self.stage2.lookup(mem, at).is_none() {
                self.map_written(mem, at, piece)?;
            } else {
                let pa = self.translate_or_back(mem, at)?;
                mem.write(pa, piece);
            }
            done += n;
        }
        Ok(())
    }

    /// Back the unbacked page at `ipa` (page-aligned) with a frame holding
    /// `page` (a whole page), written before it is mapped.
    fn map_written(
        &mut self,
        mem: &mut impl HostMemory,
        ipa: GuestAddr,
        page: &[u8],
    ) -> Result<(), RamError> {
        let (pa, stale) = mem
            .alloc_frame_to_overwrite(self.vm)
            .ok_or(RamError::OutOfMemory { ipa })?;
        mem.write(pa, page);
        // After the write is cleaned (`HostMemory::write`), before the map.
        self.invalidate_icache(mem, stale);
        if let Err(e) = self.stage2.map(mem, ipa, pa) {
            self.free_frame(mem, pa);
            return Err(RamError::Stage2(e));
        }
        self.stats.faults_backed += 1;
        Ok(())
    }

    /// Split `[ipa, ipa + len)` at page boundaries and call `f` with each
    /// piece's host address and its byte range within the whole.
    fn for_each_page<M: HostMemory>(
        &mut self,
        mem: &mut M,
        ipa: GuestAddr,
        len: usize,
        mut f: impl FnMut(&mut M, PhysAddr, core::ops::Range<usize>),
    ) -> Result<(), RamError> {
        self.check_span(ipa, len)?;
        let mut done = 0;
        while done < len {
            let at = ipa + done as u64;
            let n = page_piece(at, len - done);
            let pa = self.translate_or_back(mem, at)?;
            f(mem, pa, done..done + n);
            done += n;
        }
        Ok(())
    }

    fn check_span(&self, ipa: GuestAddr, len: usize) -> Result<(), RamError> {
        let end = ipa
            .checked_add(len as u64)
            .ok_or(RamError::NotRam { ipa })?;
        let last = GuestAddr::new(end.raw().wrapping_sub(1));
        if len > 0 && (!self.contains(ipa) || !self.contains(last)) {
            return Err(RamError::NotRam { ipa });
        }
        Ok(())
    }

    /// Every (IPA, frame) mapped, in IPA order, for invariant checks.
    pub fn for_each_mapped(
        &self,
        mem: &mut impl HostMemory,
        mut f: impl FnMut(GuestAddr, PhysAddr),
    ) {
        self.stage2.for_each_mapped(mem, |_, ipa, pa| f(ipa, pa));
    }

    /// Check this VM's side of the ownership invariant: every mapped frame
    /// is owned by this VM (so no frame is mapped into two VMs), and the VM
    /// owns exactly the frames it maps. Walks the tables in place: no
    /// memory in proportion to the guest's size.
    pub fn check(&self, mem: &mut impl HostMemory) -> Result<(), OwnershipError> {
        let mut mapped = 0u64;
        let mut foreign = None;
        self.stage2.for_each_mapped(mem, |mem, ipa, pa| {
            mapped += 1;
            let owner = mem.frame_owner(pa);
            if owner != Some(self.vm) && foreign.is_none() {
                foreign = Some(OwnershipError::Foreign {
                    vm: self.vm,
                    ipa,
                    pa,
                    owner,
                });
            }
        });
        if let Some(e) = foreign {
            return Err(e);
        }
        let owned = mem.frames_owned(self.vm);
        if owned != mapped {
            return Err(OwnershipError::Unmapped {
                vm: self.vm,
                owned,
                mapped,
            });
        }
        Ok(())
    }

    /// Unmap everything and give every frame and table back, in batches of
    /// [`FREE_BATCH`] frames (one TLB invalidation each, before the frames
    /// can be reused): bounded memory whatever the guest's size. Frames the
    /// frame table refuses stay accounted to the VM and are reported.
    pub fn destroy(mut self, mem: &mut impl HostMemory) -> Teardown {
        let mut cursor = GuestAddr::new(0);
        let mut freed = 0;
        loop {
            let mut batch: heapless::Vec<PhysAddr, FREE_BATCH> = heapless::Vec::new();
            self.stage2.unmap_some(mem, &mut cursor, &mut batch);
            if batch.is_empty() {
                break;
            }
            mem.flush_tlb(self.vmid);
            self.trace_flush(batch.len());
            for pa in batch {
                freed += u64::from(self.free_frame(mem, pa));
            }
        }
        // Nothing is mapped any more: no TLB entry can point at a table.
        let (mut leaked, mut error) = (self.stats.frames_leaked, self.frame_error);
        if let Err(e) = self.stage2.destroy(mem) {
            leaked += 1;
            error.get_or_insert(e);
        }
        Teardown {
            freed,
            leaked,
            error,
        }
    }
}

/// A broken ownership invariant (a hypervisor bug, never a guest's doing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnershipError {
    Foreign {
        vm: usize,
        ipa: GuestAddr,
        pa: PhysAddr,
        owner: Option<usize>,
    },
    Unmapped {
        vm: usize,
        owned: u64,
        mapped: u64,
    },
}

impl core::fmt::Display for OwnershipError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            OwnershipError::Foreign { vm, ipa, pa, owner } => {
                write!(f, "VM {vm} maps IPA {ipa:#x} to frame {pa:#x}, which ")?;
                match owner {
                    Some(other) => write!(f, "VM {other} owns"),
                    None => f.write_str("no VM owns"),
                }
            }
            OwnershipError::Unmapped { vm, owned, mapped } => {
                write!(f, "VM {vm} owns {owned} frames but maps {mapped}")
            }
        }
    }
}

/// How many of `left` bytes from `at` lie in `at`'s page.
fn page_piece(at: GuestAddr, left: usize) -> usize {
    (PAGE_SIZE - at.page_offset()).min(left as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mm::frames::FrameUse;
    use crate::vm::testing::FakeHost;

    const BASE: GuestAddr = GuestAddr::new(0x4000_0000);

    /// Runs that cross a 2 MiB region, run past the end of RAM, start
    /// below it, wrap, repeat or are lone pages: exactly the pages in RAM
    /// are released, once, as the page-at-a-time loop would.
    #[test]
    fn release_by_runs_takes_exactly_the_pages_in_ram() {
        let pages = 1200; // RAM ends inside the third 2 MiB region
        let mut host = FakeHost::new(2048);
        let mut ram = GuestRam::new(&mut host, 1, 1, BASE, pages * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        let base = BASE.pfn().raw();
        let mut pfns: Vec<u64> = (base + 500..base + 530).collect(); // crosses 512
        pfns.extend(base + pages - 3..base + pages + 5); // past the end
        pfns.extend([base - 2, base - 1, base, base + 1]); // from below
        pfns.extend([base + 700, base + 700, base + 702]); // repeated, lone
        pfns.extend([u64::MAX - 1, u64::MAX, 0, 1]); // wraps
        let pfns: Vec<GuestPfn> = pfns.into_iter().map(GuestPfn::new).collect();
        let in_ram: std::collections::BTreeSet<u64> = pfns
            .iter()
            .map(|p| p.raw())
            .filter(|p| (base..base + pages).contains(p))
            .collect();
        assert_eq!(ram.release(&mut host, &pfns), in_ram.len() as u64);
        assert_eq!(ram.mapped_pages(), pages - in_ram.len() as u64);
        for p in base..base + pages {
            let mapped = ram
                .stage2
                .lookup(&mut host, GuestPfn::new(p).addr().unwrap())
                .is_some();
            assert_eq!(mapped, !in_ram.contains(&p), "page {p:#x}");
        }
        ram.check(&mut host).unwrap();
        host.frames.check_invariants().unwrap();
    }

    /// A guest giving pages back one request at a time (a balloon driver
    /// inflating a page per notify) costs a TLB flush per request and no
    /// instruction cache invalidation: nothing can be stale before a frame
    /// goes to a guest again.
    #[test]
    fn inflating_page_by_page_invalidates_no_instruction_cache() {
        let mut host = FakeHost::new(256);
        let mut ram = GuestRam::new(&mut host, 1, 1, BASE, 64 * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        let invalidations = host.icache_invalidations;
        for pfn in GuestPfn::iter(BASE.pfn()..BASE.pfn() + 48) {
            assert_eq!(ram.release(&mut host, &[pfn]), 1);
        }
        assert_eq!(host.flushes, 48, "one TLB flush a request");
        assert_eq!(host.icache_invalidations, invalidations);
        assert_eq!(ram.stats.icache_invalidations, 0);
        // The VM's frames left with whatever lines they had.
        assert!(host.frames.icache_stale());
        ram.destroy(&mut host);
        assert_eq!(host.icache_invalidations, invalidations);
    }

    /// Frames VM 1 gave back, page by page, reach VM 2 after exactly one
    /// invalidation of every instruction cache, done before the first is
    /// mapped (the fake host panics if a stage-2 table is touched while
    /// one is owed); what VM 2 takes after that needs none.
    #[test]
    fn frames_changing_owner_get_one_invalidation_before_they_are_mapped() {
        let mut host = FakeHost::new(256);
        let mut a = GuestRam::new(&mut host, 1, 1, BASE, 64 * PAGE_SIZE).unwrap();
        let mut b = GuestRam::new(&mut host, 2, 2, BASE, 64 * PAGE_SIZE).unwrap();
        a.populate(&mut host).unwrap();
        let mut given_back = Vec::new();
        for pfn in GuestPfn::iter(BASE.pfn()..BASE.pfn() + 16) {
            let ipa = pfn.addr().unwrap();
            given_back.push(a.stage2.lookup(&mut host, ipa).unwrap());
            assert_eq!(a.release(&mut host, &[pfn]), 1);
        }
        let before = host.icache_invalidations;
        // VM 2 touches a page: the fault and its neighbours take frames in
        // two batches, then single pages come one fault at a time.
        b.translate_or_back(&mut host, BASE).unwrap();
        let around: Vec<GuestPfn> = GuestPfn::iter(BASE.pfn() + 1..BASE.pfn() + 8).collect();
        assert_eq!(b.back_around(&mut host, &around, u64::MAX), 7);
        for page in 8..20 {
            b.translate_or_back(&mut host, BASE + page * PAGE_SIZE)
                .unwrap();
        }
        let mut taken = Vec::new();
        b.for_each_mapped(&mut host, |_, pa| taken.push(pa));
        // All but one (which VM 2's new stage-2 table took).
        let reused = given_back.iter().filter(|pa| taken.contains(pa)).count();
        assert_eq!(reused, given_back.len() - 1, "{taken:x?} {given_back:x?}");
        assert_eq!(host.icache_invalidations, before + 1);
        assert_eq!(b.stats.icache_invalidations, 1);
        assert_eq!(a.stats.icache_invalidations, 0);
        assert!(!host.frames.icache_stale());
        b.check(&mut host).unwrap();
        host.frames.check_invariants().unwrap();
    }

    #[test]
    fn populate_release_back_destroy() {
        let mut host = FakeHost::new(256);
        let mut ram = GuestRam::new(&mut host, 1, 1, BASE, 64 * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        assert_eq!(ram.mapped_pages(), 64);
        assert_eq!(host.frames.guest_pages(1), 64);
        ram.write(&mut host, BASE + 4090, b"straddles a page")
            .unwrap();
        let mut buf = [0u8; 16];
        ram.read(&mut host, BASE + 4090, &mut buf).unwrap();
        assert_eq!(&buf, b"straddles a page");
        let free_before = host.frames.free_pages();
        let pfns: Vec<GuestPfn> = GuestPfn::iter(BASE.pfn()..BASE.pfn() + 32).collect();
        assert_eq!(ram.release(&mut host, &pfns), 32);
        assert_eq!(host.flushes, 1, "one TLB flush for the whole batch");
        assert_eq!(host.frames.free_pages(), free_before + 32);
        // A released page reads as zero: it is backed again on access.
        ram.read(&mut host, BASE + 4090, &mut buf).unwrap();
        assert_eq!(buf, [0; 16]);
        assert_eq!(ram.stats.faults_backed, 2);
        ram.check(&mut host).unwrap();
        assert_eq!(
            ram.read(&mut host, BASE + (64 * PAGE_SIZE - 2), &mut buf),
            Err(RamError::NotRam {
                ipa: BASE + (64 * PAGE_SIZE - 2)
            })
        );
        assert_eq!(
            ram.release(&mut host, &[0, u64::MAX, 0x0a000].map(GuestPfn::new)),
            0,
            "outside RAM: ignored"
        );
        // 2^52 + a RAM PFN: the product wraps to a RAM address; not RAM.
        let mapped = ram.mapped_pages();
        let wraps = GuestPfn::new((1 << 52) + BASE.pfn().raw());
        assert_eq!(ram.release(&mut host, &[wraps]), 0);
        assert_eq!(ram.mapped_pages(), mapped, "nothing released");
        ram.destroy(&mut host);
        assert_eq!(host.frames.guest_pages(1), 0);
        assert_eq!(host.frames.pages(FrameUse::PageTables), 0);
        assert_eq!(host.frames.free_pages(), 256);
        host.frames.check_invariants().unwrap();
    }

    #[test]
    fn released_blocks_come_back_with_the_page_fill() {
        let mut host = FakeHost::new(1200);
        let mut ram = GuestRam::new(&mut host, 1, 1, BASE, 600 * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        ram.write(&mut host, BASE, b"kept").unwrap();
        let first = BASE.pfn();
        let free_before = host.frames.free_pages();
        // Two blocks, 300 + 200 pages: more than one 256-page batch.
        let blocks = [first + 10..first + 310, first + 400..first + 600];
        assert_eq!(ram.release_blocks(&mut host, &blocks), 500);
        assert_eq!(host.frames.free_pages(), free_before + 500);
        // Again: already given back, nothing to do.
        assert_eq!(ram.release_blocks(&mut host, &blocks), 0);
        ram.set_page_fill(0xaaaa_5555);
        let mut buf = [0u8; 8];
        ram.read(&mut host, BASE + 11 * PAGE_SIZE + 4088, &mut buf)
            .unwrap();
        assert_eq!(buf, [0x55, 0x55, 0xaa, 0xaa, 0x55, 0x55, 0xaa, 0xaa]);
        // Pages never given back keep their contents.
        ram.read(&mut host, BASE, &mut buf[..4]).unwrap();
        assert_eq!(&buf[..4], b"kept");
        ram.check(&mut host).unwrap();
        ram.destroy(&mut host);
        host.frames.check_invariants().unwrap();
    }

    /// A load's whole pages get frames that are not zeroed (the fake's
    /// hold stale bytes, as a frame back from the pool may), written before
    /// they are mapped: the guest reads exactly the data, zeros around it
    /// in its partial first and last pages, and a page already backed is
    /// written in place.
    #[test]
    fn whole_page_writes_show_the_data_alone() {
        let mut host = FakeHost::new(256);
        let mut ram = GuestRam::new(&mut host, 1, 1, BASE, 64 * PAGE_SIZE).unwrap();
        let start = BASE + 4000;
        let data: Vec<u8> = (0..3 * PAGE_SIZE + 100).map(|i| (i % 251) as u8).collect();
        ram.write(&mut host, start, &data).unwrap();
        // Two partial pages and three whole ones: five backed.
        assert_eq!(ram.stats.faults_backed, 5);
        assert_eq!(host.frames_owned(1), 5);
        let mut back = vec![0u8; data.len()];
        ram.read(&mut host, start, &mut back).unwrap();
        assert_eq!(back, data);
        let end = start + data.len() as u64;
        let mut before = vec![1u8; 4000];
        ram.read(&mut host, BASE, &mut before).unwrap();
        let mut after = vec![1u8; (PAGE_SIZE - end.page_offset()) as usize];
        ram.read(&mut host, end, &mut after).unwrap();
        assert!(before.iter().chain(&after).all(|&b| b == 0));
        let page = vec![7u8; PAGE_SIZE as usize];
        ram.write(&mut host, BASE + PAGE_SIZE, &page).unwrap();
        assert_eq!(host.frames_owned(1), 5);
        let mut back = vec![0u8; PAGE_SIZE as usize];
        ram.read(&mut host, BASE + PAGE_SIZE, &mut back).unwrap();
        assert_eq!(back, page);
        // With no frame left, an error: nothing mapped, nothing leaked.
        let mut small = FakeHost::new(18);
        let mut ram2 = GuestRam::new(&mut small, 2, 2, BASE, 64 * PAGE_SIZE).unwrap();
        assert!(matches!(
            ram2.write(&mut small, BASE, &data),
            Err(RamError::OutOfMemory { .. })
        ));
        ram2.check(&mut small).unwrap();
        ram.check(&mut host).unwrap();
        ram.destroy(&mut host);
        host.frames.check_invariants().unwrap();
    }

    #[test]
    fn out_of_memory_is_an_error_not_a_panic() {
        let mut host = FakeHost::new(40);
        let mut ram = GuestRam::new(&mut host, 0, 1, BASE, 64 * PAGE_SIZE).unwrap();
        assert!(matches!(
            ram.populate(&mut host),
            Err(RamError::OutOfMemory { .. })
        ));
        ram.check(&mut host).unwrap();
        ram.destroy(&mut host);
        assert_eq!(host.frames.free_pages(), 40);
    }

    /// Random inflate / report / fault / write / stop / zero-ahead sequences
    /// over two VMs keep every frame with one owner and every VM mapping
    /// only its own frames; and a VM reads only zeros or what this VM (this
    /// life of it) wrote: a page it gave back, or never touched, reads zero
    /// (frames zeroed ahead of time included), never the other VM's data
    /// nor an earlier life's.
    #[test]
    fn random_sequences_keep_ownership() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut host = FakeHost::new(400);
        let sizes = [96 * PAGE_SIZE, 160 * PAGE_SIZE];
        let mut vms: Vec<Option<GuestRam>> = Vec::new();
        // What a VM writes: its index and its life, in every byte pair.
        let mut lives = [0u8; 2];
        let tag = |vm: usize, life: u8| [vm as u8 + 1, life].repeat(4);
        for (vm, size) in sizes.iter().enumerate() {
            let mut ram = GuestRam::new(&mut host, vm, vm as u16 + 1, BASE, *size).unwrap();
            ram.populate(&mut host).unwrap();
            vms.push(Some(ram));
        }
        let (mut reported, mut own_reads, mut zeroed_ahead) = (0, 0, 0);
        for step in 0..6000u64 {
            let vm = rnd(2) as usize;
            let size = sizes[vm];
            match (rnd(14), vms[vm].as_mut()) {
                (0..=2, Some(ram)) => {
                    let pfns: Vec<GuestPfn> = (0..rnd(40))
                        .map(|_| BASE.pfn() + rnd(size / PAGE_SIZE + 8))
                        .collect();
                    ram.release(&mut host, &pfns);
                }
                (3..=4, Some(ram)) => {
                    let blocks: Vec<core::ops::Range<GuestPfn>> = (0..rnd(3))
                        .map(|_| {
                            let first = BASE.pfn() + rnd(size / PAGE_SIZE + 8);
                            first..first + rnd(32)
                        })
                        .collect();
                    reported += ram.release_blocks(&mut host, &blocks);
                }
                (5..=6, Some(ram)) => {
                    let ipa = BASE + rnd(size + 3 * PAGE_SIZE);
                    let _ = ram.translate_or_back(&mut host, ipa);
                }
                (7..=8, Some(ram)) => {
                    let ipa = BASE + rnd(size / PAGE_SIZE) * PAGE_SIZE + rnd(2) * 8;
                    ram.write(&mut host, ipa, &tag(vm, lives[vm])).unwrap();
                }
                (9..=10, Some(ram)) => {
                    let ipa = BASE + rnd(size / PAGE_SIZE) * PAGE_SIZE + rnd(2) * 8;
                    let mut word = [0u8; 8];
                    ram.read(&mut host, ipa, &mut word).unwrap();
                    assert!(
                        word == [0; 8] || word[..] == tag(vm, lives[vm])[..],
                        "step {step}: VM {vm} reads {word:x?} at {ipa:#x}"
                    );
                    own_reads += u64::from(word != [0; 8]);
                }
                (12, _) => {
                    zeroed_ahead += host.zero_ahead(rnd(16) as usize, rnd(100));
                }
                (11, _) if rnd(6) == 0 => {
                    if let Some(ram) = vms[vm].take() {
                        ram.destroy(&mut host);
                        assert_eq!(host.frames.guest_pages(vm), 0);
                        lives[vm] += 1;
                    }
                }
                (_, None) => {
                    let mut ram = GuestRam::new(&mut host, vm, vm as u16 + 1, BASE, size).unwrap();
                    let _ = ram.populate(&mut host);
                    vms[vm] = Some(ram);
                }
                _ => {}
            }
            host.frames.check_invariants().unwrap();
            for ram in vms.iter().flatten() {
                ram.check(&mut host)
                    .unwrap_or_else(|e| panic!("step {step}: {e}"));
            }
            let owned: u64 = (0..2).map(|v| host.frames.guest_pages(v)).sum();
            assert_eq!(owned, host.frames.pages(FrameUse::Guest));
        }
        // The sequence did what it is for.
        assert!(reported > 500 && own_reads > 10, "{reported} {own_reads}");
        let taken = host.frames.zeroed_pages().1;
        assert!(zeroed_ahead > 300 && taken > 100, "{zeroed_ahead} {taken}");
        assert!(lives.iter().all(|&l| l > 3), "{lives:?}");
    }

    /// Bytes the calling thread allocated on the heap (the tests run in
    /// parallel threads: each counts only its own).
    pub mod counting {
        use std::alloc::{GlobalAlloc, Layout, System};
        use std::cell::Cell;

        thread_local! {
            static ALLOCATED: Cell<u64> = const { Cell::new(0) };
        }

        pub struct Counting;

        // SAFETY: forwards to the system allocator unchanged; only counts.
        unsafe impl GlobalAlloc for Counting {
            unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
                let _ = ALLOCATED.try_with(|c| c.set(c.get() + layout.size() as u64));
                // SAFETY: the caller's contract is passed on as is.
                unsafe { System.alloc(layout) }
            }
            unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
                // SAFETY: as in `alloc`.
                unsafe { System.dealloc(ptr, layout) }
            }
        }

        #[global_allocator]
        static COUNTING: Counting = Counting;

        pub fn allocated() -> u64 {
            ALLOCATED.with(Cell::get)
        }
    }

    /// Freeing a 1 GiB guest allocates nothing on the heap (the old code
    /// collected every frame in a Vec: 2 MiB per GiB) and flushes the TLB
    /// once per batch, before any frame of the batch is back in the pool.
    #[test]
    fn destroy_of_a_large_guest_allocates_nothing() {
        let pages = (1u64 << 30) / PAGE_SIZE;
        let mut host = FakeHost::without_data(pages + 1024);
        let mut ram = GuestRam::new(&mut host, 3, 4, BASE, pages * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        assert_eq!(host.frames.guest_pages(3), pages);
        // The counter sees this thread's allocations.
        let before = counting::allocated();
        drop(std::hint::black_box(vec![0u8; 100]));
        assert_eq!(counting::allocated() - before, 100);
        let before = counting::allocated();
        let teardown = ram.destroy(&mut host);
        assert_eq!(counting::allocated() - before, 0, "bytes allocated");
        assert_eq!(
            teardown,
            Teardown {
                freed: pages,
                leaked: 0,
                error: None
            }
        );
        assert_eq!(host.flushes, pages.div_ceil(FREE_BATCH as u64));
        assert_eq!(host.frames.guest_pages(3), 0);
        assert_eq!(host.frames.pages(FrameUse::PageTables), 0);
        host.frames.check_invariants().unwrap();
    }

    /// A frame the frame table refuses (a hypervisor bug: here it was freed
    /// behind the VM's back and taken by another VM) is counted as leaked
    /// and reported, never a panic; everything else is still freed.
    #[test]
    fn a_refused_frame_is_reported_not_a_panic() {
        // 64 pages and 17 tables (16 of them the root): the freed frame is
        // the only free one.
        let mut host = FakeHost::new(81);
        let mut ram = GuestRam::new(&mut host, 1, 2, BASE, 64 * PAGE_SIZE).unwrap();
        ram.populate(&mut host).unwrap();
        let pa = ram
            .translate_or_back(&mut host, BASE + 5 * PAGE_SIZE)
            .unwrap();
        host.frames.free_guest(1, pa).unwrap();
        assert_eq!(host.frames.alloc_guest(2), Some(pa));
        assert!(matches!(
            ram.check(&mut host),
            Err(OwnershipError::Foreign { owner: Some(2), .. })
        ));
        let released = ram.release(&mut host, &[BASE.pfn() + 5]);
        assert_eq!(released, 0);
        assert_eq!(ram.stats.frames_leaked, 1);
        assert!(matches!(
            ram.frame_error,
            Some(FrameError::NotOwnedBy { vm: 1, .. })
        ));
        let teardown = ram.destroy(&mut host);
        assert_eq!((teardown.freed, teardown.leaked), (63, 1));
        assert_eq!(host.frames.guest_pages(1), 0);
        assert_eq!(
            host.frames.guest_pages(2),
            1,
            "the other VM keeps its frame"
        );
        host.frames.check_invariants().unwrap();
    }
}
