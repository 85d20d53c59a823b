//! Recovery points: a way back to a known place on this CPU's stack after a
//! hypervisor failure (a panic, an EL2 exception) in a VM's path.
//!
//! The crate is `panic = "abort"`, `no_std`, without unwinding, so a failure
//! cannot return through the frames that failed. [`run_recoverable`] saves
//! the callee-saved registers (x19-x29, the link register, SP and d8-d15)
//! and calls its closure; [`jump`] restores them, which returns from
//! `run_recoverable` a second time, now with `Err(Failed)`. The frames in
//! between are abandoned: their destructors never run. What they held must
//! be released by whoever jumps: the locks (tracked per CPU in
//! `crate::held`) and the VM's resources (the VM is stopped and its pages
//! freed as for any stop). Heap memory owned by abandoned frames is lost;
//! the paths that jump own no heap memory of note (nothing there allocates
//! in proportion to a guest's size).
//!
//! One recovery point per CPU; a jump disarms it, so a failure while the
//! failure is handled is never recovered again (no second recovery loop).

use core::arch::global_asm;
use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, Ordering};

use super::{cpu_index, MAX_CPUS};

/// Callee-saved state of the AAPCS64: x19-x28, x29 (FP), x30 (LR), SP,
/// then d8-d15 (the target has FP/SIMD enabled, so they may hold values).
#[repr(C)]
struct RecoveryPoint {
    x19_to_lr: [u64; 12],
    sp: u64,
    d8_to_d15: [u64; 8],
}

const _: () = assert!(core::mem::size_of::<RecoveryPoint>() == 168);

// Stays in assembly: saving and resuming a recovery point swaps the stack
// pointer and callee-saved registers, which compiled code cannot do.
global_asm!(
    r#"
.section .text
/* u64 recovery_try(RecoveryPoint *point, void (*f)(void *), void *arg):
   save the callee-saved state in *point, call f(arg), return 0. A later
   recovery_jump(point) returns from here again with 1. */
.global recovery_try
recovery_try:
    stp     x19, x20, [x0, #0]
    stp     x21, x22, [x0, #16]
    stp     x23, x24, [x0, #32]
    stp     x25, x26, [x0, #48]
    stp     x27, x28, [x0, #64]
    stp     x29, x30, [x0, #80]
    mov     x9, sp
    str     x9, [x0, #96]
    stp     d8, d9, [x0, #104]
    stp     d10, d11, [x0, #120]
    stp     d12, d13, [x0, #136]
    stp     d14, d15, [x0, #152]
    stp     x29, x30, [sp, #-16]!
    mov     x29, sp
    mov     x9, x1
    mov     x0, x2
    blr     x9
    ldp     x29, x30, [sp], #16
    mov     x0, #0
    ret

/* ! recovery_jump(const RecoveryPoint *point): back into recovery_try's
   caller, which sees it return 1. */
.global recovery_jump
recovery_jump:
    ldp     x19, x20, [x0, #0]
    ldp     x21, x22, [x0, #16]
    ldp     x23, x24, [x0, #32]
    ldp     x25, x26, [x0, #48]
    ldp     x27, x28, [x0, #64]
    ldp     x29, x30, [x0, #80]
    ldr     x9, [x0, #96]
    mov     sp, x9
    ldp     d8, d9, [x0, #104]
    ldp     d10, d11, [x0, #120]
    ldp     d12, d13, [x0, #136]
    ldp     d14, d15, [x0, #152]
    mov     x0, #1
    ret
"#
);

extern "C" {
    fn recovery_try(
        point: *mut RecoveryPoint,
        f: extern "C" fn(*mut core::ffi::c_void),
        arg: *mut core::ffi::c_void,
    ) -> u64;
    fn recovery_jump(point: *const RecoveryPoint) -> !;
}

/// Per-CPU recovery points; each is written and read only by its CPU.
struct Points([UnsafeCell<RecoveryPoint>; MAX_CPUS]);
// SAFETY: slot `i` is touched only by CPU `i` (see `run_recoverable`/`jump`).
unsafe impl Sync for Points {}

static POINTS: Points = Points(
    [const {
        UnsafeCell::new(RecoveryPoint {
            x19_to_lr: [0; 12],
            sp: 0,
            d8_to_d15: [0; 8],
        })
    }; MAX_CPUS],
);
static ARMED: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// `run_recoverable`'s closure did not return: a failure jumped back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failed;

/// Call `f` with a recovery point armed on this CPU: `Ok` with its result,
/// or `Err(Failed)` if a failure inside it called [`jump`]. Not nested: the
/// point is disarmed when `f` returns or a failure jumps.
pub fn run_recoverable<F: FnOnce() -> R, R>(f: F) -> Result<R, Failed> {
    let cpu = cpu_index();
    let mut call = (Some(f), None::<R>);
    extern "C" fn trampoline<F: FnOnce() -> R, R>(arg: *mut core::ffi::c_void) {
        // SAFETY: `arg` is the `call` tuple of `run_recoverable`, alive for
        // the whole of `recovery_try`, and nothing else touches it meanwhile.
        let call = unsafe { &mut *(arg as *mut (Option<F>, Option<R>)) };
        if let Some(f) = call.0.take() {
            call.1 = Some(f());
        }
    }
    let point = &POINTS.0[cpu];
    ARMED[cpu].store(true, Ordering::Release);
    // SAFETY: `point` is this CPU's slot; `trampoline` matches the call
    // tuple's type; `recovery_try` follows the C ABI and returns normally
    // (0) or through `recovery_jump` (1) with every callee-saved register
    // and SP restored, so this frame is intact either way. Frames abandoned
    // by a jump are those of `f`, which the jumping code accounts for.
    let jumped = unsafe {
        recovery_try(
            point.get(),
            trampoline::<F, R>,
            core::ptr::addr_of_mut!(call).cast(),
        )
    };
    ARMED[cpu].store(false, Ordering::Release);
    match (jumped, call.1) {
        (0, Some(result)) => Ok(result),
        _ => Err(Failed),
    }
}

/// Call `f` with this CPU's recovery point disarmed, then arm it again: the
/// shell's work on the CPU it shares with a vCPU. A failure there is the
/// hypervisor's, not that VM's, and must not end the VM as if it were.
pub fn unarmed<R>(f: impl FnOnce() -> R) -> R {
    let cpu = cpu_index();
    let was = ARMED[cpu].swap(false, Ordering::AcqRel);
    let result = f();
    // The point is still valid: `run_recoverable`'s frame is below us.
    ARMED[cpu].store(was, Ordering::Release);
    result
}

/// Whether this CPU has a recovery point armed.
pub fn armed() -> bool {
    ARMED
        .get(cpu_index())
        .is_some_and(|a| a.load(Ordering::Acquire))
}

/// Disarm this CPU's recovery point and go back to it: `run_recoverable`
/// returns `Err(Failed)`. Returns (doing nothing) if none is armed.
///
/// # Safety
///
/// The frames between the recovery point and here are abandoned without
/// running their destructors: the caller must have released what they held
/// that others need (locks) and must be running on this CPU's own stack,
/// below the recovery point (a panic or an EL2 exception handler is).
pub unsafe fn jump() {
    let cpu = cpu_index();
    let Some(armed) = ARMED.get(cpu) else { return };
    if !armed.swap(false, Ordering::AcqRel) {
        return;
    }
    // SAFETY: the point was armed by `run_recoverable` on this CPU, whose
    // frame is still live (it disarms before returning); the caller vouches
    // for the abandoned frames.
    unsafe { recovery_jump(POINTS.0[cpu].get()) }
}
