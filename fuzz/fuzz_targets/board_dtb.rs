//! The board device-tree reader over any bytes (the firmware's tree is
//! trusted less than it seems: a board may ship a broken one). Invariants:
//! what it accepts is as documented on `BoardInfo`, checked by
//! `platform::testing::assert_invariants` (shared with the property test in
//! platform/src/discover/tests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use platform::{discover, testing::assert_invariants};

fuzz_target!(|input: (u64, &[u8])| {
    let (addr, dtb) = input;
    if let Ok(info) = discover(dtb, addr) {
        assert_invariants(dtb, addr, &info);
    }
});
