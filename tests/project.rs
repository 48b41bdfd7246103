//! What the release path relies on but no test can run here (no Docker daemon, no registry):
//! the release workflow parses and its scripts are shellcheck-clean, and the versions it checks
//! and pins agree with Cargo.toml, Chart.yaml, the Dockerfile and the versions the tests build.

use std::path::{Path, PathBuf};

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
