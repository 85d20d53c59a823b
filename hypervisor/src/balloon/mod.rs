//! The virtio balloon device (virtio 1.2 section 5.5), device side.
//!
//! This module owns the balloon's protocol state for one VM: which guest pages
//! are ballooned (a bitmap over the VM's RAM, the source of truth the
//! hypervisor's frame table follows), the config space (`num_pages` target,
//! `actual`, `free_page_hint_cmd_id`, `poison_val`), the queue layout implied
//! by the offered features, and the validation of every PFN a guest sends.
//! What happens to a page (unmapping it from stage 2, returning its frame to
//! the pool, backing it again) is the [`BalloonBackend`]'s job; the memory
//! policy that chooses targets lives elsewhere and calls
//! [`MmioTransport::set_balloon_target`].
//!
//! This stage implements inflateq and deflateq (with or without
//! MUST_TELL_HOST: a deflate is applied before its buffer is returned either
//! way). The other queues exist when their feature is offered, at the
//! indexes Linux expects, but their buffers are not interpreted yet: the
//! first statistics buffer is kept (the driver refills and kicks it each time
//! it comes back, so returning it at once would make the two sides ping-pong)
//! and every other buffer is returned unused and counted.
//!
//! # Requests
//!
//! An inflate or deflate buffer is one chain of driver-written descriptors
//! holding little-endian u32 PFNs in 4 KiB units (whatever the guest's page
//! size), at most [`MAX_REQUEST_BYTES`] in total. Each PFN is zero-extended,
//! then rejected and counted if it is outside guest RAM, repeats a PFN of the
//! same request, or does not fit the page's state (inflating a ballooned page,
//! deflating one that is not). The backend is called once per request with
//! the accepted PFNs (sorted), then the bitmap is updated. Every buffer goes
//! back through the used ring with written length 0, rejected PFNs or not:
//! the Linux driver sleeps until it does.
//!
//! A malformed request (a device-writable descriptor, a length that is not a
//! multiple of 4 or over the bound, a buffer outside RAM, a broken chain) is
//! a device error: nothing of it is applied, its buffer is returned if its
//! head was valid (so a driver that never resets is not stuck on it), and the
//! transport sets DEVICE_NEEDS_RESET.
//!
//! # Reset
//!
//! When the driver resets the device (status 0, e.g. the balloon driver is
//! unloaded or the guest reboots) it assumes it owns all its memory again.
//! The device therefore deflates every ballooned page (through the backend,
//! in batches) and clears its state, except the target, which is the host's.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;
use core::ops::Range;

use crate::virtio::{
    DescChain, DeviceError, DeviceErrorKind, GuestMemory, MmioTransport, VirtioDevice,
    VirtioDeviceIo, Virtqueue, VIRTIO_F_VERSION_1,
};

/// Virtio device ID of the balloon.
pub const DEVICE_ID: u32 = 5;

/// The driver does not reuse deflated pages before the deflate buffer is used.
pub const F_MUST_TELL_HOST: u64 = 1 << 0;
/// Statistics queue.
pub const F_STATS_VQ: u64 = 1 << 1;
/// The guest may deflate on its own under memory pressure.
pub const F_DEFLATE_ON_OOM: u64 = 1 << 2;
/// Free page hinting (free_page_vq, `free_page_hint_cmd_id`).
pub const F_FREE_PAGE_HINT: u64 = 1 << 3;
/// `poison_val` in config.
pub const F_PAGE_POISON: u64 = 1 << 4;
/// Free page reporting (reporting_vq).
pub const F_PAGE_REPORTING: u64 = 1 << 5;
/// Modern virtio (always offered).
pub const F_VERSION_1: u64 = VIRTIO_F_VERSION_1;

/// Every feature a VM configuration may offer.
pub const SUPPORTED_FEATURES: u64 = F_MUST_TELL_HOST
    | F_STATS_VQ
    | F_DEFLATE_ON_OOM
    | F_FREE_PAGE_HINT
    | F_PAGE_POISON
    | F_PAGE_REPORTING
    | F_VERSION_1;

const FEATURE_NAMES: [(u64, &str); 7] = [
    (F_MUST_TELL_HOST, "MUST_TELL_HOST"),
    (F_STATS_VQ, "STATS_VQ"),
    (F_DEFLATE_ON_OOM, "DEFLATE_ON_OOM"),
    (F_FREE_PAGE_HINT, "FREE_PAGE_HINT"),
    (F_PAGE_POISON, "PAGE_POISON"),
    (F_PAGE_REPORTING, "PAGE_REPORTING"),
    (F_VERSION_1, "VERSION_1"),
];

/// QueueNumMax of every balloon queue. Linux needs at least 32 entries on
/// reporting_vq and 2 on free_page_vq; inflate and deflate use one at a time.
pub const QUEUE_SIZE: u16 = 128;

/// Largest inflate or deflate request accepted, in bytes (4096 PFNs; Linux
/// sends at most 256 PFNs, 1 KiB).
pub const MAX_REQUEST_BYTES: u32 = 16 * 1024;
const MAX_REQUEST_PFNS: usize = (MAX_REQUEST_BYTES / 4) as usize;

/// Balloon PFNs are in units of this, whatever the guest page size.
pub const BALLOON_PAGE_SHIFT: u32 = 12;

/// PFNs per backend call when the device deflates everything on reset.
const RESET_BATCH: usize = 256;

/// What a balloon queue is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueKind {
    Inflate,
    Deflate,
    Stats,
    FreePageHint,
    Reporting,
}

impl QueueKind {
    /// The name Linux gives the queue.
    pub fn name(self) -> &'static str {
        match self {
            QueueKind::Inflate => "inflateq",
            QueueKind::Deflate => "deflateq",
            QueueKind::Stats => "statsq",
            QueueKind::FreePageHint => "free_page_vq",
            QueueKind::Reporting => "reporting_vq",
        }
    }
}

/// The balloon cannot be created as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BalloonError {
    /// The VM configuration offers feature bits the balloon does not know.
    UnknownFeatures { bits: u64 },
    /// The heap could not hold the ballooned-page bitmap and request buffer.
    OutOfMemory { bytes: usize },
}

impl fmt::Display for BalloonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BalloonError::UnknownFeatures { bits } => {
                write!(f, "balloon features {bits:#x} are not balloon features")
            }
            BalloonError::OutOfMemory { bytes } => {
                write!(f, "no heap for the balloon's {bytes} bytes of page state")
            }
        }
    }
}

/// The hypervisor side of ballooning, over the VM's stage-2 tables and the
/// frame table. Tests implement it with a recording fake.
pub trait BalloonBackend {
    /// Guest PFNs (IPA >> 12) that are guest RAM: [start, end). The balloon
    /// is created with this range ([`Balloon::new`]); debug builds check
    /// that it does not change.
    fn ram_pfns(&self) -> Range<u64>;
    /// Unmap these guest pages and return their frames to the pool. Called
    /// once per request (the implementation flushes the TLB once), only with
    /// PFNs the device validated: in RAM, distinct, not ballooned.
    fn inflate(&mut self, pfns: &[u64]);
    /// These pages may be used by the guest again (the next access backs
    /// them, zeroed). Only with distinct, ballooned PFNs.
    fn deflate(&mut self, pfns: &[u64]);
}

/// What the balloon needs from the hypervisor while it works: guest memory
/// to read requests from and the backend to act on them. One per-VM view
/// implements both, so the device never holds a borrow of the VM.
pub trait BalloonEnv: GuestMemory + BalloonBackend {}
impl<T: GuestMemory + BalloonBackend + ?Sized> BalloonEnv for T {}

/// Balloon counters, for the shell and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BalloonStats {
    /// Buffers received on inflateq (well-formed or not).
    pub inflate_requests: u64,
    /// Buffers received on deflateq.
    pub deflate_requests: u64,
    /// Pages ballooned.
    pub pages_inflated: u64,
    /// Pages given back by deflate requests.
    pub pages_deflated: u64,
    /// Pages given back because the driver reset the device.
    pub pages_deflated_on_reset: u64,
    /// PFNs outside guest RAM (below, past the end, MMIO).
    pub rejected_out_of_range: u64,
    /// PFNs repeated within one request.
    pub rejected_duplicate: u64,
    /// Inflate of a page already ballooned.
    pub rejected_already_ballooned: u64,
    /// Deflate of a page not ballooned.
    pub rejected_not_ballooned: u64,
    /// Buffers on queues this stage does not interpret, returned unused.
    pub buffers_ignored: u64,
    /// Statistics buffers kept (not returned) until the device wants fresh
    /// statistics.
    pub stats_buffers_held: u64,
    /// Malformed requests or queues (each set DEVICE_NEEDS_RESET).
    pub device_errors: u64,
}

impl fmt::Display for BalloonStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "inflate {} req/{} pages, deflate {} req/{} pages (+{} on reset), rejected: {} out of range, \
             {} duplicate, {} already ballooned, {} not ballooned; {} buffers ignored, {} errors",
            self.inflate_requests,
            self.pages_inflated,
            self.deflate_requests,
            self.pages_deflated,
            self.pages_deflated_on_reset,
            self.rejected_out_of_range,
            self.rejected_duplicate,
            self.rejected_already_ballooned,
            self.rejected_not_ballooned,
            self.buffers_ignored,
            self.device_errors,
        )
    }
}

/// Feature bits as names ("MUST_TELL_HOST VERSION_1"); unknown bits as
/// "bit N"; no bits as "none".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureNames(pub u64);

/// See [`FeatureNames`].
pub fn feature_names(bits: u64) -> FeatureNames {
    FeatureNames(bits)
}

impl fmt::Display for FeatureNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        let mut sep = "";
        for bit in 0..64 {
            let mask = 1u64 << bit;
            if self.0 & mask == 0 {
                continue;
            }
            match FEATURE_NAMES.iter().find(|(m, _)| *m == mask) {
                Some((_, name)) => write!(f, "{sep}{name}")?,
                None => write!(f, "{sep}bit {bit}")?,
            }
            sep = " ";
        }
        Ok(())
    }
}

/// The balloon device of one VM.
pub struct Balloon {
    offered: u64,
    negotiated: u64,
    /// Guest RAM in PFNs, clipped to what a 32-bit PFN can name.
    ram: Range<u64>,
    /// One bit per page of `ram`: ballooned.
    ballooned: Vec<u64>,
    ballooned_count: u64,
    /// The current request's PFNs; allocated once, never grown.
    pfns: Vec<u64>,
    target: u32,
    actual: u32,
    poison_val: u32,
    free_page_hint_cmd_id: u32,
    /// Head of the statistics buffer the device keeps.
    held_stats: Option<u16>,
    stats: BalloonStats,
}

impl Balloon {
    /// A balloon offering `offered` (plus VERSION_1) for a VM whose RAM is
    /// the guest PFNs `ram` (what its backend's
    /// [`ram_pfns`](BalloonBackend::ram_pfns) reports).
    pub fn new(offered: u64, ram: Range<u64>) -> Result<Self, BalloonError> {
        let unknown = offered & !SUPPORTED_FEATURES;
        if unknown != 0 {
            return Err(BalloonError::UnknownFeatures { bits: unknown });
        }
        let ram = clip(ram);
        let (start, end) = (ram.start, ram.end);
        // At most 2^26 words: fits usize on every target we build for.
        let words = usize::try_from((end - start).div_ceil(64)).unwrap_or(usize::MAX);
        let mut ballooned = Vec::new();
        let mut pfns = Vec::new();
        let oom = BalloonError::OutOfMemory {
            bytes: words.saturating_mul(8) + MAX_REQUEST_PFNS * 8,
        };
        ballooned.try_reserve_exact(words).map_err(|_| oom)?;
        pfns.try_reserve_exact(MAX_REQUEST_PFNS).map_err(|_| oom)?;
        ballooned.resize(words, 0);
        Ok(Balloon {
            offered: offered | F_VERSION_1,
            negotiated: 0,
            ram,
            ballooned,
            ballooned_count: 0,
            pfns,
            target: 0,
            actual: 0,
            poison_val: 0,
            free_page_hint_cmd_id: 0,
            held_stats: None,
            stats: BalloonStats::default(),
        })
    }

    /// What the queue at `index` is, given the offered features: inflateq,
    /// deflateq, then statsq, free_page_vq and reporting_vq each only if its
    /// feature is offered, later ones moving down (as Linux numbers them).
    pub fn queue_kind(&self, index: usize) -> Option<QueueKind> {
        let optional = [
            (F_STATS_VQ, QueueKind::Stats),
            (F_FREE_PAGE_HINT, QueueKind::FreePageHint),
            (F_PAGE_REPORTING, QueueKind::Reporting),
        ];
        [QueueKind::Inflate, QueueKind::Deflate]
            .into_iter()
            .chain(
                optional
                    .into_iter()
                    .filter(|(f, _)| self.offered & f != 0)
                    .map(|(_, k)| k),
            )
            .nth(index)
    }

    /// The host's target, in 4 KiB pages (config `num_pages`).
    pub fn target(&self) -> u32 {
        self.target
    }

    /// Set the target. Returns whether it changed; if so the owner must tell
    /// the driver ([`MmioTransport::config_changed`], or use
    /// [`MmioTransport::set_balloon_target`], which does both).
    pub fn set_target(&mut self, pages: u32) -> bool {
        let changed = self.target != pages;
        self.target = pages;
        changed
    }

    /// The driver's `actual` (pages it says it has given).
    pub fn actual(&self) -> u32 {
        self.actual
    }

    /// Pages the device holds as ballooned.
    pub fn ballooned_pages(&self) -> u64 {
        self.ballooned_count
    }

    /// Whether guest page `pfn` is ballooned.
    pub fn is_ballooned(&self, pfn: u64) -> bool {
        self.bit(pfn).is_some_and(|i| bit_test(&self.ballooned, i))
    }

    /// Guest RAM as the balloon tracks it, in PFNs.
    pub fn ram_pfns(&self) -> Range<u64> {
        self.ram.clone()
    }

    /// Features negotiated at DRIVER_OK (0 before, and after reset).
    pub fn negotiated_features(&self) -> u64 {
        self.negotiated
    }

    pub fn offered_features(&self) -> u64 {
        self.offered
    }

    /// `poison_val` as written by the driver.
    pub fn poison_val(&self) -> u32 {
        self.poison_val
    }

    pub fn stats(&self) -> &BalloonStats {
        &self.stats
    }

    /// Config space size: QEMU's rule, 16 with PAGE_POISON, 12 with
    /// FREE_PAGE_HINT, else 8.
    pub fn config_size(&self) -> u64 {
        if self.offered & F_PAGE_POISON != 0 {
            16
        } else if self.offered & F_FREE_PAGE_HINT != 0 {
            12
        } else {
            8
        }
    }

    fn config_bytes(&self) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0..4].copy_from_slice(&self.target.to_le_bytes());
        c[4..8].copy_from_slice(&self.actual.to_le_bytes());
        c[8..12].copy_from_slice(&self.free_page_hint_cmd_id.to_le_bytes());
        c[12..16].copy_from_slice(&self.poison_val.to_le_bytes());
        c
    }

    /// Bit index of `pfn` in the bitmap, if it is guest RAM.
    fn bit(&self, pfn: u64) -> Option<usize> {
        if self.ram.contains(&pfn) {
            usize::try_from(pfn - self.ram.start).ok()
        } else {
            None
        }
    }

    fn process_queue<E: BalloonEnv + ?Sized>(
        &mut self,
        index: usize,
        kind: QueueKind,
        q: &mut Virtqueue,
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let name = kind.name();
        if kind == QueueKind::Stats && q.in_flight() == 0 {
            // The queue was restarted: the held buffer is gone with it.
            self.held_stats = None;
        }
        // Bounded: a driver on another vCPU adding buffers as fast as they are
        // used cannot keep this vCPU here. The device never suppresses
        // notifications, so the driver kicks again for what is left.
        for _ in 0..q.size() {
            let chain = match q.pop(env) {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => return Err(DeviceError::from_queue(index, name, e)),
            };
            let head = chain.head();
            match kind {
                QueueKind::Inflate | QueueKind::Deflate => {
                    let inflate = kind == QueueKind::Inflate;
                    if inflate {
                        self.stats.inflate_requests += 1;
                    } else {
                        self.stats.deflate_requests += 1;
                    }
                    self.handle_pfns(inflate, &chain, env)
                        .map_err(|k| DeviceError::request(index, name, head, k))?;
                }
                QueueKind::Stats if self.held_stats.is_none() => {
                    self.held_stats = Some(head);
                    self.stats.stats_buffers_held += 1;
                    continue;
                }
                QueueKind::Stats | QueueKind::FreePageHint | QueueKind::Reporting => {
                    self.stats.buffers_ignored += 1;
                }
            }
            q.push_used(env, head, 0)
                .map_err(|e| DeviceError::from_queue(index, name, e))?;
        }
        Ok(())
    }

    /// Validate and apply one inflate or deflate request.
    fn handle_pfns<E: BalloonEnv + ?Sized>(
        &mut self,
        inflate: bool,
        chain: &DescChain,
        env: &mut E,
    ) -> Result<(), DeviceErrorKind> {
        if let Some(d) = chain.descriptors().iter().find(|d| d.writable) {
            return Err(DeviceErrorKind::UnexpectedWritable { desc: d.index });
        }
        let len = chain.readable_len();
        if !len.is_multiple_of(4) {
            return Err(DeviceErrorKind::BadLength {
                len,
                multiple_of: 4,
            });
        }
        if len > MAX_REQUEST_BYTES {
            return Err(DeviceErrorKind::TooLong {
                len,
                max: MAX_REQUEST_BYTES,
            });
        }

        // Copy the PFNs out of guest memory first (each byte read once), in
        // chunks of whole PFNs; `pfns` has room for MAX_REQUEST_PFNS.
        self.pfns.clear();
        let mut chunk = [0u8; 256];
        let mut offset = 0u32;
        while offset < len {
            let n = core::cmp::min(chunk.len() as u32, len - offset) as usize;
            let got = chain
                .read_readable_at(env, offset, &mut chunk[..n])
                .map_err(DeviceErrorKind::Queue)?;
            for w in chunk[..got].chunks_exact(4) {
                // Zero-extended: a PFN is never sign-extended into a huge one.
                self.pfns
                    .push(u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]])));
            }
            if got < n {
                break; // Cannot happen: `len` is the readable length.
            }
            offset += n as u32;
        }

        // Sorting puts duplicates next to each other and gives the backend
        // ascending PFNs (runs it can merge).
        self.pfns.sort_unstable();
        let mut kept = 0;
        let mut prev = None;
        for i in 0..self.pfns.len() {
            let pfn = self.pfns[i];
            if prev == Some(pfn) {
                self.stats.rejected_duplicate += 1;
                continue;
            }
            prev = Some(pfn);
            let Some(bit) = self.bit(pfn) else {
                self.stats.rejected_out_of_range += 1;
                continue;
            };
            match (inflate, bit_test(&self.ballooned, bit)) {
                (true, true) => self.stats.rejected_already_ballooned += 1,
                (false, false) => self.stats.rejected_not_ballooned += 1,
                _ => {
                    self.pfns[kept] = pfn;
                    kept += 1;
                }
            }
        }
        self.pfns.truncate(kept);
        if kept == 0 {
            return Ok(());
        }

        if inflate {
            env.inflate(&self.pfns);
        } else {
            env.deflate(&self.pfns);
        }
        let start = self.ram.start;
        for &pfn in &self.pfns {
            // In range: checked above.
            let bit = (pfn - start) as usize;
            if inflate {
                bit_set(&mut self.ballooned, bit);
            } else {
                bit_clear(&mut self.ballooned, bit);
            }
        }
        let n = kept as u64;
        if inflate {
            self.ballooned_count += n;
            self.stats.pages_inflated += n;
        } else {
            self.ballooned_count -= n;
            self.stats.pages_deflated += n;
        }
        Ok(())
    }

    /// Give every ballooned page back to the guest and clear the bitmap.
    fn deflate_all<E: BalloonEnv + ?Sized>(&mut self, env: &mut E) {
        let mut batch = [0u64; RESET_BATCH];
        let mut n = 0;
        let start = self.ram.start;
        for (w, word) in self.ballooned.iter_mut().enumerate() {
            let mut bits = core::mem::take(word);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                batch[n] = start + (w as u64) * 64 + b;
                n += 1;
                if n == RESET_BATCH {
                    env.deflate(&batch);
                    n = 0;
                }
            }
        }
        if n > 0 {
            env.deflate(&batch[..n]);
        }
        self.stats.pages_deflated_on_reset += self.ballooned_count;
        self.ballooned_count = 0;
    }
}

/// The part of `ram` a guest can name: PFNs are 32-bit, so pages at and
/// above 2^32 (16 TiB) are never ballooned. An inverted range is empty.
fn clip(ram: Range<u64>) -> Range<u64> {
    let end = ram.end.min(1 << 32);
    ram.start.min(end)..end
}

fn bit_test(map: &[u64], i: usize) -> bool {
    map.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

fn bit_set(map: &mut [u64], i: usize) {
    if let Some(w) = map.get_mut(i / 64) {
        *w |= 1 << (i % 64);
    }
}

fn bit_clear(map: &mut [u64], i: usize) {
    if let Some(w) = map.get_mut(i / 64) {
        *w &= !(1 << (i % 64));
    }
}

impl VirtioDevice for Balloon {
    fn name(&self) -> &'static str {
        "virtio-balloon"
    }

    fn device_id(&self) -> u32 {
        DEVICE_ID
    }

    fn device_features(&self) -> u64 {
        self.offered
    }

    fn queue_count(&self) -> usize {
        2 + [F_STATS_VQ, F_FREE_PAGE_HINT, F_PAGE_REPORTING]
            .iter()
            .filter(|&&f| self.offered & f != 0)
            .count()
    }

    fn queue_max_size(&self, _queue: usize) -> u16 {
        QUEUE_SIZE
    }

    fn queue_name(&self, queue: usize) -> &'static str {
        self.queue_kind(queue)
            .map_or("unknown queue", QueueKind::name)
    }

    fn config_read(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_bytes();
        let size = self.config_size();
        for (at, b) in (offset..).zip(data.iter_mut()) {
            *b = if at < size { config[at as usize] } else { 0 };
        }
    }

    fn config_write(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (4..8) and `poison_val` (12..16) are the driver's;
        // `num_pages` and the hint command id are the device's.
        let mut config = self.config_bytes();
        let size = self.config_size();
        for (at, &b) in (offset..).zip(data.iter()) {
            if at < size && matches!(at, 4..=7 | 12..=15) {
                config[at as usize] = b;
            }
        }
        self.actual = u32::from_le_bytes([config[4], config[5], config[6], config[7]]);
        self.poison_val = u32::from_le_bytes([config[12], config[13], config[14], config[15]]);
    }

    fn activate(&mut self, features: u64) {
        self.negotiated = features;
    }
}

impl<E: BalloonEnv + ?Sized> VirtioDeviceIo<E> for Balloon {
    fn reset(&mut self, env: &mut E) {
        self.deflate_all(env);
        self.negotiated = 0;
        self.actual = 0;
        self.poison_val = 0;
        self.free_page_hint_cmd_id = 0;
        self.held_stats = None;
    }

    fn notify(
        &mut self,
        queue: usize,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let (Some(kind), Some(q)) = (self.queue_kind(queue), queues.get_mut(queue)) else {
            return Ok(());
        };
        debug_assert_eq!(
            clip(env.ram_pfns()),
            self.ram,
            "the balloon was created for other RAM"
        );
        let r = self.process_queue(queue, kind, q, env);
        if r.is_err() {
            self.stats.device_errors += 1;
        }
        r
    }
}

impl MmioTransport<Balloon> {
    /// Set the balloon target (in 4 KiB pages) and, if it changed, bump the
    /// config generation and raise the config-change interrupt. Returns
    /// whether the target changed.
    ///
    /// A target for a guest with larger pages should be a multiple of its
    /// page size in 4 KiB units: Linux rounds, and an unaligned target once
    /// made 64 KiB guests inflate and deflate endlessly.
    pub fn set_balloon_target(&mut self, pages: u32) -> bool {
        let changed = self.device_mut().set_target(pages);
        if changed {
            self.config_changed();
        }
        changed
    }
}

#[cfg(test)]
mod tests;
