//! The hypervisor's fixed sizes, in one place: how many of each thing the
//! tables are built for. Each limit says what it bounds; the modules that
//! keep such tables take their sizes from here.

/// Most VMs a bundle may describe (the VM table's size).
pub const MAX_GUESTS: usize = 8;
/// Most vCPUs per VM.
pub const MAX_VCPUS: usize = 4;
/// List registers tracked per vCPU (GICv2 has at most 64; boards have 4).
pub const MAX_LRS: usize = 16;
/// SPIs a guest's virtual distributor has: the PL011 (1) and virtio
/// devices (16..).
pub const GUEST_SPIS: u32 = 64;
/// Physical CPUs the hypervisor runs on.
pub use platform::MAX_CPUS;
