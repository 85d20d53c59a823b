//! The documents name only what exists. README.md, docs/*.md and the
//! READMEs below the root (guests/, guest-driver/) name files, Rust items
//! and functions, `cargo xtask` commands and their flags, and shell
//! commands; each name is looked up in the repository here, so a rename or
//! a removal that leaves a document behind fails a test instead of
//! misleading a reader (issue 38). Host-only: reads files.
//!
//! What counts as a name, and the rules that keep out what is not ours:
//! - a path in backticks (it has a `/` or a source extension) and a source
//!   file named in prose or in a code block: it exists from the root, from a
//!   crate's directory or its `src/` (the documents write `vm/bus.rs` for
//!   hypervisor/src/vm/bus.rs), and a bare file name anywhere; `file.rs:N`
//!   has N lines. Not checked: `target/` (build outputs), absolute paths
//!   (the guest's, the device tree's), placeholders (`<name>`, `TARGET`,
//!   `*`, `~`, `...`).
//! - a Rust path in backticks (`vm::cpu::PhysCpu`): its last segment is an
//!   item, variant, field or module the sources define, its lowercase
//!   segments are modules or crates, its others types defined or used; a
//!   path the code itself writes is real. Paths into external crates (the
//!   dependencies the Cargo.toml files list, `core`, `std`, `alloc`) are
//!   not checked.
//! - a name in backticks that can only be code: `name()` is a function the
//!   sources define or call (std's `checked_add` too); `name!` a macro;
//!   snake_case with an underscore is defined, called, a word of a string
//!   literal (a JSON key), of an attribute (`no_std`), of a doctest's fence
//!   (`compile_fail`), of a script, a key of a guests/ TOML file, or a
//!   bundle field whose offset const is its SCREAMING_CASE; SCREAMING_CASE
//!   with an underscore (the virtio spec's `VIRTIO_BALLOON_F_X` as our `X`)
//!   and CamelCase with two humps are defined or used by the code. Single
//!   words (`mm`, `Balloon`, `WAIT`) are too ambiguous to check, and the
//!   few Linux, QEMU and ELF names are listed in [`EXTERNAL_NAMES`].
//! - `cargo xtask SUB --flag`: SUB is an arm of xtask's dispatch match (and
//!   a second word, an arm of SUB's own match if it has one), each flag a
//!   string literal in xtask's sources; `cargo ... -p PKG`: a package here.
//! - `tidal> CMD`: CMD is in the shell's command table (`COMMANDS`).
//!
//! Every failure is collected and reported as `doc:line: message`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use harness::workspace_root;
use regex::Regex;

/// A regex compiled once.
macro_rules! re {
    ($pattern:expr) => {{
        static RE: OnceLock<Regex> = OnceLock::new();
        RE.get_or_init(|| Regex::new($pattern).unwrap())
    }};
}

/// Names the documents use that are Linux's or QEMU's, not ours: functions
/// seen in profiles and kernel knobs the guest fixture's text discusses.
const EXTERNAL_NAMES: &[&str] = &[
    // Linux functions in the guest's profiles (docs/ARCHITECTURE.md).
    "finish_task_switch",
    "_raw_spin_unlock_irqrestore",
    "clear_page_erms",
    // Linux's hvc console driver's callbacks.
    "put_chars",
    "put_char",
    // Linux kernel configuration the Debian kernel is built with.
    "init_on_alloc",
    "PREEMPT_VOLUNTARY",
    // QEMU's TCG functions in the host's profiles of QEMU.
    "helper_lookup_tb_ptr",
    "qht_lookup_custom",
    "cpu_get_tb_cpu_state",
    "aa64_va_parameters",
    "arm_hcr_el2_eff_secstate",
    // The ELF file type of the linked test guest.
    "ET_EXEC",
];

/// File extensions that make a bare backticked word a file of ours (an
/// `.img`, `.dtb` or `.elf` is a build output or the firmware's).
const SOURCE_EXTENSIONS: &[&str] = &["rs", "md", "toml", "ld", "py", "json", "svg"];

// ---------------------------------------------------------------------------
// Documents: code spans, code block lines and prose, each with its line.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// An inline code span (`...`), its newlines made spaces.
    Span,
    /// A line of a fenced code block.
    Code,
    /// A line of text outside code, its code spans blanked out.
    Prose,
}

#[derive(Debug, PartialEq, Eq)]
struct Piece {
    line: usize,
    kind: Kind,
    text: String,
}

/// A Markdown document's code spans, code block lines and prose lines.
fn pieces(doc: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut in_code = false;
    let mut para: Vec<(usize, &str)> = Vec::new();
    for (i, line) in doc.lines().enumerate() {
        let n = i + 1;
        let fence = line.trim_start().starts_with("```");
        if in_code {
            if fence {
                in_code = false;
            } else {
                out.push(Piece {
                    line: n,
                    kind: Kind::Code,
                    text: line.to_string(),
                });
            }
        } else if fence {
            paragraph(&para, &mut out);
            para.clear();
            in_code = true;
        } else if line.trim().is_empty() {
            paragraph(&para, &mut out);
            para.clear();
        } else if line.trim_start().starts_with('|') {
            // A table row: its spans end with it.
            paragraph(&para, &mut out);
            para.clear();
            paragraph(&[(n, line)], &mut out);
        } else {
            para.push((n, line));
        }
    }
    paragraph(&para, &mut out);
    out
}

/// A paragraph's code spans (which may run over lines) and prose lines.
fn paragraph(lines: &[(usize, &str)], out: &mut Vec<Piece>) {
    let Some(&(first, _)) = lines.first() else {
        return;
    };
    let text = lines.iter().map(|l| l.1).collect::<Vec<_>>().join("\n");
    let bytes = text.as_bytes();
    let run = |at: usize| bytes[at..].iter().take_while(|&&b| b == b'`').count();
    let mut prose = String::new();
    let (mut i, mut copied) = (0, 0);
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let n = run(i);
        let start = i + n;
        // The closing run has exactly as many backticks as the opening.
        let mut j = start;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let m = run(j);
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        let Some(end) = close else {
            i = start;
            continue;
        };
        let content = text[start..end].split_whitespace().collect::<Vec<_>>();
        out.push(Piece {
            line: first + text[..i].matches('\n').count(),
            kind: Kind::Span,
            text: content.join(" "),
        });
        prose.push_str(&text[copied..i]);
        prose.extend(
            text[i..end + n]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' }),
        );
        i = end + n;
        copied = i;
    }
    prose.push_str(&text[copied..]);
    for (k, line) in prose.lines().enumerate() {
        out.push(Piece {
            line: first + k,
            kind: Kind::Prose,
            text: line.to_string(),
        });
    }
}

// ---------------------------------------------------------------------------
// Rust sources: code without comments and literals, and the literals.

/// A Rust file's code with comments and literals blanked, and the text of
/// its string literals.
fn lex(src: &str) -> (String, Vec<String>) {
    let chars: Vec<char> = src.chars().collect();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut code = String::with_capacity(src.len());
    let mut literals = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        code.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == 'r'
            && matches!(next, Some('"' | '#'))
            && (i == 0
                || !ident(chars[i - 1])
                || (chars[i - 1] == 'b' && (i < 2 || !ident(chars[i - 2]))))
        {
            // A raw string r#"..."#, or a raw identifier r#name.
            let hashes = chars[i + 1..].iter().take_while(|&&c| c == '#').count();
            let open = i + 1 + hashes;
            if chars.get(open) != Some(&'"') {
                code.push(c);
                i += 1;
                continue;
            }
            let mut j = open + 1;
            while j < chars.len() {
                if chars[j] == '"' && chars[j + 1..].iter().take(hashes).all(|&c| c == '#') {
                    break;
                }
                j += 1;
            }
            literals.push(chars[open + 1..j.min(chars.len())].iter().collect());
            code.push(' ');
            i = j + 1 + hashes;
        } else if c == '"' {
            let mut j = i + 1;
            let mut text = String::new();
            while j < chars.len() && chars[j] != '"' {
                if chars[j] == '\\' {
                    j += 1;
                }
                if let Some(&c) = chars.get(j) {
                    text.push(c);
                }
                j += 1;
            }
            literals.push(text);
            code.push(' ');
            i = j + 1;
        } else if c == '\'' && next == Some('\\') {
            // A character literal with an escape: '\n', '\'', '\u{..}'.
            let mut j = i + 3;
            while j < chars.len() && chars[j] != '\'' {
                j += 1;
            }
            code.push(' ');
            i = j + 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            code.push(' ');
            i += 3;
        } else {
            code.push(c);
            i += 1;
        }
    }
    (code, literals)
}

/// The arms of the `match` that starts on the line containing `head`:
/// their string patterns (`Some("run")`), each with the arms of a nested
/// `match` in its body containing `nested_head`.
fn match_arms(text: &str, head: &str, nested_head: &str) -> BTreeMap<String, BTreeSet<String>> {
    let indent = |l: &str| l.len() - l.trim_start().len();
    let literal = re!(r#""([^"]+)""#);
    let patterns = |line: &str| -> Vec<String> {
        let pattern = line.split("=>").next().unwrap_or("");
        literal
            .captures_iter(pattern)
            .map(|c| c[1].to_string())
            .collect()
    };
    let mut lines = text.lines().skip_while(|l| !l.contains(head));
    let Some(first) = lines.next() else {
        return BTreeMap::new();
    };
    let base = indent(first);
    let mut arms = BTreeMap::<String, BTreeSet<String>>::new();
    let mut current: Vec<String> = Vec::new();
    let (mut arm_indent, mut nested_indent) = (None, None::<usize>);
    let mut in_nested = false;
    for line in lines {
        if line.trim().is_empty() {
            continue;
        }
        let at = indent(line);
        if at <= base {
            break;
        }
        let arm_at = *arm_indent.get_or_insert(at);
        if at == arm_at && line.contains("=>") {
            current = patterns(line);
            for p in &current {
                arms.entry(p.clone()).or_default();
            }
            in_nested = false;
            nested_indent = None;
        } else if line.contains(nested_head) {
            in_nested = true;
        } else if in_nested && line.contains("=>") {
            let nested_at = *nested_indent.get_or_insert(at);
            if at == nested_at {
                for p in patterns(line) {
                    for sub in &current {
                        arms.entry(sub.clone()).or_default().insert(p.clone());
                    }
                }
            }
        }
    }
    arms
}

// ---------------------------------------------------------------------------
// The repository: its files, its Rust names, xtask's and the shell's words.

#[derive(Default)]
struct Repo {
    root: PathBuf,
    /// Where a relative path may start: the root, every crate's directory
    /// and `src/`, guests/ and fuzz/fuzz_targets/.
    bases: Vec<PathBuf>,
    /// Every file and directory, by name.
    by_name: BTreeMap<String, Vec<PathBuf>>,
    /// Items the Rust sources define (fn, struct, enum, trait, const,
    /// static, type, mod, union, macro_rules!), enum variants and fields.
    defined: BTreeSet<String>,
    /// Functions defined (`fn name`) or called (`name(`, `.name::<`).
    functions: BTreeSet<String>,
    /// Macros defined or invoked.
    macros: BTreeSet<String>,
    /// Modules: `mod` declarations, source files' stems and directories,
    /// the workspace's crates.
    modules: BTreeSet<String>,
    /// Every identifier the code uses.
    idents: BTreeSet<String>,
    /// Words of string literals, keys of guests/ TOML files and words of the
    /// repository's scripts.
    words: BTreeSet<String>,
    /// All the code (comments and literals blanked), to find a path the
    /// code writes.
    code: String,
    /// External crates: dependencies of every Cargo.toml, and the sysroot.
    external: BTreeSet<String>,
    /// Packages of the workspace (as `-p` takes them).
    packages: BTreeSet<String>,
    /// xtask's subcommands, each with its own subcommands if it has any.
    xtask: BTreeMap<String, BTreeSet<String>>,
    /// String literals of xtask's sources.
    xtask_literals: BTreeSet<String>,
    /// The shell's commands.
    shell: BTreeSet<String>,
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            // Build outputs, git's own files and the fuzzers' findings.
            if !matches!(&*name, "target" | ".git" | "corpus" | "artifacts") {
                out.push(path.clone());
                walk(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

fn words_of(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

impl Repo {
    fn read() -> Repo {
        let root = workspace_root();
        let mut paths = Vec::new();
        walk(&root, &mut paths);
        let mut repo = Repo {
            root: root.clone(),
            ..Repo::default()
        };
        repo.bases.push(root.clone());
        let def = re!(
            r"\b(?:fn|struct|enum|trait|const|static|type|mod|union)\s+(?:mut\s+)?(?:r#)?([A-Za-z_]\w*)|macro_rules!\s*(\w+)"
        );
        let call = re!(r"([A-Za-z_]\w*)\s*(?:::<[^>]*>\s*)?\(");
        let mac = re!(r"([A-Za-z_]\w*)!\s*[(\[{]");
        let fun = re!(r"\bfn\s+(?:r#)?([A-Za-z_]\w*)");
        let body = re!(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:enum|struct|union)\s+\w+[^;]*\{\s*$");
        let member =
            re!(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:r#)?([A-Za-z_]\w*)\s*(?:[,({=]|:[^:]|$)");
        let package = re!(r#"(?m)^name\s*=\s*"([^"]+)""#);
        let dependency = re!(r"^([A-Za-z0-9_-]+)(?:\.[a-z]+)?\s*=");
        let toml_key = re!(r"(?m)^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=");
        repo.external
            .extend(["core", "std", "alloc"].map(String::from));
        for path in &paths {
            let rel = path.strip_prefix(&root).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            repo.by_name
                .entry(name.clone())
                .or_default()
                .push(path.clone());
            if path.is_dir() {
                if rel.components().any(|c| c.as_os_str() == "src") {
                    repo.modules.insert(name);
                }
                continue;
            }
            let Ok(text) = std::fs::read_to_string(path) else {
                continue;
            };
            if name == "Cargo.toml" {
                let dir = path.parent().unwrap();
                repo.bases.push(dir.to_path_buf());
                repo.bases.push(dir.join("src"));
                // The first `name` is the package's; the later ones are
                // binaries, named like modules.
                for (k, c) in package.captures_iter(&text).enumerate() {
                    if k == 0 {
                        repo.packages.insert(c[1].to_string());
                    }
                    repo.modules.insert(c[1].replace('-', "_"));
                }
                // Dependencies: keys of the dependency tables.
                let mut in_deps = false;
                for line in text.lines() {
                    let line = line.trim();
                    if line.starts_with('[') {
                        in_deps = line.contains("dependencies");
                        if let Some(dep) = line
                            .strip_prefix('[')
                            .and_then(|l| l.split_once("dependencies."))
                        {
                            let dep = dep.1.trim_end_matches(']');
                            repo.external.insert(dep.replace('-', "_"));
                        }
                    } else if in_deps {
                        if let Some(c) = dependency.captures(line) {
                            repo.external.insert(c[1].replace('-', "_"));
                        }
                    }
                }
            } else if name.ends_with(".toml") && rel.starts_with("guests") {
                repo.words
                    .extend(toml_key.captures_iter(&text).map(|c| c[1].to_string()));
            } else if name.ends_with(".rs") {
                repo.modules
                    .insert(name.trim_end_matches(".rs").to_string());
                if rel == Path::new("tests/tests/docs.rs") {
                    // This test: it misspells names on purpose.
                    continue;
                }
                let (code, literals) = lex(&text);
                // Attributes (`no_std`) and doctests' (```compile_fail).
                for line in text.lines() {
                    let line = line.trim_start();
                    if let Some(attribute) = line.strip_prefix("#!").or(line.strip_prefix('#')) {
                        repo.words.extend(words_of(attribute).map(String::from));
                    }
                    if let Some((_, fence)) = line.split_once("```") {
                        if line.starts_with("//") {
                            repo.words.extend(words_of(fence).map(String::from));
                        }
                    }
                }
                for c in def.captures_iter(&code) {
                    let name = c.get(1).or(c.get(2)).unwrap().as_str().to_string();
                    if c[0].starts_with("mod") {
                        repo.modules.insert(name.clone());
                    }
                    if c.get(2).is_some() {
                        repo.macros.insert(name.clone());
                    }
                    repo.defined.insert(name);
                }
                for c in fun.captures_iter(&code) {
                    repo.functions.insert(c[1].to_string());
                    repo.defined.insert(c[1].to_string());
                }
                repo.functions
                    .extend(call.captures_iter(&code).map(|c| c[1].to_string()));
                repo.macros
                    .extend(mac.captures_iter(&code).map(|c| c[1].to_string()));
                // Variants and fields: the first word of each line of an
                // enum's or a struct's body.
                let mut body_indent = None;
                for line in code.lines() {
                    let at = line.len() - line.trim_start().len();
                    match body_indent {
                        None if body.is_match(line) => body_indent = Some(at),
                        Some(b) if at <= b && !line.trim().is_empty() => body_indent = None,
                        Some(b) if at == b + 4 => {
                            if let Some(c) = member.captures(line) {
                                repo.defined.insert(c[1].to_string());
                            }
                        }
                        _ => {}
                    }
                }
                repo.idents.extend(words_of(&code).map(String::from));
                for literal in &literals {
                    repo.words.extend(words_of(literal).map(String::from));
                }
                if rel.starts_with("xtask") {
                    repo.xtask_literals.extend(literals.iter().cloned());
                }
                repo.code.push_str(&code);
                repo.code.push('\n');
            } else if text.starts_with("#!") {
                // A script: the words of its lines that are not comments.
                for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
                    repo.words.extend(words_of(line).map(String::from));
                }
            }
        }
        repo.bases.push(root.join("guests"));
        repo.bases.push(root.join("fuzz/fuzz_targets"));
        for package in &repo.packages {
            repo.modules.insert(package.replace('-', "_"));
        }
        // Our own crates are not external, even where one depends on another.
        for module in repo.packages.iter().map(|p| p.replace('-', "_")) {
            repo.external.remove(&module);
        }
        let main = std::fs::read_to_string(root.join("xtask/src/main.rs")).unwrap();
        repo.xtask = match_arms(&main, "match args.first()", "match args.get(1)");
        let shell = std::fs::read_to_string(root.join("hypervisor/src/console/shell.rs")).unwrap();
        let table = &shell[shell
            .find("pub const COMMANDS")
            .expect("the shell's COMMANDS")..];
        let usage = re!(r#"usage:\s*"([^"\s]+)"#);
        let table = &table[..table.find("];").unwrap_or(table.len())];
        repo.shell = usage
            .captures_iter(table)
            .map(|c| c[1].to_string())
            .collect();
        repo
    }

    fn get() -> &'static Repo {
        static REPO: OnceLock<Repo> = OnceLock::new();
        REPO.get_or_init(Repo::read)
    }
}

// ---------------------------------------------------------------------------
// The checks.

/// What one document names, checked; failures as `doc:line: message`.
#[derive(Default)]
struct Report {
    failures: Vec<String>,
    /// How many names of each kind were checked (so no check is vacuous).
    checked: BTreeMap<&'static str, usize>,
}

impl Report {
    fn fail(&mut self, doc: &str, line: usize, message: String) {
        let failure = format!("{doc}:{line}: {message}");
        if !self.failures.contains(&failure) {
            self.failures.push(failure);
        }
    }

    fn count(&mut self, kind: &'static str) {
        *self.checked.entry(kind).or_default() += 1;
    }
}

/// A path-looking token without its `:line` suffix and the line, or `None`
/// when the token is not a path of ours to check.
fn as_path(token: &str, extensions: &[&str]) -> Option<(String, Option<usize>)> {
    let line_suffix = re!(r"^(.*?)((?::\d+)+)$");
    let (path, line) = match line_suffix.captures(token) {
        Some(c) => (
            c[1].to_string(),
            c[2].split(':').nth(1).and_then(|n| n.parse().ok()),
        ),
        None => (token.to_string(), None),
    };
    let has_extension = Path::new(&path)
        .extension()
        .is_some_and(|e| extensions.contains(&&*e.to_string_lossy()));
    let looks_like_path = path.contains('/') || has_extension;
    let file_chars = path
        .chars()
        .all(|c| c.is_alphanumeric() || "_-./".contains(c));
    let placeholder = path.split('/').any(|part| {
        part.len() > 1 && part.chars().all(|c| c.is_ascii_uppercase())
            || part == ".."
            || part == "..."
    });
    let skip = !looks_like_path
        || !file_chars
        || placeholder
        || path.starts_with('/')
        || path.starts_with("target/")
        || path.starts_with('.') && !path.contains('/')
        || path.starts_with('-')
        || !path.chars().any(|c| c.is_alphabetic());
    (!skip).then_some((path, line))
}

/// Where `path` is in the repository, if anywhere.
fn find_path(repo: &Repo, path: &str) -> Vec<PathBuf> {
    let dir = path.ends_with('/');
    let rel = path.trim_end_matches('/');
    let mut found: Vec<PathBuf> = repo
        .bases
        .iter()
        .map(|base| base.join(rel))
        .filter(|p| if dir { p.is_dir() } else { p.exists() })
        .collect();
    if !rel.contains('/') {
        found.extend(repo.by_name.get(rel).into_iter().flatten().cloned());
    }
    found
}

fn check_path(
    repo: &Repo,
    report: &mut Report,
    doc: &str,
    line: usize,
    token: &str,
    path: &str,
    at: Option<usize>,
) {
    report.count("path");
    let found = find_path(repo, path);
    if found.is_empty() {
        report.fail(
            doc,
            line,
            format!("`{token}` names no file in the repository"),
        );
    } else if let Some(at) = at {
        let long_enough = found
            .iter()
            .any(|f| std::fs::read_to_string(f).is_ok_and(|t| t.lines().count() >= at));
        if !long_enough {
            report.fail(
                doc,
                line,
                format!("`{token}` points past the end of its file"),
            );
        }
    }
}

/// The Rust path a code span starts with (`vm::cpu::PhysCpu` of
/// `vm::cpu::PhysCpu::kick(..)`), its segments.
fn rust_path(span: &str) -> Option<Vec<String>> {
    let path =
        re!(r"^(?:crate::|self::|super::)*([A-Za-z_]\w*(?:::[A-Za-z_]\w*)+)").captures(span)?;
    Some(path[1].split("::").map(String::from).collect())
}

fn check_rust_path(
    repo: &Repo,
    report: &mut Report,
    doc: &str,
    line: usize,
    token: &str,
    segments: &[String],
) {
    if repo.external.contains(&segments[0]) {
        return;
    }
    report.count("rust path");
    let written = Regex::new(&format!(
        r"(^|[^\w:]){}\b",
        regex::escape(&segments.join("::"))
    ))
    .unwrap();
    if written.is_match(&repo.code) {
        return;
    }
    let last = segments.len() - 1;
    for (k, segment) in segments.iter().enumerate() {
        let lower = segment.starts_with(|c: char| c.is_ascii_lowercase());
        let known = if k == last {
            repo.defined.contains(segment) || repo.modules.contains(segment)
        } else if lower {
            repo.modules.contains(segment)
        } else {
            // An external type our code uses (`Hal::share` for our `share`).
            repo.defined.contains(segment) || repo.idents.contains(segment)
        };
        if !known {
            let what = if k == last {
                "no item, variant, field or module"
            } else if lower {
                "no module or crate"
            } else {
                "no type"
            };
            report.fail(
                doc,
                line,
                format!("`{token}` names no Rust item in the repository: `{segment}` is {what} the sources define"),
            );
            return;
        }
    }
}

/// A backticked name that can only be code, and which kind: `name()`,
/// `name!`, snake_case or SCREAMING_CASE with an underscore, CamelCase with
/// two humps; a trailing `*` asks for some name with that prefix.
fn code_name(span: &str) -> Option<(&'static str, String)> {
    let call = re!(r"^([A-Za-z_]\w*)\(");
    let mac = re!(r"^([A-Za-z_]\w*)!$");
    let snake = re!(r"^(_?[a-z][a-z0-9]*(?:_[a-z0-9]+)*(?:_\*)?)$");
    let scream = re!(r"^([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*(?:_\*)?)$");
    let camel = re!(r"^((?:[A-Z][a-z0-9]+){2,})$");
    if let Some(c) = call.captures(span) {
        Some(("function", c[1].to_string()))
    } else if let Some(c) = mac.captures(span) {
        Some(("macro", c[1].to_string()))
    } else if let Some(c) = snake.captures(span).filter(|_| span.contains('_')) {
        Some(("snake", c[1].to_string()))
    } else if let Some(c) = scream.captures(span).filter(|_| span.contains('_')) {
        Some(("constant", c[1].to_string()))
    } else {
        camel.captures(span).map(|c| ("type", c[1].to_string()))
    }
}

fn check_code_name(
    repo: &Repo,
    report: &mut Report,
    doc: &str,
    line: usize,
    kind: &str,
    name: &str,
) {
    // A crate the workspace depends on (`buddy_system_allocator`).
    if EXTERNAL_NAMES.contains(&name) || repo.external.contains(name) {
        return;
    }
    report.count("name");
    // The virtio specification's VIRTIO_BALLOON_F_STATS_VQ is the code's
    // STATS_VQ.
    let name = match name.split_once("_F_") {
        Some((spec, ours)) if spec.starts_with("VIRTIO_") => ours,
        _ => name,
    };
    let sets: Vec<&BTreeSet<String>> = match kind {
        "function" => vec![&repo.functions, &repo.defined],
        "macro" => vec![&repo.macros],
        "snake" => vec![&repo.defined, &repo.functions, &repo.modules, &repo.words],
        _ => vec![&repo.defined, &repo.idents, &repo.words],
    };
    let known = match name.strip_suffix('*') {
        Some(prefix) => sets.iter().any(|s| {
            s.range(prefix.to_string()..)
                .next()
                .is_some_and(|n| n.starts_with(prefix))
        }),
        // A bundle field (`vm_entry_size`) is named by the const of its
        // offset (`VM_ENTRY_SIZE`).
        None => {
            sets.iter().any(|s| s.contains(name))
                || kind == "snake" && repo.defined.contains(&name.to_uppercase())
        }
    };
    if !known {
        let (shown, what) = match kind {
            "function" => (
                format!("{name}()"),
                "no function the sources define or call",
            ),
            "macro" => (format!("{name}!"), "no macro the sources define or use"),
            _ => (name.to_string(), "nothing the sources define, use or quote"),
        };
        report.fail(doc, line, format!("`{shown}` names {what}"));
    }
}

/// The `cargo xtask` commands in a text: each subcommand with the words
/// after it, up to the end of the command (a comment, a pipe, `--`, or
/// punctuation that ends a sentence).
fn xtask_commands(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices("cargo xtask") {
        let rest = &text[at + "cargo xtask".len()..];
        if !rest.starts_with(char::is_whitespace) {
            continue;
        }
        let mut words = Vec::new();
        for word in rest.split_whitespace() {
            if word.starts_with('#') || matches!(word, "--" | "|" | "&&" | ";" | ">" | "\\") {
                break;
            }
            let trimmed = word.trim_end_matches([')', ',', '.', ';', ':', '`', '\'', '"']);
            let trimmed = trimmed.trim_matches(['[', ']']);
            if !trimmed.is_empty() {
                words.push(trimmed.to_string());
            }
            if trimmed.len() < word.trim_matches(['[', ']']).len() {
                break;
            }
        }
        let sub = words.first().cloned().unwrap_or_default();
        if sub.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.push((sub, words[1..].to_vec()));
        }
    }
    out
}

fn check_xtask(repo: &Repo, report: &mut Report, doc: &str, line: usize, text: &str) {
    for (sub, args) in xtask_commands(text) {
        report.count("xtask");
        let Some(subs) = repo.xtask.get(&sub) else {
            report.fail(
                doc,
                line,
                format!("`cargo xtask {sub}`: `{sub}` is not an xtask command (xtask/src/main.rs's match)"),
            );
            continue;
        };
        if let Some(second) = args.first().filter(|a| !a.starts_with('-')) {
            if !subs.is_empty()
                && second.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                && !subs.contains(second)
            {
                report.fail(
                    doc,
                    line,
                    format!("`cargo xtask {sub} {second}`: `{second}` is not one of `cargo xtask {sub}`'s commands"),
                );
            }
        }
        for flag in args.iter().filter(|a| a.starts_with('-') && a.len() > 1) {
            let flag = flag.split('=').next().unwrap();
            if !repo.xtask_literals.contains(flag) {
                report.fail(
                    doc,
                    line,
                    format!("`cargo xtask {sub} {flag}`: xtask's sources have no `{flag}`"),
                );
            }
        }
    }
}

/// The packages `cargo ... -p NAME` names.
fn cargo_packages(text: &str) -> Vec<String> {
    re!(r"\bcargo\s+[a-z]+\b[^#|`]*?\s-p\s+([A-Za-z0-9_-]+)")
        .captures_iter(text)
        .map(|c| c[1].to_string())
        .collect()
}

/// The shell command of a `tidal> ` line or span.
fn shell_command(text: &str) -> Option<&str> {
    text.trim_start()
        .strip_prefix("tidal> ")?
        .split_whitespace()
        .next()
}

/// Checks one document; `doc` is its path for the messages.
fn check_document(repo: &Repo, doc: &str, text: &str, report: &mut Report) {
    let file_word = re!(r"(?:^|[^\w./~<>*-])([\w./~<>*-]*\w\.(?:rs|md|toml|ld)(?::\d+)*)\b");
    for piece in pieces(text) {
        let (line, t) = (piece.line, piece.text.as_str());
        check_xtask(repo, report, doc, line, t);
        for package in cargo_packages(t) {
            report.count("package");
            if !repo.packages.contains(&package) {
                report.fail(
                    doc,
                    line,
                    format!("`-p {package}` names no package of the workspace"),
                );
            }
        }
        if piece.kind != Kind::Prose {
            if let Some(command) = shell_command(t) {
                report.count("shell");
                if !repo.shell.contains(command) {
                    report.fail(
                        doc,
                        line,
                        format!("`tidal> {command}`: `{command}` is not in the shell's command table (hypervisor/src/console/shell.rs)"),
                    );
                }
            }
        }
        match piece.kind {
            // A span of several words is checked only for what it starts
            // with: a Rust path or a call (`decode(vector, esr)`).
            Kind::Span => {
                let one_word = !t.contains(char::is_whitespace);
                if let Some((path, at)) = as_path(t, SOURCE_EXTENSIONS).filter(|_| one_word) {
                    check_path(repo, report, doc, line, t, &path, at);
                } else if let Some(segments) = rust_path(t) {
                    check_rust_path(repo, report, doc, line, t, &segments);
                } else if let Some((kind, name)) =
                    code_name(t).filter(|(kind, _)| one_word || *kind == "function")
                {
                    check_code_name(repo, report, doc, line, kind, &name);
                }
            }
            // In code blocks and prose, source files only: a `.toml` in a
            // code block is often the reader's own (`my.toml`).
            Kind::Code | Kind::Prose => {
                let extensions: &[&str] = if piece.kind == Kind::Code {
                    &["rs", "ld", "md"]
                } else {
                    &["rs", "ld", "md", "toml"]
                };
                for c in file_word.captures_iter(t) {
                    let token = &c[1];
                    if let Some((path, at)) = as_path(token, extensions) {
                        if extensions.iter().any(|e| path.ends_with(&format!(".{e}"))) {
                            check_path(repo, report, doc, line, token, &path, at);
                        }
                    }
                }
            }
        }
    }
}

/// The documents: the top-level README, docs/*.md, the READMEs below.
fn documents() -> Vec<String> {
    let root = workspace_root();
    let mut docs = vec!["README.md".to_string()];
    let mut paths = Vec::new();
    walk(&root, &mut paths);
    let mut more: Vec<String> = paths
        .iter()
        .map(|p| {
            p.strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|p| {
            let name = p.rsplit('/').next().unwrap();
            (p.starts_with("docs/") && p.ends_with(".md") && !p[5..].contains('/'))
                || (p.contains('/') && name.starts_with("README") && name.ends_with(".md"))
        })
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

#[test]
fn every_name_in_the_documents_exists() {
    let repo = Repo::get();
    let docs = documents();
    assert!(
        docs.iter().any(|d| d == "docs/ARCHITECTURE.md") && docs.len() > 5,
        "the documents are found: {docs:?}"
    );
    let mut report = Report::default();
    for doc in &docs {
        let text = std::fs::read_to_string(repo.root.join(doc)).unwrap();
        check_document(repo, doc, &text, &mut report);
    }
    for (kind, least) in [
        ("path", 100),
        ("rust path", 50),
        ("name", 100),
        ("xtask", 30),
        ("shell", 10),
        ("package", 1),
    ] {
        let n = report.checked.get(kind).copied().unwrap_or(0);
        assert!(
            n >= least,
            "only {n} names of kind {kind} checked: {:?}",
            report.checked
        );
    }
    assert!(
        report.failures.is_empty(),
        "{} name(s) in the documents that the repository does not have:\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
}

// ---------------------------------------------------------------------------
// The extraction, and that the checks fail on what does not exist.

#[test]
fn code_spans_are_found_across_lines_and_outside_code_blocks() {
    let doc = "See `vm/bus.rs` and ``a ` b``, then `cargo xtask\n  bench linux`.\n\n```sh\ncargo xtask run `x`\n```\nunclosed ` tick\n| `a | b |\n| `c` |\n";
    let spans: Vec<_> = pieces(doc)
        .into_iter()
        .filter(|p| p.kind != Kind::Prose)
        .map(|p| (p.line, p.kind, p.text))
        .collect();
    assert_eq!(
        spans,
        vec![
            (1, Kind::Span, "vm/bus.rs".to_string()),
            (1, Kind::Span, "a ` b".to_string()),
            (1, Kind::Span, "cargo xtask bench linux".to_string()),
            (5, Kind::Code, "cargo xtask run `x`".to_string()),
            // A table row's spans end with it.
            (9, Kind::Span, "c".to_string()),
        ]
    );
    let prose: Vec<_> = pieces(doc)
        .into_iter()
        .filter(|p| p.kind == Kind::Prose)
        .map(|p| p.text.trim_end().to_string())
        .collect();
    let blank = |n| " ".repeat(n);
    assert_eq!(
        prose[0],
        format!("See {} and {}, then", blank(11), blank(9))
    );
    assert!(prose.contains(&"unclosed ` tick".to_string()), "{prose:?}");
}

#[test]
fn paths_items_and_names_are_told_apart() {
    assert_eq!(
        as_path("vm/bus.rs", SOURCE_EXTENSIONS),
        Some(("vm/bus.rs".into(), None))
    );
    assert_eq!(
        as_path("vm/handle.rs:380", SOURCE_EXTENSIONS),
        Some(("vm/handle.rs".into(), Some(380)))
    );
    assert_eq!(
        as_path("run.rs", SOURCE_EXTENSIONS),
        Some(("run.rs".into(), None))
    );
    assert_eq!(
        as_path("guests/tests/", SOURCE_EXTENSIONS),
        Some(("guests/tests/".into(), None))
    );
    for not_ours in [
        "target/guests.img",
        "/proc/vmstat",
        "tests/<name>.toml",
        "fuzz/seeds/TARGET",
        "lib/modules/*",
        "~/vms/Image",
        ".toml",
        "kernel8.img",
        "vm::bus::write",
        "a b/c",
    ] {
        assert_eq!(as_path(not_ours, SOURCE_EXTENSIONS), None, "{not_ours}");
    }
    assert_eq!(
        rust_path("vm::cpu::PhysCpu"),
        Some(vec!["vm".into(), "cpu".into(), "PhysCpu".into()])
    );
    assert_eq!(
        rust_path("smccc::psci::cpu_on::<Smc>"),
        Some(vec!["smccc".into(), "psci".into(), "cpu_on".into()])
    );
    assert_eq!(rust_path("back_page()"), None);
    assert_eq!(
        code_name("back_page()"),
        Some(("function", "back_page".into()))
    );
    assert_eq!(
        code_name("negotiate(offered, wanted)"),
        Some(("function", "negotiate".into()))
    );
    assert_eq!(code_name("run_vcpu"), Some(("snake", "run_vcpu".into())));
    assert_eq!(code_name("mem_*"), Some(("snake", "mem_*".into())));
    assert_eq!(
        code_name("FREE_BATCH"),
        Some(("constant", "FREE_BATCH".into()))
    );
    assert_eq!(code_name("GuestRam"), Some(("type", "GuestRam".into())));
    assert_eq!(
        code_name("trace_event!"),
        Some(("macro", "trace_event".into()))
    );
    for not_code in ["mm", "Balloon", "WAIT", "MiB", "free-page-hint", "pool.min"] {
        assert_eq!(code_name(not_code), None, "{not_code}");
    }
}

#[test]
fn commands_are_parsed_with_their_flags() {
    assert_eq!(
        xtask_commands("cargo xtask run --board raspi4b"),
        vec![(
            "run".to_string(),
            vec!["--board".to_string(), "raspi4b".to_string()]
        )]
    );
    assert_eq!(
        xtask_commands("cargo xtask trace [--board B] [--bundle NAME]"),
        vec![(
            "trace".to_string(),
            ["--board", "B", "--bundle", "NAME"]
                .map(String::from)
                .to_vec()
        )]
    );
    assert_eq!(
        xtask_commands("components are added by cargo xtask setup) and --more"),
        vec![("setup".to_string(), vec![])]
    );
    assert_eq!(
        xtask_commands("cargo xtask sdcard --tests   # the --on-target tests"),
        vec![("sdcard".to_string(), vec!["--tests".to_string()])]
    );
    assert!(xtask_commands("the `cargo xtask` alias").is_empty());
    assert_eq!(
        cargo_packages("cargo test -p guest-driver"),
        vec!["guest-driver"]
    );
    assert_eq!(
        shell_command("tidal> info balloon linux   # target"),
        Some("info")
    );
    assert_eq!(shell_command("tidal>"), None);
    let main = "    let r = match args.first() {\n        Some(\"run\") => run(),\n        Some(\"bench\") => {\n            match args.get(1) {\n                None => a(),\n                Some(\"linux\") => b(),\n            }\n        }\n        Some(\"help\") | None => h(),\n    };\n";
    let arms = match_arms(main, "match args.first()", "match args.get(1)");
    assert_eq!(arms.keys().collect::<Vec<_>>(), ["bench", "help", "run"]);
    assert_eq!(arms["bench"].iter().collect::<Vec<_>>(), ["linux"]);
}

#[test]
fn the_lexer_drops_comments_and_keeps_literals() {
    let (code, literals) = lex(
        "fn a() { // b_c\n let s = \"x \\\"y\\\"\"; /* d /* e */ f */ 'g'; r#\"h\"#; }\n'static",
    );
    assert!(code.contains("fn a()") && code.contains("'static"));
    assert!(!code.contains("b_c") && !code.contains('d') && !code.contains('h'));
    assert_eq!(literals, vec!["x \"y\"".to_string(), "h".to_string()]);
}

/// The repository's own knowledge answers: what exists passes, and a
/// misspelt path, item, function, xtask command and flag, and shell
/// command each fail, so the main test cannot pass vacuously.
#[test]
fn misspelt_names_fail() {
    let repo = Repo::get();
    assert!(repo.xtask.contains_key("run") && repo.xtask["bench"].contains("linux"));
    assert!(repo.shell.contains("balloon") && repo.shell.contains("mm"));
    assert!(repo.xtask_literals.contains("--board"));
    let good = "`vm/bus.rs` `docs/CONFIGURATION.md` `guests/tests/overcommit.toml` `tests/tests/layers.rs` \
                `vm::cpu::PhysCpu` `vm::testing::FakeCpu` `FrameTable::set_inflating` `run.rs` \
                `wait_for_interrupt_or` `back_page()` `FREE_BATCH` `GuestRam` `checked_add` \
                `cargo xtask run --board raspi4b` `cargo xtask bench linux` `tidal> balloon linux 0` \
                vm/handle.rs and mm/manager.rs\n";
    let mut report = Report::default();
    check_document(repo, "good.md", good, &mut report);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let bad = [
        ("`vm/buss.rs`", "`vm/buss.rs` names no file"),
        ("`runn.rs`", "`runn.rs` names no file"),
        ("see vm/hanlde.rs for it", "`vm/hanlde.rs` names no file"),
        ("`vm::cpu::PhysCpuu`", "`PhysCpuu` is no item"),
        ("`vm::cpuu::PhysCpu`", "`cpuu` is no module"),
        ("`back_pagee()`", "`back_pagee()` names no function"),
        (
            "`wait_for_interupt_or`",
            "`wait_for_interupt_or` names nothing",
        ),
        ("`FREE_BATCHES`", "`FREE_BATCHES` names nothing"),
        ("`GuestRan`", "`GuestRan` names nothing"),
        ("`cargo xtask rum`", "`rum` is not an xtask command"),
        ("`cargo xtask run --bord raspi4b`", "have no `--bord`"),
        ("`cargo xtask bench linx`", "`linx` is not one of"),
        (
            "`tidal> balloom linux 0`",
            "`balloom` is not in the shell's command table",
        ),
        (
            "`cargo test -p guest-drivers`",
            "`-p guest-drivers` names no package",
        ),
        ("`vm/handle.rs:99999`", "points past the end"),
    ];
    for (text, expected) in bad {
        let mut report = Report::default();
        check_document(repo, "bad.md", text, &mut report);
        assert!(
            report.failures.len() == 1 && report.failures[0].contains(expected),
            "{text}: {:?}",
            report.failures
        );
        assert!(
            report.failures[0].starts_with("bad.md:1: "),
            "{:?}",
            report.failures
        );
    }
}
