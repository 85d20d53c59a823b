//! The hypervisor crate's layering, checked from its sources: which
//! top-level modules each module imports (`crate::x`, and `super::x` inside
//! a directory module), no import cycles between modules (top level and one
//! level down), and the low layers never reaching up: `arch/` builds only
//! on `hw`, `mm` and `addr`, and the portable core (`vm`, `vgic`,
//! `virtio`, `balloon`) never on `arch`, the target glue (`run`) or the
//! shell (`console`). Host-only: reads files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use harness::workspace_root;

type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file: `vm/bus.rs` is `["vm", "bus"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// Code without comments and without the file's `#[cfg(test)]` module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module paths named after `prefix` (`crate::` or `super::`) in `code`.
fn paths_after<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = Vec<&'a str>> + 'a {
    code.match_indices(prefix).filter_map(move |(i, _)| {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        // The inner links of a `super::super::` chain: the chain is read
        // once, from its start.
        if code[..i].ends_with(prefix) {
            return None;
        }
        let rest = &code[i + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        let path: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
        (!path.is_empty()).then_some(path)
    })
}

/// The import graph at `depth` (1: top-level modules; 2: also one level
/// down), test-only files left out.
fn graph(depth: usize) -> Graph {
    let src = workspace_root().join("hypervisor/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let module = module_of(&src, &file);
        if module
            .iter()
            .any(|m| m.ends_with("tests") || m == "testing")
        {
            continue;
        }
        let me = module
            .iter()
            .take(depth)
            .cloned()
            .collect::<Vec<_>>()
            .join("::");
        let text = code(&std::fs::read_to_string(&file).unwrap());
        let parent: Vec<&str> = {
            // `super` is the parent of this module (for a directory's
            // mod.rs too: its module is the directory).
            let keep = module.len().saturating_sub(1);
            module[..keep].iter().map(String::as_str).collect()
        };
        let crate_paths = paths_after(&text, "crate::").map(|p| p.to_vec());
        // `super::super::x` from a/b/c.rs is a::x: each leading `super`
        // one level up (the chain's inner `super::` is not a path of its own).
        let super_paths = paths_after(&text, "super::").map(|p| {
            let ups = p.iter().take_while(|s| **s == "super").count();
            let mut full = parent[..parent.len().saturating_sub(ups)].to_vec();
            full.extend(&p[ups..]);
            full
        });
        for path in crate_paths.chain(super_paths) {
            let target = path
                .iter()
                .take(depth)
                .copied()
                .collect::<Vec<_>>()
                .join("::");
            let first_is_module = path[0].starts_with(|c: char| c.is_ascii_lowercase());
            if first_is_module && target != me && !me.is_empty() {
                graph.entry(me.clone()).or_default().insert(target);
            }
        }
    }
    graph
}

/// A cycle through `start`, if any (depth-first search).
fn cycle_from(graph: &Graph, start: &str) -> Option<Vec<String>> {
    fn visit(graph: &Graph, node: &str, path: &mut Vec<String>, start: &str) -> bool {
        for next in graph.get(node).into_iter().flatten() {
            if next == start {
                return true;
            }
            if !path.contains(next) {
                path.push(next.clone());
                if visit(graph, next, path, start) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    visit(graph, start, &mut path, start).then_some(path)
}

#[test]
fn no_import_cycles() {
    for depth in [1, 2] {
        let graph = graph(depth);
        assert!(graph.len() > 10, "the scan found the modules: {graph:?}");
        for node in graph.keys() {
            if let Some(cycle) = cycle_from(&graph, node) {
                panic!("import cycle at depth {depth}: {}", cycle.join(" -> "));
            }
        }
    }
}

#[test]
fn low_layers_never_import_high_ones() {
    let graph = graph(1);
    let allowed: &[(&str, &[&str])] = &[
        ("addr", &[]),
        ("mm", &["addr"]),
        ("hw", &["addr", "mm"]),
        ("arch", &["addr", "hw", "mm"]),
    ];
    for (module, may) in allowed {
        let imports = graph.get(*module).cloned().unwrap_or_default();
        let extra: Vec<_> = imports
            .iter()
            .filter(|m| !may.contains(&m.as_str()))
            .collect();
        assert!(
            extra.is_empty(),
            "{module} imports {extra:?}; it may import only {may:?}"
        );
    }
    for core in ["vm", "vgic", "virtio", "balloon"] {
        let imports = graph.get(core).cloned().unwrap_or_default();
        for high in ["arch", "run", "console", "boot", "crash"] {
            assert!(!imports.contains(high), "{core} imports {high}");
        }
    }
    assert!(
        graph["arch"].contains("hw"),
        "the scan reads arch's imports"
    );
}

#[test]
fn the_scan_sees_a_cycle_when_there_is_one() {
    let mut graph = Graph::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("a".into());
    assert_eq!(cycle_from(&graph, "a"), Some(vec!["a".into(), "b".into()]));
    let text = "use crate::vm::bus::route;\nuse super::state::Vm;\nlet mycrate::x = 1;\n";
    let paths: Vec<_> = paths_after(text, "crate::").collect();
    assert_eq!(paths, vec![vec!["vm", "bus", "route"]]);
    let text = "use super::super::bus::route;\nuse super::state::Vm;\n";
    let paths: Vec<_> = paths_after(text, "super::").collect();
    assert_eq!(
        paths,
        vec![vec!["super", "bus", "route"], vec!["state", "Vm"]]
    );
}
