//! The PL011's window: a register access given to the emulated PL011
//! (`crate::pl011`), a byte it sends shown on the VM's console line, its
//! interrupt line driven into the vGIC, the read-only mirror of its
//! registers kept in step (`uart_mirror`), and typed input moved into its
//! FIFO as the guest reads. Its state is the PL011's and the input still
//! waiting behind the FIFO.

use super::super::console_line::Echo;
use super::super::cpu::{GuestContext, PhysCpu};
use super::super::exit::{load_result, VcpuExit};
use super::super::exit_profile::ExitKind;
use super::super::fast::{line_at, Fast, FastExit, Shown, Stored, Traced};
use super::super::fault::Device;
use super::super::fdt::{self, layout};
use super::super::irq;
use super::super::state::{Vm, CONSOLE_INPUT_MAX};
use super::{MmioDevice, Refused};
use crate::addr::GuestAddr;
use crate::pl011::Pl011;
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};

/// The PL011's window.
pub struct UartWindow;

/// Whether `ipa` is in the PL011's window: the test `handle::fast_exit`
/// makes before [`fast_exit`]. No window [`bus::route`] tries before the
/// UART's overlaps it (asserted below), so an address in it is the UART's
/// as the bus decodes it.
///
/// [`bus::route`]: super::super::bus::route
#[inline]
pub fn contains(ipa: GuestAddr) -> bool {
    super::offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE).is_some()
}

/// A write to the PL011 and all it does: the byte it sends shown (live
/// as an [`Echo`] for the caller to print when `echo` and it fits one),
/// the mirror page synced when `sync_mirror` (or always, when `None`: the
/// full path), the interrupt line driven if it changed.
#[inline(always)]
pub fn write_register(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    offset: u64,
    width: u8,
    value: u64,
    echo: bool,
    sync_mirror: bool,
) -> Option<Echo> {
    let effect = vm.devices.uart.write(offset, width, value as u32);
    let shown = effect
        .output
        .and_then(|byte| console_output(vm, byte, echo));
    if sync_mirror {
        // The page first: a vCPU the interrupt reaches reads it.
        irq::sync_uart_mirror(vm, cpu);
    }
    if effect.irq_changed {
        irq::update_uart(vm, cpu);
    }
    shown
}

const _: () = {
    let redist_end =
        layout::GICR_BASE.raw() + crate::vgic::GICR_STRIDE * fdt::MAX_VCPUS_GICV3 as u64;
    let dist_end = layout::GICD_BASE.raw() + crate::vgic::GICV3_DIST_WINDOW;
    assert!(layout::UART_BASE.raw() >= redist_end && layout::UART_BASE.raw() >= dist_end);
};

/// The PL011's fast path (`handle::fast_exit` takes it for an access in
/// its window): `quiet_read` or `transmit`. Like the balloon's
/// (`balloon::empty_notify`) it takes its arguments in registers and builds the
/// [`Fast`] here, where it costs nothing: passed by value to a call, it is
/// spilled to the stack (25 more instructions per UART exit under -icount).
#[inline(never)]
pub fn fast_exit(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
    exit: &VcpuExit,
    before: u32,
) -> Option<FastExit> {
    let fast = Fast::new(vm, cpu, vcpu, ctx, exit, before);
    match *exit {
        VcpuExit::MmioRead { .. } => quiet_read(fast).map(FastExit::quiet),
        _ => transmit(fast),
    }
}

/// [`fast_exit`] for a load from the PL011: taken when the address is in
/// the UART's window (not RAM), no console input waits
/// behind the receive FIFO (the full path would feed it after a byte is
/// taken), the UART's line in the vGIC has the level the UART asks for,
/// and the read leaves that level as it is ([`Pl011::read_keeping_level`]:
/// a DR read that lowers the line, taking the last byte or the FIFO below
/// its trigger level with no other interrupt up, goes the full way). Such
/// a read changes nothing but the model (as the full path's read changes
/// it), the guest's register and PC; the exit is recorded as an
/// `mmio-uart`.
///
/// [`Pl011::read_keeping_level`]: crate::pl011::Pl011::read_keeping_level
#[inline(always)]
fn quiet_read(fast: Fast<'_, impl PhysCpu>) -> Option<u32> {
    let VcpuExit::MmioRead {
        ipa,
        width,
        reg,
        sign_extend,
        sixty_four,
        insn_len,
    } = *fast.exit
    else {
        return None;
    };
    let offset = super::offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE)?;
    if !fast.vm.console.input.is_empty() || !fast.plain_access(ipa) {
        return None;
    }
    let uart = &mut fast.vm.devices.uart;
    if !line_at(
        fast.vm.devices.vgic.as_ref(),
        irq::UART_INTID,
        uart.irq_level(),
    ) {
        return None;
    }
    let value = u64::from(uart.read_keeping_level(offset, width)?);
    // A DR read that emptied the FIFO with the line unchanged (its
    // interrupts masked): the page can be shown again.
    irq::sync_uart_mirror(fast.vm, fast.cpu);
    fast.ctx
        .set_reg(reg, load_result(value, width, sign_extend, sixty_four));
    let traced = Traced {
        what: "read",
        ipa,
        width,
        device: Device::Uart,
        value,
    };
    let kind = ExitKind::mmio(Some(Device::Uart));
    Some(fast.finish(kind, traced, insn_len))
}

/// [`fast_exit`] for a store to the PL011's DR: taken when the address is
/// the UART's DR (not RAM), and the UART's line in
/// the vGIC has the level the UART asks for both before the byte and after
/// it (the write raises TXRIS; with TXIM masked, or TXRIS already raised,
/// the line stays). The byte goes where the full path sends it (the VM's
/// console line; what it shows: [`FastExit::shown`]); the exit is recorded
/// as an `mmio-uart`.
#[inline(always)]
fn transmit(fast: Fast<'_, impl PhysCpu>) -> Option<FastExit> {
    let Stored {
        ipa,
        width,
        reg,
        insn_len,
    } = fast.stored()?;
    if super::offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE) != Some(crate::pl011::UARTDR) {
        return None;
    }
    if !fast.plain_access(ipa) {
        return None;
    }
    let vm = &mut *fast.vm;
    let level = vm.devices.uart.irq_level();
    if vm.devices.uart.irq_level_after_transmit() != level
        || !line_at(vm.devices.vgic.as_ref(), irq::UART_INTID, level)
    {
        return None;
    }
    let value = fast.ctx.reg(reg);
    // The full path's write, but the mirror synced only when the byte
    // changes what the guest reads there (TXRIS), and a live byte kept as
    // an echo to print once the lock is released. Its interrupt line
    // stays where it is (checked above).
    let changes = vm.devices.uart.transmit_changes_registers();
    let echo = write_register(
        vm,
        fast.cpu,
        crate::pl011::UARTDR,
        width,
        value,
        true,
        changes,
    );
    let shown = match echo {
        Some(echo) => {
            vm.console.echo = Some(echo);
            Shown::Live
        }
        None if vm.console.out.is_empty() => Shown::Nothing,
        None => Shown::Outbox,
    };
    let traced = Traced {
        what: "write",
        ipa,
        width,
        device: Device::Uart,
        value,
    };
    let kind = ExitKind::mmio(Some(Device::Uart));
    Some(FastExit {
        recorded: fast.finish(kind, traced, insn_len),
        shown,
    })
}

impl MmioDevice for UartWindow {
    const DEVICE: Device = Device::Uart;

    #[inline]
    fn window(_vm: &Vm) -> Option<(GuestAddr, u64)> {
        Some((layout::UART_BASE, fdt::UART_SIZE))
    }

    fn read(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused> {
        let value = vm.devices.uart.read(offset, width);
        if vm.console.input.is_empty() {
            irq::update_uart(vm, cpu);
            irq::sync_uart_mirror(vm, cpu);
        } else {
            irq::feed_console(vm, cpu);
        }
        Ok(u64::from(value))
    }

    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused> {
        write_register(vm, cpu, offset, width, value, false, true);
        Ok(())
    }

    fn save(vm: &Vm, w: &mut StateWriter) {
        vm.devices.uart.save(w);
        w.u64(vm.console.input.len() as u64);
        for &byte in vm.console.input.iter() {
            w.u8(byte);
        }
    }

    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
        vm.devices.uart = Pl011::restore(r)?;
        let waiting = r.at_most(CONSOLE_INPUT_MAX as u64, "console input waiting")?;
        vm.console.input.clear();
        for _ in 0..waiting {
            // Fits: at most its capacity.
            let _ = vm.console.input.push_back(r.u8()?);
        }
        Ok(())
    }
}

/// A byte the guest wrote to its console: part of a line, or shown live
/// when its console has the keyboard (prompts, echo). Live output whose
/// line fits an [`Echo`] is returned for the caller to print once the VM's
/// lock is released; whatever else it makes goes to the outbox.
fn console_output(vm: &mut Vm, byte: u8, echo: bool) -> Option<Echo> {
    if vm.console.focused {
        if !echo {
            let output = vm.console.line.push_live(byte);
            vm.console.out.live(output);
            return None;
        }
        return match vm.console.line.push_live_echo(byte) {
            Ok(echo) => Some(echo),
            Err(output) => {
                vm.console.out.live(output);
                None
            }
        };
    }
    super::super::device_memory::show_byte(
        &mut vm.console.line,
        &mut vm.console.out,
        &vm.name,
        false,
        byte,
    );
    None
}
