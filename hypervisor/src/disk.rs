//! The board's disk: a virtio-blk device behind one of the board's
//! virtio-mmio slots (on QEMU `virt`, the image `cargo xtask run`
//! attaches), driven by the hypervisor itself with the virtio-drivers
//! crate. It owns the device and its DMA frames (the hypervisor's,
//! `FrameUse::Allocated`, from the frame table). Guests never see it: no
//! guest's stage-2 map or device tree has the board's virtio-mmio slots.
//!
//! Requests are polled, one at a time, under the disk's lock: the only
//! user is the shell's snapshot commands, in the shell's failure domain;
//! the device's interrupt is never enabled. Above it, [`Disk`] is all the
//! snapshot store sees, so that another device (the Pi 4's SD card) can
//! follow. Target only (the frame table behind `run::frames`, and MMIO).

use spin::Mutex;
use virtio_drivers::device::blk::{VirtIOBlk, SECTOR_SIZE};
use virtio_drivers::transport::mmio::MmioTransport;
use virtio_drivers::transport::DeviceType;

use crate::dma::FrameHal;
use crate::snapshot::store::{Disk, DiskError};

/// The board's disk once found.
pub struct BoardDisk {
    blk: VirtIOBlk<FrameHal, MmioTransport<'static>>,
    /// Where its slot is, for `info disk`.
    pub regs: platform::PhysRange,
}

impl Disk for BoardDisk {
    fn sectors(&self) -> u64 {
        self.blk.capacity()
    }

    fn read(&mut self, sector: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        let block = usize::try_from(sector).map_err(|_| DiskError("sector out of range"))?;
        self.blk
            .read_blocks(block, buf)
            .map_err(|_| DiskError("the disk refused a read"))
    }

    fn write(&mut self, sector: u64, buf: &[u8]) -> Result<(), DiskError> {
        let block = usize::try_from(sector).map_err(|_| DiskError("sector out of range"))?;
        self.blk
            .write_blocks(block, buf)
            .map_err(|_| DiskError("the disk refused a write"))
    }
}

const _: () = assert!(SECTOR_SIZE == crate::snapshot::store::SECTOR);

static DISK: Mutex<Option<BoardDisk>> = Mutex::new(None);

/// What [`probe`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskInfo {
    pub regs: platform::PhysRange,
    pub sectors: u64,
}

/// Looks behind each of the board's virtio-mmio slots for a block device
/// and takes the first for the board (the others stay untouched). Called
/// once at boot, before any VM runs.
pub fn probe(slots: &[platform::VirtioMmioSlot]) -> Option<DiskInfo> {
    let (transport, regs) = crate::dma::find_device(slots, None, DeviceType::Block)?;
    let blk = VirtIOBlk::<FrameHal, _>::new(transport).ok()?;
    let info = DiskInfo {
        regs,
        sectors: blk.capacity(),
    };
    *DISK.lock() = Some(BoardDisk { blk, regs });
    Some(info)
}

/// Runs `f` on the board's disk, if it has one.
pub fn with_disk<R>(f: impl FnOnce(&mut BoardDisk) -> R) -> Option<R> {
    DISK.lock().as_mut().map(f)
}

/// `f` on the board's disk under its lock, or on `None` if it has none.
pub fn with_disk_or_none<R>(f: impl FnOnce(Option<&mut BoardDisk>) -> R) -> R {
    f(DISK.lock().as_mut())
}
