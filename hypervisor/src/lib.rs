//! The Tidal hypervisor, an EL2 firmware for 64-bit Arm boards.
//!
//! The portable core (the address types of [`addr`], memory accounting,
//! page-table construction, the device models, the VM core over the
//! `vm::cpu::PhysCpu` trait, the shell's parsing and the reports it prints)
//! is plain Rust and is tested on the host
//! with `cargo test`; `arch`, the boot flow, the VM table and vCPU loop
//! (`run`) and failure containment exist only on the target
//! (`aarch64-unknown-none`).
#![cfg_attr(not(test), no_std)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod addr;
pub mod balloon;
pub mod bundle_crc;
pub mod console;
pub mod domain;
pub mod hw;
pub mod limits;
pub mod lock;
pub mod mm;
pub mod pl011;
pub mod register_access;
pub mod report;
pub mod savestate;
pub mod selftest;
pub mod size;
pub mod snapshot;
#[cfg(test)]
mod test_rng;

#[cfg(target_os = "none")]
pub mod arch;
#[cfg(target_os = "none")]
mod boot;
#[cfg(target_os = "none")]
pub mod crash;
#[cfg(target_os = "none")]
pub mod disk;
#[cfg(target_os = "none")]
pub mod dma;
#[cfg(target_os = "none")]
mod heap;
#[cfg(target_os = "none")]
pub mod held;
#[cfg(target_os = "none")]
pub mod hog;
#[cfg(target_os = "none")]
pub mod net;
#[cfg(target_os = "none")]
mod ontarget;
#[cfg(target_os = "none")]
pub mod run;
pub mod trace;
pub mod vgic;
pub mod virtio;
pub mod virtio_console;
pub mod vm;

#[cfg(target_os = "none")]
#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    crash::panic(info)
}
