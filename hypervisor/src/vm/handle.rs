//! What one vCPU exit does to its VM: the decoded exit ([`VcpuExit`]) is
//! handled under the VM's lock — MMIO given to the device it addresses
//! ([`super::bus`]), a stage-2 fault in RAM backed again, PSCI answered,
//! WFI turned into a sleep — and the outcome tells the vCPU loop whether
//! to enter the guest again.
//!
//! A bad access (a device register access the device refuses, an address
//! that is neither RAM nor a device, an unemulated system register) gets
//! what the VM's policy says ([`super::fault`]): by default an exception
//! injected into the guest ([`super::inject`]), else the VM stops.
//!
//! Every exit is recorded in the VM's exit profile ([`super::exit_profile`],
//! `info exits`) under the kind [`handle`] found it to be, with the EL2
//! instructions it cost.

use core::fmt::Write as _;

use super::balloon_ctl;
use super::bus::{self, Detail, Refused};
use super::cpu::{GuestContext, PhysCpu};
use super::devices;
use super::exit::{il32, load_result, FaultKind, VcpuExit};
use super::exit_profile::ExitKind;
use super::fast::{trace_exit, trace_mmio, Fast};
pub use super::fast::{FastExit, Shown};
use super::fault::{BadAccessKind, OnBadAccess};
use super::inject::GuestException;
use super::irq;
use super::manage;
use super::memory::{HostMemory as _, RamError};
use super::psci::{self, PsciOutcome};
use super::ratelimit::LineKind;
use super::state::Vm;
use super::uart_mirror;
use crate::addr::{GuestAddr, GuestPfn};
use crate::trace::trace_event;
use crate::vgic::{ICC_ASGI1R_EL1, ICC_SGI0R_EL1, ICC_SGI1R_EL1};

/// Why a VM stopped after a hypervisor failure in its path.
pub const FAILURE: &str = "a hypervisor failure in this VM's path";

/// What the vCPU loop does after an exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Continue,
    /// The guest executed WFI: sleep until an interrupt could be for it.
    Idle,
    /// No frame for a fault (the pool at its floor): wait a moment and
    /// retry the access; only this vCPU waits.
    WaitMemory,
    /// This vCPU turned itself off (PSCI CPU_OFF).
    VcpuOff,
    Stop(&'static str),
    Reset,
}

/// Everything an exit does under the VM's lock, after the decode: the exit
/// handled, the exit profile and the balloon change's cost updated, vCPU 0's
/// time-driven balloon work done. `before`: the instruction count when the
/// guest left.
pub fn after_exit(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: VcpuExit,
    before: u32,
) -> Outcome {
    let counted = vm.counters.change.is_some() && balloon_work(vm, &exit);
    let (mut outcome, kind) = handle(vm, cpu, vcpu, ctx, exit);
    if let Some(e) = vm.memory.ram.as_ref().and_then(|r| r.frame_error) {
        // A broken frame-table invariant: not a guest's doing, but it
        // ends only this VM.
        vm.console.out.line(format_args!(
            "tidal: [{}] hypervisor failure in this VM's path: the frame table refused one of its frames: {e}; the VM is stopped",
            vm.name
        ));
        outcome = Outcome::Stop(FAILURE);
    }
    let spent = u64::from(cpu.instructions().wrapping_sub(before));
    vm.counters.profile.record(kind, spent);
    if counted {
        if let Some(change) = vm.counters.change.as_mut() {
            change.instructions += spent;
            change.exits += 1;
        }
    }
    balloon_ctl::finish_change(vm, cpu);
    if vcpu == 0 {
        balloon_ctl::poll(vm, cpu);
    }
    outcome
}

/// What the vCPU loop does before it enters the guest from the full path:
/// the list registers synced with the virtual distributor, and the guest's
/// WFI trapped or not ([`traps_wfi`]).
pub fn before_entry(vm: &mut Vm, cpu: &mut impl PhysCpu, vcpu: usize) {
    irq::sync_list_registers(vm, cpu, vcpu);
    cpu.trap_wfi(traps_wfi(vm, vcpu) || cpu.zeroing_wanted());
}

/// Whether vCPU `vcpu`'s WFI traps. Mostly not: the vCPU has its physical
/// CPU to itself, and whatever is for it ends the sleep on its own: an
/// interrupt in a list register (synced before every entry; one made
/// deliverable later comes with a kick) or a physical interrupt, which
/// exits to EL2 (IMO), its virtual timer's included. A trapped WFI costs
/// an exit to fall asleep and a second one to wake: the kick or timer
/// interrupt that ends the hypervisor's sleep is taken again once the
/// guest runs. WFI traps where a sleep must be bounded or seen:
/// - without the virtual GIC (physical interrupts are not routed to EL2);
/// - on vCPU 0 while statistics polling is scheduled: the poll runs from
///   its exits ([`balloon_ctl::poll`]), and a trapped WFI sleeps at most
///   10 ms;
/// - (in [`before_entry`]) while the pool wants frames zeroed ahead of
///   time ([`PhysCpu::zeroing_wanted`]): the CPU zeroes them while its
///   vCPU idles.
pub fn traps_wfi(vm: &Vm, vcpu: usize) -> bool {
    vm.devices.vgic.is_none()
        || (vcpu == 0
            && vm
                .devices
                .balloon
                .as_ref()
                .is_some_and(|b| b.device().next_stats_poll_us().is_some()))
}

/// The fast paths: an exit that certainly has nothing to do but its own
/// access is finished here, right after the decode, instead of by
/// [`after_exit`], with the effects the full path would have. Each is its
/// device's (`vm::devices`), picked here by address; these qualify:
/// - a trapped 32-bit store to the balloon's QueueNotify with nothing new
///   in the queue (`devices::balloon::empty_notify`);
/// - a load from the PL011 that leaves its interrupt line where it is (the
///   flag register polled before each byte sent, above all, and a byte
///   read that leaves the receive interrupt as it was), while no console
///   input waits behind its FIFO, and a store to its DR, a byte the guest
///   sends (`devices::uart::fast_exit`);
/// - a store to a GICv2's GICD_SGIR that sends an SGI to other vCPUs only
///   (`devices::gic::sgi_send`).
///
/// Returns what it did ([`FastExit`]); `None`, with nothing changed, for
/// anything the full path must see.
///
/// All ask that the VM run normally (`runs_plainly`): no stop requested
/// (the full path leaves then), no `debug fail` armed, no frame-table
/// failure to stop on, no console text waiting in its outbox (the full
/// path prints it), no balloon change being measured (its exits are counted
/// and its end is detected after each exit), no time-driven balloon work
/// due on vCPU 0 (the statistics buffer the full path's
/// [`balloon_ctl::poll`] would return); and that the device's interrupt
/// line in the vGIC already has the level the device asks for, so the
/// full path's update of it would change nothing.
///
/// What the vCPU loop skips after a fast exit, the list registers' sync,
/// is only needed once something else changes this vCPU's interrupts:
/// another CPU that does kicks this CPU, and an EOI or an underflow the
/// sync must see raises the maintenance interrupt; either is a physical
/// interrupt pending at EL2, taken as an exit as soon as the guest runs,
/// which goes the full way. The one thing that runs on this CPU between
/// two fast exits and can change them, the memory manager's tick (it kicks
/// other CPUs only), sends the loop round the sync when it ran.
#[inline]
pub fn fast_exit(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: &VcpuExit,
    before: u32,
) -> Option<FastExit> {
    // What every other exit pays: a compare or two, no call.
    match *exit {
        VcpuExit::MmioWrite { ipa, width: 4, .. } if devices::balloon::is_notify(vm, ipa) => {
            devices::balloon::empty_notify(vm, cpu, vcpu, ctx, exit, before)
        }
        VcpuExit::MmioRead { ipa, .. } | VcpuExit::MmioWrite { ipa, .. }
            if devices::uart::contains(ipa) =>
        {
            devices::uart::fast_exit(vm, cpu, vcpu, ctx, exit, before)
        }
        VcpuExit::MmioWrite { ipa, width: 4, .. } if ipa == devices::gic::SGIR_IPA => {
            devices::gic::sgi_send(Fast::new(vm, cpu, vcpu, ctx, exit, before))
        }
        // Not an arm of its own: that made the match a jump table, five
        // more instructions on the notify.
        _ => read_only_store(vm, cpu, vcpu, ctx, exit, before),
    }
}

/// [`fast_exit`] for a store to the PL011's mirror page (`uart_mirror`),
/// a byte sent above all: placed in that page, as `uart_transmit`.
#[inline(never)]
fn read_only_store(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: &VcpuExit,
    before: u32,
) -> Option<FastExit> {
    let exit = exit.read_only_store_at(uart_mirror::PAGE)?;
    devices::uart::fast_exit(vm, cpu, vcpu, ctx, &exit, before)
}

/// Whether an exit is part of moving the balloon: a balloon register access
/// or a fault backing RAM.
#[inline]
fn balloon_work(vm: &Vm, exit: &VcpuExit) -> bool {
    match *exit {
        VcpuExit::MmioRead { ipa, .. }
        | VcpuExit::MmioWrite { ipa, .. }
        | VcpuExit::Abort { ipa, .. } => {
            matches!(bus::route(vm, ipa), Some(bus::Window::Balloon(_)))
                || vm.memory.ram.as_ref().is_some_and(|r| r.contains(ipa))
        }
        _ => false,
    }
}

/// Handle one exit; what the vCPU loop does next, and what kind of exit
/// it was for the profile (`info exits`).
pub fn handle(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: VcpuExit,
) -> (Outcome, ExitKind) {
    let exit = exit.read_only_store_at(uart_mirror::PAGE).unwrap_or(exit);
    // A simple load or store to a RAM page that has no frame (given back
    // through the balloon) carries a full syndrome too: it is a fault to
    // back, not MMIO to emulate.
    let exit = match exit {
        VcpuExit::MmioRead { ipa, .. } | VcpuExit::MmioWrite { ipa, .. }
            if vm.memory.ram.as_ref().is_some_and(|r| r.contains(ipa)) =>
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
    trace_exit(vm, vcpu, &exit, ctx.elr);
    match exit {
        VcpuExit::MmioRead {
            ipa,
            width,
            reg,
            sign_extend,
            sixty_four,
            insn_len,
        } => {
            // Routed once: for the profile and for the access.
            let window = bus::route(vm, ipa);
            let kind = ExitKind::mmio(window.map(bus::Window::device));
            match bus::read(vm, cpu, vcpu, window, width) {
                Ok(value) => {
                    trace_mmio(
                        vm,
                        "read",
                        ipa,
                        width,
                        window.map(bus::Window::device),
                        value,
                    );
                    ctx.set_reg(reg, load_result(value, width, sign_extend, sixty_four));
                }
                Err(refused) => {
                    let access = Access::data(ipa, false, width, insn_len, ctx.far);
                    return (bad_access(vm, cpu, ctx, refused, access), kind);
                }
            }
            ctx.elr = ctx.elr.wrapping_add(u64::from(insn_len));
            (Outcome::Continue, kind)
        }
        VcpuExit::MmioWrite {
            ipa,
            width,
            reg,
            insn_len,
        } => {
            let window = bus::route(vm, ipa);
            let kind = window.map_or(ExitKind::mmio(None), bus::Window::store_kind);
            let value = ctx.reg(reg);
            if let Err(refused) = bus::write(vm, cpu, vcpu, window, width, value) {
                let access = Access::data(ipa, true, width, insn_len, ctx.far);
                return (bad_access(vm, cpu, ctx, refused, access), kind);
            }
            trace_mmio(
                vm,
                "write",
                ipa,
                width,
                window.map(bus::Window::device),
                value,
            );
            ctx.elr = ctx.elr.wrapping_add(u64::from(insn_len));
            (Outcome::Continue, kind)
        }
        VcpuExit::Abort {
            ipa,
            instruction,
            fault,
            write,
        } => abort(vm, cpu, vcpu, ctx, ipa, write, instruction, fault),
        VcpuExit::Hvc { .. } => (psci_outcome(psci::call(vm, cpu, vcpu, ctx)), ExitKind::Hvc),
        VcpuExit::Smc { insn_len, .. } => {
            ctx.elr = ctx.elr.wrapping_add(u64::from(insn_len));
            (psci_outcome(psci::call(vm, cpu, vcpu, ctx)), ExitKind::Smc)
        }
        VcpuExit::Wait { wfe, insn_len } => {
            ctx.elr = ctx.elr.wrapping_add(u64::from(insn_len));
            if wfe {
                // A spin-wait hint: go straight back.
                return (Outcome::Continue, ExitKind::Wfe);
            }
            // A WFI with the virtual GIC idle waits for a physical
            // interrupt (timer, kick).
            let idle = vm
                .devices
                .vgic
                .as_ref()
                .is_some_and(|g| !g.has_pending(vcpu))
                && !irq::lr_pending(vm, cpu, vcpu);
            let outcome = if idle {
                Outcome::Idle
            } else {
                Outcome::Continue
            };
            (outcome, ExitKind::Wfi)
        }
        VcpuExit::Interrupt => (Outcome::Continue, irq::take_physical(vm, cpu, vcpu)),
        VcpuExit::SysReg {
            encoding,
            reg,
            read,
            insn_len,
        } => (
            sysreg(vm, cpu, vcpu, ctx, encoding, reg, read, insn_len),
            ExitKind::SysReg,
        ),
        VcpuExit::Unknown { esr } => {
            let refused = Refused {
                kind: BadAccessKind::UnknownExit,
                detail: Detail::Esr(esr),
            };
            let access = Access::trap(esr & (1 << 25) != 0);
            (bad_access(vm, cpu, ctx, refused, access), ExitKind::Other)
        }
        // Made an MMIO write above.
        VcpuExit::ReadOnlyStore { .. } => (Outcome::Continue, ExitKind::Other),
    }
}

/// Pages of the aligned block around a fault that a fresh fault backs too
/// (128 KiB; Linux's `fault_around_bytes` is 64 KiB): a guest touches the
/// pages it takes back (a deflate, memory reported free) mostly in order,
/// so one exit serves 32 first touches. Measured with `cargo xtask bench
/// bare-metal`, deflate plus first touch: 16 pages 649-652 EL2
/// instructions per page, 32 pages 598-601.
pub(super) const FAULT_AROUND_PAGES: u64 = 32;

/// Back the unbacked neighbours of the page at `ipa` (just backed by a
/// fault) in its aligned [`FAULT_AROUND_PAGES`] block, except pages the
/// balloon holds or a hinting run has (those stay with the pool); returns
/// how many. Nothing while the pool is below its low watermark: the frames
/// are then for faults that need them and for the guests' inflating (an
/// overcommitted board once stalled with every balloon waiting for frames
/// that fault-around had taken). Stops quietly when the pool gives no
/// more: the fault itself was served.
fn fault_around(vm: &mut Vm, cpu: &mut impl PhysCpu, ipa: GuestAddr) -> u64 {
    if cpu.memory().pool_low() {
        return 0;
    }
    // Within the VM's `max` too.
    let room = vm.memory.ram.as_ref().map_or(0, |r| {
        vm.managed.limits.max.saturating_sub(r.mapped_pages())
    });
    let pfn = ipa.pfn().raw();
    let first = pfn & !(FAULT_AROUND_PAGES - 1);
    let mut around: heapless::Vec<GuestPfn, { FAULT_AROUND_PAGES as usize }> = heapless::Vec::new();
    for p in (first..first + FAULT_AROUND_PAGES).map(GuestPfn::new) {
        let kept = vm.devices.balloon.as_ref().is_some_and(|b| {
            let d = b.device();
            d.is_ballooned(p) || d.is_hinted(p)
        });
        if p.raw() != pfn && !kept {
            // Cannot overflow: at most FAULT_AROUND_PAGES.
            let _ = around.push(p);
        }
    }
    vm.memory
        .ram
        .as_mut()
        .map_or(0, |ram| ram.back_around(cpu.memory(), &around, room))
}

/// A stage-2 abort: a RAM page to back, or a bad access.
#[allow(clippy::too_many_arguments)]
#[inline]
fn abort(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    ipa: GuestAddr,
    write: bool,
    instruction: bool,
    fault: FaultKind,
) -> (Outcome, ExitKind) {
    let in_ram = vm.memory.ram.as_ref().is_some_and(|r| r.contains(ipa));
    if in_ram && fault == FaultKind::Translation {
        return (back_page(vm, cpu, vcpu, ctx, ipa), ExitKind::Stage2Fault);
    }
    let kind = if instruction && !in_ram {
        BadAccessKind::InstructionFetch
    } else if in_ram {
        BadAccessKind::RamFault
    } else if let Some(window) = bus::route(vm, ipa) {
        // A device register, but the syndrome does not say
        // which register or width (ldp/stp, writeback, SIMD).
        BadAccessKind::NoSyndrome(window.device())
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
    let outcome = bad_access(vm, cpu, ctx, Refused::new(kind), access);
    (outcome, ExitKind::BadAccess)
}

/// A trapped system register access: the GICv3 SGI registers, or a bad
/// access.
#[allow(clippy::too_many_arguments)]
#[inline]
fn sysreg(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    encoding: (u8, u8, u8, u8, u8),
    reg: u8,
    read: bool,
    insn_len: u8,
) -> Outcome {
    let sgi = [ICC_SGI1R_EL1, ICC_ASGI1R_EL1, ICC_SGI0R_EL1].contains(&encoding);
    match vm.devices.vgic.as_mut() {
        // The SGI generation registers are write-only.
        Some(vgic) if sgi && !read => {
            if let Ok(effect) = vgic.send_sgi_v3(vcpu, ctx.reg(reg)) {
                irq::apply_effect(vm, cpu, effect);
            }
        }
        Some(_) if sgi => ctx.set_reg(reg, 0),
        _ => {
            let refused = Refused {
                kind: BadAccessKind::SystemRegister,
                detail: Detail::SysReg { encoding, read },
            };
            return bad_access(vm, cpu, ctx, refused, Access::trap(il32(insn_len)));
        }
    }
    ctx.elr = ctx.elr.wrapping_add(u64::from(insn_len));
    Outcome::Continue
}

/// The `mmio` trace event of an access the device accepted.
fn psci_outcome(outcome: PsciOutcome) -> Outcome {
    match outcome {
        PsciOutcome::Answered => Outcome::Continue,
        PsciOutcome::SystemOff => Outcome::Stop("powered off by the guest (PSCI SYSTEM_OFF)"),
        PsciOutcome::SystemReset => Outcome::Reset,
        PsciOutcome::CpuOff => Outcome::VcpuOff,
    }
}

/// A translation fault on a RAM page not backed (never touched, or given
/// back: balloon, reported, hinted): back it, zeroed or with the guest's
/// poison value. With no frame to be had (the pool at its floor), the
/// vCPU waits and retries; the memory manager sees the wait as pressure.
#[inline]
fn back_page(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &GuestContext,
    ipa: GuestAddr,
) -> Outcome {
    let fill = vm
        .devices
        .balloon
        .as_ref()
        .map_or(0, |b| b.device().page_fill());
    let Some(ram) = vm.memory.ram.as_mut() else {
        return Outcome::Continue;
    };
    ram.set_page_fill(fill);
    // Never backed above its `max` (a VM whose balloon does not keep it
    // there waits, then stops).
    let max = vm.managed.limits.max;
    if max < ram.pages() && ram.mapped_pages() >= max {
        if manage::max_wait(vm, vcpu, cpu.uptime_us()) {
            let why = "it needed more than its memory max and its balloon made no room";
            vm.console.out.line(format_args!(
                "tidal: [{}] stopping the VM: {why} within {} s",
                vm.name,
                manage::WAIT_BOUND_US / 1_000_000
            ));
            return Outcome::Stop(why);
        }
        return Outcome::WaitMemory;
    }
    let backed = ram.stats.faults_backed;
    match ram.translate_or_back(cpu.memory(), ipa) {
        Ok(_) => {}
        Err(RamError::OutOfMemory { .. }) => {
            let (now, free) = (cpu.uptime_us(), cpu.memory().pool_free());
            manage::frame_wait(vm, vcpu, now, free);
            return Outcome::WaitMemory;
        }
        Err(e) => {
            let why = "its RAM could not be mapped";
            vm.console.out.line(format_args!(
                "tidal: [{}] stopping the VM: {why}: IPA {ipa:#x}, PC {:#x}: {e}",
                vm.name, ctx.elr
            ));
            return Outcome::Stop(why);
        }
    }
    if vm.managed.waits.get(vcpu).is_some_and(Option::is_some) {
        manage::frame_served(vm, vcpu, cpu.uptime_us());
    }
    let fresh = vm
        .memory
        .ram
        .as_ref()
        .is_some_and(|r| r.stats.faults_backed != backed);
    let around = if fresh { fault_around(vm, cpu, ipa) } else { 0 };
    trace_event!(
        "fault-in vm{=usize} {=u64:#x} fresh={=bool} fill={=u32:#x} around={=u64}",
        vm.id,
        ipa.raw(),
        fresh,
        fill,
        around
    );
    if let Some(balloon) = vm.devices.balloon.as_mut() {
        balloon.device_mut().page_refaulted(ipa.pfn());
    }
    Outcome::Continue
}

/// The facts of a refused access, for the message and the exception.
struct Access {
    ipa: Option<GuestAddr>,
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
    fn data(ipa: GuestAddr, write: bool, width: u8, insn_len: u8, far: u64) -> Self {
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
fn bad_access(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    ctx: &mut GuestContext,
    refused: Refused,
    access: Access,
) -> Outcome {
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
        vm.console.out.line(format_args!(
            "tidal: [{}] stopping the VM (on_bad_access = \"stop\"): {refused}: {place}",
            vm.name
        ));
        return Outcome::Stop(bad_access_reason(refused.kind));
    }
    let exception = if access.fetch {
        GuestException::InstructionAbort
    } else {
        refused.kind.exception(access.write)
    };
    vm.counters.bad_access.count(refused.kind);
    vm.lines_at(cpu.uptime_us()).say(
        LineKind::Abort,
        format_args!("{} injected: {refused}: {place}", exception.label()),
    );
    cpu.inject(ctx, exception, access.far, access.il32);
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
