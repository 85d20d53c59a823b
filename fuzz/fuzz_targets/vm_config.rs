//! The VM configuration parser (vmconfig, what `cargo xtask build` runs on
//! guests/*.toml) over any text. Files are "loaded" from memory: any path
//! gives a small kernel, except paths naming "missing" (not found) and
//! "empty" (zero bytes). Invariants: no panic; an accepted file yields a
//! bundle the hypervisor's reader accepts, with valid names, as many VMs
//! as the file has `[[vm]]` tables, and each of CPUs 0-7 given to at most
//! one vCPU.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fn load(path: &Path) -> std::io::Result<Vec<u8>> {
    let s = path.to_string_lossy();
    if s.contains("missing") {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "not found",
        ))
    } else if s.contains("empty") {
        Ok(Vec::new())
    } else {
        Ok(vec![0xaa; 4096 + s.len()])
    }
}

fuzz_target!(|text: &str| {
    let root = Path::new("/work");
    let Ok(bytes) = vmconfig::bundle_from_str(text, "fuzz.toml", root, Path::new("/tg.bin"), &load)
    else {
        return;
    };
    let bundle = guest_bundle::parse(&bytes).expect("a bundle built from an accepted file parses");
    let tables: toml::Table = text.parse().expect("accepted text is TOML");
    let vms = tables
        .get("vm")
        .and_then(|v| v.as_array())
        .map_or(0, Vec::len);
    assert_eq!(bundle.vm_count(), vms);
    // Each physical CPU runs at most one VM's vCPU (CPU 0 shares the shell).
    let mut cpus_taken = 0u64;
    for vm in bundle.vms() {
        assert!(guest_bundle::is_valid_name(vm.name()));
        assert!(vm.vcpus() >= 1);
        let cpus = vm.cpu_affinity();
        assert_eq!(cpus.count_ones(), vm.vcpus(), "one CPU per vCPU");
        assert_eq!(cpus >> vmconfig::MAX_CPUS, 0, "CPUs 0 to 7");
        assert_eq!(cpus & cpus_taken, 0, "no CPU given twice");
        cpus_taken |= cpus;
        assert!(vm.ram_size() >= vm.kernel().len() as u64);
    }
});
