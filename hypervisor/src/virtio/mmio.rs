//! The virtio-mmio transport, version 2 ("modern") only (virtio 1.2 section
//! 4.2.2), device side.
//!
//! This module owns the register window of one device: decoding offsets and
//! access widths, feature negotiation, the device status state machine, queue
//! configuration registers, the interrupt status and the config generation.
//! It hands config-space accesses to the device uninterpreted and hands queue
//! notifications to [`VirtioDeviceIo::notify`].
//!
//! Rules it enforces, all against untrusted guest values:
//!
//! - registers below 0x100 take aligned 32-bit accesses only; the config space
//!   (0x100..0x200) takes aligned 1-, 2- and 4-byte accesses; anything else is
//!   an [`MmioError`] for the hypervisor to turn into an abort (or ignore);
//! - the driver may accept only offered features and must accept
//!   VIRTIO_F_VERSION_1; otherwise FEATURES_OK does not stick (the driver
//!   reads the status back and gives up, as the spec prescribes);
//! - queue registers of a ready queue, driver features after FEATURES_OK and
//!   attempts to clear status bits (other than by writing 0) are ignored and
//!   counted;
//! - a guest error found by the transport (bad queue configuration,
//!   DRIVER_OK without FEATURES_OK) or by the device sets DEVICE_NEEDS_RESET,
//!   raises the config-change interrupt if DRIVER_OK was set, and stops all
//!   processing until the driver writes 0 to Status. The write returns
//!   [`TransportEvent::NeedsReset`] naming the device and the reason.
//!
//! Notifications that arrive before DRIVER_OK are remembered and processed
//! when DRIVER_OK is set (Linux may kick a queue it primed during probe).
//!
//! Interrupts are not delivered by this module: the line level is
//! [`MmioTransport::interrupt_pending`], which the owner checks after every
//! write and after [`MmioTransport::config_changed`].

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

use crate::register_access::{check_access, AccessFault, UP_TO_WORD};
use crate::savestate::{SaveState, StateError, StateReader, StateWriter};

use super::queue::{Area, Virtqueue};
use super::{
    DeviceError, DeviceErrorKind, GuestMemory, QueueId, VirtioDevice, VirtioDeviceIo,
    VIRTIO_F_VERSION_1,
};

// Register offsets (virtio 1.2 table 4.1).
pub const MAGIC_VALUE: u64 = 0x000;
pub const VERSION: u64 = 0x004;
pub const DEVICE_ID: u64 = 0x008;
pub const VENDOR_ID: u64 = 0x00c;
pub const DEVICE_FEATURES: u64 = 0x010;
pub const DEVICE_FEATURES_SEL: u64 = 0x014;
pub const DRIVER_FEATURES: u64 = 0x020;
pub const DRIVER_FEATURES_SEL: u64 = 0x024;
pub const QUEUE_SEL: u64 = 0x030;
pub const QUEUE_NUM_MAX: u64 = 0x034;
pub const QUEUE_NUM: u64 = 0x038;
pub const QUEUE_READY: u64 = 0x044;
pub const QUEUE_NOTIFY: u64 = 0x050;
pub const INTERRUPT_STATUS: u64 = 0x060;
pub const INTERRUPT_ACK: u64 = 0x064;
pub const STATUS: u64 = 0x070;
pub const QUEUE_DESC_LOW: u64 = 0x080;
pub const QUEUE_DESC_HIGH: u64 = 0x084;
pub const QUEUE_DRIVER_LOW: u64 = 0x090;
pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
pub const SHM_SEL: u64 = 0x0ac;
pub const SHM_LEN_LOW: u64 = 0x0b0;
pub const SHM_LEN_HIGH: u64 = 0x0b4;
pub const SHM_BASE_LOW: u64 = 0x0b8;
pub const SHM_BASE_HIGH: u64 = 0x0bc;
pub const CONFIG_GENERATION: u64 = 0x0fc;
/// Start of the device config space.
pub const CONFIG: u64 = 0x100;
/// Size of one device's register window (the guest board spaces devices 0x200 apart).
pub const WINDOW_SIZE: u64 = 0x200;

/// "virt" in little-endian ASCII.
pub const MAGIC: u32 = 0x7472_6976;
/// "TIDL" in little-endian ASCII.
pub const VENDOR: u32 = 0x4c44_4954;

// Device status bits (virtio 1.2 section 2.1).
pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_DEVICE_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;
/// The status bits a driver may set.
const DRIVER_STATUS_BITS: u32 =
    STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK | STATUS_FEATURES_OK | STATUS_FAILED;

/// InterruptStatus: a queue has new used buffers.
pub const INT_USED_BUFFER: u32 = 1;
/// InterruptStatus: the device configuration (or status) changed.
pub const INT_CONFIG_CHANGE: u32 = 2;

/// Device-specific feature bits (0..=23 and 50..=63): whatever a device
/// offers there is passed on. Of the reserved transport range only
/// VERSION_1 is implemented here (no indirect descriptors, event index,
/// packed rings, notification data, queue reset, ...).
const DEVICE_FEATURE_MASK: u64 = 0x00ff_ffff | (!0u64 << 50);

/// An access the register window does not accept. The hypervisor decides
/// what the guest sees (an injected abort, or the access ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmioError {
    /// Width is not 1, 2 or 4 bytes.
    BadWidth { offset: u64, width: u8 },
    /// A config-space access not aligned to its width, or crossing the end of
    /// the window.
    Unaligned { offset: u64, width: u8 },
    /// A register below 0x100 accessed other than as an aligned 32-bit word.
    NotWord { offset: u64, width: u8 },
    /// No register at this offset.
    Unknown { offset: u64 },
    /// Write to a read-only register.
    ReadOnly { offset: u64, register: &'static str },
    /// Read of a write-only register.
    WriteOnly { offset: u64, register: &'static str },
}

impl fmt::Display for MmioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MmioError::BadWidth { offset, width } => write!(
                f,
                "{width}-byte access at offset {:#x}: virtio-mmio takes 1-, 2- or 4-byte accesses",
                offset
            ),
            MmioError::Unaligned { offset, width } => {
                write!(f, "{width}-byte config access at offset {offset:#x} is not aligned to its width")
            }
            MmioError::NotWord { offset, width } => write!(
                f,
                "{width}-byte access at offset {offset:#x}: registers below 0x100 take aligned 32-bit accesses only"
            ),
            MmioError::Unknown { offset } => write!(f, "no virtio-mmio register at offset {offset:#x}"),
            MmioError::ReadOnly { offset, register } => {
                write!(f, "write to read-only register {register} (offset {offset:#x})")
            }
            MmioError::WriteOnly { offset, register } => {
                write!(f, "read of write-only register {register} (offset {offset:#x})")
            }
        }
    }
}

/// What a register write caused, for the owner to act on or print. The
/// interrupt line level is always [`MmioTransport::interrupt_pending`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// Nothing the owner needs to know.
    None,
    /// Used buffers were returned: InterruptStatus bit 0 is set.
    Interrupt,
    /// The driver set DRIVER_OK with these features.
    Activated { features: u64 },
    /// The driver reset the device (wrote 0 to Status).
    Reset,
    /// A guest error: the device now shows DEVICE_NEEDS_RESET and does
    /// nothing until reset.
    NeedsReset {
        device: &'static str,
        error: DeviceError,
    },
}

impl TransportEvent {
    /// The event, if it is worth a console line (reset, activation, needs
    /// reset); `None` for the frequent ones (nothing, used buffers).
    pub fn message(&self) -> Option<&Self> {
        match self {
            TransportEvent::None | TransportEvent::Interrupt => None,
            _ => Some(self),
        }
    }
}

impl fmt::Display for TransportEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportEvent::None => f.write_str("no event"),
            TransportEvent::Interrupt => f.write_str("used buffers returned"),
            TransportEvent::Activated { features } => {
                write!(f, "driver ready, features {features:#x}")
            }
            TransportEvent::Reset => f.write_str("reset by the driver"),
            TransportEvent::NeedsReset { device, error } => {
                write!(f, "{device} needs reset: {error}")
            }
        }
    }
}

/// The layout version of a transport's saved state.
const TRANSPORT_STATE_VERSION: u8 = 1;

/// Transport counters, for the shell and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// QueueNotify writes.
    pub notifications: u64,
    /// Notifications not acted on: unknown or not-ready queue, device stopped
    /// (NEEDS_RESET or FAILED).
    pub notifications_ignored: u64,
    /// Guest errors that set DEVICE_NEEDS_RESET.
    pub device_errors: u64,
    /// Resets by the driver.
    pub resets: u64,
    /// Accesses refused with an [`MmioError`].
    pub bad_accesses: u64,
    /// Writes ignored (queue registers of a ready queue, features after
    /// FEATURES_OK, clearing status bits, unknown QueueReady values).
    pub ignored_writes: u64,
    /// FEATURES_OK refused because the driver accepted un-offered features or
    /// not VERSION_1.
    pub features_refused: u64,
    /// Times a new InterruptStatus bit was set.
    pub interrupts: u64,
}

/// One virtio-mmio device: the register window and the device model behind it.
pub struct MmioTransport<D: VirtioDevice> {
    device: D,
    /// Features offered: the device's, filtered (see [`DEVICE_FEATURE_MASK`]).
    offered: u64,
    queues: Vec<Virtqueue>,
    /// Notifications received before DRIVER_OK, per queue.
    pending: Vec<bool>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    /// The driver wrote a nonzero word for features 64 and up (never offered).
    driver_features_beyond_64: bool,
    queue_sel: u32,
    interrupt_status: u32,
    config_generation: u32,
    stats: TransportStats,
    last_error: Option<DeviceError>,
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// Put `device` behind a register window, in the reset state.
    pub fn new(device: D) -> Self {
        let offered = (device.device_features() & DEVICE_FEATURE_MASK) | VIRTIO_F_VERSION_1;
        let queues = (0..device.queue_count())
            .map(|q| Virtqueue::new(device.queue_max_size(q)))
            .collect();
        let pending = alloc::vec![false; device.queue_count()];
        MmioTransport {
            device,
            offered,
            queues,
            pending,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            driver_features_beyond_64: false,
            queue_sel: 0,
            interrupt_status: 0,
            config_generation: 0,
            stats: TransportStats::default(),
            last_error: None,
        }
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// Write the transport's state and its device's ([`SaveState`]).
    pub fn save(&self, w: &mut StateWriter)
    where
        D: SaveState,
    {
        w.u8(TRANSPORT_STATE_VERSION);
        self.device.save(w);
        w.u64(self.offered);
        w.u64(self.queues.len() as u64);
        for (queue, pending) in self.queues.iter().zip(&self.pending) {
            queue.save(w);
            w.bool(*pending);
        }
        for reg in [
            self.status,
            self.device_features_sel,
            self.driver_features_sel,
        ] {
            w.u32(reg);
        }
        w.u64(self.driver_features);
        w.bool(self.driver_features_beyond_64);
        for reg in [
            self.queue_sel,
            self.interrupt_status,
            self.config_generation,
        ] {
            w.u32(reg);
        }
        let s = &self.stats;
        for n in [
            s.notifications,
            s.notifications_ignored,
            s.device_errors,
            s.resets,
            s.bad_accesses,
            s.ignored_writes,
            s.features_refused,
            s.interrupts,
        ] {
            w.u64(n);
        }
        w.bool(self.last_error.is_some());
        if let Some(e) = &self.last_error {
            e.save(w);
        }
    }

    /// A transport [`MmioTransport::save`] wrote: its device restored
    /// first, then what the transport offered checked against what that
    /// device offers, a queue per queue of the device, status bits a
    /// driver and the device can set, features accepted only among those
    /// offered.
    pub fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError>
    where
        D: SaveState,
    {
        r.version("virtio-mmio transport", TRANSPORT_STATE_VERSION)?;
        let mut t = MmioTransport::new(D::restore(r)?);
        if r.u64()? != t.offered {
            return Err(StateError::Invalid("virtio features offered"));
        }
        if r.u64()? != t.queues.len() as u64 {
            return Err(StateError::Invalid("virtqueue count"));
        }
        for q in 0..t.queues.len() {
            t.queues[q] = Virtqueue::restore(r, t.device.queue_max_size(q))?;
            t.pending[q] = r.bool("virtio notification pending")?;
        }
        t.status = r.masked_u32(
            DRIVER_STATUS_BITS | STATUS_DEVICE_NEEDS_RESET,
            "virtio status",
        )?;
        t.device_features_sel = r.u32()?;
        t.driver_features_sel = r.u32()?;
        t.driver_features = r.u64()?;
        if t.status & STATUS_FEATURES_OK != 0 && t.driver_features & !t.offered != 0 {
            return Err(StateError::Invalid("virtio features accepted"));
        }
        t.driver_features_beyond_64 = r.bool("virtio features beyond 64")?;
        t.queue_sel = r.u32()?;
        t.interrupt_status = r.masked_u32(
            INT_USED_BUFFER | INT_CONFIG_CHANGE,
            "virtio interrupt status",
        )?;
        t.config_generation = r.u32()?;
        t.stats = TransportStats {
            notifications: r.count("virtio transport counter")?,
            notifications_ignored: r.count("virtio transport counter")?,
            device_errors: r.count("virtio transport counter")?,
            resets: r.count("virtio transport counter")?,
            bad_accesses: r.count("virtio transport counter")?,
            ignored_writes: r.count("virtio transport counter")?,
            features_refused: r.count("virtio transport counter")?,
            interrupts: r.count("virtio transport counter")?,
        };
        if r.bool("virtio device error")? {
            let device = &t.device;
            t.last_error = Some(DeviceError::restore(r, t.queues.len(), |q| {
                device.queue_name(q)
            })?);
        }
        Ok(t)
    }

    /// The device, for its owner (e.g. to change config, then call
    /// [`config_changed`](Self::config_changed)).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    pub fn queues(&self) -> &[Virtqueue] {
        &self.queues
    }

    /// Features offered to the driver.
    pub fn offered_features(&self) -> u64 {
        self.offered
    }

    /// Features negotiated: the driver's, once FEATURES_OK was accepted; 0 before.
    pub fn negotiated_features(&self) -> u64 {
        if self.status & STATUS_FEATURES_OK != 0 {
            self.driver_features
        } else {
            0
        }
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub fn needs_reset(&self) -> bool {
        self.status & STATUS_DEVICE_NEEDS_RESET != 0
    }

    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    /// The level of the device's interrupt line.
    pub fn interrupt_pending(&self) -> bool {
        self.interrupt_status != 0
    }

    pub fn config_generation(&self) -> u32 {
        self.config_generation
    }

    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    /// The error that set DEVICE_NEEDS_RESET most recently (kept across
    /// resets, for the shell).
    pub fn last_error(&self) -> Option<&DeviceError> {
        self.last_error.as_ref()
    }

    /// The device owner changed device config: bump ConfigGeneration so the
    /// driver rereads consistently, and raise the config-change interrupt if
    /// the driver is live. Returns whether the interrupt was raised. Before
    /// DRIVER_OK no interrupt is sent (the driver reads the config when it
    /// starts anyway).
    pub fn config_changed(&mut self) -> bool {
        self.config_generation = self.config_generation.wrapping_add(1);
        if self.status & STATUS_DRIVER_OK != 0 && !self.needs_reset() {
            self.raise(INT_CONFIG_CHANGE);
            true
        } else {
            false
        }
    }

    fn raise(&mut self, bit: u32) {
        if self.interrupt_status & bit == 0 {
            self.stats.interrupts += 1;
        }
        self.interrupt_status |= bit;
    }

    fn selected_queue(&mut self) -> Option<&mut Virtqueue> {
        let sel = usize::try_from(self.queue_sel).ok()?;
        self.queues.get_mut(sel)
    }

    /// The device is stopped: NEEDS_RESET, or the driver gave up (FAILED).
    fn stopped(&self) -> bool {
        self.status & (STATUS_DEVICE_NEEDS_RESET | STATUS_FAILED) != 0
    }

    /// A guest read of `width` bytes at `offset` in the window.
    pub fn read(&mut self, offset: u64, width: u8) -> Result<u32, MmioError> {
        let r = self.read_inner(offset, width);
        if r.is_err() {
            self.stats.bad_accesses += 1;
        }
        r
    }

    fn read_inner(&mut self, offset: u64, width: u8) -> Result<u32, MmioError> {
        if offset >= CONFIG {
            let rel = check_config_access(offset, width)?;
            let mut buf = [0u8; 4];
            let n = usize::from(width);
            self.device.config_read(rel, &mut buf[..n]);
            return Ok(u32::from_le_bytes(buf));
        }
        check_register_access(offset, width)?;
        Ok(match offset {
            MAGIC_VALUE => MAGIC,
            VERSION => 2,
            DEVICE_ID => self.device.device_id(),
            VENDOR_ID => VENDOR,
            DEVICE_FEATURES => match self.device_features_sel {
                0 => self.offered as u32,
                1 => (self.offered >> 32) as u32,
                _ => 0,
            },
            // A queue that does not exist has QueueNumMax 0 (spec 4.2.2).
            QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            INTERRUPT_STATUS => self.interrupt_status,
            STATUS => self.status,
            CONFIG_GENERATION => self.config_generation,
            // No shared memory regions: length -1 (all ones), base likewise.
            SHM_LEN_LOW | SHM_LEN_HIGH | SHM_BASE_LOW | SHM_BASE_HIGH => u32::MAX,
            _ => {
                return Err(match register_name(offset) {
                    Some(register) => MmioError::WriteOnly { offset, register },
                    None => MmioError::Unknown { offset },
                })
            }
        })
    }
}

/// Register writes and resets: these may act on the VM through the device's
/// view `E` of it.
impl<D: VirtioDevice> MmioTransport<D> {
    /// A guest write of `width` bytes of `value` at `offset` in the window.
    /// `env` is the device's view of the VM (guest memory and whatever else
    /// the device acts on).
    pub fn write<E: GuestMemory + ?Sized>(
        &mut self,
        offset: u64,
        width: u8,
        value: u32,
        env: &mut E,
    ) -> Result<TransportEvent, MmioError>
    where
        D: VirtioDeviceIo<E>,
    {
        let r = self.write_inner(offset, width, value, env);
        if r.is_err() {
            self.stats.bad_accesses += 1;
        }
        r
    }

    fn write_inner<E: GuestMemory + ?Sized>(
        &mut self,
        offset: u64,
        width: u8,
        value: u32,
        env: &mut E,
    ) -> Result<TransportEvent, MmioError>
    where
        D: VirtioDeviceIo<E>,
    {
        if offset >= CONFIG {
            let rel = check_config_access(offset, width)?;
            let bytes = value.to_le_bytes();
            self.device.config_write(rel, &bytes[..usize::from(width)]);
            return Ok(TransportEvent::None);
        }
        check_register_access(offset, width)?;
        match offset {
            DEVICE_FEATURES_SEL => self.device_features_sel = value,
            DRIVER_FEATURES => {
                if self.status & STATUS_FEATURES_OK != 0 {
                    // Features are fixed once accepted.
                    self.stats.ignored_writes += 1;
                } else {
                    match self.driver_features_sel {
                        0 => {
                            self.driver_features =
                                (self.driver_features & !0xffff_ffff) | u64::from(value)
                        }
                        1 => {
                            self.driver_features =
                                (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
                        }
                        _ => self.driver_features_beyond_64 |= value != 0,
                    }
                }
            }
            DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            QUEUE_SEL => self.queue_sel = value,
            QUEUE_NUM => self.queue_config(|q| q.set_num(value)),
            QUEUE_DESC_LOW | QUEUE_DESC_HIGH => self.queue_config(|q| {
                q.set_area_half(Area::Descriptors, offset == QUEUE_DESC_HIGH, value)
            }),
            QUEUE_DRIVER_LOW | QUEUE_DRIVER_HIGH => self
                .queue_config(|q| q.set_area_half(Area::Avail, offset == QUEUE_DRIVER_HIGH, value)),
            QUEUE_DEVICE_LOW | QUEUE_DEVICE_HIGH => self
                .queue_config(|q| q.set_area_half(Area::Used, offset == QUEUE_DEVICE_HIGH, value)),
            QUEUE_READY => return Ok(self.queue_ready(value, env)),
            QUEUE_NOTIFY => return Ok(self.notify(value, env)),
            INTERRUPT_ACK => self.interrupt_status &= !value,
            STATUS => return Ok(self.write_status(value, env)),
            // No shared memory regions: the selector has no effect.
            SHM_SEL => {}
            _ => {
                return Err(match register_name(offset) {
                    Some(register) => MmioError::ReadOnly { offset, register },
                    None => MmioError::Unknown { offset },
                })
            }
        }
        Ok(TransportEvent::None)
    }

    /// Apply a configuration write to the selected queue, unless it does not
    /// exist or is ready (the spec forbids changing a live queue).
    fn queue_config(&mut self, f: impl FnOnce(&mut Virtqueue)) {
        match self.selected_queue() {
            Some(q) if !q.ready() => f(q),
            _ => self.stats.ignored_writes += 1,
        }
    }

    fn queue_ready<E: GuestMemory + ?Sized>(&mut self, value: u32, env: &mut E) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        let Ok(index) = usize::try_from(self.queue_sel) else {
            self.stats.ignored_writes += 1;
            return TransportEvent::None;
        };
        let stopped = self.stopped();
        let Some(q) = self.queues.get_mut(index) else {
            self.stats.ignored_writes += 1;
            return TransportEvent::None;
        };
        match value {
            0 => {
                q.disable();
                TransportEvent::None
            }
            1 if !q.ready() && !stopped => match q.enable(env) {
                Ok(()) => TransportEvent::None,
                Err(e) => {
                    let name = self.device.queue_name(index);
                    self.fail(DeviceError::from_queue(index, name, e), env)
                }
            },
            _ => {
                // Already ready, device stopped, or a value the spec does not define.
                self.stats.ignored_writes += 1;
                TransportEvent::None
            }
        }
    }

    fn notify<E: GuestMemory + ?Sized>(&mut self, value: u32, env: &mut E) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        self.stats.notifications += 1;
        // Without VIRTIO_F_NOTIFICATION_DATA the value is the queue index.
        let index = match usize::try_from(value) {
            Ok(i) if i < self.queues.len() => i,
            _ => {
                self.stats.notifications_ignored += 1;
                return TransportEvent::None;
            }
        };
        if self.stopped() {
            self.stats.notifications_ignored += 1;
            return TransportEvent::None;
        }
        if self.status & STATUS_DRIVER_OK == 0 {
            // Remembered for DRIVER_OK; a legitimate driver may prime a queue
            // and kick it before the device is live.
            self.pending[index] = true;
            return TransportEvent::None;
        }
        if !self.queues[index].ready() {
            self.stats.notifications_ignored += 1;
            return TransportEvent::None;
        }
        self.process(index, env)
    }

    /// A `width`-byte QueueNotify write of `value` that certainly has
    /// nothing to do: counted as [`write`](Self::write) counts it, and true.
    /// False, with nothing changed, whenever the full write could do
    /// anything more (or refuse the access): a bad width, an unknown or not
    /// ready queue, the device stopped or not live yet (a notify before
    /// DRIVER_OK is remembered), a device that does not call the pass
    /// quiet ([`VirtioDevice::quiet_when_empty`]), used buffers not yet
    /// signalled, or anything new (or unreadable) in the avail ring, read
    /// through `mem` with the checks [`Virtqueue::pop`] makes.
    ///
    /// The notify fast path's decision (`vm::devices::balloon::empty_notify`); `mem`
    /// may be a view that only reads what is mapped, so that an answer of
    /// true never backed a page or wrote anything.
    #[inline]
    pub fn empty_notify<E: GuestMemory + ?Sized>(
        &mut self,
        width: u8,
        value: u32,
        mem: &mut E,
    ) -> bool {
        // `check_register_access(QUEUE_NOTIFY, width)` accepts exactly 4
        // (a test checks it), written as the compare it reduces to.
        let quiet = width == 4
            && self.status & STATUS_DRIVER_OK != 0
            && !self.stopped()
            && usize::try_from(value).is_ok_and(|index| {
                self.queues
                    .get(index)
                    .is_some_and(|q| q.ready() && self.device.quiet_when_empty(index))
            })
            && !self.queues.iter().any(Virtqueue::used_signal_pending);
        // Only now the guest memory read (the costly part).
        if !quiet || !self.queues[value as usize].nothing_available(mem) {
            return false;
        }
        self.stats.notifications += 1;
        true
    }

    /// Let the device process `index`, then turn returned buffers into the
    /// used-buffer interrupt, or an error into NEEDS_RESET.
    fn process<E: GuestMemory + ?Sized>(&mut self, index: usize, env: &mut E) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        let result = self.device.notify(index, &mut self.queues, env);
        self.finish_work(result, env)
    }

    /// Let the device use its queues outside a notification: on a timer or
    /// a host command (the balloon returning its statistics buffer). Does
    /// nothing unless the driver is live (DRIVER_OK, not stopped). Used
    /// buffers raise the used-buffer interrupt, a device config change the
    /// config-change interrupt, an error sets NEEDS_RESET, as after a
    /// notification.
    pub fn device_work<E, F>(&mut self, env: &mut E, work: F) -> TransportEvent
    where
        E: GuestMemory + ?Sized,
        D: VirtioDeviceIo<E>,
        F: FnOnce(&mut D, &mut [Virtqueue], &mut E) -> Result<(), DeviceError>,
    {
        if self.status & STATUS_DRIVER_OK == 0 || self.stopped() {
            return TransportEvent::None;
        }
        let result = work(&mut self.device, &mut self.queues, env);
        self.finish_work(result, env)
    }

    /// After the device worked on its queues: interrupts for what it
    /// returned or changed, or NEEDS_RESET for its error.
    fn finish_work<E: GuestMemory + ?Sized>(
        &mut self,
        result: Result<(), DeviceError>,
        env: &mut E,
    ) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        if self.device.take_config_change() {
            self.config_changed();
        }
        match result {
            Ok(()) => {
                if self.collect_used() {
                    TransportEvent::Interrupt
                } else {
                    TransportEvent::None
                }
            }
            Err(e) => self.fail(e, env),
        }
    }

    /// Whether any queue returned buffers; sets the interrupt bit if so.
    /// Queues whose signal the device defers
    /// ([`VirtioDevice::defers_used_signal`]) only join another's.
    fn collect_used(&mut self) -> bool {
        let mut any = false;
        for (i, q) in self.queues.iter_mut().enumerate() {
            if !self.device.defers_used_signal(i) {
                any |= q.take_used_signal();
            }
        }
        if any {
            for q in &mut self.queues {
                q.take_used_signal();
            }
            self.raise(INT_USED_BUFFER);
        }
        any
    }

    /// Raise the used-buffer interrupt for buffers returned on a deferring
    /// queue ([`VirtioDevice::defers_used_signal`]) since the last one;
    /// whether it did. Nothing while the driver is not live.
    pub fn flush_deferred(&mut self) -> bool {
        if self.status & STATUS_DRIVER_OK == 0 || self.stopped() {
            return false;
        }
        let mut any = false;
        for q in &mut self.queues {
            any |= q.take_used_signal();
        }
        if any {
            self.raise(INT_USED_BUFFER);
        }
        any
    }

    /// A guest error: return the chain it concerned if possible, set
    /// DEVICE_NEEDS_RESET, tell the driver, stop.
    fn fail<E: GuestMemory + ?Sized>(&mut self, error: DeviceError, env: &mut E) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        if let (Some(QueueId { index, .. }), Some(head)) = (error.queue, error.head) {
            if let Some(q) = self.queues.get_mut(index) {
                // Best effort: a driver that sleeps until this buffer comes
                // back (Linux's balloon does) is not left hanging. If the used
                // ring itself is broken there is nothing more to do.
                let _ = q.push_used(env, head, 0);
            }
        }
        // Every queue's signal, deferred or not: the device stops here.
        let mut any = false;
        for q in &mut self.queues {
            any |= q.take_used_signal();
        }
        if any {
            self.raise(INT_USED_BUFFER);
        }
        self.status |= STATUS_DEVICE_NEEDS_RESET;
        if self.status & STATUS_DRIVER_OK != 0 {
            // Spec 2.1.2: after setting NEEDS_RESET on a live device, send a
            // configuration change notification.
            self.raise(INT_CONFIG_CHANGE);
        }
        self.stats.device_errors += 1;
        self.last_error = Some(error.clone());
        TransportEvent::NeedsReset {
            device: self.device.name(),
            error,
        }
    }

    fn write_status<E: GuestMemory + ?Sized>(&mut self, value: u32, env: &mut E) -> TransportEvent
    where
        D: VirtioDeviceIo<E>,
    {
        if value == 0 {
            self.reset(env);
            return TransportEvent::Reset;
        }
        let old = self.status;
        // DEVICE_NEEDS_RESET belongs to the device: the driver's copy of it
        // (it writes back what it read, plus a bit) is ignored.
        let wanted = value & DRIVER_STATUS_BITS;
        if old & DRIVER_STATUS_BITS & !wanted != 0
            || value & !(DRIVER_STATUS_BITS | STATUS_DEVICE_NEEDS_RESET) != 0
        {
            // Clearing bits other than by reset, or undefined bits.
            self.stats.ignored_writes += 1;
            return TransportEvent::None;
        }
        let new_bits = wanted & !old;
        let mut status = old | new_bits;
        if new_bits & STATUS_FEATURES_OK != 0 && !self.features_acceptable() {
            // Per spec the device leaves FEATURES_OK clear; the driver reads
            // the status back and fails the probe.
            status &= !STATUS_FEATURES_OK;
            self.stats.features_refused += 1;
        }
        if new_bits & STATUS_DRIVER_OK != 0 && status & STATUS_FEATURES_OK == 0 {
            self.status = status & !STATUS_DRIVER_OK;
            let e = DeviceError::transport(DeviceErrorKind::DriverOkWithoutFeaturesOk {
                status: value,
            });
            return self.fail(e, env);
        }
        self.status = status;
        if new_bits & STATUS_DRIVER_OK != 0 && !self.stopped() {
            let features = self.driver_features;
            self.device.activate(features);
            // Process queues kicked before DRIVER_OK. A used-buffer interrupt
            // this raises shows in the line level, not in the event.
            for index in 0..self.queues.len() {
                if core::mem::take(&mut self.pending[index]) && self.queues[index].ready() {
                    if let ev @ TransportEvent::NeedsReset { .. } = self.process(index, env) {
                        return ev;
                    }
                }
            }
            return TransportEvent::Activated { features };
        }
        TransportEvent::None
    }

    fn features_acceptable(&self) -> bool {
        self.driver_features & !self.offered == 0
            && self.driver_features & VIRTIO_F_VERSION_1 != 0
            && !self.driver_features_beyond_64
    }

    /// Device reset (the driver wrote 0 to Status): the device undoes its
    /// effects through `env`, queues and registers go back to their initial
    /// state. ConfigGeneration keeps counting (a driver only compares it).
    pub fn reset<E: GuestMemory + ?Sized>(&mut self, env: &mut E)
    where
        D: VirtioDeviceIo<E>,
    {
        self.device.reset(env);
        for q in &mut self.queues {
            q.reset();
        }
        self.pending.iter_mut().for_each(|p| *p = false);
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.driver_features_beyond_64 = false;
        self.queue_sel = 0;
        self.interrupt_status = 0;
        self.stats.resets += 1;
    }
}

/// Registers below 0x100: aligned 32-bit accesses only.
fn check_register_access(offset: u64, width: u8) -> Result<(), MmioError> {
    if check_access(offset, width, UP_TO_WORD) == Err(AccessFault::BadWidth) {
        return Err(MmioError::BadWidth { offset, width });
    }
    check_access(offset, width, &[4]).map_err(|_| MmioError::NotWord { offset, width })
}

/// Config space: 1, 2 or 4 bytes, naturally aligned, inside the window.
/// Returns the offset relative to the config space.
fn check_config_access(offset: u64, width: u8) -> Result<u64, MmioError> {
    check_access(offset, width, UP_TO_WORD).map_err(|fault| match fault {
        AccessFault::BadWidth => MmioError::BadWidth { offset, width },
        AccessFault::Unaligned => MmioError::Unaligned { offset, width },
    })?;
    if offset.saturating_add(u64::from(width)) > WINDOW_SIZE {
        return Err(MmioError::Unknown { offset });
    }
    Ok(offset - CONFIG)
}

/// Names of the registers with a direction (for read-only/write-only errors).
fn register_name(offset: u64) -> Option<&'static str> {
    Some(match offset {
        MAGIC_VALUE => "MagicValue",
        VERSION => "Version",
        DEVICE_ID => "DeviceID",
        VENDOR_ID => "VendorID",
        DEVICE_FEATURES => "DeviceFeatures",
        DEVICE_FEATURES_SEL => "DeviceFeaturesSel",
        DRIVER_FEATURES => "DriverFeatures",
        DRIVER_FEATURES_SEL => "DriverFeaturesSel",
        QUEUE_SEL => "QueueSel",
        QUEUE_NUM_MAX => "QueueNumMax",
        QUEUE_NUM => "QueueNum",
        QUEUE_NOTIFY => "QueueNotify",
        INTERRUPT_STATUS => "InterruptStatus",
        INTERRUPT_ACK => "InterruptACK",
        QUEUE_DESC_LOW => "QueueDescLow",
        QUEUE_DESC_HIGH => "QueueDescHigh",
        QUEUE_DRIVER_LOW => "QueueDriverLow",
        QUEUE_DRIVER_HIGH => "QueueDriverHigh",
        QUEUE_DEVICE_LOW => "QueueDeviceLow",
        QUEUE_DEVICE_HIGH => "QueueDeviceHigh",
        SHM_SEL => "SHMSel",
        SHM_LEN_LOW => "SHMLenLow",
        SHM_LEN_HIGH => "SHMLenHigh",
        SHM_BASE_LOW => "SHMBaseLow",
        SHM_BASE_HIGH => "SHMBaseHigh",
        CONFIG_GENERATION => "ConfigGeneration",
        _ => return None,
    })
}

/// Offsets of registers a driver may write (for tests and fuzzing).
pub const WRITABLE_REGISTERS: [u64; 19] = [
    DEVICE_FEATURES_SEL,
    DRIVER_FEATURES,
    DRIVER_FEATURES_SEL,
    QUEUE_SEL,
    QUEUE_NUM,
    QUEUE_READY,
    QUEUE_NOTIFY,
    INTERRUPT_ACK,
    STATUS,
    QUEUE_DESC_LOW,
    QUEUE_DESC_HIGH,
    QUEUE_DRIVER_LOW,
    QUEUE_DRIVER_HIGH,
    QUEUE_DEVICE_LOW,
    QUEUE_DEVICE_HIGH,
    SHM_SEL,
    CONFIG,
    CONFIG + 4,
    CONFIG + 12,
];

#[cfg(test)]
mod tests {
    #[test]
    fn queue_notify_accepts_exactly_a_word() {
        // What `empty_notify` relies on in place of the table lookup.
        for width in 0..=u8::MAX {
            assert_eq!(
                super::check_register_access(super::QUEUE_NOTIFY, width).is_ok(),
                width == 4,
                "width {width}"
            );
        }
    }

    use super::*;
    use crate::addr::GuestAddr;
    use crate::virtio::testing::{
        driver_ok, handshake, read_reg, write_reg, DriverQueue, Sink, VecMemory,
    };
    use crate::virtio::QueueError;
    use alloc::format;
    use alloc::vec;
    use proptest::test_runner::TestCaseError;

    const BASE: u64 = 0x4000_0000;

    fn rig() -> (MmioTransport<Sink>, VecMemory, [DriverQueue; 2]) {
        let t = MmioTransport::new(Sink::default());
        let mem = VecMemory::new(BASE, 0x10000);
        let qs = [
            DriverQueue::new(8, BASE, BASE + 0x800, BASE + 0x1000),
            DriverQueue::new(16, BASE + 0x2000, BASE + 0x2800, BASE + 0x3000),
        ];
        (t, mem, qs)
    }

    #[test]
    fn device_work_only_while_live() {
        let (mut t, mut mem, qs) = rig();
        let mut calls = 0;
        let mut work = |_: &mut Sink, _: &mut [Virtqueue], _: &mut VecMemory| {
            calls += 1;
            Ok(())
        };
        assert_eq!(t.device_work(&mut mem, &mut work), TransportEvent::None);
        handshake(&mut t, &mut mem, 1 | VIRTIO_F_VERSION_1, &qs);
        assert_eq!(t.device_work(&mut mem, &mut work), TransportEvent::None);
        driver_ok(&mut t, &mut mem);
        assert_eq!(t.device_work(&mut mem, &mut work), TransportEvent::None);
        assert_eq!(calls, 1, "not before DRIVER_OK");
        // A buffer returned from outside a notification raises the interrupt.
        let mut dq = qs[1].clone();
        dq.add(&mut mem, &[(BASE + 0x8000, 4, false)]);
        let ev = t.device_work(&mut mem, |_, queues, mem| {
            let c = queues[1].pop(mem).unwrap().unwrap();
            queues[1].push_used(mem, c.head(), 0).unwrap();
            Ok(())
        });
        assert_eq!(ev, TransportEvent::Interrupt);
        assert_eq!(t.interrupt_status(), INT_USED_BUFFER);
        // An error stops the device like one found on a notification.
        let ev = t.device_work(&mut mem, |_, _, _| {
            Err(DeviceError::from_queue(
                0,
                "rxq",
                QueueError::NothingInFlight,
            ))
        });
        assert!(matches!(ev, TransportEvent::NeedsReset { .. }));
        assert!(t.needs_reset());
        let mut called = false;
        t.device_work(&mut mem, |_, _, _| {
            called = true;
            Ok(())
        });
        assert!(!called, "stopped");
    }

    /// Per queue: ready, last avail index, used index, chains in flight.
    type QueueFacts = Vec<(bool, u16, u16, u32)>;

    /// What a test can see of a transport after a write.
    fn observed(t: &MmioTransport<Sink>) -> (TransportStats, u32, u32, QueueFacts) {
        let queues = t
            .queues()
            .iter()
            .map(|q| (q.ready(), q.last_avail_idx(), q.used_idx(), q.in_flight()))
            .collect();
        (*t.stats(), t.status(), t.interrupt_status(), queues)
    }

    /// A transport with a quiet device, queues set up and (`live`)
    /// DRIVER_OK set.
    fn quiet_rig(live: bool) -> (MmioTransport<Sink>, VecMemory, [DriverQueue; 2]) {
        let (mut t, mut mem, qs) = rig();
        t.device_mut().quiet = true;
        handshake(&mut t, &mut mem, 1 | VIRTIO_F_VERSION_1, &qs);
        if live {
            driver_ok(&mut t, &mut mem);
        }
        (t, mem, qs)
    }

    #[test]
    fn an_empty_notify_is_only_taken_when_nothing_is_to_do() {
        // Before DRIVER_OK a notify is remembered: the full write's.
        let (mut t, mut mem, mut qs) = quiet_rig(false);
        assert!(!t.empty_notify(4, 0, &mut mem));
        driver_ok(&mut t, &mut mem);
        let before = observed(&t);
        assert!(t.empty_notify(4, 0, &mut mem));
        assert!(t.empty_notify(4, 1, &mut mem));
        let after = observed(&t);
        assert_eq!(after.0.notifications, before.0.notifications + 2);
        assert_eq!(
            (after.1, after.2, &after.3),
            (before.1, before.2, &before.3)
        );
        assert!(mem.writes().is_empty(), "nothing written");
        // Not a notify the register takes, or no such queue.
        for (width, value) in [(2, 0), (8, 0), (1, 0), (4, 2), (4, u32::MAX)] {
            assert!(!t.empty_notify(width, value, &mut mem), "{width} {value}");
        }
        // A buffer on queue 1: not empty; queue 0 still is.
        qs[1].add(&mut mem, &[(BASE + 0x8000, 4, false)]);
        assert!(!t.empty_notify(4, 1, &mut mem));
        assert!(t.empty_notify(4, 0, &mut mem));
        // Used buffers not signalled yet: the full path raises them.
        let c = t.queues[1].pop(&mut mem).unwrap().unwrap();
        t.queues[1].push_used(&mut mem, c.head(), 0).unwrap();
        assert!(!t.empty_notify(4, 0, &mut mem));
        assert_eq!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 0),
            TransportEvent::Interrupt
        );
        assert!(t.empty_notify(4, 0, &mut mem));
        assert!(t.empty_notify(4, 1, &mut mem));
        // An index too far ahead is an error for the full path to find.
        mem.poke(BASE + 0x800 + 2, &100u16.to_le_bytes());
        assert!(!t.empty_notify(4, 0, &mut mem));
        assert!(matches!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 0),
            TransportEvent::NeedsReset { .. }
        ));
        // A stopped device ignores (and counts) notifies the full way.
        assert!(!t.empty_notify(4, 1, &mut mem));
        // A device that does not call it quiet.
        let (mut t, mut mem, _) = quiet_rig(true);
        assert!(t.empty_notify(4, 0, &mut mem));
        t.device_mut().quiet = false;
        assert!(!t.empty_notify(4, 0, &mut mem));
        // A queue not ready.
        let (mut t, mut mem, _) = quiet_rig(true);
        write_reg(&mut t, &mut mem, QUEUE_SEL, 1);
        write_reg(&mut t, &mut mem, QUEUE_READY, 0);
        assert!(!t.empty_notify(4, 1, &mut mem));
        assert!(t.empty_notify(4, 0, &mut mem));
    }

    /// One step of a driver (or a hostile guest) for the differential test.
    #[derive(Clone, Debug)]
    enum Step {
        Notify { width: u8, value: u32 },
        Add { queue: usize },
        Ack(u32),
        AvailIdx { queue: usize, idx: u16 },
        QueueReady { queue: u32, value: u32 },
        Status(u32),
    }

    fn any_step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            12 => (prop_oneof![4 => Just(4u8), 1 => Just(2), 1 => Just(8)], 0u32..3)
                .prop_map(|(width, value)| Step::Notify { width, value }),
            3 => (0usize..2).prop_map(|queue| Step::Add { queue }),
            2 => (0u32..4).prop_map(Step::Ack),
            1 => (0usize..2, any::<u16>()).prop_map(|(queue, idx)| Step::AvailIdx { queue, idx }),
            1 => (0u32..3, 0u32..2).prop_map(|(queue, value)| Step::QueueReady { queue, value }),
            1 => prop_oneof![Just(0u32), Just(STATUS_DRIVER_OK)].prop_map(Step::Status),
        ]
    }

    proptest::proptest! {
        /// Whatever the driver does between them, a notify that
        /// `empty_notify` takes leaves the transport, its queues and guest
        /// memory exactly as the full QueueNotify write leaves them.
        #[test]
        fn an_empty_notify_is_the_full_write_without_the_work(
            steps in proptest::collection::vec(any_step(), 1..60),
        ) {
            let (mut fast, mut fast_mem, mut fast_qs) = quiet_rig(true);
            let (mut full, mut full_mem, mut full_qs) = quiet_rig(true);
            for step in steps {
                for (t, mem, qs, is_fast) in [
                    (&mut fast, &mut fast_mem, &mut fast_qs, true),
                    (&mut full, &mut full_mem, &mut full_qs, false),
                ] {
                    match step {
                        Step::Notify { width, value } => {
                            if !(is_fast && t.empty_notify(width, value, mem)) {
                                let _ = t.write(QUEUE_NOTIFY, width, value, mem);
                            }
                        }
                        Step::Add { queue } => {
                            qs[queue].add(mem, &[(BASE + 0x8000, 4, false)]);
                        }
                        Step::Ack(bits) => {
                            write_reg(t, mem, INTERRUPT_ACK, bits);
                        }
                        Step::AvailIdx { queue, idx } => {
                            mem.poke(qs[queue].avail + 2, &idx.to_le_bytes());
                        }
                        Step::QueueReady { queue, value } => {
                            write_reg(t, mem, QUEUE_SEL, queue);
                            write_reg(t, mem, QUEUE_READY, value);
                        }
                        Step::Status(0) => {
                            write_reg(t, mem, STATUS, 0);
                        }
                        Step::Status(_) => {
                            let status = t.status();
                            write_reg(t, mem, STATUS, status | STATUS_DRIVER_OK);
                        }
                    }
                }
                proptest::prop_assert_eq!(observed(&fast), observed(&full));
                proptest::prop_assert_eq!(&fast_mem.bytes, &full_mem.bytes);
                // Every state this traffic reaches (device errors
                // included) is saved and restored as it is.
                let saved = saved_bytes(&full);
                let back = restored(&saved).map_err(|e| TestCaseError::fail(e.to_string()))?;
                proptest::prop_assert_eq!(observed(&back), observed(&full));
                proptest::prop_assert_eq!(back.last_error(), full.last_error());
                proptest::prop_assert_eq!(saved_bytes(&back), saved);
            }
        }
    }

    fn saved_bytes(t: &MmioTransport<Sink>) -> Vec<u8> {
        let mut w = StateWriter::default();
        t.save(&mut w);
        w.into_bytes()
    }

    fn restored(bytes: &[u8]) -> Result<MmioTransport<Sink>, StateError> {
        let mut r = StateReader::new(bytes);
        let t = MmioTransport::<Sink>::restore(&mut r)?;
        r.finish()?;
        Ok(t)
    }

    #[test]
    fn a_saved_transport_restores_as_it_was_and_refuses_what_no_driver_set() {
        let (mut t, mut mem, qs) = quiet_rig(true);
        // A device error: the available index jumps past the ring.
        mem.poke(qs[0].avail + 2, &100u16.to_le_bytes());
        let _ = t.write(QUEUE_NOTIFY, 4, 0, &mut mem);
        assert!(t.last_error().is_some());
        let saved = saved_bytes(&t);
        let back = restored(&saved).expect("restores");
        assert_eq!(back.last_error(), t.last_error());
        assert_eq!(back.negotiated_features(), t.negotiated_features());
        assert_eq!(observed(&back), observed(&t));
        // Offsets: version 0, the Sink 1..15, offered 15..23, queue count
        // 23..31, then each queue (40 bytes) and its pending flag.
        let status = 31 + 2 * 41;
        let with = |at: usize, bytes: &[u8]| {
            let mut bad = saved.clone();
            bad[at..at + bytes.len()].copy_from_slice(bytes);
            bad
        };
        assert_eq!(
            restored(&with(15, &[0])).err(),
            Some(StateError::Invalid("virtio features offered"))
        );
        assert_eq!(
            restored(&with(23, &[3])).err(),
            Some(StateError::Invalid("virtqueue count"))
        );
        assert_eq!(
            restored(&with(status, &[0x10])).err(),
            Some(StateError::Invalid("virtio status"))
        );
        // Accepted (FEATURES_OK) a feature never offered.
        assert_eq!(
            restored(&with(status + 12, &[2])).err(),
            Some(StateError::Invalid("virtio features accepted"))
        );
        assert_eq!(
            restored(&with(0, &[9])).err(),
            Some(StateError::Version {
                device: "virtio-mmio transport",
                found: 9
            })
        );
    }

    #[test]
    fn identity_registers() {
        let (mut t, _, _) = rig();
        assert_eq!(read_reg(&mut t, MAGIC_VALUE), MAGIC);
        assert_eq!(read_reg(&mut t, VERSION), 2);
        assert_eq!(read_reg(&mut t, DEVICE_ID), 42);
        assert_eq!(read_reg(&mut t, VENDOR_ID), VENDOR);
        assert_eq!(read_reg(&mut t, DEVICE_FEATURES), 1);
        assert_eq!(t.offered_features(), 1 | VIRTIO_F_VERSION_1);
        assert_eq!(read_reg(&mut t, SHM_LEN_LOW), u32::MAX);
        assert_eq!(read_reg(&mut t, SHM_LEN_HIGH), u32::MAX);
        assert_eq!(read_reg(&mut t, QUEUE_NUM_MAX), 16);
        assert_eq!(read_reg(&mut t, CONFIG_GENERATION), 0);
    }

    #[test]
    fn bad_accesses_are_errors() {
        let (mut t, mut mem, _) = rig();
        assert_eq!(
            t.read(STATUS, 2),
            Err(MmioError::NotWord {
                offset: STATUS,
                width: 2
            })
        );
        assert_eq!(
            t.read(STATUS + 1, 4),
            Err(MmioError::NotWord {
                offset: STATUS + 1,
                width: 4
            })
        );
        assert_eq!(
            t.read(STATUS, 8),
            Err(MmioError::BadWidth {
                offset: STATUS,
                width: 8
            })
        );
        assert_eq!(t.read(0x18, 4), Err(MmioError::Unknown { offset: 0x18 }));
        assert_eq!(
            t.read(QUEUE_NOTIFY, 4),
            Err(MmioError::WriteOnly {
                offset: QUEUE_NOTIFY,
                register: "QueueNotify"
            })
        );
        assert_eq!(
            t.write(MAGIC_VALUE, 4, 0, &mut mem),
            Err(MmioError::ReadOnly {
                offset: MAGIC_VALUE,
                register: "MagicValue"
            })
        );
        assert_eq!(
            t.read(CONFIG + 1, 2),
            Err(MmioError::Unaligned {
                offset: CONFIG + 1,
                width: 2
            })
        );
        assert_eq!(
            t.read(WINDOW_SIZE, 4),
            Err(MmioError::Unknown {
                offset: WINDOW_SIZE
            })
        );
        assert_eq!(
            t.read(u64::MAX - 3, 4),
            Err(MmioError::Unknown {
                offset: u64::MAX - 3
            })
        );
        assert_eq!(t.stats().bad_accesses, 9);
        assert_eq!(
            format!(
                "{}",
                MmioError::NotWord {
                    offset: 0x70,
                    width: 2
                }
            ),
            "2-byte access at offset 0x70: registers below 0x100 take aligned 32-bit accesses only"
        );
        // Config space: 1, 2, 4 bytes; past the device's config reads zero.
        assert_eq!(t.read(CONFIG, 4), Ok(0x0403_0201));
        assert_eq!(t.read(CONFIG + 6, 2), Ok(0x0807));
        assert_eq!(t.read(CONFIG + 5, 1), Ok(6));
        assert_eq!(t.read(CONFIG + 8, 4), Ok(0));
    }

    #[test]
    fn handshake_and_io() {
        let (mut t, mut mem, mut qs) = rig();
        let status = handshake(&mut t, &mut mem, u64::MAX, &qs);
        assert_eq!(
            status,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK
        );
        assert_eq!(
            driver_ok(&mut t, &mut mem),
            TransportEvent::Activated {
                features: 1 | VIRTIO_F_VERSION_1
            }
        );
        assert_eq!(t.device().activated, Some(1 | VIRTIO_F_VERSION_1));
        let head = qs[1].add(
            &mut mem,
            &[(BASE + 0x8000, 12, false), (BASE + 0x9000, 4, true)],
        );
        assert_eq!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 1),
            TransportEvent::Interrupt
        );
        assert_eq!(qs[1].take_used(&mut mem), vec![(u32::from(head), 12)]);
        assert!(t.interrupt_pending());
        assert_eq!(read_reg(&mut t, INTERRUPT_STATUS), INT_USED_BUFFER);
        write_reg(&mut t, &mut mem, INTERRUPT_ACK, INT_USED_BUFFER);
        assert!(!t.interrupt_pending());
        // Notifying a queue that does not exist is ignored.
        assert_eq!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 7),
            TransportEvent::None
        );
        assert_eq!(t.stats().notifications, 2);
        assert_eq!(t.stats().notifications_ignored, 1);
        // Queue registers of a ready queue are frozen.
        write_reg(&mut t, &mut mem, QUEUE_SEL, 1);
        write_reg(&mut t, &mut mem, QUEUE_NUM, 2);
        assert_eq!(t.queues()[1].size(), 16);
        assert_eq!(t.stats().ignored_writes, 1);
        // The generation moves and the driver is told.
        assert!(t.config_changed());
        assert_eq!(read_reg(&mut t, CONFIG_GENERATION), 1);
        assert_eq!(read_reg(&mut t, INTERRUPT_STATUS), INT_CONFIG_CHANGE);
        // Reset.
        assert_eq!(
            write_reg(&mut t, &mut mem, STATUS, 0),
            TransportEvent::Reset
        );
        assert_eq!(t.device().resets, 2); // the handshake's and this one
        assert_eq!(read_reg(&mut t, STATUS), 0);
        assert_eq!(read_reg(&mut t, INTERRUPT_STATUS), 0);
        assert_eq!(read_reg(&mut t, QUEUE_READY), 0);
        assert!(!t.queues()[1].ready());
        assert_eq!(read_reg(&mut t, CONFIG_GENERATION), 1);
    }

    #[test]
    fn features_must_be_offered_and_modern() {
        let (mut t, mut mem, qs) = rig();
        // Un-offered bit 5.
        write_reg(&mut t, &mut mem, STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES_SEL, 0);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES, 1 << 5);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES_SEL, 1);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES, 1);
        write_reg(
            &mut t,
            &mut mem,
            STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
        assert_eq!(read_reg(&mut t, STATUS) & STATUS_FEATURES_OK, 0);
        assert_eq!(t.stats().features_refused, 1);
        // Legacy driver (no VERSION_1).
        let status = handshake(&mut t, &mut mem, 1, &qs);
        assert_eq!(status & STATUS_FEATURES_OK, 0);
        // Bits beyond 64.
        write_reg(&mut t, &mut mem, STATUS, 0);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES_SEL, 1);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES, 1);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES_SEL, 2);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES, 1);
        write_reg(&mut t, &mut mem, STATUS, STATUS_FEATURES_OK);
        assert_eq!(read_reg(&mut t, STATUS) & STATUS_FEATURES_OK, 0);
        assert_eq!(t.stats().features_refused, 3);
        // Good driver; its features are fixed after FEATURES_OK.
        let status = handshake(&mut t, &mut mem, VIRTIO_F_VERSION_1, &qs);
        assert_ne!(status & STATUS_FEATURES_OK, 0);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES_SEL, 0);
        write_reg(&mut t, &mut mem, DRIVER_FEATURES, 1);
        assert_eq!(t.negotiated_features(), VIRTIO_F_VERSION_1);
        // DRIVER_OK without FEATURES_OK is a protocol error.
        write_reg(&mut t, &mut mem, STATUS, 0);
        write_reg(&mut t, &mut mem, STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        let ev = write_reg(
            &mut t,
            &mut mem,
            STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK,
        );
        assert!(matches!(ev, TransportEvent::NeedsReset { .. }), "{ev:?}");
        assert!(t.needs_reset());
        assert_eq!(t.device().activated, None);
    }

    #[test]
    fn clearing_status_bits_is_ignored() {
        let (mut t, mut mem, qs) = rig();
        handshake(&mut t, &mut mem, u64::MAX, &qs);
        let before = read_reg(&mut t, STATUS);
        write_reg(&mut t, &mut mem, STATUS, STATUS_ACKNOWLEDGE);
        assert_eq!(read_reg(&mut t, STATUS), before);
        write_reg(&mut t, &mut mem, STATUS, before | 0x10);
        assert_eq!(read_reg(&mut t, STATUS), before);
    }

    #[test]
    fn bad_queue_setup_needs_reset() {
        let (mut t, mut mem, mut qs) = rig();
        qs[0].used = BASE + 0x1002; // not 4-byte aligned
        handshake(&mut t, &mut mem, u64::MAX, &qs[..0]);
        write_reg(&mut t, &mut mem, QUEUE_SEL, 0);
        write_reg(&mut t, &mut mem, QUEUE_NUM, 8);
        write_reg(&mut t, &mut mem, QUEUE_DESC_LOW, qs[0].desc as u32);
        write_reg(&mut t, &mut mem, QUEUE_DRIVER_LOW, qs[0].avail as u32);
        write_reg(&mut t, &mut mem, QUEUE_DEVICE_LOW, qs[0].used as u32);
        let ev = write_reg(&mut t, &mut mem, QUEUE_READY, 1);
        let TransportEvent::NeedsReset { device, error } = &ev else {
            panic!("{ev:?}")
        };
        assert_eq!(*device, "sink");
        assert_eq!(
            error.kind,
            DeviceErrorKind::Queue(QueueError::Misaligned {
                area: Area::Used,
                ipa: GuestAddr::new(BASE + 0x1002)
            })
        );
        assert_eq!(
            format!("{ev}"),
            "sink needs reset: rxq: used ring at IPA 0x4000_1002 is not 4-byte aligned"
        );
        assert_ne!(read_reg(&mut t, STATUS) & STATUS_DEVICE_NEEDS_RESET, 0);
        // Not live yet: no config-change interrupt.
        assert!(!t.interrupt_pending());
        assert_eq!(read_reg(&mut t, QUEUE_READY), 0);
        // A reset recovers.
        write_reg(&mut t, &mut mem, STATUS, 0);
        qs[0].used = BASE + 0x1000;
        handshake(&mut t, &mut mem, u64::MAX, &qs);
        driver_ok(&mut t, &mut mem);
        assert!(!t.needs_reset());
        assert_eq!(t.last_error(), Some(error));
    }

    #[test]
    fn device_error_returns_the_buffer_and_stops() {
        let (mut t, mut mem, mut qs) = rig();
        handshake(&mut t, &mut mem, u64::MAX, &qs);
        driver_ok(&mut t, &mut mem);
        let head = qs[0].add(&mut mem, &[(0x8000_0000, 4096, false)]);
        let ev = write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 0);
        assert_eq!(
            format!("{ev}"),
            "sink needs reset: rxq: descriptor 0 points outside guest RAM (IPA 0x8000_0000, 4096 bytes)"
        );
        // The buffer came back (written length 0), and both interrupt bits are set.
        assert_eq!(qs[0].take_used(&mut mem), vec![(u32::from(head), 0)]);
        assert_eq!(
            read_reg(&mut t, INTERRUPT_STATUS),
            INT_USED_BUFFER | INT_CONFIG_CHANGE
        );
        // Stopped until reset.
        qs[0].add(&mut mem, &[(BASE + 0x8000, 4, false)]);
        assert_eq!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 0),
            TransportEvent::None
        );
        assert!(qs[0].take_used(&mut mem).is_empty());
        assert_eq!(t.stats().device_errors, 1);
        assert_eq!(t.stats().notifications_ignored, 1);
    }

    #[test]
    fn kick_before_driver_ok_is_processed_at_driver_ok() {
        let (mut t, mut mem, mut qs) = rig();
        handshake(&mut t, &mut mem, u64::MAX, &qs);
        let head = qs[1].add(&mut mem, &[(BASE + 0x8000, 8, false)]);
        assert_eq!(
            write_reg(&mut t, &mut mem, QUEUE_NOTIFY, 1),
            TransportEvent::None
        );
        assert!(qs[1].take_used(&mut mem).is_empty());
        assert!(matches!(
            driver_ok(&mut t, &mut mem),
            TransportEvent::Activated { .. }
        ));
        assert_eq!(qs[1].take_used(&mut mem), vec![(u32::from(head), 8)]);
        assert!(t.interrupt_pending());
    }
}
