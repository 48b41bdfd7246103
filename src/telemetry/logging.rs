//! Logging: text for people, JSON for log pipelines. JSON lines are flat, as zap and klog write
//! them: `timestamp`, `level`, `message` and `target` at the top level, then the fields of the
//! spans the event is in (outermost first) and the event's own fields, also at the top level
//! (an event field wins over a span field of the same name; a field named like one of the four
//! fixed keys is written as `fields.<name>`).
//!
//! The level is `RUST_LOG` when it is set (and not empty), else `--log-level` (default `info`).

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_log::NormalizeEvent;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One flat JSON object per line.
    Json,
}

/// The level when neither `RUST_LOG` nor `--log-level` says otherwise.
pub const DEFAULT_LEVEL: &str = "info";

/// The target of the deletion path's trace events (deletion seen, worker took it, handed to the
/// writer, queued for its pool, token reserved, batch formed, patch sent and returned): with
/// `RUST_LOG=ipreclaim::timeline=trace` the scale bench splits a release's latency by stage.
pub const TIMELINE: &str = "ipreclaim::timeline";

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Checks a `--log-level` value: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or
/// comma-separated directives as in `RUST_LOG` whose levels are such names
/// (`info,ipreclaim=debug`). A bare word that is no level is refused (the filter would read it
/// as a target and log everything of it).
pub fn parse_log_level(s: &str) -> Result<String, String> {
    let ok = !s.trim().is_empty()
        && s.split(',').all(|d| {
            let level = d.rsplit_once('=').map_or(d, |(_, l)| l).trim();
            LEVELS.contains(&level.to_ascii_lowercase().as_str())
        });
    if !ok {
        return Err(format!(
            "{s:?}: use a level ({}) or directives like info,ipreclaim=debug",
            LEVELS.join(", ")
        ));
    }
    EnvFilter::builder()
        .parse(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("{s:?}: {e}"))
}

/// The filter directives in force: `RUST_LOG` when set and usable, else `level`; and a note
/// when `RUST_LOG` was set but unusable (logged once logging is up).
fn directives(rust_log: Option<&str>, level: &str) -> (String, Option<String>) {
    match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(env) => match EnvFilter::builder().parse(env) {
            Ok(_) => (env.to_owned(), None),
            Err(e) => (
                level.to_owned(),
                Some(format!(
                    "RUST_LOG={env:?} is not a valid filter ({e}); using {level:?}"
                )),
            ),
        },
        None => (level.to_owned(), None),
    }
}

/// Installs the global subscriber at the default level (`RUST_LOG` still wins). Safe to call
/// twice (the second call is ignored).
pub fn init_logging(format: LogFormat) {
    init_logging_at(format, DEFAULT_LEVEL);
}

/// Installs the global subscriber at `level` (a value [`parse_log_level`] accepted);
/// `RUST_LOG` wins when set. Safe to call twice (the second call is ignored).
pub fn init_logging_at(format: LogFormat, level: &str) {
    let rust_log = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let (directives, note) = directives(rust_log.as_deref(), level);
    let filter = EnvFilter::builder()
        .parse(&directives)
        .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LEVEL));
    // Colour only for a person at a terminal: files, pipes and `kubectl logs` get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .try_init(),
    };
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
}

/// One error line in `format` written straight to stderr, for errors before logging is up
/// (a flag clap refused): `{"timestamp":..,"level":"error","message":..,"target":"ipreclaim",
/// "error":..}` in JSON.
pub fn early_error_line(format: LogFormat, message: &str, error: &str) -> String {
    match format {
        LogFormat::Text => format!("{} ERROR ipreclaim: {message} error={error}", now()),
        LogFormat::Json => {
            let mut fields = Map::new();
            fields.insert("error".into(), error.into());
            flat_line(&now(), "error", message, "ipreclaim", fields)
        }
    }
}

fn now() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Microsecond)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

/// The fixed keys of a JSON line, in the order written.
const FIXED: [&str; 4] = ["timestamp", "level", "message", "target"];

/// Formats events as flat JSON objects (see the module doc).
struct FlatJson;

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let mut fields = Map::new();
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                if let Some(f) = ext.get::<FormattedFields<N>>()
                    && let Ok(Value::Object(o)) = serde_json::from_str::<Value>(f.as_str())
                {
                    fields.extend(o);
                }
            }
        }
        let mut visitor = Fields {
            map: &mut fields,
            message: None,
        };
        event.record(&mut visitor);
        let message = visitor.message.take().unwrap_or_default();
        let line = flat_line(
            &now(),
            &meta.level().as_str().to_ascii_lowercase(),
            &message,
            meta.target(),
            fields,
        );
        writer.write_str(&line)?;
        writer.write_char('\n')
    }
}

/// One JSON object: the fixed keys first, then `fields` (renamed where they clash).
fn flat_line(
    timestamp: &str,
    level: &str,
    message: &str,
    target: &str,
    fields: Map<String, Value>,
) -> String {
    let mut out = String::from("{");
    let mut first = true;
    let mut put = |k: &str, v: &Value| {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&Value::String(k.to_owned()).to_string());
        out.push(':');
        out.push_str(&v.to_string());
    };
    for (k, v) in FIXED.iter().zip([timestamp, level, message, target]) {
        put(k, &Value::String(v.to_owned()));
    }
    for (k, v) in &fields {
        if FIXED.contains(&k.as_str()) {
            put(&format!("fields.{k}"), v);
        } else {
            put(k, v);
        }
    }
    out.push('}');
    out
}

/// Records an event's fields as JSON values; `message` apart; the `log.*` fields of events that
/// came from the `log` crate are dropped (their metadata is normalized instead).
struct Fields<'a> {
    map: &'a mut Map<String, Value>,
    message: Option<String>,
}

impl Fields<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        let name = field.name();
        if name.starts_with("log.") {
            return;
        }
        if name == "message" {
            self.message = Some(match value {
                Value::String(s) => s,
                other => other.to_string(),
            });
        } else {
            self.map.insert(name.to_owned(), value);
        }
    }
}

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(
            field,
            serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number),
        );
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_i128(&mut self, field: &Field, value: i128) {
        self.put(field, value.to_string().into());
    }
    fn record_u128(&mut self, field: &Field, value: u128) {
        self.put(field, value.to_string().into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;
    use tracing_subscriber::fmt::MakeWriter;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    fn lines(log: impl FnOnce()) -> Vec<Map<String, Value>> {
        let buffer = Buffer::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buffer.clone())
            .with_env_filter(EnvFilter::new("trace"))
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .finish();
        tracing::subscriber::with_default(subscriber, log);
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| match serde_json::from_str(l) {
                Ok(Value::Object(o)) => o,
                other => panic!("not a JSON object: {l} ({other:?})"),
            })
            .collect()
    }

    #[test]
    fn event_and_span_fields_are_at_the_top_level() {
        let got = lines(|| {
            let outer = tracing::info_span!("outer", watch = "pods", attempt = 1);
            let _o = outer.enter();
            let inner = tracing::debug_span!("inner", attempt = 2, pool = "p");
            let _i = inner.enter();
            tracing::warn!(
                error = "refused",
                attempt = 3,
                ok = true,
                ratio = 0.5,
                "watch error"
            );
        });
        assert_eq!(got.len(), 1, "{got:?}");
        let l = &got[0];
        assert_eq!(l["level"], "warn");
        assert_eq!(l["message"], "watch error");
        assert_eq!(l["target"], module_path!());
        assert!(l["timestamp"].as_str().unwrap().ends_with('Z'), "{l:?}");
        assert_eq!(l["watch"], "pods");
        assert_eq!(l["pool"], "p");
        // The event's own field wins over the spans'; the inner span's over the outer's.
        assert_eq!(l["attempt"], 3);
        assert_eq!(l["ok"], true);
        assert_eq!(l["ratio"], 0.5);
        assert_eq!(l["error"], "refused");
        assert!(
            l.values().all(|v| !v.is_object() && !v.is_array()),
            "flat: {l:?}"
        );
        let keys: Vec<&str> = l.keys().map(String::as_str).collect();
        assert!(
            !keys.contains(&"span") && !keys.contains(&"fields"),
            "{keys:?}"
        );
    }

    #[test]
    fn a_field_named_like_a_fixed_key_does_not_overwrite_it() {
        let got = lines(|| tracing::info!(target: "ipreclaim::audit", level = "custom", "hello"));
        assert_eq!(got[0]["level"], "info");
        assert_eq!(got[0]["fields.level"], "custom");
        assert_eq!(got[0]["target"], "ipreclaim::audit");
        assert_eq!(got[0]["message"], "hello");
    }

    #[test]
    fn rust_log_wins_over_the_flag_when_set_and_valid() {
        assert_eq!(directives(None, "warn"), ("warn".into(), None));
        assert_eq!(directives(Some(""), "warn"), ("warn".into(), None));
        assert_eq!(
            directives(Some("debug,kube=info"), "warn"),
            ("debug,kube=info".into(), None)
        );
        let (d, note) = directives(Some("info,a=[[["), "warn");
        assert_eq!(d, "warn");
        assert!(note.unwrap().contains("RUST_LOG"));
    }

    #[test]
    fn log_levels_are_checked() {
        for ok in [
            "info",
            "WARN",
            "debug,kube=warn",
            "error,ipreclaim::audit=info",
            "off",
        ] {
            assert_eq!(parse_log_level(ok).as_deref(), Ok(ok), "{ok}");
        }
        for bad in ["", "verbose", "info,kube", "ipreclaim=loud"] {
            assert!(parse_log_level(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn early_errors_follow_the_format() {
        let json = early_error_line(LogFormat::Json, "invalid arguments", "bad --leak-grace");
        let v: Map<String, Value> = serde_json::from_str(&json).unwrap();
        assert_eq!(v["level"], "error");
        assert_eq!(v["message"], "invalid arguments");
        assert_eq!(v["error"], "bad --leak-grace");
        assert_eq!(v["target"], "ipreclaim");
        let text = early_error_line(LogFormat::Text, "invalid arguments", "bad");
        assert!(
            text.contains("ERROR ipreclaim: invalid arguments"),
            "{text}"
        );
    }
}
