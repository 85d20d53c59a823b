//! Virtio, device side: what every emulated virtio device shares.
//!
//! This module owns the contract between a device model and the rest of the
//! hypervisor:
//!
//! - [`GuestMemory`], the only way a device touches guest RAM (checked,
//!   IPA-addressed, implemented by the hypervisor over the VM's stage-2
//!   mapping and by tests over a `Vec`);
//! - [`VirtioDevice`] and [`VirtioDeviceIo`], the device model a transport
//!   drives (device ID, features, queues, config space, notifications, reset)
//!   without knowing register offsets;
//! - [`DeviceError`], the typed reason a device stops and asks the driver for a
//!   reset (`DEVICE_NEEDS_RESET`).
//!
//! [`queue`] parses split virtqueues (virtio 1.2 section 2.7); [`mmio`] is the
//! virtio-mmio register interface, version 2 only (section 4.2.2). Devices
//! such as the balloon live in their own modules and depend on this one, never
//! the other way round.
//!
//! Guests are untrusted: every value read from guest memory or written to a
//! register is validated before use, and nothing here panics on guest input.

use core::fmt;

use crate::addr::GuestAddr;
use crate::savestate::{StateError, StateReader, StateWriter};

pub mod mmio;
pub mod queue;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use mmio::{MmioError, MmioTransport, TransportEvent, TransportStats};
pub use queue::{DescChain, Descriptor, QueueError, Virtqueue};

/// VIRTIO_F_VERSION_1: the device is modern (non-legacy) virtio. Every device
/// behind [`MmioTransport`] offers it; a driver that does not accept it is
/// refused at FEATURES_OK.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Guest-physical memory of one VM, as the device may touch it. The hypervisor
/// implements it over the VM's stage-2 mapping; tests implement it over a Vec.
/// Every access is bounds-checked by the implementation; an error means "not
/// guest RAM".
pub trait GuestMemory {
    /// Copy `buf.len()` bytes starting at `ipa` into `buf`. `&mut self`
    /// because the hypervisor may have to back a ballooned page on first
    /// touch.
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError>;
    /// Copy `data` to guest memory starting at `ipa`.
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError>;
    /// Read a little-endian `u16` at `ipa` (one access: the value is
    /// fetched once and then only the copy is used).
    fn read_le16(&mut self, ipa: GuestAddr) -> Result<u16, GuestMemError> {
        let mut b = [0u8; 2];
        self.read(ipa, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }
}

/// A guest memory access that is not entirely inside guest RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestMemError {
    /// First IPA of the refused access.
    pub ipa: GuestAddr,
    /// Its length in bytes.
    pub len: usize,
}

impl fmt::Display for GuestMemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IPA {} (+{} bytes) is not guest RAM",
            Hex(self.ipa.raw()),
            self.len
        )
    }
}

/// Read a little-endian `u16` from guest memory (one access: the value is
/// fetched once and then only the copy is used).
#[inline]
pub(crate) fn read_le16<M: GuestMemory + ?Sized>(
    mem: &mut M,
    ipa: GuestAddr,
) -> Result<u16, GuestMemError> {
    mem.read_le16(ipa)
}

/// A hexadecimal number printed with `_` between groups of four digits
/// (`0x8000_0000`), as IPAs are written in the board documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hex(pub u64);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digits = if self.0 == 0 {
            1
        } else {
            (64 - self.0.leading_zeros()).div_ceil(4)
        };
        f.write_str("0x")?;
        for i in (0..digits).rev() {
            let nibble = (self.0 >> (i * 4)) & 0xf;
            let c = char::from_digit(nibble as u32, 16).unwrap_or('?');
            write!(f, "{c}")?;
            if i != 0 && i % 4 == 0 {
                f.write_str("_")?;
            }
        }
        Ok(())
    }
}

/// A device model driven by a transport ([`MmioTransport`]): identity,
/// features, queues and config space.
///
/// The transport owns the registers, the status state machine, feature
/// negotiation and the virtqueue registers; the device owns its config space
/// and what its queues mean. Devices never see transport register offsets and
/// the transport never interprets device config. What a device does to the VM
/// is in [`VirtioDeviceIo`].
pub trait VirtioDevice {
    /// Short name for messages ("virtio-balloon").
    fn name(&self) -> &'static str;
    /// Virtio device ID (5 for the balloon).
    fn device_id(&self) -> u32;
    /// Feature bits the device offers; must include [`VIRTIO_F_VERSION_1`].
    /// Must not change while the transport exists.
    fn device_features(&self) -> u64;
    /// Number of virtqueues; may depend on the offered features, must not
    /// change while the transport exists.
    fn queue_count(&self) -> usize;
    /// QueueNumMax of `queue` (< [`queue_count`](Self::queue_count)).
    fn queue_max_size(&self, queue: usize) -> u16;
    /// Name of `queue` for messages ("inflateq").
    fn queue_name(&self, queue: usize) -> &'static str;
    /// Read `data.len()` bytes of device config at `offset`. Bytes past the
    /// device's config size read as zero.
    fn config_read(&self, offset: u64, data: &mut [u8]);
    /// The driver wrote `data` at config `offset`. Read-only fields and bytes
    /// past the config size are ignored.
    fn config_write(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK having negotiated `features`.
    fn activate(&mut self, features: u64);
    /// Whether the device changed its own config while processing a queue
    /// (e.g. the balloon ending a free page hint run) and the driver must be
    /// told; reading it clears it. The transport checks it after every
    /// [`VirtioDeviceIo::notify`] and raises the config-change interrupt.
    fn take_config_change(&mut self) -> bool {
        false
    }
    /// Whether a notification of `queue` with nothing available would
    /// change nothing in the device: no state it updates on every
    /// notification, no config change waiting to be taken. The transport's
    /// [`MmioTransport::empty_notify`] is allowed only then; a device that
    /// does not say so (the default) always gets the full notification.
    fn quiet_when_empty(&self, _queue: usize) -> bool {
        false
    }
    /// Whether buffers used on `queue` raise no interrupt by themselves:
    /// its driver polls the used ring (Linux's console writes do), and an
    /// interrupt for each would double the exits of the queue's traffic.
    /// The spec allows it (a device SHOULD, not MUST, notify, section
    /// 2.7.10). The signal is not lost: it goes out with the device's next
    /// interrupt and at [`MmioTransport::flush_deferred`], which the
    /// hypervisor calls every memory tick, for a driver that does wait.
    fn defers_used_signal(&self, _queue: usize) -> bool {
        false
    }
}

/// What a device does to the VM, through `E`: the device's view of the VM,
/// at least its guest memory (the balloon also needs its stage-2 backend).
///
/// The view is passed per call rather than owned by the device, and the
/// trait is generic over it rather than naming one type, so that the
/// hypervisor can hand a short-lived per-VM view (borrowing the VM, any
/// lifetime) that provides everything at once, without the device holding a
/// borrow of the VM or two borrows of it meeting.
pub trait VirtioDeviceIo<E: GuestMemory + ?Sized>: VirtioDevice {
    /// The driver reset the device (status 0): return to the initial state,
    /// undoing through `env` whatever the device did to the VM.
    fn reset(&mut self, env: &mut E);
    /// The driver notified `queue`: process available buffers and return every
    /// one used (or keep it on purpose, documented per device).
    ///
    /// On error the device stops at the offending chain and does not return
    /// it; if the error names a head ([`DeviceError::head`]) the transport
    /// returns it (written length 0) so that a driver waiting for it is not
    /// stuck, then marks the device DEVICE_NEEDS_RESET.
    fn notify(
        &mut self,
        queue: usize,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError>;
}

/// Which virtqueue an error concerns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueId {
    pub index: usize,
    pub name: &'static str,
}

/// A guest error that makes a device stop until the driver resets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError {
    /// The queue it was found on, or `None` for a transport-level error.
    pub queue: Option<QueueId>,
    /// The head of a chain the device consumed but did not return; the
    /// transport returns it with written length 0.
    pub head: Option<u16>,
    pub kind: DeviceErrorKind,
}

impl DeviceError {
    /// A virtqueue-level error on `queue`; the head to return, if any, comes
    /// from the queue error.
    pub fn from_queue(index: usize, name: &'static str, error: QueueError) -> Self {
        DeviceError {
            queue: Some(QueueId { index, name }),
            head: error.head(),
            kind: DeviceErrorKind::Queue(error),
        }
    }

    /// A malformed request: the chain `head` on `queue` was walked correctly
    /// but its content is wrong for this queue.
    pub fn request(index: usize, name: &'static str, head: u16, kind: DeviceErrorKind) -> Self {
        DeviceError {
            queue: Some(QueueId { index, name }),
            head: Some(head),
            kind,
        }
    }

    /// A transport-level protocol error.
    pub fn transport(kind: DeviceErrorKind) -> Self {
        DeviceError {
            queue: None,
            head: None,
            kind,
        }
    }
}

impl DeviceError {
    /// Write the error (the transport keeps the last for the shell).
    pub fn save(&self, w: &mut StateWriter) {
        w.bool(self.queue.is_some());
        w.u64(self.queue.map_or(0, |q| q.index as u64));
        w.bool(self.head.is_some());
        w.u16(self.head.unwrap_or(0));
        let pair = |w: &mut StateWriter, tag: u8, a: u32, b: u32| {
            w.u8(tag);
            w.u32(a);
            w.u32(b);
        };
        match self.kind {
            DeviceErrorKind::Queue(ref e) => {
                w.u8(0);
                e.save(w);
            }
            DeviceErrorKind::UnexpectedWritable { desc } => pair(w, 1, desc.into(), 0),
            DeviceErrorKind::UnexpectedReadable { desc } => pair(w, 2, desc.into(), 0),
            DeviceErrorKind::BadLength { len, multiple_of } => pair(w, 3, len, multiple_of),
            DeviceErrorKind::TooLong { len, max } => pair(w, 4, len, max),
            DeviceErrorKind::WrongLength { len, expected } => pair(w, 5, len, expected),
            DeviceErrorKind::DriverOkWithoutFeaturesOk { status } => pair(w, 6, status, 0),
        }
    }

    /// An error [`DeviceError::save`] wrote, on a device with
    /// `queue_count` queues, named by `queue_name`.
    pub fn restore(
        r: &mut StateReader<'_>,
        queue_count: usize,
        queue_name: impl Fn(usize) -> &'static str,
    ) -> Result<Self, StateError> {
        let on_queue = r.bool("device error queue")?;
        let index = r.u64()?;
        // What is absent is written as 0: one error, one encoding.
        if !on_queue && index != 0 {
            return Err(StateError::Invalid("device error queue"));
        }
        let queue = match on_queue {
            false => None,
            true => {
                let index = usize::try_from(index)
                    .ok()
                    .filter(|&i| i < queue_count)
                    .ok_or(StateError::Invalid("device error queue"))?;
                Some(QueueId {
                    index,
                    name: queue_name(index),
                })
            }
        };
        let has_head = r.bool("device error head")?;
        let head = r.u16()?;
        if !has_head && head != 0 {
            return Err(StateError::Invalid("device error head"));
        }
        let head = has_head.then_some(head);
        let tag = r.u8()?;
        let kind = if tag == 0 {
            DeviceErrorKind::Queue(QueueError::restore(r)?)
        } else {
            let (a, b) = (r.u32()?, r.u32()?);
            let desc =
                || u16::try_from(a).map_err(|_| StateError::Invalid("device error descriptor"));
            if matches!(tag, 1 | 2 | 6) && b != 0 {
                return Err(StateError::Invalid("device error kind"));
            }
            match tag {
                1 => DeviceErrorKind::UnexpectedWritable { desc: desc()? },
                2 => DeviceErrorKind::UnexpectedReadable { desc: desc()? },
                3 => DeviceErrorKind::BadLength {
                    len: a,
                    multiple_of: b,
                },
                4 => DeviceErrorKind::TooLong { len: a, max: b },
                5 => DeviceErrorKind::WrongLength {
                    len: a,
                    expected: b,
                },
                6 => DeviceErrorKind::DriverOkWithoutFeaturesOk { status: a },
                _ => return Err(StateError::Invalid("device error kind")),
            }
        };
        Ok(DeviceError { queue, head, kind })
    }
}

/// What exactly was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// The rings or a descriptor chain are malformed.
    Queue(QueueError),
    /// A device-writable descriptor on a queue that carries only
    /// driver-written buffers.
    UnexpectedWritable { desc: u16 },
    /// A driver-written descriptor on a queue that carries only
    /// device-writable buffers.
    UnexpectedReadable { desc: u16 },
    /// The buffer length is not a multiple of the element size.
    BadLength { len: u32, multiple_of: u32 },
    /// The buffer is longer than the device accepts in one request.
    TooLong { len: u32, max: u32 },
    /// The buffer must be exactly `expected` bytes long.
    WrongLength { len: u32, expected: u32 },
    /// The driver set DRIVER_OK although FEATURES_OK was not accepted.
    DriverOkWithoutFeaturesOk { status: u32 },
}

impl fmt::Display for DeviceErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceErrorKind::Queue(e) => write!(f, "{e}"),
            DeviceErrorKind::UnexpectedWritable { desc } => write!(
                f,
                "descriptor {desc} is device-writable, but this queue takes only driver-written buffers"
            ),
            DeviceErrorKind::UnexpectedReadable { desc } => write!(
                f,
                "descriptor {desc} is driver-written, but this queue takes only device-writable buffers"
            ),
            DeviceErrorKind::BadLength { len, multiple_of } => {
                write!(f, "buffer of {len} bytes is not a multiple of {multiple_of} bytes")
            }
            DeviceErrorKind::TooLong { len, max } => {
                write!(f, "buffer of {len} bytes is longer than the {max} bytes accepted per request")
            }
            DeviceErrorKind::WrongLength { len, expected } => {
                write!(f, "buffer of {len} bytes, but this queue takes buffers of exactly {expected} bytes")
            }
            DeviceErrorKind::DriverOkWithoutFeaturesOk { status } => write!(
                f,
                "driver set DRIVER_OK (status {status:#x}) without the device accepting FEATURES_OK"
            ),
        }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(q) = &self.queue {
            write!(f, "{}: ", q.name)?;
        }
        write!(f, "{}", self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;

    extern crate alloc;

    #[test]
    fn hex_groups_digits() {
        assert_eq!(format!("{}", Hex(0)), "0x0");
        assert_eq!(format!("{}", Hex(0x1234)), "0x1234");
        assert_eq!(format!("{}", Hex(0x8000_0000)), "0x8000_0000");
        assert_eq!(format!("{}", Hex(0x1_0000)), "0x1_0000");
        assert_eq!(format!("{}", Hex(u64::MAX)), "0xffff_ffff_ffff_ffff");
    }

    #[test]
    fn errors_read_well() {
        let e = GuestMemError {
            ipa: GuestAddr::new(0x8000_0000),
            len: 16,
        };
        assert_eq!(
            format!("{e}"),
            "IPA 0x8000_0000 (+16 bytes) is not guest RAM"
        );
        let e = DeviceError::from_queue(
            0,
            "inflateq",
            QueueError::DescriptorNotRam {
                head: 3,
                index: 3,
                ipa: GuestAddr::new(0x8000_0000),
                len: 4096,
            },
        );
        assert_eq!(
            format!("{e}"),
            "inflateq: descriptor 3 points outside guest RAM (IPA 0x8000_0000, 4096 bytes)"
        );
        assert_eq!(e.head, Some(3));
    }
}
