//! What a guest gets for an access the hypervisor refuses: a synchronous
//! exception taken to its EL1, as the hardware would raise it — an external
//! abort (data or instruction) for a bad device access or an address that is
//! neither RAM nor a device, an UNDEFINED exception for a system register
//! the hypervisor does not emulate (what KVM does).
//!
//! [`exception`] turns the guest's state and the facts of the fault into
//! the new register values; the arch layer only writes them
//! (`arch::aarch64::vcpu::inject`). Plain data, tested on the host.

use tock_registers::fields::FieldValue;

use super::syndrome::{ESR, ISS_DATA_ABORT};
use ESR::EC::Value as EC;

/// SPSR/PSTATE bits the exception entry keeps or sets.
const PSTATE_M_MASK: u64 = 0x1f;
/// M[4]: the interrupted context was AArch32 (only EL0 can be, HCR_EL2.RW = 1).
const PSTATE_NRW: u64 = 1 << 4;
/// EL1 with SP_EL1 (EL1h).
const PSTATE_EL1H: u64 = 0b0101;
/// EL1 with SP_EL0 (EL1t).
const PSTATE_EL1T: u64 = 0b0100;
/// D, A, I and F masked.
const PSTATE_DAIF: u64 = 0xf << 6;
/// PAN (bit 22), UAO (23), DIT (24): kept across an exception entry.
const PSTATE_PAN: u64 = 1 << 22;
const PSTATE_KEPT: u64 = PSTATE_PAN | (1 << 23) | (1 << 24);

/// ESR_ELx.EC values (the tests compare against them).
pub const EC_UNKNOWN: u64 = EC::Unknown as u64;
pub const EC_IABT_LOWER: u64 = EC::InstrAbortLowerEl as u64;
pub const EC_IABT_SAME: u64 = EC::InstrAbortCurrentEl as u64;
pub const EC_DABT_LOWER: u64 = EC::DataAbortLowerEl as u64;
pub const EC_DABT_SAME: u64 = EC::DataAbortCurrentEl as u64;

/// The kind of exception a guest gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestException {
    /// A synchronous external abort on a load or store.
    DataAbort { write: bool },
    /// A synchronous external abort on an instruction fetch.
    InstructionAbort,
    /// An UNDEFINED instruction (EC 0), e.g. an unemulated system register.
    Undefined,
}

/// The guest's state when it trapped, and the facts of the fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trapped {
    /// The guest's PSTATE (SPSR_EL2).
    pub pstate: u64,
    /// The faulting instruction's address (ELR_EL2).
    pub pc: u64,
    /// The faulting virtual address (FAR_EL2), if valid.
    pub far: Option<u64>,
    /// The trapped instruction was 32 bits long (ESR_EL2.IL).
    pub il32: bool,
    /// The guest's VBAR_EL1.
    pub vbar: u64,
    /// PSTATE.PAN is to be set on entry (the CPU has PAN and the guest's
    /// SCTLR_EL1.SPAN is clear).
    pub set_pan: bool,
}

/// The guest's registers after the exception entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injection {
    pub esr_el1: u64,
    /// `None`: FAR_EL1 is left as it is (UNDEFINED does not set it, and an
    /// abort without a valid address says so with FnV).
    pub far_el1: Option<u64>,
    pub elr_el1: u64,
    pub spsr_el1: u64,
    /// Where the guest continues (ELR_EL2) and in what state (SPSR_EL2).
    pub pc: u64,
    pub pstate: u64,
}

/// Whether the guest was at EL1 (an exception "from the current EL").
fn from_el1(pstate: u64) -> bool {
    pstate & PSTATE_NRW == 0 && (pstate & 0xc) == 0x4
}

/// VBAR_EL1 offset of a synchronous exception taken to EL1 from `pstate`.
pub fn vector_offset(pstate: u64) -> u64 {
    match pstate & PSTATE_M_MASK {
        PSTATE_EL1T => 0x000,
        PSTATE_EL1H => 0x200,
        m if m & PSTATE_NRW != 0 => 0x600,
        _ => 0x400,
    }
}

/// The register values that deliver `exception` to the guest's EL1.
pub fn exception(exception: GuestException, t: &Trapped) -> Injection {
    let same = from_el1(t.pstate);
    let external = ISS_DATA_ABORT::FSC::SyncExternal;
    let (ec, iss, far): (_, FieldValue<u64, ISS_DATA_ABORT::Register>, _) = match exception {
        GuestException::DataAbort { write } => {
            let ec = if same {
                ESR::EC::DataAbortCurrentEl
            } else {
                ESR::EC::DataAbortLowerEl
            };
            let wnr = ISS_DATA_ABORT::WNR.val(u64::from(write));
            let fnv = ISS_DATA_ABORT::FNV.val(u64::from(t.far.is_none()));
            (ec, external + wnr + fnv, t.far)
        }
        GuestException::InstructionAbort => {
            let ec = if same {
                ESR::EC::InstrAbortCurrentEl
            } else {
                ESR::EC::InstrAbortLowerEl
            };
            // The address is the PC itself when FAR_EL2 has none.
            (ec, external, Some(t.far.unwrap_or(t.pc)))
        }
        GuestException::Undefined => (ESR::EC::Unknown, ISS_DATA_ABORT::FSC.val(0), None),
    };
    // Aborts reported without an instruction syndrome have IL = 1 (RES1);
    // UNDEFINED reports the trapped instruction's length.
    let il = match exception {
        GuestException::Undefined => t.il32,
        _ => true,
    };
    let esr = ec + ESR::IL.val(u64::from(il)) + ESR::ISS.val(iss.value);
    let pan = if t.set_pan { PSTATE_PAN } else { 0 };
    Injection {
        esr_el1: esr.value,
        far_el1: far,
        elr_el1: t.pc,
        spsr_el1: t.pstate,
        pc: t.vbar.wrapping_add(vector_offset(t.pstate)),
        pstate: PSTATE_EL1H | PSTATE_DAIF | (t.pstate & PSTATE_KEPT) | pan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trapped(pstate: u64) -> Trapped {
        Trapped {
            pstate,
            pc: 0x4020_1234,
            far: Some(0xffff_0000_0a00_0101),
            il32: true,
            vbar: 0x4020_0800,
            set_pan: false,
        }
    }

    #[test]
    fn data_abort_from_el1h() {
        // EL1h, interrupts enabled, NZCV set.
        let pstate = 0xf000_0005;
        let i = exception(GuestException::DataAbort { write: false }, &trapped(pstate));
        assert_eq!(i.esr_el1, (0x25 << 26) | (1 << 25) | 0x10);
        assert_eq!(i.far_el1, Some(0xffff_0000_0a00_0101));
        assert_eq!(i.elr_el1, 0x4020_1234);
        assert_eq!(i.spsr_el1, pstate);
        assert_eq!(i.pc, 0x4020_0800 + 0x200);
        assert_eq!(i.pstate, 0x3c5);
    }

    #[test]
    fn write_abort_from_el0_without_far() {
        let mut t = trapped(0x0000_0000);
        t.far = None;
        let i = exception(GuestException::DataAbort { write: true }, &t);
        assert_eq!(
            i.esr_el1,
            (0x24 << 26) | (1 << 25) | (1 << 10) | (1 << 6) | 0x10
        );
        assert_eq!(i.far_el1, None);
        assert_eq!(i.pc, 0x4020_0800 + 0x400);
    }

    #[test]
    fn vector_offsets() {
        assert_eq!(vector_offset(0b0100), 0x000); // EL1t
        assert_eq!(vector_offset(0b0101), 0x200); // EL1h
        assert_eq!(vector_offset(0b0000), 0x400); // EL0 AArch64
        assert_eq!(vector_offset(0b10000), 0x600); // EL0 AArch32 (usr)
        let i = exception(GuestException::DataAbort { write: false }, &trapped(0b0100));
        assert_eq!(i.esr_el1 >> 26, EC_DABT_SAME);
        assert_eq!(i.pc, 0x4020_0800);
        // An AArch32 EL0 is a lower EL even though M[3:2] would read as 1.
        let i = exception(
            GuestException::DataAbort { write: false },
            &trapped(0b10100),
        );
        assert_eq!(i.esr_el1 >> 26, EC_DABT_LOWER);
        assert_eq!(i.pc, 0x4020_0800 + 0x600);
    }

    #[test]
    fn instruction_abort_reports_the_pc() {
        let mut t = trapped(0x3c5);
        t.far = None;
        let i = exception(GuestException::InstructionAbort, &t);
        assert_eq!(i.esr_el1, (0x21 << 26) | (1 << 25) | 0x10);
        assert_eq!(i.far_el1, Some(t.pc));
        assert_eq!(i.spsr_el1, 0x3c5);
        let i = exception(GuestException::InstructionAbort, &trapped(0));
        assert_eq!(i.esr_el1 >> 26, EC_IABT_LOWER);
        assert_eq!(i.far_el1, Some(0xffff_0000_0a00_0101));
    }

    #[test]
    fn undefined_keeps_far_and_reports_the_length() {
        let i = exception(GuestException::Undefined, &trapped(0x5));
        assert_eq!(i.esr_el1, 1 << 25);
        assert_eq!(i.far_el1, None);
        let mut t = trapped(0x10); // AArch32 EL0, a 16-bit T32 instruction
        t.il32 = false;
        assert_eq!(exception(GuestException::Undefined, &t).esr_el1, 0);
    }

    #[test]
    fn pan_uao_dit_kept_and_pan_set_on_request() {
        let mut t = trapped(0x0040_0005 | (1 << 23) | (1 << 24) | (1 << 21));
        let i = exception(GuestException::DataAbort { write: false }, &t);
        // PAN, UAO, DIT kept; SS (21) and the flags dropped.
        assert_eq!(i.pstate, 0x3c5 | (1 << 22) | (1 << 23) | (1 << 24));
        t.pstate = 0x5;
        t.set_pan = true;
        let i = exception(GuestException::DataAbort { write: false }, &t);
        assert_eq!(i.pstate, 0x3c5 | (1 << 22));
    }
}
