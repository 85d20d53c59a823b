//! Test fixtures that may not be committed (licences): Debian's current arm64
//! kernel package, unpacked under `target/fixtures/debian-arm64/`, and the
//! Raspberry Pi 4 device tree it ships, copied to `target/fixtures/`.
//!
//! apt runs with its own lists, cache and (empty) status under the cache
//! directory, so the machine's own package state is never read or written;
//! only the configured package sources are shared. The kernel version is
//! never pinned: whatever `linux-image-arm64` depends on today is fetched.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const PI4_DTB: &str = "bcm2711-rpi-4-b.dtb";
const METAPACKAGE: &str = "linux-image-arm64";

fn fixtures_dir(workspace_root: &Path) -> PathBuf {
    workspace_root.join("target/fixtures")
}

/// The Pi 4 device tree, fetched on first use.
pub fn pi4_dtb(workspace_root: &Path) -> Result<PathBuf, String> {
    broadcom_dtb(workspace_root, PI4_DTB)
}

/// RAM of QEMU's raspi4b model (its board revision 0xb03115: 2 GiB).
const QEMU_RASPI4B_RAM: u64 = 2 << 30;

/// The Pi 4 device tree for QEMU raspi4b ([`harness::PI4_QEMU_DTB`], whose
/// doc says why): [`pi4_dtb`] with a `device_type = "memory"` node
/// `/ram@40000000` for the RAM above 1 GiB, added by `fdtput`. Rewritten
/// when older than the tree it is made from.
pub fn pi4_qemu_dtb(workspace_root: &Path) -> Result<PathBuf, String> {
    let src = pi4_dtb(workspace_root)?;
    let out = fixtures_dir(workspace_root).join(harness::PI4_QEMU_DTB);
    let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    if out.is_file() && modified(&out) >= modified(&src) {
        return Ok(out);
    }
    let tmp = out.with_extension("dtb.part");
    fs::copy(&src, &tmp).map_err(|e| format!("copying {}: {e}", src.display()))?;
    let node = format!("/ram@{:x}", UPPER_RAM_BASE);
    let fdtput = |args: &[&str]| {
        let mut cmd = Command::new("fdtput");
        cmd.arg(&tmp).args(args);
        run(&mut cmd)
    };
    fdtput(&["-c", &node])?;
    fdtput(&["-t", "s", &node, "device_type", "memory"])?;
    let cells: Vec<String> = upper_ram_reg(QEMU_RASPI4B_RAM)
        .iter()
        .map(|c| format!("{c:x}"))
        .collect();
    let mut args = vec!["-t", "x", node.as_str(), "reg"];
    args.extend(cells.iter().map(String::as_str));
    fdtput(&args)?;
    fs::rename(&tmp, &out).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(out)
}

/// Where the BCM2711's RAM above the first GiB starts.
const UPPER_RAM_BASE: u64 = 1 << 30;
/// The peripherals' window in the BCM2711's low-peripheral mode (the
/// firmware's default): RAM under it is not reachable.
const LOW_PERIPHERALS: (u64, u64) = (0xfc00_0000, 1 << 32);

/// The `reg` cells (2 address cells, 1 size cell, as in the BCM2711 trees)
/// for a board with `ram` bytes of RAM above [`UPPER_RAM_BASE`], the way the
/// firmware lists it: without the low-peripheral window, a range too big
/// for one size cell in 2 GiB pieces.
fn upper_ram_reg(ram: u64) -> Vec<u32> {
    const MAX_PIECE: u64 = 1 << 31;
    let mut cells = Vec::new();
    let ranges = [
        (UPPER_RAM_BASE, ram.min(LOW_PERIPHERALS.0)),
        (LOW_PERIPHERALS.1, ram.max(LOW_PERIPHERALS.1)),
    ];
    for (mut start, end) in ranges {
        while start < end {
            let left = end - start;
            let size = if left <= u64::from(u32::MAX) {
                left
            } else {
                MAX_PIECE
            };
            cells.extend([(start >> 32) as u32, start as u32, size as u32]);
            start += size;
        }
    }
    cells
}

/// `name` (e.g. `bcm2711-rpi-400.dtb`) from the kernel package's
/// `usr/lib/linux-image-*/broadcom/`, copied to `target/fixtures/` on
/// first use.
pub fn broadcom_dtb(workspace_root: &Path, name: &str) -> Result<PathBuf, String> {
    let out = fixtures_dir(workspace_root).join(name);
    if out.is_file() {
        return Ok(out);
    }
    let kernel = debian_kernel(workspace_root)?;
    let lib = kernel.join("usr/lib");
    let entries = fs::read_dir(&lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    let dtb = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("linux-image-"))
        .map(|e| e.path().join("broadcom").join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("no linux-image-*/broadcom/{name} under {}", lib.display()))?;
    // Copy to a temporary name first so an interrupted copy is not mistaken
    // for the fixture next time.
    let tmp = out.with_extension("dtb.part");
    fs::copy(&dtb, &tmp).map_err(|e| format!("copying {}: {e}", dtb.display()))?;
    fs::rename(&tmp, &out).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(out)
}

/// The root of Debian's current arm64 kernel package, unpacked (it holds
/// `boot/vmlinuz-*`, `lib/modules/*` and `usr/lib/linux-image-*`), fetched
/// on first use.
pub fn debian_kernel(workspace_root: &Path) -> Result<PathBuf, String> {
    let dir = fixtures_dir(workspace_root).join("debian-arm64");
    let kernel = dir.join("kernel");
    // Written last, so a half-unpacked tree is redone rather than trusted.
    let done = dir.join("kernel.done");
    if done.is_file() {
        return Ok(kernel);
    }
    for sub in ["lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(dir.join(sub)).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    eprintln!(
        "fixtures: downloading Debian's arm64 kernel package into {}",
        dir.display()
    );
    run(apt(&dir, "apt-get").args(["-qq", "update"]))?;
    let package = current_dependency(&dir)?;
    download_and_unpack(&dir, &dir, &package, &kernel)?;
    fs::write(&done, format!("{package}\n")).map_err(|e| format!("{}: {e}", done.display()))?;
    Ok(kernel)
}

/// The root of Debian's current arm64 `package` (any architecture-specific
/// package without a kernel's version dance, e.g. `busybox-static`), unpacked
/// under `target/fixtures/debian-arm64/<package>/root`, fetched on first use
/// with the same apt lists, cache and options as [`debian_kernel`]. The
/// version is whatever the archive's candidate is today; see
/// [`debian_package_deb`].
pub fn debian_package(workspace_root: &Path, package: &str) -> Result<PathBuf, String> {
    let dir = fixtures_dir(workspace_root).join("debian-arm64");
    let pkg_dir = dir.join(package);
    let root = pkg_dir.join("root");
    // Written last (holding the .deb's file name), so a half-unpacked tree is
    // redone rather than trusted.
    let done = pkg_dir.join("done");
    if done.is_file() {
        return Ok(root);
    }
    for sub in ["lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(dir.join(sub)).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    fs::create_dir_all(&pkg_dir).map_err(|e| format!("{}: {e}", pkg_dir.display()))?;
    eprintln!(
        "fixtures: downloading Debian's arm64 {package} package into {}",
        pkg_dir.display()
    );
    // Refresh the lists: ones left by an earlier kernel download may name a
    // version the archive has since dropped.
    run(apt(&dir, "apt-get").args(["-qq", "update"]))?;
    let deb = download_and_unpack(&dir, &pkg_dir, package, &root)?;
    let name = deb.file_name().unwrap_or_default().to_string_lossy();
    fs::write(&done, format!("{name}\n")).map_err(|e| format!("{}: {e}", done.display()))?;
    Ok(root)
}

/// Debian's `raspi-firmware` package (the Pi's GPU firmware, `start4.elf`,
/// `fixup4.dat` and the others, under `usr/lib/raspi-firmware/`), unpacked
/// under `target/fixtures/debian-arm64/raspi-firmware/root` on first use.
///
/// It is in the `non-free-firmware` component, which the machine's sources
/// may not have: apt runs here with sources of its own (in the same
/// directory), one entry with the URI and release of the machine's Debian
/// archive and that component, so nothing under /etc/apt changes.
pub fn raspi_firmware(workspace_root: &Path) -> Result<PathBuf, String> {
    const PACKAGE: &str = "raspi-firmware";
    let dir = fixtures_dir(workspace_root)
        .join("debian-arm64")
        .join(PACKAGE);
    let root = dir.join("root");
    let done = dir.join("done");
    if done.is_file() {
        return Ok(root);
    }
    let apt_dir = dir.join("apt");
    for sub in ["lists/partial", "cache/archives/partial", "sources.list.d"] {
        fs::create_dir_all(apt_dir.join(sub)).map_err(|e| format!("{}: {e}", apt_dir.display()))?;
    }
    let (uri, suite) = machine_debian_archive().ok_or_else(|| {
        "cannot find the machine's Debian archive in /etc/apt/sources.list or \
         /etc/apt/sources.list.d/*.sources; add a source for the Pi firmware, e.g. \
         /etc/apt/sources.list.d/non-free-firmware.sources with the lines \
         `Types: deb`, `URIs: <your Debian mirror>`, `Suites: bookworm`, \
         `Components: non-free-firmware`, \
         `Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg`, and run \
         `apt-get update`"
            .to_string()
    })?;
    let sources = apt_dir
        .join("sources.list.d")
        .join("non-free-firmware.sources");
    fs::write(&sources, firmware_source(&uri, &suite))
        .map_err(|e| format!("{}: {e}", sources.display()))?;
    // An empty one-line list, so only the file above is read.
    let list = apt_dir.join("sources.list");
    fs::write(&list, "").map_err(|e| format!("{}: {e}", list.display()))?;
    eprintln!(
        "fixtures: downloading Debian's {PACKAGE} package ({suite} non-free-firmware) into {}",
        dir.display()
    );
    let apt_fw = |program: &str| {
        let mut cmd = apt(&apt_dir, program);
        cmd.arg("-o")
            .arg(format!("Dir::Etc::SourceList={}", list.display()))
            .arg("-o")
            .arg(format!(
                "Dir::Etc::SourceParts={}",
                apt_dir.join("sources.list.d").display()
            ));
        cmd
    };
    run(apt_fw("apt-get").args(["-qq", "update"]))?;
    for deb in debs(&dir)? {
        fs::remove_file(&deb).map_err(|e| format!("{}: {e}", deb.display()))?;
    }
    run(apt_fw("apt-get")
        .current_dir(&dir)
        .args(["-qq", "download", PACKAGE]))?;
    let deb = match debs(&dir)?.as_slice() {
        [deb] => deb.clone(),
        other => {
            return Err(format!(
                "expected one .deb in {} after download, found {}",
                dir.display(),
                other.len()
            ))
        }
    };
    if root.exists() {
        fs::remove_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    }
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
    let name = deb.file_name().unwrap_or_default().to_string_lossy();
    fs::write(&done, format!("{name}\n")).map_err(|e| format!("{}: {e}", done.display()))?;
    Ok(root)
}

/// The `raspi-firmware` .deb [`raspi_firmware`] unpacked, if it has.
pub fn raspi_firmware_deb(workspace_root: &Path) -> Option<String> {
    let done = fixtures_dir(workspace_root).join("debian-arm64/raspi-firmware/done");
    Some(fs::read_to_string(done).ok()?.trim().to_string())
}

/// The deb822 source of the `non-free-firmware` component of `suite` at `uri`.
fn firmware_source(uri: &str, suite: &str) -> String {
    format!(
        "Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: non-free-firmware\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
}

/// The URI and release (e.g. `bookworm`) of the machine's Debian archive.
fn machine_debian_archive() -> Option<(String, String)> {
    let mut deb822 = Vec::new();
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "sources"))
            .collect();
        paths.sort();
        deb822.extend(paths.iter().filter_map(|p| fs::read_to_string(p).ok()));
    }
    let one_line = fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    debian_archive(&deb822, &one_line)
}

/// The first source, in deb822 files then the one-line list, that is a
/// Debian release itself: type `deb`, a suite without a `-` (not
/// `-updates`, `-security`, `-backports`) and a URI not of the security
/// archive. Returns its URI and suite.
fn debian_archive(deb822: &[String], one_line: &str) -> Option<(String, String)> {
    let release = |suite: &str| !suite.is_empty() && !suite.contains('-');
    for text in deb822 {
        for stanza in text.split("\n\n") {
            let field = |name: &str| {
                stanza.lines().find_map(|l| {
                    let (key, value) = l.split_once(':')?;
                    key.trim()
                        .eq_ignore_ascii_case(name)
                        .then(|| value.trim().to_string())
                })
            };
            let is_deb = field("Types").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
            let (Some(uris), Some(suites)) = (field("URIs"), field("Suites")) else {
                continue;
            };
            let uri = uris.split_whitespace().next().unwrap_or("");
            if !is_deb || uri.is_empty() || uri.contains("security") {
                continue;
            }
            if let Some(suite) = suites.split_whitespace().find(|s| release(s)) {
                return Some((uri.to_string(), suite.to_string()));
            }
        }
    }
    one_line.lines().find_map(|line| {
        let mut words = line
            .split_whitespace()
            .filter(|w| !w.starts_with('[') && !w.ends_with(']'));
        if words.next()? != "deb" {
            return None;
        }
        let uri = words.next()?;
        let suite = words.next()?;
        (uri.contains("://") && !uri.contains("security") && release(suite))
            .then(|| (uri.to_string(), suite.to_string()))
    })
}

/// `apt-get download` `package` into `into` (with the apt state in
/// `apt_dir`), after removing any .deb already there, and unpack it into
/// `dest` (emptied first). Returns the .deb's path.
fn download_and_unpack(
    apt_dir: &Path,
    into: &Path,
    package: &str,
    dest: &Path,
) -> Result<PathBuf, String> {
    for deb in debs(into)? {
        fs::remove_file(&deb).map_err(|e| format!("{}: {e}", deb.display()))?;
    }
    // Not quiet: apt shows the download's progress (its size, and bytes and
    // rate as it goes when the output is a terminal; `progress` prints them
    // when it is not); a package of a few hundred MiB takes minutes.
    let watched = [into.to_path_buf(), apt_dir.join("cache/archives/partial")];
    crate::progress::run_watching(
        apt(apt_dir, "apt-get")
            .current_dir(into)
            .args(["download", package]),
        &format!("fixtures: downloading {package}"),
        &watched,
        package_size(apt_dir, package),
    )
    .map_err(|e| {
        format!(
            "downloading Debian's arm64 package {package} failed ({e}); check the network and \
             the machine's apt sources (/etc/apt/sources.list*), then run the command again"
        )
    })?;
    let deb = match debs(into)?.as_slice() {
        [deb] => deb.clone(),
        other => {
            return Err(format!(
                "expected one .deb in {} after download, found {}",
                into.display(),
                other.len()
            ))
        }
    };
    if dest.exists() {
        fs::remove_dir_all(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    }
    let size = fs::metadata(&deb).map_or(0, |m| m.len());
    eprintln!(
        "fixtures: unpacking {} ({:.1} MiB) into {}",
        deb.file_name().unwrap_or_default().to_string_lossy(),
        size as f64 / f64::from(1 << 20),
        dest.display()
    );
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(dest))?;
    Ok(deb)
}

/// The `package_version_arch.deb` file name [`debian_package`] unpacked, if
/// it has (the version is URL-escaped as in the archive: `1%3a1.35.0-4`).
pub fn debian_package_deb(workspace_root: &Path, package: &str) -> Option<String> {
    let done = fixtures_dir(workspace_root)
        .join("debian-arm64")
        .join(package)
        .join("done");
    let text = fs::read_to_string(done).ok()?;
    Some(text.trim().to_string())
}

/// The size in bytes of `package`'s candidate .deb, as the apt lists in
/// `dir` give it (`None` if they do not).
fn package_size(dir: &Path, package: &str) -> Option<u64> {
    let out = apt(dir, "apt-cache")
        .args(["show", "--no-all-versions", package])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Size: ")?.trim().parse().ok())
}

/// An apt command that sees only arm64 and keeps all its state under `dir`.
fn apt(dir: &Path, program: &str) -> Command {
    let mut cmd = Command::new(program);
    let opt = |cmd: &mut Command, kv: String| {
        cmd.arg("-o").arg(kv);
    };
    opt(&mut cmd, "APT::Architecture=arm64".into());
    opt(&mut cmd, "APT::Architectures=arm64".into());
    opt(
        &mut cmd,
        format!("Dir::State::Lists={}", dir.join("lists").display()),
    );
    opt(
        &mut cmd,
        format!("Dir::Cache={}", dir.join("cache").display()),
    );
    // The installed-package database of an amd64 machine means nothing here.
    opt(&mut cmd, "Dir::State::Status=/dev/null".into());
    // Run as root, apt drops to `_apt` for downloads, which cannot write
    // into a cache owned by the user running xtask.
    opt(&mut cmd, "APT::Sandbox::User=root".into());
    cmd
}

/// The package `linux-image-arm64` currently depends on, e.g.
/// `linux-image-6.1.0-57-arm64`.
fn current_dependency(dir: &Path) -> Result<String, String> {
    let out = apt(dir, "apt-cache")
        .args(["depends", METAPACKAGE])
        .output();
    let out = out.map_err(|e| format!("apt-cache: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "apt-cache depends {METAPACKAGE}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .map(|p| p.trim_matches(|c| c == '<' || c == '>').to_string())
        .find(|p| p.starts_with("linux-image-"))
        .ok_or_else(|| {
            format!("apt-cache depends {METAPACKAGE} names no linux-image package:\n{text}")
        })
}

fn debs(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect())
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("{:?}: {e}", cmd.get_program()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_source_is_found_in_deb822() {
        let sources = "Types: deb\nURIs: http://mirror.example/debian\n\
                       Suites: bookworm bookworm-updates\nComponents: main\n\n\
                       Types: deb\nURIs: http://mirror.example/debian-security\n\
                       Suites: bookworm-security\nComponents: main\n";
        let backports = "Types: deb\nURIs: http://mirror.example/debian\n\
                         Suites: bookworm-backports\nComponents: main\n";
        assert_eq!(
            debian_archive(&[backports.into(), sources.into()], ""),
            Some(("http://mirror.example/debian".into(), "bookworm".into()))
        );
    }

    #[test]
    fn the_release_source_is_found_in_a_one_line_list() {
        let list = "# comment\n\
                    deb http://mirror.example/debian-security bookworm-security main\n\
                    deb [arch=amd64] http://mirror.example/debian bookworm main\n";
        assert_eq!(
            debian_archive(&[], list),
            Some(("http://mirror.example/debian".into(), "bookworm".into()))
        );
        assert_eq!(
            debian_archive(&[], "deb-src http://x/debian bookworm main"),
            None
        );
    }

    #[test]
    fn upper_ram_is_listed_as_the_firmware_does() {
        // 1 GiB board: nothing above 1 GiB.
        assert_eq!(upper_ram_reg(1 << 30), Vec::<u32>::new());
        // QEMU raspi4b, 2 GiB.
        assert_eq!(upper_ram_reg(2 << 30), [0, 0x4000_0000, 0x4000_0000]);
        // 4 GiB: up to the peripherals' window.
        assert_eq!(upper_ram_reg(4 << 30), [0, 0x4000_0000, 0xbc00_0000]);
        // 8 GiB: and from 4 GiB up, in 2 GiB pieces.
        assert_eq!(
            upper_ram_reg(8 << 30),
            [
                0,
                0x4000_0000,
                0xbc00_0000,
                1,
                0,
                0x8000_0000,
                1,
                0x8000_0000,
                0x8000_0000
            ]
        );
    }

    #[test]
    fn the_firmware_source_names_only_non_free_firmware() {
        let s = firmware_source("http://mirror.example/debian", "bookworm");
        assert!(s.contains("Components: non-free-firmware\n"), "{s}");
        assert!(s.contains("Suites: bookworm\n"), "{s}");
    }
}
