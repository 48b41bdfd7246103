//! `ipreclaim_build_info` and the standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_virtual_memory_bytes`, `process_open_fds`,
//! `process_max_fds`, `process_start_time_seconds`), read from `/proc/self` on each scrape.
//!
//! prometheus-client has no process collector, and the crates that have one either belong to
//! the other `prometheus` crate's registry or pull in a whole `/proc` library for six numbers:
//! this one reads three small files and is checked against them by its tests. Where `/proc` is
//! missing (not Linux) it reports nothing.

use std::fmt;
use std::path::{Path, PathBuf};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

/// The labels of `ipreclaim_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildInfo {
    /// The crate version.
    pub version: String,
    /// The commit built (empty when unknown: a build outside a git checkout without
    /// `IPRECLAIM_GIT_COMMIT`, or a debug build).
    pub git_commit: String,
    /// The compiler's version.
    pub rustc: String,
}

impl BuildInfo {
    /// This binary's.
    pub fn current() -> Self {
        BuildInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            git_commit: env!("IPRECLAIM_GIT_COMMIT").into(),
            rustc: env!("IPRECLAIM_RUSTC_VERSION").into(),
        }
    }
}

/// Registers `ipreclaim_build_info` (always 1) and the process metrics in `registry` (the root
/// registry: process metrics carry no prefix).
pub fn register(registry: &mut Registry) {
    let info: Family<BuildInfo, Gauge> = Family::default();
    info.get_or_create(&BuildInfo::current()).set(1);
    registry.sub_registry_with_prefix("ipreclaim").register(
        "build_info",
        "1, labelled with the version, the git commit and the compiler of this binary",
        info,
    );
    registry.register_collector(Box::new(ProcessCollector::new("/proc/self")));
}

/// Reads a process's metrics from its `/proc` directory on each scrape.
#[derive(Debug)]
pub struct ProcessCollector {
    dir: PathBuf,
    proc_root: PathBuf,
    ticks_per_second: f64,
    page_size: f64,
}

impl ProcessCollector {
    /// A collector of the process whose `/proc` directory is `dir` (e.g. `/proc/self`).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        let proc_root = dir.parent().unwrap_or(Path::new("/proc")).to_path_buf();
        ProcessCollector {
            dir,
            proc_root,
            ticks_per_second: sysconf(Sysconf::ClockTicks).unwrap_or(100.0),
            page_size: sysconf(Sysconf::PageSize).unwrap_or(4096.0),
        }
    }

    /// A sample now (`None` where `/proc` cannot be read).
    pub fn sample(&self) -> Option<Sample> {
        let stat = Stat::parse(&std::fs::read_to_string(self.dir.join("stat")).ok()?)?;
        let boot = std::fs::read_to_string(self.proc_root.join("stat"))
            .ok()
            .and_then(|s| boot_time(&s));
        let open_fds = std::fs::read_dir(self.dir.join("fd"))
            .ok()
            .map(|d| d.count() as u64);
        let max_fds = std::fs::read_to_string(self.dir.join("limits"))
            .ok()
            .and_then(|s| max_open_files(&s));
        Some(Sample {
            cpu_seconds: (stat.utime + stat.stime) as f64 / self.ticks_per_second,
            resident_bytes: stat.rss_pages as f64 * self.page_size,
            virtual_bytes: stat.vsize_bytes as f64,
            start_time_seconds: boot
                .map(|b| b as f64 + stat.start_ticks as f64 / self.ticks_per_second),
            open_fds,
            max_fds,
        })
    }
}

/// What one scrape reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// User and system CPU time.
    pub cpu_seconds: f64,
    /// Resident set size.
    pub resident_bytes: f64,
    /// Virtual memory size.
    pub virtual_bytes: f64,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: Option<f64>,
    /// Open file descriptors.
    pub open_fds: Option<u64>,
    /// The soft limit of open file descriptors.
    pub max_fds: Option<u64>,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let Some(s) = self.sample() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let mut gauge = |name: &str, help: &str, value: f64| -> Result<(), fmt::Error> {
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
        };
        gauge(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            s.resident_bytes,
        )?;
        gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            s.virtual_bytes,
        )?;
        if let Some(t) = s.start_time_seconds {
            gauge(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                t,
            )?;
        }
        if let Some(n) = s.open_fds {
            gauge(
                "process_open_fds",
                "Number of open file descriptors",
                n as f64,
            )?;
        }
        if let Some(n) = s.max_fds {
            gauge(
                "process_max_fds",
                "Maximum number of open file descriptors",
                n as f64,
            )?;
        }
        Ok(())
    }
}

/// The fields of `/proc/<pid>/stat` used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

impl Stat {
    /// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may hold
    /// spaces and parentheses itself: the fields after it start after the last `)`.
    fn parse(s: &str) -> Option<Stat> {
        let rest = &s[s.rfind(')')? + 1..];
        // rest[0] is field 3 (state): field n is rest[n - 3].
        let f: Vec<&str> = rest.split_whitespace().collect();
        let n = |field: usize| f.get(field - 3)?.parse::<u64>().ok();
        Some(Stat {
            utime: n(14)?,
            stime: n(15)?,
            start_ticks: n(22)?,
            vsize_bytes: n(23)?,
            rss_pages: n(24)?,
        })
    }
}

/// `btime` of `/proc/stat`: boot time, seconds since the Unix epoch.
fn boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft limit of `Max open files` in `/proc/<pid>/limits` (`None` when unlimited).
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

enum Sysconf {
    ClockTicks,
    PageSize,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn sysconf(what: Sysconf) -> Option<f64> {
    let name = match what {
        Sysconf::ClockTicks => libc::_SC_CLK_TCK,
        Sysconf::PageSize => libc::_SC_PAGESIZE,
    };
    // SAFETY: sysconf only reads a configuration value.
    let v = unsafe { libc::sysconf(name) };
    (v > 0).then_some(v as f64)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn sysconf(_: Sysconf) -> Option<f64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        // A command name with spaces and a parenthesis, as the kernel writes it.
        let line = "4242 (ipre (claim) x) S 1 4242 4242 0 -1 4194560 2048 0 0 0 \
                    250 75 0 0 20 0 9 0 123456 104857600 3072 18446744073709551615 1 1 0 0 0 0 \
                    0 4096 17922 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            Stat::parse(line),
            Some(Stat {
                utime: 250,
                stime: 75,
                start_ticks: 123456,
                vsize_bytes: 104857600,
                rss_pages: 3072,
            })
        );
        assert_eq!(Stat::parse("4242 (x) S 1"), None);
        assert_eq!(Stat::parse("garbage"), None);
    }

    #[test]
    fn boot_time_and_the_fd_limit_are_read() {
        assert_eq!(
            boot_time("cpu  1 2 3\nintr 5\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        assert_eq!(boot_time("cpu 1\n"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max cpu time              unlimited            unlimited            seconds   \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(max_open_files(limits), Some(1024));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
    }

    #[test]
    fn this_process_reads_plausibly() {
        let s = ProcessCollector::new("/proc/self")
            .sample()
            .expect("/proc/self is readable on Linux");
        assert!(s.resident_bytes > 1e6 && s.resident_bytes < 64e9, "{s:?}");
        assert!(s.virtual_bytes >= s.resident_bytes, "{s:?}");
        assert!(s.cpu_seconds >= 0.0, "{s:?}");
        let now = jiff::Timestamp::now().as_second() as f64;
        let start = s.start_time_seconds.expect("a start time");
        assert!(
            start <= now + 1.0 && start > now - 86_400.0 * 365.0,
            "{s:?}"
        );
        assert!(s.open_fds.expect("open fds") >= 3, "{s:?}");
        assert!(s.max_fds.expect("a limit") >= s.open_fds.unwrap(), "{s:?}");
    }

    #[test]
    fn the_registry_shows_build_info_and_process_metrics() {
        let mut registry = Registry::default();
        register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let info = text
            .lines()
            .find(|l| l.starts_with("ipreclaim_build_info{"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            info.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
            "{info}"
        );
        assert!(info.contains("rustc=\"1."), "{info}");
        assert!(info.ends_with(" 1"), "{info}");
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_max_fds ",
        ] {
            assert!(text.lines().any(|l| l.starts_with(name)), "{name}: {text}");
        }
    }
}
