//! A guest bundle from any VM configuration file (`cargo xtask bundle`,
//! `cargo xtask run --config`): only what its VMs use is built or fetched
//! (the test guest, the Linux fixture, initramfs images for a user's own
//! kernel); see docs/CONFIGURATION.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::linux;

/// Builds the bundle of the configuration file `config` (a path relative to
/// the current directory, or absolute) into
/// `target/user-bundles/<file stem>.img` and returns that path. For
/// `cargo xtask run --config` and anything else that boots a user's file.
pub fn bundle_for_config(root: &Path, config: &Path) -> Result<PathBuf, String> {
    let stem = config
        .file_stem()
        .ok_or_else(|| format!("{}: not a file name", config.display()))?;
    let mut name = stem.to_os_string();
    name.push(".img");
    let out = root.join("target").join("user-bundles").join(name);
    write_bundle_for_config(root, config, &out)?;
    Ok(out)
}

/// Builds the bundle of `config` into `out` (`cargo xtask bundle CONFIG -o
/// OUT`): first what its VMs need (see [`vmconfig::needs`]), nothing else.
pub fn write_bundle_for_config(root: &Path, config: &Path, out: &Path) -> Result<(), String> {
    let config = std::path::absolute(config).map_err(|e| format!("{}: {e}", config.display()))?;
    let needs = vmconfig::needs(&config, root)?;
    let testguest = if needs.testguest {
        crate::build_testguest(root)?
    } else {
        // Never read: no VM names the test guest.
        PathBuf::new()
    };
    if needs.linux_fixture || !needs.linux.is_empty() {
        crate::build_memtool(root)?;
    }
    let memtool = linux::memtool_path(root);
    if needs.linux_fixture {
        linux::build_initramfs(root, &memtool)?;
    }
    let mut generated = HashMap::new();
    for source in &needs.linux {
        let built = linux::build_user_linux(root, &memtool, source)?;
        generated.insert(source.clone(), built);
    }
    let bytes = vmconfig::build_bundle_with(
        &config,
        &vmconfig::Inputs {
            root,
            testguest: &testguest,
            generated: &generated,
        },
    )?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    std::fs::write(out, &bytes).map_err(|e| format!("writing {}: {e}", out.display()))?;
    let bundle = guest_bundle::parse(&bytes).map_err(|e| format!("{}: {e}", out.display()))?;
    let vms: Vec<String> = bundle
        .vms()
        .map(|v| format!("{} ({})", v.name(), vmconfig::format_size(v.ram_size())))
        .collect();
    eprintln!(
        "xtask: {} -> {} ({} bytes): {}",
        config.display(),
        out.display(),
        bytes.len(),
        vms.join(", ")
    );
    Ok(())
}
