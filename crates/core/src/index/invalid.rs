//! Objects skipped because they do not fit their type: reported once (a log line and an Event
//! on the object), forgotten when they fit again or go.

use std::collections::BTreeMap;

/// An object that does not fit its type: kind, namespace, name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InvalidKey {
    /// Its kind.
    pub kind: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// Why an object does not fit, and its uid (for an Event on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidObject {
    /// Its uid.
    pub uid: String,
    /// What is wrong.
    pub error: String,
}

/// Objects that do not fit their type.
#[derive(Debug, Default)]
pub struct InvalidIndex {
    objects: BTreeMap<InvalidKey, InvalidObject>,
}

impl InvalidIndex {
    /// Records an object that does not fit; whether this is news (new or changed).
    pub fn set(&mut self, key: InvalidKey, uid: String, error: String) -> bool {
        let object = InvalidObject { uid, error };
        self.objects.insert(key, object.clone()) != Some(object)
    }

    /// Forgets an invalid object (it fits now, or it is gone).
    pub fn clear(&mut self, key: &InvalidKey) {
        self.objects.remove(key);
    }

    /// Whether `kind` `name` (in any namespace) is known not to fit.
    pub fn has(&self, kind: &str, name: &str) -> bool {
        self.objects
            .keys()
            .any(|k| k.kind == kind && k.name == name)
    }

    /// The invalid objects of `kind`.
    pub fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a InvalidKey> + 'a {
        self.objects.keys().filter(move |k| k.kind == kind)
    }

    /// Every invalid object.
    pub fn all(&self) -> &BTreeMap<InvalidKey, InvalidObject> {
        &self.objects
    }
}
