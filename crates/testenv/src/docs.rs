//! What the README promises, read back for tests.

use crate::procs::workspace_root;

/// The metric names of the README paragraph that starts `Metrics (prefix `<prefix>`):`, full
/// names without labels (`ipreclaim_releases_total`). Label values in parentheses are not
/// names. Panics when the paragraph is missing (the README and the test disagree).
pub fn readme_metrics(prefix: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let start = format!("Metrics (prefix `{prefix}`):");
    let at = readme
        .find(&start)
        .unwrap_or_else(|| panic!("README has no paragraph starting {start:?}"));
    let rest = &readme[at + start.len()..];
    let paragraph = rest.split("\n\n").next().unwrap_or_default();
    // Drop parenthesised asides (label values).
    let mut text = String::new();
    let mut depth = 0usize;
    for c in paragraph.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => text.push(c),
            _ => {}
        }
    }
    // The paragraph ends where its metric list does: the first full stop after a name.
    let list = text.split(". ").next().unwrap_or_default();
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(|name| {
            let bare = name.split('{').next().unwrap_or(name);
            if bare.starts_with("ipreclaim_") {
                bare.to_string()
            } else {
                format!("{prefix}{bare}")
            }
        })
        .collect()
}

/// The names in `names` that `/metrics` text does not describe (no `# TYPE` line; a
/// counter's is written without `_total`).
pub fn undescribed_metrics(metrics: &str, names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| {
            let family = n.strip_suffix("_total").unwrap_or(n);
            !metrics
                .lines()
                .any(|l| l.starts_with(&format!("# TYPE {family} ")))
        })
        .cloned()
        .collect()
}

/// Fails the test unless every metric of the README paragraph for `prefix` (at least
/// `at_least` of them, or the paragraph was misread) is described in `/metrics` text.
pub fn assert_readme_metrics_on(metrics: &str, prefix: &str, at_least: usize) {
    let names = readme_metrics(prefix);
    assert!(names.len() >= at_least, "README metric list: {names:?}");
    let missing = undescribed_metrics(metrics, &names);
    assert!(
        missing.is_empty(),
        "named in the README, not on /metrics: {missing:?}"
    );
}
