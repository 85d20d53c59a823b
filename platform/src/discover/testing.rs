//! What [`discover`](super::discover) promises about a tree it accepts, as
//! one check shared by the host property tests and the `board_dtb` fuzz
//! target (feature `testing`): RAM banks sorted, non-empty, disjoint and not
//! adjacent; reserved regions, virtio-mmio slots and the initrd non-empty; the tree range is
//! the blob's size at its address; the same input gives the same answer.

use crate::BoardInfo;

/// Panics, naming the broken invariant, if `info` (what `discover(dtb, addr)`
/// returned) breaks a promise of [`BoardInfo`]'s documentation.
pub fn assert_invariants(dtb: &[u8], addr: u64, info: &BoardInfo) {
    assert_eq!(
        super::discover(dtb, addr).as_ref(),
        Ok(info),
        "discover is pure"
    );
    assert_eq!(info.dtb.start, addr);
    assert!(info.dtb.end >= info.dtb.start);
    assert!(
        info.dtb.size() <= dtb.len() as u64,
        "tree range past the blob"
    );
    assert!(!info.ram.is_empty(), "accepted without RAM");
    for bank in &info.ram {
        assert!(!bank.is_empty(), "empty RAM bank {bank:?}");
    }
    for pair in info.ram.windows(2) {
        assert!(
            pair[0].end < pair[1].start,
            "RAM banks not sorted and merged: {:?}",
            info.ram
        );
    }
    for r in &info.reserved {
        assert!(!r.range.is_empty(), "empty reserved region {r:?}");
    }
    if let Some(initrd) = info.initrd {
        assert!(!initrd.is_empty(), "empty initrd {initrd:?}");
    }
    for slot in &info.virtio_mmio {
        assert!(!slot.regs.is_empty(), "empty virtio-mmio slot {slot:?}");
    }
    if let Some(args) = &info.bootargs {
        assert!(!args.contains('\0'), "NUL inside bootargs");
    }
}
