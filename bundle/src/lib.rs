//! The Tidal guest bundle: one blob, passed to the hypervisor as the initrd,
//! that carries every guest's kernel, optional initrd and command line and the
//! VM configuration.
//!
//! The byte layout, the versioning rule and how the hypervisor finds the blob
//! are documented in `docs/BUNDLE.md`; the constants in [`header`] and
//! [`entry`] are that layout. In short (all integers little-endian):
//!
//! ```text
//! 0                 header (HEADER_SIZE = 64 bytes, or HEADER_SIZE_POOL = 96
//!                   with the pool watermarks; the writer always writes 96)
//! vm_table_offset   vm_count entries of vm_entry_size (192) bytes each
//! 4 KiB aligned     blobs (kernels, initrds, command lines), each 4 KiB aligned
//! total_size        end; CRC-32 covers [header_size, total_size)
//! ```
//!
//! The reader, [`parse`], is `no_std` and allocation-free (the hypervisor runs
//! it before it has a heap), validates everything before handing anything out,
//! and never panics: any byte string gives either a [`Bundle`] whose every
//! accessor is in bounds, or a [`BundleError`] whose `Display` names the VM
//! and the field at fault. [`parse`] (alias [`parse_untrusted`]) is the fuzz
//! entry point.
//!
//! The writer, [`BundleBuilder`], needs the `std` feature (the host build tool
//! uses it) and only produces bundles that [`parse`] accepts.
#![cfg_attr(not(any(test, feature = "std")), no_std)]
#![forbid(unsafe_code)]

use core::fmt;

mod crc;
pub use crc::{crc32, Crc32};

#[cfg(any(test, feature = "std"))]
mod writer;
#[cfg(any(test, feature = "std"))]
pub use writer::{BundleBuilder, PoolSpec, VmMemory, VmSpec};

#[cfg(test)]
mod tests;

/// The first eight bytes of every bundle.
pub const MAGIC: [u8; 8] = *b"TIDALBND";
/// The format version this crate reads and writes. Readers reject any other
/// version: a newer one may change the meaning of fields this reader knows.
pub const VERSION: u32 = 1;
/// Size of the version 1 header without extensions (the minimum). A bundle
/// may declare a larger `header_size` (a compatible extension): bytes past
/// [`HEADER_SIZE_POOL`] are ignored by this reader.
pub const HEADER_SIZE: usize = 64;
/// A `header_size` of at least this means the header carries the free page
/// pool extension ([`header::POOL_MIN`] to [`header::POOL_RESERVED`]).
pub const HEADER_SIZE_POOL: usize = 96;
/// Size of a version 1 VM entry. A bundle may declare a larger
/// `vm_entry_size`: the extra bytes of each entry are ignored by this reader.
pub const VM_ENTRY_SIZE: usize = 192;
/// Every blob starts at a multiple of this offset from the start of the
/// bundle, and the writer pads the bundle to a multiple of it.
pub const BLOB_ALIGN: u64 = 4096;
/// Guest RAM sizes are a multiple of this.
pub const RAM_ALIGN: u64 = 4096;
/// Bytes of the NUL-padded name field.
pub const NAME_LEN: usize = 32;
/// Most VMs a bundle may describe.
pub const MAX_VMS: usize = 256;
/// Bits of the header's `flags`.
pub mod flags {
    /// Once its VMs have started, the hypervisor runs its on-target
    /// self-checks and prints one `ON-TARGET:` line per check and a summary.
    pub const ON_TARGET_TESTS: u32 = 1 << 0;
}
/// Header flags defined so far ([`flags`]): any other bit is rejected.
pub const KNOWN_FLAGS: u32 = flags::ON_TARGET_TESTS;
/// Memory limits (entry `mem_min`, `mem_low`, `mem_max`) and pool
/// watermarks are multiples of this.
pub const MEM_ALIGN: u64 = 4096;
/// [`VmEntry::weight`] when the entry says 0.
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest memory weight.
pub const MAX_WEIGHT: u32 = 10_000;

/// Codes of [`VmEntry::on_bad_access`]: what a VM gets for an access the
/// hypervisor refuses (a malformed device access, an address that is
/// neither RAM nor a device, an unemulated system register).
pub mod bad_access {
    /// An exception injected into the guest, as hardware raises it (the
    /// default, and what every bundle written before the field existed says).
    pub const ABORT: u32 = 0;
    /// The whole VM is stopped.
    pub const STOP: u32 = 1;
    /// Every code defined so far; any other is rejected.
    pub const LAST: u32 = STOP;
}

/// Bits of [`VmEntry::devices`].
pub mod devices {
    /// A virtio-mmio memory balloon.
    pub const BALLOON: u64 = 1 << 0;
    /// A virtio-mmio console (one port) beside the PL011.
    pub const CONSOLE: u64 = 1 << 1;
    /// Every bit defined so far; any other bit is rejected.
    pub const KNOWN: u64 = BALLOON | CONSOLE;
}

/// Bits of a VM entry's `mem_flags`.
pub mod mem_flags {
    /// All of the VM's RAM is backed when it starts and never reclaimed.
    pub const PREALLOC: u32 = 1 << 0;
    /// Every bit defined so far; any other bit is rejected.
    pub const KNOWN: u32 = PREALLOC;
}

/// Bits of the header's `pool_flags` (pool extension).
pub mod pool_flags {
    /// When a vCPU has waited the bound for a frame, stop the lowest-weight
    /// VM. Written by older tools; it is also what a bundle without
    /// [`WAIT`] does.
    pub const STOP_LOWEST: u32 = 1 << 0;
    /// A vCPU waits for a frame without bound (`when_exhausted = "wait"`);
    /// it wins over [`STOP_LOWEST`].
    pub const WAIT: u32 = 1 << 1;
    /// Every bit defined so far; any other bit is rejected.
    pub const KNOWN: u32 = STOP_LOWEST | WAIT;
}

/// Bits of the header's `board_flags` byte.
pub mod board_flags {
    /// The board has a network address (`[board] address`): the header's
    /// `board_address` and `board_prefix` hold it.
    pub const ADDRESS: u8 = 1 << 0;
    /// Every bit defined so far; any other bit is rejected.
    pub const KNOWN: u8 = ADDRESS;
}

/// The board's IPv4 address and prefix length (`[board] address =
/// "10.0.0.2/24"`), checked: a dotted quad, a prefix of 1 to 32, neither
/// the network's nor its broadcast address (below /31), not in 0.0.0.0/8,
/// 127.0.0.0/8 (loopback) or 224.0.0.0 and up (multicast, reserved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BoardAddress {
    octets: [u8; 4],
    prefix: u8,
}

impl BoardAddress {
    /// The address `octets`/`prefix`, or why it cannot be a board's.
    pub fn new(octets: [u8; 4], prefix: u8) -> Result<BoardAddress, &'static str> {
        if !(1..=32).contains(&prefix) {
            return Err("the prefix length is 1 to 32");
        }
        match octets[0] {
            0 => return Err("0.0.0.0/8 is not an address a board can have"),
            127 => return Err("127.0.0.0/8 is the loopback network"),
            224.. => return Err("224.0.0.0 and up are multicast or reserved"),
            _ => {}
        }
        if prefix <= 30 {
            let host_mask = u32::MAX >> prefix;
            let host = u32::from_be_bytes(octets) & host_mask;
            if host == 0 {
                return Err("that is the network's own address (its host part is all zeros)");
            }
            if host == host_mask {
                return Err("that is the network's broadcast address (its host part is all ones)");
            }
        }
        Ok(BoardAddress { octets, prefix })
    }

    /// `"a.b.c.d/n"`, checked as [`BoardAddress::new`] does.
    pub fn parse(text: &str) -> Result<BoardAddress, &'static str> {
        const FORM: &str = "write a dotted quad and a prefix length, e.g. \"10.0.0.2/24\"";
        let (quad, prefix) = text.split_once('/').ok_or(FORM)?;
        let mut octets = [0u8; 4];
        let mut parts = quad.split('.');
        for octet in &mut octets {
            *octet = parts.next().and_then(decimal_u8).ok_or(FORM)?;
        }
        if parts.next().is_some() {
            return Err(FORM);
        }
        BoardAddress::new(octets, decimal_u8(prefix).ok_or(FORM)?)
    }

    pub fn octets(&self) -> [u8; 4] {
        self.octets
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

/// 0 to 255 in plain decimal (no sign, no leading zeros but "0").
fn decimal_u8(text: &str) -> Option<u8> {
    let ok = !text.is_empty()
        && text.len() <= 3
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if !ok {
        return None;
    }
    text.parse().ok()
}

impl fmt::Display for BoardAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d] = self.octets;
        write!(f, "{a}.{b}.{c}.{d}/{}", self.prefix)
    }
}

/// Byte offsets of the header fields.
pub mod header {
    /// `[u8; 8]`, [`MAGIC`](crate::MAGIC).
    pub const MAGIC: usize = 0;
    /// `u32`, [`VERSION`](crate::VERSION).
    pub const VERSION: usize = 8;
    /// `u32`, at least [`HEADER_SIZE`](crate::HEADER_SIZE), multiple of 8;
    /// at least [`HEADER_SIZE_POOL`](crate::HEADER_SIZE_POOL) when the pool
    /// extension is present.
    pub const HEADER_SIZE: usize = 12;
    /// `u64`, bytes of the whole bundle.
    pub const TOTAL_SIZE: usize = 16;
    /// `u32`, number of VM entries.
    pub const VM_COUNT: usize = 24;
    /// `u32`, at least [`VM_ENTRY_SIZE`](crate::VM_ENTRY_SIZE), multiple of 8.
    pub const VM_ENTRY_SIZE: usize = 28;
    /// `u64`, offset of the VM table from the start of the bundle.
    pub const VM_TABLE_OFFSET: usize = 32;
    /// `u64`, `vm_count * vm_entry_size`.
    pub const VM_TABLE_SIZE: usize = 40;
    /// `u32`, CRC-32 (IEEE) of bytes `[header_size, total_size)`.
    pub const CRC32: usize = 48;
    /// `u32`, [`flags`](crate::flags) bits; any other bit must be zero.
    pub const FLAGS: usize = 52;
    /// `[u8; 8]`: the board's network address (below), else zero. Bundles
    /// written before it have zero here ("no address").
    pub const RESERVED: usize = 56;
    /// `u32`, the board's IPv4 address (`10.0.0.2` is `0x0a00_0002`),
    /// read only when [`board_flags::ADDRESS`](crate::board_flags::ADDRESS)
    /// is set; zero otherwise.
    pub const BOARD_ADDRESS: usize = 56;
    /// `u8`, the address's prefix length (1 to 32); zero without an address.
    pub const BOARD_PREFIX: usize = 60;
    /// `u8`, [`board_flags`](crate::board_flags) bits.
    pub const BOARD_FLAGS: usize = 61;
    /// `[u8; 2]`, reserved, must be zero.
    pub const BOARD_RESERVED: usize = 62;
    // The pool extension, read only when `header_size` is at least
    // [`HEADER_SIZE_POOL`](crate::HEADER_SIZE_POOL).
    /// `u64` bytes each, the free page pool's watermarks: multiples of 4 KiB,
    /// either all zero (the hypervisor derives them from RAM) or all
    /// non-zero with `min <= low <= high`.
    pub const POOL_MIN: usize = 64;
    pub const POOL_LOW: usize = 72;
    pub const POOL_HIGH: usize = 80;
    /// `u32`, [`pool_flags`](crate::pool_flags) bits.
    pub const POOL_FLAGS: usize = 88;
    /// `[u8; 4]`, reserved, must be zero.
    pub const POOL_RESERVED: usize = 92;
}

/// Byte offsets of the fields of a VM entry.
pub mod entry {
    /// `[u8; 32]`, ASCII `[a-z0-9_-]`, NUL-padded.
    pub const NAME: usize = 0;
    /// `u64`, bytes of guest RAM, non-zero multiple of 4 KiB.
    pub const RAM_SIZE: usize = 32;
    /// `u32`, at least 1.
    pub const VCPUS: usize = 40;
    /// `u32`, [`bad_access`](crate::bad_access) code (0, abort, in bundles
    /// written before the field existed, where it was reserved).
    pub const ON_BAD_ACCESS: usize = 44;
    /// `u64`, physical CPUs (by index) the vCPUs may run on; non-zero.
    pub const CPU_AFFINITY: usize = 48;
    /// `u64` offset and `u64` size of the kernel image (size non-zero).
    pub const KERNEL_OFFSET: usize = 56;
    pub const KERNEL_SIZE: usize = 64;
    /// `u64` offset and `u64` size of the initrd (size 0 and offset 0: none).
    pub const INITRD_OFFSET: usize = 72;
    pub const INITRD_SIZE: usize = 80;
    /// `u64` offset and `u64` size of the command line, UTF-8 without NUL and
    /// without terminator (size 0 and offset 0: none).
    pub const CMDLINE_OFFSET: usize = 88;
    pub const CMDLINE_SIZE: usize = 96;
    /// `u64`, virtio balloon feature bits the device offers.
    pub const BALLOON_FEATURES: usize = 104;
    /// `u64`, [`devices`](crate::devices) bits.
    pub const DEVICES: usize = 112;
    /// `u64`, bytes never reclaimed, multiple of 4 KiB (0: none).
    pub const MEM_MIN: usize = 120;
    /// `u64`, bytes reclaimed below only when no VM is above its own low,
    /// multiple of 4 KiB, at least `mem_min` (0: same as `mem_min`).
    pub const MEM_LOW: usize = 128;
    /// `u64`, bytes never backed above, multiple of 4 KiB, at most
    /// `ram_size` and at least the effective min and low (0: `ram_size`).
    pub const MEM_MAX: usize = 136;
    /// `u32`, reclaim weight, at most 10000 (0: the default, 100).
    pub const MEM_WEIGHT: usize = 144;
    /// `u32`, [`mem_flags`](crate::mem_flags) bits.
    pub const MEM_FLAGS: usize = 148;
    /// `[u8; 32]`, the snapshot the VM starts from instead of booting:
    /// printable ASCII without spaces, NUL-padded (all NUL: it boots).
    pub const RESTORE: usize = 152;
    /// `[u8; 8]`, reserved, must be zero.
    pub const RESERVED: usize = 184;
}

/// The fuzz entry point: the same as [`parse`], named so that a fuzz target
/// (and a reader of the code) sees that arbitrary bytes are expected.
pub fn parse_untrusted(bytes: &[u8]) -> Result<Bundle<'_>, BundleError> {
    parse(bytes)
}

// ---------------------------------------------------------------------------
// Little-endian field access that cannot panic.

fn read_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = off.checked_add(4).and_then(|end| b.get(off..end)) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

fn read_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = off.checked_add(8).and_then(|end| b.get(off..end)) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

// ---------------------------------------------------------------------------
// Errors.

/// A VM name as stored in the bundle, kept in errors so that messages can say
/// which VM is at fault without borrowing the bundle.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct VmName {
    bytes: [u8; NAME_LEN],
    len: u8,
}

impl VmName {
    /// The name, if `raw` holds a valid one.
    fn from_raw(raw: &[u8; NAME_LEN]) -> Option<Self> {
        let len = name_len(raw).ok()?;
        Some(Self {
            bytes: *raw,
            len: len as u8,
        })
    }

    pub fn as_str(&self) -> &str {
        let b = self.bytes.get(..self.len as usize).unwrap_or(&[]);
        core::str::from_utf8(b).unwrap_or("")
    }
}

impl fmt::Debug for VmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for VmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which blob of a VM entry an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blob {
    Kernel,
    Initrd,
    Cmdline,
}

impl Blob {
    pub const fn label(self) -> &'static str {
        match self {
            Blob::Kernel => "kernel",
            Blob::Initrd => "initrd",
            Blob::Cmdline => "command line",
        }
    }
}

/// Which memory limit of a VM entry an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemField {
    Min,
    Low,
    Max,
}

impl MemField {
    pub const fn label(self) -> &'static str {
        match self {
            MemField::Min => "memory min",
            MemField::Low => "memory low",
            MemField::Max => "memory max",
        }
    }
}

/// Which pool watermark an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolField {
    Min,
    Low,
    High,
}

impl PoolField {
    pub const fn label(self) -> &'static str {
        match self {
            PoolField::Min => "pool min",
            PoolField::Low => "pool low",
            PoolField::High => "pool high",
        }
    }
}

/// Why a name is not valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameProblem {
    Empty,
    /// Byte at this index is not `[a-z0-9_-]`.
    BadChar(usize),
    /// A non-NUL byte follows the NUL padding at this index.
    GarbageAfterNul(usize),
    /// Longer than [`NAME_LEN`] (writer only).
    TooLong(usize),
}

/// What is wrong with one VM entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmError {
    BadName {
        raw: [u8; NAME_LEN],
        problem: NameProblem,
    },
    /// Same name as the entry at index `first`.
    DuplicateName {
        first: usize,
    },
    /// A reserved field (at this byte offset within the entry) is not zero.
    ReservedNonZero {
        offset: usize,
    },
    ZeroRam,
    RamNotAligned {
        ram_size: u64,
    },
    ZeroVcpus,
    ZeroAffinity,
    /// An `on_bad_access` code this reader does not know.
    UnknownBadAccessPolicy {
        code: u32,
    },
    UnknownDevices {
        bits: u64,
    },
    BalloonFeaturesWithoutBalloon {
        features: u64,
    },
    EmptyKernel,
    /// The snapshot name to restore from is not printable ASCII without
    /// spaces, NUL-padded.
    BadRestore,
    /// Size 0 (no blob) but a non-zero offset.
    OffsetWithoutBlob {
        blob: Blob,
        offset: u64,
    },
    BlobMisaligned {
        blob: Blob,
        offset: u64,
    },
    /// The blob starts before the end of the VM table.
    BlobOverlapsTable {
        blob: Blob,
        offset: u64,
        table_end: u64,
    },
    BlobOutOfBounds {
        blob: Blob,
        offset: u64,
        size: u64,
        bundle_size: u64,
    },
    CmdlineNotUtf8 {
        valid_up_to: usize,
    },
    CmdlineHasNul {
        at: usize,
    },
    /// Kernel plus initrd do not fit in the VM's RAM.
    BlobsExceedRam {
        kernel: u64,
        initrd: u64,
        ram_size: u64,
    },
    UnknownMemFlags {
        flags: u32,
    },
    MemWeightOutOfRange {
        weight: u32,
    },
    /// A memory limit is not a multiple of [`MEM_ALIGN`].
    MemNotAligned {
        field: MemField,
        value: u64,
    },
    MemMaxAboveRam {
        max: u64,
        ram_size: u64,
    },
    /// `mem_low` is non-zero and below `mem_min`.
    MemMinAboveLow {
        min: u64,
        low: u64,
    },
    /// `field` (min or low, effective value `value`) is above the effective
    /// max (`max`; the RAM size when `mem_max` is 0).
    MemAboveMax {
        field: MemField,
        value: u64,
        max: u64,
    },
}

/// Why a bundle was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BundleError {
    /// Fewer bytes than a header.
    TooShort {
        len: usize,
    },
    BadMagic {
        found: [u8; 8],
    },
    /// Version 0 or newer than [`VERSION`].
    UnsupportedVersion {
        found: u32,
        supported: u32,
    },
    BadHeaderSize {
        header_size: u32,
    },
    UnknownFlags {
        flags: u32,
    },
    /// A reserved header byte (at this offset) is not zero.
    HeaderReservedNonZero {
        offset: usize,
    },
    /// The header's `board_flags` has bits this reader does not know.
    UnknownBoardFlags {
        flags: u8,
    },
    /// The board's address is not one a board can have.
    BadBoardAddress {
        octets: [u8; 4],
        prefix: u8,
        why: &'static str,
    },
    /// `total_size` is smaller than the header.
    TotalSizeTooSmall {
        total_size: u64,
        header_size: u32,
    },
    /// `total_size` is larger than the bytes available.
    Truncated {
        total_size: u64,
        available: usize,
    },
    BadEntrySize {
        entry_size: u32,
    },
    TooManyVms {
        count: u32,
    },
    VmTableMisaligned {
        offset: u64,
    },
    VmTableOverlapsHeader {
        offset: u64,
        header_size: u32,
    },
    VmTableSizeMismatch {
        size: u64,
        count: u32,
        entry_size: u32,
    },
    VmTableOutOfBounds {
        offset: u64,
        size: u64,
        total_size: u64,
    },
    CrcMismatch {
        stored: u32,
        computed: u32,
    },
    UnknownPoolFlags {
        flags: u32,
    },
    PoolNotAligned {
        field: PoolField,
        value: u64,
    },
    /// Some pool watermarks are zero (default) and others are not.
    PoolPartlyZero {
        min: u64,
        low: u64,
        high: u64,
    },
    /// Not `min <= low <= high`.
    PoolOutOfOrder {
        min: u64,
        low: u64,
        high: u64,
    },
    /// VM entry `index` is invalid; `name` is its name when that is readable.
    Vm {
        index: usize,
        name: Option<VmName>,
        error: VmError,
    },
}

struct HexBytes<'a>(&'a [u8]);

impl fmt::Display for HexBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            VmError::BadName { raw, problem } => {
                let shown = match problem {
                    NameProblem::TooLong(_) => &raw[..],
                    _ => &raw[..name_shown_len(&raw)],
                };
                write!(f, "name \"{}\" is invalid: ", shown.escape_ascii())?;
                match problem {
                    NameProblem::Empty => f.write_str("empty"),
                    NameProblem::BadChar(i) => write!(
                        f,
                        "byte {i} ({:#04x}) is not one of [a-z0-9_-]",
                        raw.get(i).copied().unwrap_or(0)
                    ),
                    NameProblem::GarbageAfterNul(i) => {
                        write!(f, "non-NUL byte at {i} after the NUL padding")
                    }
                    NameProblem::TooLong(n) => {
                        write!(f, "{n} bytes long, the most is {NAME_LEN}")
                    }
                }
            }
            VmError::DuplicateName { first } => {
                write!(f, "name is already used by VM {first}")
            }
            VmError::ReservedNonZero { offset } => write!(
                f,
                "reserved field at entry offset {offset:#x} is not zero \
                 (written by a newer tool?)"
            ),
            VmError::ZeroRam => f.write_str("RAM size is zero"),
            VmError::RamNotAligned { ram_size } => write!(
                f,
                "RAM size {ram_size:#x} is not a multiple of {RAM_ALIGN:#x} bytes"
            ),
            VmError::ZeroVcpus => f.write_str("vCPU count is zero"),
            VmError::ZeroAffinity => f.write_str("CPU affinity mask is empty"),
            VmError::UnknownBadAccessPolicy { code } => write!(
                f,
                "on_bad_access code {code} is unknown (0 abort, 1 stop; written by a newer tool?)"
            ),
            VmError::UnknownDevices { bits } => {
                write!(f, "device flags {bits:#x} include unknown bits {:#x}", bits & !devices::KNOWN)
            }
            VmError::BalloonFeaturesWithoutBalloon { features } => write!(
                f,
                "balloon features {features:#x} offered but the balloon device is not enabled"
            ),
            VmError::EmptyKernel => f.write_str("kernel blob is empty"),
            VmError::BadRestore => f.write_str(
                "the snapshot to restore from is not a name of printable ASCII without spaces, NUL-padded",
            ),
            VmError::OffsetWithoutBlob { blob, offset } => write!(
                f,
                "{} blob has size 0 (none) but offset {offset:#x} (must be 0)",
                blob.label()
            ),
            VmError::BlobMisaligned { blob, offset } => write!(
                f,
                "{} blob at offset {offset:#x} is not {BLOB_ALIGN:#x}-byte aligned",
                blob.label()
            ),
            VmError::BlobOverlapsTable { blob, offset, table_end } => write!(
                f,
                "{} blob at offset {offset:#x} starts before the end of the VM table ({table_end:#x})",
                blob.label()
            ),
            VmError::BlobOutOfBounds { blob, offset, size, bundle_size } => write!(
                f,
                "{} blob at offset {offset:#x} size {size:#x} runs past the end of the bundle \
                 ({bundle_size:#x} bytes)",
                blob.label()
            ),
            VmError::CmdlineNotUtf8 { valid_up_to } => write!(
                f,
                "command line is not UTF-8 (invalid byte at {valid_up_to})"
            ),
            VmError::CmdlineHasNul { at } => {
                write!(f, "command line contains a NUL byte at {at}")
            }
            VmError::BlobsExceedRam { kernel, initrd, ram_size } => write!(
                f,
                "kernel ({kernel:#x} bytes) and initrd ({initrd:#x} bytes) do not fit in RAM \
                 ({ram_size:#x} bytes)"
            ),
            VmError::UnknownMemFlags { flags } => write!(
                f,
                "memory flags {flags:#x} include unknown bits {:#x} (written by a newer tool?)",
                flags & !mem_flags::KNOWN
            ),
            VmError::MemWeightOutOfRange { weight } => write!(
                f,
                "memory weight {weight} is out of range (1 to {MAX_WEIGHT}, or 0 for the default \
                 {DEFAULT_WEIGHT})"
            ),
            VmError::MemNotAligned { field, value } => write!(
                f,
                "{} {value:#x} is not a multiple of {MEM_ALIGN:#x} bytes",
                field.label()
            ),
            VmError::MemMaxAboveRam { max, ram_size } => write!(
                f,
                "memory max {max:#x} is more than the RAM size ({ram_size:#x} bytes)"
            ),
            VmError::MemMinAboveLow { min, low } => {
                write!(f, "memory min {min:#x} is more than memory low {low:#x}")
            }
            VmError::MemAboveMax { field, value, max } => write!(
                f,
                "{} {value:#x} is more than memory max {max:#x}",
                field.label()
            ),
        }
    }
}

impl fmt::Display for BundleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BundleError::TooShort { len } => write!(
                f,
                "bundle is {len} bytes, shorter than its {HEADER_SIZE}-byte header"
            ),
            BundleError::BadMagic { found } => write!(
                f,
                "bad magic: expected \"TIDALBND\", found {} (\"{}\")",
                HexBytes(&found),
                found.escape_ascii()
            ),
            BundleError::UnsupportedVersion { found, supported } => {
                if found > supported {
                    write!(
                        f,
                        "bundle format version {found} is newer than this hypervisor supports \
                         (version {supported}); rebuild the bundle with a matching tool or update \
                         the hypervisor"
                    )
                } else {
                    write!(
                        f,
                        "bundle format version {found} is not valid (this hypervisor supports \
                         version {supported})"
                    )
                }
            }
            BundleError::BadHeaderSize { header_size } => write!(
                f,
                "header size {header_size} is invalid (at least {HEADER_SIZE}, multiple of 8)"
            ),
            BundleError::UnknownFlags { flags } => write!(
                f,
                "header flags {flags:#x} include unknown bits {:#x}",
                flags & !KNOWN_FLAGS
            ),
            BundleError::HeaderReservedNonZero { offset } => {
                write!(f, "reserved header byte at offset {offset:#x} is not zero")
            }
            BundleError::TotalSizeTooSmall {
                total_size,
                header_size,
            } => write!(
                f,
                "total size {total_size:#x} is smaller than the header ({header_size:#x} bytes)"
            ),
            BundleError::Truncated {
                total_size,
                available,
            } => write!(
                f,
                "bundle is truncated: header says {total_size:#x} bytes, only {available:#x} \
                 available"
            ),
            BundleError::BadEntrySize { entry_size } => write!(
                f,
                "VM entry size {entry_size} is invalid (at least {VM_ENTRY_SIZE}, multiple of 8)"
            ),
            BundleError::TooManyVms { count } => {
                write!(f, "{count} VMs, the most a bundle may hold is {MAX_VMS}")
            }
            BundleError::VmTableMisaligned { offset } => {
                write!(f, "VM table offset {offset:#x} is not 8-byte aligned")
            }
            BundleError::VmTableOverlapsHeader {
                offset,
                header_size,
            } => write!(
                f,
                "VM table offset {offset:#x} is inside the header ({header_size:#x} bytes)"
            ),
            BundleError::VmTableSizeMismatch {
                size,
                count,
                entry_size,
            } => write!(
                f,
                "VM table size {size:#x} is not {count} entries of {entry_size} bytes"
            ),
            BundleError::VmTableOutOfBounds {
                offset,
                size,
                total_size,
            } => write!(
                f,
                "VM table at offset {offset:#x} size {size:#x} runs past the end of the bundle \
                 ({total_size:#x} bytes)"
            ),
            BundleError::CrcMismatch { stored, computed } => write!(
                f,
                "CRC mismatch: header says {stored:#010x}, contents give {computed:#010x} \
                 (corrupted or truncated bundle)"
            ),
            BundleError::UnknownBoardFlags { flags } => write!(
                f,
                "board flags {flags:#x} include unknown bits {:#x} (written by a newer tool?)",
                flags & !board_flags::KNOWN
            ),
            BundleError::BadBoardAddress {
                octets,
                prefix,
                why,
            } => {
                let [a, b, c, d] = octets;
                write!(f, "board address {a}.{b}.{c}.{d}/{prefix}: {why}")
            }
            BundleError::UnknownPoolFlags { flags } => write!(
                f,
                "pool flags {flags:#x} include unknown bits {:#x} (written by a newer tool?)",
                flags & !pool_flags::KNOWN
            ),
            BundleError::PoolNotAligned { field, value } => write!(
                f,
                "{} {value:#x} is not a multiple of {MEM_ALIGN:#x} bytes",
                field.label()
            ),
            BundleError::PoolPartlyZero { min, low, high } => write!(
                f,
                "pool watermarks min {min:#x}, low {low:#x}, high {high:#x}: either all are 0 \
                 (the default) or none"
            ),
            BundleError::PoolOutOfOrder { min, low, high } => write!(
                f,
                "pool watermarks min {min:#x}, low {low:#x}, high {high:#x} are not in order \
                 (min <= low <= high)"
            ),
            BundleError::Vm { index, name, error } => {
                match name {
                    Some(n) => write!(f, "VM {index} (\"{n}\"): ")?,
                    None => write!(f, "VM {index}: ")?,
                }
                fmt::Display::fmt(&error, f)
            }
        }
    }
}

impl core::error::Error for BundleError {}
impl core::error::Error for VmError {}

// ---------------------------------------------------------------------------
// Checks shared by the reader and the writer.

/// The board's address from header bytes 56 to 64 (`hdr` is at least
/// [`HEADER_SIZE`] long): `None` when the flag is clear, and then the
/// other bytes must be zero, as in bundles written before the field.
fn read_board_address(hdr: &[u8]) -> Result<Option<BoardAddress>, BundleError> {
    let flags = hdr.get(header::BOARD_FLAGS).copied().unwrap_or(0);
    if flags & !board_flags::KNOWN != 0 {
        return Err(BundleError::UnknownBoardFlags { flags });
    }
    let must_be_zero = if flags & board_flags::ADDRESS == 0 {
        header::RESERVED..header::BOARD_FLAGS
    } else {
        header::BOARD_RESERVED..header::BOARD_RESERVED
    };
    for range in [must_be_zero, header::BOARD_RESERVED..HEADER_SIZE] {
        let start = range.start;
        if let Some(i) = hdr.get(range).and_then(|r| r.iter().position(|&b| b != 0)) {
            return Err(BundleError::HeaderReservedNonZero { offset: start + i });
        }
    }
    if flags & board_flags::ADDRESS == 0 {
        return Ok(None);
    }
    let octets = read_u32(hdr, header::BOARD_ADDRESS).to_be_bytes();
    let prefix = hdr.get(header::BOARD_PREFIX).copied().unwrap_or(0);
    BoardAddress::new(octets, prefix)
        .map(Some)
        .map_err(|why| BundleError::BadBoardAddress {
            octets,
            prefix,
            why,
        })
}

/// Header bytes 56 to 64 for `address` (all zero for `None`).
pub fn board_address_bytes(address: Option<BoardAddress>) -> [u8; 8] {
    let mut b = [0u8; 8];
    if let Some(a) = address {
        b[..4].copy_from_slice(&u32::from_be_bytes(a.octets).to_le_bytes());
        b[header::BOARD_PREFIX - header::RESERVED] = a.prefix;
        b[header::BOARD_FLAGS - header::RESERVED] = board_flags::ADDRESS;
    }
    b
}

/// Give a valid bundle (`bytes`, checked first) another board address in
/// place: the header only, which the CRC does not cover, so the rest of
/// the bundle is untouched. How `cargo xtask run --address` and the test
/// harness boot two boards of one bundle with different addresses.
pub fn set_board_address(
    bytes: &mut [u8],
    address: Option<BoardAddress>,
) -> Result<(), BundleError> {
    parse(bytes)?;
    let field = bytes
        .get_mut(header::RESERVED..HEADER_SIZE)
        .ok_or(BundleError::TooShort { len: 0 })?;
    field.copy_from_slice(&board_address_bytes(address));
    Ok(())
}

/// Length of a valid NUL-padded name, or why it is invalid.
fn name_len(raw: &[u8; NAME_LEN]) -> Result<usize, NameProblem> {
    let len = raw.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
    if len == 0 {
        return Err(NameProblem::Empty);
    }
    check_name_chars(&raw[..len])?;
    if let Some(i) = raw[len..].iter().position(|&b| b != 0) {
        return Err(NameProblem::GarbageAfterNul(len + i));
    }
    Ok(len)
}

fn name_shown_len(raw: &[u8; NAME_LEN]) -> usize {
    raw.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)
}

fn check_name_chars(name: &[u8]) -> Result<(), NameProblem> {
    match name
        .iter()
        .position(|&b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'))
    {
        Some(i) => Err(NameProblem::BadChar(i)),
        None => Ok(()),
    }
}

/// Whether `name` is a valid VM name: 1 to 32 bytes of `[a-z0-9_-]`.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= NAME_LEN && check_name_chars(name.as_bytes()).is_ok()
}

/// The checks on an entry's scalar fields, in the order the reader applies them.
fn check_scalars(
    ram_size: u64,
    vcpus: u32,
    cpu_affinity: u64,
    balloon_features: u64,
    devs: u64,
    on_bad_access: u32,
) -> Result<(), VmError> {
    if ram_size == 0 {
        return Err(VmError::ZeroRam);
    }
    if !ram_size.is_multiple_of(RAM_ALIGN) {
        return Err(VmError::RamNotAligned { ram_size });
    }
    if vcpus == 0 {
        return Err(VmError::ZeroVcpus);
    }
    if cpu_affinity == 0 {
        return Err(VmError::ZeroAffinity);
    }
    if on_bad_access > bad_access::LAST {
        return Err(VmError::UnknownBadAccessPolicy {
            code: on_bad_access,
        });
    }
    if devs & !devices::KNOWN != 0 {
        return Err(VmError::UnknownDevices { bits: devs });
    }
    if devs & devices::BALLOON == 0 && balloon_features != 0 {
        return Err(VmError::BalloonFeaturesWithoutBalloon {
            features: balloon_features,
        });
    }
    Ok(())
}

/// The checks on an entry's memory limits (raw fields, 0 = default), in the
/// order the reader applies them; `ram_size` is already valid.
fn check_memory(
    ram_size: u64,
    min: u64,
    low: u64,
    max: u64,
    weight: u32,
    flags: u32,
) -> Result<(), VmError> {
    if flags & !mem_flags::KNOWN != 0 {
        return Err(VmError::UnknownMemFlags { flags });
    }
    if weight > MAX_WEIGHT {
        return Err(VmError::MemWeightOutOfRange { weight });
    }
    for (field, value) in [
        (MemField::Min, min),
        (MemField::Low, low),
        (MemField::Max, max),
    ] {
        if !value.is_multiple_of(MEM_ALIGN) {
            return Err(VmError::MemNotAligned { field, value });
        }
    }
    if max > ram_size {
        return Err(VmError::MemMaxAboveRam { max, ram_size });
    }
    if low != 0 && min > low {
        return Err(VmError::MemMinAboveLow { min, low });
    }
    let max = effective_max(max, ram_size);
    if min > max {
        return Err(VmError::MemAboveMax {
            field: MemField::Min,
            value: min,
            max,
        });
    }
    let low = effective_low(low, min);
    if low > max {
        return Err(VmError::MemAboveMax {
            field: MemField::Low,
            value: low,
            max,
        });
    }
    Ok(())
}

fn effective_max(max: u64, ram_size: u64) -> u64 {
    if max == 0 {
        ram_size
    } else {
        max
    }
}

fn effective_low(low: u64, min: u64) -> u64 {
    if low == 0 {
        min
    } else {
        low
    }
}

/// The checks on the pool extension's flags and watermarks.
fn check_pool(min: u64, low: u64, high: u64, flags: u32) -> Result<(), BundleError> {
    if flags & !pool_flags::KNOWN != 0 {
        return Err(BundleError::UnknownPoolFlags { flags });
    }
    for (field, value) in [
        (PoolField::Min, min),
        (PoolField::Low, low),
        (PoolField::High, high),
    ] {
        if !value.is_multiple_of(MEM_ALIGN) {
            return Err(BundleError::PoolNotAligned { field, value });
        }
    }
    if min == 0 && low == 0 && high == 0 {
        return Ok(());
    }
    if min == 0 || low == 0 || high == 0 {
        return Err(BundleError::PoolPartlyZero { min, low, high });
    }
    if min > low || low > high {
        return Err(BundleError::PoolOutOfOrder { min, low, high });
    }
    Ok(())
}

/// A snapshot name (`restore`) as the entry stores it: printable ASCII
/// without spaces, then NUL padding; all NUL is none.
pub(crate) fn check_restore(b: &[u8]) -> Result<Option<&str>, VmError> {
    let len = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let (name, pad) = b.split_at(len);
    if !name.iter().all(|c| c.is_ascii_graphic()) || pad.iter().any(|&c| c != 0) {
        return Err(VmError::BadRestore);
    }
    Ok((!name.is_empty()).then(|| core::str::from_utf8(name).unwrap_or("")))
}

fn check_cmdline(b: &[u8]) -> Result<&str, VmError> {
    let s = core::str::from_utf8(b).map_err(|e| VmError::CmdlineNotUtf8 {
        valid_up_to: e.valid_up_to(),
    })?;
    if let Some(at) = b.iter().position(|&c| c == 0) {
        return Err(VmError::CmdlineHasNul { at });
    }
    Ok(s)
}

fn check_fits(kernel: u64, initrd: u64, ram_size: u64) -> Result<(), VmError> {
    match kernel.checked_add(initrd) {
        Some(t) if t <= ram_size => Ok(()),
        _ => Err(VmError::BlobsExceedRam {
            kernel,
            initrd,
            ram_size,
        }),
    }
}

// ---------------------------------------------------------------------------
// The reader.

/// A validated bundle.
#[derive(Clone, Copy, Debug)]
pub struct Bundle<'a> {
    /// Exactly `total_size` bytes.
    bytes: &'a [u8],
    version: u32,
    header_size: usize,
    crc: u32,
    vm_count: usize,
    entry_size: usize,
    table_offset: usize,
    /// Pool watermarks min, low, high (all zero: default or absent).
    pool: [u64; 3],
    pool_flags: u32,
    /// The header's [`flags`] bits.
    flags: u32,
    /// The board's network address, if the header has one.
    board_address: Option<BoardAddress>,
}

/// One VM of a validated bundle.
#[derive(Clone, Copy, Debug)]
pub struct VmEntry<'a> {
    index: usize,
    name: &'a str,
    ram_size: u64,
    vcpus: u32,
    cpu_affinity: u64,
    kernel: &'a [u8],
    initrd: Option<&'a [u8]>,
    cmdline: Option<&'a str>,
    balloon_features: u64,
    devices: u64,
    on_bad_access: u32,
    /// The raw memory fields (0 = default).
    mem_min: u64,
    mem_low: u64,
    mem_max: u64,
    mem_weight: u32,
    mem_flags: u32,
    /// The snapshot it starts from instead of booting.
    restore: Option<&'a str>,
}

impl<'a> VmEntry<'a> {
    /// The snapshot it starts from instead of booting (`restore = "..."`).
    pub fn restore(&self) -> Option<&'a str> {
        self.restore
    }

    /// Position in the VM table.
    pub fn index(&self) -> usize {
        self.index
    }
    /// 1 to 32 bytes of `[a-z0-9_-]`, unique within the bundle.
    pub fn name(&self) -> &'a str {
        self.name
    }
    /// Bytes of guest RAM: non-zero, a multiple of 4 KiB, at least kernel
    /// plus initrd.
    pub fn ram_size(&self) -> u64 {
        self.ram_size
    }
    /// At least 1.
    pub fn vcpus(&self) -> u32 {
        self.vcpus
    }
    /// Bit `n` set: vCPUs may run on physical CPU `n`. Non-zero.
    pub fn cpu_affinity(&self) -> u64 {
        self.cpu_affinity
    }
    /// The kernel image, non-empty, starting 4 KiB aligned in the bundle.
    pub fn kernel(&self) -> &'a [u8] {
        self.kernel
    }
    /// The initrd, if any (never empty), starting 4 KiB aligned in the bundle.
    pub fn initrd(&self) -> Option<&'a [u8]> {
        self.initrd
    }
    /// The command line, if any (never empty; UTF-8, no NUL).
    pub fn cmdline(&self) -> Option<&'a str> {
        self.cmdline
    }
    /// Virtio balloon feature bits offered; zero unless the balloon is enabled.
    pub fn balloon_features(&self) -> u64 {
        self.balloon_features
    }
    /// [`devices`] bits.
    pub fn devices(&self) -> u64 {
        self.devices
    }
    pub fn has_balloon(&self) -> bool {
        self.devices & devices::BALLOON != 0
    }
    pub fn has_virtio_console(&self) -> bool {
        self.devices & devices::CONSOLE != 0
    }
    /// A [`bad_access`] code.
    pub fn on_bad_access(&self) -> u32 {
        self.on_bad_access
    }
    /// Bytes never reclaimed (0: none). A multiple of 4 KiB, at most
    /// [`mem_low`](Self::mem_low).
    pub fn mem_min(&self) -> u64 {
        self.mem_min
    }
    /// Bytes reclaimed below only when no VM is above its own low: the
    /// entry's `mem_low`, or [`mem_min`](Self::mem_min) when that is 0. At
    /// most [`mem_max`](Self::mem_max).
    pub fn mem_low(&self) -> u64 {
        effective_low(self.mem_low, self.mem_min)
    }
    /// Bytes never backed above: the entry's `mem_max`, or the RAM size when
    /// that is 0 (no limit).
    pub fn mem_max(&self) -> u64 {
        effective_max(self.mem_max, self.ram_size)
    }
    /// Reclaim weight, 1 to [`MAX_WEIGHT`] ([`DEFAULT_WEIGHT`] when the
    /// entry says 0).
    pub fn weight(&self) -> u32 {
        if self.mem_weight == 0 {
            DEFAULT_WEIGHT
        } else {
            self.mem_weight
        }
    }
    /// [`mem_flags`] bits.
    pub fn mem_flags(&self) -> u32 {
        self.mem_flags
    }
    /// All RAM is backed at start and never reclaimed.
    pub fn prealloc(&self) -> bool {
        self.mem_flags & mem_flags::PREALLOC != 0
    }
    /// Bytes the VM is promised: the RAM size with [`prealloc`](Self::prealloc),
    /// else [`mem_min`](Self::mem_min).
    pub fn guaranteed(&self) -> u64 {
        if self.prealloc() {
            self.ram_size
        } else {
            self.mem_min
        }
    }
}

/// Parses and validates a bundle. `bytes` may be longer than the bundle (the
/// initrd region may be padded); the bytes after `total_size` are ignored.
///
/// Checks, in order: header (magic, version, flags, reserved bytes, header
/// size, total size against `bytes`, entry size, VM count, VM table bounds),
/// the pool extension when `header_size >= 96` (reserved bytes, flags,
/// watermarks), then the CRC of everything after the header, then each VM
/// entry (name, reserved fields, RAM, vCPUs, affinity, `on_bad_access`,
/// devices, balloon features, memory flags, weight and limits, blob
/// offsets/sizes/alignment, command line, fit in RAM, then uniqueness of the
/// name). The first failure is returned.
pub fn parse(bytes: &[u8]) -> Result<Bundle<'_>, BundleError> {
    parse_with_crc(bytes, crc32)
}

/// [`parse`] with the CRC-32 (IEEE) of the bytes after the header computed
/// by `crc32` instead of [`crc32()`]: the hypervisor's reads the bundle a
/// 64-bit word at a time where it is aligned ([`Crc32::update_words`]),
/// which this crate, free of `unsafe`, does not do. `crc32` must compute
/// the same function; a different one can only make bundles fail their
/// check.
pub fn parse_with_crc(
    bytes: &[u8],
    crc32: impl FnOnce(&[u8]) -> u32,
) -> Result<Bundle<'_>, BundleError> {
    let hdr = match bytes.get(..HEADER_SIZE) {
        Some(h) => h,
        None => return Err(BundleError::TooShort { len: bytes.len() }),
    };
    let mut magic = [0u8; 8];
    magic.copy_from_slice(&hdr[header::MAGIC..header::MAGIC + 8]);
    if magic != MAGIC {
        return Err(BundleError::BadMagic { found: magic });
    }
    let version = read_u32(hdr, header::VERSION);
    if version != VERSION {
        return Err(BundleError::UnsupportedVersion {
            found: version,
            supported: VERSION,
        });
    }
    let flags = read_u32(hdr, header::FLAGS);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(BundleError::UnknownFlags { flags });
    }
    let board_address = read_board_address(hdr)?;
    let header_size32 = read_u32(hdr, header::HEADER_SIZE);
    let header_size = header_size32 as usize;
    if header_size < HEADER_SIZE || !header_size.is_multiple_of(8) {
        return Err(BundleError::BadHeaderSize {
            header_size: header_size32,
        });
    }
    let total_size = read_u64(hdr, header::TOTAL_SIZE);
    if total_size < header_size as u64 {
        return Err(BundleError::TotalSizeTooSmall {
            total_size,
            header_size: header_size32,
        });
    }
    let bytes = match usize::try_from(total_size)
        .ok()
        .and_then(|t| bytes.get(..t))
    {
        Some(b) => b,
        None => {
            return Err(BundleError::Truncated {
                total_size,
                available: bytes.len(),
            })
        }
    };
    let entry_size32 = read_u32(hdr, header::VM_ENTRY_SIZE);
    let entry_size = entry_size32 as usize;
    if entry_size < VM_ENTRY_SIZE || !entry_size.is_multiple_of(8) {
        return Err(BundleError::BadEntrySize {
            entry_size: entry_size32,
        });
    }
    let count32 = read_u32(hdr, header::VM_COUNT);
    if count32 as usize > MAX_VMS {
        return Err(BundleError::TooManyVms { count: count32 });
    }
    let table_offset = read_u64(hdr, header::VM_TABLE_OFFSET);
    let table_size = read_u64(hdr, header::VM_TABLE_SIZE);
    if !table_offset.is_multiple_of(8) {
        return Err(BundleError::VmTableMisaligned {
            offset: table_offset,
        });
    }
    if table_offset < header_size as u64 {
        return Err(BundleError::VmTableOverlapsHeader {
            offset: table_offset,
            header_size: header_size32,
        });
    }
    // Both factors are small (count <= MAX_VMS, entry_size < 2^32): no overflow.
    if table_size != count32 as u64 * entry_size32 as u64 {
        return Err(BundleError::VmTableSizeMismatch {
            size: table_size,
            count: count32,
            entry_size: entry_size32,
        });
    }
    match table_offset.checked_add(table_size) {
        Some(end) if end <= total_size => {}
        _ => {
            return Err(BundleError::VmTableOutOfBounds {
                offset: table_offset,
                size: table_size,
                total_size,
            })
        }
    }
    // The pool extension. `bytes` is at least `header_size` long here.
    let mut pool = [0u64; 3];
    let mut pool_flags = 0;
    if header_size >= HEADER_SIZE_POOL {
        let ext = bytes.get(..HEADER_SIZE_POOL).unwrap_or(&[]);
        if let Some(i) = ext
            .get(header::POOL_RESERVED..HEADER_SIZE_POOL)
            .and_then(|r| r.iter().position(|&b| b != 0))
        {
            return Err(BundleError::HeaderReservedNonZero {
                offset: header::POOL_RESERVED + i,
            });
        }
        pool = [
            read_u64(ext, header::POOL_MIN),
            read_u64(ext, header::POOL_LOW),
            read_u64(ext, header::POOL_HIGH),
        ];
        pool_flags = read_u32(ext, header::POOL_FLAGS);
        check_pool(pool[0], pool[1], pool[2], pool_flags)?;
    }
    let stored = read_u32(hdr, header::CRC32);
    let computed = crc32(bytes.get(header_size..).unwrap_or(&[]));
    if stored != computed {
        return Err(BundleError::CrcMismatch { stored, computed });
    }

    let bundle = Bundle {
        bytes,
        version,
        header_size,
        crc: stored,
        vm_count: count32 as usize,
        entry_size,
        table_offset: table_offset as usize,
        pool,
        pool_flags,
        flags,
        board_address,
    };
    for index in 0..bundle.vm_count {
        let raw = bundle.raw_entry(index);
        let mut raw_name = [0u8; NAME_LEN];
        raw_name.copy_from_slice(raw.get(..NAME_LEN).unwrap_or(&[0; NAME_LEN]));
        let name = VmName::from_raw(&raw_name);
        let fail = |error| BundleError::Vm { index, name, error };
        bundle.decode(index).map_err(fail)?;
        for first in 0..index {
            if bundle.raw_entry(first).get(..NAME_LEN) == Some(&raw_name[..]) {
                return Err(fail(VmError::DuplicateName { first }));
            }
        }
    }
    Ok(bundle)
}

impl<'a> Bundle<'a> {
    /// The format version of this bundle ([`VERSION`]).
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Bytes of the bundle (the `total_size` header field).
    pub fn total_size(&self) -> u64 {
        self.bytes.len() as u64
    }
    /// The bundle's bytes, exactly [`total_size`](Self::total_size) long.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// The CRC-32 stored in (and checked against) the header.
    pub fn crc32(&self) -> u32 {
        self.crc
    }
    pub fn header_size(&self) -> usize {
        self.header_size
    }
    pub fn vm_count(&self) -> usize {
        self.vm_count
    }
    pub fn vms(&self) -> Vms<'a> {
        Vms {
            bundle: *self,
            next: 0,
        }
    }
    pub fn vm(&self, index: usize) -> Option<VmEntry<'a>> {
        if index < self.vm_count {
            self.decode(index).ok()
        } else {
            None
        }
    }
    pub fn find(&self, name: &str) -> Option<VmEntry<'a>> {
        self.vms().find(|vm| vm.name() == name)
    }
    /// The free page pool's watermarks `(min, low, high)` in bytes
    /// (multiples of 4 KiB, non-zero, in order), or `None` when the bundle
    /// leaves them to the hypervisor (no pool extension, or all zero).
    pub fn board_address(&self) -> Option<BoardAddress> {
        self.board_address
    }
    /// The header's watermarks, if any.
    pub fn pool_watermarks(&self) -> Option<(u64, u64, u64)> {
        let [min, low, high] = self.pool;
        (min != 0).then_some((min, low, high))
    }
    /// The [`pool_flags`] bits (0 without the pool extension).
    pub fn pool_flags(&self) -> u32 {
        self.pool_flags
    }
    /// When a vCPU has waited the bound for a frame, stop the lowest-weight
    /// VM: unless [`pool_flags::WAIT`] says to wait without bound.
    pub fn stop_lowest_when_exhausted(&self) -> bool {
        self.pool_flags & pool_flags::WAIT == 0
    }
    /// The header's [`flags`] bits.
    pub fn flags(&self) -> u32 {
        self.flags
    }
    /// Run the on-target self-checks once the VMs have started
    /// ([`flags::ON_TARGET_TESTS`]).
    pub fn on_target_tests(&self) -> bool {
        self.flags & flags::ON_TARGET_TESTS != 0
    }

    /// The first `VM_ENTRY_SIZE` bytes of entry `index` (empty if out of
    /// bounds, which a parsed bundle never is).
    fn raw_entry(&self, index: usize) -> &'a [u8] {
        let bytes = self.bytes;
        index
            .checked_mul(self.entry_size)
            .and_then(|o| o.checked_add(self.table_offset))
            .and_then(|start| bytes.get(start..start.checked_add(VM_ENTRY_SIZE)?))
            .unwrap_or(&[])
    }

    fn table_end(&self) -> u64 {
        (self.table_offset + self.vm_count * self.entry_size) as u64
    }

    fn blob(&self, raw: &[u8], blob: Blob, off_field: usize) -> Result<&'a [u8], VmError> {
        let offset = read_u64(raw, off_field);
        let size = read_u64(raw, off_field + 8);
        if size == 0 {
            if blob == Blob::Kernel {
                return Err(VmError::EmptyKernel);
            }
            if offset != 0 {
                return Err(VmError::OffsetWithoutBlob { blob, offset });
            }
            return Ok(&[]);
        }
        if !offset.is_multiple_of(BLOB_ALIGN) {
            return Err(VmError::BlobMisaligned { blob, offset });
        }
        let table_end = self.table_end();
        if offset < table_end {
            return Err(VmError::BlobOverlapsTable {
                blob,
                offset,
                table_end,
            });
        }
        let bundle_size = self.bytes.len() as u64;
        let oob = VmError::BlobOutOfBounds {
            blob,
            offset,
            size,
            bundle_size,
        };
        let end = offset.checked_add(size).ok_or(oob)?;
        if end > bundle_size {
            return Err(oob);
        }
        self.bytes.get(offset as usize..end as usize).ok_or(oob)
    }

    /// Decodes and validates entry `index` (everything but name uniqueness).
    fn decode(&self, index: usize) -> Result<VmEntry<'a>, VmError> {
        let raw = self.raw_entry(index);
        let mut raw_name = [0u8; NAME_LEN];
        raw_name.copy_from_slice(raw.get(..NAME_LEN).unwrap_or(&[0; NAME_LEN]));
        let name_len = name_len(&raw_name).map_err(|problem| VmError::BadName {
            raw: raw_name,
            problem,
        })?;
        let name = raw
            .get(..name_len)
            .and_then(|n| core::str::from_utf8(n).ok())
            .unwrap_or("");
        if let Some(i) = raw
            .get(entry::RESERVED..VM_ENTRY_SIZE)
            .and_then(|r| r.iter().position(|&b| b != 0))
        {
            return Err(VmError::ReservedNonZero {
                offset: entry::RESERVED + i,
            });
        }
        let ram_size = read_u64(raw, entry::RAM_SIZE);
        let vcpus = read_u32(raw, entry::VCPUS);
        let cpu_affinity = read_u64(raw, entry::CPU_AFFINITY);
        let balloon_features = read_u64(raw, entry::BALLOON_FEATURES);
        let devs = read_u64(raw, entry::DEVICES);
        let on_bad_access = read_u32(raw, entry::ON_BAD_ACCESS);
        check_scalars(
            ram_size,
            vcpus,
            cpu_affinity,
            balloon_features,
            devs,
            on_bad_access,
        )?;
        let mem_min = read_u64(raw, entry::MEM_MIN);
        let mem_low = read_u64(raw, entry::MEM_LOW);
        let mem_max = read_u64(raw, entry::MEM_MAX);
        let mem_weight = read_u32(raw, entry::MEM_WEIGHT);
        let mem_flags = read_u32(raw, entry::MEM_FLAGS);
        check_memory(ram_size, mem_min, mem_low, mem_max, mem_weight, mem_flags)?;
        let kernel = self.blob(raw, Blob::Kernel, entry::KERNEL_OFFSET)?;
        let initrd = self.blob(raw, Blob::Initrd, entry::INITRD_OFFSET)?;
        let cmdline = self.blob(raw, Blob::Cmdline, entry::CMDLINE_OFFSET)?;
        let cmdline = check_cmdline(cmdline)?;
        check_fits(kernel.len() as u64, initrd.len() as u64, ram_size)?;
        let restore = raw
            .get(entry::RESTORE..entry::RESTORE + NAME_LEN)
            .map_or(Ok(None), check_restore)?;
        Ok(VmEntry {
            index,
            name,
            ram_size,
            vcpus,
            cpu_affinity,
            kernel,
            initrd: (!initrd.is_empty()).then_some(initrd),
            cmdline: (!cmdline.is_empty()).then_some(cmdline),
            balloon_features,
            devices: devs,
            on_bad_access,
            mem_min,
            mem_low,
            mem_max,
            mem_weight,
            mem_flags,
            restore,
        })
    }
}

/// Iterator over the VMs of a [`Bundle`], in table order.
#[derive(Clone, Debug)]
pub struct Vms<'a> {
    bundle: Bundle<'a>,
    next: usize,
}

impl<'a> Iterator for Vms<'a> {
    type Item = VmEntry<'a>;

    fn next(&mut self) -> Option<VmEntry<'a>> {
        while self.next < self.bundle.vm_count {
            let i = self.next;
            self.next += 1;
            // Every entry was validated by `parse`, so this always succeeds.
            if let Ok(vm) = self.bundle.decode(i) {
                return Some(vm);
            }
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.bundle.vm_count - self.next.min(self.bundle.vm_count);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Vms<'_> {}
