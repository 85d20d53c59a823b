//! Integration tests of the built hypervisor under QEMU: one test per (board,
//! scenario), named `<board>::<scenario>`, plus virt-gicv2-only error paths
//! and trace checks. They need `cargo xtask` to have built the image, bundle
//! and Pi 4 tree, so they are ignored by plain `cargo test`; `cargo xtask
//! test` runs them with `--include-ignored`. Console logs of every run are in
//! `target/test-logs/<board>-<scenario>.log`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use harness::{
    decode_trace, log_dir, parse_cpus, parse_mem, symbolize, Artifacts, Board, HarnessError,
    QemuOptions, Session, PROMPT,
};
use regex::Regex;

const BOOT: Duration = Duration::from_secs(60);
const COMMAND: Duration = Duration::from_secs(10);
const POWEROFF: Duration = Duration::from_secs(20);
const FATAL_EXIT: Duration = Duration::from_secs(30);

/// What a board's boot must report.
#[derive(Clone, Copy)]
struct Target {
    board: Board,
    /// Part of the banner's board name.
    machine: &'static str,
    /// `GICv2` or `GICv3`.
    gic: &'static str,
    /// The RAM the hypervisor must find, in any number of banks.
    ram: u64,
}

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn start(t: Target, scenario: &str, tweak: impl FnOnce(&mut QemuOptions)) -> Session {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(t.board, &artifacts);
    tweak(&mut opts);
    let name = format!("{}-{scenario}", t.board.name());
    ok(Session::start(&name, t.board, &artifacts, &opts))
}

/// Starts QEMU and checks the banner, the GIC line and the prompt.
fn boot_with(t: Target, scenario: &str, tweak: impl FnOnce(&mut QemuOptions)) -> Session {
    let mut s = start(t, scenario, tweak);
    let t0 = Instant::now();
    let left = || BOOT.saturating_sub(t0.elapsed());
    let banner = ok(s.expect(
        r"(?m)^Tidal hypervisor v(\S+) \(([^)\r\n]*)\) on ([^\[\r\n]*) \[([^\]\r\n]*)\]",
        left(),
    ));
    assert!(
        banner[3].contains(t.machine),
        "banner names `{}`, want `{}`",
        banner[3],
        t.machine
    );
    let gic = ok(s.expect(r"(?m)^GIC: (GICv\d)", left()));
    assert_eq!(gic[1], t.gic, "GIC line");
    // Guests get a virtual GIC of the host's version.
    let vgic = ok(s.expect(
        r"(?m)^virtual GIC: (GICv\d) with (\d+) list registers",
        left(),
    ));
    assert_eq!(vgic[1], t.gic, "virtual GIC line");
    ok(s.expect(&regex::escape(PROMPT), left()));
    s
}

fn boot(t: Target, scenario: &str) -> Session {
    boot_with(t, scenario, |_| {})
}

fn boots_to_shell(t: Target) {
    let mut s = boot(t, "boots_to_shell");
    s.assert_check();
}

fn mem_accounting_adds_up(t: Target) {
    let mut s = boot(t, "mem_accounting_adds_up");
    let out = ok(s.run("mem", COMMAND));
    let report = parse_mem(&out).unwrap_or_else(|e| panic!("{e} in `mem` output:\n{out}"));
    let sum = report
        .categories
        .iter()
        .try_fold(0u64, |sum, (_, bytes)| sum.checked_add(*bytes));
    assert_eq!(
        sum,
        Some(report.total),
        "categories do not add up to total:\n{out}"
    );
    assert_eq!(report.total, report.ram_bytes, "total is not RAM:\n{out}");
    assert!(
        out.contains("frame table invariants: ok"),
        "the frame table check did not pass:\n{out}"
    );
    assert_eq!(report.ram_bytes, t.ram, "RAM size:\n{out}");
    s.assert_check();
}

fn cpus_all_online(t: Target) {
    let mut s = boot(t, "cpus_all_online");
    let out = ok(s.run("cpus", COMMAND));
    let cpus = parse_cpus(&out);
    assert_eq!(cpus.len(), 4, "`cpus` output:\n{out}");
    for (i, cpu) in cpus.iter().enumerate() {
        assert_eq!(cpu.index, i, "`cpus` output:\n{out}");
        assert!(cpu.online, "CPU {i} is {}:\n{out}", cpu.state);
    }
    s.assert_check();
}

fn help_and_unknown_command(t: Target) {
    let mut s = boot(t, "help_and_unknown_command");
    let help = ok(s.run("help", COMMAND));
    for command in ["mem", "cpus", "check", "poweroff"] {
        let word = Regex::new(&format!(r"\b{command}\b")).unwrap();
        assert!(
            word.is_match(&help),
            "`help` does not list `{command}`:\n{help}"
        );
    }
    let out = ok(s.run("frobnicate", COMMAND));
    assert!(
        out.lines()
            .any(|l| l.contains("unknown command") && l.contains("help")),
        "no `unknown command ... help` line:\n{out}"
    );
    s.assert_check();
}

fn poweroff_exits_cleanly(t: Target) {
    let mut s = boot(t, "poweroff_exits_cleanly");
    s.assert_check();
    ok(s.send_line("poweroff"));
    let status = ok(s.wait_exit(POWEROFF));
    assert!(status.success(), "QEMU exit status {status}");
}

fn debug_fault_dumps_and_symbolizes(t: Target) {
    let mut s = boot(t, "debug_fault_dumps_and_symbolizes");
    // The shell's CPU is parked afterwards: check while it still answers.
    s.assert_check();
    ok(s.send_line("debug fault"));
    let dump = ok(s.expect(r"(?s)\*\*\* EXCEPTION on CPU 0:.*?CPU 0 parked\.", COMMAND));
    let dump = &dump[0];
    for field in [
        r"ESR_EL2 0x[0-9a-fA-F]+",
        r"FAR_EL2 0x[0-9a-fA-F]+",
        r"\bx30\b",
    ] {
        assert!(
            Regex::new(field).unwrap().is_match(dump),
            "no /{field}/ in dump:\n{dump}"
        );
    }
    let elr = Regex::new(r"ELR_EL2 0x[0-9a-fA-F]+ \(image offset 0x([0-9a-fA-F]+)\)").unwrap();
    let offset = elr
        .captures(dump)
        .map(|c| u64::from_str_radix(&c[1], 16).unwrap())
        .unwrap_or_else(|| panic!("no `ELR_EL2 0x.. (image offset 0x..)` in dump:\n{dump}"));
    let elf = Artifacts::locate().elf;
    let site = symbolize(&elf, offset)
        .unwrap_or_else(|| panic!("{} has no location for {offset:#x}", elf.display()));
    println!("fault at {site}");
    assert!(
        site.contains("debug_fault") && site.contains("hypervisor/src/boot.rs"),
        "fault located at {site}, not in the shell's debug_fault"
    );
}

fn debug_panic_reports_location(t: Target) {
    let mut s = boot(t, "debug_panic_reports_location");
    s.assert_check();
    ok(s.send_line("debug panic"));
    ok(s.expect(
        r"(?m)^\*\*\* PANIC on CPU 0 at hypervisor/src/[^:\s]+:\d+:\d+: ",
        COMMAND,
    ));
    ok(s.expect(r"CPU 0 parked\.", COMMAND));
}

macro_rules! board_tests {
    ($($module:ident => $target:expr;)*) => {$(
        mod $module {
            use super::*;
            const T: Target = $target;
            board_tests!(@tests boots_to_shell, mem_accounting_adds_up, cpus_all_online,
                help_and_unknown_command, poweroff_exits_cleanly,
                debug_fault_dumps_and_symbolizes, debug_panic_reports_location);
        }
    )*};
    (@tests $($scenario:ident),*) => {$(
        #[test]
        #[ignore = "boots QEMU: run cargo xtask test"]
        fn $scenario() {
            super::$scenario(T)
        }
    )*};
}

const VIRT_GICV2: Target = Target {
    board: Board::VirtGicv2,
    machine: "QEMU virt",
    gic: "GICv2",
    ram: 2 << 30,
};

/// QEMU raspi4b is the 2 GiB board: all of it but the VideoCore's 64 MiB
/// share below 1 GiB (0x3c000000-0x40000000), in two banks, as the firmware
/// describes it (the harness's tree adds the RAM above 1 GiB, see
/// `harness::PI4_QEMU_DTB`).
const RASPI4B_RAM: u64 = (2 << 30) - (64 << 20);

board_tests! {
    virt_gicv2 => VIRT_GICV2;
    virt_gicv3 => Target { board: Board::VirtGicv3, gic: "GICv3", ..VIRT_GICV2 };
    raspi4b => Target { board: Board::Raspi4b, machine: "Raspberry Pi 4", gic: "GICv2", ram: RASPI4B_RAM };
}

/// Boot errors (virt-gicv2 only): exactly one `FATAL:` line containing all
/// of `words`, and QEMU exits by itself within 30 s.
mod virt_gicv2_errors {
    use super::*;

    fn expect_fatal(scenario: &str, words: &[&str], tweak: impl FnOnce(&mut QemuOptions)) {
        let mut s = start(VIRT_GICV2, scenario, tweak);
        let t0 = Instant::now();
        // Match up to the line end, so a line still arriving is not cut short.
        let line = ok(s.expect(r"(?m)^FATAL: [^\r\n]*\r?\n", FATAL_EXIT))[0].clone();
        for word in words {
            assert!(line.contains(word), "`{line}` does not mention `{word}`");
        }
        ok(s.wait_exit(FATAL_EXIT.saturating_sub(t0.elapsed())));
        let out = s.output();
        let fatal_lines = out.lines().filter(|l| l.starts_with("FATAL:")).count();
        assert_eq!(fatal_lines, 1, "want one FATAL line:\n{out}");
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn fatal_without_bundle() {
        expect_fatal("fatal_without_bundle", &["no guest bundle"], |o| {
            o.initrd = None
        });
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn fatal_on_garbage_bundle() {
        let garbage = log_dir().join("virt-gicv2-garbage-bundle.img");
        std::fs::write(&garbage, [0x5a; 4096]).unwrap();
        expect_fatal("fatal_on_garbage_bundle", &["guest bundle", "magic"], |o| {
            o.initrd = Some(garbage)
        });
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn fatal_with_too_little_ram() {
        expect_fatal("fatal_with_too_little_ram", &["RAM"], |o| {
            o.memory = Some("32M".into())
        });
    }

    /// QEMU virt's own tree, dumped to `<log dir>/<name>` (QEMU exits).
    fn dump_virt_tree(name: &str) -> std::path::PathBuf {
        let dumped = log_dir().join(name);
        let mut s = start(VIRT_GICV2, &format!("dumpdtb-{name}"), |o| {
            o.extra = vec!["-machine".into(), format!("dumpdtb={}", dumped.display())];
        });
        assert!(
            ok(s.wait_exit(FATAL_EXIT)).success(),
            "dumpdtb failed:\n{}",
            s.output()
        );
        dumped
    }

    /// A tree naming a Raspberry Pi 5: one line naming the board and what
    /// runs, not a boot that goes wrong later.
    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn fatal_on_unsupported_board() {
        let dir = log_dir();
        let dumped = dump_virt_tree("virt-gicv2-qemu-pi5.dtb");
        let dts_path = dir.join("virt-gicv2-as-pi5.dts");
        let renamed = dir.join("virt-gicv2-as-pi5.dtb");
        dtc("dtb", "dts", &dumped, &dts_path);
        let dts = std::fs::read_to_string(&dts_path).unwrap();
        let root_compatible = "\tcompatible = \"linux,dummy-virt\";";
        assert!(
            dts.contains(root_compatible),
            "QEMU's root compatible:\n{dts}"
        );
        let dts = dts.replacen(
            root_compatible,
            "\tcompatible = \"raspberrypi,5-model-b\", \"brcm,bcm2712\";",
            1,
        );
        std::fs::write(&dts_path, dts).unwrap();
        dtc("dts", "dtb", &dts_path, &renamed);
        expect_fatal(
            "fatal_on_unsupported_board",
            &["unsupported board", "Raspberry Pi 5", "Raspberry Pi 4"],
            |o| o.dtb = Some(renamed),
        );
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn fatal_without_console() {
        let dir = log_dir();
        let dumped = dump_virt_tree("virt-gicv2-qemu.dtb");
        let stripped = dir.join("virt-gicv2-no-console.dtb");

        let dts_path = dir.join("virt-gicv2-no-console.dts");
        dtc("dtb", "dts", &dumped, &dts_path);
        let dts = std::fs::read_to_string(&dts_path).unwrap();
        let kept: Vec<&str> = dts
            .lines()
            .filter(|l| {
                let l = l.trim_start();
                !l.starts_with("stdout-path") && !l.starts_with("serial0 =")
            })
            .collect();
        assert!(
            kept.len() < dts.lines().count(),
            "QEMU's tree has no stdout-path:\n{dts}"
        );
        std::fs::write(&dts_path, kept.join("\n")).unwrap();
        dtc("dts", "dtb", &dts_path, &stripped);

        expect_fatal("fatal_without_console", &["console"], |o| {
            o.dtb = Some(stripped)
        });
    }

    fn dtc(from: &str, to: &str, input: &Path, output: &Path) {
        let out = Command::new("dtc")
            .args(["-q", "-I", from, "-O", to, "-o"])
            .args([output, input])
            .output()
            .expect("dtc (device-tree-compiler) installed");
        assert!(
            out.status.success(),
            "dtc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The binary trace UART: every CPU coming up is traced.
#[test]
#[ignore = "boots QEMU: run cargo xtask test"]
fn virt_gicv2_trace_reports_cpus() {
    let trace = log_dir().join("virt-gicv2-trace.defmt");
    let _ = std::fs::remove_file(&trace);
    let mut s = boot_with(VIRT_GICV2, "trace_reports_cpus", |o| {
        o.trace = Some(trace.clone())
    });
    s.assert_check();
    ok(s.send_line("poweroff"));
    assert!(ok(s.wait_exit(POWEROFF)).success());
    let bytes = std::fs::read(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
    let lines = decode_trace(&Artifacts::locate().elf, &bytes).unwrap_or_else(|e| panic!("{e}"));
    println!("{}", lines.join("\n"));
    assert!(
        lines.iter().any(|l| l.to_lowercase().contains("cpu")),
        "no CPU in {} trace lines ({} bytes)",
        lines.len(),
        bytes.len()
    );
}
