//! VM configuration files (`guests/*.toml`) and the guest bundles built from
//! them.
//!
//! The format is documented in `guests/README.md`. In short:
//!
//! ```toml
//! [[vm]]
//! name = "alpha"          # [a-z0-9_-], 1 to 31 characters, unique
//! ram = "256M"            # K/M/G suffix (or plain bytes); a multiple of 2 MiB
//! vcpus = 1
//! cpus = [1]              # one physical CPU per vCPU, never CPU 0
//! kernel = "testguest"    # or a path relative to the workspace root
//! initrd = "path"         # optional
//! cmdline = "pattern"     # optional
//! [vm.balloon]            # optional; absent: no balloon device
//! features = ["must-tell-host"]
//! ```
//!
//! [`build_bundle`] parses and validates one file and returns the bundle
//! bytes; [`build_all`] writes `target/guests.img` from `guests/demo.toml` and
//! `target/bundles/<name>.img` for every `guests/tests/<name>.toml`. Every
//! error names the file, the VM and the field.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use guest_bundle::{bad_access, devices, BundleBuilder, VmSpec};

/// The name `kernel` takes for the test guest built from `guest-driver/testguest`.
pub const TESTGUEST: &str = "testguest";

/// Longest VM name (the bundle's 32-byte field keeps room for a NUL).
pub const MAX_NAME_LEN: usize = 31;

/// Physical CPUs a VM may be pinned to are `1..MAX_CPUS` (CPU 0 runs the
/// hypervisor's shell; the platform crate describes at most 8 CPUs).
pub const MAX_CPUS: u32 = 8;

/// Guest RAM sizes are multiples of this (stage 2 can then use 2 MiB blocks,
/// and the guest board puts the kernel at RAM base + 2 MiB).
pub const RAM_GRANULE: u64 = 2 << 20;

/// Most RAM all VMs of one configuration may have together: the boards have
/// 2 GiB (QEMU `-m 2G`, the Raspberry Pi 4 model in QEMU), and the
/// hypervisor, its frame table, the bundle and the firmware need the rest.
pub const MAX_TOTAL_RAM: u64 = 1536 << 20;

/// Longest command line (Linux arm64's `COMMAND_LINE_SIZE` is 2048 including
/// the terminating NUL).
pub const MAX_CMDLINE: usize = 2047;

/// Where the guest board loads things (docs/GUEST-BOARD.md): the device tree
/// at RAM base, the kernel at RAM base + 2 MiB (+ `text_offset`), the initrd
/// after the kernel on a 2 MiB boundary.
const KERNEL_OFFSET: u64 = 2 << 20;

/// Virtio balloon feature names, as written in `[vm.balloon] features`, and
/// their bit numbers (virtio 1.2, 5.5.3).
pub const BALLOON_FEATURES: [(&str, u32); 6] = [
    ("must-tell-host", 0),      // VIRTIO_BALLOON_F_MUST_TELL_HOST
    ("stats", 1),               // VIRTIO_BALLOON_F_STATS_VQ
    ("deflate-on-oom", 2),      // VIRTIO_BALLOON_F_DEFLATE_ON_OOM
    ("free-page-hint", 3),      // VIRTIO_BALLOON_F_FREE_PAGE_HINT
    ("page-poison", 4),         // VIRTIO_BALLOON_F_PAGE_POISON
    ("free-page-reporting", 5), // VIRTIO_BALLOON_F_PAGE_REPORTING
];

// ------------------------------------------------------------- file format

/// Keys a `[[vm]]` table may have.
const VM_KEYS: [&str; 9] = [
    "name",
    "ram",
    "vcpus",
    "cpus",
    "kernel",
    "initrd",
    "cmdline",
    "balloon",
    "on_bad_access",
];

/// Values of `on_bad_access` and their bundle codes.
const BAD_ACCESS_POLICIES: [(&str, u32); 2] =
    [("abort", bad_access::ABORT), ("stop", bad_access::STOP)];

/// One `[[vm]]` table, types checked, values not yet validated.
#[derive(Debug)]
struct VmConfig {
    name: String,
    /// As written, for messages.
    ram_text: String,
    /// `Err`: the message for a `ram` string that is not a size.
    ram: Result<u64, String>,
    vcpus: u32,
    cpus: Vec<u32>,
    kernel: String,
    initrd: Option<String>,
    cmdline: Option<String>,
    /// `Some(features)` when `[vm.balloon]` is present.
    balloon: Option<Vec<String>>,
    /// A [`bad_access`] code (default abort).
    on_bad_access: u32,
}

/// `value` for a message: `string "1"`, `integer 5`, `array [1, 2]`.
fn describe(value: &toml::Value) -> String {
    format!("{} {value}", value.type_str())
}

fn wrong_type(key: &str, want: &str, value: &toml::Value) -> String {
    format!("{key} must be {want}, found {}", describe(value))
}

impl VmConfig {
    /// Reads one `[[vm]]` table; `Err` names the field.
    fn from_table(t: &toml::Table) -> Result<VmConfig, String> {
        if let Some(k) = t.keys().find(|k| !VM_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "unknown field `{k}`; a [[vm]] table has {}",
                VM_KEYS.join(", ")
            ));
        }
        let required = |key: &str| {
            t.get(key)
                .ok_or_else(|| format!("required field `{key}` is missing"))
        };
        let string = |key: &str, v: &toml::Value| {
            v.as_str()
                .map(String::from)
                .ok_or_else(|| wrong_type(key, "a string", v))
        };
        let optional_string = |key: &str| t.get(key).map(|v| string(key, v)).transpose();
        let integer = |key: &str, v: &toml::Value, max: u64| match v.as_integer() {
            Some(n) if n >= 0 && n as u64 <= max => Ok(n as u64),
            Some(n) => Err(format!("{key} {n} is out of range (0 to {max})")),
            None => Err(wrong_type(key, "an integer", v)),
        };

        let name = string("name", required("name")?)?;
        let (ram_text, ram) = match required("ram")? {
            toml::Value::String(text) => (text.clone(), parse_size(text)),
            toml::Value::Integer(n) => (
                n.to_string(),
                u64::try_from(*n).map_err(|_| format!("{n} is negative")),
            ),
            other => {
                return Err(wrong_type(
                    "ram",
                    "a size such as \"256M\" or an integer number of bytes",
                    other,
                ))
            }
        };
        let vcpus = integer("vcpus", required("vcpus")?, u32::MAX.into())? as u32;
        let cpus = match required("cpus")? {
            toml::Value::Array(list) => list
                .iter()
                .map(|v| integer("cpus", v, u32::MAX.into()).map(|n| n as u32))
                .collect::<Result<Vec<u32>, String>>()
                .map_err(|e| format!("{e} (cpus is a list of CPU numbers, e.g. [1])"))?,
            other => {
                return Err(wrong_type(
                    "cpus",
                    "a list of CPU numbers such as [1]",
                    other,
                ))
            }
        };
        let kernel = string("kernel", required("kernel")?)?;
        let initrd = optional_string("initrd")?;
        let cmdline = optional_string("cmdline")?;
        let on_bad_access = match optional_string("on_bad_access")? {
            None => bad_access::ABORT,
            Some(word) => BAD_ACCESS_POLICIES
                .iter()
                .find(|(w, _)| *w == word)
                .map(|&(_, code)| code)
                .ok_or_else(|| {
                    format!("on_bad_access \"{word}\" is unknown; it is \"abort\" (the default) or \"stop\"")
                })?,
        };
        let balloon = match t.get("balloon") {
            None => None,
            Some(toml::Value::Table(b)) => {
                if let Some(k) = b.keys().find(|k| k.as_str() != "features") {
                    return Err(format!(
                        "unknown field `balloon.{k}`; [vm.balloon] has features"
                    ));
                }
                match b.get("features") {
                    None => Some(Vec::new()),
                    Some(toml::Value::Array(list)) => Some(
                        list.iter()
                            .map(|v| string("balloon.features", v))
                            .collect::<Result<Vec<String>, String>>()
                            .map_err(|e| format!("{e} (features is a list of names)"))?,
                    ),
                    Some(other) => {
                        return Err(wrong_type(
                            "balloon.features",
                            "a list of feature names",
                            other,
                        ))
                    }
                }
            }
            Some(other) => return Err(wrong_type("balloon", "a table ([vm.balloon])", other)),
        };
        Ok(VmConfig {
            name,
            ram_text,
            ram,
            vcpus,
            cpus,
            kernel,
            initrd,
            cmdline,
            balloon,
            on_bad_access,
        })
    }
}

// ------------------------------------------------------------- public API

/// Parses a size: decimal digits, optionally followed by `K`, `M` or `G`
/// (binary multiples; lower case accepted, as is a trailing `iB` or `B`).
/// Plain digits are bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "\"{text}\" is not a size: expected a whole number with a K, M or G suffix, e.g. \"256M\""
        )
    };
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.as_bytes().last() {
        Some(b'K' | b'k') => (&t[..t.len() - 1], 10),
        Some(b'M' | b'm') => (&t[..t.len() - 1], 20),
        Some(b'G' | b'g') => (&t[..t.len() - 1], 30),
        _ if t.len() < text.trim().len() => return Err(bad()), // "12B"-like without a unit letter
        _ => (t, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("\"{text}\" is too large"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("\"{text}\" is too large"))
}

/// Formats a byte count the way a configuration would write it.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}")
}

/// Parses and validates the configuration file `config` and returns the
/// guest bundle it describes. Kernel and initrd paths are relative to `root`
/// (the workspace root); `kernel = "testguest"` means `testguest_image`.
///
/// Errors name the file (relative to `root` when inside it), the VM and the
/// field, e.g. `guests/demo.toml: VM "alpha": ram "300K" is not a multiple
/// of 2 MiB`.
pub fn build_bundle(config: &Path, root: &Path, testguest_image: &Path) -> Result<Vec<u8>, String> {
    let shown = config
        .strip_prefix(root)
        .unwrap_or(config)
        .display()
        .to_string();
    let text = std::fs::read_to_string(config).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    let loader = |path: &Path| std::fs::read(path);
    bundle_from_str(&text, &shown, root, testguest_image, &loader)
}

/// Builds every bundle: `target/guests.img` from `guests/demo.toml` (what
/// `cargo xtask run` boots) and `target/bundles/<name>.img` for each
/// `guests/tests/<name>.toml`. Returns `(name, path)` for each, the default
/// one first under the name `demo`, the others sorted by name.
pub fn build_all(root: &Path, testguest_image: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let target = root.join("target");
    let mut jobs = vec![(
        "demo".to_string(),
        root.join("guests").join("demo.toml"),
        target.join("guests.img"),
    )];
    let tests_dir = root.join("guests").join("tests");
    let mut tests = Vec::new();
    if tests_dir.is_dir() {
        let entries = std::fs::read_dir(&tests_dir)
            .map_err(|e| format!("reading {}: {e}", tests_dir.display()))?;
        for entry in entries {
            let path = entry
                .map_err(|e| format!("reading {}: {e}", tests_dir.display()))?
                .path();
            if path.extension().is_some_and(|x| x == "toml") {
                let name = path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .ok_or_else(|| format!("{}: file name is not UTF-8", path.display()))?
                    .to_string();
                tests.push((
                    name.clone(),
                    path,
                    target.join("bundles").join(format!("{name}.img")),
                ));
            }
        }
    }
    tests.sort();
    jobs.extend(tests);

    let mut built = Vec::with_capacity(jobs.len());
    for (name, config, out) in jobs {
        let bytes = build_bundle(&config, root, testguest_image)?;
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        std::fs::write(&out, bytes).map_err(|e| format!("writing {}: {e}", out.display()))?;
        built.push((name, out));
    }
    Ok(built)
}

// ------------------------------------------------------------- the work

/// Parse, validate and build; `load` reads kernel and initrd files (tests
/// and the fuzz target replace it). `file` is the name errors show.
pub fn bundle_from_str(
    text: &str,
    file: &str,
    root: &Path,
    testguest_image: &Path,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let specs = specs_from_str(text, file, root, testguest_image, load)?;
    let mut builder = BundleBuilder::new();
    for spec in specs {
        builder
            .add_vm(spec)
            .map_err(|e| format!("{file}: bundle writer refused {e}"))?;
    }
    Ok(builder.build())
}

fn specs_from_str(
    text: &str,
    file: &str,
    root: &Path,
    testguest_image: &Path,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<VmSpec>, String> {
    let doc: toml::Table = toml::from_str(text).map_err(|e| {
        let msg = e.to_string();
        format!("{file}: {}", msg.trim_end())
    })?;
    if let Some(k) = doc.keys().find(|k| k.as_str() != "vm") {
        return Err(format!(
            "{file}: unknown top-level key `{k}`; a configuration is a list of [[vm]] tables"
        ));
    }
    let tables = match doc.get("vm") {
        None => &Vec::new(),
        Some(toml::Value::Array(list)) => list,
        Some(other) => {
            return Err(format!(
                "{file}: `vm` must be a list of [[vm]] tables, found {}",
                describe(other)
            ))
        }
    };
    if tables.is_empty() {
        return Err(format!(
            "{file}: no VMs: add at least one [[vm]] table (see guests/README.md)"
        ));
    }
    if tables.len() > guest_bundle::MAX_VMS {
        return Err(format!(
            "{file}: {} VMs; a bundle holds at most {}",
            tables.len(),
            guest_bundle::MAX_VMS
        ));
    }
    let mut vms = Vec::with_capacity(tables.len());
    for (index, table) in tables.iter().enumerate() {
        let toml::Value::Table(t) = table else {
            return Err(format!(
                "{file}: VM {index}: must be a [[vm]] table, found {}",
                describe(table)
            ));
        };
        let who = match t.get("name").and_then(|n| n.as_str()) {
            Some(n) if check_name(n).is_ok() => format!("VM \"{n}\""),
            _ => format!("VM {index}"),
        };
        vms.push(VmConfig::from_table(t).map_err(|e| format!("{file}: {who}: {e}"))?);
    }

    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut cpu_owner: HashMap<u32, &str> = HashMap::new();
    let mut total_ram: u64 = 0;
    let mut specs = Vec::with_capacity(vms.len());

    for (index, vm) in vms.iter().enumerate() {
        // Name first: every later message uses it.
        check_name(&vm.name)
            .map_err(|e| format!("{file}: VM {index}: name \"{}\" {e}", vm.name))?;
        let who = format!("{file}: VM \"{}\"", vm.name);
        if let Some(first) = names.insert(&vm.name, index) {
            return Err(format!(
                "{who}: name is used twice (VM {first} and VM {index}); names must be unique"
            ));
        }

        // RAM.
        let ram_text = &vm.ram_text;
        let ram = *vm.ram.as_ref().map_err(|e| format!("{who}: ram {e}"))?;
        if ram == 0 {
            return Err(format!("{who}: ram \"{ram_text}\" is zero"));
        }
        if !ram.is_multiple_of(RAM_GRANULE) {
            return Err(format!(
                "{who}: ram \"{ram_text}\" is not a multiple of 2 MiB"
            ));
        }
        total_ram = total_ram.saturating_add(ram);
        if total_ram > MAX_TOTAL_RAM {
            return Err(format!(
                "{who}: ram \"{ram_text}\" brings the total of all VMs to {}, more than the {} the boards can give guests",
                format_size(total_ram),
                format_size(MAX_TOTAL_RAM)
            ));
        }

        // vCPUs and pinning.
        if vm.vcpus == 0 {
            return Err(format!("{who}: vcpus is 0; a VM needs at least one"));
        }
        if vm.vcpus as usize != vm.cpus.len() {
            return Err(format!(
                "{who}: vcpus is {} but cpus lists {} CPU(s) {:?}; give one physical CPU per vCPU",
                vm.vcpus,
                vm.cpus.len(),
                vm.cpus
            ));
        }
        let mut affinity: u64 = 0;
        for &cpu in &vm.cpus {
            if cpu == 0 {
                return Err(format!(
                    "{who}: cpus {:?} includes CPU 0, which runs the hypervisor's shell; use CPUs 1 to {}",
                    vm.cpus,
                    MAX_CPUS - 1
                ));
            }
            if cpu >= MAX_CPUS {
                return Err(format!(
                    "{who}: cpus {:?} includes CPU {cpu}; physical CPUs are numbered 1 to {}",
                    vm.cpus,
                    MAX_CPUS - 1
                ));
            }
            if let Some(other) = cpu_owner.insert(cpu, &vm.name) {
                return Err(if other == vm.name {
                    format!("{who}: cpus {:?} lists CPU {cpu} twice", vm.cpus)
                } else {
                    format!(
                        "{who}: cpus {:?} includes CPU {cpu}, already given to VM \"{other}\"; each physical CPU runs one VM",
                        vm.cpus
                    )
                });
            }
            affinity |= 1 << cpu;
        }

        // Kernel and initrd.
        let (kernel_path, kernel_shown) = if vm.kernel == TESTGUEST {
            (testguest_image.to_path_buf(), format!("\"{TESTGUEST}\""))
        } else {
            (root.join(&vm.kernel), format!("\"{}\"", vm.kernel))
        };
        if vm.kernel.is_empty() {
            return Err(format!(
                "{who}: kernel is empty; give \"{TESTGUEST}\" or a path relative to the workspace root"
            ));
        }
        let kernel = load(&kernel_path).map_err(|e| {
            let hint = if vm.kernel == TESTGUEST {
                " (the test guest is built from guest-driver/testguest by `cargo xtask build`)"
            } else {
                " (paths are relative to the workspace root)"
            };
            format!(
                "{who}: kernel {kernel_shown}: cannot read {}: {e}{hint}",
                kernel_path.display()
            )
        })?;
        if kernel.is_empty() {
            return Err(format!(
                "{who}: kernel {kernel_shown}: {} is empty",
                kernel_path.display()
            ));
        }
        let initrd = match &vm.initrd {
            None => None,
            Some(p) if p.is_empty() => {
                return Err(format!(
                    "{who}: initrd is empty; leave the field out for no initrd"
                ))
            }
            Some(p) => {
                let path = root.join(p);
                let bytes = load(&path).map_err(|e| {
                    format!(
                        "{who}: initrd \"{p}\": cannot read {}: {e} (paths are relative to the workspace root)",
                        path.display()
                    )
                })?;
                if bytes.is_empty() {
                    return Err(format!(
                        "{who}: initrd \"{p}\": {} is empty",
                        path.display()
                    ));
                }
                Some(bytes)
            }
        };
        let footprint = kernel_footprint(&kernel);
        let kernel_end = KERNEL_OFFSET.saturating_add(footprint);
        let initrd_len = initrd.as_ref().map_or(0, |i| i.len() as u64);
        let needed = if initrd_len == 0 {
            kernel_end
        } else {
            kernel_end
                .div_ceil(RAM_GRANULE)
                .saturating_mul(RAM_GRANULE)
                .saturating_add(initrd_len)
        };
        if needed > ram {
            return Err(format!(
                "{who}: ram \"{ram_text}\" is too small: 2 MiB for the device tree, then the kernel ({} bytes in memory){} need {} bytes; use at least \"{}\"",
                footprint,
                if initrd_len == 0 {
                    String::new()
                } else {
                    format!(" and the initrd ({initrd_len} bytes, 2 MiB aligned)")
                },
                needed,
                format_size(needed.div_ceil(RAM_GRANULE).saturating_mul(RAM_GRANULE))
            ));
        }

        // Command line.
        let cmdline = match &vm.cmdline {
            None => None,
            Some(c) if c.is_empty() => None,
            Some(c) => {
                if c.contains('\0') {
                    return Err(format!("{who}: cmdline contains a NUL character"));
                }
                if c.len() > MAX_CMDLINE {
                    return Err(format!(
                        "{who}: cmdline is {} bytes; at most {MAX_CMDLINE}",
                        c.len()
                    ));
                }
                Some(c.clone())
            }
        };

        // Balloon.
        let (devices, balloon_features) = match &vm.balloon {
            None => (0, 0),
            Some(features) => {
                let mut bits = 0u64;
                for name in features {
                    let Some(&(_, bit)) = BALLOON_FEATURES.iter().find(|(n, _)| n == name) else {
                        let known: Vec<&str> = BALLOON_FEATURES.iter().map(|(n, _)| *n).collect();
                        return Err(format!(
                            "{who}: balloon.features: unknown feature \"{name}\"; known: {}",
                            known.join(", ")
                        ));
                    };
                    if bits & (1 << bit) != 0 {
                        return Err(format!("{who}: balloon.features lists \"{name}\" twice"));
                    }
                    bits |= 1 << bit;
                }
                (devices::BALLOON, bits)
            }
        };

        specs.push(VmSpec {
            name: vm.name.clone(),
            ram_size: ram,
            vcpus: vm.vcpus,
            cpu_affinity: affinity,
            kernel,
            initrd,
            cmdline,
            balloon_features,
            devices,
            on_bad_access: vm.on_bad_access,
        });
    }
    Ok(specs)
}

/// `Err` says what is wrong with a VM name.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} characters long; at most {MAX_NAME_LEN}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '_' | '-'))
    {
        return Err(format!(
            "contains {c:?}; use only lower-case letters, digits, '_' and '-'"
        ));
    }
    Ok(())
}

/// Bytes the kernel occupies in guest memory from the 2 MiB load offset: for
/// an arm64 `Image` (magic `ARM\x64` at byte 56) `text_offset + image_size`
/// (which includes the BSS), else the file length.
fn kernel_footprint(kernel: &[u8]) -> u64 {
    let file = kernel.len() as u64;
    if kernel.len() >= 64 && &kernel[56..60] == b"ARM\x64" {
        let word = |at: usize| u64::from_le_bytes(kernel[at..at + 8].try_into().unwrap());
        let (text_offset, image_size) = (word(8), word(16));
        if image_size != 0 {
            return text_offset.saturating_add(image_size).max(file);
        }
    }
    file
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &[u8] = &[0xaa; 10_000];
    const INITRD: &[u8] = &[0x55; 5000];

    fn root() -> PathBuf {
        // The workspace root (this crate's parent folder).
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf()
    }

    /// Loads the fake test guest for `/tg.bin` and `/kernels/*`, an initrd
    /// for `/initrds/*`, nothing else.
    fn fake_load(path: &Path) -> std::io::Result<Vec<u8>> {
        let s = path.to_string_lossy();
        if s.ends_with("/tg.bin") || s.contains("/kernels/") || s.ends_with("/fixtures/linux/Image")
        {
            Ok(KERNEL.to_vec())
        } else if s.contains("/initrds/") || s.ends_with("/fixtures/linux/initramfs.cpio") {
            Ok(INITRD.to_vec())
        } else if s.contains("/empty") {
            Ok(Vec::new())
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "No such file or directory",
            ))
        }
    }

    fn build(text: &str) -> Result<Vec<u8>, String> {
        bundle_from_str(
            text,
            "t.toml",
            Path::new("/ws"),
            Path::new("/ws/tg.bin"),
            &fake_load,
        )
    }

    fn err(text: &str) -> String {
        build(text).expect_err("config should be rejected")
    }

    const ONE: &str = r#"
[[vm]]
name = "alpha"
ram = "64M"
vcpus = 1
cpus = [1]
kernel = "testguest"
"#;

    /// `ONE` with `field = value` replaced or added.
    fn one_with(lines: &str) -> String {
        let key = |l: &str| l.split('=').next().unwrap().trim().to_string();
        let keys: Vec<String> = lines.lines().map(key).collect();
        let mut out: Vec<String> = ONE
            .lines()
            .filter(|l| !keys.contains(&key(l)))
            .map(String::from)
            .collect();
        out.push(lines.to_string());
        out.join("\n") + "\n"
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("4096K"), Ok(4 << 20));
        assert_eq!(parse_size("64m"), Ok(64 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1GB"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 8M "), Ok(8 << 20));
        for bad in ["", "M", "12X", "1.5G", "-1M", "0x10M", "12B", "1 G", "M12"] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
        assert!(parse_size("99999999999999999999")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_size("17179869184G")
            .unwrap_err()
            .contains("too large"));
        assert_eq!(format_size(256 << 20), "256M");
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(12 << 10), "12K");
        assert_eq!(format_size(100), "100");
    }

    #[test]
    fn demo_parses_and_round_trips() {
        let root = root();
        let text = std::fs::read_to_string(root.join("guests/demo.toml")).unwrap();
        let bytes = bundle_from_str(
            &text,
            "guests/demo.toml",
            &root,
            Path::new("/ws/tg.bin"),
            &fake_load,
        )
        .unwrap();
        let bundle = guest_bundle::parse(&bytes).unwrap();
        assert_eq!(bundle.vm_count(), 2);
        let a = bundle.vm(0).unwrap();
        assert_eq!(a.name(), "linux");
        assert_eq!(a.ram_size(), 512 << 20);
        assert_eq!(a.vcpus(), 2);
        assert_eq!(a.cpu_affinity(), (1 << 1) | (1 << 2));
        assert_eq!(a.kernel(), KERNEL);
        assert_eq!(a.initrd(), Some(INITRD));
        assert!(a.cmdline().is_some_and(|c| c.contains("console=ttyAMA0")));
        assert!(a.has_balloon());
        assert_eq!(a.devices(), devices::BALLOON);
        // Every balloon feature (bits 0-5) for the demo's Linux.
        assert_eq!(a.balloon_features(), 0x3f);
        let b = bundle.vm(1).unwrap();
        assert_eq!(b.name(), "beta");
        assert_eq!(b.ram_size(), 128 << 20);
        assert_eq!(b.cpu_affinity(), 1 << 3);
        assert_eq!(b.cmdline(), Some("pattern"));
        assert_eq!(b.balloon_features(), 1 << 0);
        assert_eq!(b.devices(), devices::BALLOON);
    }

    #[test]
    fn every_shipped_config_builds() {
        let root = root();
        let mut files = vec![root.join("guests/demo.toml")];
        for e in std::fs::read_dir(root.join("guests/tests")).unwrap() {
            files.push(e.unwrap().path());
        }
        let mut seen = Vec::new();
        for f in files
            .iter()
            .filter(|f| f.extension().is_some_and(|x| x == "toml"))
        {
            let text = std::fs::read_to_string(f).unwrap();
            let shown = f.strip_prefix(&root).unwrap().display().to_string();
            let bytes = bundle_from_str(&text, &shown, &root, Path::new("/ws/tg.bin"), &fake_load)
                .unwrap_or_else(|e| panic!("{e}"));
            let b = guest_bundle::parse(&bytes).unwrap_or_else(|e| panic!("{shown}: {e}"));
            seen.push((
                f.file_stem().unwrap().to_string_lossy().to_string(),
                b.vms()
                    .map(|v| {
                        (
                            v.name().to_string(),
                            v.ram_size() >> 20,
                            v.cpu_affinity(),
                            v.cmdline().map(String::from),
                        )
                    })
                    .collect::<Vec<_>>(),
            ));
        }
        seen.sort();
        let p = |s: &str| Some(s.to_string());
        let quiet = "console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet";
        let poisoned = "console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet page_poison=1";
        // The balloon feature bundles: one Linux guest on CPUs 1 and 2.
        let linux_alone = |bundle: &str, cmdline: &str| {
            (
                bundle.to_string(),
                vec![("linux".to_string(), 512, 6, p(cmdline))],
            )
        };
        let pair = vec![
            ("alpha".to_string(), 256, 2, p("pattern")),
            ("beta".to_string(), 128, 4, p("pattern")),
        ];
        assert_eq!(
            seen,
            vec![
                ("bench".into(), vec![("bench".into(), 256, 2, p("pattern"))]),
                (
                    "demo".into(),
                    vec![
                        (
                            "linux".into(),
                            512,
                            6,
                            p("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet")
                        ),
                        ("beta".into(), 128, 8, p("pattern"))
                    ]
                ),
                (
                    "faults".into(),
                    vec![
                        ("spinner".into(), 64, 2, p("spin")),
                        ("flooder".into(), 64, 4, p("flood")),
                        ("holder".into(), 128, 8, p("features hold-stats"))
                    ]
                ),
                (
                    "gd-features".into(),
                    vec![("gdf".into(), 128, 2, p("features"))]
                ),
                (
                    "gd-features-nopoison".into(),
                    vec![("gdf".into(), 128, 2, p("features"))]
                ),
                (
                    "hostile".into(),
                    vec![
                        ("hostile".into(), 128, 2, p("hostile")),
                        ("beta".into(), 128, 4, p("pattern"))
                    ]
                ),
                (
                    "linux".into(),
                    vec![(
                        "linux".into(),
                        512,
                        6,
                        p("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet")
                    )]
                ),
                linux_alone("linux-full", poisoned),
                linux_alone("linux-hint", quiet),
                (
                    "linux-multi".into(),
                    vec![
                        (
                            "linux2".into(),
                            512,
                            6,
                            p("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet")
                        ),
                        (
                            "linux1".into(),
                            384,
                            8,
                            p("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet")
                        ),
                        ("beta".into(), 128, 16, p("pattern"))
                    ]
                ),
                linux_alone("linux-oom", quiet),
                linux_alone("linux-poison", poisoned),
                linux_alone("linux-reporting", quiet),
                (
                    "linux-resets".into(),
                    vec![
                        ("linux".into(), 512, 6, p(quiet)),
                        ("beta".into(), 128, 8, p("pattern"))
                    ]
                ),
                linux_alone("linux-stats", quiet),
                ("pair".into(), pair),
                (
                    "wild".into(),
                    vec![
                        ("wild".into(), 64, 2, p("wild")),
                        ("strict".into(), 64, 8, p("wild")),
                        ("beta".into(), 128, 4, p("pattern"))
                    ]
                ),
            ]
        );
    }

    #[test]
    fn all_fields_round_trip() {
        let text = r#"
[[vm]]
name = "linux-1"
ram = "1G"
vcpus = 3
cpus = [3, 5, 7]
kernel = "kernels/Image"
initrd = "initrds/initramfs.cpio"
cmdline = "console=ttyAMA0 earlycon"
[vm.balloon]
features = ["must-tell-host", "stats", "deflate-on-oom", "free-page-hint", "page-poison", "free-page-reporting"]

[[vm]]
name = "bare_2"
ram = 33554432
vcpus = 1
cpus = [1]
kernel = "testguest"
on_bad_access = "stop"
"#;
        let bytes = build(text).unwrap();
        let b = guest_bundle::parse(&bytes).unwrap();
        let l = b.find("linux-1").unwrap();
        assert_eq!(l.ram_size(), 1 << 30);
        assert_eq!(l.vcpus(), 3);
        assert_eq!(l.cpu_affinity(), 0b1010_1000);
        assert_eq!(l.kernel(), KERNEL);
        assert_eq!(l.initrd(), Some(INITRD));
        assert_eq!(l.cmdline(), Some("console=ttyAMA0 earlycon"));
        assert_eq!(l.balloon_features(), 0b11_1111);
        assert_eq!(l.devices(), devices::BALLOON);
        assert_eq!(l.on_bad_access(), bad_access::ABORT, "the default");
        let m = b.find("bare_2").unwrap();
        assert_eq!(m.on_bad_access(), bad_access::STOP);
        assert_eq!(m.ram_size(), 32 << 20);
        assert_eq!(m.cmdline(), None);
        assert_eq!(m.initrd(), None);
        assert_eq!(m.devices(), 0);
        assert_eq!(m.balloon_features(), 0);
        assert!(!m.has_balloon());
    }

    #[test]
    fn balloon_without_features() {
        let b = build(&(ONE.to_string() + "[vm.balloon]\n")).unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        let v = b.vm(0).unwrap();
        assert_eq!(v.devices(), devices::BALLOON);
        assert_eq!(v.balloon_features(), 0);
    }

    #[test]
    fn error_messages() {
        let cases: Vec<(String, &str)> = vec![
            (one_with("ram = \"300K\""), "t.toml: VM \"alpha\": ram \"300K\" is not a multiple of 2 MiB"),
            (one_with("ram = \"3M\""), "t.toml: VM \"alpha\": ram \"3M\" is not a multiple of 2 MiB"),
            (one_with("ram = \"0M\""), "t.toml: VM \"alpha\": ram \"0M\" is zero"),
            (one_with("ram = \"lots\""), "t.toml: VM \"alpha\": ram \"lots\" is not a size"),
            (one_with("ram = \"2G\""), "t.toml: VM \"alpha\": ram \"2G\" brings the total of all VMs to 2G"),
            (one_with("ram = \"2M\""), "t.toml: VM \"alpha\": ram \"2M\" is too small"),
            (one_with("name = \"Alpha\""), "t.toml: VM 0: name \"Alpha\" contains 'A'"),
            (one_with("name = \"\""), "t.toml: VM 0: name \"\" is empty"),
            (
                one_with(&format!("name = \"{}\"", "a".repeat(32))),
                "is 32 characters long; at most 31",
            ),
            (one_with("vcpus = 2"), "t.toml: VM \"alpha\": vcpus is 2 but cpus lists 1 CPU(s) [1]"),
            (one_with("vcpus = 0\ncpus = []"), "t.toml: VM \"alpha\": vcpus is 0"),
            (one_with("cpus = [0]"), "t.toml: VM \"alpha\": cpus [0] includes CPU 0, which runs the hypervisor's shell"),
            (one_with("cpus = [8]"), "t.toml: VM \"alpha\": cpus [8] includes CPU 8; physical CPUs are numbered 1 to 7"),
            (
                one_with("vcpus = 2\ncpus = [3, 3]"),
                "t.toml: VM \"alpha\": cpus [3, 3] lists CPU 3 twice",
            ),
            (one_with("kernel = \"nope/Image\""), "t.toml: VM \"alpha\": kernel \"nope/Image\": cannot read /ws/nope/Image"),
            (one_with("kernel = \"empty\""), "t.toml: VM \"alpha\": kernel \"empty\": /ws/empty is empty"),
            (one_with("kernel = \"\""), "t.toml: VM \"alpha\": kernel is empty"),
            (one_with("initrd = \"nope.cpio\""), "t.toml: VM \"alpha\": initrd \"nope.cpio\": cannot read /ws/nope.cpio"),
            (one_with("initrd = \"\""), "t.toml: VM \"alpha\": initrd is empty"),
            (one_with("cmdline = \"a\\u0000b\""), "t.toml: VM \"alpha\": cmdline contains a NUL character"),
            (
                one_with(&format!("cmdline = \"{}\"", "x".repeat(3000))),
                "t.toml: VM \"alpha\": cmdline is 3000 bytes; at most 2047",
            ),
            (
                ONE.to_string() + "[vm.balloon]\nfeatures = [\"turbo\"]\n",
                "t.toml: VM \"alpha\": balloon.features: unknown feature \"turbo\"; known: must-tell-host, stats,",
            ),
            (
                ONE.to_string() + "[vm.balloon]\nfeatures = [\"stats\", \"stats\"]\n",
                "t.toml: VM \"alpha\": balloon.features lists \"stats\" twice",
            ),
            (
                ONE.to_string() + "[vm.balloon]\nfeature = [\"stats\"]\n",
                "t.toml: VM \"alpha\": unknown field `balloon.feature`; [vm.balloon] has features",
            ),
            (one_with("colour = \"blue\""), "t.toml: VM \"alpha\": unknown field `colour`; a [[vm]] table has name, ram,"),
            (ONE.replace("vcpus = 1\n", ""), "t.toml: VM \"alpha\": required field `vcpus` is missing"),
            (ONE.replace("name = \"alpha\"\n", ""), "t.toml: VM 0: required field `name` is missing"),
            (one_with("name = 5"), "t.toml: VM 0: name must be a string, found integer 5"),
            (
                one_with("on_bad_access = \"ignore\""),
                "t.toml: VM \"alpha\": on_bad_access \"ignore\" is unknown; it is \"abort\" (the default) or \"stop\"",
            ),
            (one_with("ram = 64.5"), "t.toml: VM \"alpha\": ram must be a size such as \"256M\" or an integer number of bytes, found float 64.5"),
            (one_with("ram = -2097152"), "t.toml: VM \"alpha\": ram -2097152 is negative"),
            (one_with("vcpus = -1"), "t.toml: VM \"alpha\": vcpus -1 is out of range (0 to 4294967295)"),
            (one_with("cpus = 1"), "t.toml: VM \"alpha\": cpus must be a list of CPU numbers such as [1], found integer 1"),
            (one_with("cpus = [\"1\"]"), "t.toml: VM \"alpha\": cpus must be an integer, found string \"1\" (cpus is a list of CPU numbers, e.g. [1])"),
            (one_with("kernel = 7"), "t.toml: VM \"alpha\": kernel must be a string, found integer 7"),
            (one_with("cmdline = [\"a\"]"), "t.toml: VM \"alpha\": cmdline must be a string, found array"),
            (one_with("balloon = true"), "t.toml: VM \"alpha\": balloon must be a table ([vm.balloon]), found boolean true"),
            (
                ONE.to_string() + "[vm.balloon]\nfeatures = \"stats\"\n",
                "t.toml: VM \"alpha\": balloon.features must be a list of feature names, found string \"stats\"",
            ),
            (
                ONE.to_string() + "[vm.balloon]\nfeatures = [1]\n",
                "t.toml: VM \"alpha\": balloon.features must be a string, found integer 1",
            ),
            ("vm = 5\n".into(), "t.toml: `vm` must be a list of [[vm]] tables, found integer 5"),
            ("vm = [5]\n".into(), "t.toml: VM 0: must be a [[vm]] table, found integer 5"),
            ("title = \"x\"\n".to_string() + ONE, "t.toml: unknown top-level key `title`"),
            (one_with("vcpus = \"1\""), "t.toml: VM \"alpha\": vcpus must be an integer, found string \"1\""),
            ("".into(), "t.toml: no VMs"),
            ("[[vm]\n".into(), "t.toml: TOML parse error"),
            (ONE.to_string() + ONE, "t.toml: VM \"alpha\": name is used twice (VM 0 and VM 1)"),
            (
                ONE.to_string() + &ONE.replace("alpha", "beta"),
                "t.toml: VM \"beta\": cpus [1] includes CPU 1, already given to VM \"alpha\"",
            ),
        ];
        for (text, want) in cases {
            let got = err(&text);
            assert!(
                got.contains(want),
                "config:\n{text}\nwant: {want}\ngot:  {got}"
            );
        }
    }

    #[test]
    fn testguest_missing_says_how_to_build_it() {
        let e = bundle_from_str(
            ONE,
            "t.toml",
            Path::new("/ws"),
            Path::new("/nowhere/tg.img"),
            &fake_load,
        )
        .unwrap_err();
        assert!(
            e.starts_with(
                "t.toml: VM \"alpha\": kernel \"testguest\": cannot read /nowhere/tg.img"
            ),
            "{e}"
        );
        assert!(e.contains("cargo xtask build"), "{e}");
    }

    #[test]
    fn image_header_sets_the_kernel_footprint() {
        let mut image = vec![0u8; 4096];
        image[8..16].copy_from_slice(&0u64.to_le_bytes());
        image[16..24].copy_from_slice(&(40u64 << 20).to_le_bytes());
        image[56..60].copy_from_slice(b"ARM\x64");
        assert_eq!(kernel_footprint(&image), 40 << 20);
        assert_eq!(kernel_footprint(KERNEL), KERNEL.len() as u64);
        // A 40 MiB-in-memory Image does not fit in 32 MiB of RAM.
        let load = move |p: &Path| -> std::io::Result<Vec<u8>> {
            if p.ends_with("Image") {
                Ok(image.clone())
            } else {
                fake_load(p)
            }
        };
        let text = one_with("kernel = \"Image\"").replace("64M", "32M");
        let e = bundle_from_str(
            &text,
            "t.toml",
            Path::new("/ws"),
            Path::new("/ws/tg.bin"),
            &load,
        )
        .unwrap_err();
        assert!(
            e.contains("ram \"32M\" is too small") && e.contains("use at least \"42M\""),
            "{e}"
        );
        let ok = text.replace("32M", "42M");
        bundle_from_str(
            &ok,
            "t.toml",
            Path::new("/ws"),
            Path::new("/ws/tg.bin"),
            &load,
        )
        .unwrap();
    }

    #[test]
    fn build_all_writes_every_bundle() {
        let dir = std::env::temp_dir().join(format!("tidal-vmconfig-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("guests/tests")).unwrap();
        let tg = dir.join("tg.bin");
        std::fs::write(&tg, KERNEL).unwrap();
        std::fs::write(dir.join("guests/demo.toml"), ONE).unwrap();
        std::fs::write(dir.join("guests/tests/b.toml"), ONE.replace("alpha", "bee")).unwrap();
        std::fs::write(dir.join("guests/tests/a.toml"), ONE).unwrap();
        std::fs::write(dir.join("guests/tests/notes.txt"), "not a config").unwrap();
        let built = build_all(&dir, &tg).unwrap();
        let names: Vec<&str> = built.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["demo", "a", "b"]);
        assert_eq!(built[0].1, dir.join("target/guests.img"));
        assert_eq!(built[2].1, dir.join("target/bundles/b.img"));
        let bytes = std::fs::read(&built[2].1).unwrap();
        assert_eq!(
            guest_bundle::parse(&bytes).unwrap().vm(0).unwrap().name(),
            "bee"
        );
        // A bad file is reported by its path relative to the root.
        std::fs::write(dir.join("guests/tests/c.toml"), one_with("ram = \"300K\"")).unwrap();
        assert_eq!(
            build_all(&dir, &tg).unwrap_err(),
            "guests/tests/c.toml: VM \"alpha\": ram \"300K\" is not a multiple of 2 MiB"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
