//! Interrupt delivery to a VM: device lines into its virtual distributor,
//! kicks for the vCPUs a change concerns, the physical interrupts a vCPU's
//! CPU takes while the guest runs, and the list registers synced with the
//! distributor before every entry.

use super::cpu::PhysCpu;
use super::device_memory::{ConsoleView, DeviceView};
use super::exit_profile::ExitKind;
use super::fdt::layout;
use super::ratelimit::LineKind;
use super::state::Vm;
use crate::limits::MAX_LRS;
use crate::vgic::intid::{HYP_TIMER_PPI, KICK_SGI, MAINTENANCE_PPI, SPURIOUS, VTIMER_PPI};
use crate::vgic::{LrStatus, VgicEffect};
use crate::virtio::mmio::MmioTransport;
use crate::virtio::TransportEvent;
use crate::virtio_console::VirtioConsole;

/// The guest's PL011 and first virtio-mmio device, as INTIDs.
pub const UART_INTID: u32 = 32 + layout::UART_SPI;
pub const VIRTIO_INTID: u32 = 32 + layout::VIRTIO_SPI_BASE;
/// The virtio console's.
pub const VCONSOLE_INTID: u32 = 32 + layout::VIRTIO_SPI_BASE + layout::CONSOLE_SLOT as u32;

/// Kick the CPUs of the vCPUs a vGIC change made something deliverable to
/// (not the caller's own CPU: it syncs before entering anyway).
pub fn apply_effect(vm: &Vm, cpu: &mut impl PhysCpu, effect: VgicEffect) {
    let me = cpu.index();
    for (v, other) in vm.vcpus.awake_elsewhere(me) {
        if effect.kicks(v) {
            cpu.kick(other);
        }
    }
}

/// Drive the balloon's interrupt line into the virtual distributor.
pub fn update_virtio(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    let level = vm
        .devices
        .balloon
        .as_ref()
        .is_some_and(|b| b.interrupt_pending());
    set_line(vm, cpu, VIRTIO_INTID, level);
}

/// After the guest's InterruptACK: bits it did not acknowledge keep the
/// device's line high. A guest that configured the SPI edge-triggered (the
/// device tree says edge, as QEMU's `virt` does) would then never see them:
/// a bit raised between its read of InterruptStatus and its ACK (a target
/// set from another CPU, a statistics request) makes no rising edge, and
/// with the line stuck high no later event does either. So the ACK that
/// leaves bits set signals a new edge, as an edge-signalling device pulses
/// again. A level-configured SPI needs nothing: it stays pending while the
/// line is high.
pub fn update_virtio_after_ack(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    update_virtio(vm, cpu);
    let pending = vm
        .devices
        .balloon
        .as_ref()
        .is_some_and(|b| b.interrupt_pending());
    edge_again(vm, cpu, VIRTIO_INTID, pending);
}

/// An edge-configured SPI whose device still has bits pending after an
/// ACK signals again ([`update_virtio_after_ack`]).
fn edge_again(vm: &mut Vm, cpu: &mut impl PhysCpu, intid: u32, pending: bool) {
    let Some(vgic) = vm.devices.vgic.as_mut() else {
        return;
    };
    if pending && vgic.spi_is_edge(intid) == Some(true) {
        if let Ok(effect) = vgic.pend_edge(intid) {
            apply_effect(vm, cpu, effect);
        }
    }
}

/// Drive the virtio console's interrupt line into the virtual distributor.
pub fn update_vconsole(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    let level = vm
        .devices
        .vconsole
        .as_ref()
        .is_some_and(|c| c.interrupt_pending());
    set_line(vm, cpu, VCONSOLE_INTID, level);
}

/// [`update_virtio_after_ack`] for the virtio console.
pub fn update_vconsole_after_ack(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    update_vconsole(vm, cpu);
    let pending = vm
        .devices
        .vconsole
        .as_ref()
        .is_some_and(|c| c.interrupt_pending());
    edge_again(vm, cpu, VCONSOLE_INTID, pending);
}

/// The virtio console's transmit buffers returned since its last
/// interrupt, signalled now (every memory tick; see
/// [`crate::virtio::VirtioDevice::defers_used_signal`]); first one more
/// bounded pass over a queue whose last pass stopped at its bound
/// ([`VirtioConsole::resume`]), so that what a guest published without
/// notifying again still moves.
pub fn flush_vconsole(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    if vm
        .devices
        .vconsole
        .as_ref()
        .is_some_and(|c| c.device().has_more())
    {
        with_vconsole(vm, cpu, |transport, view| {
            Ok::<_, ()>(
                transport.device_work(view, |device, queues, env| device.resume(queues, env)),
            )
        });
        update_vconsole(vm, cpu);
    }
    if vm
        .devices
        .vconsole
        .as_mut()
        .is_some_and(|c| c.flush_deferred())
    {
        update_vconsole(vm, cpu);
    }
}

/// Whether typed input goes to the virtio console: its driver is ready
/// (DRIVER_OK, not waiting for a reset) and its receive queue enabled.
/// Before that (the kernel's boot, a guest without the driver) it goes to
/// the PL011.
pub fn vconsole_takes_input(vm: &Vm) -> bool {
    vm.devices.vconsole.as_ref().is_some_and(|c| {
        c.status() & crate::virtio::mmio::STATUS_DRIVER_OK != 0
            && !c.needs_reset()
            && c.queues()
                .get(crate::virtio_console::RECEIVEQ)
                .is_some_and(|q| q.ready())
    })
}

/// Waiting input into the virtio console's receive buffers, as far as the
/// driver posted them; its interrupt line updated.
fn feed_vconsole(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    with_vconsole(vm, cpu, |transport, view| {
        Ok::<_, ()>(transport.device_work(view, |device, queues, env| device.receive(queues, env)))
    });
    update_vconsole(vm, cpu);
}

/// `work` on the VM's virtio console with its view of the VM
/// ([`ConsoleView`]); the event it returns is said on the console (rate
/// limited). `None` without a console or RAM; `work`'s error is passed on.
pub fn with_vconsole<C: PhysCpu, E>(
    vm: &mut Vm,
    cpu: &mut C,
    work: impl FnOnce(
        &mut MmioTransport<VirtioConsole>,
        &mut ConsoleView<'_, C::Memory>,
    ) -> Result<TransportEvent, E>,
) -> Option<Result<(), E>> {
    let now = cpu.uptime_us();
    let (Some(transport), Some(ram)) = (vm.devices.vconsole.as_mut(), vm.memory.ram.as_mut())
    else {
        return None;
    };
    let mut view = ConsoleView {
        memory: DeviceView {
            ram,
            mem: cpu.memory(),
            now_us: now,
        },
        line: &mut vm.console.line,
        out: &mut vm.console.out,
        name: &vm.name,
        focused: vm.console.focused,
        input: &mut vm.console.input,
    };
    let event = match work(transport, &mut view) {
        Ok(event) => event,
        Err(e) => return Some(Err(e)),
    };
    if let Some(msg) = event.message() {
        let kind = match msg {
            TransportEvent::NeedsReset { .. } => LineKind::DeviceError,
            _ => LineKind::DeviceEvent,
        };
        vm.lines_at(now).say(kind, format_args!("console: {msg}"));
    }
    Some(Ok(()))
}

/// Drive the PL011's interrupt line into the virtual distributor.
pub fn update_uart(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    let level = vm.devices.uart.irq_level();
    set_line(vm, cpu, UART_INTID, level);
}

fn set_line(vm: &mut Vm, cpu: &mut impl PhysCpu, intid: u32, level: bool) {
    if let Some(Ok(effect)) = vm.devices.vgic.as_mut().map(|g| g.set_level(intid, level)) {
        apply_effect(vm, cpu, effect);
    }
}

/// The PL011's mirror page brought up to date with the model (shown, or
/// withdrawn while input waits): after every UART access that trapped and
/// every move of input into its FIFO, before the UART's line moves.
#[inline]
pub fn sync_uart_mirror(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    let input_waits = !vm.console.input.is_empty();
    vm.devices.uart_mirror.sync(
        &vm.devices.uart,
        input_waits,
        vm.memory.ram.as_mut(),
        cpu.memory(),
    );
}

/// The PL011's mirror page withdrawn (before input enters its FIFO, and at
/// a stop).
pub fn withdraw_uart_mirror(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    vm.devices
        .uart_mirror
        .withdraw(vm.memory.ram.as_mut(), cpu.memory());
}

/// Give a byte typed on the physical console to a VM: into its PL011's
/// receive FIFO, or queued behind it until the guest reads (see
/// [`feed_console`]). False (the byte is lost) only when the queue is full:
/// the guest has not read for [`super::state::CONSOLE_INPUT_MAX`] bytes.
pub fn console_input(vm: &mut Vm, cpu: &mut impl PhysCpu, byte: u8) -> bool {
    console_input_bytes(vm, cpu, &[byte]) == 1
}

/// [`console_input`] for several bytes at once, with one update of the
/// PL011's interrupt: how many were kept (the first ones; the rest found
/// the queue full and are lost).
pub fn console_input_bytes(vm: &mut Vm, cpu: &mut impl PhysCpu, bytes: &[u8]) -> usize {
    let kept = bytes
        .iter()
        .take_while(|&&b| vm.console.input.push_back(b).is_ok())
        .count();
    feed_console(vm, cpu);
    kept
}

/// Move queued console input into the PL011's receive FIFO while it has
/// room (after a guest read took a byte out), and update its interrupt.
pub fn feed_console(vm: &mut Vm, cpu: &mut impl PhysCpu) {
    if vconsole_takes_input(vm) {
        feed_vconsole(vm, cpu);
        return;
    }
    if !vm.console.input.is_empty() {
        // Before the byte can be seen: the guest must trap to take it.
        withdraw_uart_mirror(vm, cpu);
    }
    while let Some(&byte) = vm.console.input.front() {
        if !vm.devices.uart.push_input(byte) {
            break;
        }
        vm.console.input.pop_front();
    }
    update_uart(vm, cpu);
    sync_uart_mirror(vm, cpu);
}

/// Take the physical interrupt that made the guest leave (the guest was
/// interrupted): the virtual timer goes to the guest, the rest is ours.
/// One per exit: acknowledging again to find the next would cost every
/// interrupt exit one more read of the CPU interface (under QEMU a device
/// access that takes its global lock), and came back spurious for half of
/// them; a second interrupt pending at once makes the guest leave again as
/// soon as it is entered. A level interrupt that stays asserted (the
/// console's UART until the shell reads it) is taken once per exit too.
/// What the exit was, for the profile: the source of the interrupt.
pub fn take_physical(vm: &mut Vm, cpu: &mut impl PhysCpu, vcpu: usize) -> ExitKind {
    let (intid, iar) = cpu.acknowledge();
    match intid {
        SPURIOUS => {}
        VTIMER_PPI => {
            // Priority drop only: the interrupt stays active until the
            // guest's EOI deactivates it through the hardware-linked LR.
            cpu.end_of_interrupt(iar);
            match vm.devices.vgic.as_mut() {
                Some(vgic) => {
                    let _ = vgic.pend_ppi(vcpu, VTIMER_PPI);
                }
                None => cpu.deactivate(iar),
            }
        }
        MAINTENANCE_PPI => {
            // The maintenance interrupt is level: it stays asserted
            // until the list registers are retired and refilled.
            sync_list_registers(vm, cpu, vcpu);
            cpu.end_of_interrupt(iar);
            cpu.deactivate(iar);
        }
        // The hypervisor's own timer or device (the console's UART, on
        // the shell's CPU: a level line that stays asserted until the
        // shell's look, right after this exit, re-arms the timer or reads
        // the UART), or a kick (the list registers are synced before the
        // next entry).
        _ => {
            cpu.end_of_interrupt(iar);
            cpu.deactivate(iar);
        }
    }
    match intid {
        KICK_SGI => ExitKind::IrqKick,
        MAINTENANCE_PPI => ExitKind::IrqMaintenance,
        VTIMER_PPI => ExitKind::VTimer,
        HYP_TIMER_PPI => ExitKind::El2Timer,
        _ => ExitKind::IrqOther,
    }
}

/// Sync the list registers with the virtual distributor before entering
/// the guest: retire what the guest finished, then list what is pending.
pub fn sync_list_registers(vm: &mut Vm, cpu: &mut impl PhysCpu, vcpu: usize) {
    let Some(vgic) = vm.devices.vgic.as_mut() else {
        return;
    };
    let Some(listed) = vm.vcpus.listed_mut(vcpu) else {
        return;
    };
    let count = cpu.list_registers().min(MAX_LRS);
    // Retired list registers still holding what the guest finished: each
    // is cleared unless refilled below (a write replaces all of it), which
    // spares most retirements a write to the virtual interface (under QEMU
    // a device access that takes its global lock).
    let mut stale = 0u32;
    for (i, slot) in listed.iter_mut().enumerate().take(count) {
        let Some(intid) = *slot else { continue };
        let lr = cpu.read_lr(i);
        if lr.is_free() {
            // The guest is done with it; a level line still high pends again.
            if lr.eoi || !lr.hw {
                let _ = vgic.on_eoi(vcpu, intid);
            }
            stale |= 1 << i;
            *slot = None;
        }
    }
    // Whether every free list register was filled: only then can more be
    // pending than fits (else the search for the next one came up empty).
    let mut filled_all = true;
    for i in 0..count {
        if listed[i].is_some() {
            continue;
        }
        let now = *listed;
        let Some(irq) = vgic.next_pending(vcpu, |id| now.contains(&Some(id))) else {
            filled_all = false;
            break;
        };
        // The virtual timer is linked to the physical timer interrupt: the
        // guest's EOI deactivates it in hardware.
        let hw = (irq.intid == VTIMER_PPI).then_some(VTIMER_PPI);
        cpu.write_lr(i, &irq, hw);
        stale &= !(1 << i);
        vgic.on_listed(vcpu, &irq);
        listed[i] = Some(irq.intid);
    }
    // Clear the rest: a stale EOI bit keeps the maintenance interrupt
    // (GICH_EISR) asserted and the guest could never run.
    while stale != 0 {
        cpu.clear_lr(stale.trailing_zeros() as usize);
        stale &= stale - 1;
    }
    let waiting = filled_all && {
        let now = *listed;
        vgic.next_pending(vcpu, |id| now.contains(&Some(id)))
            .is_some()
    };
    // More pending than list registers: ask for a maintenance interrupt
    // when they drain (underflow), so the rest gets listed.
    cpu.enable_virtual_interface(waiting);
}

/// Whether a list register holds an interrupt the guest has not taken yet
/// (it may have executed WFI with interrupts masked: it must not sleep).
pub fn lr_pending(vm: &Vm, cpu: &impl PhysCpu, vcpu: usize) -> bool {
    let Some(listed) = vm.vcpus.listed(vcpu) else {
        return false;
    };
    let count = cpu.list_registers().min(MAX_LRS);
    (0..count).any(|i| {
        listed[i].is_some()
            && matches!(
                cpu.read_lr(i).state,
                LrStatus::Pending | LrStatus::PendingActive
            )
    })
}
