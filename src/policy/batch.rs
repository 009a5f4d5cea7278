//! Batches (SPEC section 9.3): one call that carries many side effects ("email these five
//! people"). In `atomic` mode the batch is one execution like any call: the downstream's
//! transaction is the commit boundary. In `independent` mode each item is an execution of
//! its own, so a retry after a crash after item 3 replays items 1–3 from their records and
//! goes on with item 4. This module owns what a batch *is*: its items as sent (the exact
//! bytes of each array element), each item's key, and the refusals that come before any
//! record is written (not an array, too many items, a repeated item key).

use std::sync::Arc;

use serde_json::value::RawValue;

use crate::config::Route;

/// `batch:` on a side-effect route.
#[derive(Clone, Debug)]
pub struct BatchSpec {
    /// JSON pointer to the array of items in the request body (MCP: in `arguments`).
    pub items: String,
    /// JSON pointer inside an item to its key; `None`: the item's index.
    pub item_key: Option<String>,
    /// More items than this is refused (`413 batch-too-large`) before anything is recorded.
    pub max_items: usize,
    /// How one item goes downstream in an `independent` batch (the `each` method and path,
    /// with the batch route's timeout, downstream key, reconciliation and retention; no
    /// approval of its own: the batch's approval covers every item). `None`: `atomic`.
    pub each: Option<Arc<Route>>,
}

impl BatchSpec {
    /// The mode the route declared: independent exactly when items have a route of their own.
    pub fn mode(&self) -> Mode {
        if self.each.is_some() {
            Mode::Independent
        } else {
            Mode::Atomic
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Independent,
    Atomic,
}

/// One item of a batch: where it is, its key, and its JSON exactly as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub index: usize,
    pub key: String,
    pub body: Vec<u8>,
}

/// Why a batch is refused before anything is recorded or sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The body is not JSON, or there is no array at the pointer (`400 batch-invalid`).
    Invalid(String),
    /// More items than `max_items` (`413 batch-too-large`).
    TooMany { count: usize, max: usize },
    /// Two items share a key (`422 batch-duplicate-item`).
    Duplicate {
        key: String,
        first: usize,
        second: usize,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Invalid(why) => f.write_str(why),
            Refusal::TooMany { count, max } => write!(
                f,
                "the batch has {count} items, more than this route's batch.max_items ({max}); nothing was recorded or sent"
            ),
            Refusal::Duplicate { key, first, second } => write!(
                f,
                "items {first} and {second} have the same item key `{key}`; each item of a batch needs its own key, nothing was recorded or sent"
            ),
        }
    }
}

/// The value at `pointer` in the JSON text `text`, as its raw text; `None` when absent.
fn raw_at<'a>(mut at: &'a RawValue, pointer: &str) -> Option<&'a RawValue> {
    if pointer.is_empty() {
        return Some(at);
    }
    for token in pointer[1..].split('/') {
        let token = token.replace("~1", "/").replace("~0", "~");
        at = match at.get().as_bytes().first() {
            Some(b'{') => {
                // Repeated member names were refused by the fingerprint already.
                let members: std::collections::HashMap<String, &RawValue> =
                    serde_json::from_str(at.get()).ok()?;
                members.get(&token).copied()?
            }
            Some(b'[') => {
                let elems: Vec<&RawValue> = serde_json::from_str(at.get()).ok()?;
                elems.get(token.parse::<usize>().ok()?).copied()?
            }
            _ => return None,
        };
    }
    Some(at)
}

/// The array at `pointer` in `body`, each element as its raw JSON text.
fn raw_items<'a>(body: &'a [u8], pointer: &str) -> Result<Vec<&'a RawValue>, Refusal> {
    let text = std::str::from_utf8(body)
        .map_err(|_| Refusal::Invalid("the batch body is not UTF-8 JSON".into()))?;
    let root: &RawValue = serde_json::from_str(text)
        .map_err(|e| Refusal::Invalid(format!("the batch body is not JSON: {e}")))?;
    let missing = || Refusal::Invalid(format!("the batch body has no array at `{pointer}`"));
    let at = raw_at(root, pointer).ok_or_else(missing)?;
    if !at.get().starts_with('[') {
        return Err(missing());
    }
    serde_json::from_str(at.get()).map_err(|_| missing())
}

/// How many items the batch carries, for an approval's preview (either mode).
pub fn count(spec: &BatchSpec, body: &[u8]) -> Option<usize> {
    raw_items(body, &spec.items).ok().map(|v| v.len())
}

/// The raw items, refused when there are more than the route allows (either mode).
fn sized<'a>(spec: &BatchSpec, body: &'a [u8]) -> Result<Vec<&'a RawValue>, Refusal> {
    let raw = raw_items(body, &spec.items)?;
    if raw.len() > spec.max_items {
        return Err(Refusal::TooMany {
            count: raw.len(),
            max: spec.max_items,
        });
    }
    Ok(raw)
}

/// Refuse a batch with more items than the route allows (an atomic batch's only check).
pub fn check_size(spec: &BatchSpec, body: &[u8]) -> Result<usize, Refusal> {
    sized(spec, body).map(|raw| raw.len())
}

/// The items of an `independent` batch in request order, with their keys: the value at
/// `item_key` (a string as is, anything else as its canonical JSON text) or the index.
pub fn items(spec: &BatchSpec, body: &[u8]) -> Result<Vec<Item>, Refusal> {
    let raw = sized(spec, body)?;
    let mut seen = std::collections::HashMap::with_capacity(raw.len());
    let mut out = Vec::with_capacity(raw.len());
    for (index, item) in raw.into_iter().enumerate() {
        let key = match &spec.item_key {
            None => index.to_string(),
            Some(p) => item_key(item, p).ok_or_else(|| {
                Refusal::Invalid(format!(
                    "item {index} has no item key at {p} (batch.item_key)"
                ))
            })?,
        };
        if let Some(first) = seen.insert(key.clone(), index) {
            return Err(Refusal::Duplicate {
                key,
                first,
                second: index,
            });
        }
        out.push(Item {
            index,
            key,
            body: item.get().as_bytes().to_vec(),
        });
    }
    Ok(out)
}

fn item_key(item: &RawValue, pointer: &str) -> Option<String> {
    let v = raw_at(item, pointer)?;
    match v.get().as_bytes().first()? {
        b'"' => serde_json::from_str(v.get()).ok(),
        b'n' => None,
        // Anything else by its canonical text (exact numbers: `1`, `1.0` and `1e0` are
        // one key, `9007199254740993` is not `9007199254740992`).
        _ => crate::policy::fingerprint::canonical_text(v.get().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(items: &str, key: Option<&str>, max: usize) -> BatchSpec {
        BatchSpec {
            items: items.into(),
            item_key: key.map(str::to_string),
            max_items: max,
            each: None,
        }
    }

    #[test]
    fn items_keep_their_bytes_and_order() {
        let body = br#"{"messages":[{"to":"a","n":1.50},{"to":"b"}]}"#;
        let got = items(&spec("/messages", Some("/to"), 10), body).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].key, "a");
        assert_eq!(got[0].body, br#"{"to":"a","n":1.50}"#);
        assert_eq!(got[1].index, 1);
        let by_index = items(&spec("/messages", None, 10), body).unwrap();
        assert_eq!(by_index[1].key, "1");
    }

    #[test]
    fn a_root_array_and_nested_pointers() {
        assert_eq!(items(&spec("", None, 10), b"[1,2,3]").unwrap().len(), 3);
        let body = br#"{"a":{"b/c":[{"id":7}]}}"#;
        let got = items(&spec("/a/b~1c", Some("/id"), 10), body).unwrap();
        assert_eq!(got[0].key, "7");
    }

    #[test]
    fn refusals() {
        let s = spec("/m", Some("/to"), 2);
        assert!(matches!(items(&s, b"nope"), Err(Refusal::Invalid(_))));
        assert!(matches!(
            items(&s, br#"{"m":{}}"#),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            items(&s, br#"{"m":[{"to":1},{"to":2},{"to":3}]}"#),
            Err(Refusal::TooMany { count: 3, max: 2 })
        ));
        assert_eq!(
            items(&s, br#"{"m":[{"to":"x"},{"to":"x"}]}"#),
            Err(Refusal::Duplicate {
                key: "x".into(),
                first: 0,
                second: 1
            })
        );
        // One number, two spellings: one key.
        assert!(matches!(
            items(&s, br#"{"m":[{"to":1},{"to":1.0}]}"#),
            Err(Refusal::Duplicate { .. })
        ));
        assert!(matches!(
            items(&s, br#"{"m":[{"from":"x"}]}"#),
            Err(Refusal::Invalid(_))
        ));
        assert_eq!(count(&s, br#"{"m":[1,2,3]}"#), Some(3));
    }
}
