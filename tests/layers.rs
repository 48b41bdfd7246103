//! Modules only import downwards: the resource types (`api`) < the pure domain (`ipam` <
//! `reclaim`) < `telemetry` < `release` < the programs (`controller`, `node`), and the programs
//! not from each other.

use std::path::Path;

/// (module, modules it must not import).
const RULES: &[(&str, &[&str])] = &[
    (
        "api",
        &[
            "ipam",
            "reclaim",
            "telemetry",
            "release",
            "controller",
            "node",
            "scan",
        ],
    ),
    (
        "ipam",
        &[
            "reclaim",
            "telemetry",
            "release",
            "controller",
            "node",
            "scan",
        ],
    ),
    (
        "reclaim",
        &["telemetry", "release", "controller", "node", "scan"],
    ),
    ("telemetry", &["release", "controller", "node", "scan"]),
    ("release", &["controller", "node", "scan"]),
    ("node", &["controller", "scan"]),
    ("controller", &["node", "scan"]),
];

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn modules_import_only_downwards() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for (module, forbidden) in RULES {
        let mut files = Vec::new();
        sources(&src.join(module), &mut files);
        assert!(!files.is_empty(), "no sources under src/{module}");
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for f in *forbidden {
                if text.contains(&format!("crate::{f}::")) || text.contains(&format!("crate::{f};"))
                {
                    found.push(format!("{} imports crate::{f}", file.display()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "imports against the layering:\n{}",
        found.join("\n")
    );
}
