//! The board device-tree reader over any bytes (the firmware's tree is
//! trusted less than it seems: a board may ship a broken one). Invariants:
//! what it accepts is as documented on `BoardInfo`: RAM banks sorted,
//! non-empty, disjoint and not adjacent; reserved regions and the initrd
//! non-empty; the tree range is the blob's size at its address; the same
//! input gives the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use platform::discover;

fuzz_target!(|input: (u64, &[u8])| {
    let (addr, dtb) = input;
    let Ok(info) = discover(dtb, addr) else {
        return;
    };
    assert_eq!(discover(dtb, addr).as_ref(), Ok(&info), "discover is pure");
    assert_eq!(info.dtb.start, addr);
    assert!(info.dtb.end >= info.dtb.start);
    assert!(
        info.dtb.size() <= dtb.len() as u64,
        "tree range past the blob"
    );
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
        assert!(!initrd.is_empty());
    }
    if let Some(args) = &info.bootargs {
        assert!(!args.contains('\0'));
    }
});
