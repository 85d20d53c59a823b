//! A device's state as bytes, and back: what a snapshot or a migration
//! carries of each emulated device (issue: one interface per device, so
//! that nothing is forgotten when a VM moves).
//!
//! [`SaveState::save`] writes a device's whole state with a
//! [`StateWriter`]; [`SaveState::restore`] reads it back with a
//! [`StateReader`] and builds the device only if every field is one the
//! device could have reached: the bytes may come from a damaged or swapped
//! disk, or a peer, so reading them is parsing untrusted input. Fields are
//! little-endian and fixed-width, in the order the device writes them; a
//! device's state starts with its own version byte, so a format change is
//! refused rather than misread.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

/// The largest counter or time a saved state may hold
/// ([`StateReader::count`]).
pub const MAX_COUNT: u64 = 1 << 62;

/// Why a device's saved state was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateError {
    /// The bytes end before the state does.
    Truncated,
    /// Bytes are left after the state.
    Trailing,
    /// A version this build does not read.
    Version { device: &'static str, found: u8 },
    /// A field no device could have: which one.
    Invalid(&'static str),
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateError::Truncated => write!(f, "the saved state is cut short"),
            StateError::Trailing => write!(f, "bytes follow the saved state"),
            StateError::Version { device, found } => {
                write!(
                    f,
                    "{device}: saved state version {found} is not one this build reads"
                )
            }
            StateError::Invalid(what) => write!(f, "invalid saved state: {what}"),
        }
    }
}

/// A device's state, saved and restored.
pub trait SaveState: Sized {
    /// Write the whole state.
    fn save(&self, w: &mut StateWriter);
    /// Read a state [`SaveState::save`] wrote; every field checked.
    fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError>;
}

/// `state` saved into a new buffer.
pub fn to_bytes(state: &impl SaveState) -> Vec<u8> {
    let mut w = StateWriter::default();
    state.save(&mut w);
    w.into_bytes()
}

/// A state restored from `bytes`, all of them.
pub fn from_bytes<T: SaveState>(bytes: &[u8]) -> Result<T, StateError> {
    let mut r = StateReader::new(bytes);
    let state = T::restore(&mut r)?;
    r.finish()?;
    Ok(state)
}

/// Writes a state's fields, in order.
#[derive(Default)]
pub struct StateWriter {
    bytes: Vec<u8>,
}

impl StateWriter {
    pub fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }
    pub fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    pub fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.bytes.extend_from_slice(v);
    }
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

/// Reads a state's fields, in order, each checked by its caller.
pub struct StateReader<'a> {
    rest: &'a [u8],
}

impl<'a> StateReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        StateReader { rest: bytes }
    }

    /// The next `N` bytes.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], StateError> {
        let (head, rest) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(StateError::Truncated)?;
        self.rest = rest;
        Ok(*head)
    }
    pub fn u8(&mut self) -> Result<u8, StateError> {
        Ok(self.array::<1>()?[0])
    }
    /// A byte that must be 0 or 1.
    pub fn bool(&mut self, what: &'static str) -> Result<bool, StateError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(StateError::Invalid(what)),
        }
    }
    pub fn u16(&mut self) -> Result<u16, StateError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, StateError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, StateError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A u32 with no bit outside `mask` (a register's writable bits).
    pub fn masked_u32(&mut self, mask: u32, what: &'static str) -> Result<u32, StateError> {
        let v = self.u32()?;
        if v & !mask != 0 {
            return Err(StateError::Invalid(what));
        }
        Ok(v)
    }
    /// A count or index at most `max`.
    pub fn at_most(&mut self, max: u64, what: &'static str) -> Result<u64, StateError> {
        let v = self.u64()?;
        if v > max {
            return Err(StateError::Invalid(what));
        }
        Ok(v)
    }
    /// A counter or a time in microseconds: at most [`MAX_COUNT`], which
    /// no device reaches (2^62 events at a billion a second take 146
    /// years), so that the device's own arithmetic on it, an increment or
    /// an interval added, cannot overflow after a restore.
    pub fn count(&mut self, what: &'static str) -> Result<u64, StateError> {
        self.at_most(MAX_COUNT, what)
    }

    /// A state's version byte: `expected`, or the state is refused.
    pub fn version(&mut self, device: &'static str, expected: u8) -> Result<(), StateError> {
        match self.u8()? {
            v if v == expected => Ok(()),
            found => Err(StateError::Version { device, found }),
        }
    }
    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Every byte was read.
    pub fn finish(self) -> Result<(), StateError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(StateError::Trailing)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_back_in_order_and_are_checked() {
        let mut w = StateWriter::default();
        w.u8(7);
        w.bool(true);
        w.u16(0x1234);
        w.u32(0x8000_0001);
        w.u64(u64::MAX);
        w.u32(0xff);
        w.u64(10);
        let bytes = w.into_bytes();
        assert_eq!(bytes.len(), 1 + 1 + 2 + 4 + 8 + 4 + 8);
        let mut r = StateReader::new(&bytes);
        assert_eq!(r.u8(), Ok(7));
        assert_eq!(r.bool("flag"), Ok(true));
        assert_eq!(r.u16(), Ok(0x1234));
        assert_eq!(r.u32(), Ok(0x8000_0001));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.masked_u32(0xff, "reg"), Ok(0xff));
        assert_eq!(r.at_most(10, "count"), Ok(10));
        assert_eq!(r.finish(), Ok(()));

        let mut r = StateReader::new(&[2, 0x00, 0x01, 0, 0, 11, 0, 0, 0, 0, 0, 0]);
        assert_eq!(r.bool("flag"), Err(StateError::Invalid("flag")));
        assert_eq!(r.masked_u32(0xff, "reg"), Err(StateError::Invalid("reg")));
        assert_eq!(r.at_most(10, "count"), Err(StateError::Truncated));
        let mut r = StateReader::new(&[3, 0]);
        assert_eq!(
            r.version("pl011", 1),
            Err(StateError::Version {
                device: "pl011",
                found: 3
            })
        );
        assert_eq!(r.finish(), Err(StateError::Trailing));
    }
}
