//! Why a vCPU left its guest, decoded once from the exception syndrome
//! (ESR_EL2, FAR_EL2, HPFAR_EL2) into a [`VcpuExit`]; the VM manager matches
//! on it and never looks at syndrome bits. Plain data, tested on the host.
//!
//! Exits whose instruction the hypervisor completes carry `insn_len`, the
//! trapped instruction's length from ESR_EL2.IL (4, or 2 for a 16-bit T32
//! instruction of an AArch32 EL0): the PC is stepped by that, never by a
//! fixed 4.

use crate::addr::GuestAddr;

use super::syndrome::{fault_ipa, Syndrome, ESR, ISS_CALL, ISS_DATA_ABORT, ISS_SYSREG, ISS_WFX};
use ESR::EC::Value as EC;

/// Why the guest stopped running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuExit {
    /// A load the hypervisor must emulate: write the result to `reg`.
    MmioRead {
        ipa: GuestAddr,
        width: u8,
        reg: u8,
        sign_extend: bool,
        sixty_four: bool,
        insn_len: u8,
    },
    /// A store the hypervisor must emulate; the value is in `reg`.
    MmioWrite {
        ipa: GuestAddr,
        width: u8,
        reg: u8,
        insn_len: u8,
    },
    /// A stage-2 fault the syndrome does not describe as a simple load or
    /// store (no valid ISV), or an instruction fetch: `write` is meaningful
    /// for data aborts only.
    Abort {
        ipa: GuestAddr,
        write: bool,
        instruction: bool,
        fault: FaultKind,
    },
    /// `hvc #imm`; the arguments are in x0-x7. ELR already points past it.
    Hvc { imm: u16 },
    /// `smc #imm`, trapped; ELR points at it.
    Smc { imm: u16, insn_len: u8 },
    /// WFI (`false`) or WFE (`true`).
    Wait { wfe: bool, insn_len: u8 },
    /// A trapped MSR (`read` false) or MRS of the system register
    /// (op0, op1, CRn, CRm, op2) with general register `reg` (31: XZR).
    /// ELR points at the instruction.
    SysReg {
        encoding: (u8, u8, u8, u8, u8),
        reg: u8,
        read: bool,
        insn_len: u8,
    },
    /// An IRQ, FIQ or SError arrived while the guest ran.
    Interrupt,
    /// A store that found a read-only stage-2 page, with a valid syndrome:
    /// emulated like a [`VcpuExit::MmioWrite`], but the architecture
    /// leaves HPFAR_EL2 UNKNOWN for a permission fault, so only `far`'s
    /// offset in its page is known. The one page a VM's stage 2 maps
    /// read-only is the PL011's mirror (`vm::uart_mirror`), which places
    /// it ([`VcpuExit::read_only_store_at`]).
    ReadOnlyStore {
        far: u64,
        width: u8,
        reg: u8,
        insn_len: u8,
    },
    /// Anything else, with the raw syndrome for the message.
    Unknown { esr: u64 },
}

/// What kind of exit a [`VcpuExit`] is, without its fields: the `exit`
/// trace event's (see `crate::trace`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(all(target_os = "none", feature = "trace"), derive(defmt::Format))]
pub enum ExitKind {
    MmioRead,
    MmioWrite,
    Abort,
    Hvc,
    Smc,
    Wfi,
    Wfe,
    SysReg,
    Interrupt,
    Unknown,
}

impl VcpuExit {
    /// A [`VcpuExit::ReadOnlyStore`] as the MMIO store it is, in the page
    /// at `page` (the read-only page it found), at `far`'s offset: a
    /// stage-1 page is 4 KiB or a multiple, so a virtual address and its
    /// IPA share their low 12 bits. `None` for any other exit.
    pub fn read_only_store_at(&self, page: GuestAddr) -> Option<VcpuExit> {
        let VcpuExit::ReadOnlyStore {
            far,
            width,
            reg,
            insn_len,
        } = *self
        else {
            return None;
        };
        Some(VcpuExit::MmioWrite {
            ipa: page + (far & 0xfff),
            width,
            reg,
            insn_len,
        })
    }

    pub fn kind(&self) -> ExitKind {
        match self {
            VcpuExit::MmioRead { .. } => ExitKind::MmioRead,
            VcpuExit::MmioWrite { .. } | VcpuExit::ReadOnlyStore { .. } => ExitKind::MmioWrite,
            VcpuExit::Abort { .. } => ExitKind::Abort,
            VcpuExit::Hvc { .. } => ExitKind::Hvc,
            VcpuExit::Smc { .. } => ExitKind::Smc,
            VcpuExit::Wait { wfe: false, .. } => ExitKind::Wfi,
            VcpuExit::Wait { wfe: true, .. } => ExitKind::Wfe,
            VcpuExit::SysReg { .. } => ExitKind::SysReg,
            VcpuExit::Interrupt => ExitKind::Interrupt,
            VcpuExit::Unknown { .. } => ExitKind::Unknown,
        }
    }
}

/// The kind of a stage-2 fault (DFSC/IFSC bits 5:2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Translation,
    AccessFlag,
    Permission,
    Other(u8),
}

/// Decode an exit from the vector taken and the syndrome registers.
pub fn decode(vector: u64, esr: u64, far: u64, hpfar: u64) -> VcpuExit {
    if vector & 3 != 0 {
        return VcpuExit::Interrupt;
    }
    let syndrome = Syndrome::new(esr);
    let insn_len = instruction_length(esr);
    let ipa = fault_ipa(hpfar, far);
    let abort = syndrome.abort();
    let fault = match abort.read_as_enum(ISS_DATA_ABORT::FSC_TYPE) {
        Some(ISS_DATA_ABORT::FSC_TYPE::Value::Translation) => FaultKind::Translation,
        Some(ISS_DATA_ABORT::FSC_TYPE::Value::AccessFlag) => FaultKind::AccessFlag,
        Some(ISS_DATA_ABORT::FSC_TYPE::Value::Permission) => FaultKind::Permission,
        None => FaultKind::Other(abort.read(ISS_DATA_ABORT::FSC) as u8),
    };
    let Some(ec) = syndrome.ec() else {
        return VcpuExit::Unknown { esr };
    };
    match ec {
        EC::WfiWfe => VcpuExit::Wait {
            wfe: syndrome.wfx().is_set(ISS_WFX::TI_WFE),
            insn_len,
        },
        EC::Hvc64 => VcpuExit::Hvc {
            imm: syndrome.call().read(ISS_CALL::IMM16) as u16,
        },
        EC::Smc64 => VcpuExit::Smc {
            imm: syndrome.call().read(ISS_CALL::IMM16) as u16,
            insn_len,
        },
        EC::SysReg64 => {
            let iss = syndrome.sysreg();
            VcpuExit::SysReg {
                encoding: (
                    iss.read(ISS_SYSREG::OP0) as u8,
                    iss.read(ISS_SYSREG::OP1) as u8,
                    iss.read(ISS_SYSREG::CRN) as u8,
                    iss.read(ISS_SYSREG::CRM) as u8,
                    iss.read(ISS_SYSREG::OP2) as u8,
                ),
                reg: iss.read(ISS_SYSREG::RT) as u8,
                read: iss.is_set(ISS_SYSREG::DIRECTION),
                insn_len,
            }
        }
        EC::InstrAbortLowerEl => VcpuExit::Abort {
            ipa,
            write: false,
            instruction: true,
            fault,
        },
        EC::DataAbortLowerEl => {
            let write = abort.is_set(ISS_DATA_ABORT::WNR);
            // S1PTW: the fault was on the guest's own page-table walk, which
            // is not an access to emulate even if ISV were set.
            if !abort.is_set(ISS_DATA_ABORT::ISV)
                || abort.is_set(ISS_DATA_ABORT::S1PTW)
                || fault != FaultKind::Translation
            {
                return data_abort(esr, ipa, far, fault);
            }
            let width = 1 << abort.read(ISS_DATA_ABORT::SAS);
            let reg = abort.read(ISS_DATA_ABORT::SRT) as u8;
            if write {
                VcpuExit::MmioWrite {
                    ipa,
                    width,
                    reg,
                    insn_len,
                }
            } else {
                VcpuExit::MmioRead {
                    ipa,
                    width,
                    reg,
                    sign_extend: abort.is_set(ISS_DATA_ABORT::SSE),
                    sixty_four: abort.is_set(ISS_DATA_ABORT::SF),
                    insn_len,
                }
            }
        }
        _ => VcpuExit::Unknown { esr },
    }
}

/// [`decode`] for a data abort that is not a simple access to an unmapped
/// page: a store that found a read-only page (the PL011's mirror), which is
/// emulated like one that found none once its IPA is known, or an abort.
/// Out of line, off the translation faults' way: a notify with nothing to
/// do is bounded at 500 EL2 instructions, and this test in line cost it 4.
#[cold]
#[inline(never)]
fn data_abort(esr: u64, ipa: GuestAddr, far: u64, fault: FaultKind) -> VcpuExit {
    let abort = Syndrome::new(esr).abort();
    let write = abort.is_set(ISS_DATA_ABORT::WNR);
    if write
        && fault == FaultKind::Permission
        && abort.is_set(ISS_DATA_ABORT::ISV)
        && !abort.is_set(ISS_DATA_ABORT::S1PTW)
    {
        return VcpuExit::ReadOnlyStore {
            far,
            width: 1 << abort.read(ISS_DATA_ABORT::SAS),
            reg: abort.read(ISS_DATA_ABORT::SRT) as u8,
            insn_len: instruction_length(esr),
        };
    }
    VcpuExit::Abort {
        ipa,
        write,
        instruction: false,
        fault,
    }
}

/// The length in bytes of the instruction that trapped: 4 when ESR_ELx.IL
/// is set, 2 (a 16-bit T32 instruction) when it is clear.
pub fn instruction_length(esr: u64) -> u8 {
    if Syndrome::new(esr).esr.is_set(ESR::IL) {
        4
    } else {
        2
    }
}

/// Whether the syndrome of a trapped instruction was 32 bits long (IL).
pub fn il32(insn_len: u8) -> bool {
    insn_len == 4
}

/// The value a load of `width` bytes puts in its register.
pub fn load_result(value: u64, width: u8, sign_extend: bool, sixty_four: bool) -> u64 {
    let bits = u32::from(width) * 8;
    if bits >= 64 {
        return value;
    }
    // Not an access `decode` produces (1 << SAS is at least 1), but the
    // sign extension below must not shift by 64 for it.
    if bits == 0 {
        return 0;
    }
    let v = value & ((1 << bits) - 1);
    if !sign_extend {
        return v;
    }
    let extended = ((v << (64 - bits)) as i64 >> (64 - bits)) as u64;
    if sixty_four {
        extended
    } else {
        extended & 0xffff_ffff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EC_DABT_LOW: u64 = 0x24 << 26;
    const IL: u64 = 1 << 25;

    /// HPFAR_EL2 for a fault at `ipa`.
    fn hp(ipa: u64) -> u64 {
        (ipa >> 12) << 4
    }

    #[test]
    fn exit_kinds() {
        assert_eq!(decode(8, 0x01 << 26, 0, 0).kind(), ExitKind::Wfi);
        assert_eq!(decode(8, (0x01 << 26) | IL | 1, 0, 0).kind(), ExitKind::Wfe);
        assert_eq!(decode(9, 0, 0, 0).kind(), ExitKind::Interrupt);
        assert_eq!(decode(8, 0x16 << 26, 0, 0).kind(), ExitKind::Hvc);
        assert_eq!(decode(8, 0x3f << 26, 0, 0).kind(), ExitKind::Unknown);
        // A translation fault with a valid syndrome (ISV): a load, a store.
        let isv = (1 << 24) | (2 << 22) | 0x07;
        let load = decode(8, EC_DABT_LOW | IL | isv, 0x900_0000, hp(0x900_0000));
        assert_eq!(load.kind(), ExitKind::MmioRead);
        let store = decode(8, EC_DABT_LOW | IL | isv | (1 << 6), 0, hp(0x900_0000));
        assert_eq!(store.kind(), ExitKind::MmioWrite);
        // Without ISV: an abort to back or refuse.
        assert_eq!(
            decode(8, EC_DABT_LOW | IL | 0x07, 0, hp(0x4000_0000)).kind(),
            ExitKind::Abort
        );
    }

    #[test]
    fn trapped_icc_sgi1r_write() {
        // msr ICC_SGI1R_EL1, x2: EC 0x18, op0 3, op2 5, op1 0, CRn 12,
        // Rt 2, CRm 11, direction 0 (write).
        let iss = (3 << 20) | (5 << 17) | (12 << 10) | (2 << 5) | (11 << 1);
        let exit = decode(8, (0x18 << 26) | IL | iss, 0, 0);
        assert_eq!(
            exit,
            VcpuExit::SysReg {
                encoding: (3, 0, 12, 11, 5),
                reg: 2,
                read: false,
                insn_len: 4
            }
        );
        let read = decode(8, (0x18 << 26) | IL | iss | 1, 0, 0);
        assert!(matches!(read, VcpuExit::SysReg { read: true, .. }));
    }

    #[test]
    fn mmio_store_word() {
        // str w3, [x1] to IPA 0x0a00_0050: ISV, SAS=2 (word), SRT=3, WnR,
        // DFSC translation level 3.
        let esr = EC_DABT_LOW | IL | (1 << 24) | (2 << 22) | (3 << 16) | (1 << 6) | 0b000111;
        let exit = decode(8, esr, 0xffff_0050, hp(0x0a00_0050));
        assert_eq!(
            exit,
            VcpuExit::MmioWrite {
                ipa: GuestAddr::new(0x0a00_0050),
                width: 4,
                reg: 3,
                insn_len: 4
            }
        );
    }

    #[test]
    fn mmio_load_byte_sign_extended() {
        let esr = EC_DABT_LOW | IL | (1 << 24) | (1 << 21) | (7 << 16) | 0b000101;
        let exit = decode(8, esr, 0x18, hp(0x0900_0000));
        assert_eq!(
            exit,
            VcpuExit::MmioRead {
                ipa: GuestAddr::new(0x0900_0018),
                width: 1,
                reg: 7,
                sign_extend: true,
                sixty_four: false,
                insn_len: 4
            }
        );
        assert_eq!(load_result(0x80, 1, true, false), 0xffff_ff80);
        assert_eq!(load_result(0x80, 1, true, true), 0xffff_ffff_ffff_ff80);
        assert_eq!(load_result(0x1_2345_6780, 4, false, true), 0x2345_6780);
        assert_eq!(load_result(u64::MAX, 8, false, true), u64::MAX);
    }

    #[test]
    fn il_gives_the_instruction_length() {
        // A WFI of a 16-bit T32 instruction (AArch32 EL0): IL clear.
        assert_eq!(
            decode(8, 0x01 << 26, 0, 0),
            VcpuExit::Wait {
                wfe: false,
                insn_len: 2
            }
        );
        // A 16-bit T32 store with a full syndrome.
        let esr = EC_DABT_LOW | (1 << 24) | (2 << 22) | (1 << 16) | (1 << 6) | 0b000111;
        assert!(matches!(
            decode(8, esr, 0, hp(0x0900_0000)),
            VcpuExit::MmioWrite { insn_len: 2, .. }
        ));
        assert!(matches!(
            decode(8, esr | IL, 0, hp(0x0900_0000)),
            VcpuExit::MmioWrite { insn_len: 4, .. }
        ));
        assert_eq!(instruction_length(IL), 4);
        assert_eq!(instruction_length(0), 2);
        assert!(il32(4) && !il32(2));
    }

    #[test]
    fn aborts_without_syndrome_and_other_exits() {
        // A load pair (no ISV) in RAM.
        let esr = EC_DABT_LOW | IL | 0b000111;
        assert_eq!(
            decode(8, esr, 0x123, hp(0x4000_1000)),
            VcpuExit::Abort {
                ipa: GuestAddr::new(0x4000_1123),
                write: false,
                instruction: false,
                fault: FaultKind::Translation
            }
        );
        // A store that found a read-only page (the PL011's mirror) is
        // emulated in that page, at FAR's offset (HPFAR_EL2 does not hold
        // its IPA); a load that did is not MMIO.
        let esr = EC_DABT_LOW | IL | (1 << 24) | (1 << 6) | 0b001111;
        assert_eq!(
            decode(8, esr | 3 << 16, 0xffff_0000_0900_0018, 0x1234),
            VcpuExit::ReadOnlyStore {
                far: 0xffff_0000_0900_0018,
                width: 1,
                reg: 3,
                insn_len: 4
            }
        );
        assert_eq!(
            decode(8, esr | 3 << 16, 0xffff_0000_1234_5018, 0x1234)
                .read_only_store_at(GuestAddr::new(0x0900_0000)),
            Some(VcpuExit::MmioWrite {
                ipa: GuestAddr::new(0x0900_0018),
                width: 1,
                reg: 3,
                insn_len: 4
            })
        );
        assert_eq!(
            VcpuExit::Interrupt.read_only_store_at(GuestAddr::new(0)),
            None
        );
        assert!(
            matches!(decode(8, esr | 1 << 7, 0, 0), VcpuExit::Abort { .. }),
            "S1PTW"
        );
        let esr = EC_DABT_LOW | IL | (1 << 24) | 0b001111;
        assert!(matches!(
            decode(8, esr, 0, 0),
            VcpuExit::Abort {
                write: false,
                fault: FaultKind::Permission,
                ..
            }
        ));
        // Without ISV (a store pair, an atomic) it is not emulated either.
        let esr = EC_DABT_LOW | IL | (1 << 6) | 0b001111;
        assert!(matches!(
            decode(8, esr, 0, 0),
            VcpuExit::Abort {
                write: true,
                fault: FaultKind::Permission,
                ..
            }
        ));
        assert_eq!(decode(8, (0x16 << 26) | IL, 0, 0), VcpuExit::Hvc { imm: 0 });
        assert_eq!(
            decode(8, (0x17 << 26) | IL | 5, 0, 0),
            VcpuExit::Smc {
                imm: 5,
                insn_len: 4
            }
        );
        assert_eq!(
            decode(8, (0x01 << 26) | IL | 1, 0, 0),
            VcpuExit::Wait {
                wfe: true,
                insn_len: 4
            }
        );
        assert_eq!(decode(9, 0, 0, 0), VcpuExit::Interrupt);
        assert_eq!(
            decode(8, 0x3f << 26, 0, 0),
            VcpuExit::Unknown { esr: 0x3f << 26 }
        );
        assert!(matches!(
            decode(8, (0x20 << 26) | 0b000110, 0, 0x1 << 4),
            VcpuExit::Abort {
                instruction: true,
                ipa,
                ..
            } if ipa == GuestAddr::new(0x1000)
        ));
    }
}
