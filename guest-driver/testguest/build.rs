//! Links the test guest with linker/guest.ld when building for the bare-metal
//! target.
//!
//! The workspace builds aarch64-unknown-none code with `-C relocation-model=pie`
//! (the hypervisor relocates itself). The guest does not need that: QEMU virt
//! and the hypervisor both load it at exactly 0x4020_0000, its link address. So
//! it links statically with `--no-pie` (the PIE-compiled code is only
//! PC-relative, which works at a fixed address too); guest.ld asserts that no
//! dynamic relocation is left.
fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "none" {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap();
        let script = format!("{dir}/../../linker/guest.ld");
        println!("cargo:rustc-link-arg-bins=-T{script}");
        println!("cargo:rustc-link-arg-bins=--no-pie");
        println!("cargo:rerun-if-changed={script}");
    }
}
