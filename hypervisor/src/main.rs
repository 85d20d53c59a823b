//! The hypervisor image. Everything lives in the library; this binary only
//! links it (its entry point is `_start` in `arch::aarch64::entry`).
#![cfg_attr(target_os = "none", no_std, no_main)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(target_os = "none")]
use hypervisor as _;

#[cfg(not(target_os = "none"))]
fn main() {
    eprintln!(
        "the hypervisor runs on aarch64-unknown-none only: build it with `cargo xtask build`"
    );
    std::process::exit(2);
}
