//! ICC_SGI1R_EL1's fields (GICv3 architecture specification, 12.2.21):
//! the arch code sends SGIs with them and the vGIC decodes a guest's
//! writes (to ICC_SGI1R_EL1, ICC_ASGI1R_EL1 or ICC_SGI0R_EL1, which share
//! the layout) with the same definition.

use tock_registers::register_bitfields;

register_bitfields! [u64,
    pub ICC_SGI1R_EL1 [
        Aff3 OFFSET(48) NUMBITS(8) [],
        /// Range selector: TargetList covers Aff0 16*RS..16*RS+15.
        RS OFFSET(44) NUMBITS(4) [],
        /// Interrupt routing mode: 0 means to the listed targets, 1 to
        /// every PE but the sender.
        IRM OFFSET(40) NUMBITS(1) [],
        Aff2 OFFSET(32) NUMBITS(8) [],
        INTID OFFSET(24) NUMBITS(4) [],
        Aff1 OFFSET(16) NUMBITS(8) [],
        TargetList OFFSET(0) NUMBITS(16) []
    ]
];
