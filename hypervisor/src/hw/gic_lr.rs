//! A portable model of the GICv2 virtual interface's list registers
//! (GICH_LRn, GIC architecture specification v2, section 5.3.11).
//!
//! The hypervisor's arch code writes [`lr_value`] into a free list register
//! and decodes what it reads back with [`parse_lr`]; neither touches
//! hardware.
//!
//! ```text
//!  31  30   29:28  27:23     22:20  19   18:13  12:10  9:0
//!  HW  Grp1 State  Priority  -      EOI  -      CPUID  VirtualID   (HW = 0)
//!  HW  Grp1 State  Priority  -      PhysicalID[19:10]  VirtualID   (HW = 1)
//! ```

/// The most list registers a GIC has (GICv2's GICH_LR0-63 are capped
/// at 16 as GICv3's are): what a saved virtual interface holds.
pub const MAX_LIST_REGISTERS: usize = 16;

/// An interrupt to put into a list register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingIrq {
    pub intid: u32,
    /// Priority (bits 7:3 significant).
    pub priority: u8,
    /// The CPU that sent it, for SGIs.
    pub source_cpu: Option<u8>,
    /// Level-sensitive: list it with the EOI bit and call
    /// `VDistributor::on_eoi` (vgic) at the maintenance interrupt.
    pub is_level: bool,
    /// Group 1 (the list register's Grp1 bit).
    pub group1: bool,
}

/// HW: the virtual interrupt is backed by a physical one (never set here).
pub const LR_HW: u32 = 1 << 31;
/// Grp1: a group 1 virtual interrupt.
pub const LR_GRP1: u32 = 1 << 30;
/// State field: pending.
pub const LR_PENDING: u32 = 1 << 28;
/// State field: active.
pub const LR_ACTIVE: u32 = 1 << 29;
/// Lowest bit of the 5-bit priority field (priority bits 7:3).
pub const LR_PRIORITY_SHIFT: u32 = 23;
/// EOI (HW = 0): raise a maintenance interrupt when the guest deactivates
/// this interrupt.
pub const LR_EOI: u32 = 1 << 19;
/// Lowest bit of the CPUID field (HW = 0): the source CPU of an SGI.
pub const LR_CPUID_SHIFT: u32 = 10;
/// Lowest bit of the PhysicalID field (HW = 1), where EOI and CPUID are
/// otherwise.
pub const LR_PHYSICAL_ID_SHIFT: u32 = 10;
/// The PhysicalID field, shifted down.
pub const LR_PHYSICAL_ID_MASK: u32 = 0x3ff;
/// The VirtualID field.
pub const LR_VIRTUAL_ID_MASK: u32 = 0x3ff;

/// The State field of a list register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrStatus {
    /// The list register is free.
    Invalid,
    Pending,
    Active,
    PendingActive,
}

/// A decoded list register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LrState {
    /// VirtualID: the INTID the guest sees.
    pub intid: u32,
    pub state: LrStatus,
    /// The EOI maintenance bit (only meaningful with `hw` clear).
    pub eoi: bool,
    pub hw: bool,
    pub group1: bool,
    /// Priority, bits 7:3 significant.
    pub priority: u8,
    /// The CPUID field for an SGI (`hw` clear, `intid` < 16).
    pub source_cpu: Option<u8>,
    /// The PhysicalID field when `hw` is set.
    pub physical_id: Option<u32>,
}

impl LrState {
    /// Whether the list register is free for a new interrupt.
    pub fn is_free(&self) -> bool {
        self.state == LrStatus::Invalid
    }
}

/// The GICH_LRn value that presents `irq` to the guest as pending: its
/// INTID as VirtualID, priority bits 7:3, the group. With `hw` the
/// interrupt is linked to that physical INTID (HW set, PhysicalID), whose
/// deactivation the guest's own does. Without: the EOI bit for
/// level-sensitive interrupts (so the hypervisor learns through a
/// maintenance interrupt when the guest is done and can re-sample the line,
/// see `VDistributor::on_eoi` in vgic), and the source CPU for an SGI.
pub fn lr_value(irq: &PendingIrq, hw: Option<u32>) -> u32 {
    let mut value = (irq.intid & LR_VIRTUAL_ID_MASK)
        | (u32::from(irq.priority >> 3) << LR_PRIORITY_SHIFT)
        | LR_PENDING;
    if irq.group1 {
        value |= LR_GRP1;
    }
    if let Some(physical) = hw {
        return value | LR_HW | (physical & LR_PHYSICAL_ID_MASK) << LR_PHYSICAL_ID_SHIFT;
    }
    if irq.is_level {
        value |= LR_EOI;
    }
    if let Some(source) = irq.source_cpu {
        value |= u32::from(source & 7) << LR_CPUID_SHIFT;
    }
    value
}

/// Decodes a GICH_LRn value read back from the hardware (any value).
pub fn parse_lr(value: u32) -> LrState {
    let intid = value & LR_VIRTUAL_ID_MASK;
    let hw = value & LR_HW != 0;
    let state = match (value & LR_PENDING != 0, value & LR_ACTIVE != 0) {
        (false, false) => LrStatus::Invalid,
        (true, false) => LrStatus::Pending,
        (false, true) => LrStatus::Active,
        (true, true) => LrStatus::PendingActive,
    };
    LrState {
        intid,
        state,
        eoi: !hw && value & LR_EOI != 0,
        hw,
        group1: value & LR_GRP1 != 0,
        priority: (((value >> LR_PRIORITY_SHIFT) & 0x1f) << 3) as u8,
        source_cpu: (!hw && intid < 16).then_some(((value >> LR_CPUID_SHIFT) & 7) as u8),
        physical_id: hw.then_some((value >> LR_PHYSICAL_ID_SHIFT) & LR_PHYSICAL_ID_MASK),
    }
}

/// GICv3 list register (ICH_LR<n>_EL2) fields.
const LR3_STATE_SHIFT: u32 = 62;
const LR3_HW: u64 = 1 << 61;
const LR3_GROUP: u64 = 1 << 60;
const LR3_PRIORITY_SHIFT: u32 = 48;
/// With HW = 0: raise a maintenance interrupt when the guest deactivates.
const LR3_EOI: u64 = 1 << 41;
const LR3_PINTID_SHIFT: u32 = 32;
const LR3_PINTID_MASK: u64 = 0x1fff;

/// The `ICH_LR<n>_EL2` value that makes `irq` pending in the guest. With
/// `hw` the interrupt is linked to that physical INTID, whose deactivation
/// the guest's own does (no EOI maintenance then). GICv3 SGIs carry no
/// source CPU.
pub fn lr_value_v3(irq: &PendingIrq, hw: Option<u32>) -> u64 {
    let mut value = u64::from(irq.intid)
        | (u64::from(irq.priority & 0xf8) << LR3_PRIORITY_SHIFT)
        | (1 << LR3_STATE_SHIFT);
    if irq.group1 {
        value |= LR3_GROUP;
    }
    match hw {
        Some(physical) => {
            value |= LR3_HW | ((u64::from(physical) & LR3_PINTID_MASK) << LR3_PINTID_SHIFT)
        }
        None if irq.is_level => value |= LR3_EOI,
        None => {}
    }
    value
}

/// Decode an `ICH_LR<n>_EL2` value.
pub fn parse_lr_v3(value: u64) -> LrState {
    let hw = value & LR3_HW != 0;
    let state = match (value >> LR3_STATE_SHIFT) & 3 {
        0 => LrStatus::Invalid,
        1 => LrStatus::Pending,
        2 => LrStatus::Active,
        _ => LrStatus::PendingActive,
    };
    LrState {
        intid: value as u32,
        state,
        eoi: !hw && value & LR3_EOI != 0,
        hw,
        group1: value & LR3_GROUP != 0,
        priority: ((value >> LR3_PRIORITY_SHIFT) & 0xf8) as u8,
        source_cpu: None,
        physical_id: hw.then_some(((value >> LR3_PINTID_SHIFT) & LR3_PINTID_MASK) as u32),
    }
}

/// The GICv2 list register value that decodes to `lr` ([`parse_lr`]'s
/// inverse for every value it can return).
pub fn encode_lr(lr: &LrState) -> u32 {
    let mut value =
        (lr.intid & LR_VIRTUAL_ID_MASK) | (u32::from(lr.priority >> 3) << LR_PRIORITY_SHIFT);
    value |= match lr.state {
        LrStatus::Invalid => 0,
        LrStatus::Pending => LR_PENDING,
        LrStatus::Active => LR_ACTIVE,
        LrStatus::PendingActive => LR_PENDING | LR_ACTIVE,
    };
    if lr.group1 {
        value |= LR_GRP1;
    }
    if lr.hw {
        let physical = lr.physical_id.unwrap_or(0) & LR_PHYSICAL_ID_MASK;
        return value | LR_HW | physical << LR_PHYSICAL_ID_SHIFT;
    }
    if lr.eoi {
        value |= LR_EOI;
    }
    if let Some(source) = lr.source_cpu {
        value |= u32::from(source & 7) << LR_CPUID_SHIFT;
    }
    value
}

/// The GICv3 list register value that decodes to `lr` ([`parse_lr_v3`]'s
/// inverse for every value it can return).
pub fn encode_lr_v3(lr: &LrState) -> u64 {
    let state: u64 = match lr.state {
        LrStatus::Invalid => 0,
        LrStatus::Pending => 1,
        LrStatus::Active => 2,
        LrStatus::PendingActive => 3,
    };
    let mut value = u64::from(lr.intid)
        | (u64::from(lr.priority & 0xf8) << LR3_PRIORITY_SHIFT)
        | (state << LR3_STATE_SHIFT);
    if lr.group1 {
        value |= LR3_GROUP;
    }
    if lr.hw {
        let physical = u64::from(lr.physical_id.unwrap_or(0)) & LR3_PINTID_MASK;
        value |= LR3_HW | physical << LR3_PINTID_SHIFT;
    } else if lr.eoi {
        value |= LR3_EOI;
    }
    value
}

#[cfg(test)]
mod encode_tests {
    use super::*;

    #[test]
    fn encoding_a_decoded_list_register_gives_it_back_when_it_is_canonical() {
        let irq = PendingIrq {
            intid: 33,
            priority: 0xa0,
            source_cpu: None,
            is_level: true,
            group1: true,
        };
        for v in [
            lr_value(&irq, None),
            lr_value(&irq, Some(27)),
            0,
            LR_ACTIVE | 5 | (3 << 10),
        ] {
            assert_eq!(encode_lr(&parse_lr(v)), v, "{v:#x}");
        }
        for v in [
            lr_value_v3(&irq, None),
            lr_value_v3(&irq, Some(27)),
            0,
            (2 << 62) | 30,
        ] {
            assert_eq!(encode_lr_v3(&parse_lr_v3(v)), v, "{v:#x}");
        }
        // Reserved bits do not survive: a reader refuses such a value.
        assert_ne!(encode_lr(&parse_lr(1 << 21)), 1 << 21);
        assert_ne!(encode_lr_v3(&parse_lr_v3(1 << 45)), 1 << 45);
    }
}
