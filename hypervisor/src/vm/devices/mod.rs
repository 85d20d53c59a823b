//! The emulated devices on a VM's MMIO bus, one module each: where the
//! device sits in the VM, what a register access does to it and to the VM
//! around it (its interrupt line, console output, the balloon's pages),
//! its fast path if it has one, and its state for a snapshot or a
//! migration. Each implements [`MmioDevice`] and is registered once, in
//! `bus.rs`; what refuses an access ([`Refused`]) is here too.

pub mod balloon;
pub mod gic;
pub mod uart;
pub mod virtio_console;

use super::cpu::PhysCpu;
use super::exit_profile::ExitKind;
use super::fault::{BadAccessKind, Device};
use super::state::Vm;
use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};
use crate::virtio::mmio::MmioError;
use crate::virtio::{MmioTransport, VirtioDevice};

/// A guest load from a virtio-mmio slot's registers (`None`: the VM has no
/// device there).
pub(super) fn read_transport<D: VirtioDevice>(
    transport: Option<&mut MmioTransport<D>>,
    offset: u64,
    width: u8,
) -> Result<u64, Refused> {
    transport
        .ok_or(Refused::device(Device::Virtio))?
        .read(offset, width)
        .map(u64::from)
        .map_err(Refused::virtio)
}

/// Write whether a VM has a device, then (if it has) its state.
pub(super) fn save_optional<T>(
    w: &mut StateWriter,
    device: Option<&T>,
    save: impl FnOnce(&T, &mut StateWriter),
) {
    w.bool(device.is_some());
    if let Some(d) = device {
        save(d, w);
    }
}

/// Read what [`save_optional`] wrote into `slot`: a device the VM has
/// must be in the state, and one it has not must not.
pub(super) fn restore_optional<T>(
    r: &mut StateReader<'_>,
    slot: &mut Option<T>,
    what: &'static str,
    restore: impl FnOnce(&mut StateReader<'_>) -> Result<T, StateError>,
) -> Result<(), StateError> {
    let saved = r.bool(what)?;
    if saved != slot.is_some() {
        return Err(StateError::Invalid(what));
    }
    if saved {
        *slot = Some(restore(r)?);
    }
    Ok(())
}

/// An emulated device on a VM's MMIO bus. A device is a module of
/// `vm::devices` implementing this, and a line of the registration in
/// `bus.rs`: the bus decodes its window (`bus::route`), gives it the
/// accesses there, and saves and restores its state with every other
/// device's; its fault messages and its exits in the profile are named by
/// [`MmioDevice::DEVICE`]. A device with a fast path has it in its module
/// (over `vm::fast`), calling the same functions as its
/// [`MmioDevice::write`]; `handle::fast_exit` picks it by address.
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
