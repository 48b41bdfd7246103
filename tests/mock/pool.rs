//! One IPPool served as the apiserver serves it: JSON patches applied whole or not at all
//! (a failed `test` refused with 422), reads by GET or by a LIST by name. A test changes it
//! between requests (another writer, the CNI) or refuses writes it chooses.

use serde_json::{Value, json};

use super::apiserver::Call;
use super::fixtures::{NS, POOL};

/// The pool, as JSON.
pub struct Pool {
    pub object: Value,
    /// Patches answered (applied or refused).
    pub patches: usize,
    /// Reads answered.
    pub reads: usize,
}

impl Pool {
    /// Pool [`POOL`] on 192.0.2.0/24 with entries `(key, sandbox, podref)`.
    pub fn new(entries: &[(&str, &str, &str)]) -> Pool {
        let pool = ipreclaim_core::fixtures::pool_named(POOL, entries);
        let mut object = serde_json::to_value(pool).expect("a pool");
        object["metadata"]["namespace"] = json!(NS);
        object["metadata"]["uid"] = json!("uid-pool");
        object["metadata"]["resourceVersion"] = json!("1");
        Pool {
            object,
            patches: 0,
            reads: 0,
        }
    }

    /// Pool [`POOL`] with entries `1..=n`, each of sandbox `sb-K` and pod `ns/pod-K`.
    pub fn numbered(n: usize) -> Pool {
        let entries: Vec<(String, String, String)> = (1..=n)
            .map(|k| (k.to_string(), format!("sb-{k}"), format!("ns/pod-{k}")))
            .collect();
        let entries: Vec<(&str, &str, &str)> = entries
            .iter()
            .map(|(k, s, p)| (k.as_str(), s.as_str(), p.as_str()))
            .collect();
        Pool::new(&entries)
    }

    /// Its allocation keys, sorted as the map is.
    pub fn keys(&self) -> Vec<String> {
        self.object["spec"]["allocations"]
            .as_object()
            .map(|a| a.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Sets entry `key` (another writer allocating it).
    pub fn allocate(&mut self, key: &str, id: &str, podref: &str) {
        self.object["spec"]["allocations"][key] = json!({"id": id, "podref": podref});
    }

    /// Removes entry `key` (the CNI's DEL).
    pub fn free(&mut self, key: &str) {
        if let Some(a) = self.object["spec"]["allocations"].as_object_mut() {
            a.remove(key);
        }
    }

    /// Answers `call`, a request for this pool: a read, or a patch applied if every op holds
    /// (else 422, as the apiserver refuses a failed `test`). Panics on anything else.
    pub fn answer(&mut self, call: Call) {
        let what = call.what();
        if what == format!("GET ippools/{POOL}") {
            self.reads += 1;
            return call.respond(200, &self.object);
        }
        if what == "GET ippools" {
            assert!(call.query.contains(POOL), "a LIST by name: {}", call.query);
            self.reads += 1;
            let list = json!({
                "apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPoolList",
                "metadata": {"resourceVersion": "1"}, "items": [self.object],
            });
            return call.respond(200, &list);
        }
        assert_eq!(what, format!("PATCH ippools/{POOL}"), "{}", call.body);
        self.patches += 1;
        match apply(&self.object, &call.body) {
            Ok(patched) => {
                self.object = patched;
                call.respond(200, &self.object);
            }
            Err(e) => call.fail(422, "Invalid", &e),
        }
    }
}

/// `patch` applied to `object` whole, or why not. A `test` for `null` holds where the path is
/// missing, as in the apiserver's JSON patch (whereabouts' own patches rely on it).
pub fn apply(object: &Value, patch: &Value) -> Result<Value, String> {
    let mut ops = Vec::new();
    for op in patch.as_array().expect("a JSON patch is an array") {
        let missing = object
            .pointer(op["path"].as_str().unwrap_or_default())
            .is_none();
        if op["op"] == "test" && op["value"].is_null() {
            if missing {
                continue;
            }
            return Err(format!("testing value {} failed: not null", op["path"]));
        }
        ops.push(op.clone());
    }
    let ops: json_patch::Patch =
        serde_json::from_value(Value::Array(ops)).map_err(|e| e.to_string())?;
    let mut patched = object.clone();
    json_patch::patch(&mut patched, &ops).map_err(|e| e.to_string())?;
    Ok(patched)
}

/// The keys of the entries a patch writes (`/spec/allocations/K/...`), once each.
pub fn patched_keys(patch: &Value) -> Vec<String> {
    let mut keys: Vec<String> = patch
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|op| op["path"].as_str()?.strip_prefix("/spec/allocations/"))
        .map(|rest| rest.split('/').next().unwrap_or_default().to_owned())
        .collect();
    keys.dedup();
    keys
}
