//! What the guest learns from its device tree.

use crate::arch;
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

/// The board, as the device tree describes it.
pub struct Board {
    pub ram: Range,
    pub uart: Option<u64>,
    /// virtio-mmio slots: (base, size).
    pub virtio: [(u64, u64); MAX],
    pub virtio_count: usize,
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
                board.virtio_count += 1;
            }
        }
        Ok(board)
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
