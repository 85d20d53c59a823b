//! The snapshot format: the layout of the byte stream a snapshot of a VM
//! is, written into the store and read back (docs/SNAPSHOT.md has it byte
//! by byte). It owns the header, the framing and checksum of every part,
//! and guest memory as chunks of pages; the configuration, vCPU and device
//! sections are opaque bytes to it (what the VM's `SaveState`
//! implementations wrote), handed back only once their checksum matches.
//!
//! The bytes come from a disk that can be damaged or swapped, so every
//! number in them is bounded where it is read: a section is at most
//! [`MAX_SECTION`] bytes and a chunk at most [`CHUNK_PAGES`] pages, checked
//! before anything is allocated for it; a reader holds one section or one
//! chunk at a time whatever the lengths say, and no page reaches its
//! caller before the whole chunk holding it was checked.

extern crate alloc;

use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

use guest_bundle::Crc32;

use crate::bundle_crc::crc32;
use crate::snapshot::store::{Disk, EntryReader, StoreError, Writer};

pub const MAGIC: [u8; 8] = *b"TIDALVM\0";
/// Any change of the layout takes a new version; a reader refuses every
/// version but its own.
pub const VERSION: u16 = 1;
/// Pages per memory chunk.
pub const CHUNK_PAGES: usize = 64;
/// The largest opaque section (config, vCPUs, devices) a reader accepts.
pub const MAX_SECTION: usize = 1 << 20;
/// The largest guest RAM a snapshot may describe (8 GiB in pages).
pub const MAX_RAM_PAGES: u64 = (8 << 30) / 4096;
pub const PAGE: usize = 4096;
/// The header's length, its checksum included.
pub const HEADER_LEN: usize = 60;
/// What starts a memory chunk, and the end marker.
pub const CHUNK_TAG: u32 = 0x4D45_4D00;
pub const END_TAG: u32 = 0x454E_4400;
/// The end marker's length: its tag, the three totals and its checksum.
pub const END_LEN: usize = 4 + 3 * 8 + 4;

/// A chunk's tag, first pfn and page count.
const CHUNK_HEAD: usize = 4 + 8 + 2;
/// Bytes of page kinds in a full chunk (2 bits a page).
const MAX_KINDS: usize = CHUNK_PAGES / 4;
/// Where a chunk buffer holds its first data page: the head and the kinds
/// go right before it, so that a whole chunk is one slice (one checksum
/// pass, one write) and its pages are not copied again.
const DATA_AT: usize = 32;
const _: () = assert!(DATA_AT >= CHUNK_HEAD + MAX_KINDS && CHUNK_PAGES.is_multiple_of(4));
const CHUNK_MAX: usize = DATA_AT + CHUNK_PAGES * PAGE + 4;

/// A page's kind in a chunk (two bits; 3 is none).
const NOT_BACKED: u8 = 0;
const ZERO: u8 = 1;
const DATA: u8 = 2;

/// Where a snapshot's bytes go, in order (the store's [`Writer`]; a `Vec`
/// in tests).
pub trait Sink {
    fn write(&mut self, bytes: &[u8]) -> Result<(), StoreError>;
}

/// Where they come from, in order.
pub trait Source {
    /// Exactly `buf.len()` bytes, or an error ([`StoreError::Truncated`]
    /// when the source ends first).
    fn read(&mut self, buf: &mut [u8]) -> Result<(), StoreError>;
    /// Bytes left, when the source knows (a store entry, a slice): the
    /// reader then refuses any after the end marker. A stream that cannot
    /// tell says `None`.
    fn remaining(&self) -> Option<u64> {
        None
    }
}

impl Sink for Vec<u8> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.extend_from_slice(bytes);
        Ok(())
    }
}

impl<T: Sink + ?Sized> Sink for &mut T {
    fn write(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        (**self).write(bytes)
    }
}

/// A cursor: what is read is cut off the front.
impl Source for &[u8] {
    fn read(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        let (head, rest) = self
            .split_at_checked(buf.len())
            .ok_or(StoreError::Truncated)?;
        buf.copy_from_slice(head);
        *self = rest;
        Ok(())
    }
    fn remaining(&self) -> Option<u64> {
        Some(self.len() as u64)
    }
}

impl<T: Source + ?Sized> Source for &mut T {
    fn read(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        (**self).read(buf)
    }
    fn remaining(&self) -> Option<u64> {
        (**self).remaining()
    }
}

// The store's writer and reader are a sink and a source here, not in
// store.rs: the store knows nothing of what a snapshot holds.
impl<D: Disk> Sink for Writer<'_, D> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        Writer::write(self, bytes)
    }
}

impl<D: Disk> Source for EntryReader<'_, D> {
    fn read(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        EntryReader::read(self, buf)
    }
    fn remaining(&self) -> Option<u64> {
        Some(EntryReader::remaining(self))
    }
}

/// What a snapshot was taken of; a restore checks it against the board
/// and the VM it restores into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Board and GIC tag (also the store entry's `board`): the reader
    /// compares it, the format does not interpret it.
    pub board: u32,
    /// 0: no GIC, 2 or 3.
    pub gic: u8,
    /// MIDR_EL1 of the CPU it was taken on.
    pub midr: u64,
    /// vCPUs (1..=[`crate::limits::MAX_VCPUS`]).
    pub vcpus: u8,
    /// Generic timer frequency (Hz, nonzero) and the guest's virtual
    /// counter when it was paused.
    pub counter_hz: u64,
    pub guest_counter: u64,
    /// Guest RAM: first guest-physical address (page aligned) and pages
    /// (1..=[`MAX_RAM_PAGES`]).
    pub ram_base: u64,
    pub ram_pages: u64,
}

impl Header {
    /// Every field in range: what a writer writes, a reader takes.
    fn check(&self) -> Result<(), FormatError> {
        let invalid = |why| Err(FormatError::Invalid(why));
        if !matches!(self.gic, 0 | 2 | 3) {
            return invalid("the GIC version is not 0, 2 or 3");
        }
        if self.vcpus == 0 || usize::from(self.vcpus) > crate::limits::MAX_VCPUS {
            return invalid("the number of vCPUs is not one this build runs");
        }
        if self.counter_hz == 0 {
            return invalid("the timer frequency is zero");
        }
        if !self.ram_base.is_multiple_of(PAGE as u64) {
            return invalid("guest RAM does not start at a page boundary");
        }
        if self.ram_pages == 0 || self.ram_pages > MAX_RAM_PAGES {
            return invalid("guest RAM is empty or larger than 8 GiB");
        }
        let end = self
            .ram_pages
            .checked_mul(PAGE as u64)
            .and_then(|bytes| self.ram_base.checked_add(bytes));
        if end.is_none() {
            return invalid("guest RAM ends past the address space");
        }
        Ok(())
    }

    fn encode(&self) -> [u8; HEADER_LEN] {
        let fields: [&[u8]; 10] = [
            &MAGIC,
            &VERSION.to_le_bytes(),
            &[self.gic],
            &[self.vcpus],
            &self.board.to_le_bytes(),
            &self.midr.to_le_bytes(),
            &self.counter_hz.to_le_bytes(),
            &self.guest_counter.to_le_bytes(),
            &self.ram_base.to_le_bytes(),
            &self.ram_pages.to_le_bytes(),
        ];
        let mut b = [0; HEADER_LEN];
        let mut at = 0;
        for field in fields {
            b[at..at + field.len()].copy_from_slice(field);
            at += field.len();
        }
        let crc = crc32(&b[..at]);
        b[at..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The fields after the magic and the version, in order.
    fn decode(fields: &mut Fields<'_>) -> Self {
        let gic = fields.u8();
        let vcpus = fields.u8();
        Header {
            gic,
            vcpus,
            board: fields.u32(),
            midr: fields.u64(),
            counter_hz: fields.u64(),
            guest_counter: fields.u64(),
            ram_base: fields.u64(),
            ram_pages: fields.u64(),
        }
    }
}

/// An opaque section; they come in this order, each once, before memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SectionKind {
    Config = 1,
    Vcpus = 2,
    Devices = 3,
}

impl SectionKind {
    /// What it is, for messages.
    pub fn name(self) -> &'static str {
        match self {
            SectionKind::Config => "configuration section",
            SectionKind::Vcpus => "vCPU section",
            SectionKind::Devices => "device section",
        }
    }

    fn next(self) -> Stage {
        match self {
            SectionKind::Config => Stage::Section(SectionKind::Vcpus),
            SectionKind::Vcpus => Stage::Section(SectionKind::Devices),
            SectionKind::Devices => Stage::Pages,
        }
    }

    fn missing(self) -> &'static str {
        match self {
            SectionKind::Config => "the configuration section is not where it belongs",
            SectionKind::Vcpus => "the vCPU section is not where it belongs",
            SectionKind::Devices => "the device section is not where it belongs",
        }
    }
}

/// One guest page as the snapshot has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Page<'a> {
    /// Never touched, or given back by the balloon: no frame behind it,
    /// and none after a restore.
    NotBacked,
    /// Backed, all zeros: one bit pair, no data.
    Zero,
    Data(&'a [u8; PAGE]),
}

/// Pages of each kind in a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub not_backed: u64,
    pub zero: u64,
    pub data: u64,
}

impl Totals {
    /// Every page.
    pub fn pages(&self) -> u64 {
        self.not_backed
            .saturating_add(self.zero)
            .saturating_add(self.data)
    }

    fn count(&mut self, kind: u8) {
        let n = match kind {
            NOT_BACKED => &mut self.not_backed,
            ZERO => &mut self.zero,
            _ => &mut self.data,
        };
        *n = n.saturating_add(1);
    }
}

/// Why a snapshot was not written or not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatError {
    Store(StoreError),
    /// Not a snapshot at all (its magic).
    NotASnapshot,
    /// A format version this build does not read.
    Version(u16),
    /// The header, a section or the end marker fails its checksum: which.
    Checksum(&'static str),
    /// A value no writer writes, or a writer used out of order: what.
    Invalid(&'static str),
    /// The memory chunk expected at guest page `pfn` (from `ram_base`)
    /// fails its checksum.
    ChunkChecksum {
        pfn: u64,
    },
    /// The memory chunk expected at guest page `pfn` is one no writer
    /// writes: why.
    BadChunk {
        pfn: u64,
        why: &'static str,
    },
}

impl From<StoreError> for FormatError {
    fn from(e: StoreError) -> Self {
        FormatError::Store(e)
    }
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Store(e) => write!(f, "{e}"),
            FormatError::NotASnapshot => write!(f, "this is not a Tidal snapshot"),
            FormatError::Version(v) => write!(
                f,
                "the snapshot is in format version {v}; this build reads version {VERSION} only"
            ),
            FormatError::Checksum(part) => {
                write!(f, "the snapshot's {part} fails its checksum: it is damaged")
            }
            FormatError::Invalid(why) => write!(f, "invalid snapshot: {why}"),
            FormatError::ChunkChecksum { pfn } => write!(
                f,
                "the snapshot's memory chunk at page {pfn} fails its checksum: it is damaged"
            ),
            FormatError::BadChunk { pfn, why } => {
                write!(
                    f,
                    "the snapshot's memory chunk at page {pfn} is invalid: {why}"
                )
            }
        }
    }
}

/// Where a writer or a reader is in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// This section is next.
    Section(SectionKind),
    Pages,
    Done,
    /// A write or a read failed part way: the stream's position is lost.
    Broken,
}

/// Writes one snapshot: the header, the three sections, every page, the
/// end marker.
pub struct SnapshotWriter<S: Sink> {
    sink: S,
    ram_pages: u64,
    stage: Stage,
    /// Pages given: the next one's pfn.
    next: u64,
    /// The chunk being filled: its pages' kinds and, from [`DATA_AT`],
    /// their data.
    kinds: [u8; MAX_KINDS],
    count: usize,
    buf: Vec<u8>,
    totals: Totals,
}

impl<S: Sink> SnapshotWriter<S> {
    /// Writes the header.
    pub fn new(mut sink: S, header: &Header) -> Result<Self, FormatError> {
        header.check()?;
        sink.write(&header.encode())?;
        let mut buf = Vec::with_capacity(CHUNK_MAX);
        buf.resize(DATA_AT, 0);
        Ok(Self {
            sink,
            ram_pages: header.ram_pages,
            stage: Stage::Section(SectionKind::Config),
            next: 0,
            kinds: [0; MAX_KINDS],
            count: 0,
            buf,
            totals: Totals::default(),
        })
    }

    /// An opaque section; sections are written Config, Vcpus, Devices in
    /// that order, each once, before any page.
    pub fn section(&mut self, kind: SectionKind, bytes: &[u8]) -> Result<(), FormatError> {
        if self.stage != Stage::Section(kind) {
            return Err(FormatError::Invalid(
                "sections are written configuration, vCPUs, devices, each once, before any page",
            ));
        }
        let len = u32::try_from(bytes.len())
            .ok()
            .filter(|_| bytes.len() <= MAX_SECTION)
            .ok_or(FormatError::Invalid("a section is larger than 1 MiB"))?;
        let mut head = [0; 8];
        head[..4].copy_from_slice(&(kind as u32).to_le_bytes());
        head[4..].copy_from_slice(&len.to_le_bytes());
        let mut crc = Crc32::new();
        crc.update(&head);
        crc.update(bytes);
        for part in [&head[..], bytes, &crc.finish().to_le_bytes()] {
            emit(&mut self.sink, &mut self.stage, part)?;
        }
        self.stage = kind.next();
        Ok(())
    }

    /// The next page, in guest-physical order from page 0; exactly
    /// `ram_pages` of them. A chunk is written when full.
    pub fn page(&mut self, page: Page<'_>) -> Result<(), FormatError> {
        if self.stage != Stage::Pages {
            return Err(FormatError::Invalid(
                "pages are written after the three sections, before finish",
            ));
        }
        if self.next >= self.ram_pages {
            return Err(FormatError::Invalid("more pages than the header's RAM"));
        }
        let kind = match page {
            Page::NotBacked => NOT_BACKED,
            Page::Zero => ZERO,
            Page::Data(data) => {
                self.buf.extend_from_slice(data);
                DATA
            }
        };
        // Below CHUNK_PAGES: a full chunk is written at once.
        if let Some(byte) = self.kinds.get_mut(self.count / 4) {
            *byte |= kind << (2 * (self.count % 4));
        }
        self.count += 1;
        self.next += 1;
        self.totals.count(kind);
        if self.count == CHUNK_PAGES {
            self.write_chunk()?;
        }
        Ok(())
    }

    /// The chunk buffered: head and kinds put before its data, sealed,
    /// written in one piece.
    fn write_chunk(&mut self) -> Result<(), FormatError> {
        let count = self.count;
        let kinds = count.div_ceil(4);
        let from = DATA_AT - kinds - CHUNK_HEAD;
        let first = self.next - count as u64;
        let head = &mut self.buf[from..DATA_AT];
        head[..4].copy_from_slice(&CHUNK_TAG.to_le_bytes());
        head[4..12].copy_from_slice(&first.to_le_bytes());
        head[12..14].copy_from_slice(&(count as u16).to_le_bytes());
        head[14..].copy_from_slice(&self.kinds[..kinds]);
        let crc = crc32(&self.buf[from..]);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        emit(&mut self.sink, &mut self.stage, &self.buf[from..])?;
        self.buf.truncate(DATA_AT);
        self.kinds = [0; MAX_KINDS];
        self.count = 0;
        Ok(())
    }

    /// Writes the last chunk and the end marker (with the totals); the
    /// sink back.
    pub fn finish(mut self) -> Result<(S, Totals), FormatError> {
        if self.stage != Stage::Pages || self.next != self.ram_pages {
            return Err(FormatError::Invalid(
                "finished before every section and page was written",
            ));
        }
        if self.count > 0 {
            self.write_chunk()?;
        }
        let mut end = [0; END_LEN];
        end[..4].copy_from_slice(&END_TAG.to_le_bytes());
        end[4..12].copy_from_slice(&self.totals.not_backed.to_le_bytes());
        end[12..20].copy_from_slice(&self.totals.zero.to_le_bytes());
        end[20..28].copy_from_slice(&self.totals.data.to_le_bytes());
        let crc = crc32(&end[..28]);
        end[28..].copy_from_slice(&crc.to_le_bytes());
        emit(&mut self.sink, &mut self.stage, &end)?;
        Ok((self.sink, self.totals))
    }

    /// Pages given so far, by kind.
    pub fn totals(&self) -> Totals {
        self.totals
    }
}

/// `bytes` into the sink; a failure leaves the stream broken.
fn emit<S: Sink>(sink: &mut S, stage: &mut Stage, bytes: &[u8]) -> Result<(), FormatError> {
    sink.write(bytes).map_err(|e| {
        *stage = Stage::Broken;
        FormatError::Store(e)
    })
}

/// Reads one snapshot back, each part checked before it is used.
pub struct SnapshotReader<S: Source> {
    source: S,
    ram_pages: u64,
    stage: Stage,
    /// The chunk being read, laid out as the writer's; grows to one chunk
    /// at most and is reused.
    buf: Vec<u8>,
}

/// A chunk read and checked: its pages' kinds.
struct Chunk {
    count: usize,
    kinds: [u8; CHUNK_PAGES],
}

impl<S: Source> SnapshotReader<S> {
    /// Reads and checks the header (magic, version, checksum, every field
    /// in range).
    pub fn open(mut source: S) -> Result<(Self, Header), FormatError> {
        let mut b = [0; HEADER_LEN];
        let (start, rest) = b.split_at_mut(MAGIC.len() + 2);
        source.read(start)?;
        if start[..MAGIC.len()] != MAGIC {
            return Err(FormatError::NotASnapshot);
        }
        let version = u16::from_le_bytes([start[8], start[9]]);
        if version != VERSION {
            return Err(FormatError::Version(version));
        }
        source.read(rest)?;
        let (sealed, crc) = b.split_at(HEADER_LEN - 4);
        if crc32(sealed) != Fields(crc).u32() {
            return Err(FormatError::Checksum("header"));
        }
        let header = Header::decode(&mut Fields(&sealed[MAGIC.len() + 2..]));
        header.check()?;
        let reader = Self {
            source,
            ram_pages: header.ram_pages,
            stage: Stage::Section(SectionKind::Config),
            buf: Vec::new(),
        };
        Ok((reader, header))
    }

    /// The next section, which must be `kind`; its bytes (at most
    /// [`MAX_SECTION`]) checked against its checksum before they are
    /// returned.
    pub fn section(&mut self, kind: SectionKind) -> Result<Vec<u8>, FormatError> {
        if self.stage != Stage::Section(kind) {
            return Err(FormatError::Invalid(
                "sections are read configuration, vCPUs, devices, each once, before the pages",
            ));
        }
        self.stage = Stage::Broken;
        let mut head = [0; 8];
        self.source.read(&mut head)?;
        let mut fields = Fields(&head);
        if fields.u32() != kind as u32 {
            return Err(FormatError::Invalid(kind.missing()));
        }
        let len = usize::try_from(fields.u32())
            .ok()
            .filter(|len| *len <= MAX_SECTION)
            .ok_or(FormatError::Invalid("a section is larger than 1 MiB"))?;
        let mut bytes = vec![0; len];
        self.source.read(&mut bytes)?;
        let mut sealed = [0; 4];
        self.source.read(&mut sealed)?;
        let mut crc = Crc32::new();
        crc.update(&head);
        crc.update(&bytes);
        if crc.finish() != u32::from_le_bytes(sealed) {
            return Err(FormatError::Checksum(kind.name()));
        }
        self.stage = kind.next();
        Ok(bytes)
    }

    /// Every page in order, each chunk checked (checksum, kinds, pfns
    /// contiguous from where the last ended, within `ram_pages`) before
    /// any of its pages goes to `each`; then the end marker, whose totals
    /// must be what was read, and nothing after it. `each` gets (pfn from
    /// `ram_base`, page); an error from it stops the read and is returned
    /// as it is.
    pub fn pages<E: From<FormatError>>(
        &mut self,
        mut each: impl FnMut(u64, Page<'_>) -> Result<(), E>,
    ) -> Result<Totals, E> {
        if self.stage != Stage::Pages {
            return Err(
                FormatError::Invalid("pages are read after the three sections, once").into(),
            );
        }
        self.stage = Stage::Broken;
        let mut next = 0;
        let mut totals = Totals::default();
        loop {
            let mut tag = [0; 4];
            self.source.read(&mut tag).map_err(FormatError::from)?;
            match u32::from_le_bytes(tag) {
                CHUNK_TAG => {
                    let chunk = self.chunk(next)?;
                    let mut data = self.buf.get(DATA_AT..).unwrap_or_default();
                    for (pfn, &kind) in (next..).zip(&chunk.kinds[..chunk.count]) {
                        let page = match kind {
                            NOT_BACKED => Page::NotBacked,
                            ZERO => Page::Zero,
                            _ => {
                                let (page, rest) = data
                                    .split_first_chunk::<PAGE>()
                                    .ok_or(FormatError::Invalid("a chunk lost its data"))?;
                                data = rest;
                                Page::Data(page)
                            }
                        };
                        each(pfn, page)?;
                        totals.count(kind);
                    }
                    next += chunk.count as u64;
                }
                END_TAG => {
                    self.end(next, totals)?;
                    self.stage = Stage::Done;
                    return Ok(totals);
                }
                _ => {
                    return Err(FormatError::BadChunk {
                        pfn: next,
                        why: "neither a memory chunk nor the end marker comes next",
                    }
                    .into())
                }
            }
        }
    }

    /// The rest of a chunk after its tag, expected at page `next`, read
    /// whole into the buffer and checked.
    fn chunk(&mut self, next: u64) -> Result<Chunk, FormatError> {
        let bad = |why| FormatError::BadChunk { pfn: next, why };
        let mut head = [0; CHUNK_HEAD];
        head[..4].copy_from_slice(&CHUNK_TAG.to_le_bytes());
        self.source.read(&mut head[4..])?;
        let mut fields = Fields(&head[4..]);
        let first = fields.u64();
        let count = usize::from(fields.u16());
        if count == 0 || count > CHUNK_PAGES {
            return Err(bad("it holds no page, or more than 64"));
        }
        let kinds_len = count.div_ceil(4);
        let from = DATA_AT - kinds_len - CHUNK_HEAD;
        if self.buf.len() < DATA_AT {
            self.buf.resize(DATA_AT, 0);
        }
        self.buf[from..from + CHUNK_HEAD].copy_from_slice(&head);
        self.source
            .read(&mut self.buf[DATA_AT - kinds_len..DATA_AT])?;
        let mut kinds = [0; CHUNK_PAGES];
        let mut data = 0;
        for (i, kind) in kinds.iter_mut().enumerate().take(kinds_len * 4) {
            let bits = (self.buf[DATA_AT - kinds_len + i / 4] >> (2 * (i % 4))) & 3;
            if i >= count {
                if bits != 0 {
                    return Err(bad("bits are set after its last page's kind"));
                }
            } else if bits > DATA {
                return Err(bad("a page's kind is 3, which no writer writes"));
            }
            data += usize::from(bits == DATA);
            *kind = bits;
        }
        let end = DATA_AT + data * PAGE;
        if self.buf.len() < end + 4 {
            self.buf.resize(end + 4, 0);
        }
        self.source.read(&mut self.buf[DATA_AT..end + 4])?;
        if crc32(&self.buf[from..end]) != Fields(&self.buf[end..end + 4]).u32() {
            return Err(FormatError::ChunkChecksum { pfn: next });
        }
        if first != next {
            return Err(bad("its first page is not the one after the last chunk's"));
        }
        if first.saturating_add(count as u64) > self.ram_pages {
            return Err(bad("it goes past the end of guest RAM"));
        }
        Ok(Chunk { count, kinds })
    }

    /// The end marker after its tag, with `next` pages read, `totals` of
    /// each kind.
    fn end(&mut self, next: u64, totals: Totals) -> Result<(), FormatError> {
        let mut end = [0; END_LEN];
        end[..4].copy_from_slice(&END_TAG.to_le_bytes());
        self.source.read(&mut end[4..])?;
        let (sealed, crc) = end.split_at(END_LEN - 4);
        if crc32(sealed) != Fields(crc).u32() {
            return Err(FormatError::Checksum("end marker"));
        }
        if next != self.ram_pages {
            return Err(FormatError::BadChunk {
                pfn: next,
                why: "the snapshot ends before its last page",
            });
        }
        let mut fields = Fields(&sealed[4..]);
        let said = Totals {
            not_backed: fields.u64(),
            zero: fields.u64(),
            data: fields.u64(),
        };
        if said != totals {
            return Err(FormatError::Invalid(
                "the end marker's page counts differ from the pages read",
            ));
        }
        if self.source.remaining().is_some_and(|n| n > 0) {
            return Err(FormatError::Invalid("bytes follow the end marker"));
        }
        Ok(())
    }
}

/// Little-endian fields taken in order from a part read whole (its length
/// fixed, so a short one is a bug: it reads as zeros, never a panic).
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        match self.0.split_first_chunk::<N>() {
            Some((head, rest)) => {
                self.0 = rest;
                *head
            }
            None => {
                self.0 = &[];
                [0; N]
            }
        }
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}
