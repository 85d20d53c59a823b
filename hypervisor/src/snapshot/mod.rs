//! Snapshots of a VM on the board's disk (issue 39). What is here so far:
//! the store of named snapshots on a disk of sectors (`store`), which
//! knows nothing of what a snapshot holds nor of the device under it; and
//! the snapshot format (`format`), the layout of one snapshot's bytes:
//! header, opaque configuration, vCPU and device sections, guest memory in
//! checked chunks (docs/SNAPSHOT.md).

pub mod format;
#[cfg(test)]
mod format_tests;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
