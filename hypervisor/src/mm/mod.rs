//! Memory management, as plain data: the frame table (who uses every page of
//! RAM), layout helpers used before it exists, and the EL2 identity map.

pub mod frames;
pub mod layout;
pub mod manager;
pub mod pagetable;
pub mod stage2;
