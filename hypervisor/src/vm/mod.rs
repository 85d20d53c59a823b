//! Virtual machines: what each guest is given and how it is described to it.
//!
//! The VM core, in the order an exit meets it:
//! - [`exit`]: why a vCPU left its guest, decoded from the exception syndrome.
//! - [`handle`]: what one exit does to its VM, and what the vCPU loop does next.
//! - [`exit_profile`]: per kind of exit (device, stage-2 fault, sysreg, HVC,
//!   WFI, interrupt source...) the count and EL2 instructions (`info exits`).
//! - [`bus`]: which device an address falls in, and the register access given to it.
//! - [`balloon_ctl`]: the host's side of the balloon (targets, statistics, hints, costs).
//! - [`memory`]: a VM's RAM, backed frame by frame through its stage-2 tables.
//! - [`irq`]: interrupt lines, kicks, physical interrupts and the list registers.
//! - [`psci`]: PSCI for guests.
//! - [`lifecycle`]: start, enter, leave and stop.
//! - [`state`]: what the hypervisor keeps per VM; [`cpu`]: the [`cpu::PhysCpu`]
//!   trait, all the core needs from the physical CPU; [`outbox`]: console text
//!   made under a VM's lock, printed after it.
//!
//! The VM table, its locks and the vCPU loop on the target are
//! `crate::run`, which drives this core through [`cpu::PhysCpu`].
//!
//! Beside it:
//! - [`check`]: the `check` command's system-wide memory invariants.
//! - [`controls`]: the EL2 control register values a guest runs under.
//! - [`fault`]: bad guest accesses, the per-VM policy for them and their counters.
//! - [`inject`]: the exception a guest gets for a bad access, as register values.
//! - [`ratelimit`]: the token bucket for console lines a guest can trigger.
//! - [`fdt`]: the device tree of the virtual board every guest sees
//!   (`docs/GUEST-BOARD.md`).
//!
//! Plain Rust over plain data, tested on the host.

pub mod balloon_ctl;
pub mod balloon_info;
pub mod bus;
pub mod check;
pub mod console_line;
#[cfg(test)]
mod core_tests;
pub mod cpu;
pub mod device_memory;
pub mod devices;
pub mod exit;
pub mod exit_profile;
pub mod fast;
pub mod fault;
pub mod fdt;
pub mod handle;
pub mod irq;
pub mod lifecycle;
pub mod manage;
pub mod memory;
pub mod outbox;
pub mod pause;
pub mod psci;
pub mod ratelimit;
pub mod snapshot;
pub mod state;
pub mod uart_mirror;
pub mod vcpu_loop;
pub mod vcpu_state;
pub mod vcpus;

pub use crate::hw::{controls, inject, syndrome};
#[cfg(any(test, feature = "testing"))]
pub mod testing;
