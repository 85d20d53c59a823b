//! Code the fuzz targets share (fuzz_targets/*.rs are the targets).

pub mod vgic;
