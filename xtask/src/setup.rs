//! Installs what the build and the tests need and is missing: the Rust target
//! and components (rustup does not install them from rust-toolchain.toml
//! here), QEMU >= 9 from bookworm-backports when the installed one is older
//! or absent, dtc, cpio, a C++ compiler (for libFuzzer in the fuzz
//! targets), and dosfstools and mtools (the SD card image). Each step
//! checks first, so a second run is quick.

use std::path::PathBuf;
use std::process::Command;

use crate::run_cmd;

const MIN_QEMU_MAJOR: u32 = 9;

pub fn run() -> Result<(), String> {
    rust()?;
    debian_packages()
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn rust() -> Result<(), String> {
    let targets =
        output(Command::new("rustup").args(["target", "list", "--installed"])).unwrap_or_default();
    // The hypervisor and bare-metal guests, and the Linux guest's tools.
    for target in [crate::TARGET, crate::linux::TOOLS_TARGET] {
        if !targets.lines().any(|l| l.trim() == target) {
            eprintln!("xtask: setup: adding the Rust target {target}");
            run_cmd(Command::new("rustup").args(["target", "add", target]))?;
        }
    }
    let components = output(Command::new("rustup").args(["component", "list", "--installed"]))
        .unwrap_or_default();
    for component in ["llvm-tools", "clippy", "rustfmt"] {
        if !components.lines().any(|l| l.starts_with(component)) {
            eprintln!("xtask: setup: adding the Rust component {component}");
            run_cmd(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    Ok(())
}

/// The path of an LLVM tool from the `llvm-tools` component.
pub fn llvm_tool(name: &str) -> Result<PathBuf, String> {
    let sysroot =
        output(Command::new("rustc").args(["--print", "sysroot"])).ok_or("cannot run rustc")?;
    let host = output(Command::new("rustc").arg("-vV"))
        .and_then(|v| {
            v.lines()
                .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        })
        .ok_or("cannot read the host triple from rustc -vV")?;
    let path = PathBuf::from(sysroot.trim())
        .join("lib/rustlib")
        .join(host)
        .join("bin")
        .join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: run `rustup component add llvm-tools`",
            path.display()
        ))
    }
}

/// The installed QEMU's major version, if qemu-system-aarch64 runs.
fn qemu_major() -> Option<u32> {
    let v = output(Command::new("qemu-system-aarch64").arg("--version"))?;
    let version = v
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)?;
    version.split('.').next()?.parse().ok()
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {cmd}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn debian_packages() -> Result<(), String> {
    let mut plain = Vec::new();
    if !have("dtc") {
        plain.push("device-tree-compiler");
    }
    if !have("cpio") {
        plain.push("cpio");
    }
    // `cargo xtask sdcard --image` formats and fills the FAT32 partition.
    if !have("mkfs.fat") {
        plain.push("dosfstools");
    }
    if !have("mcopy") {
        plain.push("mtools");
    }
    // libfuzzer-sys compiles libFuzzer (C++) for the fuzz targets.
    if !have("c++") {
        plain.push("g++");
    }
    let qemu_ok = qemu_major().is_some_and(|m| m >= MIN_QEMU_MAJOR);
    if plain.is_empty() && qemu_ok {
        return Ok(());
    }
    if !is_root() {
        return Err(format!(
            "missing: {}{}; run `cargo xtask setup` as root, or install them yourself",
            plain.join(", "),
            if qemu_ok {
                ""
            } else {
                " qemu-system-arm (>= 9, from bookworm-backports)"
            }
        ));
    }
    if !qemu_ok {
        add_backports()?;
    }
    eprintln!("xtask: setup: apt-get update");
    run_cmd(Command::new("apt-get").args(["update", "-q"]))?;
    if !plain.is_empty() {
        eprintln!("xtask: setup: installing {}", plain.join(" "));
        run_cmd(apt_install().args(&plain))?;
    }
    if !qemu_ok {
        eprintln!("xtask: setup: installing qemu-system-arm from bookworm-backports");
        run_cmd(apt_install().args(["-t", "bookworm-backports", "qemu-system-arm"]))?;
        if qemu_major().is_none_or(|m| m < MIN_QEMU_MAJOR) {
            return Err(format!(
                "qemu-system-aarch64 is still older than {MIN_QEMU_MAJOR} after installing"
            ));
        }
    }
    Ok(())
}

fn apt_install() -> Command {
    let mut cmd = Command::new("apt-get");
    cmd.args(["install", "-y", "-q", "--no-install-recommends"])
        .env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|u| u.trim() == "0")
}

/// Add bookworm-backports using the URIs of the Debian source the machine
/// already has (so no mirror is named here).
fn add_backports() -> Result<(), String> {
    let path = "/etc/apt/sources.list.d/tidal-backports.sources";
    let existing =
        std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    if existing.contains("bookworm-backports") || std::path::Path::new(path).exists() {
        return Ok(());
    }
    let uri = existing
        .lines()
        .find_map(|l| {
            l.strip_prefix("URIs:")
                .map(|u| u.split_whitespace().next().unwrap_or("").to_string())
        })
        .or_else(|| {
            let list = std::fs::read_to_string("/etc/apt/sources.list").ok()?;
            list.lines()
                .filter(|l| l.starts_with("deb ") && l.contains(" bookworm"))
                .find_map(|l| {
                    l.split_whitespace()
                        .find(|w| w.contains("://"))
                        .map(str::to_string)
                })
        })
        .filter(|u| !u.is_empty())
        .ok_or("cannot find the machine's Debian source to add bookworm-backports")?;
    eprintln!("xtask: setup: adding bookworm-backports ({path})");
    let text = format!(
        "Types: deb\nURIs: {uri}\nSuites: bookworm-backports\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    );
    std::fs::write(path, text).map_err(|e| format!("writing {path}: {e}"))
}
