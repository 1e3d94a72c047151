//! The repository stands alone: no file in it reads or points at a path outside it, so
//! a fresh clone builds, tests and documents itself. Scans every text file of the work tree
//! (build folders `target*` and `.git` excepted) for two kinds of escape:
//! - a relative path whose `../` steps climb above the repository root, counted from the file's
//!   folder and from its crate's root (`env!("CARGO_MANIFEST_DIR")` paths start there);
//! - a named place that only exists on a developer's machine (the team's notes folder beside the
//!   repository, or an absolute path into the developers' work area).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Every file under `dir`, skipping `.git` and build output (`target`, `target-*`).
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        // `.git` is a folder in a clone and a file (pointing outside) in a work tree or submodule.
        if name == ".git" {
            continue;
        }
        if path.is_dir() {
            if !name.starts_with("target") {
                files(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

/// Depth below the repository root of the folder relative paths in `file` start from: the
/// shallower of the file's own folder and its crate root (the nearest folder below the
/// repository root with a Cargo.toml; the root's is the workspace's, not a crate's).
fn anchor_depth(root: &Path, file: &Path) -> usize {
    let dir = file.parent().unwrap();
    let depth = |d: &Path| d.strip_prefix(root).unwrap().components().count();
    let crate_root = dir
        .ancestors()
        .take_while(|d| d.starts_with(root) && *d != root)
        .find(|d| d.join("Cargo.toml").is_file());
    crate_root.map_or(depth(dir), |c| depth(c).min(depth(dir)))
}

/// The longest run of consecutive `../` steps in `text`, with the line it is on.
fn deepest_climb(text: &str) -> Option<(usize, usize)> {
    let step = ["..", "/"].concat();
    let mut best: Option<(usize, usize)> = None;
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find(&step) {
            let mut k = 0;
            let mut tail = &rest[i..];
            while let Some(t) = tail.strip_prefix(&step) {
                k += 1;
                tail = t;
            }
            if best.is_none_or(|(b, _)| k > b) {
                best = Some((k, n + 1));
            }
            rest = tail;
        }
    }
    best
}

/// Offending places in the work tree, as `path:line: why`.
fn escapes() -> Vec<String> {
    let root = root();
    let mut all = Vec::new();
    files(&root, &mut all);
    // Spelled in pieces so that this file does not match itself.
    let outside = [
        ["..", "/shared"].concat(),
        ["shared", "/cases"].concat(),
        ["shared", "/DESIGN"].concat(),
        ["/work", "/"].concat(),
    ];
    let mut found = Vec::new();
    for path in all {
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let rel = path.strip_prefix(&root).unwrap().display().to_string();
        for (n, line) in text.lines().enumerate() {
            if let Some(needle) = outside.iter().find(|s| line.contains(s.as_str())) {
                found.push(format!("{rel}:{}: names `{needle}`, outside the repository", n + 1));
            }
        }
        let depth = anchor_depth(&root, &path);
        if let Some((k, line)) = deepest_climb(&text).filter(|&(k, _)| k > depth) {
            found.push(format!("{rel}:{line}: climbs {k} folders up from depth {depth}"));
        }
    }
    found
}

#[test]
fn no_file_refers_to_a_path_outside_the_repository() {
    let found = escapes();
    assert!(found.is_empty(), "files that leave the repository:\n{}", found.join("\n"));
}

#[test]
fn the_scan_catches_a_path_that_climbs_out() {
    let climb = ["..", "/"].concat().repeat(3);
    assert_eq!(deepest_climb(&format!("a\nlet p = \"{climb}x\";\n")), Some((3, 2)));
    assert_eq!(deepest_climb("no climbing here"), None);
    let root = root();
    // A test file two folders below its crate root climbs at most two folders.
    assert_eq!(anchor_depth(&root, &root.join("crates/graphpp/tests/repository.rs")), 2);
    assert_eq!(anchor_depth(&root, &root.join("README.md")), 0);
    // A page in docs/ links its neighbours from its own folder.
    assert_eq!(anchor_depth(&root, &root.join("docs/cli/train.md")), 2);
}

/// The sections that files cite as `docs/ARCHITECTURE.md` … "Section" (a heading, or a bold
/// paragraph title), as `(citing file, section)`.
fn cited_sections() -> Vec<(String, String)> {
    let root = root();
    let mut all = Vec::new();
    files(&root.join("crates"), &mut all);
    let mut cited = Vec::new();
    let doc = ["ARCHITECTURE", ".md"].concat();
    for path in all {
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (i, _) in text.match_indices(&doc) {
            let after = text[i + doc.len()..].trim_start_matches(['`', ',', ' ']);
            if let Some((quoted, _)) = after.strip_prefix('"').and_then(|q| q.split_once('"')) {
                // A citation may wrap onto the next comment line.
                let words: Vec<&str> =
                    quoted.split_whitespace().filter(|w| !matches!(*w, "//" | "///" | "//!")).collect();
                cited.push((path.strip_prefix(&root).unwrap().display().to_string(), words.join(" ")));
            }
        }
    }
    cited
}

#[test]
fn every_cited_section_of_the_architecture_document_exists() {
    let doc = std::fs::read_to_string(root().join("docs").join(["ARCHITECTURE", ".md"].concat())).unwrap();
    let titles: Vec<&str> = doc
        .lines()
        .filter_map(|l| l.trim_start_matches('#').strip_prefix(' ').filter(|_| l.starts_with('#')))
        .chain(
            doc.match_indices("**")
                .collect::<Vec<_>>()
                .chunks(2)
                .filter(|c| c.len() == 2)
                .map(|c| &doc[c[0].0 + 2..c[1].0]),
        )
        .collect();
    let cited = cited_sections();
    assert!(cited.len() >= 20, "only {} citations found: the scan is broken", cited.len());
    let missing: Vec<String> = cited
        .iter()
        .filter(|(_, s)| !titles.contains(&s.as_str()))
        .map(|(f, s)| format!("{f}: \"{s}\""))
        .collect();
    assert!(missing.is_empty(), "cited sections missing from docs/ARCHITECTURE.md:\n{}", missing.join("\n"));
}
