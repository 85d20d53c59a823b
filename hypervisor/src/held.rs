//! The locks each CPU holds, so that a failure in a VM's path can release
//! exactly those before going back to its CPU loop
//! (`arch::aarch64::recovery`, `run`). A lock taken on a VM's path is
//! taken through [`Tracked`], which marks it held by this CPU until the
//! guard is dropped. Marking is two relaxed atomic operations.

use core::ops::{Deref, DerefMut};
use core::sync::atomic::{AtomicU32, Ordering};

use crate::arch::aarch64::{cpu_index, MAX_CPUS};

/// The frame table.
pub const FRAMES: u32 = 1 << 0;
/// The console UART.
pub const CONSOLE: u32 = 1 << 1;
/// The console's open live line (taken only under [`CONSOLE`]).
pub const OPEN_LINE: u32 = 1 << 2;
/// The memory manager (`run`'s tick and the `mm` command).
pub const MANAGER: u32 = 1 << 3;
/// First bit of the VM locks: VM `id` is bit `VM_BASE + id`.
const VM_BASE: u32 = 8;

/// The bit of VM `id`'s lock (`id` < 24).
#[inline]
pub const fn vm(id: usize) -> u32 {
    1 << (VM_BASE + id as u32)
}

/// VM ids whose lock bit is set in `held`.
pub fn vms(held: u32) -> impl Iterator<Item = usize> {
    (0..32 - VM_BASE as usize).filter(move |&id| held & vm(id) != 0)
}

static HELD: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];

/// The locks the calling CPU holds.
pub fn held_here() -> u32 {
    HELD[cpu_index()].load(Ordering::Relaxed)
}

/// Forget every lock of the calling CPU (after they were force-released).
pub fn clear_here() {
    set_here(0);
}

/// The calling CPU now holds exactly `held` (after the others were
/// force-released).
pub fn set_here(held: u32) {
    HELD[cpu_index()].store(held, Ordering::Relaxed);
}

/// A lock guard marked held by this CPU while it lives.
pub struct Tracked<G> {
    guard: G,
    bit: u32,
}

impl<G> Tracked<G> {
    /// Mark `guard` (just acquired) as lock `bit`, held by this CPU.
    pub fn new(guard: G, bit: u32) -> Self {
        HELD[cpu_index()].fetch_or(bit, Ordering::Relaxed);
        Self { guard, bit }
    }
}

impl<G> Drop for Tracked<G> {
    fn drop(&mut self) {
        // Runs before `guard` unlocks: nothing between can fail.
        HELD[cpu_index()].fetch_and(!self.bit, Ordering::Relaxed);
    }
}

impl<G: Deref> Deref for Tracked<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Tracked<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}
