//! Repository checks. What the release path relies on but no test can run here (no Docker
//! daemon, no registry): the release workflow parses and its scripts are shellcheck-clean, and
//! the versions it checks and pins agree with Cargo.toml, Chart.yaml, the Dockerfile and the
//! versions the tests build. And the docs against the code: every flag of every command in
//! docs/reference/flags.md and back, every Event reason in docs/reference/events.md and back,
//! and every relative link of the README, docs/ and the chart README resolving.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml(path: &str) -> Value {
    serde_norway::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not YAML: {e}"))
}

/// `name = "value"` or `name: value` on a line of its own, first match.
fn field(text: &str, prefix: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}"))
        .trim()
        .trim_matches('"')
        .to_string()
}

#[test]
fn the_release_workflow_parses_and_its_scripts_are_shellcheck_clean() {
    let workflow = yaml(".github/workflows/release.yaml");
    assert_eq!(
        workflow["on"]["push"]["tags"],
        serde_json::json!(["v*.*.*"]),
        "runs on version tags"
    );
    let steps = workflow["jobs"]["release"]["steps"]
        .as_array()
        .expect("jobs.release.steps");
    let uses: Vec<&str> = steps.iter().filter_map(|s| s["uses"].as_str()).collect();
    for want in ["docker/build-push-action", "docker/setup-buildx-action"] {
        assert!(
            uses.iter().any(|u| u.starts_with(want)),
            "{want} in {uses:?}"
        );
    }
    let build = steps
        .iter()
        .find(|s| {
            s["uses"]
                .as_str()
                .is_some_and(|u| u.starts_with("docker/build-push-action"))
        })
        .unwrap();
    assert_eq!(build["with"]["platforms"], "linux/amd64,linux/arm64");
    let scripts: Vec<&str> = steps.iter().filter_map(|s| s["run"].as_str()).collect();
    assert!(
        scripts.iter().any(|s| s.contains("helm push")),
        "the chart is pushed as an OCI artifact"
    );

    // GitHub expressions are replaced before the shell sees them (as actionlint does).
    let dir = root().join("target/testenv/workflow-scripts");
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for (i, script) in scripts.iter().enumerate() {
        let mut text = String::from("#!/usr/bin/env bash\nset -euo pipefail\n");
        let mut rest = *script;
        while let Some(start) = rest.find("${{") {
            let end = rest[start..].find("}}").expect("closed expression") + start + 2;
            text.push_str(&rest[..start]);
            text.push_str("EXPRESSION");
            rest = &rest[end..];
        }
        text.push_str(rest);
        let path = dir.join(format!("step-{i}.sh"));
        std::fs::write(&path, text).unwrap();
        files.push(path);
    }
    testenv::procs::assert_shellcheck_clean(
        "shellcheck of release.yaml's run steps",
        &["--shell=bash", "--exclude=SC2034"],
        &files,
    );
}

#[test]
fn versions_agree_across_cargo_chart_dockerfile_and_workflow() {
    let cargo = read("Cargo.toml");
    let chart = yaml("charts/ipreclaim/Chart.yaml");
    let version = field(&cargo, "version = ");
    // The release workflow refuses a tag unless both carry it.
    assert_eq!(chart["version"], version.as_str(), "Chart.yaml version");
    assert_eq!(
        chart["appVersion"],
        version.as_str(),
        "Chart.yaml appVersion"
    );
    // The image is built with the toolchain Cargo.toml asks for.
    let dockerfile = read("Dockerfile");
    assert_eq!(
        field(&dockerfile, "ARG RUST_VERSION="),
        field(&cargo, "rust-version = "),
        "Dockerfile RUST_VERSION and Cargo.toml rust-version"
    );
    for want in [
        "cargo auditable build",
        "ARG TARGETARCH",
        "FROM --platform=$BUILDPLATFORM",
        "cargo chef cook",
        "org.opencontainers.image.version=\"${VERSION}\"",
        "org.opencontainers.image.revision=\"${REVISION}\"",
        "org.opencontainers.image.licenses=\"Apache-2.0\"",
    ] {
        assert!(dockerfile.contains(want), "the Dockerfile has {want:?}");
    }
    // The workflow's helm is the one the tests build and lint the chart with.
    let workflow = yaml(".github/workflows/release.yaml");
    assert_eq!(
        workflow["env"]["HELM_VERSION"],
        field(&read("e2e/controlplane/versions.env"), "HELM_VERSION=").as_str()
    );
    // The license Cargo.toml names is the one in LICENSE.
    assert_eq!(field(&cargo, "license = "), "Apache-2.0");
    let license = read("LICENSE");
    assert!(
        license.contains("Apache License") && license.contains("Version 2.0, January 2004"),
        "LICENSE is the Apache License 2.0"
    );
    assert!(
        license.contains("END OF TERMS AND CONDITIONS"),
        "LICENSE is the whole text"
    );
}

/// The commands docs/reference/flags.md documents, each under a `## ipreclaim <command>` heading.
const COMMANDS: [&str; 7] = [
    "controller",
    "node-agent",
    "scan",
    "unfence",
    "release",
    "approve-hold",
    "crds",
];

/// The `--long` names in `text`: `--` then lower-case letters, digits and dashes.
fn long_flags(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let name: String = rest[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        rest = &rest[at + 2 + name.len()..];
        if name.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.push(format!("--{name}"));
        }
    }
    out
}

/// The flags `ipreclaim <command> --help` lists: the first `--long` of each option line
/// (`  -o, --output <OUTPUT>`, `      --dry-run`), `--help` and `--version` left out.
fn help_flags(command: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
        .args([command, "--help"])
        .output()
        .expect("run ipreclaim");
    assert!(out.status.success(), "ipreclaim {command} --help: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| {
            // Option lines are indented; the text after the options is not.
            if !line.starts_with("  ") {
                return None;
            }
            let option = line.trim_start().strip_prefix('-')?;
            // `-o, --output` or `--dry-run`; a possible value's line (`- text: ...`) is neither.
            let option = option
                .strip_prefix('-')
                .or_else(|| option.get(1..)?.strip_prefix(", --"))?;
            long_flags(&format!("--{option}")).into_iter().next()
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// The flags of the table under `## ipreclaim <command>` in docs/reference/flags.md: every
/// `--long` of each row's first cell.
fn reference_flags(page: &str, command: &str) -> BTreeSet<String> {
    let heading = format!("ipreclaim {command}\n");
    let section = page
        .split("\n## ")
        .find(|s| s.starts_with(&heading))
        .unwrap_or_else(|| panic!("docs/reference/flags.md has no `## ipreclaim {command}`"));
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .flat_map(|row| long_flags(row.split('|').nth(1).unwrap_or_default()))
        .collect()
}

#[test]
fn every_flag_of_every_command_is_in_the_flags_reference_and_back() {
    let page = read("docs/reference/flags.md");
    let mut problems = Vec::new();
    for command in COMMANDS {
        let help = help_flags(command);
        assert!(!help.is_empty(), "read no flag from `{command} --help`");
        let documented = reference_flags(&page, command);
        for flag in help.difference(&documented) {
            problems.push(format!(
                "`ipreclaim {command} {flag}` is not in docs/reference/flags.md"
            ));
        }
        for flag in documented.difference(&help) {
            problems.push(format!(
                "docs/reference/flags.md names `ipreclaim {command} {flag}`, which --help does not list"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The Event reasons defined in src/ and the core crate: each `const NAME: &str = "Reason";`
/// whose doc comment calls it one (`/// Event reason: ...`, `/// whereabouts' reason for ...`,
/// `/// ipreclaim's reason for ...`).
fn code_event_reasons() -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    rust_files(&root().join("crates/core/src"), &mut files);
    let mut reasons = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some((_, value)) = line.split_once(": &str = \"") else {
                continue;
            };
            if !line.trim_start().starts_with("pub const ")
                && !line.trim_start().starts_with("const ")
            {
                continue;
            }
            let Some(value) = value.strip_suffix("\";") else {
                continue;
            };
            let doc: Vec<&str> = lines[..i]
                .iter()
                .rev()
                .take_while(|l| l.trim_start().starts_with("///"))
                .copied()
                .collect();
            let doc = doc.join(" ");
            if doc.contains("Event reason") || doc.contains("reason for ") {
                reasons.insert(value.to_string());
            }
        }
    }
    reasons
}

#[test]
fn every_event_reason_in_the_code_is_in_the_events_reference_and_back() {
    let code = code_event_reasons();
    assert!(
        code.len() >= 13,
        "the reasons were found in src/ (doc comments `Event reason: ...` or `... reason for ...`): {code:?}"
    );
    for reason in &code {
        assert!(
            reason.chars().all(|c| c.is_ascii_alphanumeric()),
            "an Event reason is one CamelCase word: {reason:?}"
        );
    }
    let page = read("docs/reference/events.md");
    let documented: BTreeSet<String> = page
        .lines()
        .filter_map(|l| {
            let first = l.strip_prefix("| `")?;
            Some(first.split('`').next()?.to_string())
        })
        .collect();
    let missing: Vec<_> = code.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&code).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/reference/events.md and the code disagree: in the code, not the page: {missing:?}; on the page, not in the code: {stale:?}"
    );
}

/// GitHub's anchor of a heading: lower case, letters, digits, `-` and `_` kept, spaces made
/// `-`, everything else dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks), with GitHub's `-1`, `-2`
/// for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        if in_code {
            continue;
        }
        let base = anchor_of(heading.trim_start_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while !seen.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
    }
    seen
}

/// Every Markdown file under `dir`, recursively.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            markdown_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut files = vec![
        root().join("README.md"),
        root().join("charts/ipreclaim/README.md"),
    ];
    markdown_files(&root().join("docs"), &mut files);
    assert!(files.len() > 20, "read the docs: {files:?}");
    let mut problems = Vec::new();
    let mut links = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let name = file.strip_prefix(root()).unwrap().display().to_string();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            links += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target, None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !resolved.exists() {
                problems.push(format!("{name}: ({target}): no {}", resolved.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let target_text = std::fs::read_to_string(&resolved).unwrap_or_default();
                if !anchors(&target_text).contains(anchor) {
                    problems.push(format!("{name}: ({target}): no heading with that anchor"));
                }
            }
        }
    }
    assert!(links > 100, "read the links: {links}");
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

/// `scripts/test.sh` runs the root tiers in a lane of their own, beside the rest: its list
/// must name exactly the test binaries the `root-tests` feature gates, or a root test would
/// run beside the real node's (or one named there would not exist).
#[test]
fn the_test_scripts_root_lane_names_the_binaries_the_root_feature_gates() {
    let script = read("scripts/test.sh");
    let listed: BTreeSet<String> = field(&script, "root_tests=(")
        .trim_end_matches(')')
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut gated = BTreeSet::new();
    for entry in std::fs::read_dir(root().join("tests")).unwrap() {
        let path = entry.unwrap().path();
        let (name, main) = if path.is_dir() {
            (path.file_name(), path.join("main.rs"))
        } else {
            (path.file_stem(), path.clone())
        };
        let name = name.unwrap().to_string_lossy().into_owned();
        let Ok(text) = std::fs::read_to_string(&main) else {
            continue;
        };
        if text
            .lines()
            .any(|l| l.trim() == r#"#![cfg(feature = "root-tests")]"#)
        {
            gated.insert(name);
        }
    }
    assert!(!gated.is_empty(), "no test binary is gated by root-tests");
    assert_eq!(listed, gated, "scripts/test.sh's root_tests");
}

/// The other lane is every test target `scripts/test.sh`'s globs find (`tests/*.rs`,
/// `tests/*/main.rs`, and the same under `crates/*/`): each target cargo knows must be one
/// of them, or it would run in neither lane.
#[test]
fn the_test_scripts_globs_find_every_test_target_cargo_knows() {
    let script = read("scripts/test.sh");
    let globs =
        "for f in tests/*.rs tests/*/main.rs crates/*/tests/*.rs crates/*/tests/*/main.rs; do";
    assert!(
        script.contains(globs),
        "scripts/test.sh lists its tests otherwise"
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut tests = Vec::new();
    for package in metadata["packages"].as_array().unwrap() {
        for target in package["targets"].as_array().unwrap() {
            if target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k == "test")
            {
                let path = Path::new(target["src_path"].as_str().unwrap());
                tests.push(path.strip_prefix(root()).unwrap().to_path_buf());
            }
        }
    }
    assert!(tests.len() > 10, "{tests:?}");
    for path in tests {
        let parts: Vec<&str> = path.iter().map(|p| p.to_str().unwrap()).collect();
        let in_tests = match parts.as_slice() {
            ["crates", _, rest @ ..] => rest,
            rest => rest,
        };
        let found = match in_tests {
            ["tests", file] => file.ends_with(".rs"),
            ["tests", _, "main.rs"] => true,
            _ => false,
        };
        assert!(found, "{} is in neither of test.sh's lanes", path.display());
    }
}
