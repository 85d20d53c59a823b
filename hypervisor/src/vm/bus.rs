//! A VM's MMIO bus: which emulated device an intermediate-physical address
//! falls in ([`route`], the one place the address windows are decoded), the
//! register accesses the vCPU trapped on, given to that device, and what a
//! device does back (an interrupt line, console output, a balloon event).

use super::console_line::Echo;
use super::cpu::PhysCpu;
use super::device_memory::DeviceView;
use super::fault::{BadAccessKind, Device};
use super::fdt::{self, layout};
use super::irq;
use super::ratelimit::Lines;
use super::state::Vm;
use crate::addr::GuestAddr;
use crate::vgic::{VgicEffect, VgicVersion, GICR_STRIDE, GICV3_DIST_WINDOW};
use crate::virtio::mmio::MmioError;

/// An emulated device's register window, and the offset into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The GIC distributor (4 KiB on a GICv2, 64 KiB on a GICv3).
    GicDistributor(u64),
    /// GICv3 redistributor `index` (one per vCPU).
    GicRedistributor {
        index: usize,
        offset: u64,
    },
    Uart(u64),
    /// Virtio-mmio slot 0: the balloon.
    Virtio(u64),
    /// Virtio-mmio slot 1: the virtio console.
    VirtioConsole(u64),
}

impl Window {
    pub fn device(self) -> Device {
        match self {
            Window::GicDistributor(_) => Device::GicDistributor,
            Window::GicRedistributor { .. } => Device::GicRedistributor,
            Window::Uart(_) => Device::Uart,
            Window::Virtio(_) | Window::VirtioConsole(_) => Device::Virtio,
        }
    }
}

/// `ipa - base` if `ipa` is in `base..base + size`.
#[inline]
pub fn offset_in(ipa: GuestAddr, base: GuestAddr, size: u64) -> Option<u64> {
    ipa.offset_from(base).filter(|&off| off < size)
}

/// The device window `ipa` is in, among the devices this VM has.
#[inline]
pub fn route(vm: &Vm, ipa: GuestAddr) -> Option<Window> {
    if let Some(vgic) = vm.vgic.as_ref() {
        let v3 = vgic.version() == VgicVersion::V3;
        let dist_size = if v3 {
            GICV3_DIST_WINDOW
        } else {
            fdt::GICV2_DIST_SIZE
        };
        if let Some(off) = offset_in(ipa, layout::GICD_BASE, dist_size) {
            return Some(Window::GicDistributor(off));
        }
        let redists = GICR_STRIDE * vgic.vcpus() as u64;
        if let Some(off) = offset_in(ipa, layout::GICR_BASE, redists).filter(|_| v3) {
            return Some(Window::GicRedistributor {
                index: (off / GICR_STRIDE) as usize,
                offset: off % GICR_STRIDE,
            });
        }
    }
    if let Some(off) = offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE) {
        return Some(Window::Uart(off));
    }
    if vm.balloon.is_some() {
        if let Some(off) = offset_in(ipa, layout::VIRTIO_BASE, layout::VIRTIO_STRIDE) {
            return Some(Window::Virtio(off));
        }
    }
    if vm.vconsole.is_some() {
        let base = layout::VIRTIO_BASE + layout::VIRTIO_STRIDE * layout::CONSOLE_SLOT as u64;
        if let Some(off) = offset_in(ipa, base, layout::VIRTIO_STRIDE) {
            return Some(Window::VirtioConsole(off));
        }
    }
    None
}

/// The balloon's QueueNotify register lies in no window [`route`] looks at
/// before the virtio slots, whatever the vGIC and its vCPU count: so for a
/// VM with a balloon, [`route`] decodes it as `Window::Virtio(QUEUE_NOTIFY)`
/// ([`is_balloon_notify`] relies on it).
const _: () = {
    let notify = layout::VIRTIO_BASE.raw() + crate::virtio::mmio::QUEUE_NOTIFY;
    let dist_end = layout::GICD_BASE.raw() + max(GICV3_DIST_WINDOW, fdt::GICV2_DIST_SIZE);
    let redist_end = layout::GICR_BASE.raw() + GICR_STRIDE * fdt::MAX_VCPUS_GICV3 as u64;
    let uart_end = layout::UART_BASE.raw() + fdt::UART_SIZE;
    assert!(notify >= dist_end && notify >= redist_end && notify >= uart_end);
    assert!(crate::virtio::mmio::QUEUE_NOTIFY < layout::VIRTIO_STRIDE);
};

const fn max(a: u64, b: u64) -> u64 {
    if a > b {
        a
    } else {
        b
    }
}

/// Whether `ipa` is this VM's balloon QueueNotify register: [`route`]'s
/// answer `Window::Virtio(QUEUE_NOTIFY)`, without its walk over the other
/// windows (the assertion above shows none contains it). For the notify
/// fast path.
#[inline]
pub fn is_balloon_notify(vm: &Vm, ipa: GuestAddr) -> bool {
    vm.balloon.is_some() && ipa == layout::VIRTIO_BASE + crate::virtio::mmio::QUEUE_NOTIFY
}

/// Whether `ipa` is in the PL011's window: a first cheap test for the
/// UART fast path, which then asks [`route`] (the one decode).
#[inline]
pub fn is_uart(ipa: GuestAddr) -> bool {
    offset_in(ipa, layout::UART_BASE, fdt::UART_SIZE).is_some()
}

/// What was refused, and the device's own reason if it gave one.
pub struct Refused {
    pub kind: BadAccessKind,
    pub detail: Detail,
}

pub enum Detail {
    None,
    Virtio(MmioError),
    SysReg {
        encoding: (u8, u8, u8, u8, u8),
        read: bool,
    },
    Esr(u64),
}

impl Refused {
    pub fn new(kind: BadAccessKind) -> Self {
        Self {
            kind,
            detail: Detail::None,
        }
    }

    fn device(window: Window) -> Self {
        Self::new(BadAccessKind::DeviceRegister(window.device()))
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

/// A refused access to the virtio-mmio device, with its reason.
fn bad_virtio(e: MmioError) -> Refused {
    Refused {
        kind: BadAccessKind::DeviceRegister(Device::Virtio),
        detail: Detail::Virtio(e),
    }
}

/// A guest register read of `width` bytes in `window` (the caller routed
/// the address once: [`route`]; `None`, no device, is refused).
pub fn read(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    window: Option<Window>,
    width: u8,
) -> Result<u64, Refused> {
    let Some(window) = window else {
        return Err(Refused::new(BadAccessKind::Unmapped));
    };
    let refused = |_| Refused::device(window);
    match window {
        Window::GicDistributor(off) | Window::GicRedistributor { offset: off, .. } => {
            let vgic = vm.vgic.as_mut().ok_or(Refused::device(window))?;
            match window {
                Window::GicRedistributor { index, .. } => {
                    vgic.read_redist(vcpu, index, off, width).map_err(refused)
                }
                _ if vgic.version() == VgicVersion::V3 => {
                    vgic.read_dist_v3(vcpu, off, width).map_err(refused)
                }
                _ => vgic.read(vcpu, off, width).map(u64::from).map_err(refused),
            }
        }
        Window::Uart(off) => {
            let value = vm.uart.read(off, width);
            if vm.input.is_empty() {
                irq::update_uart(vm, cpu);
                irq::sync_uart_mirror(vm, cpu);
            } else {
                irq::feed_console(vm, cpu);
            }
            Ok(u64::from(value))
        }
        Window::Virtio(off) => {
            let balloon = vm.balloon.as_mut().ok_or(Refused::device(window))?;
            balloon.read(off, width).map(u64::from).map_err(bad_virtio)
        }
        Window::VirtioConsole(off) => {
            let console = vm.vconsole.as_mut().ok_or(Refused::device(window))?;
            console.read(off, width).map(u64::from).map_err(bad_virtio)
        }
    }
}

/// A guest register write of `value` (`width` bytes) in `window` (routed
/// by the caller, as for [`read`]).
pub fn write(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    window: Option<Window>,
    width: u8,
    value: u64,
) -> Result<(), Refused> {
    let Some(window) = window else {
        return Err(Refused::new(BadAccessKind::Unmapped));
    };
    let refused = |_| Refused::device(window);
    match window {
        Window::GicDistributor(off) | Window::GicRedistributor { offset: off, .. } => {
            let vgic = vm.vgic.as_mut().ok_or(Refused::device(window))?;
            let effect: VgicEffect = match window {
                Window::GicRedistributor { index, .. } => vgic
                    .write_redist(vcpu, index, off, width, value)
                    .map_err(refused)?,
                _ if vgic.version() == VgicVersion::V3 => vgic
                    .write_dist_v3(vcpu, off, width, value)
                    .map_err(refused)?,
                _ => vgic
                    .write(vcpu, off, width, value as u32)
                    .map_err(refused)?,
            };
            // An SGI to another vCPU, an enable: make its CPU sync.
            irq::apply_effect(vm, cpu, effect);
            Ok(())
        }
        Window::Uart(off) => {
            let effect = vm.uart.write(off, width, value as u32);
            if let Some(byte) = effect.output {
                console_output(vm, byte, false);
            }
            // The page first: a vCPU the interrupt reaches reads it.
            irq::sync_uart_mirror(vm, cpu);
            if effect.irq_changed {
                irq::update_uart(vm, cpu);
            }
            Ok(())
        }
        Window::Virtio(off) => virtio_write(vm, cpu, off, width, value),
        Window::VirtioConsole(off) => vconsole_write(vm, cpu, off, width, value),
    }
}

/// A byte the guest wrote to its console: part of a line, or shown live
/// when its console has the keyboard (prompts, echo). Live output whose
/// line fits an [`Echo`] is returned for the caller to print once the VM's
/// lock is released; whatever else it makes goes to the outbox.
pub(super) fn console_output(vm: &mut Vm, byte: u8, echo: bool) -> Option<Echo> {
    if vm.focused {
        if !echo {
            let output = vm.console.push_live(byte);
            vm.out.live(output);
            return None;
        }
        return match vm.console.push_live_echo(byte) {
            Ok(echo) => Some(echo),
            Err(output) => {
                vm.out.live(output);
                None
            }
        };
    }
    super::device_memory::show_byte(&mut vm.console, &mut vm.out, &vm.name, false, byte);
    None
}

/// A guest register write to its virtio console: the transport's, then
/// waiting input into receive buffers the write may have made available,
/// then the device's interrupt line.
fn vconsole_write(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    off: u64,
    width: u8,
    value: u64,
) -> Result<(), Refused> {
    irq::with_vconsole(vm, cpu, |transport, view| {
        transport
            .write(off, width, value as u32, view)
            .map_err(bad_virtio)
    })
    .ok_or(Refused::new(BadAccessKind::Unmapped))??;
    if !vm.input.is_empty() {
        irq::feed_console(vm, cpu);
    }
    match off {
        crate::virtio::mmio::INTERRUPT_ACK => irq::update_vconsole_after_ack(vm, cpu),
        _ => irq::update_vconsole(vm, cpu),
    }
    Ok(())
}

fn virtio_write(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    off: u64,
    width: u8,
    value: u64,
) -> Result<(), Refused> {
    let now = cpu.uptime_us();
    let (Some(balloon), Some(ram)) = (vm.balloon.as_mut(), vm.ram.as_mut()) else {
        return Err(Refused::new(BadAccessKind::Unmapped));
    };
    // Pages a deflate backs get what a fault would give them.
    ram.set_page_fill(balloon.device().page_fill());
    let mut view = DeviceView {
        ram,
        mem: cpu.memory(),
        now_us: now,
    };
    let before = *balloon.device().stats();
    let hint_before = balloon.device().hint_run().copied();
    let event = balloon
        .write(off, width, value as u32, &mut view)
        .map_err(bad_virtio)?;
    let mut lines = Lines {
        lines: &mut vm.lines,
        out: &mut vm.out,
        name: &vm.name,
        now_us: now,
    };
    if let Some(msg) = event.message() {
        lines.say(
            super::balloon_ctl::event_kind(msg),
            format_args!("balloon: {msg}"),
        );
    }
    super::balloon_ctl::report_rejections(&mut lines, &before, balloon.device().stats());
    super::balloon_ctl::report_hint_end(
        lines.out,
        lines.name,
        hint_before,
        balloon.device().hint_run(),
    );
    match off {
        crate::virtio::mmio::INTERRUPT_ACK => irq::update_virtio_after_ack(vm, cpu),
        _ => irq::update_virtio(vm, cpu),
    }
    Ok(())
}
