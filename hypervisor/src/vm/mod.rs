//! Virtual machines: what each guest is given and how it is described to it.
//!
//! - [`check`]: the `check` command's system-wide memory invariants.
//! - [`controls`]: the EL2 control register values a guest runs under.
//! - [`exit`]: why a vCPU left its guest, decoded from the exception syndrome.
//! - [`fault`]: bad guest accesses, the per-VM policy for them and their counters.
//! - [`inject`]: the exception a guest gets for a bad access, as register values.
//! - [`ratelimit`]: the token bucket for console lines a guest can trigger.
//! - [`fdt`]: the device tree of the virtual board every guest sees
//!   (`docs/GUEST-BOARD.md`).
//! - [`memory`]: a VM's RAM, backed frame by frame through its stage-2 tables.
//!
//! Plain Rust over plain data, tested on the host.

pub mod check;
pub mod console;
pub mod controls;
pub mod exit;
pub mod fault;
pub mod fdt;
#[cfg(target_os = "none")]
pub mod hog;
pub mod inject;
pub mod memory;
pub mod ratelimit;
#[cfg(target_os = "none")]
pub mod run;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
