//! The exception syndrome (ESR_ELx) and the fault address register
//! HPFAR_EL2, as named fields (tock-registers bitfields; aarch64-cpu leaves
//! ESR's ISS raw): what `vm::exit` decodes a trap from and
//! [`super::inject`] encodes an exception for the guest with. Plain values,
//! so they are read and built on the host too (`Syndrome`).

use tock_registers::register_bitfields;
use tock_registers::LocalRegisterCopy;

use crate::addr::GuestAddr;

register_bitfields! [u64,
    /// ESR_ELx: the exception class, instruction length and the
    /// class-specific syndrome.
    pub ESR [
        /// Exception class.
        EC OFFSET(26) NUMBITS(6) [
            Unknown = 0x00,
            WfiWfe = 0x01,
            Hvc64 = 0x16,
            Smc64 = 0x17,
            SysReg64 = 0x18,
            InstrAbortLowerEl = 0x20,
            InstrAbortCurrentEl = 0x21,
            DataAbortLowerEl = 0x24,
            DataAbortCurrentEl = 0x25
        ],
        /// The trapped instruction was 32 bits (else a 16-bit T32 one).
        IL OFFSET(25) NUMBITS(1) [],
        ISS OFFSET(0) NUMBITS(25) []
    ],

    /// ISS of a data abort (EC 0x24/0x25).
    pub ISS_DATA_ABORT [
        /// The fields SAS..AR below are valid.
        ISV OFFSET(24) NUMBITS(1) [],
        /// Access size: 1 << SAS bytes.
        SAS OFFSET(22) NUMBITS(2) [],
        /// Sign-extend the loaded value.
        SSE OFFSET(21) NUMBITS(1) [],
        /// The register transferred.
        SRT OFFSET(16) NUMBITS(5) [],
        /// The register is 64 bits (else 32).
        SF OFFSET(15) NUMBITS(1) [],
        /// FAR is not valid.
        FNV OFFSET(10) NUMBITS(1) [],
        /// The fault was on a stage-1 translation table walk.
        S1PTW OFFSET(7) NUMBITS(1) [],
        /// Write, not read.
        WNR OFFSET(6) NUMBITS(1) [],
        /// Fault status code (DFSC; IFSC for instruction aborts).
        FSC OFFSET(0) NUMBITS(6) [
            SyncExternal = 0x10
        ],
        /// The FSC's type, without its level (bits 5:2).
        FSC_TYPE OFFSET(2) NUMBITS(4) [
            Translation = 0b0001,
            AccessFlag = 0b0010,
            Permission = 0b0011
        ]
    ],

    /// ISS of a trapped MSR, MRS or system instruction (EC 0x18).
    pub ISS_SYSREG [
        OP0 OFFSET(20) NUMBITS(2) [],
        OP2 OFFSET(17) NUMBITS(3) [],
        OP1 OFFSET(14) NUMBITS(3) [],
        CRN OFFSET(10) NUMBITS(4) [],
        /// The general register transferred.
        RT OFFSET(5) NUMBITS(5) [],
        CRM OFFSET(1) NUMBITS(4) [],
        /// Read (MRS), not write.
        DIRECTION OFFSET(0) NUMBITS(1) []
    ],

    /// ISS of a trapped WFI or WFE (EC 0x01).
    pub ISS_WFX [
        /// WFE, not WFI (bit 0 of TI).
        TI_WFE OFFSET(0) NUMBITS(1) []
    ],

    /// ISS of an HVC or SMC (EC 0x16/0x17).
    pub ISS_CALL [
        IMM16 OFFSET(0) NUMBITS(16) []
    ],

    /// HPFAR_EL2: the faulting IPA of a stage-2 abort.
    pub HPFAR [
        /// IPA bits 51:12.
        FIPA OFFSET(4) NUMBITS(40) []
    ]
];

/// An ESR value with its ISS read under each encoding.
#[derive(Clone, Copy)]
pub struct Syndrome {
    pub esr: LocalRegisterCopy<u64, ESR::Register>,
}

impl Syndrome {
    #[inline]
    pub fn new(esr: u64) -> Self {
        Self {
            esr: LocalRegisterCopy::new(esr),
        }
    }

    #[inline]
    pub fn ec(&self) -> Option<ESR::EC::Value> {
        self.esr.read_as_enum(ESR::EC)
    }

    /// The ISS read as a data or instruction abort's.
    #[inline]
    pub fn abort(&self) -> LocalRegisterCopy<u64, ISS_DATA_ABORT::Register> {
        LocalRegisterCopy::new(self.esr.read(ESR::ISS))
    }

    /// The ISS read as a trapped system register access's.
    #[inline]
    pub fn sysreg(&self) -> LocalRegisterCopy<u64, ISS_SYSREG::Register> {
        LocalRegisterCopy::new(self.esr.read(ESR::ISS))
    }

    #[inline]
    pub fn wfx(&self) -> LocalRegisterCopy<u64, ISS_WFX::Register> {
        LocalRegisterCopy::new(self.esr.read(ESR::ISS))
    }

    #[inline]
    pub fn call(&self) -> LocalRegisterCopy<u64, ISS_CALL::Register> {
        LocalRegisterCopy::new(self.esr.read(ESR::ISS))
    }
}

/// The IPA of a stage-2 abort: the page from HPFAR_EL2, the offset in it
/// from FAR_EL2.
#[inline]
pub fn fault_ipa(hpfar: u64, far: u64) -> GuestAddr {
    let hpfar: LocalRegisterCopy<u64, HPFAR::Register> = LocalRegisterCopy::new(hpfar);
    GuestAddr::new((hpfar.read(HPFAR::FIPA) << 12) | (far & 0xfff))
}
