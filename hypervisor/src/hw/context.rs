//! The guest registers the world switch saves and loads, as plain data:
//! the assembly in `arch::aarch64::vcpu` uses its field offsets (and checks
//! them), the VM core reads and writes the registers of an exit.

/// Guest registers and the syndrome of the last exit. Field offsets are used
/// by the world switch's assembly (`arch::aarch64::vcpu`, which checks them).
#[repr(C, align(16))]
#[derive(Clone)]
pub struct GuestContext {
    pub x: [u64; 31],
    pub _pad: u64,
    /// PC and PSTATE to return to.
    pub elr: u64,
    pub spsr: u64,
    pub esr: u64,
    pub far: u64,
    pub hpfar: u64,
    /// The EL2 instruction counter as the interrupt vector was entered
    /// (an IRQ exit's cost starts there: see `crate::run`).
    pub irq_instructions: u64,
    /// q0-q31, then FPSR and FPCR.
    pub fp: [u128; 32],
    pub fpsr: u64,
    pub fpcr: u64,
}

/// EL1h with D, A, I and F masked: how a guest kernel is entered.
pub const SPSR_EL1H_MASKED: u64 = 0x3c5;

impl GuestContext {
    pub const fn new(pc: u64, x0: u64) -> Self {
        let mut x = [0; 31];
        x[0] = x0;
        Self {
            x,
            _pad: 0,
            elr: pc,
            spsr: SPSR_EL1H_MASKED,
            esr: 0,
            far: 0,
            hpfar: 0,
            irq_instructions: 0,
            fp: [0; 32],
            fpsr: 0,
            fpcr: 0,
        }
    }

    /// Register `n` as an instruction operand: 31 is XZR.
    pub fn reg(&self, n: u8) -> u64 {
        self.x.get(n as usize).copied().unwrap_or(0)
    }

    pub fn set_reg(&mut self, n: u8, value: u64) {
        if let Some(r) = self.x.get_mut(n as usize) {
            *r = value;
        }
    }
}
