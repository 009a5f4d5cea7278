//! Exactly-once against a hostile or sloppy client (SPEC section 4, issue 32): path
//! variants, derived-key and number collisions, ambiguous bodies, repeated fields, quoted
//! keys and unprotected forwards. The real binary and a real redb file; the fake
//! downstream normalises paths as most servers do and counts every side effect.

mod common;

use common::fake_downstream::FakeDownstream;
use common::*;
use http::{Method, StatusCode};

const AUTH: (&str, &str) = ("authorization", "Bearer tenant-a");

async fn setup() -> (tempfile::TempDir, FakeDownstream, ProxyProc) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ds = FakeDownstream::start().await;
    let proxy = ProxyProc::start(dir.path(), &config(dir.path(), &ds.url()));
    (dir, ds, proxy)
}

const VARIANTS: [&str; 5] = [
    "/mail/send/",
    "/mail//send",
    "/mail/./send",
    "/mail/x/../send",
    "/mail/%73end",
];

/// Item 1: five spellings of `/mail/send`, each tried twice, are one route. Without a key
/// each is refused like `/mail/send` (key required), never forwarded unprotected.
#[tokio::test(flavor = "multi_thread")]
async fn path_variants_without_a_key_are_the_declared_route() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    for path in VARIANTS.iter().chain(VARIANTS.iter()) {
        let r = post(&c, &proxy.url(path), &[AUTH], r#"{"to":"a@x"}"#).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:key-missing");
    }
    assert_eq!(ds.commits(), 0, "no variant reached the downstream");
    assert_eq!(ds.hits(), 0);
}

/// Item 1: with one key, `/mail/send` and its variants are one execution: one side
/// effect, every other try a replay with the same execution id, and the downstream saw
/// the path that was matched.
#[tokio::test(flavor = "multi_thread")]
async fn path_variants_with_one_key_are_one_execution() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let k = [AUTH, ("idempotency-key", "k-path")];
    let body = r#"{"to":"a@x"}"#;
    let first = post(&c, &proxy.url("/mail/send"), &k, body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let id = first.header("idempotency-execution-id").expect("id");
    for path in VARIANTS.iter().chain(VARIANTS.iter()) {
        let r = post(&c, &proxy.url(path), &k, body).await;
        assert_eq!(r.status, StatusCode::CREATED, "{path}: {r:?}");
        assert_eq!(r.header("idempotent-replayed"), Some("true"), "{path}");
        assert_eq!(r.header("idempotency-execution-id"), Some(id), "{path}");
    }
    assert_eq!(ds.commits(), 1);
    // A variant tried first is forwarded as the route's own path.
    let k2 = [AUTH, ("idempotency-key", "k-path-2")];
    let r = post(&c, &proxy.url("/mail/x/../%73end/"), &k2, body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!(ds.commits(), 2);
    assert_eq!(ds.hits_on("/send"), 2, "forwarded as /send both times");
}

/// Item 1: a path with no normal form is refused, nothing forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn a_broken_percent_encoding_is_refused() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    for path in ["/mail/se%zznd", "/mail/send%", "/mail/%4"] {
        let r = post(
            &c,
            &proxy.url(path),
            &[AUTH, ("idempotency-key", "k-bad")],
            "{}",
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:bad-request");
    }
    assert_eq!(ds.hits(), 0);
}

/// Item 2: `op:1` + `2:3` and `op` + `1:2:3` (same tool call id) are two calls.
#[tokio::test(flavor = "multi_thread")]
async fn derived_keys_with_colons_do_not_collide() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let body = r#"{"to":"a@x"}"#;
    let a = post(
        &c,
        &url,
        &[
            AUTH,
            ("x-operation-id", "op:1"),
            ("x-model-round", "2:3"),
            ("x-tool-call-id", "call_1"),
        ],
        body,
    )
    .await;
    let b = post(
        &c,
        &url,
        &[
            AUTH,
            ("x-operation-id", "op"),
            ("x-model-round", "1:2:3"),
            ("x-tool-call-id", "call_1"),
        ],
        body,
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert_eq!(
        b.header("idempotent-replayed"),
        None,
        "not the first call's answer"
    );
    assert_ne!(
        a.header("idempotency-execution-id"),
        b.header("idempotency-execution-id")
    );
    assert_eq!(ds.commits(), 2, "both calls executed");
}

/// Item 3: numbers are compared by exact value, so a changed 64-bit id is a changed call
/// (422), while another spelling of the same value is a replay.
#[tokio::test(flavor = "multi_thread")]
async fn big_numbers_are_compared_exactly() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let pairs = [
        ("9007199254740992", "9007199254740993"),
        ("1234567890123456789", "1234567890123456788"),
        ("18446744073709551615", "18446744073709551614"),
        ("0.1", "0.10000000000000001"),
    ];
    for (i, (first, changed)) in pairs.iter().enumerate() {
        let key = format!("k-num-{i}");
        let k = [AUTH, ("idempotency-key", key.as_str())];
        let a = post(&c, &url, &k, &format!(r#"{{"id":{first}}}"#)).await;
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
        let b = post(&c, &url, &k, &format!(r#"{{"id":{changed}}}"#)).await;
        assert_eq!(
            b.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{first} vs {changed}"
        );
        assert_eq!(b.problem_type(), "urn:idemproxy:problem:key-mismatch");
    }
    assert_eq!(ds.commits(), pairs.len());
    let k = [AUTH, ("idempotency-key", "k-num-spelling")];
    let a = post(&c, &url, &k, r#"{"n":1,"m":12345678901234567890}"#).await;
    let b = post(&c, &url, &k, r#"{"m":1234567890123456789.0e1,"n":1.0e0}"#).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.header("idempotent-replayed"), Some("true"), "{b:?}");
    assert_eq!(ds.commits(), pairs.len() + 1);
}

/// Item 4: a JSON body naming one member twice is refused before anything is recorded.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_member_names_are_refused() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    for (i, body) in [
        r#"{"to":"alice","to":"mallory"}"#,
        r#"{"msg":{"to":"alice","subject":"x","to":"mallory"}}"#,
        r#"{"to":"alice","\u0074o":"mallory"}"#,
    ]
    .iter()
    .enumerate()
    {
        let key = format!("k-dup-{i}");
        let r = post(&c, &url, &[AUTH, ("idempotency-key", key.as_str())], body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:body-ambiguous");
        assert!(
            !String::from_utf8_lossy(&r.body).contains("mallory"),
            "the problem names the member, never its values"
        );
        // Nothing was recorded: the same key with a clean body is a first execution.
        let ok = post(
            &c,
            &url,
            &[AUTH, ("idempotency-key", key.as_str())],
            r#"{"to":"alice"}"#,
        )
        .await;
        assert_eq!(ok.status, StatusCode::CREATED, "{ok:?}");
        assert_eq!(ok.header("idempotent-replayed"), None);
    }
    assert_eq!(ds.commits(), 3, "only the clean bodies were sent");
}

/// Item 5: repeated query and form fields keep their order.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_fields_keep_their_order() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let k = [AUTH, ("idempotency-key", "k-query")];
    let a = post(&c, &proxy.url("/mail/send?a=1&a=2&b=0"), &k, "{}").await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let same = post(&c, &proxy.url("/mail/send?b=0&a=1&a=2"), &k, "{}").await;
    assert_eq!(same.header("idempotent-replayed"), Some("true"), "{same:?}");
    let swapped = post(&c, &proxy.url("/mail/send?a=2&a=1&b=0"), &k, "{}").await;
    assert_eq!(
        swapped.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{swapped:?}"
    );
    let form = |key: &'static str, body: &'static str| {
        let c = c.clone();
        let url = proxy.url("/mail/send");
        async move {
            send(
                &c,
                Method::POST,
                &url,
                &[
                    AUTH,
                    ("idempotency-key", key),
                    ("content-type", "application/x-www-form-urlencoded"),
                ],
                body,
            )
            .await
        }
    };
    assert_eq!(
        form("k-form", "to=a&to=b").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        form("k-form", "to=b&to=a").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(ds.commits(), 2);
}

/// Item 6: `"abc"` (an RFC 8941 string) and `abc` are one key; a key with a space, or a
/// broken quoted string, is invalid.
#[tokio::test(flavor = "multi_thread")]
async fn quoted_keys_are_the_same_key() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    let url = proxy.url("/mail/send");
    let body = r#"{"to":"a@x"}"#;
    let a = post(&c, &url, &[AUTH, ("idempotency-key", "\"k-q\"")], body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let b = post(&c, &url, &[AUTH, ("idempotency-key", "k-q")], body).await;
    assert_eq!(b.header("idempotent-replayed"), Some("true"), "{b:?}");
    assert_eq!(
        a.header("idempotency-execution-id"),
        b.header("idempotency-execution-id")
    );
    assert_eq!(ds.commits(), 1);
    for bad in ["a b", "\"a b\"", "\"abc", "\"a\"b\"", "\"a\\x\""] {
        let r = post(&c, &url, &[AUTH, ("idempotency-key", bad)], body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {r:?}");
        assert_eq!(r.problem_type(), "urn:idemproxy:problem:key-invalid");
    }
    assert_eq!(ds.commits(), 1);
}

/// Item 7: a side effect forwarded without protection says so.
#[tokio::test(flavor = "multi_thread")]
async fn unprotected_forwards_are_visible() {
    let (_dir, ds, proxy) = setup().await;
    let c = client();
    // A declared route with `key_required: false`, and an undeclared POST
    // (`unmatched: by_method`).
    for path in ["/mail/echo/x", "/mail/undeclared"] {
        let r = post(&c, &proxy.url(path), &[AUTH], "{}").await;
        assert_eq!(
            r.header("idempotency-status"),
            Some("unprotected"),
            "{path}: {r:?}"
        );
    }
    // A keyed call on the same route is protected, and says nothing of the kind.
    let r = post(
        &c,
        &proxy.url("/mail/echo/x"),
        &[AUTH, ("idempotency-key", "k-echo")],
        "{}",
    )
    .await;
    assert_eq!(r.header("idempotency-status"), None, "{r:?}");
    assert_eq!(ds.hits(), 3);
}
