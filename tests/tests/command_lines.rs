//! Every QEMU command line the project builds or documents must run with
//! only what `cargo xtask setup` installs: QEMU from `qemu-system-arm`
//! with `--no-install-recommends`, so no `ipxe-qemu`, `seabios` or EFI
//! firmware. On `-M virt` that means `-nic none`: without it QEMU adds a
//! virtio-net-pci card and fails on its missing option ROM
//! (`failed to find romfile "efi-virtio.rom"`). Host-only: reads files and
//! builds command lines, starts nothing.

use std::path::{Path, PathBuf};

use harness::{qemu_args, workspace_root, Artifacts, Board, NetLink, QemuOptions};

/// The one thing every line must carry, spelled as a shell word pair or as
/// the items of an argument list (Python, Rust).
fn disables_default_nic(text: &str) -> bool {
    let squeezed: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    squeezed.contains("-nic none")
        || squeezed.contains(r#""-nic", "none""#)
        || squeezed.contains(r#"&"-nic", &"none""#)
}

fn artifacts() -> Artifacts {
    Artifacts {
        image: "IMAGE".into(),
        elf: "ELF".into(),
        bundle: "BUNDLE".into(),
        pi4_dtb: "PI4_DTB".into(),
    }
}

#[test]
fn every_harness_command_line_has_no_default_nic() {
    for board in Board::ALL {
        let variants: [fn(&mut QemuOptions); 6] = [
            |_| {},
            |o| o.interactive = true,
            |o| o.trace = Some("trace.bin".into()),
            |o| {
                o.initrd = None;
                o.dtb = None;
                o.extra = vec!["-S".into()];
            },
            // The board's own card is added beside `-nic none`.
            |o| o.net = Some(NetLink::Listen(5555)),
            |o| o.net = Some(NetLink::Connect("127.0.0.1".into(), 5555)),
        ];
        for tweak in variants {
            let mut opts = QemuOptions::for_board(board, &artifacts());
            tweak(&mut opts);
            let args: Vec<String> = qemu_args(board, &artifacts(), &opts)
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            assert!(
                args.windows(2).any(|w| w[0] == "-nic" && w[1] == "none"),
                "{board}: {args:?}"
            );
        }
    }
}

/// Files that may hold a QEMU command: documentation, scripts and sources
/// (not `target/`, not hidden folders).
fn candidate_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        if path.is_dir() {
            candidate_files(&path, out);
        } else if [".md", ".py", ".sh", ".rs", ".txt"]
            .iter()
            .any(|ext| name.ends_with(ext))
        {
            out.push(path);
        }
    }
}

/// The text of the command that starts at byte `start`: that line and every
/// line it continues onto (a trailing `\`, or an open argument list).
fn command_extent(text: &str, start: usize) -> &str {
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let mut end = line_start;
    let mut depth: i32 = 0;
    for line in text[line_start..].split_inclusive('\n') {
        end += line.len();
        depth += line.matches(['[', '(']).count() as i32;
        depth -= line.matches([']', ')']).count() as i32;
        let trimmed = line.trim_end();
        let continues = trimmed.ends_with('\\') || trimmed.ends_with(',') || depth > 0;
        if !continues {
            break;
        }
    }
    &text[line_start..end]
}

#[test]
fn every_documented_or_scripted_virt_command_has_no_default_nic() {
    let root = workspace_root();
    let mut files = Vec::new();
    candidate_files(&root, &mut files);
    let mut checked = 0;
    let mut bad = Vec::new();
    for file in files {
        if file.ends_with("tests/tests/command_lines.rs") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let is_rust = file.extension().is_some_and(|e| e == "rs");
        // A shell or Python command line that starts QEMU on `virt` (Rust
        // code is checked below, where it spawns QEMU).
        for (at, _) in text.match_indices("qemu-system-aarch64") {
            if is_rust {
                break;
            }
            // `qemu-system-aarch64 -M virt` quoted inline in prose is a
            // name, not a command.
            if text[..at].ends_with('`') {
                continue;
            }
            let command = command_extent(&text, at);
            let first_args: String = text[at..].chars().take(80).collect();
            let starts_virt =
                first_args.contains("-M virt") || first_args.contains("\"-M\", machine");
            if starts_virt {
                checked += 1;
                if !disables_default_nic(command) {
                    bad.push(format!("{}: {}", file.display(), command.trim()));
                }
            }
        }
        // Rust code that spawns QEMU itself rather than through the harness.
        // Rust code that spawns QEMU itself rather than through the harness
        // (whose lines the test above checks): the function that builds the
        // command, up to its closing brace.
        let spawns = ["Command::new(harness::QEMU)", "Command::new(QEMU)"]
            .into_iter()
            .chain(std::iter::once("Command::new(\"qemu-system-aarch64\")"));
        let harness_builder = file.ends_with("tests/src/qemu.rs");
        for pattern in spawns.filter(|_| is_rust && !harness_builder) {
            for (at, _) in text.match_indices(pattern) {
                let end = ["\n}\n", "\n    }\n"]
                    .iter()
                    .filter_map(|close| text[at..].find(close))
                    .min()
                    .map_or(text.len(), |i| at + i);
                let statement = &text[at..end];
                // Asking QEMU its version starts no machine.
                if statement.contains("--version") {
                    continue;
                }
                checked += 1;
                if !disables_default_nic(statement) {
                    bad.push(format!("{}: {}", file.display(), statement.trim()));
                }
            }
        }
    }
    assert!(
        checked >= 6,
        "found only {checked} QEMU command lines: the scan lost them"
    );
    assert!(
        bad.is_empty(),
        "QEMU command lines that need ipxe-qemu's ROM (add `-nic none`):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_scan_sees_a_missing_nic() {
    let doc =
        "```sh\nqemu-system-aarch64 -M virt -cpu cortex-a72 \\\n  -kernel x -serial stdio\n```\n";
    let at = doc.find("qemu-system").unwrap();
    assert!(!disables_default_nic(command_extent(doc, at)));
    let fixed = doc.replace("-serial stdio", "-serial stdio -nic none");
    let at = fixed.find("qemu-system").unwrap();
    assert!(disables_default_nic(command_extent(&fixed, at)));
    let py = "cmd = [\"qemu-system-aarch64\", \"-M\", machine,\n  \"-nic\", \"none\"]\nother()\n";
    assert!(disables_default_nic(command_extent(
        py,
        py.find("qemu").unwrap()
    )));
}
