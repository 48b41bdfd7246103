//! Modules only import downwards. In the pure core crate (`crates/core`): the resource types
//! (`api`), the clock and `seen` < the whereabouts domain (`ipam`) < test fixtures < the
//! decisions (`rules`) < `index` < which fences lift (`lifts`). In `ipreclaim`, over the core: the flags < `telemetry` < listing pages (and pod pages in protobuf)
//! and the watch retry < `release` < the programs (`controller`, `node`) < `scan`, and the
//! programs not from each other. The core depends on no async runtime and no API client (its
//! manifest names neither); `podlife` knows nothing of Kubernetes.

use std::path::{Path, PathBuf};

/// The core's layers, from the ground up: a module imports only from the layers below its own,
/// never from a module beside it in its layer or above it.
const CORE_LAYERS: &[&[&str]] = &[
    &["api", "clock", "seen"],
    &["ipam"],
    &["fixtures"],
    &["rules"],
    &["index"],
    &["lifts"],
];

/// `ipreclaim`'s layers over the core (which they all may import).
const LAYERS: &[&[&str]] = &[
    &["flags"],
    &["telemetry"],
    &["client_layer"],
    &["request_deadline"],
    &["paged", "protobuf_lists", "watch_retry"],
    &["release"],
    &["controller", "node"],
    &["scan"],
];

/// (module, modules it must not import), from `layers`.
fn rules(layers: &[&[&'static str]]) -> Vec<(&'static str, Vec<&'static str>)> {
    let mut out = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        for module in *layer {
            let beside = layer.iter().filter(|m| *m != module);
            let above = layers[i + 1..].iter().flat_map(|l| l.iter());
            out.push((*module, beside.chain(above).copied().collect()));
        }
    }
    out
}

/// What the core must not use (an async runtime, an API client), in its code or its manifest.
const IMPURE: &[&str] = &[
    "tokio",
    "kube::Client",
    "kube::Api",
    "kube::api::Api",
    "reqwest",
];

fn sources(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        out.push(path.to_owned());
        return;
    }
    for entry in std::fs::read_dir(path).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A module's files: `src/<m>/` or `src/<m>.rs`.
fn module_files(src: &Path, module: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for path in [src.join(module), src.join(format!("{module}.rs"))] {
        if path.exists() {
            sources(&path, &mut files);
        }
    }
    assert!(!files.is_empty(), "no sources for module {module}");
    files
}

/// The crate modules a source imports: `crate::m::`, `crate::m;` and grouped
/// `crate::{m, n::x, ...}` (nested braces included).
fn imported_modules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group, up to its closing brace.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(first_segment(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(first_segment(&item));
        } else {
            out.push(first_segment(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn first_segment(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

#[test]
fn grouped_imports_are_read() {
    let text = "use crate::{api::IPPool, index::{Index, kinds}, node};\nuse crate::scan;";
    assert_eq!(imported_modules(text), ["api", "index", "node", "scan"]);
}

/// The imports of `src`'s modules against `layers`.
fn against_layering(src: &Path, layers: &[&[&'static str]]) -> Vec<String> {
    let mut found = Vec::new();
    for (module, forbidden) in rules(layers) {
        for file in module_files(src, module) {
            let text = std::fs::read_to_string(&file).unwrap();
            for m in imported_modules(&text) {
                if forbidden.contains(&m.as_str()) {
                    found.push(format!("{} imports crate::{m}", file.display()));
                }
            }
        }
    }
    found
}

#[test]
fn modules_import_only_downwards() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = against_layering(&root.join("crates/core/src"), CORE_LAYERS);
    found.extend(against_layering(&root.join("src"), LAYERS));
    assert!(
        found.is_empty(),
        "imports against the layering:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_forbidden_import_is_found() {
    let dir = std::env::temp_dir().join(format!("layers-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("ipam")).unwrap();
    std::fs::write(dir.join("api.rs"), "use crate::ipam::x;").unwrap();
    std::fs::write(dir.join("ipam/mod.rs"), "use crate::api::y;").unwrap();
    let found = against_layering(&dir, &[&["api"], &["ipam"]]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].ends_with("api.rs imports crate::ipam"),
        "{found:?}"
    );
}

/// Where `files` use any of `words` (as a path: `word::` or `word;`).
fn uses(files: &[PathBuf], words: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap();
        for word in words {
            let word = word.trim_end_matches("::");
            if text.contains(&format!("{word}::")) || text.contains(&format!("{word};")) {
                found.push(format!("{} uses {word}", file.display()));
            }
        }
    }
    found
}

#[test]
fn the_core_uses_no_runtime_and_no_client() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/core");
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    let mut found = uses(&files, IMPURE);
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let dependencies = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("the core's [dependencies]");
    for line in dependencies.lines() {
        let name = line.split(['=', '.']).next().unwrap_or("").trim();
        if [
            "tokio",
            "kube",
            "kube-client",
            "reqwest",
            "podlife",
            "hyper",
        ]
        .contains(&name)
        {
            found.push(format!("crates/core/Cargo.toml depends on {name}"));
        }
    }
    assert!(found.is_empty(), "impure core:\n{}", found.join("\n"));
}

#[test]
fn podlife_knows_nothing_of_kubernetes_or_ipreclaim() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/podlife/src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let found = uses(&files, &["kube", "k8s_openapi", "ipreclaim"]);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The writer's parts that reach the index only through the ledger (`release::ledger`): the
/// writer itself and its three jobs. `manual` plans over an index of its own (the manual
/// commands' fresh read) and `inventories` reads no index: neither is listed.
const WRITER_PARTS: &[&str] = &["writer.rs", "ledger.rs", "pools", "objects", "reports"];

/// What reaching into the index looks like (types that only carry data, such as a missing
/// reservation found by the sweep, are not the index).
const INDEX_HANDLES: &[&str] = &[
    "SharedIndex",
    "IndexLock",
    "index::Index",
    "Index,",
    "Index}",
];

#[test]
fn the_writer_asks_and_tells_only_through_its_ledger() {
    let release = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/release");
    let mut files = Vec::new();
    for part in WRITER_PARTS {
        sources(&release.join(part), &mut files);
    }
    assert!(files.len() > WRITER_PARTS.len(), "{files:?}");
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for handle in INDEX_HANDLES {
            if text.contains(handle) {
                found.push(format!("{} names {handle}", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}
