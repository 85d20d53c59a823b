//! The EL2 control values a guest runs under (HCR_EL2, VTCR_EL2, VTTBR_EL2,
//! VMPIDR_EL2, CNTHCTL_EL2), built from aarch64-cpu's named fields.
//! Values only: `arch::aarch64::vcpu::load_vm_controls` writes them. Portable
//! so that their bits are checked on the host.

use aarch64_cpu::registers::ID_AA64MMFR0_EL1::PARange;
use aarch64_cpu::registers::{CNTHCTL_EL2, HCR_EL2, VMPIDR_EL2, VTCR_EL2, VTTBR_EL2};

use crate::addr::PhysAddr;
use crate::mm::stage2;

/// HCR_EL2 while a guest runs: stage 2 on (VM), set/way invalidation
/// upgraded (SWIO), forced broadcast (FB), inner-shareable barriers (BSU),
/// WFE and SMC trapped, EL1 is AArch64 (RW); WFI trapped with `trap_wfi`
/// (see `vm::handle::traps_wfi`: else the guest sleeps in WFI itself, on
/// the CPU it alone uses). With `virtual_irqs`, physical IRQs and FIQs are
/// routed to EL2 (IMO/FMO), which also enables virtual interrupts from the
/// list registers.
pub fn hcr(virtual_irqs: bool, trap_wfi: bool) -> u64 {
    let guest = HCR_EL2::VM::Enable
        + HCR_EL2::SWIO::SET
        + HCR_EL2::FB::SET
        + HCR_EL2::BSU::InnerShareable
        + HCR_EL2::TWE::SET
        + HCR_EL2::TSC::EnableTrapEl1SmcToEl2
        + HCR_EL2::RW::EL1IsAarch64;
    let irqs = if virtual_irqs {
        HCR_EL2::IMO::EnableVirtualIRQ + HCR_EL2::FMO::EnableVirtualFIQ
    } else {
        HCR_EL2::IMO::DisableVirtualIRQ + HCR_EL2::FMO::DisableVirtualFIQ
    };
    let wfi = if trap_wfi {
        HCR_EL2::TWI::SET
    } else {
        HCR_EL2::TWI::CLEAR
    };
    (guest + irqs + wfi).value
}

/// VTCR_EL2 for [`crate::mm::stage2`]: its IPA size (T0SZ), start at level
/// 2 (its 16 concatenated root tables), write-back inner shareable walks, 4 KiB granule, 8-bit VMIDs, `pa_range`
/// (ID_AA64MMFR0_EL1.PARange) as the output size, at most 48 bits.
pub fn vtcr(pa_range: u64) -> u64 {
    (VTCR_EL2::T0SZ.val(u64::from(64 - stage2::IPA_BITS))
        + VTCR_EL2::SL0::Granule4KBLevel2
        + VTCR_EL2::IRGN0::NormalWBRAWA
        + VTCR_EL2::ORGN0::NormalWBRAWA
        + VTCR_EL2::SH0::Inner
        + VTCR_EL2::TG0::Granule4KB
        // VTCR_EL2.PS has PARange's encodings; stage 2 stops at 48 bits.
        + VTCR_EL2::PS.val(pa_range.min(PARange::Value::Bits_48 as u64))
        + VTCR_EL2::VS::Bits8
        + VTCR_EL2::RES1::SET)
        .value
}

/// VTTBR_EL2 for VM `vmid` (8 bits, VTCR_EL2.VS = 0) with its stage-2 root
/// table at `root`.
pub fn vttbr(vmid: u16, root: PhysAddr) -> u64 {
    (VTTBR_EL2::VMID.val(u64::from(vmid) & 0xff) + VTTBR_EL2::BADDR.val(root.raw() >> 1)).value
}

/// VMPIDR_EL2: the MPIDR the guest's vCPU `vcpu_index` reads (Aff0 = index).
pub fn vmpidr(vcpu_index: u64) -> u64 {
    (VMPIDR_EL2::RES1::SET + VMPIDR_EL2::Aff0.val(vcpu_index)).value
}

/// CNTHCTL_EL2 while a guest runs: EL1 may read the physical counter and
/// use the physical timer.
pub fn cnthctl() -> u64 {
    (CNTHCTL_EL2::EL1PCTEN::SET + CNTHCTL_EL2::EL1PCEN::SET).value
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values these controls had as magic numbers before they were
    /// built from named fields (VTCR: T0SZ 30 and SL0 0 since stage 2
    /// starts at level 2).
    #[test]
    fn values_are_the_former_magic_numbers() {
        let hcr_guest: u64 = (1 << 0)
            | (1 << 1)
            | (1 << 9)
            | (1 << 10)
            | (1 << 13)
            | (1 << 14)
            | (1 << 19)
            | (1 << 31);
        assert_eq!(hcr(false, true), hcr_guest);
        assert_eq!(hcr(true, true), hcr_guest | (1 << 4) | (1 << 3));
        // TWI is bit 13.
        assert_eq!(
            hcr(true, false),
            (hcr_guest & !(1 << 13)) | (1 << 4) | (1 << 3)
        );
        for ps in 0..=7u64 {
            let ps_field = (ps & 7).min(5);
            let old = 30 | (1 << 8) | (1 << 10) | (3 << 12) | (ps_field << 16) | (1 << 31);
            assert_eq!(vtcr(ps), old, "PARange {ps}");
        }
        let root = 0x4123_4000;
        assert_eq!(vttbr(3, PhysAddr::new(root)), (3 << 48) | root);
        assert_eq!(vttbr(0x1ff, PhysAddr::new(root)), (0xff << 48) | root);
        assert_eq!(vmpidr(2), (1 << 31) | 2);
        assert_eq!(cnthctl(), 3);
    }
}
