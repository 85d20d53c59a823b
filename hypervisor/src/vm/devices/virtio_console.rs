//! Virtio-mmio slot 1, the virtio console (`console = "virtio"`): a
//! register access given to its transport over the VM's RAM and console
//! (`irq::with_vconsole`), input waiting moved into receive buffers the
//! access made available, and its interrupt line driven. Its state is the
//! transport's and the console's.

use super::super::cpu::PhysCpu;
use super::super::exit_profile::ExitKind;
use super::super::fault::{BadAccessKind, Device};
use super::super::fdt::layout;
use super::super::irq;
use super::super::state::Vm;
use super::{MmioDevice, Refused};
use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};
use crate::virtio::mmio::{MmioTransport, INTERRUPT_ACK};

/// The virtio console's window.
pub struct ConsoleWindow;

impl MmioDevice for ConsoleWindow {
    const DEVICE: Device = Device::Virtio;

    #[inline]
    fn window(vm: &Vm) -> Option<(GuestAddr, u64)> {
        vm.devices.vconsole.as_ref()?;
        let base = layout::VIRTIO_BASE + layout::VIRTIO_STRIDE * layout::CONSOLE_SLOT as u64;
        Some((base, layout::VIRTIO_STRIDE))
    }

    fn read(
        vm: &mut Vm,
        _cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused> {
        super::read_transport(vm.devices.vconsole.as_mut(), offset, width)
    }

    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        _vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused> {
        irq::with_vconsole(vm, cpu, |transport, view| {
            transport
                .write(offset, width, value as u32, view)
                .map_err(Refused::virtio)
        })
        .ok_or(Refused::new(BadAccessKind::Unmapped))??;
        if !vm.console.input.is_empty() {
            irq::feed_console(vm, cpu);
        }
        match offset {
            INTERRUPT_ACK => irq::update_vconsole_after_ack(vm, cpu),
            _ => irq::update_vconsole(vm, cpu),
        }
        Ok(())
    }

    fn store_kind(offset: u64) -> ExitKind {
        super::virtio_store_kind(offset)
    }

    fn save(vm: &Vm, w: &mut StateWriter) {
        super::save_optional(w, vm.devices.vconsole.as_ref(), MmioTransport::save);
    }

    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
        super::restore_optional(
            r,
            &mut vm.devices.vconsole,
            "virtio console",
            MmioTransport::restore,
        )
    }
}
