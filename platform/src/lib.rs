//! Board support for the hypervisor, `no_std`.
//!
//! This crate owns everything that differs between boards: [`BoardInfo`], what
//! the hypervisor learns from the flattened device tree the firmware passes in
//! `x0` ([`discover`]); [`boards`], the few facts a tree cannot tell, as one
//! `const` description per board; and [`uart`], the console UART drivers.
//! Discovery is plain Rust over a byte slice, so it is unit-tested on the host
//! against real trees (QEMU virt GICv2 and GICv3, the Raspberry Pi 4).
#![cfg_attr(not(test), no_std)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod boards;
mod discover;
pub mod power;
pub mod uart;

/// Discovery's invariants as one check, for property tests and fuzz targets.
#[cfg(any(test, feature = "testing"))]
pub use discover::testing;
pub use discover::{board_desc, discover, unsupported_board, DiscoveryError};

/// Most RAM banks, reserved regions and CPUs a board may describe; a tree with
/// more is rejected with [`DiscoveryError::TooMany`] rather than truncated.
pub const MAX_RAM_BANKS: usize = 8;
pub const MAX_RESERVED: usize = 32;
/// Virtio-mmio slots [`BoardInfo`] holds (QEMU `virt` has 32).
pub const MAX_VIRTIO_MMIO: usize = 32;
pub const MAX_CPUS: usize = 8;

/// A half-open physical address range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PhysRange {
    pub start: u64,
    pub end: u64,
}

impl PhysRange {
    pub const fn new(start: u64, end: u64) -> Self {
        Self { start, end }
    }
    pub const fn from_base_size(base: u64, size: u64) -> Self {
        Self {
            start: base,
            end: base.saturating_add(size),
        }
    }
    pub const fn size(&self) -> u64 {
        self.end - self.start
    }
    pub const fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    pub const fn contains(&self, addr: u64) -> bool {
        addr >= self.start && addr < self.end
    }
    pub const fn overlaps(&self, other: &PhysRange) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Why a region of RAM is reserved by the firmware or the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservedRegion {
    pub range: PhysRange,
    /// `/memreserve/`, the `/reserved-memory` child's node name, or
    /// `spin-table` for the page holding a CPU's release address.
    pub name: heapless::String<32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UartKind {
    /// ARM PrimeCell PL011 (`arm,pl011`).
    Pl011,
    /// The BCM2835 auxiliary "mini" UART (`brcm,bcm2835-aux-uart`), the Pi 4's
    /// default console; its registers start at the node's `reg` base.
    Bcm2835Aux,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Uart {
    pub kind: UartKind,
    /// CPU physical address of the register block (bus ranges already applied).
    pub regs: PhysRange,
    /// GIC interrupt ID (INTID: SPI n is 32 + n), if the node has one.
    pub intid: Option<u32>,
}

/// A `virtio,mmio` slot of the board: a transport the hypervisor may
/// drive itself (a disk, a network device) if a device sits behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioMmioSlot {
    /// CPU physical address of the register block (bus ranges applied).
    pub regs: PhysRange,
    /// GIC interrupt ID, if the node has one.
    pub intid: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GicVersion {
    V2,
    V3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gic {
    pub version: GicVersion,
    /// GICD.
    pub distributor: PhysRange,
    /// GICv2: GICC. GICv3: GICC if the tree lists the legacy interface.
    pub cpu_interface: Option<PhysRange>,
    /// GICv2 virtualization: GICH (hypervisor control) and GICV (virtual CPU interface).
    pub hyp_interface: Option<PhysRange>,
    pub virtual_cpu_interface: Option<PhysRange>,
    /// GICv3: the first redistributor region.
    pub redistributors: Option<PhysRange>,
    /// The maintenance interrupt (INTID), when the tree gives it.
    pub maintenance_intid: Option<u32>,
}

/// How a secondary CPU is started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnableMethod {
    /// PSCI `CPU_ON` through the conduit in [`BoardInfo::psci`].
    Psci,
    /// Write the entry point to `release_addr` (a u64), clean it to the point
    /// of coherency, then `sev`.
    SpinTable { release_addr: u64 },
    /// No `enable-method` property (usually the boot CPU only), or a method
    /// the hypervisor cannot use (anything but `psci` and `spin-table`).
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpu {
    /// The `reg` value: MPIDR affinity bits (Aff3 in bits 39:32, Aff2..Aff0 in 23:0).
    pub mpidr: u64,
    pub enable_method: EnableMethod,
}

/// The instruction a PSCI call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsciConduit {
    Smc,
    Hvc,
}

/// The architected timer's interrupts (INTIDs, PPI n is 16 + n), in the order
/// of the `arm,armv8-timer` binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TimerIrqs {
    pub secure_phys: Option<u32>,
    pub nonsecure_phys: Option<u32>,
    pub virt: Option<u32>,
    pub hyp_phys: Option<u32>,
}

/// How the board is powered off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerOff {
    /// PSCI `SYSTEM_OFF`.
    Psci(PsciConduit),
    /// The BCM2835 power-management watchdog (`brcm,bcm2835-pm`,
    /// `brcm,bcm2835-pm-wdt` or `brcm,bcm2711-pm`; `regs` is its first `reg`
    /// entry): halt partition 63, then a watchdog reset.
    Bcm2835Watchdog { regs: PhysRange },
    /// Nothing in the tree can power the board off: park the CPUs.
    None,
}

/// Everything the hypervisor knows about the board, all from the device tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoardInfo {
    /// The root node's `model` property, or its first `compatible`.
    pub model: heapless::String<64>,
    /// The root node's first `compatible` string.
    pub compatible: heapless::String<64>,
    /// The tree blob itself: `[dtb address, address + totalsize)`.
    pub dtb: PhysRange,
    /// RAM banks from every available `device_type = "memory"` node, sorted
    /// by address, with overlapping and adjacent entries merged and zero-size
    /// ones dropped.
    pub ram: heapless::Vec<PhysRange, MAX_RAM_BANKS>,
    /// `/memreserve/` entries, available `/reserved-memory` children with
    /// `reg`, and the pages holding spin-table release addresses (one entry
    /// per page), in that order; zero-size entries dropped. Entries are not
    /// merged, so they may overlap (on the Pi 4, `/memreserve/` and the spin
    /// table both cover page 0).
    pub reserved: heapless::Vec<ReservedRegion, MAX_RESERVED>,
    /// `/chosen/linux,initrd-start` .. `linux,initrd-end` (each one or two
    /// cells): the guest bundle. `None` if either is missing or the range is
    /// empty.
    pub initrd: Option<PhysRange>,
    /// `/chosen/stdout-path` (an alias or a path, options after ':' ignored),
    /// else the `serial0` alias. `None` if that node is not a UART kind
    /// [`uart`] drives or its `reg` cannot be translated to a CPU address.
    pub console: Option<Uart>,
    /// The UART for the binary trace stream, when the board description says
    /// which alias to use and that alias is a PL011 other than the console.
    pub trace_uart: Option<Uart>,
    /// The first available node compatible with a GICv2 (`arm,gic-400`,
    /// `arm,cortex-a15-gic`, `arm,cortex-a9-gic`, `arm,gic-v2`) or GICv3
    /// (`arm,gic-v3`) binding.
    pub gic: Option<Gic>,
    /// In `/cpus` order; the boot CPU is among them.
    pub cpus: heapless::Vec<Cpu, MAX_CPUS>,
    /// The `method` of `/psci` (or else of the first node compatible with
    /// `arm,psci*`), when it is "smc" or "hvc".
    pub psci: Option<PsciConduit>,
    /// From the first `arm,armv8-timer` or `arm,armv7-timer` node; all `None`
    /// when its interrupt parent is not a GIC.
    pub timer: TimerIrqs,
    /// PSCI if [`BoardInfo::psci`] is set, else the BCM2835 watchdog if the
    /// tree has one.
    pub power_off: PowerOff,
    /// Every available `virtio,mmio` node with a `reg`, in tree order (up
    /// to [`MAX_VIRTIO_MMIO`]; more are left out). Whether a device sits
    /// behind a slot is read from its registers, not from the tree.
    pub virtio_mmio: heapless::Vec<VirtioMmioSlot, MAX_VIRTIO_MMIO>,
    /// `/chosen/bootargs`, if any, cut to capacity at a character boundary
    /// (and at the first byte that is not UTF-8).
    pub bootargs: Option<heapless::String<256>>,
}
