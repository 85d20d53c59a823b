//! Boards, build artifacts and QEMU command lines: the single source of truth
//! for how the hypervisor is started under QEMU (used by the tests and by
//! `cargo xtask run`/`test`).

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

/// The QEMU binary every board runs on.
pub const QEMU: &str = "qemu-system-aarch64";

/// A board the hypervisor is tested on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Board {
    /// `-M virt,virtualization=on,gic-version=2`
    VirtGicv2,
    /// `-M virt,virtualization=on,gic-version=3`
    VirtGicv3,
    /// `-M raspi4b` with the Raspberry Pi 4 device tree.
    Raspi4b,
}

impl Board {
    pub const ALL: [Board; 3] = [Board::VirtGicv2, Board::VirtGicv3, Board::Raspi4b];

    /// The name used on the command line and in log file names.
    pub fn name(self) -> &'static str {
        match self {
            Board::VirtGicv2 => "virt-gicv2",
            Board::VirtGicv3 => "virt-gicv3",
            Board::Raspi4b => "raspi4b",
        }
    }
}

impl fmt::Display for Board {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Board {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Board::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Board::ALL.iter().map(|b| b.name()).collect();
                format!("unknown board `{s}`; valid boards: {}", names.join(", "))
            })
    }
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` if set, else `<root>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// Where sessions write their console logs and tests their scratch files:
/// `<target>/test-logs/` (created on demand).
pub fn log_dir() -> PathBuf {
    let dir = target_dir().join("test-logs");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// A new sparse image of `mib` MiB under the test logs (`<name>.img`): a
/// board disk for a test.
pub fn disk_image(name: &str, mib: u64) -> PathBuf {
    let path = log_dir().join(format!("{name}.img"));
    let file = std::fs::File::create(&path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    file.set_len(mib << 20)
        .unwrap_or_else(|e| panic!("cannot size {}: {e}", path.display()));
    path
}

/// Where `cargo xtask` puts the trace build of the hypervisor (the `trace`
/// feature, `DEFMT_LOG=trace`), relative to the workspace root: a target
/// directory of its own.
pub const TRACE_BUILD_DIR: &str = "target/trace-build";

/// The trace build's raw Image and ELF under the workspace `root`.
pub fn trace_build(root: &Path) -> (PathBuf, PathBuf) {
    let release = root
        .join(TRACE_BUILD_DIR)
        .join("aarch64-unknown-none")
        .join("release");
    (release.join("hypervisor.bin"), release.join("hypervisor"))
}

/// `$var` taken relative to the workspace root, else `default`.
fn path_from_env(var: &str, default: PathBuf) -> PathBuf {
    match std::env::var_os(var) {
        Some(path) => workspace_root().join(path),
        None => default,
    }
}

/// The Raspberry Pi 4 device tree as QEMU raspi4b gets it, under
/// `<target>/fixtures/` (written by `cargo xtask build` from Debian's
/// `bcm2711-rpi-4-b.dtb`): with a node for the board's RAM above 1 GiB.
///
/// On the board the firmware fills `/memory` from the board revision,
/// with the RAM above 1 GiB. QEMU's raspi4b (2 GiB) instead drops every
/// root `/memory*` node and adds one for its boot RAM, 0-0x3c000000 (the
/// RAM below 1 GiB less the VideoCore's 64 MiB); its hook that should then
/// add a node for the RAM above 1 GiB compares that boot RAM, never over
/// 1 GiB, with 1 GiB, so it never does, and the rest of the 2 GiB stays
/// unlisted. The extra node, `/ram@40000000` (`device_type = "memory"`, a
/// name QEMU does not drop), lists 0x40000000-0x80000000.
pub const PI4_QEMU_DTB: &str = "bcm2711-rpi-4-b-qemu.dtb";

/// The files a QEMU run needs, as built by `cargo xtask`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifacts {
    /// Raw arm64 Image (`-kernel`).
    pub image: PathBuf,
    /// The image's ELF, linked at address 0: used to symbolize and decode traces.
    pub elf: PathBuf,
    /// The guest bundle (`-initrd`).
    pub bundle: PathBuf,
    /// The Raspberry Pi 4 device tree (`-dtb` on raspi4b), by default
    /// [`PI4_QEMU_DTB`].
    pub pi4_dtb: PathBuf,
}

impl Artifacts {
    /// Paths from `HV_IMAGE`, `HV_ELF`, `HV_BUNDLE` and `HV_PI4_DTB`, else the
    /// default build outputs under the target directory. Relative paths in
    /// the variables are taken relative to the workspace root. Nothing is
    /// checked here; [`crate::Session::start`] reports missing files.
    pub fn locate() -> Artifacts {
        let target = target_dir();
        let release = target.join("aarch64-unknown-none").join("release");
        Artifacts {
            image: path_from_env("HV_IMAGE", release.join("hypervisor.bin")),
            elf: path_from_env("HV_ELF", release.join("hypervisor")),
            bundle: path_from_env("HV_BUNDLE", target.join("guests.img")),
            pi4_dtb: path_from_env("HV_PI4_DTB", target.join("fixtures").join(PI4_QEMU_DTB)),
        }
    }

    /// [`Artifacts::locate`] with the trace build's image and ELF instead:
    /// `HV_TRACE_IMAGE` and `HV_TRACE_ELF`, else [`trace_build`]'s paths.
    pub fn locate_trace() -> Artifacts {
        let (image, elf) = trace_build(&workspace_root());
        Artifacts {
            image: path_from_env("HV_TRACE_IMAGE", image),
            elf: path_from_env("HV_TRACE_ELF", elf),
            ..Artifacts::locate()
        }
    }
}

/// How a board's network card reaches the other board's: the two QEMU
/// processes are joined by one TCP connection carrying Ethernet frames
/// (`-netdev stream`). The listening board starts first; the other
/// connects, and tries again every second until it can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetLink {
    /// Listen on this TCP port of 127.0.0.1.
    Listen(u16),
    /// Connect to the board listening on `host` (an IPv4 address or a
    /// name), this port.
    Connect(String, u16),
}

impl NetLink {
    /// The card's MAC address: QEMU's prefix (52:54:00), then one for
    /// each side, so that the two boards differ.
    pub fn mac(&self) -> &'static str {
        match self {
            NetLink::Listen(_) => "52:54:00:74:64:01",
            NetLink::Connect(..) => "52:54:00:74:64:02",
        }
    }

    /// The `-netdev` argument.
    fn netdev(&self) -> String {
        match self {
            NetLink::Listen(port) => format!(
                "stream,id=board-net,server=on,addr.type=inet,addr.host=127.0.0.1,addr.port={port}"
            ),
            NetLink::Connect(host, port) => format!(
                "stream,id=board-net,server=off,reconnect-ms=1000,addr.type=inet,addr.host={host},addr.port={port}"
            ),
        }
    }
}

impl FromStr for NetLink {
    type Err = String;

    /// `listen:PORT`, `connect:PORT` (127.0.0.1) or `connect:HOST:PORT`.
    fn from_str(s: &str) -> Result<Self, String> {
        const FORM: &str = "write listen:PORT, connect:PORT or connect:HOST:PORT";
        let port = |p: &str| {
            p.parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("'{p}' is not a TCP port (1 to 65535); {FORM}"))
        };
        let host_ok = |h: &str| {
            !h.is_empty()
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
        };
        match s.split(':').collect::<Vec<_>>().as_slice() {
            ["listen", p] => Ok(NetLink::Listen(port(p)?)),
            ["connect", p] => Ok(NetLink::Connect("127.0.0.1".into(), port(p)?)),
            ["connect", h, p] if host_ok(h) => Ok(NetLink::Connect(h.to_string(), port(p)?)),
            _ => Err(format!("'{s}' is not a network link; {FORM}")),
        }
    }
}

/// A copy of the bundle `from`, with the board address `address`
/// (`"10.0.0.1/24"`), at `to` (the header only changes:
/// `guest_bundle::set_board_address`).
pub fn bundle_with_address(from: &Path, address: &str, to: &Path) -> Result<(), String> {
    let address = guest_bundle::BoardAddress::parse(address)
        .map_err(|e| format!("board address \"{address}\": {e}"))?;
    let mut bytes = std::fs::read(from).map_err(|e| format!("{}: {e}", from.display()))?;
    guest_bundle::set_board_address(&mut bytes, Some(address))
        .map_err(|e| format!("{}: {e}", from.display()))?;
    std::fs::write(to, &bytes).map_err(|e| format!("{}: {e}", to.display()))
}

/// What varies between QEMU runs of one board. Start from
/// [`QemuOptions::for_board`]; every field is used verbatim by [`qemu_command`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuOptions {
    /// File that receives the second (trace) UART; `None`: no trace UART.
    pub trace: Option<PathBuf>,
    /// `-initrd`, normally the guest bundle; `None`: no `-initrd` at all.
    pub initrd: Option<PathBuf>,
    /// `-dtb`; `None`: QEMU's own tree (virt only; raspi4b has none).
    pub dtb: Option<PathBuf>,
    /// `-m`; `None`: no `-m` (raspi4b has a fixed 2 GiB).
    pub memory: Option<String>,
    /// `-smp`: how many CPUs; `None`: no `-smp` (raspi4b has a fixed 4).
    /// The hypervisor uses at most `platform::MAX_CPUS` (8).
    pub smp: Option<u32>,
    /// The board's disk (virt only): a raw image attached as a
    /// `virtio-blk-device` on one of the board's virtio-mmio slots, which
    /// the hypervisor drives itself (snapshots); `None`: no disk.
    pub disk: Option<PathBuf>,
    /// The board's network card (virt only): a `virtio-net-device` on
    /// another of the board's virtio-mmio slots, joined to one other board
    /// by a TCP stream (QEMU's `-netdev stream`), which the hypervisor
    /// drives itself (smoltcp); `None`: no card.
    pub net: Option<NetLink>,
    /// Appended to the command line as is.
    pub extra: Vec<String>,
    /// Console on `mon:stdio` (Ctrl-A X quits, Ctrl-A C is the monitor)
    /// instead of a plain `stdio` serial with no monitor.
    pub interactive: bool,
}

impl QemuOptions {
    /// The standard run of `board`: the guest bundle as initrd, 2 GiB and 4
    /// CPUs on virt, the Pi 4 tree on raspi4b, no trace UART, not interactive.
    pub fn for_board(board: Board, artifacts: &Artifacts) -> QemuOptions {
        let raspi = board == Board::Raspi4b;
        QemuOptions {
            trace: None,
            initrd: Some(artifacts.bundle.clone()),
            dtb: raspi.then(|| artifacts.pi4_dtb.clone()),
            memory: (!raspi).then(|| "2G".to_string()),
            smp: (!raspi).then_some(4),
            disk: None,
            net: None,
            extra: Vec::new(),
            interactive: false,
        }
    }
}

/// The QEMU arguments (without the program name) for one run.
pub fn qemu_args(board: Board, artifacts: &Artifacts, opts: &QemuOptions) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |a: &[&dyn AsRef<std::ffi::OsStr>]| {
        args.extend(a.iter().map(|s| s.as_ref().to_os_string()));
    };
    match board {
        Board::VirtGicv2 | Board::VirtGicv3 => {
            let gic = if board == Board::VirtGicv2 { 2 } else { 3 };
            let machine = format!("virt,virtualization=on,gic-version={gic}");
            push(&[&"-M", &machine, &"-cpu", &"cortex-a72"]);
        }
        Board::Raspi4b => push(&[&"-M", &"raspi4b"]),
    }
    if let Some(smp) = opts.smp {
        push(&[&"-smp", &smp.to_string()]);
    }
    if let Some(memory) = &opts.memory {
        push(&[&"-m", memory]);
    }
    push(&[&"-kernel", &artifacts.image]);
    if let Some(dtb) = &opts.dtb {
        push(&[&"-dtb", dtb]);
    }
    if let Some(initrd) = &opts.initrd {
        push(&[&"-initrd", initrd]);
    }
    // No default network card: on virt QEMU would add a virtio-net-pci
    // whose option ROM (efi-virtio.rom) comes from ipxe-qemu, a package
    // `cargo xtask setup` does not install (apt's --no-install-recommends).
    push(&[&"-nic", &"none", &"-no-reboot", &"-display", &"none"]);
    if let (Some(disk), false) = (&opts.disk, board == Board::Raspi4b) {
        let mut drive = OsString::from("if=none,format=raw,id=board-disk,file=");
        drive.push(disk);
        push(&[
            &"-drive",
            &drive,
            &"-device",
            &"virtio-blk-device,drive=board-disk",
        ]);
    }
    if let (Some(net), false) = (&opts.net, board == Board::Raspi4b) {
        let device = format!("virtio-net-device,netdev=board-net,mac={}", net.mac());
        push(&[&"-netdev", &net.netdev(), &"-device", &device]);
    }

    let console = if opts.interactive {
        "mon:stdio"
    } else {
        "stdio"
    };
    let trace = opts.trace.as_ref().map(|path| {
        let mut s = OsString::from("file:");
        s.push(path);
        s
    });
    // virt: serial0 (PL011 0x0900_0000) is the console, serial1 the trace UART.
    // raspi4b: serial0 is UART0 (PL011, trace), serial1 the mini UART console.
    if board == Board::Raspi4b {
        let uart0 = trace.unwrap_or_else(|| "null".into());
        push(&[&"-serial", &uart0, &"-serial", &console]);
        if !opts.interactive {
            push(&[&"-monitor", &"none"]);
        }
    } else {
        push(&[&"-serial", &console]);
        if !opts.interactive {
            push(&[&"-monitor", &"none"]);
        }
        if let Some(trace) = trace {
            push(&[&"-serial", &trace]);
        }
    }
    args.extend(opts.extra.iter().map(OsString::from));
    args
}

/// The QEMU command for one run; stdio is left for the caller to set.
pub fn qemu_command(board: Board, artifacts: &Artifacts, opts: &QemuOptions) -> Command {
    let mut cmd = Command::new(QEMU);
    cmd.args(qemu_args(board, artifacts, opts));
    cmd
}

/// [`qemu_command`] rendered for a shell (arguments quoted where needed).
pub fn qemu_command_line(board: Board, artifacts: &Artifacts, opts: &QemuOptions) -> String {
    std::iter::once(QEMU.to_string())
        .chain(
            qemu_args(board, artifacts, opts)
                .iter()
                .map(|a| shell_quote(&a.to_string_lossy())),
        )
        .collect::<Vec<_>>()
        .join(" ")
}

/// Any command rendered for a shell, as [`qemu_command_line`] does.
pub(crate) fn render_command(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| shell_quote(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_=,.:/+@%".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifacts() -> Artifacts {
        Artifacts {
            image: "IMAGE".into(),
            elf: "ELF".into(),
            bundle: "BUNDLE".into(),
            pi4_dtb: "PI4_DTB".into(),
        }
    }

    fn line(board: Board, tweak: impl FnOnce(&mut QemuOptions)) -> String {
        let mut opts = QemuOptions::for_board(board, &artifacts());
        tweak(&mut opts);
        qemu_command_line(board, &artifacts(), &opts)
    }

    const VIRT: &str = "qemu-system-aarch64 -M virt,virtualization=on,gic-version=2 \
        -cpu cortex-a72 -smp 4 -m 2G -kernel IMAGE -initrd BUNDLE -nic none -no-reboot -display none";

    #[test]
    fn board_names_round_trip() {
        for board in Board::ALL {
            assert_eq!(board.name().parse::<Board>(), Ok(board));
            assert_eq!(board.to_string(), board.name());
        }
        let err = "virt".parse::<Board>().unwrap_err();
        assert!(err.contains("virt-gicv2, virt-gicv3, raspi4b"), "{err}");
    }

    #[test]
    fn virt_command_lines() {
        assert_eq!(
            line(Board::VirtGicv2, |_| {}),
            format!("{VIRT} -serial stdio -monitor none")
        );
        assert_eq!(
            line(Board::VirtGicv3, |_| {}),
            format!("{VIRT} -serial stdio -monitor none").replace("gic-version=2", "gic-version=3")
        );
        assert_eq!(
            line(Board::VirtGicv2, |o| {
                o.interactive = true;
                o.trace = Some("out/trace.bin".into());
            }),
            format!("{VIRT} -serial mon:stdio -serial file:out/trace.bin")
        );
    }

    #[test]
    fn virt_options() {
        assert_eq!(
            line(Board::VirtGicv2, |o| {
                o.initrd = None;
                o.memory = Some("32M".into());
                o.smp = Some(8);
                o.dtb = Some("x.dtb".into());
                o.extra = vec!["-d".into(), "int guest".into()];
            }),
            "qemu-system-aarch64 -M virt,virtualization=on,gic-version=2 -cpu cortex-a72 \
             -smp 8 -m 32M -kernel IMAGE -dtb x.dtb -nic none -no-reboot -display none \
             -serial stdio -monitor none -d 'int guest'"
        );
    }

    #[test]
    fn net_links_parse_and_reach_the_command_line() {
        assert_eq!("listen:5555".parse(), Ok(NetLink::Listen(5555)));
        assert_eq!(
            "connect:5555".parse(),
            Ok(NetLink::Connect("127.0.0.1".into(), 5555))
        );
        assert_eq!(
            "connect:pi.local:7".parse(),
            Ok(NetLink::Connect("pi.local".into(), 7))
        );
        for bad in [
            "listen",
            "listen:0",
            "listen:70000",
            "dial:1",
            "connect:a b:1",
            "connect::1",
        ] {
            assert!(bad.parse::<NetLink>().is_err(), "{bad}");
        }
        assert_eq!(
            line(Board::VirtGicv3, |o| o.net = Some(NetLink::Listen(5555))),
            format!(
                "{VIRT} -netdev stream,id=board-net,server=on,addr.type=inet,addr.host=127.0.0.1,addr.port=5555 \
                 -device virtio-net-device,netdev=board-net,mac=52:54:00:74:64:01 -serial stdio -monitor none"
            )
            .replace("gic-version=2", "gic-version=3")
        );
        assert!(line(Board::VirtGicv2, |o| {
            o.net = Some(NetLink::Connect("127.0.0.1".into(), 5555))
        })
        .contains("server=off,reconnect-ms=1000,addr.type=inet,addr.host=127.0.0.1,addr.port=5555 -device virtio-net-device,netdev=board-net,mac=52:54:00:74:64:02"));
        // Not on the Pi (no virtio-mmio there).
        assert!(!line(Board::Raspi4b, |o| o.net = Some(NetLink::Listen(1))).contains("netdev"));
    }

    #[test]
    fn raspi4b_command_lines() {
        const PI: &str = "qemu-system-aarch64 -M raspi4b -kernel IMAGE -dtb PI4_DTB \
            -initrd BUNDLE -nic none -no-reboot -display none";
        assert_eq!(
            line(Board::Raspi4b, |_| {}),
            format!("{PI} -serial null -serial stdio -monitor none")
        );
        assert_eq!(
            line(Board::Raspi4b, |o| {
                o.interactive = true;
                o.trace = Some("t".into());
            }),
            format!("{PI} -serial file:t -serial mon:stdio")
        );
    }

    #[test]
    fn command_has_program_and_args() {
        let opts = QemuOptions::for_board(Board::VirtGicv2, &artifacts());
        let cmd = qemu_command(Board::VirtGicv2, &artifacts(), &opts);
        assert_eq!(cmd.get_program(), QEMU);
        assert_eq!(cmd.get_args().count(), 21);
    }

    #[test]
    fn the_trace_build_has_its_own_target_directory() {
        let (image, elf) = trace_build(Path::new("/w"));
        assert_eq!(
            image,
            Path::new("/w/target/trace-build/aarch64-unknown-none/release/hypervisor.bin")
        );
        assert_eq!(elf, image.with_extension(""));
        let traced = Artifacts::locate_trace();
        assert_eq!(traced.bundle, Artifacts::locate().bundle);
        if std::env::var_os("HV_TRACE_ELF").is_none() {
            assert!(traced.elf.ends_with(elf.strip_prefix("/w").unwrap()));
        }
    }

    #[test]
    fn default_artifacts_are_under_the_workspace() {
        let a = Artifacts::locate();
        for p in [&a.image, &a.elf, &a.bundle, &a.pi4_dtb] {
            assert!(p.is_absolute(), "{}", p.display());
        }
        if std::env::var_os("HV_IMAGE").is_none() && std::env::var_os("CARGO_TARGET_DIR").is_none()
        {
            assert!(a
                .image
                .ends_with("target/aarch64-unknown-none/release/hypervisor.bin"));
        }
    }
}
