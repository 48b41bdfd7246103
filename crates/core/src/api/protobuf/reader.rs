//! A pod list read as its bytes arrive: each pod is read and dropped once its bytes are in, so
//! a page costs its reader one pod's bytes and the JSON it keeps, not the page's bytes. A page
//! of pods whose tenants filled their annotations is 256 KiB a pod in protobuf: read whole, the
//! page size was bounded by that.
//!
//! The envelope's kind must come before its raw bytes (Go writes fields in their order); a
//! response that has them the other way round is refused, and the caller asks for JSON.

use super::{Fields, MAGIC, ProtobufError, Value, list_meta, pod, status, text};

/// The largest field read whole: a pod, the list's metadata, a `Status`. etcd refuses objects
/// over 1.5 MiB by default; a larger one is refused here too (its page is then asked in JSON).
pub const MAX_FIELD: usize = 16 * 1024 * 1024;

/// Where in the response the next bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Magic,
    /// Between the envelope's fields.
    Envelope,
    /// Inside the envelope's raw `PodList`, with this many of its bytes still to come.
    List {
        left: usize,
    },
}

/// A `PodList` (or a `Status`) in protobuf, fed as it arrives, read into the JSON
/// [`pod_list_as_json`](super::pod_list_as_json) writes.
#[derive(Debug)]
pub struct PodListReader {
    /// Bytes received and not read yet (at most one field and what came with it).
    pending: Vec<u8>,
    /// How many bytes were read before `pending`'s first: the place an error names.
    offset: usize,
    place: Place,
    kind: Option<String>,
    encoding: String,
    /// `{"items":[` and the items so far, each as its JSON.
    items: Vec<u8>,
    count: usize,
    /// The list's metadata, as JSON.
    meta: Vec<u8>,
    /// A `Status` response, as JSON.
    status: Option<Vec<u8>>,
    /// Whether the raw bytes were met.
    raw_seen: bool,
}

impl Default for PodListReader {
    fn default() -> Self {
        PodListReader {
            pending: Vec::new(),
            offset: 0,
            place: Place::Magic,
            kind: None,
            encoding: String::new(),
            items: br#"{"items":["#.to_vec(),
            count: 0,
            meta: b"{}".to_vec(),
            status: None,
            raw_seen: false,
        }
    }
}

/// A field's header: its tag and the size of its value.
struct Header {
    tag: u64,
    value: HeaderValue,
    /// The header's length in bytes.
    len: usize,
}

enum HeaderValue {
    /// A varint, read with the header (no field read here is one).
    Varint,
    Fixed(usize),
    Bytes(usize),
}

/// A varint at the start of `bytes`: `None` when its end has not arrived yet.
fn varint(bytes: &[u8]) -> Result<Option<(u64, usize)>, ()> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if *byte < 0x80 {
            return Ok(Some((value, i + 1)));
        }
    }
    if bytes.len() >= 10 { Err(()) } else { Ok(None) }
}

/// The header of the field at the start of `bytes`: `None` when it has not all arrived.
fn header(bytes: &[u8], at: usize) -> Result<Option<Header>, ProtobufError> {
    let malformed = |_| ProtobufError::Malformed(at);
    let Some((key, n)) = varint(bytes).map_err(malformed)? else {
        return Ok(None);
    };
    let value = match key & 7 {
        0 => match varint(&bytes[n..]).map_err(malformed)? {
            Some((_, m)) => {
                return Ok(Some(Header {
                    tag: key >> 3,
                    value: HeaderValue::Varint,
                    len: n + m,
                }));
            }
            None => return Ok(None),
        },
        1 => HeaderValue::Fixed(8),
        5 => HeaderValue::Fixed(4),
        2 => match varint(&bytes[n..]).map_err(malformed)? {
            Some((len, m)) => {
                let len = usize::try_from(len).map_err(|_| ProtobufError::Malformed(at))?;
                return Ok(Some(Header {
                    tag: key >> 3,
                    value: HeaderValue::Bytes(len),
                    len: n + m,
                }));
            }
            None => return Ok(None),
        },
        other => return Err(ProtobufError::WireType(other as u8)),
    };
    Ok(Some(Header {
        tag: key >> 3,
        value,
        len: n,
    }))
}

impl PodListReader {
    /// Reads the bytes that arrived next.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), ProtobufError> {
        self.pending.extend_from_slice(bytes);
        let mut read = 0;
        let result = self.read_fields(&mut read);
        self.pending.drain(..read);
        self.offset += read;
        result
    }

    /// The JSON of the whole response, once every byte was pushed.
    pub fn finish(mut self) -> Result<Vec<u8>, ProtobufError> {
        if self.place == Place::Magic {
            return Err(ProtobufError::NoMagic);
        }
        if !self.pending.is_empty() || self.place != Place::Envelope {
            return Err(ProtobufError::Malformed(self.offset));
        }
        let kind = self.kind.unwrap_or_default();
        if !self.encoding.is_empty() {
            return Err(ProtobufError::Unexpected(format!(
                "{kind} encoded {}",
                self.encoding
            )));
        }
        match kind.as_str() {
            "PodList" => {
                self.items
                    .extend_from_slice(br#"],"apiVersion":"v1","kind":"PodList","metadata":"#);
                self.items.extend_from_slice(&self.meta);
                self.items.push(b'}');
                // Copied whole by its reader: no spare capacity held beside that copy.
                self.items.shrink_to_fit();
                Ok(self.items)
            }
            "Status" => self.status.map_or_else(|| status(&[]), Ok),
            _ => Err(ProtobufError::Unexpected(kind)),
        }
    }

    /// How many received bytes wait to be read.
    #[cfg(test)]
    pub(super) fn buffered(&self) -> usize {
        self.pending.len()
    }

    /// Reads every whole field in `pending` from `*read` on, moving `*read` past each.
    fn read_fields(&mut self, read: &mut usize) -> Result<(), ProtobufError> {
        if self.place == Place::Magic {
            if self.pending.len() < MAGIC.len() {
                return if MAGIC.starts_with(&self.pending) {
                    Ok(())
                } else {
                    Err(ProtobufError::NoMagic)
                };
            }
            if !self.pending.starts_with(MAGIC) {
                return Err(ProtobufError::NoMagic);
            }
            *read = MAGIC.len();
            self.place = Place::Envelope;
        }
        loop {
            let at = self.offset + *read;
            let rest = &self.pending[*read..];
            if let Place::List { left: 0 } = self.place {
                self.place = Place::Envelope;
            }
            if rest.is_empty() {
                return Ok(());
            }
            let Some(h) = header(rest, at)? else {
                return Ok(());
            };
            let size = match h.value {
                HeaderValue::Varint => 0,
                HeaderValue::Fixed(n) | HeaderValue::Bytes(n) => n,
            };
            let whole = h
                .len
                .checked_add(size)
                .ok_or(ProtobufError::Malformed(at))?;
            match self.place {
                Place::Envelope if h.tag == 2 && matches!(h.value, HeaderValue::Bytes(_)) => {
                    // The raw object: a pod list is read as it comes, anything else whole.
                    if self.raw_seen {
                        return Err(ProtobufError::Unexpected("two raw objects".into()));
                    }
                    match self.kind.as_deref() {
                        Some("PodList") => {
                            self.raw_seen = true;
                            *read += h.len;
                            self.place = Place::List { left: size };
                            continue;
                        }
                        Some("Status") => {}
                        Some(other) => return Err(ProtobufError::Unexpected(other.to_owned())),
                        None => {
                            return Err(ProtobufError::Unexpected(
                                "an object whose kind comes after it".into(),
                            ));
                        }
                    }
                }
                Place::List { left } if whole > left => {
                    return Err(ProtobufError::Malformed(at));
                }
                _ => {}
            }
            // Read whole from here on: bounded (the raw list, streamed above, is not).
            if size > MAX_FIELD {
                return Err(ProtobufError::Malformed(at));
            }
            if rest.len() < whole {
                return Ok(());
            }
            let value = &rest[h.len..whole];
            match (self.place, h.tag, h.value) {
                (Place::Envelope, 1, HeaderValue::Bytes(_)) => {
                    if self.raw_seen {
                        // The object was read as the kind named before it.
                        return Err(ProtobufError::Unexpected("a kind after its object".into()));
                    }
                    for f in Fields::of(value) {
                        if let (2, Value::Bytes(k)) = f? {
                            self.kind = Some(text(k).into_owned());
                        }
                    }
                }
                (Place::Envelope, 2, HeaderValue::Bytes(_)) => {
                    self.raw_seen = true;
                    self.status = Some(status(value)?);
                }
                (Place::Envelope, 3, HeaderValue::Bytes(_)) => {
                    self.encoding = text(value).into_owned();
                }
                (Place::List { .. }, 1, HeaderValue::Bytes(_)) => {
                    self.meta = serde_json::to_vec(&list_meta(value)?)
                        .expect("a list's metadata serialises");
                }
                (Place::List { .. }, 2, HeaderValue::Bytes(_)) => {
                    if self.count > 0 {
                        self.items.push(b',');
                    }
                    serde_json::to_writer(&mut self.items, &pod(value)?)
                        .expect("a pod of strings and numbers serialises");
                    self.count += 1;
                }
                _ => {}
            }
            *read += whole;
            if let Place::List { left } = &mut self.place {
                *left -= whole;
            }
        }
    }
}
