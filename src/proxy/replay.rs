//! Delivered results kept in memory, ready to replay without a store read.
//!
//! A record in `result_delivered` never changes again: the state machine has no transition
//! out of it, and the only way it leaves the store is retention (gc deletes records whose
//! `expires_at` passed). So a copy of its answer, keyed by execution id and dropped at the
//! same `expires_at`, answers a retry exactly as the store would, whatever backend and
//! however many instances share it. Only `result_delivered` records are kept: a replay of a
//! `committed` one must still write `result_delivered`, so it takes the store path.
//!
//! A hit also skips canonicalising the arguments: the entry keeps the
//! [`RawDigest`](crate::policy::fingerprint::raw_digest) of the request that replayed or
//! delivered it, and a retry with the same bytes has the same `args_hash`. A retry with
//! other bytes (respelled JSON, other arguments) misses and is judged on the store path,
//! which answers a changed argument with 422 as before.
//!
//! An answer is admitted on its first replay from the store, not when it is first
//! delivered: most calls are never retried, and caching every first answer filled the
//! cache (and the proxy's memory) with answers nobody asks for again, evicting the ones
//! that are being retried. A call that is retried at all is likely retried again (an agent
//! loop that keeps failing after the call, duplicate deliveries), and from its second retry
//! on it is answered from memory.
//!
//! The cache is bounded by `limits.replay_cache_bytes` (weighted by each answer's size,
//! evicted by quick_cache's S3-FIFO policy) and belongs to one loaded config: a reload
//! starts an empty one, since the fingerprint rules of a route may have changed.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use std::sync::Arc;

use crate::policy::fingerprint::RawDigest;
use crate::policy::identity::ExecutionId;
use crate::policy::state::State;
use crate::store::{Record, StoredResponse};
use crate::wire::body::{self, ProxyBody};
use crate::wire::headers::{EXECUTION_ID, REPLAYED};

pub struct ReplayCache {
    entries: Option<Cache<ExecutionId, Arc<Entry>, ByBytes>>,
}

struct Entry {
    raw: RawDigest,
    expires_at_ms: i64,
    status: StatusCode,
    /// As a list, not a map: a `HeaderMap` is over half a kilobyte even for two headers,
    /// more than most answers; the map is built per replay instead.
    headers: Box<[(HeaderName, HeaderValue)]>,
    body: Bytes,
    weight: u64,
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<ExecutionId, Arc<Entry>> for ByBytes {
    fn weight(&self, _id: &ExecutionId, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// Memory per entry beside its bytes: the entry and its Arc, the cache's slot and key.
const ENTRY_OVERHEAD: u64 = 256;
/// Per header beside its name and value bytes.
const HEADER_OVERHEAD: u64 = 64;

impl ReplayCache {
    /// A cache of at most `bytes` (0: none; every replay reads the store).
    pub fn new(bytes: u64) -> ReplayCache {
        let entries = (bytes > 0).then(|| {
            let estimated_items = (bytes / 1024).clamp(16, 1 << 20) as usize;
            Cache::with_weighter(estimated_items, bytes, ByBytes)
        });
        ReplayCache { entries }
    }

    /// The replayed answer, if `id` is cached with the same request bytes and is still
    /// within retention.
    pub fn replay(
        &self,
        id: &ExecutionId,
        raw: &RawDigest,
        now_ms: i64,
    ) -> Option<Response<ProxyBody>> {
        let entry = self.entries.as_ref()?.get(id)?;
        if entry.raw != *raw || entry.expires_at_ms <= now_ms {
            return None;
        }
        let mut resp = Response::new(body::full(entry.body.clone()));
        *resp.status_mut() = entry.status;
        let headers = resp.headers_mut();
        headers.reserve(entry.headers.len());
        for (name, value) in entry.headers.iter() {
            headers.append(name.clone(), value.clone());
        }
        Some(resp)
    }

    /// Keep `record`'s answer if it is delivered (nothing else is final), matched by the
    /// request bytes `raw` from now on.
    pub fn remember(&self, record: &Record, raw: RawDigest) {
        let Some(entries) = &self.entries else { return };
        if record.state() != State::ResultDelivered
            || record.expires_at_ms <= crate::store::now_ms()
        {
            // Not final yet, or past retention (the store path still replays a record
            // that gc has not reached; memory keeps nothing past it).
            return;
        }
        let Some(stored) = &record.response else {
            return;
        };
        let (status, mut map) = response_head(stored, &record.id);
        map.insert(REPLAYED, HeaderValue::from_static("true"));
        let mut headers = Vec::with_capacity(map.len());
        let mut last = None;
        for (name, value) in map {
            // `into_iter` names only the first of a repeated header's values.
            if let Some(n) = name {
                last = Some(n);
            }
            if let Some(n) = &last {
                headers.push((n.clone(), value));
            }
        }
        let weight = ENTRY_OVERHEAD
            + (record.id.as_str().len() + stored.body.len()) as u64
            + headers
                .iter()
                .map(|(n, v)| (n.as_str().len() + v.len()) as u64 + HEADER_OVERHEAD)
                .sum::<u64>();
        entries.insert(
            record.id.clone(),
            Arc::new(Entry {
                raw,
                expires_at_ms: record.expires_at_ms,
                status,
                headers: headers.into_boxed_slice(),
                body: Bytes::from(stored.body.clone()),
                weight,
            }),
        );
    }
}

/// Status and headers of a stored answer as the client gets them: the downstream's
/// headers in their order, plus the execution id.
pub fn response_head(stored: &StoredResponse, id: &ExecutionId) -> (StatusCode, HeaderMap) {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut h = HeaderMap::with_capacity(stored.headers.len() + 2);
    for (n, v) in &stored.headers {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            h.append(n, v);
        }
    }
    h.insert(EXECUTION_ID, super::downstream::header_value(id.as_str()));
    (status, h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::state::Event;

    /// An expiry well after the test runs (remember keeps nothing already expired).
    const LATER: i64 = i64::MAX / 2;

    fn delivered(id: &str, expires_at_ms: i64) -> Record {
        let mut r = crate::store::record::tests::sample();
        r.id = ExecutionId(id.into());
        r.expires_at_ms = expires_at_ms;
        r.apply(Event::Start, 1, None).expect("start");
        r.response = Some(StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("set-cookie".into(), b"a=1".to_vec()),
                ("set-cookie".into(), b"b=2".to_vec()),
            ],
            body: br#"{"id":"msg_1"}"#.to_vec(),
        });
        r.apply(Event::Commit, 2, None).expect("commit");
        r
    }

    #[test]
    fn replays_only_delivered_records_with_the_same_bytes_within_retention() {
        let cache = ReplayCache::new(1 << 20);
        let raw = RawDigest([7; 32]);
        let mut r = delivered("ex_1", LATER);
        cache.remember(&r, raw);
        assert!(
            cache.replay(&r.id, &raw, 10).is_none(),
            "committed is not final: its replay must write result_delivered"
        );
        r.apply(Event::Deliver, 3, None).expect("deliver");
        cache.remember(&r, raw);
        let resp = cache.replay(&r.id, &raw, 10).expect("hit");
        assert_eq!(resp.status(), StatusCode::CREATED);
        assert_eq!(resp.headers()[EXECUTION_ID], "ex_1");
        assert_eq!(resp.headers()[REPLAYED], "true");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let cookies: Vec<_> = resp.headers().get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"], "repeated headers kept in order");
        assert!(
            cache.replay(&r.id, &RawDigest([8; 32]), 10).is_none(),
            "other bytes go to the store path"
        );
        assert!(cache.replay(&r.id, &raw, LATER).is_none(), "past retention");
        let mut expired = delivered("ex_3", crate::store::now_ms() - 1);
        expired.apply(Event::Deliver, 3, None).expect("deliver");
        cache.remember(&expired, raw);
        assert!(
            cache.replay(&expired.id, &raw, 10).is_none(),
            "nothing is kept past retention"
        );
        assert!(cache
            .replay(&ExecutionId("ex_2".into()), &raw, 10)
            .is_none());
    }

    #[test]
    fn a_zero_budget_keeps_nothing_and_the_budget_bounds_the_cache() {
        let off = ReplayCache::new(0);
        let mut r = delivered("ex_1", LATER);
        r.apply(Event::Deliver, 3, None).expect("deliver");
        off.remember(&r, RawDigest([1; 32]));
        assert!(off.replay(&r.id, &RawDigest([1; 32]), 10).is_none());

        let small = ReplayCache::new(16 * 1024);
        for i in 0..1_000 {
            let mut r = delivered(&format!("ex_{i}"), LATER);
            r.apply(Event::Deliver, 3, None).expect("deliver");
            small.remember(&r, RawDigest([1; 32]));
        }
        let kept = (0..1_000)
            .filter(|i| {
                small
                    .replay(&ExecutionId(format!("ex_{i}")), &RawDigest([1; 32]), 10)
                    .is_some()
            })
            .count();
        assert!(kept > 0 && kept < 100, "kept {kept} entries in 16 KiB");
    }
}
