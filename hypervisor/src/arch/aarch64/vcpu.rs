//! Entering and leaving a guest: the world switch, the EL2 controls a guest
//! runs under, and decoding why it left into one [`VcpuExit`].
//!
//! `enter_guest` saves the host's callee-saved registers on the host stack,
//! loads the guest's general and FP/SIMD registers and `eret`s. Any exception
//! from the guest enters `guest_exit` (vectors 8-11), which stores the guest
//! registers and the syndrome back into the same [`GuestContext`] and returns
//! from `enter_guest` as if it were a call. EL1 system registers are not
//! switched per exit: a vCPU owns its physical CPU, so they stay live in
//! hardware; [`El1Regs`] loads them when a vCPU starts.

use core::arch::{asm, global_asm};

/// The guest registers the world switch saves and loads (portable, so the
/// VM core can be tested on the host); the offsets below are the assembly's.
pub use crate::vm::cpu::{GuestContext, SPSR_EL1H_MASKED};

const OFF_ELR: usize = 256;
const OFF_ESR: usize = 272;
const OFF_HPFAR: usize = 288;
const OFF_FP: usize = 304;
const OFF_FPSR: usize = OFF_FP + 512;
const _: () = assert!(core::mem::offset_of!(GuestContext, elr) == OFF_ELR);
const _: () = assert!(core::mem::offset_of!(GuestContext, esr) == OFF_ESR);
const _: () = assert!(core::mem::offset_of!(GuestContext, hpfar) == OFF_HPFAR);
const _: () = assert!(core::mem::offset_of!(GuestContext, fp) == OFF_FP);
const _: () = assert!(core::mem::offset_of!(GuestContext, fpsr) == OFF_FPSR);

global_asm!(
    r#"
.macro SAVE_FP base
    stp     q0, q1, [\base, #0]
    stp     q2, q3, [\base, #32]
    stp     q4, q5, [\base, #64]
    stp     q6, q7, [\base, #96]
    stp     q8, q9, [\base, #128]
    stp     q10, q11, [\base, #160]
    stp     q12, q13, [\base, #192]
    stp     q14, q15, [\base, #224]
    stp     q16, q17, [\base, #256]
    stp     q18, q19, [\base, #288]
    stp     q20, q21, [\base, #320]
    stp     q22, q23, [\base, #352]
    stp     q24, q25, [\base, #384]
    stp     q26, q27, [\base, #416]
    stp     q28, q29, [\base, #448]
    stp     q30, q31, [\base, #480]
.endm
.macro LOAD_FP base
    ldp     q0, q1, [\base, #0]
    ldp     q2, q3, [\base, #32]
    ldp     q4, q5, [\base, #64]
    ldp     q6, q7, [\base, #96]
    ldp     q8, q9, [\base, #128]
    ldp     q10, q11, [\base, #160]
    ldp     q12, q13, [\base, #192]
    ldp     q14, q15, [\base, #224]
    ldp     q16, q17, [\base, #256]
    ldp     q18, q19, [\base, #288]
    ldp     q20, q21, [\base, #320]
    ldp     q22, q23, [\base, #352]
    ldp     q24, q25, [\base, #384]
    ldp     q26, q27, [\base, #416]
    ldp     q28, q29, [\base, #448]
    ldp     q30, q31, [\base, #480]
.endm

.section .text
/* u64 enter_guest(GuestContext *ctx): returns the vector index of the exit. */
.global enter_guest
enter_guest:
    /* Host callee-saved state: x19-x30 and d8-d15, then ctx on top. */
    stp     x29, x30, [sp, #-16]!
    stp     x27, x28, [sp, #-16]!
    stp     x25, x26, [sp, #-16]!
    stp     x23, x24, [sp, #-16]!
    stp     x21, x22, [sp, #-16]!
    stp     x19, x20, [sp, #-16]!
    stp     d14, d15, [sp, #-16]!
    stp     d12, d13, [sp, #-16]!
    stp     d10, d11, [sp, #-16]!
    stp     d8, d9, [sp, #-16]!
    stp     x0, xzr, [sp, #-16]!

    add     x1, x0, #{off_fp}
    LOAD_FP x1
    add     x1, x1, #512
    ldp     x2, x3, [x1]            /* FPSR, FPCR */
    msr     FPSR, x2
    msr     FPCR, x3
    ldp     x2, x3, [x0, #{off_elr}]
    msr     ELR_EL2, x2
    msr     SPSR_EL2, x3
    ldp     x2, x3, [x0, #16]
    ldp     x4, x5, [x0, #32]
    ldp     x6, x7, [x0, #48]
    ldp     x8, x9, [x0, #64]
    ldp     x10, x11, [x0, #80]
    ldp     x12, x13, [x0, #96]
    ldp     x14, x15, [x0, #112]
    ldp     x16, x17, [x0, #128]
    ldp     x18, x19, [x0, #144]
    ldp     x20, x21, [x0, #160]
    ldp     x22, x23, [x0, #176]
    ldp     x24, x25, [x0, #192]
    ldp     x26, x27, [x0, #208]
    ldp     x28, x29, [x0, #224]
    ldr     x30, [x0, #240]
    ldp     x0, x1, [x0, #0]
    eret
    dsb     nsh
    isb

/* Entered from the vectors with the guest's x0/x1 pushed and x1 = vector. */
.global guest_exit
guest_exit:
    ldr     x0, [sp, #16]           /* ctx, pushed by enter_guest */
    stp     x2, x3, [x0, #16]
    stp     x4, x5, [x0, #32]
    stp     x6, x7, [x0, #48]
    stp     x8, x9, [x0, #64]
    stp     x10, x11, [x0, #80]
    stp     x12, x13, [x0, #96]
    stp     x14, x15, [x0, #112]
    stp     x16, x17, [x0, #128]
    stp     x18, x19, [x0, #144]
    stp     x20, x21, [x0, #160]
    stp     x22, x23, [x0, #176]
    stp     x24, x25, [x0, #192]
    stp     x26, x27, [x0, #208]
    stp     x28, x29, [x0, #224]
    str     x30, [x0, #240]
    mov     x19, x1                 /* the vector */
    ldp     x2, x3, [sp], #16       /* the guest's x0, x1 */
    stp     x2, x3, [x0, #0]
    mrs     x2, ELR_EL2
    mrs     x3, SPSR_EL2
    stp     x2, x3, [x0, #{off_elr}]
    mrs     x2, ESR_EL2
    mrs     x3, FAR_EL2
    stp     x2, x3, [x0, #{off_esr}]
    mrs     x2, HPFAR_EL2
    str     x2, [x0, #{off_hpfar}]
    add     x1, x0, #{off_fp}
    SAVE_FP x1
    mrs     x2, FPSR
    mrs     x3, FPCR
    add     x1, x1, #512
    stp     x2, x3, [x1]
    mov     x0, x19

    add     sp, sp, #16             /* ctx slot */
    ldp     d8, d9, [sp], #16
    ldp     d10, d11, [sp], #16
    ldp     d12, d13, [sp], #16
    ldp     d14, d15, [sp], #16
    ldp     x19, x20, [sp], #16
    ldp     x21, x22, [sp], #16
    ldp     x23, x24, [sp], #16
    ldp     x25, x26, [sp], #16
    ldp     x27, x28, [sp], #16
    ldp     x29, x30, [sp], #16
    ret
"#,
    off_fp = const OFF_FP,
    off_elr = const OFF_ELR,
    off_esr = const OFF_ESR,
    off_hpfar = const OFF_HPFAR,
);

extern "C" {
    fn enter_guest(ctx: *mut GuestContext) -> u64;
}

/// Run the guest until it exits; returns the exception vector it exited by
/// (8 synchronous, 9 IRQ, 10 FIQ, 11 SError).
pub fn run(ctx: &mut GuestContext) -> u64 {
    // SAFETY: the stage-2 and EL2 controls for this guest are loaded
    // (`load_vm_controls`); enter_guest preserves every register the Rust
    // ABI needs and returns here on the guest's next exception.
    unsafe { enter_guest(ctx) }
}

/// HCR_EL2 while a guest runs: stage 2 on (VM), set/way invalidation
/// upgraded (SWIO), forced broadcast (FB), inner-shareable barriers (BSU),
/// WFI/WFE and SMC trapped, EL1 is AArch64 (RW).
pub const HCR_GUEST: u64 =
    (1 << 0) | (1 << 1) | (1 << 9) | (1 << 10) | (1 << 13) | (1 << 14) | (1 << 19) | (1 << 31);

/// VTCR_EL2 for [`crate::mm::stage2`]: T0SZ 25, start at level 1, write-back
/// inner shareable walks, 4 KiB granule, PS from the CPU, RES1 bit 31.
pub fn vtcr() -> u64 {
    let mmfr0: u64;
    // SAFETY: reading an ID register has no side effects.
    unsafe { asm!("mrs {}, ID_AA64MMFR0_EL1", out(reg) mmfr0, options(nomem, nostack)) };
    let ps = (mmfr0 & 7).min(5);
    25 | (1 << 6) | (1 << 8) | (1 << 10) | (3 << 12) | (ps << 16) | (1 << 31)
}

/// Point this CPU's stage 2 at a VM and set the controls a guest runs under.
/// With `virtual_irqs`, physical IRQs and FIQs are routed to EL2 (HCR_EL2
/// IMO/FMO), which also enables virtual interrupts from the list registers.
pub fn load_vm_controls(vmid: u16, root: u64, vcpu_index: u64, virtual_irqs: bool) {
    let hcr = HCR_GUEST | if virtual_irqs { (1 << 4) | (1 << 3) } else { 0 };
    let vttbr = ((vmid as u64 & 0xff) << 48) | root;
    // SAFETY: these registers only affect guest execution (EL1/EL0), which
    // does not run on this CPU until `run`.
    unsafe {
        asm!(
            "msr VTCR_EL2, {vtcr}",
            "msr VTTBR_EL2, {vttbr}",
            "msr VMPIDR_EL2, {vmpidr}",
            "msr HCR_EL2, {hcr}",
            "msr CNTHCTL_EL2, {cnthctl}",
            "msr CNTVOFF_EL2, xzr",
            "isb",
            vtcr = in(reg) vtcr(),
            vttbr = in(reg) vttbr,
            vmpidr = in(reg) (1u64 << 31) | vcpu_index,
            hcr = in(reg) hcr,
            // EL1 may read the physical counter and use the physical timer.
            cnthctl = in(reg) 3u64,
            options(nostack)
        );
    }
}

/// Invalidate every stage-1 and stage-2 TLB entry of VM `vmid` on every CPU
/// (one broadcast per batch of unmaps, never per page).
pub fn flush_vm_tlb(vmid: u16) {
    // SAFETY: VTTBR_EL2 is switched to the VMID only for the TLBI (which
    // uses the current VMID) and restored; no guest runs on this CPU now.
    unsafe {
        asm!(
            "mrs {saved}, VTTBR_EL2",
            "msr VTTBR_EL2, {vttbr}",
            "isb",
            "dsb ishst",
            "tlbi vmalls12e1is",
            "dsb ish",
            "isb",
            "msr VTTBR_EL2, {saved}",
            "isb",
            saved = out(reg) _,
            vttbr = in(reg) (vmid as u64 & 0xff) << 48,
            options(nostack)
        );
    }
}

/// The EL1 system registers a guest uses, loaded when its vCPU starts.
#[derive(Clone, Copy, Default)]
pub struct El1Regs {
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
}

impl El1Regs {
    /// Architectural reset state: MMU and caches off, little-endian.
    pub fn reset() -> Self {
        Self {
            sctlr: 0x30d0_0800,
            ..Self::default()
        }
    }

    /// Load these values into the CPU's EL1 registers.
    pub fn load(&self) {
        // SAFETY: EL1 registers only affect the guest that runs next on this CPU.
        unsafe {
            asm!(
                "msr SCTLR_EL1, {0}", "msr TTBR0_EL1, {1}", "msr TTBR1_EL1, {2}",
                "msr TCR_EL1, {3}", "msr MAIR_EL1, {4}", "msr AMAIR_EL1, {5}",
                "msr VBAR_EL1, {6}", "msr CONTEXTIDR_EL1, {7}",
                in(reg) self.sctlr, in(reg) self.ttbr0, in(reg) self.ttbr1, in(reg) self.tcr,
                in(reg) self.mair, in(reg) self.amair, in(reg) self.vbar, in(reg) self.contextidr,
                options(nostack)
            );
            asm!(
                "msr TPIDR_EL0, {0}", "msr TPIDRRO_EL0, {1}", "msr TPIDR_EL1, {2}",
                "msr SP_EL0, {3}", "msr SP_EL1, {4}", "msr ELR_EL1, {5}", "msr SPSR_EL1, {6}",
                "msr ESR_EL1, {7}",
                in(reg) self.tpidr_el0, in(reg) self.tpidrro_el0, in(reg) self.tpidr_el1,
                in(reg) self.sp_el0, in(reg) self.sp_el1, in(reg) self.elr_el1,
                in(reg) self.spsr_el1, in(reg) self.esr_el1,
                options(nostack)
            );
            asm!(
                "msr FAR_EL1, {0}", "msr PAR_EL1, {1}", "msr CPACR_EL1, {2}",
                "msr CNTKCTL_EL1, {3}", "msr CNTV_CTL_EL0, {4}", "msr CNTV_CVAL_EL0, {5}",
                "isb",
                in(reg) self.far_el1, in(reg) self.par_el1, in(reg) self.cpacr,
                in(reg) self.cntkctl, in(reg) self.cntv_ctl, in(reg) self.cntv_cval,
                options(nostack)
            );
        }
    }
}

/// Turn the EL1 virtual timer off (a guest left this CPU): its interrupt
/// would otherwise keep waking the idle CPU.
pub fn disable_virtual_timer() {
    // SAFETY: the virtual timer belongs to whichever guest runs here; none
    // does now, and the next one loads its own timer state.
    unsafe { asm!("msr CNTV_CTL_EL0, xzr", "isb", options(nomem, nostack)) };
}

/// Deliver `exception` to the guest that just exited into `ctx`: its EL1
/// syndrome registers are written (they are live on this CPU, see the
/// module docs) and it resumes at its vector (`vm::inject` computes all of
/// it). `far`: the faulting address, if valid; `il32`: ESR_EL2.IL.
pub fn inject(
    ctx: &mut GuestContext,
    exception: crate::vm::inject::GuestException,
    far: Option<u64>,
    il32: bool,
) {
    let (vbar, sctlr, mmfr1): (u64, u64, u64);
    // SAFETY: reading the guest's EL1 registers and an ID register has no
    // side effects.
    unsafe {
        asm!(
            "mrs {0}, VBAR_EL1", "mrs {1}, SCTLR_EL1", "mrs {2}, ID_AA64MMFR1_EL1",
            out(reg) vbar, out(reg) sctlr, out(reg) mmfr1,
            options(nomem, nostack)
        );
    }
    // PSTATE.PAN is set on entry to EL1 when the CPU has PAN
    // (ID_AA64MMFR1_EL1.PAN) and SCTLR_EL1.SPAN (bit 23) is clear.
    let set_pan = (mmfr1 >> 20) & 0xf != 0 && sctlr & (1 << 23) == 0;
    let trapped = crate::vm::inject::Trapped {
        pstate: ctx.spsr,
        pc: ctx.elr,
        far,
        il32,
        vbar,
        set_pan,
    };
    let regs = crate::vm::inject::exception(exception, &trapped);
    // SAFETY: the EL1 exception registers belong to the guest that runs on
    // this CPU; writing them is what taking the exception would have done.
    unsafe {
        asm!(
            "msr ESR_EL1, {esr}", "msr ELR_EL1, {elr}", "msr SPSR_EL1, {spsr}",
            esr = in(reg) regs.esr_el1, elr = in(reg) regs.elr_el1,
            spsr = in(reg) regs.spsr_el1,
            options(nomem, nostack)
        );
        if let Some(far) = regs.far_el1 {
            asm!("msr FAR_EL1, {}", in(reg) far, options(nomem, nostack));
        }
    }
    ctx.elr = regs.pc;
    ctx.spsr = regs.pstate;
}
