//! Prometheus metrics (SPEC section 10), every family labelled by upstream and route but the
//! listener's count of connections served by hyper.
//! prometheus-client is the Prometheus project's own Rust client: typed label sets, no
//! global registry, OpenMetrics text encoding. Counter names get `_total` from the encoder.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub upstream: String,
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub upstream: String,
    pub route: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    pub upstream: String,
    pub route: String,
    pub state: String,
}

type HistogramFamily = Family<RouteLabels, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    pub attempts: Family<RouteLabels, Counter>,
    pub replays: Family<RouteLabels, Counter>,
    pub duplicates_prevented: Family<RouteLabels, Counter>,
    pub outcome_unknown: Family<RouteLabels, Counter>,
    pub reconciliations: Family<ResultLabels, Counter>,
    /// Webhook deliveries by result (SPEC section 9.1).
    pub webhooks: Family<ResultLabels, Counter>,
    /// Background jobs by each move (SPEC section 9.2): `running` when a call starts one,
    /// `succeeded` / `failed` when it ends.
    pub jobs: Family<JobLabels, Counter>,
    /// Items of independent batches (SPEC section 9.3), by result: `sent` (sent and
    /// committed for this request), `replayed` (answered from the item's record),
    /// `stopped` (the item the batch stopped at: unknown, failed, refused).
    pub batch_items: Family<ResultLabels, Counter>,
    pub unprotected: Family<RouteLabels, Counter>,
    /// Read-only requests forwarded (the request path bumps a handle resolved once per
    /// route, `proxy::Runtime::count_with`).
    pub read_only: Family<RouteLabels, Counter>,
    /// Side-effect calls answered without sending, by why (`key_mismatch`, `in_flight`,
    /// `approval_required`).
    pub refusals: Family<ResultLabels, Counter>,
    /// Operator decisions on calls waiting for approval (`approved`, `rejected`).
    pub approvals: Family<ResultLabels, Counter>,
    pub upstream_duration: HistogramFamily,
    /// Client connections of the proxy listener served by hyper (`wire::fast` hands them
    /// over), not labelled.
    pub hyper_connections: Counter,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~16 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let attempts = Family::<RouteLabels, Counter>::default();
        let replays = Family::<RouteLabels, Counter>::default();
        let duplicates_prevented = Family::<RouteLabels, Counter>::default();
        let outcome_unknown = Family::<RouteLabels, Counter>::default();
        let reconciliations = Family::<ResultLabels, Counter>::default();
        let webhooks = Family::<ResultLabels, Counter>::default();
        let jobs = Family::<JobLabels, Counter>::default();
        let batch_items = Family::<ResultLabels, Counter>::default();
        let unprotected = Family::<RouteLabels, Counter>::default();
        let read_only = Family::<RouteLabels, Counter>::default();
        let refusals = Family::<ResultLabels, Counter>::default();
        let approvals = Family::<ResultLabels, Counter>::default();
        let upstream_duration: HistogramFamily = Family::new_with_constructor(latency_histogram);
        let hyper_connections = Counter::default();
        registry.register(
            "idemproxy_attempts",
            "Side-effect requests sent downstream",
            attempts.clone(),
        );
        registry.register(
            "idemproxy_replays",
            "Retries answered from a stored result",
            replays.clone(),
        );
        registry.register(
            "idemproxy_duplicates_prevented",
            "Retries that did not reach the downstream because a record existed (replayed, in flight, or outcome unknown)",
            duplicates_prevented.clone(),
        );
        registry.register(
            "idemproxy_outcome_unknown",
            "Executions that ended with an unknown outcome",
            outcome_unknown.clone(),
        );
        registry.register(
            "idemproxy_reconciliations",
            "Reconciliations of unknown outcomes, by result",
            reconciliations.clone(),
        );
        registry.register(
            "idemproxy_webhooks",
            "Webhook deliveries by result: forwarded, replayed, signature_rejected, correlated, uncorrelated",
            webhooks.clone(),
        );
        registry.register(
            "idemproxy_jobs",
            "Background job moves by state: running (started by a call), succeeded, failed",
            jobs.clone(),
        );
        registry.register(
            "idemproxy_batch_items",
            "Items of independent batches by result: sent, replayed, stopped",
            batch_items.clone(),
        );
        registry.register(
            "idemproxy_unprotected",
            "Side-effect requests forwarded without a key (key_required: false)",
            unprotected.clone(),
        );
        registry.register(
            "idemproxy_read_only",
            "Read-only requests forwarded to the upstream",
            read_only.clone(),
        );
        registry.register(
            "idemproxy_refusals",
            "Side-effect calls answered without sending, by result: key_mismatch, in_flight, approval_required",
            refusals.clone(),
        );
        registry.register(
            "idemproxy_approvals",
            "Operator decisions on calls waiting for approval, by result: approved, rejected",
            approvals.clone(),
        );
        registry.register(
            "idemproxy_upstream_duration_seconds",
            "Time from sending a side effect downstream to its complete answer",
            upstream_duration.clone(),
        );
        registry.register(
            "idemproxy_hyper_connections",
            "Client connections the HTTP/1.1 fast path handed to hyper (HTTP/2, HTTP/1.0, chunked or larger bodies, Expect, upgrades, malformed heads), or every connection with IDEMPROXY_FAST_PATH=0",
            hyper_connections.clone(),
        );
        Metrics {
            registry,
            attempts,
            replays,
            duplicates_prevented,
            outcome_unknown,
            reconciliations,
            webhooks,
            jobs,
            batch_items,
            unprotected,
            read_only,
            refusals,
            approvals,
            upstream_duration,
            hyper_connections,
        }
    }

    /// Count one `result` of `family` for a route.
    pub fn count(
        family: &Family<ResultLabels, Counter>,
        upstream: &str,
        route: &str,
        result: &str,
    ) {
        family
            .get_or_create(&ResultLabels {
                upstream: upstream.to_string(),
                route: route.to_string(),
                result: result.to_string(),
            })
            .inc();
    }

    pub fn labels(upstream: &str, route: &str) -> RouteLabels {
        RouteLabels {
            upstream: upstream.to_string(),
            route: route.to_string(),
        }
    }

    pub fn webhook(&self, upstream: &str, route: &str, result: &str) {
        self.webhooks
            .get_or_create(&ResultLabels {
                upstream: upstream.to_string(),
                route: route.to_string(),
                result: result.to_string(),
            })
            .inc();
    }

    /// A job moved to `state` (started, or ended by a webhook, an observed poll or polling).
    pub fn job(&self, upstream: &str, route: &str, state: crate::policy::job::JobState) {
        self.jobs
            .get_or_create(&JobLabels {
                upstream: upstream.to_string(),
                route: route.to_string(),
                state: state.as_str().to_string(),
            })
            .inc();
    }

    pub fn reconciled(&self, upstream: &str, route: &str, result: &str) {
        self.reconciliations
            .get_or_create(&ResultLabels {
                upstream: upstream.to_string(),
                route: route.to_string(),
                result: result.to_string(),
            })
            .inc();
    }

    /// The counters a replay bumps for one route, looked up once: a replay from memory
    /// costs little enough that two label lookups (two strings, two SipHashes, two read
    /// locks) were a measurable part of it.
    pub fn replay_counters(&self, upstream: &str, route: &str) -> ReplayCounters {
        let labels = Metrics::labels(upstream, route);
        ReplayCounters {
            replays: self.replays.get_or_create(&labels).clone(),
            duplicates_prevented: self.duplicates_prevented.get_or_create(&labels).clone(),
        }
    }

    /// OpenMetrics text for `GET /metrics`.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Handles on one route's replay counters (they share the registered counters' values).
#[derive(Clone, Debug)]
pub struct ReplayCounters {
    replays: Counter,
    duplicates_prevented: Counter,
}

impl ReplayCounters {
    /// One retry answered from a stored result.
    pub fn replayed(&self) {
        self.replays.inc();
        self.duplicates_prevented.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_named_as_the_spec_says() {
        let m = Metrics::new();
        let l = Metrics::labels("mail", "send_email");
        m.attempts.get_or_create(&l).inc();
        m.replays.get_or_create(&l).inc();
        m.replay_counters("mail", "send_email").replayed();
        m.reconciled("mail", "send_email", "found");
        m.upstream_duration.get_or_create(&l).observe(0.01);
        let text = m.encode();
        for name in [
            "idemproxy_attempts_total{upstream=\"mail\",route=\"send_email\"} 1",
            "idemproxy_replays_total{upstream=\"mail\",route=\"send_email\"} 2",
            "idemproxy_duplicates_prevented_total{upstream=\"mail\",route=\"send_email\"} 1",
            "idemproxy_reconciliations_total{upstream=\"mail\",route=\"send_email\",result=\"found\"} 1",
            "idemproxy_upstream_duration_seconds_count{upstream=\"mail\",route=\"send_email\"} 1",
            "idemproxy_hyper_connections_total 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}
