//! The GICv2 distributor under any guest accesses and
//! device lines: see `tidal_fuzz::vgic` for the invariants.
#![no_main]

libfuzzer_sys::fuzz_target!(|input: tidal_fuzz::vgic::Input| tidal_fuzz::vgic::run(input, false));
