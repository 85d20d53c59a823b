//! Snapshots of a VM on the board's disk (issue 39). What is here so far:
//! the store of named snapshots on a disk of sectors (`store`), which
//! knows nothing of what a snapshot holds nor of the device under it.

pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
