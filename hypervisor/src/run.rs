//! The VM table and the vCPU loop: the target's side of the VM core.
//!
//! Each VM sits behind its own lock in [`VMS`]; each of its vCPUs runs on
//! the physical CPU its configuration pins it to. That CPU's loop enters
//! the guest, decodes each exit ([`crate::vm::exit`]) and hands it to the
//! portable core ([`crate::vm::handle`]) under the VM's lock, with
//! [`TargetCpu`] as the [`PhysCpu`] it acts through; console text the
//! exit produced is printed once the lock is released. The shell on CPU 0
//! changes a VM only through its lock: a stop is requested and carried out
//! by the vCPUs' CPUs at their next exit. Lock order: a VM, then the frame
//! table.
//!
//! A hypervisor failure on a vCPU's path (a panic, an EL2 exception) is
//! contained here: the locks that CPU held are released and only that VM
//! ends ([`contain_failure`]).

use core::cell::Cell;
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use guest_bundle::Bundle;
use spin::mutex::{SpinMutex, SpinMutexGuard, TicketMutex, TicketMutexGuard};

use crate::addr::PhysAddr;
use crate::arch::aarch64::vcpu;
use crate::arch::aarch64::{self, gic, pmu, recovery};
use crate::domain::{self, Domain, FailureLine, Point, Service, Services};
use crate::held::{self, Tracked};
use crate::hw::context::{El1State, VirtualInterface};
use crate::limits::{MAX_CPUS, MAX_GUESTS, MAX_VCPUS};
use crate::lock::ServiceFirst;
use crate::mm::frames::{
    self, FrameError, FrameTable, FrameUse, Shortfall, StaleIcache, PAGE_SIZE,
};
use crate::mm::manager::{Manager, Tunables, VmInput, Watermarks};
use crate::mm::stage2::{TableMemory, ROOT_TABLES};
use crate::println;
use crate::vgic::intid::{HYP_TIMER_PPI, KICK_SGI, MAINTENANCE_PPI, SPURIOUS, VTIMER_PPI};
use crate::vgic::{LrState, PendingIrq};
use crate::vm::balloon_ctl;
pub use crate::vm::balloon_ctl::HintStartError;
use crate::vm::console_line::Echo;
use crate::vm::cpu::{GuestContext, PhysCpu};
use crate::vm::exit::{decode, VcpuExit};
use crate::vm::handle::FAILURE;
use crate::vm::inject::GuestException;
use crate::vm::irq;
use crate::vm::lifecycle;
use crate::vm::manage;
use crate::vm::memory::HostMemory;
use crate::vm::outbox::Notice;
use crate::vm::state::{GuestGic, InjectedFailure};
pub use crate::vm::state::{Vm, VmState};
use crate::vm::vcpu_loop::{self, take_pending, Pending, VcpuHost};

/// The VM and vCPU each physical CPU is inside (between entering its run
/// loop and leaving it), or NO_VM: what a failure there must leave for it.
static ENTERED: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(NO_VM) }; MAX_CPUS];
/// Whether each CPU is ending a failed VM ([`end_failed_vm`]): a failure
/// then is the second, and the VM's frames are left accounted to it.
static ENDING: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// Physical address of the GICV page the guests' GICC maps to (0: none).
static GICV: AtomicU64 = AtomicU64::new(0);
/// Whether guests get a GICv3 (the host has one with the ICH interface).
static GIC_V3: AtomicBool = AtomicBool::new(false);

/// Guests get a virtual GICv2 whose CPU interface is the host's GICV page
/// at `pa` (the host has a GICv2 with GICH and GICV).
pub fn set_gicv(pa: PhysAddr) {
    GICV.store(pa.raw(), Ordering::Relaxed);
}

/// Guests get a virtual GICv3 (the host has a GICv3: its virtual CPU
/// interface is the ICC_* system registers, nothing to map).
pub fn set_gic_v3() {
    GIC_V3.store(true, Ordering::Relaxed);
}

/// The GIC guests get.
fn guest_gic() -> GuestGic {
    let gicv = GICV.load(Ordering::Relaxed);
    if GIC_V3.load(Ordering::Relaxed) {
        GuestGic::V3
    } else if gicv != 0 {
        GuestGic::V2 {
            gicv: PhysAddr::new(gicv),
        }
    } else {
        GuestGic::None
    }
}

/// `CPU_VM` packs a VM and a vCPU index.
fn encode(id: usize, vcpu: usize) -> usize {
    id * MAX_VCPUS + vcpu
}
const NO_VM: usize = usize::MAX;

/// Each VM behind its lock. A vCPU loop takes it once per exit and
/// releases it before the guest runs; board services (the shell, the
/// memory manager, zeroing ahead, `check`) go before the vCPUs
/// ([`ServiceFirst`]): however many vCPUs flood it with exits, a service
/// waits at most one exit of each (the QEMU test
/// `spin_flood_and_held_stats` uses the shell while a guest writes its
/// console without pause).
static VMS: [VmLock; MAX_GUESTS] = [const { VmLock::new(None) }; MAX_GUESTS];
type VmLock = ServiceFirst<Option<Vm>, aarch64::SpinThenNap>;
type VmGuard = SpinMutexGuard<'static, Option<Vm>, aarch64::SpinThenNap>;
/// The VM and vCPU each physical CPU runs, or NO_VM.
static CPU_VM: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(NO_VM) }; MAX_CPUS];
static FRAMES: spin::Once<&'static FrameLock> = spin::Once::new();
/// The frame table's lock: a spin lock whose data a failure that abandoned
/// its guard can still read ([`check_frames_after_failure`]).
pub type FrameLock = SpinMutex<FrameTable<'static>>;

pub(crate) fn frames() -> Tracked<SpinMutexGuard<'static, FrameTable<'static>>> {
    let table = FRAMES.get().expect("VMs are set up after the frame table");
    Tracked::new(table.lock(), held::FRAMES)
}

/// VM `id`'s lock for one of its vCPUs, marked held by this CPU
/// (`crate::held`) so that a failure can release it. Inlined: every exit
/// takes it.
#[inline(always)]
fn lock_vm(id: usize) -> Tracked<VmGuard> {
    Tracked::new(VMS[id].lock_vcpu(), held::vm(id))
}

/// VM `id`'s lock for a board service: before the VM's vCPUs.
fn lock_vm_for_service(id: usize) -> Tracked<VmGuard> {
    Tracked::new(VMS[id].lock_service(), held::vm(id))
}

/// The host side of guest memory on the target: frames from the frame table
/// (locked per operation, never across a whole request), tables and data
/// through the EL2 identity map.
#[derive(Default)]
pub struct HostMem;

fn zero_and_clean(pa: PhysAddr) {
    let pa = pa.raw() as usize;
    // `pa` is a whole frame the frame table just handed to us,
    // identity-mapped as normal memory.
    // A guest with its MMU off reads memory uncached: make it see the zeros
    // (cleaned to the point of coherency, not only zeroed in the cache).
    aarch64::zero_and_clean_frame(pa);
}

/// Frames zeroed per lock of the frame table, and batches per idle wait
/// at most (1 MiB): a CPU whose vCPU idles zeroes free frames ahead of
/// time, so that a guest's first touches and refaults need no zeroing.
const ZERO_BATCH: usize = 8;
const ZERO_BATCHES_PER_IDLE: usize = 32;

/// Free frames kept zeroed ahead of time, at most: this share of the RAM
/// the frame table tracks (under QEMU each zeroed frame is host memory
/// the QEMU process then holds).
const ZEROED_SHARE: u64 = 4;

/// Whether idle CPUs zero frames ahead of time now: set by the memory
/// manager's tick when the guests were quiet since the last one
/// ([`frames::zero_ahead_now`]); cleared as soon as a guest takes frames,
/// or when nothing is left to zero. While set, the guests' WFI traps
/// ([`PhysCpu::zeroing_wanted`]).
static ZEROING_WANTED: AtomicBool = AtomicBool::new(false);
/// Guests took frames since the last tick.
static FRAMES_TAKEN: AtomicBool = AtomicBool::new(false);
/// The guests' exits, summed over their exit profiles, at the last tick.
static EXITS_AT_TICK: AtomicU64 = AtomicU64::new(0);

/// Exits of all guests since the last tick, from their exit profiles (no
/// cost on the exit path). Every VM is seen: a service goes before its
/// vCPUs ([`ServiceFirst`]), so a VM whose lock is always busy cannot hide.
/// A profile started over counts as no exits.
fn exits_since_tick() -> u64 {
    let mut total = 0u64;
    for id in 0..MAX_GUESTS {
        let guard = lock_vm_for_service(id);
        if let Some(vm) = guard.as_ref() {
            total = total.saturating_add(vm.profile().total().count);
        }
    }
    total.saturating_sub(EXITS_AT_TICK.swap(total, Ordering::Relaxed))
}

/// At each tick: zero ahead from now on if the guests were quiet since the
/// last one and there is something to zero (see [`ZEROING_WANTED`]).
fn update_zeroing_wanted() {
    // Idle CPUs tick from boot on; the frame table comes with the VMs.
    let Some(table) = FRAMES.get() else {
        return;
    };
    let exits = exits_since_tick();
    let taken = FRAMES_TAKEN.swap(false, Ordering::Relaxed);
    let wanted = {
        let table = Tracked::new(table.lock(), held::FRAMES);
        frames::zero_ahead_now(&table, taken, exits, table.total_pages() / ZEROED_SHARE)
    };
    ZEROING_WANTED.store(wanted, Ordering::Relaxed);
}

/// Zero free frames ahead of time, a batch at a time, while this CPU has
/// nothing else to do: until an interrupt is pending (the guest's wake-up
/// waits for at most one batch), the pool's zeroed frames reach their
/// share, or [`ZERO_BATCHES_PER_IDLE`] batches. No lock is held while a
/// frame is zeroed: the frame table lends the frames out
/// (`claim_to_zero`), and they come back marked zeroed.
fn zero_while_idle() {
    if !ZEROING_WANTED.load(Ordering::Relaxed) {
        return;
    }
    run_service(Service::Zeroing, zero_batches);
}

/// [`zero_while_idle`]'s work, in the zeroing service's own domain.
fn zero_batches() {
    for _ in 0..ZERO_BATCHES_PER_IDLE {
        if aarch64::interrupt_pending() || !ZEROING_WANTED.load(Ordering::Relaxed) {
            return;
        }
        let mut batch = [PhysAddr::new(0); ZERO_BATCH];
        let n = {
            let mut table = frames();
            let target = table.total_pages() / ZEROED_SHARE;
            table.claim_to_zero(&mut batch, target)
        };
        if n == 0 {
            // The share is reached (or no plain free frame is left): WFI
            // stops trapping for this until frames move again.
            ZEROING_WANTED.store(false, Ordering::Relaxed);
            return;
        }
        for &pa in &batch[..n] {
            zero_and_clean(pa);
        }
        if let Err(e) = frames().finish_zeroing(&batch[..n]) {
            // A hypervisor bug: the frames stay out of the pool.
            println!("tidal: frames zeroed ahead refused by the frame table: {e}");
            return;
        }
    }
}

/// Up to 64 frames for VM `vm` into `out`, one lock of the frame table,
/// each zeroed unless the table says it was zeroed ahead of time (while a
/// CPU idled): how many, and the table's instruction cache report.
#[inline]
fn alloc_guest_chunk(vm: usize, out: &mut [PhysAddr]) -> (usize, Option<StaleIcache>) {
    let (got, ready, stale, free) = {
        let mut table = frames();
        let got = table.alloc_guest_frames_marked(vm, out);
        (got.count, got.zeroed, got.stale, table.unreserved_free())
    };
    if got < out.len() || free < POOL_LOW.load(Ordering::Relaxed) {
        POOL_EVENT.store(true, Ordering::Relaxed);
    }
    // Frames the frame table just handed to us, identity-mapped; cleaned
    // to the point of coherency as `zero_and_clean` says why.
    let to_zero = out[..got]
        .iter()
        .enumerate()
        .filter(|&(i, _)| ready & (1 << i) == 0)
        .map(|(_, pa)| pa.raw() as usize);
    aarch64::zero_and_clean_frames(to_zero);
    if got > 0 {
        FRAMES_TAKEN.store(true, Ordering::Relaxed);
        if ZEROING_WANTED.load(Ordering::Relaxed) {
            ZEROING_WANTED.store(false, Ordering::Relaxed);
        }
    }
    (got, stale)
}

impl TableMemory for HostMem {
    fn alloc_table(&mut self) -> Option<PhysAddr> {
        let pa = frames().alloc(1, 1, FrameUse::PageTables)?;
        zero_and_clean(pa);
        Some(pa)
    }
    fn alloc_root(&mut self) -> Option<PhysAddr> {
        let tables = ROOT_TABLES as usize;
        let root = frames().alloc(tables, tables, FrameUse::PageTables)?;
        for t in 0..ROOT_TABLES {
            zero_and_clean(root + t * PAGE_SIZE);
        }
        Some(root)
    }
    fn free_table(&mut self, pa: PhysAddr) -> Result<(), FrameError> {
        frames().free(pa, 1, FrameUse::PageTables)
    }
    fn table(&mut self, pa: PhysAddr) -> &mut [u64; 512] {
        // SAFETY: `pa` is a table frame this VM's stage 2 owns (frame table
        // use PageTables), identity-mapped; the VM's lock serialises access.
        unsafe { &mut *(pa.raw() as *mut [u64; 512]) }
    }
}

impl HostMemory for HostMem {
    fn alloc_frame(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        let mut frame = [PhysAddr::new(0)];
        let (got, stale) = alloc_guest_chunk(vm, &mut frame);
        (got == 1).then_some((frame[0], stale))
    }
    fn alloc_frame_to_overwrite(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        let mut frame = [PhysAddr::new(0)];
        let (pa, free) = {
            let mut table = frames();
            let got = table.alloc_guest_frames_marked(vm, &mut frame);
            (
                (got.count == 1).then_some((frame[0], got.stale)),
                table.unreserved_free(),
            )
        };
        // Below the low watermark (or out of frames): the manager ticks at
        // the next chance rather than at its next period.
        if pa.is_none() || free < POOL_LOW.load(Ordering::Relaxed) {
            POOL_EVENT.store(true, Ordering::Relaxed);
        }
        if pa.is_some() {
            FRAMES_TAKEN.store(true, Ordering::Relaxed);
            ZEROING_WANTED.store(false, Ordering::Relaxed);
        }
        pa
    }
    fn alloc_frames(&mut self, vm: usize, out: &mut [PhysAddr]) -> (usize, Option<StaleIcache>) {
        // At most 64 frames a lock: the frame table marks those that need
        // no zeroing in a 64-bit mask. One report for them all: the
        // latest covers the earlier ones.
        let (mut n, mut stale) = (0, None);
        for chunk in out.chunks_mut(64) {
            let (got, s) = alloc_guest_chunk(vm, chunk);
            n += got;
            stale = stale.max(s);
            if got < chunk.len() {
                break;
            }
        }
        (n, stale)
    }
    fn alloc_hypervisor_page(&mut self) -> Option<PhysAddr> {
        let pa = frames().alloc(1, 1, FrameUse::Allocated)?;
        zero_and_clean(pa);
        Some(pa)
    }
    fn free_frame(&mut self, vm: usize, pa: PhysAddr) -> Result<(), FrameError> {
        frames().free_guest(vm, pa)
    }
    fn free_frames(
        &mut self,
        vm: usize,
        pas: &[PhysAddr],
        on_error: &mut dyn FnMut(FrameError),
    ) -> u64 {
        frames().free_guest_frames(vm, pas, on_error)
    }
    fn read(&mut self, pa: PhysAddr, buf: &mut [u8]) {
        let pa = pa.raw() as usize;
        // SAFETY: `pa..pa + len` lies in one frame of this VM (GuestRam
        // splits at pages), identity-mapped.
        unsafe { core::ptr::copy_nonoverlapping(pa as *const u8, buf.as_mut_ptr(), buf.len()) };
    }
    fn read_u16(&mut self, pa: PhysAddr) -> u16 {
        debug_assert!(pa.raw().is_multiple_of(2));
        // SAFETY: an even address in a frame of this VM (GuestRam checked
        // it), identity-mapped; volatile because the guest may be writing.
        u16::from_le(unsafe { core::ptr::read_volatile(pa.raw() as usize as *const u16) })
    }
    fn write(&mut self, pa: PhysAddr, data: &[u8]) {
        let pa = pa.raw() as usize;
        // SAFETY: as in `read`.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), pa as *mut u8, data.len()) };
        aarch64::clean_dcache_range(pa, data.len());
    }
    fn write_u32(&mut self, pa: PhysAddr, value: u32) {
        debug_assert!(pa.raw().is_multiple_of(4));
        let pa = pa.raw() as usize;
        // SAFETY: a 4-aligned address in a frame we own (a mirror page),
        // identity-mapped; volatile: a single store the guest may be
        // reading.
        unsafe { core::ptr::write_volatile(pa as *mut u32, value.to_le()) };
        aarch64::clean_dcache_range(pa, 4);
    }
    fn flush_tlb(&mut self, vmid: u16) {
        vcpu::flush_vm_tlb(vmid);
    }
    fn invalidate_icache(&mut self, stale: StaleIcache) {
        // Without the frame table's lock: a CPU allocating meanwhile gets
        // the report too and invalidates itself, and the acknowledgement
        // comes only once this CPU's invalidation has completed (the DSB
        // in `invalidate_icache_all`), so no CPU maps a stale frame first.
        aarch64::invalidate_icache_all();
        frames().icache_invalidated(stale);
    }
    fn frame_owner(&self, pa: PhysAddr) -> Option<usize> {
        frames().guest_owner(pa)
    }
    fn frames_owned(&self, vm: usize) -> u64 {
        frames().guest_pages(vm)
    }
    fn pool_free(&self) -> u64 {
        frames().unreserved_free()
    }
    fn pool_low(&self) -> bool {
        frames().unreserved_free() < POOL_LOW.load(Ordering::Relaxed)
    }
    fn guarantee(&mut self, vm: usize, pages: u64) -> Result<(), Shortfall> {
        frames().guarantee(vm, pages)
    }
}

/// The CPU this code runs on, as the VM core sees it.
#[derive(Default)]
pub struct TargetCpu {
    mem: HostMem,
}

impl TargetCpu {
    pub const fn new() -> Self {
        Self { mem: HostMem }
    }
}

impl PhysCpu for TargetCpu {
    type Memory = HostMem;
    fn memory(&mut self) -> &mut HostMem {
        &mut self.mem
    }
    fn index(&self) -> usize {
        aarch64::cpu_index()
    }
    fn uptime_us(&self) -> u64 {
        aarch64::uptime_us()
    }
    fn counter(&self) -> (u64, u64) {
        aarch64::counter()
    }
    fn instructions(&self) -> u32 {
        pmu::instructions()
    }
    fn counts_instructions(&self) -> bool {
        pmu::counts_instructions()
    }
    fn cpu_online(&self, cpu: usize) -> bool {
        aarch64::smp::state(cpu) == aarch64::smp::CpuState::Online
            && (cpu != SHELL_CPU || SHELL_CPU_SHARED.load(Ordering::Relaxed))
    }
    fn kick(&mut self, cpu: usize) {
        gic::kick(cpu);
    }
    fn hand_vcpu(&mut self, cpu: usize, vm: usize, vcpu: usize) {
        if let Some(slot) = CPU_VM.get(cpu) {
            slot.store(encode(vm, vcpu), Ordering::Release);
            wake_cpu(cpu);
        }
    }
    fn vcpu_left(&mut self) {
        ENTERED[aarch64::cpu_index()].store(NO_VM, Ordering::Relaxed);
    }
    fn list_registers(&self) -> usize {
        gic::list_registers()
    }
    fn read_lr(&self, i: usize) -> LrState {
        gic::read_lr(i)
    }
    fn write_lr(&mut self, i: usize, irq: &PendingIrq, hw: Option<u32>) {
        gic::write_lr(i, irq, hw);
    }
    fn clear_lr(&mut self, i: usize) {
        gic::clear_lr(i);
    }
    fn enable_virtual_interface(&mut self, underflow: bool) {
        gic::enable_virtual_interface(underflow);
    }
    fn trap_wfi(&mut self, trap: bool) {
        vcpu::set_wfi_trap(trap);
    }
    fn zeroing_wanted(&self) -> bool {
        ZEROING_WANTED.load(Ordering::Relaxed)
    }
    fn reset_virtual_interface(&mut self) {
        gic::reset_virtual_interface();
    }
    fn acknowledge(&mut self) -> (u32, u32) {
        let (intid, iar) = gic::acknowledge();
        if intid != SPURIOUS {
            count_taken(intid);
        }
        (intid, iar)
    }
    fn end_of_interrupt(&mut self, iar: u32) {
        gic::end_of_interrupt(iar);
    }
    fn deactivate(&mut self, iar: u32) {
        gic::deactivate(iar);
    }
    fn inject(
        &mut self,
        ctx: &mut GuestContext,
        exception: GuestException,
        far: Option<u64>,
        il32: bool,
    ) {
        vcpu::inject(ctx, exception, far, il32);
    }
    fn invalidate_icache(&mut self) {
        aarch64::invalidate_icache_all();
    }
}

/// Print what [`take_pending`] took (no VM lock held).
fn show(pending: Option<Pending>) {
    let Some(p) = pending else { return };
    for notice in p.notices.iter() {
        match notice {
            Notice::Line(line) => println!("{line}"),
            _ => {
                if let Some(output) = notice.live() {
                    crate::console::guest_live_output(p.id, &p.name, output, || {
                        FOCUS.load(Ordering::Relaxed) == p.id
                    });
                }
            }
        }
    }
    if p.dropped > 0 {
        println!(
            "tidal: [{}] {} console lines lost (too many at once)",
            p.name, p.dropped
        );
    }
}

/// Print a byte VM `id` showed live (a fast exit's, no VM lock held).
/// Taken by reference as the `Option` it came out of the VM in: taking
/// the `Echo` out of it by value was a 15-byte unaligned copy, a memcpy
/// call.
fn show_live(id: usize, echo: &Option<Echo>) {
    let Some(echo) = echo else { return };
    let name = NAMES[id].get().map_or("?", |name| name.as_str());
    crate::console::guest_live_output(id, name, echo.output(), || {
        FOCUS.load(Ordering::Relaxed) == id
    });
}

/// Each VM's name as [`init`] registered it (it never changes): what its
/// live output is prefixed with, read without its lock. A copy of the name
/// out of the VM on every byte it printed cost about 90 EL2 instructions.
static NAMES: [spin::Once<heapless::String<32>>; MAX_GUESTS] =
    [const { spin::Once::new() }; MAX_GUESTS];

/// Register the bundle's VMs (all stopped) and the frame table they draw from.
pub fn init(bundle: Bundle<'static>, frame_table: &'static FrameLock) {
    FRAMES.call_once(|| frame_table);
    let gic = guest_gic();
    for (id, spec) in bundle.vms().enumerate().take(MAX_GUESTS) {
        let vm = Vm::new(id, spec, gic);
        NAMES[id].call_once(|| vm.name().clone());
        *lock_vm(id) = Some(vm);
    }
    if bundle.vm_count() > MAX_GUESTS {
        println!("only the first {MAX_GUESTS} VMs of the bundle are used");
    }
}

/// Call `f` on every VM, in table order; what each leaves to print is
/// printed after its lock is released.
pub fn for_each(mut f: impl FnMut(&mut Vm)) {
    for id in 0..MAX_GUESTS {
        let mut guard = lock_vm_for_service(id);
        let pending = guard.as_mut().and_then(|vm| {
            f(vm);
            take_pending(vm)
        });
        drop(guard);
        show(pending);
    }
}

/// Call `f` on the VM called `name`; `None` if there is none.
pub fn with_vm<R>(name: &str, f: impl FnOnce(&mut Vm) -> R) -> Option<R> {
    for id in 0..MAX_GUESTS {
        let mut guard = lock_vm_for_service(id);
        if let Some(vm) = guard.as_mut().filter(|vm| vm.name() == name) {
            let result = f(vm);
            let pending = take_pending(vm);
            drop(guard);
            show(pending);
            return Some(result);
        }
    }
    None
}

/// The VM whose lock a shell command holds for seconds (a snapshot's
/// write, a restore's read; `usize::MAX`: none): the memory manager's
/// tick, which any CPU may run between two exits of another VM's vCPU,
/// leaves it out of its rounds rather than wait for it.
static HELD_LONG: AtomicUsize = AtomicUsize::new(usize::MAX);

/// [`with_vm`] for work that holds the VM's lock for seconds: the
/// memory manager's rounds leave the VM out meanwhile (its last input
/// stands; no target is set on it), so no other VM's CPU waits on it.
pub fn with_vm_held_long<R>(name: &str, f: impl FnOnce(&mut Vm) -> R) -> Option<R> {
    let id = (0..MAX_GUESTS).find(|&id| {
        lock_vm_for_service(id)
            .as_ref()
            .is_some_and(|vm| vm.name() == name)
    })?;
    HELD_LONG.store(id, Ordering::Release);
    // A round already past its check of the flag ends before the lock is
    // taken here; every later round sees the flag.
    drop(MANAGER.lock());
    let mut guard = lock_vm_for_service(id);
    let done = guard.as_mut().filter(|vm| vm.name() == name).map(|vm| {
        let result = f(vm);
        (result, take_pending(vm))
    });
    drop(guard);
    HELD_LONG.store(usize::MAX, Ordering::Release);
    done.map(|(result, pending)| {
        show(pending);
        result
    })
}

/// Whether the shell holds VM `id`'s lock for long ([`with_vm_held_long`]).
fn held_long(id: usize) -> bool {
    HELD_LONG.load(Ordering::Acquire) == id
}

/// The `check` command, one VM at a time: each VM's stage-2 tables are
/// walked under its lock alone; the frame table's own invariants are
/// checked under its lock alone; then the figures added up across VMs are
/// read with every VM's lock held for those reads only (constant time per
/// VM), so they are one snapshot. `ram_bytes`: the board's RAM.
pub fn check_system(ram_bytes: u64, out: &mut impl core::fmt::Write) {
    use crate::vm::check::{self, FrameFacts, RamFacts, VmFacts};
    let mut walked: [Option<(u64, RamFacts)>; MAX_GUESTS] = [None; MAX_GUESTS];
    for (id, walk) in walked.iter_mut().enumerate() {
        let guard = lock_vm_for_service(id);
        *walk = guard
            .as_ref()
            .and_then(|vm| Some((vm.starts(), RamFacts::of(vm.ram()?, &mut HostMem))));
    }
    let invariants = frames().check_invariants();
    let mut names: heapless::Vec<
        (usize, heapless::String<32>, bool, Option<RamFacts>),
        MAX_GUESTS,
    > = heapless::Vec::new();
    let facts = {
        let guards: [_; MAX_GUESTS] = core::array::from_fn(lock_vm_for_service);
        for vm in guards.iter().filter_map(|g| g.as_ref()) {
            let ram = vm.ram().map(|ram| {
                // The walk's verdict, if this is the VM that was walked.
                let ownership = walked[vm.id() % MAX_GUESTS]
                    .filter(|(starts, _)| *starts == vm.starts())
                    .map_or(Ok(()), |(_, w)| w.ownership);
                RamFacts {
                    ownership,
                    ..RamFacts::counts(ram)
                }
            });
            let _ = names.push((
                vm.id(),
                vm.name().clone(),
                vm.state() == VmState::Stopped,
                ram,
            ));
        }
        FrameFacts::counts(&frames(), ram_bytes)
    }
    .with_invariants(invariants);
    let vms: heapless::Vec<VmFacts<'_>, MAX_GUESTS> = names
        .iter()
        .map(|(id, name, stopped, ram)| VmFacts {
            id: *id,
            name,
            stopped: *stopped,
            ram: *ram,
        })
        .collect();
    let result = check::check(&facts, &vms);
    let mut text = alloc::string::String::new();
    let _ = check::write_result(&mut text, &result);
    let _ = out.write_str(&text);
}

/// Build a VM's memory and devices and hand it to its CPU.
pub fn start(vm: &mut Vm) -> Result<(), &'static str> {
    lifecycle::start(vm, &mut TargetCpu::new())
}

/// Set the balloon target of a VM, in 4 KiB pages, and tell the driver.
pub fn set_balloon(vm: &mut Vm, pages: u64) -> Result<(), &'static str> {
    balloon_ctl::set_target(vm, &mut TargetCpu::new(), pages)
}

/// Start a free page hinting run in VM `vm` (shell `hint`): its command id.
pub fn start_hint(vm: &mut Vm) -> Result<u32, HintStartError> {
    balloon_ctl::start_hint(vm, &mut TargetCpu::new())
}

extern crate alloc;

/// Wake an idle CPU that was just given a vCPU (see `aarch64::idle_wait`).
fn wake_cpu(cpu: usize) {
    // SEV wakes CPUs waiting in WFE (hosts without our GIC).
    aarch64::send_event();
    gic::kick(cpu);
}

/// The loop of a CPU that runs vCPUs: wait for one, run it until it stops.
/// The vCPU runs under a recovery point: a hypervisor failure in its path
/// comes back here ([`contain_failure`]) and ends only that VM.
pub fn cpu_loop(cpu: usize) -> ! {
    loop {
        if !run_assigned(cpu) {
            // A start or CPU_ON kicks this CPU; 10 ms bounds a missed kick.
            aarch64::idle_wait(10_000);
            memory_tick();
        }
    }
}

/// Run the vCPU handed to this CPU, if any, until it leaves; false if
/// there was none. The shell's CPU calls it from its idle loop.
pub fn run_assigned(cpu: usize) -> bool {
    let slot = CPU_VM[cpu].load(Ordering::Acquire);
    if slot == NO_VM {
        return false;
    }
    let (id, vcpu) = (slot / MAX_VCPUS, slot % MAX_VCPUS);
    if recovery::run_recoverable(|| run_vcpu(id, vcpu)).is_err() {
        end_failed_vm(cpu, id, vcpu);
    }
    // The guest's virtual timer must not keep waking an idle CPU, nor the
    // shell's look a shell that sleeps.
    vcpu::disable_virtual_timer();
    aarch64::disarm_el2_timer();
    // The vCPU left: this CPU is free unless it was handed a new one.
    let _ = CPU_VM[cpu].compare_exchange(slot, NO_VM, Ordering::AcqRel, Ordering::Acquire);
    true
}

// ------------------------------------------------------------ the shell's CPU

/// The physical CPU the shell runs on. A vCPU pinned to it runs from the
/// shell's idle loop, and the shell is looked at from that vCPU's exits
/// ([`share_shell_cpu`]): on a board every core can run a guest, and under
/// QEMU no emulated CPU sits idle (TCG wakes an idle CPU's thread for each
/// broadcast TLB invalidation a guest issues, taking a host core from the
/// guests' threads).
pub const SHELL_CPU: usize = 0;

/// Whether a vCPU may run on [`SHELL_CPU`]: only when the console's input
/// interrupt takes that CPU out of its guest (the shell must see every byte
/// typed while the guest computes).
static SHELL_CPU_SHARED: AtomicBool = AtomicBool::new(false);
/// What a vCPU loop on the shell's CPU calls to let the shell read the
/// console and act on it (set once by boot).
static SHELL_POLL: spin::Once<fn() -> u64> = spin::Once::new();
/// The console's interrupt (a host SPI) was taken while a guest ran on the
/// shell's CPU: the shell looks at the console before the guest runs again.
static HOST_SPI_TAKEN: AtomicBool = AtomicBool::new(false);
/// How long a vCPU loop on the shell's CPU lets the shell go without a
/// look, before the shell says (each look returns when it wants the next):
/// the memory manager's period.
const SHELL_LOOK_US: u64 = TICK_US;

/// Let vCPUs run on the shell's CPU, their exits calling `poll` (the
/// shell's look at the console, which returns in how many microseconds it
/// wants to look again without input). Called by boot once the console's
/// input interrupt is routed to the shell's CPU, before any VM starts.
pub fn share_shell_cpu(poll: fn() -> u64) {
    SHELL_POLL.call_once(|| poll);
    SHELL_CPU_SHARED.store(true, Ordering::Relaxed);
}

/// Whether a vCPU is handed to the shell's CPU: the shell's commands must
/// not wait for a guest then (that vCPU runs only once they return, and its
/// guest stands still while they wait).
pub fn shell_cpu_runs_guest() -> bool {
    CPU_VM[SHELL_CPU].load(Ordering::Acquire) != NO_VM
}

/// The shell's look from a vCPU loop on its CPU. The look runs in the
/// shell's own failure domain (boot arms it, [`run_service`]): a failure
/// in the shell is the hypervisor's, not the VM's. When it wants the next
/// one (microseconds).
fn poll_shell() -> u64 {
    SHELL_POLL.get().map_or(SHELL_LOOK_US, |poll| poll())
}

// ------------------------------------------------------ failure domains

/// The board services' states: on, or off since a failure.
static SERVICES: Services = Services::new();
/// What stops the board when it cannot go on safely (set by boot: prints
/// `FATAL: ...` and powers off).
static FATAL: spin::Once<fn(core::fmt::Arguments) -> !> = spin::Once::new();

/// How the board stops when it must (`FATAL: ...`).
pub fn set_fatal(fatal: fn(core::fmt::Arguments) -> !) {
    FATAL.call_once(|| fatal);
}

/// `None` if `service` is on, else why it went off.
pub fn service_off(service: Service) -> Option<heapless::String<{ domain::REASON_BYTES }>> {
    let state = SERVICES.get(service);
    state.is_off().then(|| state.reason())
}

/// Run `f` as board service `service`, in its own failure domain: a
/// failure inside it releases only the locks taken inside, turns the
/// service off (the shell: abandons the command) with one console line,
/// and returns `None`; every VM goes on. `None` at once if the service is
/// off.
pub fn run_service<R>(service: Service, f: impl FnOnce() -> R) -> Option<R> {
    if SERVICES.get(service).is_off() {
        return None;
    }
    let point = Point {
        domain: Domain::Service(service),
        held_at_entry: held::held_here(),
    };
    recovery::run_recoverable_as(point.encode(), f).ok()
}

/// Run `f`, `service`'s handling of VM `id`'s input, in that VM's failure
/// domain: a failure inside it is blamed on VM `id` (`Err`: the caller
/// stops it), never on the VM whose CPU runs the service.
fn for_vm_input<R>(service: Service, id: usize, f: impl FnOnce() -> R) -> Result<R, usize> {
    let point = Point {
        domain: Domain::Input { vm: id, service },
        held_at_entry: held::held_here(),
    };
    recovery::run_recoverable_as(point.encode(), f).map_err(|_| id)
}

/// VM `id`'s name, for a failure's line. Waits for its lock as a service
/// does (another CPU may take it the moment the failure released it),
/// unless this CPU still holds it in `held` (a domain outside the failed
/// one): then only its number.
fn name_of(id: usize, held: u32) -> heapless::String<32> {
    let name = VMS
        .get(id)
        .filter(|_| held & held::vm(id) == 0)
        .and_then(|lock| lock.lock_service().as_ref().map(|vm| vm.name().clone()));
    name.unwrap_or_else(|| {
        let mut s = heapless::String::new();
        let _ = core::fmt::write(&mut s, format_args!("VM {id}"));
        s
    })
}

/// A panic or an EL2 exception on a CPU with a recovery point armed
/// (called by `crate::crash`): release the locks taken inside the failed
/// domain, say what happened and whose it was, and jump back to where the
/// domain began ([`Point`]): a vCPU's failure ends that VM
/// ([`end_failed_vm`]), a service's turns the service off, a VM's input
/// handled by a service stops that VM. A failure that held the frame table
/// checks it first: if the table is broken the board stops with one
/// `FATAL:` line, it never runs on a half-updated table. Returns only when
/// no recovery point is armed.
pub fn contain_failure(what: core::fmt::Arguments) {
    let Some(tag) = recovery::current_tag() else {
        return;
    };
    let point = Point::decode(tag);
    let cpu = aarch64::cpu_index();
    let held = held::held_here();
    let release = held & !point.held_at_entry;
    // SAFETY: `release` lists locks this CPU took inside the failed
    // domain, whose guards live in the frames the jump below abandons:
    // nobody uses them again.
    unsafe { crate::console::release_held(release) };
    if release & held::FRAMES != 0 {
        check_frames_after_failure(what);
    }
    // SAFETY: as above.
    unsafe { release_held(release) };
    held::set_here(held & !release);
    match point.domain {
        Domain::Vcpu => {
            let slot = CPU_VM[cpu].load(Ordering::Acquire);
            let name = name_of(slot / MAX_VCPUS, held & !release);
            if ENDING[cpu].load(Ordering::Relaxed) {
                println!(
                    "tidal: [{name}] hypervisor failure again while stopping the VM: {what}; the VM is left failed and its frames stay accounted to it"
                );
            } else {
                println!("tidal: [{name}] hypervisor failure in this VM's path: {what}; the VM is stopped");
            }
        }
        Domain::Service(service) => {
            if service.stops_on_failure() {
                SERVICES.get(service).turn_off(what);
            }
            if service == Service::Zeroing {
                ZEROING_WANTED.store(false, Ordering::Relaxed);
            }
            println!("{}", FailureLine { service, what });
        }
        Domain::Input { vm, service } => {
            println!(
                "tidal: [{}] hypervisor failure in the {} handling this VM's input: {what}; the VM is stopped",
                name_of(vm, held & !release),
                service.name()
            );
        }
    }
    // SAFETY: we run on this CPU's stack below its recovery point (in the
    // panic or exception handler), and every lock the abandoned frames
    // held was released above.
    unsafe { recovery::jump() };
}

/// A failure abandoned the frame table's guard mid-operation: check the
/// table before anyone else uses it. Broken: the board stops (the lock
/// stays held, so no CPU goes on with the table meanwhile).
fn check_frames_after_failure(what: core::fmt::Arguments) {
    let Some(lock) = FRAMES.get() else { return };
    // SAFETY: this CPU holds the lock (its guard was abandoned by the
    // failure), so no other CPU touches the table until it is released.
    let table = unsafe { &*lock.as_mut_ptr() };
    if let Err(e) = table.check_invariants() {
        let fatal = FATAL.get().copied().unwrap_or(fatal_fallback);
        fatal(format_args!(
            "the frame table is inconsistent after a hypervisor failure that held it ({what}): {e}; the board stops rather than run VMs on it"
        ));
    }
}

fn fatal_fallback(args: core::fmt::Arguments) -> ! {
    println!("FATAL: {args}");
    aarch64::park()
}

/// Force-release the VM and frame-table locks in `held`.
///
/// # Safety
///
/// Only for locks the calling CPU holds and whose guards are abandoned.
unsafe fn release_held(held: u32) {
    for id in held::vms(held).filter(|&id| id < MAX_GUESTS) {
        // SAFETY: this CPU holds it (the caller's contract).
        unsafe { VMS[id].force_unlock() };
    }
    if held & held::FRAMES != 0 {
        if let Some(table) = FRAMES.get() {
            // SAFETY: as above.
            unsafe { table.force_unlock() };
        }
    }
    if held & held::MANAGER != 0 {
        // SAFETY: as above.
        unsafe { MANAGER.force_unlock() };
    }
}

/// Back in the CPU loop after a failure in VM `id`'s path: stop the VM as
/// any stop does (its other vCPUs are kicked out, the last one out frees
/// its pages), under a recovery point of its own. If that fails too, or
/// its frames could not all be freed, the VM is left failed with its
/// frames accounted to it, never recovered twice.
fn end_failed_vm(cpu: usize, id: usize, vcpu: usize) {
    ENDING[cpu].store(true, Ordering::Relaxed);
    let ended = recovery::run_recoverable(|| {
        let mut target = TargetCpu::new();
        let mut guard = lock_vm(id);
        let Some(vm) = guard.as_mut() else { return };
        lifecycle::stop_for_failure(vm, &mut target, FAILURE);
        if ENTERED[cpu].load(Ordering::Relaxed) == encode(id, vcpu) {
            lifecycle::leave(vm, &mut target, vcpu, true);
        }
        // Its other vCPUs may still be leaving: they finish the stop.
        let pending = take_pending(vm);
        drop(guard);
        show(pending);
    });
    ENDING[cpu].store(false, Ordering::Relaxed);
    ENTERED[cpu].store(NO_VM, Ordering::Relaxed);
    if gic::present() {
        gic::reset_virtual_interface();
    }
    let mut guard = lock_vm(id);
    let Some(vm) = guard.as_mut() else { return };
    let owned = frames().guest_pages(id);
    if ended.is_err() || (vm.state() == VmState::Stopped && owned > 0) {
        let _ = frames().guarantee(id, 0);
        lifecycle::mark_failed(vm, owned);
    }
    let pending = take_pending(vm);
    drop(guard);
    show(pending);
}

/// Run vCPU `vcpu` of VM `id` on this CPU until it leaves
/// ([`vcpu_loop::run_vcpu`] over the target's [`TargetHost`]).
fn run_vcpu(id: usize, vcpu: usize) {
    let host = TargetHost {
        on_shell_cpu: aarch64::cpu_index() == SHELL_CPU,
        next_shell_look: Cell::new(0),
    };
    vcpu_loop::run_vcpu(&host, &mut TargetCpu::new(), id, vcpu);
}

/// What the vCPU loop reaches of the target board: the VM table's locks,
/// the world switch, the tick, the console, the sleeps.
struct TargetHost {
    on_shell_cpu: bool,
    /// When the shell (on its CPU) looks at the console next without input.
    next_shell_look: Cell<u64>,
}

impl VcpuHost for TargetHost {
    type Guard<'a> = Tracked<VmGuard>;

    #[inline]
    fn lock_vm(&self, id: usize) -> Tracked<VmGuard> {
        lock_vm(id)
    }

    fn load_guest(&self, vm: &Vm, vcpu: usize) {
        ENTERED[aarch64::cpu_index()].store(encode(vm.id(), vcpu), Ordering::Relaxed);
        let restored = vm.restored_vcpu(vcpu).and_then(|s| s.running.as_ref());
        vcpu::load_el1(&restored.map_or(El1State::reset(), |r| r.el1));
        if let Some(ram) = vm.ram() {
            vcpu::load_vm_controls(
                ram.vmid,
                ram.stage2_root(),
                vcpu as u64,
                vm.vgic().is_some(),
            );
        }
        vcpu::set_counter_offset(vm.counter_offset());
        if vm.vgic().is_some() {
            gic::reset_virtual_interface();
            if let Some(r) = restored {
                gic::load_virtual_interface(&r.vif);
            }
            let gic_version = vm.vgic().map_or(0, |v| match v.version() {
                crate::vgic::VgicVersion::V2 => 2,
                crate::vgic::VgicVersion::V3 => 3,
            });
            if vm
                .restored_vcpu(vcpu)
                .is_some_and(|s| s.timer_linked(gic_version))
            {
                // Listed linked to the physical timer interrupt, which the
                // hypervisor had taken and left active for the guest's
                // deactivation: make it so on this CPU too.
                gic::activate_private(crate::vgic::intid::VTIMER_PPI);
            }
        }
    }

    fn save_cpu_state(&self, gic: bool) -> (El1State, VirtualInterface) {
        let vif = if gic {
            gic::save_virtual_interface()
        } else {
            VirtualInterface::default()
        };
        (vcpu::save_el1(), vif)
    }

    #[inline]
    fn run_guest(&self, ctx: &mut GuestContext) -> VcpuExit {
        let vector = vcpu::run(ctx);
        decode(vector, ctx.esr, ctx.far, ctx.hpfar)
    }

    #[inline]
    fn memory_tick(&self) -> bool {
        memory_tick()
    }

    fn show(&self, pending: Pending) {
        show(Some(pending));
    }

    #[inline]
    fn show_live(&self, id: usize, echo: &Option<Echo>) {
        show_live(id, echo);
    }

    fn fail(&self, vm: &mut Vm, kind: InjectedFailure) -> ! {
        let mut frames = frames();
        if kind == InjectedFailure::BrokenFrames {
            // Half a transition: a counter moved, its frame did not.
            frames.break_for_test();
        }
        if kind == InjectedFailure::Abort {
            let bad = crate::mm::pagetable::VA_LIMIT as usize + 0x1234_5678;
            // SAFETY: deliberately faults (no map covers `bad`): the
            // exception handler contains it and never returns here.
            let v = unsafe { core::ptr::read_volatile(bad as *const u64) };
            // Not printed here: the VM's lock is held.
            let name = vm.name().clone();
            vm.out().line(format_args!(
                "tidal: [{name}] debug fail: unexpectedly read {v:#x}"
            ));
        }
        panic!("injected failure ('debug fail {}')", vm.name());
    }

    fn idle(&self) {
        zero_while_idle();
        // Any pending physical interrupt (even masked at EL2) ends the
        // wait; it is taken as soon as the guest runs again.
        aarch64::wait_for_interrupt_or(10_000);
    }

    fn wait_memory(&self) {
        aarch64::idle_wait(1_000);
    }

    #[inline]
    fn shell_look(&self, slept: bool, first: bool) -> bool {
        if !self.on_shell_cpu {
            return false;
        }
        let mut next = self.next_shell_look.get();
        let looked = !first && shell_look_due(slept, next);
        if first || looked {
            let wait_us = if looked { poll_shell() } else { SHELL_LOOK_US };
            schedule_shell_look(&mut next, wait_us);
            self.next_shell_look.set(next);
        }
        looked
    }
}

/// Whether a vCPU loop on the shell's CPU lets the shell look at the
/// console now: the console's interrupt took the guest out, the vCPU just
/// slept at EL2 (typing ends that sleep; the sleep used the EL2 timer), or
/// the time the last look asked for has come.
fn shell_look_due(after_sleep: bool, next: u64) -> bool {
    let input = HOST_SPI_TAKEN.load(Ordering::Relaxed);
    if !(input || after_sleep || aarch64::counter().0 >= next) {
        return false;
    }
    if input {
        HOST_SPI_TAKEN.store(false, Ordering::Relaxed);
    }
    true
}

/// The shell's next look in `micros`, with the EL2 timer armed for it: a
/// guest asleep in WFI on the shell's CPU does not exit for a second or
/// more on its own, and the shell (a statistics request it waits for, the
/// memory manager's tick) must not wait that long.
fn schedule_shell_look(next: &mut u64, micros: u64) {
    let (now, freq) = aarch64::counter();
    let period = crate::hw::timer::us_to_ticks(micros, freq);
    *next = now + period;
    aarch64::arm_el2_timer(period);
}

/// Physical interrupts taken while a guest ran, per CPU: kicks, the
/// maintenance interrupt, the EL2 timer, the guest's virtual timer, others.
static IRQS_TAKEN: [[AtomicU64; 5]; MAX_CPUS] =
    [const { [const { AtomicU64::new(0) }; 5] }; MAX_CPUS];

/// [`IRQS_TAKEN`] of CPU `cpu` (zeros for a CPU that does not exist).
pub fn interrupts_taken(cpu: usize) -> [u64; 5] {
    IRQS_TAKEN.get(cpu).map_or([0; 5], |c| {
        core::array::from_fn(|i| c[i].load(Ordering::Relaxed))
    })
}

fn count_taken(intid: u32) {
    let slot = match intid {
        KICK_SGI => 0,
        MAINTENANCE_PPI => 1,
        HYP_TIMER_PPI => 2,
        VTIMER_PPI => 3,
        32..1020 => {
            HOST_SPI_TAKEN.store(true, Ordering::Relaxed);
            4
        }
        _ => 4,
    };
    if let Some(c) = IRQS_TAKEN.get(aarch64::cpu_index()) {
        c[slot].fetch_add(1, Ordering::Relaxed);
    }
}

/// The VM whose console has the keyboard, if any (`console <vm>`).
static FOCUS: AtomicUsize = AtomicUsize::new(NO_VM);

/// Give the keyboard to VM `name`; false if there is no such VM.
pub fn focus(name: &str) -> bool {
    let found = with_vm(name, |vm| FOCUS.store(vm.id(), Ordering::Relaxed)).is_some();
    let focus = FOCUS.load(Ordering::Relaxed);
    for_each(|vm| {
        vm.set_focused(vm.id() == focus);
    });
    found
}

/// Whether a VM has the keyboard.
pub fn input_to_focus_active() -> bool {
    FOCUS.load(Ordering::Relaxed) != NO_VM
}

pub fn unfocus() {
    FOCUS.store(NO_VM, Ordering::Relaxed);
    for_each(|vm| {
        vm.unfocus();
    });
    crate::console::end_live_output();
}

/// Pass bytes typed to the focused VM; false when no VM has the keyboard.
/// They go into the guest's receive FIFO or waits in the VM's input queue
/// until the guest reads, so the shell never waits on a guest and a long
/// line (or a paste) arrives whole. A guest that reads nothing while the
/// queue fills loses what does not fit, as a UART would; the console says
/// so once per stretch of loss (Ctrl-] still gets through).
pub fn input_to_focus(bytes: &[u8]) -> bool {
    let id = FOCUS.load(Ordering::Relaxed);
    if id >= MAX_GUESTS {
        return false;
    }
    // One lock for the whole batch: the VM's vCPUs take this lock on every
    // exit (the guest reading those bytes among them), and under QEMU a
    // spinning waiter can hold up a preempted holder for a host time slice.
    let mut guard = lock_vm_for_service(id);
    let pending = guard.as_mut().and_then(|vm| {
        if vm.state() == VmState::Running {
            let kept = irq::console_input_bytes(vm, &mut TargetCpu::new(), bytes) == bytes.len();
            let was_losing = INPUT_LOST.swap(!kept, Ordering::Relaxed);
            if !kept && !was_losing {
                let (name, waiting) = (vm.name().clone(), vm.input_waiting());
                vm.out().line(format_args!(
                    "tidal: [{name}] console input lost: the guest read none of the last {waiting} bytes typed"
                ));
            }
        }
        take_pending(vm)
    });
    drop(guard);
    show(pending);
    true
}

/// The last byte typed for the focused VM found its input queue full.
static INPUT_LOST: AtomicBool = AtomicBool::new(false);

// ------------------------------------------------------------ memory manager

/// How often the memory manager ticks (oVirt MOM: 10 s; ChromeOS
/// concierge: 1 s; ours converges within 1 s of a demand spike).
pub const TICK_US: u64 = 100_000;

/// The memory manager and what its tick keeps between rounds. Lock order:
/// the manager, then a VM (taken as a service, before its vCPUs), then the
/// frame table.
pub struct MemoryManager {
    pub manager: Manager,
    /// Each VM's start count at the last tick: a VM that stopped or
    /// restarted since is forgotten.
    starts: [u64; MAX_GUESTS],
    managed: [bool; MAX_GUESTS],
    /// The last input read from each VM (reused while its lock is busy).
    inputs: [VmInput; MAX_GUESTS],
    /// `when_exhausted = "stop-lowest"`: stop the lowest-weight VM when a
    /// vCPU has waited [`manage::WAIT_BOUND_US`] for a frame.
    pub stop_lowest: bool,
    pub exhausted_stops: u64,
    /// When the last of them was stopped.
    last_exhausted_stop_us: Option<u64>,
}

static MANAGER: TicketMutex<Option<MemoryManager>> = TicketMutex::new(None);
/// The least time between two ticks, whatever the pool events.
pub const TICK_MIN_US: u64 = 10_000;

/// The counter value (CNTPCT) at which the next tick is due.
static NEXT_TICK: AtomicU64 = AtomicU64::new(0);
/// The counter value before which a pool event does not bring a tick.
static EARLIEST_TICK: AtomicU64 = AtomicU64::new(0);
/// The pool fell below its low watermark (or ran out): tick now.
static POOL_EVENT: AtomicBool = AtomicBool::new(false);
static POOL_LOW: AtomicU64 = AtomicU64::new(0);

/// Start the memory manager over the frame table (after [`init`]): guest
/// frames beyond a guarantee stop at the `min` watermark.
pub fn init_manager(watermarks: Watermarks, stop_lowest: bool) {
    frames().set_guest_floor(watermarks.min);
    POOL_LOW.store(watermarks.low, Ordering::Relaxed);
    *lock_manager() = Some(MemoryManager {
        manager: Manager::new(watermarks, Tunables::default()),
        starts: [0; MAX_GUESTS],
        managed: [false; MAX_GUESTS],
        inputs: [VmInput::default(); MAX_GUESTS],
        stop_lowest,
        exhausted_stops: 0,
        last_exhausted_stop_us: None,
    });
}

fn lock_manager() -> Tracked<TicketMutexGuard<'static, Option<MemoryManager>>> {
    Tracked::new(MANAGER.lock(), held::MANAGER)
}

/// Call `f` with the memory manager (the `mm` and `set` commands).
pub fn with_manager<R>(f: impl FnOnce(&mut MemoryManager) -> R) -> Option<R> {
    lock_manager().as_mut().map(f)
}

/// One tick of the memory manager if one is due (every [`TICK_US`], or at
/// once after a pool event), from any CPU's loop with no lock held. One
/// CPU ticks at a time; the others go on at once. A VM's lock is waited
/// for as a service waits ([`ServiceFirst`]: one exit per vCPU at most),
/// so no VM escapes the manager by keeping its lock busy. Whether this CPU
/// ticked: a target it set raises an interrupt without kicking this CPU
/// (its own), so a vCPU loop must sync its list registers before it
/// enters the guest again.
#[inline]
pub fn memory_tick() -> bool {
    // The fast path runs after every exit: a counter read and a compare,
    // no division (the time in microseconds is worked out only when due).
    let (count, freq) = aarch64::counter();
    let due = NEXT_TICK.load(Ordering::Relaxed);
    // A pool event brings the tick forward, but not closer than
    // TICK_MIN_US to the last: below `low` nearly every allocation raises
    // one.
    let event =
        POOL_EVENT.load(Ordering::Relaxed) && count >= EARLIEST_TICK.load(Ordering::Relaxed);
    if count < due && !event {
        return false;
    }
    let period = freq.saturating_mul(TICK_US) / 1_000_000;
    if NEXT_TICK
        .compare_exchange(
            due,
            count + period.max(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .is_err()
    {
        return false;
    }
    let gap = freq.saturating_mul(TICK_MIN_US) / 1_000_000;
    EARLIEST_TICK.store(count.saturating_add(gap), Ordering::Relaxed);
    tick_now();
    true
}

/// The tick itself, once [`memory_tick`] found it due: zeroing ahead's
/// decision and the memory manager's round, each a board service in its
/// own failure domain ([`run_service`]).
#[inline(never)]
fn tick_now() {
    let now = aarch64::uptime_us();
    POOL_EVENT.store(false, Ordering::Relaxed);
    run_service(Service::Zeroing, || {
        if take_injected(INJECT_ZEROING) {
            panic!("injected failure ('debug fail-board zeroing')");
        }
        update_zeroing_wanted();
    });
    run_service(Service::Manager, || manager_tick(now));
}

/// A failure injected into the next tick (`debug fail-board`,
/// `debug fail-input`): [`NO_INJECTION`], [`INJECT_MANAGER`],
/// [`INJECT_ZEROING`], or the id of the VM whose input fails.
static INJECTED: AtomicUsize = AtomicUsize::new(NO_INJECTION);
const NO_INJECTION: usize = usize::MAX;
const INJECT_MANAGER: usize = usize::MAX - 1;
const INJECT_ZEROING: usize = usize::MAX - 2;

fn take_injected(what: usize) -> bool {
    INJECTED
        .compare_exchange(what, NO_INJECTION, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// Make the next tick fail in `into` (`debug fail-board`, `debug
/// fail-input`).
pub fn inject_service_failure(into: domain::InjectInto) {
    let code = match into {
        domain::InjectInto::Manager => INJECT_MANAGER,
        domain::InjectInto::Zeroing => INJECT_ZEROING,
        domain::InjectInto::Input(id) => id,
    };
    INJECTED.store(code, Ordering::Release);
    // Tick at the next chance.
    POOL_EVENT.store(true, Ordering::Relaxed);
}

/// The memory manager's round: read every VM's input, decide, apply. Each
/// VM's part runs in that VM's failure domain ([`for_vm_input`]): a VM
/// whose input makes the hypervisor fail is stopped, and the round goes
/// on with the others. Every VM is seen each round: a service goes before
/// its vCPUs ([`ServiceFirst`]).
fn manager_tick(now: u64) {
    let Some(guard) = MANAGER.try_lock() else {
        return;
    };
    let mut guard = Tracked::new(guard, held::MANAGER);
    let Some(mm) = guard.as_mut() else { return };
    if take_injected(INJECT_MANAGER) {
        panic!("injected failure ('debug fail-board mm')");
    }
    let mut longest_wait = 0;
    let mut failed = [false; MAX_GUESTS];
    // Short of memory, the manager asks for fresh statistics rather than
    // deciding on a sample up to a poll interval old.
    let short = frames().unreserved_free() < mm.manager.watermarks().low;
    for (id, failed) in failed.iter_mut().enumerate() {
        if held_long(id) {
            continue;
        }
        let read = for_vm_input(Service::Manager, id, || {
            let mut vm_guard = lock_vm_for_service(id);
            let vm = vm_guard.as_mut()?;
            if take_injected(id) {
                panic!("injected failure ('debug fail-input {}')", vm.name());
            }
            irq::flush_vconsole(vm, &mut TargetCpu::new());
            if short {
                manage::want_fresh_stats(vm, now);
            }
            Some((
                manage::is_managed(vm),
                vm.starts(),
                manage::input(vm),
                manage::longest_wait_us(vm, now).unwrap_or(0),
            ))
        });
        match read {
            Ok(Some((managed, starts, input, wait))) => {
                if (mm.managed[id] && !managed) || starts != mm.starts[id] {
                    mm.manager.forget(id);
                }
                mm.managed[id] = managed;
                mm.starts[id] = starts;
                mm.inputs[id] = input;
                longest_wait = longest_wait.max(wait);
            }
            Ok(None) => {}
            Err(_) => {
                *failed = true;
                mm.manager.forget(id);
                mm.managed[id] = false;
                mm.inputs[id] = VmInput::default();
            }
        }
    }
    let pool = frames().unreserved_free();
    let decisions = mm.manager.tick(now, pool, &mm.inputs);
    for (id, target) in decisions.targets.iter().enumerate() {
        let Some(target) = *target else { continue };
        if failed.get(id).copied().unwrap_or(true) || held_long(id) {
            continue;
        }
        let applied = for_vm_input(Service::Manager, id, || {
            let mut vm_guard = lock_vm_for_service(id);
            let vm = vm_guard.as_mut()?;
            manage::apply(vm, &mut TargetCpu::new(), target);
            take_pending(vm)
        });
        match applied {
            Ok(pending) => show(pending),
            Err(_) => failed[id] = true,
        }
    }
    for (id, _) in failed.iter().enumerate().filter(|(_, &f)| f) {
        stop_for_failed_input(id);
    }
    // A VM giving memory back may take frames from the upper half of the
    // reserve (`Manager::may_dip`): parked at the floor, it could not.
    {
        let mut table = frames();
        for (id, input) in mm.inputs.iter().enumerate() {
            table.set_inflating(id, input.size > 0 && mm.manager.may_dip(id));
        }
    }
    // One stop per bound at most: the memory of the VM just stopped needs
    // a moment to reach the vCPUs that waited for it.
    let due = manage::escalation_due(now, longest_wait, mm.last_exhausted_stop_us);
    if mm.stop_lowest && due && stop_lowest_weight() {
        mm.exhausted_stops += 1;
        mm.last_exhausted_stop_us = Some(now);
        mm.manager.escalated();
    }
}

/// Stop VM `id`: its input made the hypervisor fail in a board service.
fn stop_for_failed_input(id: usize) {
    let mut guard = lock_vm_for_service(id);
    let Some(vm) = guard.as_mut() else { return };
    if vm.state() == VmState::Running {
        lifecycle::stop_for_failure(vm, &mut TargetCpu::new(), INPUT_FAILURE);
    }
    let pending = take_pending(vm);
    drop(guard);
    show(pending);
}

/// Why a VM stopped whose input made a board service fail.
const INPUT_FAILURE: &str = "a hypervisor failure handling its input to the memory manager";

/// The pool is exhausted and a vCPU has waited the bound: stop the running
/// VM with the lowest weight (the furthest above its `low` among equals), unless a VM
/// is already stopping. True if one was stopped.
fn stop_lowest_weight() -> bool {
    let mut running = [None; MAX_GUESTS];
    for (id, slot) in running.iter_mut().enumerate() {
        let vm_guard = lock_vm_for_service(id);
        let Some(vm) = vm_guard.as_ref() else {
            continue;
        };
        match vm.state() {
            VmState::StopRequested => return false,
            VmState::Running => {}
            _ => continue,
        }
        let backed = vm.ram().map_or(0, |r| r.mapped_pages());
        let limits = vm.managed().limits();
        *slot = Some(manage::StopCandidate {
            weight: limits.weight,
            backed,
            low: limits.low,
        });
    }
    let victim = manage::lowest_weight(&running);
    let Some(id) = victim else {
        return false;
    };
    let mut vm_guard = lock_vm_for_service(id);
    let Some(vm) = vm_guard.as_mut() else {
        return false;
    };
    let name = vm.name().clone();
    vm.out().line(format_args!(
        "tidal: [{name}] stopping the VM: the pool is exhausted, a vCPU has waited {} s for memory, and it has the lowest weight (when_exhausted = \"stop-lowest\", the default)",
        manage::WAIT_BOUND_US / 1_000_000
    ));
    lifecycle::begin_stop(
        vm,
        &mut TargetCpu::new(),
        "stopped by the memory manager: the pool was exhausted",
        false,
    );
    let pending = take_pending(vm);
    drop(vm_guard);
    show(pending);
    true
}

/// What the shell shows of the memory manager, if it runs.
pub fn manager_facts() -> Option<crate::console::commands::ManagerFacts> {
    with_manager(|mm| crate::console::commands::ManagerFacts {
        watermarks: mm.manager.watermarks(),
        policy: mm.manager.policy(),
        stop_lowest: mm.stop_lowest,
        exhausted_stops: mm.exhausted_stops,
        stats: mm.manager.stats(),
        vms: core::array::from_fn(|id| mm.manager.vm_stats(id)),
    })
}
