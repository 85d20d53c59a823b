//! System registers (and fields) aarch64-cpu does not define, in its style:
//! a `register_bitfields!` definition with named fields and a unit struct
//! implementing tock-registers' `Readable`/`Writeable`, so that callers write
//! `ICC_CTLR_EL1.write(ICC_CTLR_EL1::EOImode::SET)` exactly as they do for
//! aarch64-cpu's registers. Everything else comes from
//! `aarch64_cpu::registers`.
//!
//! What is missing there: CTR_EL0, DCZID_EL0, CNTHP_TVAL_EL2 and CNTHP_CVAL_EL2, the PMU (PMCR, PMSELR,
//! PMXEVTYPER, PMCNTENSET, PMCEID0, PMEVCNTR0), the GICv3 CPU interface
//! beyond ICC_SRE_EL2 (ICC_PMR, BPR1, a writable CTLR, IGRPEN1, IAR1, EOIR1,
//! DIR, SGI1R, whose fields are in `hw::sgi`), and two fields of registers it has: CNTHCTL_EL2's event
//! stream and SCTLR_EL1.SPAN.

use core::arch::asm;

use tock_registers::interfaces::{Readable, Writeable};
use tock_registers::register_bitfields;

// Its fields are portable: the vGIC decodes a guest's writes with them.
pub use crate::hw::sgi::ICC_SGI1R_EL1;

/// A unit struct giving access to one system register, with `$fields` as
/// its field definitions. The GIC CPU interface registers are named by
/// their `S<op0>_<op1>_C<n>_C<m>_<op2>` encodings, which every assembler
/// accepts. `read`/`write` may move across memory accesses (`nomem`, as
/// aarch64-cpu's); `ordered_read`/`ordered_write` may not: acknowledging,
/// ending and sending interrupts is ordered against the memory accesses
/// (flags, queues) around them.
macro_rules! system_register {
    ($(#[$doc:meta])* $access:ident, $reg:ident: $fields:ty = $asm_name:literal, $($op:ident),+) => {
        $(#[$doc])*
        pub struct $access;
        pub const $reg: $access = $access;
        $(system_register!(@$op $access, $fields, $asm_name);)+
    };
    (@read $access:ident, $fields:ty, $asm_name:literal) => {
        impl Readable for $access {
            type T = u64;
            type R = $fields;
            #[inline]
            fn get(&self) -> u64 {
                let value;
                // SAFETY: reading this register has no side effects.
                unsafe {
                    asm!(concat!("mrs {}, ", $asm_name), out(reg) value, options(nomem, nostack))
                };
                value
            }
        }
    };
    (@write $access:ident, $fields:ty, $asm_name:literal) => {
        impl Writeable for $access {
            type T = u64;
            type R = $fields;
            #[inline]
            fn set(&self, value: u64) {
                // SAFETY: these registers control only this CPU's PMU, timer
                // and GIC interface, which the hypervisor owns at EL2.
                unsafe {
                    asm!(concat!("msr ", $asm_name, ", {}"), in(reg) value, options(nomem, nostack))
                };
            }
        }
    };
    (@ordered_read $access:ident, $fields:ty, $asm_name:literal) => {
        impl Readable for $access {
            type T = u64;
            type R = $fields;
            #[inline]
            fn get(&self) -> u64 {
                let value;
                // SAFETY: reading this register at EL2 has no effect beyond
                // the one its definition names (IAR1 acknowledges), which
                // concerns only this CPU's GIC interface.
                unsafe {
                    asm!(concat!("mrs {}, ", $asm_name), out(reg) value, options(nostack))
                };
                value
            }
        }
    };
    (@ordered_write $access:ident, $fields:ty, $asm_name:literal) => {
        impl Writeable for $access {
            type T = u64;
            type R = $fields;
            #[inline]
            fn set(&self, value: u64) {
                // SAFETY: these registers control only this CPU's GIC
                // interface, which the hypervisor owns at EL2.
                unsafe {
                    asm!(concat!("msr ", $asm_name, ", {}"), in(reg) value, options(nostack))
                };
            }
        }
    };
}

register_bitfields! {u64,
    /// Cache type.
    pub CTR_EL0 [
        /// Log2 of the smallest data cache line, in words.
        DminLine OFFSET(16) NUMBITS(4) []
    ],
    /// Data cache zero ID: what `DC ZVA` zeroes.
    pub DCZID_EL0 [
        /// DC ZVA is prohibited.
        DZP OFFSET(4) NUMBITS(1) [],
        /// Log2 of the block `DC ZVA` zeroes, in words.
        BS OFFSET(0) NUMBITS(4) []
    ],
    /// Interrupt status (aarch64-cpu has none): read at EL2, which
    /// physical interrupts are pending at this CPU, masked or not.
    pub ISR_EL1 [
        A OFFSET(8) NUMBITS(1) [],
        I OFFSET(7) NUMBITS(1) [],
        F OFFSET(6) NUMBITS(1) []
    ],
    /// EL2 physical timer: ticks until it fires.
    pub CNTHP_TVAL_EL2 [
        TimerValue OFFSET(0) NUMBITS(32) []
    ],
    /// EL2 physical timer: the counter value at which it fires.
    pub CNTHP_CVAL_EL2 [
        CompareValue OFFSET(0) NUMBITS(64) []
    ],
    /// The event-stream fields of CNTHCTL_EL2 (aarch64-cpu's CNTHCTL_EL2
    /// has only EL1PCTEN/EL1PCEN); apply with `modify` to its value.
    pub CNTHCTL_EL2_EVENT_STREAM [
        /// Which counter bit (0-15) triggers an event.
        EVNTI OFFSET(4) NUMBITS(4) [],
        EVNTDIR OFFSET(3) NUMBITS(1) [],
        EVNTEN OFFSET(2) NUMBITS(1) []
    ],
    /// SCTLR_EL1.SPAN, which aarch64-cpu's SCTLR_EL1 lacks: clear means
    /// PSTATE.PAN is set on taking an exception to EL1.
    pub SCTLR_EL1_PAN [
        SPAN OFFSET(23) NUMBITS(1) []
    ],
    pub PMCR_EL0 [
        /// Enable all counters.
        E OFFSET(0) NUMBITS(1) []
    ],
    pub PMSELR_EL0 [
        /// The event counter PMXEVTYPER_EL0 accesses.
        SEL OFFSET(0) NUMBITS(5) []
    ],
    pub PMXEVTYPER_EL0 [
        /// Don't count at EL1.
        P OFFSET(31) NUMBITS(1) [],
        /// Don't count at EL0.
        U OFFSET(30) NUMBITS(1) [],
        /// Count at EL2.
        NSH OFFSET(27) NUMBITS(1) [],
        evtCount OFFSET(0) NUMBITS(16) [
            InstRetired = 0x08
        ]
    ],
    pub PMCNTENSET_EL0 [
        /// Event counter 0.
        P0 OFFSET(0) NUMBITS(1) []
    ],
    /// Common events implemented: bit n for event n.
    pub PMCEID0_EL0 [
        INST_RETIRED OFFSET(8) NUMBITS(1) []
    ],
    pub ICC_PMR_EL1 [
        Priority OFFSET(0) NUMBITS(8) []
    ],
    pub ICC_BPR1_EL1 [
        BinaryPoint OFFSET(0) NUMBITS(3) []
    ],
    pub ICC_CTLR_EL1 [
        /// EOImode 1: EOIR drops priority only, DIR deactivates.
        EOImode OFFSET(1) NUMBITS(1) []
    ],
    pub ICC_IGRPEN1_EL1 [
        Enable OFFSET(0) NUMBITS(1) []
    ],
    /// ICC_IAR1_EL1, ICC_EOIR1_EL1 and ICC_DIR_EL1 all carry an INTID.
    pub ICC_INTID [
        INTID OFFSET(0) NUMBITS(24) []
    ]
}

system_register!(CtrEl0, CTR_EL0: CTR_EL0::Register = "CTR_EL0", read);
system_register!(IsrEl1, ISR_EL1: ISR_EL1::Register = "ISR_EL1", read);
system_register!(DczidEl0, DCZID_EL0: DCZID_EL0::Register = "DCZID_EL0", read);
system_register!(CnthpTvalEl2, CNTHP_TVAL_EL2: CNTHP_TVAL_EL2::Register = "CNTHP_TVAL_EL2", write);
system_register!(
    CnthpCvalEl2,
    CNTHP_CVAL_EL2: CNTHP_CVAL_EL2::Register = "CNTHP_CVAL_EL2",
    read,
    write
);
system_register!(PmcrEl0, PMCR_EL0: PMCR_EL0::Register = "PMCR_EL0", read, write);
system_register!(PmselrEl0, PMSELR_EL0: PMSELR_EL0::Register = "PMSELR_EL0", write);
system_register!(
    PmxevtyperEl0,
    PMXEVTYPER_EL0: PMXEVTYPER_EL0::Register = "PMXEVTYPER_EL0",
    write
);
system_register!(
    PmcntensetEl0,
    PMCNTENSET_EL0: PMCNTENSET_EL0::Register = "PMCNTENSET_EL0",
    write
);
system_register!(PmceidEl0, PMCEID0_EL0: PMCEID0_EL0::Register = "PMCEID0_EL0", read);
system_register!(
    /// Event counter 0 (32 bits wide on the CPUs we run on).
    Pmevcntr0El0,
    PMEVCNTR0_EL0: () = "PMEVCNTR0_EL0",
    read
);
system_register!(IccPmrEl1, ICC_PMR_EL1: ICC_PMR_EL1::Register = "S3_0_C4_C6_0", write);
system_register!(IccBpr1El1, ICC_BPR1_EL1: ICC_BPR1_EL1::Register = "S3_0_C12_C12_3", write);
system_register!(IccCtlrEl1, ICC_CTLR_EL1: ICC_CTLR_EL1::Register = "S3_0_C12_C12_4", write);
system_register!(
    IccIgrpen1El1,
    ICC_IGRPEN1_EL1: ICC_IGRPEN1_EL1::Register = "S3_0_C12_C12_7",
    write
);
system_register!(IccIar1El1, ICC_IAR1_EL1: ICC_INTID::Register = "S3_0_C12_C12_0", ordered_read);
system_register!(IccEoir1El1, ICC_EOIR1_EL1: ICC_INTID::Register = "S3_0_C12_C12_1", ordered_write);
system_register!(IccDirEl1, ICC_DIR_EL1: ICC_INTID::Register = "S3_0_C12_C11_1", ordered_write);
system_register!(IccSgi1rEl1, ICC_SGI1R_EL1: ICC_SGI1R_EL1::Register = "S3_0_C12_C11_5", ordered_write);
