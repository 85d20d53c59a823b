//! What the guest learns from its device tree.

use crate::arch;
use fdt::node::FdtNode;
use fdt::Fdt;

/// Most virtio-mmio slots and reserved ranges remembered.
const MAX: usize = 32;

/// An address range `[start, end)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Range {
    pub start: u64,
    pub end: u64,
}

impl Range {
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start < end && start < self.end
    }
}

/// An interrupt as the device tree gives it (three cells of the GIC binding).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Irq {
    /// The GIC interrupt ID: SPI n is 32 + n, PPI n is 16 + n.
    pub intid: u32,
    /// Edge-triggered (flags 1 or 2) rather than level-sensitive (4 or 8).
    pub edge: bool,
}

impl Irq {
    /// Decodes one `<type number flags>` specifier.
    fn from_cells(cells: [u32; 3]) -> Option<Irq> {
        let [kind, number, flags] = cells;
        let intid = match kind {
            0 if number < 988 => 32 + number,
            1 if number < 16 => 16 + number,
            _ => return None,
        };
        Some(Irq {
            intid,
            edge: flags & 0b0011 != 0,
        })
    }
}

/// The interrupt controller, if the tree has one this guest can drive.
#[derive(Clone, Copy, Debug)]
pub enum GicInfo {
    /// `arm,cortex-a15-gic` (or `arm,gic-400`): distributor and memory-mapped
    /// CPU interface.
    V2 {
        distributor: u64,
        cpu_interface: u64,
    },
    /// `arm,gic-v3`: distributor and the first redistributor region (the CPU
    /// interface is the ICC system registers).
    V3 {
        distributor: u64,
        redistributors: u64,
        redistributors_size: u64,
    },
}

/// The board, as the device tree describes it.
pub struct Board {
    pub ram: Range,
    pub uart: Option<u64>,
    /// virtio-mmio slots: (base, size).
    pub virtio: [(u64, u64); MAX],
    pub virtio_count: usize,
    /// The interrupt of each virtio-mmio slot, if its node names one.
    pub virtio_irq: [Option<Irq>; MAX],
    pub gic: Option<GicInfo>,
    /// The virtual timer's interrupt (the third of the timer node's four).
    pub virtual_timer: Option<Irq>,
    /// Memory the page pool must not touch: the image, the device tree,
    /// /memreserve/ entries and /reserved-memory nodes.
    pub reserved: [Range; MAX],
    pub reserved_count: usize,
    bootargs: [u8; 128],
    bootargs_len: usize,
}

impl Board {
    /// Parses the device tree at `dtb`.
    ///
    /// # Safety
    ///
    /// `dtb` must be the address of a flattened device tree that stays valid
    /// and unmodified while it is parsed (the caller keeps it out of the pool).
    pub unsafe fn parse(dtb: u64) -> Result<Board, &'static str> {
        // SAFETY: the caller's promise.
        let fdt = unsafe { Fdt::from_ptr(dtb as *const u8) }.map_err(|_| "bad device tree")?;
        let mut board = Board {
            ram: Range::default(),
            uart: None,
            virtio: [(0, 0); MAX],
            virtio_count: 0,
            virtio_irq: [None; MAX],
            gic: None,
            virtual_timer: None,
            reserved: [Range::default(); MAX],
            reserved_count: 0,
            bootargs: [0; 128],
            bootargs_len: 0,
        };
        let region = fdt
            .memory()
            .regions()
            .find(|r| r.size.unwrap_or(0) > 0)
            .ok_or("no RAM in /memory")?;
        let start = region.starting_address as u64;
        board.ram = Range {
            start,
            end: start + region.size.unwrap_or(0) as u64,
        };

        let (image_start, image_end) = arch::image_range();
        board.reserve(image_start, image_end);
        board.reserve(dtb, dtb + fdt.total_size() as u64);
        for r in fdt.memory_reservations() {
            let start = r.address() as u64;
            board.reserve(start, start + r.size() as u64);
        }
        if let Some(node) = fdt.find_node("/reserved-memory") {
            for child in node.children() {
                for r in child.reg().into_iter().flatten() {
                    let start = r.starting_address as u64;
                    board.reserve(start, start + r.size.unwrap_or(0) as u64);
                }
            }
        }

        let args = fdt.chosen().bootargs().unwrap_or("").as_bytes();
        let len = args.len().min(board.bootargs.len());
        board.bootargs[..len].copy_from_slice(&args[..len]);
        board.bootargs_len = len;

        board.uart = fdt
            .find_compatible(&["arm,pl011"])
            .and_then(|n| n.reg()?.next())
            .map(|r| r.starting_address as u64);

        for node in fdt.all_nodes() {
            let is_virtio = node
                .compatible()
                .is_some_and(|c| c.all().any(|s| s == "virtio,mmio"));
            if !is_virtio || board.virtio_count == MAX {
                continue;
            }
            if let Some(r) = node.reg().and_then(|mut r| r.next()) {
                board.virtio[board.virtio_count] =
                    (r.starting_address as u64, r.size.unwrap_or(0x200) as u64);
                board.virtio_irq[board.virtio_count] = interrupt(&node, 0);
                board.virtio_count += 1;
            }
        }

        board.gic = gic(&fdt);
        board.virtual_timer = fdt
            .find_compatible(&["arm,armv8-timer", "arm,armv7-timer"])
            .and_then(|n| interrupt(&n, 2));
        Ok(board)
    }

    /// The interrupt of virtio-mmio slot `base`, if the tree names one.
    pub fn virtio_irq_of(&self, base: u64) -> Option<Irq> {
        let index = self.virtio_slots().iter().position(|s| s.0 == base)?;
        self.virtio_irq[index]
    }

    fn reserve(&mut self, start: u64, end: u64) {
        if self.reserved_count < MAX && end > start {
            self.reserved[self.reserved_count] = Range { start, end };
            self.reserved_count += 1;
        }
    }

    /// Whether `[start, end)` touches reserved memory.
    pub fn is_reserved(&self, start: u64, end: u64) -> bool {
        self.reserved[..self.reserved_count]
            .iter()
            .any(|r| r.overlaps(start, end))
    }

    /// /chosen/bootargs, or "" (truncated to 128 bytes).
    pub fn bootargs(&self) -> &str {
        core::str::from_utf8(&self.bootargs[..self.bootargs_len]).unwrap_or("")
    }

    pub fn virtio_slots(&self) -> &[(u64, u64)] {
        &self.virtio[..self.virtio_count]
    }
}

/// The `index`th specifier of a node's `interrupts` (three cells each: this
/// guest knows only the GIC binding).
fn interrupt(node: &FdtNode, index: usize) -> Option<Irq> {
    let value = node.property("interrupts")?.value;
    let cell = |i: usize| -> Option<u32> {
        let bytes = value.get(4 * i..4 * i + 4)?;
        Some(u32::from_be_bytes(bytes.try_into().ok()?))
    };
    let first = 3 * index;
    Irq::from_cells([cell(first)?, cell(first + 1)?, cell(first + 2)?])
}

/// The GIC node, if there is one with three interrupt cells and the
/// registers its binding requires.
fn gic(fdt: &Fdt) -> Option<GicInfo> {
    const V2: [&str; 2] = ["arm,cortex-a15-gic", "arm,gic-400"];
    const V3: [&str; 1] = ["arm,gic-v3"];
    let node = fdt.find_compatible(&[V2[0], V2[1], V3[0]])?;
    let cells = node.property("#interrupt-cells")?.as_usize()?;
    if cells != 3 {
        return None;
    }
    let mut reg = node.reg()?;
    let first = reg.next()?;
    let second = reg.next()?;
    let is_v3 = node
        .compatible()
        .is_some_and(|c| c.all().any(|s| V3.contains(&s)));
    Some(if is_v3 {
        GicInfo::V3 {
            distributor: first.starting_address as u64,
            redistributors: second.starting_address as u64,
            redistributors_size: second.size.unwrap_or(0) as u64,
        }
    } else {
        GicInfo::V2 {
            distributor: first.starting_address as u64,
            cpu_interface: second.starting_address as u64,
        }
    })
}
