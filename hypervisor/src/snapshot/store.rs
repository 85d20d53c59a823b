//! Named snapshots on the board's disk. The disk holds a superblock, a
//! directory of [`ENTRIES`] entries of one sector each, then the
//! snapshots' bytes, each in one extent of whole sectors. A snapshot's
//! bytes are written first and its directory entry last, in one sector
//! write: a snapshot that failed half way (disk full, a write error, the
//! board reset) is never listed, and its sectors are free again.
//!
//! This layer knows only a [`Disk`] of 512-byte sectors, so that a board
//! with an SD card instead of a virtio-blk device uses it unchanged. A
//! snapshot is written ([`Writer`]) and read ([`EntryReader`]) in runs of
//! up to [`RUN_SECTORS`] sectors per disk request: each request to the
//! board's polled virtio-blk is a round trip, and a snapshot is megabytes.
//! Everything it reads back is checked (magic, checksums, extents inside
//! the disk and apart from one another): a disk can be swapped or damaged.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

use crate::bundle_crc::crc32;

/// Bytes per sector.
pub const SECTOR: usize = 512;
/// Directory entries: snapshots a disk holds at most.
pub const ENTRIES: u64 = 64;
/// The longest snapshot or VM name.
pub const NAME_MAX: usize = 32;
/// Where the snapshots' bytes begin: after the superblock and the
/// directory, at a 4 KiB boundary.
pub const DATA_START: u64 = 72;
/// Sectors a snapshot's bytes are written or read in, at most, per disk
/// request (1 MiB, on the heap): under QEMU a polled virtio-blk request
/// costs about a millisecond whatever its size, and 64 KiB runs wrote a
/// Linux guest's 843 MiB in 12 to 29 s (docs/PERFORMANCE.md).
#[cfg(not(test))]
pub const RUN_SECTORS: usize = 2048;
/// The host tests count requests over a few hundred sectors: runs of 128
/// there, the same code.
#[cfg(test)]
pub const RUN_SECTORS: usize = 128;
const RUN: usize = RUN_SECTORS * SECTOR;

const SUPER_MAGIC: &[u8; 8] = b"TIDALDSK";
const ENTRY_MAGIC: &[u8; 8] = b"TIDALSNP";
const VERSION: u16 = 1;

/// A disk of 512-byte sectors; `buf`'s length is a multiple of [`SECTOR`].
pub trait Disk {
    /// How many sectors it has.
    fn sectors(&self) -> u64;
    fn read(&mut self, sector: u64, buf: &mut [u8]) -> Result<(), DiskError>;
    fn write(&mut self, sector: u64, buf: &[u8]) -> Result<(), DiskError>;
}

impl<D: Disk + ?Sized> Disk for &mut D {
    fn sectors(&self) -> u64 {
        (**self).sectors()
    }
    fn read(&mut self, sector: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        (**self).read(sector, buf)
    }
    fn write(&mut self, sector: u64, buf: &[u8]) -> Result<(), DiskError> {
        (**self).write(sector, buf)
    }
}

/// The device refused a read or a write (its own words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskError(pub &'static str);

/// Why a store operation failed; nothing listed changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    Disk(DiskError),
    /// The disk holds something else (a superblock that is not ours): it
    /// is left alone.
    NotOurs,
    /// Too small for the directory and one sector of data.
    TooSmall,
    /// A name empty, too long, or not printable ASCII without spaces.
    BadName,
    /// A snapshot of that name exists.
    Exists,
    /// No snapshot of that name.
    NotFound,
    /// Every directory entry is taken.
    DirectoryFull,
    /// The snapshot outgrew the largest free extent (`largest` bytes)
    /// with `written` bytes written.
    DiskFull {
        written: u64,
        largest: u64,
    },
    /// The snapshot's bytes do not match its checksum.
    Checksum,
    /// A read asked for bytes past the snapshot's end: it is shorter than
    /// what it says it holds.
    Truncated,
}

impl From<DiskError> for StoreError {
    fn from(e: DiskError) -> Self {
        StoreError::Disk(e)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Disk(DiskError(why)) => write!(f, "the disk failed: {why}"),
            StoreError::NotOurs => write!(
                f,
                "the disk holds something else; give the board an empty disk (cargo xtask run --disk FILE)"
            ),
            StoreError::TooSmall => write!(f, "the disk is too small for snapshots"),
            StoreError::BadName => write!(
                f,
                "a name is 1 to {NAME_MAX} printable characters without spaces"
            ),
            StoreError::Exists => write!(f, "a snapshot of that name exists; delete it or pick another name"),
            StoreError::NotFound => write!(f, "no snapshot of that name ('snapshots' lists them)"),
            StoreError::DirectoryFull => {
                write!(f, "the disk holds {ENTRIES} snapshots already; delete one")
            }
            StoreError::DiskFull { written, largest } => write!(
                f,
                "the disk is full: the snapshot outgrew the largest free space ({}) at {}; delete a snapshot",
                crate::report::Size(*largest),
                crate::report::Size(*written)
            ),
            StoreError::Checksum => write!(
                f,
                "the snapshot is damaged (its checksum does not match); nothing was started"
            ),
            StoreError::Truncated => write!(
                f,
                "the snapshot ends early: it is cut short or damaged"
            ),
        }
    }
}

/// A name as the store keeps it.
pub type Name = heapless::String<NAME_MAX>;

/// One listed snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: Name,
    /// The VM it was taken of.
    pub vm: Name,
    /// Its length in bytes.
    pub len: u64,
    /// When, by the guest's clock (microseconds since it started).
    pub taken_us: u64,
    /// What board and GIC it was taken on (a tag the snapshot format defines).
    pub board: u32,
    /// CRC-32 of its bytes.
    crc: u32,
    /// Its first sector.
    start: u64,
    /// Its directory slot.
    slot: u64,
}

impl Entry {
    /// The sectors it takes.
    pub fn sectors(&self) -> u64 {
        self.len.div_ceil(SECTOR as u64)
    }

    /// Its first sector.
    pub fn start(&self) -> u64 {
        self.start
    }
}

/// Whether `name` is one the store takes.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= NAME_MAX && name.bytes().all(|b| b.is_ascii_graphic())
}

fn name_of(s: &str) -> Result<Name, StoreError> {
    if !valid_name(s) {
        return Err(StoreError::BadName);
    }
    let mut name = Name::new();
    name.push_str(s).map_err(|_| StoreError::BadName)?;
    Ok(name)
}

/// The snapshots on one disk.
pub struct Store<D: Disk> {
    disk: D,
    entries: Vec<Entry>,
}

impl<D: Disk> Store<D> {
    /// The store on `disk`: an all-zero disk (a new sparse image) is
    /// formatted; one with our superblock is read, its damaged or
    /// impossible entries skipped; anything else is refused.
    pub fn open(mut disk: D) -> Result<Self, StoreError> {
        if disk.sectors() <= DATA_START {
            return Err(StoreError::TooSmall);
        }
        let mut sector = [0u8; SECTOR];
        disk.read(0, &mut sector)?;
        if sector.iter().all(|&b| b == 0) {
            let mut zero = [0u8; SECTOR];
            for slot in 0..ENTRIES {
                disk.write(1 + slot, &zero)?;
            }
            zero[..8].copy_from_slice(SUPER_MAGIC);
            zero[8..10].copy_from_slice(&VERSION.to_le_bytes());
            let crc = crc32(&zero[..SECTOR - 4]);
            zero[SECTOR - 4..].copy_from_slice(&crc.to_le_bytes());
            disk.write(0, &zero)?;
        } else if &sector[..8] != SUPER_MAGIC
            || u16::from_le_bytes([sector[8], sector[9]]) != VERSION
            || crc32(&sector[..SECTOR - 4]) != u32_at(&sector, SECTOR - 4)
        {
            return Err(StoreError::NotOurs);
        }
        let mut store = Self {
            disk,
            entries: Vec::new(),
        };
        let end = store.disk.sectors();
        for slot in 0..ENTRIES {
            store.disk.read(1 + slot, &mut sector)?;
            let Some(entry) = decode_entry(&sector, slot, end) else {
                continue;
            };
            // Overlapping or named twice: a damaged directory; the later
            // entry is erased, so that it never comes back to claim space
            // once the one it clashed with is deleted and the space reused.
            let clash = store.entries.iter().any(|e| {
                e.name == entry.name
                    || (e.start < entry.start + entry.sectors()
                        && entry.start < e.start + e.sectors())
            });
            if clash {
                store.disk.write(1 + slot, &[0u8; SECTOR])?;
            } else {
                store.entries.push(entry);
            }
        }
        Ok(store)
    }

    /// The snapshots, in directory order.
    pub fn list(&self) -> &[Entry] {
        &self.entries
    }

    pub fn find(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name.as_str() == name)
    }

    /// The disk, given back.
    pub fn into_disk(self) -> D {
        self.disk
    }

    /// The largest free extent, in sectors, and where it starts.
    fn largest_free(&self) -> (u64, u64) {
        let mut used: Vec<(u64, u64)> = self
            .entries
            .iter()
            .map(|e| (e.start, e.start + e.sectors()))
            .collect();
        used.sort_unstable();
        let mut best = (0, DATA_START);
        let mut at = DATA_START;
        for (start, end) in used.into_iter().chain([(self.disk.sectors(), 0)]) {
            if start > at && start - at > best.0 {
                best = (start - at, at);
            }
            at = at.max(end);
        }
        best
    }

    /// Begin writing snapshot `name` of VM `vm`, into the largest free
    /// extent; nothing is listed until [`Writer::commit`].
    pub fn begin(&mut self, name: &str, vm: &str) -> Result<Writer<'_, D>, StoreError> {
        let name = name_of(name)?;
        let vm = name_of(vm)?;
        if self.find(&name).is_some() {
            return Err(StoreError::Exists);
        }
        let slot = (0..ENTRIES)
            .find(|s| self.entries.iter().all(|e| e.slot != *s))
            .ok_or(StoreError::DirectoryFull)?;
        let (sectors, start) = self.largest_free();
        Ok(Writer {
            store: self,
            name,
            vm,
            slot,
            start,
            room: sectors,
            written: 0,
            buf: Vec::with_capacity(RUN),
            crc: guest_bundle::Crc32::new(),
        })
    }

    /// Snapshot `name`'s bytes, to be read in order ([`EntryReader`]). Its
    /// whole-snapshot checksum is not checked here: what reads it checks
    /// each part it acts on (the snapshot format's own checksums), and
    /// [`Store::verify`] checks the whole.
    pub fn open_reader(&mut self, name: &str) -> Result<EntryReader<'_, D>, StoreError> {
        let entry = self.find(name).ok_or(StoreError::NotFound)?;
        let (start, len) = (entry.start, entry.len);
        Ok(EntryReader {
            disk: &mut self.disk,
            start,
            len,
            read: 0,
            next: 0,
            buf: Vec::new(),
            at: 0,
        })
    }

    /// Delete snapshot `name`: its entry is cleared, its sectors free.
    pub fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        let i = self
            .entries
            .iter()
            .position(|e| e.name.as_str() == name)
            .ok_or(StoreError::NotFound)?;
        self.disk.write(1 + self.entries[i].slot, &[0; SECTOR])?;
        self.entries.remove(i);
        Ok(())
    }

    /// Read snapshot `name` in order, in pieces of up to a run, into
    /// `each`; then its checksum is checked. A caller that must not act on
    /// damaged bytes reads it through once ([`Store::verify`]) before
    /// acting on it.
    pub fn read(
        &mut self,
        name: &str,
        mut each: impl FnMut(&[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let expected = self.find(name).ok_or(StoreError::NotFound)?.crc;
        let mut reader = self.open_reader(name)?;
        let mut crc = guest_bundle::Crc32::new();
        let mut buf = alloc::vec![0u8; reader.remaining().min(RUN as u64) as usize];
        while reader.remaining() > 0 {
            let part = &mut buf[..reader.remaining().min(RUN as u64) as usize];
            reader.read(part)?;
            crate::bundle_crc::update(&mut crc, part);
            each(part)?;
        }
        if crc.finish() != expected {
            return Err(StoreError::Checksum);
        }
        Ok(())
    }

    /// Whether snapshot `name`'s bytes match its checksum.
    pub fn verify(&mut self, name: &str) -> Result<(), StoreError> {
        self.read(name, |_| Ok(()))
    }
}

/// A snapshot being written; dropped without [`Writer::commit`], it was
/// never there.
pub struct Writer<'a, D: Disk> {
    store: &'a mut Store<D>,
    name: Name,
    vm: Name,
    slot: u64,
    start: u64,
    /// Sectors of the extent.
    room: u64,
    /// Sectors written.
    written: u64,
    /// Bytes not on the disk yet: less than a run.
    buf: Vec<u8>,
    crc: guest_bundle::Crc32,
}

impl<D: Disk> Writer<'_, D> {
    /// Append `bytes`. Bytes that would pass the extent's end are refused
    /// whole, before any of them is written.
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), StoreError> {
        let largest = self.room.saturating_mul(SECTOR as u64);
        if self.len().saturating_add(bytes.len() as u64) > largest {
            return Err(StoreError::DiskFull {
                written: self.len(),
                largest,
            });
        }
        crate::bundle_crc::update(&mut self.crc, bytes);
        while !bytes.is_empty() {
            if self.buf.is_empty() && bytes.len() >= RUN {
                // A whole run goes to the disk as it is, not copied.
                let (run, rest) = bytes.split_at(RUN);
                self.put(run)?;
                bytes = rest;
                continue;
            }
            let n = (RUN - self.buf.len()).min(bytes.len());
            let (part, rest) = bytes.split_at(n);
            self.buf.extend_from_slice(part);
            bytes = rest;
            if self.buf.len() == RUN {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.written * SECTOR as u64 + self.buf.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the buffered bytes, the last sector padded with zeros.
    fn flush(&mut self) -> Result<(), StoreError> {
        let mut buf = core::mem::take(&mut self.buf);
        buf.resize(buf.len().div_ceil(SECTOR) * SECTOR, 0);
        let put = self.put(&buf);
        buf.clear();
        self.buf = buf;
        put
    }

    /// Writes whole sectors after those written; `write` checked they fit,
    /// checked again here so that no request passes the extent.
    fn put(&mut self, sectors: &[u8]) -> Result<(), StoreError> {
        let n = (sectors.len() / SECTOR) as u64;
        if self.written.saturating_add(n) > self.room {
            return Err(StoreError::DiskFull {
                written: self.written * SECTOR as u64,
                largest: self.room.saturating_mul(SECTOR as u64),
            });
        }
        self.store.disk.write(self.start + self.written, sectors)?;
        self.written += n;
        Ok(())
    }

    /// Write the last sector and the directory entry: the snapshot is
    /// listed from here on.
    pub fn commit(mut self, taken_us: u64, board: u32) -> Result<Entry, StoreError> {
        let len = self.len();
        if !self.buf.is_empty() {
            self.flush()?;
        }
        let entry = Entry {
            name: self.name.clone(),
            vm: self.vm.clone(),
            len,
            taken_us,
            board,
            crc: self.crc.finish(),
            start: self.start,
            slot: self.slot,
        };
        self.store
            .disk
            .write(1 + entry.slot, &encode_entry(&entry))?;
        // Listed in directory order, as a fresh open lists it.
        let at = self.store.entries.partition_point(|e| e.slot < entry.slot);
        self.store.entries.insert(at, entry.clone());
        Ok(entry)
    }
}

/// A snapshot's bytes read in order, in runs of up to [`RUN_SECTORS`]
/// sectors, never past its length ([`Store::open_reader`]).
pub struct EntryReader<'a, D: Disk> {
    disk: &'a mut D,
    start: u64,
    len: u64,
    /// Bytes given out.
    read: u64,
    /// The next sector to read, from the snapshot's start.
    next: u64,
    /// The last run read, cut to the snapshot's length, and how much of it
    /// was given out.
    buf: Vec<u8>,
    at: usize,
}

impl<D: Disk> EntryReader<'_, D> {
    /// The snapshot's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.read)
    }

    /// The next `out.len()` bytes; past the snapshot's end nothing is read
    /// and it fails with [`StoreError::Truncated`].
    pub fn read(&mut self, mut out: &mut [u8]) -> Result<(), StoreError> {
        if out.len() as u64 > self.remaining() {
            return Err(StoreError::Truncated);
        }
        self.read += out.len() as u64;
        while !out.is_empty() {
            if self.at == self.buf.len() {
                if out.len() >= RUN {
                    // A whole run straight into `out`: inside the snapshot,
                    // as `out` is, and starting at a sector, as the
                    // buffer was used up.
                    let (run, rest) = out.split_at_mut(RUN);
                    self.disk.read(self.start + self.next, run)?;
                    self.next += RUN_SECTORS as u64;
                    out = rest;
                    continue;
                }
                self.fill()?;
                if self.buf.is_empty() {
                    return Err(StoreError::Truncated);
                }
            }
            let n = (self.buf.len() - self.at).min(out.len());
            let (part, rest) = out.split_at_mut(n);
            part.copy_from_slice(&self.buf[self.at..self.at + n]);
            self.at += n;
            out = rest;
        }
        Ok(())
    }

    /// The next run into the buffer.
    fn fill(&mut self) -> Result<(), StoreError> {
        let from = self.next * SECTOR as u64;
        let left = self.len.saturating_sub(from);
        let sectors = left.div_ceil(SECTOR as u64).min(RUN_SECTORS as u64);
        self.buf.resize(sectors as usize * SECTOR, 0);
        self.disk.read(self.start + self.next, &mut self.buf)?;
        self.next += sectors;
        self.buf.truncate(left.min(self.buf.len() as u64) as usize);
        self.at = 0;
        Ok(())
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

// An entry sector: magic (8), name length (1) and name (32), VM name
// length (1) and name (32), start, length, time (8 each), board, data CRC
// (4 each); the sector's CRC in its last 4 bytes.
const NAME_AT: usize = 8;
const VM_AT: usize = NAME_AT + 1 + NAME_MAX;
const START_AT: usize = VM_AT + 1 + NAME_MAX;
const LEN_AT: usize = START_AT + 8;
const TIME_AT: usize = LEN_AT + 8;
const BOARD_AT: usize = TIME_AT + 8;
const CRC_AT: usize = BOARD_AT + 4;

fn encode_entry(e: &Entry) -> [u8; SECTOR] {
    let mut s = [0u8; SECTOR];
    s[..8].copy_from_slice(ENTRY_MAGIC);
    for (at, name) in [(NAME_AT, &e.name), (VM_AT, &e.vm)] {
        s[at] = name.len() as u8;
        s[at + 1..at + 1 + name.len()].copy_from_slice(name.as_bytes());
    }
    s[START_AT..START_AT + 8].copy_from_slice(&e.start.to_le_bytes());
    s[LEN_AT..LEN_AT + 8].copy_from_slice(&e.len.to_le_bytes());
    s[TIME_AT..TIME_AT + 8].copy_from_slice(&e.taken_us.to_le_bytes());
    s[BOARD_AT..BOARD_AT + 4].copy_from_slice(&e.board.to_le_bytes());
    s[CRC_AT..CRC_AT + 4].copy_from_slice(&e.crc.to_le_bytes());
    let crc = crc32(&s[..SECTOR - 4]);
    s[SECTOR - 4..].copy_from_slice(&crc.to_le_bytes());
    s
}

/// An entry sector read back: None if it is free, damaged, or names an
/// extent outside the data area of a disk of `end` sectors.
fn decode_entry(s: &[u8; SECTOR], slot: u64, end: u64) -> Option<Entry> {
    if &s[..8] != ENTRY_MAGIC || crc32(&s[..SECTOR - 4]) != u32_at(s, SECTOR - 4) {
        return None;
    }
    let name = |at: usize| {
        let len = usize::from(s[at]);
        let text = core::str::from_utf8(s.get(at + 1..at + 1 + len)?).ok()?;
        name_of(text).ok()
    };
    let entry = Entry {
        name: name(NAME_AT)?,
        vm: name(VM_AT)?,
        start: u64_at(s, START_AT),
        len: u64_at(s, LEN_AT),
        taken_us: u64_at(s, TIME_AT),
        board: u32_at(s, BOARD_AT),
        crc: u32_at(s, CRC_AT),
        slot,
    };
    let last = entry.start.checked_add(entry.sectors())?;
    (entry.start >= DATA_START && last <= end).then_some(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::snapshot::testing::RamDisk as MemDisk;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn save(store: &mut Store<MemDisk>, name: &str, data: &[u8]) -> Result<Entry, StoreError> {
        let mut w = store.begin(name, "alpha")?;
        // In odd pieces, across sector ends.
        for piece in data.chunks(700) {
            w.write(piece)?;
        }
        w.commit(1234, 7)
    }

    fn load(store: &mut Store<MemDisk>, name: &str) -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::new();
        store.read(name, |part| {
            out.extend_from_slice(part);
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn a_snapshot_reads_back_after_the_disk_is_opened_again() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        assert!(store.list().is_empty());
        let data = bytes(5000, 1);
        let entry = save(&mut store, "before-upgrade", &data).unwrap();
        assert_eq!(entry.len, 5000);
        let mut store = Store::open(store.into_disk()).unwrap();
        assert_eq!(store.list().len(), 1);
        let e = &store.list()[0];
        assert_eq!(
            (e.name.as_str(), e.vm.as_str(), e.taken_us, e.board),
            ("before-upgrade", "alpha", 1234, 7)
        );
        assert_eq!(load(&mut store, "before-upgrade").unwrap(), data);
        store.verify("before-upgrade").unwrap();
    }

    #[test]
    fn names_are_checked_and_unique() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        assert_eq!(store.begin("", "alpha").err(), Some(StoreError::BadName));
        assert_eq!(store.begin("a b", "alpha").err(), Some(StoreError::BadName));
        assert_eq!(
            store.begin(&"x".repeat(33), "alpha").err(),
            Some(StoreError::BadName)
        );
        save(&mut store, "one", &[1, 2, 3]).unwrap();
        assert_eq!(
            save(&mut store, "one", &[4]).err(),
            Some(StoreError::Exists)
        );
        assert_eq!(store.delete("two"), Err(StoreError::NotFound));
        assert_eq!(load(&mut store, "two").err(), Some(StoreError::NotFound));
    }

    #[test]
    fn a_snapshot_that_does_not_fit_is_never_listed_and_takes_nothing() {
        // 400 sectors: 328 of data.
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        save(&mut store, "small", &bytes(100 * SECTOR, 2)).unwrap();
        let err = save(&mut store, "big", &bytes(300 * SECTOR, 3)).unwrap_err();
        assert!(
            matches!(err, StoreError::DiskFull { largest, .. } if largest == 228 * SECTOR as u64),
            "{err:?}"
        );
        let mut store = Store::open(store.into_disk()).unwrap();
        assert_eq!(store.list().len(), 1);
        // The space is free again: one that fits goes in.
        save(&mut store, "fits", &bytes(228 * SECTOR, 4)).unwrap();
        assert_eq!(load(&mut store, "small").unwrap(), bytes(100 * SECTOR, 2));
    }

    #[test]
    fn a_write_error_half_way_leaves_the_directory_as_it_was() {
        // 300 sectors: runs of 128, 128 and 44, then the entry; each of
        // the four writes fails in turn.
        for fail_at in 1..=4 {
            let mut disk = Store::open(MemDisk::new(400)).unwrap().into_disk();
            disk.writes = 0;
            disk.fail_at = Some(fail_at);
            let mut store = Store::open(disk).unwrap();
            assert_eq!(
                save(&mut store, "x", &bytes(300 * SECTOR, 5)).err(),
                Some(StoreError::Disk(DiskError("I/O error"))),
                "write {fail_at} failing"
            );
            let mut disk = store.into_disk();
            disk.fail_at = None;
            assert!(Store::open(disk).unwrap().list().is_empty());
        }
    }

    #[test]
    fn a_snapshot_is_written_in_runs_of_sectors() {
        let mut disk = Store::open(MemDisk::new(400)).unwrap().into_disk();
        disk.writes = 0;
        let mut store = Store::open(disk).unwrap();
        // 300 sectors and a bit, in pieces of 700 bytes: runs of 128, 128
        // and 45 sectors (the last padded), then the entry.
        let data = bytes(300 * SECTOR + 100, 6);
        save(&mut store, "runs", &data).unwrap();
        assert_eq!(store.into_disk().writes, 4);
        // In one piece: the whole runs go from the caller's bytes.
        let mut disk = Store::open(MemDisk::new(400)).unwrap().into_disk();
        disk.writes = 0;
        let mut store = Store::open(disk).unwrap();
        let mut w = store.begin("one", "alpha").unwrap();
        w.write(&data).unwrap();
        assert_eq!(w.len(), data.len() as u64);
        w.commit(0, 0).unwrap();
        assert_eq!(load(&mut store, "one").unwrap(), data);
        store.verify("one").unwrap();
        assert_eq!(store.into_disk().writes, 4);
    }

    #[test]
    fn the_disk_is_full_exactly_at_the_extents_end() {
        // 400 sectors: 328 of data, one extent.
        let largest = 328 * SECTOR as u64;
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        let data = bytes(328 * SECTOR, 7);
        save(&mut store, "full", &data).unwrap();
        assert_eq!(load(&mut store, "full").unwrap(), data);
        store.delete("full").unwrap();
        // One byte more, in pieces: the piece that passes the end is
        // refused whole, after the ones before it.
        let err = save(&mut store, "over", &bytes(328 * SECTOR + 1, 7)).unwrap_err();
        let written = (328 * SECTOR / 700 * 700) as u64;
        assert_eq!(err, StoreError::DiskFull { written, largest });
        // In one write: refused before anything is written.
        let mut w = store.begin("over", "alpha").unwrap();
        w.write(&[1; 10]).unwrap();
        assert_eq!(
            w.write(&bytes(328 * SECTOR, 8)),
            Err(StoreError::DiskFull {
                written: 10,
                largest
            })
        );
        drop(w);
        let mut disk = store.into_disk();
        disk.writes = 0;
        let mut store = Store::open(disk).unwrap();
        assert!(store.list().is_empty());
        let mut w = store.begin("over", "alpha").unwrap();
        assert!(matches!(
            w.write(&bytes(329 * SECTOR, 9)),
            Err(StoreError::DiskFull { written: 0, .. })
        ));
        drop(w);
        assert_eq!(store.into_disk().writes, 0);
    }

    #[test]
    fn an_entry_reader_reads_in_runs_and_never_past_the_end() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        let data = bytes(300 * SECTOR + 123, 10);
        save(&mut store, "s", &data).unwrap();
        assert_eq!(
            store.open_reader("nosuch").err(),
            Some(StoreError::NotFound)
        );
        // Small reads across sector and run ends, then a large one.
        let mut r = store.open_reader("s").unwrap();
        assert_eq!(
            (r.len(), r.remaining()),
            (data.len() as u64, data.len() as u64)
        );
        let mut back = Vec::new();
        let mut at = 0;
        for n in [1, 511, 600, 64 * 1024, 3, 70_000] {
            let mut part = alloc::vec![0; n];
            r.read(&mut part).unwrap();
            back.extend_from_slice(&part);
            at += n;
            assert_eq!(r.remaining(), (data.len() - at) as u64);
        }
        let mut rest = alloc::vec![0; data.len() - at];
        r.read(&mut rest).unwrap();
        back.extend_from_slice(&rest);
        assert_eq!(back, data);
        // Past the end: an error, not zeros, and nothing consumed.
        assert_eq!(r.read(&mut [0; 1]), Err(StoreError::Truncated));
        r.read(&mut []).unwrap();
        assert_eq!(r.remaining(), 0);
        // A read longer than what is left fails whole.
        let mut r = store.open_reader("s").unwrap();
        let mut all = alloc::vec![0; data.len() + 1];
        assert_eq!(r.read(&mut all), Err(StoreError::Truncated));
        assert_eq!(r.remaining(), data.len() as u64);
    }

    #[test]
    fn an_entry_reader_asks_the_disk_for_whole_runs() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        let data = bytes(300 * SECTOR + 123, 11);
        save(&mut store, "s", &data).unwrap();
        let mut disk = store.into_disk();
        // Opening reads the superblock and each directory entry.
        let opened = 1 + ENTRIES as usize;
        for (pieces, requests) in [
            // In one read: two runs straight into the caller's buffer,
            // then the last 45 sectors.
            (alloc::vec![data.len()], 3),
            // A header's worth first: the first run goes through the
            // reader's buffer, then the same runs.
            (alloc::vec![14, data.len() - 14], 3),
        ] {
            disk.reads = 0;
            let mut store = Store::open(&mut disk).unwrap();
            let mut r = store.open_reader("s").unwrap();
            let mut back = Vec::new();
            for n in pieces {
                let mut part = alloc::vec![0; n];
                r.read(&mut part).unwrap();
                back.extend_from_slice(&part);
            }
            assert_eq!(back, data);
            drop(store);
            assert_eq!(disk.reads, opened + requests);
        }
        // `verify` reads through the same runs.
        disk.reads = 0;
        Store::open(&mut disk).unwrap().verify("s").unwrap();
        assert_eq!(disk.reads, opened + 3);
    }

    #[test]
    fn a_snapshot_in_a_freed_slot_is_listed_in_directory_order() {
        // Found by the snapshot_store fuzz target: the list and a fresh
        // open of the same disk disagreed on the order.
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        save(&mut store, "a", &bytes(SECTOR, 1)).unwrap();
        save(&mut store, "b", &bytes(SECTOR, 2)).unwrap();
        store.delete("a").unwrap();
        save(&mut store, "c", &bytes(SECTOR, 3)).unwrap();
        let names = |s: &Store<MemDisk>| {
            s.list()
                .iter()
                .map(|e| e.name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&store), ["c", "b"]);
        let store = Store::open(store.into_disk()).unwrap();
        assert_eq!(names(&store), ["c", "b"]);
    }

    #[test]
    fn deleting_frees_the_space_and_the_slot() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        save(&mut store, "a", &bytes(200 * SECTOR, 6)).unwrap();
        assert!(matches!(
            save(&mut store, "b", &bytes(200 * SECTOR, 7)),
            Err(StoreError::DiskFull { .. })
        ));
        store.delete("a").unwrap();
        save(&mut store, "b", &bytes(200 * SECTOR, 7)).unwrap();
        let mut store = Store::open(store.into_disk()).unwrap();
        assert_eq!(
            store
                .list()
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>(),
            ["b"]
        );
        assert_eq!(load(&mut store, "b").unwrap(), bytes(200 * SECTOR, 7));
    }

    #[test]
    fn the_directory_holds_at_most_its_entries() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        for n in 0..ENTRIES {
            save(&mut store, &alloc::format!("s{n}"), &[n as u8]).unwrap();
        }
        assert_eq!(
            save(&mut store, "one-more", &[0]).err(),
            Some(StoreError::DirectoryFull)
        );
    }

    #[test]
    fn damaged_bytes_fail_their_checksum() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        save(&mut store, "s", &bytes(3000, 8)).unwrap();
        let mut disk = store.into_disk();
        disk.bytes[DATA_START as usize * SECTOR + 1000] ^= 1;
        let mut store = Store::open(disk).unwrap();
        assert_eq!(store.verify("s"), Err(StoreError::Checksum));
    }

    #[test]
    fn a_disk_that_is_not_ours_is_left_alone() {
        let mut disk = MemDisk::new(400);
        disk.bytes[..4].copy_from_slice(b"\x7fELF");
        let before = disk.bytes.clone();
        let Err(err) = Store::open(disk) else {
            panic!("opened")
        };
        assert_eq!(err, StoreError::NotOurs);
        assert_eq!(before[..4], *b"\x7fELF");
        assert_eq!(
            Store::open(MemDisk::new(DATA_START)).err(),
            Some(StoreError::TooSmall)
        );
    }

    #[test]
    fn damaged_or_overlapping_entries_are_not_listed() {
        let mut store = Store::open(MemDisk::new(400)).unwrap();
        save(&mut store, "a", &bytes(10 * SECTOR, 9)).unwrap();
        save(&mut store, "b", &bytes(10 * SECTOR, 9)).unwrap();
        let mut disk = store.into_disk();
        // b's entry (slot 1) made to point into a's extent, re-sealed.
        let at = 2 * SECTOR;
        let mut entry = [0u8; SECTOR];
        entry.copy_from_slice(&disk.bytes[at..at + SECTOR]);
        entry[START_AT..START_AT + 8].copy_from_slice(&(DATA_START + 5).to_le_bytes());
        let crc = crc32(&entry[..SECTOR - 4]);
        entry[SECTOR - 4..].copy_from_slice(&crc.to_le_bytes());
        disk.bytes[at..at + SECTOR].copy_from_slice(&entry);
        // Both sealed, but overlapping: the later one is not listed, and
        // is erased.
        let store = Store::open(disk).unwrap();
        let names = |s: &Store<MemDisk>| {
            s.list()
                .iter()
                .map(|e| e.name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&store), ["a"]);
        let mut disk = store.into_disk();
        assert!(disk.bytes[at..at + SECTOR].iter().all(|&b| b == 0));
        // a's entry damaged in one byte: not listed; b does not come back
        // (had it, a snapshot written into the space a left would have
        // been hidden by it on the next open).
        disk.bytes[SECTOR + 20] ^= 0x40;
        let store = Store::open(disk).unwrap();
        assert!(names(&store).is_empty());
    }
}
