//! Byte counts as people read them ("512 KiB", "1.5 MiB"): a plain
//! formatting helper every module that prints sizes uses (the reports, the
//! balloon's counters), so none of them depends on another for it.

use core::fmt::{self, Write};

/// Bytes as a short human figure: "512 KiB", "2048 MiB", "1.5 MiB".
pub struct Size(pub u64);

impl fmt::Display for Size {
    /// Honours width and alignment (`{:<10}`), so tables line up.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = heapless::String::<24>::new();
        self.write(&mut text)?;
        f.pad(&text)
    }
}

impl Size {
    fn write(&self, f: &mut impl Write) -> fmt::Result {
        const KIB: u64 = 1024;
        const MIB: u64 = 1024 * 1024;
        let b = self.0;
        if b >= MIB {
            if b.is_multiple_of(MIB) {
                write!(f, "{} MiB", b / MIB)
            } else {
                write!(f, "{}.{} MiB", b / MIB, (b % MIB) * 10 / MIB)
            }
        } else if b >= KIB && b.is_multiple_of(KIB) {
            write!(f, "{} KiB", b / KIB)
        } else if b >= KIB {
            write!(f, "{}.{} KiB", b / KIB, (b % KIB) * 10 / KIB)
        } else {
            write!(f, "{b} bytes")
        }
    }
}
