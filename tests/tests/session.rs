//! Self-test of `Session` against a tiny hand-assembled arm64 Image (no
//! hypervisor build needed): it prints a banner with a crash-dump style image
//! offset and the prompt, echoes input until CR, prints `bye` and powers off
//! by PSCI. Skipped when QEMU is not installed.

use std::path::PathBuf;
use std::time::Duration;

use harness::{log_dir, Artifacts, Board, ErrorKind, QemuOptions, Session, PROMPT, QEMU};

/// `llvm-mc -triple=aarch64` output of the program at offset 0x40.
const CODE: [u32; 23] = [
    0xd2a12001, // movz x1, #0x900, lsl #16     (PL011 at 0x0900_0000)
    0x52806024, // mov  w4, #0x301
    0xb9003024, // str  w4, [x1, #0x30]         (UARTCR: enable, TX, RX)
    0x10000282, // adr  x2, msg
    0x38401443, // 1: ldrb w3, [x2], #1
    0x34000063, // cbz  w3, 3f
    0x39000023, // strb w3, [x1]
    0x17fffffd, // b    1b
    0xb9401824, // 3: ldr w4, [x1, #0x18]      (UARTFR)
    0x3727ffe4, // tbnz w4, #4, 3b              (RX FIFO empty)
    0xb9400023, // ldr  w3, [x1]
    0x39000023, // strb w3, [x1]                (echo)
    0x7100347f, // cmp  w3, #13
    0x54ffff61, // b.ne 3b
    0x30000282, // adr  x2, bye
    0x38401443, // 4: ldrb w3, [x2], #1
    0x34000063, // cbz  w3, 5f
    0x39000023, // strb w3, [x1]
    0x17fffffd, // b    4b
    0x52800100, // 5: mov w0, #8
    0x72b08000, // movk w0, #0x8400, lsl #16  (PSCI SYSTEM_OFF)
    0xd4000003, // smc  #0
    0x14000000, // b    .
];
const MSG: &[u8] = b"Fake hypervisor (image offset 0x40)\r\ntidal> \0"; // at 0x9c
const BYE: &[u8] = b"\nbye\r\n\0"; // at 0xc9

fn fake_artifacts(name: &str) -> Artifacts {
    let mut image = vec![0u8; 64];
    image[..4].copy_from_slice(&0x1400_0010u32.to_le_bytes()); // b 0x40
    image[16..24].copy_from_slice(&0x1000u64.to_le_bytes()); // image_size
    image[56..60].copy_from_slice(b"ARM\x64");
    image.extend(CODE.iter().flat_map(|w| w.to_le_bytes()));
    image.extend_from_slice(MSG);
    image.extend_from_slice(BYE);
    assert_eq!(image.len(), 0xc9 + BYE.len());
    let path = log_dir().join(format!("{name}.bin"));
    std::fs::write(&path, image).unwrap();
    Artifacts {
        image: path,
        elf: PathBuf::from("/nonexistent/fake.elf"),
        bundle: PathBuf::from("/nonexistent/guests.img"),
        pi4_dtb: PathBuf::from("/nonexistent/pi4.dtb"),
    }
}

fn start(name: &str) -> Option<Session> {
    if std::process::Command::new(QEMU)
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("{QEMU} not installed: skipped");
        return None;
    }
    let artifacts = fake_artifacts(name);
    let mut opts = QemuOptions::for_board(Board::VirtGicv2, &artifacts);
    opts.initrd = None;
    Some(
        Session::start(name, Board::VirtGicv2, &artifacts, &opts).unwrap_or_else(|e| panic!("{e}")),
    )
}

const T: Duration = Duration::from_secs(20);

#[test]
fn drives_console_and_waits_for_exit() {
    let Some(mut s) = start("harness-self-test-console") else {
        return;
    };
    // Anchored on " offset": a pattern ending in optional groups could
    // match the line before all of it has arrived.
    let groups = s
        .expect(r"Fake (\w+) \((image)?(nothing)? offset", T)
        .unwrap();
    assert_eq!(
        groups,
        ["Fake hypervisor (image offset", "hypervisor", "image", ""]
    );
    s.expect(&regex::escape(PROMPT), T).unwrap();
    // The cursor moved past the prompt: an earlier text no longer matches.
    s.send_line("hello").unwrap();
    s.expect("bye", T).unwrap();
    assert!(s.expect("Fake", Duration::from_secs(2)).is_err());
    let status = s.wait_exit(T).unwrap();
    assert!(status.success(), "{status}");
    assert!(s.output().contains("tidal> hello\r\nbye"), "{}", s.output());
    let err = s.expect("never", T).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Exited, "{err}");
    let log = std::fs::read_to_string(s.log_path()).unwrap();
    assert!(log.starts_with("$ qemu-system-aarch64 -M virt"), "{log}");
    assert!(log.contains("bye"), "{log}");
}

#[test]
fn timeout_reports_console_and_crash_site_and_deadline_kills() {
    let Some(mut s) = start("harness-self-test-timeout") else {
        return;
    };
    let err = s.expect("never", Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Timeout);
    let shown = err.to_string();
    for part in [
        "timed out after 2.0s waiting for /never/",
        "crashed in ?? (no debug info) (image offset 0x40)",
        "Fake hypervisor",
        "harness-self-test-timeout.log",
    ] {
        assert!(shown.contains(part), "missing `{part}` in:\n{shown}");
    }
    s.set_deadline(Duration::from_secs(1));
    let status = s.wait_exit(T).unwrap();
    assert!(!status.success());
    assert!(s.output().contains("deadline reached: QEMU killed"));
}

#[test]
fn missing_artifacts_are_reported() {
    let artifacts = fake_artifacts("harness-self-test-missing");
    let opts = QemuOptions::for_board(Board::VirtGicv2, &artifacts);
    let err = Session::start(
        "harness-self-test-missing",
        Board::VirtGicv2,
        &artifacts,
        &opts,
    )
    .err()
    .expect("no bundle");
    assert_eq!(err.kind, ErrorKind::Setup);
    assert!(err.to_string().contains("/nonexistent/guests.img"), "{err}");
}
