//! `crds/` must hold exactly what `ipreclaim crds` generates.

use std::path::Path;

#[test]
fn crds_directory_matches_the_generated_crds() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    let generated = ipreclaim::api::crd_files().expect("serialize CRDs");
    let regenerate = "regenerate with: cargo run -- crds --write-dir crds";
    for (name, yaml) in &generated {
        let on_disk = std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| panic!("crds/{name}: {e}; {regenerate}"));
        assert_eq!(
            &on_disk, yaml,
            "crds/{name} differs from the generated CRD; {regenerate}"
        );
    }
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    files.sort();
    let mut expected: Vec<String> = generated.into_iter().map(|(n, _)| n).collect();
    expected.sort();
    assert_eq!(files, expected, "stale files in crds/; {regenerate}");
}
