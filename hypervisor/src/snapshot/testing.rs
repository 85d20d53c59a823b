//! A disk in memory for host tests and the fuzz target (feature
//! `testing`): sectors in a `Vec`, requests counted, and a write that
//! fails on demand.

extern crate alloc;

use alloc::vec;
use alloc::vec::Vec;

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
