//! Calls to the firmware's PSCI (Power State Coordination Interface) by SMC
//! or HVC, as the device tree's /psci node says.

use core::arch::asm;

use platform::PsciConduit;

pub const PSCI_VERSION: u32 = 0x8400_0000;
pub const SYSTEM_OFF: u32 = 0x8400_0008;
pub const SYSTEM_RESET: u32 = 0x8400_0009;
pub const CPU_ON_64: u32 = 0xc400_0003;

/// PSCI return codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsciError {
    NotSupported,
    InvalidParameters,
    Denied,
    AlreadyOn,
    OnPending,
    InternalFailure,
    NotPresent,
    Disabled,
    InvalidAddress,
    Unknown(i64),
}

impl PsciError {
    fn from_code(code: i64) -> Result<u64, PsciError> {
        Err(match code {
            c if c >= 0 => return Ok(c as u64),
            -1 => PsciError::NotSupported,
            -2 => PsciError::InvalidParameters,
            -3 => PsciError::Denied,
            -4 => PsciError::AlreadyOn,
            -5 => PsciError::OnPending,
            -6 => PsciError::InternalFailure,
            -7 => PsciError::NotPresent,
            -8 => PsciError::Disabled,
            -9 => PsciError::InvalidAddress,
            other => PsciError::Unknown(other),
        })
    }
}

/// Issue a PSCI call with up to three arguments.
pub fn call(
    conduit: PsciConduit,
    function: u32,
    a1: u64,
    a2: u64,
    a3: u64,
) -> Result<u64, PsciError> {
    let mut x0 = function as u64;
    // SAFETY: an SMCCC call to firmware; it clobbers only x0-x17 per SMCCC,
    // which are declared as clobbered here.
    unsafe {
        match conduit {
            PsciConduit::Smc => asm!("smc #0",
                inout("x0") x0, inout("x1") a1 => _, inout("x2") a2 => _, inout("x3") a3 => _,
                out("x4") _, out("x5") _, out("x6") _, out("x7") _, out("x8") _, out("x9") _,
                out("x10") _, out("x11") _, out("x12") _, out("x13") _, out("x14") _,
                out("x15") _, out("x16") _, out("x17") _, options(nostack)),
            PsciConduit::Hvc => asm!("hvc #0",
                inout("x0") x0, inout("x1") a1 => _, inout("x2") a2 => _, inout("x3") a3 => _,
                out("x4") _, out("x5") _, out("x6") _, out("x7") _, out("x8") _, out("x9") _,
                out("x10") _, out("x11") _, out("x12") _, out("x13") _, out("x14") _,
                out("x15") _, out("x16") _, out("x17") _, options(nostack)),
        }
    }
    PsciError::from_code(x0 as i64)
}
