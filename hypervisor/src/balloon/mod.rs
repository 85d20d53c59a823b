//! The virtio balloon device (virtio 1.2 section 5.5), device side.
//!
//! This module owns the balloon's protocol state for one VM: which guest pages
//! are ballooned (a bitmap over the VM's RAM, the source of truth the
//! hypervisor's frame table follows), the config space (`num_pages` target,
//! `actual`, `free_page_hint_cmd_id`, `poison_val`), the queue layout implied
//! by the offered features, the validation of every PFN and block a guest
//! sends, the latest guest statistics ([`stats`]) and the free page hinting
//! protocol ([`hint`]). What happens to a page (unmapping it from stage 2,
//! returning its frame to the pool, backing it again) is the
//! [`BalloonBackend`]'s job; the memory policy that chooses targets lives
//! elsewhere and calls [`MmioTransport::set_balloon_target`].
//!
//! Every feature is implemented; a feature the VM configuration does not
//! offer is not offered to the driver, and its queue does not exist (later
//! queues move down one index, as Linux numbers them).
//!
//! # Inflate and deflate
//!
//! An inflate or deflate buffer is one chain of driver-written descriptors
//! holding little-endian u32 PFNs in 4 KiB units (whatever the guest's page
//! size), at most [`MAX_REQUEST_BYTES`] in total. Each PFN is zero-extended,
//! then rejected and counted if it is outside guest RAM, repeats a PFN of the
//! same request, or does not fit the page's state (inflating a ballooned page,
//! deflating one that is not). The backend is called once per request with
//! the accepted PFNs (sorted), then the bitmap is updated. Every buffer goes
//! back through the used ring with written length 0, rejected PFNs or not:
//! the Linux driver sleeps until it does. Deflates are applied before their
//! buffer is returned, so MUST_TELL_HOST is honoured either way.
//!
//! DEFLATE_ON_OOM: Linux's OOM notifier deflates up to 256 pages on its own,
//! below the target. The device accepts such deflates like any other and
//! counts the pages that took the balloon below the target
//! ([`BalloonStats::pages_deflated_on_oom`]).
//!
//! # Statistics (STATS_VQ)
//!
//! The driver primes one driver-written buffer of 10-byte entries at start
//! and refills it each time the device returns it. The device parses each
//! buffer as it arrives (the latest [`StatsSample`], stamped with
//! [`BalloonBackend::now_us`]) and keeps it; returning it asks for fresh
//! statistics. [`MmioTransport::poll_balloon`] returns it once it has been
//! held for the VM's interval (default [`DEFAULT_STATS_INTERVAL_US`], 0 turns
//! polling off) or after [`Balloon::request_stats`]. A second buffer while
//! one is held is returned at once, unread, and counted. A buffer longer than
//! [`stats::MAX_STATS_BYTES`], not a whole number of entries, or with a
//! device-writable descriptor is a device error.
//!
//! # Free page reporting (PAGE_REPORTING)
//!
//! A report is one chain of device-writable descriptors (Linux adds the
//! scatterlist with `virtqueue_add_inbuf`; QEMU reads `in_sg`), each a free
//! guest-physical block. Each block must be inside guest RAM, 4 KiB aligned
//! in address and length, hold no ballooned page and not overlap another
//! block of the report; a block that is not is skipped and counted. The
//! valid blocks go to [`BalloonBackend::report`] in one call, then the buffer
//! is returned (written length 0). A driver-written descriptor is a device
//! error. Linux needs at least 32 entries on reporting_vq: QueueNumMax is
//! [`QUEUE_SIZE`].
//!
//! # Page poisoning (PAGE_POISON)
//!
//! `poison_val` is the driver's, written before DRIVER_OK; writes after
//! DRIVER_OK are ignored and counted, so the value pages are filled with
//! cannot change under pages already given back. [`Balloon::page_fill`] is
//! what every page the backend backs again must be filled with (the 32-bit
//! value repeated; 0 without PAGE_POISON). The config window is 8, 12 or 16
//! bytes as QEMU sizes it ([`Balloon::config_size`]).
//!
//! # Free page hinting (FREE_PAGE_HINT)
//!
//! See [`hint`] for the command-id protocol. Hinted blocks are validated as
//! report blocks are, discarded through [`BalloonBackend::hint`] and marked
//! in a per-page bitmap until DONE, so that [`Balloon::page_refaulted`] can
//! count hinted pages the guest took back before DONE.
//!
//! # Errors
//!
//! A malformed request (a descriptor in the wrong direction, a bad length, a
//! buffer outside RAM, a broken chain) is a device error: nothing of it is
//! applied, its buffer is returned if its head was valid (so a driver that
//! never resets is not stuck on it), and the transport sets
//! DEVICE_NEEDS_RESET.
//!
//! # What the owner (the VM run loop) calls
//!
//! - [`MmioTransport::poll_balloon`] with the current time, regularly (on
//!   every exit or timer tick; [`Balloon::next_stats_poll_us`] says when it
//!   next matters), then updates the guest's interrupt line if it returns
//!   [`TransportEvent::Interrupt`].
//! - [`Balloon::page_refaulted`] for every guest page it backs again after
//!   a stage-2 fault, and [`Balloon::page_fill`] for what to fill it with.
//! - [`Balloon::set_stats_interval`] for `balloon-stats`,
//!   [`MmioTransport::start_free_page_hint`] for `hint` (then the interrupt
//!   line); `vm::balloon_info` formats `info balloon` from its accessors.
//! - The [`BalloonBackend`] methods, over its stage-2 tables and frames.
//!
//! # Reset
//!
//! When the driver resets the device (status 0, e.g. the balloon driver is
//! unloaded or the guest reboots) it assumes it owns all its memory again.
//! The device therefore deflates every ballooned page (through the backend,
//! in batches), abandons a hinting run, forgets a held statistics buffer and
//! clears its state, except the target, the statistics interval and the last
//! statistics sample, which are the host's.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;
use core::ops::Range;

use crate::addr::{GuestAddr, GuestPfn};
use crate::virtio::{
    DescChain, DeviceError, DeviceErrorKind, GuestMemory, MmioTransport, TransportEvent,
    VirtioDevice, VirtioDeviceIo, Virtqueue, VIRTIO_F_VERSION_1,
};

pub mod hint;
mod state;
pub mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use hint::{HintError, HintOutcome, HintRun, HintState};
pub use stats::{StatTag, StatUnit, StatsSample, STAT_TABLE};

use hint::{CMD_ID_DONE, CMD_ID_STOP};
use stats::{MAX_STATS_BYTES, STAT_ENTRY_BYTES};

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

/// Bytes in a balloon page.
const BALLOON_PAGE_BYTES: u64 = 1 << BALLOON_PAGE_SHIFT;

/// PFNs per backend call when the device deflates everything on reset.
const RESET_BATCH: usize = 256;

/// Statistics polling interval of a new balloon: 2 s.
pub const DEFAULT_STATS_INTERVAL_US: u64 = 2_000_000;

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
/// frame table. Tests implement it with a recording fake that checks every
/// contract below.
///
/// "Give back" below means: unmap the page from stage 2 if it is mapped,
/// flush the TLB (once per call), return its frame to the pool. A page that
/// is already unmapped (given back before and not touched since) is left as
/// it is. A page given back is backed again on the guest's next access, by
/// the hypervisor's stage-2 fault path, with a fresh frame filled with
/// [`Balloon::page_fill`] of that VM at that time.
pub trait BalloonBackend {
    /// Guest PFNs (IPA >> 12) that are guest RAM: [start, end). The balloon
    /// is created with this range ([`Balloon::new`]); debug builds check
    /// that it does not change.
    fn ram_pfns(&self) -> Range<GuestPfn>;
    /// Monotonic time in microseconds: the clock the owner passes to
    /// [`MmioTransport::poll_balloon`] and
    /// [`MmioTransport::start_free_page_hint`]. Stamps statistics samples
    /// and the end of hinting runs. The default, `None`, makes the device
    /// use the latest time the owner passed (less precise: samples then
    /// look as old as the poll that asked for them).
    fn now_us(&self) -> Option<u64> {
        None
    }
    /// Give back these guest pages (inflate). Called once per request, only
    /// with PFNs the device validated: in RAM, distinct, ascending, not
    /// ballooned (they may have been reported or hinted, i.e. be unmapped
    /// already).
    fn inflate(&mut self, pfns: &[GuestPfn]);
    /// These pages may be used by the guest again (deflate): the guest is
    /// about to take them, so the backend may back them now (or leave each
    /// to be backed at its next access). Only with distinct, ascending,
    /// ballooned PFNs.
    fn deflate(&mut self, pfns: &[GuestPfn]);
    /// The device gave these ballooned pages back because the driver reset
    /// it: the guest does not know them as taken back yet, so nothing needs
    /// to be backed now. The default treats them as a deflate.
    fn deflate_on_reset(&mut self, pfns: &[GuestPfn]) {
        self.deflate(pfns);
    }
    /// The guest reported these blocks free (FREE_PAGE_REPORTING): give
    /// back every page of them. Blocks are PFN ranges, non-empty, ascending,
    /// disjoint, inside [`ram_pfns`](Self::ram_pfns), holding no ballooned
    /// page. Called once per report (up to [`QUEUE_SIZE`] blocks), before the
    /// report's buffer is returned to the guest. The default gives nothing
    /// back (the pages stay mapped: correct, but saves no memory).
    fn report(&mut self, blocks: &[Range<GuestPfn>]) {
        let _ = blocks;
    }
    /// The guest hinted these blocks free (FREE_PAGE_HINT): give back every
    /// page, with the guarantees of [`report`](Self::report). Until the
    /// run ends the hypervisor calls [`Balloon::page_refaulted`] for every
    /// page of the VM it backs again. The default gives nothing back.
    fn hint(&mut self, blocks: &[Range<GuestPfn>]) {
        let _ = blocks;
    }
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
    /// Pages the guest deflated on its own below the target (with
    /// DEFLATE_ON_OOM, Linux's OOM notifier).
    pub pages_deflated_on_oom: u64,
    /// Statistics buffers kept (not returned) until the device wants fresh
    /// statistics; each was parsed into a sample.
    pub stats_buffers_held: u64,
    /// Statistics buffers that arrived while one was held: returned unread.
    pub stats_buffers_extra: u64,
    /// Held statistics buffers returned to ask for fresh statistics.
    pub stats_refreshes: u64,
    /// Statistics entries with a tag the device does not know.
    pub stats_unknown_tags: u64,
    /// Statistics values above their bound (a memory figure above the
    /// VM's RAM, a cumulative value above 2^62), kept at the bound.
    pub stats_values_clamped: u64,
    /// Writes of `actual` above the VM's RAM in pages, kept at it.
    pub actual_writes_clamped: u64,
    /// Writes to `poison_val` after DRIVER_OK, ignored.
    pub poison_writes_ignored: u64,
    /// Buffers received on reporting_vq.
    pub reports: u64,
    /// Blocks reported and given back.
    pub report_blocks: u64,
    /// Pages in them.
    pub pages_reported: u64,
    /// Hinting runs started by the host.
    pub hint_runs: u64,
    /// Hinted blocks accepted and given back.
    pub hint_blocks: u64,
    /// Pages newly hinted in them.
    pub pages_hinted: u64,
    /// Hinted pages the guest touched again before DONE.
    pub hint_pages_reused: u64,
    /// Command-id buffers naming no run the device is waiting for.
    pub hint_ids_stale: u64,
    /// Hint buffers that arrived while no run was started: returned, not
    /// touched.
    pub hint_buffers_stale: u64,
    /// Report or hint blocks not entirely inside guest RAM.
    pub blocks_rejected_outside_ram: u64,
    /// Blocks whose address or length is not a multiple of 4 KiB (or empty).
    pub blocks_rejected_unaligned: u64,
    /// Blocks holding a ballooned page.
    pub blocks_rejected_ballooned: u64,
    /// Blocks overlapping an earlier block of the same buffer.
    pub blocks_rejected_overlapping: u64,
    /// Malformed requests or queues (each set DEVICE_NEEDS_RESET).
    pub device_errors: u64,
}

impl BalloonStats {
    /// Report or hint blocks rejected, for any reason.
    pub fn blocks_rejected(&self) -> u64 {
        self.blocks_rejected_outside_ram
            + self.blocks_rejected_unaligned
            + self.blocks_rejected_ballooned
            + self.blocks_rejected_overlapping
    }
}

impl fmt::Display for BalloonStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "inflate {} req/{} pages, deflate {} req/{} pages (+{} on reset, {} on OOM), rejected: \
             {} out of range, {} duplicate, {} already ballooned, {} not ballooned; {} pages reported, \
             {} hinted; {} errors",
            self.inflate_requests,
            self.pages_inflated,
            self.deflate_requests,
            self.pages_deflated,
            self.pages_deflated_on_reset,
            self.pages_deflated_on_oom,
            self.rejected_out_of_range,
            self.rejected_duplicate,
            self.rejected_already_ballooned,
            self.rejected_not_ballooned,
            self.pages_reported,
            self.pages_hinted,
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
    /// DRIVER_OK was set (and no reset since): `poison_val` is frozen.
    live: bool,
    /// Guest RAM in PFNs, clipped to what a 32-bit PFN can name.
    ram: Range<GuestPfn>,
    /// One bit per page of `ram`: ballooned.
    ballooned: Vec<u64>,
    ballooned_count: u64,
    /// One bit per page of `ram`: hinted in the current run and not touched
    /// since. Empty unless FREE_PAGE_HINT is offered.
    hinted: Vec<u64>,
    hinted_count: u64,
    /// The current request's PFNs; allocated once, never grown.
    pfns: Vec<GuestPfn>,
    /// The current report's or hint's valid blocks; allocated once (a chain
    /// has at most QUEUE_SIZE descriptors), never grown.
    blocks: Vec<Range<GuestPfn>>,
    target: u32,
    actual: u32,
    poison_val: u32,
    /// Head of the statistics buffer the device keeps, and since when.
    held_stats: Option<u16>,
    held_since_us: u64,
    stats_interval_us: u64,
    stats_requested: bool,
    sample: Option<StatsSample>,
    hint_state: HintState,
    /// The id of the latest run (0 before the first).
    hint_id: u32,
    /// The latest run, going or ended.
    hint_run: Option<HintRun>,
    /// Config changed by the device; the transport raises the interrupt.
    config_change: bool,
    /// The latest time seen (owner's calls and the backend's clock), so
    /// that time never goes backwards for the device.
    clock_us: u64,
    stats: BalloonStats,
}

/// Why a report or hint block was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockReject {
    OutsideRam,
    Unaligned,
    Ballooned,
}

impl Balloon {
    /// A balloon offering `offered` (plus VERSION_1) for a VM whose RAM is
    /// the guest PFNs `ram` (what its backend's
    /// [`ram_pfns`](BalloonBackend::ram_pfns) reports).
    pub fn new(offered: u64, ram: Range<GuestPfn>) -> Result<Self, BalloonError> {
        let unknown = offered & !SUPPORTED_FEATURES;
        if unknown != 0 {
            return Err(BalloonError::UnknownFeatures { bits: unknown });
        }
        let ram = clip(ram);
        let (start, end) = (ram.start, ram.end);
        // At most 2^26 words: fits usize on every target we build for.
        let words = usize::try_from((end - start).div_ceil(64)).unwrap_or(usize::MAX);
        let hint_words = if offered & F_FREE_PAGE_HINT != 0 {
            words
        } else {
            0
        };
        let mut ballooned = Vec::new();
        let mut hinted = Vec::new();
        let mut pfns = Vec::new();
        let mut blocks = Vec::new();
        let oom = BalloonError::OutOfMemory {
            bytes: (words.saturating_add(hint_words)).saturating_mul(8)
                + MAX_REQUEST_PFNS * 8
                + usize::from(QUEUE_SIZE) * core::mem::size_of::<Range<GuestPfn>>(),
        };
        ballooned.try_reserve_exact(words).map_err(|_| oom)?;
        hinted.try_reserve_exact(hint_words).map_err(|_| oom)?;
        pfns.try_reserve_exact(MAX_REQUEST_PFNS).map_err(|_| oom)?;
        blocks
            .try_reserve_exact(usize::from(QUEUE_SIZE))
            .map_err(|_| oom)?;
        ballooned.resize(words, 0);
        hinted.resize(hint_words, 0);
        Ok(Balloon {
            offered: offered | F_VERSION_1,
            negotiated: 0,
            live: false,
            ram,
            ballooned,
            ballooned_count: 0,
            hinted,
            hinted_count: 0,
            pfns,
            blocks,
            target: 0,
            actual: 0,
            poison_val: 0,
            held_stats: None,
            held_since_us: 0,
            stats_interval_us: DEFAULT_STATS_INTERVAL_US,
            stats_requested: false,
            sample: None,
            hint_state: HintState::Idle,
            hint_id: 0,
            hint_run: None,
            config_change: false,
            clock_us: 0,
            stats: BalloonStats::default(),
        })
    }

    /// What the queue at `index` is, given the offered features: inflateq,
    /// deflateq, then statsq, free_page_vq and reporting_vq each only if its
    /// feature is offered, later ones moving down (as Linux numbers them).
    pub fn queue_kind(&self, index: usize) -> Option<QueueKind> {
        self.queue_kinds().nth(index)
    }

    /// The index of the `kind` queue, if its feature is offered.
    pub fn queue_index(&self, kind: QueueKind) -> Option<usize> {
        self.queue_kinds().position(|k| k == kind)
    }

    fn queue_kinds(&self) -> impl Iterator<Item = QueueKind> {
        let optional = [
            (F_STATS_VQ, QueueKind::Stats),
            (F_FREE_PAGE_HINT, QueueKind::FreePageHint),
            (F_PAGE_REPORTING, QueueKind::Reporting),
        ];
        let offered = self.offered;
        [QueueKind::Inflate, QueueKind::Deflate].into_iter().chain(
            optional
                .into_iter()
                .filter(move |(f, _)| offered & f != 0)
                .map(|(_, k)| k),
        )
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
    pub fn is_ballooned(&self, pfn: GuestPfn) -> bool {
        self.bit(pfn).is_some_and(|i| bit_test(&self.ballooned, i))
    }

    /// Whether guest page `pfn` was hinted free in the current hinting run
    /// and not touched since.
    pub fn is_hinted(&self, pfn: GuestPfn) -> bool {
        self.hinted_count != 0 && self.bit(pfn).is_some_and(|i| bit_test(&self.hinted, i))
    }

    /// Guest RAM as the balloon tracks it, in PFNs.
    pub fn ram_pfns(&self) -> Range<GuestPfn> {
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

    /// What every page of this VM that the hypervisor backs again (after a
    /// deflate, report or hint, or any other page given back) must be filled
    /// with: this 32-bit value repeated, little-endian. `poison_val` when
    /// PAGE_POISON is negotiated, else 0 (zeroed pages).
    pub fn page_fill(&self) -> u32 {
        if self.negotiated & F_PAGE_POISON != 0 {
            self.poison_val
        } else {
            0
        }
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

    /// `free_page_hint_cmd_id` as the driver reads it (see [`hint`]).
    pub fn free_page_hint_cmd_id(&self) -> u32 {
        match self.hint_state {
            HintState::Idle | HintState::HostStopped => CMD_ID_STOP,
            HintState::Requested | HintState::Started => self.hint_id,
            HintState::Done => CMD_ID_DONE,
        }
    }

    fn config_bytes(&self) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[0..4].copy_from_slice(&self.target.to_le_bytes());
        c[4..8].copy_from_slice(&self.actual.to_le_bytes());
        c[8..12].copy_from_slice(&self.free_page_hint_cmd_id().to_le_bytes());
        c[12..16].copy_from_slice(&self.poison_val.to_le_bytes());
        c
    }

    /// The current time: the backend's clock if it has one, never before
    /// the latest time seen.
    fn now<E: BalloonEnv + ?Sized>(&mut self, env: &E) -> u64 {
        self.clock_us = self.clock_us.max(env.now_us().unwrap_or(0));
        self.clock_us
    }

    /// The owner says it is `now_us`.
    fn saw_time(&mut self, now_us: u64) -> u64 {
        self.clock_us = self.clock_us.max(now_us);
        self.clock_us
    }

    // ---- Statistics --------------------------------------------------------

    /// The latest statistics the guest sent.
    pub fn stats_sample(&self) -> Option<&StatsSample> {
        self.sample.as_ref()
    }

    /// Tests only: an empty sample that arrived at `arrived_us`, as if the
    /// driver had sent one.
    #[cfg(any(test, feature = "testing"))]
    pub fn set_stats_sample_for_test(&mut self, arrived_us: u64) {
        self.sample = Some(StatsSample::new(arrived_us));
    }

    /// The statistics polling interval, microseconds (0: off).
    pub fn stats_interval_us(&self) -> u64 {
        self.stats_interval_us
    }

    /// Set the polling interval (`balloon-stats <vm> <seconds>`); 0 turns
    /// periodic polling off ([`request_stats`](Self::request_stats) still
    /// works).
    pub fn set_stats_interval(&mut self, seconds: u32) {
        self.stats_interval_us = u64::from(seconds) * 1_000_000;
    }

    /// Ask for fresh statistics: the next [`MmioTransport::poll_balloon`]
    /// returns the held buffer whatever the interval. If no buffer is held
    /// the driver is already refilling it.
    pub fn request_stats(&mut self) {
        self.stats_requested = true;
    }

    /// Whether [`MmioTransport::poll_balloon`] at `now_us` would return the
    /// statistics buffer.
    pub fn stats_due(&self, now_us: u64) -> bool {
        self.negotiated & F_STATS_VQ != 0
            && self.held_stats.is_some()
            && (self.stats_requested
                || (self.stats_interval_us != 0
                    && now_us.saturating_sub(self.held_since_us) >= self.stats_interval_us))
    }

    /// When the statistics buffer falls due if nothing else happens, for the
    /// owner's timer; `None` while no buffer is held or polling is off.
    #[inline]
    pub fn next_stats_poll_us(&self) -> Option<u64> {
        if self.negotiated & F_STATS_VQ == 0 || self.held_stats.is_none() {
            return None;
        }
        if self.stats_requested {
            return Some(self.held_since_us);
        }
        (self.stats_interval_us != 0)
            .then(|| self.held_since_us.saturating_add(self.stats_interval_us))
    }

    /// Return the held statistics buffer (the driver refills it).
    fn return_stats<E: BalloonEnv + ?Sized>(
        &mut self,
        queues: &mut [Virtqueue],
        env: &mut E,
    ) -> Result<(), DeviceError> {
        let Some(index) = self.queue_index(QueueKind::Stats) else {
            return Ok(());
        };
        let (Some(q), Some(head)) = (queues.get_mut(index), self.held_stats.take()) else {
            return Ok(());
        };
        if !q.ready() || q.in_flight() == 0 {
            // The queue was restarted: the held buffer went with it.
            return Ok(());
        }
        if let Err(e) = q.push_used(env, head, 0) {
            self.stats.device_errors += 1;
            return Err(DeviceError::from_queue(index, QueueKind::Stats.name(), e));
        }
        self.stats_requested = false;
        self.stats.stats_refreshes += 1;
        Ok(())
    }

    /// Parse a statistics buffer into the latest sample.
    fn take_stats<E: BalloonEnv + ?Sized>(
        &mut self,
        chain: &DescChain,
        env: &mut E,
    ) -> Result<(), DeviceErrorKind> {
        if let Some(d) = chain.descriptors().iter().find(|d| d.writable) {
            return Err(DeviceErrorKind::UnexpectedWritable { desc: d.index });
        }
        let len = chain.readable_len();
        if len > MAX_STATS_BYTES {
            return Err(DeviceErrorKind::TooLong {
                len,
                max: MAX_STATS_BYTES,
            });
        }
        if !len.is_multiple_of(STAT_ENTRY_BYTES) {
            return Err(DeviceErrorKind::BadLength {
                len,
                multiple_of: STAT_ENTRY_BYTES,
            });
        }
        let mut buf = [0u8; MAX_STATS_BYTES as usize];
        let buf = &mut buf[..len as usize];
        chain
            .read_readable(env, buf)
            .map_err(DeviceErrorKind::Queue)?;
        let mut sample = StatsSample::new(self.now(env));
        sample.add_entries_within(buf, self.ram_bytes());
        self.stats.stats_unknown_tags += u64::from(sample.unknown_tags);
        self.stats.stats_values_clamped += u64::from(sample.clamped);
        self.sample = Some(sample);
        Ok(())
    }

    // ---- Free page hinting -------------------------------------------------

    /// Where the hinting protocol stands.
    pub fn hint_state(&self) -> HintState {
        self.hint_state
    }

    /// The latest hinting run (going or ended).
    pub fn hint_run(&self) -> Option<&HintRun> {
        self.hint_run.as_ref()
    }

    /// Start a hinting run with a fresh command id at `now_us`. Sets the
    /// config; the owner must raise the config-change interrupt
    /// ([`MmioTransport::start_free_page_hint`] does both and also checks
    /// that the device is not stopped). A run the driver has not answered
    /// yet is superseded; a started one must end first.
    pub fn start_hint(&mut self, now_us: u64) -> Result<u32, HintError> {
        let now_us = self.saw_time(now_us);
        if self.offered & F_FREE_PAGE_HINT == 0 {
            return Err(HintError::NotOffered);
        }
        if self.negotiated & F_FREE_PAGE_HINT == 0 {
            return Err(HintError::NotNegotiated);
        }
        match self.hint_state {
            HintState::Started | HintState::HostStopped => {
                return Err(HintError::InProgress { id: self.hint_id });
            }
            HintState::Requested => self.end_run(HintOutcome::Superseded, now_us),
            HintState::Idle | HintState::Done => {}
        }
        let id = hint::next_id(self.hint_id);
        self.hint_id = id;
        self.hint_state = HintState::Requested;
        self.hint_run = Some(HintRun::new(id, now_us));
        self.stats.hint_runs += 1;
        self.config_change = true;
        Ok(id)
    }

    /// Ask the driver to stop the current run (config shows STOP); it
    /// answers with its STOP buffer, then the device sets DONE. A run the
    /// driver has not answered ends at once with DONE. Returns whether there
    /// was a run to stop; the owner raises the config-change interrupt
    /// ([`MmioTransport::stop_free_page_hint`]).
    pub fn stop_hint(&mut self, now_us: u64) -> bool {
        let now_us = self.saw_time(now_us);
        match self.hint_state {
            HintState::Requested => self.finish_run(now_us),
            HintState::Started => {
                self.hint_state = HintState::HostStopped;
                self.config_change = true;
            }
            _ => return false,
        }
        true
    }

    /// The hypervisor backed guest page `pfn` again after a stage-2 fault.
    /// Call it on every such fault (cheap when no run is going): if the page
    /// was hinted in the current run and not touched since, it counts as
    /// reused before DONE. Returns whether it did.
    pub fn page_refaulted(&mut self, pfn: GuestPfn) -> bool {
        if self.hinted_count == 0 {
            return false;
        }
        let Some(i) = self.bit(pfn) else {
            return false;
        };
        if !bit_test(&self.hinted, i) {
            return false;
        }
        bit_clear(&mut self.hinted, i);
        self.hinted_count -= 1;
        self.stats.hint_pages_reused += 1;
        if let Some(run) = self.hint_run.as_mut() {
            run.pages_reused += 1;
        }
        true
    }

    /// The driver's command-id buffer.
    fn hint_command(&mut self, id: u32, now_us: u64) {
        match self.hint_state {
            HintState::Requested if id == self.hint_id => {
                self.hint_state = HintState::Started;
                if let Some(run) = self.hint_run.as_mut() {
                    run.answered_us = Some(now_us);
                }
            }
            // STOP, or the driver moved on to another id: the run is over.
            HintState::Started if id != self.hint_id => self.finish_run(now_us),
            HintState::HostStopped if id == CMD_ID_STOP => self.finish_run(now_us),
            _ => self.stats.hint_ids_stale += 1,
        }
    }

    /// The run ended normally: show DONE, the guest reuses its hinted pages.
    fn finish_run(&mut self, now_us: u64) {
        self.end_run(HintOutcome::Done, now_us);
        self.hint_state = HintState::Done;
        self.config_change = true;
    }

    /// Close the record of the current run and forget which pages it hinted.
    fn end_run(&mut self, outcome: HintOutcome, now_us: u64) {
        if let Some(run) = self.hint_run.as_mut() {
            if run.outcome == HintOutcome::Running {
                run.outcome = outcome;
                run.ended_us = Some(now_us);
            }
        }
        if self.hinted_count != 0 {
            self.hinted.iter_mut().for_each(|w| *w = 0);
            self.hinted_count = 0;
        }
    }

    /// One buffer on free_page_vq: an optional 4-byte command id
    /// (driver-written), then optional hinted blocks (device-writable).
    fn handle_hint<E: BalloonEnv + ?Sized>(
        &mut self,
        chain: &DescChain,
        env: &mut E,
    ) -> Result<(), DeviceErrorKind> {
        let readable = chain.readable_len();
        let has_blocks = chain.descriptors().iter().any(|d| d.writable);
        if readable != 0 || !has_blocks {
            if readable != 4 {
                return Err(DeviceErrorKind::WrongLength {
                    len: readable,
                    expected: 4,
                });
            }
            let mut id = [0u8; 4];
            chain
                .read_readable(env, &mut id)
                .map_err(DeviceErrorKind::Queue)?;
            let now = self.now(env);
            self.hint_command(u32::from_le_bytes(id), now);
        }
        if !has_blocks {
            return Ok(());
        }
        if self.hint_state != HintState::Started {
            self.stats.hint_buffers_stale += 1;
            return Ok(());
        }
        self.collect_blocks(chain);
        if self.blocks.is_empty() {
            return Ok(());
        }
        env.hint(&self.blocks);
        let start = self.ram.start;
        let mut new_pages = 0;
        for r in &self.blocks {
            // In range: collect_blocks checked it.
            new_pages += bits_set(
                &mut self.hinted,
                (r.start - start) as usize..(r.end - start) as usize,
            );
        }
        let n = self.blocks.len() as u64;
        self.hinted_count += new_pages;
        self.stats.hint_blocks += n;
        self.stats.pages_hinted += new_pages;
        if let Some(run) = self.hint_run.as_mut() {
            run.blocks += n;
            run.pages_hinted += new_pages;
        }
        Ok(())
    }

    // ---- Free page reporting -----------------------------------------------

    /// One report: device-writable blocks only.
    fn handle_report<E: BalloonEnv + ?Sized>(
        &mut self,
        chain: &DescChain,
        env: &mut E,
    ) -> Result<(), DeviceErrorKind> {
        if let Some(d) = chain.descriptors().iter().find(|d| !d.writable) {
            return Err(DeviceErrorKind::UnexpectedReadable { desc: d.index });
        }
        self.stats.reports += 1;
        self.collect_blocks(chain);
        if self.blocks.is_empty() {
            return Ok(());
        }
        env.report(&self.blocks);
        self.stats.report_blocks += self.blocks.len() as u64;
        self.stats.pages_reported += self.blocks.iter().map(|r| r.end - r.start).sum::<u64>();
        Ok(())
    }

    /// Fill `blocks` with the valid device-writable blocks of `chain`,
    /// ascending and disjoint; count the others.
    fn collect_blocks(&mut self, chain: &DescChain) {
        self.blocks.clear();
        // A chain has at most QueueNum <= QUEUE_SIZE descriptors, the
        // capacity of `blocks`: `take` skips nothing, `push` never allocates.
        let room = self.blocks.capacity();
        for d in chain.descriptors().iter().filter(|d| d.writable).take(room) {
            match self.check_block(d.ipa, d.len) {
                Ok(r) => self.blocks.push(r),
                Err(BlockReject::OutsideRam) => self.stats.blocks_rejected_outside_ram += 1,
                Err(BlockReject::Unaligned) => self.stats.blocks_rejected_unaligned += 1,
                Err(BlockReject::Ballooned) => self.stats.blocks_rejected_ballooned += 1,
            }
        }
        self.blocks.sort_unstable_by_key(|r| r.start);
        let mut kept = 0;
        let mut end = GuestPfn::new(0);
        for i in 0..self.blocks.len() {
            let r = self.blocks[i].clone();
            if kept > 0 && r.start < end {
                self.stats.blocks_rejected_overlapping += 1;
                continue;
            }
            end = r.end;
            self.blocks[kept] = r;
            kept += 1;
        }
        self.blocks.truncate(kept);
    }

    /// The PFN range of a block at `ipa`, `len` bytes, if it may be given
    /// back. `ipa + len` does not overflow (the queue parser checked).
    fn check_block(&self, at: GuestAddr, len: u32) -> Result<Range<GuestPfn>, BlockReject> {
        let (ipa, end) = (at.raw(), (at + u64::from(len)).raw());
        let ram_start = self.ram.start.raw() << BALLOON_PAGE_SHIFT;
        let ram_end = self.ram.end.raw() << BALLOON_PAGE_SHIFT;
        if ipa < ram_start || end > ram_end {
            return Err(BlockReject::OutsideRam);
        }
        if len == 0
            || !ipa.is_multiple_of(BALLOON_PAGE_BYTES)
            || !u64::from(len).is_multiple_of(BALLOON_PAGE_BYTES)
        {
            return Err(BlockReject::Unaligned);
        }
        let pfns =
            GuestPfn::new(ipa >> BALLOON_PAGE_SHIFT)..GuestPfn::new(end >> BALLOON_PAGE_SHIFT);
        let bits = (pfns.start - self.ram.start) as usize..(pfns.end - self.ram.start) as usize;
        if self.ballooned_count != 0 && bits_any(&self.ballooned, bits) {
            return Err(BlockReject::Ballooned);
        }
        Ok(pfns)
    }

    // ---- Queues ------------------------------------------------------------

    /// The VM's RAM in bytes (as far as a 32-bit PFN names it).
    fn ram_bytes(&self) -> u64 {
        (self.ram.end - self.ram.start).saturating_mul(BALLOON_PAGE_BYTES)
    }

    /// Bit index of `pfn` in the bitmaps, if it is guest RAM.
    fn bit(&self, pfn: GuestPfn) -> Option<usize> {
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
            let result = match kind {
                QueueKind::Inflate | QueueKind::Deflate => {
                    let inflate = kind == QueueKind::Inflate;
                    if inflate {
                        self.stats.inflate_requests += 1;
                    } else {
                        self.stats.deflate_requests += 1;
                    }
                    self.handle_pfns(inflate, &chain, env)
                }
                QueueKind::Stats if self.held_stats.is_none() => {
                    self.take_stats(&chain, env)
                        .map_err(|k| DeviceError::request(index, name, head, k))?;
                    self.held_stats = Some(head);
                    self.held_since_us = self.sample.map_or(0, |s| s.arrived_us);
                    self.stats.stats_buffers_held += 1;
                    continue;
                }
                QueueKind::Stats => {
                    self.stats.stats_buffers_extra += 1;
                    Ok(())
                }
                QueueKind::FreePageHint => self.handle_hint(&chain, env),
                QueueKind::Reporting => self.handle_report(&chain, env),
            };
            result.map_err(|k| DeviceError::request(index, name, head, k))?;
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
                self.pfns.push(GuestPfn::from_wire(u32::from_le_bytes([
                    w[0], w[1], w[2], w[3],
                ])));
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
        let mut i = 0;
        while i < self.pfns.len() {
            // A run of consecutive PFNs, checked a bitmap word at a time
            // when it is all in RAM and all in the state the request needs
            // (the common case); else one PFN at a time, as is a run that
            // starts with a duplicate of the last one's end.
            let end = i + run_len(&self.pfns[i..]);
            let (first, last) = (self.pfns[i], self.pfns[end - 1]);
            if prev != Some(first) {
                if let (Some(lo), Some(_)) = (self.bit(first), self.bit(last)) {
                    let bits = lo..lo + (end - i);
                    let clean = if inflate {
                        !bits_any(&self.ballooned, bits)
                    } else {
                        bits_all(&self.ballooned, bits)
                    };
                    if clean {
                        self.pfns.copy_within(i..end, kept);
                        kept += end - i;
                        prev = Some(last);
                        i = end;
                        continue;
                    }
                }
            }
            for j in i..end {
                let pfn = self.pfns[j];
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
            i = end;
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
        let mut i = 0;
        while i < self.pfns.len() {
            // In range and unique: checked above.
            let end = i + run_len(&self.pfns[i..]);
            let lo = (self.pfns[i] - start) as usize;
            let bits = lo..lo + (end - i);
            if inflate {
                bits_set(&mut self.ballooned, bits);
            } else {
                bits_clear(&mut self.ballooned, bits);
            }
            i = end;
        }
        let n = kept as u64;
        if inflate {
            self.ballooned_count += n;
            self.stats.pages_inflated += n;
            if self.hinted_count != 0 {
                // Hinted pages the guest balloons are no longer the run's.
                for &pfn in &self.pfns {
                    let bit = (pfn - start) as usize;
                    if bit_test(&self.hinted, bit) {
                        bit_clear(&mut self.hinted, bit);
                        self.hinted_count -= 1;
                    }
                }
            }
        } else {
            let before = self.ballooned_count;
            self.ballooned_count -= n;
            self.stats.pages_deflated += n;
            // The pages that took the balloon below the target: the guest
            // took them back on its own (DEFLATE_ON_OOM). Without the
            // feature such a deflate is a balloon page migration (Linux
            // gives back the old page around inflating the new one): not
            // an OOM deflate.
            if self.negotiated & F_DEFLATE_ON_OOM != 0 {
                let target = u64::from(self.target);
                self.stats.pages_deflated_on_oom +=
                    target.saturating_sub(self.ballooned_count) - target.saturating_sub(before);
            }
        }
        Ok(())
    }

    /// Give every ballooned page back to the guest and clear the bitmap.
    fn deflate_all<E: BalloonEnv + ?Sized>(&mut self, env: &mut E) {
        let mut batch = [GuestPfn::new(0); RESET_BATCH];
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
                    env.deflate_on_reset(&batch);
                    n = 0;
                }
            }
        }
        if n > 0 {
            env.deflate_on_reset(&batch[..n]);
        }
        self.stats.pages_deflated_on_reset += self.ballooned_count;
        self.ballooned_count = 0;
    }
}

/// The part of `ram` a guest can name: PFNs are 32-bit, so pages at and
/// The part of `ram` a guest can name: PFNs are 32-bit, so pages at and
/// above 2^32 (16 TiB) are never ballooned. An inverted range is empty.
fn clip(ram: Range<GuestPfn>) -> Range<GuestPfn> {
    let end = ram.end.min(GuestPfn::new(1 << 32));
    ram.start.min(end)..end
}

fn bit_test(map: &[u64], i: usize) -> bool {
    map.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

fn bit_clear(map: &mut [u64], i: usize) {
    if let Some(w) = map.get_mut(i / 64) {
        *w &= !(1 << (i % 64));
    }
}

/// The words of `map` covering the bits `bits`, each with the mask of the
/// bits inside the range.
fn word_masks(bits: Range<usize>) -> impl Iterator<Item = (usize, u64)> {
    let mut i = bits.start;
    core::iter::from_fn(move || {
        if i >= bits.end {
            return None;
        }
        let (w, b) = (i / 64, i % 64);
        let n = (64 - b).min(bits.end - i);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << b
        };
        i += n;
        Some((w, mask))
    })
}

/// Whether any bit in `bits` is set.
fn bits_any(map: &[u64], bits: Range<usize>) -> bool {
    word_masks(bits).any(|(w, mask)| map.get(w).is_some_and(|x| x & mask != 0))
}

/// Whether every bit in `bits` is set.
fn bits_all(map: &[u64], bits: Range<usize>) -> bool {
    word_masks(bits).all(|(w, mask)| map.get(w).is_some_and(|x| x & mask == mask))
}

/// Clear the bits `bits`.
fn bits_clear(map: &mut [u64], bits: Range<usize>) {
    for (w, mask) in word_masks(bits) {
        if let Some(x) = map.get_mut(w) {
            *x &= !mask;
        }
    }
}

/// The length of the run of consecutive PFNs `pfns` starts with (at least
/// 1 for a non-empty slice).
fn run_len(pfns: &[GuestPfn]) -> usize {
    1 + pfns
        .windows(2)
        .take_while(|w| w[0].raw().checked_add(1) == Some(w[1].raw()))
        .count()
}

/// Set the bits `bits`; returns how many were clear.
fn bits_set(map: &mut [u64], bits: Range<usize>) -> u64 {
    let mut newly = 0;
    for (w, mask) in word_masks(bits) {
        if let Some(x) = map.get_mut(w) {
            newly += u64::from((!*x & mask).count_ones());
            *x |= mask;
        }
    }
    newly
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
        // `num_pages` and the hint command id are the device's. `poison_val`
        // is frozen at DRIVER_OK: pages already given back are filled with it.
        let mut config = self.config_bytes();
        let size = self.config_size();
        let mut poison_ignored = false;
        for (at, &b) in (offset..).zip(data.iter()) {
            if at >= size {
                continue;
            }
            match at {
                4..=7 => config[at as usize] = b,
                12..=15 if self.live => poison_ignored = true,
                12..=15 => config[at as usize] = b,
                _ => {}
            }
        }
        if poison_ignored {
            self.stats.poison_writes_ignored += 1;
        }
        // `actual` is the driver's word on how many pages it gave: never
        // more than the VM has (the memory manager and `info` compute on it).
        let actual = u32::from_le_bytes([config[4], config[5], config[6], config[7]]);
        let pages = u32::try_from(self.ram.end - self.ram.start).unwrap_or(u32::MAX);
        if actual > pages {
            self.stats.actual_writes_clamped += 1;
        }
        self.actual = actual.min(pages);
        self.poison_val = u32::from_le_bytes([config[12], config[13], config[14], config[15]]);
    }

    fn activate(&mut self, features: u64) {
        self.negotiated = features;
        self.live = true;
    }

    fn take_config_change(&mut self) -> bool {
        core::mem::take(&mut self.config_change)
    }

    /// An empty pass changes nothing, except on the statistics queue (it
    /// forgets the held buffer when the queue was restarted) or with a
    /// config change waiting (the transport would raise it).
    fn quiet_when_empty(&self, queue: usize) -> bool {
        !self.config_change
            && (queue < 2
                || self
                    .queue_kind(queue)
                    .is_some_and(|k| k != QueueKind::Stats))
    }
}

impl<E: BalloonEnv + ?Sized> VirtioDeviceIo<E> for Balloon {
    fn reset(&mut self, env: &mut E) {
        self.deflate_all(env);
        let now = self.now(env);
        self.end_run(HintOutcome::Reset, now);
        // The id counter stays: an id is never reused for a new driver either.
        self.hint_state = HintState::Idle;
        self.config_change = false;
        self.negotiated = 0;
        self.live = false;
        self.actual = 0;
        self.poison_val = 0;
        self.held_stats = None;
        self.stats_requested = false;
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

    /// The balloon's periodic work at `now_us` (the clock of
    /// [`BalloonBackend::now_us`]): if a statistics refresh is due (the
    /// buffer was held for the interval, or [`Balloon::request_stats`] was
    /// called), return the held buffer to the driver. Cheap when nothing is
    /// due. Returns [`TransportEvent::Interrupt`] when the interrupt line
    /// went up (the owner then updates the guest's interrupt), or
    /// NeedsReset if the used ring is broken.
    pub fn poll_balloon<E: BalloonEnv + ?Sized>(
        &mut self,
        env: &mut E,
        now_us: u64,
    ) -> TransportEvent {
        let now_us = self.device_mut().saw_time(now_us);
        if !self.device().stats_due(now_us) {
            return TransportEvent::None;
        }
        self.device_work(env, |balloon, queues, env| {
            balloon.return_stats(queues, env)
        })
    }

    /// Ask for fresh statistics now: [`Balloon::request_stats`], then
    /// [`poll_balloon`](Self::poll_balloon).
    pub fn request_balloon_stats<E: BalloonEnv + ?Sized>(
        &mut self,
        env: &mut E,
        now_us: u64,
    ) -> TransportEvent {
        self.device_mut().request_stats();
        self.poll_balloon(env, now_us)
    }

    /// `hint <vm>`: start a free page hinting run at `now_us` and raise the
    /// config-change interrupt (the owner then updates the guest's
    /// interrupt). Returns the run's command id.
    pub fn start_free_page_hint(&mut self, now_us: u64) -> Result<u32, HintError> {
        if self.needs_reset() {
            return Err(HintError::DeviceStopped);
        }
        let id = self.device_mut().start_hint(now_us)?;
        self.raise_balloon_config_change();
        Ok(id)
    }

    /// Ask the driver to end the current hinting run
    /// ([`Balloon::stop_hint`]) and raise the config-change interrupt.
    /// Returns whether there was a run to stop.
    pub fn stop_free_page_hint(&mut self, now_us: u64) -> bool {
        let stopped = self.device_mut().stop_hint(now_us);
        self.raise_balloon_config_change();
        stopped
    }

    fn raise_balloon_config_change(&mut self) {
        if self.device_mut().take_config_change() {
            self.config_changed();
        }
    }
}

#[cfg(test)]
mod tests;
