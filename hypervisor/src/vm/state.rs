//! A VM: what the hypervisor keeps for one guest, in parts (its vCPUs,
//! memory, devices, console and counters, and what the memory manager
//! keeps on it), and its lifecycle states. `Vm`'s fields are the `vm`
//! module's: the rest of the hypervisor reads them through getters and
//! changes a VM only through `vm`'s functions, so a stop, a start or a
//! failure changes every part that must change with it. The table of VMs
//! and its locks are the target's (`crate::run`); everything here is
//! plain data.

extern crate alloc;

use guest_bundle::VmEntry;

use super::console_line::{ConsoleLine, Echo};
use super::exit_profile::ExitProfile;
use super::fault::{BadAccessStats, OnBadAccess};
use super::fdt::GicVersion;
use super::memory::GuestRam;
use super::outbox::Outbox;
use super::ratelimit::{GuestLines, Lines};
use super::vcpu_state::VcpuState;
pub use super::vcpus::Power;
use super::vcpus::Vcpus;
use crate::addr::PhysAddr;
use crate::balloon::Balloon;
use crate::limits::MAX_VCPUS;
use crate::mm::frames::PAGE_SIZE;
use crate::mm::manager::{Limits, DEFAULT_WEIGHT};
use crate::pl011::Pl011;
use crate::vgic::VDistributor;
use crate::virtio::mmio::MmioTransport;
use crate::virtio_console::VirtioConsole;

/// Console input kept for a VM beyond its UART's FIFO (Linux's tty line
/// buffer is as long).
pub const CONSOLE_INPUT_MAX: usize = 4096;

/// The GIC a VM's guest gets: the host's version, fixed at boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestGic {
    /// No GIC with a virtual interface: guests run without interrupts.
    None,
    /// A GICv2 whose CPU interface is the host's GICV page at `gicv`.
    V2 { gicv: PhysAddr },
    /// A GICv3: the virtual CPU interface is the ICC_* system registers.
    V3,
}

impl GuestGic {
    /// The version the guest's device tree describes.
    pub fn version(self) -> GicVersion {
        match self {
            GuestGic::V3 => GicVersion::V3,
            _ => GicVersion::V2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmState {
    Stopped,
    Running,
    /// A stop was asked for; the vCPUs carry it out at their next exit.
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

/// A vCPU waiting for a frame: since when, and whether the console was told.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameWait {
    pub since_us: u64,
    pub announced: bool,
    /// The VM is at its memory `max`, not the pool at its floor: its own
    /// balloon must make room (not a sign the board is exhausted).
    pub at_max: bool,
}

/// What the manager keeps on each VM between ticks, and its waits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Managed {
    /// Limits in pages (from the configuration; `set` changes them).
    pub(in crate::vm) limits: Limits,
    /// `balloon <vm> <size>` from the shell: the manager leaves this VM's
    /// balloon alone until `balloon <vm> auto`.
    pub(in crate::vm) manual: bool,
    /// Stage-2 fault-ins, deflate-on-OOM pages, and pages reported or
    /// hinted, at the last tick.
    pub(in crate::vm) faults_seen: u64,
    pub(in crate::vm) returned_seen: u64,
    pub(in crate::vm) oom_deflated_seen: u64,
    /// Per vCPU: the wait for a frame in progress.
    pub(in crate::vm) waits: [Option<FrameWait>; MAX_VCPUS],
    /// Waits that began, and those that lasted past a second (`vm::manage`).
    pub(in crate::vm) waits_begun: u64,
    pub(in crate::vm) waits_long: u64,
    /// Waits that lasted longer than `vm::manage::SLOW_WAIT_US`, and the
    /// longest that ended, in microseconds.
    pub(in crate::vm) waits_slow: u64,
    pub(in crate::vm) wait_longest_us: u64,
    /// Values of the memory manager's input out of bounds for the VM's
    /// size, bounded before the manager saw them (`vm::manage::input`).
    pub(in crate::vm) inputs_clamped: u64,
}

impl Managed {
    /// From the configuration's limits (bytes) for a VM of `size` bytes.
    pub fn from_config(size: u64, min: u64, low: u64, max: u64, weight: u32) -> Self {
        let pages = |b: u64| b / PAGE_SIZE;
        let max = if max == 0 { size } else { max };
        let weight = if weight == 0 { DEFAULT_WEIGHT } else { weight };
        Self {
            limits: Limits {
                min: pages(min),
                low: pages(low.max(min)),
                max: pages(max),
                weight,
            },
            ..Self::default()
        }
    }

    /// Whether the shell set its balloon (`balloon <vm> <size>`): the
    /// manager leaves it alone.
    pub fn manual(&self) -> bool {
        self.manual
    }

    /// Its limits in pages.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Whether a vCPU waits for a frame from the pool now (not at the
    /// VM's own `max`).
    pub fn waiting(&self) -> bool {
        self.waits.iter().flatten().any(|w| !w.at_max)
    }
}

/// Who set a balloon target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetBy {
    /// `balloon <vm> <size>`: the console says when it is reached, and
    /// what it cost.
    Shell,
    /// The memory manager, every tick it changes its mind: counted by
    /// `mm`, no console line.
    Manager,
}

/// One move of the balloon to a new target, measured for `info balloon`
/// and the benchmark.
#[derive(Clone, Copy, Debug)]
pub struct BalloonChange {
    pub from: u32,
    pub to: u32,
    /// The system counter when the target was set, and when the driver
    /// reported it reached.
    pub started: u64,
    pub ended: u64,
    /// Hypervisor (EL2) instructions spent on the change's exits: balloon
    /// register accesses and faults backing RAM, world switch included.
    pub instructions: u64,
    pub exits: u64,
    /// The VM's instruction cache invalidations
    /// ([`RamStats::icache_invalidations`](super::memory::RamStats)) when
    /// the target was set.
    pub icache_at_start: u64,
    /// The shell or the memory manager.
    pub by: SetBy,
}

impl BalloonChange {
    pub fn pages(&self) -> u64 {
        u64::from(self.from.abs_diff(self.to))
    }
}

/// How `debug fail <vm>` fails the VM's next exit, with its lock and the
/// frame table held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectedFailure {
    /// A panic.
    Panic,
    /// A data abort at EL2.
    Abort,
    /// A panic half-way through a frame-table update (the board must stop).
    BrokenFrames,
}

/// Its emulated devices. The PL011 is always there; the others exist
/// while the VM runs, as its configuration asks.
pub struct Devices {
    /// The GIC its guest gets.
    pub(in crate::vm) gic: GuestGic,
    /// The virtual GIC distributor (and GICv3 redistributors).
    pub(in crate::vm) vgic: Option<VDistributor>,
    pub(in crate::vm) balloon: Option<MmioTransport<Balloon>>,
    /// The virtio console (`console = "virtio"`), beside the PL011.
    pub(in crate::vm) vconsole: Option<MmioTransport<VirtioConsole>>,
    /// The emulated PL011 the guest's console driver talks to.
    pub(in crate::vm) uart: Pl011,
    /// Its registers shown read-only while reading them changes nothing.
    pub(in crate::vm) uart_mirror: super::uart_mirror::UartMirror,
}

/// Its side of the shared console: what it printed, what was typed to it,
/// and what waits to be shown.
pub struct VmConsole {
    /// The line it is printing.
    pub(in crate::vm) line: ConsoleLine,
    /// Typed bytes its receive FIFO had no room for yet: they move into it
    /// as the guest reads, so a long line typed or pasted at once arrives
    /// whole although the FIFO holds 32 bytes, and the shell never waits.
    pub(in crate::vm) input: heapless::Deque<u8, CONSOLE_INPUT_MAX>,
    /// The rate limits of the console lines the guest can trigger.
    pub(in crate::vm) lines: GuestLines,
    /// Whether it has the keyboard: its output is shown live.
    pub(in crate::vm) focused: bool,
    /// Console text produced under the VM's lock, printed once it is released.
    pub(in crate::vm) out: Outbox,
    /// A byte's live output from the vCPU fast path
    /// ([`super::handle::Shown::Live`]), printed like the outbox.
    pub(in crate::vm) echo: Option<Echo>,
}

/// What it did, counted for `info`, `mm` and the benchmarks.
pub struct Counters {
    /// Its exits and their EL2 instructions, per kind, since it started
    /// or `info exits <vm> reset`.
    pub(in crate::vm) profile: ExitProfile,
    /// Exceptions injected for bad accesses, per kind.
    pub(in crate::vm) bad_access: BadAccessStats,
    /// How many times it started.
    pub(in crate::vm) starts: u64,
    /// The balloon change in progress (from `set_balloon` until the driver
    /// reports the target reached), and the last one completed.
    pub(in crate::vm) change: Option<BalloonChange>,
    pub(in crate::vm) last_change: Option<BalloonChange>,
    /// The balloon's counters when the VM last stopped.
    pub(in crate::vm) last_balloon_stats: Option<crate::balloon::BalloonStats>,
}

/// Its memory.
pub struct Memory {
    /// Its RAM size in bytes, as configured.
    pub(in crate::vm) size: u64,
    /// Its RAM (stage-2 tables and frames) while it runs.
    pub(in crate::vm) ram: Option<GuestRam>,
}

/// What a snapshot and a restore keep on it (`vm::snapshot`).
#[derive(Default)]
pub struct Snap {
    /// The guest's virtual counter offset (CNTVOFF_EL2): 0 from a boot;
    /// from a restore, what makes its clock go on from the snapshot's.
    pub(in crate::vm) counter_offset: u64,
    /// A snapshot asked its vCPUs to pause: each saves its state at its
    /// next exit and waits until the pause ends.
    pub(in crate::vm) pause_requested: bool,
    /// The paused vCPUs' states.
    pub(in crate::vm) captured: [Option<alloc::boxed::Box<VcpuState>>; MAX_VCPUS],
    /// A restore's vCPU states, each taken by its vCPU as it enters.
    pub(in crate::vm) restored: [Option<alloc::boxed::Box<VcpuState>>; MAX_VCPUS],
}

/// A VM: its identity and lifecycle, and its parts. Every field is the
/// `vm` module's own; the parts that have invariants of their own keep
/// them behind their methods (`Vcpus`).
pub struct Vm {
    /// What the bundle says about it (kernel, RAM size, devices...).
    pub(in crate::vm) spec: VmEntry<'static>,
    pub(in crate::vm) id: usize,
    pub(in crate::vm) name: heapless::String<32>,
    pub(in crate::vm) state: VmState,
    /// Start again once every vCPU has left (PSCI SYSTEM_RESET).
    pub(in crate::vm) restart: bool,
    /// Why the VM last stopped.
    pub(in crate::vm) last_stop: &'static str,
    /// `debug fail <vm> [abort|frames]`: fail in this VM's path at its
    /// next exit.
    pub(in crate::vm) inject_failure: Option<InjectedFailure>,
    /// What the guest gets for a bad access (its configuration's `on_bad_access`).
    pub(in crate::vm) on_bad_access: OnBadAccess,
    /// The physical CPU vCPU 0 is pinned to.
    pub(in crate::vm) cpu: usize,
    /// Its vCPUs: where each runs, whether it is on, whether it is inside
    /// its run loop (RAM is freed only when none is), its list registers.
    pub(in crate::vm) vcpus: Vcpus,
    pub(in crate::vm) memory: Memory,
    pub(in crate::vm) devices: Devices,
    pub(in crate::vm) console: VmConsole,
    pub(in crate::vm) counters: Counters,
    /// Its limits and what the memory manager keeps on it (`vm::manage`).
    pub(in crate::vm) managed: Managed,
    pub(in crate::vm) snap: Snap,
}

impl Vm {
    /// VM `id` of the bundle, stopped.
    pub fn new(id: usize, spec: VmEntry<'static>, gic: GuestGic) -> Self {
        let mut name = heapless::String::new();
        let _ = name.push_str(spec.name());
        Self {
            spec,
            id,
            name,
            state: VmState::Stopped,
            restart: false,
            last_stop: "not started yet",
            inject_failure: None,
            on_bad_access: OnBadAccess::from_code(spec.on_bad_access()).unwrap_or_default(),
            cpu: spec.cpu_affinity().trailing_zeros() as usize,
            vcpus: Vcpus::pinned(spec.cpu_affinity()),
            memory: Memory {
                size: spec.ram_size(),
                ram: None,
            },
            devices: Devices {
                gic,
                vgic: None,
                balloon: None,
                vconsole: None,
                uart: Pl011::new(),
                uart_mirror: super::uart_mirror::UartMirror::new(),
            },
            console: VmConsole {
                line: ConsoleLine::new(),
                input: heapless::Deque::new(),
                lines: GuestLines::new(),
                focused: false,
                out: Outbox::new(),
                echo: None,
            },
            counters: Counters {
                profile: ExitProfile::default(),
                bad_access: BadAccessStats::default(),
                starts: 0,
                change: None,
                last_change: None,
                last_balloon_stats: None,
            },
            managed: Managed::from_config(
                spec.ram_size(),
                spec.mem_min(),
                spec.mem_low(),
                spec.mem_max(),
                spec.weight(),
            ),
            snap: Snap::default(),
        }
    }

    /// VMID of its stage-2 tables (0 is the hypervisor's own).
    pub fn vmid(&self) -> u16 {
        self.id as u16 + 1
    }
}

/// What the rest of the hypervisor reads of a VM. Its fields are the `vm`
/// module's own: outside it, a VM changes only through the functions of
/// `vm::lifecycle`, `vm::balloon_ctl`, `vm::irq`, `vm::manage` and the
/// methods below, which keep its parts consistent.
impl Vm {
    pub fn id(&self) -> usize {
        self.id
    }

    pub fn name(&self) -> &heapless::String<32> {
        &self.name
    }

    /// What the bundle says about it.
    pub fn spec(&self) -> VmEntry<'static> {
        self.spec
    }

    pub fn state(&self) -> VmState {
        self.state
    }

    /// The physical CPU its vCPU 0 is pinned to.
    pub fn cpu(&self) -> usize {
        self.cpu
    }

    /// Its RAM size in bytes, as configured.
    pub fn ram_size(&self) -> u64 {
        self.memory.size
    }

    /// Its guest's virtual counter offset (CNTVOFF_EL2).
    pub fn counter_offset(&self) -> u64 {
        self.snap.counter_offset
    }

    /// The state a restored vCPU starts from, until it has entered.
    pub fn restored_vcpu(&self, vcpu: usize) -> Option<&VcpuState> {
        self.snap.restored.get(vcpu)?.as_deref()
    }

    /// Whether a snapshot pauses it.
    pub fn pause_requested(&self) -> bool {
        self.snap.pause_requested
    }

    /// Its RAM while it runs.
    pub fn ram(&self) -> Option<&GuestRam> {
        self.memory.ram.as_ref()
    }

    pub fn vcpus(&self) -> &Vcpus {
        &self.vcpus
    }

    /// The virtual GIC while it runs with one.
    pub fn vgic(&self) -> Option<&VDistributor> {
        self.devices.vgic.as_ref()
    }

    pub fn balloon(&self) -> Option<&MmioTransport<Balloon>> {
        self.devices.balloon.as_ref()
    }

    pub fn vconsole(&self) -> Option<&MmioTransport<VirtioConsole>> {
        self.devices.vconsole.as_ref()
    }

    pub fn uart_mirror(&self) -> &super::uart_mirror::UartMirror {
        &self.devices.uart_mirror
    }

    /// Its exits since it started or the last reset.
    pub fn profile(&self) -> &ExitProfile {
        &self.counters.profile
    }

    /// `info exits <vm> reset`: count from `now_us` on.
    pub fn reset_profile(&mut self, now_us: u64) {
        self.counters.profile.reset(now_us);
    }

    /// Why it last stopped.
    pub fn last_stop(&self) -> &'static str {
        self.last_stop
    }

    /// How many times it started.
    pub fn starts(&self) -> u64 {
        self.counters.starts
    }

    /// The failure `debug fail` made it wait for at its next exit.
    pub fn inject_failure(&self) -> Option<InjectedFailure> {
        self.inject_failure
    }

    pub fn on_bad_access(&self) -> OnBadAccess {
        self.on_bad_access
    }

    /// `set <vm> on_bad_access <policy>`.
    pub fn set_on_bad_access(&mut self, policy: OnBadAccess) {
        self.on_bad_access = policy;
    }

    pub fn bad_access(&self) -> &BadAccessStats {
        &self.counters.bad_access
    }

    /// Its limits and what the memory manager keeps on it.
    pub fn managed(&self) -> &Managed {
        &self.managed
    }

    /// `balloon <vm> <size>` (true) or `balloon <vm> auto` (false): whether
    /// the memory manager leaves its balloon alone; the setting before.
    pub fn set_manual(&mut self, manual: bool) -> bool {
        core::mem::replace(&mut self.managed.manual, manual)
    }

    /// Console text produced under its lock, to print once it is released.
    pub fn out(&mut self) -> &mut Outbox {
        &mut self.console.out
    }

    /// A byte's live output from the vCPU fast path, to print like the
    /// outbox.
    pub fn take_echo(&mut self) -> Option<Echo> {
        self.console.echo.take()
    }

    /// Typed bytes waiting for room in its UART's receive FIFO.
    pub fn input_waiting(&self) -> usize {
        self.console.input.len()
    }

    pub fn focused(&self) -> bool {
        self.console.focused
    }

    /// The keyboard goes to this VM (`focused`) or to another: a VM that
    /// gets it shows the line it has so far, live.
    pub fn set_focused(&mut self, focused: bool) {
        if focused && !self.console.focused {
            let output = self.console.line.begin_live();
            self.console.out.live(output);
        }
        self.console.focused = focused;
    }

    /// The keyboard goes back to the shell: its output is shown line by
    /// line again.
    pub fn unfocus(&mut self) {
        self.console.focused = false;
        self.console.line.end_live();
    }
}

impl Vm {
    /// This VM's rate-limited lines, at `now_us`.
    pub fn lines_at(&mut self, now_us: u64) -> Lines<'_> {
        Lines {
            lines: &mut self.console.lines,
            out: &mut self.console.out,
            name: &self.name,
            now_us,
        }
    }
}
