//! Links the image with linker/hypervisor.ld as a position-independent
//! executable when building for the bare-metal target.
fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "none" {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap();
        let script = format!("{dir}/../linker/hypervisor.ld");
        println!("cargo:rustc-link-arg-bins=-T{script}");
        println!("cargo:rustc-link-arg-bins=-pie");
        println!("cargo:rustc-link-arg-bins=--no-dynamic-linker");
        println!("cargo:rustc-link-arg-bins=-znorelro");
        // libcore is built without PIC: allow its absolute pointers in
        // read-only data; they are relocated before the MMU is on.
        println!("cargo:rustc-link-arg-bins=-znotext");
        println!("cargo:rustc-link-arg-bins=-Tdefmt.x");
        println!("cargo:rerun-if-changed={script}");
    }
    println!("cargo:rerun-if-env-changed=TIDAL_BUILD_ID");
}
