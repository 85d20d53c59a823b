//! The emulated devices on a VM's MMIO bus, one module each: where the
//! device sits in the VM, what a register access does to it and to the VM
//! around it (its interrupt line, console output, the balloon's pages),
//! and its state for a snapshot or a migration. Each implements
//! [`super::bus::MmioDevice`] and is registered once, in `bus.rs`.

pub mod balloon;
pub mod console;
pub mod gic;
pub mod uart;

use super::bus::Refused;
use super::fault::Device;
use crate::savestate::{StateError, StateReader, StateWriter};
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
