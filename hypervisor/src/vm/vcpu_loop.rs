//! The vCPU loop: one vCPU of one VM run on this physical CPU until it
//! leaves (its VM stops or resets, or it turns itself off). Each trip:
//! the list registers synced, the guest entered, its exit finished on a
//! fast path ([`handle::fast_exit`]) or handled in full
//! ([`handle::after_exit`]), what the VM has to say printed once its lock
//! is released, the memory manager's tick looked at, and a sleep when the
//! guest waits for an interrupt or a frame.
//!
//! It reaches the board through [`VcpuHost`]: the VM table's locks, the
//! world switch, the tick, the console and the sleeps. `run.rs` implements
//! it for the target; the host tests run the same loop over scripted exits
//! and the fake CPU.
//!
//! Lock order: the VM's lock is taken once per exit (twice when the exit
//! waited: the list registers are synced again before the entry), never
//! held across the world switch, a sleep, the tick or the printing.

extern crate alloc;

use core::ops::DerefMut;

use super::console_line::Echo;
use super::cpu::{GuestContext, PhysCpu};
use super::exit::VcpuExit;
use super::handle::{self, Outcome, Shown};
use super::lifecycle;
use super::outbox::Notice;
use super::state::{InjectedFailure, Vm, VmState};
use super::vcpu_state::{Running, VcpuState};
use crate::hw::context::{El1State, VirtualInterface};

/// Fast exits between two looks at the clock for the memory manager's
/// tick (under QEMU a counter read takes the global lock, as every device
/// access does; the tick is global, and CPU 0's idle shell looks at least
/// every 20 ms).
pub const FAST_EXITS_PER_TICK_LOOK: u32 = 16;

/// What the vCPU loop needs of the board it runs on. Every method takes
/// `&self`: the loop holds a VM's guard while it calls some of them.
pub trait VcpuHost {
    /// A VM's lock held: the slot of the VM table (`None`: no VM there).
    type Guard<'a>: DerefMut<Target = Option<Vm>>
    where
        Self: 'a;
    fn lock_vm(&self, id: usize) -> Self::Guard<'_>;
    /// Load what the guest runs with on this CPU, as vCPU `vcpu` enters
    /// (EL1 registers reset, or restored with its virtual interface if
    /// `vm.restored_vcpu(vcpu)` has them; stage-2 and virtual interface
    /// controls; the guest's counter offset).
    fn load_guest(&self, vm: &Vm, vcpu: usize);
    /// What this CPU holds of the guest that runs on it, for a snapshot:
    /// its EL1 registers and virtual timer, and (`gic`) its virtual CPU
    /// interface.
    fn save_cpu_state(&self, gic: bool) -> (El1State, VirtualInterface);
    /// Run the guest until it exits, and decode the exit.
    fn run_guest(&self, ctx: &mut GuestContext) -> VcpuExit;
    /// The memory manager's tick, if due: whether it ran (the targets it
    /// set may raise interrupts this CPU's guest must see listed).
    fn memory_tick(&self) -> bool;
    /// Print what a VM's path left in its outbox (no VM lock held).
    fn show(&self, pending: Pending);
    /// Print a byte VM `id` showed live from a fast exit (no lock held).
    fn show_live(&self, id: usize, echo: &Option<Echo>);
    /// `debug fail <vm>`: fail as a bug in a frame-table path would, with
    /// the VM's lock and the frame table held.
    fn fail(&self, vm: &mut Vm, kind: InjectedFailure) -> !;
    /// The guest waits for an interrupt: zero frames ahead if the pool
    /// wants them, then sleep until an interrupt (at most 10 ms).
    fn idle(&self);
    /// A fault found no frame: this vCPU alone waits a moment (1 ms).
    fn wait_memory(&self);
    /// On the shell's CPU, let the shell look at the console when it is
    /// due (`slept`: the vCPU just slept); whether it looked. `first`: the
    /// loop begins (the look is scheduled, nothing looked at).
    fn shell_look(&self, slept: bool, first: bool) -> bool;
}

/// Console text a VM's path left in its outbox, taken under its lock to be
/// printed after.
pub struct Pending {
    pub id: usize,
    pub name: heapless::String<32>,
    pub notices: alloc::collections::VecDeque<Notice>,
    pub dropped: u64,
}

/// What `vm` has to print, taken out of its outbox.
pub fn take_pending(vm: &mut Vm) -> Option<Pending> {
    if vm.console.out.is_empty() {
        return None;
    }
    let (notices, dropped) = vm.console.out.take();
    Some(Pending {
        id: vm.id,
        name: vm.name.clone(),
        notices,
        dropped,
    })
}

/// Print what `vm`'s outbox holds, once `guard` (its lock) is dropped.
#[inline]
fn release<H: VcpuHost>(host: &H, mut guard: H::Guard<'_>) {
    let pending = guard.as_mut().and_then(take_pending);
    drop(guard);
    if let Some(pending) = pending {
        host.show(pending);
    }
}

/// Run vCPU `vcpu` of VM `id` on this CPU (`cpu`) until it leaves.
pub fn run_vcpu<H: VcpuHost>(host: &H, cpu: &mut impl PhysCpu, id: usize, vcpu: usize) {
    let mut ctx = {
        let mut guard = host.lock_vm(id);
        let Some(vm) = guard.as_mut() else { return };
        let Some((entry, x0)) = lifecycle::enter(vm, vcpu) else {
            return;
        };
        host.load_guest(vm, vcpu);
        match lifecycle::take_restored(vm, vcpu) {
            Some(running) => running.ctx,
            None => GuestContext::new(entry, x0),
        }
    };
    // Whether the list registers were synced since the last wait: an exit
    // handled with nothing to wait for syncs them under the lock it
    // already holds, so the common exit takes the VM's lock once (its
    // other vCPU takes it as often).
    let mut synced = false;
    // An exit's cost (the exit profile) runs from here: the list registers
    // synced, the world switch in, the trap, the handling.
    let mut before = cpu.instructions();
    // Fast exits since the clock was last looked at for the memory tick.
    let mut unticked: u32 = 0;
    host.shell_look(false, true);
    'entry: loop {
        if !synced {
            before = cpu.instructions();
            let mut guard = host.lock_vm(id);
            if let Some(vm) = guard.as_mut() {
                if vm.state == VmState::StopRequested {
                    // Asked while this CPU was away from the guest (the
                    // shell's look, on its CPU, a stop's own kick skips).
                    return leave_stopping(host, guard, cpu, vcpu);
                }
                handle::before_entry(vm, cpu, vcpu);
            }
        }
        synced = false;
        // Exits with nothing else to do go straight back to the guest
        // (`handle::fast_exit` says which, what that skips and why it may);
        // each is counted from the previous one's record, so the unlock,
        // the world switch and the printing of a byte it sent are in its
        // cost.
        let (exit, mut guard) = loop {
            let exit = host.run_guest(&mut ctx);
            let mut guard = host.lock_vm(id);
            let Some(vm) = guard.as_mut() else { return };
            let Some(fast) = handle::fast_exit(vm, cpu, vcpu, &mut ctx, &exit, before) else {
                break (exit, guard);
            };
            before = fast.recorded;
            match fast.shown {
                Shown::Nothing => drop(guard),
                Shown::Outbox => release(host, guard),
                Shown::Live => {
                    let echo = vm.console.echo.take();
                    drop(guard);
                    host.show_live(id, &echo);
                }
            }
            unticked += 1;
            if unticked >= FAST_EXITS_PER_TICK_LOOK {
                unticked = 0;
                if host.memory_tick() {
                    // What it changed is listed before the guest runs.
                    continue 'entry;
                }
            }
        };
        let Some(vm) = guard.as_mut() else { return };
        if vm.state == VmState::StopRequested {
            return leave_stopping(host, guard, cpu, vcpu);
        }
        if let Some(kind) = vm.inject_failure.take() {
            host.fail(vm, kind);
        }
        if matches!(exit, VcpuExit::Interrupt) && cpu.counts_instructions() {
            // An interrupt exit's cost starts at its vector (which read the
            // counter): since its entry the guest may have slept in WFI,
            // which QEMU's -icount PMU counts as EL2 instructions. The
            // world switch in and the sync before it are left out then.
            before = ctx.irq_instructions as u32;
        }
        let outcome = handle::after_exit(vm, cpu, vcpu, &mut ctx, exit, before);
        let left = match outcome {
            Outcome::Continue | Outcome::Idle | Outcome::WaitMemory => false,
            Outcome::Stop(why) => {
                lifecycle::begin_stop(vm, cpu, why, false);
                true
            }
            Outcome::Reset => {
                lifecycle::begin_stop(vm, cpu, "reset by the guest (PSCI SYSTEM_RESET)", true);
                true
            }
            Outcome::VcpuOff => true,
        };
        if left {
            lifecycle::leave(vm, cpu, vcpu, true);
        }
        if outcome == Outcome::Continue {
            before = cpu.instructions();
            handle::before_entry(vm, cpu, vcpu);
            synced = true;
        }
        let pause = !left && super::pause::pause_due(vm, vcpu);
        if pause {
            capture(host, vm, vcpu, &ctx);
        }
        release(host, guard);
        if left {
            return;
        }
        if pause {
            if !sit_out_pause(host, cpu, id, vcpu) {
                return;
            }
            synced = false;
            continue;
        }
        if outcome == Outcome::Idle {
            host.idle();
        }
        if host.memory_tick() {
            synced = false;
        }
        if outcome == Outcome::WaitMemory {
            // No frame for its fault: only this vCPU waits (no lock held),
            // then retries the access.
            host.wait_memory();
        }
        let slept = matches!(outcome, Outcome::Idle | Outcome::WaitMemory);
        if host.shell_look(slept, false) {
            // No lock held. What the shell changed (input for this guest,
            // a stop) is synced before the guest runs again, and its work
            // is not counted in the next exit's cost.
            synced = false;
        }
    }
}

/// A snapshot asked the VM to pause: save this vCPU's state (its
/// registers, and what its CPU holds of the guest) for the snapshot.
fn capture<H: VcpuHost>(host: &H, vm: &mut Vm, vcpu: usize, ctx: &GuestContext) {
    let (el1, vif) = host.save_cpu_state(vm.devices.vgic.is_some());
    let listed = vm.vcpus.listed(vcpu).copied().unwrap_or_default();
    let state = VcpuState {
        power: vm.vcpus.power(vcpu),
        running: Some(Running {
            ctx: ctx.clone(),
            el1,
            vif,
            listed,
        }),
    };
    super::pause::captured(vm, vcpu, state);
}

/// Wait, paused, until the snapshot that paused the VM ends the pause
/// (true: go on) or the VM stops (false: this vCPU has left). No lock is
/// held while it waits; on the shell's CPU the shell goes on looking (it
/// may be the one taking the snapshot).
fn sit_out_pause<H: VcpuHost>(host: &H, cpu: &mut impl PhysCpu, id: usize, vcpu: usize) -> bool {
    loop {
        host.wait_memory();
        host.shell_look(true, false);
        let mut guard = host.lock_vm(id);
        let Some(vm) = guard.as_mut() else {
            return false;
        };
        if vm.state == VmState::StopRequested {
            leave_stopping(host, guard, cpu, vcpu);
            return false;
        }
        if !vm.pause_requested() {
            release(host, guard);
            return true;
        }
        drop(guard);
    }
}

/// A vCPU of a stopping VM leaves its loop (the last one out frees it).
fn leave_stopping<H: VcpuHost>(
    host: &H,
    mut guard: H::Guard<'_>,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
) {
    if let Some(vm) = guard.as_mut() {
        lifecycle::leave(vm, cpu, vcpu, true);
    }
    release(host, guard);
}
