//! `cargo xtask`: installs what is missing, builds the hypervisor image and
//! the guest bundle, runs them in QEMU, and runs every test.
//!
//! Commands: `setup`, `build`, `bundle CONFIG -o FILE`, `run [--board B]
//! [--bundle NAME | --config CONFIG]`, `trace [--board B] [--bundle NAME]`,
//! `sdcard [-o DIR] [--image FILE] [--bundle FILE | --config CONFIG | --tests]`, `test`, `bench`, `fuzz`.
//! Every command starts with `setup`, which is quick
//! when everything is present.

mod bench;
mod fixtures;
mod fuzz;
mod json;
mod linux;
mod progress;
mod sdcard;
mod setup;
pub mod userconfig;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use harness::{Artifacts, Board, NetLink, QemuOptions};

const TARGET: &str = "aarch64-unknown-none";

/// Seconds each fuzz target runs in `cargo xtask test`: a check that every
/// target builds, runs its seeds and finds nothing shallow (the manager's
/// overflows fell within 0.2 s), not a search; that is `fuzz --long`. Three
/// seconds for 19 targets is 57 s.
const FUZZ_SECONDS: u64 = 3;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("setup") => setup::run(),
        Some("build") => setup::run().and_then(|_| {
            let root = root();
            build(&root)?;
            build_trace(&root).map(|_| ())
        }),
        Some("bundle") => bundle(&args[1..]),
        Some("run") => run(&args[1..]),
        Some("trace") => trace(&args[1..]),
        Some("test") => test(&args[1..]),
        Some("sdcard") => sdcard::run(&args[1..]),
        Some("fuzz") => setup::run().and_then(|_| fuzz::run(&root(), &args[1..])),
        Some("bench") => setup::run().and_then(|_| {
            let root = root();
            match args.get(1).map(String::as_str) {
                None => bench::run(&root, &build(&root)?),
                Some("bare-metal") => bench::bare_metal(&root, &build(&root)?),
                Some("linux") => bench::linux(&root, &build(&root)?),
                Some("features") => bench::features(&root, &build(&root)?),
                Some("snapshot") => bench::snapshot(&root, &build(&root)?),
                Some("policy") => {
                    let rounds = bench::policy_rounds(&args[2..])?;
                    bench::policy(&root, &build(&root)?, rounds)
                }
                Some(other) => Err(format!(
                    "unknown bench '{other}'; `cargo xtask bench` runs the balloon benches, `cargo xtask bench bare-metal` the -icount part only, `cargo xtask bench linux` the Linux comparison only, `cargo xtask bench features` the balloon features only, `cargo xtask bench policy` the memory manager under overcommit, `cargo xtask bench snapshot` a Linux guest's snapshot and restore against QEMU's save"
                )),
            }
        }),
        Some("help") | Some("--help") | Some("-h") | None => {
            print_help();
            Ok(())
        }
        Some(other) => Err(format!("unknown command '{other}'; try `cargo xtask help`")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_help() {
    println!(
        "cargo xtask <command>

  setup              install what is missing (Rust target and components, QEMU, dtc, cpio,
                     mtools, dosfstools)
  build              build the hypervisor image and the guest bundle, and the trace
                     build (below) in target/trace-build
  bundle CONFIG -o FILE
                     the guest bundle of the VM configuration file CONFIG (anywhere on
                     disk; format: docs/CONFIGURATION.md), written to FILE; builds or
                     fetches only what its VMs use (the test guest, the Linux fixture,
                     the initramfs for a kernel of your own)
  run [--board B] [--bundle NAME | --config CONFIG] [--disk FILE] [--net LINK]
      [--address A.B.C.D/N]
                     build, then boot in QEMU with the console on this terminal
                     (B: virt-gicv2 (default), virt-gicv3, raspi4b; Ctrl-A X quits QEMU);
                     the guests: guests/demo.toml, or NAME, a bundle of target/bundles
                     (guests/tests/NAME.toml), or the bundle of the file CONFIG;
                     --disk FILE: the board's disk (default target/board-disk.img);
                     --net listen:PORT | connect:[HOST:]PORT: the board's network card,
                     joined to another board's by TCP (start the listening one first);
                     --address A.B.C.D/N: the board's address instead of the bundle's
                     ([board] address), on a copy of the bundle
  trace [--board B] [--bundle NAME]
                     as run, with the trace build: the hot paths' trace events too
                     (exits, MMIO, balloon batches, faults, TLB flushes); B: virt-gicv2
                     (default) or virt-gicv3; NAME: a bundle of target/bundles (default:
                     the demo bundle); at exit the trace is decoded to
                     target/trace-<board>.log
  sdcard [-o DIR] [--image FILE] [--bundle FILE | --config CONFIG.toml | --tests]
                     build, then write the Raspberry Pi 4 SD card's boot partition to DIR
                     (default target/sdcard): the Pi firmware (start4.elf, fixup4.dat), the
                     BCM2711 device trees, the hypervisor as kernel8.img, the guest bundle
                     (default target/guests.img) as guests.img, a commented config.txt and
                     a README.txt (flashing, serial wiring, what to expect); --image FILE:
                     also an SD card image (MBR, one FAT32 partition) to dd to the card;
                     --config: the guests of your own VM configuration (docs/CONFIGURATION.md);
                     --tests: the on-target test bundle (guests/tests/on-target.toml): the
                     hypervisor checks itself on the board and prints 'ON-TARGET: ...'
                     lines, the last 'ON-TARGET: N passed, M failed' (README.txt)
  test               run every test, host and QEMU; ends with 'N passed, M failed'
  bench              balloon benchmarks: a bare-metal guest under QEMU -icount (table, and
                     target/bench/balloon.json), then Linux under Tidal vs. directly under
                     QEMU, side by side (table, and target/bench/linux.json), then the
                     balloon features with Linux: page faults with free page reporting off
                     and on (under Tidal and, for reference, directly under QEMU with its own
                     device), free to back in the pool, a hinting run (target/bench/features.json)
  bench bare-metal   only the first part: the bare-metal guest under QEMU -icount
  bench linux        only the Linux comparison (Tidal vs. QEMU, free page reporting off and
                     on), with Tidal's exit profile of the boot and of 10 s idle, by kind
                     (in target/bench/linux.json too)
  bench features     only the balloon features with Linux (the last part of `bench`)
  bench policy [--rounds N]
                     the memory manager under overcommit (not part of `bench`): three 1 GiB
                     Linux VMs with page cache and a test guest on 2 GiB, a 700 MiB hog moving
                     between them; the same under no controller (reporting and hinting alone),
                     the naive controller, and static 600 MiB partitions; N rounds each
                     (default 3); per phase the time until the demand is met, pages moved,
                     vCPU waits over 100 ms, OOM kills (target/bench/policy.json, with the
                     median and spread), and a plot per run (target/bench/policy-*.svg)
  bench snapshot     a Linux guest's snapshot (not part of `bench`): 1 GiB, 768 MiB of random
                     data written to a tmpfs and removed; under Tidal (free page reporting off,
                     and the demo's balloon features) `snapshot --no-hint` and `snapshot` with
                     hinting, then `restore` timed to the agent's answer against a boot; beside
                     QEMU's own save (`stop`, `migrate file:`); 3 rounds; bytes written, time,
                     pause, pages by kind, and the goals' ratios (target/bench/snapshot.json)
  fuzz [TARGET...] [--time S | --runs N | --long]
                     build and run the fuzz targets (default: all, 60 s each; --long: 10
                     million executions each); per target executions, exec/s, coverage;
                     target/fuzz/report.json with the commit fuzzed; crashes saved under
                     target/fuzz/crashes/TARGET, and the command fails naming them
  fuzz --table       write docs/TRUST.md's long-run table from target/fuzz/report.json"
    );
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Run a command, failing with its command line if it fails.
pub fn run_cmd(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed ({status})"))
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn build_id(root: &Path) -> String {
    Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `cargo build --release` for the target, with the build id and the
/// defmt log filter `defmt_log`; the packages are the caller's to add.
fn cargo_build_target(root: &Path, defmt_log: &str) -> Command {
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--target", TARGET])
        .env("TIDAL_BUILD_ID", build_id(root))
        .env("DEFMT_LOG", defmt_log)
        .current_dir(root);
    cmd
}

/// Build the image (ELF and raw Image) and the guest bundle.
fn build(root: &Path) -> Result<Artifacts, String> {
    let (mut artifacts, testguest) = build_hypervisor(root)?;
    // The Linux guest fixture: Debian's arm64 kernel and a busybox initramfs
    // (target/fixtures/linux/), for the configurations that name them.
    build_memtool(root)?;
    linux::build_initramfs(root, &linux::memtool_path(root))?;
    // The Pi 4 tree QEMU raspi4b boots with (the harness's default).
    fixtures::pi4_qemu_dtb(root)?;
    // guests/demo.toml -> target/guests.img, guests/tests/<name>.toml ->
    // target/bundles/<name>.img (see guests/README.md).
    vmconfig::build_all(root, &testguest)?;
    artifacts.bundle = root.join("target").join("guests.img");
    Ok(artifacts)
}

/// The hypervisor (ELF and raw Image) and the test guest (raw image, the
/// second value), in one cargo run; the bundle is left as `Artifacts`
/// finds it.
fn build_hypervisor(root: &Path) -> Result<(Artifacts, PathBuf), String> {
    run_cmd(cargo_build_target(root, "debug").args(["-p", "hypervisor", "-p", "testguest"]))?;
    let out = root.join("target").join(TARGET).join("release");
    let elf = out.join("hypervisor");
    let image = out.join("hypervisor.bin");
    let testguest = out.join("testguest.bin");
    for (from, to) in [(&elf, &image), (&out.join("testguest"), &testguest)] {
        raw_image(from, to)?;
    }
    let mut artifacts = Artifacts::locate();
    artifacts.image = image;
    artifacts.elf = elf;
    Ok((artifacts, testguest))
}

/// The bare-metal test guest alone (`kernel = "testguest"`), as a raw
/// image; returns its path.
pub fn build_testguest(root: &Path) -> Result<PathBuf, String> {
    run_cmd(cargo_build_target(root, "debug").args(["-p", "testguest"]))?;
    let out = root.join("target").join(TARGET).join("release");
    let testguest = out.join("testguest.bin");
    raw_image(&out.join("testguest"), &testguest)?;
    Ok(testguest)
}

/// `tidal-mem`, the Linux guests' static tool ([`linux::memtool_path`]).
pub fn build_memtool(root: &Path) -> Result<(), String> {
    run_cmd(
        cargo()
            .args(["build", "--release", "-p", "tidal-memtool", "--target"])
            .arg(linux::TOOLS_TARGET)
            .current_dir(root),
    )
}

/// `cargo xtask bundle CONFIG -o FILE`.
fn bundle(args: &[String]) -> Result<(), String> {
    const USAGE: &str = "usage: cargo xtask bundle CONFIG.toml -o FILE";
    let (mut config, mut out) = (None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-o" | "--output" => out = Some(PathBuf::from(it.next().ok_or(USAGE)?)),
            other if other.starts_with('-') => {
                return Err(format!("unknown option '{other}'; {USAGE}"))
            }
            path if config.is_none() => config = Some(PathBuf::from(path)),
            extra => {
                return Err(format!(
                    "one configuration file at a time ('{extra}'); {USAGE}"
                ))
            }
        }
    }
    let (Some(config), Some(out)) = (config, out) else {
        return Err(USAGE.into());
    };
    setup::run()?;
    userconfig::write_bundle_for_config(&root(), &config, &out)
}

/// `objcopy -O binary` of the ELF `from` to `to`, checked to be an Image.
fn raw_image(from: &Path, to: &Path) -> Result<(), String> {
    let objcopy = setup::llvm_tool("llvm-objcopy")?;
    run_cmd(
        Command::new(&objcopy)
            .args(["-O", "binary"])
            .arg(from)
            .arg(to),
    )?;
    check_image_header(to)
}

/// The trace build of the hypervisor (raw Image, ELF): the `trace` feature
/// with `DEFMT_LOG=trace`, in its own target directory so that neither
/// build makes the other rebuild (`harness::trace_build` says where).
fn build_trace(root: &Path) -> Result<(PathBuf, PathBuf), String> {
    let (image, elf) = harness::trace_build(root);
    run_cmd(
        cargo_build_target(root, "trace")
            .args(["-p", "hypervisor", "--features", "hypervisor/trace"])
            .arg("--target-dir")
            .arg(root.join(harness::TRACE_BUILD_DIR)),
    )?;
    raw_image(&elf, &image)?;
    Ok((image, elf))
}

/// The Image header must be at offset 0 (see linker/hypervisor.ld).
fn check_image_header(image: &Path) -> Result<(), String> {
    let bytes = std::fs::read(image).map_err(|e| format!("reading {}: {e}", image.display()))?;
    if bytes.len() < 64 || &bytes[56..60] != b"ARM\x64" {
        return Err(format!(
            "{} has no arm64 Image header at offset 0",
            image.display()
        ));
    }
    Ok(())
}

fn run(args: &[String]) -> Result<(), String> {
    const USAGE: &str = "usage: cargo xtask run [--board virt-gicv2|virt-gicv3|raspi4b] [--bundle NAME | --config CONFIG.toml] [--disk FILE] [--net listen:PORT|connect:[HOST:]PORT] [--address A.B.C.D/N]";
    let mut board = Board::VirtGicv2;
    let mut bundle = None;
    let mut config = None;
    let mut disk = None;
    let mut net: Option<NetLink> = None;
    let mut address = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--board" => {
                let name = it
                    .next()
                    .ok_or("--board needs a name: virt-gicv2, virt-gicv3 or raspi4b")?;
                board = name.parse()?;
            }
            "--bundle" => bundle = Some(it.next().ok_or(USAGE)?.clone()),
            "--config" => config = Some(PathBuf::from(it.next().ok_or(USAGE)?)),
            "--disk" => disk = Some(PathBuf::from(it.next().ok_or(USAGE)?)),
            "--net" => net = Some(it.next().ok_or(USAGE)?.parse()?),
            "--address" => {
                let text = it.next().ok_or(USAGE)?;
                guest_bundle::BoardAddress::parse(text)
                    .map_err(|e| format!("--address {text}: {e}"))?;
                address = Some(text.clone());
            }
            other => return Err(format!("unknown option '{other}'; {USAGE}")),
        }
    }
    if bundle.is_some() && config.is_some() {
        return Err(format!("--bundle and --config exclude each other; {USAGE}"));
    }
    if net.is_some() && board == Board::Raspi4b {
        return Err(format!(
            "--net is for the virt boards (QEMU raspi4b has no virtio-mmio); {USAGE}"
        ));
    }
    setup::run()?;
    let root = root();
    let mut artifacts = match &config {
        // Only what the file's VMs use: no Linux fixture for bare-metal guests.
        Some(config) => {
            let (mut artifacts, _) = build_hypervisor(&root)?;
            artifacts.bundle = userconfig::bundle_for_config(&root, config)?;
            artifacts
        }
        None => build(&root)?,
    };
    if let Some(name) = bundle {
        artifacts.bundle = test_bundle(&root, &name)?;
    }
    if board == Board::Raspi4b {
        artifacts.pi4_dtb = fixtures::pi4_qemu_dtb(&root)?;
    }
    // Another address than the bundle's: a copy with it (the header
    // only), so that two boards run one configuration.
    if let Some(address) = &address {
        let copy = root
            .join("target")
            .join(format!("guests-{}.img", address.replace(['.', '/'], "-")));
        harness::bundle_with_address(&artifacts.bundle, address, &copy)?;
        artifacts.bundle = copy;
    }
    // The board's disk (virt): the named file, else target/board-disk.img;
    // with --net, one per side (two QEMUs cannot share an image).
    let disk = match board {
        Board::Raspi4b => None,
        _ => Some(board_disk(&root, disk, net.as_ref())?),
    };
    boot_interactive(&root, board, &artifacts, disk, net)
}

/// Size of the board disk made on first use: sparse, so it takes only
/// what snapshots write.
const BOARD_DISK_BYTES: u64 = 8 << 30;

/// The board disk: `named`, or `target/board-disk.img`, made (sparse,
/// [`BOARD_DISK_BYTES`]) if it does not exist. A named file must exist.
fn board_disk(
    root: &Path,
    named: Option<PathBuf>,
    net: Option<&NetLink>,
) -> Result<PathBuf, String> {
    if let Some(path) = named {
        return match path.is_file() {
            true => Ok(path),
            false => Err(format!(
                "--disk {}: no such file; make one with `truncate -s 8G {}`",
                path.display(),
                path.display()
            )),
        };
    }
    let file = match net {
        None => "board-disk.img",
        Some(NetLink::Listen(_)) => "board-disk-listen.img",
        Some(NetLink::Connect(..)) => "board-disk-connect.img",
    };
    let path = root.join("target").join(file);
    if !path.is_file() {
        let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        file.set_len(BOARD_DISK_BYTES)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!(
            "xtask: made the board disk {} ({} GiB, sparse)",
            path.display(),
            BOARD_DISK_BYTES >> 30
        );
    }
    Ok(path)
}

/// `target/bundles/<name>.img`, built from `guests/tests/<name>.toml`.
fn test_bundle(root: &Path, name: &str) -> Result<PathBuf, String> {
    let path = root
        .join("target")
        .join("bundles")
        .join(format!("{name}.img"));
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no bundle {}: the names are those of guests/tests/*.toml",
            path.display()
        ))
    }
}

/// `cargo xtask trace`: `run` with the trace build.
fn trace(args: &[String]) -> Result<(), String> {
    const USAGE: &str = "usage: cargo xtask trace [--board virt-gicv2|virt-gicv3] [--bundle NAME]";
    let mut board = Board::VirtGicv2;
    let mut bundle = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--board" => board = it.next().ok_or(USAGE)?.parse()?,
            "--bundle" => bundle = Some(it.next().ok_or(USAGE)?.clone()),
            other => return Err(format!("unknown option '{other}'; {USAGE}")),
        }
    }
    if board == Board::Raspi4b {
        return Err(format!(
            "the trace UART is captured on the virt boards only, as by `cargo xtask run`; {USAGE}"
        ));
    }
    setup::run()?;
    let root = root();
    let mut artifacts = build(&root)?;
    (artifacts.image, artifacts.elf) = build_trace(&root)?;
    if let Some(name) = bundle {
        artifacts.bundle = test_bundle(&root, &name)?;
    }
    let disk = board_disk(&root, None, None)?;
    boot_interactive(&root, board, &artifacts, Some(disk), None)
}

/// Boot `artifacts` on `board` with the console on this terminal; on virt
/// the trace UART goes to `target/trace-<board>.defmt`, decoded to
/// `target/trace-<board>.log` once QEMU exits.
fn boot_interactive(
    root: &Path,
    board: Board,
    artifacts: &Artifacts,
    disk: Option<PathBuf>,
    net: Option<NetLink>,
) -> Result<(), String> {
    // Two boards on a network run at once: a trace file each.
    let side = match &net {
        None => "",
        Some(NetLink::Listen(_)) => "-listen",
        Some(NetLink::Connect(..)) => "-connect",
    };
    let trace = root
        .join("target")
        .join(format!("trace-{}{side}.defmt", board.name()));
    let mut opts = QemuOptions::for_board(board, artifacts);
    opts.interactive = true;
    opts.disk = disk;
    opts.net = net;
    // As many CPUs as the highest CPU the bundle pins a vCPU to needs (the
    // virt boards): under TCG an emulated CPU nobody uses still costs the
    // others (its thread is woken for every broadcast TLB invalidation).
    if let (Some(_), Ok(bytes)) = (opts.smp, std::fs::read(&artifacts.bundle)) {
        let highest = guest_bundle::parse(&bytes)
            .ok()
            .and_then(|b| b.vms().map(|v| 63 - v.cpu_affinity().leading_zeros()).max());
        if let Some(highest) = highest {
            opts.smp = Some(highest + 1);
        }
    }
    if board != Board::Raspi4b {
        opts.trace = Some(trace.clone());
    }
    let mut cmd = harness::qemu_command(board, artifacts, &opts);
    eprintln!(
        "xtask: {}",
        harness::qemu_command_line(board, artifacts, &opts)
    );
    eprintln!("xtask: the console is this terminal; Ctrl-A X quits QEMU.");
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start QEMU: {e}"))?;
    if opts.trace.is_some() {
        decode_trace_file(&artifacts.elf, &trace);
    }
    if status.success() {
        Ok(())
    } else {
        Err(format!("QEMU exited with {status}"))
    }
}

/// Decode the binary trace QEMU wrote and put it beside it as text.
fn decode_trace_file(elf: &Path, trace: &Path) {
    let Ok(bytes) = std::fs::read(trace) else {
        return;
    };
    let text_path = trace.with_extension("log");
    match harness::decode_trace(elf, &bytes) {
        Ok(lines) => {
            let _ = std::fs::write(&text_path, lines.join("\n") + "\n");
            eprintln!(
                "xtask: trace ({} events) decoded to {}",
                lines.len(),
                text_path.display()
            );
        }
        Err(e) => eprintln!("xtask: cannot decode the trace in {}: {e}", trace.display()),
    }
}

/// Every test: formatting and lints, host unit tests, QEMU tests.
fn test(args: &[String]) -> Result<(), String> {
    if !args.is_empty() {
        return Err("usage: cargo xtask test".into());
    }
    setup::run()?;
    let root = root();
    let mut artifacts = build(&root)?;
    artifacts.pi4_dtb = fixtures::pi4_qemu_dtb(&root)?;
    let trace_build = build_trace(&root)?;
    let mut passed = 0u32;
    let mut failed = 0u32;
    let mut check = |name: &str, cmd: &mut Command| {
        eprintln!("xtask: check: {name}");
        match run_cmd(cmd.current_dir(&root)) {
            Ok(()) => passed += 1,
            Err(e) => {
                eprintln!("xtask: FAILED {name}: {e}");
                failed += 1;
            }
        }
    };
    check(
        "cargo fmt --check",
        cargo().args(["fmt", "--all", "--", "--check"]),
    );
    check(
        "clippy (host)",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    );
    check(
        "clippy (aarch64-unknown-none)",
        cargo().args([
            "clippy",
            "--target",
            TARGET,
            "-p",
            "hypervisor",
            "-p",
            "platform",
            "-p",
            "guest-bundle",
            "-p",
            "guest-driver",
            "-p",
            "testguest",
            "--",
            "-D",
            "warnings",
        ]),
    );
    // Module docs name real items: a broken intra-doc link fails.
    check(
        "rustdoc (hypervisor, platform)",
        cargo()
            .args(["doc", "--no-deps", "-p", "hypervisor", "-p", "platform"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    );
    check(
        "clippy (aarch64-unknown-linux-musl)",
        cargo()
            .args(["clippy", "-p", "tidal-memtool", "--target"])
            .arg(linux::TOOLS_TARGET)
            .args(["--", "-D", "warnings"]),
    );
    check(
        "clippy (fuzz targets)",
        cargo()
            .args(["clippy", "--all-targets", "--manifest-path"])
            .arg(root.join("fuzz").join("Cargo.toml"))
            .arg("--target-dir")
            .arg(root.join("target").join("fuzz").join("clippy"))
            .args(["--", "-D", "warnings"]),
    );
    // A short run of every fuzz target, each one check.
    match fuzz::build(&root, &fuzz::all_targets()) {
        Ok(bins) => {
            for (target, bin) in fuzz::TARGETS.iter().zip(&bins) {
                eprintln!("xtask: check: fuzz {target}");
                match fuzz::run_target(&root, target, bin, fuzz::Budget::Seconds(FUZZ_SECONDS)) {
                    Ok(o) if o.crash.is_none() => passed += 1,
                    Ok(o) => {
                        eprintln!(
                            "xtask: FAILED fuzz {target}: crash saved as {}",
                            o.crash.unwrap_or_default().display()
                        );
                        failed += 1;
                    }
                    Err(e) => {
                        eprintln!("xtask: FAILED fuzz {target}: {e}");
                        failed += 1;
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("xtask: FAILED building the fuzz targets: {e}");
            failed += fuzz::TARGETS.len() as u32;
        }
    }
    let (p, f) = cargo_test(&root, &artifacts, &trace_build)?;
    passed += p;
    failed += f;
    println!("{passed} passed, {failed} failed");
    if failed == 0 {
        Ok(())
    } else {
        Err(format!("{failed} test(s) failed"))
    }
}

/// `cargo test` over the workspace including the QEMU tests (marked
/// `#[ignore]` so a plain `cargo test` stays host-only), with the trace
/// build's (image, ELF) too; returns the counts summed from every "test
/// result:" line.
fn cargo_test(
    root: &Path,
    artifacts: &Artifacts,
    (trace_image, trace_elf): &(PathBuf, PathBuf),
) -> Result<(u32, u32), String> {
    let output = cargo()
        .args([
            "test",
            "--workspace",
            "--no-fail-fast",
            "--",
            "--include-ignored",
        ])
        .env("HV_IMAGE", &artifacts.image)
        .env("HV_ELF", &artifacts.elf)
        // The QEMU tests' default bundle is the pair of bare-metal test
        // guests; the tests that want Linux (or another) ask for it by name.
        .env(
            "HV_BUNDLE",
            root.join("target").join("bundles").join("pair.img"),
        )
        .env("HV_PI4_DTB", &artifacts.pi4_dtb)
        // The platform tests read the tree as Debian ships it (the board's
        // firmware fills its memory node), not the one QEMU boots with.
        .env("HV_PI4_FIRMWARE_DTB", fixtures::pi4_dtb(root)?)
        .env("HV_TRACE_IMAGE", trace_image)
        .env("HV_TRACE_ELF", trace_elf)
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    let (mut passed, mut failed, mut results) = (0, 0, 0);
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix("test result: ") else {
            continue;
        };
        results += 1;
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                match (n.parse::<u32>(), what) {
                    (Ok(n), "passed") => passed += n,
                    (Ok(n), "failed") => failed += n,
                    _ => {}
                }
            }
        }
    }
    if !output.status.success() && failed == 0 {
        // A test binary that did not build or crashed prints no result line.
        failed += 1;
        eprintln!("xtask: cargo test failed without a failing test: see above");
    }
    if results == 0 {
        return Err("cargo test printed no test results".into());
    }
    Ok((passed, failed))
}
