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

/// The EL1 system registers a guest uses, and its virtual timer: loaded
/// when its vCPU starts (reset, or restored from a snapshot), read back
/// when a paused vCPU's state is saved. They are not switched per exit: a
/// vCPU owns its physical CPU, so they stay live in hardware.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct El1State {
    pub sctlr: u64,
    pub ttbr0: u64,
    pub ttbr1: u64,
    pub tcr: u64,
    pub mair: u64,
    pub amair: u64,
    pub vbar: u64,
    pub contextidr: u64,
    pub tpidr_el0: u64,
    pub tpidrro_el0: u64,
    pub tpidr_el1: u64,
    pub sp_el0: u64,
    pub sp_el1: u64,
    pub elr_el1: u64,
    pub spsr_el1: u64,
    pub esr_el1: u64,
    pub far_el1: u64,
    pub par_el1: u64,
    pub cpacr: u64,
    pub cntkctl: u64,
    pub cntv_ctl: u64,
    pub cntv_cval: u64,
    pub afsr0: u64,
    pub afsr1: u64,
    pub csselr: u64,
    pub mdscr: u64,
}

impl El1State {
    /// Architectural reset state: MMU and caches off, little-endian.
    pub const fn reset() -> Self {
        Self {
            sctlr: 0x30d0_0800,
            ttbr0: 0,
            ttbr1: 0,
            tcr: 0,
            mair: 0,
            amair: 0,
            vbar: 0,
            contextidr: 0,
            tpidr_el0: 0,
            tpidrro_el0: 0,
            tpidr_el1: 0,
            sp_el0: 0,
            sp_el1: 0,
            elr_el1: 0,
            spsr_el1: 0,
            esr_el1: 0,
            far_el1: 0,
            par_el1: 0,
            cpacr: 0,
            cntkctl: 0,
            cntv_ctl: 0,
            cntv_cval: 0,
            afsr0: 0,
            afsr1: 0,
            csselr: 0,
            mdscr: 0,
        }
    }

    /// Every register, in a fixed order (a snapshot's).
    pub fn to_array(&self) -> [u64; 26] {
        [
            self.sctlr,
            self.ttbr0,
            self.ttbr1,
            self.tcr,
            self.mair,
            self.amair,
            self.vbar,
            self.contextidr,
            self.tpidr_el0,
            self.tpidrro_el0,
            self.tpidr_el1,
            self.sp_el0,
            self.sp_el1,
            self.elr_el1,
            self.spsr_el1,
            self.esr_el1,
            self.far_el1,
            self.par_el1,
            self.cpacr,
            self.cntkctl,
            self.cntv_ctl,
            self.cntv_cval,
            self.afsr0,
            self.afsr1,
            self.csselr,
            self.mdscr,
        ]
    }

    /// [`El1State::to_array`]'s inverse.
    pub fn from_array(a: [u64; 26]) -> Self {
        let [sctlr, ttbr0, ttbr1, tcr, mair, amair, vbar, contextidr, tpidr_el0, tpidrro_el0, tpidr_el1, sp_el0, sp_el1, elr_el1, spsr_el1, esr_el1, far_el1, par_el1, cpacr, cntkctl, cntv_ctl, cntv_cval, afsr0, afsr1, csselr, mdscr] =
            a;
        Self {
            sctlr,
            ttbr0,
            ttbr1,
            tcr,
            mair,
            amair,
            vbar,
            contextidr,
            tpidr_el0,
            tpidrro_el0,
            tpidr_el1,
            sp_el0,
            sp_el1,
            elr_el1,
            spsr_el1,
            esr_el1,
            far_el1,
            par_el1,
            cpacr,
            cntkctl,
            cntv_ctl,
            cntv_cval,
            afsr0,
            afsr1,
            csselr,
            mdscr,
        }
    }
}

/// A vCPU's virtual CPU interface as the hardware holds it (GICv2's GICH,
/// GICv3's ICH_* registers): the list registers (raw, in the GIC
/// version's encoding, `crate::hw::gic_lr`), the virtual machine control
/// register and the active priorities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VirtualInterface {
    /// List registers this CPU has (at most `MAX_LRS`).
    pub count: u8,
    pub lrs: [u64; crate::hw::gic_lr::MAX_LIST_REGISTERS],
    pub vmcr: u32,
    /// GICv2: GICH_APR, 0. GICv3: ICH_AP0R0_EL2, ICH_AP1R0_EL2.
    pub apr: [u32; 2],
}
