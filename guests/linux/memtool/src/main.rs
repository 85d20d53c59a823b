//! `tidal-mem`: memory workloads the Linux test guest runs through its agent
//! (guests/linux/README.md). xtask builds it as a static
//! aarch64-unknown-linux-musl binary linked with rust-lld and puts it in the
//! initramfs as /bin/tidal-mem. Every mapping is anonymous and private, and
//! every page is written, so the kernel really allocates (and, on munmap,
//! really frees) it.
//!
//! - `pagefault <MiB> <seconds>`: like will-it-scale's page_fault1: map
//!   `<MiB>`, write one byte per page, unmap, over and over for `<seconds>`;
//!   prints the pages faulted in per second.
//! - `hog <MiB> [hold-seconds]`: map and write `<MiB>`, say so, keep it for
//!   hold-seconds (default 0), exit. An OOM kill shows as rc 137.
//! - `alloc-free <MiB>`: map and write `<MiB>`, then unmap it: that much
//!   memory goes back to the guest's free lists at once.
//! - `touch-loop <MiB> <seconds>`: keep rewriting `<MiB>` for `<seconds>`,
//!   printing a progress line with the monotonic time about every 100 ms.

use std::process::ExitCode;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

mod args;

use args::{parse, Workload};

/// An anonymous private mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Mapping, String> {
        // SAFETY: an anonymous private mapping at an address of the
        // kernel's choice touches no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "mmap of {} MiB failed: {}",
                len / MIB,
                std::io::Error::last_os_error()
            ));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Write `value` into one byte of every page; returns the pages touched.
    fn touch(&mut self, value: u8) -> usize {
        let pages = self.len / PAGE;
        for page in 0..pages {
            // SAFETY: page * PAGE < len, inside the mapping; volatile so
            // the write (and the fault it causes) is not optimised away.
            unsafe { self.ptr.add(page * PAGE).write_volatile(value) };
        }
        pages
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn uptime() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn run(workload: Workload) -> Result<(), String> {
    match workload {
        Workload::PageFault { mib, seconds } => {
            let start = Instant::now();
            let (mut iterations, mut pages) = (0u64, 0u64);
            while start.elapsed() < Duration::from_secs(seconds) {
                let mut m = Mapping::new(mib * MIB)?;
                pages += m.touch(1) as u64;
                iterations += 1;
            }
            let ms = start.elapsed().as_millis().max(1) as u64;
            println!(
                "pagefault: {iterations} iterations, {pages} pages in {ms} ms: {} pages/s",
                pages * 1000 / ms
            );
        }
        Workload::Hog { mib, hold } => {
            let mut m = Mapping::new(mib * MIB)?;
            m.touch(0x5a);
            println!("hog: touched {mib} MiB");
            std::thread::sleep(Duration::from_secs(hold));
            drop(m);
            println!("hog: released {mib} MiB");
        }
        Workload::AllocFree { mib } => {
            let mut m = Mapping::new(mib * MIB)?;
            m.touch(0xa5);
            drop(m);
            println!("alloc-free: {mib} MiB touched and freed");
        }
        Workload::TouchLoop { mib, seconds } => {
            let mut m = Mapping::new(mib * MIB)?;
            let start = Instant::now();
            let mut last = Duration::ZERO;
            let mut rounds = 0u64;
            while start.elapsed() < Duration::from_secs(seconds) {
                m.touch(rounds as u8);
                rounds += 1;
                let now = start.elapsed();
                if now - last >= Duration::from_millis(100) {
                    last = now;
                    let t = uptime();
                    println!(
                        "touch-loop: t={}.{:03} rounds={rounds}",
                        t.as_secs(),
                        t.subsec_millis()
                    );
                }
            }
            println!("touch-loop: done, {rounds} rounds");
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workload = match parse(&args) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("tidal-mem: {e}\n{}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    match run(workload) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tidal-mem: {e}");
            ExitCode::FAILURE
        }
    }
}
