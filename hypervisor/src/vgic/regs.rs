//! GICv2 distributor register map (GIC architecture specification v2,
//! section 4.1.2, table 4-1) and the decoding of an offset into the register
//! it names.

/// Distributor Control Register.
pub const GICD_CTLR: u64 = 0x000;
/// Interrupt Controller Type Register (read-only; fields in [`TYPER`]).
pub const GICD_TYPER: u64 = 0x004;
/// Distributor Implementer Identification Register (read-only).
pub const GICD_IIDR: u64 = 0x008;
/// Interrupt Group Registers, one bit per interrupt.
pub const GICD_IGROUPR: u64 = 0x080;
/// Interrupt Set-Enable Registers.
pub const GICD_ISENABLER: u64 = 0x100;
/// Interrupt Clear-Enable Registers.
pub const GICD_ICENABLER: u64 = 0x180;
/// Interrupt Set-Pending Registers.
pub const GICD_ISPENDR: u64 = 0x200;
/// Interrupt Clear-Pending Registers.
pub const GICD_ICPENDR: u64 = 0x280;
/// Interrupt Set-Active Registers.
pub const GICD_ISACTIVER: u64 = 0x300;
/// Interrupt Clear-Active Registers.
pub const GICD_ICACTIVER: u64 = 0x380;
/// Interrupt Priority Registers, one byte per interrupt.
pub const GICD_IPRIORITYR: u64 = 0x400;
/// Interrupt Processor Targets Registers, one byte per interrupt.
pub const GICD_ITARGETSR: u64 = 0x800;
/// Interrupt Configuration Registers, two bits per interrupt.
pub const GICD_ICFGR: u64 = 0xc00;

tock_registers::register_bitfields! [u32,
    /// GICD_TYPER's fields, the same in both versions but for `IDbits`.
    pub TYPER [
        /// GICv3: the number of INTID bits minus one.
        IDbits OFFSET(19) NUMBITS(5) [],
        /// The number of CPUs minus one (GICv2; ignored by a GICv3 with
        /// affinity routing, which still reports at most 8).
        CPUNumber OFFSET(5) NUMBITS(3) [],
        /// INTIDs go up to 32 * (ITLinesNumber + 1) - 1.
        ITLinesNumber OFFSET(0) NUMBITS(5) []
    ]
];
/// Non-secure Access Control Registers (RAZ/WI: no Security Extensions).
pub const GICD_NSACR: u64 = 0xe00;
/// Software Generated Interrupt Register (write-only).
pub const GICD_SGIR: u64 = 0xf00;
/// SGI Clear-Pending Registers, one byte per SGI (a bit per source CPU).
pub const GICD_CPENDSGIR: u64 = 0xf10;
/// SGI Set-Pending Registers.
pub const GICD_SPENDSGIR: u64 = 0xf20;
/// Peripheral ID4 (first of the identification registers).
pub const GICD_PIDR4: u64 = 0xfd0;
/// Peripheral ID2: bits 7:4 are ArchRev (2 for GICv2).
pub const GICD_PIDR2: u64 = 0xfe8;
/// Size of the distributor's register page.
pub const GICD_SIZE: u64 = 0x1000;
/// Size of the guest-physical window the distributor occupies on the
/// guest board (`0x0800_0000..0x0801_0000`); offsets in it past
/// [`GICD_SIZE`] are reserved.
pub const GICD_WINDOW: u64 = 0x1_0000;

/// GICD_CTLR.EnableGrp0 (the "Enable" bit Linux sets).
pub const CTLR_ENABLE_GRP0: u32 = 1 << 0;
/// GICD_CTLR.EnableGrp1.
pub const CTLR_ENABLE_GRP1: u32 = 1 << 1;

/// The identification registers PIDR4..PIDR7, PIDR0..PIDR3, CIDR0..CIDR3
/// (0xfd0..0x1000), with the values of Arm's GIC-400: PIDR2 = 0x2b says
/// "GICv2 architecture, JEP106 code used".
pub const GICD_ID_VALUES: [u32; 12] = [
    0x04, 0x00, 0x00, 0x00, // PIDR4..PIDR7
    0x90, 0xb4, 0x2b, 0x00, // PIDR0..PIDR3
    0x0d, 0xf0, 0x05, 0xb1, // CIDR0..CIDR3
];

/// The registers holding one bit per interrupt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BitReg {
    Group,
    SetEnable,
    ClearEnable,
    SetPending,
    ClearPending,
    SetActive,
    ClearActive,
}

/// A decoded distributor offset. Interrupt numbers are the first INTID the
/// accessed register (or byte) covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reg {
    Ctlr,
    Typer,
    Iidr,
    /// One bit per interrupt, 32 interrupts from `first`.
    Bits(BitReg, u32),
    /// One byte per interrupt from `first`.
    Priority(u32),
    /// One byte per interrupt from `first`.
    Targets(u32),
    /// Two bits per interrupt, 16 interrupts from `first`.
    Config(u32),
    Sgir,
    /// One byte per SGI from `first`.
    ClearPendingSgi(u32),
    /// One byte per SGI from `first`.
    SetPendingSgi(u32),
    /// An identification register with its value.
    Id(u32),
    /// No register, or one this model implements as RAZ/WI (NSACR, the
    /// implementation-defined block): reads as zero, writes are ignored.
    Reserved,
}

impl Reg {
    /// Whether the register also takes single-byte accesses (the spec's
    /// "byte-accessible" registers); all others take aligned words only.
    pub(crate) fn byte_accessible(self) -> bool {
        matches!(
            self,
            Reg::Priority(_) | Reg::Targets(_) | Reg::ClearPendingSgi(_) | Reg::SetPendingSgi(_)
        )
    }
}

/// Decodes `offset` (already known to be inside the window) into a
/// register. The offset need not be word-aligned: byte registers decode to
/// the exact byte.
pub(crate) fn decode(offset: u64) -> Reg {
    // Offsets handled below are all < 0x1000, so the casts are lossless.
    let bit_block = |base: u64| ((offset - base) / 4) as u32 * 32;
    match offset {
        0x000..=0x003 => Reg::Ctlr,
        0x004..=0x007 => Reg::Typer,
        0x008..=0x00b => Reg::Iidr,
        0x080..=0x0ff => Reg::Bits(BitReg::Group, bit_block(GICD_IGROUPR)),
        0x100..=0x17f => Reg::Bits(BitReg::SetEnable, bit_block(GICD_ISENABLER)),
        0x180..=0x1ff => Reg::Bits(BitReg::ClearEnable, bit_block(GICD_ICENABLER)),
        0x200..=0x27f => Reg::Bits(BitReg::SetPending, bit_block(GICD_ISPENDR)),
        0x280..=0x2ff => Reg::Bits(BitReg::ClearPending, bit_block(GICD_ICPENDR)),
        0x300..=0x37f => Reg::Bits(BitReg::SetActive, bit_block(GICD_ISACTIVER)),
        0x380..=0x3ff => Reg::Bits(BitReg::ClearActive, bit_block(GICD_ICACTIVER)),
        // INTIDs 1020..1023 are special: their priority and target bytes
        // (0x7fc.., 0xbfc..) are reserved.
        0x400..=0x7fb => Reg::Priority((offset - GICD_IPRIORITYR) as u32),
        0x800..=0xbfb => Reg::Targets((offset - GICD_ITARGETSR) as u32),
        0xc00..=0xcff => Reg::Config(((offset - GICD_ICFGR) / 4) as u32 * 16),
        0xf00..=0xf03 => Reg::Sgir,
        0xf10..=0xf1f => Reg::ClearPendingSgi((offset - GICD_CPENDSGIR) as u32),
        0xf20..=0xf2f => Reg::SetPendingSgi((offset - GICD_SPENDSGIR) as u32),
        0xfd0..=0xfff => Reg::Id(GICD_ID_VALUES[((offset - GICD_PIDR4) / 4) as usize]),
        _ => Reg::Reserved,
    }
}
