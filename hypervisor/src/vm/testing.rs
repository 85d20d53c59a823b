//! Test helpers (host tests and the fuzz targets, feature `testing`): a host
//! for [`GuestRam`](super::memory::GuestRam) over a real [`FrameTable`],
//! with page contents and stage-2 tables kept in vectors indexed by frame.

extern crate alloc;

use alloc::boxed::Box;
use alloc::vec;
use alloc::vec::Vec;

use platform::PhysRange;

use super::memory::HostMemory;
use crate::addr::PhysAddr;
use crate::mm::frames::{FrameError, FrameTable, FrameUse, Shortfall, StaleIcache, PAGE_SIZE};
use crate::mm::stage2::{TableMemory, ROOT_TABLES};

/// Physical address of the fake RAM.
const RAM_BASE: u64 = 0x8000_0000;

/// A fake frame's contents: one byte repeated until something is written
/// (a whole page is allocated only then: a VM's start and stop handle
/// thousands of frames that are never written).
enum Page {
    Filled(u8),
    Data(Box<[u8; 4096]>),
}

/// A host with `pages` pages of fake RAM at 0x8000_0000 and a real frame
/// table. Frames given back to the pool are filled with 0xdd, so a VM that
/// could still reach one would read garbage a test notices; as on the
/// target, frames zeroed ahead of time ([`FakeHost::zero_ahead`]) are
/// handed out as they are.
///
/// It also models the instruction caches, apart from the frame table's own
/// account: a frame freed from a guest may hold that guest's instruction
/// lines unless every CPU's instruction cache was invalidated after the
/// TLB flush that preceded its free (no CPU can fetch from it after that
/// flush). A guest allocation that hands out such a frame leaves an
/// invalidation owed, and touching a stage-2 table (mapping the frame)
/// while one is owed panics.
pub struct FakeHost {
    pub frames: FrameTable<'static>,
    /// Per frame: its contents as a stage-2 table, or as a guest page.
    tables: Vec<Option<Box<[u64; 512]>>>,
    data: Vec<Option<Page>>,
    /// TLB invalidations asked for.
    pub flushes: u64,
    /// Instruction cache invalidations (every CPU's) asked for.
    pub icache_invalidations: u64,
    /// Per frame: the TLB flushes done when a guest last gave it back.
    freed_after_flush: Vec<Option<u64>>,
    /// The TLB flushes done at the last instruction cache invalidation.
    flushes_at_icache: u64,
    /// A guest was handed a frame that may hold another's instruction
    /// lines and no invalidation followed yet.
    icache_owed: Option<PhysAddr>,
    /// Whether guest page contents are kept (off for a large guest whose
    /// contents a test does not read: nothing is allocated per page).
    keep_data: bool,
    /// Free frames below which the pool counts as low (`pool_low`).
    pub pool_low_below: u64,
    /// Reads and writes of frames that are neither a guest's nor the
    /// hypervisor's own pages (free frames, stage-2 tables, reserved
    /// memory): what a VM must never reach.
    pub stray_accesses: u64,
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
            icache_invalidations: 0,
            freed_after_flush: vec![None; frames_n],
            flushes_at_icache: 0,
            icache_owed: None,
            keep_data: true,
            pool_low_below: 0,
            stray_accesses: 0,
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

    /// What an idle CPU does on the target: up to `n` plain free frames
    /// zeroed ahead of time, while fewer than `target` are; how many.
    pub fn zero_ahead(&mut self, n: usize, target: u64) -> usize {
        let mut claimed = vec![PhysAddr::new(0); n];
        let got = self.frames.claim_to_zero(&mut claimed, target);
        for &pa in &claimed[..got] {
            if self.keep_data {
                self.data[Self::frame(pa)] = Some(Page::Filled(0));
            }
        }
        self.frames
            .finish_zeroing(&claimed[..got])
            .expect("claimed frames come back");
        got
    }

    /// Whether the frame at `pa` may still hold instruction lines of a
    /// guest that gave it back (see the type's docs).
    pub fn icache_stale(&self, pa: PhysAddr) -> bool {
        self.freed_after_flush[Self::frame(pa)].is_some_and(|f| f > self.flushes_at_icache)
    }

    /// `pa` was just handed to a guest: an invalidation is owed before it
    /// is mapped if it may hold stale instruction lines.
    fn handed_to_guest(&mut self, pa: PhysAddr) {
        if self.icache_stale(pa) {
            self.icache_owed.get_or_insert(pa);
        }
    }

    /// The frame at `pa` went back to the pool from a guest.
    fn freed_from_guest(&mut self, pa: PhysAddr) {
        self.freed_after_flush[Self::frame(pa)] = Some(self.flushes);
    }

    /// Counts an access to `pa` unless a guest or the hypervisor owns it.
    fn note_access(&mut self, pa: PhysAddr) {
        if !matches!(
            self.frames.use_of(pa),
            Some(FrameUse::Guest | FrameUse::Allocated)
        ) {
            self.stray_accesses += 1;
        }
    }

    /// The index of the frame holding `pa` (which must be fake RAM).
    fn frame(pa: PhysAddr) -> usize {
        usize::try_from((pa.raw() - RAM_BASE) / PAGE_SIZE).expect("frame index fits usize")
    }
}

impl TableMemory for FakeHost {
    fn alloc_table(&mut self) -> Option<PhysAddr> {
        let pa = self.frames.alloc(1, 1, FrameUse::PageTables)?;
        self.tables[Self::frame(pa)] = Some(Box::new([0; 512]));
        Some(pa)
    }
    fn alloc_root(&mut self) -> Option<PhysAddr> {
        let tables = ROOT_TABLES as usize;
        let root = self.frames.alloc(tables, tables, FrameUse::PageTables)?;
        for t in 0..ROOT_TABLES {
            self.tables[Self::frame(root + t * PAGE_SIZE)] = Some(Box::new([0; 512]));
        }
        Some(root)
    }
    fn free_table(&mut self, pa: PhysAddr) -> Result<(), FrameError> {
        self.frames.free(pa, 1, FrameUse::PageTables)?;
        self.tables[Self::frame(pa)].take().expect("table");
        Ok(())
    }
    fn table(&mut self, pa: PhysAddr) -> &mut [u64; 512] {
        if let Some(frame) = self.icache_owed {
            panic!(
                "a stage-2 table is touched while frame {frame:#x}, handed to a guest, may hold \
                 another guest's instruction lines (no invalidation since)"
            );
        }
        self.tables[Self::frame(pa)].as_mut().expect("table")
    }
}

impl HostMemory for FakeHost {
    fn alloc_frame(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        let mut frame = [PhysAddr::new(0)];
        let got = self.frames.alloc_guest_frames_marked(vm, &mut frame);
        if got.count == 0 {
            return None;
        }
        let pa = frame[0];
        if self.keep_data && got.zeroed & 1 == 0 {
            self.data[Self::frame(pa)] = Some(Page::Filled(0));
        }
        self.handed_to_guest(pa);
        Some((pa, got.stale))
    }
    /// With the stale bytes a frame back from the pool may hold (0xdd, as
    /// [`Self::free_frame`] leaves them): nothing may read them.
    fn alloc_frame_to_overwrite(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        let mut frame = [PhysAddr::new(0)];
        let got = self.frames.alloc_guest_frames_marked(vm, &mut frame);
        if got.count == 0 {
            return None;
        }
        let pa = frame[0];
        if self.keep_data {
            self.data[Self::frame(pa)] = Some(Page::Filled(0xdd));
        }
        self.handed_to_guest(pa);
        Some((pa, got.stale))
    }
    fn alloc_hypervisor_page(&mut self) -> Option<PhysAddr> {
        let pa = self.frames.alloc(1, 1, FrameUse::Allocated)?;
        self.data[Self::frame(pa)] = Some(Page::Filled(0));
        Some(pa)
    }
    fn free_frame(&mut self, vm: usize, pa: PhysAddr) -> Result<(), FrameError> {
        self.frames.free_guest(vm, pa)?;
        self.freed_from_guest(pa);
        if self.keep_data {
            // Poison what the pool gets back: a VM must never see it again.
            self.data[Self::frame(pa)] = Some(Page::Filled(0xdd));
        }
        Ok(())
    }
    fn read(&mut self, pa: PhysAddr, buf: &mut [u8]) {
        self.note_access(pa);
        if !self.keep_data {
            return buf.fill(0);
        }
        let off = pa.page_offset() as usize;
        match self.data[Self::frame(pa)].as_ref().expect("guest page") {
            Page::Filled(byte) => buf.fill(*byte),
            Page::Data(page) => buf.copy_from_slice(&page[off..off + buf.len()]),
        }
    }
    fn write(&mut self, pa: PhysAddr, data: &[u8]) {
        self.note_access(pa);
        if !self.keep_data {
            return;
        }
        let slot = self.data[Self::frame(pa)].as_mut().expect("guest page");
        if let Page::Filled(byte) = *slot {
            *slot = Page::Data(Box::new([byte; 4096]));
        }
        let Page::Data(page) = slot else {
            unreachable!("just made data")
        };
        let off = pa.page_offset() as usize;
        page[off..off + data.len()].copy_from_slice(data);
    }
    fn flush_tlb(&mut self, _vmid: u16) {
        self.flushes += 1;
    }
    fn invalidate_icache(&mut self, stale: StaleIcache) {
        self.icache_invalidations += 1;
        self.flushes_at_icache = self.flushes;
        self.icache_owed = None;
        self.frames.icache_invalidated(stale);
    }
    fn frame_owner(&self, pa: PhysAddr) -> Option<usize> {
        self.frames.guest_owner(pa)
    }
    fn frames_owned(&self, vm: usize) -> u64 {
        self.frames.guest_pages(vm)
    }
    fn pool_free(&self) -> u64 {
        self.frames.unreserved_free()
    }
    fn pool_low(&self) -> bool {
        self.frames.unreserved_free() < self.pool_low_below
    }
    fn guarantee(&mut self, vm: usize, pages: u64) -> Result<(), Shortfall> {
        self.frames.guarantee(vm, pages)
    }
}

/// A physical CPU for the VM core's host tests (`vm::cpu::PhysCpu`): guest
/// memory from a [`FakeHost`], list registers kept as their GICv2 encoding,
/// and a record of everything the core asked the CPU to do.
pub struct FakeCpu {
    pub host: FakeHost,
    /// This CPU's index.
    pub index: usize,
    /// CPUs online (bit per CPU).
    pub online: u64,
    pub now_us: u64,
    /// What the PMU would count.
    pub instructions: u32,
    /// Kicks sent, by target CPU.
    pub kicks: Vec<usize>,
    /// `(cpu, vm, vcpu)` handed out.
    pub handed: Vec<(usize, usize, usize)>,
    /// Exceptions injected: kind, FAR, IL.
    pub injected: Vec<(crate::vm::inject::GuestException, Option<u64>, bool)>,
    /// GICH_LRn values.
    pub lrs: [u32; 4],
    /// List registers cleared (written with zero).
    pub lr_clears: usize,
    /// Whether the virtual interface asked for an underflow interrupt.
    pub underflow: bool,
    /// Whether the guest's WFI traps (as a vCPU starts: it does).
    pub wfi_trapped: bool,
    /// What `zeroing_wanted` answers (the pool wants frames zeroed ahead).
    pub zeroing: bool,
    /// Physical interrupts waiting to be acknowledged, in order.
    pub pending_irqs: Vec<u32>,
    /// INTIDs whose priority was dropped, and those deactivated.
    pub eois: Vec<u32>,
    pub deactivated: Vec<u32>,
    pub icache_invalidations: u64,
    /// How often a vCPU left its run loop on this CPU.
    pub left: u64,
}

impl FakeCpu {
    /// CPU 0 of a board whose CPUs 1-7 are online, over `pages` of RAM.
    pub fn new(pages: u64) -> Self {
        Self::with_host(FakeHost::new(pages))
    }

    /// CPU 0 as [`FakeCpu::new`] makes it, over an existing host (a fuzz
    /// target reuses one host across runs: each new one leaks its frame
    /// table's storage).
    pub fn with_host(host: FakeHost) -> Self {
        Self {
            host,
            index: 0,
            online: 0xfe,
            now_us: 1_000_000,
            instructions: 0,
            kicks: Vec::new(),
            handed: Vec::new(),
            injected: Vec::new(),
            lrs: [0; 4],
            lr_clears: 0,
            underflow: false,
            wfi_trapped: true,
            zeroing: false,
            pending_irqs: Vec::new(),
            eois: Vec::new(),
            deactivated: Vec::new(),
            icache_invalidations: 0,
            left: 0,
        }
    }
}

impl crate::vm::cpu::PhysCpu for FakeCpu {
    type Memory = FakeHost;
    fn memory(&mut self) -> &mut FakeHost {
        &mut self.host
    }
    fn index(&self) -> usize {
        self.index
    }
    fn uptime_us(&self) -> u64 {
        self.now_us
    }
    fn counter(&self) -> (u64, u64) {
        // A 1 MHz counter.
        (self.now_us, 1_000_000)
    }
    fn instructions(&self) -> u32 {
        self.instructions
    }
    fn counts_instructions(&self) -> bool {
        true
    }
    fn cpu_online(&self, cpu: usize) -> bool {
        cpu < 64 && self.online & (1 << cpu) != 0
    }
    fn kick(&mut self, cpu: usize) {
        self.kicks.push(cpu);
    }
    fn hand_vcpu(&mut self, cpu: usize, vm: usize, vcpu: usize) {
        self.handed.push((cpu, vm, vcpu));
    }
    fn vcpu_left(&mut self) {
        self.left += 1;
    }
    fn list_registers(&self) -> usize {
        self.lrs.len()
    }
    fn read_lr(&self, i: usize) -> crate::vgic::LrState {
        crate::vgic::parse_lr(self.lrs.get(i).copied().unwrap_or(0))
    }
    fn write_lr(&mut self, i: usize, irq: &crate::vgic::PendingIrq, hw: Option<u32>) {
        self.lrs[i] = crate::vgic::lr_value(irq, hw);
    }
    fn clear_lr(&mut self, i: usize) {
        self.lrs[i] = 0;
        self.lr_clears += 1;
    }
    fn enable_virtual_interface(&mut self, underflow: bool) {
        self.underflow = underflow;
    }
    fn trap_wfi(&mut self, trap: bool) {
        self.wfi_trapped = trap;
    }
    fn zeroing_wanted(&self) -> bool {
        self.zeroing
    }
    fn reset_virtual_interface(&mut self) {
        self.lrs = [0; 4];
    }
    fn acknowledge(&mut self) -> (u32, u32) {
        if self.pending_irqs.is_empty() {
            return (crate::vgic::intid::SPURIOUS, crate::vgic::intid::SPURIOUS);
        }
        let intid = self.pending_irqs.remove(0);
        (intid, intid)
    }
    fn end_of_interrupt(&mut self, iar: u32) {
        self.eois.push(iar);
    }
    fn deactivate(&mut self, iar: u32) {
        self.deactivated.push(iar);
    }
    fn inject(
        &mut self,
        ctx: &mut crate::vm::cpu::GuestContext,
        exception: crate::vm::inject::GuestException,
        far: Option<u64>,
        il32: bool,
    ) {
        self.injected.push((exception, far, il32));
        // What the guest's handler would see: it resumes past the access.
        ctx.elr = ctx.elr.wrapping_add(4);
    }
    fn invalidate_icache(&mut self) {
        self.icache_invalidations += 1;
    }
}

/// VM 0 of the bundle `bytes` (built by `BundleBuilder`), kept for the
/// rest of the process: what a test or fuzz target starts a VM from.
pub fn first_vm(bytes: Vec<u8>) -> guest_bundle::VmEntry<'static> {
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    guest_bundle::parse(bytes)
        .expect("a bundle the builder made")
        .vm(0)
        .expect("one VM")
}

/// A VM's vCPUs set as a test (or fuzz target) wants them, which the
/// product only ever does through start, PSCI and the run loop: pinned to
/// the CPUs of `affinity`, with these power states.
pub fn set_vcpus(vm: &mut crate::vm::state::Vm, affinity: u64, power: &[crate::vm::state::Power]) {
    vm.vcpus = crate::vm::vcpus::Vcpus::pinned(affinity);
    for (v, &p) in power.iter().enumerate() {
        vm.vcpus.set_power(v, p);
    }
}
