//! Entering and leaving a guest: the world switch, and loading the EL2
//! controls a guest runs under (their values come from `vm::controls`; why
//! it left is decoded by `vm::exit` from the syndrome saved here).
//!
//! `enter_guest` saves the host's callee-saved registers on the host stack,
//! loads the guest's general and FP/SIMD registers and `eret`s. Any exception
//! from the guest enters `guest_exit` (vectors 8-11), which stores the guest
//! registers and the syndrome back into the same [`GuestContext`] and returns
//! from `enter_guest` as if it were a call. EL1 system registers are not
//! switched per exit: a vCPU owns its physical CPU, so they stay live in
//! hardware; [`El1Regs`] loads them when a vCPU starts.

use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU64, Ordering};

use aarch64_cpu::asm::barrier;
use aarch64_cpu::registers::{
    Readable, Writeable, AFSR0_EL1, AFSR1_EL1, AMAIR_EL1, CNTHCTL_EL2, CNTKCTL_EL1, CNTVOFF_EL2,
    CNTV_CTL_EL0, CNTV_CVAL_EL0, CONTEXTIDR_EL1, CPACR_EL1, CSSELR_EL1, ELR_EL1, ESR_EL1, FAR_EL1,
    HCR_EL2, ID_AA64MMFR0_EL1, ID_AA64MMFR1_EL1, MAIR_EL1, MDSCR_EL1, PAR_EL1, SCTLR_EL1, SPSR_EL1,
    SP_EL0, SP_EL1, TCR_EL1, TPIDRRO_EL0, TPIDR_EL0, TPIDR_EL1, TTBR0_EL1, TTBR1_EL1, VBAR_EL1,
    VMPIDR_EL2, VTCR_EL2, VTTBR_EL2,
};

use super::sysreg::SCTLR_EL1_PAN;
use crate::addr::PhysAddr;
use crate::hw::context::El1State;
use crate::hw::controls;

/// The guest registers the world switch saves and loads (portable, so the
/// VM core can be tested on the host); the offsets below are the assembly's.
pub use crate::hw::context::{GuestContext, SPSR_EL1H_MASKED};

const OFF_ELR: usize = 256;
const OFF_ESR: usize = 272;
const OFF_HPFAR: usize = 288;
/// [`GuestContext::irq_instructions`], written by the IRQ vector
/// (`exceptions.rs`).
pub(super) const OFF_IRQ_INSTRUCTIONS: usize = 296;
const OFF_FP: usize = 304;
const OFF_FPSR: usize = OFF_FP + 512;
const _: () = assert!(core::mem::offset_of!(GuestContext, elr) == OFF_ELR);
const _: () = assert!(core::mem::offset_of!(GuestContext, esr) == OFF_ESR);
const _: () = assert!(core::mem::offset_of!(GuestContext, hpfar) == OFF_HPFAR);
const _: () = assert!(core::mem::offset_of!(GuestContext, fp) == OFF_FP);
const _: () =
    assert!(core::mem::offset_of!(GuestContext, irq_instructions) == OFF_IRQ_INSTRUCTIONS);
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

/// Point this CPU's stage 2 at a VM and set the controls a guest runs under
/// ([`controls`]), WFI trapped until [`set_wfi_trap`] says otherwise. With
/// `virtual_irqs`, physical IRQs and FIQs are routed to EL2, which also
/// enables virtual interrupts from the list registers.
pub fn load_vm_controls(vmid: u16, root: PhysAddr, vcpu_index: u64, virtual_irqs: bool) {
    // These registers only affect guest execution (EL1/EL0), which does not
    // run on this CPU until `run`.
    VTCR_EL2.set(controls::vtcr(
        ID_AA64MMFR0_EL1.read(ID_AA64MMFR0_EL1::PARange),
    ));
    VTTBR_EL2.set(controls::vttbr(vmid, root));
    VMPIDR_EL2.set(controls::vmpidr(vcpu_index));
    let hcr = controls::hcr(virtual_irqs, true);
    HCR_EL2.set(hcr);
    if let Some(shadow) = HCR_LOADED.get(super::cpu_index()) {
        shadow.store(hcr, Ordering::Relaxed);
    }
    CNTHCTL_EL2.set(controls::cnthctl());
    barrier::isb(barrier::SY);
}

/// HCR_EL2 as this CPU last loaded it ([`load_vm_controls`],
/// [`set_wfi_trap`]): the trap is set before every entry from the full
/// path, and a write of HCR_EL2 is not free (under QEMU it takes the
/// global lock), so an unchanged value is not written again.
static HCR_LOADED: [AtomicU64; super::MAX_CPUS] = [const { AtomicU64::new(0) }; super::MAX_CPUS];

/// Trap the guest's WFI on this CPU, or let it sleep in WFI itself (it
/// wakes on any interrupt for it: a physical one, routed to EL2, exits).
pub fn set_wfi_trap(trap: bool) {
    let Some(shadow) = HCR_LOADED.get(super::cpu_index()) else {
        return;
    };
    let loaded = shadow.load(Ordering::Relaxed);
    let twi = HCR_EL2::TWI::SET.value;
    let want = if trap { loaded | twi } else { loaded & !twi };
    if want != loaded {
        HCR_EL2.set(want);
        shadow.store(want, Ordering::Relaxed);
        barrier::isb(barrier::SY);
    }
}

/// Invalidate every stage-1 and stage-2 TLB entry of VM `vmid` on every CPU
/// (one broadcast per batch of unmaps, never per page).
pub fn flush_vm_tlb(vmid: u16) {
    // TLBI VMALLS12E1IS acts on the current VMID: VTTBR_EL2 is switched to
    // `vmid` only for it and restored; no guest runs on this CPU now.
    let saved = VTTBR_EL2.get();
    VTTBR_EL2.set(controls::vttbr(vmid, PhysAddr::new(0)));
    barrier::isb(barrier::SY);
    invalidate_current_vmid_tlb();
    VTTBR_EL2.set(saved);
    barrier::isb(barrier::SY);
}

/// TLBI VMALLS12E1IS, ordered after earlier table stores and completed.
fn invalidate_current_vmid_tlb() {
    // SAFETY: dropping TLB entries only makes the next walks read the
    // tables; the barriers order it after the table stores and before
    // later accesses.
    unsafe {
        asm!(
            "dsb ishst",
            "tlbi vmalls12e1is",
            "dsb ish",
            "isb",
            options(nostack)
        )
    };
}

/// Load a vCPU's EL1 registers and virtual timer into this CPU (they only
/// affect the guest that runs next on it).
pub fn load_el1(s: &El1State) {
    SCTLR_EL1.set(s.sctlr);
    TTBR0_EL1.set(s.ttbr0);
    TTBR1_EL1.set(s.ttbr1);
    TCR_EL1.set(s.tcr);
    MAIR_EL1.set(s.mair);
    AMAIR_EL1.set(s.amair);
    VBAR_EL1.set(s.vbar);
    CONTEXTIDR_EL1.set(s.contextidr);
    TPIDR_EL0.set(s.tpidr_el0);
    TPIDRRO_EL0.set(s.tpidrro_el0);
    TPIDR_EL1.set(s.tpidr_el1);
    SP_EL0.set(s.sp_el0);
    SP_EL1.set(s.sp_el1);
    ELR_EL1.set(s.elr_el1);
    SPSR_EL1.set(s.spsr_el1);
    ESR_EL1.set(s.esr_el1);
    FAR_EL1.set(s.far_el1);
    PAR_EL1.set(s.par_el1);
    CPACR_EL1.set(s.cpacr);
    CNTKCTL_EL1.set(s.cntkctl);
    CNTV_CTL_EL0.set(s.cntv_ctl);
    CNTV_CVAL_EL0.set(s.cntv_cval);
    AFSR0_EL1.set(s.afsr0);
    AFSR1_EL1.set(s.afsr1);
    CSSELR_EL1.set(s.csselr);
    MDSCR_EL1.set(s.mdscr);
    barrier::isb(barrier::SY);
}

/// This CPU's EL1 registers and virtual timer, as the guest left them
/// (read by its own vCPU, between two of its exits).
pub fn save_el1() -> El1State {
    El1State {
        sctlr: SCTLR_EL1.get(),
        ttbr0: TTBR0_EL1.get(),
        ttbr1: TTBR1_EL1.get(),
        tcr: TCR_EL1.get(),
        mair: MAIR_EL1.get(),
        amair: AMAIR_EL1.get(),
        vbar: VBAR_EL1.get(),
        contextidr: CONTEXTIDR_EL1.get(),
        tpidr_el0: TPIDR_EL0.get(),
        tpidrro_el0: TPIDRRO_EL0.get(),
        tpidr_el1: TPIDR_EL1.get(),
        sp_el0: SP_EL0.get(),
        sp_el1: SP_EL1.get(),
        elr_el1: ELR_EL1.get(),
        spsr_el1: SPSR_EL1.get(),
        esr_el1: ESR_EL1.get(),
        far_el1: FAR_EL1.get(),
        par_el1: PAR_EL1.get(),
        cpacr: CPACR_EL1.get(),
        cntkctl: CNTKCTL_EL1.get(),
        cntv_ctl: CNTV_CTL_EL0.get(),
        cntv_cval: CNTV_CVAL_EL0.get(),
        afsr0: AFSR0_EL1.get(),
        afsr1: AFSR1_EL1.get(),
        csselr: CSSELR_EL1.get(),
        mdscr: MDSCR_EL1.get(),
    }
}

/// Set the guest's virtual counter offset (CNTVOFF_EL2): what it reads is
/// the physical count minus `offset`, so a restored guest's clock goes on
/// from where it was.
pub fn set_counter_offset(offset: u64) {
    CNTVOFF_EL2.set(offset);
    barrier::isb(barrier::SY);
}

/// Turn the EL1 virtual timer off (a guest left this CPU): its interrupt
/// would otherwise keep waking the idle CPU. The virtual timer belongs to
/// whichever guest runs here; none does now, and the next one loads its
/// own timer state.
pub fn disable_virtual_timer() {
    CNTV_CTL_EL0.set(0);
    barrier::isb(barrier::SY);
}

/// Deliver `exception` to the guest that just exited into `ctx`: its EL1
/// syndrome registers are written (they are live on this CPU, see the
/// module docs) and it resumes at its vector (`vm::inject` computes all of
/// it). `far`: the faulting address, if valid; `il32`: ESR_EL2.IL.
pub fn inject(
    ctx: &mut GuestContext,
    exception: crate::hw::inject::GuestException,
    far: Option<u64>,
    il32: bool,
) {
    let vbar = VBAR_EL1.get();
    // PSTATE.PAN is set on entry to EL1 when the CPU has PAN
    // (ID_AA64MMFR1_EL1.PAN) and SCTLR_EL1.SPAN is clear.
    let set_pan = ID_AA64MMFR1_EL1.read(ID_AA64MMFR1_EL1::PAN) != 0
        && !SCTLR_EL1_PAN::SPAN.is_set(SCTLR_EL1.get());
    let trapped = crate::hw::inject::Trapped {
        pstate: ctx.spsr,
        pc: ctx.elr,
        far,
        il32,
        vbar,
        set_pan,
    };
    let regs = crate::hw::inject::exception(exception, &trapped);
    // The EL1 exception registers belong to the guest that runs on this
    // CPU; writing them is what taking the exception would have done.
    ESR_EL1.set(regs.esr_el1);
    ELR_EL1.set(regs.elr_el1);
    SPSR_EL1.set(regs.spsr_el1);
    if let Some(far) = regs.far_el1 {
        FAR_EL1.set(far);
    }
    ctx.elr = regs.pc;
    ctx.spsr = regs.pstate;
}
