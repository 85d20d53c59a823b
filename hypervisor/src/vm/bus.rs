//! A VM's MMIO bus: the registration of its emulated devices (each a
//! module of `vm::devices` implementing [`MmioDevice`]), which one an
//! intermediate-physical address falls in ([`route`], the one place the
//! address windows are decoded), the register accesses the vCPU trapped on
//! given to it, and every device's state saved and restored in one pass.

pub use super::devices::{offset_in, Detail, MmioDevice, Refused};

use super::cpu::PhysCpu;
use super::devices;
use super::exit_profile::ExitKind;
use super::fault::{BadAccessKind, Device};
use super::fdt::{self, layout};
use super::state::Vm;
use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};
use crate::vgic::{GICR_STRIDE, GICV3_DIST_WINDOW};

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
    VirtioConsole => devices::virtio_console::ConsoleWindow,
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
