//! The frame table: the single source of truth for who uses every 4 KiB page
//! ("frame") of RAM.
//!
//! One byte per page of every RAM bank, in storage the caller provides (boot
//! places it with [`find_hole`](super::layout::find_hole) before any allocator
//! exists; [`FrameTable::entries_needed`] says how much). Only the
//! page-aligned interior of each bank is tracked; the bytes of a bank's
//! unaligned head and tail, if any, are reported as "unusable (partial page)"
//! by [`FrameTable::accounting`], so that the accounting always sums to the
//! RAM size.
//!
//! Every change of ownership goes through this type: [`FrameTable::mark`]
//! (boot-time claims of known regions), [`FrameTable::alloc`] and
//! [`FrameTable::free`]. Per-use page counters are kept incrementally and
//! [`FrameTable::check_invariants`] recounts them.
//!
//! # Encoding and its planned extension
//!
//! A frame's byte is a [`FrameUse`] discriminant for hypervisor-level uses
//! (`0x00..=0x3F`), or `FIRST_GUEST_CODE + vm` (`0x40..`) for a frame that
//! backs guest RAM of VM `vm` ([`FrameUse::Guest`], at most [`MAX_VMS`]).
//! Whether a guest page is mapped, ballooned, reported or hinted is the VM's
//! business (its stage-2 tables and balloon); a guest page that is not backed
//! has no frame at all, its frame is back in the pool. If more VMs are ever
//! needed, the element type widens to `u16`; no caller sees the raw bytes.
//!
//! # Frames zeroed ahead of time
//!
//! A free frame is one of two kinds, both counted as [`FrameUse::Free`]:
//! `Free` (contents unknown: zeroed before a guest gets it), or `ZEROED`
//! (`0x3F`: zeroed and cleaned ahead of time by a CPU whose vCPU idled).
//! [`FrameTable::claim_to_zero`] lends plain free frames out as `ZEROING`
//! (`0x3E`: still counted free, but no allocation takes them), and
//! [`FrameTable::finish_zeroing`] takes them back as `ZEROED`. Any
//! allocation may take a zeroed frame; a VM's frames come from the zeroed
//! ones first, and [`FrameTable::alloc_guest_frames_marked`] says which
//! need no zeroing. Each kind has its count and a storage index below which
//! there is none of it, which [`FrameTable::check_invariants`] checks.
//!
//! # Instruction cache
//!
//! A frame freed from a guest may still have lines in some CPU's
//! instruction cache (a Cortex-A72's is physically indexed and tagged), and
//! the next guest given it must not execute them. Freeing does not
//! invalidate: the table counts the batches of guest frames freed
//! (`icache_freed`) and how many of them an acknowledged invalidation of
//! every CPU's instruction cache covers (`icache_clean`). While the two
//! differ, a guest allocation reports [`StaleIcache`] with its frames: the
//! caller invalidates every instruction cache before it maps any of them
//! and then acknowledges ([`FrameTable::icache_invalidated`]), which covers
//! every batch freed before the allocation. So a guest that gives pages
//! back one request at a time causes no invalidation; the next allocation
//! after any number of frees causes one.
//!
//! It is kept by time, not per frame: an allocation while some freed batch
//! is not covered reports stale even if its own frames never belonged to a
//! guest (guest frames are taken lowest first, so the frames given back
//! are mostly the next ones out anyway), and a frame that passes through a
//! hypervisor use (stage-2 table, heap) needs no mark of its own: when it
//! reaches a guest later, either an invalidation since its guest free
//! covered it or the allocation reports stale. The hypervisor's own
//! allocations ([`FrameTable::alloc`]) report nothing: it never executes
//! from them and no guest fetches from them (stage-2 tables are mapped in
//! no guest; the PL011 mirror page is mapped execute-never).
//!
//! An acknowledgement covers only what was freed before the allocation
//! that reported: a batch freed meanwhile keeps the next allocation
//! reporting. Two CPUs that both got a report both invalidate; none ever
//! maps a frame before an invalidation that started after its free.

use core::fmt;

use platform::{PhysRange, MAX_RAM_BANKS};

use crate::addr::PhysAddr;

pub use crate::addr::PAGE_SIZE;
const PAGE_MASK: u64 = PAGE_SIZE - 1;

/// First byte value of guest-owned frames (see the module docs).
pub const FIRST_GUEST_CODE: u8 = 0x40;
/// Most VMs whose frames the table can tell apart.
pub const MAX_VMS: usize = 64;

/// What a page of RAM is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum FrameUse {
    HypervisorImage = 0,
    DeviceTree = 1,
    GuestBundle = 2,
    FirmwareReserved = 3,
    FrameTable = 4,
    Heap = 5,
    PageTables = 6,
    Free = 7,
    /// Handed out by [`FrameTable::alloc`] for the hypervisor's own use.
    Allocated = 8,
    /// Backs guest RAM of one VM ([`FrameTable::alloc_guest_frames_marked`]).
    Guest = 9,
}

impl FrameUse {
    /// Number of uses.
    pub const COUNT: usize = 10;
    /// Every use, in discriminant order (the order of reports).
    pub const ALL: [FrameUse; FrameUse::COUNT] = [
        FrameUse::HypervisorImage,
        FrameUse::DeviceTree,
        FrameUse::GuestBundle,
        FrameUse::FirmwareReserved,
        FrameUse::FrameTable,
        FrameUse::Heap,
        FrameUse::PageTables,
        FrameUse::Free,
        FrameUse::Allocated,
        FrameUse::Guest,
    ];

    pub const fn label(self) -> &'static str {
        match self {
            FrameUse::HypervisorImage => "hypervisor image",
            FrameUse::DeviceTree => "device tree",
            FrameUse::GuestBundle => "guest bundle",
            FrameUse::FirmwareReserved => "firmware reserved",
            FrameUse::FrameTable => "frame table",
            FrameUse::Heap => "heap",
            FrameUse::PageTables => "page tables",
            FrameUse::Free => "free",
            FrameUse::Allocated => "allocated",
            FrameUse::Guest => "guest RAM",
        }
    }

    /// The byte stored for this use.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The use a stored byte encodes, if any.
    pub const fn from_code(code: u8) -> Option<FrameUse> {
        if code >= FIRST_GUEST_CODE && ((code - FIRST_GUEST_CODE) as usize) < MAX_VMS {
            Some(FrameUse::Guest)
        } else if is_free(code) || code == ZEROING {
            Some(FrameUse::Free)
        } else if code != FrameUse::Guest as u8 && (code as usize) < FrameUse::COUNT {
            Some(FrameUse::ALL[code as usize])
        } else {
            None
        }
    }
}

impl fmt::Display for FrameUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

const FREE: u8 = FrameUse::Free as u8;
/// A free frame known to hold zeros, cleaned to the point of coherency
/// (zeroed while a CPU idled): counted as free.
const ZEROED: u8 = 0x3F;
/// A free frame lent to an idle CPU to be zeroed: counted as free (the
/// pool's accounting does not move), taken by no allocation until it comes
/// back as `ZEROED`.
const ZEROING: u8 = 0x3E;

/// Whether a stored byte is a free frame a search may take (plain or
/// zeroed: see the module docs).
#[inline]
const fn is_free(code: u8) -> bool {
    code == FREE || code == ZEROED
}

/// Why a frame table operation failed. Operations that fail change nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// More RAM banks than [`MAX_RAM_BANKS`].
    TooManyBanks {
        count: usize,
    },
    /// Bank `index` is empty (`start >= end`).
    EmptyBank {
        index: usize,
        range: PhysRange,
    },
    /// Bank `index` starts before the end of bank `index - 1`.
    UnsortedBanks {
        index: usize,
        range: PhysRange,
        previous: PhysRange,
    },
    StorageTooSmall {
        needed: usize,
        got: usize,
    },
    /// `start > end`.
    InvalidRange {
        range: PhysRange,
    },
    /// The operation does not take this use (marking as, or freeing from, free).
    InvalidUse {
        op: &'static str,
        use_: FrameUse,
    },
    Unaligned {
        addr: PhysAddr,
    },
    /// Some page of `[addr, addr + pages * PAGE_SIZE)` is not tracked RAM.
    NotInRam {
        addr: PhysAddr,
        pages: usize,
    },
    /// The page at `addr` is `found`, not `expected`.
    WrongUse {
        addr: PhysAddr,
        expected: FrameUse,
        found: FrameUse,
    },
    /// The byte for the page at `addr` encodes no [`FrameUse`].
    CorruptEntry {
        addr: PhysAddr,
        code: u8,
    },
    /// The page at `addr` is free but below where the search for guest
    /// frames starts (the first-fit hint): it would never be handed out.
    FreeBelowHint {
        addr: PhysAddr,
    },
    /// The incremental counter for `use_` disagrees with a recount.
    CounterMismatch {
        use_: FrameUse,
        counted: u64,
        recorded: u64,
    },
    /// The accounting does not sum to the RAM size.
    AccountingMismatch {
        accounted: u64,
        ram: u64,
    },
    /// The frame at `addr` is not VM `vm`'s (its byte is `code`).
    NotOwnedBy {
        addr: PhysAddr,
        vm: usize,
        code: u8,
    },
    GuestCounterMismatch {
        vm: usize,
        counted: u64,
        recorded: u64,
    },
    /// The page at `addr`, a `what` frame, is below where the search for
    /// such frames starts.
    BelowHint {
        addr: PhysAddr,
        what: &'static str,
    },
    /// The frame at `addr` was not lent out to be zeroed.
    NotBeingZeroed {
        addr: PhysAddr,
    },
    /// The counts of zeroed frames and of frames being zeroed disagree
    /// with a recount.
    ZeroedCounterMismatch {
        counted: (u64, u64),
        recorded: (u64, u64),
    },
    /// The frames held for guarantees disagree with a recount.
    ReservedMismatch {
        counted: u64,
        recorded: u64,
    },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FrameError::TooManyBanks { count } => {
                write!(
                    f,
                    "{count} RAM banks, at most {MAX_RAM_BANKS} are supported"
                )
            }
            FrameError::EmptyBank { index, range } => write!(
                f,
                "RAM bank {index} [{:#x}, {:#x}) is empty",
                range.start, range.end
            ),
            FrameError::UnsortedBanks {
                index,
                range,
                previous,
            } => write!(
                f,
                "RAM bank {index} [{:#x}, {:#x}) starts before the end of bank {} [{:#x}, {:#x}) \
                 (banks must be sorted and disjoint)",
                range.start,
                range.end,
                index - 1,
                previous.start,
                previous.end
            ),
            FrameError::StorageTooSmall { needed, got } => {
                write!(f, "frame table storage is {got} bytes, {needed} are needed")
            }
            FrameError::InvalidRange { range } => write!(
                f,
                "invalid range [{:#x}, {:#x}): start is after end",
                range.start, range.end
            ),
            FrameError::InvalidUse { op, use_ } => write!(f, "cannot {op} \"{use_}\" frames"),
            FrameError::Unaligned { addr } => {
                write!(f, "address {addr:#x} is not {PAGE_SIZE:#x}-byte aligned")
            }
            FrameError::NotInRam { addr, pages } => {
                write!(f, "{pages} pages at {addr:#x} are not all in tracked RAM")
            }
            FrameError::WrongUse {
                addr,
                expected,
                found,
            } => write!(f, "page {addr:#x} is \"{found}\", expected \"{expected}\""),
            FrameError::CorruptEntry { addr, code } => {
                write!(f, "page {addr:#x} has invalid frame code {code:#04x}")
            }
            FrameError::FreeBelowHint { addr } => {
                write!(f, "page {addr:#x} is free below the first-fit hint")
            }
            FrameError::CounterMismatch {
                use_,
                counted,
                recorded,
            } => write!(
                f,
                "\"{use_}\" counter says {recorded} pages, a recount finds {counted}"
            ),
            FrameError::NotOwnedBy { addr, vm, code } => {
                write!(
                    f,
                    "page {addr:#x} is not VM {vm}'s (frame code {code:#04x})"
                )
            }
            FrameError::GuestCounterMismatch {
                vm,
                counted,
                recorded,
            } => write!(
                f,
                "VM {vm} owns {recorded} frames by its counter, a recount finds {counted}"
            ),
            FrameError::NotBeingZeroed { addr } => {
                write!(f, "page {addr:#x} was not lent out to be zeroed")
            }
            FrameError::BelowHint { addr, what } => {
                write!(f, "page {addr:#x} is {what} below its search hint")
            }
            FrameError::ZeroedCounterMismatch { counted, recorded } => write!(
                f,
                "zeroed and being-zeroed frames: counters say {recorded:?}, a recount finds {counted:?}"
            ),
            FrameError::ReservedMismatch { counted, recorded } => write!(
                f,
                "{recorded} free frames are held for guarantees by the counter, a recount finds {counted}"
            ),
            FrameError::AccountingMismatch { accounted, ram } => write!(
                f,
                "accounting sums to {accounted:#x} bytes, RAM is {ram:#x} bytes"
            ),
        }
    }
}

impl core::error::Error for FrameError {}

/// Bytes of RAM per use. [`total`](Accounting::total) always equals the sum
/// of the RAM bank sizes the table was built from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Indexed by `FrameUse as usize`.
    pub by_use: [u64; FrameUse::COUNT],
    /// Bytes of the unaligned heads and tails of banks, not tracked.
    pub unusable_partial_pages: u64,
}

impl Accounting {
    pub fn bytes(&self, use_: FrameUse) -> u64 {
        self.by_use[use_ as usize]
    }

    pub fn total(&self) -> u64 {
        self.by_use.iter().sum::<u64>() + self.unusable_partial_pages
    }
}

#[derive(Clone, Copy, Debug)]
struct Bank {
    /// The whole bank, as given.
    range: PhysRange,
    /// First tracked page (the bank start rounded up).
    first: u64,
    /// Tracked pages.
    pages: usize,
    /// Index of the first tracked page in the storage.
    base: usize,
}

impl Bank {
    const EMPTY: Bank = Bank {
        range: PhysRange::new(0, 0),
        first: 0,
        pages: 0,
        base: 0,
    };

    /// End of the tracked pages.
    fn tracked_end(&self) -> u64 {
        self.first + self.pages as u64 * PAGE_SIZE
    }

    /// Storage indexes of the tracked pages overlapping `[lo, hi)`, with `lo`
    /// and `hi` page-aligned.
    fn indexes(&self, lo: u64, hi: u64) -> core::ops::Range<usize> {
        let lo = lo.max(self.first);
        let hi = hi.min(self.tracked_end());
        if lo >= hi {
            return self.base..self.base;
        }
        let a = ((lo - self.first) / PAGE_SIZE) as usize;
        let b = ((hi - self.first) / PAGE_SIZE) as usize;
        self.base + a..self.base + b
    }
}

/// The interior of `bank`: first tracked page and page count.
fn interior(bank: &PhysRange) -> (u64, usize) {
    let first = match bank.start.checked_add(PAGE_MASK) {
        Some(v) => v & !PAGE_MASK,
        None => return (bank.end, 0),
    };
    let last = bank.end & !PAGE_MASK;
    if bank.end <= bank.start || last <= first {
        return (first.min(bank.end), 0);
    }
    (first, ((last - first) / PAGE_SIZE) as usize)
}

/// One byte per tracked page of RAM; see the module documentation.
pub struct FrameTable<'a> {
    entries: &'a mut [u8],
    banks: [Bank; MAX_RAM_BANKS],
    nbanks: usize,
    /// Pages per use, kept in step with `entries`.
    counts: [u64; FrameUse::COUNT],
    partial_bytes: u64,
    /// Next-fit cursor: storage index where the next search starts.
    hint: usize,
    /// Storage index below which no frame is free: where a search for
    /// guest frames starts (first fit). Guest frames are taken lowest
    /// first, so the frames a guest gave back (reported, inflated) are the
    /// first handed out again: under QEMU they are already in the host's
    /// memory, where fresh ones cost the host a page fault and zeroing of a
    /// huge page each (measured: 18% of QEMU's CPU time during a Linux
    /// inflate with free page reporting on, next fit).
    lowest_free: usize,
    /// Per VM: frames owned (the split of the `Guest` count) and frames
    /// guaranteed (its `min`, or all its RAM with prealloc: kept free for it
    /// until it owns that many). One array, one bounds check on the hot path.
    guests: [GuestFrames; MAX_VMS],
    /// Free frames held for guarantees: the sum over VMs of what they are
    /// guaranteed and do not own yet. Kept in step by `set_code`.
    reserved: u64,
    /// A guest frame beyond a guarantee is refused once the unreserved free
    /// frames are down to this (the pool's `min` watermark: the reserve
    /// for stage-2 tables and the hypervisor's own needs).
    guest_floor: u64,
    /// Free frames zeroed ahead of time (byte `ZEROED`), free frames out
    /// being zeroed (`ZEROING`), and zeroed ones given to guests so far.
    zeroed: u64,
    zeroing: u64,
    zeroed_taken: u64,
    /// Storage index below which no zeroed frame is.
    lowest_zeroed: usize,
    /// Storage index below which no plain free frame (byte `FREE`) is.
    lowest_plain: usize,
    /// Batches of guest frames freed, and how many of those (the first
    /// ones) an acknowledged instruction cache invalidation covers: see
    /// "Instruction cache" in the module docs.
    icache_freed: u64,
    icache_clean: u64,
}

/// Frames a guest allocation handed out may still have lines in some
/// CPU's instruction cache: invalidate every CPU's instruction cache
/// (to the point of unification) before any of them is mapped, then give
/// this to [`FrameTable::icache_invalidated`]. See "Instruction cache" in
/// the module docs. Reports are ordered: for several allocations, the
/// greatest (`Option::max`) covers them all.
#[must_use = "invalidate the instruction caches before mapping the frames, then acknowledge"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StaleIcache {
    /// The table's `icache_freed` at the allocation.
    freed: u64,
}

/// What a guest allocation ([`FrameTable::alloc_guest_frames_marked`])
/// handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestAlloc {
    /// Frames written to the start of `out`.
    pub count: usize,
    /// Bit `i`: `out[i]` was zeroed ahead of time and needs no zeroing
    /// (only the first 64 are marked).
    pub zeroed: u64,
    /// Whether the instruction caches must be invalidated before any of
    /// the frames is mapped (`None` when no frame was handed out).
    pub stale: Option<StaleIcache>,
}

/// At most this many exits in a memory-manager tick (100 ms) count as
/// quiet guests (see [`zero_ahead_now`]): an idle Linux guest takes a few
/// (about 2 per vCPU, and 2 per sleep while its WFI traps); one agent
/// request takes about 220.
pub const QUIET_EXITS_PER_TICK: u64 = 50;

/// Whether idle CPUs should zero frames ahead of time until the next tick,
/// given what the guests did since the last one: only if they took no
/// frame and exited at most [`QUIET_EXITS_PER_TICK`] times, and the table
/// has frames to zero below `target`. A busy guest (its boot, a balloon
/// move, a stream of requests) would only share the CPUs with the zeroing
/// and wait for it after its short sleeps.
pub fn zero_ahead_now(table: &FrameTable<'_>, frames_taken: bool, exits: u64, target: u64) -> bool {
    !frames_taken && exits <= QUIET_EXITS_PER_TICK && table.zeroing_wanted(target)
}

/// One VM's frames in the table.
#[derive(Clone, Copy, Debug, Default)]
struct GuestFrames {
    owned: u64,
    guaranteed: u64,
    /// Its balloon is asked to inflate: it may take frames down to half
    /// the floor (see [`FrameTable::set_inflating`]).
    inflating: bool,
}

/// Why [`FrameTable::guarantee`] refused: the frames missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// Frames that would have to be free for the guarantee.
    pub needed: u64,
    /// Frames free and not held for other guarantees, above the floor.
    pub available: u64,
}

impl<'a> FrameTable<'a> {
    /// Bytes of storage [`new`](Self::new) needs for `ram`: one per whole
    /// page inside each bank.
    pub fn entries_needed(ram: &[PhysRange]) -> usize {
        ram.iter().map(|b| interior(b).1).sum()
    }

    /// A table for `ram` (sorted, disjoint, non-empty banks; checked) in
    /// `storage` (at least [`entries_needed`](Self::entries_needed) bytes;
    /// the rest is unused), every tracked page free.
    pub fn new(ram: &[PhysRange], storage: &'a mut [u8]) -> Result<Self, FrameError> {
        if ram.len() > MAX_RAM_BANKS {
            return Err(FrameError::TooManyBanks { count: ram.len() });
        }
        for (index, range) in ram.iter().enumerate() {
            if range.is_empty() {
                return Err(FrameError::EmptyBank {
                    index,
                    range: *range,
                });
            }
            if index > 0 && range.start < ram[index - 1].end {
                return Err(FrameError::UnsortedBanks {
                    index,
                    range: *range,
                    previous: ram[index - 1],
                });
            }
        }
        let needed = Self::entries_needed(ram);
        if storage.len() < needed {
            return Err(FrameError::StorageTooSmall {
                needed,
                got: storage.len(),
            });
        }
        let entries = &mut storage[..needed];
        entries.fill(FREE);
        let mut banks = [Bank::EMPTY; MAX_RAM_BANKS];
        let mut base = 0;
        let mut partial_bytes = 0;
        for (bank, range) in banks.iter_mut().zip(ram) {
            let (first, pages) = interior(range);
            *bank = Bank {
                range: *range,
                first,
                pages,
                base,
            };
            base += pages;
            partial_bytes += range.size() - pages as u64 * PAGE_SIZE;
        }
        let mut counts = [0; FrameUse::COUNT];
        counts[FrameUse::Free as usize] = needed as u64;
        Ok(Self {
            entries,
            banks,
            nbanks: ram.len(),
            counts,
            partial_bytes,
            hint: 0,
            lowest_free: 0,
            zeroed: 0,
            zeroing: 0,
            zeroed_taken: 0,
            lowest_zeroed: 0,
            lowest_plain: 0,
            icache_freed: 0,
            icache_clean: 0,
            guests: [GuestFrames::default(); MAX_VMS],
            reserved: 0,
            guest_floor: 0,
        })
    }

    fn banks(&self) -> &[Bank] {
        &self.banks[..self.nbanks]
    }

    /// Physical address of the page at storage index `idx`.
    fn addr_of(&self, idx: usize) -> u64 {
        self.banks()
            .iter()
            .find(|b| idx >= b.base && idx < b.base + b.pages)
            .map_or(0, |b| b.first + (idx - b.base) as u64 * PAGE_SIZE)
    }

    /// Storage index of the tracked page containing `addr`.
    fn index_of(&self, addr: u64) -> Option<usize> {
        self.banks()
            .iter()
            .find(|b| addr >= b.first && addr < b.tracked_end())
            .map(|b| b.base + ((addr - b.first) / PAGE_SIZE) as usize)
    }

    fn set(&mut self, idx: usize, to: FrameUse) {
        self.set_code(idx, to as u8);
    }

    /// The one place a frame's byte changes: keeps every counter exact.
    fn set_code(&mut self, idx: usize, to: u8) {
        for (code, delta) in [(self.entries[idx], -1i64), (to, 1)] {
            if let Some(u) = FrameUse::from_code(code) {
                self.counts[u as usize] = self.counts[u as usize].wrapping_add_signed(delta);
                if u == FrameUse::Guest {
                    let vm = (code - FIRST_GUEST_CODE) as usize;
                    let g = &mut self.guests[vm];
                    let before = g.owned;
                    g.owned = before.wrapping_add_signed(delta);
                    // Held for the guarantee: guaranteed - min(owned, guaranteed).
                    self.reserved = (self.reserved + before.min(g.guaranteed))
                        .wrapping_sub(g.owned.min(g.guaranteed));
                }
            }
        }
        if is_free(to) {
            self.lowest_free = self.lowest_free.min(idx);
        }
        if self.entries[idx] == ZEROED {
            self.zeroed -= 1;
        }
        if to == ZEROED {
            self.zeroed += 1;
            self.lowest_zeroed = self.lowest_zeroed.min(idx);
        } else if to == FREE {
            self.lowest_plain = self.lowest_plain.min(idx);
        }
        self.entries[idx] = to;
    }

    /// Claims the free pages of `range` for `to`: the range is rounded
    /// outward to whole pages and clipped to tracked RAM (parts outside RAM
    /// are ignored). Pages that are not free are left alone, so the **first
    /// claim wins**: boot marks regions in priority order (hypervisor image,
    /// device tree, frame table, firmware reservations, guest bundle, ...)
    /// and an overlap keeps the earlier, more important label. Returns the
    /// number of pages changed.
    pub fn mark(&mut self, range: PhysRange, to: FrameUse) -> Result<u64, FrameError> {
        if range.start > range.end {
            return Err(FrameError::InvalidRange { range });
        }
        if to == FrameUse::Free {
            return Err(FrameError::InvalidUse {
                op: "mark pages as",
                use_: to,
            });
        }
        if range.start == range.end {
            return Ok(0);
        }
        let lo = range.start & !PAGE_MASK;
        // A range ending in the top page of the address space cannot reach
        // tracked RAM beyond it, so saturating is exact.
        let hi = range
            .end
            .checked_add(PAGE_MASK)
            .map_or(!PAGE_MASK, |v| v & !PAGE_MASK);
        let mut changed = 0;
        for i in 0..self.nbanks {
            for idx in self.banks[i].indexes(lo, hi) {
                if is_free(self.entries[idx]) {
                    self.set(idx, to);
                    changed += 1;
                }
            }
        }
        Ok(changed)
    }

    /// Allocates `pages` contiguous free pages (never across banks) whose
    /// address is a multiple of `align_pages` pages (a power of two; 0 means
    /// 1), marks them `to` and returns their address. `None` if no such run
    /// exists, or for `pages == 0`, a bad alignment or `to == Free`.
    ///
    /// Next fit: the search starts where the previous allocation ended and
    /// wraps around once, so repeated single-page allocations cost O(1)
    /// amortised and a failed one costs a scan of the table.
    pub fn alloc(&mut self, pages: usize, align_pages: usize, to: FrameUse) -> Option<PhysAddr> {
        if to == FrameUse::Free || to == FrameUse::Guest {
            return None;
        }
        self.alloc_code(pages, align_pages, to as u8)
    }

    /// One free frame for guest RAM of VM `vm` (< [`MAX_VMS`]): from its
    /// guarantee while it owns less, else only while the free frames not
    /// held for guarantees are above the guest floor. Tests only: it drops
    /// the instruction cache report ([`Self::alloc_guest_frames_marked`]
    /// is the allocation a guest's frames come from), and the table stays
    /// stale.
    #[cfg(any(test, feature = "testing"))]
    pub fn alloc_guest(&mut self, vm: usize) -> Option<PhysAddr> {
        if vm >= MAX_VMS {
            return None;
        }
        let mut frame = [PhysAddr::new(0)];
        (self.alloc_guest_frames(vm, &mut frame) == 1).then_some(frame[0])
    }

    /// Guarantee VM `vm` `pages` frames (0 drops its guarantee): what it
    /// does not own yet is held free for it. Refused, with nothing
    /// changed, if the frames are not there beside the other guarantees
    /// and the guest floor.
    pub fn guarantee(&mut self, vm: usize, pages: u64) -> Result<(), Shortfall> {
        let Some(&GuestFrames {
            owned,
            guaranteed: old,
            ..
        }) = self.guests.get(vm)
        else {
            return Err(Shortfall {
                needed: pages,
                available: 0,
            });
        };
        let (held, want) = (old.saturating_sub(owned), pages.saturating_sub(owned));
        if want > held {
            let available = self.unreserved_free().saturating_sub(self.guest_floor);
            if want - held > available {
                return Err(Shortfall {
                    needed: want - held,
                    available,
                });
            }
        }
        self.reserved = self.reserved - held + want;
        self.guests[vm].guaranteed = pages;
        Ok(())
    }

    /// Frames guaranteed to VM `vm`.
    pub fn guaranteed(&self, vm: usize) -> u64 {
        self.guests.get(vm).map_or(0, |g| g.guaranteed)
    }

    /// Free frames held for guarantees.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Free frames not held for a guarantee: what the pool can give.
    pub fn unreserved_free(&self) -> u64 {
        self.free_pages().saturating_sub(self.reserved)
    }

    /// Where guest frames beyond a guarantee stop (see `guest_floor`).
    pub fn set_guest_floor(&mut self, pages: u64) {
        self.guest_floor = pages;
    }

    pub fn guest_floor(&self) -> u64 {
        self.guest_floor
    }

    /// VM `vm`'s balloon is asked to inflate (`true`) or not: while it is,
    /// its frames beyond a guarantee stop at half the guest floor, not at
    /// the floor. A guest parked at the floor cannot run its balloon driver
    /// or its own reclaim (the vCPU waits inside its kernel), and inflation
    /// itself may touch pages (a kernel that zeroes what it allocates): the
    /// upper half of the reserve is for the VM that is giving memory back,
    /// as Linux lets a task that frees memory dip below its watermarks.
    pub fn set_inflating(&mut self, vm: usize, inflating: bool) {
        if let Some(g) = self.guests.get_mut(vm) {
            g.inflating = inflating;
        }
    }

    /// Whether VM `vm` may take frames below the floor (see
    /// [`Self::set_inflating`]).
    pub fn inflating(&self, vm: usize) -> bool {
        self.guests.get(vm).is_some_and(|g| g.inflating)
    }

    /// Give a frame of VM `vm` back to the pool; an error (and no change) if
    /// the frame does not belong to that VM.
    pub fn free_guest(&mut self, vm: usize, addr: PhysAddr) -> Result<(), FrameError> {
        if !addr.is_page_aligned() {
            return Err(FrameError::Unaligned { addr });
        }
        let idx = self
            .index_of(addr.raw())
            .ok_or(FrameError::NotInRam { addr, pages: 1 })?;
        let code = self.entries[idx];
        if vm >= MAX_VMS || code != FIRST_GUEST_CODE + vm as u8 {
            return Err(FrameError::NotOwnedBy { addr, vm, code });
        }
        self.set(idx, FrameUse::Free);
        self.icache_freed += 1;
        Ok(())
    }

    /// `alloc_guest` for up to `out.len()` frames at once, as many
    /// as the guarantee and the floor allow: one first-fit scan from the lowest free frame and one
    /// counter update for the batch. Returns how many were written to `out`.
    /// Tests only, as `alloc_guest`.
    #[cfg(any(test, feature = "testing"))]
    pub fn alloc_guest_frames(&mut self, vm: usize, out: &mut [PhysAddr]) -> usize {
        // The instruction cache report is dropped: the table stays stale.
        self.alloc_guest_frames_marked(vm, out).count
    }

    /// Up to `out.len()` frames for guest RAM of VM `vm` (< [`MAX_VMS`]),
    /// as many as its guarantee and the floor allow (see
    /// [`Self::guarantee`]): frames zeroed ahead of time
    /// ([`Self::claim_to_zero`]) first, then first fit from the lowest free
    /// frame; one counter update for the batch. Says which need no zeroing
    /// and whether the instruction caches must be invalidated before any
    /// is mapped ([`GuestAlloc`]).
    pub fn alloc_guest_frames_marked(&mut self, vm: usize, out: &mut [PhysAddr]) -> GuestAlloc {
        let Some(&GuestFrames {
            owned,
            guaranteed,
            inflating,
        }) = self.guests.get(vm)
        else {
            return GuestAlloc {
                count: 0,
                zeroed: 0,
                stale: None,
            };
        };
        // Frames within the guarantee come out of `reserved` and leave the
        // unreserved count alone; beyond it, each takes one down to the floor
        // (half of it for a VM giving memory back).
        let floor = match inflating {
            true => self.guest_floor / 2,
            false => self.guest_floor,
        };
        let allowed =
            guaranteed.saturating_sub(owned) + self.unreserved_free().saturating_sub(floor);
        let want = (out.len() as u64).min(allowed).min(self.free_pages()) as usize;
        let code = FIRST_GUEST_CODE + vm as u8;
        let (mut n, mut ready) = (0, 0u64);
        // Zeroed frames: `zeroed` of them lie at or after `lowest_zeroed`,
        // so the scan ends at the last one.
        if self.zeroed > 0 {
            let mut idx = self.lowest_zeroed;
            let mut left = self.zeroed;
            while n < want && left > 0 && idx < self.entries.len() {
                if self.entries[idx] == ZEROED {
                    self.entries[idx] = code;
                    out[n] = PhysAddr::new(self.addr_of(idx));
                    if n < 64 {
                        ready |= 1 << n;
                    }
                    n += 1;
                    left -= 1;
                }
                idx += 1;
            }
            self.zeroed_taken += self.zeroed - left;
            self.zeroed = left;
            self.lowest_zeroed = idx;
        }
        // Then first fit: no frame below `lowest_free` is free, and `want`
        // frames are free, so one pass to the end finds them.
        if n < want {
            let (end, got, marked) = if self.zeroed > 0 {
                self.first_fit::<true>(code, &mut out[n..want])
            } else {
                self.first_fit::<false>(code, &mut out[n..want])
            };
            // Bits for `out[n..]`; past the 64th frame, none.
            ready |= marked.checked_shl(n as u32).unwrap_or(0);
            n += got;
            // Every frame before `end` was taken now or was not free.
            self.lowest_free = end;
        }
        self.moved_guest(vm, n as u64, true);
        GuestAlloc {
            count: n,
            zeroed: ready,
            stale: (n > 0 && self.icache_freed > self.icache_clean).then_some(StaleIcache {
                freed: self.icache_freed,
            }),
        }
    }

    /// Every CPU's instruction cache was invalidated after the allocation
    /// that reported `stale`: the batches freed before it are clean.
    pub fn icache_invalidated(&mut self, stale: StaleIcache) {
        self.icache_clean = self.icache_clean.max(stale.freed);
    }

    /// Whether a guest allocation now would report [`StaleIcache`]: some
    /// batch of guest frames was freed since the last invalidation that
    /// covers it.
    pub fn icache_stale(&self) -> bool {
        self.icache_freed > self.icache_clean
    }

    /// First fit from `lowest_free` into `out` for the guest code `code`
    /// (the frames are free, so one pass to the end finds them): where the
    /// scan ended, how many, and which are zeroed (bit per frame of `out`).
    /// `ZEROED`: zeroed frames may be met (they were taken before, unless
    /// the count was off); else the test of each byte is one compare.
    #[inline]
    fn first_fit<const ZEROED_TOO: bool>(
        &mut self,
        code: u8,
        out: &mut [PhysAddr],
    ) -> (usize, usize, u64) {
        let (mut n, mut ready) = (0, 0u64);
        let mut idx = self.lowest_free.min(self.entries.len());
        while n < out.len() {
            if idx >= self.entries.len() {
                break; // Cannot happen: the frames are free.
            }
            let Some(b) = self
                .banks()
                .iter()
                .find(|b| idx < b.base + b.pages)
                .copied()
            else {
                break;
            };
            let end = b.base + b.pages;
            while idx < end && n < out.len() {
                let found = self.entries[idx];
                let free = if ZEROED_TOO {
                    is_free(found)
                } else {
                    found == FREE
                };
                if free {
                    self.entries[idx] = code;
                    out[n] = PhysAddr::new(b.first + (idx - b.base) as u64 * PAGE_SIZE);
                    if ZEROED_TOO && found == ZEROED {
                        self.zeroed -= 1;
                        self.zeroed_taken += 1;
                        if n < 64 {
                            ready |= 1 << n;
                        }
                    }
                    n += 1;
                }
                idx += 1;
            }
        }
        (idx, n, ready)
    }

    /// Free frames neither zeroed nor out being zeroed: those
    /// [`Self::claim_to_zero`] takes.
    pub fn plain_free(&self) -> u64 {
        self.counts[FrameUse::Free as usize] - self.zeroed - self.zeroing
    }

    /// Whether [`Self::claim_to_zero`] with this `target` would give
    /// frames.
    pub fn zeroing_wanted(&self, target: u64) -> bool {
        self.zeroed + self.zeroing < target && self.plain_free() > 0
    }

    /// Free frames zeroed ahead of time, and how many of those guests were
    /// given so far.
    pub fn zeroed_pages(&self) -> (u64, u64) {
        (self.zeroed, self.zeroed_taken)
    }

    /// Plain free frames (lowest first) lent to an idle CPU to be zeroed,
    /// into `out`, while fewer than `target` are zeroed or being zeroed,
    /// and never frames held for guarantees: how many. Each must come back
    /// through [`Self::finish_zeroing`] (meanwhile they count as free, and
    /// no allocation takes them).
    pub fn claim_to_zero(&mut self, out: &mut [PhysAddr], target: u64) -> usize {
        let room = target.saturating_sub(self.zeroed + self.zeroing);
        let want = (out.len() as u64)
            .min(room)
            .min(self.plain_free())
            .min(self.unreserved_free()) as usize;
        let mut n = 0;
        let mut idx = self.lowest_plain;
        while n < want && idx < self.entries.len() {
            if self.entries[idx] == FREE {
                self.set_code(idx, ZEROING);
                out[n] = PhysAddr::new(self.addr_of(idx));
                n += 1;
            }
            idx += 1;
        }
        // Every plain free frame before `idx` was taken now.
        self.lowest_plain = idx;
        self.zeroing += n as u64;
        n
    }

    /// Frames [`Self::claim_to_zero`] gave out, now zeroed (and cleaned to
    /// the point of coherency): back in the pool, marked zeroed. A frame
    /// that was not claimed is refused and left as it was.
    pub fn finish_zeroing(&mut self, frames: &[PhysAddr]) -> Result<(), FrameError> {
        let mut result = Ok(());
        for &addr in frames {
            match self.index_of(addr.raw()) {
                Some(idx) if self.entries[idx] == ZEROING && addr.is_page_aligned() => {
                    self.set_code(idx, ZEROED);
                    self.zeroing -= 1;
                }
                _ => result = Err(FrameError::NotBeingZeroed { addr }),
            }
        }
        result
    }

    /// [`Self::free_guest`] for a batch of frames, with one counter update:
    /// each frame is checked as `free_guest` checks it, and one that is
    /// refused is passed to `on_error` and left as it was. Returns how many
    /// were freed.
    pub fn free_guest_frames(
        &mut self,
        vm: usize,
        frames: &[PhysAddr],
        on_error: &mut dyn FnMut(FrameError),
    ) -> u64 {
        if vm >= MAX_VMS {
            for &addr in frames {
                on_error(FrameError::NotOwnedBy { addr, vm, code: 0 });
            }
            return 0;
        }
        let code = FIRST_GUEST_CODE + vm as u8;
        let mut bank = Bank::EMPTY;
        let mut freed = 0;
        let mut lowest = usize::MAX;
        let mut rest = frames;
        while let Some((&first, _)) = rest.split_first() {
            // A run of consecutive frames (a VM's RAM is mostly backed in
            // order) all of this VM's and in one bank: freed as a slice.
            let run = 1 + rest
                .windows(2)
                .take_while(|w| w[0].raw().checked_add(PAGE_SIZE) == Some(w[1].raw()))
                .count();
            let (run_frames, next) = rest.split_at(run);
            let (a, b) = (first.raw(), run_frames[run - 1].raw());
            if run > 1 && first.is_page_aligned() {
                if let Some(bk) = self
                    .banks()
                    .iter()
                    .find(|bk| a >= bk.first && b < bk.tracked_end())
                {
                    let idx = bk.base + ((a - bk.first) / PAGE_SIZE) as usize;
                    let entries = &mut self.entries[idx..idx + run];
                    if entries.iter().all(|&c| c == code) {
                        entries.fill(FREE);
                        self.lowest_free = self.lowest_free.min(idx);
                        lowest = lowest.min(idx);
                        freed += run as u64;
                        rest = next;
                        continue;
                    }
                }
            }
            // One by one: a lone frame, or a run with a refused frame.
            rest = next;
            for &addr in run_frames {
                let a = addr.raw();
                if !addr.is_page_aligned() {
                    on_error(FrameError::Unaligned { addr });
                    continue;
                }
                // Frames of a batch are mostly in one bank: look it up only
                // when the address leaves the last one.
                if a < bank.first || a >= bank.tracked_end() {
                    match self
                        .banks()
                        .iter()
                        .find(|b| a >= b.first && a < b.tracked_end())
                    {
                        Some(b) => bank = *b,
                        None => {
                            on_error(FrameError::NotInRam { addr, pages: 1 });
                            continue;
                        }
                    }
                }
                let idx = bank.base + ((a - bank.first) / PAGE_SIZE) as usize;
                let found = self.entries[idx];
                if found != code {
                    on_error(FrameError::NotOwnedBy {
                        addr,
                        vm,
                        code: found,
                    });
                    continue;
                }
                self.entries[idx] = FREE;
                self.lowest_free = self.lowest_free.min(idx);
                lowest = lowest.min(idx);
                freed += 1;
            }
        }
        self.moved_guest(vm, freed, false);
        self.lowest_plain = self.lowest_plain.min(lowest);
        if freed > 0 {
            self.icache_freed += 1;
        }
        freed
    }

    /// The counters after `n` frames moved between the pool and VM `vm`
    /// (`to_vm`: allocated), their bytes already set.
    fn moved_guest(&mut self, vm: usize, n: u64, to_vm: bool) {
        let (free, guest) = (FrameUse::Free as usize, FrameUse::Guest as usize);
        let g = &mut self.guests[vm];
        let before = g.owned;
        if to_vm {
            self.counts[free] -= n;
            self.counts[guest] += n;
            g.owned += n;
        } else {
            self.counts[free] += n;
            self.counts[guest] -= n;
            g.owned -= n;
        }
        self.reserved = (self.reserved + before.min(g.guaranteed)) - g.owned.min(g.guaranteed);
    }

    /// The VM that owns the frame at `addr`, if a VM does.
    pub fn guest_owner(&self, addr: PhysAddr) -> Option<usize> {
        let code = self.entries[self.index_of(addr.raw())?];
        (FrameUse::from_code(code) == Some(FrameUse::Guest))
            .then(|| (code - FIRST_GUEST_CODE) as usize)
    }

    /// Frames owned by VM `vm`.
    pub fn guest_pages(&self, vm: usize) -> u64 {
        self.guests.get(vm).map_or(0, |g| g.owned)
    }

    fn alloc_code(&mut self, pages: usize, align_pages: usize, code: u8) -> Option<PhysAddr> {
        let align_pages = align_pages.max(1);
        if pages == 0 || !align_pages.is_power_of_two() {
            return None;
        }
        if self.free_pages() < pages as u64 {
            return None;
        }
        let align = (align_pages as u64).checked_mul(PAGE_SIZE)?;
        let hint = self.hint;
        let idx = self
            .search(hint, pages, align)
            .or_else(|| self.search(0, pages, align))?;
        for i in idx..idx + pages {
            self.set_code(i, code);
        }
        self.hint = if idx + pages >= self.entries.len() {
            0
        } else {
            idx + pages
        };
        Some(PhysAddr::new(self.addr_of(idx)))
    }

    /// First fitting run at or after storage index `from`.
    fn search(&self, from: usize, pages: usize, align: u64) -> Option<usize> {
        for b in self.banks() {
            if b.base + b.pages <= from {
                continue;
            }
            let start = from.saturating_sub(b.base);
            if let Some(local) = self.search_bank(b, start, pages, align) {
                return Some(b.base + local);
            }
        }
        None
    }

    fn search_bank(&self, b: &Bank, mut i: usize, pages: usize, align: u64) -> Option<usize> {
        let entries = &self.entries[b.base..b.base + b.pages];
        loop {
            let addr = b.first + i as u64 * PAGE_SIZE;
            let aligned = addr.checked_add(align - 1)? & !(align - 1);
            let j = usize::try_from((aligned - b.first) / PAGE_SIZE).ok()?;
            if j.checked_add(pages)? > b.pages {
                return None;
            }
            match entries[j..j + pages].iter().rposition(|&e| !is_free(e)) {
                None => return Some(j),
                Some(k) => i = j + k + 1,
            }
        }
    }

    /// Returns `pages` pages at `start`, all currently `from`, to the free
    /// pool. Errors (and changes nothing) if `start` is unaligned, a page is
    /// outside tracked RAM or not `from`, or `from` is `Free`.
    pub fn free(
        &mut self,
        start: PhysAddr,
        pages: usize,
        from: FrameUse,
    ) -> Result<(), FrameError> {
        let addr = start.raw();
        if from == FrameUse::Free {
            return Err(FrameError::InvalidUse {
                op: "free",
                use_: from,
            });
        }
        if !start.is_page_aligned() {
            return Err(FrameError::Unaligned { addr: start });
        }
        if pages == 0 {
            return Ok(());
        }
        let not_in_ram = FrameError::NotInRam { addr: start, pages };
        let end = (pages as u64)
            .checked_mul(PAGE_SIZE)
            .and_then(|len| addr.checked_add(len))
            .ok_or(not_in_ram)?;
        let tracked: usize = self
            .banks()
            .iter()
            .map(|b| b.indexes(addr, end).len())
            .sum();
        if tracked != pages {
            return Err(not_in_ram);
        }
        for b in self.banks() {
            for idx in b.indexes(addr, end) {
                let code = self.entries[idx];
                if code != from as u8 {
                    let page = PhysAddr::new(self.addr_of(idx));
                    return Err(match FrameUse::from_code(code) {
                        Some(found) => FrameError::WrongUse {
                            addr: page,
                            expected: from,
                            found,
                        },
                        None => FrameError::CorruptEntry { addr: page, code },
                    });
                }
            }
        }
        for i in 0..self.nbanks {
            for idx in self.banks[i].indexes(addr, end) {
                self.set(idx, FrameUse::Free);
            }
        }
        Ok(())
    }

    /// The use of the page containing `addr`; `None` outside tracked RAM
    /// (including the partial pages at unaligned bank edges).
    pub fn use_of(&self, addr: PhysAddr) -> Option<FrameUse> {
        self.index_of(addr.raw())
            .and_then(|i| FrameUse::from_code(self.entries[i]))
    }

    /// Free frames an allocation can take: all but those out being zeroed
    /// (which the accounting counts as free: [`Self::pages`]).
    pub fn free_pages(&self) -> u64 {
        self.counts[FrameUse::Free as usize] - self.zeroing
    }

    /// `debug fail <vm> frames`: the first half of a transition, as a
    /// failure between a counter's update and its frame's would leave it
    /// (one page moves from free to allocated in the counters only).
    /// [`Self::check_invariants`] finds it.
    pub fn break_for_test(&mut self) {
        let free = &mut self.counts[FrameUse::Free as usize];
        *free = free.saturating_sub(1);
        let allocated = &mut self.counts[FrameUse::Allocated as usize];
        *allocated = allocated.saturating_add(1);
    }

    /// Tracked pages (free or not).
    pub fn total_pages(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Pages currently used for `use_`.
    pub fn pages(&self, use_: FrameUse) -> u64 {
        self.counts[use_ as usize]
    }

    pub fn accounting(&self) -> Accounting {
        let mut acc = Accounting {
            by_use: [0; FrameUse::COUNT],
            unusable_partial_pages: self.partial_bytes,
        };
        for (bytes, pages) in acc.by_use.iter_mut().zip(self.counts) {
            *bytes = pages * PAGE_SIZE;
        }
        acc
    }

    /// Maximal runs of pages with the same use, in address order (runs never
    /// span banks): the memory map a shell prints.
    pub fn runs(&self) -> Runs<'_, 'a> {
        Runs {
            table: self,
            bank: 0,
            page: 0,
        }
    }

    /// Recounts every page: every stored byte is a valid [`FrameUse`], the
    /// incremental counters match, and the accounting covers exactly the RAM.
    pub fn check_invariants(&self) -> Result<(), FrameError> {
        let mut counted = [0u64; FrameUse::COUNT];
        let mut guests = [0u64; MAX_VMS];
        let (mut zeroed, mut zeroing) = (0, 0);
        for (idx, &code) in self.entries.iter().enumerate() {
            let below = |hint: usize, what: &'static str| {
                (idx < hint).then(|| FrameError::BelowHint {
                    addr: PhysAddr::new(self.addr_of(idx)),
                    what,
                })
            };
            if code == ZEROED {
                zeroed += 1;
                below(self.lowest_zeroed, "zeroed").map_or(Ok(()), Err)?;
            } else if code == ZEROING {
                zeroing += 1;
            } else if code == FREE {
                below(self.lowest_plain, "plain free").map_or(Ok(()), Err)?;
            }
            if FrameUse::from_code(code) == Some(FrameUse::Guest) {
                guests[(code - FIRST_GUEST_CODE) as usize] += 1;
            }
        }
        if (zeroed, zeroing) != (self.zeroed, self.zeroing) {
            return Err(FrameError::ZeroedCounterMismatch {
                counted: (zeroed, zeroing),
                recorded: (self.zeroed, self.zeroing),
            });
        }
        if let Some(vm) = (0..MAX_VMS).find(|&vm| guests[vm] != self.guests[vm].owned) {
            return Err(FrameError::GuestCounterMismatch {
                vm,
                counted: guests[vm],
                recorded: self.guests[vm].owned,
            });
        }
        let reserved: u64 = (0..MAX_VMS)
            .map(|vm| self.guests[vm].guaranteed.saturating_sub(guests[vm]))
            .sum();
        if reserved != self.reserved {
            return Err(FrameError::ReservedMismatch {
                counted: reserved,
                recorded: self.reserved,
            });
        }
        for b in self.banks() {
            for idx in b.base..b.base + b.pages {
                let code = self.entries[idx];
                let addr = || PhysAddr::new(b.first + (idx - b.base) as u64 * PAGE_SIZE);
                match FrameUse::from_code(code) {
                    Some(FrameUse::Free) if idx < self.lowest_free => {
                        return Err(FrameError::FreeBelowHint { addr: addr() });
                    }
                    Some(u) => counted[u as usize] += 1,
                    None => return Err(FrameError::CorruptEntry { addr: addr(), code }),
                }
            }
        }
        for use_ in FrameUse::ALL {
            let (c, r) = (counted[use_ as usize], self.counts[use_ as usize]);
            if c != r {
                return Err(FrameError::CounterMismatch {
                    use_,
                    counted: c,
                    recorded: r,
                });
            }
        }
        let ram: u64 = self.banks().iter().map(|b| b.range.size()).sum();
        let accounted = self.accounting().total();
        if accounted != ram {
            return Err(FrameError::AccountingMismatch { accounted, ram });
        }
        Ok(())
    }
}

/// Iterator returned by [`FrameTable::runs`].
pub struct Runs<'t, 'a> {
    table: &'t FrameTable<'a>,
    bank: usize,
    page: usize,
}

impl Iterator for Runs<'_, '_> {
    /// The run and its use (`None` for a byte that encodes no use).
    type Item = (PhysRange, Option<FrameUse>);

    fn next(&mut self) -> Option<Self::Item> {
        while self.bank < self.table.nbanks {
            let b = &self.table.banks[self.bank];
            if self.page >= b.pages {
                self.bank += 1;
                self.page = 0;
                continue;
            }
            let entries = &self.table.entries[b.base..b.base + b.pages];
            // Free frames of either kind are one run: the map shows uses.
            let same = |c: u8| if is_free(c) { FREE } else { c };
            let code = same(entries[self.page]);
            let start = self.page;
            let len = entries[start..]
                .iter()
                .take_while(|&&c| same(c) == code)
                .count();
            self.page = start + len;
            let range = PhysRange::new(
                b.first + start as u64 * PAGE_SIZE,
                b.first + self.page as u64 * PAGE_SIZE,
            );
            return Some((range, FrameUse::from_code(code)));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pa(addr: u64) -> PhysAddr {
        PhysAddr::new(addr)
    }

    const MIB: u64 = 1 << 20;

    fn r(start: u64, end: u64) -> PhysRange {
        PhysRange::new(start, end)
    }

    fn storage(ram: &[PhysRange]) -> Vec<u8> {
        vec![0xEE; FrameTable::entries_needed(ram)]
    }

    fn ram_size(ram: &[PhysRange]) -> u64 {
        ram.iter().map(|b| b.size()).sum()
    }

    /// How many frames an allocation gave, and which were zeroed.
    fn marked(got: GuestAlloc) -> (usize, u64) {
        (got.count, got.zeroed)
    }

    /// Everything observable about a table, to check that failures change nothing.
    fn snapshot(t: &FrameTable) -> (Vec<u8>, Accounting, u64) {
        (t.entries.to_vec(), t.accounting(), t.free_pages())
    }

    /// The 8 GiB Raspberry Pi 4 as its firmware describes it (35-bit
    /// physical addresses): RAM below the VideoCore's share, up to the
    /// low-peripheral window at 0xfc000000, and 4 GiB above 4 GiB. Every
    /// page is accounted and frames above 4 GiB are handed out like any.
    #[test]
    fn eight_gib_pi4_banks_above_4_gib() {
        let ram = [
            r(0, 0x3b40_0000),
            r(0x4000_0000, 0xfc00_0000),
            r(0x1_0000_0000, 0x2_0000_0000),
        ];
        let mut store = storage(&ram);
        // One byte per page: 7.86 GiB of RAM takes under 2 MiB of table.
        assert!(store.len() < 2 * MIB as usize);
        let mut t = FrameTable::new(&ram, &mut store).unwrap();
        assert_eq!(t.total_pages() * PAGE_SIZE, ram_size(&ram));
        assert_eq!(t.mark(r(0, PAGE_SIZE), FrameUse::FirmwareReserved), Ok(1));
        // Fill the banks below 4 GiB; the next frames come from above.
        let low = (ram[0].size() + ram[1].size()) / PAGE_SIZE - 1;
        for _ in 0..low {
            t.alloc(1, 1, FrameUse::Heap).expect("low RAM");
        }
        let high = t.alloc(512, 512, FrameUse::Heap).expect("RAM above 4 GiB");
        assert!(high.raw() >= 0x1_0000_0000 && high.raw() + 2 * MIB <= 0x2_0000_0000);
        let acc = t.accounting();
        let total: u64 = FrameUse::ALL.iter().map(|&u| acc.bytes(u)).sum();
        assert_eq!(total, ram_size(&ram));
        assert_eq!(t.check_invariants(), Ok(()));
    }

    /// What `debug fail <vm> frames` leaves is what the check after a
    /// failure looks for: a counter moved without its frame.
    #[test]
    fn half_a_transition_is_found() {
        let ram = [r(0x4000_0000, 0x4000_0000 + 4 * MIB)];
        let mut store = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut store).unwrap();
        t.alloc_guest(0).unwrap();
        assert_eq!(t.check_invariants(), Ok(()));
        t.break_for_test();
        assert!(matches!(
            t.check_invariants(),
            Err(FrameError::CounterMismatch { .. })
        ));
    }

    #[test]
    fn labels_and_codes() {
        let labels: Vec<_> = FrameUse::ALL.iter().map(|u| u.label()).collect();
        assert_eq!(
            labels,
            [
                "hypervisor image",
                "device tree",
                "guest bundle",
                "firmware reserved",
                "frame table",
                "heap",
                "page tables",
                "free",
                "allocated",
                "guest RAM"
            ]
        );
        for (i, u) in FrameUse::ALL.iter().enumerate() {
            assert_eq!(u.code() as usize, i);
            assert!(u.code() < FIRST_GUEST_CODE);
            if *u != FrameUse::Guest {
                assert_eq!(FrameUse::from_code(u.code()), Some(*u));
            }
        }
        // Guest frames are stored as FIRST_GUEST_CODE + vm, never as 9.
        assert_eq!(FrameUse::from_code(FrameUse::Guest as u8), None);
        assert_eq!(FrameUse::from_code(10), None);
        assert_eq!(FrameUse::from_code(FIRST_GUEST_CODE), Some(FrameUse::Guest));
        let past = FIRST_GUEST_CODE + MAX_VMS as u8;
        assert_eq!(FrameUse::from_code(past), None);
        // Zeroed frames and frames out being zeroed count as free.
        assert_eq!(FrameUse::from_code(ZEROED), Some(FrameUse::Free));
        assert_eq!(FrameUse::from_code(ZEROING), Some(FrameUse::Free));
        assert_eq!(FrameUse::from_code(ZEROING - 1), None);
    }

    #[test]
    fn frames_zeroed_ahead_are_free_and_taken_first() {
        let ram = [r(0, 16 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let mut got = [pa(0); 4];
        assert_eq!(marked(t.alloc_guest_frames_marked(1, &mut got)), (4, 0));
        let no_error = &mut |e| panic!("{e}");
        t.free_guest_frames(1, &got[..1], no_error);
        // Up to a target of 3: the lowest plain free frames (0, then 4, 5).
        let mut claim = [pa(0); 8];
        assert_eq!(t.claim_to_zero(&mut claim, 3), 3);
        assert_eq!(claim[..3], [pa(0), pa(4 * PAGE_SIZE), pa(5 * PAGE_SIZE)]);
        // Out being zeroed: still free for the accounting, but no
        // allocation takes them meanwhile.
        assert_eq!(t.use_of(pa(0)), Some(FrameUse::Free));
        assert_eq!(t.pages(FrameUse::Free), 16 - 3);
        assert_eq!((t.free_pages(), t.plain_free()), (16 - 3 - 3, 16 - 3 - 3));
        assert_eq!(t.claim_to_zero(&mut claim[3..], 3), 0, "target reached");
        t.check_invariants().unwrap();
        t.finish_zeroing(&claim[..3]).unwrap();
        assert!(
            t.finish_zeroing(&claim[..1]).is_err(),
            "not claimed any more"
        );
        assert_eq!(t.zeroed_pages(), (3, 0));
        assert_eq!(t.free_pages(), 16 - 3);
        t.check_invariants().unwrap();
        // VM 1: the zeroed ones first, marked, then plain (to zero).
        let mut four = [pa(0); 4];
        assert_eq!(
            marked(t.alloc_guest_frames_marked(1, &mut four)),
            (4, 0b0111)
        );
        assert_eq!(
            four,
            [
                pa(0),
                pa(4 * PAGE_SIZE),
                pa(5 * PAGE_SIZE),
                pa(6 * PAGE_SIZE)
            ]
        );
        assert_eq!(t.zeroed_pages(), (0, 3));
        t.check_invariants().unwrap();
        // Freed again: plain, zeroed again by the next claim (lowest first).
        t.free_guest_frames(1, &four[..1], no_error);
        // Plain free now: frame 0 and 7..16; 8 fit.
        assert_eq!(t.claim_to_zero(&mut claim, 100), 8);
        assert_eq!(claim[0], pa(0));
        // A hypervisor allocation may take a zeroed frame (and zeroes it).
        t.finish_zeroing(&claim[..8]).unwrap();
        assert_eq!(t.alloc(1, 1, FrameUse::PageTables), Some(pa(0)));
        t.check_invariants().unwrap();
        assert_eq!(t.zeroed_pages().0, 7);
    }

    #[test]
    fn zeroing_ahead_waits_for_quiet_guests_and_stops_at_its_target() {
        let ram = [r(0, 16 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        assert!(zero_ahead_now(&t, false, 0, 4));
        assert!(zero_ahead_now(&t, false, QUIET_EXITS_PER_TICK, 4));
        assert!(!zero_ahead_now(&t, true, 0, 4), "a guest took frames");
        assert!(
            !zero_ahead_now(&t, false, QUIET_EXITS_PER_TICK + 1, 4),
            "busy"
        );
        let mut claim = [pa(0); 4];
        assert_eq!(t.claim_to_zero(&mut claim, 4), 4);
        assert!(
            !zero_ahead_now(&t, false, 0, 4),
            "all four out being zeroed"
        );
        t.finish_zeroing(&claim).unwrap();
        assert!(!zero_ahead_now(&t, false, 0, 4), "target reached");
        assert!(zero_ahead_now(&t, false, 0, 5));
        // Nothing plain left to zero: the zeroed four went first, marked.
        let mut rest = [pa(0); 12];
        assert_eq!(
            marked(t.alloc_guest_frames_marked(1, &mut rest)),
            (12, 0b1111)
        );
        assert_eq!(t.plain_free(), 4);
        assert_eq!(
            marked(t.alloc_guest_frames_marked(1, &mut rest[..4])),
            (4, 0)
        );
        assert_eq!(t.plain_free(), 0);
        assert!(!zero_ahead_now(&t, false, 0, 100));
        t.check_invariants().unwrap();
    }

    #[test]
    fn guarantees_hold_frames_and_the_floor_stops_the_rest() {
        let ram = [r(0, 64 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        t.set_guest_floor(4);
        // VM 0 is guaranteed 20 frames: 60 - 20 = 40 unreserved above a floor of 4.
        t.guarantee(0, 20).unwrap();
        assert_eq!((t.reserved(), t.unreserved_free()), (20, 44));
        // VM 1 takes frames until only the floor is left unreserved.
        let mut taken = 0;
        while t.alloc_guest(1).is_some() {
            taken += 1;
        }
        assert_eq!(taken, 40);
        assert_eq!(t.unreserved_free(), 4);
        // VM 0 still gets its 20, from its guarantee, and not one more.
        for _ in 0..20 {
            assert!(t.alloc_guest(0).is_some());
        }
        assert_eq!(t.reserved(), 0);
        assert_eq!(t.alloc_guest(0), None);
        // A VM asked to inflate its balloon goes on to half the floor, and
        // no further; asked no more, it stops at the floor again.
        t.set_inflating(1, true);
        assert!(t.inflating(1) && !t.inflating(0));
        assert!(t.alloc_guest(1).is_some() && t.alloc_guest(1).is_some());
        assert_eq!(t.alloc_guest(1), None);
        assert_eq!(t.alloc_guest(0), None, "only the VM giving back");
        assert_eq!(t.unreserved_free(), 2);
        t.set_inflating(1, false);
        assert_eq!(t.alloc_guest(1), None);
        let back: Vec<_> = (0..64)
            .map(|i| pa(i * PAGE_SIZE))
            .filter(|&a| t.guest_owner(a) == Some(1))
            .take(2)
            .collect();
        for f in back {
            t.free_guest(1, f).unwrap();
        }
        assert_eq!(t.unreserved_free(), 4);
        // A new guarantee that does not fit is refused, naming the shortfall.
        assert_eq!(
            t.guarantee(2, 10),
            Err(Shortfall {
                needed: 10,
                available: 0
            })
        );
        assert_eq!(t.guaranteed(2), 0);
        t.check_invariants().unwrap();
        // Frames VM 0 gives back below its guarantee are held for it again.
        let f = t.alloc_code(1, 1, FIRST_GUEST_CODE); // a frame of VM 0 past the floor
        assert!(f.is_some());
        t.free_guest(0, f.unwrap()).unwrap();
        t.check_invariants().unwrap();
        let owned: Vec<_> = (0..64)
            .map(|i| pa(i * PAGE_SIZE))
            .filter(|&a| t.guest_owner(a) == Some(0))
            .take(5)
            .collect();
        for a in &owned {
            t.free_guest(0, *a).unwrap();
        }
        assert_eq!(t.reserved(), 5);
        assert_eq!(t.unreserved_free(), 4);
        t.check_invariants().unwrap();
        // Dropping the guarantee releases them.
        t.guarantee(0, 0).unwrap();
        assert_eq!((t.reserved(), t.unreserved_free()), (0, 9));
        t.check_invariants().unwrap();
    }

    #[test]
    fn guest_frames_have_one_owner() {
        let ram = [r(0, 64 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let a = t.alloc_guest(0).unwrap();
        let b = t.alloc_guest(3).unwrap();
        let c = t.alloc_guest(3).unwrap();
        assert_eq!((t.guest_owner(a), t.guest_owner(b)), (Some(0), Some(3)));
        assert_eq!((t.guest_pages(0), t.guest_pages(3)), (1, 2));
        assert_eq!(t.pages(FrameUse::Guest), 3);
        assert_eq!(t.use_of(c), Some(FrameUse::Guest));
        assert_eq!(t.alloc_guest(MAX_VMS), None);
        assert!(
            t.alloc(1, 1, FrameUse::Guest).is_none(),
            "guest frames need an owner"
        );
        // Another VM's frame, a free frame, or the wrong use: refused, unchanged.
        assert!(matches!(
            t.free_guest(0, b),
            Err(FrameError::NotOwnedBy { .. })
        ));
        assert!(t.free(b, 1, FrameUse::Allocated).is_err());
        t.check_invariants().unwrap();
        t.free_guest(3, b).unwrap();
        assert!(matches!(
            t.free_guest(3, b),
            Err(FrameError::NotOwnedBy { .. })
        ));
        assert_eq!((t.guest_pages(3), t.guest_owner(b)), (1, None));
        assert_eq!(t.accounting().bytes(FrameUse::Guest), 2 * PAGE_SIZE);
        t.check_invariants().unwrap();
        t.entries[5] = FIRST_GUEST_CODE + 7;
        assert!(t.check_invariants().is_err());
    }

    #[test]
    fn accounting_sums_to_ram_with_unaligned_edges() {
        let ram = [
            r(0x4000_0100, 0x4010_0000),
            r(0x5000_0000, 0x5000_3800),
            r(0x6000_0010, 0x6000_0ff0),
        ];
        let mut st = storage(&ram);
        // Bank 0: head 0xf00 partial, 255 pages; bank 1: 3 pages + 0x800 tail; bank 2: no page.
        assert_eq!(st.len(), 255 + 3);
        let t = FrameTable::new(&ram, &mut st).unwrap();
        let acc = t.accounting();
        assert_eq!(acc.unusable_partial_pages, 0xf00 + 0x800 + 0xfe0);
        assert_eq!(acc.total(), ram_size(&ram));
        assert_eq!(acc.bytes(FrameUse::Free), 258 * PAGE_SIZE);
        assert_eq!(t.free_pages(), 258);
        assert_eq!(t.total_pages(), 258);
        t.check_invariants().unwrap();
        assert_eq!(t.use_of(pa(0x4000_0100)), None);
        assert_eq!(t.use_of(pa(0x4000_1000)), Some(FrameUse::Free));
        assert_eq!(t.use_of(pa(0x400f_ffff)), Some(FrameUse::Free));
        assert_eq!(t.use_of(pa(0x4010_0000)), None);
        assert_eq!(t.use_of(pa(0x5000_3000)), None);
        assert_eq!(t.use_of(pa(0x6000_0800)), None);
        assert_eq!(t.use_of(pa(0)), None);
        assert_eq!(t.use_of(pa(u64::MAX)), None);
    }

    #[test]
    fn new_checks_banks_and_storage() {
        let mut st = vec![0u8; 1 << 12];
        let e = |ram: &[PhysRange], st: &mut [u8]| FrameTable::new(ram, st).err();
        assert!(matches!(
            e(&[r(0, 0x1000), r(0x800, 0x2000)], &mut st),
            Some(FrameError::UnsortedBanks { index: 1, .. })
        ));
        assert!(matches!(
            e(&[r(0x2000, 0x3000), r(0, 0x1000)], &mut st),
            Some(FrameError::UnsortedBanks { .. })
        ));
        assert!(matches!(
            e(&[r(0x2000, 0x2000)], &mut st),
            Some(FrameError::EmptyBank { index: 0, .. })
        ));
        assert!(matches!(
            e(&[r(0, 0x2000)], &mut st[..1]),
            Some(FrameError::StorageTooSmall { needed: 2, got: 1 })
        ));
        let many = [r(0, 0x1000); MAX_RAM_BANKS + 1];
        assert!(matches!(
            e(&many, &mut st),
            Some(FrameError::TooManyBanks { .. })
        ));
        // Adjacent banks are fine; so is no RAM at all, and extra storage.
        assert!(FrameTable::new(&[r(0, 0x1000), r(0x1000, 0x2000)], &mut st).is_ok());
        let t = FrameTable::new(&[], &mut st).unwrap();
        assert_eq!(t.accounting().total(), 0);
        // A bank at the very top of the address space.
        let top = [r(u64::MAX - 0x2fff, u64::MAX)];
        let t = FrameTable::new(&top, &mut st).unwrap();
        assert_eq!(t.accounting().total(), 0x2fff);
        t.check_invariants().unwrap();
        for e in [
            FrameError::TooManyBanks { count: 9 },
            FrameError::NotInRam {
                addr: pa(0),
                pages: 1,
            },
            FrameError::WrongUse {
                addr: pa(0x1000),
                expected: FrameUse::Heap,
                found: FrameUse::Free,
            },
        ] {
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn mark_first_claim_wins_and_clips() {
        let ram = [
            r(0x4000_0000, 0x4000_0000 + MIB),
            r(0x5000_0000, 0x5000_0000 + MIB),
        ];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        // Rounds outward: 0x10 bytes straddling a page boundary claim 2 pages.
        assert_eq!(
            t.mark(r(0x4000_0ff8, 0x4000_1008), FrameUse::HypervisorImage),
            Ok(2)
        );
        // Overlapping later claim only gets the free pages.
        assert_eq!(
            t.mark(r(0x4000_0000, 0x4000_4000), FrameUse::DeviceTree),
            Ok(2)
        );
        assert_eq!(t.use_of(pa(0x4000_0000)), Some(FrameUse::HypervisorImage));
        assert_eq!(t.use_of(pa(0x4000_1fff)), Some(FrameUse::HypervisorImage));
        assert_eq!(t.use_of(pa(0x4000_2000)), Some(FrameUse::DeviceTree));
        // Same claim again: nothing changes.
        assert_eq!(
            t.mark(r(0x4000_0000, 0x4000_4000), FrameUse::DeviceTree),
            Ok(0)
        );
        // Parts outside RAM are ignored; a range spanning both banks and the hole.
        assert_eq!(
            t.mark(r(0x3000_0000, 0x4000_0000), FrameUse::FirmwareReserved),
            Ok(0)
        );
        assert_eq!(
            t.mark(r(0x400f_f000, 0x5000_1000), FrameUse::FirmwareReserved),
            Ok(2)
        );
        assert_eq!(
            t.mark(r(0x5000_0000 + MIB, u64::MAX), FrameUse::GuestBundle),
            Ok(0)
        );
        assert_eq!(t.mark(r(5, 5), FrameUse::GuestBundle), Ok(0));
        let before = snapshot(&t);
        assert!(matches!(
            t.mark(r(6, 5), FrameUse::Heap),
            Err(FrameError::InvalidRange { .. })
        ));
        assert!(matches!(
            t.mark(r(0, u64::MAX), FrameUse::Free),
            Err(FrameError::InvalidUse { .. })
        ));
        assert_eq!(snapshot(&t), before);
        let acc = t.accounting();
        assert_eq!(acc.bytes(FrameUse::HypervisorImage), 2 * PAGE_SIZE);
        assert_eq!(acc.bytes(FrameUse::DeviceTree), 2 * PAGE_SIZE);
        assert_eq!(acc.bytes(FrameUse::FirmwareReserved), 2 * PAGE_SIZE);
        assert_eq!(acc.total(), 2 * MIB);
        t.check_invariants().unwrap();
        let runs: Vec<_> = t.runs().collect();
        assert_eq!(
            runs[0],
            (r(0x4000_0000, 0x4000_2000), Some(FrameUse::HypervisorImage))
        );
        assert_eq!(
            runs[1],
            (r(0x4000_2000, 0x4000_4000), Some(FrameUse::DeviceTree))
        );
        assert_eq!(runs.iter().map(|(r, _)| r.size()).sum::<u64>(), 2 * MIB);
    }

    #[test]
    fn alloc_free_round_trip_and_alignment() {
        let ram = [r(0x4000_0000, 0x4000_0000 + 4 * MIB)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        t.mark(r(0x4000_0000, 0x4000_3000), FrameUse::HypervisorImage)
            .unwrap();
        let a = t.alloc(1, 1, FrameUse::Allocated).unwrap();
        assert_eq!(a, pa(0x4000_3000));
        let b = t.alloc(1, 1, FrameUse::PageTables).unwrap();
        assert_eq!(b, pa(0x4000_4000));
        // 2 MiB aligned: skips to the next 2 MiB boundary.
        let c = t.alloc(16, 512, FrameUse::Heap).unwrap();
        assert_eq!(c, pa(0x4020_0000));
        assert_eq!(t.use_of(c + 15 * PAGE_SIZE), Some(FrameUse::Heap));
        assert_eq!(t.use_of(c + 16 * PAGE_SIZE), Some(FrameUse::Free));
        // 64 KiB aligned.
        let d = t.alloc(3, 16, FrameUse::Allocated).unwrap();
        assert_eq!(d.raw() % (16 * PAGE_SIZE), 0);
        assert_eq!(t.pages(FrameUse::Allocated), 4);
        t.check_invariants().unwrap();
        t.free(c, 16, FrameUse::Heap).unwrap();
        t.free(a, 1, FrameUse::Allocated).unwrap();
        t.free(b, 1, FrameUse::PageTables).unwrap();
        t.free(d, 3, FrameUse::Allocated).unwrap();
        assert_eq!(t.free_pages(), 1024 - 3);
        t.check_invariants().unwrap();
        // Bad parameters.
        assert_eq!(t.alloc(0, 1, FrameUse::Heap), None);
        assert_eq!(t.alloc(1, 3, FrameUse::Heap), None);
        assert_eq!(t.alloc(1, 1, FrameUse::Free), None);
        assert_eq!(t.alloc(1, 1 << 62, FrameUse::Heap), None);
        assert_eq!(
            t.alloc(1, 0, FrameUse::Heap).map(|a| a.raw() % PAGE_SIZE),
            Some(0)
        );
    }

    #[test]
    fn alloc_never_crosses_banks_and_exhausts() {
        // Two adjacent banks of 4 pages each: 5 contiguous pages never fit.
        let ram = [r(0x1000, 0x5000), r(0x5000, 0x9000)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        assert_eq!(t.alloc(5, 1, FrameUse::Heap), None);
        assert_eq!(t.alloc(4, 1, FrameUse::Heap), Some(pa(0x1000)));
        assert_eq!(t.alloc(4, 1, FrameUse::Heap), Some(pa(0x5000)));
        assert_eq!(t.alloc(1, 1, FrameUse::Heap), None);
        assert_eq!(t.free_pages(), 0);
        t.free(pa(0x2000), 2, FrameUse::Heap).unwrap();
        assert_eq!(t.alloc(2, 2, FrameUse::Allocated), Some(pa(0x2000)));
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), None);
        t.check_invariants().unwrap();
        // Freeing across the two banks at once is fine when every page matches.
        t.free(pa(0x4000), 2, FrameUse::Heap).unwrap();
        assert_eq!(t.use_of(pa(0x4000)), Some(FrameUse::Free));
        assert_eq!(t.use_of(pa(0x5000)), Some(FrameUse::Free));
    }

    #[test]
    fn next_fit_reuses_freed_pages_after_wrapping() {
        let ram = [r(0, 8 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let got: Vec<_> = (0..8)
            .map(|_| t.alloc(1, 1, FrameUse::Allocated).unwrap())
            .collect();
        assert_eq!(got, (0..8).map(|i| pa(i * PAGE_SIZE)).collect::<Vec<_>>());
        t.free(pa(3 * PAGE_SIZE), 1, FrameUse::Allocated).unwrap();
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), Some(pa(3 * PAGE_SIZE)));
        t.free(pa(PAGE_SIZE), 1, FrameUse::Allocated).unwrap();
        t.free(pa(6 * PAGE_SIZE), 1, FrameUse::Allocated).unwrap();
        // Cursor is after page 3: page 6 comes first, then page 1 after wrapping.
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), Some(pa(6 * PAGE_SIZE)));
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), Some(pa(PAGE_SIZE)));
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), None);
    }

    #[test]
    fn bad_free_changes_nothing() {
        let ram = [r(0x1000, 0x11000), r(0x20000, 0x30000)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let a = t.alloc(4, 1, FrameUse::Allocated).unwrap();
        t.mark(r(0x20000, 0x22000), FrameUse::DeviceTree).unwrap();
        let before = snapshot(&t);
        let cases = [
            (t.free(a, 4, FrameUse::Heap), "wrong use"),
            (t.free(a, 5, FrameUse::Allocated), "one page too many"),
            (t.free(a + 1, 1, FrameUse::Allocated), "unaligned"),
            (
                t.free(pa(0x11000), 1, FrameUse::Allocated),
                "gap between banks",
            ),
            (
                t.free(pa(0x10000), 2, FrameUse::Allocated),
                "runs off the bank",
            ),
            (t.free(pa(0), 1, FrameUse::Allocated), "below RAM"),
            (t.free(pa(!PAGE_MASK), 2, FrameUse::Allocated), "overflow"),
            (t.free(a, usize::MAX, FrameUse::Allocated), "huge"),
            (t.free(a, 1, FrameUse::Free), "free from free"),
            (
                t.free(pa(0x20000), 3, FrameUse::DeviceTree),
                "partly device tree",
            ),
        ];
        for (res, what) in cases {
            assert!(res.is_err(), "{what}");
        }
        assert_eq!(snapshot(&t), before);
        assert!(matches!(
            t.free(a, 4, FrameUse::Heap),
            Err(FrameError::WrongUse {
                expected: FrameUse::Heap,
                found: FrameUse::Allocated,
                ..
            })
        ));
        assert!(matches!(
            t.free(a + 1, 1, FrameUse::Allocated),
            Err(FrameError::Unaligned { .. })
        ));
        assert!(matches!(
            t.free(pa(0x11000), 1, FrameUse::Allocated),
            Err(FrameError::NotInRam { .. })
        ));
        // Wrong use in the middle of the range: the first pages are untouched too.
        assert!(matches!(
            t.free(pa(0x20000), 3, FrameUse::DeviceTree),
            Err(FrameError::WrongUse {
                addr,
                found: FrameUse::Free,
                ..
            }) if addr == pa(0x22000)
        ));
        assert_eq!(snapshot(&t), before);
        t.check_invariants().unwrap();
    }

    #[test]
    fn check_invariants_catches_corruption() {
        let ram = [r(0, 16 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let t = FrameTable::new(&ram, &mut st).unwrap();
        t.entries[3] = 0x21;
        assert_eq!(
            t.check_invariants(),
            Err(FrameError::CorruptEntry {
                addr: pa(3 * PAGE_SIZE),
                code: 0x21
            })
        );
        assert_eq!(t.use_of(pa(3 * PAGE_SIZE)), None);
        t.entries[3] = FrameUse::Heap as u8;
        assert!(matches!(
            t.check_invariants(),
            Err(FrameError::CounterMismatch { .. })
        ));
        t.entries[3] = FREE;
        t.check_invariants().unwrap();
        // A first-fit hint past a free frame.
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let first = t.alloc_guest(0).unwrap();
        assert_eq!(t.alloc_guest(0), Some(pa(first.raw() + PAGE_SIZE)));
        t.free_guest(0, first).unwrap();
        t.check_invariants().unwrap();
        t.lowest_free += 2;
        assert_eq!(
            t.check_invariants(),
            Err(FrameError::FreeBelowHint { addr: first })
        );
    }

    /// Guest frames are taken lowest first, so frames given back are the
    /// next ones handed out (under QEMU they are already in the host's
    /// memory), whichever way they were freed.
    #[test]
    fn guest_frames_given_back_are_handed_out_first() {
        let ram = [r(0, 64 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let mut out = [PhysAddr::new(0); 40];
        assert_eq!(t.alloc_guest_frames(1, &mut out), 40);
        t.free_guest(1, out[7]).unwrap();
        let run = [out[20], out[21], out[22]];
        assert_eq!(t.free_guest_frames(1, &run, &mut |e| panic!("{e}")), 3);
        assert_eq!(t.alloc_guest(1), Some(out[7]));
        let mut again = [PhysAddr::new(0); 4];
        assert_eq!(t.alloc_guest_frames(2, &mut again), 4);
        assert_eq!(again, [out[20], out[21], out[22], pa(40 * PAGE_SIZE)]);
        t.check_invariants().unwrap();
    }

    /// A frame freed from one VM and handed to another is reported stale
    /// (its lines may still be in an instruction cache) until an
    /// invalidation after that allocation is acknowledged; freeing alone
    /// never asks for one, however many requests it takes.
    #[test]
    fn frames_freed_from_a_guest_are_stale_until_invalidated() {
        let ram = [r(0, 64 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let mut a = [PhysAddr::new(0); 16];
        let got = t.alloc_guest_frames_marked(0, &mut a);
        assert_eq!((got.count, got.stale), (16, None), "fresh RAM held no code");
        // VM 0 gives back 5 pages, one request each: nothing to invalidate
        // yet, the table only remembers.
        for &pa in &a[3..8] {
            assert_eq!(t.free_guest_frames(0, &[pa], &mut |e| panic!("{e}")), 1);
        }
        assert!(t.icache_stale());
        // VM 1 gets them (lowest first): reported, and reported again to a
        // second CPU allocating before the first acknowledged.
        let mut b = [PhysAddr::new(0); 3];
        let first = t.alloc_guest_frames_marked(1, &mut b);
        assert_eq!(first.count, 3);
        assert_eq!(b, [a[3], a[4], a[5]]);
        let stale = first.stale.expect("frames freed from VM 0 are stale");
        let mut c = [PhysAddr::new(0); 2];
        let second = t.alloc_guest_frames_marked(2, &mut c);
        assert_eq!(c, [a[6], a[7]]);
        assert_eq!(second.stale, Some(stale));
        // Acknowledged: the next allocation needs no invalidation.
        t.icache_invalidated(stale);
        assert!(!t.icache_stale());
        let mut d = [PhysAddr::new(0); 4];
        let got = t.alloc_guest_frames_marked(1, &mut d);
        assert_eq!((got.count, got.stale), (4, None));
        // An allocation that hands out nothing reports nothing.
        t.free_guest(1, d[0]).unwrap();
        assert_eq!(t.alloc_guest_frames_marked(1, &mut []).stale, None);
        t.check_invariants().unwrap();
    }

    /// A batch freed between an allocation and its acknowledgement stays
    /// stale: the invalidation may have run before it was freed.
    #[test]
    fn a_free_after_the_report_keeps_the_table_stale() {
        let ram = [r(0, 32 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let mut a = [PhysAddr::new(0); 8];
        assert_eq!(t.alloc_guest_frames(0, &mut a), 8);
        t.free_guest(0, a[0]).unwrap();
        let mut one = [PhysAddr::new(0)];
        let early = t.alloc_guest_frames_marked(1, &mut one).stale.unwrap();
        t.free_guest(0, a[1]).unwrap();
        t.icache_invalidated(early);
        assert!(t.icache_stale(), "a[1] was freed after the report");
        let late = t.alloc_guest_frames_marked(1, &mut one).stale.unwrap();
        assert_eq!(one[0], a[1]);
        assert!(late > early);
        assert_eq!(Some(early).max(Some(late)), Some(late));
        assert_eq!(Some(late).max(None), Some(late));
        // An old acknowledgement arriving last does not undo a newer one.
        t.icache_invalidated(late);
        t.icache_invalidated(early);
        assert!(!t.icache_stale());
    }

    /// Staleness is by time, not per frame: a frame freed from a guest
    /// that passes through a hypervisor use, or is zeroed ahead of time,
    /// is still reported when it reaches a guest.
    #[test]
    fn stale_frames_stay_stale_through_other_uses() {
        let ram = [r(0, 8 * PAGE_SIZE)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let mut a = [PhysAddr::new(0); 8];
        assert_eq!(t.alloc_guest_frames(0, &mut a), 8);
        assert_eq!(t.free_guest_frames(0, &a[..2], &mut |e| panic!("{e}")), 2);
        // A stage-2 table takes a[0] and gives it back; a[1] is zeroed
        // while a CPU idles.
        let table = t.alloc(1, 1, FrameUse::PageTables).unwrap();
        assert_eq!(table, a[0]);
        t.free(table, 1, FrameUse::PageTables).unwrap();
        let mut claim = [PhysAddr::new(0); 2];
        assert_eq!(t.claim_to_zero(&mut claim, 2), 2);
        t.finish_zeroing(&claim).unwrap();
        let mut b = [PhysAddr::new(0); 2];
        let got = t.alloc_guest_frames_marked(1, &mut b);
        assert_eq!(got.count, 2);
        assert!(got.stale.is_some());
        t.check_invariants().unwrap();
    }

    use crate::test_rng::XorShift;

    #[test]
    fn randomized_operations_keep_invariants() {
        let ram = [
            r(0x4000_0200, 0x4004_0000),
            r(0x4004_0000, 0x4008_0000),
            r(0x8000_0000, 0x8001_0800),
        ];
        let total = ram_size(&ram);
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let uses = [
            FrameUse::Allocated,
            FrameUse::Heap,
            FrameUse::PageTables,
            FrameUse::GuestBundle,
        ];
        // What we believe we own: (addr, pages, use).
        let mut owned: Vec<(PhysAddr, usize, FrameUse)> = Vec::new();
        let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
        for step in 0..20_000 {
            match rng.below(10) {
                0..=4 => {
                    let pages = [1, 1, 1, 2, 3, 8, 17, 64][rng.below(8) as usize];
                    let align = [1, 1, 2, 4, 16, 512][rng.below(6) as usize];
                    let u = uses[rng.below(4) as usize];
                    let free_before = t.free_pages();
                    if let Some(a) = t.alloc(pages, align, u) {
                        assert_eq!(a.raw() % (align as u64 * PAGE_SIZE), 0);
                        assert_eq!(t.free_pages(), free_before - pages as u64);
                        for i in 0..pages as u64 {
                            assert_eq!(t.use_of(a + i * PAGE_SIZE), Some(u));
                        }
                        owned.push((a, pages, u));
                    } else {
                        assert_eq!(t.free_pages(), free_before);
                    }
                }
                5..=7 if !owned.is_empty() => {
                    let i = rng.below(owned.len() as u64) as usize;
                    let (a, p, u) = owned.swap_remove(i);
                    // A mismatched free first: must fail and change nothing.
                    let before = snapshot(&t);
                    let wrong = uses[(uses.iter().position(|&x| x == u).unwrap() + 1) % 4];
                    assert!(t.free(a, p, wrong).is_err());
                    assert_eq!(snapshot(&t), before);
                    t.free(a, p, u).unwrap();
                }
                8 => {
                    let start = 0x4000_0000 + rng.below(0x8000_0000);
                    let len = rng.below(0x4_0000);
                    let changed = t
                        .mark(r(start, start + len), FrameUse::FirmwareReserved)
                        .unwrap();
                    assert!(changed <= len / PAGE_SIZE + 2);
                }
                _ => {
                    let addr = 0x4000_0000 + rng.below(0x4_1000_0000);
                    let _ = t.use_of(pa(addr));
                }
            }
            assert_eq!(t.accounting().total(), total);
            if step % 97 == 0 {
                t.check_invariants().unwrap();
            }
        }
        t.check_invariants().unwrap();
        // Owned runs are disjoint and still labelled as we think.
        for &(a, p, u) in &owned {
            for i in 0..p as u64 {
                assert_eq!(t.use_of(a + i * PAGE_SIZE), Some(u));
            }
        }
        for (a, p, u) in owned.drain(..) {
            t.free(a, p, u).unwrap();
        }
        let reserved = t.pages(FrameUse::FirmwareReserved);
        assert_eq!(t.free_pages() + reserved, t.total_pages());
    }

    #[test]
    fn single_page_allocations_are_next_fit() {
        // 64 MiB of pages allocated one by one: each search starts at the cursor.
        let ram = [r(0, 64 * MIB)];
        let mut st = storage(&ram);
        let mut t = FrameTable::new(&ram, &mut st).unwrap();
        let n = (64 * MIB / PAGE_SIZE) as usize;
        for i in 0..n {
            assert_eq!(
                t.alloc(1, 1, FrameUse::Allocated),
                Some(pa(i as u64 * PAGE_SIZE))
            );
        }
        assert_eq!(t.alloc(1, 1, FrameUse::Allocated), None);
        t.check_invariants().unwrap();
    }

    /// The batched guest calls against their one-frame forms on a twin
    /// table: the same frames, the same refusals, the same counters, with
    /// guarantees, the floor, several banks and frames of other owners.
    #[test]
    fn batched_guest_frames_match_one_at_a_time() {
        let ram = [
            r(0x4000_0000, 0x4002_0000),
            r(0x4004_0000, 0x4004_8000),
            r(0x8000_0000, 0x8002_0000),
        ];
        let (mut sa, mut sb) = (storage(&ram), storage(&ram));
        let mut batched = FrameTable::new(&ram, &mut sa).unwrap();
        let mut single = FrameTable::new(&ram, &mut sb).unwrap();
        for t in [&mut batched, &mut single] {
            t.mark(r(0x4000_8000, 0x4001_0000), FrameUse::Heap).unwrap();
            t.set_guest_floor(9);
            t.guarantee(1, 20).unwrap();
        }
        let mut owned: Vec<Vec<PhysAddr>> = vec![Vec::new(); 3];
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for _ in 0..3_000 {
            let vm = rng.below(3) as usize;
            if rng.below(2) == 0 {
                let mut out = [PhysAddr::new(0); 40];
                let want = rng.below(41) as usize;
                let n = batched.alloc_guest_frames(vm, &mut out[..want]);
                let expected: Vec<PhysAddr> =
                    (0..want).map_while(|_| single.alloc_guest(vm)).collect();
                assert_eq!(&out[..n], &expected[..]);
                owned[vm].extend_from_slice(&out[..n]);
            } else {
                // Some of this VM's frames, with a stranger's, a free one
                // and a misaligned one mixed in.
                let mut frames = Vec::new();
                for _ in 0..rng.below(30) {
                    if owned[vm].is_empty() {
                        break;
                    }
                    let i = rng.below(owned[vm].len() as u64) as usize;
                    frames.push(owned[vm].swap_remove(i));
                }
                let other = (vm + 1) % 3;
                if rng.below(2) == 0 {
                    // In address order: runs of consecutive frames.
                    frames.sort();
                }
                frames.extend(owned[other].first().copied());
                frames.push(pa(0x4004_8000 + PAGE_SIZE)); // outside RAM
                frames.push(pa(0x4000_0010));
                frames.push(pa(0x4000_8000)); // heap
                let (mut errors_a, mut errors_b) = (Vec::new(), Vec::new());
                let freed = batched.free_guest_frames(vm, &frames, &mut |e| errors_a.push(e));
                let mut freed_b = 0;
                for &f in &frames {
                    match single.free_guest(vm, f) {
                        Ok(()) => freed_b += 1,
                        Err(e) => errors_b.push(e),
                    }
                }
                assert_eq!((freed, errors_a.len()), (freed_b, errors_b.len()));
                assert_eq!(errors_a, errors_b);
            }
            assert_eq!(snapshot(&batched), snapshot(&single));
            assert_eq!(batched.reserved(), single.reserved());
            batched.check_invariants().unwrap();
        }
        assert_eq!(
            batched.alloc_guest_frames(MAX_VMS, &mut [PhysAddr::new(0); 4]),
            0
        );
    }
}
