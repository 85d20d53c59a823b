//! The EL2 stage-1 MMU: replaces the boot map with the precise identity map
//! (RAM normal write-back, everything else device) built by
//! [`crate::mm::pagetable`], for this CPU and for every CPU started later.

use core::ptr::addr_of_mut;

use aarch64_cpu::asm::barrier;
use aarch64_cpu::registers::TTBR0_EL2;

use platform::PhysRange;

use super::entry::MMU_CONFIG;
use crate::mm::pagetable::{IdentityMap, MapError, MemType, Table, VA_LIMIT};

/// Tables for the identity map: enough for 8 RAM banks with unaligned edges.
const POOL_TABLES: usize = 48;

#[no_mangle]
static mut EL2_TABLES: [Table; POOL_TABLES] = [const { Table::EMPTY }; POOL_TABLES];

/// Build the identity map for `ram` and switch this CPU to it. Returns the
/// number of tables used.
pub fn init(ram: &[PhysRange]) -> Result<usize, MapError> {
    // SAFETY: called once on the boot CPU before any other CPU runs; nothing
    // else references EL2_TABLES, which the current (boot) map does not use.
    let pool = unsafe { &mut *addr_of_mut!(EL2_TABLES) };
    let pool_phys = pool.as_ptr() as u64;
    let mut map = IdentityMap::new(pool, pool_phys);
    map.map(PhysRange::new(0, VA_LIMIT), MemType::Device)?;
    for bank in ram {
        // Only whole pages of RAM are mapped as normal memory.
        let start = bank.start.next_multiple_of(4096);
        let end = bank.end & !4095;
        if start < end {
            map.map(PhysRange::new(start, end.min(VA_LIMIT)), MemType::Normal)?;
        }
    }
    let root = map.root();
    let used = map.tables_used();
    // The map is never changed after this: dropping its bookkeeping leaves
    // the tables (in EL2_TABLES) in place, never marked active.
    drop(map);
    // The new map is an identity map of the same memory with the same
    // attributes for the image, stack and device tree, so switching TTBR0
    // under our feet is safe; the TLB is flushed right after. The tables'
    // stores complete before the switch.
    barrier::dsb(barrier::ISHST);
    TTBR0_EL2.set_baddr(root);
    barrier::isb(barrier::SY);
    super::invalidate_el2_tlb();
    // SAFETY: MMU_CONFIG is read only by CPUs that start later, and by
    // none while the boot CPU runs this.
    unsafe {
        let config = addr_of_mut!(MMU_CONFIG);
        (*config).ttbr0 = root;
        super::clean_dcache_range(config as usize, core::mem::size_of_val(&*config));
    }
    Ok(used)
}
