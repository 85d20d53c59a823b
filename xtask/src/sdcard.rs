//! `cargo xtask sdcard`: what goes on a Raspberry Pi 4's SD card. A folder
//! with the boot partition's files (the GPU firmware, the BCM2711 device
//! trees, the hypervisor as `kernel8.img`, the guest bundle as the
//! initramfs, `config.txt` and `README.txt`) and, on request, an image for
//! `dd`: an MBR with one FAT32 partition holding the same files. With
//! `--tests` the bundle is the on-target test bundle
//! (`guests/tests/on-target.toml`): the hypervisor checks itself on the
//! board and prints `ON-TARGET:` lines on the serial console.
//!
//! The image is made without root by dosfstools (`mkfs.fat --offset`) and
//! mtools (`mcopy -i IMAGE@@OFFSET`), both installed by `cargo xtask setup`;
//! the MBR is written here. They were chosen over a FAT crate because they
//! are the standard tools a user has to inspect or change the image
//! (`mdir`, `mcopy`), and xtask, rebuilt by every command, keeps its few
//! dependencies.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fixtures;

/// The hypervisor image's name on the card (`kernel=` in config.txt).
pub const KERNEL: &str = "kernel8.img";
/// The guest bundle's name on the card (`initramfs ... followkernel`).
pub const BUNDLE: &str = "guests.img";
/// The on-target test bundle (`--tests`), `target/bundles/<this>.img`,
/// built from `guests/tests/<this>.toml`.
pub const TESTS_BUNDLE: &str = "on-target";
/// The GPU firmware files the Pi 4 needs, from Debian's `raspi-firmware`.
pub const FIRMWARE: &[&str] = &["start4.elf", "fixup4.dat"];
/// The BCM2711 device trees, from Debian's kernel package: the firmware
/// picks the one for the board it runs on (Pi 4 B, Pi 400, CM4 on its IO
/// board).
pub const DTBS: &[&str] = &[
    "bcm2711-rpi-4-b.dtb",
    "bcm2711-rpi-400.dtb",
    "bcm2711-rpi-cm4-io.dtb",
];

/// Where the partition starts in the image: 1 MiB, in 512-byte sectors.
const PARTITION_LBA: u64 = 2048;
const SECTOR: u64 = 512;

/// Where one file on the card comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A file of `usr/lib/raspi-firmware/` in the firmware package.
    Firmware(&'static str),
    /// A device tree of the kernel package's `broadcom/`.
    Dtb(&'static str),
    /// The hypervisor's raw image.
    Hypervisor,
    /// The guest bundle.
    Bundle,
    /// Text written here ([`config_txt`], [`readme_txt`]).
    Text(String),
}

/// Every file of the boot partition: its name on the card and its source.
pub fn files() -> Vec<(&'static str, Source)> {
    let mut files: Vec<(&'static str, Source)> =
        FIRMWARE.iter().map(|f| (*f, Source::Firmware(f))).collect();
    files.extend(DTBS.iter().map(|d| (*d, Source::Dtb(d))));
    files.push((KERNEL, Source::Hypervisor));
    files.push((BUNDLE, Source::Bundle));
    files.push(("config.txt", Source::Text(config_txt())));
    files.push(("README.txt", Source::Text(readme_txt())));
    files
}

/// The firmware's `config.txt`, commented.
pub fn config_txt() -> String {
    format!(
        "\
# config.txt for Tidal, a hypervisor, on a Raspberry Pi 4 / Pi 400 / CM4
# (written by `cargo xtask sdcard`). The GPU firmware (start4.elf) reads it
# before it starts the ARM cores; README.txt says how to use this card.

[all]
# Start the ARM cores in AArch64 state: the firmware enters {KERNEL} at EL2
# with the address of the device tree in x0 and holds the other three cores
# in its spin table.
arm_64bit=1
kernel={KERNEL}

# The guest bundle, loaded right after the kernel; the firmware records
# where in the device tree (/chosen linux,initrd-start and -end), which is
# where the hypervisor looks for it.
initramfs {BUNDLE} followkernel

# The console: the mini UART on GPIO 14 (TXD) and 15 (RXD), 115200 8N1.
# enable_uart=1 also holds the core clock steady, which the mini UART's baud
# rate follows. The device tree's /chosen/stdout-path names this UART.
enable_uart=1

# Interrupts through the GIC-400 (the Pi 4's default, said here because the
# hypervisor needs it: it gives each guest a virtual GIC through the
# GIC-400's virtualization interface, and has no driver for the legacy
# interrupt controller).
enable_gic=1

# The device tree: the firmware picks the one for this board
# (bcm2711-rpi-4-b.dtb, bcm2711-rpi-400.dtb or bcm2711-rpi-cm4-io.dtb, all on
# this card) and fills in /memory itself from the board's revision.
#
# RAM: nothing to change for a 1, 2, 4 or 8 GiB board. The firmware lists
# all of it in /memory, less the VideoCore's share below 1 GiB (gpu_mem,
# 76 MiB by default) and, on 4 and 8 GiB boards, the 64 MiB under 4 GiB that
# the peripherals cover (0xfc000000-0xffffffff); the hypervisor uses what
# /memory lists. To run with less, e.g. to try a 1 GiB configuration on a
# bigger board, limit it in MiB:
#total_mem=1024
"
    )
}

/// The card's `README.txt`.
pub fn readme_txt() -> String {
    format!(
        "\
Tidal on a Raspberry Pi 4 (Pi 4 Model B, Pi 400, Compute Module 4)
=================================================================

These are the files of the SD card's boot partition, written by
`cargo xtask sdcard`:

  start4.elf, fixup4.dat   the GPU firmware (Debian's raspi-firmware package)
  bcm2711-*.dtb            the device trees (Debian's arm64 kernel package)
  {KERNEL:<24} the Tidal hypervisor
  {BUNDLE:<24} the guest bundle: the VMs to start
  config.txt               what the firmware loads, and how (commented)

Flashing
--------
Either copy every file of this folder to the first partition of an SD card,
formatted FAT32 (an MBR partition of type 0x0c; a card as sold usually is),
or write the image that `cargo xtask sdcard --image FILE` made to the whole
card (not to a partition; this erases the card):

  dd if=FILE of=/dev/sdX bs=4M conv=fsync

where /dev/sdX is the card (check with lsblk first). The image holds an MBR
and one FAT32 partition with these files.

The serial console
------------------
Connect a USB-to-serial adapter with 3.3 V logic levels (5 V or RS-232
levels damage the Pi) to the 40-pin header:

  adapter GND  to  pin 6 (GND)
  adapter RXD  to  pin 8 (GPIO 14, the Pi's TXD)
  adapter TXD  to  pin 10 (GPIO 15, the Pi's RXD)

and open it at 115200 baud, 8 data bits, no parity, 1 stop bit (8N1), no
flow control, e.g. `picocom -b 115200 /dev/ttyUSB0` or
`screen /dev/ttyUSB0 115200`. Leave the adapter's power pin unconnected.

What you should see
-------------------
A few seconds after power-on, the hypervisor's banner, then a line per
VM it starts and the shell's prompt (as printed under QEMU's raspi4b model
with a bundle of two VMs; <...> varies with the board, build and bundle):

  Tidal hypervisor v<version> (<build>) on Raspberry Pi 4 [<compatible>]
  model: <model>; loaded at 0x<address>, device tree at 0x<address>
  GIC: GICv2, GICD 0xff841000, GICC 0xff842000, GICH 0xff844000, GICV 0xff846000
  console: BCM2835 mini UART at 0xfe215040; trace: <trace UART or none>
  virtual GIC: GICv2 with 4 list registers
  RAM: <bytes> bytes (<MiB> MiB) in <n> bank(s)
    bank 0: 0x0000000000-0x<end>  <MiB> MiB
    ...
  guest bundle: format version 1, <n> VM(s), <size> at 0x<address>
  cpu1 online (MPIDR 0x1, spin-table)
  cpu2 online (MPIDR 0x2, spin-table)
  cpu3 online (MPIDR 0x3, spin-table)
  CPUs online: 4 of 4
  memory manager: <guest RAM> committed, <free> free in the pool; ...
  tidal: [<vm>] VM started on CPU <n> with <size> of RAM
  Type 'help' for the list of commands.
  tidal>

The guests' own output follows, each line prefixed with [<vm>].

`help` lists the commands; `mem` shows where every byte of RAM is, `vms`
the guests, `console <vm>` attaches to a guest's console.

The on-target tests
-------------------
A card made with `cargo xtask sdcard --tests` carries the on-target test
bundle (guests/tests/on-target.toml): a test guest making bad accesses
(wild), one keeping a checksummed pattern (beta) and a Debian Linux
(linux), 576 MiB in all. Once they have started, the hypervisor checks
itself on this board before the prompt appears, each check within its own
deadline (the Linux ones wait up to 2 minutes for Linux to boot), one line
each:

  ON-TARGET: on-target checks start (8 of them; each has a deadline)
  ON-TARGET: ok cpus: 4 of 4 CPUs the device tree lists are online
  ON-TARGET: ok memory: accounting = RAM (<bytes> bytes); check: ok (...)
  ON-TARGET: ok isolation: wild: 7 bad accesses refused with an abort, ...
  ON-TARGET: ok balloon: beta: target 8192 pages reached in <ms> ms, ...
  ON-TARGET: ok linux-balloon: linux: target 16384 pages reached in ...
  ON-TARGET: ok linux-reporting: pages reported grew from 0 to <pages>
  ON-TARGET: ok linux-hint: linux: run 2 done: <pages> pages hinted ...
  ON-TARGET: ok final-check: accounting = RAM (<bytes> bytes); check: ok (...)
  ON-TARGET: 8 passed, 0 failed

with the guests' own lines in between. The last line is always
`ON-TARGET: N passed, M failed`; a check that failed says why on its
`ON-TARGET: FAILED <name>: ...` line, and one that could not run on this
board (the Linux checks, when its RAM is too small for the bundle) says so
on an `ON-TARGET: skipped <name>: ...` line and counts as neither. Then the
shell's prompt comes up as usual. Keep the serial log: it is the result.

When nothing appears
--------------------
Nothing on the UART comes from the firmware itself: if the hypervisor does
not start, the green ACT LED tells why. It blinks a number of long flashes,
then a number of short ones, and repeats after a pause. Some of the codes
(long, short), as listed for the Pi 4's bootloader and firmware in
https://singleboard.org/raspberrypi/raspberry_pi_act_led_error_patterns
(\"LED warning flash codes\", after the Raspberry Pi forum's boot-problems
sticky):

  0 long, 3 short   generic failure to boot
  0 long, 4 short   start*.elf not found (on a Pi 4 it also blinks so with no
                    card at all, as a forum moderator notes in
                    https://www.raspberrypi.org/forums/viewtopic.php?f=28&p=1692842)
  0 long, 7 short   kernel image not found (kernel= in config.txt names a
                    file that is not there)
  0 long, 8 short   SDRAM failure
  2 long, 1 short   partition not FAT
  2 long, 2 short   failed to read from the partition
  4 long, 4 short   unsupported board type
  4 long, 5 short   fatal firmware error

A wrong config.txt reports nothing of its own: a kernel= naming a file that
is not on the card gives the 0 long, 7 short code above; without
arm_64bit=1 the firmware starts the image in 32-bit state, which this
AArch64 image cannot run, and the UART stays silent; without enable_uart=1
the console may show nothing or garbage.
"
    )
}

/// What [`make`] writes.
#[derive(Debug, Clone)]
pub struct Card {
    /// The folder for the boot partition's files.
    pub dir: PathBuf,
    /// The hypervisor's raw image.
    pub hypervisor: PathBuf,
    /// The guest bundle.
    pub bundle: PathBuf,
    /// Also write an SD card image here.
    pub image: Option<PathBuf>,
}

/// `cargo xtask sdcard [-o DIR] [--image FILE] [--bundle FILE]`.
pub fn run(args: &[String]) -> Result<(), String> {
    const USAGE: &str =
        "usage: cargo xtask sdcard [-o DIR] [--image FILE] [--bundle FILE | --config CONFIG.toml | --tests]";
    let mut dir = None;
    let mut image = None;
    let mut bundle = None;
    let mut config = None;
    let mut tests = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().map(PathBuf::from).ok_or(USAGE.to_string());
        match arg.as_str() {
            "-o" => dir = Some(value()?),
            "--image" => image = Some(value()?),
            "--bundle" => bundle = Some(value()?),
            "--config" => config = Some(value()?),
            "--tests" => tests = true,
            other => return Err(format!("unknown option '{other}'; {USAGE}")),
        }
    }
    let chosen = [bundle.is_some(), config.is_some(), tests];
    if chosen.iter().filter(|&&c| c).count() > 1 {
        return Err(format!(
            "--bundle, --config and --tests exclude each other; {USAGE}"
        ));
    }
    crate::setup::run()?;
    let root = crate::root();
    // A configuration of one's own builds only what its VMs use.
    let (hypervisor, bundle) = match config {
        Some(config) => {
            let (artifacts, _) = crate::build_hypervisor(&root)?;
            let bundle = crate::userconfig::bundle_for_config(&root, &config)?;
            (artifacts.image, bundle)
        }
        None => {
            let artifacts = crate::build(&root)?;
            let bundle = match bundle {
                Some(b) => b,
                // `build` writes every guests/tests/<name>.toml's bundle.
                None if tests => tests_bundle(&root),
                None => artifacts.bundle,
            };
            (artifacts.image, bundle)
        }
    };
    let card = Card {
        dir: dir.unwrap_or_else(|| root.join("target").join("sdcard")),
        hypervisor,
        bundle,
        image,
    };
    make(&root, &card)
}

/// Write `card`'s folder (and image), fetching the firmware and the device
/// trees on first use.
/// The on-target test bundle `cargo xtask build` writes.
pub fn tests_bundle(root: &Path) -> PathBuf {
    root.join("target")
        .join("bundles")
        .join(format!("{TESTS_BUNDLE}.img"))
}

pub fn make(root: &Path, card: &Card) -> Result<(), String> {
    if !card.bundle.is_file() {
        return Err(format!("no guest bundle {}", card.bundle.display()));
    }
    let firmware = fixtures::raspi_firmware(root)?.join("usr/lib/raspi-firmware");
    fs::create_dir_all(&card.dir).map_err(|e| format!("{}: {e}", card.dir.display()))?;
    let mut written = Vec::new();
    for (name, source) in files() {
        let to = card.dir.join(name);
        let from = match &source {
            Source::Firmware(f) => firmware.join(f),
            Source::Dtb(d) => fixtures::broadcom_dtb(root, d)?,
            Source::Hypervisor => card.hypervisor.clone(),
            Source::Bundle => card.bundle.clone(),
            Source::Text(text) => {
                fs::write(&to, text).map_err(|e| format!("{}: {e}", to.display()))?;
                written.push(to);
                continue;
            }
        };
        fs::copy(&from, &to).map_err(|e| format!("copying {}: {e}", from.display()))?;
        written.push(to);
    }
    let names: Vec<&str> = files().iter().map(|(n, _)| *n).collect();
    let others: Vec<String> = fs::read_dir(&card.dir)
        .map_err(|e| format!("{}: {e}", card.dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !names.contains(&n.as_str()))
        .collect();
    println!(
        "xtask: the SD card's boot partition is in {} ({} files; firmware {})",
        card.dir.display(),
        written.len(),
        fixtures::raspi_firmware_deb(root).unwrap_or_else(|| "?".into())
    );
    if !others.is_empty() {
        println!(
            "xtask: {} also holds {}, which is not part of the card",
            card.dir.display(),
            others.join(", ")
        );
    }
    if let Some(image) = &card.image {
        write_image(image, &written)?;
        println!(
            "xtask: SD card image {} (MBR, one FAT32 partition): dd it to the whole card",
            image.display()
        );
    }
    Ok(())
}

/// The partition's size in bytes for `content` bytes of files: the files,
/// a quarter more and 16 MiB for the file system, at least 64 MiB (FAT32
/// needs 65525 clusters), in whole MiB.
pub fn partition_bytes(content: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let want = (content + content / 4 + 16 * MIB).max(64 * MIB);
    want.div_ceil(MIB) * MIB
}

/// A master boot record with one FAT32 (LBA) partition of `sectors`
/// 512-byte sectors at `start` (in sectors), marked bootable.
pub fn mbr(start: u32, sectors: u32) -> [u8; 512] {
    let mut m = [0u8; 512];
    // A disk signature, so tools that key partitions on it have one.
    m[440..444].copy_from_slice(&0x7469_6461u32.to_le_bytes());
    let e = &mut m[446..462];
    e[0] = 0x80;
    // CHS fields unused (LBA): the conventional "beyond CHS" values.
    e[1..4].copy_from_slice(&[0xfe, 0xff, 0xff]);
    e[4] = 0x0c; // FAT32 with LBA addressing
    e[5..8].copy_from_slice(&[0xfe, 0xff, 0xff]);
    e[8..12].copy_from_slice(&start.to_le_bytes());
    e[12..16].copy_from_slice(&sectors.to_le_bytes());
    m[510] = 0x55;
    m[511] = 0xaa;
    m
}

/// `IMAGE@@OFFSET`: how mtools addresses the partition inside the image.
pub fn mtools_target(image: &Path) -> String {
    format!("{}@@{}", image.display(), PARTITION_LBA * SECTOR)
}

/// Write `image`: an MBR, then a FAT32 partition at 1 MiB holding `files`
/// (in its root directory, under their own names).
pub fn write_image(image: &Path, files: &[PathBuf]) -> Result<(), String> {
    let mut content = 0;
    for f in files {
        content += fs::metadata(f)
            .map_err(|e| format!("{}: {e}", f.display()))?
            .len();
    }
    let part = partition_bytes(content);
    let sectors = u32::try_from(part / SECTOR).map_err(|_| "the image is over 2 TiB")?;
    let tmp = image.with_extension("img.part");
    let _ = fs::remove_file(&tmp);
    {
        let file = fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        file.set_len(PARTITION_LBA * SECTOR + part)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        use std::io::Write;
        (&file)
            .write_all(&mbr(PARTITION_LBA as u32, sectors))
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
    }
    // mkfs.fat is in /usr/sbin, which a user's PATH may not have.
    let mkfs = ["/usr/sbin/mkfs.fat", "/sbin/mkfs.fat"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap_or("mkfs.fat");
    crate::run_cmd(
        Command::new(mkfs)
            .args(["-F", "32", "-n", "TIDALBOOT", "--offset"])
            .arg(PARTITION_LBA.to_string())
            .arg(&tmp)
            .arg((part / 1024).to_string())
            .stdout(std::process::Stdio::null()),
    )?;
    crate::run_cmd(
        Command::new("mcopy")
            .env("MTOOLS_SKIP_CHECK", "1")
            .arg("-i")
            .arg(mtools_target(&tmp))
            .args(files)
            .arg("::/"),
    )?;
    fs::rename(&tmp, image).map_err(|e| format!("{}: {e}", image.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_excludes_the_other_bundle_choices() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        for other in [["--bundle", "x.img"], ["--config", "x.toml"]] {
            let mut a = args(&["--tests"]);
            a.extend(args(&other));
            let e = run(&a).unwrap_err();
            assert!(
                e.starts_with("--bundle, --config and --tests exclude each other"),
                "{e}"
            );
        }
        assert!(tests_bundle(Path::new("/ws")).ends_with("target/bundles/on-target.img"));
    }

    #[test]
    fn the_card_has_every_file_the_pi_4_boots_from() {
        let names: Vec<&str> = files().iter().map(|(n, _)| *n).collect();
        for want in [
            "start4.elf",
            "fixup4.dat",
            "bcm2711-rpi-4-b.dtb",
            "bcm2711-rpi-400.dtb",
            "bcm2711-rpi-cm4-io.dtb",
            "kernel8.img",
            "guests.img",
            "config.txt",
            "README.txt",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "a name twice: {names:?}");
        // FAT names are case-insensitive: no two may differ only in case.
        let mut lower: Vec<String> = names.iter().map(|n| n.to_lowercase()).collect();
        lower.sort();
        lower.dedup();
        assert_eq!(lower.len(), names.len());
    }

    /// The settings of config.txt, comments and section headers left out.
    fn settings() -> Vec<String> {
        config_txt()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn config_txt_boots_the_hypervisor_with_the_bundle_and_the_uart() {
        let settings = settings();
        assert_eq!(
            settings,
            [
                "arm_64bit=1",
                "kernel=kernel8.img",
                "initramfs guests.img followkernel",
                "enable_uart=1",
                "enable_gic=1",
            ],
            "{}",
            config_txt()
        );
        // Every file config.txt names is on the card.
        let names: Vec<&str> = files().iter().map(|(n, _)| *n).collect();
        assert!(names.contains(&KERNEL) && names.contains(&BUNDLE));
        // The RAM note covers every board size and how to limit it.
        let text = config_txt();
        for size in ["1, 2, 4 or 8 GiB", "#total_mem="] {
            assert!(text.contains(size), "{size} not in config.txt");
        }
    }

    #[test]
    fn readme_txt_says_how_to_flash_wire_and_what_to_expect() {
        let text = readme_txt();
        for want in [
            // The on-target card and what its serial log shows.
            "cargo xtask sdcard --tests",
            "ON-TARGET: 8 passed, 0 failed",
            "ON-TARGET: FAILED <name>",
            // Flashing and wiring.
            "dd if=",
            "FAT32",
            "GPIO 14",
            "GPIO 15",
            "GND",
            "115200",
            "8N1",
            "3.3 V",
            "tidal>",
            // The firmware's own failures.
            "start*.elf not found",
            "kernel image not found",
            // The banner's fixed lines, as hypervisor/src/boot.rs prints them.
            "Tidal hypervisor v",
            "CPUs online: 4 of 4",
            "Type 'help' for",
        ] {
            assert!(text.contains(want), "{want:?} not in README.txt:\n{text}");
        }
    }

    #[test]
    fn mbr_has_one_bootable_fat32_partition() {
        let m = mbr(2048, 131072);
        assert_eq!(&m[510..], &[0x55, 0xaa]);
        assert_eq!(m[446], 0x80);
        assert_eq!(m[450], 0x0c);
        assert_eq!(u32::from_le_bytes(m[454..458].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(m[458..462].try_into().unwrap()), 131072);
        // The other three entries are empty.
        assert!(m[462..510].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_partition_fits_fat32_and_the_files() {
        assert_eq!(partition_bytes(0), 64 << 20);
        assert_eq!(partition_bytes(40 << 20), 66 << 20);
        let big = partition_bytes(100 << 20);
        assert!(big >= (125 << 20) + (16 << 20) && big.is_multiple_of(1 << 20));
    }

    /// Builds an image of a few files with mkfs.fat and mcopy, then reads
    /// its directory and a file back with mtools (installed by `cargo xtask
    /// setup`).
    #[test]
    fn the_image_holds_the_files() {
        let dir = std::env::temp_dir().join(format!("tidal-sdcard-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let mut paths = Vec::new();
        for (name, bytes) in [
            ("config.txt", config_txt().into_bytes()),
            ("kernel8.img", vec![0xa5; 100_000]),
            ("bcm2711-rpi-4-b.dtb", vec![1, 2, 3]),
        ] {
            let p = dir.join(name);
            fs::write(&p, bytes).unwrap();
            paths.push(p);
        }
        let image = dir.join("card.img");
        write_image(&image, &paths).expect("mkfs.fat and mtools: run `cargo xtask setup`");
        let bytes = fs::read(&image).unwrap();
        assert_eq!(&bytes[510..512], &[0x55, 0xaa]);
        // The FAT32 boot sector of the partition.
        let boot = &bytes[1 << 20..(1 << 20) + 512];
        assert_eq!(&boot[82..90], b"FAT32   ");
        let mdir = Command::new("mdir")
            .env("MTOOLS_SKIP_CHECK", "1")
            .args(["-b", "-i"])
            .arg(mtools_target(&image))
            .arg("::/")
            .output()
            .unwrap();
        assert!(mdir.status.success(), "{mdir:?}");
        let listing = String::from_utf8_lossy(&mdir.stdout);
        for name in ["config.txt", "kernel8.img", "bcm2711-rpi-4-b.dtb"] {
            assert!(
                listing.lines().any(|l| l.trim() == format!("::/{name}")),
                "{name} not in:\n{listing}"
            );
        }
        let mtype = Command::new("mtype")
            .env("MTOOLS_SKIP_CHECK", "1")
            .arg("-i")
            .arg(mtools_target(&image))
            .arg("::/config.txt")
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&mtype.stdout), config_txt());
        fs::remove_dir_all(&dir).unwrap();
    }
}
