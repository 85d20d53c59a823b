//! A VM's MMIO bus: the emulated devices registered on it ([`MmioDevice`],
//! one module of `vm::devices` each), which one an intermediate-physical
//! address falls in ([`route`], the one place the address windows are
//! decoded), the register accesses the vCPU trapped on given to it, and
//! every device's state saved and restored in one pass.

use super::console_line::Echo;
use super::cpu::PhysCpu;
use super::devices;
use super::exit_profile::ExitKind;
use super::fault::{BadAccessKind, Device};
use super::fdt::{self, layout};
use super::state::Vm;
use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};
use crate::vgic::{GICR_STRIDE, GICV3_DIST_WINDOW};
use crate::virtio::mmio::MmioError;

/// An emulated device on a VM's MMIO bus. A device is a module of
/// `vm::devices` implementing this, and a line of the registration below:
/// the bus decodes its window ([`route`]), gives it the accesses there, and
/// saves and restores its state with every other device's; its fault
/// messages and its exits in the profile are named by [`MmioDevice::DEVICE`].
/// A device with a fast path of its own has it in `vm::handle`'s
/// `fast_exit`, which calls the same functions as its [`MmioDevice::write`].
pub trait MmioDevice {
    /// What fault messages call it, and its kind of exit in the profile.
    const DEVICE: Device;
    /// Its register window in `vm` (base, size), if `vm` has the device.
    fn window(vm: &Vm) -> Option<(GuestAddr, u64)>;
    /// A guest load of `width` bytes at `offset` into its window.
    fn read(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused>;
    /// A guest store of `value` (`width` bytes) at `offset`.
    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused>;
    /// The profile's kind of a store at `offset` (a virtio notify is its
    /// own kind).
    fn store_kind(_offset: u64) -> ExitKind {
        ExitKind::mmio(Some(Self::DEVICE))
    }
    /// Its state, for a snapshot or a migration.
    fn save(vm: &Vm, w: &mut StateWriter);
    /// Its state as [`MmioDevice::save`] wrote it, into `vm` (built from
    /// the same configuration, its vCPUs not running): refused unless the
    /// device could have reached it in this VM.
    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError>;
}

/// The registration: each device's [`Window`] variant and its type, in the
/// order [`route`] tries their windows, its state is saved in.
macro_rules! register_devices {
    ($($(#[$doc:meta])* $window:ident => $device:ty,)*) => {
        /// A registered device's register window, and the offset into it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Window {
            $($(#[$doc])* $window(u64),)*
        }

        impl Window {
            pub fn device(self) -> Device {
                match self {
                    $(Window::$window(_) => <$device>::DEVICE,)*
                }
            }

            /// The profile's kind of a store in this window.
            pub fn store_kind(self) -> ExitKind {
                match self {
                    $(Window::$window(offset) => <$device>::store_kind(offset),)*
                }
            }
        }

        /// The device window `ipa` is in, among the devices this VM has.
        #[inline]
        pub fn route(vm: &Vm, ipa: GuestAddr) -> Option<Window> {
            $(
                if let Some((base, size)) = <$device>::window(vm) {
                    if let Some(offset) = offset_in(ipa, base, size) {
                        return Some(Window::$window(offset));
                    }
                }
            )*
            None
        }

        fn read_window(
            vm: &mut Vm,
            cpu: &mut impl PhysCpu,
            vcpu: usize,
            window: Window,
            width: u8,
        ) -> Result<u64, Refused> {
            match window {
                $(Window::$window(offset) => <$device>::read(vm, cpu, vcpu, offset, width),)*
            }
        }

        fn write_window(
            vm: &mut Vm,
            cpu: &mut impl PhysCpu,
            vcpu: usize,
            window: Window,
            width: u8,
            value: u64,
        ) -> Result<(), Refused> {
            match window {
                $(Window::$window(offset) => <$device>::write(vm, cpu, vcpu, offset, width, value),)*
            }
        }

        /// Every device's state, in registration order.
        pub fn save_devices(vm: &Vm, w: &mut StateWriter) {
            w.u8(DEVICES_STATE_VERSION);
            $(<$device>::save(vm, w);)*
        }

        /// Every device's state as [`save_devices`] wrote it, into `vm`.
        pub fn restore_devices(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
            r.version("devices", DEVICES_STATE_VERSION)?;
            $(<$device>::restore(vm, r)?;)*
            Ok(())
        }
    };
}

/// The layout version of [`save_devices`]: the registration's order.
const DEVICES_STATE_VERSION: u8 = 1;

register_devices! {
    /// The GIC distributor (4 KiB on a GICv2, 64 KiB on a GICv3).
    GicDistributor => devices::gic::GicdWindow,
    /// The GICv3 redistributors, a frame per vCPU.
    GicRedistributors => devices::gic::GicrWindow,
    /// The PL011.
    Uart => devices::uart::UartWindow,
    /// Virtio-mmio slot 0: the balloon.
    Balloon => devices::balloon::BalloonWindow,
    /// Virtio-mmio slot 1: the virtio console.
    VirtioConsole => devices::console::ConsoleWindow,
}

/// `ipa - base` if `ipa` is in `base..base + size`.
#[inline]
pub fn offset_in(ipa: GuestAddr, base: GuestAddr, size: u64) -> Option<u64> {
    ipa.offset_from(base).filter(|&off| off < size)
}

/// A store to a virtio-mmio device: a QueueNotify is a `virtio-notify`.
pub fn virtio_store_kind(offset: u64) -> ExitKind {
    match offset {
        crate::virtio::mmio::QUEUE_NOTIFY => ExitKind::VirtioNotify,
        _ => ExitKind::mmio(Some(Device::Virtio)),
    }
}

/// The balloon's QueueNotify register lies in no window [`route`] looks at
/// before the virtio slots, whatever the vGIC and its vCPU count: so for a
/// VM with a balloon, [`route`] decodes it as `Window::Balloon(QUEUE_NOTIFY)`
/// (`devices::balloon::is_notify` relies on it).
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

    /// A register access `device` refused, for no reason it gives.
    pub fn device(device: Device) -> Self {
        Self::new(BadAccessKind::DeviceRegister(device))
    }

    /// A refused access to a virtio-mmio device, with its reason.
    pub fn virtio(e: MmioError) -> Self {
        Refused {
            kind: BadAccessKind::DeviceRegister(Device::Virtio),
            detail: Detail::Virtio(e),
        }
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

/// A guest register read of `width` bytes in `window` (the caller routed
/// the address once: [`route`]; `None`, no device, is refused).
pub fn read(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    window: Option<Window>,
    width: u8,
) -> Result<u64, Refused> {
    let window = window.ok_or(Refused::new(BadAccessKind::Unmapped))?;
    read_window(vm, cpu, vcpu, window, width)
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
    let window = window.ok_or(Refused::new(BadAccessKind::Unmapped))?;
    write_window(vm, cpu, vcpu, window, width, value)
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
