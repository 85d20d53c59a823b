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
//! Points nest: a board service run from a vCPU's loop (the memory
//! manager's tick, the shell's look) arms its own inside the vCPU's, so a
//! failure there comes back to the service, not to the VM. A jump goes to
//! the innermost point and disarms it, so a failure while a failure is
//! handled goes to the point outside, never around the same loop again.

use core::arch::global_asm;
use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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

/// Recovery points a CPU can have armed at once: a vCPU's, a board
/// service's inside it (the memory manager's tick, the shell's look), and a
/// VM's input handled by that service inside that.
pub const MAX_DEPTH: usize = 4;

/// Per-CPU stacks of recovery points; each is written and read only by its
/// CPU.
struct Points([[UnsafeCell<RecoveryPoint>; MAX_DEPTH]; MAX_CPUS]);
// SAFETY: row `i` is touched only by CPU `i` (see `run_recoverable_as`/`jump`).
unsafe impl Sync for Points {}

static POINTS: Points = Points(
    [const {
        [const {
            UnsafeCell::new(RecoveryPoint {
                x19_to_lr: [0; 12],
                sp: 0,
                d8_to_d15: [0; 8],
            })
        }; MAX_DEPTH]
    }; MAX_CPUS],
);
/// How many of each CPU's points are armed (the innermost is `DEPTH - 1`).
static DEPTH: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(0) }; MAX_CPUS];
/// What each armed point stands for: a value its arming code chose (the
/// failure domain, see `run`), read back by [`current_tag`].
static TAGS: [[AtomicU64; MAX_DEPTH]; MAX_CPUS] =
    [const { [const { AtomicU64::new(0) }; MAX_DEPTH] }; MAX_CPUS];

/// `run_recoverable`'s closure did not return: a failure jumped back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failed;

/// Call `f` with a recovery point armed on this CPU, tagged 0: `Ok` with
/// its result, or `Err(Failed)` if a failure inside it called [`jump`].
pub fn run_recoverable<F: FnOnce() -> R, R>(f: F) -> Result<R, Failed> {
    run_recoverable_as(0, f)
}

/// Call `f` with a new innermost recovery point armed on this CPU, tagged
/// `tag` ([`current_tag`] while it is innermost): `Ok` with its result, or
/// `Err(Failed)` if a failure inside it (and inside no point armed within
/// it) called [`jump`]. Points nest up to [`MAX_DEPTH`]; beyond that `f`
/// runs under the innermost point there is.
pub fn run_recoverable_as<F: FnOnce() -> R, R>(tag: u64, f: F) -> Result<R, Failed> {
    let cpu = cpu_index();
    let depth = DEPTH[cpu].load(Ordering::Acquire);
    if depth >= MAX_DEPTH {
        return Ok(f());
    }
    let mut call = (Some(f), None::<R>);
    extern "C" fn trampoline<F: FnOnce() -> R, R>(arg: *mut core::ffi::c_void) {
        // SAFETY: `arg` is the `call` tuple of `run_recoverable_as`, alive
        // for the whole of `recovery_try`, and nothing else touches it
        // meanwhile.
        let call = unsafe { &mut *(arg as *mut (Option<F>, Option<R>)) };
        if let Some(f) = call.0.take() {
            call.1 = Some(f());
        }
    }
    let point = &POINTS.0[cpu][depth];
    TAGS[cpu][depth].store(tag, Ordering::Relaxed);
    DEPTH[cpu].store(depth + 1, Ordering::Release);
    // SAFETY: `point` is this CPU's slot at this depth, unused by any
    // point armed outside us; `trampoline` matches the call tuple's type;
    // `recovery_try` follows the C ABI and returns normally (0) or through
    // `recovery_jump` (1) with every callee-saved register and SP
    // restored, so this frame is intact either way. Frames abandoned by a
    // jump are those of `f`, which the jumping code accounts for.
    let jumped = unsafe {
        recovery_try(
            point.get(),
            trampoline::<F, R>,
            core::ptr::addr_of_mut!(call).cast(),
        )
    };
    DEPTH[cpu].store(depth, Ordering::Release);
    match (jumped, call.1) {
        (0, Some(result)) => Ok(result),
        _ => Err(Failed),
    }
}

/// Call `f` with every recovery point of this CPU disarmed, then arm them
/// again: a failure inside is nobody's to contain (the crash report and a
/// parked CPU, as at boot). For the shell's `debug panic` and `debug
/// fault`, which show that report.
pub fn unarmed<R>(f: impl FnOnce() -> R) -> R {
    let cpu = cpu_index();
    let was = DEPTH[cpu].swap(0, Ordering::AcqRel);
    let result = f();
    // The points are still valid: their frames are below us.
    DEPTH[cpu].store(was, Ordering::Release);
    result
}

/// Whether this CPU has a recovery point armed.
pub fn armed() -> bool {
    DEPTH
        .get(cpu_index())
        .is_some_and(|d| d.load(Ordering::Acquire) > 0)
}

/// The tag of this CPU's innermost armed point, if any.
pub fn current_tag() -> Option<u64> {
    let cpu = cpu_index();
    let depth = DEPTH.get(cpu)?.load(Ordering::Acquire);
    let top = depth.checked_sub(1)?;
    Some(TAGS[cpu][top].load(Ordering::Relaxed))
}

/// Disarm this CPU's innermost recovery point and go back to it: its
/// `run_recoverable_as` returns `Err(Failed)`; the points outside it stay
/// armed. Returns (doing nothing) if none is armed.
///
/// # Safety
///
/// The frames between the recovery point and here are abandoned without
/// running their destructors: the caller must have released what they held
/// that others need (locks) and must be running on this CPU's own stack,
/// below the recovery point (a panic or an EL2 exception handler is).
pub unsafe fn jump() {
    let cpu = cpu_index();
    let Some(depth) = DEPTH.get(cpu) else { return };
    let Some(top) = depth.load(Ordering::Acquire).checked_sub(1) else {
        return;
    };
    depth.store(top, Ordering::Release);
    // SAFETY: the point was armed by `run_recoverable_as` on this CPU,
    // whose frame is still live (it disarms before returning); the caller
    // vouches for the abandoned frames.
    unsafe { recovery_jump(POINTS.0[cpu][top].get()) }
}
