//! Exit decoding: any (vector, ESR, FAR, HPFAR) decodes to a well-formed
//! exit, and the value a decoded load puts in its register fits the access.
#![no_main]

use hypervisor::vm::exit::{decode, load_result, VcpuExit};
use libfuzzer_sys::fuzz_target;

/// The length of the trapped instruction follows ESR_EL2.IL (bit 25).
fn assert_insn_len(insn_len: u8, esr: u64) {
    let expected = if esr & (1 << 25) != 0 { 4 } else { 2 };
    assert_eq!(insn_len, expected, "instruction length from IL");
}

fuzz_target!(|input: (u64, u64, u64, u64, u64)| {
    let (vector, esr, far, hpfar, value) = input;
    let exit = decode(vector, esr, far, hpfar);
    assert_eq!(exit, decode(vector, esr, far, hpfar), "decode is pure");
    // HPFAR_EL2.FIPA is IPA[51:12]; the page offset comes from FAR.
    let ipa_expected = ((hpfar >> 4) & 0xff_ffff_ffff) << 12 | (far & 0xfff);
    let ec = (esr >> 26) & 0x3f;
    if vector & 3 != 0 {
        assert_eq!(exit, VcpuExit::Interrupt);
        return;
    }
    match exit {
        VcpuExit::MmioRead {
            ipa,
            width,
            reg,
            sign_extend,
            sixty_four,
            insn_len,
        } => {
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x24, "MMIO only from a data abort");
            assert_ne!(esr & (1 << 24), 0, "MMIO only with a valid syndrome");
            assert_eq!(esr & (1 << 6), 0, "a read is not a write");
            assert!(matches!(width, 1 | 2 | 4 | 8), "width {width}");
            assert!(reg <= 31, "register {reg}");
            assert_eq!(ipa.raw(), ipa_expected);
            assert!(ipa.raw() < 1 << 52);
            let r = load_result(value, width, sign_extend, sixty_four);
            let bits = u32::from(width) * 8;
            if bits < 64 {
                let low = value & ((1u64 << bits) - 1);
                assert_eq!(r & ((1u64 << bits) - 1), low, "low bits kept");
                let sign = low >> (bits - 1) & 1 != 0;
                if !sign_extend || !sign {
                    assert_eq!(r, low, "zero-extended");
                } else if sixty_four {
                    assert_eq!(r >> bits, u64::MAX >> bits, "sign-extended to 64 bits");
                } else {
                    assert!(r <= u64::from(u32::MAX), "a W register holds 32 bits");
                }
            } else {
                assert_eq!(r, value);
            }
        }
        VcpuExit::MmioWrite {
            ipa,
            width,
            reg,
            insn_len,
        } => {
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x24);
            assert_ne!(esr & (1 << 24), 0);
            assert_ne!(esr & (1 << 6), 0);
            assert!(matches!(width, 1 | 2 | 4 | 8), "width {width}");
            assert!(reg <= 31, "register {reg}");
            assert_eq!(ipa.raw(), ipa_expected);
        }
        VcpuExit::ReadOnlyStore {
            far: at,
            width,
            reg,
            insn_len,
        } => {
            // A store with a syndrome that found a read-only stage-2 page
            // (a permission fault, FSC 0b0011xx), not on a stage-1 walk.
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x24);
            assert_ne!(esr & (1 << 24), 0);
            assert_ne!(esr & (1 << 6), 0);
            assert_eq!(esr & (1 << 7), 0, "not S1PTW");
            assert_eq!(esr & 0x3c, 0b1100, "a permission fault");
            assert!(matches!(width, 1 | 2 | 4 | 8), "width {width}");
            assert!(reg <= 31, "register {reg}");
            assert_eq!(at, far, "its IPA comes from FAR, not HPFAR");
        }
        VcpuExit::Abort {
            ipa, instruction, ..
        } => {
            assert!(ec == 0x24 || ec == 0x20);
            assert_eq!(instruction, ec == 0x20);
            assert_eq!(ipa.raw(), ipa_expected);
        }
        VcpuExit::Hvc { imm } => {
            assert_eq!(ec, 0x16);
            assert_eq!(u64::from(imm), esr & 0xffff);
        }
        VcpuExit::Smc { imm, insn_len } => {
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x17);
            assert_eq!(u64::from(imm), esr & 0xffff);
        }
        VcpuExit::Wait { insn_len, .. } => {
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x01);
        }
        VcpuExit::SysReg {
            encoding: (op0, op1, crn, crm, op2),
            reg,
            insn_len,
            ..
        } => {
            assert_insn_len(insn_len, esr);
            assert_eq!(ec, 0x18);
            assert!(op0 <= 3 && op1 <= 7 && crn <= 15 && crm <= 15 && op2 <= 7);
            assert!(reg <= 31);
        }
        VcpuExit::Interrupt => panic!("Interrupt from a synchronous vector"),
        VcpuExit::Unknown { esr: e } => {
            assert_eq!(e, esr);
            assert!(![0x01, 0x16, 0x17, 0x18, 0x20, 0x24].contains(&ec));
        }
    }
});
