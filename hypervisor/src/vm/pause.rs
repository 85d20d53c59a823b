//! A VM paused for a snapshot: a request kicks its vCPUs; each saves its
//! own state at its next exit (`vcpu_loop`: the EL1 registers and the
//! virtual CPU interface are live only on its CPU) and waits, no lock
//! held, until the pause ends. The VM counts as paused once every vCPU
//! inside its run loop has saved its state; nothing of it runs then, so
//! its devices and memory can be copied (`vm::snapshot`).

extern crate alloc;

use alloc::boxed::Box;

use super::cpu::PhysCpu;
use super::state::{Vm, VmState};
use super::vcpu_state::VcpuState;

/// Ask `vm`'s vCPUs to pause for a snapshot: each saves its state at its
/// next exit (the others' CPUs are kicked).
pub fn request_pause(vm: &mut Vm, cpu: &mut impl PhysCpu) -> Result<(), &'static str> {
    if vm.state != VmState::Running {
        return Err("it is not running");
    }
    if vm.snap.pause_requested {
        return Err("a snapshot of it is already being taken");
    }
    vm.snap.pause_requested = true;
    vm.snap.captured = Default::default();
    let me = cpu.index();
    for (_, other) in vm.vcpus.awake_elsewhere(me) {
        cpu.kick(other);
    }
    Ok(())
}

/// Whether vCPU `vcpu` saves its state now (a pause is asked for and it
/// has not yet).
pub fn pause_due(vm: &Vm, vcpu: usize) -> bool {
    vm.snap.pause_requested && vm.snap.captured.get(vcpu).is_some_and(|c| c.is_none())
}

/// vCPU `vcpu` saved its state and waits.
pub fn captured(vm: &mut Vm, vcpu: usize, state: VcpuState) {
    if let Some(slot) = vm.snap.captured.get_mut(vcpu) {
        *slot = Some(Box::new(state));
    }
}

/// Whether every vCPU inside its run loop has saved its state: the VM is
/// paused and may be copied.
pub fn paused(vm: &Vm) -> bool {
    vm.snap.pause_requested
        && vm.state == VmState::Running
        && vm.snap.captured.iter().flatten().count() >= vm.vcpus.inside()
}

/// End the pause: the vCPUs go on as they were.
pub fn resume(vm: &mut Vm) {
    vm.snap.pause_requested = false;
    vm.snap.captured = Default::default();
}
