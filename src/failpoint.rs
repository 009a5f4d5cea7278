//! Named crash points for the crash-matrix tests (compiled in with `--features failpoints`).
//! When `IDEMPROXY_FAILPOINT` names a point, the process announces it on stderr and parks
//! the task there forever, so the test harness can SIGKILL the process at exactly that
//! boundary. Without the feature, [`hit`] compiles to nothing.

/// The commit boundaries of SPEC section 5 / the article's crash list.
pub const POINTS: [&str; 6] = [
    "after_prepared",
    "before_downstream",
    "in_flight",
    "after_remote_commit",
    "after_local_commit",
    "after_answer",
];

#[cfg(feature = "failpoints")]
pub async fn hit(name: &'static str) {
    use std::io::Write as _;
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("IDEMPROXY_FAILPOINT").ok());
    if armed.as_deref() == Some(name) {
        {
            // Scoped, not dropped: the lock must not live across the await below.
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "FAILPOINT {name} reached");
            let _ = err.flush();
        }
        std::future::pending::<()>().await;
    }
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub async fn hit(_name: &'static str) {}
