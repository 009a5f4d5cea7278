//! Delivered results kept in memory, ready to replay without a store read.
//!
//! A record in `result_delivered` never changes again: the state machine has no transition
//! out of it, and the only way it leaves the store is retention (gc deletes records whose
//! `expires_at` passed). So a copy of its answer, dropped at the same `expires_at`, answers
//! a retry exactly as the store would, whatever backend and however many instances share
//! it. Only `result_delivered` records are kept: a replay of a `committed` one must still
//! write `result_delivered`, so it takes the store path.
//!
//! An entry is keyed by the [`RawDigest`](crate::policy::fingerprint::raw_digest) of the
//! request that replayed it: one SHA-256 over the key, the tenant headers and the request's
//! bytes. Equal digests mean the same execution id and the same `args_hash`, so a hit
//! derives no id and canonicalises nothing. A retry with other bytes (respelled JSON, other
//! arguments) misses and is judged on the store path, which answers a changed argument
//! with 422 as before.
//!
//! Every replay of an entry reads it from whichever worker thread got the retry, so the
//! entry is laid out to be cheap to copy out, in both forms an answer leaves the proxy
//! in. Its header names and values and its body are one buffer, with where each field
//! lies: a replay the fast path read (plain HTTP/1.1) is a [`RawAnswer`] made of two
//! reference counts and a copy of the spans ([`ReplayCache::replay_raw`]), with no
//! `HeaderMap` and no `Response` (docs/PERFORMANCE.md, "Replay cache"). For every other replay
//! (HTTP/2, bodies the fast path leaves to hyper) the entry holds a ready `HeaderMap`
//! whose values are slices of the same buffer, cloned rather than rebuilt and rehashed
//! (building it from the fields on each replay cost 13% more instructions per replay).
//! Both give the same status, fields, order and body.
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

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use std::sync::Arc;

use crate::policy::fingerprint::RawDigest;
use crate::policy::identity::ExecutionId;
use crate::policy::state::State;
use crate::store::{Record, StoredResponse};
use crate::wire::body::{self, ProxyBody};
use crate::wire::headers::{EXECUTION_ID, REPLAYED};
use crate::wire::raw::{pairs, Field, Fields, RawAnswer};

pub struct ReplayCache {
    entries: Option<Cache<RawDigest, Arc<Entry>, ByBytes>>,
}

struct Entry {
    expires_at_ms: i64,
    status: StatusCode,
    /// The header names and values, then the body, back to back.
    buf: Bytes,
    /// Where each header's name and value lie in `buf`: the stored headers in their order,
    /// then the execution id and `Idempotent-Replayed`. Names are lower case, as
    /// `HeaderName` spells them.
    fields: Box<[Field]>,
    /// The same headers as a map, its values slices of `buf`.
    headers: HeaderMap,
    /// The body: the end of `buf`.
    body: Bytes,
    weight: u64,
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<RawDigest, Arc<Entry>> for ByBytes {
    fn weight(&self, _raw: &RawDigest, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// Memory per entry beside its buffer and spans: the entry and its Arc, the cache's slot
/// and key, the header map's index table.
const ENTRY_OVERHEAD: u64 = 320;
/// Per header beside its bytes: its span, and its bucket in the map.
const HEADER_OVERHEAD: u64 = (std::mem::size_of::<Field>() + 112) as u64;

impl ReplayCache {
    /// A cache of at most `bytes` (0: none; every replay reads the store).
    pub fn new(bytes: u64) -> ReplayCache {
        let entries = (bytes > 0).then(|| {
            let estimated_items = (bytes / 1024).clamp(16, 1 << 20) as usize;
            Cache::with_weighter(estimated_items, bytes, ByBytes)
        });
        ReplayCache { entries }
    }

    /// The entry a request with the same raw digest replayed before, if it is still within
    /// retention.
    fn hit(&self, raw: &RawDigest, now_ms: i64) -> Option<Arc<Entry>> {
        let entry = self.entries.as_ref()?.get(raw)?;
        (entry.expires_at_ms > now_ms).then_some(entry)
    }

    /// The replayed answer, if a request with the same raw digest replayed a delivered
    /// answer before and that answer is still within retention.
    pub fn replay(&self, raw: &RawDigest, now_ms: i64) -> Option<Response<ProxyBody>> {
        let entry = self.hit(raw, now_ms)?;
        let mut resp = Response::new(body::full(entry.body.clone()));
        *resp.status_mut() = entry.status;
        *resp.headers_mut() = entry.headers.clone();
        Some(resp)
    }

    /// [`ReplayCache::replay`] as the fast path writes it: the same status, fields and
    /// body, as bytes.
    pub fn replay_raw(&self, raw: &RawDigest, now_ms: i64) -> Option<RawAnswer> {
        let entry = self.hit(raw, now_ms)?;
        Some(RawAnswer {
            status: entry.status,
            head: entry.buf.clone(),
            fields: Fields::from_slice(&entry.fields),
            body: body::full(entry.body.clone()),
        })
    }

    /// Keep `record`'s answer if it is delivered (nothing else is final), for retries whose
    /// raw digest is `raw` (the digest of the request that got `record` from the store).
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
        let (buf, fields, headers, body) = one_buffer(&map, &stored.body);
        let weight = ENTRY_OVERHEAD + buf.len() as u64 + fields.len() as u64 * HEADER_OVERHEAD;
        entries.insert(
            raw,
            Arc::new(Entry {
                expires_at_ms: record.expires_at_ms,
                status,
                buf,
                fields,
                headers,
                body,
                weight,
            }),
        );
    }
}

/// The headers' names and values, in the same order, and the body, in one buffer; where
/// each field lies in it; the same headers as a map whose values are slices of it; the
/// body as a slice of it.
fn one_buffer(map: &HeaderMap, body: &[u8]) -> (Bytes, Box<[Field]>, HeaderMap, Bytes) {
    let head: usize = map.iter().map(|(n, v)| n.as_str().len() + v.len()).sum();
    let mut buf = BytesMut::with_capacity(head + body.len());
    let mut fields = Vec::with_capacity(map.len());
    for (name, value) in map {
        let name_at = buf.len();
        buf.extend_from_slice(name.as_str().as_bytes());
        let value_at = buf.len();
        buf.extend_from_slice(value.as_bytes());
        fields.push(Field::new(name_at..value_at, value_at..buf.len()));
    }
    buf.extend_from_slice(body);
    let buf = buf.freeze();
    let mut headers = HeaderMap::with_capacity(map.len());
    for ((name, v), f) in map.iter().zip(&fields) {
        // The bytes were a valid header value a moment ago.
        let mut value = HeaderValue::from_maybe_shared(buf.slice(f.value_range()))
            .unwrap_or_else(|_| v.clone());
        value.set_sensitive(v.is_sensitive());
        headers.append(name.clone(), value);
    }
    let body = buf.slice(head..);
    (buf, fields.into(), headers, body)
}

/// The execution id among a replayed answer's fields (for the log).
pub fn execution_id_of(answer: &RawAnswer) -> &[u8] {
    pairs(&answer.head, &answer.fields)
        .find(|(n, _)| *n == EXECUTION_ID.as_str().as_bytes())
        .map_or(&[][..], |(_, v)| v)
}

/// Status and headers of a stored answer as the client gets them: the downstream's
/// headers in their order, plus the execution id. Framing fields are not among them
/// ([`crate::wire::framing`]): records stored before they were kept out, or resolved by
/// an operator with them, still replay framed by their body alone.
pub fn response_head(stored: &StoredResponse, id: &ExecutionId) -> (StatusCode, HeaderMap) {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut h = HeaderMap::with_capacity(stored.headers.len() + 2);
    for (n, v) in &stored.headers {
        if crate::wire::framing::is_framing_name(n.as_bytes()) {
            continue;
        }
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

    fn collect(body: ProxyBody) -> Bytes {
        futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(body))
            .expect("a full body is ready")
            .expect("no error")
            .to_bytes()
    }

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
    fn stored_framing_fields_are_not_replayed() {
        // A record stored before framing fields were kept out of records.
        let stored = StoredResponse {
            status: 200,
            headers: vec![
                ("content-length".into(), b"3".to_vec()),
                ("Transfer-Encoding".into(), b"chunked".to_vec()),
                ("content-type".into(), b"text/plain".to_vec()),
            ],
            body: b"abcHTTP/1.1 200 OK\r\n\r\n".to_vec(),
        };
        let (_, h) = response_head(&stored, &ExecutionId("ex_f".into()));
        let names: Vec<_> = h.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["content-type", "idempotency-execution-id"]);
    }

    #[test]
    fn replays_only_delivered_records_with_the_same_bytes_within_retention() {
        let cache = ReplayCache::new(1 << 20);
        let raw = RawDigest([7; 32]);
        let mut r = delivered("ex_1", LATER);
        cache.remember(&r, raw);
        assert!(
            cache.replay(&raw, 10).is_none(),
            "committed is not final: its replay must write result_delivered"
        );
        r.apply(Event::Deliver, 3, None).expect("deliver");
        cache.remember(&r, raw);
        let resp = cache.replay(&raw, 10).expect("hit");
        assert_eq!(resp.status(), StatusCode::CREATED);
        assert_eq!(resp.headers()[EXECUTION_ID], "ex_1");
        assert_eq!(resp.headers()[REPLAYED], "true");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let cookies: Vec<_> = resp.headers().get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"], "repeated headers kept in order");
        let names: Vec<_> = resp.headers().keys().map(|n| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content-type",
                "set-cookie",
                EXECUTION_ID.as_str(),
                REPLAYED.as_str()
            ],
            "the stored order, then the proxy's own"
        );
        // The same answer as bytes, for the fast path: status, fields in order, body.
        let lane = cache.replay_raw(&raw, 10).expect("hit as bytes");
        assert_eq!(lane.status, resp.status());
        let map_fields: Vec<_> = resp
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
        let lane_fields: Vec<_> = lane
            .fields()
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect();
        assert_eq!(lane_fields, map_fields);
        assert_eq!(execution_id_of(&lane), b"ex_1");
        assert_eq!(&collect(lane.body)[..], br#"{"id":"msg_1"}"#);
        assert!(cache.replay_raw(&raw, LATER).is_none(), "past retention");
        assert_eq!(&collect(resp.into_body())[..], br#"{"id":"msg_1"}"#);
        assert!(
            cache.replay(&RawDigest([8; 32]), 10).is_none(),
            "other bytes go to the store path"
        );
        assert!(cache.replay(&raw, LATER).is_none(), "past retention");
        let mut expired = delivered("ex_3", crate::store::now_ms() - 1);
        expired.apply(Event::Deliver, 3, None).expect("deliver");
        let other = RawDigest([9; 32]);
        cache.remember(&expired, other);
        assert!(
            cache.replay(&other, 10).is_none(),
            "nothing is kept past retention"
        );
    }

    #[test]
    fn a_zero_budget_keeps_nothing_and_the_budget_bounds_the_cache() {
        let off = ReplayCache::new(0);
        let mut r = delivered("ex_1", LATER);
        r.apply(Event::Deliver, 3, None).expect("deliver");
        off.remember(&r, RawDigest([1; 32]));
        assert!(off.replay(&RawDigest([1; 32]), 10).is_none());

        let small = ReplayCache::new(16 * 1024);
        let digest = |i: u32| {
            let mut d = [0u8; 32];
            d[..4].copy_from_slice(&i.to_be_bytes());
            RawDigest(d)
        };
        for i in 0..1_000 {
            let mut r = delivered(&format!("ex_{i}"), LATER);
            r.apply(Event::Deliver, 3, None).expect("deliver");
            small.remember(&r, digest(i));
        }
        let kept = (0..1_000)
            .filter(|i| small.replay(&digest(*i), 10).is_some())
            .count();
        assert!(kept > 0 && kept < 100, "kept {kept} entries in 16 KiB");
    }
}
