//! The device tree each guest boots with: a description of the virtual board
//! of `docs/GUEST-BOARD.md` ([`GuestBoard`]) turned into a flattened device
//! tree blob ([`build`]) that Linux and the bare-metal test guest accept.
//!
//! The blob itself is written by the `vm-fdt` crate (rust-vmm's writer,
//! `alloc` without `std`): header version 17 (last compatible 16), an empty
//! memory reservation block, the structure block, and a strings block in
//! which each property name is stored once.
//!
//! [`build`] checks the description first and returns an [`FdtError`] for
//! anything that would give a tree Linux misreads (no vCPUs, RAM or a device
//! region that wraps around the address space, an initrd outside RAM, an
//! interrupt number the GIC binding cannot express, a NUL in the command
//! line); it never panics.

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;
use vm_fdt::FdtWriter;

/// Where things are on the guest board (`docs/GUEST-BOARD.md`).
pub mod layout {
    use crate::addr::GuestAddr;

    /// Guest RAM starts here (IPA).
    pub const RAM_BASE: GuestAddr = GuestAddr::new(0x4000_0000);
    /// GIC distributor.
    pub const GICD_BASE: GuestAddr = GuestAddr::new(0x0800_0000);
    /// GICv2 CPU interface.
    pub const GICC_BASE: GuestAddr = GuestAddr::new(0x0801_0000);
    /// GICv3 redistributors (one 128 KiB frame pair per vCPU).
    pub const GICR_BASE: GuestAddr = GuestAddr::new(0x080a_0000);
    /// The PL011 console and its SPI (INTID 33).
    pub const UART_BASE: GuestAddr = GuestAddr::new(0x0900_0000);
    pub const UART_SPI: u32 = 1;
    /// Virtio-mmio device `n` is at `VIRTIO_BASE + VIRTIO_STRIDE * n`, SPI
    /// `VIRTIO_SPI_BASE + n`; device 0 is the balloon.
    pub const VIRTIO_BASE: GuestAddr = GuestAddr::new(0x0a00_0000);
    pub const VIRTIO_STRIDE: u64 = 0x200;
    pub const VIRTIO_SPI_BASE: u32 = 16;
    /// The balloon's slot, and the virtio console's.
    pub const BALLOON_SLOT: usize = 0;
    pub const CONSOLE_SLOT: usize = 1;
    /// Virtio-mmio slots the board has (QEMU `virt` has 32 too).
    pub const VIRTIO_SLOTS: usize = 32;
    /// The architected timer's PPIs in binding order: secure physical,
    /// non-secure physical, virtual, hypervisor physical (PPI n is INTID 16 + n).
    pub const TIMER_PPIS: [u32; 4] = [13, 14, 11, 10];
}

/// The virtio-mmio slots a VM's devices take: the balloon's
/// ([`layout::BALLOON_SLOT`]) and the console's ([`layout::CONSOLE_SLOT`]),
/// as one range (a console without a balloon: its slot alone).
pub fn virtio_slots(balloon: bool, console: bool) -> core::ops::Range<usize> {
    let end = if console {
        layout::CONSOLE_SLOT + 1
    } else if balloon {
        layout::BALLOON_SLOT + 1
    } else {
        0
    };
    let start = if balloon {
        layout::BALLOON_SLOT
    } else {
        end.saturating_sub(1)
    };
    start..end
}

/// `(base, SPI)` of every virtio-mmio slot, in order.
pub const VIRTIO_MMIO_SLOTS: [(u64, u32); layout::VIRTIO_SLOTS] = {
    let mut slots = [(0u64, 0u32); layout::VIRTIO_SLOTS];
    let mut n = 0;
    while n < layout::VIRTIO_SLOTS {
        slots[n] = (
            layout::VIRTIO_BASE.raw() + layout::VIRTIO_STRIDE * n as u64,
            layout::VIRTIO_SPI_BASE + n as u32,
        );
        n += 1;
    }
    slots
};

/// Bytes of the register frames the tree describes.
pub const GICV2_DIST_SIZE: u64 = 0x1000;
pub const GICV2_CPU_SIZE: u64 = 0x2000;
pub const GICV3_DIST_SIZE: u64 = 0x1_0000;
/// Per vCPU: RD_base and SGI_base frames, 64 KiB each.
pub const GICV3_REDIST_STRIDE: u64 = 0x2_0000;
pub const UART_SIZE: u64 = 0x1000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x200;
/// The PL011's reference clock (`/apb-pclk`), as on QEMU `virt`.
pub const APB_PCLK_HZ: u32 = 24_000_000;

/// Most vCPUs a guest tree describes: GICv2 targets at most 8 CPUs; the
/// GICv3 limit is the redistributor space below the UART on this board.
pub const MAX_VCPUS_GICV2: u32 = 8;
pub const MAX_VCPUS_GICV3: u32 = 64;

/// SPI numbers the GIC binding can express (INTIDs 32..1019).
const MAX_SPI: u32 = 987;
/// PPI numbers (INTIDs 16..31).
const MAX_PPI: u32 = 15;

/// Phandles the tree assigns.
const PHANDLE_GIC: u32 = 1;
const PHANDLE_CLK: u32 = 2;

/// GIC binding interrupt specifier types and flags.
const GIC_SPI: u32 = 0;
const GIC_PPI: u32 = 1;
const IRQ_EDGE_RISING: u32 = 1;
const IRQ_LEVEL_HIGH: u32 = 4;

/// The guest's interrupt controller, as the host has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestGic {
    /// GICv2: distributor and CPU interface bases (IPA).
    V2 { dist: u64, cpu: u64 },
    /// GICv3: distributor and first redistributor bases (IPA); the
    /// redistributor region is [`GICV3_REDIST_STRIDE`] per vCPU.
    V3 { dist: u64, redist: u64 },
}

/// Everything the guest's device tree says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestBoard<'a> {
    /// Guest RAM: one bank at `ram_base` (IPA), `ram_size` bytes.
    pub ram_base: u64,
    pub ram_size: u64,
    /// vCPU `n` is `/cpus/cpu@n` with `reg = n`: its MPIDR affinity must be `n`.
    pub vcpus: u32,
    /// `/chosen/bootargs`, when given.
    pub bootargs: Option<&'a str>,
    /// The initrd as `[start, end)` IPAs within RAM:
    /// `/chosen/linux,initrd-start` and `-end`.
    pub initrd: Option<(u64, u64)>,
    pub gic: GuestGic,
    /// The PL011 console: register base (IPA) and SPI number (not INTID).
    pub uart: (u64, u32),
    /// One virtio-mmio device per entry: register base (IPA) and SPI number.
    pub virtio_mmio: &'a [(u64, u32)],
    /// Timer PPI numbers (not INTIDs) in binding order: secure physical,
    /// non-secure physical, virtual, hypervisor physical.
    pub timer_ppis: [u32; 4],
}

/// Which GIC a [`GuestBoard::standard`] board has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GicVersion {
    V2,
    V3,
}

impl GuestBoard<'static> {
    /// The board of `docs/GUEST-BOARD.md` with `ram_size` bytes of RAM,
    /// `vcpus` vCPUs, the given GIC and the virtio-mmio slots `virtio_slots`
    /// ([`virtio_slots`]); no command line, no initrd (set those fields
    /// afterwards).
    pub fn standard(
        ram_size: u64,
        vcpus: u32,
        gic: GicVersion,
        virtio_slots: core::ops::Range<usize>,
    ) -> Result<Self, FdtError> {
        let virtio_mmio =
            VIRTIO_MMIO_SLOTS
                .get(virtio_slots.clone())
                .ok_or(FdtError::TooManyDevices {
                    count: virtio_slots.end,
                    max: layout::VIRTIO_SLOTS,
                })?;
        Ok(GuestBoard {
            ram_base: layout::RAM_BASE.raw(),
            ram_size,
            vcpus,
            bootargs: None,
            initrd: None,
            gic: match gic {
                GicVersion::V2 => GuestGic::V2 {
                    dist: layout::GICD_BASE.raw(),
                    cpu: layout::GICC_BASE.raw(),
                },
                GicVersion::V3 => GuestGic::V3 {
                    dist: layout::GICD_BASE.raw(),
                    redist: layout::GICR_BASE.raw(),
                },
            },
            uart: (layout::UART_BASE.raw(), layout::UART_SPI),
            virtio_mmio,
            timer_ppis: layout::TIMER_PPIS,
        })
    }
}

/// Why a [`GuestBoard`] cannot be described.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdtError {
    /// `vcpus` is 0.
    NoVcpus,
    /// More vCPUs than the GIC (or the board's redistributor space) allows.
    TooManyVcpus { vcpus: u32, max: u32 },
    /// `ram_size` is 0.
    EmptyRam,
    /// A region (`what`) runs past the end of the address space.
    Overflow { what: &'static str },
    /// The initrd range is empty, reversed, or not inside RAM.
    InitrdOutsideRam { start: u64, end: u64 },
    /// An SPI number (`what`) the GIC binding cannot express.
    BadSpi { what: &'static str, spi: u32 },
    /// Timer PPI `index` (binding order) is not 0..=15.
    BadPpi { index: usize, ppi: u32 },
    /// The command line contains a NUL byte.
    NulInBootargs,
    /// [`GuestBoard::standard`]: more virtio devices than slots.
    TooManyDevices { count: usize, max: usize },
    /// The blob would exceed the format's 4 GiB limit.
    TooLarge,
    /// The writer refused the tree (a name, string or nesting `check`
    /// should have ruled out): a bug here, reported rather than a panic.
    Refused { what: &'static str },
}

impl fmt::Display for FdtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("guest device tree: ")?;
        match *self {
            Self::NoVcpus => f.write_str("a VM needs at least one vCPU"),
            Self::TooManyVcpus { vcpus, max } => {
                write!(f, "{vcpus} vCPUs; this GIC allows at most {max}")
            }
            Self::EmptyRam => f.write_str("RAM size is 0"),
            Self::Overflow { what } => write!(f, "{what} runs past the end of the address space"),
            Self::InitrdOutsideRam { start, end } => write!(
                f,
                "initrd [{start:#x}, {end:#x}) is empty or not inside guest RAM"
            ),
            Self::BadSpi { what, spi } => {
                write!(f, "{what}: SPI {spi} is out of range (0 to {MAX_SPI})")
            }
            Self::BadPpi { index, ppi } => {
                write!(
                    f,
                    "timer interrupt {index}: PPI {ppi} is out of range (0 to {MAX_PPI})"
                )
            }
            Self::NulInBootargs => f.write_str("the command line contains a NUL byte"),
            Self::TooManyDevices { count, max } => {
                write!(f, "{count} virtio-mmio devices; the board has {max} slots")
            }
            Self::TooLarge => f.write_str("the blob would be larger than 4 GiB"),
            Self::Refused { what } => write!(f, "the writer refused it: {what}"),
        }
    }
}

impl core::error::Error for FdtError {}

impl From<vm_fdt::Error> for FdtError {
    fn from(e: vm_fdt::Error) -> Self {
        use vm_fdt::Error as E;
        let what = match e {
            E::TotalSizeTooLarge | E::PropertyValueTooLarge => return Self::TooLarge,
            E::InvalidString => "a string contains a NUL byte",
            E::InvalidNodeName => "an invalid node name",
            E::InvalidPropertyName => "an invalid property name",
            E::DuplicatePhandle => "a phandle used twice",
            E::NodeDepthTooLarge => "nodes nested too deeply",
            _ => "nodes or properties out of order",
        };
        Self::Refused { what }
    }
}

/// The path of the console node, also `/chosen/stdout-path` and the
/// `serial0` alias.
pub fn uart_path(base: u64) -> String {
    format!("/pl011@{base:x}")
}

/// Builds the guest's device tree blob.
pub fn build(board: &GuestBoard) -> Result<Vec<u8>, FdtError> {
    check(board)?;
    write(board).map_err(FdtError::from)
}

/// The tree of a checked `board`, through vm-fdt's writer.
fn write(board: &GuestBoard) -> Result<Vec<u8>, vm_fdt::Error> {
    let mut w = FdtWriter::new()?;
    let gic_v2 = matches!(board.gic, GuestGic::V2 { .. });

    let root = w.begin_node("")?;
    w.property_u32("#address-cells", 2)?;
    w.property_u32("#size-cells", 2)?;
    w.property("compatible", &strings(&["tidal,guest", "linux,dummy-virt"]))?;
    w.property_string("model", "Tidal guest")?;
    w.property_u32("interrupt-parent", PHANDLE_GIC)?;

    // /chosen and /aliases first, as QEMU and U-Boot write them.
    let uart_path = uart_path(board.uart.0);
    let chosen = w.begin_node("chosen")?;
    if let Some(args) = board.bootargs {
        w.property_string("bootargs", args)?;
    }
    w.property_string("stdout-path", &uart_path)?;
    if let Some((start, end)) = board.initrd {
        w.property_u64("linux,initrd-start", start)?;
        w.property_u64("linux,initrd-end", end)?;
    }
    w.end_node(chosen)?;
    let aliases = w.begin_node("aliases")?;
    w.property_string("serial0", &uart_path)?;
    w.end_node(aliases)?;

    let memory = w.begin_node(&format!("memory@{:x}", board.ram_base))?;
    w.property_string("device_type", "memory")?;
    // `reg` entries: two address and two size cells each.
    w.property_array_u64("reg", &[board.ram_base, board.ram_size])?;
    w.end_node(memory)?;

    let cpus = w.begin_node("cpus")?;
    w.property_u32("#address-cells", 1)?;
    w.property_u32("#size-cells", 0)?;
    for n in 0..board.vcpus {
        let cpu = w.begin_node(&format!("cpu@{n:x}"))?;
        w.property_string("device_type", "cpu")?;
        w.property_string("compatible", "arm,armv8")?;
        w.property_u32("reg", n)?;
        w.property_string("enable-method", "psci")?;
        w.end_node(cpu)?;
    }
    w.end_node(cpus)?;

    let psci = w.begin_node("psci")?;
    w.property("compatible", &strings(&["arm,psci-1.0", "arm,psci-0.2"]))?;
    w.property_string("method", "hvc")?;
    w.end_node(psci)?;

    let intc = match board.gic {
        GuestGic::V2 { dist, cpu } => {
            let intc = w.begin_node(&format!("intc@{dist:x}"))?;
            w.property_string("compatible", "arm,cortex-a15-gic")?;
            w.property_array_u64("reg", &[dist, GICV2_DIST_SIZE, cpu, GICV2_CPU_SIZE])?;
            intc
        }
        GuestGic::V3 { dist, redist } => {
            let intc = w.begin_node(&format!("intc@{dist:x}"))?;
            w.property_string("compatible", "arm,gic-v3")?;
            let redist_size = redist_size(board.vcpus);
            w.property_array_u64("reg", &[dist, GICV3_DIST_SIZE, redist, redist_size])?;
            w.property_u32("#redistributor-regions", 1)?;
            intc
        }
    };
    w.property_u32("#interrupt-cells", 3)?;
    // No child nodes: an interrupt-map into the GIC carries no address cells.
    w.property_u32("#address-cells", 0)?;
    w.property_null("interrupt-controller")?;
    w.property_phandle(PHANDLE_GIC)?;
    w.end_node(intc)?;

    // GICv2 PPI flags carry a mask of the CPUs the interrupt goes to.
    let ppi_flags = if gic_v2 {
        IRQ_LEVEL_HIGH | (((1u32 << board.vcpus.min(8)) - 1) << 8)
    } else {
        IRQ_LEVEL_HIGH
    };
    let timer_node = w.begin_node("timer")?;
    w.property_string("compatible", "arm,armv8-timer")?;
    let mut timer = [0u32; 12];
    for (cells, &ppi) in timer.chunks_exact_mut(3).zip(&board.timer_ppis) {
        cells.copy_from_slice(&[GIC_PPI, ppi, ppi_flags]);
    }
    w.property_array_u32("interrupts", &timer)?;
    w.end_node(timer_node)?;

    let clock = w.begin_node("apb-pclk")?;
    w.property_string("compatible", "fixed-clock")?;
    w.property_u32("#clock-cells", 0)?;
    w.property_u32("clock-frequency", APB_PCLK_HZ)?;
    w.property_string("clock-output-names", "clk24mhz")?;
    w.property_phandle(PHANDLE_CLK)?;
    w.end_node(clock)?;

    let (uart_base, uart_spi) = board.uart;
    let uart = w.begin_node(&uart_path[1..])?;
    w.property("compatible", &strings(&["arm,pl011", "arm,primecell"]))?;
    w.property_array_u64("reg", &[uart_base, UART_SIZE])?;
    w.property_array_u32("interrupts", &[GIC_SPI, uart_spi, IRQ_LEVEL_HIGH])?;
    w.property_array_u32("clocks", &[PHANDLE_CLK, PHANDLE_CLK])?;
    w.property("clock-names", &strings(&["uartclk", "apb_pclk"]))?;
    w.end_node(uart)?;

    for &(base, spi) in board.virtio_mmio {
        let virtio = w.begin_node(&format!("virtio_mmio@{base:x}"))?;
        w.property_string("compatible", "virtio,mmio")?;
        w.property_array_u64("reg", &[base, VIRTIO_MMIO_SIZE])?;
        w.property_array_u32("interrupts", &[GIC_SPI, spi, IRQ_EDGE_RISING])?;
        w.property_null("dma-coherent")?;
        w.end_node(virtio)?;
    }

    w.end_node(root)?;
    w.finish()
}

/// A string-list value (`compatible`): each string NUL-terminated. The
/// strings here are constants without NULs.
fn strings(list: &[&str]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for s in list {
        bytes.extend_from_slice(s.as_bytes());
        bytes.push(0);
    }
    bytes
}

fn redist_size(vcpus: u32) -> u64 {
    GICV3_REDIST_STRIDE * u64::from(vcpus)
}

/// Every rule [`build`] relies on.
fn check(board: &GuestBoard) -> Result<(), FdtError> {
    let max = match board.gic {
        GuestGic::V2 { .. } => MAX_VCPUS_GICV2,
        GuestGic::V3 { .. } => MAX_VCPUS_GICV3,
    };
    if board.vcpus == 0 {
        return Err(FdtError::NoVcpus);
    }
    if board.vcpus > max {
        return Err(FdtError::TooManyVcpus {
            vcpus: board.vcpus,
            max,
        });
    }
    if board.ram_size == 0 {
        return Err(FdtError::EmptyRam);
    }
    let fits = |base: u64, size: u64, what| {
        base.checked_add(size)
            .map(|_| ())
            .ok_or(FdtError::Overflow { what })
    };
    fits(board.ram_base, board.ram_size, "RAM")?;
    let ram_end = board.ram_base + board.ram_size;
    match board.gic {
        GuestGic::V2 { dist, cpu } => {
            fits(dist, GICV2_DIST_SIZE, "GIC distributor")?;
            fits(cpu, GICV2_CPU_SIZE, "GIC CPU interface")?;
        }
        GuestGic::V3 { dist, redist } => {
            fits(dist, GICV3_DIST_SIZE, "GIC distributor")?;
            fits(redist, redist_size(board.vcpus), "GIC redistributors")?;
        }
    }
    fits(board.uart.0, UART_SIZE, "PL011")?;
    if board.uart.1 > MAX_SPI {
        return Err(FdtError::BadSpi {
            what: "PL011",
            spi: board.uart.1,
        });
    }
    for &(base, spi) in board.virtio_mmio {
        fits(base, VIRTIO_MMIO_SIZE, "virtio-mmio device")?;
        if spi > MAX_SPI {
            return Err(FdtError::BadSpi {
                what: "virtio-mmio device",
                spi,
            });
        }
    }
    for (index, &ppi) in board.timer_ppis.iter().enumerate() {
        if ppi > MAX_PPI {
            return Err(FdtError::BadPpi { index, ppi });
        }
    }
    if let Some((start, end)) = board.initrd {
        if start >= end || start < board.ram_base || end > ram_end {
            return Err(FdtError::InitrdOutsideRam { start, end });
        }
    }
    if board.bootargs.is_some_and(|a| a.contains('\0')) {
        return Err(FdtError::NulInBootargs);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use platform::{
        EnableMethod, GicVersion as HostGic, PhysRange, PowerOff, PsciConduit, UartKind,
    };
    use std::process::Command;
    use std::string::ToString;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The tree decoded by `dtc`, which must accept it without a warning.
    fn dtc(blob: &[u8]) -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "tidal-guest-fdt-{}-{}.dtb",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, blob).unwrap();
        let out = Command::new("dtc")
            .args(["-I", "dtb", "-O", "dts", "-o", "-"])
            .arg(&path)
            .output();
        let _ = std::fs::remove_file(&path);
        let out = match out {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "dtc (the device tree compiler) is not installed; these tests need it: \
                 apt-get install device-tree-compiler (or run `cargo xtask setup`)"
            ),
            Err(e) => panic!("cannot run dtc: {e}"),
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "dtc rejected the blob:\n{stderr}");
        assert!(stderr.trim().is_empty(), "dtc warnings:\n{stderr}");
        String::from_utf8(out.stdout).unwrap()
    }

    fn v2_board() -> GuestBoard<'static> {
        let mut b = GuestBoard::standard(256 << 20, 2, GicVersion::V2, 0..2).unwrap();
        b.bootargs = Some("pattern console=ttyAMA0");
        b.initrd = Some((0x4440_0000, 0x4450_1000));
        b
    }

    fn v3_board() -> GuestBoard<'static> {
        let mut b = GuestBoard::standard(128 << 20, 3, GicVersion::V3, 0..1).unwrap();
        b.bootargs = Some("hostile");
        b
    }

    const V2_DTS: &str = r#"/dts-v1/;

/ {
	#address-cells = <0x02>;
	#size-cells = <0x02>;
	compatible = "tidal,guest\0linux,dummy-virt";
	model = "Tidal guest";
	interrupt-parent = <0x01>;

	chosen {
		bootargs = "pattern console=ttyAMA0";
		stdout-path = "/pl011@9000000";
		linux,initrd-start = <0x00 0x44400000>;
		linux,initrd-end = <0x00 0x44501000>;
	};

	aliases {
		serial0 = "/pl011@9000000";
	};

	memory@40000000 {
		device_type = "memory";
		reg = <0x00 0x40000000 0x00 0x10000000>;
	};

	cpus {
		#address-cells = <0x01>;
		#size-cells = <0x00>;

		cpu@0 {
			device_type = "cpu";
			compatible = "arm,armv8";
			reg = <0x00>;
			enable-method = "psci";
		};

		cpu@1 {
			device_type = "cpu";
			compatible = "arm,armv8";
			reg = <0x01>;
			enable-method = "psci";
		};
	};

	psci {
		compatible = "arm,psci-1.0\0arm,psci-0.2";
		method = "hvc";
	};

	intc@8000000 {
		compatible = "arm,cortex-a15-gic";
		reg = <0x00 0x8000000 0x00 0x1000 0x00 0x8010000 0x00 0x2000>;
		#interrupt-cells = <0x03>;
		#address-cells = <0x00>;
		interrupt-controller;
		phandle = <0x01>;
	};

	timer {
		compatible = "arm,armv8-timer";
		interrupts = <0x01 0x0d 0x304 0x01 0x0e 0x304 0x01 0x0b 0x304 0x01 0x0a 0x304>;
	};

	apb-pclk {
		compatible = "fixed-clock";
		#clock-cells = <0x00>;
		clock-frequency = <0x16e3600>;
		clock-output-names = "clk24mhz";
		phandle = <0x02>;
	};

	pl011@9000000 {
		compatible = "arm,pl011\0arm,primecell";
		reg = <0x00 0x9000000 0x00 0x1000>;
		interrupts = <0x00 0x01 0x04>;
		clocks = <0x02 0x02>;
		clock-names = "uartclk\0apb_pclk";
	};

	virtio_mmio@a000000 {
		compatible = "virtio,mmio";
		reg = <0x00 0xa000000 0x00 0x200>;
		interrupts = <0x00 0x10 0x01>;
		dma-coherent;
	};

	virtio_mmio@a000200 {
		compatible = "virtio,mmio";
		reg = <0x00 0xa000200 0x00 0x200>;
		interrupts = <0x00 0x11 0x01>;
		dma-coherent;
	};
};
"#;

    #[test]
    fn dtc_decodes_the_gicv2_tree() {
        let dts = dtc(&build(&v2_board()).unwrap());
        if dts != V2_DTS {
            for (i, (got, want)) in dts.lines().zip(V2_DTS.lines()).enumerate() {
                assert_eq!(got, want, "line {} of the decoded tree", i + 1);
            }
            panic!(
                "decoded tree has {} lines, expected {}:\n{dts}",
                dts.lines().count(),
                V2_DTS.lines().count()
            );
        }
    }

    #[test]
    fn dtc_decodes_the_gicv3_tree() {
        let dts = dtc(&build(&v3_board()).unwrap());
        for want in [
            "\tchosen {\n\t\tbootargs = \"hostile\";\n\t\tstdout-path = \"/pl011@9000000\";\n\t};\n",
            "\tmemory@40000000 {\n\t\tdevice_type = \"memory\";\n\t\treg = <0x00 0x40000000 0x00 0x8000000>;\n\t};\n",
            "\t\tcpu@2 {\n\t\t\tdevice_type = \"cpu\";\n\t\t\tcompatible = \"arm,armv8\";\n\t\t\treg = <0x02>;\n\t\t\tenable-method = \"psci\";\n\t\t};\n",
            "\tintc@8000000 {\n\t\tcompatible = \"arm,gic-v3\";\n\t\treg = <0x00 0x8000000 0x00 0x10000 0x00 0x80a0000 0x00 0x60000>;\n\t\t#redistributor-regions = <0x01>;\n\t\t#interrupt-cells = <0x03>;\n\t\t#address-cells = <0x00>;\n\t\tinterrupt-controller;\n\t\tphandle = <0x01>;\n\t};\n",
            "\ttimer {\n\t\tcompatible = \"arm,armv8-timer\";\n\t\tinterrupts = <0x01 0x0d 0x04 0x01 0x0e 0x04 0x01 0x0b 0x04 0x01 0x0a 0x04>;\n\t};\n",
            "\tvirtio_mmio@a000000 {\n\t\tcompatible = \"virtio,mmio\";\n\t\treg = <0x00 0xa000000 0x00 0x200>;\n\t\tinterrupts = <0x00 0x10 0x01>;\n\t\tdma-coherent;\n\t};\n",
        ] {
            assert!(dts.contains(want), "missing:\n{want}\nin:\n{dts}");
        }
        assert!(!dts.contains("cpu@3"), "{dts}");
        assert!(!dts.contains("virtio_mmio@a000200"), "{dts}");
        assert!(!dts.contains("initrd"), "{dts}");
    }

    #[test]
    fn minimal_tree_has_no_optional_properties() {
        let b = GuestBoard::standard(2 << 20, 1, GicVersion::V2, 0..0).unwrap();
        let dts = dtc(&build(&b).unwrap());
        assert!(
            dts.contains("\tchosen {\n\t\tstdout-path = \"/pl011@9000000\";\n\t};\n"),
            "{dts}"
        );
        assert!(!dts.contains("virtio"), "{dts}");
        assert!(!dts.contains("bootargs"), "{dts}");
        // One vCPU: the GICv2 PPI CPU mask has one bit.
        assert!(dts.contains("interrupts = <0x01 0x0d 0x104 "), "{dts}");
        let info = platform::discover(&build(&b).unwrap(), 0x4000_0000).unwrap();
        assert_eq!(info.initrd, None);
        assert_eq!(info.bootargs, None);
        assert_eq!(info.cpus.len(), 1);
    }

    #[test]
    fn every_virtio_slot_decodes() {
        let b = GuestBoard::standard(64 << 20, 8, GicVersion::V2, 0..layout::VIRTIO_SLOTS).unwrap();
        let dts = dtc(&build(&b).unwrap());
        assert!(dts.contains("\tvirtio_mmio@a003e00 {\n\t\tcompatible = \"virtio,mmio\";\n\t\treg = <0x00 0xa003e00 0x00 0x200>;\n\t\tinterrupts = <0x00 0x2f 0x01>;\n"), "{dts}");
        assert!(dts.contains("0x01 0x0d 0xff04 "), "{dts}");
        assert!(dts.contains("cpu@7 {"), "{dts}");
    }

    #[test]
    fn platform_discovery_reads_the_gicv2_tree_back() {
        let blob = build(&v2_board()).unwrap();
        let info = platform::discover(&blob, 0x4000_0000).unwrap();
        assert_eq!(info.model.as_str(), "Tidal guest");
        assert_eq!(info.compatible.as_str(), "tidal,guest");
        assert_eq!(
            info.dtb,
            PhysRange::from_base_size(0x4000_0000, blob.len() as u64)
        );
        assert_eq!(&info.ram[..], &[PhysRange::new(0x4000_0000, 0x5000_0000)]);
        assert!(info.reserved.is_empty());
        assert_eq!(info.initrd, Some(PhysRange::new(0x4440_0000, 0x4450_1000)));
        let console = info.console.unwrap();
        assert_eq!(console.kind, UartKind::Pl011);
        assert_eq!(console.regs, PhysRange::new(0x0900_0000, 0x0900_1000));
        assert_eq!(console.intid, Some(33));
        let gic = info.gic.unwrap();
        assert_eq!(gic.version, HostGic::V2);
        assert_eq!(gic.distributor, PhysRange::new(0x0800_0000, 0x0800_1000));
        assert_eq!(
            gic.cpu_interface,
            Some(PhysRange::new(0x0801_0000, 0x0801_2000))
        );
        assert_eq!(gic.hyp_interface, None);
        assert_eq!(gic.redistributors, None);
        assert_eq!(info.cpus.len(), 2);
        for (n, cpu) in info.cpus.iter().enumerate() {
            assert_eq!(cpu.mpidr, n as u64);
            assert_eq!(cpu.enable_method, EnableMethod::Psci);
        }
        assert_eq!(info.psci, Some(PsciConduit::Hvc));
        assert_eq!(info.power_off, PowerOff::Psci(PsciConduit::Hvc));
        assert_eq!(info.timer.secure_phys, Some(29));
        assert_eq!(info.timer.nonsecure_phys, Some(30));
        assert_eq!(info.timer.virt, Some(27));
        assert_eq!(info.timer.hyp_phys, Some(26));
        assert_eq!(info.bootargs.as_deref(), Some("pattern console=ttyAMA0"));
    }

    #[test]
    fn platform_discovery_reads_the_gicv3_tree_back() {
        let mut b = v3_board();
        b.ram_base = 0x8000_0000;
        b.initrd = Some((0x8100_0000, 0x8100_0001));
        let info = platform::discover(&build(&b).unwrap(), 0x8000_0000).unwrap();
        assert_eq!(&info.ram[..], &[PhysRange::new(0x8000_0000, 0x8800_0000)]);
        assert_eq!(info.initrd, Some(PhysRange::new(0x8100_0000, 0x8100_0001)));
        let gic = info.gic.unwrap();
        assert_eq!(gic.version, HostGic::V3);
        assert_eq!(gic.distributor, PhysRange::new(0x0800_0000, 0x0801_0000));
        assert_eq!(
            gic.redistributors,
            Some(PhysRange::new(0x080a_0000, 0x0810_0000))
        );
        assert_eq!(gic.cpu_interface, None);
        assert_eq!(info.cpus.len(), 3);
        assert_eq!(info.cpus[2].mpidr, 2);
        assert_eq!(info.timer.virt, Some(27));
        assert_eq!(info.bootargs.as_deref(), Some("hostile"));
        assert_eq!(info.console.unwrap().intid, Some(33));
    }

    fn be32(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn header_and_blocks() {
        let blob = build(&v2_board()).unwrap();
        assert_eq!(be32(&blob, 0), 0xd00d_feed);
        assert_eq!(be32(&blob, 4) as usize, blob.len());
        let (off_struct, off_strings, off_rsv) = (be32(&blob, 8), be32(&blob, 12), be32(&blob, 16));
        assert_eq!(
            (be32(&blob, 20), be32(&blob, 24), be32(&blob, 28)),
            (17, 16, 0)
        );
        let (size_strings, size_struct) = (be32(&blob, 32), be32(&blob, 36));
        assert_eq!(off_rsv % 8, 0);
        assert_eq!(&blob[off_rsv as usize..off_rsv as usize + 16], &[0; 16]);
        assert_eq!(off_struct % 4, 0);
        assert_eq!(off_struct + size_struct, off_strings);
        assert_eq!((off_strings + size_strings) as usize, blob.len());
        const FDT_END: u32 = 9;
        assert_eq!(be32(&blob, (off_strings - 4) as usize), FDT_END);
        // Each property name is stored once.
        let strings = &blob[off_strings as usize..];
        let names: Vec<&[u8]> = strings
            .split(|&b| b == 0)
            .filter(|s| !s.is_empty())
            .collect();
        for (i, n) in names.iter().enumerate() {
            assert!(
                !names[..i].contains(n),
                "{:?} stored twice",
                std::str::from_utf8(n)
            );
        }
        assert!(names.contains(&&b"compatible"[..]));
        assert!(names.contains(&&b"linux,initrd-end"[..]));
    }

    #[test]
    fn build_is_deterministic() {
        assert_eq!(build(&v2_board()), build(&v2_board()));
    }

    #[test]
    fn long_command_line() {
        let long = "x".repeat(3000);
        let mut b = v2_board();
        b.bootargs = Some(&long);
        let dts = dtc(&build(&b).unwrap());
        assert!(dts.contains(&format!("bootargs = \"{long}\";")));
    }

    #[test]
    fn bad_boards_are_errors() {
        let ok = v2_board();
        let v3 = v3_board();
        let cases: Vec<(GuestBoard, FdtError)> = vec![
            (GuestBoard { vcpus: 0, ..ok }, FdtError::NoVcpus),
            (
                GuestBoard { vcpus: 9, ..ok },
                FdtError::TooManyVcpus { vcpus: 9, max: 8 },
            ),
            (
                GuestBoard { vcpus: 65, ..v3 },
                FdtError::TooManyVcpus { vcpus: 65, max: 64 },
            ),
            (GuestBoard { ram_size: 0, ..ok }, FdtError::EmptyRam),
            (
                GuestBoard {
                    ram_base: u64::MAX - 0xfff,
                    ..ok
                },
                FdtError::Overflow { what: "RAM" },
            ),
            (
                GuestBoard {
                    uart: (u64::MAX, 1),
                    ..ok
                },
                FdtError::Overflow { what: "PL011" },
            ),
            (
                GuestBoard {
                    uart: (0x0900_0000, 988),
                    ..ok
                },
                FdtError::BadSpi {
                    what: "PL011",
                    spi: 988,
                },
            ),
            (
                GuestBoard {
                    virtio_mmio: &[(0x0a00_0000, 16), (0x0a00_0200, 5000)],
                    ..ok
                },
                FdtError::BadSpi {
                    what: "virtio-mmio device",
                    spi: 5000,
                },
            ),
            (
                GuestBoard {
                    virtio_mmio: &[(u64::MAX - 0x100, 16)],
                    ..ok
                },
                FdtError::Overflow {
                    what: "virtio-mmio device",
                },
            ),
            (
                GuestBoard {
                    gic: GuestGic::V2 {
                        dist: u64::MAX,
                        cpu: 0,
                    },
                    ..ok
                },
                FdtError::Overflow {
                    what: "GIC distributor",
                },
            ),
            (
                GuestBoard {
                    gic: GuestGic::V2 {
                        dist: 0,
                        cpu: u64::MAX - 0x1000,
                    },
                    ..ok
                },
                FdtError::Overflow {
                    what: "GIC CPU interface",
                },
            ),
            (
                GuestBoard {
                    gic: GuestGic::V3 {
                        dist: 0,
                        redist: u64::MAX - 0x2_0000,
                    },
                    ..v3
                },
                FdtError::Overflow {
                    what: "GIC redistributors",
                },
            ),
            (
                GuestBoard {
                    timer_ppis: [13, 14, 16, 10],
                    ..ok
                },
                FdtError::BadPpi { index: 2, ppi: 16 },
            ),
            (
                GuestBoard {
                    initrd: Some((0x4500_0000, 0x4500_0000)),
                    ..ok
                },
                FdtError::InitrdOutsideRam {
                    start: 0x4500_0000,
                    end: 0x4500_0000,
                },
            ),
            (
                GuestBoard {
                    initrd: Some((0x4600_0000, 0x4500_0000)),
                    ..ok
                },
                FdtError::InitrdOutsideRam {
                    start: 0x4600_0000,
                    end: 0x4500_0000,
                },
            ),
            (
                GuestBoard {
                    initrd: Some((0x3fff_f000, 0x4000_1000)),
                    ..ok
                },
                FdtError::InitrdOutsideRam {
                    start: 0x3fff_f000,
                    end: 0x4000_1000,
                },
            ),
            (
                GuestBoard {
                    initrd: Some((0x4f00_0000, 0x5000_1000)),
                    ..ok
                },
                FdtError::InitrdOutsideRam {
                    start: 0x4f00_0000,
                    end: 0x5000_1000,
                },
            ),
            (
                GuestBoard {
                    bootargs: Some("a\0b"),
                    ..ok
                },
                FdtError::NulInBootargs,
            ),
        ];
        for (board, want) in cases {
            assert_eq!(build(&board), Err(want), "{board:?}");
            assert!(want.to_string().starts_with("guest device tree: "));
        }
        // The edges that are fine.
        build(&GuestBoard {
            initrd: Some((0x4000_0000, 0x5000_0000)),
            ..ok
        })
        .unwrap();
        build(&GuestBoard { vcpus: 64, ..v3 }).unwrap();
        build(&GuestBoard {
            ram_base: u64::MAX - 0x1fff,
            ram_size: 0x1000,
            initrd: None,
            ..ok
        })
        .unwrap();
        assert_eq!(
            GuestBoard::standard(1 << 20, 1, GicVersion::V3, 0..33),
            Err(FdtError::TooManyDevices { count: 33, max: 32 })
        );
        assert_eq!(
            FdtError::InitrdOutsideRam {
                start: 0x10,
                end: 0x20
            }
            .to_string(),
            "guest device tree: initrd [0x10, 0x20) is empty or not inside guest RAM"
        );
    }

    /// Pseudo-random boards, extremes included: `build` never panics, and
    /// every tree it produces reads back through platform discovery.
    #[test]
    fn random_boards_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut pick = move |choices: &[u64]| {
            let r = next();
            if r % 16 == 0 {
                r >> 8
            } else {
                choices[(r as usize >> 3) % choices.len()]
            }
        };
        let slots: Vec<(u64, u32)> = VIRTIO_MMIO_SLOTS.to_vec();
        let words = ["", "pattern", "a\0b", "console=ttyAMA0 root=/dev/ram0"];
        let mut built = 0;
        for i in 0..20_000 {
            let addrs = [
                0x4000_0000,
                0x0800_0000,
                0,
                u64::MAX,
                u64::MAX - 0xfff,
                1 << 48,
            ];
            let ram_base = pick(&addrs);
            let ram_size = pick(&[0, 0x1000, 2 << 20, 256 << 20, u64::MAX]);
            let board = GuestBoard {
                ram_base,
                ram_size,
                vcpus: pick(&[0, 1, 2, 8, 9, 64, 65, u32::MAX as u64]) as u32,
                bootargs: if i % 5 == 0 {
                    None
                } else {
                    Some(words[i % words.len()])
                },
                initrd: if i % 3 == 0 {
                    None
                } else {
                    let s = pick(&[ram_base, ram_base.wrapping_add(0x1000), 0]);
                    Some((
                        s,
                        pick(&[s.wrapping_add(0x1000), s, ram_base.wrapping_add(ram_size)]),
                    ))
                },
                gic: if i % 2 == 0 {
                    GuestGic::V2 {
                        dist: pick(&addrs),
                        cpu: pick(&addrs),
                    }
                } else {
                    GuestGic::V3 {
                        dist: pick(&addrs),
                        redist: pick(&addrs),
                    }
                },
                uart: (pick(&addrs), pick(&[1, 987, 988, u32::MAX as u64]) as u32),
                virtio_mmio: &slots[..i % 4],
                timer_ppis: [13, 14, pick(&[11, 15, 16]) as u32, 10],
            };
            if let Ok(blob) = build(&board) {
                built += 1;
                let found = platform::discover(&blob, 0);
                if board.vcpus as usize > platform::MAX_CPUS {
                    // More CPUs than the host-side reader holds: refused, not truncated.
                    assert!(matches!(
                        found,
                        Err(platform::DiscoveryError::TooMany { .. })
                    ));
                    continue;
                }
                let info = found.unwrap_or_else(|e| panic!("{board:?}: {e}"));
                assert_eq!(
                    &info.ram[..],
                    &[PhysRange::from_base_size(board.ram_base, board.ram_size)]
                );
                assert_eq!(info.cpus.len(), board.vcpus as usize);
                assert_eq!(info.bootargs.as_deref(), board.bootargs);
                assert_eq!(info.initrd, board.initrd.map(|(s, e)| PhysRange::new(s, e)));
            }
        }
        assert!(built > 100, "only {built} random boards were valid");
    }
}
