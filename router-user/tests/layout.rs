//! The crate's layout rules (ARCHITECTURE.md, "Which folder may use which"),
//! checked on the source: every `crate::` path a module names must be one
//! its folder may use, and no two modules may use each other, directly or
//! around a loop. A module and the private submodules it declares
//! (`mod probe;`) count as one: they are one file's parts. The workspace's
//! other crates (benches, tests, xtask) are checked for loops too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level part of the crate may use besides itself.
const MAY_USE: &[(&str, &[&str])] = &[
    ("error", &[]),
    ("http", &["error"]),
    ("prompt", &["error"]),
    ("policy", &[]),
    ("replica", &[]),
    ("fleet", &["error", "policy"]),
    ("precise", &["error", "prompt", "fleet", "policy"]),
    (
        "config",
        &["error", "http", "prompt", "fleet", "policy", "precise"],
    ),
    (
        "metrics",
        &[
            "error", "config", "prompt", "fleet", "policy", "precise", "replica",
        ],
    ),
    (
        "shared",
        &[
            "error", "config", "prompt", "fleet", "policy", "precise", "metrics", "replica",
        ],
    ),
    (
        "proxy",
        &[
            "error", "http", "config", "prompt", "fleet", "policy", "precise", "metrics", "shared",
            "replica",
        ],
    ),
    (
        "epp",
        &[
            "error", "http", "config", "prompt", "fleet", "policy", "precise", "metrics", "shared",
            "replica",
        ],
    ),
    (
        "control",
        &[
            "error", "http", "config", "prompt", "fleet", "policy", "precise", "metrics", "shared",
            "replica", "proxy",
        ],
    ),
    (
        "app",
        &[
            "error", "http", "config", "prompt", "fleet", "policy", "precise", "metrics", "shared",
            "replica", "proxy", "control", "epp",
        ],
    ),
];

struct Module {
    /// `proxy::conn`, `policy::select`, `shared`.
    path: String,
    /// What it names with `crate::`, outside its tests.
    uses: BTreeSet<String>,
    /// Submodules it declares without `pub`: parts of it.
    private_children: Vec<String>,
}

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading src") {
        let p = entry.expect("dir entry").path();
        if p.is_dir() {
            source_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn module_path(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    match parts.as_slice() {
        [one] if one == "lib" || one == "main" => None,
        _ if parts.last().is_some_and(|l| l == "tests") => None,
        _ => Some(parts.join("::")),
    }
}

/// The code before its `#[cfg(test)]` module, without comments.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or(text);
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::a::b` path in `code`, braces expanded one level
/// (`crate::{a, b::c}`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(inner) = rest.strip_prefix('{') {
            let end = inner.find('}').unwrap_or(inner.len());
            for item in inner[..end].split(',') {
                out.push(path_prefix(item.trim()));
            }
        } else {
            out.push(path_prefix(rest));
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

fn path_prefix(s: &str) -> String {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(s.len());
    s[..end].trim_end_matches(':').to_owned()
}

fn load() -> BTreeMap<String, Module> {
    load_from(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// The modules of the crate whose sources are under `src`.
fn load_from(src: &Path) -> BTreeMap<String, Module> {
    let src = src.to_path_buf();
    let mut files = Vec::new();
    source_files(&src, &mut files);
    let mut modules = BTreeMap::new();
    for f in files {
        let Some(path) = module_path(&src, &f) else {
            continue;
        };
        let text = std::fs::read_to_string(&f).expect("reading a source file");
        let code = code_of(&text);
        let private_children = code
            .lines()
            .filter_map(|l| l.trim().strip_prefix("mod "))
            .map(|m| format!("{path}::{}", m.trim_end_matches(';').trim()))
            .collect();
        let uses = crate_paths(&code).into_iter().collect();
        modules.insert(
            path.clone(),
            Module {
                path,
                uses,
                private_children,
            },
        );
    }
    modules
}

/// The module a `crate::` path lands in: its longest prefix that is one.
fn target<'a>(modules: &'a BTreeMap<String, Module>, path: &str) -> Option<&'a str> {
    let mut p = path;
    loop {
        if let Some(m) = modules.get(p) {
            return Some(&m.path);
        }
        p = &p[..p.rfind("::")?];
    }
}

fn top(path: &str) -> &str {
    path.split("::").next().unwrap_or(path)
}

#[test]
fn every_folder_uses_only_what_it_may() {
    let modules = load();
    assert!(
        modules.len() > 30 && modules.contains_key("proxy::forward"),
        "the layout test found {} modules: it is not reading the crate",
        modules.len()
    );
    // The routing core's three rooms, each where ARCHITECTURE.md says.
    for m in ["prompt::scan", "fleet::index", "policy::select", "shared"] {
        assert!(
            modules.contains_key(m),
            "{m} is not where the code map says"
        );
    }
    let mut wrong = Vec::new();
    for m in modules.values() {
        let from = top(&m.path);
        let may = MAY_USE
            .iter()
            .find(|(t, _)| *t == from)
            .unwrap_or_else(|| panic!("{from} is not in MAY_USE: add its rule"))
            .1;
        for u in &m.uses {
            let to = top(u);
            if to != from && !may.contains(&to) {
                wrong.push(format!("{} uses crate::{u}", m.path));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the folder rule in ARCHITECTURE.md:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_module_uses_itself_through_another() {
    let modules = load();
    let (edges, cycle) = cycle_of(&modules);
    let count: usize = edges.values().map(BTreeSet::len).sum();
    assert!(count > 40, "only {count} dependencies found");
    if let Some(cycle) = cycle {
        panic!("module cycle: {}", cycle.join(" -> "));
    }
}

/// The workspace's other crates hold no module cycle either.
#[test]
fn no_crate_of_the_workspace_has_a_module_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    // `common` is one file.
    for krate in ["benches", "tests", "xtask"] {
        let src = root.join(krate).join("src");
        let modules = load_from(&src);
        assert!(!modules.is_empty(), "no modules under {}", src.display());
        let (edges, cycle) = cycle_of(&modules);
        checked += edges.values().map(BTreeSet::len).sum::<usize>();
        if let Some(cycle) = cycle {
            panic!("module cycle in {krate}: {}", cycle.join(" -> "));
        }
    }
    assert!(checked > 20, "only {checked} dependencies found");
}

/// The dependencies between the modules (a private submodule counts as
/// its parent), and a loop among them if there is one.
type Edges = BTreeMap<String, BTreeSet<String>>;

fn cycle_of(modules: &BTreeMap<String, Module>) -> (Edges, Option<Vec<String>>) {
    // A private submodule is part of its parent.
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for m in modules.values() {
        for c in &m.private_children {
            if modules.contains_key(c) {
                owner.insert(c.clone(), m.path.clone());
            }
        }
    }
    let unit = |p: &str| -> String {
        let mut p = p.to_owned();
        while let Some(o) = owner.get(&p) {
            p = o.clone();
        }
        p
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in modules.values() {
        let from = unit(&m.path);
        for u in &m.uses {
            if let Some(t) = target(modules, u) {
                let to = unit(t);
                if to != from {
                    edges.entry(from.clone()).or_default().insert(to);
                }
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = stack.iter().position(|s| s == n).unwrap_or(0);
                let mut cycle = stack[at..].to_vec();
                cycle.push(n.to_owned());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(n.to_owned(), 1);
        stack.push(n.to_owned());
        for next in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, edges, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if let Some(cycle) = visit(n, &edges, &mut state, &mut Vec::new()) {
            return (edges, Some(cycle));
        }
    }
    (edges, None)
}
