//! The board's disk under QEMU (issue 39): a raw image attached as a
//! `virtio-blk-device` is found on the board's virtio-mmio slots and
//! driven by the hypervisor; `snapshots` formats a new disk on first use,
//! the format survives QEMU's exit, a disk holding something else is left
//! alone, and a board without a disk says so. Ignored by plain `cargo
//! test`; `cargo xtask test` runs them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::{disk_image, Artifacts, Board, HarnessError, QemuOptions, Session, PROMPT};

const BOOT: Duration = Duration::from_secs(60);
const COMMAND: Duration = Duration::from_secs(10);

fn ok<T>(result: Result<T, HarnessError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// A sparse image of `mib` MiB under the test logs, filled with `byte`
/// for its first sector if `byte` is not 0.
fn image(name: &str, mib: u64, byte: u8) -> PathBuf {
    let path = disk_image(name, mib);
    if byte != 0 {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[byte; 512], 0).unwrap();
    }
    path
}

fn boot(board: Board, name: &str, disk: Option<&Path>) -> Session {
    let artifacts = Artifacts::locate();
    let mut opts = QemuOptions::for_board(board, &artifacts);
    opts.disk = disk.map(Path::to_path_buf);
    let mut s = ok(Session::start(name, board, &artifacts, &opts));
    ok(s.expect(&regex::escape(PROMPT), BOOT));
    s
}

fn disk_is_found_formatted_and_kept(board: Board) {
    let name = format!("{}-disk", board.name());
    let path = image(&name, 64, 0);
    let mut s = boot(board, &name, Some(&path));
    // Said at boot, before the prompt.
    ok(s.expect_since(&mut 0, r"disk: virtio-blk at 0x[0-9a-f]+, 64 MiB", COMMAND));
    let out = ok(s.run("snapshots", COMMAND));
    assert!(
        out.contains("no snapshots on the board's disk (64 MiB)"),
        "{out}"
    );
    s.assert_check();
    drop(s);
    // Formatted on the image itself: the superblock is there after QEMU's
    // exit, and a second boot reads it instead of formatting again.
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..8], b"TIDALDSK", "no superblock on the image");
    let mut s = boot(board, &format!("{name}-again"), Some(&path));
    let out = ok(s.run("snapshots", COMMAND));
    assert!(
        out.contains("no snapshots on the board's disk (64 MiB)"),
        "{out}"
    );
}

fn no_disk_says_so(board: Board) {
    let name = format!("{}-no-disk", board.name());
    let mut s = boot(board, &name, None);
    assert!(!s.output().contains("disk: virtio-blk"));
    let out = ok(s.run("snapshots", COMMAND));
    assert!(out.contains("snapshots: the board has no disk"), "{out}");
}

mod virt_gicv2 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn disk_is_found_formatted_and_kept() {
        super::disk_is_found_formatted_and_kept(Board::VirtGicv2);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn no_disk_says_so() {
        super::no_disk_says_so(Board::VirtGicv2);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn a_disk_holding_something_else_is_left_alone() {
        let name = "virt-gicv2-foreign-disk";
        let path = image(name, 16, 0xee);
        let mut s = boot(Board::VirtGicv2, name, Some(&path));
        let out = ok(s.run("snapshots", COMMAND));
        assert!(
            out.contains("snapshots: the disk holds something else"),
            "{out}"
        );
        drop(s);
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            bytes[..512].iter().all(|&b| b == 0xee),
            "the disk was written"
        );
        assert!(bytes[512..].iter().all(|&b| b == 0), "the disk was written");
    }
}

mod virt_gicv3 {
    use super::*;

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn disk_is_found_formatted_and_kept() {
        super::disk_is_found_formatted_and_kept(Board::VirtGicv3);
    }

    #[test]
    #[ignore = "boots QEMU: run cargo xtask test"]
    fn no_disk_says_so() {
        super::no_disk_says_so(Board::VirtGicv3);
    }
}
