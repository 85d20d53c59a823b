//! What every fast path shares (`handle::fast_exit` dispatches, each
//! device's module has its own): the exit being handled ([`Fast`]), the
//! conditions under which an exit may skip the full path
//! ([`runs_plainly`]), its record in the exit profile and the trace, and
//! what it did ([`FastExit`]).

use super::cpu::{GuestContext, PhysCpu};
use super::exit::VcpuExit;
use super::exit_profile::ExitKind;
use super::fault::Device;
use super::state::{Vm, VmState};
use crate::addr::GuestAddr;
use crate::trace::trace_event;
use crate::vgic::VDistributor;

/// What a fast exit did (small: every fast exit returns it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastExit {
    /// The instruction count it recorded up to (the next exit's `before`:
    /// the vCPU loop counts every instruction of a fast exit, unlock, world
    /// switch and printing included, in one exit or the next).
    pub recorded: u32,
    /// What the caller prints once the VM's lock is released.
    pub shown: Shown,
}

/// Console output a fast exit made (a byte sent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shown {
    Nothing,
    /// Text in the VM's outbox, printed as after a full exit.
    Outbox,
    /// A byte shown live, kept in the VM's console part until printed ([`Vm::take_echo`](super::state::Vm::take_echo)).
    Live,
}

impl FastExit {
    #[inline]
    pub fn quiet(recorded: u32) -> Self {
        Self {
            recorded,
            shown: Shown::Nothing,
        }
    }
}

/// The conditions every fast path shares (see `handle::fast_exit`).
#[inline]
pub fn runs_plainly(vm: &Vm, cpu: &impl PhysCpu, vcpu: usize) -> bool {
    vm.state == VmState::Running
        && vm.inject_failure.is_none()
        && vm.counters.change.is_none()
        && vm.console.out.is_empty()
        && vm
            .memory
            .ram
            .as_ref()
            .is_some_and(|r| r.frame_error.is_none())
        && !(vcpu == 0
            && vm.devices.balloon.as_ref().is_some_and(|b| {
                b.device()
                    .next_stats_poll_us()
                    .is_some_and(|t| t <= cpu.uptime_us())
            }))
}

/// A fast exit being handled: what each fast path works on.
pub struct Fast<'a, C> {
    pub vm: &'a mut Vm,
    pub cpu: &'a mut C,
    pub vcpu: usize,
    pub ctx: &'a mut GuestContext,
    pub exit: &'a VcpuExit,
    /// The instruction count the exit's cost runs from.
    pub before: u32,
}

impl<'a, C: PhysCpu> Fast<'a, C> {
    #[inline]
    pub fn new(
        vm: &'a mut Vm,
        cpu: &'a mut C,
        vcpu: usize,
        ctx: &'a mut GuestContext,
        exit: &'a VcpuExit,
        before: u32,
    ) -> Self {
        Fast {
            vm,
            cpu,
            vcpu,
            ctx,
            exit,
            before,
        }
    }

    /// The exit's store, if it is one.
    #[inline]
    pub fn stored(&self) -> Option<Stored> {
        match *self.exit {
            VcpuExit::MmioWrite {
                ipa,
                width,
                reg,
                insn_len,
            } => Some(Stored {
                ipa,
                width,
                reg,
                insn_len,
            }),
            _ => None,
        }
    }

    /// Whether a device access at `ipa` may go the fast way: `ipa` is not
    /// the VM's RAM (a load or store there is a fault to back) and the VM
    /// runs plainly (`runs_plainly`).
    #[inline]
    pub fn plain_access(&self, ipa: GuestAddr) -> bool {
        !self.vm.memory.ram.as_ref().is_some_and(|r| r.contains(ipa))
            && runs_plainly(self.vm, self.cpu, self.vcpu)
    }

    /// The access is done: traced, the guest's PC stepped past its
    /// `insn_len`-byte instruction, and the exit recorded as `kind`; the
    /// instruction count recorded up to.
    #[inline]
    pub fn finish(self, kind: ExitKind, access: Traced, insn_len: u8) -> u32 {
        trace_exit(self.vm, self.vcpu, self.exit, self.ctx.elr);
        trace_mmio(
            self.vm,
            access.what,
            access.ipa,
            access.width,
            Some(access.device),
            access.value,
        );
        self.ctx.elr = self.ctx.elr.wrapping_add(u64::from(insn_len));
        record_fast(self.vm, self.cpu, kind, self.before)
    }
}

/// A trapped store's operands ([`Fast::stored`]).
pub struct Stored {
    pub ipa: GuestAddr,
    pub width: u8,
    pub reg: u8,
    pub insn_len: u8,
}

/// What [`Fast::finish`] traces of an MMIO access.
pub struct Traced {
    pub what: &'static str,
    pub ipa: GuestAddr,
    pub width: u8,
    pub device: Device,
    pub value: u64,
}

/// The trace's record of an exit (nothing without the `trace` feature).
#[inline]
pub fn trace_exit(vm: &Vm, vcpu: usize, exit: &VcpuExit, pc: u64) {
    trace_event!(
        "exit vm{=usize} vcpu{=usize} {} pc={=u64:#x}",
        vm.id,
        vcpu,
        exit.kind(),
        pc
    );
}

/// Whether SPI `intid`'s line in the vGIC (if the VM has one) is at `level`.
#[inline]
pub fn line_at(vgic: Option<&VDistributor>, intid: u32, level: bool) -> bool {
    vgic.is_none_or(|g| g.spi_line(intid) == Some(level))
}

/// A fast exit recorded as `kind`, with the instructions since `before`;
/// the count it recorded up to.
#[inline]
pub fn record_fast(vm: &mut Vm, cpu: &mut impl PhysCpu, kind: ExitKind, before: u32) -> u32 {
    let now = cpu.instructions();
    vm.counters
        .profile
        .record(kind, u64::from(now.wrapping_sub(before)));
    now
}

/// The trace's record of an MMIO access (nothing without the `trace`
/// feature), naming the device it reached.
pub fn trace_mmio(
    vm: &Vm,
    op: &str,
    ipa: GuestAddr,
    width: u8,
    device: Option<Device>,
    value: u64,
) {
    trace_event!(
        "mmio vm{=usize} {=str} {=u64:#x} {=u8}B {} = {=u64:#x}",
        vm.id,
        op,
        ipa.raw(),
        width,
        device,
        value
    );
}
