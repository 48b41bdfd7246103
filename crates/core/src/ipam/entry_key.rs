//! A pool entry's key (its decimal offset, as stored) kept inline: 100,000 heap copies of a
//! few digits are 100,000 allocations of 32 bytes, beside the index's other copies of it.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Most bytes of a key kept inline: a decimal offset of up to 22 digits (any IPv4 range, an
/// IPv6 one of up to 2^73 addresses); a longer one is boxed.
const INLINE: usize = 22;

/// A pool entry's key as stored; reads as the `str` it was made from (order, equality and
/// hash are the text's, as a `String` key's are).
#[derive(Clone)]
pub struct EntryKey(Repr);

#[derive(Clone)]
enum Repr {
    Inline(u8, [u8; INLINE]),
    Boxed(Box<str>),
}

impl EntryKey {
    /// The key `key`.
    pub fn new(key: &str) -> EntryKey {
        if key.len() > INLINE {
            return EntryKey(Repr::Boxed(key.into()));
        }
        let mut bytes = [0; INLINE];
        bytes[..key.len()].copy_from_slice(key.as_bytes());
        EntryKey(Repr::Inline(key.len() as u8, bytes))
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Copied whole from a `str` at a char boundary (its end).
            Repr::Inline(len, bytes) => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
            Repr::Boxed(key) => key,
        }
    }

    /// Whether it is kept inline (no heap copy).
    pub fn is_inline(&self) -> bool {
        matches!(self.0, Repr::Inline(..))
    }
}

impl Deref for EntryKey {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for EntryKey {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for EntryKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for EntryKey {
    fn eq(&self, other: &EntryKey) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for EntryKey {}

impl PartialEq<str> for EntryKey {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for EntryKey {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for EntryKey {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<EntryKey> for String {
    fn eq(&self, other: &EntryKey) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<EntryKey> for str {
    fn eq(&self, other: &EntryKey) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<EntryKey> for &str {
    fn eq(&self, other: &EntryKey) -> bool {
        *self == other.as_str()
    }
}

impl PartialOrd for EntryKey {
    fn partial_cmp(&self, other: &EntryKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for EntryKey {
    fn cmp(&self, other: &EntryKey) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for EntryKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl fmt::Debug for EntryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for EntryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for EntryKey {
    fn from(key: &str) -> EntryKey {
        EntryKey::new(key)
    }
}

impl From<&String> for EntryKey {
    fn from(key: &String) -> EntryKey {
        EntryKey::new(key)
    }
}

impl From<String> for EntryKey {
    fn from(key: String) -> EntryKey {
        EntryKey::new(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_reads_back_as_stored_inline_or_boxed() {
        let long = "1".repeat(INLINE + 1);
        for key in ["", "0", "12345", "010", &"9".repeat(INLINE), &long] {
            assert_eq!(EntryKey::new(key).as_str(), key);
        }
        assert!(!EntryKey::new(&long).is_inline());
        assert!(EntryKey::new("12345").is_inline());
        assert_ne!(EntryKey::new("1"), EntryKey::new("10"));
        assert_eq!(std::mem::size_of::<EntryKey>(), 24);
    }

    #[test]
    fn keys_order_and_hash_as_their_text() {
        let mut keys: Vec<EntryKey> = ["9", "10", "010", "1"].map(EntryKey::from).into();
        keys.sort();
        assert_eq!(keys, ["010", "1", "10", "9"]);
        let set: std::collections::HashSet<EntryKey> = keys.into_iter().collect();
        assert!(set.contains("10"));
        assert_eq!(
            format!("{} {:?}", EntryKey::new("7"), EntryKey::new("7")),
            "7 \"7\""
        );
    }
}
