//! Split virtqueues, device side (virtio 1.2 section 2.7).
//!
//! This module owns the device's view of one queue: its configuration as the
//! driver wrote it through the transport, the device's cursors
//! (`last_avail_idx`, `used_idx`), walking descriptor chains out of the
//! available ring ([`Virtqueue::pop`]) and returning them through the used ring
//! ([`Virtqueue::push_used`]).
//!
//! What the device offers, and so what the parser accepts:
//!
//! - no `VIRTIO_F_INDIRECT_DESC`: a descriptor with `VIRTQ_DESC_F_INDIRECT` is
//!   an error;
//! - no `VIRTIO_F_EVENT_IDX`: `used_event`/`avail_event` are never read or
//!   written, and the device never sets `VIRTQ_USED_F_NO_NOTIFY`, so a driver
//!   notifies after every batch it adds;
//! - no `VIRTIO_F_RING_PACKED`: split rings only, whose size must be a power of
//!   two (the free-running 16-bit indexes wrap onto `ring[idx % size]` only
//!   then).
//!
//! Every guest-controlled value (ring index, descriptor fields) is read once
//! into a local and validated there; nothing is re-read after validation. The
//! walk of a chain is bounded by the queue size, so a loop ends as an error,
//! not as a hang.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;
use core::sync::atomic::{fence, Ordering};

use super::{read_le16, GuestMemError, GuestMemory, Hex};
use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};

/// Largest queue size the split ring format allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// The chain continues in `next`.
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
/// The buffer is device-writable (else driver-written, device-readable).
pub const VIRTQ_DESC_F_WRITE: u16 = 2;
/// The buffer holds an indirect descriptor table (not offered, rejected).
pub const VIRTQ_DESC_F_INDIRECT: u16 = 4;

const DESC_SIZE: u64 = 16;

/// The three areas of a split virtqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Area {
    /// Descriptor table (QueueDesc), 16 bytes per entry, 16-byte aligned.
    Descriptors,
    /// Driver area: the available ring (QueueDriver), 2-byte aligned.
    Avail,
    /// Device area: the used ring (QueueDevice), 4-byte aligned.
    Used,
}

impl Area {
    /// Alignment the spec requires of the area's address.
    pub fn align(self) -> u64 {
        match self {
            Area::Descriptors => 16,
            Area::Avail => 2,
            Area::Used => 4,
        }
    }

    /// Size in bytes of the part of the area this device uses for a queue of
    /// `size` entries (no event-idx fields, as EVENT_IDX is not offered).
    pub fn len(self, size: u16) -> u64 {
        let n = u64::from(size);
        match self {
            Area::Descriptors => DESC_SIZE * n,
            Area::Avail => 4 + 2 * n,
            Area::Used => 4 + 8 * n,
        }
    }
}

impl fmt::Display for Area {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Area::Descriptors => "descriptor table",
            Area::Avail => "available ring",
            Area::Used => "used ring",
        })
    }
}

/// A malformed queue or chain. Variants with a `head` were found after the
/// chain's head index was consumed and validated: that head can still be
/// returned to the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueueError {
    /// The queue is not enabled (QueueReady is 0).
    NotReady,
    /// QueueNum is zero, above QueueNumMax, or not a power of two.
    BadSize { num: u32, max: u16 },
    /// An area's address is not aligned as the spec requires.
    Misaligned { area: Area, ipa: GuestAddr },
    /// An area's end overflows the address space.
    AreaOverflow { area: Area, ipa: GuestAddr },
    /// A ring access hit memory that is not guest RAM.
    RingNotRam { area: Area, err: GuestMemError },
    /// `avail.idx` is more than `size` entries ahead of the device.
    AvailTooFarAhead {
        avail_idx: u16,
        last_avail_idx: u16,
        size: u16,
    },
    /// The available ring names a head descriptor index >= size.
    HeadOutOfRange { head: u16, size: u16 },
    /// A descriptor's `next` is >= size.
    NextOutOfRange {
        head: u16,
        index: u16,
        next: u16,
        size: u16,
    },
    /// The chain has more descriptors than the queue (it loops).
    ChainTooLong { head: u16, size: u16 },
    /// A descriptor uses VIRTQ_DESC_F_INDIRECT, which the device does not offer.
    Indirect { head: u16, index: u16 },
    /// A descriptor's `addr + len` overflows the address space.
    DescriptorOverflow {
        head: u16,
        index: u16,
        ipa: GuestAddr,
        len: u32,
    },
    /// The chain's lengths add up to more than `u32::MAX` bytes.
    ChainLengthOverflow { head: u16 },
    /// A driver-written descriptor follows a device-writable one.
    ReadableAfterWritable { head: u16, index: u16 },
    /// A buffer the device read or wrote is not entirely guest RAM.
    DescriptorNotRam {
        head: u16,
        index: u16,
        ipa: GuestAddr,
        len: u32,
    },
    /// Device bug: a used element for a head outside the queue.
    UsedHeadOutOfRange { head: u16, size: u16 },
    /// Device bug: a used element although no chain is in flight.
    NothingInFlight,
}

impl Area {
    fn code(self) -> u8 {
        match self {
            Area::Descriptors => 0,
            Area::Avail => 1,
            Area::Used => 2,
        }
    }

    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        match r.u8()? {
            0 => Ok(Area::Descriptors),
            1 => Ok(Area::Avail),
            2 => Ok(Area::Used),
            _ => Err(StateError::Invalid("virtqueue area")),
        }
    }
}

impl QueueError {
    /// Write the error (a device's last, kept for the shell): a tag per
    /// kind, then its fields.
    pub fn save(&self, w: &mut StateWriter) {
        match *self {
            QueueError::NotReady => w.u8(0),
            QueueError::BadSize { num, max } => {
                w.u8(1);
                w.u32(num);
                w.u16(max);
            }
            QueueError::Misaligned { area, ipa } | QueueError::AreaOverflow { area, ipa } => {
                w.u8(if matches!(self, QueueError::Misaligned { .. }) {
                    2
                } else {
                    3
                });
                w.u8(area.code());
                w.u64(ipa.raw());
            }
            QueueError::RingNotRam { area, err } => {
                w.u8(4);
                w.u8(area.code());
                w.u64(err.ipa.raw());
                w.u64(err.len as u64);
            }
            QueueError::AvailTooFarAhead {
                avail_idx,
                last_avail_idx,
                size,
            } => {
                w.u8(5);
                for v in [avail_idx, last_avail_idx, size] {
                    w.u16(v);
                }
            }
            QueueError::HeadOutOfRange { head, size } => {
                w.u8(6);
                w.u16(head);
                w.u16(size);
            }
            QueueError::NextOutOfRange {
                head,
                index,
                next,
                size,
            } => {
                w.u8(7);
                for v in [head, index, next, size] {
                    w.u16(v);
                }
            }
            QueueError::ChainTooLong { head, size } => {
                w.u8(8);
                w.u16(head);
                w.u16(size);
            }
            QueueError::Indirect { head, index } => {
                w.u8(9);
                w.u16(head);
                w.u16(index);
            }
            QueueError::DescriptorOverflow {
                head,
                index,
                ipa,
                len,
            }
            | QueueError::DescriptorNotRam {
                head,
                index,
                ipa,
                len,
            } => {
                w.u8(if matches!(self, QueueError::DescriptorOverflow { .. }) {
                    10
                } else {
                    13
                });
                w.u16(head);
                w.u16(index);
                w.u64(ipa.raw());
                w.u32(len);
            }
            QueueError::ChainLengthOverflow { head } => {
                w.u8(11);
                w.u16(head);
            }
            QueueError::ReadableAfterWritable { head, index } => {
                w.u8(12);
                w.u16(head);
                w.u16(index);
            }
            QueueError::UsedHeadOutOfRange { head, size } => {
                w.u8(14);
                w.u16(head);
                w.u16(size);
            }
            QueueError::NothingInFlight => w.u8(15),
        }
    }

    /// An error [`QueueError::save`] wrote.
    pub fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        Ok(match r.u8()? {
            0 => QueueError::NotReady,
            1 => QueueError::BadSize {
                num: r.u32()?,
                max: r.u16()?,
            },
            tag @ (2 | 3) => {
                let area = Area::restore(r)?;
                let ipa = GuestAddr::new(r.u64()?);
                if tag == 2 {
                    QueueError::Misaligned { area, ipa }
                } else {
                    QueueError::AreaOverflow { area, ipa }
                }
            }
            4 => QueueError::RingNotRam {
                area: Area::restore(r)?,
                err: GuestMemError {
                    ipa: GuestAddr::new(r.u64()?),
                    len: usize::try_from(r.u64()?)
                        .map_err(|_| StateError::Invalid("virtqueue error length"))?,
                },
            },
            5 => QueueError::AvailTooFarAhead {
                avail_idx: r.u16()?,
                last_avail_idx: r.u16()?,
                size: r.u16()?,
            },
            6 => QueueError::HeadOutOfRange {
                head: r.u16()?,
                size: r.u16()?,
            },
            7 => QueueError::NextOutOfRange {
                head: r.u16()?,
                index: r.u16()?,
                next: r.u16()?,
                size: r.u16()?,
            },
            8 => QueueError::ChainTooLong {
                head: r.u16()?,
                size: r.u16()?,
            },
            9 => QueueError::Indirect {
                head: r.u16()?,
                index: r.u16()?,
            },
            tag @ (10 | 13) => {
                let (head, index, ipa, len) =
                    (r.u16()?, r.u16()?, GuestAddr::new(r.u64()?), r.u32()?);
                if tag == 10 {
                    QueueError::DescriptorOverflow {
                        head,
                        index,
                        ipa,
                        len,
                    }
                } else {
                    QueueError::DescriptorNotRam {
                        head,
                        index,
                        ipa,
                        len,
                    }
                }
            }
            11 => QueueError::ChainLengthOverflow { head: r.u16()? },
            12 => QueueError::ReadableAfterWritable {
                head: r.u16()?,
                index: r.u16()?,
            },
            14 => QueueError::UsedHeadOutOfRange {
                head: r.u16()?,
                size: r.u16()?,
            },
            15 => QueueError::NothingInFlight,
            _ => return Err(StateError::Invalid("virtqueue error kind")),
        })
    }

    /// The head of the chain being processed, if the error was found after it
    /// was consumed and validated.
    pub fn head(&self) -> Option<u16> {
        match *self {
            QueueError::NextOutOfRange { head, .. }
            | QueueError::ChainTooLong { head, .. }
            | QueueError::Indirect { head, .. }
            | QueueError::DescriptorOverflow { head, .. }
            | QueueError::ChainLengthOverflow { head }
            | QueueError::ReadableAfterWritable { head, .. }
            | QueueError::DescriptorNotRam { head, .. } => Some(head),
            _ => None,
        }
    }
}

impl fmt::Display for QueueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueueError::NotReady => f.write_str("queue used while not ready"),
            QueueError::BadSize { num, max } => {
                write!(f, "queue size {num} is not a power of two between 1 and {max}")
            }
            QueueError::Misaligned { area, ipa } => {
                write!(f, "{area} at IPA {} is not {}-byte aligned", Hex(ipa.raw()), area.align())
            }
            QueueError::AreaOverflow { area, ipa } => {
                write!(f, "{area} at IPA {} runs past the end of the address space", Hex(ipa.raw()))
            }
            QueueError::RingNotRam { area, err } => write!(f, "{area}: {err}"),
            QueueError::AvailTooFarAhead { avail_idx, last_avail_idx, size } => write!(
                f,
                "available index {avail_idx} is more than the queue size {size} ahead of {last_avail_idx}"
            ),
            QueueError::HeadOutOfRange { head, size } => {
                write!(f, "available ring names descriptor {head}, but the queue has {size}")
            }
            QueueError::NextOutOfRange { index, next, size, .. } => {
                write!(f, "descriptor {index} chains to descriptor {next}, but the queue has {size}")
            }
            QueueError::ChainTooLong { head, size } => {
                write!(f, "chain from descriptor {head} is longer than the queue size {size} (a loop?)")
            }
            QueueError::Indirect { index, .. } => write!(
                f,
                "descriptor {index} is indirect, but VIRTIO_F_INDIRECT_DESC is not offered"
            ),
            QueueError::DescriptorOverflow { index, ipa, len, .. } => write!(
                f,
                "descriptor {index} (IPA {}, {len} bytes) runs past the end of the address space",
                Hex(ipa.raw())
            ),
            QueueError::ChainLengthOverflow { head } => {
                write!(f, "chain from descriptor {head} is longer than 4 GiB in total")
            }
            QueueError::ReadableAfterWritable { index, .. } => write!(
                f,
                "descriptor {index} is driver-written but follows a device-writable one"
            ),
            QueueError::DescriptorNotRam { index, ipa, len, .. } => write!(
                f,
                "descriptor {index} points outside guest RAM (IPA {}, {len} bytes)",
                Hex(ipa.raw())
            ),
            QueueError::UsedHeadOutOfRange { head, size } => {
                write!(f, "device returned descriptor {head} of a queue of {size}")
            }
            QueueError::NothingInFlight => f.write_str("device returned a buffer it never took"),
        }
    }
}

/// One descriptor of a chain, copied out of guest memory and validated:
/// `ipa + len` does not overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Index in the descriptor table (for messages).
    pub index: u16,
    pub ipa: GuestAddr,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub writable: bool,
}

/// A descriptor chain popped from the available ring: the driver-written
/// descriptors first, then the device-writable ones (the parser enforces that
/// order), at most the queue size of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DescChain {
    head: u16,
    descs: Vec<Descriptor>,
    readable_len: u32,
    writable_len: u32,
}

impl DescChain {
    /// Index of the head descriptor: what [`Virtqueue::push_used`] takes.
    pub fn head(&self) -> u16 {
        self.head
    }

    /// The descriptors, in chain order.
    pub fn descriptors(&self) -> &[Descriptor] {
        &self.descs
    }

    /// Total bytes of the driver-written descriptors.
    pub fn readable_len(&self) -> u32 {
        self.readable_len
    }

    /// Total bytes of the device-writable descriptors.
    pub fn writable_len(&self) -> u32 {
        self.writable_len
    }

    /// Copy the driver-written bytes `[offset, offset + buf.len())` of the
    /// chain (as if its readable descriptors were one buffer) into `buf`.
    /// Returns how many bytes were copied: less than `buf.len()` only at the
    /// end of the readable part. The caller bounds the work by `buf`.
    pub fn read_readable_at<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        offset: u32,
        buf: &mut [u8],
    ) -> Result<usize, QueueError> {
        self.copy(mem, false, offset, Io::Read(buf))
    }

    /// [`read_readable_at`](Self::read_readable_at) from offset 0.
    pub fn read_readable<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        buf: &mut [u8],
    ) -> Result<usize, QueueError> {
        self.read_readable_at(mem, 0, buf)
    }

    /// Copy `data` into the device-writable part of the chain, from its
    /// start. Returns how many bytes were written: less than `data.len()` if
    /// the writable part is shorter.
    pub fn write_writable<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        data: &[u8],
    ) -> Result<usize, QueueError> {
        self.write_writable_at(mem, 0, data)
    }

    /// Copy `data` into the device-writable part of the chain at `offset`
    /// (as if its writable descriptors were one buffer). Returns how many
    /// bytes were written: less than `data.len()` at the end of that part.
    pub fn write_writable_at<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        offset: u32,
        data: &[u8],
    ) -> Result<usize, QueueError> {
        self.copy(mem, true, offset, Io::Write(data))
    }

    fn copy<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        writable: bool,
        offset: u32,
        mut io: Io<'_, '_>,
    ) -> Result<usize, QueueError> {
        let want = io.len();
        let mut done = 0usize;
        // Bytes of this direction still to skip before `offset`.
        let mut skip = u64::from(offset);
        for d in self.descs.iter().filter(|d| d.writable == writable) {
            if done == want {
                break;
            }
            let len = u64::from(d.len);
            if skip >= len {
                skip -= len;
                continue;
            }
            // Both fit in usize: `len - skip` <= u32::MAX and `want - done` is a slice length.
            let n = core::cmp::min(len - skip, (want - done) as u64) as usize;
            // Cannot overflow: the parser checked `ipa + len`, and `skip < len`.
            let ipa = d.ipa + skip;
            let res = match &mut io {
                Io::Read(buf) => mem.read(ipa, &mut buf[done..done + n]),
                Io::Write(data) => mem.write(ipa, &data[done..done + n]),
            };
            res.map_err(|_| QueueError::DescriptorNotRam {
                head: self.head,
                index: d.index,
                ipa: d.ipa,
                len: d.len,
            })?;
            done += n;
            skip = 0;
        }
        Ok(done)
    }
}

enum Io<'a, 'b> {
    Read(&'a mut [u8]),
    Write(&'b [u8]),
}

impl Io<'_, '_> {
    fn len(&self) -> usize {
        match self {
            Io::Read(b) => b.len(),
            Io::Write(d) => d.len(),
        }
    }
}

/// One split virtqueue, as the device sees it.
#[derive(Clone, Debug)]
pub struct Virtqueue {
    max_size: u16,
    /// QueueNum as written; validated when the queue is enabled.
    num: u32,
    /// The validated size while ready.
    size: u16,
    ready: bool,
    desc: GuestAddr,
    avail: GuestAddr,
    used: GuestAddr,
    last_avail_idx: u16,
    used_idx: u16,
    /// Chains popped (head consumed) and not yet returned.
    in_flight: u32,
    /// Used elements were added since the transport last looked.
    used_signal: bool,
}

impl Virtqueue {
    /// A queue whose QueueNumMax is `max_size` (clamped to the spec's 32768).
    pub fn new(max_size: u16) -> Self {
        Virtqueue {
            max_size: max_size.min(MAX_QUEUE_SIZE),
            num: 0,
            size: 0,
            ready: false,
            desc: GuestAddr::new(0),
            avail: GuestAddr::new(0),
            used: GuestAddr::new(0),
            last_avail_idx: 0,
            used_idx: 0,
            in_flight: 0,
            used_signal: false,
        }
    }

    /// Back to the state after device reset: not ready, nothing configured.
    pub fn reset(&mut self) {
        *self = Virtqueue::new(self.max_size);
    }

    pub fn max_size(&self) -> u16 {
        self.max_size
    }

    /// The size while ready, 0 otherwise.
    pub fn size(&self) -> u16 {
        self.size
    }

    pub fn ready(&self) -> bool {
        self.ready
    }

    /// Address of `area` as configured.
    pub fn area(&self, area: Area) -> GuestAddr {
        match area {
            Area::Descriptors => self.desc,
            Area::Avail => self.avail,
            Area::Used => self.used,
        }
    }

    pub fn last_avail_idx(&self) -> u16 {
        self.last_avail_idx
    }

    pub fn used_idx(&self) -> u16 {
        self.used_idx
    }

    /// Chains popped and not yet returned through the used ring.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Set QueueNum. Checked when the queue is enabled.
    pub fn set_num(&mut self, num: u32) {
        self.num = num;
    }

    /// Set the low or high 32 bits of an area's address.
    pub fn set_area_half(&mut self, area: Area, high: bool, value: u32) {
        let slot = match area {
            Area::Descriptors => &mut self.desc,
            Area::Avail => &mut self.avail,
            Area::Used => &mut self.used,
        };
        let old = slot.raw();
        *slot = GuestAddr::new(if high {
            (old & 0xffff_ffff) | (u64::from(value) << 32)
        } else {
            (old & !0xffff_ffff) | u64::from(value)
        });
    }

    /// The driver wrote 1 to QueueReady: validate the configuration and start
    /// from index 0. Checks the size, each area's alignment and that its
    /// first and last bytes are guest RAM (every later access is checked
    /// again, so a hole in the middle is caught on use).
    pub fn enable<M: GuestMemory + ?Sized>(&mut self, mem: &mut M) -> Result<(), QueueError> {
        let num = self.num;
        let size = match u16::try_from(num) {
            Ok(s) if s != 0 && s <= self.max_size && s.is_power_of_two() => s,
            _ => {
                return Err(QueueError::BadSize {
                    num,
                    max: self.max_size,
                })
            }
        };
        for area in [Area::Descriptors, Area::Avail, Area::Used] {
            let ipa = self.area(area);
            if !ipa.raw().is_multiple_of(area.align()) {
                return Err(QueueError::Misaligned { area, ipa });
            }
            let last = ipa
                .checked_add(area.len(size) - 1)
                .ok_or(QueueError::AreaOverflow { area, ipa })?;
            let mut probe = [0u8; 1];
            for at in [ipa, last] {
                mem.read(at, &mut probe)
                    .map_err(|err| QueueError::RingNotRam { area, err })?;
            }
        }
        self.size = size;
        self.ready = true;
        self.last_avail_idx = 0;
        self.used_idx = 0;
        self.in_flight = 0;
        self.used_signal = false;
        Ok(())
    }

    /// Write the queue's state (its QueueNumMax is the device's, not saved).
    pub fn save(&self, w: &mut StateWriter) {
        w.u32(self.num);
        w.u16(self.size);
        w.bool(self.ready);
        for area in [self.desc, self.avail, self.used] {
            w.u64(area.raw());
        }
        w.u16(self.last_avail_idx);
        w.u16(self.used_idx);
        w.u32(self.in_flight);
        w.bool(self.used_signal);
    }

    /// A queue [`Virtqueue::save`] wrote, behind a device whose QueueNumMax
    /// is `max_size`: a ready queue with the size and ring placement
    /// [`Virtqueue::enable`] accepts (whether the rings are in RAM is for
    /// each access to say, as it is for a live queue), a queue not ready
    /// with nothing in flight, never more in flight than its size.
    pub fn restore(r: &mut StateReader<'_>, max_size: u16) -> Result<Self, StateError> {
        let mut q = Virtqueue::new(max_size);
        q.num = r.u32()?;
        q.size = r.u16()?;
        q.ready = r.bool("virtqueue ready")?;
        q.desc = GuestAddr::new(r.u64()?);
        q.avail = GuestAddr::new(r.u64()?);
        q.used = GuestAddr::new(r.u64()?);
        q.last_avail_idx = r.u16()?;
        q.used_idx = r.u16()?;
        q.in_flight = r.u32()?;
        q.used_signal = r.bool("virtqueue used signal")?;
        if q.ready {
            let size = q.size;
            if u32::from(size) != q.num || size == 0 || size > q.max_size || !size.is_power_of_two()
            {
                return Err(StateError::Invalid("virtqueue size"));
            }
            for area in [Area::Descriptors, Area::Avail, Area::Used] {
                let ipa = q.area(area);
                if !ipa.raw().is_multiple_of(area.align())
                    || ipa.checked_add(area.len(size) - 1).is_none()
                {
                    return Err(StateError::Invalid("virtqueue ring placement"));
                }
            }
        } else if q.size != 0 {
            return Err(StateError::Invalid("virtqueue size"));
        }
        if q.in_flight > u32::from(q.size) {
            return Err(StateError::Invalid("virtqueue chains in flight"));
        }
        Ok(q)
    }

    /// The driver wrote 0 to QueueReady. Chains in flight are forgotten.
    pub fn disable(&mut self) {
        self.ready = false;
        self.size = 0;
        self.in_flight = 0;
    }

    /// Whether used elements were added since the last call (the transport
    /// turns that into the used-buffer interrupt).
    pub fn take_used_signal(&mut self) -> bool {
        core::mem::take(&mut self.used_signal)
    }

    /// Whether used elements were added since the transport last looked,
    /// without taking the signal ([`take_used_signal`](Self::take_used_signal)).
    pub fn used_signal_pending(&self) -> bool {
        self.used_signal
    }

    /// Whether the driver has certainly made nothing new available: the
    /// queue is ready and avail.idx, read once through `mem` exactly as
    /// [`pop`](Self::pop) reads it, equals the index the device reached.
    /// False for anything else (new buffers, an index too far ahead, a ring
    /// `mem` cannot read): then `pop` must look, and reports any error.
    #[inline]
    pub fn nothing_available<M: GuestMemory + ?Sized>(&self, mem: &mut M) -> bool {
        self.ready && read_le16(mem, self.avail + 2).is_ok_and(|idx| idx == self.last_avail_idx)
    }

    /// Take the next available chain, if any.
    ///
    /// Once the head index has been read the slot is consumed, whatever
    /// follows: an error is never retried on the same entry. A validated
    /// head counts as in flight (also on a later error, which then carries
    /// it) until [`push_used`](Self::push_used) returns it.
    pub fn pop<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &mut M,
    ) -> Result<Option<DescChain>, QueueError> {
        if !self.ready {
            return Err(QueueError::NotReady);
        }
        let size = self.size;
        // avail.idx is read once; the entries it publishes are read after an
        // acquire fence, pairing with the driver's write barrier before it
        // bumped the index.
        let avail_idx = read_le16(mem, self.avail + 2).map_err(|err| QueueError::RingNotRam {
            area: Area::Avail,
            err,
        })?;
        let pending = avail_idx.wrapping_sub(self.last_avail_idx);
        if pending == 0 {
            return Ok(None);
        }
        if pending > size {
            return Err(QueueError::AvailTooFarAhead {
                avail_idx,
                last_avail_idx: self.last_avail_idx,
                size,
            });
        }
        fence(Ordering::Acquire);
        let slot = u64::from(self.last_avail_idx & (size - 1));
        // No overflow: enable() checked the whole area.
        let head =
            read_le16(mem, self.avail + 4 + 2 * slot).map_err(|err| QueueError::RingNotRam {
                area: Area::Avail,
                err,
            })?;
        self.last_avail_idx = self.last_avail_idx.wrapping_add(1);
        if head >= size {
            return Err(QueueError::HeadOutOfRange { head, size });
        }
        self.in_flight += 1;
        self.walk(mem, head).map(Some)
    }

    fn walk<M: GuestMemory + ?Sized>(
        &self,
        mem: &mut M,
        head: u16,
    ) -> Result<DescChain, QueueError> {
        let size = self.size;
        let mut chain = DescChain {
            head,
            descs: Vec::new(),
            readable_len: 0,
            writable_len: 0,
        };
        let mut index = head;
        loop {
            if chain.descs.len() >= usize::from(size) {
                return Err(QueueError::ChainTooLong { head, size });
            }
            // One 16-byte read; every field is taken from this copy only.
            let mut raw = [0u8; DESC_SIZE as usize];
            mem.read(self.desc + DESC_SIZE * u64::from(index), &mut raw)
                .map_err(|err| QueueError::RingNotRam {
                    area: Area::Descriptors,
                    err,
                })?;
            // The decode boundary: the guest's raw `addr` becomes an IPA.
            let ipa = GuestAddr::new(u64::from_le_bytes([
                raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
            ]));
            let len = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
            let flags = u16::from_le_bytes([raw[12], raw[13]]);
            let next = u16::from_le_bytes([raw[14], raw[15]]);

            if flags & VIRTQ_DESC_F_INDIRECT != 0 {
                return Err(QueueError::Indirect { head, index });
            }
            if ipa.checked_add(u64::from(len)).is_none() {
                return Err(QueueError::DescriptorOverflow {
                    head,
                    index,
                    ipa,
                    len,
                });
            }
            let writable = flags & VIRTQ_DESC_F_WRITE != 0;
            // The parser keeps the order, so the last descriptor tells whether
            // a device-writable one came before.
            if !writable && chain.descs.last().is_some_and(|d| d.writable) {
                return Err(QueueError::ReadableAfterWritable { head, index });
            }
            // The whole chain must fit the used element's 32-bit length.
            chain
                .readable_len
                .checked_add(chain.writable_len)
                .and_then(|t| t.checked_add(len))
                .ok_or(QueueError::ChainLengthOverflow { head })?;
            if writable {
                chain.writable_len += len;
            } else {
                chain.readable_len += len;
            }
            chain.descs.push(Descriptor {
                index,
                ipa,
                len,
                writable,
            });
            if flags & VIRTQ_DESC_F_NEXT == 0 {
                return Ok(chain);
            }
            if next >= size {
                return Err(QueueError::NextOutOfRange {
                    head,
                    index,
                    next,
                    size,
                });
            }
            index = next;
        }
    }

    /// Return chain `head` to the driver, `written` bytes of it filled.
    pub fn push_used<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &mut M,
        head: u16,
        written: u32,
    ) -> Result<(), QueueError> {
        if !self.ready {
            return Err(QueueError::NotReady);
        }
        if head >= self.size {
            return Err(QueueError::UsedHeadOutOfRange {
                head,
                size: self.size,
            });
        }
        if self.in_flight == 0 {
            return Err(QueueError::NothingInFlight);
        }
        let slot = u64::from(self.used_idx & (self.size - 1));
        let mut elem = [0u8; 8];
        elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        elem[4..].copy_from_slice(&written.to_le_bytes());
        let ring_err = |err| QueueError::RingNotRam {
            area: Area::Used,
            err,
        };
        mem.write(self.used + 4 + 8 * slot, &elem)
            .map_err(ring_err)?;
        // The element must be visible before the index that publishes it.
        fence(Ordering::Release);
        let idx = self.used_idx.wrapping_add(1);
        mem.write(self.used + 2, &idx.to_le_bytes())
            .map_err(ring_err)?;
        self.used_idx = idx;
        self.in_flight -= 1;
        self.used_signal = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{DriverQueue, VecMemory};
    use alloc::vec;
    use proptest::prelude::*;

    const BASE: u64 = 0x4000_0000;

    fn setup(size: u16) -> (VecMemory, Virtqueue, DriverQueue) {
        let mut mem = VecMemory::new(BASE, 0x10000);
        let dq = DriverQueue::new(size, BASE, BASE + 0x1000, BASE + 0x2000);
        let mut q = Virtqueue::new(256);
        dq.configure(&mut q);
        q.enable(&mut mem).unwrap();
        mem.clear_log();
        (mem, q, dq)
    }

    #[test]
    fn pop_push_roundtrip() {
        let (mut mem, mut q, mut dq) = setup(8);
        assert_eq!(q.pop(&mut mem).unwrap(), None);
        let head = dq.add(
            &mut mem,
            &[(BASE + 0x4000, 10, false), (BASE + 0x5000, 20, true)],
        );
        let chain = q.pop(&mut mem).unwrap().unwrap();
        assert_eq!(chain.head(), head);
        assert_eq!(chain.readable_len(), 10);
        assert_eq!(chain.writable_len(), 20);
        assert_eq!(q.in_flight(), 1);
        mem.write(GuestAddr::new(BASE + 0x4000), b"0123456789")
            .unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(chain.read_readable_at(&mut mem, 8, &mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], b"89");
        assert_eq!(chain.write_writable(&mut mem, b"hi").unwrap(), 2);
        q.push_used(&mut mem, head, 2).unwrap();
        assert_eq!(dq.take_used(&mut mem), vec![(u32::from(head), 2)]);
        assert!(q.take_used_signal());
        assert!(!q.take_used_signal());
        assert_eq!(
            q.push_used(&mut mem, head, 0),
            Err(QueueError::NothingInFlight)
        );
    }

    #[test]
    fn read_spans_descriptors() {
        let (mut mem, mut q, mut dq) = setup(8);
        dq.add(
            &mut mem,
            &[(BASE + 0x4000, 3, false), (BASE + 0x5000, 5, false)],
        );
        mem.write(GuestAddr::new(BASE + 0x4000), b"abc").unwrap();
        mem.write(GuestAddr::new(BASE + 0x5000), b"defgh").unwrap();
        let chain = q.pop(&mut mem).unwrap().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(chain.read_readable(&mut mem, &mut buf).unwrap(), 8);
        assert_eq!(&buf, b"abcdefgh");
        let mut buf = [0u8; 4];
        assert_eq!(chain.read_readable_at(&mut mem, 2, &mut buf).unwrap(), 4);
        assert_eq!(&buf, b"cdef");
    }

    #[test]
    fn enable_checks_configuration() {
        let mut mem = VecMemory::new(BASE, 0x10000);
        let mut q = Virtqueue::new(128);
        let dq = DriverQueue::new(8, BASE, BASE + 0x1000, BASE + 0x2000);
        for (num, ok) in [(0, false), (3, false), (256, false), (128, true), (1, true)] {
            q.reset();
            dq.configure(&mut q);
            q.set_num(num);
            assert_eq!(q.enable(&mut mem).is_ok(), ok, "size {num}");
        }
        q.reset();
        dq.configure(&mut q);
        q.set_area_half(Area::Descriptors, false, (BASE + 8) as u32);
        assert_eq!(
            q.enable(&mut mem),
            Err(QueueError::Misaligned {
                area: Area::Descriptors,
                ipa: GuestAddr::new(BASE + 8)
            })
        );
        q.reset();
        dq.configure(&mut q);
        q.set_area_half(Area::Used, false, (BASE + 0xfffc) as u32);
        assert!(matches!(
            q.enable(&mut mem),
            Err(QueueError::RingNotRam {
                area: Area::Used,
                ..
            })
        ));
        q.reset();
        dq.configure(&mut q);
        q.set_area_half(Area::Avail, true, 0xffff_ffff);
        q.set_area_half(Area::Avail, false, 0xffff_fffe);
        assert!(matches!(
            q.enable(&mut mem),
            Err(QueueError::AreaOverflow {
                area: Area::Avail,
                ..
            })
        ));
    }

    #[test]
    fn malformed_chains() {
        // A loop: 0 -> 1 -> 0.
        let (mut mem, mut q, mut dq) = setup(4);
        dq.write_desc(&mut mem, 0, BASE + 0x4000, 4, VIRTQ_DESC_F_NEXT, 1);
        dq.write_desc(&mut mem, 1, BASE + 0x4000, 4, VIRTQ_DESC_F_NEXT, 0);
        dq.publish(&mut mem, 0);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::ChainTooLong { head: 0, size: 4 })
        );
        assert_eq!(q.in_flight(), 1);
        q.push_used(&mut mem, 0, 0).unwrap();

        dq.write_desc(&mut mem, 2, BASE + 0x4000, 4, VIRTQ_DESC_F_NEXT, 9);
        dq.publish(&mut mem, 2);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::NextOutOfRange {
                head: 2,
                index: 2,
                next: 9,
                size: 4
            })
        );
        q.push_used(&mut mem, 2, 0).unwrap();

        dq.publish(&mut mem, 7);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::HeadOutOfRange { head: 7, size: 4 })
        );
        assert_eq!(q.in_flight(), 0);

        dq.write_desc(&mut mem, 3, BASE, 4, VIRTQ_DESC_F_INDIRECT, 0);
        dq.publish(&mut mem, 3);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::Indirect { head: 3, index: 3 })
        );
        q.push_used(&mut mem, 3, 0).unwrap();

        dq.write_desc(&mut mem, 1, u64::MAX - 2, 4, 0, 0);
        dq.publish(&mut mem, 1);
        assert!(matches!(
            q.pop(&mut mem),
            Err(QueueError::DescriptorOverflow { head: 1, .. })
        ));
        q.push_used(&mut mem, 1, 0).unwrap();

        dq.write_desc(
            &mut mem,
            0,
            BASE,
            4,
            VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_NEXT,
            1,
        );
        dq.write_desc(&mut mem, 1, BASE, 4, 0, 0);
        dq.publish(&mut mem, 0);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::ReadableAfterWritable { head: 0, index: 1 })
        );
        q.push_used(&mut mem, 0, 0).unwrap();

        dq.write_desc(&mut mem, 0, BASE, u32::MAX, VIRTQ_DESC_F_NEXT, 1);
        dq.write_desc(&mut mem, 1, BASE, 1, 0, 0);
        dq.publish(&mut mem, 0);
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::ChainLengthOverflow { head: 0 })
        );
        q.push_used(&mut mem, 0, 0).unwrap();

        // A buffer outside RAM is found when it is read.
        dq.write_desc(&mut mem, 0, 0x8000_0000, 4096, 0, 0);
        dq.publish(&mut mem, 0);
        let chain = q.pop(&mut mem).unwrap().unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(
            chain.read_readable(&mut mem, &mut buf),
            Err(QueueError::DescriptorNotRam {
                head: 0,
                index: 0,
                ipa: GuestAddr::new(0x8000_0000),
                len: 4096
            })
        );
    }

    #[test]
    fn avail_index_too_far_ahead() {
        let (mut mem, mut q, _dq) = setup(4);
        mem.write(GuestAddr::new(BASE + 0x1000 + 2), &5u16.to_le_bytes())
            .unwrap();
        assert_eq!(
            q.pop(&mut mem),
            Err(QueueError::AvailTooFarAhead {
                avail_idx: 5,
                last_avail_idx: 0,
                size: 4
            })
        );
    }

    #[test]
    fn indexes_wrap() {
        let (mut mem, mut q, mut dq) = setup(2);
        for i in 0..70_000u32 {
            let head = dq.add(&mut mem, &[(BASE + 0x4000, 4, false)]);
            let chain = q.pop(&mut mem).unwrap().unwrap();
            assert_eq!(chain.head(), head);
            q.push_used(&mut mem, head, i).unwrap();
            assert_eq!(dq.take_used(&mut mem), vec![(u32::from(head), i)]);
            if i == 1000 {
                mem.clear_log();
            }
        }
        assert_eq!(q.used_idx(), (70_000u32 % 65536) as u16);
    }

    #[test]
    fn a_saved_queue_no_driver_could_set_up_is_refused() {
        let mut mem = VecMemory::new(BASE, 0x4000);
        let mut q = Virtqueue::new(16);
        q.set_num(8);
        q.set_area_half(Area::Descriptors, false, BASE as u32);
        q.set_area_half(Area::Avail, false, (BASE + 0x1000) as u32);
        q.set_area_half(Area::Used, false, (BASE + 0x2000) as u32);
        q.enable(&mut mem).expect("a valid queue");
        let mut w = StateWriter::default();
        q.save(&mut w);
        let saved = w.into_bytes();
        let restore = |bytes: &[u8], max: u16| {
            let mut r = StateReader::new(bytes);
            Virtqueue::restore(&mut r, max)
        };
        assert!(restore(&saved, 16).is_ok());
        // Offsets: num 0..4, size 4..6, ready 6, rings 7..31, indexes
        // 31..35, in flight 35..39, used signal 39.
        let with = |at: usize, bytes: &[u8]| {
            let mut bad = saved.clone();
            bad[at..at + bytes.len()].copy_from_slice(bytes);
            bad
        };
        let size = StateError::Invalid("virtqueue size");
        assert_eq!(restore(&saved, 4).unwrap_err(), size, "above QueueNumMax");
        assert_eq!(
            restore(&with(0, &[6]), 16).unwrap_err(),
            size,
            "num and size differ"
        );
        assert_eq!(
            restore(&with(0, &[6, 0, 0, 0, 6]), 16).unwrap_err(),
            size,
            "not a power of two"
        );
        assert_eq!(
            restore(&with(6, &[0]), 16).unwrap_err(),
            size,
            "a size while not ready"
        );
        assert_eq!(
            restore(&with(6, &[2]), 16).unwrap_err(),
            StateError::Invalid("virtqueue ready")
        );
        assert_eq!(
            restore(&with(23, &[2]), 16).unwrap_err(),
            StateError::Invalid("virtqueue ring placement"),
            "a used ring not 4-byte aligned"
        );
        assert_eq!(
            restore(&with(35, &[9]), 16).unwrap_err(),
            StateError::Invalid("virtqueue chains in flight")
        );
        assert_eq!(
            restore(&saved[..39], 16).unwrap_err(),
            StateError::Truncated
        );
    }

    proptest! {
        /// Random descriptor tables and available rings over random queue
        /// placement: no panic, every access the device makes is either
        /// inside guest RAM or refused, the device writes only its used ring,
        /// every popped head is returned exactly once, and an error is final.
        #[test]
        fn random_rings(
            size_log in 0u32..5,
            desc_off in 0u64..0x3000,
            avail_off in 0u64..0x3000,
            used_off in 0u64..0x3000,
            table in proptest::collection::vec(any::<u8>(), 16 * 16),
            ring in proptest::collection::vec(any::<u8>(), 2 * 16),
            avail_idx in any::<u16>(),
            steps in 1usize..40,
        ) {
            let size = 1u16 << size_log;
            let mut mem = VecMemory::new(BASE, 0x4000);
            let desc = BASE + (desc_off & !15);
            let avail = BASE + (avail_off & !1);
            let used = BASE + (used_off & !3);
            let _ = mem.write(GuestAddr::new(desc), &table[..16 * usize::from(size)]);
            let _ = mem.write(GuestAddr::new(avail + 4), &ring[..2 * usize::from(size)]);
            let _ = mem.write(GuestAddr::new(avail + 2), &avail_idx.to_le_bytes());
            let mut q = Virtqueue::new(16);
            q.set_num(u32::from(size));
            q.set_area_half(Area::Descriptors, false, desc as u32);
            q.set_area_half(Area::Avail, false, avail as u32);
            q.set_area_half(Area::Used, false, used as u32);
            if q.enable(&mut mem).is_err() {
                return Ok(());
            }
            mem.clear_log();
            let used_area = used..used + Area::Used.len(size);
            let mut returned = 0u32;
            let mut popped = 0u32;
            for _ in 0..steps {
                // Every state the rings bring the queue to is saved and
                // restored as it is.
                let mut w = StateWriter::default();
                q.save(&mut w);
                let bytes = w.into_bytes();
                let mut r = StateReader::new(&bytes);
                let back = Virtqueue::restore(&mut r, 16)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(r.finish(), Ok(()));
                prop_assert_eq!(format!("{back:?}"), format!("{q:?}"));
                match q.pop(&mut mem) {
                    Ok(None) => break,
                    Ok(Some(chain)) => {
                        popped += 1;
                        prop_assert!(chain.descriptors().len() <= usize::from(size));
                        prop_assert!(chain.descriptors().iter().all(|d| d.index < size));
                        let mut buf = [0u8; 64];
                        let _ = chain.read_readable(&mut mem, &mut buf);
                        prop_assert!(q.push_used(&mut mem, chain.head(), 0).is_ok());
                        returned += 1;
                    }
                    Err(e) => {
                        if let Some(h) = e.head() {
                            popped += 1;
                            prop_assert!(h < size);
                            prop_assert!(q.push_used(&mut mem, h, 0).is_ok());
                            returned += 1;
                        }
                        break;
                    }
                }
            }
            prop_assert_eq!(popped, returned);
            prop_assert_eq!(q.in_flight(), 0);
            for &(ipa, len) in mem.writes() {
                prop_assert!(used_area.contains(&ipa) && ipa + len as u64 <= used_area.end,
                    "device wrote {ipa:#x}+{len} outside its used ring");
            }
        }
    }
}
