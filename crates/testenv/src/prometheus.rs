//! Debian's Prometheus (`apt-get install prometheus`, by `scripts/setup.sh`): `promtool`, and a
//! server started on 127.0.0.1 in a directory of its own, scraping the targets a test gives it
//! and evaluating the rule files it gives, queried over its HTTP API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Empty};
use serde_json::Value;

use crate::procs::{free_port, run_dir, spawn_supervised, write_file};

/// `name` (a program of Debian's `prometheus` package) on PATH or in /usr/bin, or an error that
/// says how to get it.
fn packaged(name: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} not found: run scripts/setup.sh (it installs Debian's `prometheus` \
                 package, which ships prometheus and promtool)"
            )
        })
}

/// The path of `promtool`.
pub fn promtool() -> Result<PathBuf> {
    packaged("promtool")
}

/// Runs `promtool` with `args` in `dir` and returns whether it succeeded, with its stdout and
/// stderr together (promtool reports a failed check on either).
pub fn run_promtool(dir: &Path, args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new(promtool()?)
        .args(args)
        .current_dir(dir)
        .output()
        .context("run promtool")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

/// A scrape target: its `job` label and address (`http://<addr>/metrics`).
#[derive(Clone, Debug)]
pub struct Target {
    pub job: String,
    pub addr: SocketAddr,
}

/// A running Prometheus; killed when dropped (and when the test process exits).
pub struct Prometheus {
    child: Child,
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` and evaluating `rule_files` every `interval`, and
    /// waits until it is ready. Its data, configuration and log are in a new run directory.
    pub async fn start(
        targets: &[Target],
        rule_files: &[PathBuf],
        interval: Duration,
    ) -> Result<Prometheus> {
        let binary = packaged("prometheus")?;
        let dir = run_dir("prometheus")?;
        let every = format!("{}ms", interval.as_millis());
        let config = serde_json::json!({
            "global": {
                "scrape_interval": every,
                "scrape_timeout": every,
                "evaluation_interval": every,
            },
            "rule_files": rule_files,
            "scrape_configs": targets.iter().map(|t| serde_json::json!({
                "job_name": t.job,
                "static_configs": [{"targets": [t.addr.to_string()]}],
            })).collect::<Vec<_>>(),
        });
        // JSON is YAML: no second serializer needed.
        let config_file = dir.join("prometheus.yml");
        write_file(&config_file, serde_json::to_vec_pretty(&config)?)?;
        let port = free_port()?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut cmd = Command::new(binary);
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=info");
        let child = spawn_supervised(cmd, &dir.join("prometheus.log"))?;
        let mut prometheus = Prometheus { child, addr, dir };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, _)) = prometheus.get("/-/ready").await {
                return Ok(prometheus);
            }
            if let Some(status) = prometheus.child.try_wait()? {
                bail!(
                    "prometheus exited ({status}) before it was ready; its log: {}",
                    prometheus.log()
                );
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "prometheus not ready on {addr} after 60s; its log: {}",
                    prometheus.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// GETs `path` (with its query string) and returns the status code and body.
    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        let stream = tokio::net::TcpStream::connect(self.addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, self.addr.to_string())
            .body(Empty::<bytes::Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// GETs an API path and returns its `data`; an error carries Prometheus's `error`.
    pub async fn api(&self, path: &str) -> Result<Value> {
        let (code, body) = self.get(path).await?;
        let v: Value = serde_json::from_str(&body)
            .with_context(|| format!("GET {path}: {code} and not JSON: {body}"))?;
        if v["status"] != "success" {
            bail!("GET {path}: {code} {}: {}", v["errorType"], v["error"]);
        }
        Ok(v["data"].clone())
    }

    /// Evaluates the instant query `expr` now: its result (a vector's samples, as the API
    /// gives them), or Prometheus's error (e.g. a parse error).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encode(expr)))
            .await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The active alerts (pending and firing) of `/api/v1/alerts`.
    pub async fn alerts(&self) -> Result<Vec<Value>> {
        let data = self.api("/api/v1/alerts").await?;
        Ok(data["alerts"].as_array().cloned().unwrap_or_default())
    }

    /// The rule groups of `/api/v1/rules`.
    pub async fn rule_groups(&self) -> Result<Vec<Value>> {
        let data = self.api("/api/v1/rules").await?;
        Ok(data["groups"].as_array().cloned().unwrap_or_default())
    }

    /// Every metric name it holds.
    pub async fn metric_names(&self) -> Result<Vec<String>> {
        let data = self.api("/api/v1/label/__name__/values").await?;
        Ok(data
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// Percent-encodes `s` for a query string (everything but RFC 3986's unreserved characters).
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `helm template` of the chart as `release` with `--set` values (`--set-json` for a decimal
/// number) after the chart's `--kube-version`: its documents, or helm's error.
pub fn render_chart(release: &str, sets: &[&str]) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let chart = crate::helm::chart_dir();
    let kube = crate::procs::pinned_version("KUBERNETES_VERSION")?;
    let mut args = vec![
        "template",
        release,
        chart.to_str().context("utf-8 chart path")?,
        "--namespace",
        "ipr",
        "--kube-version",
        &kube,
    ];
    for set in sets {
        // helm's --set gives `0.2` as a string, which the schema refuses for a number.
        let float = set
            .split_once('=')
            .is_some_and(|(_, v)| v.parse::<i64>().is_err() && v.parse::<f64>().is_ok());
        args.extend([if float { "--set-json" } else { "--set" }, set]);
    }
    let yaml = crate::helm::helm(None, &args)?;
    let mut docs = Vec::new();
    for d in serde_norway::Deserializer::from_str(&yaml) {
        let v = Value::deserialize(d).context("YAML from helm")?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// The chart's alerting rules as a Prometheus rule file (`{"groups": ...}`, the PrometheusRule's
/// spec), rendered as `release` with `prometheusRule.enabled=true` and `sets`.
pub fn chart_rules(release: &str, sets: &[&str]) -> Result<Value> {
    let mut all = vec!["prometheusRule.enabled=true"];
    all.extend_from_slice(sets);
    let docs = render_chart(release, &all)?;
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .context("no PrometheusRule in the chart's output")?;
    Ok(serde_json::json!({"groups": rule["spec"]["groups"]}))
}

/// Every PromQL expression of the chart's dashboard (`dashboards/ipreclaim.json`) as (panel
/// title, expression), Grafana's variables replaced by values a query runs with: `$pool` by
/// every pool, `$__rate_interval` by `rate_interval`.
pub fn dashboard_queries(rate_interval: &str) -> Result<Vec<(String, String)>> {
    let file = crate::helm::chart_dir().join("dashboards/ipreclaim.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&file)?)
        .with_context(|| format!("{} is not JSON", file.display()))?;
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .with_context(|| format!("a target without expr in {}", panel["title"]))?
                .replace("$__rate_interval", rate_interval)
                .replace("$pool", ".*");
            if expr.contains('$') {
                bail!("a Grafana variable left in {expr}");
            }
            out.push((panel["title"].as_str().unwrap_or("").to_string(), expr));
        }
    }
    Ok(out)
}
