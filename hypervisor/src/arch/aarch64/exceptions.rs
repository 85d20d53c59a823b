//! EL2 exception vectors and the register frame they save.
//!
//! Every vector saves the full general-purpose register file, ELR_EL2,
//! SPSR_EL2, ESR_EL2 and FAR_EL2 on the current stack and calls
//! [`handle_exception`]. Nothing at EL2 itself is expected to take an
//! exception, so every such exception is reported with a register dump and
//! the CPU is parked. Exceptions from a guest (lower EL, AArch64) take the
//! `guest_exit` path in `vcpu.rs` instead.

use core::arch::global_asm;
use core::fmt;

/// The frame the vectors push, in this order; `x[31]` is the stack pointer at
/// the time of the exception.
#[repr(C)]
pub struct ExceptionFrame {
    pub x: [u64; 31],
    pub sp: u64,
    pub elr: u64,
    pub spsr: u64,
    pub esr: u64,
    pub far: u64,
}

/// Which of the 16 vectors was taken: `source * 4 + kind`.
#[derive(Clone, Copy)]
pub struct VectorKind(pub u64);

impl fmt::Display for VectorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = ["synchronous", "IRQ", "FIQ", "SError"][(self.0 & 3) as usize];
        let source = [
            "EL2 with SP_EL0",
            "EL2 with SP_EL2",
            "a lower EL in AArch64",
            "a lower EL in AArch32",
        ][(self.0 >> 2 & 3) as usize];
        write!(f, "{kind} from {source}")
    }
}

// Stays in assembly: the vectors save and restore every register before
// and after any Rust code runs, with no stack frame set up for them.
global_asm!(
    r#"
.equ FRAME_SIZE, 0x120

.macro VECTOR kind
    .balign 0x80
    sub     sp, sp, #FRAME_SIZE
    stp     x0, x1, [sp, #0]
    mov     x1, #\kind
    b       exception_common
.endm

/* Exceptions from a guest (a lower EL in AArch64) leave the guest: see
   vcpu.rs. */
.macro GUEST_VECTOR kind
    .balign 0x80
    stp     x0, x1, [sp, #-16]!
    mov     x1, #\kind
    b       guest_exit
.endm

/* An IRQ from a guest: the EL2 instruction counter goes into the context
   (enter_guest pushed it just above) first. The guest may have slept in
   WFI since it was entered, and QEMU's -icount PMU counts that sleep as
   EL2 instructions: the exit's cost starts here (see run.rs). Read only
   where the PMU counts instructions (pmu::COUNTING; 0 stored otherwise):
   under QEMU without -icount it does not, and a PMU register read takes
   QEMU's global lock. */
.macro GUEST_IRQ_VECTOR kind
    .balign 0x80
    stp     x0, x1, [sp, #-16]!
    ldr     x0, [sp, #16]
    adrp    x1, {pmu_counting}
    ldrb    w1, [x1, :lo12:{pmu_counting}]
    cbz     w1, 1f
    mrs     x1, PMEVCNTR0_EL0
1:
    str     x1, [x0, #{off_irq_instructions}]
    mov     x1, #\kind
    b       guest_exit
.endm

.section .text.vectors, "ax"
.balign 0x800
.global exception_vectors
exception_vectors:
    VECTOR 0
    VECTOR 1
    VECTOR 2
    VECTOR 3
    VECTOR 4
    VECTOR 5
    VECTOR 6
    VECTOR 7
    GUEST_VECTOR 8
    GUEST_IRQ_VECTOR 9
    GUEST_VECTOR 10
    GUEST_VECTOR 11
    VECTOR 12
    VECTOR 13
    VECTOR 14
    VECTOR 15

exception_common:
    stp     x2, x3, [sp, #16]
    stp     x4, x5, [sp, #32]
    stp     x6, x7, [sp, #48]
    stp     x8, x9, [sp, #64]
    stp     x10, x11, [sp, #80]
    stp     x12, x13, [sp, #96]
    stp     x14, x15, [sp, #112]
    stp     x16, x17, [sp, #128]
    stp     x18, x19, [sp, #144]
    stp     x20, x21, [sp, #160]
    stp     x22, x23, [sp, #176]
    stp     x24, x25, [sp, #192]
    stp     x26, x27, [sp, #208]
    stp     x28, x29, [sp, #224]
    add     x2, sp, #FRAME_SIZE
    stp     x30, x2, [sp, #240]
    mrs     x2, ELR_EL2
    mrs     x3, SPSR_EL2
    stp     x2, x3, [sp, #256]
    mrs     x2, ESR_EL2
    mrs     x3, FAR_EL2
    stp     x2, x3, [sp, #272]
    mov     x0, sp
    bl      handle_exception
    ldp     x2, x3, [sp, #256]
    msr     ELR_EL2, x2
    msr     SPSR_EL2, x3
    ldp     x2, x3, [sp, #16]
    ldp     x4, x5, [sp, #32]
    ldp     x6, x7, [sp, #48]
    ldp     x8, x9, [sp, #64]
    ldp     x10, x11, [sp, #80]
    ldp     x12, x13, [sp, #96]
    ldp     x14, x15, [sp, #112]
    ldp     x16, x17, [sp, #128]
    ldp     x18, x19, [sp, #144]
    ldp     x20, x21, [sp, #160]
    ldp     x22, x23, [sp, #176]
    ldp     x24, x25, [sp, #192]
    ldp     x26, x27, [sp, #208]
    ldp     x28, x29, [sp, #224]
    ldr     x30, [sp, #240]
    ldp     x0, x1, [sp, #0]
    add     sp, sp, #FRAME_SIZE
    eret
"#,
    off_irq_instructions = const super::vcpu::OFF_IRQ_INSTRUCTIONS,
    pmu_counting = sym super::pmu::COUNTING,
);

const _: () = assert!(core::mem::size_of::<ExceptionFrame>() == 0x120);

// The vectors call `handle_exception(frame, kind)`: it is `crate::crash`'s
// (what to do with an unexpected exception is not the arch layer's call).

/// A short name for an exception class (ESR_EL2.EC).
pub fn exception_class_name(esr: u64) -> &'static str {
    match (esr >> 26) & 0x3f {
        0x00 => "unknown reason",
        0x01 => "WFI/WFE",
        0x07 => "FP/SIMD access",
        0x15 => "SVC",
        0x16 => "HVC",
        0x17 => "SMC",
        0x18 => "system register access",
        0x20 => "instruction abort, lower EL",
        0x21 => "instruction abort, same EL",
        0x22 => "PC alignment fault",
        0x24 => "data abort, lower EL",
        0x25 => "data abort, same EL",
        0x26 => "SP alignment fault",
        0x2f => "SError",
        0x3c => "BRK",
        _ => "other",
    }
}
