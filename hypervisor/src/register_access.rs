//! The check every emulated device applies to a trapped register access
//! before decoding it: a width the register block accepts, naturally
//! aligned. Each device turns a refusal into its own error and counter.

/// Why an access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessFault {
    /// A width the registers do not accept.
    BadWidth,
    /// An accepted width, at an offset that is not a multiple of it.
    Unaligned,
}

/// Byte, halfword and word accesses.
pub const UP_TO_WORD: &[u8] = &[1, 2, 4];

/// Whether an access of `width` bytes at `offset` is one of `widths`,
/// naturally aligned.
pub fn check_access(offset: u64, width: u8, widths: &[u8]) -> Result<(), AccessFault> {
    if !widths.contains(&width) {
        return Err(AccessFault::BadWidth);
    }
    if !offset.is_multiple_of(u64::from(width)) {
        return Err(AccessFault::Unaligned);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_and_alignment() {
        assert_eq!(check_access(0x10, 4, UP_TO_WORD), Ok(()));
        assert_eq!(check_access(0x11, 1, UP_TO_WORD), Ok(()));
        assert_eq!(check_access(0x12, 2, UP_TO_WORD), Ok(()));
        assert_eq!(
            check_access(0x11, 2, UP_TO_WORD),
            Err(AccessFault::Unaligned)
        );
        assert_eq!(
            check_access(0x12, 4, UP_TO_WORD),
            Err(AccessFault::Unaligned)
        );
        assert_eq!(
            check_access(0x10, 8, UP_TO_WORD),
            Err(AccessFault::BadWidth)
        );
        assert_eq!(check_access(0, 0, UP_TO_WORD), Err(AccessFault::BadWidth));
        assert_eq!(check_access(0, 3, UP_TO_WORD), Err(AccessFault::BadWidth));
        assert_eq!(check_access(0x8, 8, &[4, 8]), Ok(()));
        assert_eq!(check_access(0x4, 8, &[4, 8]), Err(AccessFault::Unaligned));
        assert_eq!(check_access(0x4, 1, &[4, 8]), Err(AccessFault::BadWidth));
    }
}
