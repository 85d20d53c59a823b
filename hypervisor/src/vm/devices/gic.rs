//! The GIC distributor's window (4 KiB on a GICv2, 64 KiB on a GICv3) and
//! the GICv3 redistributors' (a 128 KiB frame per vCPU): the guest's
//! accesses given to the virtual distributor, and the vCPUs a change makes
//! something deliverable to kicked. The distributor holds the
//! redistributors' state too: it is saved once, with the distributor.

use super::super::cpu::PhysCpu;
use super::super::exit_profile::ExitKind;
use super::super::fast::{Fast, FastExit, Traced};
use super::super::fault::Device;
use super::super::fdt::{self, layout};
use super::super::irq;
use super::super::state::Vm;
use super::{MmioDevice, Refused};
use crate::addr::GuestAddr;
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};
use crate::vgic::{VDistributor, VgicVersion, GICD_SGIR, GICR_STRIDE, GICV3_DIST_WINDOW};

/// The distributor's window.
pub struct GicdWindow;

impl MmioDevice for GicdWindow {
    const DEVICE: Device = Device::GicDistributor;

    #[inline]
    fn window(vm: &Vm) -> Option<(GuestAddr, u64)> {
        let size = match vm.devices.vgic.as_ref()?.version() {
            VgicVersion::V3 => GICV3_DIST_WINDOW,
            VgicVersion::V2 => fdt::GICV2_DIST_SIZE,
        };
        Some((layout::GICD_BASE, size))
    }

    fn read(
        vm: &mut Vm,
        _cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused> {
        let refused = |_| Refused::device(Self::DEVICE);
        let vgic = vm
            .devices
            .vgic
            .as_mut()
            .ok_or(Refused::device(Self::DEVICE))?;
        match vgic.version() {
            VgicVersion::V3 => vgic.read_dist_v3(vcpu, offset, width).map_err(refused),
            VgicVersion::V2 => vgic
                .read(vcpu, offset, width)
                .map(u64::from)
                .map_err(refused),
        }
    }

    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused> {
        let refused = |_| Refused::device(Self::DEVICE);
        let vgic = vm
            .devices
            .vgic
            .as_mut()
            .ok_or(Refused::device(Self::DEVICE))?;
        let effect = match vgic.version() {
            VgicVersion::V3 => vgic.write_dist_v3(vcpu, offset, width, value),
            VgicVersion::V2 => vgic.write(vcpu, offset, width, value as u32),
        }
        .map_err(refused)?;
        // An SGI to another vCPU, an enable: make its CPU sync.
        irq::apply_effect(vm, cpu, effect);
        Ok(())
    }

    fn save(vm: &Vm, w: &mut StateWriter) {
        super::save_optional(w, vm.devices.vgic.as_ref(), VDistributor::save);
    }

    /// The distributor of the VM's own GIC version and vCPU count.
    fn restore(vm: &mut Vm, r: &mut StateReader<'_>) -> Result<(), StateError> {
        let (version, vcpus) = match vm.devices.vgic.as_ref() {
            Some(v) => (Some(v.version()), v.vcpus()),
            None => (None, 0),
        };
        super::restore_optional(r, &mut vm.devices.vgic, "vGIC", |r| {
            let d = VDistributor::restore(r)?;
            if Some(d.version()) != version || d.vcpus() != vcpus {
                return Err(StateError::Invalid("vGIC of another version or size"));
            }
            Ok(d)
        })
    }
}

/// Where a GICv2 distributor's GICD_SGIR is in every VM.
pub const SGIR_IPA: GuestAddr = GuestAddr::new(layout::GICD_BASE.raw() + GICD_SGIR);

/// The distributor's fast path (`handle::fast_exit` takes it for a 4-byte
/// store to a GICv2 distributor's GICD_SGIR): an
/// SGI the guest sends (Linux's IPIs, about two per process it starts).
/// Taken when the vGIC is a GICv2 (a GICv3's distributor has no SGIR), the
/// VM runs plainly (`runs_plainly`) and the SGI goes to other vCPUs only,
/// so that nothing of the sender's own interrupts changes and the sync of
/// its list registers the full path does before the entry would change
/// nothing (an SGI to itself, or the reserved TargetListFilter, goes the
/// full way). The SGI is made pending by the distributor's own write, the CPUs of the vCPUs it became deliverable to are kicked,
/// and the exit is recorded as an `mmio-gicd`.
#[inline(never)]
pub fn sgi_send(fast: Fast<'_, impl PhysCpu>) -> Option<FastExit> {
    let store = fast.stored()?;
    let vgic = fast.vm.devices.vgic.as_ref()?;
    if vgic.version() != VgicVersion::V2 || !fast.plain_access(store.ipa) {
        return None;
    }
    let value = fast.ctx.reg(store.reg);
    let targets = vgic.sgir_targets(fast.vcpu, value as u32)?;
    if targets & (1 << fast.vcpu) != 0 {
        return None;
    }
    // The distributor's write, as the full path makes it.
    GicdWindow::write(fast.vm, fast.cpu, fast.vcpu, GICD_SGIR, store.width, value).ok()?;
    let traced = Traced {
        what: "write",
        ipa: store.ipa,
        width: store.width,
        device: Device::GicDistributor,
        value,
    };
    let kind = ExitKind::mmio(Some(Device::GicDistributor));
    Some(FastExit::quiet(fast.finish(kind, traced, store.insn_len)))
}

/// The GICv3 redistributors' window: frame `offset / GICR_STRIDE` is
/// vCPU `offset / GICR_STRIDE`'s.
pub struct GicrWindow;

impl MmioDevice for GicrWindow {
    const DEVICE: Device = Device::GicRedistributor;

    #[inline]
    fn window(vm: &Vm) -> Option<(GuestAddr, u64)> {
        let vgic = vm
            .devices
            .vgic
            .as_ref()
            .filter(|v| v.version() == VgicVersion::V3)?;
        Some((layout::GICR_BASE, GICR_STRIDE * vgic.vcpus() as u64))
    }

    fn read(
        vm: &mut Vm,
        _cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
    ) -> Result<u64, Refused> {
        let vgic = vm
            .devices
            .vgic
            .as_mut()
            .ok_or(Refused::device(Self::DEVICE))?;
        let index = (offset / GICR_STRIDE) as usize;
        vgic.read_redist(vcpu, index, offset % GICR_STRIDE, width)
            .map_err(|_| Refused::device(Self::DEVICE))
    }

    fn write(
        vm: &mut Vm,
        cpu: &mut impl PhysCpu,
        vcpu: usize,
        offset: u64,
        width: u8,
        value: u64,
    ) -> Result<(), Refused> {
        let vgic = vm
            .devices
            .vgic
            .as_mut()
            .ok_or(Refused::device(Self::DEVICE))?;
        let index = (offset / GICR_STRIDE) as usize;
        let effect = vgic
            .write_redist(vcpu, index, offset % GICR_STRIDE, width, value)
            .map_err(|_| Refused::device(Self::DEVICE))?;
        irq::apply_effect(vm, cpu, effect);
        Ok(())
    }

    /// Saved with the distributor ([`GicdWindow`]).
    fn save(_vm: &Vm, _w: &mut StateWriter) {}

    fn restore(_vm: &mut Vm, _r: &mut StateReader<'_>) -> Result<(), StateError> {
        Ok(())
    }
}
