//! What the programs' flags share.

use std::time::Duration;

/// A duration flag: `500ms`, `30s`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 30s, 2m)"))
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
}
