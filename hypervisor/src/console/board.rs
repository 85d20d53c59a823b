//! What the shell's commands act on ([`Board`]): the VMs, the frame
//! table, the memory manager, the board's services and its disk. The
//! target implements it over the hypervisor's globals (`crate::boot`);
//! the shell's host tests over a fake board.

extern crate alloc;

use alloc::string::String;

use crate::domain::{InjectInto, Service, REASON_BYTES};
use crate::limits::MAX_GUESTS;
use crate::mm::frames::FrameTable;
use crate::mm::manager::{ManagerStats, Policy, VmStats, Watermarks};
use crate::snapshot::store::Disk;
use crate::vm::cpu::PhysCpu;
use crate::vm::state::Vm;

/// What the shell's commands act on.
pub trait Board {
    type Cpu: PhysCpu;
    /// `f` on the VM called `name`, under its lock, with this CPU; `None`
    /// if there is none. What `f` leaves in the VM's outbox is printed
    /// once its lock is released.
    fn with_vm<R>(&mut self, name: &str, f: impl FnOnce(&mut Vm, &mut Self::Cpu) -> R)
        -> Option<R>;
    /// `f` on every VM, in table order, one lock at a time.
    fn for_each_vm(&mut self, f: impl FnMut(&mut Vm));
    /// `f` on the frame table, under its lock.
    fn with_frames<R>(&mut self, f: impl FnOnce(&FrameTable<'_>) -> R) -> R;
    /// What the memory manager shows, if it runs.
    fn manager(&mut self) -> Option<ManagerFacts>;
    /// Who sets the balloon targets (`mm policy`); false if no manager runs.
    fn set_policy(&mut self, policy: Policy) -> bool;
    /// Why a board service is off, if a failure turned it off.
    fn service_off(&self, service: Service) -> Option<heapless::String<REASON_BYTES>>;
    /// The board's RAM, in bytes.
    fn ram_bytes(&self) -> u64;
    /// Microseconds since boot.
    fn now_us(&self) -> u64;
    /// Whether exits' costs are counted in instructions (the PMU runs).
    fn counts_instructions(&self) -> bool;
    /// The `check` command's walk and verdict.
    fn check(&mut self, out: &mut String);
    /// The board's memory map (`mem`'s first part).
    fn write_memory_map(&self, out: &mut String);
    /// The `cpus` table and the interrupts each CPU took.
    fn write_cpus(&self, out: &mut String);
    /// Give the keyboard to VM `name`'s console; false if there is none.
    fn focus(&mut self, name: &str) -> bool;
    /// Make the memory manager's next tick fail in `into`.
    fn inject(&mut self, into: InjectInto);
    /// Take `pages` (all: `None`) from the pool: pages taken, pages held.
    fn hog(&mut self, pages: Option<u64>) -> (u64, u64);
    /// Give back what [`Board::hog`] took: pages freed.
    fn unhog(&mut self) -> u64;
    /// `f` on the board's disk, under its lock; `None` if it has none.
    fn with_disk<R>(&mut self, f: impl FnOnce(&mut dyn Disk) -> R) -> Option<R>;
    /// `f` on the VM called `name` and the board's disk (`None`: no disk),
    /// under both locks, the VM's first; `None` if there is no such VM.
    fn with_vm_and_disk<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Vm, &mut Self::Cpu, Option<&mut dyn Disk>) -> R,
    ) -> Option<R>;
    /// The board as a snapshot records it (kind and GIC, CPU, timer).
    fn snapshot_board(&self) -> crate::vm::snapshot::BoardId;
    /// The physical counter now.
    fn counter_now(&self) -> u64;
}

/// The memory manager's state as `mm` and `mem` show it.
#[derive(Clone, Copy, Debug, Default)]
pub struct ManagerFacts {
    pub watermarks: Watermarks,
    pub policy: Policy,
    /// `when_exhausted = "stop-lowest"`, and how often it stopped a VM.
    pub stop_lowest: bool,
    pub exhausted_stops: u64,
    pub stats: ManagerStats,
    /// Per VM id.
    pub vms: [VmStats; MAX_GUESTS],
}

/// The names of all VMs, for error messages.
pub fn names(board: &mut impl Board) -> heapless::String<128> {
    let mut s = heapless::String::new();
    board.for_each_vm(|vm| {
        if !s.is_empty() {
            let _ = s.push_str(", ");
        }
        let _ = s.push_str(vm.name());
    });
    s
}
