//! Writes events.k8s.io/v1 Events that the apiserver accepts whatever the names in them. Like
//! kube's `Recorder` (a repeat of an Event, same type, reason, action and object, within six
//! minutes becomes a `series` patch of the first), but every field ipreclaim writes is cut to the
//! API's limit first (`k8s.io/kubernetes/pkg/apis/core/validation/events.go`, v1.36: action,
//! reason and reportingInstance at most 128 bytes, note at most 1,024; the Event's name a DNS
//! subdomain of at most 253). kube's recorder names an Event `<object name>.<hex time>`: with a
//! pod name of 253 characters that name is refused, and so is an action naming a network of
//! `namespace/name` past 128 characters (issue 35, item 8).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};

/// Most bytes of an Event's `action`.
pub const ACTION_MAX: usize = 128;
/// Most bytes of an Event's `reason`.
pub const REASON_MAX: usize = 128;
/// Most bytes of an Event's `note`.
pub const NOTE_MAX: usize = 1024;
/// Most bytes of an Event's `reportingInstance`.
pub const INSTANCE_MAX: usize = 128;
/// Most bytes of an object's name (a DNS subdomain).
pub const NAME_MAX: usize = 253;

/// Marks where a text was cut.
const CUT: &str = "…";

/// How long a published Event is remembered for its repeats (kube's recorder: six minutes).
const REMEMBER: jiff::SignedDuration = jiff::SignedDuration::from_mins(6);

/// `text` within `max` bytes: as it is when it fits, else its start (cut at a character
/// boundary) and [`CUT`].
pub fn fit(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let mut end = max.saturating_sub(CUT.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{CUT}", &text[..end]))
}

/// Like [`fit`], and a text cut ends in a short hash of the whole: two long texts that share
/// their start stay two (an action is a key: the recorder merges Events of one action).
pub fn fit_distinct(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let tag = format!("~{:08x}", fnv1a(text));
    let start = fit(text, max - tag.len());
    Cow::Owned(format!("{start}{tag}"))
}

/// FNV-1a, 32 bits: stable across builds and processes (std's hasher is not).
fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The name of an Event about the object named `object`, at `nanos`: `<object>.<hex>` as kube
/// names it, the object's part cut so that the whole is a DNS subdomain of at most 253.
pub fn event_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let room = NAME_MAX - suffix.len();
    let mut end = object.len().min(room);
    while !object.is_char_boundary(end) {
        end -= 1;
    }
    // A subdomain's labels end in a letter or digit.
    let start = object[..end].trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    let start = if start.is_empty() { "event" } else { start };
    format!("{start}{suffix}")
}

/// What makes two Events one series: type, action, reason and the object (api version, kind,
/// namespace, name, uid).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    type_: EventType,
    action: String,
    reason: String,
    regarding: [Option<String>; 5],
}

/// Publishes Events within the API's limits, merging repeats into series.
pub struct Recorder {
    client: Client,
    controller: String,
    instance: String,
    published: Mutex<HashMap<Key, K8sEvent>>,
}

impl Recorder {
    /// A recorder reporting as `reporter`.
    pub fn new(client: Client, reporter: Reporter) -> Recorder {
        let instance = reporter
            .instance
            .clone()
            .unwrap_or_else(|| reporter.controller.clone());
        Recorder {
            client,
            instance,
            controller: reporter.controller,
            published: Mutex::default(),
        }
    }

    /// Publishes `ev` about `regarding`: a new Event, or the next of its series.
    pub async fn publish(&self, ev: &Event, regarding: &ObjectReference) -> kube::Result<()> {
        let now = jiff::Timestamp::now();
        // The key holds the action as written: what is compared is what the apiserver has.
        let key = Key {
            type_: ev.type_,
            action: fit_distinct(&ev.action, ACTION_MAX).into_owned(),
            reason: fit(&ev.reason, REASON_MAX).into_owned(),
            regarding: {
                let r = regarding.clone();
                [r.api_version, r.kind, r.namespace, r.name, r.uid]
            },
        };
        let event = {
            let mut published = self.published.lock().expect("recorder lock");
            published.retain(|_, e| last_seen(e).is_some_and(|t| t + REMEMBER > now));
            match published.get(&key) {
                Some(first) => {
                    let mut e = first.clone();
                    e.series = Some(EventSeries {
                        count: first.series.as_ref().map_or(2, |s| s.count + 1),
                        last_observed_time: MicroTime(now),
                    });
                    e
                }
                None => written(&self.controller, &self.instance, ev, regarding, now),
            }
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let api = Api::<K8sEvent>::namespaced(self.client.clone(), namespace);
        let name = event.metadata.name.clone().unwrap_or_default();
        if event.series.is_some() {
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&event))
                .await?;
        } else {
            api.create(&PostParams::default(), &event).await?;
        }
        self.published
            .lock()
            .expect("recorder lock")
            .insert(key, event);
        Ok(())
    }
}

/// The Event `ev` about `regarding` reported by `controller` (`instance`), as written, with
/// every field within its limit.
fn written(
    controller: &str,
    instance: &str,
    ev: &Event,
    regarding: &ObjectReference,
    now: jiff::Timestamp,
) -> K8sEvent {
    let object = regarding.name.as_deref().unwrap_or(controller);
    K8sEvent {
        action: Some(fit_distinct(&ev.action, ACTION_MAX).into_owned()),
        reason: Some(fit(&ev.reason, REASON_MAX).into_owned()),
        note: ev.note.as_deref().map(|n| fit(n, NOTE_MAX).into_owned()),
        event_time: Some(MicroTime(now)),
        regarding: Some(regarding.clone()),
        related: ev.secondary.clone(),
        metadata: ObjectMeta {
            namespace: regarding.namespace.clone(),
            name: Some(event_name(object, now.as_nanosecond())),
            ..Default::default()
        },
        reporting_controller: Some(controller.to_owned()),
        reporting_instance: Some(fit(instance, INSTANCE_MAX).into_owned()),
        type_: Some(
            match ev.type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .into(),
        ),
        ..Default::default()
    }
}

/// When an Event was last seen: its series' last observation, else its time.
fn last_seen(e: &K8sEvent) -> Option<jiff::Timestamp> {
    match &e.series {
        Some(s) => Some(s.last_observed_time.0),
        None => e.event_time.as_ref().map(|t| t.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_that_fits_is_kept_and_a_longer_one_keeps_its_start_and_marks_the_cut() {
        assert_eq!(fit("Release ns/net", ACTION_MAX), "Release ns/net");
        let long = format!("Release {}/{}", "n".repeat(63), "x".repeat(253));
        let cut = fit(&long, ACTION_MAX);
        assert_eq!(cut.len(), ACTION_MAX);
        assert!(
            cut.starts_with("Release nnn") && cut.ends_with(CUT),
            "{cut}"
        );
        // Never inside a character.
        let wide = "é".repeat(600);
        let cut = fit(&wide, NOTE_MAX);
        assert!(cut.len() <= NOTE_MAX && cut.ends_with(CUT));
    }

    #[test]
    fn two_long_actions_with_one_start_stay_two() {
        let a = format!("Release ns/{}-a", "x".repeat(200));
        let b = format!("Release ns/{}-b", "x".repeat(200));
        let (fa, fb) = (fit_distinct(&a, ACTION_MAX), fit_distinct(&b, ACTION_MAX));
        assert!(fa.len() <= ACTION_MAX && fb.len() <= ACTION_MAX);
        assert_ne!(fa, fb);
        assert!(fa.starts_with("Release ns/xxx"));
        assert_eq!(fit_distinct("Release ns/net", ACTION_MAX), "Release ns/net");
    }

    #[test]
    fn every_field_written_is_within_its_limit_at_the_longest_names() {
        let (ns, nad, pod) = ("n".repeat(63), "x".repeat(253), "p".repeat(253));
        let regarding = ObjectReference {
            namespace: Some(ns.clone()),
            name: Some(pod.clone()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Normal,
            reason: "R".repeat(200),
            note: Some(
                format!("successful cleanup of IP address [192.0.2.10] from network {ns}/{nad}")
                    .repeat(4),
            ),
            action: format!("Release {ns}/{nad} Cooldown"),
            secondary: None,
        };
        let instance = "i".repeat(253);
        let e = written(
            "ipreclaim",
            &instance,
            &ev,
            &regarding,
            jiff::Timestamp::now(),
        );
        let len = |f: &Option<String>| f.as_deref().map_or(0, str::len);
        assert!(len(&e.action) <= ACTION_MAX && len(&e.action) > 100);
        assert!(len(&e.reason) <= REASON_MAX);
        assert!(len(&e.note) <= NOTE_MAX && len(&e.note) > 1000);
        assert!(len(&e.reporting_instance) <= INSTANCE_MAX);
        assert!(len(&e.metadata.name) <= NAME_MAX);
        // The object is named whole: only the Event's own name is cut.
        assert_eq!(e.regarding.unwrap().name, Some(pod));
    }

    #[test]
    fn an_event_name_is_a_subdomain_of_at_most_253() {
        let nanos = 1_795_000_000_123_456_789_i128;
        assert_eq!(event_name("web-0", nanos), format!("web-0.{nanos:x}"));
        for object in [
            "p".repeat(253),
            format!("{}-{}", "a".repeat(235), "b".repeat(17)),
            format!("{}.{}", "a".repeat(235), "b".repeat(17)),
        ] {
            let name = event_name(&object, nanos);
            assert!(name.len() <= NAME_MAX, "{}", name.len());
            let valid = name.split('.').all(|label| {
                !label.is_empty()
                    && label.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && label.ends_with(|c: char| c.is_ascii_alphanumeric())
            });
            assert!(valid, "{name}");
        }
    }
}
