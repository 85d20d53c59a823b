//! Guest memory statistics (STATS_VQ): the tags Linux sends, parsing a
//! statistics buffer into a [`StatsSample`], and the lines `info balloon`
//! prints.
//!
//! A buffer is a packed array of 10-byte entries, `le16 tag, le64 val` (no
//! padding: one guest-driver crate pads to 16 bytes, Linux does not). Tags
//! 0-9 are in the virtio spec; Linux sends 10-15 too
//! (`include/uapi/linux/virtio_balloon.h`, `VIRTIO_BALLOON_S_NR` = 16).
//! Unknown tags are skipped and counted; a repeated tag keeps its last
//! value; a tag the guest does not send stays unknown (a new sample
//! replaces the old one whole, so no stale value survives).
//!
//! Every value is bounded where it enters ([`StatsSample::add_entries_within`]):
//! a memory figure (free, total, available, disk caches) is at most the
//! VM's RAM size (and [`MAX_MEMORY_BYTES`]), any other value (cumulative
//! bytes moved or events counted since the guest's boot) at most
//! [`MAX_CUMULATIVE`]. A value above its bound is kept at the bound and
//! counted ([`StatsSample::clamped`], `BalloonStats::stats_values_clamped`,
//! shown by `info balloon`): whatever adds or scales them later cannot
//! overflow (issue 36: free_memory + disk_caches of 2^64-1 each did).

use core::fmt;

/// Size of one statistics entry in the buffer.
pub const STAT_ENTRY_BYTES: u32 = 10;

/// Largest statistics buffer accepted: 64 entries (Linux sends 16).
pub const MAX_STATS_BYTES: u32 = 64 * STAT_ENTRY_BYTES;

/// Statistics tags the device knows: `VIRTIO_BALLOON_S_NR` in Linux.
pub const STAT_TAGS: usize = 16;

/// Largest memory figure accepted from any guest, whatever its RAM: 2^48
/// bytes (256 TiB, a 48-bit address space).
pub const MAX_MEMORY_BYTES: u64 = 1 << 48;

/// Largest cumulative value accepted (bytes swapped or scanned, events
/// counted since the guest booted): 2^62, decades of traffic at 2^32 a
/// second, and four of them still add up without overflow.
pub const MAX_CUMULATIVE: u64 = 1 << 62;

/// Whether `tag` is a memory figure (how much memory is free, in total,
/// available, in disk caches) rather than a cumulative value: it cannot
/// exceed the VM's RAM.
pub const fn is_memory_figure(tag: u16) -> bool {
    matches!(tag, 4..=7)
}

/// What a statistic's value counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatUnit {
    Bytes,
    Count,
}

/// One statistics tag: its number, the name Linux gives it (without the
/// `VIRTIO_BALLOON_S_` prefix, as in `VIRTIO_BALLOON_S_NAMES`, with `_`), and
/// its unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatTag {
    pub tag: u16,
    pub name: &'static str,
    pub unit: StatUnit,
}

const fn tag(tag: u16, name: &'static str, unit: StatUnit) -> StatTag {
    StatTag { tag, name, unit }
}

/// Tags 0-15 in Linux's order. Swap traffic and the reclaim scan/steal
/// counters are converted to bytes by the driver (`pages_to_bytes`); fault,
/// hugetlb, OOM-kill and stall counters are event counts.
pub const STAT_TABLE: [StatTag; STAT_TAGS] = [
    tag(0, "swap_in", StatUnit::Bytes),
    tag(1, "swap_out", StatUnit::Bytes),
    tag(2, "major_faults", StatUnit::Count),
    tag(3, "minor_faults", StatUnit::Count),
    tag(4, "free_memory", StatUnit::Bytes),
    tag(5, "total_memory", StatUnit::Bytes),
    tag(6, "available_memory", StatUnit::Bytes),
    tag(7, "disk_caches", StatUnit::Bytes),
    tag(8, "hugetlb_allocations", StatUnit::Count),
    tag(9, "hugetlb_failures", StatUnit::Count),
    tag(10, "oom_kills", StatUnit::Count),
    tag(11, "alloc_stalls", StatUnit::Count),
    tag(12, "async_scans", StatUnit::Bytes),
    tag(13, "direct_scans", StatUnit::Bytes),
    tag(14, "async_reclaims", StatUnit::Bytes),
    tag(15, "direct_reclaims", StatUnit::Bytes),
];

/// One set of statistics from the guest, and when it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsSample {
    /// Value per tag (index = tag); `None` if the guest did not send it.
    pub values: [Option<u64>; STAT_TAGS],
    /// When the buffer arrived ([`BalloonBackend::now_us`](super::BalloonBackend::now_us)).
    pub arrived_us: u64,
    /// Entries with a tag the device does not know.
    pub unknown_tags: u32,
    /// Entries whose value was above its bound and was kept at it.
    pub clamped: u32,
}

impl StatsSample {
    /// An empty sample (no value known) that arrived at `arrived_us`.
    pub fn new(arrived_us: u64) -> Self {
        StatsSample {
            values: [None; STAT_TAGS],
            arrived_us,
            unknown_tags: 0,
            clamped: 0,
        }
    }

    /// [`add_entries_within`](Self::add_entries_within) a VM of the
    /// largest RAM ([`MAX_MEMORY_BYTES`]).
    pub fn add_entries(&mut self, bytes: &[u8]) {
        self.add_entries_within(bytes, MAX_MEMORY_BYTES);
    }

    /// Take the entries of `bytes` (whole 10-byte entries; a partial tail is
    /// ignored, the caller checks the length) from a VM of `ram_bytes` of
    /// RAM: memory figures above `ram_bytes` (or [`MAX_MEMORY_BYTES`]),
    /// other values above [`MAX_CUMULATIVE`], are kept at the bound and
    /// counted in [`clamped`](Self::clamped).
    pub fn add_entries_within(&mut self, bytes: &[u8], ram_bytes: u64) {
        let memory_bound = ram_bytes.min(MAX_MEMORY_BYTES);
        for e in bytes.chunks_exact(STAT_ENTRY_BYTES as usize) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let val = u64::from_le_bytes([e[2], e[3], e[4], e[5], e[6], e[7], e[8], e[9]]);
            let Some(slot) = self.values.get_mut(usize::from(tag)) else {
                self.unknown_tags = self.unknown_tags.saturating_add(1);
                continue;
            };
            let bound = match is_memory_figure(tag) {
                true => memory_bound,
                false => MAX_CUMULATIVE,
            };
            if val > bound {
                self.clamped = self.clamped.saturating_add(1);
            }
            *slot = Some(val.min(bound));
        }
    }

    /// The value of `tag`, if the guest sent it.
    pub fn get(&self, tag: u16) -> Option<u64> {
        self.values.get(usize::from(tag)).copied().flatten()
    }

    /// The value of the statistic called `name` (see [`STAT_TABLE`]).
    pub fn by_name(&self, name: &str) -> Option<u64> {
        STAT_TABLE
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| self.get(t.tag))
    }
}

/// A duration in microseconds as seconds with one decimal ("2.5 s").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seconds(pub u64);

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tenths = self.0 / 100_000;
        write!(f, "{}.{} s", tenths / 10, tenths % 10)
    }
}
