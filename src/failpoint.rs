//! Named crash points for the crash-matrix tests (compiled in with `--features failpoints`).
//! When `IDEMPROXY_FAILPOINT` names a point, the process announces it on stderr
//! (`FAILPOINT <name> reached`) and parks the task there forever, so the test harness can
//! SIGKILL the process at exactly that boundary. `IDEMPROXY_FAILPOINT=<name>@<n>` lets the
//! first n-1 passes through (a batch's items pass each point once per item). Without the
//! feature every function here compiles to nothing.
//!
//! Where the points sit (see `src/proxy/side_effect.rs`):
//!
//! | point | the proxy has … |
//! |---|---|
//! | `after_prepared` | durably written the record as `executing` (the claim *is* the prepared record: SPEC section 5 wants it durable before the first byte, and a separate `prepared` write would add an fsync and no information); nothing is sent |
//! | `before_downstream` | built the downstream request; nothing is sent |
//! | `in_flight` | handed the whole request to the connection; no answer read |
//! | `after_remote_commit` | read the downstream's complete answer; nothing recorded |
//! | `after_local_commit` | durably recorded the attempt's outcome (`committed`, `outcome_unknown` or `failed_before_commit`); the client has no answer |
//! | `after_answer` | handed the whole answer to the client connection; `result_delivered` not recorded |

/// The commit boundaries of SPEC section 5 / the article's crash list.
pub const POINTS: [&str; 6] = [
    "after_prepared",
    "before_downstream",
    "in_flight",
    "after_remote_commit",
    "after_local_commit",
    "after_answer",
];

/// The armed point and from which pass on it parks: `IDEMPROXY_FAILPOINT=in_flight@4`
/// parks at the fourth send (a batch's fourth item), `in_flight` at the first.
#[cfg(feature = "failpoints")]
fn armed_point() -> Option<&'static (String, u64)> {
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let v = std::env::var("IDEMPROXY_FAILPOINT").ok()?;
            Some(match v.split_once('@') {
                Some((name, nth)) => (name.to_string(), nth.parse().unwrap_or(1).max(1)),
                None => (v, 1),
            })
        })
        .as_ref()
}

#[cfg(feature = "failpoints")]
fn armed_name() -> Option<&'static str> {
    armed_point().map(|(name, _)| name.as_str())
}

/// Whether `name` is the armed point (always `false` without the feature).
#[cfg(feature = "failpoints")]
pub fn armed(name: &str) -> bool {
    armed_name() == Some(name)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn armed(_name: &str) -> bool {
    false
}

/// Park forever if `name` is armed; return at once otherwise.
#[cfg(feature = "failpoints")]
pub async fn hit(name: &'static str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static PASSES: AtomicU64 = AtomicU64::new(0);
    if armed(name) {
        let nth = armed_point().map_or(1, |(_, n)| *n);
        if PASSES.fetch_add(1, Ordering::SeqCst) + 1 < nth {
            return;
        }
        announce(name);
        std::future::pending::<()>().await;
    }
}

#[cfg(feature = "failpoints")]
fn announce(name: &str) {
    use std::io::Write as _;
    // The lock guard is not `Send`: it must be gone before the caller awaits.
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "FAILPOINT {name} reached");
    let _ = err.flush();
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub async fn hit(_name: &'static str) {}

/// For `in_flight`: when armed, wrap a request body so that the returned receiver fires
/// once hyper has taken its last frame (the whole request is handed to the connection,
/// whose own task keeps writing it while the caller parks). Bodies hyper never polls
/// (empty ones) never fire: the point is then not reached.
#[cfg(feature = "failpoints")]
pub fn watch_sent(
    name: &'static str,
    body: crate::wire::body::ProxyBody,
) -> (
    crate::wire::body::ProxyBody,
    Option<tokio::sync::oneshot::Receiver<()>>,
) {
    use http_body_util::BodyExt as _;
    if !armed(name) {
        return (body, None);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let body = crate::wire::body::NotifyOnEnd::new(body, move || {
        let _ = tx.send(());
    })
    .boxed();
    (body, Some(rx))
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn watch_sent(
    _name: &'static str,
    body: crate::wire::body::ProxyBody,
) -> (
    crate::wire::body::ProxyBody,
    Option<tokio::sync::oneshot::Receiver<()>>,
) {
    (body, None)
}

/// For `after_answer` on every side-effect answer (not only committed ones): when armed,
/// announce and park once the client connection has taken the whole answer.
#[cfg(feature = "failpoints")]
pub fn on_answer(
    resp: http::Response<crate::wire::body::ProxyBody>,
) -> http::Response<crate::wire::body::ProxyBody> {
    resp.map(on_answer_body)
}

/// [`on_answer`] for an answer's body alone (a replay the fast path writes as bytes).
#[cfg(feature = "failpoints")]
pub fn on_answer_body(body: crate::wire::body::ProxyBody) -> crate::wire::body::ProxyBody {
    use http_body_util::BodyExt as _;
    if !armed("after_answer") {
        return body;
    }
    crate::wire::body::NotifyOnEnd::new(body, || {
        tokio::spawn(hit("after_answer"));
    })
    .boxed()
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn on_answer_body(body: crate::wire::body::ProxyBody) -> crate::wire::body::ProxyBody {
    body
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn on_answer(
    resp: http::Response<crate::wire::body::ProxyBody>,
) -> http::Response<crate::wire::body::ProxyBody> {
    resp
}
