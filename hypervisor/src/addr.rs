//! Address types: a host physical address ([`PhysAddr`]), a guest
//! intermediate-physical address ([`GuestAddr`], an IPA) and a guest page
//! frame number ([`GuestPfn`], an IPA in 4 KiB pages, what the balloon
//! protocol carries). Each is a `#[repr(transparent)]` `u64`, so they cost
//! nothing, but one kind cannot be passed where another is expected:
//!
//! ```compile_fail
//! use hypervisor::addr::{GuestAddr, PhysAddr};
//! fn frame_owner(pa: PhysAddr) -> u64 { pa.raw() }
//! frame_owner(GuestAddr::new(0x4000_0000)); // an IPA is not a host address
//! ```
//!
//! ```compile_fail
//! use hypervisor::addr::{GuestAddr, GuestPfn};
//! fn inflate(pfn: GuestPfn) -> u64 { pfn.raw() }
//! inflate(GuestAddr::new(0x4000_0000)); // an IPA is not a frame number
//! ```
//!
//! ```
//! use hypervisor::addr::{GuestAddr, GuestPfn};
//! let ipa = GuestAddr::new(0x4000_1234);
//! assert_eq!(ipa.pfn(), GuestPfn::new(0x4_0001));
//! assert_eq!(ipa.page_offset(), 0x234);
//! assert_eq!(format!("{ipa}"), "0x40001234");
//! ```
//!
//! Raw integers become typed where they enter the hypervisor: the fault
//! registers (HPFAR_EL2/FAR_EL2, `vm::syndrome::fault_ipa`), a virtqueue
//! descriptor's `addr` field and a queue's area registers (`virtio::queue`),
//! a balloon request's 32-bit PFNs (`balloon`), the frame table's answers
//! (`mm::frames`) and stage-2 descriptors (`mm::stage2`). They become raw
//! again only where the hardware or a pointer needs them (VTTBR_EL2, a
//! descriptor's output address, the identity map). Nothing converts
//! implicitly: there is no `From<u64>`, only [`new`](PhysAddr::new) and
//! [`raw`](PhysAddr::raw), and conversions between kinds are named
//! ([`GuestAddr::pfn`], [`GuestPfn::addr`]).
//!
//! Arithmetic on a value a guest chose is checked ([`GuestAddr::checked_add`],
//! [`GuestPfn::addr`]): a guest must get an error, never panic the
//! hypervisor. `+ u64` is for offsets the hypervisor computed and knows to be
//! in range; it overflows exactly as the `u64` sum did.
//!
//! Host frame numbers have no type: the frame table and the stage-2 tables
//! name a frame by its [`PhysAddr`]. MMIO register offsets inside a device
//! window and guest virtual addresses (FAR_EL2, ELR_EL2) are not addresses
//! of either space and stay plain integers.

use core::fmt;
use core::ops::{Add, Sub};

/// The translation granule of stage 2, the frame table and the balloon
/// protocol: 4 KiB.
pub const PAGE_SHIFT: u32 = 12;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
const PAGE_MASK: u64 = PAGE_SIZE - 1;

/// What both address kinds have: construction from and to `u64`, page
/// arithmetic, checked offsets, and `0x…` formatting (`{}` and `{:#x}` both
/// print what `{:#x}` of the `u64` printed).
macro_rules! address {
    ($name:ident) => {
        impl $name {
            /// The address `raw` (no check: every `u64` is an address).
            #[inline(always)]
            pub const fn new(raw: u64) -> Self {
                Self(raw)
            }

            /// The address as a plain integer, for hardware or a pointer.
            #[inline(always)]
            pub const fn raw(self) -> u64 {
                self.0
            }

            /// `self + bytes`, or `None` past the end of the address space.
            #[inline(always)]
            pub const fn checked_add(self, bytes: u64) -> Option<Self> {
                match self.0.checked_add(bytes) {
                    Some(v) => Some(Self(v)),
                    None => None,
                }
            }

            /// The distance from `base` up to `self`; `None` below `base`.
            #[inline(always)]
            pub const fn offset_from(self, base: Self) -> Option<u64> {
                self.0.checked_sub(base.0)
            }

            /// The offset of the address in its 4 KiB page.
            #[inline(always)]
            pub const fn page_offset(self) -> u64 {
                self.0 & PAGE_MASK
            }

            /// The start of the 4 KiB page holding the address.
            #[inline(always)]
            pub const fn page_base(self) -> Self {
                Self(self.0 & !PAGE_MASK)
            }

            #[inline(always)]
            pub const fn is_page_aligned(self) -> bool {
                self.0 & PAGE_MASK == 0
            }
        }

        /// An offset the hypervisor computed (overflow panics, as for
        /// `u64`); use [`checked_add`](Self::checked_add) for guest values.
        impl Add<u64> for $name {
            type Output = Self;
            #[inline(always)]
            fn add(self, bytes: u64) -> Self {
                Self(self.0 + bytes)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }

        /// Formats the `u64` with the caller's flags: `{:#x}` and
        /// `{:#010x}` print exactly what they printed for the integer.
        impl fmt::LowerHex for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

/// A host physical address: a frame of RAM, a table, a device page.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[repr(transparent)]
pub struct PhysAddr(u64);

/// A guest intermediate-physical address (IPA): what a VM's stage-2 tables
/// translate, what its devices' DMA and its faults name.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[repr(transparent)]
pub struct GuestAddr(u64);

address!(PhysAddr);
address!(GuestAddr);

impl GuestAddr {
    /// The guest page frame number of the page holding the address.
    #[inline(always)]
    pub const fn pfn(self) -> GuestPfn {
        GuestPfn(self.0 >> PAGE_SHIFT)
    }
}

/// A guest page frame number: an IPA divided by 4 KiB. The balloon protocol
/// carries these (32 bits on the wire, whatever the guest's page size); they
/// are not host frames.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
#[repr(transparent)]
pub struct GuestPfn(u64);

impl GuestPfn {
    #[inline(always)]
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// A PFN as a balloon request carries it.
    #[inline(always)]
    pub const fn from_wire(pfn: u32) -> Self {
        Self(pfn as u64)
    }

    #[inline(always)]
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// The IPA of the page's first byte; `None` if it does not fit 64 bits
    /// (a wrapped product could alias a real page).
    #[inline(always)]
    pub const fn addr(self) -> Option<GuestAddr> {
        match self.0.checked_mul(PAGE_SIZE) {
            Some(v) => Some(GuestAddr(v)),
            None => None,
        }
    }

    /// The distance in pages from `base` up to `self`; `None` below `base`.
    #[inline(always)]
    pub const fn offset_from(self, base: Self) -> Option<u64> {
        self.0.checked_sub(base.0)
    }

    /// The PFNs of `range`, one by one (`Range<GuestPfn>` is no iterator).
    pub fn iter(range: core::ops::Range<Self>) -> impl Iterator<Item = Self> + Clone {
        (range.start.0..range.end.0).map(Self)
    }
}

/// A page count the hypervisor computed (overflow panics, as for `u64`).
impl Add<u64> for GuestPfn {
    type Output = Self;
    #[inline(always)]
    fn add(self, pages: u64) -> Self {
        Self(self.0 + pages)
    }
}

/// Pages from `base` up to `self`, for PFNs the hypervisor knows ordered
/// (underflow panics, as for `u64`); [`GuestPfn::offset_from`] otherwise.
impl Sub for GuestPfn {
    type Output = u64;
    #[inline(always)]
    fn sub(self, base: Self) -> u64 {
        self.0 - base.0
    }
}

impl fmt::Display for GuestPfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::LowerHex for GuestPfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_cost() {
        assert_eq!(core::mem::size_of::<PhysAddr>(), 8);
        assert_eq!(core::mem::size_of::<Option<GuestAddr>>(), 16);
        assert_eq!(core::mem::align_of::<GuestPfn>(), 8);
    }

    #[test]
    fn page_arithmetic() {
        let ipa = GuestAddr::new(0x4000_1234);
        assert_eq!(ipa.page_offset(), 0x234);
        assert_eq!(ipa.page_base(), GuestAddr::new(0x4000_1000));
        assert!(!ipa.is_page_aligned());
        assert!(ipa.page_base().is_page_aligned());
        assert_eq!(ipa.pfn(), GuestPfn::new(0x4_0001));
        assert_eq!(ipa.pfn().addr(), Some(ipa.page_base()));
        assert_eq!(ipa + 0x10, GuestAddr::new(0x4000_1244));
        let pa = PhysAddr::new(0x8000_0000);
        assert_eq!((pa + 0x1fff).page_base(), PhysAddr::new(0x8000_1000));
        assert_eq!(GuestPfn::from_wire(u32::MAX).raw(), 0xffff_ffff);
        assert_eq!(GuestPfn::new(7) + 3, GuestPfn::new(10));
        assert_eq!(GuestPfn::new(7) - GuestPfn::new(3), 4);
        let pfns: Vec<_> = GuestPfn::iter(GuestPfn::new(3)..GuestPfn::new(6)).collect();
        assert_eq!(pfns, [GuestPfn::new(3), GuestPfn::new(4), GuestPfn::new(5)]);
    }

    #[test]
    fn checked_arithmetic() {
        let top = GuestAddr::new(u64::MAX - 1);
        assert_eq!(top.checked_add(1), Some(GuestAddr::new(u64::MAX)));
        assert_eq!(top.checked_add(2), None);
        assert_eq!(PhysAddr::new(u64::MAX).checked_add(1), None);
        assert_eq!(
            GuestAddr::new(0x5000).offset_from(GuestAddr::new(0x4000)),
            Some(0x1000)
        );
        assert_eq!(
            GuestAddr::new(0x3000).offset_from(GuestAddr::new(0x4000)),
            None
        );
        assert_eq!(GuestPfn::new(1 << 52).addr(), None, "2^64 wraps");
        assert_eq!(
            GuestPfn::new((1 << 52) - 1).addr(),
            Some(GuestAddr::new(0xffff_ffff_ffff_f000))
        );
        assert_eq!(GuestPfn::new(5).offset_from(GuestPfn::new(2)), Some(3));
        assert_eq!(GuestPfn::new(2).offset_from(GuestPfn::new(5)), None);
    }

    #[test]
    fn formatting_matches_the_integer() {
        for v in [0, 0x1234, 0x8000_0000, u64::MAX] {
            let (pa, ipa) = (PhysAddr::new(v), GuestAddr::new(v));
            assert_eq!(format!("{pa}"), format!("{v:#x}"));
            assert_eq!(format!("{ipa}"), format!("{v:#x}"));
            assert_eq!(format!("{pa:#x}"), format!("{v:#x}"));
            assert_eq!(format!("{ipa:#010x}"), format!("{v:#010x}"));
            assert_eq!(format!("{:x}", GuestPfn::new(v)), format!("{v:x}"));
        }
    }
}
