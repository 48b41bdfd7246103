//! Pod lists in the apiserver's protobuf encoding, read into the text [`PodView`] reads.
//!
//! The apiserver serves a page of pods in protobuf in half to four fifths of its JSON's
//! time, and the page is a third of the bytes (issue 36: most of a start at 100,000 pods is
//! the apiserver's list). Only the fields [`PodView`] reads are taken from each pod, and of its annotations
//! only [`KEPT_POD_ANNOTATIONS`], each cut to its most as `PodView` cuts it from JSON; the rest
//! is skipped unread. A whole pod is never decoded: what a page costs past its bytes is what
//! the reader keeps.
//! The output is JSON of the same shape a JSON list has, for the same reader: one reading of
//! pods, whichever encoding the page came in.
//!
//! A hand-written walk over the wire format (varints and length-prefixed fields) rather than a
//! generated decoder: a generated `Pod` decodes every field (containers, env, every annotation)
//! into memory before any is dropped.
//!
//! [`PodView`]: super::slim::PodView

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;

use super::slim::{KEPT_POD_ANNOTATIONS, cut_to};

/// The media type a protobuf response is in.
pub const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// The four bytes every protobuf object of the apiserver starts with.
const MAGIC: &[u8; 4] = b"k8s\0";

/// Why a protobuf response could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtobufError {
    /// It does not start with the apiserver's magic bytes.
    #[error("not a Kubernetes protobuf object (no magic prefix)")]
    NoMagic,
    /// The wire format is broken at this byte.
    #[error("malformed protobuf at byte {0}")]
    Malformed(usize),
    /// A wire type this reader does not take (groups).
    #[error("unsupported protobuf wire type {0}")]
    WireType(u8),
    /// The object is compressed or of a kind this reader does not take.
    #[error("unexpected protobuf object {0:?}")]
    Unexpected(String),
    /// A timestamp out of range.
    #[error("timestamp {0} out of range")]
    Time(i64),
}

/// One field's value on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// A fixed 32- or 64-bit value (no field read here has one).
    Fixed,
}

/// The fields of one message, in wire order.
struct Fields<'a> {
    whole: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn of(message: &'a [u8]) -> Fields<'a> {
        Fields {
            whole: message,
            at: 0,
        }
    }

    fn varint(&mut self) -> Result<u64, ProtobufError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .whole
                .get(self.at)
                .ok_or(ProtobufError::Malformed(self.at))?;
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(value);
            }
        }
        Err(ProtobufError::Malformed(self.at))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtobufError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.whole.len())
            .ok_or(ProtobufError::Malformed(self.at))?;
        let taken = &self.whole[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn field(&mut self) -> Result<(u64, Value<'a>), ProtobufError> {
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => self.take(8).map(|_| Value::Fixed)?,
            2 => {
                let len = usize::try_from(self.varint()?)
                    .map_err(|_| ProtobufError::Malformed(self.at))?;
                Value::Bytes(self.take(len)?)
            }
            5 => self.take(4).map(|_| Value::Fixed)?,
            other => return Err(ProtobufError::WireType(other as u8)),
        };
        Ok((key >> 3, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), ProtobufError>;

    fn next(&mut self) -> Option<Self::Item> {
        (self.at < self.whole.len()).then(|| self.field())
    }
}

/// A string field's text as the apiserver's JSON writes it: each byte that is not part of
/// valid UTF-8 becomes one U+FFFD, as Go's encoder does (Rust's `from_utf8_lossy` would write
/// one for a whole broken sequence).
fn text(bytes: &[u8]) -> Cow<'_, str> {
    if let Ok(valid) = std::str::from_utf8(bytes) {
        return Cow::Borrowed(valid);
    }
    let mut out = String::with_capacity(bytes.len() + 2);
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        out.extend(std::iter::repeat_n(
            char::REPLACEMENT_CHARACTER,
            chunk.invalid().len(),
        ));
    }
    Cow::Owned(out)
}

/// A kept annotation's value, cut as [`PodView`](super::slim::PodView) cuts it: the page's
/// JSON never carries more of a tenant's annotation than the reader keeps (escaped, a value of
/// quotes would be twice its size).
fn cut(value: Cow<'_, str>, most: usize) -> Cow<'_, str> {
    match value {
        Cow::Borrowed(v) => Cow::Borrowed(cut_to(v, most)),
        Cow::Owned(mut v) => {
            let end = cut_to(&v, most).len();
            v.truncate(end);
            Cow::Owned(v)
        }
    }
}

/// A string field that JSON omits when empty.
fn non_empty(bytes: &[u8]) -> Option<Cow<'_, str>> {
    (!bytes.is_empty()).then(|| text(bytes))
}

/// A response body in protobuf as the JSON a JSON response would have been, for what
/// [`PodView`](super::slim::PodView) and kube's `Status` read: a `PodList` or a `Status`.
/// Read as it arrives with [`PodListReader`].
pub fn pod_list_as_json(body: &[u8]) -> Result<Vec<u8>, ProtobufError> {
    let mut reader = PodListReader::default();
    reader.push(body)?;
    reader.finish()
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListMeta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_version: Option<Cow<'a, str>>,
    #[serde(rename = "continue", skip_serializing_if = "Option::is_none")]
    continue_: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining_item_count: Option<i64>,
}

fn list_meta(message: &[u8]) -> Result<ListMeta<'_>, ProtobufError> {
    let mut meta = ListMeta::default();
    for field in Fields::of(message) {
        match field? {
            (2, Value::Bytes(rv)) => meta.resource_version = non_empty(rv),
            (3, Value::Bytes(c)) => meta.continue_ = non_empty(c),
            (4, Value::Varint(n)) => meta.remaining_item_count = Some(n as i64),
            _ => {}
        }
    }
    Ok(meta)
}

/// A pod, as much as `PodView` reads.
#[derive(Serialize, Default)]
struct Pod<'a> {
    metadata: PodMeta<'a>,
    spec: PodSpec<'a>,
    status: PodStatus<'a>,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodMeta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    uid: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource_version: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    creation_timestamp: Option<Time>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<Cow<'a, str>, Cow<'a, str>>,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct PodSpec<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    node_name: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    termination_grace_period_seconds: Option<i64>,
}

#[derive(Serialize, Default)]
struct PodStatus<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    phase: Option<Cow<'a, str>>,
}

fn pod(message: &[u8]) -> Result<Pod<'_>, ProtobufError> {
    let mut pod = Pod::default();
    for field in Fields::of(message) {
        match field? {
            (1, Value::Bytes(m)) => pod.metadata = meta(m)?,
            (2, Value::Bytes(spec)) => {
                for f in Fields::of(spec) {
                    match f? {
                        (10, Value::Bytes(node)) => pod.spec.node_name = non_empty(node),
                        (4, Value::Varint(s)) => {
                            pod.spec.termination_grace_period_seconds = Some(s as i64)
                        }
                        _ => {}
                    }
                }
            }
            (3, Value::Bytes(status)) => {
                for f in Fields::of(status) {
                    if let (1, Value::Bytes(phase)) = f? {
                        pod.status.phase = non_empty(phase);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(pod)
}

fn meta(message: &[u8]) -> Result<PodMeta<'_>, ProtobufError> {
    let mut meta = PodMeta::default();
    for field in Fields::of(message) {
        match field? {
            (1, Value::Bytes(b)) => meta.name = non_empty(b),
            (3, Value::Bytes(b)) => meta.namespace = non_empty(b),
            (5, Value::Bytes(b)) => meta.uid = non_empty(b),
            (6, Value::Bytes(b)) => meta.resource_version = non_empty(b),
            (8, Value::Bytes(t)) => meta.creation_timestamp = time(t)?,
            (12, Value::Bytes(entry)) => {
                let (mut key, mut value) = (&[][..], &[][..]);
                for f in Fields::of(entry) {
                    match f? {
                        (1, Value::Bytes(k)) => key = k,
                        (2, Value::Bytes(v)) => value = v,
                        _ => {}
                    }
                }
                if let Some((kept, most)) = KEPT_POD_ANNOTATIONS
                    .iter()
                    .find(|(k, _)| k.as_bytes() == key)
                {
                    meta.annotations
                        .insert(Cow::Borrowed(*kept), cut(text(value), *most));
                }
            }
            _ => {}
        }
    }
    Ok(meta)
}

/// A `metav1.Time`: none when empty (Go's zero time); whole seconds, as its JSON has them.
fn time(message: &[u8]) -> Result<Option<Time>, ProtobufError> {
    if message.is_empty() {
        return Ok(None);
    }
    let mut seconds = 0i64;
    for field in Fields::of(message) {
        if let (1, Value::Varint(s)) = field? {
            seconds = s as i64;
        }
    }
    jiff::Timestamp::from_second(seconds)
        .map(|t| Some(Time(t)))
        .map_err(|_| ProtobufError::Time(seconds))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ApiStatus<'a> {
    api_version: &'static str,
    kind: &'static str,
    metadata: ListMeta<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details<'a>>,
    code: i64,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct Details<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    uid: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    causes: Vec<Cause<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<i64>,
}

#[derive(Serialize, Default)]
struct Cause<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<Cow<'a, str>>,
}

fn status(raw: &[u8]) -> Result<Vec<u8>, ProtobufError> {
    let mut status = ApiStatus {
        api_version: "v1",
        kind: "Status",
        metadata: ListMeta::default(),
        status: None,
        message: None,
        reason: None,
        details: None,
        code: 0,
    };
    for field in Fields::of(raw) {
        match field? {
            (1, Value::Bytes(m)) => status.metadata = list_meta(m)?,
            (2, Value::Bytes(s)) => status.status = non_empty(s),
            (3, Value::Bytes(m)) => status.message = non_empty(m),
            (4, Value::Bytes(r)) => status.reason = non_empty(r),
            (5, Value::Bytes(d)) => status.details = Some(details(d)?),
            // An int32: a negative one is ten bytes of sign.
            (6, Value::Varint(c)) => status.code = i64::from(c as i32),
            _ => {}
        }
    }
    Ok(serde_json::to_vec(&status).expect("a status of strings and numbers serialises"))
}

fn details(message: &[u8]) -> Result<Details<'_>, ProtobufError> {
    let mut details = Details::default();
    for field in Fields::of(message) {
        match field? {
            (1, Value::Bytes(b)) => details.name = non_empty(b),
            (2, Value::Bytes(b)) => details.group = non_empty(b),
            (3, Value::Bytes(b)) => details.kind = non_empty(b),
            (6, Value::Bytes(b)) => details.uid = non_empty(b),
            (5, Value::Varint(s)) => details.retry_after_seconds = Some(i64::from(s as i32)),
            (4, Value::Bytes(c)) => {
                let mut cause = Cause::default();
                for f in Fields::of(c) {
                    match f? {
                        (1, Value::Bytes(b)) => cause.reason = non_empty(b),
                        (2, Value::Bytes(b)) => cause.message = non_empty(b),
                        (3, Value::Bytes(b)) => cause.field = non_empty(b),
                        _ => {}
                    }
                }
                details.causes.push(cause);
            }
            _ => {}
        }
    }
    Ok(details)
}

mod reader;
pub use reader::{MAX_FIELD, PodListReader};

#[cfg(test)]
mod tests;
