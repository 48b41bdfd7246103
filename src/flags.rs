//! What the programs' flags share.

use std::time::Duration;

/// A duration flag: `500ms`, `30s`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 30s, 2m)"))
}

/// A share flag: a number from 0 to 1 (`--max-release-ratio`).
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&r) {
        Ok(r)
    } else {
        Err(format!("{r} is not between 0 and 1"))
    }
}

/// The namespace ipreclaim runs in, where the node agents' sandbox inventories are: `flag`,
/// else `$POD_NAMESPACE` (the chart's downward API), else the whereabouts namespace.
pub fn own_namespace(flag: Option<&str>, whereabouts_namespace: &str) -> String {
    flag.map(str::to_owned)
        .or_else(|| {
            std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|n| !n.is_empty())
        })
        .unwrap_or_else(|| whereabouts_namespace.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_an_operator_writes_them_and_a_bad_one_says_how() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        let e = parse_duration("2 minutes please").unwrap_err();
        assert!(e.contains("use e.g."), "{e}");
    }

    #[test]
    fn ratios_are_numbers_from_0_to_1_inclusive() {
        assert_eq!(parse_ratio("0.5"), Ok(0.5));
        assert_eq!(parse_ratio("0"), Ok(0.0));
        assert_eq!(parse_ratio("1"), Ok(1.0));
        assert_eq!(parse_ratio("1.5"), Err("1.5 is not between 0 and 1".into()));
        assert_eq!(
            parse_ratio("-0.1"),
            Err("-0.1 is not between 0 and 1".into())
        );
        assert_eq!(parse_ratio("half"), Err(r#""half" is not a number"#.into()));
        // NaN parses as a number but lies in no range.
        assert!(parse_ratio("NaN").is_err());
    }
}
