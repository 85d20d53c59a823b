//! For host tests and the fuzz targets (feature `testing`): a disk in
//! memory (sectors in a `Vec`, requests counted, a write that fails on
//! demand), and everything a snapshot reader gets from some bytes.

extern crate alloc;

use alloc::vec;
use alloc::vec::Vec;

use alloc::boxed::Box;

use super::format::{FormatError, Header, Page, SectionKind, SnapshotReader, Totals, PAGE};
use super::store::{Disk, DiskError, SECTOR};

pub struct RamDisk {
    pub bytes: Vec<u8>,
    /// Reads so far (requests, whatever their length).
    pub reads: usize,
    /// Writes so far, and the first one (counting from 1) that fails, with
    /// every one after it.
    pub writes: usize,
    pub fail_at: Option<usize>,
}

impl RamDisk {
    /// `sectors` zeroed sectors: a new, empty disk.
    pub fn new(sectors: u64) -> Self {
        Self::from_bytes(vec![0; sectors as usize * SECTOR])
    }

    /// A disk holding `bytes` (whole sectors are used).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            reads: 0,
            writes: 0,
            fail_at: None,
        }
    }

    fn range(&self, sector: u64, len: usize) -> Result<core::ops::Range<usize>, DiskError> {
        let at = usize::try_from(sector)
            .ok()
            .and_then(|s| s.checked_mul(SECTOR))
            .ok_or(DiskError("beyond the end"))?;
        let end = at.checked_add(len).ok_or(DiskError("beyond the end"))?;
        if end > self.bytes.len() {
            return Err(DiskError("beyond the end"));
        }
        Ok(at..end)
    }
}

impl Disk for RamDisk {
    fn sectors(&self) -> u64 {
        (self.bytes.len() / SECTOR) as u64
    }

    fn read(&mut self, sector: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        self.reads += 1;
        let r = self.range(sector, buf.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(())
    }

    fn write(&mut self, sector: u64, buf: &[u8]) -> Result<(), DiskError> {
        self.writes += 1;
        if self.fail_at.is_some_and(|n| self.writes >= n) {
            return Err(DiskError("I/O error"));
        }
        let r = self.range(sector, buf.len())?;
        self.bytes[r].copy_from_slice(buf);
        Ok(())
    }
}

/// A page as a test keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnedPage {
    NotBacked,
    Zero,
    Data(Box<[u8; PAGE]>),
}

impl OwnedPage {
    pub fn page(&self) -> Page<'_> {
        match self {
            OwnedPage::NotBacked => Page::NotBacked,
            OwnedPage::Zero => Page::Zero,
            OwnedPage::Data(d) => Page::Data(d),
        }
    }

    pub fn of(page: Page<'_>) -> Self {
        match page {
            Page::NotBacked => OwnedPage::NotBacked,
            Page::Zero => OwnedPage::Zero,
            Page::Data(d) => OwnedPage::Data(Box::new(*d)),
        }
    }
}

/// The three sections, in the order a snapshot has them.
pub const SECTION_KINDS: [SectionKind; 3] = [
    SectionKind::Config,
    SectionKind::Vcpus,
    SectionKind::Devices,
];

/// Everything a reader got from some bytes, and how it ended.
#[derive(Debug)]
pub struct ReadAll {
    pub header: Option<Header>,
    pub sections: Vec<Vec<u8>>,
    /// Each page as delivered, with its page number.
    pub pages: Vec<(u64, OwnedPage)>,
    pub result: Result<Totals, FormatError>,
}

/// Read `bytes` as far as the reader goes.
pub fn read_all(bytes: &[u8]) -> ReadAll {
    let mut out = ReadAll {
        header: None,
        sections: Vec::new(),
        pages: Vec::new(),
        result: Err(FormatError::Invalid("not read")),
    };
    let (mut r, header) = match SnapshotReader::open(bytes) {
        Ok(opened) => opened,
        Err(e) => {
            out.result = Err(e);
            return out;
        }
    };
    out.header = Some(header);
    for kind in SECTION_KINDS {
        match r.section(kind) {
            Ok(bytes) => out.sections.push(bytes),
            Err(e) => {
                out.result = Err(e);
                return out;
            }
        }
    }
    out.result = r.pages(|pfn, page| {
        out.pages.push((pfn, OwnedPage::of(page)));
        Ok::<_, FormatError>(())
    });
    out
}
