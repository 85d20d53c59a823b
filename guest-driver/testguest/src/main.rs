//! The Tidal test guest: a bare-metal EL1 kernel that drives the balloon through
//! `guest-driver`, checks that memory it still owns is never disturbed, and can
//! misbehave on purpose (`wild`, `hostile`, `hostile-stats`). See
//! `guest-driver/README.md`.
//!
//! Built for `aarch64-unknown-none` it is an arm64 Image linked at 0x4020_0000
//! (linker/guest.ld). On the host its `main` is a stub, so that
//! `cargo test --workspace` builds.
#![cfg_attr(target_os = "none", no_std, no_main)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(target_os = "none")]
#[macro_use]
mod console;

#[cfg(target_os = "none")]
mod arch;
#[cfg(target_os = "none")]
mod board;
#[cfg(target_os = "none")]
mod faults;
#[cfg(target_os = "none")]
mod features;
#[cfg(target_os = "none")]
mod gic;
#[cfg(target_os = "none")]
mod hal;
#[cfg(target_os = "none")]
mod hostile;
#[cfg(target_os = "none")]
mod hostile_stats;
#[cfg(target_os = "none")]
mod pool;
#[cfg(target_os = "none")]
mod run;
#[cfg(target_os = "none")]
mod wait;

#[cfg(not(target_os = "none"))]
fn main() {}
