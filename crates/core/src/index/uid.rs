//! An object's uid as the index keeps it: the apiserver assigns UUIDs, whose 36 characters
//! fit in 16 bytes inline instead of a heap string of 48 (100,000 reservations: 4 MB).

use std::fmt;

/// A uid: a UUID's bytes, or the text as given when it is not a UUID in its canonical
/// lowercase form (so the text read back is always the text stored).
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Uid {
    /// A canonical lowercase UUID.
    Uuid([u8; 16]),
    /// Anything else, kept as it was.
    Text(Box<str>),
}

impl Uid {
    /// The uid `text`.
    pub fn of(text: &str) -> Uid {
        parse_uuid(text).map_or_else(|| Uid::Text(text.into()), Uid::Uuid)
    }

    /// Whether this is the uid `text`.
    pub fn is(&self, text: &str) -> bool {
        match self {
            Uid::Uuid(bytes) => parse_uuid(text).is_some_and(|b| &b == bytes),
            Uid::Text(t) => &**t == text,
        }
    }
}

impl Default for Uid {
    fn default() -> Self {
        Uid::Text("".into())
    }
}

/// The bytes of a canonical lowercase UUID (`8-4-4-4-12` hex digits).
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let b = text.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let mut digits = b.iter().filter(|&&c| c != b'-');
    let mut out = [0u8; 16];
    for byte in &mut out {
        let hi = hex(*digits.next()?)?;
        let lo = hex(*digits.next()?)?;
        *byte = hi << 4 | lo;
    }
    Some(out)
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Uid::Uuid(b) => {
                for (i, byte) in b.iter().enumerate() {
                    if matches!(i, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            Uid::Text(t) => f.write_str(t),
        }
    }
}

impl fmt::Debug for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_is_kept_in_its_bytes_and_reads_back_as_given() {
        let text = "6f1c9d2e-8a4b-4c3d-9e2f-1a2b3c4d5e6f";
        let uid = Uid::of(text);
        assert!(matches!(uid, Uid::Uuid(_)));
        assert_eq!(uid.to_string(), text);
        assert!(uid.is(text));
        assert!(!uid.is("6f1c9d2e-8a4b-4c3d-9e2f-1a2b3c4d5e60"));
        assert!(!uid.is("6F1C9D2E-8A4B-4C3D-9E2F-1A2B3C4D5E6F"));
    }

    #[test]
    fn anything_else_is_kept_as_text() {
        for text in [
            "",
            "u1",
            "6F1C9D2E-8A4B-4C3D-9E2F-1A2B3C4D5E6F",
            "6f1c9d2e08a4b-4c3d-9e2f-1a2b3c4d5e6f",
            "6f1c9d2e-8a4b-4c3d-9e2f-1a2b3c4d5e6g",
            "6f1c9d2e-8a4b-4c3d-9e2f-1a2b3c4d5e6f0",
        ] {
            let uid = Uid::of(text);
            assert!(matches!(uid, Uid::Text(_)), "{text}");
            assert_eq!(uid.to_string(), text);
            assert!(uid.is(text));
        }
        assert!(!Uid::of("u1").is("u2"));
        assert_eq!(std::mem::size_of::<Uid>(), 24);
    }
}
