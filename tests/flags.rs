//! Both programs take the last value of a flag given more than once (clap's
//! `args_override_self`), so the chart's `extraArgs`, which come after its own flags, override
//! them. (That the chart renders `extraArgs` last is tested in `chart.rs`.)

use clap::Parser;
use ipreclaim::controller::ControllerArgs;
use ipreclaim::node::NodeAgentArgs;

/// A program's flags (`ControllerArgs`, `NodeAgentArgs`) as a command line.
#[derive(Parser)]
struct Cli<A: clap::Args> {
    #[command(flatten)]
    args: A,
}

/// A flag given twice takes the last value (clap's `args_override_self`), for every kind of
/// flag: durations, numbers, strings, optional values, `=BOOL` and plain switches.
#[test]
fn a_repeated_flag_takes_its_last_value() {
    let parsed = Cli::<ControllerArgs>::try_parse_from([
        "controller",
        "--sweep-interval",
        "1m",
        "--sweep-interval",
        "2m",
        "--max-release-ratio=0.1",
        "--max-release-ratio=0.2",
        "--lease-name=a",
        "--lease-name=b",
        "--fence-timeout=1m",
        "--fence-timeout=5m",
        "--release-terminal-pods=false",
        "--release-terminal-pods=true",
        "--max-retries=1",
        "--max-retries=9",
        "--dry-run",
        "--dry-run",
    ])
    .unwrap_or_else(|e| panic!("repeated controller flags: {e}"));
    let a = parsed.args;
    assert_eq!(a.sweep_interval, std::time::Duration::from_secs(120));
    assert_eq!(a.max_release_ratio, 0.2);
    assert_eq!(a.lease_name, "b");
    assert_eq!(a.fence_timeout, Some(std::time::Duration::from_secs(300)));
    assert!(a.release_terminal_pods);
    assert_eq!(a.max_retries, 9);
    assert!(a.dry_run);

    let parsed = Cli::<NodeAgentArgs>::try_parse_from([
        "node-agent",
        "--node-name=a",
        "--node-name=b",
        "--cri-endpoint=unix:///a.sock",
        "--cri-endpoint=unix:///b.sock",
        "--sandbox-grace=1s",
        "--sandbox-grace=7s",
        "--max-release-ratio=0.1",
        "--max-release-ratio=0.3",
    ])
    .unwrap_or_else(|e| panic!("repeated node-agent flags: {e}"));
    assert_eq!(parsed.args.node_name, "b");
    assert_eq!(parsed.args.cri_endpoint, "unix:///b.sock");
    assert_eq!(parsed.args.sandbox_grace, std::time::Duration::from_secs(7));
    assert_eq!(parsed.args.max_release_ratio, 0.3);

    // The binary's own subcommands (built from the same structs) accept them too.
    for args in [
        [
            "controller",
            "--sweep-interval=1m",
            "--sweep-interval=2m",
            "--help",
        ],
        [
            "node-agent",
            "--relist-period=1s",
            "--relist-period=2s",
            "--help",
        ],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ipreclaim"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ipreclaim {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `--fence-watch-timeout` takes whole seconds from 1 s to 1 h, and says so otherwise (0 would
/// turn the watcher's idle check off; the apiserver takes whole seconds).
#[test]
fn the_fence_watch_timeout_is_whole_seconds_from_one_to_an_hour() {
    let parse = |v: &str| {
        Cli::<NodeAgentArgs>::try_parse_from(["node-agent", "--node-name=a", v])
            .map(|c| c.args.fence_watch_timeout)
            .map_err(|e| e.to_string())
    };
    let secs = std::time::Duration::from_secs;
    assert_eq!(parse("--fence-watch-timeout=1s"), Ok(secs(1)));
    assert_eq!(parse("--fence-watch-timeout=1h"), Ok(secs(3600)));
    assert_eq!(parse("--node-name=a").unwrap(), secs(40), "the default");
    for (bad, says) in [
        ("0s", "between 1s and 1h"),
        ("2h", "between 1s and 1h"),
        ("1500ms", "whole number of seconds"),
        ("soon", "use e.g."),
    ] {
        let e = parse(&format!("--fence-watch-timeout={bad}")).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}
