//! The Linux guest fixture: Debian's current arm64 kernel `Image` and a
//! busybox initramfs whose `/init` loads `virtio_mmio` and `virtio_balloon`,
//! prints [`READY`] and runs the harness agent on the console (PL011,
//! `ttyAMA0`). Both land under `target/fixtures/linux/`.
//!
//! The agent protocol: the harness writes [`agent_request`] lines (`run <id>
//! <shell command>`); the guest prints the command's output followed by a
//! line `tidal-guest: done <id> rc=<status>`, which [`agent_done`] parses. The
//! line `shell` leaves the agent for an interactive busybox shell. The
//! scripts are `guests/linux/init` and `guests/linux/agent`.
//!
//! The initramfs is an uncompressed newc cpio written here (so `/dev/console`
//! can be a device node without root): busybox (applet links are made by
//! `busybox --install -s` at boot), `/init`, the agent, the modules
//! (uncompressed, in dependency order in `/etc/tidal-modules`).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fixtures;

/// The kernel command line the tests boot the fixture with. `earlycon` is
/// QEMU `virt`'s PL011; `quiet` keeps the console to warnings and above.
/// The same line is what a configuration's generated Linux guest gets by
/// default.
pub const CMDLINE: &str = vmconfig::LINUX_CMDLINE;

/// Printed on a line of its own once the modules are loaded and the agent is
/// about to read the console.
#[allow(dead_code)] // For the QEMU harness.
pub const READY: &str = "tidal-guest: ready";

/// The modules the fixture loads, before their dependencies are added:
/// the balloon and the console on virtio-mmio, and what an ext2 file system on a loop
/// device needs (the balloon tests read a file on one to fill the page
/// cache; ext4 asks the crypto API for crc32c, which is no module
/// dependency).
pub const MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_balloon",
    "virtio_console",
    "loop",
    "crc32c_generic",
    "ext4",
];

const BUSYBOX_PACKAGE: &str = "busybox-static";
const INIT: &str = include_str!("../../guests/linux/init");
const AGENT: &str = include_str!("../../guests/linux/agent");

/// What [`build_initramfs`] produces.
#[derive(Debug, Clone)]
pub struct LinuxFixture {
    /// The uncompressed arm64 `Image` (`target/fixtures/linux/Image`).
    pub kernel: PathBuf,
    /// The uncompressed newc initramfs
    /// (`target/fixtures/linux/initramfs.cpio`).
    pub initramfs: PathBuf,
    /// The kernel's release, e.g. `6.1.0-57-arm64`.
    pub kernel_release: String,
    /// The busybox-static package version, e.g. `1:1.35.0-4+deb12u1+b1`.
    pub busybox_version: String,
}

/// Fetches (on first use) Debian's current arm64 kernel and busybox-static,
/// then writes the kernel `Image` and the initramfs under
/// `target/fixtures/linux/`. The initramfs is rebuilt every call (it takes
/// milliseconds) but only rewritten when its bytes change.
/// The Rust target of the guest's own tools (static musl binaries; see
/// guests/linux/memtool and .cargo/config.toml).
pub const TOOLS_TARGET: &str = "aarch64-unknown-linux-musl";

/// Where `cargo build --release -p tidal-memtool --target TOOLS_TARGET`
/// puts `tidal-mem`.
pub fn memtool_path(root: &Path) -> PathBuf {
    root.join("target")
        .join(TOOLS_TARGET)
        .join("release")
        .join("tidal-mem")
}

pub fn build_initramfs(root: &Path, memtool: &Path) -> Result<LinuxFixture, String> {
    let memtool = read_memtool(memtool)?;
    let kernel_pkg = fixtures::debian_kernel(root)?;
    let busybox = busybox(root)?;
    let out = root.join("target/fixtures/linux");
    fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;

    let modules_root = single_dir(&kernel_pkg.join("lib/modules"))?;
    let kernel_release = release_of(&modules_root);
    let kernel = out.join("Image");
    install_image(
        &kernel_pkg.join(format!("boot/vmlinuz-{kernel_release}")),
        &kernel,
    )?;
    let modules = resolve_modules(&modules_root, MODULES, &[], true)?;
    let initramfs = out.join("initramfs.cpio");
    let bytes = initramfs_bytes(&kernel_release, &modules, &busybox, &memtool);
    write_if_changed(&initramfs, &bytes)?;
    let busybox_version = fixtures::debian_package_deb(root, BUSYBOX_PACKAGE)
        .and_then(|deb| deb_version(&deb))
        .unwrap_or_else(|| "unknown".into());
    let fixture = LinuxFixture {
        kernel,
        initramfs,
        kernel_release,
        busybox_version,
    };
    eprintln!("fixtures: {fixture}");
    Ok(fixture)
}

/// The modules a user's kernel must have (built in or as modules): the
/// balloon on virtio-mmio. The rest of [`MODULES`] is taken when present.
pub const USER_REQUIRED_MODULES: &[&str] = &["virtio_mmio", "virtio_balloon"];

/// The Linux guest a configuration's `modules` or `linux_deb` asks for: the
/// kernel `Image` (decompressed if gzipped) and an initramfs built as the
/// fixture's is (busybox, `/init`, the agent, `tidal-mem`, and the
/// kernel's virtio balloon modules, with the ext4-on-loop ones when the
/// kernel has them), under `target/user-linux/<hash of the source>/`.
pub fn build_user_linux(
    root: &Path,
    memtool: &Path,
    source: &vmconfig::LinuxSource,
) -> Result<vmconfig::GeneratedLinux, String> {
    use std::hash::{Hash, Hasher};
    let memtool = read_memtool(memtool)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    let out = root
        .join("target/user-linux")
        .join(format!("{:016x}", hasher.finish()));
    fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let (vmlinuz, modules_root, what) = match source {
        vmconfig::LinuxSource::Image { kernel, modules } => {
            (kernel.clone(), modules.clone(), "modules")
        }
        vmconfig::LinuxSource::Deb(deb) => {
            let pkg = unpack_deb(deb, &out.join("package"))?;
            let modules_root = ["lib/modules", "usr/lib/modules"]
                .iter()
                .map(|d| pkg.join(d))
                .find(|d| d.is_dir())
                .ok_or_else(|| format!("{}: no lib/modules in the package", deb.display()))
                .and_then(|d| single_dir(&d))?;
            let vmlinuz = pkg
                .join("boot")
                .join(format!("vmlinuz-{}", release_of(&modules_root)));
            (vmlinuz, modules_root, "linux_deb")
        }
    };
    if !modules_root.join("kernel").is_dir() {
        return Err(format!(
            "{what}: {} is not a kernel's modules directory (lib/modules/<release>, with kernel/ in it)",
            modules_root.display()
        ));
    }
    let kernel_release = release_of(&modules_root);
    let kernel = out.join("Image");
    install_image(&vmlinuz, &kernel)?;
    let optional: Vec<&str> = MODULES
        .iter()
        .copied()
        .filter(|m| !USER_REQUIRED_MODULES.contains(m))
        .collect();
    let modules = resolve_modules(&modules_root, USER_REQUIRED_MODULES, &optional, false)?;
    let busybox = busybox(root)?;
    let initrd = out.join("initramfs.cpio");
    write_if_changed(
        &initrd,
        &initramfs_bytes(&kernel_release, &modules, &busybox, &memtool),
    )?;
    let names: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
    eprintln!(
        "linux: {} -> Linux {kernel_release} ({}), initramfs {} (modules: {})",
        match source {
            vmconfig::LinuxSource::Image { kernel, .. } => kernel.display(),
            vmconfig::LinuxSource::Deb(deb) => deb.display(),
        },
        kernel.display(),
        initrd.display(),
        if names.is_empty() {
            "none, all built in".to_string()
        } else {
            names.join(", ")
        }
    );
    Ok(vmconfig::GeneratedLinux { kernel, initrd })
}

/// `dpkg -x deb into`, unless `into` already holds this .deb (same path,
/// size and modification time, recorded in `into/.unpacked`).
fn unpack_deb(deb: &Path, into: &Path) -> Result<PathBuf, String> {
    let meta = fs::metadata(deb).map_err(|e| format!("linux_deb: {}: {e}", deb.display()))?;
    let stamp = format!(
        "{}\n{}\n{:?}\n",
        deb.display(),
        meta.len(),
        meta.modified().ok()
    );
    let stamp_file = into.join(".unpacked");
    if fs::read_to_string(&stamp_file).is_ok_and(|s| s == stamp) {
        return Ok(into.to_path_buf());
    }
    if into.exists() {
        fs::remove_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    }
    eprintln!("linux: unpacking {} into {}", deb.display(), into.display());
    crate::run_cmd(Command::new("dpkg").arg("-x").arg(deb).arg(into))?;
    fs::write(&stamp_file, stamp).map_err(|e| format!("{}: {e}", stamp_file.display()))?;
    Ok(into.to_path_buf())
}

fn read_memtool(memtool: &Path) -> Result<Vec<u8>, String> {
    fs::read(memtool).map_err(|e| {
        format!(
            "{}: {e} (it is built by `cargo xtask build`)",
            memtool.display()
        )
    })
}

/// Debian's static busybox, fetched on first use.
fn busybox(root: &Path) -> Result<Vec<u8>, String> {
    let busybox = fixtures::debian_package(root, BUSYBOX_PACKAGE)?.join("bin/busybox");
    fs::read(&busybox).map_err(|e| format!("{}: {e}", busybox.display()))
}

/// The kernel release a modules directory is named after.
fn release_of(modules_root: &Path) -> String {
    modules_root
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

/// The initramfs: busybox, `/init`, the agent, `tidal-mem` and `modules`
/// (in load order) under `lib/modules/<kernel_release>`.
fn initramfs_bytes(
    kernel_release: &str,
    modules: &[(String, Vec<u8>)],
    busybox: &[u8],
    memtool: &[u8],
) -> Vec<u8> {
    let mut cpio = Cpio::default();
    for dir in [
        "bin",
        "sbin",
        "usr",
        "usr/bin",
        "usr/sbin",
        "dev",
        "proc",
        "sys",
        "tmp",
        "run",
        "etc",
        "root",
        "lib",
        "lib/modules",
    ] {
        cpio.dir(dir, 0o755);
    }
    cpio.dir(&format!("lib/modules/{kernel_release}"), 0o755);
    // The kernel opens /dev/console for init before any devtmpfs exists.
    cpio.char_dev("dev/console", 0o600, 5, 1);
    cpio.char_dev("dev/null", 0o666, 1, 3);
    cpio.file("bin/busybox", 0o755, busybox);
    cpio.symlink("bin/sh", "busybox");
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/tidal-agent", 0o755, AGENT.as_bytes());
    cpio.file("bin/tidal-mem", 0o755, memtool);
    let mut list = String::new();
    for (name, bytes) in modules {
        let path = format!("lib/modules/{kernel_release}/{name}.ko");
        cpio.file(&path, 0o644, bytes);
        list.push_str(&format!("/{path}\n"));
    }
    cpio.file("etc/tidal-modules", 0o644, list.as_bytes());
    cpio.file("etc/tidal-kernel", 0o644, format!("{CMDLINE}\n").as_bytes());
    cpio.finish()
}

impl std::fmt::Display for LinuxFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Linux {} ({}), busybox-static {} ({})",
            self.kernel_release,
            self.kernel.display(),
            self.busybox_version,
            self.initramfs.display()
        )
    }
}

/// The line that asks the agent to run `command` as request `id`.
#[allow(dead_code)] // For the QEMU harness; unit-tested here.
pub fn agent_request(id: u32, command: &str) -> Result<String, String> {
    if command.contains(['\n', '\r']) {
        return Err(format!("agent commands are one line: {command:?}"));
    }
    Ok(format!("run {id} {command}\n"))
}

/// Parses the agent's completion line: `Some((id, rc))` for exactly
/// `tidal-guest: done <id> rc=<rc>` (a trailing `\r` from the tty is allowed).
#[allow(dead_code)] // For the QEMU harness; unit-tested here.
pub fn agent_done(line: &str) -> Option<(u32, i32)> {
    let rest = line.trim_end_matches(['\r', '\n']);
    let rest = rest.strip_prefix("tidal-guest: done ")?;
    let (id, rc) = rest.split_once(' ')?;
    let rc = rc.strip_prefix("rc=")?;
    Some((id.parse().ok()?, rc.parse().ok()?))
}

/// The version in a Debian `.deb` file name (`name_version_arch.deb`), with
/// the archive's `%3a` escape of the epoch colon undone.
fn deb_version(deb: &str) -> Option<String> {
    let mut parts = deb.strip_suffix(".deb")?.split('_');
    let (_name, version, _arch) = (parts.next()?, parts.next()?, parts.next()?);
    Some(version.replace("%3a", ":").replace("%3A", ":"))
}

fn single_dir(parent: &Path) -> Result<PathBuf, String> {
    let entries = fs::read_dir(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    let dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    match dirs.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "expected one directory in {}, found {}",
            parent.display(),
            dirs.len()
        )),
    }
}

/// Offset of the arm64 `Image` header's magic, `ARM\x64`.
const IMAGE_MAGIC_AT: usize = 0x38;
const IMAGE_MAGIC: &[u8; 4] = b"ARM\x64";

/// Copies (or, if gzip-compressed, decompresses) the packaged kernel to `out`
/// and checks it is an arm64 `Image`. Debian's arm64 `vmlinuz-*` is the raw
/// `Image` today; the gzip case is kept for other kernels.
fn install_image(vmlinuz: &Path, out: &Path) -> Result<(), String> {
    let raw = fs::read(vmlinuz).map_err(|e| format!("{}: {e}", vmlinuz.display()))?;
    let image = if raw.starts_with(&[0x1f, 0x8b]) {
        decompress("gzip", vmlinuz)?
    } else {
        raw
    };
    if image.get(IMAGE_MAGIC_AT..IMAGE_MAGIC_AT + 4) != Some(IMAGE_MAGIC) {
        return Err(format!(
            "{} is not an arm64 Image (no ARM\\x64 magic)",
            vmlinuz.display()
        ));
    }
    write_if_changed(out, &image)
}

fn decompress(program: &str, path: &Path) -> Result<Vec<u8>, String> {
    let out = Command::new(program)
        .arg("-dc")
        .arg(path)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} -dc {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

/// Writes via a temporary name and a rename, so a concurrent reader (QEMU
/// started by another test) never sees half a file; skips identical bytes.
fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("part{}", std::process::id()));
    fs::write(&tmp, bytes).map_err(|e| format!("{}: {e}", tmp.display()))?;
    fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// A module's name as the kernel knows it: file name without `.ko[.xz|.zst|
/// .gz]`, dashes as underscores. `None` for a file that is not a module.
fn module_name(file: &str) -> Option<String> {
    let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|ext| file.strip_suffix(ext))?;
    Some(stem.replace('-', "_"))
}

/// Every module file under `dir`, by module name.
fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) -> Result<(), String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            index_modules(&path, index)?;
        } else if let Some(name) = module_name(&entry.file_name().to_string_lossy()) {
            index.insert(name, path);
        }
    }
    Ok(())
}

/// A module file's bytes, decompressed if the package compresses modules
/// (busybox `insmod` takes plain ELF only).
fn read_module(path: &Path) -> Result<Vec<u8>, String> {
    let name = path.to_string_lossy();
    if name.ends_with(".ko.xz") {
        decompress("xz", path)
    } else if name.ends_with(".ko.zst") {
        decompress("zstd", path)
    } else if name.ends_with(".ko.gz") {
        decompress("gzip", path)
    } else {
        fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// `required` and those of `optional` the kernel has, and what they
/// depend on (read from each module's `.modinfo`, since the package ships
/// no `modules.dep`), in load order, as (name, uncompressed bytes). Modules
/// built into the kernel are skipped. `modules.builtin` may be missing only
/// when `!builtin_list_required` (then nothing counts as built in).
fn resolve_modules(
    modules_root: &Path,
    required: &[&str],
    optional: &[&str],
    builtin_list_required: bool,
) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut index = BTreeMap::new();
    index_modules(&modules_root.join("kernel"), &mut index)?;
    let builtin_list = modules_root.join("modules.builtin");
    let builtin: HashSet<String> = match fs::read_to_string(&builtin_list) {
        Ok(text) => text
            .lines()
            .filter_map(|l| module_name(l.rsplit('/').next().unwrap_or(l)))
            .collect(),
        Err(e) if builtin_list_required => return Err(format!("{}: {e}", builtin_list.display())),
        Err(_) => HashSet::new(),
    };
    let wanted: Vec<&str> = required
        .iter()
        .copied()
        .chain(optional.iter().copied().filter(|m| {
            let m = m.replace('-', "_");
            index.contains_key(&m) || builtin.contains(&m)
        }))
        .collect();
    let mut bytes = BTreeMap::new();
    let order = load_order(&wanted, &builtin, |name| {
        let path = index.get(name).ok_or_else(|| {
            format!(
                "module {name} is neither in {} nor in its modules.builtin (the guest needs it for the balloon)",
                modules_root.display()
            )
        })?;
        let elf = read_module(path)?;
        let deps = module_depends(&elf).map_err(|e| format!("{}: {e}", path.display()))?;
        bytes.insert(name.to_string(), elf);
        Ok(deps)
    })?;
    Ok(order
        .into_iter()
        .map(|name| {
            let elf = bytes.remove(&name).unwrap_or_default();
            (name, elf)
        })
        .collect())
}

/// Depth-first load order of `wanted` and their dependencies (each after
/// everything it depends on, each once), skipping `builtin` modules;
/// `depends(name)` lists a module's direct dependencies. Cycles are errors.
fn load_order(
    wanted: &[&str],
    builtin: &HashSet<String>,
    mut depends: impl FnMut(&str) -> Result<Vec<String>, String>,
) -> Result<Vec<String>, String> {
    fn visit(
        name: &str,
        builtin: &HashSet<String>,
        depends: &mut dyn FnMut(&str) -> Result<Vec<String>, String>,
        stack: &mut Vec<String>,
        order: &mut Vec<String>,
    ) -> Result<(), String> {
        let name = name.replace('-', "_");
        if builtin.contains(&name) || order.contains(&name) {
            return Ok(());
        }
        if stack.contains(&name) {
            return Err(format!(
                "module dependency cycle: {} -> {name}",
                stack.join(" -> ")
            ));
        }
        stack.push(name.clone());
        for dep in depends(&name)? {
            visit(&dep, builtin, depends, stack, order)?;
        }
        stack.pop();
        order.push(name);
        Ok(())
    }
    let mut order = Vec::new();
    let mut stack = Vec::new();
    for name in wanted {
        visit(name, builtin, &mut depends, &mut stack, &mut order)?;
    }
    Ok(order)
}

/// The `depends=` entry of a module's `.modinfo` section, split on commas.
fn module_depends(elf: &[u8]) -> Result<Vec<String>, String> {
    let info = elf_section(elf, ".modinfo")?;
    let mut deps = Vec::new();
    for kv in info.split(|&b| b == 0) {
        if let Some(value) = kv.strip_prefix(b"depends=") {
            let value = String::from_utf8_lossy(value);
            deps.extend(
                value
                    .split(',')
                    .filter(|d| !d.is_empty())
                    .map(str::to_string),
            );
        }
    }
    Ok(deps)
}

/// The contents of the section called `wanted` in a little-endian ELF64
/// file.
fn elf_section<'a>(elf: &'a [u8], wanted: &str) -> Result<&'a [u8], String> {
    let bad = || "not a little-endian ELF64 file, or truncated".to_string();
    if elf.get(..6) != Some(b"\x7fELF\x02\x01") {
        return Err(bad());
    }
    let u16_at = |at: usize| -> Result<usize, String> {
        let b = elf.get(at..at + 2).ok_or_else(bad)?;
        Ok(u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |at: usize| -> Result<usize, String> {
        let b = elf.get(at..at + 4).ok_or_else(bad)?;
        Ok(u32::from_le_bytes(b.try_into().unwrap()) as usize)
    };
    let u64_at = |at: usize| -> Result<usize, String> {
        let b = elf.get(at..at + 8).ok_or_else(bad)?;
        usize::try_from(u64::from_le_bytes(b.try_into().unwrap())).map_err(|_| bad())
    };
    let shoff = u64_at(0x28)?;
    let shentsize = u16_at(0x3a)?;
    let shnum = u16_at(0x3c)?;
    let shstrndx = u16_at(0x3e)?;
    if shentsize < 0x40 {
        return Err(bad());
    }
    let section = |i: usize| -> Result<(usize, &'a [u8]), String> {
        let hdr = shoff
            .checked_add(i.checked_mul(shentsize).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        let name = u32_at(hdr)?;
        let offset = u64_at(hdr + 0x18)?;
        let size = u64_at(hdr + 0x20)?;
        let end = offset.checked_add(size).ok_or_else(bad)?;
        Ok((name, elf.get(offset..end).ok_or_else(bad)?))
    };
    let (_, names) = section(shstrndx)?;
    for i in 0..shnum {
        let (name, data) = section(i)?;
        let name = names.get(name..).ok_or_else(bad)?;
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        if name == wanted.as_bytes() {
            return Ok(data);
        }
    }
    Err(format!("no {wanted} section"))
}

/// A newc ("070701") cpio archive writer, as the kernel's initramfs
/// unpacker reads it. Owners are root, times are zero (so the archive is
/// reproducible), inode numbers count up from 1.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, S_IFDIR | perm, 2, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, S_IFREG | perm, 1, (0, 0), data);
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, S_IFLNK | 0o777, 1, (0, 0), target.as_bytes());
    }

    fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, S_IFCHR | perm, 1, (major, minor), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[]);
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One parsed newc entry: (name, mode, rdev, data).
    type Entry = (String, u32, (u32, u32), Vec<u8>);

    /// A minimal newc reader, independent of the writer's code.
    fn read_cpio(mut buf: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let start = buf.len();
        loop {
            assert_eq!(&buf[..6], b"070701");
            let field = |i: usize| {
                u32::from_str_radix(
                    std::str::from_utf8(&buf[6 + 8 * i..14 + 8 * i]).unwrap(),
                    16,
                )
                .unwrap()
            };
            let (mode, size, rmaj, rmin, namesize) =
                (field(1), field(6), field(9), field(10), field(11));
            let name_end = 110 + namesize as usize;
            assert_eq!(buf[name_end - 1], 0, "name is NUL-terminated");
            let name = String::from_utf8(buf[110..name_end - 1].to_vec()).unwrap();
            let consumed = start - buf.len();
            let data_at = (consumed + name_end).next_multiple_of(4) - consumed;
            let data = buf[data_at..data_at + size as usize].to_vec();
            let next = (consumed + data_at + size as usize).next_multiple_of(4) - consumed;
            buf = &buf[next..];
            if name == "TRAILER!!!" {
                assert!(buf.is_empty());
                return out;
            }
            out.push((name, mode, (rmaj, rmin), data));
        }
    }

    #[test]
    fn cpio_round_trips_every_kind_of_entry() {
        let mut c = Cpio::default();
        c.dir("bin", 0o755);
        c.file("bin/busybox", 0o755, b"\x7fELF12345");
        c.symlink("bin/sh", "busybox");
        c.char_dev("dev/console", 0o600, 5, 1);
        c.file("e", 0o644, b"");
        let bytes = c.finish();
        assert!(bytes.len().is_multiple_of(4));
        let entries = read_cpio(&bytes);
        let want: Vec<Entry> = vec![
            ("bin".into(), 0o040_755, (0, 0), vec![]),
            (
                "bin/busybox".into(),
                0o100_755,
                (0, 0),
                b"\x7fELF12345".to_vec(),
            ),
            ("bin/sh".into(), 0o120_777, (0, 0), b"busybox".to_vec()),
            ("dev/console".into(), 0o020_600, (5, 1), vec![]),
            ("e".into(), 0o100_644, (0, 0), vec![]),
        ];
        assert_eq!(entries, want);
    }

    #[test]
    fn cpio_header_layout_matches_newc() {
        let mut c = Cpio::default();
        c.file("ab", 0o644, b"xyz");
        let bytes = c.finish();
        // 110-byte header, "ab\0" padded to 116, 3 data bytes padded to 120.
        assert_eq!(&bytes[..14], b"07070100000001");
        assert_eq!(&bytes[14..22], b"000081A4");
        assert_eq!(&bytes[54..62], b"00000003", "filesize");
        assert_eq!(&bytes[94..102], b"00000003", "namesize counts the NUL");
        assert_eq!(&bytes[110..116], b"ab\0\0\0\0");
        assert_eq!(&bytes[116..120], b"xyz\0");
        assert_eq!(&bytes[120..126], b"070701");
    }

    /// A little-endian ELF64 file with the given sections (plus the null
    /// section and .shstrtab), enough for [`elf_section`].
    fn fake_elf(sections: &[(&str, &[u8])]) -> Vec<u8> {
        let mut shstrtab = vec![0u8];
        let mut body = Vec::new();
        let mut headers = vec![[0u8; 64]];
        let mut add = |name: &str, data: &[u8], shstrtab: &mut Vec<u8>| {
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(&(shstrtab.len() as u32).to_le_bytes());
            shstrtab.extend_from_slice(name.as_bytes());
            shstrtab.push(0);
            h[0x18..0x20].copy_from_slice(&((64 + body.len()) as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(data.len() as u64).to_le_bytes());
            body.extend_from_slice(data);
            headers.push(h);
        };
        for (name, data) in sections {
            add(name, data, &mut shstrtab);
        }
        let mut names = shstrtab.clone();
        names.extend_from_slice(b".shstrtab\0");
        let strtab_name = shstrtab.len() as u32;
        let mut h = [0u8; 64];
        h[..4].copy_from_slice(&strtab_name.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&((64 + body.len()) as u64).to_le_bytes());
        h[0x20..0x28].copy_from_slice(&(names.len() as u64).to_le_bytes());
        body.extend_from_slice(&names);
        headers.push(h);
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&((64 + body.len()) as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&(headers.len() as u16).to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&((headers.len() - 1) as u16).to_le_bytes());
        elf.extend_from_slice(&body);
        for h in headers {
            elf.extend_from_slice(&h);
        }
        elf
    }

    #[test]
    fn modinfo_depends_are_read_from_the_elf_section() {
        let elf = fake_elf(&[
            (".text", b"\x00\x01depends=bogus\x00"),
            (
                ".modinfo",
                b"license=GPL\0depends=virtio_ring,virtio\0name=virtio_balloon\0",
            ),
        ]);
        assert_eq!(module_depends(&elf).unwrap(), ["virtio_ring", "virtio"]);
        let none = fake_elf(&[(".modinfo", b"depends=\0name=virtio_mmio\0")]);
        assert!(module_depends(&none).unwrap().is_empty());
        let missing = fake_elf(&[(".text", b"x")]);
        assert!(module_depends(&missing).is_err());
        assert!(module_depends(b"\x7fELF\x01\x01").is_err());
        let mut truncated = elf.clone();
        truncated.truncate(elf.len() - 40);
        assert!(module_depends(&truncated).is_err());
    }

    fn graph(edges: &[(&str, &[&str])]) -> impl FnMut(&str) -> Result<Vec<String>, String> {
        let map: BTreeMap<String, Vec<String>> = edges
            .iter()
            .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect();
        move |name| map.get(name).cloned().ok_or_else(|| format!("no {name}"))
    }

    #[test]
    fn load_order_puts_dependencies_first_once_and_skips_builtins() {
        let builtin: HashSet<String> = ["virtio".to_string()].into();
        let deps = graph(&[
            ("virtio_mmio", &["virtio"]),
            ("virtio_balloon", &["virtio", "page-reporting"]),
            ("page_reporting", &["virtio_mmio"]),
        ]);
        let order = load_order(&["virtio_mmio", "virtio_balloon"], &builtin, deps).unwrap();
        assert_eq!(order, ["virtio_mmio", "page_reporting", "virtio_balloon"]);
    }

    #[test]
    fn load_order_reports_cycles_and_missing_modules() {
        let none = HashSet::new();
        let cyclic = graph(&[("a", &["b"]), ("b", &["a"])]);
        let err = load_order(&["a"], &none, cyclic).unwrap_err();
        assert!(err.contains("a -> b -> a"), "{err}");
        let missing = graph(&[("a", &["gone"])]);
        assert_eq!(load_order(&["a"], &none, missing).unwrap_err(), "no gone");
    }

    #[test]
    fn a_users_modules_need_only_the_balloon_ones() {
        let dir = std::env::temp_dir().join(format!("tidal-modules-{}", std::process::id()));
        let kernel = dir.join("6.1.0-test/kernel/drivers");
        fs::create_dir_all(&kernel).unwrap();
        let root = dir.join("6.1.0-test");
        fs::write(
            kernel.join("virtio_mmio.ko"),
            fake_elf(&[(".modinfo", b"depends=\0")]),
        )
        .unwrap();
        fs::write(
            kernel.join("virtio_balloon.ko"),
            fake_elf(&[(".modinfo", b"depends=virtio_mmio\0")]),
        )
        .unwrap();
        // No modules.builtin, and none of the optional ones: fine for a user's kernel.
        let optional = ["loop", "ext4"];
        let got = resolve_modules(&root, USER_REQUIRED_MODULES, &optional, false).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["virtio_mmio", "virtio_balloon"]);
        // Not for the fixture, which must have its modules.builtin.
        assert!(resolve_modules(&root, USER_REQUIRED_MODULES, &[], true).is_err());
        // A required module that is neither there nor built in is named.
        fs::remove_file(kernel.join("virtio_balloon.ko")).unwrap();
        let e = resolve_modules(&root, USER_REQUIRED_MODULES, &optional, false).unwrap_err();
        assert!(e.starts_with("module virtio_balloon is neither in"), "{e}");
        // Built in: nothing to load.
        fs::write(
            root.join("modules.builtin"),
            "kernel/drivers/virtio_balloon.ko\n",
        )
        .unwrap();
        let got = resolve_modules(&root, USER_REQUIRED_MODULES, &optional, false).unwrap();
        assert_eq!(got.len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn module_names_follow_the_kernel() {
        assert_eq!(
            module_name("virtio_mmio.ko").as_deref(),
            Some("virtio_mmio")
        );
        assert_eq!(
            module_name("virtio-balloon.ko.xz").as_deref(),
            Some("virtio_balloon")
        );
        assert_eq!(module_name("x.ko.zst").as_deref(), Some("x"));
        assert_eq!(module_name("modules.order"), None);
    }

    #[test]
    fn agent_protocol_lines() {
        assert_eq!(
            agent_request(1, "cat /proc/meminfo | head -3").unwrap(),
            "run 1 cat /proc/meminfo | head -3\n"
        );
        assert!(agent_request(2, "a\nb").is_err());
        assert_eq!(agent_done("tidal-guest: done 1 rc=0\r"), Some((1, 0)));
        assert_eq!(agent_done("tidal-guest: done 12 rc=127"), Some((12, 127)));
        assert_eq!(agent_done("run 1 echo tidal-guest: done 1 rc=0"), None);
        assert_eq!(agent_done("tidal-guest: done x rc=0"), None);
        assert_eq!(agent_done("tidal-guest: ready"), None);
    }

    #[test]
    fn deb_versions_unescape_the_epoch() {
        assert_eq!(
            deb_version("busybox-static_1%3a1.35.0-4+deb12u1+b1_arm64.deb").as_deref(),
            Some("1:1.35.0-4+deb12u1+b1")
        );
        assert_eq!(deb_version("nonsense"), None);
    }

    #[test]
    fn the_scripts_speak_the_protocol() {
        assert!(INIT.starts_with("#!/bin/sh\n"));
        assert!(AGENT.starts_with("#!/bin/sh\n"));
        assert!(INIT.contains(&format!("echo \"{READY}\"")));
        assert!(INIT.contains("/etc/tidal-modules"));
        assert!(INIT.contains("/bin/tidal-agent"));
        assert!(AGENT.contains("tidal-guest: done $id rc="));
    }

    /// Downloads the packages on first use: `cargo test -p xtask --
    /// --ignored linux_fixture`.
    #[test]
    #[ignore = "fetches Debian packages"]
    fn linux_fixture_builds() {
        let root = crate::root();
        let f = build_initramfs(&root, &memtool_path(&root)).unwrap();
        eprintln!("{f:#?}");
        let image = fs::read(&f.kernel).unwrap();
        assert_eq!(&image[IMAGE_MAGIC_AT..IMAGE_MAGIC_AT + 4], IMAGE_MAGIC);
        let entries = read_cpio(&fs::read(&f.initramfs).unwrap());
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        for want in [
            "init",
            "bin/busybox",
            "bin/sh",
            "dev/console",
            "etc/tidal-modules",
            "bin/tidal-mem",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        let list = &entries
            .iter()
            .find(|e| e.0 == "etc/tidal-modules")
            .unwrap()
            .3;
        let list = String::from_utf8_lossy(list);
        let mmio = list.find("virtio_mmio.ko").unwrap();
        let balloon = list.find("virtio_balloon.ko").unwrap();
        assert!(mmio < balloon, "{list}");
    }
}
