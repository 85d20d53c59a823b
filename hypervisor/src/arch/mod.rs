//! Architecture support. Only AArch64 at EL2 exists; everything in here
//! touches system registers, exception levels or MMIO.
pub mod aarch64;
