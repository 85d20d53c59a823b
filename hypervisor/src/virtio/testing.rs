//! Test helpers (host only): guest memory over a `Vec`, and a small virtio
//! "driver" that lays out split rings in it and talks to a transport through
//! its registers, the way Linux's virtio_mmio and virtio_ring do.

extern crate alloc;

use alloc::vec::Vec;

use super::mmio::{self, MmioTransport, TransportEvent};
use super::queue::{Area, Virtqueue, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE};
use super::{
    DeviceError, GuestMemError, GuestMemory, VirtioDevice, VirtioDeviceIo, VIRTIO_F_VERSION_1,
};
use crate::addr::GuestAddr;

/// Guest RAM `[base, base + bytes.len())`. Records every write made through
/// [`GuestMemory`] (the device's) and every access it refused, so tests can
/// check where the device wrote and that nothing outside RAM was touched. The
/// test driver writes with [`poke`](Self::poke), which is not recorded.
#[derive(Clone, Debug)]
pub struct VecMemory {
    pub base: u64,
    pub bytes: Vec<u8>,
    writes: Vec<(u64, usize)>,
    refused: Vec<(u64, usize)>,
}

impl VecMemory {
    pub fn new(base: u64, len: usize) -> Self {
        VecMemory {
            base,
            bytes: alloc::vec![0; len],
            writes: Vec::new(),
            refused: Vec::new(),
        }
    }

    fn range(&self, ipa: u64, len: usize) -> Option<core::ops::Range<usize>> {
        let start = usize::try_from(ipa.checked_sub(self.base)?).ok()?;
        let end = start.checked_add(len)?;
        (end <= self.bytes.len()).then_some(start..end)
    }

    /// Writes made through [`GuestMemory::write`] since the last
    /// [`clear_log`](Self::clear_log).
    pub fn writes(&self) -> &[(u64, usize)] {
        &self.writes
    }

    /// Accesses refused as outside RAM since the last clear.
    pub fn refused(&self) -> &[(u64, usize)] {
        &self.refused
    }

    pub fn clear_log(&mut self) {
        self.writes.clear();
        self.refused.clear();
    }

    /// Test-side (driver) writes, not logged.
    pub fn poke(&mut self, ipa: u64, data: &[u8]) {
        let r = self
            .range(ipa, data.len())
            .expect("test wrote outside its memory");
        self.bytes[r].copy_from_slice(data);
    }
}

impl GuestMemory for VecMemory {
    fn read(&mut self, at: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        let ipa = at.raw();
        match self.range(ipa, buf.len()) {
            Some(r) => {
                buf.copy_from_slice(&self.bytes[r]);
                Ok(())
            }
            None => {
                self.refused.push((ipa, buf.len()));
                Err(GuestMemError {
                    ipa: at,
                    len: buf.len(),
                })
            }
        }
    }

    fn write(&mut self, at: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        let ipa = at.raw();
        match self.range(ipa, data.len()) {
            Some(r) => {
                self.bytes[r].copy_from_slice(data);
                self.writes.push((ipa, data.len()));
                Ok(())
            }
            None => {
                self.refused.push((ipa, data.len()));
                Err(GuestMemError {
                    ipa: at,
                    len: data.len(),
                })
            }
        }
    }
}

/// Guest memory as the test driver writes it (the guest's own stores, not
/// the device's: [`VecMemory`] does not log them).
pub trait DriverMemory {
    fn poke(&mut self, ipa: u64, data: &[u8]);
}

impl DriverMemory for VecMemory {
    fn poke(&mut self, ipa: u64, data: &[u8]) {
        VecMemory::poke(self, ipa, data)
    }
}

/// The driver side of one split queue.
#[derive(Clone, Debug)]
pub struct DriverQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl DriverQueue {
    pub fn new(size: u16, desc: u64, avail: u64, used: u64) -> Self {
        DriverQueue {
            size,
            desc,
            avail,
            used,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// Configure `q` directly (queue-level tests, no transport).
    pub fn configure(&self, q: &mut Virtqueue) {
        q.set_num(u32::from(self.size));
        for (area, ipa) in [
            (Area::Descriptors, self.desc),
            (Area::Avail, self.avail),
            (Area::Used, self.used),
        ] {
            q.set_area_half(area, false, ipa as u32);
            q.set_area_half(area, true, (ipa >> 32) as u32);
        }
    }

    pub fn write_desc(
        &self,
        mem: &mut impl DriverMemory,
        i: u16,
        ipa: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&ipa.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        mem.poke(self.desc + 16 * u64::from(i), &raw);
    }

    /// Make `head` available.
    pub fn publish(&mut self, mem: &mut impl DriverMemory, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        mem.poke(self.avail + 4 + 2 * slot, &head.to_le_bytes());
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.poke(self.avail + 2, &self.avail_idx.to_le_bytes());
    }

    /// Add a chain of `(ipa, len, writable)` buffers (descriptors taken
    /// round-robin) and publish it. Returns its head.
    pub fn add(&mut self, mem: &mut impl DriverMemory, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (n, &(ipa, len, writable)) in bufs.iter().enumerate() {
            let i = self.next_desc;
            let next = (i + 1) % self.size;
            let mut flags = if writable { VIRTQ_DESC_F_WRITE } else { 0 };
            if n + 1 < bufs.len() {
                flags |= VIRTQ_DESC_F_NEXT;
            }
            self.write_desc(mem, i, ipa, len, flags, next);
            self.next_desc = next;
        }
        self.publish(mem, head);
        head
    }

    /// Used elements `(id, len)` the device added since the last call.
    pub fn take_used<M: GuestMemory>(&mut self, mem: &mut M) -> Vec<(u32, u32)> {
        let mut idx = [0u8; 2];
        mem.read(GuestAddr::new(self.used + 2), &mut idx)
            .expect("used ring in RAM");
        let idx = u16::from_le_bytes(idx);
        let mut out = Vec::new();
        while self.used_seen != idx {
            let slot = u64::from(self.used_seen % self.size);
            let mut e = [0u8; 8];
            mem.read(GuestAddr::new(self.used + 4 + 8 * slot), &mut e)
                .expect("used ring in RAM");
            out.push((
                u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
                u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            ));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// The byte range of the used ring the device may write.
    pub fn used_area(&self) -> core::ops::Range<u64> {
        self.used..self.used + Area::Used.len(self.size)
    }
}

/// A 32-bit register write that must be accepted by the transport.
pub fn write_reg<E: GuestMemory + ?Sized, D: VirtioDeviceIo<E>>(
    t: &mut MmioTransport<D>,
    env: &mut E,
    offset: u64,
    value: u32,
) -> TransportEvent {
    t.write(offset, 4, value, env)
        .expect("register write accepted")
}

/// A 32-bit register read that must be accepted by the transport.
pub fn read_reg<D: super::VirtioDevice>(t: &mut MmioTransport<D>, offset: u64) -> u32 {
    t.read(offset, 4).expect("register read accepted")
}

/// What Linux's virtio_mmio + virtio core do at probe, up to (not including)
/// DRIVER_OK: reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK (checked),
/// queue setup. Returns the status read back after FEATURES_OK.
pub fn handshake<E: GuestMemory + ?Sized, D: VirtioDeviceIo<E>>(
    t: &mut MmioTransport<D>,
    env: &mut E,
    features: u64,
    queues: &[DriverQueue],
) -> u32 {
    assert_eq!(read_reg(t, mmio::MAGIC_VALUE), 0x7472_6976);
    assert_eq!(read_reg(t, mmio::VERSION), 2);
    write_reg(t, env, mmio::STATUS, 0);
    write_reg(t, env, mmio::STATUS, mmio::STATUS_ACKNOWLEDGE);
    write_reg(
        t,
        env,
        mmio::STATUS,
        mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER,
    );
    write_reg(t, env, mmio::DEVICE_FEATURES_SEL, 1);
    let high = u64::from(read_reg(t, mmio::DEVICE_FEATURES)) << 32;
    write_reg(t, env, mmio::DEVICE_FEATURES_SEL, 0);
    let offered = high | u64::from(read_reg(t, mmio::DEVICE_FEATURES));
    let accepted = features & offered;
    write_reg(t, env, mmio::DRIVER_FEATURES_SEL, 1);
    write_reg(t, env, mmio::DRIVER_FEATURES, (accepted >> 32) as u32);
    write_reg(t, env, mmio::DRIVER_FEATURES_SEL, 0);
    write_reg(t, env, mmio::DRIVER_FEATURES, accepted as u32);
    let status = read_reg(t, mmio::STATUS) | mmio::STATUS_FEATURES_OK;
    write_reg(t, env, mmio::STATUS, status);
    let status = read_reg(t, mmio::STATUS);
    if status & mmio::STATUS_FEATURES_OK == 0 {
        return status;
    }
    for (i, q) in queues.iter().enumerate() {
        write_reg(t, env, mmio::QUEUE_SEL, i as u32);
        assert_eq!(read_reg(t, mmio::QUEUE_READY), 0);
        let max = read_reg(t, mmio::QUEUE_NUM_MAX);
        assert!(
            u32::from(q.size) <= max,
            "queue {i}: size {} > max {max}",
            q.size
        );
        write_reg(t, env, mmio::QUEUE_NUM, u32::from(q.size));
        for (lo, ipa) in [
            (mmio::QUEUE_DESC_LOW, q.desc),
            (mmio::QUEUE_DRIVER_LOW, q.avail),
            (mmio::QUEUE_DEVICE_LOW, q.used),
        ] {
            write_reg(t, env, lo, ipa as u32);
            write_reg(t, env, lo + 4, (ipa >> 32) as u32);
        }
        write_reg(t, env, mmio::QUEUE_READY, 1);
        assert_eq!(read_reg(t, mmio::QUEUE_READY), 1, "queue {i} ready");
    }
    status
}

/// Set DRIVER_OK after [`handshake`].
pub fn driver_ok<E: GuestMemory + ?Sized, D: VirtioDeviceIo<E>>(
    t: &mut MmioTransport<D>,
    env: &mut E,
) -> TransportEvent {
    let status = read_reg(t, mmio::STATUS);
    write_reg(t, env, mmio::STATUS, status | mmio::STATUS_DRIVER_OK)
}

/// Two queues; returns every chain with its readable length as written
/// length; 8 bytes of config `01 02 .. 08`, writes ignored.
#[derive(Default)]
pub struct Sink {
    /// Resets seen.
    pub resets: u32,
    /// The features of the latest DRIVER_OK, until a reset.
    pub activated: Option<u64>,
    /// Whether it calls an empty pass quiet
    /// ([`VirtioDevice::quiet_when_empty`]; its notify has no other effect).
    pub quiet: bool,
}

impl VirtioDevice for Sink {
    fn name(&self) -> &'static str {
        "sink"
    }
    fn device_id(&self) -> u32 {
        42
    }
    fn device_features(&self) -> u64 {
        1 | VIRTIO_F_VERSION_1 | (1 << 28) // bit 28 (INDIRECT_DESC) must be filtered out
    }
    fn queue_count(&self) -> usize {
        2
    }
    fn queue_max_size(&self, _q: usize) -> u16 {
        16
    }
    fn queue_name(&self, q: usize) -> &'static str {
        ["rxq", "txq"][q]
    }
    fn config_read(&self, offset: u64, data: &mut [u8]) {
        for (at, b) in (offset..).zip(data.iter_mut()) {
            *b = if at < 8 { at as u8 + 1 } else { 0 };
        }
    }
    fn config_write(&mut self, _offset: u64, _data: &[u8]) {}
    fn activate(&mut self, features: u64) {
        self.activated = Some(features);
    }
    fn quiet_when_empty(&self, _queue: usize) -> bool {
        self.quiet
    }
}

impl crate::savestate::SaveState for Sink {
    fn save(&self, w: &mut crate::savestate::StateWriter) {
        w.u32(self.resets);
        w.bool(self.activated.is_some());
        w.u64(self.activated.unwrap_or(0));
        w.bool(self.quiet);
    }
    fn restore(
        r: &mut crate::savestate::StateReader<'_>,
    ) -> Result<Self, crate::savestate::StateError> {
        let resets = r.u32()?;
        let active = r.bool("sink activated")?;
        let features = r.u64()?;
        Ok(Sink {
            resets,
            activated: active.then_some(features),
            quiet: r.bool("sink quiet")?,
        })
    }
}

impl<E: GuestMemory + ?Sized> VirtioDeviceIo<E> for Sink {
    fn reset(&mut self, _env: &mut E) {
        self.resets += 1;
        self.activated = None;
    }
    fn notify(
        &mut self,
        queue: usize,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let name = self.queue_name(queue);
        let q = &mut queues[queue];
        while let Some(c) = q
            .pop(env)
            .map_err(|e| DeviceError::from_queue(queue, name, e))?
        {
            let mut buf = [0u8; 64];
            c.read_readable(env, &mut buf)
                .map_err(|e| DeviceError::from_queue(queue, name, e))?;
            q.push_used(env, c.head(), c.readable_len())
                .map_err(|e| DeviceError::from_queue(queue, name, e))?;
        }
        Ok(())
    }
}
