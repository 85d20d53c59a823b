//! The PL011's window: a register access given to the emulated PL011
//! (`crate::pl011`), a byte it sends shown on the VM's console line, its
//! interrupt line driven into the vGIC, the read-only mirror of its
//! registers kept in step (`uart_mirror`), and typed input moved into its
//! FIFO as the guest reads. Its state is the PL011's and the input still
//! waiting behind the FIFO.

use super::super::bus::{self, MmioDevice, Refused};
use super::super::console_line::Echo;
use super::super::cpu::PhysCpu;
use super::super::fault::Device;
use super::super::fdt::{self, layout};
use super::super::irq;
use super::super::state::{Vm, CONSOLE_INPUT_MAX};
use crate::addr::GuestAddr;
use crate::pl011::Pl011;
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};

/// The PL011's window.
pub struct UartWindow;

/// Whether `ipa` is in the PL011's window: a first cheap test for the
/// UART fast path, which then asks [`bus::route`] (the one decode).
#[inline]
pub fn contains(ipa: GuestAddr) -> bool {
    bus::offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE).is_some()
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
    let effect = vm.uart.write(offset, width, value as u32);
    let shown = effect
        .output
        .and_then(|byte| bus::console_output(vm, byte, echo));
    if sync_mirror {
        // The page first: a vCPU the interrupt reaches reads it.
        irq::sync_uart_mirror(vm, cpu);
    }
    if effect.irq_changed {
        irq::update_uart(vm, cpu);
    }
    shown
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
        let value = vm.uart.read(offset, width);
        if vm.input.is_empty() {
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
        vm.uart.save(w);
        w.u64(vm.input.len() as u64);
        for &byte in vm.input.iter() {
            w.u8(byte);
        }
    }

    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
        vm.uart = Pl011::restore(r)?;
        let waiting = r.at_most(CONSOLE_INPUT_MAX as u64, "console input waiting")?;
        vm.input.clear();
        for _ in 0..waiting {
            // Fits: at most its capacity.
            let _ = vm.input.push_back(r.u8()?);
        }
        Ok(())
    }
}
