//! What the reference docs promise, read back for tests.

use crate::procs::workspace_root;

/// The reference page of the metrics, relative to the workspace root.
pub const METRICS_REFERENCE: &str = "docs/reference/metrics.md";

/// The metric names of the table in the section of `docs/reference/metrics.md` that says
/// ``Prefix `<prefix>` ``: the first cell of each row, a full name (`ipreclaim_releases_total`)
/// without its labels. Rows whose first cell is not a code span (a separator) are not names.
/// Panics when the section is missing (the page and the test disagree).
pub fn reference_metrics(prefix: &str) -> Vec<String> {
    let path = workspace_root().join(METRICS_REFERENCE);
    let page = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let marker = format!("Prefix `{prefix}`");
    let section = page
        .split("\n## ")
        .find(|s| s.contains(&marker))
        .unwrap_or_else(|| panic!("{METRICS_REFERENCE} has no section saying {marker:?}"));
    section
        .lines()
        .filter_map(|line| {
            let first = line.strip_prefix('|')?.split('|').next()?.trim();
            let name = first.strip_prefix('`')?.strip_suffix('`')?;
            Some(name.split('{').next().unwrap_or(name).to_string())
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

/// Fails the test unless every metric of the reference section for `prefix` (at least
/// `at_least` of them, or the table was misread) is described in `/metrics` text.
pub fn assert_reference_metrics_on(metrics: &str, prefix: &str, at_least: usize) {
    let names = reference_metrics(prefix);
    assert!(
        names.len() >= at_least,
        "{METRICS_REFERENCE} metric list: {names:?}"
    );
    let missing = undescribed_metrics(metrics, &names);
    assert!(
        missing.is_empty(),
        "named in {METRICS_REFERENCE}, not on /metrics: {missing:?}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_reference_reads_as_one_name_per_row() {
        let controller = reference_metrics("ipreclaim_");
        let node = reference_metrics("ipreclaim_node_");
        assert!(controller.len() > 40, "{controller:?}");
        assert!(node.len() > 14, "{node:?}");
        for name in controller.iter().chain(&node) {
            assert!(
                name.starts_with("ipreclaim_") && !name.contains(['{', ' ', '`']),
                "{name}"
            );
        }
        assert!(controller.contains(&"ipreclaim_pool_held".to_string()));
        assert!(!controller.iter().any(|n| n.starts_with("ipreclaim_node_")));
        assert!(node.contains(&"ipreclaim_node_pleg_healthy".to_string()));
        assert!(node.contains(&"ipreclaim_build_info".to_string()));
    }
}
