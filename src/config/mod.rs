//! Configuration: the YAML contract (SPEC section 3) parsed by [`raw`], then validated
//! once by [`resolve`] into [`Config`], the form the hot path uses without re-checking.
//! Every problem names the file, the YAML path and what was expected; all problems in a
//! file are reported together.

pub mod raw;
mod resolve;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method};

use crate::policy::classify::RouteTable;
use crate::policy::fingerprint::FingerprintSpec;

pub use resolve::from_yaml;

/// Default config path for `serve`.
pub const DEFAULT_PATH: &str = "config/idemproxy.yaml";

#[derive(Debug)]
pub struct Config {
    /// The file this was loaded from (for messages and SIGHUP reload).
    pub source: PathBuf,
    pub listen: SocketAddr,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    pub limits: Limits,
    pub identity: IdentityConfig,
    pub timeouts: Timeouts,
    pub unmatched: Unmatched,
    pub upstreams: Vec<Upstream>,
    /// Mounts and routes compiled for matching.
    pub routes: RouteTable,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// The bearer tokens the admin listener admits: `admin.token_env` (one token with every
    /// scope, named `admin`) and the named `admin.tokens`.
    pub tokens: Vec<AdminToken>,
    /// `admin.notify`: signed notifications when a call starts waiting for a person.
    pub notify: Option<NotifyConfig>,
}

/// Where and what `admin::notify` posts (Standard Webhooks, signed with the secret in
/// `secret_env`, `whsec_` + base64).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyConfig {
    pub url: http::Uri,
    pub secret_env: String,
    pub events: Vec<NotifyEvent>,
    /// One delivery attempt's deadline.
    pub timeout: Duration,
}

/// What a notification is about: a record that entered a state a person has to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyEvent {
    ApprovalRequired,
    OutcomeUnknown,
}

impl NotifyEvent {
    pub const ALL: [NotifyEvent; 2] = [NotifyEvent::ApprovalRequired, NotifyEvent::OutcomeUnknown];

    pub fn name(self) -> &'static str {
        match self {
            NotifyEvent::ApprovalRequired => "approval_required",
            NotifyEvent::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// One admin token: its name (recorded with every decision it makes), the environment
/// variable holding the secret (never the secret itself), and what it may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminToken {
    pub name: String,
    pub token_env: String,
    pub scopes: Vec<Scope>,
}

/// What an admin token may do (SPEC section 10). `Admin` may do everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Read records, operations, metrics and the console's data.
    View,
    /// Approve or reject calls waiting for approval.
    Approve,
    /// Resolve `outcome_unknown` records.
    Resolve,
    /// Cancel operations (an orchestrator's Stop button).
    Cancel,
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 5] = [
        Scope::View,
        Scope::Approve,
        Scope::Resolve,
        Scope::Cancel,
        Scope::Admin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scope::View => "view",
            Scope::Approve => "approve",
            Scope::Resolve => "resolve",
            Scope::Cancel => "cancel",
            Scope::Admin => "admin",
        }
    }
}

impl AdminToken {
    /// Whether this token may act under `scope`.
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes.iter().any(|&s| s == scope || s == Scope::Admin)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    Redb {
        path: PathBuf,
        /// redb's page cache (`store.cache_bytes`).
        cache_bytes: usize,
    },
    Postgres {
        url_env: String,
        schema: String,
    },
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// Default retention for routes that do not set their own.
    pub retention: Duration,
    /// How long an `executing` record stays owned without renewal.
    pub lease: Duration,
    pub gc_interval: Duration,
    /// How often `outcome_unknown` records of routes with a lookup are reconciled in the
    /// background (also once right after start).
    pub reconcile_interval: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_key_bytes: usize,
    pub max_response_bytes: usize,
    /// Memory for delivered results kept ready to replay (0: no cache; see
    /// `proxy::replay`).
    pub replay_cache_bytes: u64,
    /// Keyed side-effect calls past admission at once; more wait their turn before
    /// anything durable happens (see `proxy::Proxy::handle_on`).
    pub max_calls_in_flight: usize,
    /// The largest request head (request line and headers) the listener reads; a larger
    /// one is answered `431` (see `wire::server::Options::max_header_bytes`).
    pub max_header_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct IdentityConfig {
    pub key_header: HeaderName,
    pub derive_from: Vec<HeaderName>,
    pub tenant_from: Vec<HeaderName>,
    /// The header naming the parent operation (cancellation). Defaults to the first
    /// `derive_from` header.
    pub operation_from: Option<HeaderName>,
    /// The header naming the provider's tool call (`identity.tool_call_from`; default the
    /// last of `derive_from`, `X-Tool-Call-Id` in the usual order): logged with the call.
    pub tool_call_from: Option<HeaderName>,
    /// The header naming the model round (`identity.model_round_from`; default the
    /// `derive_from` header `X-Model-Round`, when it is one): kept on the record.
    pub model_round_from: Option<HeaderName>,
    /// MCP: `params._meta` fields whose values, joined with the tool name and version,
    /// make a derived key (used when no key header and no `derive_from` headers are sent).
    pub derive_from_meta: Vec<String>,
    /// MCP: one `params._meta` field holding a whole key.
    pub key_meta: Option<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub request: Duration,
    /// Longest a `concurrent: wait` duplicate is held before answering 409.
    pub wait: Duration,
    /// Longest a client connection may take to send a complete request head, counted
    /// from the first byte of it, or from when the connection is idle (opened, or after
    /// its last answer); then the connection is closed (hyper's `header_read_timeout`).
    pub client_header: Duration,
    /// Longest a request body may go without a byte arriving: `408` and the connection
    /// closed (nginx's `client_body_timeout`).
    pub client_body: Duration,
    /// Longest a read-only answer's body may go without a byte from the upstream once its
    /// head came: the answer is cut off and the client's connection closed (nginx's
    /// `proxy_read_timeout`). Side effects are bounded by the route's `timeout` instead.
    pub upstream_body: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            connect: Duration::from_secs(5),
            request: Duration::from_secs(30),
            wait: Duration::from_secs(30),
            client_header: Duration::from_secs(30),
            client_body: Duration::from_secs(60),
            upstream_body: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmatched {
    /// GET/HEAD/OPTIONS are read-only, everything else a side effect.
    ByMethod,
    /// 404 problem `route-unmatched`.
    Reject,
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// `Host` for the downstream: the authority, as a header value made once.
    pub host: http::HeaderValue,
    /// Path prefix of the upstream URL (no trailing slash; empty for `/`).
    pub base_path: String,
    /// Proxy path prefix (no trailing slash; empty for `/`).
    pub mount: String,
    /// Extra trusted roots (PEM) for this upstream's TLS, beside the webpki set.
    pub ca_file: Option<PathBuf>,
    pub routes: Vec<Route>,
    /// Used for requests under the mount that match no route (`unmatched: by_method`).
    pub fallback_side_effect: Route,
    pub fallback_read_only: Route,
    /// `protocol: mcp`: the upstream is an MCP server (SPEC section 11); its `tools/call`
    /// requests are classified per tool, everything else passes through.
    pub mcp: Option<McpConfig>,
}

/// An MCP upstream's tool policy (`mcp:` in the YAML).
#[derive(Debug)]
pub struct McpConfig {
    pub unlisted: Unlisted,
    /// The listed tools, each a route named after the tool (the `route` of its records
    /// and metrics), in name order.
    pub tools: Vec<Route>,
    /// What an unlisted side-effecting tool runs under (its name is set per call).
    pub unlisted_route: Route,
    /// `reconcile.tool` lookups, by the name of the tool they reconcile.
    pub lookups: Vec<(String, ToolLookup)>,
    /// `unlisted: by_annotations`: the server's `readOnlyHint` per tool, as last fetched
    /// (`proxy::mcp`); a reload starts afresh.
    pub hints: parking_lot::Mutex<ToolHints>,
}

/// The server's `tools/list` annotations: tool name → `readOnlyHint: true`.
#[derive(Debug, Default)]
pub struct ToolHints {
    pub read_only: std::collections::HashMap<String, bool>,
    pub fetched_at: Option<std::time::Instant>,
}

/// `reconcile: { tool, arguments, found, not_found, settle }` of an MCP tool: a read-only
/// `tools/call` on the same server; the matchers' pointers are relative to its `result`.
#[derive(Debug, Clone)]
pub struct ToolLookup {
    pub tool: String,
    /// JSON whose strings may hold `{execution_id}` and `{key}`.
    pub arguments: serde_json::Value,
    pub found: Matcher,
    pub not_found: Matcher,
    pub settle: Duration,
}

/// What happens to a `tools/call` of a tool the YAML does not list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unlisted {
    SideEffect,
    /// The server's `tools/list` annotations: `readOnlyHint: true` → read-only.
    ByAnnotations,
    Reject,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    SideEffect,
    ReadOnly,
    /// Fronts the application's webhook receiver (SPEC section 9.1): a side effect keyed
    /// by the event id, see `Route::webhook`.
    Webhook,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On5xx {
    OutcomeUnknown,
    FailedBeforeCommit,
    Committed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concurrent {
    Reject,
    Wait,
}

impl On5xx {
    pub fn as_str(self) -> &'static str {
        match self {
            On5xx::OutcomeUnknown => "outcome_unknown",
            On5xx::FailedBeforeCommit => "failed_before_commit",
            On5xx::Committed => "committed",
        }
    }
}

impl Concurrent {
    pub fn as_str(self) -> &'static str {
        match self {
            Concurrent::Reject => "reject",
            Concurrent::Wait => "wait",
        }
    }
}

#[derive(Debug, Clone)]
pub struct DownstreamKey {
    pub header: HeaderName,
    /// The downstream dedups keyed requests and replays the original answer, so
    /// re-sending under the same key is safe (SPEC section 7, preference 1).
    pub replays: bool,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    /// `None` matches any method.
    pub method: Option<Method>,
    pub path: String,
    pub class: Class,
    pub tool_version: String,
    pub key_required: bool,
    pub downstream_key: Option<DownstreamKey>,
    pub fingerprint: FingerprintSpec,
    pub on_5xx: On5xx,
    pub concurrent: Concurrent,
    pub reconcile: Option<ReconcileSpec>,
    pub approval: Option<ApprovalSpec>,
    pub retention: Duration,
    pub retry: RetrySpec,
    pub timeout: Duration,
    /// JSON pointer to the downstream's own id in a committed answer (default `/id`).
    pub external_id: Option<String>,
    /// Whether the external ids of this route's calls go into the stores' external-id
    /// index: set on every route when some webhook route correlates `to: external_id`
    /// (a job's id is indexed regardless).
    pub index_external_id: bool,
    /// `class: webhook` only: the event id, signature and correlation rules.
    pub webhook: Option<std::sync::Arc<crate::policy::webhook::WebhookSpec>>,
    /// `job:` (side-effect routes): the job id pointer into the committed answer.
    pub job: Option<crate::policy::job::JobSpec>,
    /// Read-only routes only: the `job.status` endpoints of this upstream's side-effect
    /// routes whose polls this route carries (fixed when the config is resolved), so a
    /// pass-through tests one field to know it observes nothing.
    pub observes: Option<std::sync::Arc<crate::policy::job::JobWatch>>,
    /// `batch:` (side-effect routes): the items, their keys and, in independent mode, the
    /// route each item runs on.
    pub batch: Option<std::sync::Arc<crate::policy::batch::BatchSpec>>,
    /// This route's `idemproxy_read_only_total` counter, set once by the proxy that
    /// serves the config (`proxy::Runtime::count_with`), so a request only adds to it.
    pub read_only_total: std::sync::OnceLock<prometheus_client::metrics::counter::Counter>,
}

#[derive(Debug, Clone)]
pub struct ReconcileSpec {
    pub method: Method,
    /// Path (and query) template relative to the upstream, with `{execution_id}`, `{key}`
    /// and route path parameters.
    pub path: String,
    pub headers: Vec<(HeaderName, String)>,
    pub found: Matcher,
    pub not_found: Matcher,
    /// JSON pointer to the downstream's id in the found item (default: the route's).
    pub external_id: Option<String>,
    /// A "not found" is trusted only once the last send is this old: before that the
    /// original request may still be in progress downstream. Default: twice the route's
    /// timeout. Must exceed the downstream's worst-case processing time.
    pub settle: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct Matcher {
    pub status: Option<u16>,
    pub json_nonempty: Option<String>,
    pub json_empty: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ApprovalSpec {
    pub required: bool,
    pub preview: Vec<String>,
    pub expires: Option<Duration>,
}

/// Retries inside the proxy. Read-only routes retry transient failures; side-effect routes
/// retry only failures provably before any byte was sent (connect, DNS, TLS), under the
/// same execution. Nothing else is ever retried by the proxy.
#[derive(Debug, Clone, Copy)]
pub struct RetrySpec {
    /// Total tries including the first (1 = no retry).
    pub attempts: u32,
    pub backoff: Duration,
}

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issue {
    /// YAML path such as `upstreams[0].routes[1].on_5xx` (empty for the whole file).
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

/// A config file that cannot be used, with every problem found in it.
#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    pub issues: Vec<Issue>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let file = self.file.display();
        for (i, issue) in self.issues.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{file}")?;
            if let Some(line) = issue.line {
                write!(f, ":{line}")?;
            }
            if !issue.path.is_empty() {
                write!(f, ": {}", issue.path)?;
            }
            write!(f, ": {}", issue.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Read and validate a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            issues: vec![Issue {
                path: String::new(),
                line: None,
                message: format!("cannot read file: {e}"),
            }],
        })?;
        from_yaml(&text, path)
    }

    /// The route table as `idemproxy check` prints it.
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(out, "listen {}", self.listen);
        if let Some(a) = &self.admin {
            let _ = writeln!(out, "admin  {}", a.listen);
            if let Some(n) = &a.notify {
                let events: Vec<&str> = n.events.iter().map(|e| e.name()).collect();
                let _ = writeln!(
                    out,
                    "  notify POST {} ({}), signed with ${}",
                    n.url,
                    events.join(", "),
                    n.secret_env
                );
            }
            for t in &a.tokens {
                let scopes: Vec<&str> = t.scopes.iter().map(|s| s.name()).collect();
                let _ = writeln!(
                    out,
                    "  token {} from ${}: {}",
                    t.name,
                    t.token_env,
                    scopes.join(", ")
                );
            }
        }
        match &self.store.backend {
            StoreBackend::Redb { path, cache_bytes } => {
                let _ = writeln!(
                    out,
                    "store  redb {} (page cache {} MiB)",
                    path.display(),
                    cache_bytes >> 20
                );
            }
            StoreBackend::Postgres { url_env, schema } => {
                let _ = writeln!(
                    out,
                    "store  postgres (url from ${url_env}, schema {schema})"
                );
            }
        }
        let _ = writeln!(
            out,
            "{:<8} {:<32} {:<12} {:<20} {:<5} details",
            "METHOD", "PATH", "CLASS", "UPSTREAM/ROUTE", "KEY"
        );
        for up in &self.upstreams {
            if let Some(mcp) = &up.mcp {
                describe_mcp(&mut out, up, mcp);
                continue;
            }
            for r in &up.routes {
                let method = r.method.as_ref().map(|m| m.as_str()).unwrap_or("*");
                let path = format!("{}{}", up.mount, r.path);
                let class = match r.class {
                    Class::SideEffect => "side_effect",
                    Class::ReadOnly => "read_only",
                    Class::Webhook => "webhook",
                };
                let key = match (r.class, r.key_required) {
                    (Class::ReadOnly, _) => "-",
                    (Class::Webhook, _) => "event",
                    (_, true) => "req",
                    (_, false) => "opt",
                };
                let mut details = Vec::new();
                if let Some(w) = &r.webhook {
                    details.push(match &w.verify {
                        Some(v) => format!("verify={}", v.scheme.as_str()),
                        None => "verify=none".into(),
                    });
                }
                if r.class != Class::ReadOnly {
                    details.push(format!("tool={}:{}", r.name, r.tool_version));
                    side_effect_details(&mut details, r);
                } else if let Some(w) = &r.observes {
                    let names: Vec<&str> = w.watchers.iter().map(|w| w.route.as_str()).collect();
                    details.push(format!("observes_jobs_of={}", names.join(",")));
                }
                if r.class == Class::ReadOnly && r.retry.attempts > 1 {
                    details.push(format!(
                        "retry={}x{}ms",
                        r.retry.attempts,
                        r.retry.backoff.as_millis()
                    ));
                }
                let _ = writeln!(
                    out,
                    "{:<8} {:<32} {:<12} {:<20} {:<5} {}",
                    method,
                    path,
                    class,
                    format!("{}/{}", up.name, r.name),
                    key,
                    details.join(" ")
                );
            }
            let _ = writeln!(
                out,
                "{:<8} {:<32} {:<12} {:<20} -> {}://{}{}",
                "",
                format!("{}/**", up.mount),
                match self.unmatched {
                    Unmatched::ByMethod => "by_method",
                    Unmatched::Reject => "reject",
                },
                format!("{}/*", up.name),
                up.scheme,
                up.authority,
                up.base_path
            );
        }
        out
    }
}

/// The details column of a side-effecting route or MCP tool.
fn side_effect_details(details: &mut Vec<String>, r: &Route) {
    details.push(match &r.downstream_key {
        Some(k) => format!(
            "downstream_key={}{}",
            k.header,
            if k.replays { "(replays)" } else { "" }
        ),
        None => "downstream_key=none".into(),
    });
    details.push(format!("on_5xx={}", r.on_5xx.as_str()));
    details.push(format!("concurrent={}", r.concurrent.as_str()));
    if r.reconcile.is_some() {
        details.push("reconcile".into());
    }
    if r.approval.as_ref().is_some_and(|a| a.required) {
        details.push("approval".into());
    }
    if let Some(j) = &r.job {
        details.push(format!("job={}", j.id));
        if let Some(st) = &j.status {
            details.push(match st.every {
                Some(every) => format!(
                    "job_status={} {} every {}",
                    st.method,
                    st.path,
                    humantime::format_duration(every)
                ),
                None => format!("job_status={} {} (observed)", st.method, st.path),
            });
        }
    }
    if let Some(b) = &r.batch {
        details.push(match &b.each {
            Some(each) => format!(
                "batch=independent({} items, each {} {})",
                b.items,
                each.method.as_ref().map_or("POST", |m| m.as_str()),
                each.path
            ),
            None => format!("batch=atomic({} items)", b.items),
        });
    }
    details.push(format!(
        "retention={}",
        humantime::format_duration(r.retention)
    ));
}

/// The tool table of a `protocol: mcp` upstream, as `idemproxy check` prints it.
fn describe_mcp(out: &mut String, up: &Upstream, mcp: &McpConfig) {
    use std::fmt::Write as _;
    let mount = if up.mount.is_empty() { "/" } else { &up.mount };
    let _ = writeln!(
        out,
        "MCP {} at {} -> {}://{}{}",
        up.name, mount, up.scheme, up.authority, up.base_path
    );
    let _ = writeln!(
        out,
        "  {:<24} {:<12} {:<8} {:<5} details",
        "TOOL", "CLASS", "VERSION", "KEY"
    );
    for r in &mcp.tools {
        let (class, key) = match (r.class, r.key_required) {
            (Class::ReadOnly, _) => ("read_only", "-"),
            (_, true) => ("side_effect", "req"),
            (_, false) => ("side_effect", "opt"),
        };
        let mut details = Vec::new();
        if r.class == Class::SideEffect {
            side_effect_details(&mut details, r);
        }
        if let Some((_, l)) = mcp.lookups.iter().find(|(n, _)| *n == r.name) {
            details.push(format!("reconcile=tool:{}", l.tool));
        }
        let _ = writeln!(
            out,
            "  {:<24} {:<12} {:<8} {:<5} {}",
            r.name,
            class,
            r.tool_version,
            key,
            details.join(" ")
        );
    }
    let _ = writeln!(
        out,
        "  {:<24} {}",
        "(unlisted)",
        match mcp.unlisted {
            Unlisted::SideEffect => "side_effect (v1, key required)",
            Unlisted::ByAnnotations => {
                "by_annotations (readOnlyHint: true -> read_only, else side_effect v1)"
            }
            Unlisted::Reject => "reject",
        }
    );
    let _ = writeln!(
        out,
        "  everything but tools/call (initialize, tools/list, notifications, GET streams) passes through"
    );
}

#[cfg(test)]
mod tests;
