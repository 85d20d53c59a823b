//! Crash reports: an unexpected exception or a panic prints what happened,
//! where, and the registers, on the console (even if another CPU holds the
//! console lock), then parks the CPU. The test harness looks for these lines.
//!
//! On a CPU running a vCPU (a recovery point armed, see
//! `arch::aarch64::recovery`), the failure is contained instead: one
//! `tidal: [vm] hypervisor failure in this VM's path: …` line, the locks
//! that CPU held are released, and only that VM is stopped
//! (`run::contain_failure`).

use core::fmt;

use crate::arch::aarch64::exceptions::{exception_class_name, ExceptionFrame, VectorKind};
use crate::arch::aarch64::{cpu_index, park, smp};

macro_rules! crash_print {
    ($($arg:tt)*) => { crate::console::write_fmt_forced(format_args!($($arg)*)) };
}

/// Where the image was loaded, to turn addresses into image offsets (the ELF
/// is linked at 0, so an image offset is an address in the ELF).
pub fn image_base() -> u64 {
    extern "C" {
        static __image_start: u8;
    }
    core::ptr::addr_of!(__image_start) as u64
}

fn image_offset(addr: u64) -> Option<u64> {
    extern "C" {
        static __image_end: u8;
    }
    let end = core::ptr::addr_of!(__image_end) as u64;
    (image_base()..end)
        .contains(&addr)
        .then(|| addr - image_base())
}

struct Offset(u64);

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match image_offset(self.0) {
            Some(off) => write!(f, " (image offset {off:#x})"),
            None => Ok(()),
        }
    }
}

/// Called by the EL2 vectors (`arch::aarch64::exceptions`) with the saved frame.
#[no_mangle]
extern "C" fn handle_exception(frame: &mut ExceptionFrame, kind: u64) {
    exception(frame, VectorKind(kind));
}

pub fn exception(frame: &ExceptionFrame, kind: VectorKind) -> ! {
    let cpu = cpu_index();
    // On a CPU running a vCPU, this ends that VM only (returns otherwise).
    crate::run::contain_failure(format_args!(
        "{kind} exception, ESR_EL2 {:#010x} ({}), FAR_EL2 {:#x}, at ELR_EL2 {:#x}{}",
        frame.esr,
        exception_class_name(frame.esr),
        frame.far,
        frame.elr,
        Offset(frame.elr)
    ));
    crash_print!("\n*** EXCEPTION on CPU {cpu}: {kind}\n");
    crash_print!(
        "ESR_EL2 {:#010x} ({}), FAR_EL2 {:#x}\n",
        frame.esr,
        exception_class_name(frame.esr),
        frame.far
    );
    crash_print!(
        "ELR_EL2 {:#x}{}, SPSR_EL2 {:#x}\n",
        frame.elr,
        Offset(frame.elr),
        frame.spsr
    );
    for row in 0..8 {
        for col in 0..4 {
            let r = row * 4 + col;
            if r < 31 {
                crash_print!(" x{:<2} {:#018x}", r, frame.x[r]);
            } else {
                crash_print!("  sp {:#018x}", frame.sp);
            }
        }
        crash_print!("\n");
    }
    crash_print!("lr (x30) {:#x}{}\n", frame.x[30], Offset(frame.x[30]));
    stop_cpu(cpu)
}

pub fn panic(info: &core::panic::PanicInfo) -> ! {
    let cpu = cpu_index();
    // On a CPU running a vCPU, this ends that VM only (returns otherwise).
    match info.location() {
        Some(l) => crate::run::contain_failure(format_args!(
            "{} at {}:{}",
            info.message(),
            l.file(),
            l.line()
        )),
        None => crate::run::contain_failure(format_args!("{}", info.message())),
    }
    match info.location() {
        Some(l) => crash_print!(
            "\n*** PANIC on CPU {cpu} at {}:{}:{}: {}\n",
            l.file(),
            l.line(),
            l.column(),
            info.message()
        ),
        None => crash_print!("\n*** PANIC on CPU {cpu}: {}\n", info.message()),
    }
    stop_cpu(cpu)
}

fn stop_cpu(cpu: usize) -> ! {
    smp::set_state(cpu, smp::CpuState::Parked);
    crash_print!("CPU {cpu} parked.\n");
    park()
}
