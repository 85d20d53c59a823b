//! The VM table and the vCPU loop (target only).
//!
//! Each VM sits behind its own lock in [`VMS`]; its one vCPU runs on the
//! physical CPU its configuration pins it to. That CPU's loop enters the
//! guest, decodes each exit ([`super::exit`]), handles it under the VM's
//! lock (MMIO to the console or the balloon, stage-2 faults in RAM, PSCI,
//! WFI/WFE) and enters again. The shell on CPU 0 changes a VM only through
//! its lock: a stop is requested and carried out by the vCPU's CPU at its
//! next exit. Lock order: a VM, then the frame table.
//!
//! A bad access (a device register access the device refuses, an address
//! that is neither RAM nor a device, an unemulated system register) gets
//! what the VM's policy says ([`super::fault`]): by default an exception
//! injected into the guest ([`super::inject`]), else the VM stops. Every
//! hypervisor console line about a VM starts `tidal: [name] `; those a
//! guest can trigger go through the VM's rate limit ([`say`]).

use core::fmt::Write as _;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use guest_bundle::Bundle;
use spin::mutex::{TicketMutex, TicketMutexGuard};
use spin::{Mutex, MutexGuard};

use super::console::ConsoleLine;
use super::exit::{decode, il32, load_result, FaultKind, VcpuExit};
use super::fault::{BadAccessKind, BadAccessStats, Device, OnBadAccess};
use super::fdt::{self, layout, GicVersion, GuestBoard};
use super::memory::{GuestRam, HostMemory, RamError};
use super::ratelimit::{GuestLines, LineKind, Permit};
use crate::arch::aarch64::gic;
use crate::arch::aarch64::vcpu::{self, El1Regs, GuestContext};
use crate::arch::aarch64::{self, pmu, recovery, MAX_CPUS};
use crate::balloon::{Balloon, HintError, HintRun};
use crate::held::{self, Tracked};
use crate::mm::frames::{FrameError, FrameTable, FrameUse, PAGE_SIZE};
use crate::mm::stage2::TableMemory;
use crate::pl011::Pl011;
use crate::vgic::{
    VDistributor, VgicVersion, GICR_STRIDE, GICV3_DIST_WINDOW, ICC_ASGI1R_EL1, ICC_SGI0R_EL1,
    ICC_SGI1R_EL1,
};
use crate::virtio::mmio::MmioTransport;
use crate::virtio::{GuestMemError, GuestMemory};

/// List registers tracked per vCPU (GICv2 has at most 64; boards have 4).
const MAX_LRS: usize = 16;
/// SPIs the guest's distributor has: the PL011 (1) and virtio devices (16..).
const GUEST_SPIS: u32 = 64;
/// The guest's PL011 and first virtio-mmio device, as INTIDs.
const UART_INTID: u32 = 32 + layout::UART_SPI;
const VIRTIO_INTID: u32 = 32 + layout::VIRTIO_SPI_BASE;
/// Why a VM stopped after a hypervisor failure in its path.
const FAILURE: &str = "a hypervisor failure in this VM's path";

/// The VM and vCPU each physical CPU is inside (between entering its run
/// loop and `leave`), or NO_VM: what a failure there must leave for it.
static ENTERED: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(NO_VM) }; MAX_CPUS];
/// Whether each CPU is ending a failed VM ([`end_failed_vm`]): a failure
/// then is the second, and the VM's frames are left accounted to it.
static ENDING: [core::sync::atomic::AtomicBool; MAX_CPUS] =
    [const { core::sync::atomic::AtomicBool::new(false) }; MAX_CPUS];

/// Physical address of the GICV page the guests' GICC maps to (0: none).
static GICV: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

/// Whether guests get a GICv3 (the host has one with the ICH interface).
static GIC_V3: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Guests get a virtual GICv2 whose CPU interface is the host's GICV page
/// at `pa` (the host has a GICv2 with GICH and GICV).
pub fn set_gicv(pa: u64) {
    GICV.store(pa, Ordering::Relaxed);
}

/// Guests get a virtual GICv3 (the host has a GICv3: its virtual CPU
/// interface is the ICC_* system registers, nothing to map).
pub fn set_gic_v3() {
    GIC_V3.store(true, Ordering::Relaxed);
}

/// The GIC guests see, if any.
fn guest_gic() -> Option<GicVersion> {
    if GIC_V3.load(Ordering::Relaxed) {
        Some(GicVersion::V3)
    } else if GICV.load(Ordering::Relaxed) != 0 {
        Some(GicVersion::V2)
    } else {
        None
    }
}
use crate::{print, println};

/// Most VMs a bundle may describe.
pub const MAX_GUESTS: usize = 8;
/// Most vCPUs per VM.
pub const MAX_VCPUS: usize = 4;

/// A vCPU's power state, as PSCI sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Power {
    Off,
    /// CPU_ON accepted: enter at `entry` with x0 = `context`.
    Starting {
        entry: u64,
        context: u64,
    },
    On,
}

/// `CPU_VM` packs a VM and a vCPU index.
fn encode(id: usize, vcpu: usize) -> usize {
    id * MAX_VCPUS + vcpu
}
const NO_VM: usize = usize::MAX;
/// Where a guest kernel's 2 MiB-aligned base is, above the device tree.
const KERNEL_OFFSET: u64 = 2 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmState {
    Stopped,
    Running,
    /// The shell asked for a stop; the vCPU's CPU carries it out.
    StopRequested,
    /// A hypervisor failure in its path, and freeing its pages failed too:
    /// its frames stay accounted to it (`check` reports them); it cannot
    /// be started again.
    Failed,
}

impl VmState {
    pub fn label(self) -> &'static str {
        match self {
            VmState::Stopped => "stopped",
            VmState::Running => "running",
            VmState::StopRequested => "stopping",
            VmState::Failed => "failed",
        }
    }
}

/// Exit counters, per VM.
#[derive(Clone, Copy, Default)]
pub struct ExitStats {
    pub mmio: u64,
    pub hvc: u64,
    pub wfx: u64,
    /// Trapped system-register accesses (GICv3 SGIs).
    pub sysreg: u64,
    pub faults: u64,
    /// EL2 instructions over all exits (when the PMU counts them).
    pub instructions: u64,
    pub total: u64,
}

/// One move of the balloon to a new target, measured for `info balloon`
/// and the benchmark.
#[derive(Clone, Copy, Debug)]
pub struct BalloonChange {
    pub from: u32,
    pub to: u32,
    /// CNTPCT when the target was set, and when the driver reported it reached.
    pub started: u64,
    pub ended: u64,
    /// Hypervisor (EL2) instructions spent on the change's exits: balloon
    /// register accesses and faults backing RAM, world switch included.
    pub instructions: u64,
    pub exits: u64,
}

impl BalloonChange {
    pub fn pages(&self) -> u64 {
        u64::from(self.from.abs_diff(self.to))
    }
}

pub struct Vm {
    /// The virtual GIC distributor (GICv2 hosts; the CPU interface is the
    /// hardware GICV page mapped at the guest's GICC).
    pub vgic: Option<VDistributor>,
    /// Which INTID each list register of each vCPU holds.
    pub listed: [[Option<u32>; MAX_LRS]; MAX_VCPUS],
    /// vCPUs, the physical CPU each is pinned to, and whether each is on.
    pub vcpus: usize,
    pub cpus: [usize; MAX_VCPUS],
    power: [Power; MAX_VCPUS],
    /// vCPUs inside their run loop: RAM is freed only when none is.
    inside: usize,
    /// Start again once every vCPU has left (PSCI SYSTEM_RESET).
    restart: bool,
    pub id: usize,
    pub name: heapless::String<32>,
    pub state: VmState,
    /// The physical CPU the vCPU is pinned to.
    pub cpu: usize,
    pub ram_size: u64,
    pub ram: Option<GuestRam>,
    pub balloon: Option<MmioTransport<Balloon>>,
    pub console: ConsoleLine,
    /// The emulated PL011 the guest's console driver talks to.
    pub uart: Pl011,
    pub exits: ExitStats,
    /// Why the VM last stopped.
    pub last_stop: &'static str,
    /// The balloon change in progress (from `set_balloon` until the driver
    /// reports the target reached), and the last one completed.
    pub change: Option<BalloonChange>,
    pub last_change: Option<BalloonChange>,
    /// The balloon's counters when the VM last stopped.
    pub last_balloon_stats: Option<crate::balloon::BalloonStats>,
    pub starts: u64,
    /// `debug fail <vm> [abort]`: fail in this VM's path at its next exit,
    /// by a panic (false) or a data abort at EL2 (true).
    pub inject_failure: Option<bool>,
    /// What the guest gets for a bad access (its configuration's `on_bad_access`).
    pub on_bad_access: OnBadAccess,
    /// Exceptions injected for bad accesses, per kind.
    pub bad_access: BadAccessStats,
    /// The rate limits of the console lines the guest can trigger.
    pub lines: GuestLines,
}

/// Ticket locks: a vCPU exiting in a tight loop must not starve the shell.
static VMS: [TicketMutex<Option<Vm>>; MAX_GUESTS] = [const { TicketMutex::new(None) }; MAX_GUESTS];
/// The VM each physical CPU runs, or NO_VM.
static CPU_VM: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(NO_VM) }; MAX_CPUS];
static BUNDLE: spin::Once<Bundle<'static>> = spin::Once::new();
static FRAMES: spin::Once<&'static Mutex<FrameTable<'static>>> = spin::Once::new();

/// The host side of guest memory on the target: frames from the frame table
/// (locked per operation, never across a whole request), tables and data
/// through the EL2 identity map.
struct HostMem;

pub(super) fn frames() -> Tracked<MutexGuard<'static, FrameTable<'static>>> {
    let table = FRAMES.get().expect("VMs are set up after the frame table");
    Tracked::new(table.lock(), held::FRAMES)
}

/// VM `id`'s lock, marked held by this CPU (`crate::held`) so that a
/// failure can release it.
fn lock_vm(id: usize) -> Tracked<TicketMutexGuard<'static, Option<Vm>>> {
    Tracked::new(VMS[id].lock(), held::vm(id))
}

fn zero_and_clean(pa: u64) {
    // SAFETY: `pa` is a whole frame the frame table just handed to us,
    // identity-mapped as normal memory.
    unsafe { core::ptr::write_bytes(pa as *mut u8, 0, PAGE_SIZE as usize) };
    // A guest with its MMU off reads memory uncached: make it see the zeros.
    aarch64::clean_dcache_range(pa as usize, PAGE_SIZE as usize);
}

impl TableMemory for HostMem {
    fn alloc_table(&mut self) -> Option<u64> {
        let pa = frames().alloc(1, 1, FrameUse::PageTables)?;
        zero_and_clean(pa);
        Some(pa)
    }
    fn free_table(&mut self, pa: u64) -> Result<(), FrameError> {
        frames().free(pa, 1, FrameUse::PageTables)
    }
    fn table(&mut self, pa: u64) -> &mut [u64; 512] {
        // SAFETY: `pa` is a table frame this VM's stage 2 owns (frame table
        // use PageTables), identity-mapped; the VM's lock serialises access.
        unsafe { &mut *(pa as *mut [u64; 512]) }
    }
}

impl HostMemory for HostMem {
    fn alloc_frame(&mut self, vm: usize) -> Option<u64> {
        let pa = frames().alloc_guest(vm)?;
        zero_and_clean(pa);
        Some(pa)
    }
    fn free_frame(&mut self, vm: usize, pa: u64) -> Result<(), FrameError> {
        frames().free_guest(vm, pa)
    }
    fn read(&mut self, pa: u64, buf: &mut [u8]) {
        // SAFETY: `pa..pa + len` lies in one frame of this VM (GuestRam
        // splits at pages), identity-mapped.
        unsafe { core::ptr::copy_nonoverlapping(pa as *const u8, buf.as_mut_ptr(), buf.len()) };
    }
    fn write(&mut self, pa: u64, data: &[u8]) {
        // SAFETY: as in `read`.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), pa as *mut u8, data.len()) };
        aarch64::clean_dcache_range(pa as usize, data.len());
    }
    fn flush_tlb(&mut self, vmid: u16) {
        vcpu::flush_vm_tlb(vmid);
        // The frames unmapped are about to go back to the pool: no stale
        // instruction line of this VM may reach the VM that gets them next
        // (no CPU can fetch from them any more, so none comes back).
        aarch64::invalidate_icache_all();
    }
    fn frame_owner(&self, pa: u64) -> Option<usize> {
        frames().guest_owner(pa)
    }
    fn frames_owned(&self, vm: usize) -> u64 {
        frames().guest_pages(vm)
    }
}

/// Guest memory as a device sees it: this VM's RAM only.
pub struct DeviceView<'a> {
    pub ram: &'a mut GuestRam,
}

impl GuestMemory for DeviceView<'_> {
    fn read(&mut self, ipa: u64, buf: &mut [u8]) -> Result<(), GuestMemError> {
        self.ram
            .read(&mut HostMem, ipa, buf)
            .map_err(|_| GuestMemError {
                ipa,
                len: buf.len(),
            })
    }
    fn write(&mut self, ipa: u64, data: &[u8]) -> Result<(), GuestMemError> {
        self.ram
            .write(&mut HostMem, ipa, data)
            .map_err(|_| GuestMemError {
                ipa,
                len: data.len(),
            })
    }
}

impl crate::balloon::BalloonBackend for DeviceView<'_> {
    fn ram_pfns(&self) -> core::ops::Range<u64> {
        self.ram.pfns()
    }
    fn inflate(&mut self, pfns: &[u64]) {
        self.ram.release(&mut HostMem, pfns);
    }
    fn deflate(&mut self, _pfns: &[u64]) {
        // Nothing to do now: each page is backed again (zeroed or poisoned)
        // on its next access.
    }
    fn now_us(&self) -> Option<u64> {
        Some(aarch64::uptime_us())
    }
    fn report(&mut self, blocks: &[core::ops::Range<u64>]) {
        self.ram.release_blocks(&mut HostMem, blocks);
    }
    fn hint(&mut self, blocks: &[core::ops::Range<u64>]) {
        self.ram.release_blocks(&mut HostMem, blocks);
    }
}

/// Register the bundle's VMs (all stopped) and the frame table they draw from.
pub fn init(bundle: Bundle<'static>, frame_table: &'static Mutex<FrameTable<'static>>) {
    FRAMES.call_once(|| frame_table);
    let bundle = BUNDLE.call_once(|| bundle);
    for (id, spec) in bundle.vms().enumerate().take(MAX_GUESTS) {
        let cpu = spec.cpu_affinity().trailing_zeros() as usize;
        let mut name = heapless::String::new();
        let _ = name.push_str(spec.name());
        let mut cpus = [usize::MAX; MAX_VCPUS];
        let mut vcpus = 0;
        for bit in 0..64 {
            if spec.cpu_affinity() & (1 << bit) != 0 && vcpus < MAX_VCPUS {
                cpus[vcpus] = bit;
                vcpus += 1;
            }
        }
        *lock_vm(id) = Some(Vm {
            vgic: None,
            listed: [[None; MAX_LRS]; MAX_VCPUS],
            vcpus: vcpus.max(1),
            cpus,
            power: [Power::Off; MAX_VCPUS],
            inside: 0,
            restart: false,
            id,
            name,
            state: VmState::Stopped,
            cpu,
            ram_size: spec.ram_size(),
            ram: None,
            balloon: None,
            console: ConsoleLine::new(),
            uart: Pl011::new(),
            exits: ExitStats::default(),
            last_stop: "not started yet",
            last_balloon_stats: None,
            change: None,
            last_change: None,
            starts: 0,
            inject_failure: None,
            on_bad_access: OnBadAccess::from_code(spec.on_bad_access()).unwrap_or_default(),
            bad_access: BadAccessStats::default(),
            lines: GuestLines::new(),
        });
    }
    if bundle.vm_count() > MAX_GUESTS {
        println!("only the first {MAX_GUESTS} VMs of the bundle are used");
    }
}

/// Call `f` on every VM, in table order.
pub fn for_each(mut f: impl FnMut(&mut Vm)) {
    for id in 0..MAX_GUESTS {
        if let Some(vm) = lock_vm(id).as_mut() {
            f(vm);
        }
    }
}

/// Call `f` on the VM called `name`; `None` if there is none.
pub fn with_vm<R>(name: &str, f: impl FnOnce(&mut Vm) -> R) -> Option<R> {
    for id in 0..MAX_GUESTS {
        let mut guard = lock_vm(id);
        if let Some(vm) = guard.as_mut().filter(|vm| vm.name == name) {
            return Some(f(vm));
        }
    }
    None
}

/// The names of all VMs, for error messages.
pub fn names() -> heapless::String<128> {
    let mut s = heapless::String::new();
    for_each(|vm| {
        if !s.is_empty() {
            let _ = s.push_str(", ");
        }
        let _ = s.push_str(&vm.name);
    });
    s
}

/// The `check` command: every VM is locked (in table order; nothing else
/// holds two VM locks) while its stage-2 tables are walked and the frame
/// table is read, so the figures are one snapshot. `ram_bytes`: the
/// board's RAM.
pub fn check_system(ram_bytes: u64, out: &mut impl core::fmt::Write) {
    let guards: [_; MAX_GUESTS] = core::array::from_fn(lock_vm);
    let facts = super::check::FrameFacts::of(&frames(), ram_bytes);
    let vms: heapless::Vec<super::check::VmFacts<'_>, MAX_GUESTS> = guards
        .iter()
        .filter_map(|g| g.as_ref())
        .map(|vm| super::check::VmFacts {
            id: vm.id,
            name: &vm.name,
            stopped: vm.state == VmState::Stopped,
            ram: vm.ram.as_ref(),
        })
        .collect();
    let result = super::check::check(&facts, &vms, &mut HostMem);
    let _ = super::check::write_result(out, &result);
}

/// Build a VM's memory and devices and hand it to its CPU.
pub fn start(vm: &mut Vm) -> Result<(), &'static str> {
    if vm.state == VmState::Failed {
        return Err("a hypervisor failure left its frames unfreed (see 'check')");
    }
    if vm.state != VmState::Stopped {
        return Err("it is already running");
    }
    let cpus_ok = vm.cpus[..vm.vcpus].iter().all(|&c| {
        c != 0 && c < MAX_CPUS && aarch64::smp::state(c) == aarch64::smp::CpuState::Online
    });
    if !cpus_ok {
        return Err("a CPU it is pinned to is not online (or is CPU 0, which runs the shell)");
    }
    if vm.inside > 0 {
        return Err("its vCPUs are still leaving; try again");
    }
    let spec = BUNDLE
        .get()
        .and_then(|b| b.vm(vm.id))
        .ok_or("it is not in the bundle")?;
    if spec.vcpus() as usize != vm.vcpus || vm.vcpus > MAX_VCPUS {
        return Err("its vCPU count and CPU list disagree, or it asks for more than 4 vCPUs");
    }
    let mut mem = HostMem;
    let vmid = vm.id as u16 + 1;
    let mut ram = GuestRam::new(&mut mem, vm.id, vmid, layout::RAM_BASE, spec.ram_size())
        .map_err(|_| "no memory")?;
    if let Err(e) = ram.populate(&mut mem) {
        println!("tidal: [{}] {e}", vm.name);
        give_back(&vm.name, ram);
        return Err("not enough free memory for its RAM");
    }
    let gicv = GICV.load(Ordering::Relaxed);
    vm.vgic = None;
    vm.listed = [[None; MAX_LRS]; MAX_VCPUS];
    vm.power = [Power::Off; MAX_VCPUS];
    vm.power[0] = Power::On;
    vm.restart = false;
    vm.uart.reset();
    if gicv != 0 {
        // The guest's GICC (8 KiB) is the hardware virtual CPU interface.
        let mapped = (0..2u64).try_for_each(|page| {
            ram.map_device(
                &mut mem,
                layout::GICC_BASE + page * PAGE_SIZE,
                gicv + page * PAGE_SIZE,
            )
        });
        if mapped.is_err() {
            give_back(&vm.name, ram);
            return Err("its GIC CPU interface cannot be mapped");
        }
        vm.vgic = VDistributor::new(vm.vcpus, GUEST_SPIS).ok();
    } else if guest_gic() == Some(GicVersion::V3) {
        vm.vgic = VDistributor::new_v3(vm.vcpus, GUEST_SPIS).ok();
    }
    if let Err(why) = load_images(&mut ram, &spec) {
        give_back(&vm.name, ram);
        return Err(why);
    }
    vm.balloon = None;
    if spec.has_balloon() {
        match Balloon::new(spec.balloon_features(), ram.pfns()) {
            Ok(balloon) => vm.balloon = Some(MmioTransport::new(balloon)),
            Err(e) => {
                println!("tidal: [{}] no balloon device: {e}", vm.name);
            }
        }
    }
    vm.ram = Some(ram);
    vm.state = VmState::Running;
    vm.starts += 1;
    CPU_VM[vm.cpus[0]].store(encode(vm.id, 0), Ordering::Release);
    wake_cpu(vm.cpus[0]);
    Ok(())
}

/// Copy the kernel (and initrd) into RAM and write the device tree below it.
fn load_images(ram: &mut GuestRam, spec: &guest_bundle::VmEntry<'_>) -> Result<(), &'static str> {
    let mut mem = HostMem;
    let kernel = spec.kernel();
    // An arm64 Image says where in its 2 MiB block it wants to be.
    let text_offset = if kernel.len() >= 64 && kernel[56..60] == *b"ARM\x64" {
        u64::from_le_bytes(kernel[8..16].try_into().unwrap_or([0; 8])) & 0x1f_ffff
    } else {
        0
    };
    let kernel_ipa = layout::RAM_BASE + KERNEL_OFFSET + text_offset;
    ram.write(&mut mem, kernel_ipa, kernel)
        .map_err(|_| "its kernel does not fit in its RAM")?;
    let mut board = GuestBoard::standard(
        spec.ram_size(),
        spec.vcpus(),
        guest_gic().unwrap_or(GicVersion::V2),
        spec.has_balloon() as usize,
    )
    .map_err(|_| "its virtual board cannot be described")?;
    board.bootargs = spec.cmdline();
    if let Some(initrd) = spec.initrd() {
        // Past the kernel's whole footprint (image_size includes its .bss).
        let image_size = if kernel.len() >= 64 && kernel[56..60] == *b"ARM\x64" {
            u64::from_le_bytes(kernel[16..24].try_into().unwrap_or([0; 8]))
        } else {
            0
        };
        // image_size comes from the bundle's kernel header: checked.
        let footprint = image_size.max(kernel.len() as u64);
        let too_big = "its initrd does not fit in its RAM";
        let start = kernel_ipa
            .checked_add(footprint)
            .and_then(|end| end.checked_next_multiple_of(2 << 20))
            .ok_or(too_big)?;
        ram.write(&mut mem, start, initrd).map_err(|_| too_big)?;
        let end = start.checked_add(initrd.len() as u64).ok_or(too_big)?;
        board.initrd = Some((start, end));
    }
    let dtb = fdt::build(&board).map_err(|_| "its device tree cannot be built")?;
    if dtb.len() as u64 > KERNEL_OFFSET {
        return Err("its device tree is larger than 2 MiB");
    }
    ram.write(&mut mem, layout::RAM_BASE, &dtb)
        .map_err(|_| "its device tree does not fit")?;
    // Every write above was cleaned by VA to the point of coherency
    // (`HostMem::write`); the kernel's instruction fetches must see it too
    // on a CPU with separate instruction caches (a Cortex-A72), before any
    // vCPU of the VM runs.
    aarch64::invalidate_icache_all();
    Ok(())
}

/// Begin stopping a VM: every vCPU leaves at its next exit (the others are
/// kicked), and the last one out gives the pages back ([`finish_stop`]).
fn begin_stop(vm: &mut Vm, why: &'static str, restart: bool) {
    if vm.state != VmState::StopRequested {
        vm.last_stop = why;
    }
    vm.state = VmState::StopRequested;
    vm.restart |= restart;
    let me = aarch64::cpu_index();
    for v in 0..vm.vcpus {
        if vm.power[v] != Power::Off && vm.cpus[v] != me {
            gic::kick(vm.cpus[v]);
        }
    }
    if vm.inside == 0 {
        finish_stop(vm);
    }
}

/// Free a VM's RAM; the pages returned to the pool. Frames the frame table
/// refuses (a hypervisor bug) stay accounted to the VM and are reported.
fn give_back(name: &str, ram: GuestRam) -> u64 {
    let teardown = ram.destroy(&mut HostMem);
    if let Some(e) = teardown.error {
        println!(
            "tidal: [{name}] {} frames could not be returned to the pool and stay accounted to it (a hypervisor bug; 'check' shows them): {e}",
            teardown.leaked
        );
    }
    teardown.freed
}

/// Every vCPU has left: flush the console, give every page back, say why,
/// and start again if the guest asked for a reset.
fn finish_stop(vm: &mut Vm) {
    if let Some(line) = vm.console.flush() {
        println!("[{}] {line}", vm.name);
    }
    let suppressed = vm.lines.take_suppressed();
    if suppressed > 0 {
        println!(
            "tidal: [{}] {suppressed} similar messages suppressed",
            vm.name
        );
    }
    let why = vm.last_stop;
    if let Some(ram) = vm.ram.take() {
        let freed = give_back(&vm.name, ram);
        println!(
            "tidal: [{}] VM stopped: {why}; {freed} pages returned to the pool",
            vm.name
        );
    }
    vm.last_balloon_stats = vm.balloon.take().map(|b| *b.device().stats());
    vm.vgic = None;
    vm.power = [Power::Off; MAX_VCPUS];
    vm.state = VmState::Stopped;
    if core::mem::take(&mut vm.restart) {
        if let Err(e) = start(vm) {
            println!("tidal: [{}] cannot restart: {e}", vm.name);
        }
    }
}

/// `debug fail <vm> [abort]`: make the VM's next exit fail (a panic, or a
/// data abort at EL2, with the VM's lock and the frame table held), to show
/// that only this VM ends.
pub fn inject_failure(vm: &mut Vm, abort: bool) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running");
    }
    vm.inject_failure = Some(abort);
    // An exit soon, even from a guest asleep in WFI.
    gic::kick(vm.cpus[0]);
    Ok(())
}

/// Ask a running VM to stop; its vCPUs stop at their next exit.
pub fn request_stop(vm: &mut Vm) -> Result<(), &'static str> {
    match vm.state {
        VmState::Stopped | VmState::Failed => Err("it is not running"),
        VmState::StopRequested | VmState::Running => {
            begin_stop(vm, "stopped from the shell", false);
            Ok(())
        }
    }
}

/// Wake an idle CPU that was just given a vCPU (see `aarch64::idle_wait`).
fn wake_cpu(cpu: usize) {
    // SAFETY: SEV only wakes CPUs waiting in WFE (hosts without our GIC).
    unsafe { core::arch::asm!("sev", options(nomem, nostack)) };
    gic::kick(cpu);
}

/// The loop of a CPU that runs vCPUs: wait for one, run it until it stops.
/// The vCPU runs under a recovery point: a hypervisor failure in its path
/// comes back here ([`contain_failure`]) and ends only that VM.
pub fn cpu_loop(cpu: usize) -> ! {
    loop {
        let slot = CPU_VM[cpu].load(Ordering::Acquire);
        if slot == NO_VM {
            // A start or CPU_ON kicks this CPU; 10 ms bounds a missed kick.
            aarch64::idle_wait(10_000);
            continue;
        }
        let (id, vcpu) = (slot / MAX_VCPUS, slot % MAX_VCPUS);
        if recovery::run_recoverable(|| run_vcpu(id, vcpu)).is_err() {
            end_failed_vm(cpu, id, vcpu);
        }
        // The guest's virtual timer must not keep waking an idle CPU.
        vcpu::disable_virtual_timer();
        // The vCPU left: this CPU is free unless it was handed a new one.
        let _ = CPU_VM[cpu].compare_exchange(slot, NO_VM, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// A panic or an EL2 exception on a CPU running a vCPU, with a recovery
/// point armed (called by `crate::crash`): release the locks this CPU holds,
/// say what happened, and jump back to the CPU loop, which ends the VM
/// ([`end_failed_vm`]). Returns only when no recovery point is armed.
pub fn contain_failure(what: core::fmt::Arguments) {
    if !recovery::armed() {
        return;
    }
    let cpu = aarch64::cpu_index();
    let held = held::held_here();
    // SAFETY: `held` lists exactly the locks this CPU holds, whose guards
    // live in the frames the jump below abandons: nobody uses them again.
    unsafe {
        crate::console::release_held(held);
        release_held(held);
    }
    held::clear_here();
    let slot = CPU_VM[cpu].load(Ordering::Acquire);
    let mut name = heapless::String::<32>::new();
    if let Some(vm) = VMS.get(slot / MAX_VCPUS) {
        if let Some(vm) = vm.lock().as_ref() {
            name = vm.name.clone();
        }
    }
    if ENDING[cpu].load(Ordering::Relaxed) {
        println!(
            "tidal: [{name}] hypervisor failure again while stopping the VM: {what}; the VM is left failed and its frames stay accounted to it"
        );
    } else {
        println!("tidal: [{name}] hypervisor failure in this VM's path: {what}; the VM is stopped");
    }
    // SAFETY: we run on this CPU's stack below its recovery point (in the
    // panic or exception handler), and every lock the abandoned frames
    // held was released above.
    unsafe { recovery::jump() };
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
}

/// Back in the CPU loop after a failure in VM `id`'s path: stop the VM as
/// any stop does (its other vCPUs are kicked out, the last one out frees
/// its pages), under a recovery point of its own. If that fails too, or
/// its frames could not all be freed, the VM is left failed with its
/// frames accounted to it, never recovered twice.
fn end_failed_vm(cpu: usize, id: usize, vcpu: usize) {
    ENDING[cpu].store(true, Ordering::Relaxed);
    let ended = recovery::run_recoverable(|| {
        let mut guard = lock_vm(id);
        let Some(vm) = guard.as_mut() else { return };
        vm.restart = false;
        if !matches!(vm.state, VmState::Stopped | VmState::Failed) {
            vm.last_stop = FAILURE;
            begin_stop(vm, FAILURE, false);
        }
        if ENTERED[cpu].load(Ordering::Relaxed) == encode(id, vcpu) {
            leave(vm, vcpu, true);
        }
        // Its other vCPUs may still be leaving: they finish the stop.
    });
    ENDING[cpu].store(false, Ordering::Relaxed);
    ENTERED[cpu].store(NO_VM, Ordering::Relaxed);
    if gic::present() {
        gic::reset_virtual_interface();
    }
    let mut guard = lock_vm(id);
    let Some(vm) = guard.as_mut() else { return };
    let owned = frames().guest_pages(id);
    if ended.is_err() || (vm.state == VmState::Stopped && owned > 0) {
        // Its RAM may be half freed: what is left stays accounted to it in
        // the frame table (dropping the GuestRam frees nothing).
        vm.ram = None;
        vm.balloon = None;
        vm.vgic = None;
        vm.inside = 0;
        vm.power = [Power::Off; MAX_VCPUS];
        vm.state = VmState::Failed;
        vm.last_stop = "a hypervisor failure, and its pages could not be freed";
        println!(
            "tidal: [{}] the VM is failed: {owned} frames stay accounted to it; 'check' reports them",
            vm.name
        );
    }
}

/// Where a vCPU starts: vCPU 0 at the kernel with the device tree in x0,
/// the others where PSCI CPU_ON said.
fn vcpu_entry(vm: &mut Vm, vcpu: usize) -> Option<(u64, u64)> {
    let entry = match vm.power[vcpu] {
        Power::Starting { entry, context } => (entry, context),
        Power::On if vcpu == 0 => (
            layout::RAM_BASE + KERNEL_OFFSET + kernel_text_offset(vm.id),
            layout::RAM_BASE,
        ),
        _ => return None,
    };
    vm.power[vcpu] = Power::On;
    Some(entry)
}

/// Leave the run loop: give up this CPU's GIC state; the last vCPU out of
/// a stopping VM finishes the stop.
fn leave(vm: &mut Vm, vcpu: usize, power_off: bool) {
    if vm.vgic.is_some() {
        gic::reset_virtual_interface();
        // The virtual timer may be active, handed to the guest: end it.
        gic::deactivate(gic::VTIMER_PPI);
    }
    vm.listed[vcpu] = [None; MAX_LRS];
    if power_off {
        vm.power[vcpu] = Power::Off;
    }
    vm.inside -= 1;
    ENTERED[aarch64::cpu_index()].store(NO_VM, Ordering::Relaxed);
    if vm.state == VmState::StopRequested && vm.inside == 0 {
        finish_stop(vm);
    } else if vm.state == VmState::Running
        && vm.inside == 0
        && vm.power.iter().all(|p| *p == Power::Off)
    {
        begin_stop(vm, "every vCPU turned itself off (PSCI CPU_OFF)", false);
    }
}

fn run_vcpu(id: usize, vcpu: usize) {
    let mut ctx = {
        let mut guard = lock_vm(id);
        let Some(vm) = guard.as_mut() else { return };
        if vm.state != VmState::Running || vcpu >= vm.vcpus {
            return;
        }
        let Some((entry, x0)) = vcpu_entry(vm, vcpu) else {
            return;
        };
        let Some(ram) = vm.ram.as_ref() else { return };
        vm.inside += 1;
        ENTERED[aarch64::cpu_index()].store(encode(id, vcpu), Ordering::Relaxed);
        El1Regs::reset().load();
        vcpu::load_vm_controls(ram.vmid, ram.stage2_root(), vcpu as u64, vm.vgic.is_some());
        if vm.vgic.is_some() {
            gic::reset_virtual_interface();
        }
        GuestContext::new(entry, x0)
    };
    loop {
        if let Some(vm) = lock_vm(id).as_mut() {
            flush_list_registers(vm, vcpu);
        }
        let before = pmu::instructions();
        let vector = vcpu::run(&mut ctx);
        let exit = decode(vector, ctx.esr, ctx.far, ctx.hpfar);
        let mut guard = lock_vm(id);
        let Some(vm) = guard.as_mut() else { return };
        if vm.state == VmState::StopRequested {
            leave(vm, vcpu, true);
            return;
        }
        if let Some(abort) = vm.inject_failure.take() {
            // `debug fail`: a failure with the VM lock and the frame table
            // held, as a bug in a frame-table path would have them.
            let _frames = frames();
            if abort {
                let bad = crate::mm::pagetable::VA_LIMIT as usize + 0x1234_5678;
                // SAFETY: deliberately faults (no map covers `bad`): the
                // exception handler contains it and never returns here.
                let v = unsafe { core::ptr::read_volatile(bad as *const u64) };
                println!("unexpectedly read {v:#x}");
            }
            panic!("injected failure ('debug fail {}')", vm.name);
        }
        let counted = vm.change.is_some() && balloon_work(vm, &exit);
        let mut outcome = handle_exit(vm, vcpu, &mut ctx, exit);
        if let Some(e) = vm.ram.as_ref().and_then(|r| r.frame_error) {
            // A broken frame-table invariant: not a guest's doing, but it
            // ends only this VM.
            println!(
                "tidal: [{}] hypervisor failure in this VM's path: the frame table refused one of its frames: {e}; the VM is stopped",
                vm.name
            );
            outcome = Outcome::Stop(FAILURE);
        }
        vm.exits.total += 1;
        vm.exits.instructions += u64::from(pmu::instructions().wrapping_sub(before));
        if counted {
            if let Some(change) = vm.change.as_mut() {
                change.instructions += u64::from(pmu::instructions().wrapping_sub(before));
                change.exits += 1;
            }
        }
        finish_change(vm);
        if vcpu == 0 {
            poll_balloon(vm);
        }
        match outcome {
            Outcome::Continue => {}
            Outcome::Idle => {
                drop(guard);
                // Any pending physical interrupt (even masked at EL2) ends
                // the wait; it is taken as soon as the guest runs again.
                aarch64::wait_for_interrupt_or(10_000);
            }
            Outcome::Stop(why) => {
                begin_stop(vm, why, false);
                leave(vm, vcpu, true);
                return;
            }
            Outcome::Reset => {
                begin_stop(vm, "reset by the guest (PSCI SYSTEM_RESET)", true);
                leave(vm, vcpu, true);
                return;
            }
            Outcome::VcpuOff => {
                leave(vm, vcpu, true);
                return;
            }
        }
    }
}

fn kernel_text_offset(id: usize) -> u64 {
    let Some(spec) = BUNDLE.get().and_then(|b| b.vm(id)) else {
        return 0;
    };
    let k = spec.kernel();
    if k.len() >= 64 && k[56..60] == *b"ARM\x64" {
        u64::from_le_bytes(k[8..16].try_into().unwrap_or([0; 8])) & 0x1f_ffff
    } else {
        0
    }
}

enum Outcome {
    Continue,
    /// The guest executed WFI: sleep until an interrupt could be for it.
    Idle,
    /// This vCPU turned itself off (PSCI CPU_OFF).
    VcpuOff,
    Stop(&'static str),
    Reset,
}

const PSCI_VERSION: u32 = 0x8400_0000;
const PSCI_CPU_OFF: u32 = 0x8400_0002;
const PSCI_SYSTEM_OFF: u32 = 0x8400_0008;
const PSCI_SYSTEM_RESET: u32 = 0x8400_0009;
const PSCI_FEATURES: u32 = 0x8400_000a;
const PSCI_NOT_SUPPORTED: u64 = -1i64 as u64;

fn handle_exit(vm: &mut Vm, vcpu: usize, ctx: &mut GuestContext, exit: VcpuExit) -> Outcome {
    // A simple load or store to a RAM page that has no frame (given back
    // through the balloon) carries a full syndrome too: it is a fault to
    // back, not MMIO to emulate.
    let exit = match exit {
        VcpuExit::MmioRead { ipa, .. } | VcpuExit::MmioWrite { ipa, .. }
            if vm.ram.as_ref().is_some_and(|r| r.contains(ipa)) =>
        {
            VcpuExit::Abort {
                ipa,
                write: matches!(exit, VcpuExit::MmioWrite { .. }),
                instruction: false,
                fault: FaultKind::Translation,
            }
        }
        other => other,
    };
    match exit {
        VcpuExit::MmioRead {
            ipa,
            width,
            reg,
            sign_extend,
            sixty_four,
            insn_len,
        } => {
            vm.exits.mmio += 1;
            match mmio_read(vm, vcpu, ipa, width) {
                Ok(value) => ctx.set_reg(reg, load_result(value, width, sign_extend, sixty_four)),
                Err(refused) => {
                    let access = Access::data(ipa, false, width, insn_len, ctx.far);
                    return bad_access(vm, ctx, refused, access);
                }
            }
            ctx.elr += u64::from(insn_len);
        }
        VcpuExit::MmioWrite {
            ipa,
            width,
            reg,
            insn_len,
        } => {
            vm.exits.mmio += 1;
            let value = ctx.reg(reg);
            if let Err(refused) = mmio_write(vm, vcpu, ipa, width, value) {
                let access = Access::data(ipa, true, width, insn_len, ctx.far);
                return bad_access(vm, ctx, refused, access);
            }
            ctx.elr += u64::from(insn_len);
        }
        VcpuExit::Abort {
            ipa,
            instruction,
            fault,
            write,
        } => {
            vm.exits.faults += 1;
            let in_ram = vm.ram.as_ref().is_some_and(|r| r.contains(ipa));
            if in_ram && fault == FaultKind::Translation {
                // A page given back (balloon, reported, hinted): back it
                // again, zeroed or with the guest's poison value.
                let fill = vm.balloon.as_ref().map_or(0, |b| b.device().page_fill());
                let ram = vm.ram.as_mut().expect("checked above");
                ram.set_page_fill(fill);
                if let Err(RamError::OutOfMemory { .. }) = ram.translate_or_back(&mut HostMem, ipa)
                {
                    return stop_for(vm, ctx, ipa, "no free memory left to back its RAM");
                }
                if let Some(balloon) = vm.balloon.as_mut() {
                    balloon.device_mut().page_refaulted(ipa / PAGE_SIZE);
                }
            } else {
                let kind = if instruction && !in_ram {
                    BadAccessKind::InstructionFetch
                } else if in_ram {
                    BadAccessKind::RamFault
                } else if let Some(device) = device_at(vm, ipa) {
                    // A device register, but the syndrome does not say
                    // which register or width (ldp/stp, writeback, SIMD).
                    BadAccessKind::NoSyndrome(device)
                } else {
                    BadAccessKind::Unmapped
                };
                let access = Access {
                    ipa: Some(ipa),
                    write,
                    width: None,
                    // Aborts without a syndrome are reported with IL = 1.
                    il32: true,
                    far: far_if_valid(ctx),
                    fetch: instruction,
                };
                return bad_access(vm, ctx, Refused::new(kind), access);
            }
        }
        VcpuExit::Hvc { .. } => {
            vm.exits.hvc += 1;
            return psci(vm, vcpu, ctx);
        }
        VcpuExit::Smc { insn_len, .. } => {
            vm.exits.hvc += 1;
            ctx.elr += u64::from(insn_len);
            return psci(vm, vcpu, ctx);
        }
        VcpuExit::Wait { wfe, insn_len } => {
            vm.exits.wfx += 1;
            ctx.elr += u64::from(insn_len);
            // WFE is a spin-wait hint: go straight back. A WFI with the
            // virtual GIC idle waits for a physical interrupt (timer, kick).
            if !wfe
                && vm.vgic.as_ref().is_some_and(|g| !g.has_pending(vcpu))
                && !lr_pending(vm, vcpu)
            {
                return Outcome::Idle;
            }
        }
        VcpuExit::Interrupt => handle_physical_irqs(vm, vcpu),
        VcpuExit::SysReg {
            encoding,
            reg,
            read,
            insn_len,
        } => {
            vm.exits.sysreg += 1;
            let sgi = [ICC_SGI1R_EL1, ICC_ASGI1R_EL1, ICC_SGI0R_EL1].contains(&encoding);
            match vm.vgic.as_mut() {
                // The SGI generation registers are write-only.
                Some(vgic) if sgi && !read => {
                    if let Ok(effect) = vgic.send_sgi_v3(vcpu, ctx.reg(reg)) {
                        apply_effect(vm, effect);
                    }
                }
                Some(_) if sgi => ctx.set_reg(reg, 0),
                _ => {
                    let refused = Refused {
                        kind: BadAccessKind::SystemRegister,
                        detail: Detail::SysReg { encoding, read },
                    };
                    return bad_access(vm, ctx, refused, Access::trap(il32(insn_len)));
                }
            }
            ctx.elr += u64::from(insn_len);
        }
        VcpuExit::Unknown { esr } => {
            let refused = Refused {
                kind: BadAccessKind::UnknownExit,
                detail: Detail::Esr(esr),
            };
            return bad_access(vm, ctx, refused, Access::trap(esr & (1 << 25) != 0));
        }
    }
    Outcome::Continue
}

/// A stop the guest caused but that is not a bad access (its RAM cannot be
/// backed): said once, as the VM ends.
fn stop_for(vm: &Vm, ctx: &GuestContext, ipa: u64, why: &'static str) -> Outcome {
    println!(
        "tidal: [{}] stopping the VM: {why}: IPA {ipa:#x}, PC {:#x}",
        vm.name, ctx.elr
    );
    Outcome::Stop(why)
}

/// What was refused, and the device's own reason if it gave one.
struct Refused {
    kind: BadAccessKind,
    detail: Detail,
}

enum Detail {
    None,
    Virtio(crate::virtio::mmio::MmioError),
    SysReg {
        encoding: (u8, u8, u8, u8, u8),
        read: bool,
    },
    Esr(u64),
}

impl Refused {
    fn new(kind: BadAccessKind) -> Self {
        Self {
            kind,
            detail: Detail::None,
        }
    }
}

impl core::fmt::Display for Refused {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}", self.kind)?;
        match self.detail {
            Detail::None => Ok(()),
            Detail::Virtio(e) => write!(f, " ({e})"),
            Detail::SysReg {
                encoding: (op0, op1, crn, crm, op2),
                read,
            } => write!(
                f,
                " ({} of S{op0}_{op1}_C{crn}_C{crm}_{op2})",
                if read { "read" } else { "write" }
            ),
            Detail::Esr(esr) => write!(f, " (ESR_EL2 {esr:#x})"),
        }
    }
}

/// The facts of a refused access, for the message and the exception.
struct Access {
    ipa: Option<u64>,
    write: bool,
    width: Option<u8>,
    il32: bool,
    /// The faulting virtual address (FAR_EL2), when valid.
    far: Option<u64>,
    /// An instruction fetch (else a load, store or trapped instruction).
    fetch: bool,
}

impl Access {
    /// A load or store with a full syndrome (FAR_EL2 is valid then).
    fn data(ipa: u64, write: bool, width: u8, insn_len: u8, far: u64) -> Self {
        Self {
            ipa: Some(ipa),
            write,
            width: Some(width),
            il32: il32(insn_len),
            far: Some(far),
            fetch: false,
        }
    }

    /// A trapped instruction that is no memory access.
    fn trap(il32: bool) -> Self {
        Self {
            ipa: None,
            write: false,
            width: None,
            il32,
            far: None,
            fetch: false,
        }
    }
}

/// FAR_EL2 of an abort, unless the syndrome says it is not valid (FnV).
fn far_if_valid(ctx: &GuestContext) -> Option<u64> {
    (ctx.esr & (1 << 10) == 0).then_some(ctx.far)
}

/// A bad access: an exception for the guest, or the VM stopped, as its
/// policy says; counted and said on the console (rate-limited).
fn bad_access(vm: &mut Vm, ctx: &mut GuestContext, refused: Refused, access: Access) -> Outcome {
    let mut place: heapless::String<64> = heapless::String::new();
    if let Some(width) = access.width {
        let _ = write!(
            place,
            "{width}-byte {} ",
            if access.write { "write" } else { "read" }
        );
    }
    if let Some(ipa) = access.ipa {
        let _ = write!(place, "at IPA {ipa:#x}, ");
    }
    let _ = write!(place, "PC {:#x}", ctx.elr);
    if vm.on_bad_access == OnBadAccess::Stop {
        println!(
            "tidal: [{}] stopping the VM (on_bad_access = \"stop\"): {refused}: {place}",
            vm.name
        );
        return Outcome::Stop(bad_access_reason(refused.kind));
    }
    let exception = if access.fetch {
        crate::vm::inject::GuestException::InstructionAbort
    } else {
        refused.kind.exception(access.write)
    };
    vm.bad_access.count(refused.kind);
    say(
        &mut vm.lines,
        LineKind::Abort,
        &vm.name,
        format_args!("{} injected: {refused}: {place}", exception.label()),
    );
    vcpu::inject(ctx, exception, access.far, access.il32);
    Outcome::Continue
}

/// The `last_stop` reason of a VM stopped by policy.
fn bad_access_reason(kind: BadAccessKind) -> &'static str {
    match kind {
        BadAccessKind::DeviceRegister(_) => "a device register access the device refuses",
        BadAccessKind::NoSyndrome(_) => "a device access the hypervisor cannot emulate",
        BadAccessKind::Unmapped => "an access to an address that is neither its RAM nor a device",
        BadAccessKind::InstructionFetch => "an instruction fetch outside its RAM",
        BadAccessKind::RamFault => "an unexpected fault on its RAM",
        BadAccessKind::SystemRegister => "a system register the hypervisor does not emulate",
        BadAccessKind::UnknownExit => "a trap the hypervisor does not handle",
    }
}

/// Print `tidal: [name] <args>`, a line the guest can trigger, within the
/// VM's rate limit; the first line after a quiet spell says how many were
/// held back.
fn say(lines: &mut GuestLines, kind: LineKind, name: &str, args: core::fmt::Arguments<'_>) {
    match lines.check(kind, aarch64::uptime_us()) {
        Permit::Suppress => {}
        Permit::Print { suppressed } => {
            if suppressed > 0 {
                println!("tidal: [{name}] {suppressed} similar messages suppressed");
            }
            println!("tidal: [{name}] {args}");
        }
    }
}

/// The emulated device whose window `ipa` is in, if any.
fn device_at(vm: &Vm, ipa: u64) -> Option<Device> {
    let vgic = vm.vgic.as_ref();
    let v3 = vgic.is_some_and(|g| g.version() == VgicVersion::V3);
    let dist = if v3 {
        GICV3_DIST_WINDOW
    } else {
        fdt::GICV2_DIST_SIZE
    };
    if vgic.is_some() && offset_in(ipa, layout::GICD_BASE, dist).is_some() {
        return Some(Device::GicDistributor);
    }
    if let Some(g) = vgic.filter(|_| v3) {
        if offset_in(ipa, layout::GICR_BASE, GICR_STRIDE * g.vcpus() as u64).is_some() {
            return Some(Device::GicRedistributor);
        }
    }
    if offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE).is_some() {
        return Some(Device::Uart);
    }
    if vm.balloon.is_some() && offset_in(ipa, layout::VIRTIO_BASE, layout::VIRTIO_STRIDE).is_some()
    {
        return Some(Device::Virtio);
    }
    None
}

const PSCI_CPU_ON: u32 = 0xc400_0003;
const PSCI_AFFINITY_INFO: u32 = 0xc400_0004;
const PSCI_MIGRATE_INFO_TYPE: u32 = 0x8400_0006;
const PSCI_INVALID_PARAMETERS: u64 = -2i64 as u64;
const PSCI_ALREADY_ON: u64 = -4i64 as u64;

/// PSCI for guests (SMC64 and SMC32 function IDs of the calls below).
fn psci(vm: &mut Vm, vcpu: usize, ctx: &mut GuestContext) -> Outcome {
    let function = ctx.x[0] as u32;
    // The 32-bit calling convention's IDs differ only in bit 30.
    let function64 = if function & 0xff00_0000 == 0x8400_0000 {
        function | 0x4000_0000
    } else {
        function
    };
    let target = |mpidr: u64| {
        let v = (mpidr & 0xff_00ff_ffff) as usize;
        (v < vm.vcpus).then_some(v)
    };
    let result = match function64 {
        _ if function == PSCI_VERSION => 0x1_0000, // 1.0
        _ if function == PSCI_FEATURES => match ctx.x[1] as u32 | 0x4000_0000 {
            f if [
                PSCI_VERSION | 0x4000_0000,
                PSCI_CPU_OFF | 0x4000_0000,
                PSCI_SYSTEM_OFF | 0x4000_0000,
                PSCI_SYSTEM_RESET | 0x4000_0000,
                PSCI_FEATURES | 0x4000_0000,
                PSCI_CPU_ON,
                PSCI_AFFINITY_INFO,
                PSCI_MIGRATE_INFO_TYPE | 0x4000_0000,
            ]
            .contains(&f) =>
            {
                0
            }
            _ => PSCI_NOT_SUPPORTED,
        },
        _ if function == PSCI_SYSTEM_OFF => {
            return Outcome::Stop("powered off by the guest (PSCI SYSTEM_OFF)")
        }
        _ if function == PSCI_SYSTEM_RESET => return Outcome::Reset,
        _ if function == PSCI_CPU_OFF => return Outcome::VcpuOff,
        _ if function == PSCI_MIGRATE_INFO_TYPE => 2, // no trusted OS to migrate
        PSCI_CPU_ON => match target(ctx.x[1]) {
            None => PSCI_INVALID_PARAMETERS,
            Some(t) if vm.power[t] != Power::Off || t == vcpu => PSCI_ALREADY_ON,
            Some(t) => {
                vm.power[t] = Power::Starting {
                    entry: ctx.x[2],
                    context: ctx.x[3],
                };
                let cpu = vm.cpus[t];
                CPU_VM[cpu].store(encode(vm.id, t), Ordering::Release);
                wake_cpu(cpu);
                0
            }
        },
        PSCI_AFFINITY_INFO => match target(ctx.x[1]) {
            None => PSCI_INVALID_PARAMETERS,
            Some(t) => match vm.power[t] {
                Power::On => 0,
                Power::Off => 1,
                Power::Starting { .. } => 2,
            },
        },
        _ => PSCI_NOT_SUPPORTED,
    };
    let _ = vcpu;
    ctx.x[0] = result;
    Outcome::Continue
}

/// Kick the CPUs of the vCPUs a vGIC change made something deliverable to
/// (not the caller's own CPU: it syncs before entering anyway).
fn apply_effect(vm: &Vm, effect: crate::vgic::VgicEffect) {
    let me = aarch64::cpu_index();
    for v in 0..vm.vcpus {
        if effect.kicks(v) && vm.power[v] != Power::Off && vm.cpus[v] != me {
            gic::kick(vm.cpus[v]);
        }
    }
}

/// A guest access to the GICv3 distributor or a redistributor (`value`:
/// a write); None if `ipa` is outside them or the VM's GIC is not a GICv3.
fn gic_v3_mmio(
    vm: &mut Vm,
    vcpu: usize,
    ipa: u64,
    width: u8,
    value: Option<u64>,
) -> Option<Result<u64, Refused>> {
    let vgic = vm
        .vgic
        .as_mut()
        .filter(|g| g.version() == VgicVersion::V3)?;
    let redist_size = GICR_STRIDE * vgic.vcpus() as u64;
    let none = crate::vgic::VgicEffect::NONE;
    let result = if let Some(off) = offset_in(ipa, layout::GICD_BASE, GICV3_DIST_WINDOW) {
        match value {
            None => vgic.read_dist_v3(vcpu, off, width).map(|r| (r, none)),
            Some(v) => vgic.write_dist_v3(vcpu, off, width, v).map(|e| (0, e)),
        }
    } else if let Some(off) = offset_in(ipa, layout::GICR_BASE, redist_size) {
        let redist = (off / GICR_STRIDE) as usize;
        let off = off % GICR_STRIDE;
        match value {
            None => vgic
                .read_redist(vcpu, redist, off, width)
                .map(|r| (r, none)),
            Some(v) => vgic
                .write_redist(vcpu, redist, off, width, v)
                .map(|e| (0, e)),
        }
    } else {
        return None;
    };
    // An enable or a pending bit for another vCPU: make its CPU sync.
    let result = result.map(|(read, effect)| {
        apply_effect(vm, effect);
        read
    });
    let device = if offset_in(ipa, layout::GICD_BASE, GICV3_DIST_WINDOW).is_some() {
        Device::GicDistributor
    } else {
        Device::GicRedistributor
    };
    Some(result.map_err(|_| Refused::new(BadAccessKind::DeviceRegister(device))))
}

/// A refused access to the GIC distributor.
fn bad_gicd<E>(_: E) -> Refused {
    Refused::new(BadAccessKind::DeviceRegister(Device::GicDistributor))
}

/// A refused access to the virtio-mmio device, with its reason.
fn bad_virtio(e: crate::virtio::mmio::MmioError) -> Refused {
    Refused {
        kind: BadAccessKind::DeviceRegister(Device::Virtio),
        detail: Detail::Virtio(e),
    }
}

fn mmio_read(vm: &mut Vm, vcpu: usize, ipa: u64, width: u8) -> Result<u64, Refused> {
    if let Some(result) = gic_v3_mmio(vm, vcpu, ipa, width, None) {
        return result;
    }
    if let Some(off) = offset_in(ipa, layout::GICD_BASE, fdt::GICV2_DIST_SIZE) {
        // No GIC on this host: nothing is there.
        let Some(vgic) = vm.vgic.as_mut() else {
            return Err(Refused::new(BadAccessKind::Unmapped));
        };
        return vgic.read(vcpu, off, width).map(u64::from).map_err(bad_gicd);
    }
    if let Some(off) = offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE) {
        let value = vm.uart.read(off, width);
        update_uart_irq(vm);
        return Ok(u64::from(value));
    }
    if let Some(off) = offset_in(ipa, layout::VIRTIO_BASE, layout::VIRTIO_STRIDE) {
        let Some(balloon) = vm.balloon.as_mut() else {
            return Err(Refused::new(BadAccessKind::Unmapped));
        };
        return balloon.read(off, width).map(u64::from).map_err(bad_virtio);
    }
    Err(Refused::new(BadAccessKind::Unmapped))
}

fn mmio_write(vm: &mut Vm, vcpu: usize, ipa: u64, width: u8, value: u64) -> Result<(), Refused> {
    if let Some(result) = gic_v3_mmio(vm, vcpu, ipa, width, Some(value)) {
        return result.map(|_| ());
    }
    if let Some(off) = offset_in(ipa, layout::GICD_BASE, fdt::GICV2_DIST_SIZE) {
        let Some(vgic) = vm.vgic.as_mut() else {
            return Err(Refused::new(BadAccessKind::Unmapped));
        };
        let effect = vgic
            .write(vcpu, off, width, value as u32)
            .map_err(bad_gicd)?;
        // An SGI to another vCPU, an enable: make its CPU sync.
        apply_effect(vm, effect);
        return Ok(());
    }
    if let Some(off) = offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE) {
        let effect = vm.uart.write(off, width, value as u32);
        if let Some(byte) = effect.output {
            // The console with the keyboard is shown live (prompts, echo).
            if FOCUS.load(Ordering::Relaxed) == vm.id {
                let output = vm.console.push_live(byte);
                let id = vm.id;
                crate::console::guest_live_output(id, &vm.name, output, || {
                    FOCUS.load(Ordering::Relaxed) == id
                });
            } else if let Some(line) = vm.console.push(byte) {
                println!("[{}] {line}", vm.name);
            }
        }
        if effect.irq_changed {
            update_uart_irq(vm);
        }
        return Ok(());
    }
    if let Some(off) = offset_in(ipa, layout::VIRTIO_BASE, layout::VIRTIO_STRIDE) {
        let (Some(balloon), Some(ram)) = (vm.balloon.as_mut(), vm.ram.as_mut()) else {
            return Err(Refused::new(BadAccessKind::Unmapped));
        };
        let mut view = DeviceView { ram };
        let before = *balloon.device().stats();
        let hint_before = balloon.device().hint_run().copied();
        let event = balloon
            .write(off, width, value as u32, &mut view)
            .map_err(bad_virtio)?;
        if let Some(msg) = event.message() {
            let kind = event_kind(msg);
            say(
                &mut vm.lines,
                kind,
                &vm.name,
                format_args!("balloon: {msg}"),
            );
        }
        report_rejections(&mut vm.lines, &vm.name, &before, balloon.device().stats());
        report_hint_end(&vm.name, hint_before, balloon.device().hint_run());
        update_virtio_irq(vm);
        return Ok(());
    }
    Err(Refused::new(BadAccessKind::Unmapped))
}

fn offset_in(ipa: u64, base: u64, size: u64) -> Option<u64> {
    (ipa >= base && ipa - base < size).then(|| ipa - base)
}

/// Time-driven balloon work (statistics requests), from vCPU 0's exits:
/// a guest exits at least every 10 ms (its WFI sleep is bounded).
fn poll_balloon(vm: &mut Vm) {
    let now = aarch64::uptime_us();
    let (Some(balloon), Some(ram)) = (vm.balloon.as_mut(), vm.ram.as_mut()) else {
        return;
    };
    if balloon
        .device()
        .next_stats_poll_us()
        .is_none_or(|t| t > now)
    {
        return;
    }
    let event = balloon.poll_balloon(&mut DeviceView { ram }, now);
    if let Some(msg) = event.message() {
        let kind = event_kind(msg);
        say(
            &mut vm.lines,
            kind,
            &vm.name,
            format_args!("balloon: {msg}"),
        );
    }
    update_virtio_irq(vm);
}

/// Why `hint <vm>` did not start a run.
pub enum HintStartError {
    NotRunning,
    NoBalloon,
    Device(HintError),
}

impl core::fmt::Display for HintStartError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HintStartError::NotRunning => {
                f.write_str("it is not running (type 'start <vm>' first)")
            }
            HintStartError::NoBalloon => f.write_str("it has no balloon device"),
            HintStartError::Device(e) => write!(f, "{e}"),
        }
    }
}

/// Ask VM `vm`'s guest for fresh statistics now (`balloon-stats <vm> now`);
/// the sample arrives a moment later ([`stats_arrived_us`]).
pub fn request_stats(vm: &mut Vm) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running (type 'start <vm>' first)");
    }
    let Some(balloon) = vm.balloon.as_mut() else {
        return Err("it has no balloon device");
    };
    if balloon.negotiated_features() & crate::balloon::F_STATS_VQ == 0 {
        return Err("its guest did not accept STATS_VQ (is it offered in the VM's configuration?)");
    }
    balloon.device_mut().request_stats();
    poll_balloon(vm);
    // vCPU 0 may sleep in WFI: make it look at its interrupts.
    apply_effect(vm, crate::vgic::VgicEffect { kick: 1 });
    Ok(())
}

/// When the guest's latest statistics sample arrived (uptime, us).
pub fn stats_arrived_us(vm: &mut Vm) -> Option<u64> {
    Some(vm.balloon.as_ref()?.device().stats_sample()?.arrived_us)
}

/// Start a free page hinting run in VM `vm` (shell `hint`): its command id.
pub fn start_hint(vm: &mut Vm) -> Result<u32, HintStartError> {
    if vm.state != VmState::Running {
        return Err(HintStartError::NotRunning);
    }
    let Some(balloon) = vm.balloon.as_mut() else {
        return Err(HintStartError::NoBalloon);
    };
    let id = balloon
        .start_free_page_hint(aarch64::uptime_us())
        .map_err(HintStartError::Device)?;
    update_virtio_irq(vm);
    Ok(id)
}

/// Say so when a hinting run ends (the driver's STOP made it DONE).
fn report_hint_end(name: &str, before: Option<HintRun>, after: Option<&HintRun>) {
    let Some(run) = after else { return };
    let was_running = before.is_some_and(|b| b.id == run.id && b.ended_us.is_none());
    if let (true, Some(ended)) = (was_running, run.ended_us) {
        println!(
            "tidal: [{name}] balloon: free page hint {run}; {} ({} ms)",
            crate::report::Size(run.pages_hinted * PAGE_SIZE),
            ended.saturating_sub(run.started_us) / 1000
        );
    }
}

/// Set the balloon target of a VM, in 4 KiB pages, and tell the driver.
pub fn set_balloon(vm: &mut Vm, pages: u64) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running (type 'start <vm>' first)");
    }
    let ram_pages = vm.ram_size / PAGE_SIZE;
    let Some(balloon) = vm.balloon.as_mut() else {
        return Err("it has no balloon device");
    };
    if pages > ram_pages {
        return Err("that is more than its RAM");
    }
    let from = balloon.device().actual();
    balloon.device_mut().set_target(pages as u32);
    balloon.config_changed();
    update_virtio_irq(vm);
    vm.change = Some(BalloonChange {
        from,
        to: pages as u32,
        started: aarch64::counter().0,
        ended: 0,
        instructions: 0,
        exits: 0,
    });
    Ok(())
}

/// The `info balloon` block of one VM.
pub fn print_balloon(vm: &mut Vm) {
    let Some(balloon) = vm.balloon.as_ref() else {
        match &vm.last_balloon_stats {
            Some(stats) => println!(
                "{}: {}; {}; its balloon's last counters: {stats}",
                vm.name,
                vm.state.label(),
                vm.last_stop
            ),
            None => println!("{}: no balloon device ({})", vm.name, vm.state.label()),
        }
        return;
    };
    let dev = balloon.device();
    let (target, actual) = (u64::from(dev.target()), u64::from(dev.actual()));
    println!("{}: balloon ({})", vm.name, vm.state.label());
    println!(
        "  target {target} pages ({}), actual {actual} pages ({}), ballooned {} pages",
        crate::report::Size(target * PAGE_SIZE),
        crate::report::Size(actual * PAGE_SIZE),
        dev.ballooned_pages()
    );
    println!(
        "  features offered: {}; negotiated: {}",
        crate::balloon::feature_names(balloon.offered_features()),
        crate::balloon::feature_names(balloon.negotiated_features())
    );
    println!("  {}", dev.stats());
    print!("{}", dev.info_lines(aarch64::uptime_us()));
    if let Some(e) = balloon.last_error() {
        println!("  last device error: {e}");
    }
    let e = &vm.exits;
    println!(
        "  exits: {} ({} MMIO, {} HVC/SMC, {} WFI/WFE, {} faults), {} EL2 instructions each on average",
        e.total,
        e.mmio,
        e.hvc,
        e.wfx,
        e.faults,
        e.instructions / e.total.max(1)
    );
    if let Some(ram) = vm.ram.as_ref() {
        println!(
            "  memory: {} pages mapped, {} backed again on fault, {} released, {} TLB flushes",
            ram.mapped_pages(),
            ram.stats.faults_backed,
            ram.stats.pages_released,
            ram.stats.tlb_flushes
        );
    }
}

/// Which rate limit a virtio transport event's line goes through.
fn event_kind(event: &crate::virtio::mmio::TransportEvent) -> LineKind {
    match event {
        crate::virtio::mmio::TransportEvent::NeedsReset { .. } => LineKind::DeviceError,
        _ => LineKind::DeviceEvent,
    }
}

/// Say on the console which PFNs a balloon request had rejected, and why.
fn report_rejections(
    lines: &mut GuestLines,
    name: &str,
    before: &crate::balloon::BalloonStats,
    after: &crate::balloon::BalloonStats,
) {
    let range = after.rejected_out_of_range - before.rejected_out_of_range;
    let dup = after.rejected_duplicate - before.rejected_duplicate;
    let already = after.rejected_already_ballooned - before.rejected_already_ballooned;
    let not = after.rejected_not_ballooned - before.rejected_not_ballooned;
    if range + dup + already + not > 0 {
        say(
            lines,
            LineKind::DeviceError,
            name,
            format_args!(
                "balloon: rejected PFNs: {range} outside guest RAM, {dup} duplicated, \
                 {already} already ballooned, {not} not ballooned (buffers returned, nothing unmapped)"
            ),
        );
    }
}

/// Whether an exit is part of moving the balloon: a balloon register access
/// or a fault backing RAM.
fn balloon_work(vm: &Vm, exit: &VcpuExit) -> bool {
    match *exit {
        VcpuExit::MmioRead { ipa, .. }
        | VcpuExit::MmioWrite { ipa, .. }
        | VcpuExit::Abort { ipa, .. } => {
            offset_in(ipa, layout::VIRTIO_BASE, layout::VIRTIO_STRIDE).is_some()
                || vm.ram.as_ref().is_some_and(|r| r.contains(ipa))
        }
        _ => false,
    }
}

/// When the driver reports the target reached, close the change and say
/// what it cost.
fn finish_change(vm: &mut Vm) {
    let (Some(change), Some(balloon)) = (vm.change.as_mut(), vm.balloon.as_ref()) else {
        return;
    };
    if balloon.device().actual() != change.to || balloon.device().target() != change.to {
        return;
    }
    change.ended = aarch64::counter().0;
    let change = *change;
    vm.change = None;
    vm.last_change = Some(change);
    let freq = aarch64::counter().1.max(1);
    let micros = (change.ended - change.started) as u128 * 1_000_000 / freq as u128;
    let pages = change.pages();
    let rate = (pages as u128 * 1_000_000).checked_div(micros).unwrap_or(0);
    let verb = if change.to >= change.from {
        "inflated"
    } else {
        "deflated"
    };
    print!(
        "tidal: [{}] balloon: reached {} pages: {pages} pages {verb} in {micros} us ({rate} pages/s)",
        vm.name, change.to
    );
    if pmu::counts_instructions() && pages > 0 {
        let per_page = change.instructions as f64 / pages as f64;
        println!(
            ", {per_page:.1} hypervisor instructions per page ({} in {} exits)",
            change.instructions, change.exits
        );
    } else {
        println!(", hypervisor instructions: not counted (no PMU instruction event)");
    }
}

/// Drive the balloon's interrupt line into the virtual distributor.
fn update_virtio_irq(vm: &mut Vm) {
    let level = vm.balloon.as_ref().is_some_and(|b| b.interrupt_pending());
    if let Some(Ok(effect)) = vm.vgic.as_mut().map(|g| g.set_level(VIRTIO_INTID, level)) {
        apply_effect(vm, effect);
    }
}

/// Physical interrupts taken while a guest ran, per CPU: kicks, the
/// maintenance interrupt, the EL2 timer, the guest's virtual timer, others.
static IRQS_TAKEN: [[AtomicU64; 5]; aarch64::MAX_CPUS] =
    [const { [const { AtomicU64::new(0) }; 5] }; aarch64::MAX_CPUS];

/// [`IRQS_TAKEN`] of CPU `cpu` (zeros for a CPU that does not exist).
pub fn interrupts_taken(cpu: usize) -> [u64; 5] {
    IRQS_TAKEN.get(cpu).map_or([0; 5], |c| {
        core::array::from_fn(|i| c[i].load(Ordering::Relaxed))
    })
}

fn count_taken(intid: u32) {
    let slot = match intid {
        gic::KICK_SGI => 0,
        gic::MAINTENANCE_PPI => 1,
        gic::HYP_TIMER_PPI => 2,
        gic::VTIMER_PPI => 3,
        _ => 4,
    };
    if let Some(c) = IRQS_TAKEN.get(aarch64::cpu_index()) {
        c[slot].fetch_add(1, Ordering::Relaxed);
    }
}

/// Take the pending physical interrupts on this CPU (the guest was
/// interrupted): the virtual timer goes to the guest, the rest is ours.
/// Bounded: a level interrupt that stays asserted must not trap us here.
fn handle_physical_irqs(vm: &mut Vm, vcpu: usize) {
    for _ in 0..16 {
        let (intid, iar) = gic::acknowledge();
        if intid != gic::SPURIOUS {
            count_taken(intid);
        }
        match intid {
            gic::SPURIOUS => return,
            gic::VTIMER_PPI => {
                // Priority drop only: the interrupt stays active until the
                // guest's EOI deactivates it through the hardware-linked LR.
                gic::end_of_interrupt(iar);
                match vm.vgic.as_mut() {
                    Some(vgic) => {
                        let _ = vgic.pend_ppi(vcpu, gic::VTIMER_PPI);
                    }
                    None => gic::deactivate(iar),
                }
            }
            gic::MAINTENANCE_PPI => {
                // The maintenance interrupt is level: it stays asserted
                // until the list registers are retired and refilled.
                flush_list_registers(vm, vcpu);
                gic::end_of_interrupt(iar);
                gic::deactivate(iar);
            }
            _ => {
                // A kick: the list registers are synced before the next entry.
                gic::end_of_interrupt(iar);
                gic::deactivate(iar);
            }
        }
    }
}

/// Sync the list registers with the virtual distributor before entering
/// the guest: retire what the guest finished, then list what is pending.
fn flush_list_registers(vm: &mut Vm, vcpu: usize) {
    let Some(vgic) = vm.vgic.as_mut() else { return };
    let count = gic::list_registers().min(MAX_LRS);
    for (i, slot) in vm.listed[vcpu].iter_mut().enumerate().take(count) {
        let Some(intid) = *slot else { continue };
        let lr = gic::read_lr(i);
        if lr.is_free() {
            // The guest is done with it; a level line still high pends again.
            if lr.eoi || !lr.hw {
                let _ = vgic.on_eoi(vcpu, intid);
            }
            // Clear it: a stale EOI bit keeps the maintenance interrupt
            // (GICH_EISR) asserted and the guest could never run.
            gic::clear_lr(i);
            *slot = None;
        }
    }
    let mut waiting = false;
    for i in 0..count {
        if vm.listed[vcpu][i].is_some() {
            continue;
        }
        let listed = vm.listed[vcpu];
        let Some(irq) = vgic.next_pending(vcpu, |id| listed.contains(&Some(id))) else {
            break;
        };
        // The virtual timer is linked to the physical timer interrupt: the
        // guest's EOI deactivates it in hardware.
        let hw = (irq.intid == gic::VTIMER_PPI).then_some(gic::VTIMER_PPI);
        gic::write_lr(i, &irq, hw);
        vgic.on_listed(vcpu, &irq);
        vm.listed[vcpu][i] = Some(irq.intid);
    }
    if vgic.has_pending(vcpu) {
        let listed = vm.listed[vcpu];
        waiting = vgic
            .next_pending(vcpu, |id| listed.contains(&Some(id)))
            .is_some();
    }
    // More pending than list registers: ask for a maintenance interrupt
    // when they drain (underflow), so the rest gets listed.
    gic::enable_virtual_interface(waiting);
}

/// Drive the PL011's interrupt line into the virtual distributor.
fn update_uart_irq(vm: &mut Vm) {
    let level = vm.uart.irq_level();
    if let Some(Ok(effect)) = vm.vgic.as_mut().map(|g| g.set_level(UART_INTID, level)) {
        apply_effect(vm, effect);
    }
}

/// Give a byte typed on the physical console to a VM's PL011, and make its
/// vCPU notice. False if the VM's receive FIFO is full.
pub fn console_input(vm: &mut Vm, byte: u8) -> bool {
    if !vm.uart.push_input(byte) {
        return false;
    }
    update_uart_irq(vm);
    true
}

/// The VM whose console has the keyboard, if any (`console <vm>`).
static FOCUS: AtomicUsize = AtomicUsize::new(NO_VM);

/// Give the keyboard to VM `name`; false if there is no such VM.
pub fn focus(name: &str) -> bool {
    with_vm(name, |vm| FOCUS.store(vm.id, Ordering::Relaxed)).is_some()
}

/// Whether a VM has the keyboard.
pub fn input_to_focus_active() -> bool {
    FOCUS.load(Ordering::Relaxed) != NO_VM
}

pub fn unfocus() {
    FOCUS.store(NO_VM, Ordering::Relaxed);
    crate::console::end_live_output();
}

/// Pass a byte to the focused VM; false when no VM has the keyboard. When
/// the VM's receive FIFO is full the byte waits for the guest to drain it,
/// however slowly (a vCPU on a loaded host may read a byte a second):
/// pasted text is not cut short. Only a guest that reads nothing at all for
/// five seconds loses the byte, as a UART would, and later bytes are
/// dropped at once until it reads again, so the shell cannot hang on it
/// (Ctrl-] still gets through).
pub fn input_to_focus(byte: u8) -> bool {
    let id = FOCUS.load(Ordering::Relaxed);
    if id >= MAX_GUESTS {
        return false;
    }
    let (mut progress_at, freq) = aarch64::counter();
    let patience = if INPUT_STALLED.load(Ordering::Relaxed) == id {
        0
    } else {
        5 * freq
    };
    let mut waiting = usize::MAX;
    loop {
        match lock_vm(id).as_mut() {
            Some(vm) if vm.state == VmState::Running => {
                if console_input(vm, byte) {
                    INPUT_STALLED.store(NO_VM, Ordering::Relaxed);
                    return true;
                }
                let queued = vm.uart.rx_len();
                if queued < waiting {
                    waiting = queued;
                    progress_at = aarch64::counter().0;
                }
            }
            _ => return true,
        }
        if aarch64::counter().0 - progress_at >= patience {
            // The guest is not reading: drop it, as a UART would.
            INPUT_STALLED.store(id, Ordering::Relaxed);
            return true;
        }
        aarch64::idle_wait(200);
    }
}

/// The focused VM whose console read nothing for five seconds (NO_VM: none).
static INPUT_STALLED: AtomicUsize = AtomicUsize::new(NO_VM);

/// Whether a list register holds an interrupt the guest has not taken yet
/// (it may have executed WFI with interrupts masked: it must not sleep).
fn lr_pending(vm: &Vm, vcpu: usize) -> bool {
    let count = gic::list_registers().min(MAX_LRS);
    (0..count).any(|i| {
        vm.listed[vcpu][i].is_some() && {
            let lr = gic::read_lr(i);
            matches!(
                lr.state,
                crate::vgic::LrStatus::Pending | crate::vgic::LrStatus::PendingActive
            )
        }
    })
}
