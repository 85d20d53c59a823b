//! What the VM core needs from the physical CPU it runs on, as one narrow
//! trait ([`PhysCpu`]); the guest registers a vCPU exit hands over
//! ([`GuestContext`]) are defined in `crate::hw::context`.
//!
//! Everything else under `vm/` is plain Rust over plain data: the target
//! implements [`PhysCpu`] with the GIC's virtual interface, the generic
//! timer, the PMU and the EL2 identity map (`crate::run`); host tests and the
//! fuzz targets implement it with a fake that records what the VM core
//! asked for (`vm::testing::FakeCpu`).

use super::memory::HostMemory;
use crate::hw::inject::GuestException;
use crate::vgic::{LrState, PendingIrq};

pub use crate::hw::context::{GuestContext, SPSR_EL1H_MASKED};

/// The physical CPU a vCPU's exits are handled on: the only things the VM
/// core cannot do in plain Rust.
pub trait PhysCpu {
    /// Where guest frames and stage-2 tables come from.
    type Memory: HostMemory;
    fn memory(&mut self) -> &mut Self::Memory;

    /// This CPU's index.
    fn index(&self) -> usize;
    /// Microseconds since boot.
    fn uptime_us(&self) -> u64;
    /// The system counter and its frequency (ticks per second).
    fn counter(&self) -> (u64, u64);
    /// EL2 instructions retired so far (wrapping), when the PMU counts them.
    fn instructions(&self) -> u32;
    fn counts_instructions(&self) -> bool;

    /// Whether physical CPU `cpu` is online and free to run vCPUs.
    fn cpu_online(&self, cpu: usize) -> bool;
    /// Make CPU `cpu` leave its guest (a kick SGI).
    fn kick(&mut self, cpu: usize);
    /// Give vCPU `vcpu` of VM `vm` to physical CPU `cpu` and wake it.
    fn hand_vcpu(&mut self, cpu: usize, vm: usize, vcpu: usize);
    /// The vCPU this CPU ran has left its run loop (what a failure on this
    /// CPU must clean up changes).
    fn vcpu_left(&mut self);

    /// The GIC's virtual CPU interface on this CPU.
    fn list_registers(&self) -> usize;
    fn read_lr(&self, i: usize) -> LrState;
    fn write_lr(&mut self, i: usize, irq: &PendingIrq, hw: Option<u32>);
    fn clear_lr(&mut self, i: usize);
    /// Enable the virtual interface, with an underflow maintenance
    /// interrupt when more is pending than the list registers hold.
    fn enable_virtual_interface(&mut self, underflow: bool);
    /// Clear every list register and the active priorities.
    fn reset_virtual_interface(&mut self);
    /// Trap the guest's WFI on this CPU from its next entry, or let it
    /// sleep in WFI itself.
    fn trap_wfi(&mut self, trap: bool);
    /// Whether the pool wants free frames zeroed ahead of time, which this
    /// CPU does while its vCPU idles (so its WFI traps meanwhile).
    fn zeroing_wanted(&self) -> bool {
        false
    }
    /// Physical interrupts: acknowledge the highest pending one (its INTID,
    /// [`SPURIOUS`](crate::vgic::intid::SPURIOUS) if none, and the raw IAR),
    /// drop its priority, deactivate it.
    fn acknowledge(&mut self) -> (u32, u32);
    fn end_of_interrupt(&mut self, iar: u32);
    fn deactivate(&mut self, iar: u32);

    /// Take `exception` to the guest's EL1, as the hardware would have
    /// (the guest's EL1 registers are live on this CPU).
    fn inject(
        &mut self,
        ctx: &mut GuestContext,
        exception: GuestException,
        far: Option<u64>,
        il32: bool,
    );
    /// Invalidate every instruction cache to the point of unification
    /// (after writing code into a guest's RAM).
    fn invalidate_icache(&mut self);
}
