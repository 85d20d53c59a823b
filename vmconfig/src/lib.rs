//! VM configuration files (`guests/*.toml`) and the guest bundles built from
//! them.
//!
//! The format is documented in `docs/CONFIGURATION.md`. In short:
//!
//! ```toml
//! [[vm]]
//! name = "alpha"          # [a-z0-9_-], 1 to 31 characters, unique
//! ram = "256M"            # K/M/G suffix (or plain bytes); a multiple of 2 MiB
//! vcpus = 1
//! cpus = [1]              # one physical CPU per vCPU (0 to 7; CPU 0 shares with the shell)
//! kernel = "testguest"    # or an arm64 Image's path (relative: to this file's folder)
//! initrd = "path"         # optional
//! modules = "path"        # optional: the kernel's lib/modules/<release>; initramfs generated
//! linux_deb = "path"      # instead of kernel: a linux-image-*-arm64 .deb; initramfs generated
//! cmdline = "pattern"     # optional
//! restore = "snap-1"      # optional: start from this snapshot on the board's disk instead of booting
//! [vm.balloon]            # optional; absent: no balloon device
//! features = ["must-tell-host"]
//! [vm.memory]             # optional; every key optional
//! min = "128M"            # never reclaimed below (default none)
//! low = "256M"            # reclaimed below only when no VM is above its low (default min)
//! max = "768M"            # never backed above (default ram)
//! weight = 100            # 1 to 10000 (default 100)
//! prealloc = false        # true: all RAM backed at start
//!
//! [pool]                  # optional; the hypervisor's free page pool
//! min = "16M"             # watermarks: all three or none (default: from RAM)
//! low = "48M"
//! high = "80M"
//! when_exhausted = "stop-lowest" # or "wait" (without bound)
//!
//! [board]                 # optional; the board itself
//! address = "10.0.0.2/24" # its IPv4 address on its network card (QEMU virt)
//!
//! on_target_tests = true  # optional, top level (before any table): the
//!                         # hypervisor runs its on-target self-checks
//! ```
//!
//! RAM may be overcommitted: the VMs' `ram` may add up to more than the board
//! has, but what they are guaranteed (`memory.min`, or `ram` with
//! `prealloc`) may not exceed [`MAX_GUARANTEED`] (the largest board's), and
//! each board checks it against its own RAM at boot.
//!
//! [`build_bundle`] parses and validates one file and returns the bundle
//! bytes; [`build_all`] writes `target/guests.img` from `guests/demo.toml` and
//! `target/bundles/<name>.img` for every `guests/tests/<name>.toml`.
//! [`needs`] says what a file's VMs need built first (the test guest, the
//! Linux fixture, initramfs images to generate), and [`build_bundle_with`]
//! takes what was built. Every error names the file, the line and column,
//! the VM and the field.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::de::{DeString, DeTable, DeValue};

use guest_bundle::{
    bad_access, devices, BoardAddress, BundleBuilder, PoolSpec, VmMemory, VmSpec, MAX_WEIGHT,
    MEM_ALIGN,
};

/// The name `kernel` takes for the test guest built from `guest-driver/testguest`.
pub const TESTGUEST: &str = "testguest";

/// Longest VM name (the bundle's 32-byte field keeps room for a NUL).
pub const MAX_NAME_LEN: usize = 31;

/// Physical CPUs a VM may be pinned to are `0..MAX_CPUS` (the platform
/// crate describes at most 8 CPUs; a vCPU on CPU 0 shares it with the
/// hypervisor's shell).
pub const MAX_CPUS: u32 = 8;

/// Guest RAM sizes are multiples of this (stage 2 can then use 2 MiB blocks,
/// and the guest board puts the kernel at RAM base + 2 MiB).
pub const RAM_GRANULE: u64 = 2 << 20;

/// Most memory all VMs of one configuration may be guaranteed together (the
/// sum of `memory.min`, or of `ram` for VMs with `memory.prealloc`) on any
/// board: the largest, a Raspberry Pi 4 with 8 GiB, less what the
/// hypervisor, its frame table, the bundle and the firmware need. A bundle
/// is not built for one board; each board checks the guarantees against its
/// own RAM when it starts the VMs (a VM whose guarantee its pool cannot
/// hold is not started, with the shortfall named). The sum of `ram` itself
/// is not limited (overcommit).
pub const MAX_GUARANTEED: u64 = (8 << 30) - (512 << 20);

/// Most RAM one VM may have: a sanity limit, and well inside the
/// hypervisor's 16 GiB guest-physical space (RAM starts at 1 GiB).
pub const MAX_VM_RAM: u64 = 8 << 30;

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
const VM_KEYS: [&str; 14] = [
    "name",
    "ram",
    "vcpus",
    "cpus",
    "kernel",
    "initrd",
    "modules",
    "linux_deb",
    "cmdline",
    "balloon",
    "on_bad_access",
    "memory",
    "console",
    "restore",
];

/// Keys a `[vm.memory]` table may have.
const MEMORY_KEYS: [&str; 5] = ["min", "low", "max", "weight", "prealloc"];

/// Keys the `[pool]` table may have.
const POOL_KEYS: [&str; 4] = ["min", "low", "high", "when_exhausted"];

/// Keys the `[board]` table may have.
const BOARD_KEYS: [&str; 1] = ["address"];

/// Values of `[pool] when_exhausted` and whether they set the bundle's
/// wait flag (vCPUs wait for a frame without bound).
const EXHAUSTED_POLICIES: [(&str, bool); 2] = [("stop-lowest", false), ("wait", true)];

/// A size as written (for messages) and its value in bytes.
type Size = (String, u64);

/// One `[vm.memory]` table, types checked, values not yet validated.
#[derive(Debug, Default)]
struct MemoryConfig {
    min: Option<Size>,
    low: Option<Size>,
    max: Option<Size>,
    /// 1 to `MAX_WEIGHT`.
    weight: Option<u32>,
    prealloc: bool,
}

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
    /// `None` only with `linux_deb` (the package holds the kernel).
    kernel: Option<String>,
    initrd: Option<String>,
    /// A user kernel's modules directory: the initramfs is generated.
    modules: Option<String>,
    /// A Debian `linux-image-*` package: kernel and generated initramfs.
    linux_deb: Option<String>,
    cmdline: Option<String>,
    /// The snapshot it starts from instead of booting.
    restore: Option<String>,
    /// `Some(features)` when `[vm.balloon]` is present.
    balloon: Option<Vec<String>>,
    /// A [`bad_access`] code (default abort).
    on_bad_access: u32,
    /// `console = "virtio"`: a virtio console beside the PL011.
    virtio_console: bool,
    /// `[vm.memory]`, or the defaults.
    memory: MemoryConfig,
}

/// `value` for a message: `string "1"`, `integer 5`, `array [1, 2]`.
fn describe(value: &toml::Value) -> String {
    format!("{} {value}", value.type_str())
}

fn wrong_type(key: &str, want: &str, value: &toml::Value) -> String {
    format!("{key} must be {want}, found {}", describe(value))
}

/// A size field (`"256M"` or an integer number of bytes); `key` names it in
/// messages.
fn size_field(key: &str, value: &toml::Value) -> Result<Size, String> {
    match value {
        toml::Value::String(text) => parse_size(text)
            .map(|n| (text.clone(), n))
            .map_err(|e| format!("{key} {e}")),
        toml::Value::Integer(n) => u64::try_from(*n)
            .map(|b| (n.to_string(), b))
            .map_err(|_| format!("{key} {n} is negative")),
        other => Err(wrong_type(
            key,
            "a size such as \"256M\" or an integer number of bytes",
            other,
        )),
    }
}

/// `Err` when `size` (field `key`) is not a multiple of 4 KiB, saying what
/// to write instead.
fn check_granule(key: &str, (text, value): &Size) -> Result<(), String> {
    if value.is_multiple_of(MEM_ALIGN) {
        return Ok(());
    }
    let up = value.div_ceil(MEM_ALIGN).saturating_mul(MEM_ALIGN);
    Err(format!(
        "{key} \"{text}\" is not a multiple of 4 KiB; use \"{}\"",
        format_size(up)
    ))
}

impl MemoryConfig {
    /// Reads `[vm.memory]`; `Err` names the field.
    fn from_value(value: &toml::Value) -> Result<MemoryConfig, String> {
        let toml::Value::Table(t) = value else {
            return Err(wrong_type("memory", "a table ([vm.memory])", value));
        };
        if let Some(k) = t.keys().find(|k| !MEMORY_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "unknown field `memory.{k}`; [vm.memory] has {}",
                MEMORY_KEYS.join(", ")
            ));
        }
        let size = |key: &str| {
            t.get(key)
                .map(|v| size_field(&format!("memory.{key}"), v))
                .transpose()
        };
        let weight = match t.get("weight") {
            None => None,
            Some(v) => match v.as_integer() {
                Some(n) if (1..=i64::from(MAX_WEIGHT)).contains(&n) => Some(n as u32),
                Some(n) => {
                    return Err(format!(
                        "memory.weight {n} is out of range; use 1 to {MAX_WEIGHT} (default 100)"
                    ))
                }
                None => return Err(wrong_type("memory.weight", "an integer", v)),
            },
        };
        let prealloc = match t.get("prealloc") {
            None => false,
            Some(toml::Value::Boolean(b)) => *b,
            Some(other) => return Err(wrong_type("memory.prealloc", "true or false", other)),
        };
        Ok(MemoryConfig {
            min: size("min")?,
            low: size("low")?,
            max: size("max")?,
            weight,
            prealloc,
        })
    }

    /// Validates the limits against `ram` (already valid, written as
    /// `ram_text`) and returns them as the bundle stores them.
    fn check(&self, ram: u64, ram_text: &str) -> Result<VmMemory, String> {
        for (key, size) in [
            ("memory.min", &self.min),
            ("memory.low", &self.low),
            ("memory.max", &self.max),
        ] {
            if let Some(size) = size {
                check_granule(key, size)?;
            }
        }
        if let Some((text, max)) = &self.max {
            if *max == 0 {
                return Err(format!(
                    "memory.max \"{text}\" is zero; leave it out for no limit below ram"
                ));
            }
            if *max > ram {
                return Err(format!(
                    "memory.max \"{text}\" is more than ram \"{ram_text}\"; use at most \"{}\"",
                    format_size(ram)
                ));
            }
        }
        if let (Some((min_text, min)), Some((low_text, low))) = (&self.min, &self.low) {
            if min > low {
                return Err(format!(
                    "memory.min \"{min_text}\" is more than memory.low \"{low_text}\""
                ));
            }
        }
        let (max_key, max_text, max) = match &self.max {
            Some((text, max)) => ("memory.max", text.as_str(), *max),
            None => ("ram", ram_text, ram),
        };
        for (key, size) in [("memory.min", &self.min), ("memory.low", &self.low)] {
            if let Some((text, value)) = size {
                if *value > max {
                    return Err(format!(
                        "{key} \"{text}\" is more than {max_key} \"{max_text}\""
                    ));
                }
            }
        }
        let bytes = |s: &Option<Size>| s.as_ref().map_or(0, |(_, n)| *n);
        Ok(VmMemory {
            min: bytes(&self.min),
            low: bytes(&self.low),
            max: bytes(&self.max),
            weight: self.weight.unwrap_or(0),
            prealloc: self.prealloc,
        })
    }
}

/// Reads and validates the top-level `[pool]` table; `Err` names the field.
fn pool_from_value(value: &toml::Value) -> Result<PoolSpec, String> {
    let toml::Value::Table(t) = value else {
        return Err(format!(
            "must be a table ([pool]), found {}",
            describe(value)
        ));
    };
    if let Some(k) = t.keys().find(|k| !POOL_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field `{k}`; [pool] has {}",
            POOL_KEYS.join(", ")
        ));
    }
    let wait = match t.get("when_exhausted") {
        None => false,
        Some(toml::Value::String(word)) => EXHAUSTED_POLICIES
            .iter()
            .find(|(w, _)| w == word)
            .map(|&(_, wait)| wait)
            .ok_or_else(|| {
                format!(
                    "when_exhausted \"{word}\" is unknown; it is \"stop-lowest\" (the default) or \"wait\""
                )
            })?,
        Some(other) => return Err(wrong_type("when_exhausted", "a string", other)),
    };
    let mut marks = Vec::new();
    for key in ["min", "low", "high"] {
        let size = t.get(key).map(|v| size_field(key, v)).transpose()?;
        if let Some(size) = &size {
            check_granule(key, size)?;
            if size.1 == 0 {
                return Err(format!(
                    "{key} \"{}\" is zero; leave min, low and high out for the defaults (1%, 3% and 5% of RAM)",
                    size.0
                ));
            }
        }
        marks.push((key, size));
    }
    let missing: Vec<&str> = marks
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(k, _)| *k)
        .collect();
    if missing.len() == 3 {
        return Ok(PoolSpec {
            wait,
            ..PoolSpec::default()
        });
    }
    if !missing.is_empty() {
        return Err(format!(
            "{} missing; give all of min, low and high, or none for the defaults (1%, 3% and 5% of RAM)",
            missing.join(" and ")
        ));
    }
    let get = |i: usize| marks[i].1.clone().unwrap_or_default();
    let ((min_text, min), (low_text, low), (high_text, high)) = (get(0), get(1), get(2));
    if low < min {
        return Err(format!("low \"{low_text}\" is below min \"{min_text}\""));
    }
    if high < low {
        return Err(format!("high \"{high_text}\" is below low \"{low_text}\""));
    }
    Ok(PoolSpec {
        min,
        low,
        high,
        wait,
    })
}

/// Reads and validates the top-level `[board]` table: the board's network
/// address, if it has one; `Err` names the field.
fn board_from_value(value: &toml::Value) -> Result<Option<BoardAddress>, String> {
    let toml::Value::Table(t) = value else {
        return Err(format!(
            "must be a table ([board]), found {}",
            describe(value)
        ));
    };
    if let Some(k) = t.keys().find(|k| !BOARD_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field `{k}`; [board] has {}",
            BOARD_KEYS.join(", ")
        ));
    }
    match t.get("address") {
        None => Ok(None),
        Some(toml::Value::String(text)) => BoardAddress::parse(text)
            .map(Some)
            .map_err(|why| format!("address \"{text}\": {why}")),
        Some(other) => Err(wrong_type("address", "a string", other)),
    }
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
        let kernel = optional_string("kernel")?;
        let initrd = optional_string("initrd")?;
        let modules = optional_string("modules")?;
        let linux_deb = optional_string("linux_deb")?;
        let cmdline = optional_string("cmdline")?;
        let restore = optional_string("restore")?;
        if let Some(r) = &restore {
            if r.is_empty() || r.len() > 32 || !r.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "restore \"{r}\" is not a snapshot name: 1 to 32 printable characters without spaces"
                ));
            }
        }
        if linux_deb.is_some() {
            for (key, given) in [
                ("kernel", kernel.is_some()),
                ("initrd", initrd.is_some()),
                ("modules", modules.is_some()),
            ] {
                if given {
                    return Err(format!(
                        "linux_deb and {key} exclude each other: the package gives the kernel and its modules, and the initramfs is generated"
                    ));
                }
            }
        } else if kernel.is_none() {
            return Err("required field `kernel` is missing".into());
        }
        if modules.is_some() {
            if initrd.is_some() {
                return Err("modules and initrd exclude each other: with modules the initramfs is generated (busybox, the agent and the kernel's virtio modules); leave initrd out, or modules out to use your own initramfs".into());
            }
            if let Some(k) = kernel.as_deref().filter(|k| *k == TESTGUEST) {
                return Err(format!(
                    "modules needs kernel to be your own arm64 Image, not \"{k}\""
                ));
            }
        }
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
        let virtio_console = match optional_string("console")?.as_deref() {
            None | Some("pl011") => false,
            Some("virtio") => true,
            Some(word) => {
                return Err(format!(
                    "console \"{word}\" is unknown; it is \"pl011\" (the default) or \"virtio\" (a virtio console beside the PL011: Linux's /dev/hvc0)"
                ))
            }
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
        let memory = match t.get("memory") {
            None => MemoryConfig::default(),
            Some(v) => MemoryConfig::from_value(v)?,
        };
        Ok(VmConfig {
            name,
            ram_text,
            ram,
            vcpus,
            cpus,
            kernel,
            initrd,
            modules,
            linux_deb,
            cmdline,
            restore,
            balloon,
            on_bad_access,
            virtio_console,
            memory,
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

/// The kernel command line a VM with a generated initramfs (`modules` or
/// `linux_deb`) gets when the configuration gives none: the console on the
/// guest's PL011 and the initramfs's `/init`, as for the Linux fixture.
pub const LINUX_CMDLINE: &str = "console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet";

/// The Linux fixture's kernel and initramfs, as configurations name them
/// (`cargo xtask` builds them under the workspace root, whatever folder the
/// configuration is in).
pub const LINUX_FIXTURE_KERNEL: &str = "target/fixtures/linux/Image";
/// See [`LINUX_FIXTURE_KERNEL`].
pub const LINUX_FIXTURE_INITRD: &str = "target/fixtures/linux/initramfs.cpio";

/// A Linux guest whose initramfs `cargo xtask` generates (busybox, the
/// agent, `tidal-mem` and the kernel's virtio modules), as a configuration
/// asks for it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinuxSource {
    /// `kernel` and `modules`: an arm64 `Image` (or `Image.gz`) and its
    /// modules directory (`lib/modules/<release>`).
    Image { kernel: PathBuf, modules: PathBuf },
    /// `linux_deb`: a Debian `linux-image-*-arm64` package.
    Deb(PathBuf),
}

/// What `cargo xtask` made for a [`LinuxSource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedLinux {
    /// The uncompressed arm64 `Image`.
    pub kernel: PathBuf,
    /// The generated initramfs.
    pub initrd: PathBuf,
}

/// What a configuration needs built before its bundle can be: see [`needs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Needs {
    /// Some VM runs the test guest (`kernel = "testguest"`).
    pub testguest: bool,
    /// Some VM names the Linux fixture ([`LINUX_FIXTURE_KERNEL`] or
    /// [`LINUX_FIXTURE_INITRD`]).
    pub linux_fixture: bool,
    /// The generated Linux guests, each once, in file order.
    pub linux: Vec<LinuxSource>,
}

/// What the names in a configuration stand for.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// The workspace root: the Linux fixture's names resolve against it.
    pub root: &'a Path,
    /// The test guest's raw image (`kernel = "testguest"`).
    pub testguest: &'a Path,
    /// The generated Linux guests.
    pub generated: &'a HashMap<LinuxSource, GeneratedLinux>,
}

/// `path` from a configuration in folder `base`: the Linux fixture's names
/// are under the workspace `root`, other relative paths under `base`.
fn resolve(base: &Path, root: &Path, path: &str) -> PathBuf {
    if path == LINUX_FIXTURE_KERNEL || path == LINUX_FIXTURE_INITRD {
        root.join(path)
    } else {
        base.join(path)
    }
}

impl VmConfig {
    /// The generated Linux guest this VM asks for, paths resolved.
    fn linux_source(&self, base: &Path, root: &Path) -> Option<LinuxSource> {
        if let Some(deb) = &self.linux_deb {
            return Some(LinuxSource::Deb(resolve(base, root, deb)));
        }
        let (kernel, modules) = (self.kernel.as_ref()?, self.modules.as_ref()?);
        Some(LinuxSource::Image {
            kernel: resolve(base, root, kernel),
            modules: resolve(base, root, modules),
        })
    }

    /// `linux_deb "…"` or `modules "…"`, for messages.
    fn linux_field(&self) -> String {
        match (&self.linux_deb, &self.modules) {
            (Some(deb), _) => format!("linux_deb \"{deb}\""),
            (None, Some(m)) => format!("modules \"{m}\""),
            (None, None) => "kernel".into(),
        }
    }
}

/// A configuration file's text, the name its errors show (relative to
/// `root` when inside it) and its folder.
fn read_config(config: &Path, root: &Path) -> Result<(String, String, PathBuf), String> {
    let shown = config
        .strip_prefix(root)
        .unwrap_or(config)
        .display()
        .to_string();
    let text = std::fs::read_to_string(config).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    let base = config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    Ok((text, shown, base))
}

/// Parses and validates the configuration file `config` and returns the
/// guest bundle it describes. Relative kernel and initrd paths are relative
/// to the file's folder, but the Linux fixture's names
/// ([`LINUX_FIXTURE_KERNEL`]) are under `root` (the workspace root);
/// `kernel = "testguest"` means `testguest_image`. A VM whose initramfs is
/// generated (`modules`, `linux_deb`) needs [`build_bundle_with`].
///
/// Errors name the file (relative to `root` when inside it), the line and
/// column, the VM and the field, e.g. `guests/demo.toml:7:7: VM "alpha": ram
/// "300K" is not a multiple of 2 MiB`.
pub fn build_bundle(config: &Path, root: &Path, testguest_image: &Path) -> Result<Vec<u8>, String> {
    build_bundle_with(
        config,
        &Inputs {
            root,
            testguest: testguest_image,
            generated: &HashMap::new(),
        },
    )
}

/// [`build_bundle`] with the generated Linux guests [`needs`] asked for.
pub fn build_bundle_with(config: &Path, inputs: &Inputs) -> Result<Vec<u8>, String> {
    let (text, shown, base) = read_config(config, inputs.root)?;
    let loader = |path: &Path| std::fs::read(path);
    bundle_from_str_in(&text, &shown, &base, inputs, &loader)
}

/// What the configuration file `config` needs built (the test guest, the
/// Linux fixture, generated Linux guests), after checking every key and
/// type in it: so a caller builds only what is used, and a misspelt key is
/// reported before anything is built.
pub fn needs(config: &Path, root: &Path) -> Result<Needs, String> {
    let (text, shown, base) = read_config(config, root)?;
    needs_from_str(&text, &shown, &base, root)
}

/// [`needs`] of a configuration's text; `file` is the name errors show,
/// `base` its folder.
pub fn needs_from_str(text: &str, file: &str, base: &Path, root: &Path) -> Result<Needs, String> {
    let doc = parse_doc(text, file)?;
    let loc = Locator::new(text, file);
    let vms = read_vms(&doc, &loc)?;
    let mut needs = Needs::default();
    for vm in &vms {
        let names = [vm.kernel.as_deref(), vm.initrd.as_deref()];
        needs.testguest |= names[0] == Some(TESTGUEST);
        needs.linux_fixture |= names
            .iter()
            .any(|n| matches!(*n, Some(LINUX_FIXTURE_KERNEL | LINUX_FIXTURE_INITRD)));
        if let Some(source) = vm.linux_source(base, root) {
            if !needs.linux.contains(&source) {
                needs.linux.push(source);
            }
        }
    }
    Ok(needs)
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
/// and the fuzz target replace it). `file` is the name errors show. Every
/// relative path is relative to `root` here (see [`bundle_from_str_in`]).
pub fn bundle_from_str(
    text: &str,
    file: &str,
    root: &Path,
    testguest_image: &Path,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let inputs = Inputs {
        root,
        testguest: testguest_image,
        generated: &HashMap::new(),
    };
    bundle_from_str_in(text, file, root, &inputs, load)
}

/// [`bundle_from_str`] for a configuration in folder `base` (relative paths
/// other than the Linux fixture's names resolve against it).
pub fn bundle_from_str_in(
    text: &str,
    file: &str,
    base: &Path,
    inputs: &Inputs,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let (specs, pool, on_target_tests, board_address) =
        specs_from_str(text, file, base, inputs, load)?;
    let mut builder = BundleBuilder::new();
    builder
        .on_target_tests(on_target_tests)
        .board_address(board_address);
    builder
        .pool(pool)
        .map_err(|e| format!("{file}: bundle writer refused {e}"))?;
    for (spec, memory) in specs {
        builder
            .add_vm_with_memory(spec, memory)
            .map_err(|e| format!("{file}: bundle writer refused {e}"))?;
    }
    Ok(builder.build())
}

// ------------------------------------------------------------- locations

/// Where keys and values are in a configuration's text, for messages:
/// `file:line:column`.
struct Locator<'t> {
    text: &'t str,
    file: &'t str,
    /// `None` if the text does not parse (then no location is given).
    doc: Option<toml::Spanned<DeTable<'t>>>,
}

impl<'t> Locator<'t> {
    fn new(text: &'t str, file: &'t str) -> Locator<'t> {
        Locator {
            text,
            file,
            doc: DeTable::parse(text).ok(),
        }
    }

    /// The span of the value at top-level `key` (element `index` of it if
    /// given), then down the table keys of `path`; as deep as they exist.
    fn span(&self, key: &str, index: Option<usize>, path: &[&str]) -> Option<Range<usize>> {
        fn get<'d, 'i>(
            t: &'d DeTable<'i>,
            k: &str,
        ) -> Option<(
            &'d toml::Spanned<DeString<'i>>,
            &'d toml::Spanned<DeValue<'i>>,
        )> {
            t.iter().find(|(name, _)| name.get_ref() == k)
        }
        let doc = self.doc.as_ref()?;
        let (_, mut value) = get(doc.get_ref(), key)?;
        if let Some(i) = index {
            value = value.get_ref().as_array()?.get(i)?;
        }
        for k in path {
            let Some((_, v)) = value.get_ref().as_table().and_then(|t| get(t, k)) else {
                break;
            };
            value = v;
        }
        Some(value.span())
    }

    /// `file:line:column` of `span`'s start, or `file` without one.
    fn at(&self, span: Option<Range<usize>>) -> String {
        let Some(span) = span else {
            return self.file.to_string();
        };
        let before = &self.text[..span.start.min(self.text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
        format!("{}:{line}:{column}", self.file)
    }

    /// Where the message `msg` about VM `index` points: at the field it
    /// starts with (see [`field_of`]), else at the VM's `[[vm]]` line.
    fn vm(&self, index: usize, msg: &str) -> String {
        let field = field_of(msg);
        let path: Vec<&str> = field.split('.').collect();
        self.at(self.span("vm", Some(index), &path))
    }

    /// Where the message `msg` about the `[pool]` table points.
    fn pool(&self, msg: &str) -> String {
        self.at(self.span("pool", None, &[field_of(msg)]))
    }

    /// Where the message `msg` about the `[board]` table points.
    fn board(&self, msg: &str) -> String {
        self.at(self.span("board", None, &[field_of(msg)]))
    }
}

/// The field a message is about. Messages start with the field, dotted
/// inside a sub-table (`ram "3M" is …`, `memory.max "900M" …`,
/// `balloon.features: …`), or say `unknown field `k`` or `required field
/// `k``.
fn field_of(msg: &str) -> &str {
    for prefix in ["unknown field `", "required field `"] {
        if let Some(rest) = msg.strip_prefix(prefix) {
            return rest.split('`').next().unwrap_or("");
        }
    }
    msg.split([' ', ':']).next().unwrap_or("")
}

/// The text as a TOML table; a syntax error names the line and column.
fn parse_doc(text: &str, file: &str) -> Result<toml::Table, String> {
    toml::from_str(text).map_err(|e| {
        let at = Locator {
            text,
            file,
            doc: None,
        }
        .at(e.span());
        let msg = e.message().trim_end().replace('\n', "; ");
        format!("{at}: TOML syntax error: {msg}")
    })
}

/// The `[[vm]]` tables, keys and types checked; every error located.
fn read_vms(doc: &toml::Table, loc: &Locator) -> Result<Vec<VmConfig>, String> {
    let file = loc.file;
    if let Some(k) = doc
        .keys()
        .find(|k| !matches!(k.as_str(), "vm" | "pool" | "board" | "on_target_tests"))
    {
        return Err(format!(
            "{}: unknown top-level key `{k}`; a configuration is a list of [[vm]] tables, an optional [pool] table, an optional [board] table and an optional on_target_tests = true",
            loc.at(loc.span(k, None, &[]))
        ));
    }
    let tables = match doc.get("vm") {
        None => &Vec::new(),
        Some(toml::Value::Array(list)) => list,
        Some(other) => {
            return Err(format!(
                "{}: `vm` must be a list of [[vm]] tables, found {}",
                loc.at(loc.span("vm", None, &[])),
                describe(other)
            ))
        }
    };
    if tables.is_empty() {
        return Err(format!(
            "{file}: no VMs: add at least one [[vm]] table (see docs/CONFIGURATION.md)"
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
                "{}: VM {index}: must be a [[vm]] table, found {}",
                loc.at(loc.span("vm", Some(index), &[])),
                describe(table)
            ));
        };
        let who = match t.get("name").and_then(|n| n.as_str()) {
            Some(n) if check_name(n).is_ok() => format!("VM \"{n}\""),
            _ => format!("VM {index}"),
        };
        vms.push(
            VmConfig::from_table(t).map_err(|e| format!("{}: {who}: {e}", loc.vm(index, &e)))?,
        );
    }
    Ok(vms)
}

/// What the VMs checked so far hold, for the checks across VMs.
#[derive(Default)]
struct Seen<'a> {
    names: HashMap<&'a str, usize>,
    cpu_owner: HashMap<u32, &'a str>,
    /// Memory guaranteed to the VMs so far.
    guaranteed: u64,
}

/// What a file describes: each VM with its memory limits, the pool,
/// whether the bundle runs the on-target checks, and the board's address.
type FileSpecs = (
    Vec<(VmSpec, VmMemory)>,
    PoolSpec,
    bool,
    Option<BoardAddress>,
);

fn specs_from_str(
    text: &str,
    file: &str,
    base: &Path,
    inputs: &Inputs,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<FileSpecs, String> {
    let doc = parse_doc(text, file)?;
    let loc = Locator::new(text, file);
    let vms = read_vms(&doc, &loc)?;
    let mut seen = Seen::default();
    let mut specs = Vec::with_capacity(vms.len());
    for (index, vm) in vms.iter().enumerate() {
        // Name first: every later message uses it.
        check_name(&vm.name).map_err(|e| {
            format!(
                "{}: VM {index}: name \"{}\" {e}",
                loc.vm(index, "name"),
                vm.name
            )
        })?;
        let spec = check_vm(vm, index, &mut seen, base, inputs, load)
            .map_err(|e| format!("{}: VM \"{}\": {e}", loc.vm(index, &e), vm.name))?;
        specs.push(spec);
    }
    let pool = match doc.get("pool") {
        None => PoolSpec::default(),
        Some(v) => pool_from_value(v).map_err(|e| format!("{}: pool: {e}", loc.pool(&e)))?,
    };
    let on_target_tests = match doc.get("on_target_tests") {
        None => false,
        Some(toml::Value::Boolean(b)) => *b,
        Some(other) => {
            return Err(format!(
                "{}: on_target_tests must be true or false, found {}",
                loc.at(loc.span("on_target_tests", None, &[])),
                describe(other)
            ))
        }
    };
    let board_address = match doc.get("board") {
        None => None,
        Some(v) => board_from_value(v).map_err(|e| format!("{}: board: {e}", loc.board(&e)))?,
    };
    Ok((specs, pool, on_target_tests, board_address))
}

/// Validates VM `index` against itself and the VMs before it (`seen`) and
/// loads its files; `Err` starts with the field.
fn check_vm<'a>(
    vm: &'a VmConfig,
    index: usize,
    seen: &mut Seen<'a>,
    base: &Path,
    inputs: &Inputs,
    load: &dyn Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<(VmSpec, VmMemory), String> {
    if let Some(first) = seen.names.insert(&vm.name, index) {
        return Err(format!(
            "name is used twice (VM {first} and VM {index}); names must be unique"
        ));
    }
    let cpu_owner = &mut seen.cpu_owner;

    // RAM.
    let ram_text = &vm.ram_text;
    let ram = *vm.ram.as_ref().map_err(|e| format!("ram {e}"))?;
    if ram == 0 {
        return Err(format!("ram \"{ram_text}\" is zero"));
    }
    if !ram.is_multiple_of(RAM_GRANULE) {
        return Err(format!("ram \"{ram_text}\" is not a multiple of 2 MiB"));
    }
    if ram > MAX_VM_RAM {
        return Err(format!(
            "ram \"{ram_text}\" is more than a VM may have; use at most \"{}\"",
            format_size(MAX_VM_RAM)
        ));
    }

    // Memory limits, and what all VMs are guaranteed together.
    let memory = vm.memory.check(ram, ram_text)?;
    let promised = if memory.prealloc { ram } else { memory.min };
    seen.guaranteed = seen.guaranteed.saturating_add(promised);
    if seen.guaranteed > MAX_GUARANTEED {
        let what = if memory.prealloc {
            format!("memory.prealloc = true (all of ram \"{ram_text}\")")
        } else {
            let text = vm.memory.min.as_ref().map_or("", |(t, _)| t.as_str());
            format!("memory.min \"{text}\"")
        };
        return Err(format!(
            "{what} brings the memory guaranteed to all VMs to {}, more than the {} the largest board (8G) can guarantee; lower memory.min or turn memory.prealloc off somewhere (ram itself may be overcommitted)",
            format_size(seen.guaranteed),
            format_size(MAX_GUARANTEED)
        ));
    }

    // vCPUs and pinning.
    if vm.vcpus == 0 {
        return Err("vcpus is 0; a VM needs at least one".into());
    }
    if vm.vcpus as usize != vm.cpus.len() {
        return Err(format!(
            "vcpus is {} but cpus lists {} CPU(s) {:?}; give one physical CPU per vCPU",
            vm.vcpus,
            vm.cpus.len(),
            vm.cpus
        ));
    }
    let mut affinity: u64 = 0;
    for &cpu in &vm.cpus {
        if cpu >= MAX_CPUS {
            return Err(format!(
                "cpus {:?} includes CPU {cpu}; physical CPUs are numbered 0 to {}",
                vm.cpus,
                MAX_CPUS - 1
            ));
        }
        if let Some(other) = cpu_owner.insert(cpu, &vm.name) {
            return Err(if other == vm.name {
                format!("cpus {:?} lists CPU {cpu} twice", vm.cpus)
            } else {
                format!(
                    "cpus {:?} includes CPU {cpu}, already given to VM \"{other}\"; each physical CPU runs one VM",
                    vm.cpus
                )
            });
        }
        affinity |= 1 << cpu;
    }

    // Kernel and initrd: the files named, or what the xtask generated
    // for `modules` and `linux_deb`.
    let generated = match vm.linux_source(base, inputs.root) {
        None => None,
        Some(source) => Some(inputs.generated.get(&source).ok_or_else(|| {
            format!(
                "{}: its initramfs is generated by `cargo xtask bundle` or `cargo xtask run --config` (a plain `cargo xtask build` does not)",
                vm.linux_field()
            )
        })?),
    };
    let (kernel_path, kernel_field, hint) = match (&vm.linux_deb, vm.kernel.as_deref()) {
        (Some(_), _) => (
            generated.map(|g| g.kernel.clone()).unwrap_or_default(),
            format!("{}: kernel", vm.linux_field()),
            "",
        ),
        (None, Some(TESTGUEST)) => (
            inputs.testguest.to_path_buf(),
            format!("kernel \"{TESTGUEST}\""),
            " (the test guest is built from guest-driver/testguest by `cargo xtask build`)",
        ),
        (None, Some("")) | (None, None) => {
            return Err(format!(
                "kernel is empty; give \"{TESTGUEST}\" or the path of an arm64 Image"
            ))
        }
        (None, Some(k)) => (
            match generated {
                // The xtask's copy (decompressed if it was gzipped).
                Some(g) => g.kernel.clone(),
                None => resolve(base, inputs.root, k),
            },
            format!("kernel \"{k}\""),
            " (a relative path is relative to the configuration file's folder)",
        ),
    };
    let kernel = load(&kernel_path).map_err(|e| {
        format!(
            "{kernel_field}: cannot read {}: {e}{hint}",
            kernel_path.display()
        )
    })?;
    if kernel.is_empty() {
        return Err(format!(
            "{kernel_field}: {} is empty",
            kernel_path.display()
        ));
    }
    let initrd_file = match (generated, &vm.initrd) {
        (Some(g), _) => Some((
            g.initrd.clone(),
            format!("{}: generated initramfs", vm.linux_field()),
        )),
        (None, None) => None,
        (None, Some(p)) if p.is_empty() => {
            return Err("initrd is empty; leave the field out for no initrd".into())
        }
        (None, Some(p)) => Some((resolve(base, inputs.root, p), format!("initrd \"{p}\""))),
    };
    let initrd = match initrd_file {
        None => None,
        Some((path, field)) => {
            let bytes = load(&path).map_err(|e| {
                format!(
                    "{field}: cannot read {}: {e} (a relative path is relative to the configuration file's folder)",
                    path.display()
                )
            })?;
            if bytes.is_empty() {
                return Err(format!("{field}: {} is empty", path.display()));
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
            "ram \"{ram_text}\" is too small: 2 MiB for the device tree, then the kernel ({} bytes in memory){} need {} bytes; use at least \"{}\"",
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
        // A generated initramfs is booted as the Linux fixture is.
        None if generated.is_some() => Some(LINUX_CMDLINE.to_string()),
        None => None,
        Some(c) if c.is_empty() => None,
        Some(c) => {
            if c.contains('\0') {
                return Err("cmdline contains a NUL character".into());
            }
            if c.len() > MAX_CMDLINE {
                return Err(format!(
                    "cmdline is {} bytes; at most {MAX_CMDLINE}",
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
                        "balloon.features: unknown feature \"{name}\"; known: {}",
                        known.join(", ")
                    ));
                };
                if bits & (1 << bit) != 0 {
                    return Err(format!("balloon.features lists \"{name}\" twice"));
                }
                bits |= 1 << bit;
            }
            (devices::BALLOON, bits)
        }
    };
    let devices = if vm.virtio_console {
        devices | devices::CONSOLE
    } else {
        devices
    };
    Ok((
        VmSpec {
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
            restore: vm.restore.clone(),
        },
        memory,
    ))
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
        assert_eq!(a.cpu_affinity(), (1 << 0) | (1 << 1));
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
        assert_eq!(b.cpu_affinity(), 1 << 2);
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
            // Resolved from the file's own folder (as `build_all` does),
            // they need the Linux fixture exactly when a VM is Linux.
            let needs = needs_from_str(&text, &shown, f.parent().unwrap(), &root)
                .unwrap_or_else(|e| panic!("{e}"));
            let linux = b.vms().any(|v| v.initrd().is_some());
            assert_eq!(
                (needs.linux_fixture, needs.linux.len()),
                (linux, 0),
                "{shown}"
            );
            assert_eq!(
                needs.testguest,
                b.vms().any(|v| v.initrd().is_none()),
                "{shown}"
            );
            // Only the on-target bundle asks for the self-checks.
            assert_eq!(
                b.on_target_tests(),
                f.file_stem().is_some_and(|n| n == "on-target"),
                "{shown}"
            );
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
        // The balloon feature bundles: one Linux guest on CPUs 1 and 2
        // (the Linux tests' and the bench's on CPUs 0 and 1, CPU 0 shared
        // with the shell).
        let linux_alone = |bundle: &str, cmdline: &str| {
            (
                bundle.to_string(),
                vec![("linux".to_string(), 512, 6, p(cmdline))],
            )
        };
        let linux_on_cpu0 = |bundle: &str| {
            (
                bundle.to_string(),
                vec![("linux".to_string(), 512, 3, p(quiet))],
            )
        };
        // The three Linux VMs and the test guest of overcommit.toml and its
        // variants.
        let overcommit = |bundle: &str| {
            (
                bundle.to_string(),
                vec![
                    ("vma".to_string(), 1024, 2, p(quiet)),
                    ("vmb".to_string(), 1024, 4, p(quiet)),
                    ("vmc".to_string(), 1024, 8, p(quiet)),
                    ("beta".to_string(), 128, 16, p("pattern")),
                ],
            )
        };
        let pair = vec![
            ("alpha".to_string(), 256, 2, p("pattern")),
            ("beta".to_string(), 128, 4, p("pattern")),
        ];
        assert_eq!(
            seen,
            vec![
                (
                    "bench".into(),
                    vec![("bench".into(), 256, 2, p("pattern empty-notifies"))]
                ),
                linux_on_cpu0("bench-linux"),
                linux_on_cpu0("bench-linux-reporting"),
                (
                    "bench-snapshot".into(),
                    vec![("linux".into(), 1024, 3, p(quiet))]
                ),
                (
                    "bench-snapshot-demo".into(),
                    vec![("linux".into(), 1024, 3, p(quiet))]
                ),
                (
                    "demo".into(),
                    vec![
                        (
                            "linux".into(),
                            512,
                            3,
                            p("console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet")
                        ),
                        ("beta".into(), 128, 4, p("pattern"))
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
                    "hostile-stats".into(),
                    vec![
                        ("hostile".into(), 128, 2, p("hostile-stats")),
                        ("beta".into(), 128, 4, p("pattern"))
                    ]
                ),
                linux_on_cpu0("linux"),
                linux_alone("linux-full", poisoned),
                linux_on_cpu0("linux-hint"),
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
                linux_on_cpu0("linux-stats"),
                linux_on_cpu0("linux-vconsole"),
                (
                    "on-target".into(),
                    vec![
                        ("wild".into(), 64, 2, p("wild")),
                        ("beta".into(), 128, 4, p("pattern")),
                        ("linux".into(), 384, 8, p(quiet))
                    ]
                ),
                overcommit("overcommit"),
                overcommit("overcommit-full"),
                overcommit("overcommit-kill"),
                (
                    "overcommit-static".into(),
                    vec![
                        ("vma".into(), 600, 2, p(quiet)),
                        ("vmb".into(), 600, 4, p(quiet)),
                        ("vmc".into(), 600, 8, p(quiet)),
                        ("beta".into(), 64, 16, p("pattern"))
                    ]
                ),
                ("pair".into(), pair.clone()),
                // The pair with beta restored from snapshot s1 at boot.
                ("pair-restore".into(), pair),
                (
                    "stuck-balloon".into(),
                    vec![
                        ("vma".into(), 1024, 2, p(quiet)),
                        ("stuck".into(), 640, 4, p("pattern stuck")),
                        ("donor".into(), 640, 8, p("pattern"))
                    ]
                ),
                (
                    "stuck-balloon-control".into(),
                    vec![
                        ("vma".into(), 1024, 2, p(quiet)),
                        ("stuck".into(), 640, 4, p("pattern")),
                        ("donor".into(), 640, 8, p("pattern"))
                    ]
                ),
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
    fn virtio_console_is_a_device_bit() {
        let with = |line: &str| {
            let text = ONE.replace("[[vm]]\n", &format!("[[vm]]\n{line}\n"));
            build(&text).map(|b| guest_bundle::parse(&b).unwrap().vm(0).unwrap().devices())
        };
        assert_eq!(with("console = \"virtio\"").unwrap(), devices::CONSOLE);
        assert_eq!(with("console = \"pl011\"").unwrap(), 0);
        assert_eq!(with("").unwrap(), 0);
        let err = with("console = \"hvc\"").unwrap_err();
        assert!(err.contains("console \"hvc\" is unknown"), "{err}");
        let b =
            build(&(ONE.replace("[[vm]]\n", "[[vm]]\nconsole = \"virtio\"\n") + "[vm.balloon]\n"))
                .unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        let v = b.vm(0).unwrap();
        assert!(v.has_balloon() && v.has_virtio_console());
    }

    /// An error message without the `:line:column` after `t.toml` (the
    /// tables below check the rest; `errors_name_line_and_column` the
    /// locations), and whether it had one.
    fn unlocated(msg: &str) -> (String, bool) {
        let Some(rest) = msg.strip_prefix("t.toml:") else {
            return (msg.to_string(), false);
        };
        let mut parts = rest.splitn(3, ':');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(line), Some(col), Some(rest))
                if [line, col]
                    .iter()
                    .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) =>
            {
                (format!("t.toml:{rest}"), true)
            }
            _ => (msg.to_string(), false),
        }
    }

    #[test]
    fn errors_name_line_and_column() {
        let second = ONE.to_string() + &ONE.replace("alpha", "beta");
        let cases: Vec<(String, &str)> = vec![
            (one_with("ram = \"300X\""), "t.toml:7:7: VM \"alpha\": ram \"300X\" is not a size: expected a whole number with a K, M or G suffix, e.g. \"256M\""),
            (one_with("colour = \"blue\""), "t.toml:8:10: VM \"alpha\": unknown field `colour`; a [[vm]] table has"),
            (one_with("vcpus = \"1\""), "t.toml:7:9: VM \"alpha\": vcpus must be an integer, found string \"1\""),
            (ONE.replace("vcpus = 1\n", ""), "t.toml:2:1: VM \"alpha\": required field `vcpus` is missing"),
            (one_with("name = \"Alpha\""), "t.toml:7:8: VM 0: name \"Alpha\" contains 'A'"),
            ("[[vm]\n".into(), "t.toml:1:6: TOML syntax error: unclosed array table, expected `]`"),
            ("title = \"x\"\n".to_string() + ONE, "t.toml:1:9: unknown top-level key `title`"),
            (pool("min = \"16M\"\nlow = \"8M\"\nhigh = \"80M\""), "t.toml:11:7: pool: low \"8M\" is below min \"16M\""),
            (pool("low = \"48M\""), "t.toml:9:1: pool: min and high missing"),
            (memory("512M", "maximum = \"1G\""), "t.toml:9:11: VM \"alpha\": unknown field `memory.maximum`"),
            (memory("512M", "max = \"900M\""), "t.toml:9:7: VM \"alpha\": memory.max \"900M\" is more than ram"),
            (second, "t.toml:13:8: VM \"beta\": cpus [1] includes CPU 1, already given to VM \"alpha\""),
        ];
        for (text, want) in cases {
            let got = err(&text);
            assert!(
                got.starts_with(want),
                "config:\n{text}\nwant: {want}\ngot:  {got}"
            );
        }
    }

    /// A loader that records every path it is asked for and loads as
    /// [`fake_load`] does.
    fn recording(
        seen: &std::cell::RefCell<Vec<PathBuf>>,
    ) -> impl Fn(&Path) -> std::io::Result<Vec<u8>> + '_ {
        move |p: &Path| {
            seen.borrow_mut().push(p.to_path_buf());
            fake_load(p)
        }
    }

    #[test]
    fn relative_paths_are_relative_to_the_config_folder() {
        let none = HashMap::new();
        let inputs = Inputs {
            root: Path::new("/ws"),
            testguest: Path::new("/ws/tg.bin"),
            generated: &none,
        };
        let seen = std::cell::RefCell::new(Vec::new());
        let text = one_with("kernel = \"kernels/Image\"\ninitrd = \"/abs/initrds/i.cpio\"")
            + &ONE.replace("alpha", "beta").replace("[1]", "[2]").replace(
                "kernel = \"testguest\"",
                &format!(
                    "kernel = \"{LINUX_FIXTURE_KERNEL}\"\ninitrd = \"{LINUX_FIXTURE_INITRD}\""
                ),
            );
        bundle_from_str_in(
            &text,
            "my.toml",
            Path::new("/home/u/vms"),
            &inputs,
            &recording(&seen),
        )
        .unwrap();
        assert_eq!(
            *seen.borrow(),
            [
                "/home/u/vms/kernels/Image",
                "/abs/initrds/i.cpio",
                "/ws/target/fixtures/linux/Image",
                "/ws/target/fixtures/linux/initramfs.cpio"
            ]
            .map(PathBuf::from)
        );
        let e = bundle_from_str_in(
            &one_with("kernel = \"nope/Image\""),
            "my.toml",
            Path::new("/home/u/vms"),
            &inputs,
            &fake_load,
        )
        .unwrap_err();
        assert!(
            e.starts_with("my.toml:7:10: VM \"alpha\": kernel \"nope/Image\": cannot read /home/u/vms/nope/Image:"),
            "{e}"
        );
        assert!(
            e.contains("relative to the configuration file's folder"),
            "{e}"
        );
    }

    #[test]
    fn needs_lists_only_what_the_vms_use() {
        let root = Path::new("/ws");
        let base = Path::new("/home/u");
        let bare = needs_from_str(ONE, "t.toml", base, root).unwrap();
        assert_eq!(
            bare,
            Needs {
                testguest: true,
                linux_fixture: false,
                linux: vec![]
            }
        );
        let vm = |name: &str, cpu: u32, lines: &str| {
            format!(
                "[[vm]]\nname = \"{name}\"\nram = \"512M\"\nvcpus = 1\ncpus = [{cpu}]\n{lines}\n"
            )
        };
        let text = vm(
            "a",
            1,
            "kernel = \"Image\"\nmodules = \"lib/modules/6.1.0-9-arm64\"",
        ) + &vm("b", 2, "linux_deb = \"/debs/linux-image.deb\"")
            + &vm("c", 3, "linux_deb = \"../debs/linux-image.deb\"")
            + &vm("d", 4, &format!("kernel = \"{LINUX_FIXTURE_KERNEL}\""));
        let n = needs_from_str(&text, "t.toml", Path::new("/debs/x"), root).unwrap();
        assert!(!n.testguest && n.linux_fixture);
        assert_eq!(
            n.linux,
            vec![
                LinuxSource::Image {
                    kernel: "/debs/x/Image".into(),
                    modules: "/debs/x/lib/modules/6.1.0-9-arm64".into()
                },
                LinuxSource::Deb("/debs/linux-image.deb".into()),
                // The same package by another path is another source.
                LinuxSource::Deb("/debs/x/../debs/linux-image.deb".into()),
            ]
        );
        // A misspelt key fails before anything is built.
        let e = needs_from_str(&one_with("modulse = \"m\""), "t.toml", base, root).unwrap_err();
        assert!(
            e.starts_with("t.toml:8:11: VM \"alpha\": unknown field `modulse`"),
            "{e}"
        );
    }

    #[test]
    fn generated_linux_guests() {
        let source = LinuxSource::Deb("/home/u/linux-image.deb".into());
        let mut generated = HashMap::new();
        generated.insert(
            source.clone(),
            GeneratedLinux {
                kernel: "/ws/target/user-linux/x/kernels/Image".into(),
                initrd: "/ws/target/user-linux/x/initrds/initramfs.cpio".into(),
            },
        );
        let inputs = Inputs {
            root: Path::new("/ws"),
            testguest: Path::new("/ws/tg.bin"),
            generated: &generated,
        };
        let text =
            one_with("linux_deb = \"linux-image.deb\"").replace("kernel = \"testguest\"\n", "");
        let bytes =
            bundle_from_str_in(&text, "t.toml", Path::new("/home/u"), &inputs, &fake_load).unwrap();
        let b = guest_bundle::parse(&bytes).unwrap();
        let v = b.vm(0).unwrap();
        assert_eq!((v.kernel(), v.initrd()), (KERNEL, Some(INITRD)));
        assert_eq!(v.cmdline(), Some(LINUX_CMDLINE), "the default command line");
        let own = text.replace("linux_deb", "cmdline = \"console=ttyAMA0\"\nlinux_deb");
        let bytes =
            bundle_from_str_in(&own, "t.toml", Path::new("/home/u"), &inputs, &fake_load).unwrap();
        assert_eq!(
            guest_bundle::parse(&bytes)
                .unwrap()
                .vm(0)
                .unwrap()
                .cmdline(),
            Some("console=ttyAMA0")
        );
        // Without the xtask's generated files: said where and why.
        let e = build(&text).unwrap_err();
        assert!(
            e.starts_with("t.toml:7:13: VM \"alpha\": linux_deb \"linux-image.deb\": its initramfs is generated by `cargo xtask bundle`"),
            "{e}"
        );
        for (lines, want) in [
            ("linux_deb = \"l.deb\"", "t.toml:8:13: VM \"alpha\": linux_deb and kernel exclude each other"),
            ("modules = \"m\"\ninitrd = \"i\"", "t.toml:8:11: VM \"alpha\": modules and initrd exclude each other"),
            ("modules = \"m\"", "t.toml:8:11: VM \"alpha\": modules needs kernel to be your own arm64 Image, not \"testguest\""),
            ("modules = 5", "t.toml:8:11: VM \"alpha\": modules must be a string, found integer 5"),
        ] {
            let e = err(&one_with(lines));
            assert!(e.starts_with(want), "want: {want}\ngot:  {e}");
        }
        let e = err(&ONE.replace("kernel = \"testguest\"\n", ""));
        assert!(
            e.starts_with("t.toml:2:1: VM \"alpha\": required field `kernel` is missing"),
            "{e}"
        );
    }

    #[test]
    fn error_messages() {
        let cases: Vec<(String, &str)> = vec![
            (one_with("ram = \"300K\""), "t.toml: VM \"alpha\": ram \"300K\" is not a multiple of 2 MiB"),
            (one_with("ram = \"3M\""), "t.toml: VM \"alpha\": ram \"3M\" is not a multiple of 2 MiB"),
            (one_with("ram = \"0M\""), "t.toml: VM \"alpha\": ram \"0M\" is zero"),
            (one_with("ram = \"lots\""), "t.toml: VM \"alpha\": ram \"lots\" is not a size"),
            (one_with("ram = \"9G\""), "t.toml: VM \"alpha\": ram \"9G\" is more than a VM may have; use at most \"8G\""),
            (
                one_with("ram = \"8G\"") + "[vm.memory]\nprealloc = true\n",
                "t.toml: VM \"alpha\": memory.prealloc = true (all of ram \"8G\") brings the memory guaranteed to all VMs to 8G, more than the 7680M the largest board (8G) can guarantee",
            ),
            (one_with("ram = \"2M\""), "t.toml: VM \"alpha\": ram \"2M\" is too small"),
            (one_with("name = \"Alpha\""), "t.toml: VM 0: name \"Alpha\" contains 'A'"),
            (one_with("name = \"\""), "t.toml: VM 0: name \"\" is empty"),
            (
                one_with(&format!("name = \"{}\"", "a".repeat(32))),
                "is 32 characters long; at most 31",
            ),
            (one_with("vcpus = 2"), "t.toml: VM \"alpha\": vcpus is 2 but cpus lists 1 CPU(s) [1]"),
            (one_with("vcpus = 0\ncpus = []"), "t.toml: VM \"alpha\": vcpus is 0"),
            (one_with("cpus = [8]"), "t.toml: VM \"alpha\": cpus [8] includes CPU 8; physical CPUs are numbered 0 to 7"),
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
            (one_with("restore = \"two words\""), "t.toml: VM \"alpha\": restore \"two words\" is not a snapshot name: 1 to 32 printable characters without spaces"),
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
            ("[[vm]\n".into(), "t.toml: TOML syntax error: unclosed array table"),
            (ONE.to_string() + ONE, "t.toml: VM \"alpha\": name is used twice (VM 0 and VM 1)"),
            (
                ONE.to_string() + &ONE.replace("alpha", "beta"),
                "t.toml: VM \"beta\": cpus [1] includes CPU 1, already given to VM \"alpha\"",
            ),
        ];
        for (text, want) in cases {
            let (got, located) = unlocated(&err(&text));
            assert!(
                got.contains(want),
                "config:\n{text}\nwant: {want}\ngot:  {got}"
            );
            assert!(located || want == "t.toml: no VMs", "no line in {got}");
        }
    }

    /// `ONE` with a `[vm.memory]` table of `lines` (and `ram` set).
    fn memory(ram: &str, lines: &str) -> String {
        format!(
            "{}[vm.memory]\n{lines}\n",
            one_with(&format!("ram = \"{ram}\""))
        )
    }

    /// `ONE` with a `[pool]` table of `lines`.
    fn pool(lines: &str) -> String {
        format!("{ONE}\n[pool]\n{lines}\n")
    }

    /// `ONE` with a `[board]` table of `lines`.
    fn board(lines: &str) -> String {
        format!("{ONE}\n[board]\n{lines}\n")
    }

    #[test]
    fn board_address_is_carried_in_the_bundle() {
        let bytes = build(&board("address = \"10.0.0.2/24\"")).unwrap();
        let b = guest_bundle::parse(&bytes).unwrap();
        assert_eq!(
            b.board_address().map(|a| a.to_string()).as_deref(),
            Some("10.0.0.2/24")
        );
        let bytes = build(&board("")).unwrap();
        assert_eq!(guest_bundle::parse(&bytes).unwrap().board_address(), None);
        let bytes = build(ONE).unwrap();
        assert_eq!(guest_bundle::parse(&bytes).unwrap().board_address(), None);
    }

    #[test]
    fn board_errors_name_file_line_and_field() {
        for (lines, want) in [
            ("address = \"10.0.0.2\"", "t.toml:10:11: board: address \"10.0.0.2\": write a dotted quad and a prefix length, e.g. \"10.0.0.2/24\""),
            ("address = \"10.0.0.2/33\"", "t.toml:10:11: board: address \"10.0.0.2/33\": the prefix length is 1 to 32"),
            ("address = \"10.0.0.0/24\"", "t.toml:10:11: board: address \"10.0.0.0/24\": that is the network's own address"),
            ("address = \"10.0.0.255/24\"", "t.toml:10:11: board: address \"10.0.0.255/24\": that is the network's broadcast address"),
            ("address = 10", "t.toml:10:11: board: address must be a string, found integer 10"),
            ("mac = \"x\"", "t.toml:10:7: board: unknown field `mac`; [board] has address"),
        ] {
            let got = err(&board(lines));
            assert!(got.starts_with(want), "{lines}\nwant: {want}\ngot:  {got}");
        }
        let got = err(&format!("board = 1\n{ONE}"));
        assert!(
            got.starts_with("t.toml:1:9: board: must be a table ([board]), found integer 1"),
            "{got}"
        );
    }

    #[test]
    fn memory_and_pool_errors() {
        let v = "t.toml: VM \"alpha\": ";
        let cases: Vec<(String, String)> = vec![
            (memory("512M", "max = \"900M\""), format!("{v}memory.max \"900M\" is more than ram \"512M\"; use at most \"512M\"")),
            (memory("512M", "max = \"0\""), format!("{v}memory.max \"0\" is zero; leave it out")),
            (memory("512M", "min = \"300M\"\nmax = \"256M\""), format!("{v}memory.min \"300M\" is more than memory.max \"256M\"")),
            (memory("512M", "min = \"600M\""), format!("{v}memory.min \"600M\" is more than ram \"512M\"")),
            (memory("512M", "low = \"300M\"\nmax = \"256M\""), format!("{v}memory.low \"300M\" is more than memory.max \"256M\"")),
            (memory("512M", "min = \"300M\"\nlow = \"256M\""), format!("{v}memory.min \"300M\" is more than memory.low \"256M\"")),
            (memory("512M", "min = \"1000\""), format!("{v}memory.min \"1000\" is not a multiple of 4 KiB; use \"4K\"")),
            (memory("512M", "low = 6000"), format!("{v}memory.low \"6000\" is not a multiple of 4 KiB; use \"8K\"")),
            (memory("512M", "max = \"255M\"\nmin = \"4097\""), format!("{v}memory.min \"4097\" is not a multiple of 4 KiB; use \"8K\"")),
            (memory("512M", "min = \"lots\""), format!("{v}memory.min \"lots\" is not a size")),
            (memory("512M", "min = -4096"), format!("{v}memory.min -4096 is negative")),
            (memory("512M", "max = 1.5"), format!("{v}memory.max must be a size such as \"256M\" or an integer number of bytes, found float 1.5")),
            (memory("512M", "weight = 0"), format!("{v}memory.weight 0 is out of range; use 1 to 10000 (default 100)")),
            (memory("512M", "weight = 10001"), format!("{v}memory.weight 10001 is out of range")),
            (memory("512M", "weight = \"heavy\""), format!("{v}memory.weight must be an integer, found string \"heavy\"")),
            (memory("512M", "prealloc = \"yes\""), format!("{v}memory.prealloc must be true or false, found string \"yes\"")),
            (memory("512M", "maximum = \"1G\""), format!("{v}unknown field `memory.maximum`; [vm.memory] has min, low, max, weight, prealloc")),
            (one_with("memory = 5"), format!("{v}memory must be a table ([vm.memory]), found integer 5")),
            (pool("min = \"16M\"\nlow = \"8M\"\nhigh = \"80M\""), "t.toml: pool: low \"8M\" is below min \"16M\"".into()),
            (pool("min = \"16M\"\nlow = \"48M\"\nhigh = \"32M\""), "t.toml: pool: high \"32M\" is below low \"48M\"".into()),
            (pool("low = \"48M\""), "t.toml: pool: min and high missing; give all of min, low and high, or none for the defaults (1%, 3% and 5% of RAM)".into()),
            (pool("min = \"16M\"\nlow = \"48M\""), "t.toml: pool: high missing".into()),
            (pool("min = \"0\"\nlow = \"48M\"\nhigh = \"80M\""), "t.toml: pool: min \"0\" is zero; leave min, low and high out for the defaults".into()),
            (pool("min = \"16M\"\nlow = \"48M\"\nhigh = \"81001K\""), "t.toml: pool: high \"81001K\" is not a multiple of 4 KiB; use \"81004K\"".into()),
            (pool("min = \"many\""), "t.toml: pool: min \"many\" is not a size".into()),
            (pool("when_exhausted = \"kill\""), "t.toml: pool: when_exhausted \"kill\" is unknown; it is \"stop-lowest\" (the default) or \"wait\"".into()),
            (pool("when_exhausted = 1"), "t.toml: pool: when_exhausted must be a string, found integer 1".into()),
            (pool("size = \"1M\""), "t.toml: pool: unknown field `size`; [pool] has min, low, high, when_exhausted".into()),
            (format!("pool = 5\n{ONE}"), "t.toml: pool: must be a table ([pool]), found integer 5".into()),
        ];
        for (text, want) in cases {
            let (got, located) = unlocated(&err(&text));
            assert!(
                got.contains(&want),
                "config:\n{text}\nwant: {want}\ngot:  {got}"
            );
            assert!(located, "no line in {got}");
        }
    }

    /// Three VMs of `ram` on CPUs 1 to 3, each with the `[vm.memory]` lines
    /// `memory[i]` (none when empty).
    fn three_vms(ram: &str, memory: [&str; 3]) -> String {
        let mut text = String::new();
        for (i, m) in memory.iter().enumerate() {
            text += &format!(
                "[[vm]]\nname = \"vm{i}\"\nram = \"{ram}\"\nvcpus = 1\ncpus = [{}]\nkernel = \"testguest\"\n",
                i + 1
            );
            if !m.is_empty() {
                text += &format!("[vm.memory]\n{m}\n");
            }
        }
        text
    }

    #[test]
    fn overcommit_is_accepted_up_to_the_guarantee() {
        // 3 GiB of RAM on a 2 GiB board: fine, nothing is guaranteed.
        let b = build(&three_vms("1G", ["", "", ""])).unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        assert_eq!(b.vms().map(|v| v.ram_size()).sum::<u64>(), 3 << 30);
        assert!(b.vms().all(|v| v.guaranteed() == 0));
        // Exactly 7.5G guaranteed, what the largest board can: 4G
        // preallocated and 3.5G of min. (A 2 GiB board refuses to start
        // what its own pool cannot hold.)
        let ok = three_vms(
            "4G",
            ["prealloc = true", "min = \"1792M\"", "min = \"1792M\""],
        );
        let b = build(&ok).unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        assert_eq!(b.vms().map(|v| v.guaranteed()).sum::<u64>(), MAX_GUARANTEED);
        // 4 KiB more, and the VM that crosses the line is named.
        let over = three_vms(
            "4G",
            ["prealloc = true", "min = \"1792M\"", "min = \"1835012K\""],
        );
        assert_eq!(
            err(&over),
            "t.toml:24:7: VM \"vm2\": memory.min \"1835012K\" brings the memory guaranteed to all VMs to 7864324K, more than the 7680M the largest board (8G) can guarantee; lower memory.min or turn memory.prealloc off somewhere (ram itself may be overcommitted)"
        );
        // The per-VM ceiling.
        let b = build(&one_with("ram = \"8G\"")).unwrap();
        assert_eq!(
            guest_bundle::parse(&b).unwrap().vm(0).unwrap().ram_size(),
            MAX_VM_RAM
        );
    }

    #[test]
    fn on_target_tests_is_a_top_level_boolean() {
        let on = |text: &str| {
            let bytes = build(text).unwrap();
            guest_bundle::parse(&bytes).unwrap().on_target_tests()
        };
        assert!(!on(ONE));
        for (text, want) in [
            (format!("on_target_tests = true\n{ONE}"), true),
            (format!("on_target_tests = false\n{ONE}"), false),
        ] {
            assert_eq!(on(&text), want, "{text}");
        }
        let got = err(&format!("on_target_tests = \"yes\"\n{ONE}"));
        assert!(
            got.starts_with(
                "t.toml:1:19: on_target_tests must be true or false, found string \"yes\""
            ),
            "{got}"
        );
    }

    #[test]
    fn memory_and_pool_round_trip() {
        let text = three_vms(
            "512M",
            [
                "min = \"128M\"\nlow = \"256M\"\nmax = \"384M\"\nweight = 250",
                "prealloc = true",
                "min = 1048576",
            ],
        ) + "[pool]\nmin = \"16M\"\nlow = \"48M\"\nhigh = \"80M\"\nwhen_exhausted = \"stop-lowest\"\n";
        let bytes = build(&text).unwrap();
        let b = guest_bundle::parse(&bytes).unwrap();
        assert_eq!(b.pool_watermarks(), Some((16 << 20, 48 << 20, 80 << 20)));
        assert!(b.stop_lowest_when_exhausted());
        let v = b.vm(0).unwrap();
        assert_eq!(
            (
                v.mem_min(),
                v.mem_low(),
                v.mem_max(),
                v.weight(),
                v.prealloc()
            ),
            (128 << 20, 256 << 20, 384 << 20, 250, false)
        );
        assert_eq!(v.guaranteed(), 128 << 20);
        let v = b.vm(1).unwrap();
        assert_eq!(
            (
                v.mem_min(),
                v.mem_low(),
                v.mem_max(),
                v.weight(),
                v.prealloc()
            ),
            (0, 0, 512 << 20, 100, true)
        );
        assert_eq!(v.guaranteed(), 512 << 20);
        let v = b.vm(2).unwrap();
        assert_eq!(
            (v.mem_min(), v.mem_low(), v.mem_max()),
            (1 << 20, 1 << 20, 512 << 20)
        );

        // Without [pool] and [vm.memory]: every default (a wait for a
        // frame is bounded: stop-lowest).
        let b = build(ONE).unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        assert_eq!(b.pool_watermarks(), None);
        assert!(b.stop_lowest_when_exhausted());
        let v = b.vm(0).unwrap();
        assert_eq!(
            (
                v.mem_min(),
                v.mem_low(),
                v.mem_max(),
                v.weight(),
                v.prealloc()
            ),
            (0, 0, 64 << 20, 100, false)
        );
        // An empty [vm.memory] and a [pool] with only the policy.
        let b = build(&(memory("64M", "") + "[pool]\nwhen_exhausted = \"wait\"\n")).unwrap();
        let b = guest_bundle::parse(&b).unwrap();
        assert_eq!(b.pool_watermarks(), None);
        assert!(!b.stop_lowest_when_exhausted());
        assert_eq!(b.vm(0).unwrap().mem_max(), 64 << 20);
        // [pool] may come before the VMs.
        let b = build(&format!("[pool]\nwhen_exhausted = \"stop-lowest\"\n{ONE}")).unwrap();
        assert!(guest_bundle::parse(&b)
            .unwrap()
            .stop_lowest_when_exhausted());
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
                "t.toml:7:10: VM \"alpha\": kernel \"testguest\": cannot read /nowhere/tg.img"
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
            "guests/tests/c.toml:7:7: VM \"alpha\": ram \"300K\" is not a multiple of 2 MiB"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
