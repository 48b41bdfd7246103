//! Waiting for an effect that happens elsewhere, and reading a local HTTP endpoint.

use std::future::Future;
use std::time::Duration;

/// How long [`wait_for`] waits before failing the test.
pub const WAIT: Duration = Duration::from_secs(30);

/// Polls `check` until it holds; fails the test naming `what` after [`WAIT`]. This waits for
/// an outcome, it never stands in for timing logic.
pub async fn wait_for<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for_within(what, WAIT, Duration::from_millis(50), check).await
}

/// [`wait_for`] with its own limit and polling period (real pods and nodes take longer than
/// API effects, and are polled less often).
pub async fn wait_for_within<F, Fut>(what: &str, limit: Duration, every: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    // A check that hangs (a request to a dead endpoint) is cut off at the deadline too.
    while !tokio::time::timeout_at(deadline, check())
        .await
        .unwrap_or_else(|_| {
            panic!("timed out after {limit:?} waiting for {what} (the last check was cut off)")
        })
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(every).await;
    }
}

/// Polls `probe` until `done` holds for what it returns, and returns that. Fails the test after
/// [`WAIT`] naming `what` and showing `seen` of the last value probed: what was there instead.
pub async fn wait_seen<T, F, Fut>(
    what: &str,
    mut probe: F,
    done: impl Fn(&T) -> bool,
    seen: impl Fn(&T) -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last: Option<T> = None;
    loop {
        let Ok(value) = tokio::time::timeout_at(deadline, probe()).await else {
            let last = last.as_ref().map_or("nothing yet".into(), &seen);
            panic!(
                "timed out after {WAIT:?} waiting for {what} (the last check was cut off); \
                 seen before: {last}"
            );
        };
        if done(&value) {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {WAIT:?} waiting for {what}; seen: {}",
            seen(&value)
        );
        last = Some(value);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the /metrics of `addr` has a line that starts with `line` (a series and its
/// value, or a prefix of one); a failure shows that metric's lines as they were.
pub async fn wait_metric_line(addr: std::net::SocketAddr, line: &str) {
    wait_seen(
        &format!("a metric line {line:?}"),
        || async move { http_get(addr, "/metrics").await.1 },
        |text| text.lines().any(|l| l.starts_with(line)),
        |text| metric_lines(text, line),
    )
    .await;
}

/// Waits until series `series` (a line's part before its value) of the /metrics of `addr`
/// reads `want` (an absent series reads 0); a failure shows that metric's lines as they were.
pub async fn wait_metric(addr: std::net::SocketAddr, series: &str, want: f64) {
    wait_seen(
        &format!("{series} = {want}"),
        || async move { http_get(addr, "/metrics").await.1 },
        |text| metric_value(text, series) == want,
        |text| metric_lines(text, series),
    )
    .await;
}

/// The lines of `text` of the metric that `series` names (its name up to `{` or a space), for
/// a failure's report.
fn metric_lines(text: &str, series: &str) -> String {
    let name = series.split(['{', ' ']).next().unwrap_or(series);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(name))
        .collect();
    if lines.is_empty() {
        format!("no {name} series on /metrics")
    } else {
        lines.join("\n")
    }
}

/// GETs `http://addr/path` and returns the status code and body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write request");
    let mut out = String::new();
    stream
        .read_to_string(&mut out)
        .await
        .expect("read response");
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

/// The value of the metric line that starts with `prefix ` (0 when absent).
pub fn metric_value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The sum of every series of metric `name` (lines `name{...} v` and `name v`; 0 when absent).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
