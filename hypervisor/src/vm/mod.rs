//! Virtual machines: what each guest is given and how it is described to it.
//!
//! - [`exit`]: why a vCPU left its guest, decoded from the exception syndrome.
//! - [`fdt`]: the device tree of the virtual board every guest sees
//!   (`docs/GUEST-BOARD.md`).
//! - [`memory`]: a VM's RAM, backed frame by frame through its stage-2 tables.
//!
//! Plain Rust over plain data, tested on the host.

pub mod console;
pub mod exit;
pub mod fdt;
pub mod memory;
#[cfg(target_os = "none")]
pub mod run;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
