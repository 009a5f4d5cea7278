//! Validation: [`RawConfig`] → [`Config`]. Collects every problem with its YAML path
//! before failing, so one `idemproxy check` run shows everything that is wrong.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Method};

use super::raw::*;
use super::*;
use crate::policy::classify::{Classified, RouteRef, RouteTable};
use crate::policy::fingerprint::{validate_pointer, FingerprintSpec};

/// Parse and validate YAML text; `file` is only used in messages.
pub fn from_yaml(text: &str, file: &Path) -> Result<Config, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    let raw: RawConfig = match serde_path_to_error::deserialize(de) {
        Ok(raw) => raw,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            let first = Issue {
                message: strip_path(&strip_location(&inner.to_string()), &path),
                path: if path == "." { String::new() } else { path },
                line: inner.location().map(|l| l.line()),
            };
            return Err(ConfigError {
                file: file.to_path_buf(),
                issues: more_unknown_fields(text, first),
            });
        }
    };
    let mut v = Validator {
        issues: Vec::new(),
        base_dir: file.parent().map(Path::to_path_buf).unwrap_or_default(),
    };
    let cfg = v.config(raw, file);
    match cfg {
        Some(cfg) if v.issues.is_empty() => Ok(cfg),
        _ => Err(ConfigError {
            file: file.to_path_buf(),
            issues: v.issues,
        }),
    }
}

/// Every unknown field at once, not one per run of `check`: while the error is an unknown
/// field, that field is taken out of the document and it is read again. Later fields get
/// their line from the text when their name stands on exactly one line.
fn more_unknown_fields(text: &str, first: Issue) -> Vec<Issue> {
    let mut issues = vec![first];
    let Ok(mut doc) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) else {
        return issues;
    };
    for _ in 0..100 {
        let last = issues.last().expect("one at least");
        if !last.message.starts_with("unknown field") || !remove_at(&mut doc, &last.path) {
            break;
        }
        match serde_path_to_error::deserialize::<_, RawConfig>(doc.clone()) {
            Ok(_) => break,
            Err(e) => {
                let path = e.path().to_string();
                let message = strip_path(&strip_location(&e.into_inner().to_string()), &path);
                if !message.starts_with("unknown field") {
                    break;
                }
                let field = path.rsplit('.').next().unwrap_or_default();
                issues.push(Issue {
                    line: line_of(text, field),
                    path,
                    message,
                });
            }
        }
    }
    issues
}

/// Takes the field at `path` (`upstreams[0].routes[1].flavour`) out of `doc`.
fn remove_at(doc: &mut serde_yaml_ng::Value, path: &str) -> bool {
    let mut node = doc;
    let steps: Vec<&str> = path.split('.').collect();
    let Some((field, parents)) = steps.split_last() else {
        return false;
    };
    for step in parents {
        let (name, index) = match step.split_once('[') {
            Some((name, rest)) => (
                name,
                rest.strip_suffix(']').and_then(|i| i.parse::<usize>().ok()),
            ),
            None => (*step, None),
        };
        let Some(next) = node.get_mut(name) else {
            return false;
        };
        node = match index {
            Some(i) => match next.get_mut(i) {
                Some(n) => n,
                None => return false,
            },
            None => next,
        };
    }
    node.as_mapping_mut()
        .and_then(|m| m.remove(*field))
        .is_some()
}

/// The 1-based line where `field:` is written, when it is written on exactly one line.
fn line_of(text: &str, field: &str) -> Option<usize> {
    let is_key = |line: &str| {
        let t = line.trim_start().trim_start_matches("- ");
        t.starts_with(&format!("{field}:"))
            || line.contains(&format!("{{ {field}:"))
            || line.contains(&format!(", {field}:"))
    };
    let mut hits = text.lines().enumerate().filter(|(_, l)| is_key(l));
    match (hits.next(), hits.next()) {
        (Some((i, _)), None) => Some(i + 1),
        _ => None,
    }
}

/// serde_yaml_ng starts some messages with the path it was at (`upstreams[0].routes[0]:
/// unknown field ...`); the issue prints the path already, once.
fn strip_path(msg: &str, path: &str) -> String {
    match msg.split_once(": ") {
        Some((at, rest)) if !at.is_empty() && !at.contains(' ') && path.starts_with(at) => {
            rest.to_string()
        }
        _ => msg.to_string(),
    }
}

/// serde_yaml_ng appends " at line L column C"; we print the line ourselves.
fn strip_location(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

struct Validator {
    issues: Vec<Issue>,
    base_dir: PathBuf,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.issues.push(Issue {
            path: path.into(),
            line: None,
            message: cut_values(&message.into()),
        });
    }

    /// A mount or route template that no request could match: requests are matched on
    /// their normalised path (`policy::path`), so these must be written normalised too.
    fn normal_path(&mut self, path: &str, p: &str) {
        match crate::policy::path::normalise(p) {
            Ok(n) if n == p => {}
            Ok(n) => self.err(
                path,
                format!(
                    "`{p}` is not a normalised path and no request could match it \
                     (requests are matched on normalised paths); write `{n}`"
                ),
            ),
            Err(bad) => self.err(path, format!("`{p}`: {}", bad.0)),
        }
    }

    /// `admin`: the listener and its tokens. `token_env` is one token with every scope,
    /// named `admin`; it is the default (`IDEMPROXY_ADMIN_TOKEN`) only when no named
    /// `tokens` are listed.
    fn admin(&mut self, a: RawAdmin) -> AdminConfig {
        let listen = self.addr("admin.listen", a.listen.as_deref(), "127.0.0.1:9090");
        let mut tokens = Vec::new();
        let single = match (a.token_env, &a.tokens) {
            (Some(env), _) => Some(env),
            (None, None) => Some("IDEMPROXY_ADMIN_TOKEN".to_string()),
            (None, Some(_)) => None,
        };
        if let Some(env) = single {
            if env.trim().is_empty() {
                self.err("admin.token_env", "is empty: name an environment variable");
            }
            tokens.push(AdminToken {
                name: "admin".into(),
                token_env: env,
                scopes: vec![Scope::Admin],
            });
        }
        for (i, t) in a.tokens.into_iter().flatten().enumerate() {
            let path = format!("admin.tokens[{i}]");
            let name = match t.name.map(|n| n.trim().to_string()) {
                Some(n)
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) =>
                {
                    n
                }
                Some(n) => {
                    self.err(
                        format!("{path}.name"),
                        format!("`{}` is not a token name (1-64 of A-Z a-z 0-9 - _ .)", n),
                    );
                    continue;
                }
                None => {
                    self.err(format!("{path}.name"), "missing (e.g. ops)");
                    continue;
                }
            };
            if tokens.iter().any(|t: &AdminToken| t.name == name) {
                self.err(
                    format!("{path}.name"),
                    format!("another admin token is named `{name}`"),
                );
            }
            let token_env = match t.token_env {
                Some(e) if !e.trim().is_empty() => e,
                _ => {
                    self.err(
                        format!("{path}.token_env"),
                        "missing or empty: name the environment variable holding the token",
                    );
                    continue;
                }
            };
            let mut scopes = Vec::new();
            for (j, s) in t.scopes.into_iter().flatten().enumerate() {
                match Scope::ALL.iter().find(|k| k.name() == s) {
                    Some(&k) => scopes.push(k),
                    None => self.err(
                        format!("{path}.scopes[{j}]"),
                        format!(
                            "expected one of view | approve | resolve | cancel | admin, found `{}`",
                            s
                        ),
                    ),
                }
            }
            if scopes.is_empty() {
                self.err(
                    format!("{path}.scopes"),
                    "missing or empty: list what the token may do (view, approve, resolve, cancel, admin)",
                );
            }
            tokens.push(AdminToken {
                name,
                token_env,
                scopes,
            });
        }
        let notify = a.notify.and_then(|n| self.notify(n));
        AdminConfig {
            listen,
            tokens,
            notify,
        }
    }

    fn notify(&mut self, n: RawNotify) -> Option<NotifyConfig> {
        let url = match n.url.as_deref().map(http::Uri::from_str) {
            Some(Ok(u))
                if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() =>
            {
                Some(u)
            }
            Some(_) => {
                self.err(
                    "admin.notify.url",
                    "expected an absolute http:// or https:// URL",
                );
                None
            }
            None => {
                self.err(
                    "admin.notify.url",
                    "missing: where notifications are posted",
                );
                None
            }
        };
        let secret_env = match n.secret_env {
            Some(e) if !e.trim().is_empty() => Some(e),
            _ => {
                self.err(
                    "admin.notify.secret_env",
                    "missing or empty: name the variable holding the signing secret (whsec_ + base64)",
                );
                None
            }
        };
        let mut events = Vec::new();
        match n.events {
            None => events.extend(NotifyEvent::ALL),
            Some(list) => {
                for (i, e) in list.iter().enumerate() {
                    match NotifyEvent::ALL.iter().find(|k| k.name() == e) {
                        Some(&k) => events.push(k),
                        None => self.err(
                            format!("admin.notify.events[{i}]"),
                            format!("expected approval_required or outcome_unknown, found `{e}`"),
                        ),
                    }
                }
            }
        }
        let timeout = self.duration(
            "admin.notify.timeout",
            n.timeout.as_deref(),
            Duration::from_secs(10),
        );
        Some(NotifyConfig {
            url: url?,
            secret_env: secret_env?,
            events,
            timeout,
        })
    }

    fn addr(&mut self, path: &str, v: Option<&str>, default: &str) -> SocketAddr {
        let s = v.unwrap_or(default);
        match s.parse() {
            Ok(a) => a,
            Err(_) => {
                self.err(
                    path,
                    format!("expected a socket address like 127.0.0.1:8080, found `{s}`"),
                );
                default.parse().expect("default addresses are valid")
            }
        }
    }

    fn duration(&mut self, path: &str, v: Option<&str>, default: Duration) -> Duration {
        match v {
            None => default,
            Some(s) => match humantime::parse_duration(s) {
                Ok(d) if !d.is_zero() => d,
                Ok(_) => {
                    self.err(path, "expected a positive duration, found 0");
                    default
                }
                Err(e) => {
                    self.err(
                        path,
                        format!("expected a duration like 30s, 500ms or 24h, found `{s}` ({e})"),
                    );
                    default
                }
            },
        }
    }

    fn header(&mut self, path: &str, s: &str) -> Option<HeaderName> {
        match HeaderName::from_str(s) {
            Ok(h) => Some(h),
            Err(_) => {
                self.err(path, format!("`{s}` is not a valid HTTP header name"));
                None
            }
        }
    }

    fn headers(&mut self, path: &str, list: &[String]) -> Vec<HeaderName> {
        list.iter()
            .enumerate()
            .filter_map(|(i, s)| self.header(&format!("{path}[{i}]"), s))
            .collect()
    }

    fn one_of<T: Copy>(
        &mut self,
        path: &str,
        v: Option<&str>,
        default: T,
        options: &[(&str, T)],
    ) -> T {
        let Some(s) = v else { return default };
        match options.iter().find(|(name, _)| *name == s) {
            Some((_, t)) => *t,
            None => {
                let names: Vec<_> = options.iter().map(|(n, _)| *n).collect();
                self.err(
                    path,
                    format!("expected one of {}, found `{s}`", names.join(" | ")),
                );
                default
            }
        }
    }

    /// A required name of letters, digits, `-`, `_` and `.`.
    fn name(&mut self, path: &str, v: Option<String>, hint: &str) -> String {
        match v {
            Some(n) if is_name(&n) => n,
            Some(n) => {
                self.err(
                    format!("{path}.name"),
                    format!("expected a name of letters, digits, -, _ and ., found `{n}`"),
                );
                n
            }
            None => {
                self.err(format!("{path}.name"), format!("missing ({hint})"));
                "?".into()
            }
        }
    }

    fn pointer(&mut self, path: &str, p: &str) {
        if let Err(e) = validate_pointer(p) {
            self.err(path, e);
        }
    }

    fn config(&mut self, raw: RawConfig, file: &Path) -> Option<Config> {
        let listen = self.addr("listen", raw.listen.as_deref(), DEFAULT_LISTEN);
        let admin = raw.admin.map(|a| self.admin(a));
        let store = self.store(raw.store);
        let limits = self.limits(raw.limits);
        let identity = self.identity(raw.identity);
        let d = Timeouts::default();
        let t = &raw.timeouts;
        let timeouts = Timeouts {
            connect: self.duration("timeouts.connect", t.connect.as_deref(), d.connect),
            request: self.duration("timeouts.request", t.request.as_deref(), d.request),
            wait: self.duration("timeouts.wait", t.wait.as_deref(), d.wait),
            client_header: self.duration(
                "timeouts.client_header",
                t.client_header.as_deref(),
                d.client_header,
            ),
            client_body: self.duration(
                "timeouts.client_body",
                t.client_body.as_deref(),
                d.client_body,
            ),
            upstream_body: self.duration(
                "timeouts.upstream_body",
                t.upstream_body.as_deref(),
                d.upstream_body,
            ),
        };
        let unmatched = self.one_of(
            "unmatched",
            raw.unmatched.as_deref(),
            Unmatched::ByMethod,
            &[
                ("by_method", Unmatched::ByMethod),
                ("reject", Unmatched::Reject),
            ],
        );
        let mut upstreams = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (i, u) in raw.upstreams.into_iter().enumerate() {
            let path = format!("upstreams[{i}]");
            if let Some(up) = self.upstream(&path, u, &store, &timeouts) {
                if !names.insert(up.name.clone()) {
                    self.err(
                        format!("{path}.name"),
                        format!("duplicate upstream name `{}`", up.name),
                    );
                }
                upstreams.push(up);
            }
        }
        if upstreams.is_empty() && self.issues.is_empty() {
            self.err("upstreams", "at least one upstream is required");
        }
        let routes = match RouteTable::build(&upstreams) {
            Ok(t) => t,
            Err(issues) => {
                self.issues.extend(issues);
                return None;
            }
        };
        self.job_observers(&mut upstreams, &routes, unmatched);
        // External ids are indexed only while something looks them up.
        let correlates_external = upstreams.iter().flat_map(|u| &u.routes).any(|r| {
            r.webhook.as_ref().is_some_and(|w| {
                w.correlate
                    .iter()
                    .any(|c| c.to == crate::policy::webhook::CorrelateTo::ExternalId)
            })
        });
        if correlates_external {
            for u in upstreams.iter_mut() {
                let mcp_tools = u.mcp.as_mut().map(|m| m.tools.iter_mut());
                for r in u
                    .routes
                    .iter_mut()
                    .chain([&mut u.fallback_side_effect, &mut u.fallback_read_only])
                    .chain(mcp_tools.into_iter().flatten())
                {
                    r.index_external_id = true;
                }
            }
        }
        Some(Config {
            source: file.to_path_buf(),
            listen,
            admin,
            store,
            limits,
            identity,
            timeouts,
            unmatched,
            upstreams,
            routes,
        })
    }

    /// `store.cache_bytes`: redb needs some pages cached to work at all.
    fn redb_cache(&mut self, bytes: Option<u64>) -> usize {
        const MIN: u64 = 1 << 20;
        match bytes {
            None => crate::store::redb::DEFAULT_CACHE_BYTES,
            Some(n) if n < MIN => {
                self.err(
                    "store.cache_bytes",
                    format!("expected at least {MIN} (1 MiB), found {n}"),
                );
                crate::store::redb::DEFAULT_CACHE_BYTES
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        }
    }

    fn store(&mut self, s: RawStore) -> StoreConfig {
        let backend = match s.backend.as_deref().unwrap_or("redb") {
            "redb" => {
                if s.url_env.is_some() {
                    self.err("store.url_env", "only used with `backend: postgres`");
                }
                StoreBackend::Redb {
                    path: PathBuf::from(s.path.unwrap_or_else(|| "data/idemproxy.redb".into())),
                    cache_bytes: self.redb_cache(s.cache_bytes),
                }
            }
            "postgres" => {
                if s.path.is_some() {
                    self.err("store.path", "only used with `backend: redb`");
                }
                if s.cache_bytes.is_some() {
                    self.err("store.cache_bytes", "only used with `backend: redb`");
                }
                let schema = s.schema.unwrap_or_else(|| "idemproxy".into());
                if schema.is_empty()
                    || !schema
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_')
                    || schema.starts_with(|c: char| c.is_ascii_digit())
                {
                    self.err(
                        "store.schema",
                        format!(
                            "expected an SQL identifier (letters, digits, _), found `{schema}`"
                        ),
                    );
                }
                let url_env = s.url_env.unwrap_or_else(|| "IDEMPROXY_POSTGRES_URL".into());
                if url_env.is_empty() || url_env.contains(['=', '\0']) {
                    self.err(
                        "store.url_env",
                        format!(
                            "expected the name of the environment variable holding the PostgreSQL URL, found `{url_env}`"
                        ),
                    );
                }
                StoreBackend::Postgres { url_env, schema }
            }
            other => {
                self.err(
                    "store.backend",
                    format!("expected one of redb | postgres, found `{other}`"),
                );
                StoreBackend::Redb {
                    path: PathBuf::from("data/idemproxy.redb"),
                    cache_bytes: crate::store::redb::DEFAULT_CACHE_BYTES,
                }
            }
        };
        StoreConfig {
            backend,
            retention: self.duration(
                "store.retention",
                s.retention.as_deref(),
                Duration::from_secs(24 * 3600),
            ),
            lease: self.duration("store.lease", s.lease.as_deref(), Duration::from_secs(30)),
            gc_interval: self.duration(
                "store.gc_interval",
                s.gc_interval.as_deref(),
                Duration::from_secs(60),
            ),
            reconcile_interval: self.duration(
                "store.reconcile_interval",
                s.reconcile_interval.as_deref(),
                Duration::from_secs(10),
            ),
        }
    }

    fn limits(&mut self, l: RawLimits) -> Limits {
        let mut get = |path: &str, v: Option<u64>, default: usize| -> usize {
            match v {
                None => default,
                Some(0) => {
                    self.err(path, "must be greater than 0");
                    default
                }
                Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            }
        };
        Limits {
            max_body_bytes: get("limits.max_body_bytes", l.max_body_bytes, 1024 * 1024),
            max_key_bytes: get("limits.max_key_bytes", l.max_key_bytes, 255),
            max_response_bytes: get(
                "limits.max_response_bytes",
                l.max_response_bytes,
                16 * 1024 * 1024,
            ),
            // 0 is allowed here: it turns the cache off.
            replay_cache_bytes: l.replay_cache_bytes.unwrap_or(16 * 1024 * 1024),
            max_calls_in_flight: get("limits.max_calls_in_flight", l.max_calls_in_flight, 64),
            max_header_bytes: self.max_header_bytes(l.max_header_bytes),
        }
    }

    fn max_header_bytes(&mut self, v: Option<u64>) -> usize {
        use crate::wire::server::{DEFAULT_MAX_HEADER_BYTES, MAX_MAX_HEADER_BYTES};
        match v {
            None => DEFAULT_MAX_HEADER_BYTES,
            Some(n) if n < DEFAULT_MAX_HEADER_BYTES as u64 => {
                self.err(
                    "limits.max_header_bytes",
                    format!(
                        "must be at least {DEFAULT_MAX_HEADER_BYTES} (the smallest read buffer of the HTTP/1 server), found {n}"
                    ),
                );
                DEFAULT_MAX_HEADER_BYTES
            }
            Some(n) if n > MAX_MAX_HEADER_BYTES as u64 => {
                self.err(
                    "limits.max_header_bytes",
                    format!("must be at most {MAX_MAX_HEADER_BYTES}, found {n}"),
                );
                DEFAULT_MAX_HEADER_BYTES
            }
            Some(n) => n as usize,
        }
    }

    fn identity(&mut self, i: RawIdentity) -> IdentityConfig {
        let key_header = self
            .header(
                "identity.key_header",
                i.key_header.as_deref().unwrap_or("Idempotency-Key"),
            )
            .unwrap_or(HeaderName::from_static("idempotency-key"));
        let derive_from = self.headers("identity.derive_from", &i.derive_from.unwrap_or_default());
        let tenant_from = self.headers(
            "identity.tenant_from",
            &i.tenant_from
                .unwrap_or_else(|| vec!["Authorization".into()]),
        );
        let operation_from = match i.operation_from {
            Some(h) => self.header("identity.operation_from", &h),
            None => derive_from.first().cloned(),
        };
        let tool_call_from = match i.tool_call_from {
            Some(h) => self.header("identity.tool_call_from", &h),
            None => derive_from
                .last()
                .cloned()
                .filter(|_| derive_from.len() > 1),
        };
        let model_round_from = match i.model_round_from {
            Some(h) => self.header("identity.model_round_from", &h),
            None => derive_from
                .iter()
                .find(|h| h.as_str() == "x-model-round")
                .cloned(),
        };
        let derive_from_meta = i.derive_from_meta.unwrap_or_default();
        for (n, f) in derive_from_meta.iter().enumerate() {
            if f.is_empty() {
                self.err(
                    format!("identity.derive_from_meta[{n}]"),
                    "empty `_meta` field name",
                );
            }
        }
        if i.key_meta.as_deref() == Some("") {
            self.err("identity.key_meta", "empty `_meta` field name");
        }
        IdentityConfig {
            key_header,
            derive_from,
            tenant_from,
            operation_from,
            tool_call_from,
            model_round_from,
            derive_from_meta,
            key_meta: i.key_meta,
        }
    }

    fn upstream(
        &mut self,
        path: &str,
        u: RawUpstream,
        store: &StoreConfig,
        t: &Timeouts,
    ) -> Option<Upstream> {
        let name = self.name(path, u.name, "every upstream needs a name");
        let (scheme, authority, base_path) = match u.url.as_deref() {
            None => {
                self.err(
                    format!("{path}.url"),
                    "missing (e.g. https://api.example.com)",
                );
                return None;
            }
            Some(s) => match http::Uri::from_str(s) {
                Ok(uri)
                    if matches!(uri.scheme_str(), Some("http") | Some("https"))
                        && uri.authority().is_some()
                        && uri.query().is_none() =>
                {
                    let parts = uri.into_parts();
                    let base = parts
                        .path_and_query
                        .map(|p| p.path().trim_end_matches('/').to_string())
                        .unwrap_or_default();
                    (
                        parts.scheme.expect("checked above"),
                        parts.authority.expect("checked above"),
                        base,
                    )
                }
                _ => {
                    self.err(
                        format!("{path}.url"),
                        format!("expected an absolute http:// or https:// URL without query, found `{s}`"),
                    );
                    return None;
                }
            },
        };
        let mount = match u.mount.as_deref() {
            None => format!("/{name}"),
            Some(m) if m.starts_with('/') && !m.contains(['?', '#', '{', '}']) => {
                self.normal_path(&format!("{path}.mount"), m);
                m.trim_end_matches('/').to_string()
            }
            Some(m) => {
                self.err(
                    format!("{path}.mount"),
                    format!("expected a path prefix starting with /, found `{m}`"),
                );
                String::new()
            }
        };
        let timeout = self.duration(&format!("{path}.timeout"), u.timeout.as_deref(), t.request);
        let mut routes = Vec::new();
        let mut route_names = std::collections::HashSet::new();
        for (i, r) in u.routes.into_iter().enumerate() {
            let rp = format!("{path}.routes[{i}]");
            if let Some(route) = self.route(&rp, r, store, timeout) {
                if !route_names.insert(route.name.clone()) {
                    self.err(
                        format!("{rp}.name"),
                        format!("duplicate route name `{}` in upstream `{name}`", route.name),
                    );
                }
                routes.push(route);
            }
        }
        let fallback = |class: Class, name: &str| Route {
            name: name.into(),
            method: None,
            path: "/**".into(),
            class,
            tool_version: "v0".into(),
            key_required: false,
            downstream_key: Some(DownstreamKey {
                header: HeaderName::from_static("idempotency-key"),
                replays: false,
            }),
            fingerprint: FingerprintSpec::default(),
            on_5xx: On5xx::OutcomeUnknown,
            concurrent: Concurrent::Reject,
            reconcile: None,
            approval: None,
            retention: store.retention,
            retry: RetrySpec {
                attempts: 1,
                backoff: Duration::from_millis(50),
            },
            timeout,
            external_id: Some("/id".into()),
            webhook: None,
            job: None,
            observes: None,
            index_external_id: false,
            batch: None,
            read_only_total: Default::default(),
        };
        let mcp = match u.protocol.as_deref() {
            None | Some("http") => {
                if u.mcp.is_some() {
                    self.err(
                        format!("{path}.mcp"),
                        "only meaningful with `protocol: mcp`",
                    );
                }
                None
            }
            Some("mcp") => {
                if !routes.is_empty() {
                    self.err(
                        format!("{path}.routes"),
                        "an MCP upstream has no HTTP routes; classify its tools under `mcp.tools`",
                    );
                }
                let unlisted_route = Route {
                    name: "unlisted".into(),
                    tool_version: "v1".into(),
                    key_required: true,
                    external_id: None,
                    ..fallback(Class::SideEffect, "unlisted")
                };
                Some(self.mcp(path, u.mcp, store, timeout, unlisted_route))
            }
            Some(other) => {
                self.err(
                    format!("{path}.protocol"),
                    format!("expected one of http | mcp, found `{other}`"),
                );
                None
            }
        };
        let ca_file = u.tls.and_then(|t| t.ca_file).map(|f| {
            let p = PathBuf::from(f);
            if p.is_relative() {
                self.base_dir.join(p)
            } else {
                p
            }
        });
        if let Some(p) = &ca_file {
            if !p.is_file() {
                self.err(
                    format!("{path}.tls.ca_file"),
                    format!("no such file: {}", p.display()),
                );
            }
        }
        // A parsed authority is visible ASCII, so this cannot fail in practice.
        let Ok(host) = http::HeaderValue::from_str(authority.as_str()) else {
            self.err(
                format!("{path}.url"),
                format!("the host `{authority}` cannot be sent as a Host header"),
            );
            return None;
        };
        Some(Upstream {
            host,
            ca_file,
            fallback_side_effect: fallback(Class::SideEffect, "unmatched"),
            fallback_read_only: fallback(Class::ReadOnly, "unmatched_read"),
            name,
            scheme,
            authority,
            base_path,
            mount,
            routes,
            mcp,
        })
    }

    /// `mcp:` of a `protocol: mcp` upstream: each tool entry is validated as a route (the
    /// same keys, no `match`: a tool is found by its name).
    fn mcp(
        &mut self,
        path: &str,
        m: Option<RawMcp>,
        store: &StoreConfig,
        timeout: Duration,
        unlisted_route: Route,
    ) -> McpConfig {
        let m = m.unwrap_or(RawMcp {
            unlisted: None,
            tools: Default::default(),
        });
        let unlisted = match m.unlisted.as_deref() {
            None | Some("side_effect") => Unlisted::SideEffect,
            Some("reject") => Unlisted::Reject,
            Some("by_annotations") => Unlisted::ByAnnotations,
            Some(other) => {
                self.err(
                    format!("{path}.mcp.unlisted"),
                    format!(
                        "expected one of side_effect | by_annotations | reject, found `{other}`"
                    ),
                );
                Unlisted::SideEffect
            }
        };
        let mut tools = Vec::new();
        let mut lookups = Vec::new();
        for (name, mut t) in m.tools {
            let tp = format!("{path}.mcp.tools.{name}");
            if name.is_empty() {
                self.err(&tp, "empty tool name");
                continue;
            }
            let mut ok = true;
            for (key, set) in [
                ("match", t.matcher.is_some()),
                ("name", t.name.is_some()),
                ("retry", t.retry.is_some()),
                ("external_id", t.external_id.is_some()),
            ] {
                if set {
                    self.err(
                        format!("{tp}.{key}"),
                        "not used on an MCP tool (the tool is found by its name)",
                    );
                    ok = false;
                }
            }
            if t.batch
                .as_ref()
                .is_some_and(|b| b.mode.as_deref() == Some("independent"))
            {
                self.err(
                    format!("{tp}.batch.mode"),
                    "an MCP tool's batch is atomic (one tools/call, one execution; items relative to `arguments`): a server's tool has no per-item request to send each item with",
                );
                ok = false;
            }
            if !ok {
                continue;
            }
            let timeout = self.duration(&format!("{tp}.timeout"), t.timeout.as_deref(), timeout);
            if let Some(rc) = t.reconcile.take() {
                if let Some(l) = self.tool_lookup(&format!("{tp}.reconcile"), rc, timeout) {
                    lookups.push((name.clone(), l));
                }
            }
            t.name = Some(name);
            t.matcher = Some(RawMatch {
                method: Some("POST".into()),
                path: Some("/".into()),
            });
            t.external_id = Some("none".into());
            if t.class.is_none() {
                t.class = Some("side_effect".into());
            }
            if let Some(mut route) = self.route(&tp, t, store, timeout) {
                route.method = None;
                route.path = String::new();
                tools.push(route);
            }
        }
        McpConfig {
            unlisted,
            tools,
            unlisted_route,
            lookups,
            hints: Default::default(),
        }
    }

    /// `reconcile` of an MCP tool: `{ tool, arguments, found, not_found, settle }`.
    fn tool_lookup(
        &mut self,
        path: &str,
        rc: RawReconcile,
        timeout: Duration,
    ) -> Option<ToolLookup> {
        for (key, set) in [
            ("method", rc.method.is_some()),
            ("path", rc.path.is_some()),
            ("headers", !rc.headers.is_empty()),
            ("external_id", rc.external_id.is_some()),
        ] {
            if set {
                self.err(
                    format!("{path}.{key}"),
                    "not used by an MCP tool lookup (it calls `tool`)",
                );
            }
        }
        let tool = match rc.tool {
            Some(t) if is_name(&t) => t,
            Some(t) => {
                self.err(
                    format!("{path}.tool"),
                    format!("expected a tool name, found `{t}`"),
                );
                return None;
            }
            None => {
                self.err(
                    format!("{path}.tool"),
                    "missing (the read-only tool to call, e.g. find_email)",
                );
                return None;
            }
        };
        let arguments = rc.arguments.unwrap_or_else(|| serde_json::json!({}));
        if !arguments.is_object() {
            self.err(
                format!("{path}.arguments"),
                "expected a map of the tool's arguments",
            );
        }
        let found = self.matcher(path, "found", rc.found, true);
        let not_found = self.matcher(path, "not_found", rc.not_found, true);
        let settle = self.duration(
            &format!("{path}.settle"),
            rc.settle.as_deref(),
            timeout.saturating_mul(2),
        );
        Some(ToolLookup {
            tool,
            arguments,
            found,
            not_found,
            settle,
        })
    }

    /// A lookup's `found` / `not_found` matcher: JSON pointers checked, at least one test.
    /// `tool`: an MCP `reconcile.tool` lookup, judged on its result alone (no `status`).
    fn matcher(&mut self, path: &str, which: &str, m: Option<RawMatcher>, tool: bool) -> Matcher {
        let Some(m) = m else {
            let example = if tool {
                "missing (e.g. { json_nonempty: /structuredContent/items })"
            } else {
                "missing (e.g. { status: 200, json_nonempty: /data })"
            };
            self.err(format!("{path}.{which}"), example);
            return Matcher::default();
        };
        for (k, p) in [
            ("json_nonempty", &m.json_nonempty),
            ("json_empty", &m.json_empty),
        ] {
            if let Some(p) = p {
                self.pointer(&format!("{path}.{which}.{k}"), p);
            }
        }
        let tests = m.json_nonempty.is_some() || m.json_empty.is_some();
        if tool && m.status.is_some() {
            self.err(
                format!("{path}.{which}.status"),
                "a tool lookup is judged on its result: use json_nonempty / json_empty",
            );
        }
        if tool && !tests {
            self.err(
                format!("{path}.{which}"),
                "needs json_nonempty or json_empty",
            );
        }
        if !tool && !tests && m.status.is_none() {
            self.err(
                format!("{path}.{which}"),
                "needs at least one of status, json_nonempty, json_empty",
            );
        }
        Matcher {
            status: if tool { None } else { m.status },
            json_nonempty: m.json_nonempty,
            json_empty: m.json_empty,
        }
    }

    fn route(
        &mut self,
        path: &str,
        r: RawRoute,
        store: &StoreConfig,
        timeout: Duration,
    ) -> Option<Route> {
        let name = self.name(path, r.name, "the tool name, e.g. send_email");
        let Some(m) = r.matcher else {
            self.err(
                format!("{path}.match"),
                "missing (e.g. { method: POST, path: /send })",
            );
            return None;
        };
        let method = match m.method.as_deref() {
            None | Some("*") | Some("ANY") => None,
            Some(s) => match Method::from_bytes(s.as_bytes()) {
                Ok(m) if s.chars().all(|c| c.is_ascii_uppercase()) => Some(m),
                _ => {
                    self.err(
                        format!("{path}.match.method"),
                        format!("expected an upper-case HTTP method or *, found `{s}`"),
                    );
                    None
                }
            },
        };
        let rpath = match m.path {
            Some(p) if p.starts_with('/') && !p.contains('?') => {
                self.normal_path(&format!("{path}.match.path"), &p);
                if let Some(twice) = repeated_param(&p) {
                    self.err(
                        format!("{path}.match.path"),
                        format!("the path template `{p}` names the parameter `{twice}` more than once; give each parameter its own name"),
                    );
                    return None;
                }
                p
            }
            Some(p) => {
                self.err(
                    format!("{path}.match.path"),
                    format!("expected a path template starting with / (no query), found `{p}`"),
                );
                return None;
            }
            None => {
                self.err(
                    format!("{path}.match.path"),
                    "missing (e.g. /v1/customers/{id})",
                );
                return None;
            }
        };
        let default_class = match &method {
            Some(m) if matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS) => {
                Class::ReadOnly
            }
            _ => Class::SideEffect,
        };
        let class = match r.class.as_deref() {
            None => default_class,
            Some("side_effect") => Class::SideEffect,
            Some("read_only") => Class::ReadOnly,
            Some("webhook") => Class::Webhook,
            Some(other) => {
                self.err(
                    format!("{path}.class"),
                    format!("expected one of side_effect | read_only | webhook, found `{other}`"),
                );
                Class::SideEffect
            }
        };
        let webhook = match (class, r.webhook) {
            (Class::Webhook, Some(w)) => Some(std::sync::Arc::new(
                self.webhook(&format!("{path}.webhook"), w),
            )),
            (Class::Webhook, None) => {
                self.err(
                    format!("{path}.webhook"),
                    "missing: a webhook route needs at least `event_id` (e.g. { header: webhook-id } or { json: /id })",
                );
                None
            }
            (_, Some(_)) => {
                self.err(
                    format!("{path}.webhook"),
                    "only meaningful on class: webhook routes",
                );
                None
            }
            (_, None) => None,
        };
        if class == Class::Webhook {
            // The delivery lifecycle fixes these (SPEC section 9.1): the receiver sees the
            // delivery's execution_id as Idempotency-Key and dedupes by it, so a receiver
            // 5xx is not stored and a timeout is re-sent under the same key.
            for (key, set) in [
                ("downstream_key", r.downstream_key.is_some()),
                ("on_5xx", r.on_5xx.is_some()),
                ("approval", r.approval.is_some()),
                ("reconcile", r.reconcile.is_some()),
                ("key_required", r.key_required.is_some()),
                ("external_id", r.external_id.is_some()),
            ] {
                if set {
                    self.err(
                        format!("{path}.{key}"),
                        "not configurable on a webhook route (the receiver gets the delivery's execution_id as Idempotency-Key; a 5xx is not stored)",
                    );
                }
            }
        }
        let job = r.job.and_then(|j| {
            if class != Class::SideEffect {
                self.err(
                    format!("{path}.job"),
                    "only meaningful on side_effect routes",
                );
                return None;
            }
            let status = j
                .status
                .and_then(|st| self.job_status(&format!("{path}.job.status"), st));
            match j.id {
                Some(p) => {
                    self.pointer(&format!("{path}.job.id"), &p);
                    Some(crate::policy::job::JobSpec { id: p, status })
                }
                None => {
                    self.err(format!("{path}.job.id"), "missing (e.g. /job_id)");
                    None
                }
            }
        });
        let batch = r
            .batch
            .and_then(|b| self.batch(&format!("{path}.batch"), b, class, job.is_some()));
        let downstream_key = match r.downstream_key {
            None if class == Class::Webhook => Some(DownstreamKey {
                header: HeaderName::from_static("idempotency-key"),
                replays: true,
            }),
            None => Some(DownstreamKey {
                header: HeaderName::from_static("idempotency-key"),
                replays: false,
            }),
            Some(RawDownstreamKey::Word(w)) if w == "none" => None,
            Some(RawDownstreamKey::Word(w)) => {
                self.err(
                    format!("{path}.downstream_key"),
                    format!("expected `none` or {{ header, replays }}, found `{w}`"),
                );
                None
            }
            Some(RawDownstreamKey::Spec(s)) => {
                let header = self
                    .header(
                        &format!("{path}.downstream_key.header"),
                        s.header.as_deref().unwrap_or("Idempotency-Key"),
                    )
                    .unwrap_or(HeaderName::from_static("idempotency-key"));
                Some(DownstreamKey {
                    header,
                    replays: s.replays.unwrap_or(false),
                })
            }
        };
        let fp = r.fingerprint.unwrap_or_default();
        for (i, p) in fp.ignore_json.iter().enumerate() {
            self.pointer(&format!("{path}.fingerprint.ignore_json[{i}]"), p);
        }
        let fingerprint = FingerprintSpec {
            ignore_json: fp.ignore_json.clone(),
            headers: self.headers(&format!("{path}.fingerprint.headers"), &fp.headers),
        };
        let on_5xx = self.one_of(
            &format!("{path}.on_5xx"),
            r.on_5xx.as_deref(),
            if class == Class::Webhook {
                On5xx::FailedBeforeCommit
            } else {
                On5xx::OutcomeUnknown
            },
            &[
                ("outcome_unknown", On5xx::OutcomeUnknown),
                ("failed_before_commit", On5xx::FailedBeforeCommit),
                ("committed", On5xx::Committed),
            ],
        );
        let concurrent = self.one_of(
            &format!("{path}.concurrent"),
            r.concurrent.as_deref(),
            Concurrent::Reject,
            &[("reject", Concurrent::Reject), ("wait", Concurrent::Wait)],
        );
        let approval = r.approval.map(|a| {
            for (i, p) in a.preview.iter().enumerate() {
                self.pointer(&format!("{path}.approval.preview[{i}]"), p);
            }
            ApprovalSpec {
                required: a.required.unwrap_or(true),
                expires: a.expires.as_deref().map(|e| {
                    self.duration(
                        &format!("{path}.approval.expires"),
                        Some(e),
                        Duration::from_secs(3600),
                    )
                }),
                preview: a.preview,
            }
        });
        let retry = match r.retry {
            None => RetrySpec {
                attempts: 1,
                backoff: Duration::from_millis(50),
            },
            Some(rt) => {
                let attempts = rt.attempts.unwrap_or(3);
                if attempts == 0 || attempts > 10 {
                    self.err(
                        format!("{path}.retry.attempts"),
                        format!("expected 1..=10 tries, found {attempts}"),
                    );
                }
                RetrySpec {
                    attempts: attempts.clamp(1, 10),
                    backoff: Duration::from_millis(rt.backoff_ms.unwrap_or(50)),
                }
            }
        };
        // On a side effect, `retry` covers only failures before any byte was sent
        // (connect, DNS, TLS), under the same execution: see `RetrySpec`.
        if class == Class::ReadOnly {
            for (key, set) in [
                ("approval", approval.is_some()),
                ("reconcile", r.reconcile.is_some()),
                ("key_required", r.key_required.is_some()),
            ] {
                if set {
                    self.err(
                        format!("{path}.{key}"),
                        "only meaningful on side_effect routes",
                    );
                }
            }
        }
        let tool_version = r.tool_version.unwrap_or_else(|| "v1".into());
        let retention = self.duration(
            &format!("{path}.retention"),
            r.retention.as_deref(),
            store.retention,
        );
        let timeout = self.duration(&format!("{path}.timeout"), r.timeout.as_deref(), timeout);
        let reconcile = r
            .reconcile
            .and_then(|rc| self.reconcile(&format!("{path}.reconcile"), rc, &rpath, timeout));
        let external_id = match r.external_id.as_deref() {
            _ if class == Class::Webhook => None,
            Some("none") => None,
            Some(p) => {
                self.pointer(&format!("{path}.external_id"), p);
                Some(p.to_string())
            }
            None => Some("/id".to_string()),
        };
        let mut route = Route {
            external_id,
            name,
            method,
            path: rpath,
            class,
            tool_version,
            key_required: r.key_required.unwrap_or(true),
            downstream_key,
            fingerprint,
            on_5xx,
            concurrent,
            reconcile,
            approval,
            retention,
            retry,
            timeout,
            webhook,
            job,
            observes: None,
            index_external_id: false,
            batch: None,
            read_only_total: Default::default(),
        };
        if let Some((mut spec, each)) = batch {
            // An item goes downstream as a call of its own on the batch route's terms;
            // the batch's approval covers it, and the batch body's pointers do not apply.
            spec.each = each.map(|(method, each_path)| {
                let mut item = route.clone();
                item.method = Some(method);
                item.path = each_path;
                item.approval = None;
                item.job = None;
                item.fingerprint.ignore_json.clear();
                std::sync::Arc::new(item)
            });
            route.batch = Some(std::sync::Arc::new(spec));
        }
        Some(route)
    }

    /// A side-effect route's `batch:` block (SPEC section 9.3), with the `each` request of
    /// an independent batch (method, literal path).
    fn batch(
        &mut self,
        path: &str,
        b: RawBatch,
        class: Class,
        job: bool,
    ) -> Option<(crate::policy::batch::BatchSpec, Option<(Method, String)>)> {
        use crate::policy::batch::{BatchSpec, Mode};
        if class != Class::SideEffect {
            self.err(path, "only meaningful on side_effect routes");
            return None;
        }
        let items = match b.items {
            Some(p) => {
                self.pointer(&format!("{path}.items"), &p);
                p
            }
            None => {
                self.err(
                    format!("{path}.items"),
                    "missing: the JSON pointer to the array of items (e.g. /messages)",
                );
                return None;
            }
        };
        let mode = self.one_of(
            &format!("{path}.mode"),
            b.mode.as_deref(),
            Mode::Atomic,
            &[("independent", Mode::Independent), ("atomic", Mode::Atomic)],
        );
        if b.mode.is_none() {
            self.err(
                format!("{path}.mode"),
                "missing: independent (an execution per item) or atomic (one execution)",
            );
        }
        if let Some(p) = &b.item_key {
            self.pointer(&format!("{path}.item_key"), p);
        }
        let max_items = b.max_items.unwrap_or(100);
        if max_items == 0 || max_items > 10_000 {
            self.err(
                format!("{path}.max_items"),
                format!("expected 1..=10000 items, found {max_items}"),
            );
        }
        let each = match (mode, b.each) {
            (Mode::Atomic, Some(_)) => {
                self.err(
                    format!("{path}.each"),
                    "only meaningful in independent mode (an atomic batch is sent as is)",
                );
                None
            }
            (Mode::Atomic, None) => None,
            (Mode::Independent, None) => {
                self.err(
                    format!("{path}.each"),
                    "missing: how one item is sent downstream (e.g. { method: POST, path: /send })",
                );
                return None;
            }
            (Mode::Independent, Some(e)) => {
                if job {
                    self.err(
                        format!("{path}.mode"),
                        "an independent batch cannot also start a job (job:); use atomic",
                    );
                }
                let method = match e.method.as_deref().unwrap_or("POST") {
                    m @ ("POST" | "PUT" | "PATCH" | "DELETE") => {
                        Method::from_bytes(m.as_bytes()).expect("literal methods")
                    }
                    other => {
                        self.err(
                            format!("{path}.each.method"),
                            format!("expected POST | PUT | PATCH | DELETE, found `{other}`"),
                        );
                        Method::POST
                    }
                };
                match e.path {
                    Some(p) if p.starts_with('/') && !p.contains(['?', '{', '}']) => {
                        self.normal_path(&format!("{path}.each.path"), &p);
                        Some((method, p))
                    }
                    Some(p) => {
                        self.err(
                            format!("{path}.each.path"),
                            format!("expected a literal path starting with / (no query, no parameters), found `{p}`"),
                        );
                        None
                    }
                    None => {
                        self.err(format!("{path}.each.path"), "missing (e.g. /send)");
                        None
                    }
                }
            }
        };
        Some((
            BatchSpec {
                items,
                item_key: b.item_key,
                max_items: max_items.clamp(1, 10_000),
                each: None,
            },
            each,
        ))
    }

    /// `job.status` (SPEC section 9.2): the upstream's read-only status endpoint of a job.
    fn job_status(
        &mut self,
        path: &str,
        st: crate::config::raw::RawJobStatus,
    ) -> Option<crate::policy::job::StatusSpec> {
        use crate::policy::job::{StatusSpec, JOB_ID_PARAM};
        let method = match st.method.as_deref() {
            None | Some("GET") => Method::GET,
            Some(other) => {
                self.err(
                    format!("{path}.method"),
                    format!("expected GET (a status poll is read-only), found `{other}`"),
                );
                Method::GET
            }
        };
        let template = match st.path {
            Some(p) if p.starts_with('/') && !p.contains('?') => {
                if !p.contains(&format!("{{{JOB_ID_PARAM}}}")) {
                    self.err(
                        format!("{path}.path"),
                        format!(
                            "`{p}` does not name the job: put {{{JOB_ID_PARAM}}} where its id goes"
                        ),
                    );
                    return None;
                }
                if let Some(twice) = repeated_param(&p) {
                    self.err(
                        format!("{path}.path"),
                        format!(
                            "the path template `{p}` names the parameter `{twice}` more than once"
                        ),
                    );
                    return None;
                }
                p
            }
            Some(p) => {
                self.err(
                    format!("{path}.path"),
                    format!("expected a path template starting with / (no query), found `{p}`"),
                );
                return None;
            }
            None => {
                self.err(format!("{path}.path"), "missing (e.g. /jobs/{job_id})");
                return None;
            }
        };
        let state = st.state.unwrap_or_else(|| "/status".into());
        self.pointer(&format!("{path}.state"), &state);
        if st.succeeded.is_empty() && st.failed.is_empty() {
            self.err(
                format!("{path}.succeeded"),
                "name the states that end the job in `succeeded` and/or `failed`",
            );
        }
        let every = st.every.as_deref().map(|e| {
            let d = self.duration(&format!("{path}.every"), Some(e), Duration::from_secs(5));
            if d < Duration::from_millis(100) {
                self.err(format!("{path}.every"), "at least 100ms");
            }
            d
        });
        Some(StatusSpec {
            method,
            path: template,
            state,
            succeeded: st.succeeded,
            failed: st.failed,
            every,
        })
    }

    /// Which read-only route carries each `job.status` endpoint (SPEC section 9.2): the
    /// route a poll of it is classified to. That route gets a [`JobWatch`] so its requests
    /// are observed; every other route's `observes` stays `None`. A status endpoint the
    /// table classifies as a side effect is refused (the poll would be recorded, not
    /// observed); one no route takes (`unmatched: reject`) is polled only by the proxy.
    fn job_observers(
        &mut self,
        upstreams: &mut [Upstream],
        table: &RouteTable,
        unmatched: Unmatched,
    ) {
        use crate::policy::job::{JobWatch, Watcher};
        for ui in 0..upstreams.len() {
            let mut by_route: Vec<(RouteRef, Vec<Watcher>)> = Vec::new();
            for (ri, r) in upstreams[ui].routes.iter().enumerate() {
                let Some(status) = r.job.as_ref().and_then(|j| j.status.as_ref()) else {
                    continue;
                };
                let up = &upstreams[ui];
                // A path the template matches: every parameter one plain segment.
                let sample = sample_path(&status.path);
                let full = format!("{}{}", up.mount, sample);
                let spath = format!("upstreams[{ui}].routes[{ri}].job.status.path");
                match table.classify(upstreams, unmatched, &status.method, &full) {
                    Classified::Matched(t) if t.upstream_index == ui => {
                        if t.route.class != Class::ReadOnly {
                            self.err(
                                spath,
                                format!(
                                    "{} {} is classified as the {} route `{}`: the agent's status polls would run as side effects; declare a read-only route for it",
                                    status.method, status.path,
                                    if t.route.class == Class::Webhook { "webhook" } else { "side_effect" },
                                    t.route.name
                                ),
                            );
                            continue;
                        }
                        let w = Watcher {
                            route: r.name.clone(),
                            status: status.clone(),
                        };
                        match by_route.iter_mut().find(|(rr, _)| *rr == t.route_ref) {
                            Some((_, v)) => v.push(w),
                            None => by_route.push((t.route_ref, vec![w])),
                        }
                    }
                    _ => {}
                }
            }
            for (rr, watchers) in by_route {
                let watch = match JobWatch::new(watchers) {
                    Ok(w) => std::sync::Arc::new(w),
                    Err(e) => {
                        self.err(
                            format!("upstreams[{ui}].routes"),
                            format!("job.status paths: {e}"),
                        );
                        continue;
                    }
                };
                let up = &mut upstreams[ui];
                let route = match rr {
                    RouteRef::Declared(i) => &mut up.routes[i],
                    RouteRef::FallbackReadOnly => &mut up.fallback_read_only,
                    RouteRef::FallbackSideEffect => &mut up.fallback_side_effect,
                };
                route.observes = Some(watch);
            }
        }
    }

    /// A webhook route's `webhook:` block (SPEC section 9.1). The secret is read from the
    /// environment here; an unset variable leaves the route refusing every delivery.
    fn webhook(&mut self, path: &str, w: RawWebhook) -> crate::policy::webhook::WebhookSpec {
        use crate::policy::webhook::{
            secret, Correlate, CorrelateTo, Encoding, EventIdFrom, OutcomeSpec, Scheme, Verify,
            WebhookSpec,
        };
        let event_id = match w.event_id {
            Some(RawEventId {
                header: Some(h),
                json: None,
            }) => EventIdFrom::Header(
                self.header(&format!("{path}.event_id.header"), &h)
                    .unwrap_or(HeaderName::from_static("webhook-id")),
            ),
            Some(RawEventId {
                header: None,
                json: Some(p),
            }) => {
                self.pointer(&format!("{path}.event_id.json"), &p);
                EventIdFrom::Json(p)
            }
            None => EventIdFrom::Header(HeaderName::from_static("webhook-id")),
            Some(_) => {
                self.err(
                    format!("{path}.event_id"),
                    "expected exactly one of { header: NAME } or { json: /pointer }",
                );
                EventIdFrom::Header(HeaderName::from_static("webhook-id"))
            }
        };
        let verify = w.verify.map(|v| {
            let vp = format!("{path}.verify");
            let scheme = match v.scheme.as_deref() {
                Some("standard_webhooks") => Scheme::StandardWebhooks,
                Some("stripe") => Scheme::Stripe,
                Some("hmac_sha256") => {
                    let header = match v.header.as_deref() {
                        Some(h) => self
                            .header(&format!("{vp}.header"), h)
                            .unwrap_or(HeaderName::from_static("x-signature")),
                        None => {
                            self.err(
                                format!("{vp}.header"),
                                "missing: the header that carries the signature (e.g. X-Hub-Signature-256)",
                            );
                            HeaderName::from_static("x-signature")
                        }
                    };
                    let encoding = self.one_of(
                        &format!("{vp}.encoding"),
                        v.encoding.as_deref(),
                        Encoding::Hex,
                        &[("hex", Encoding::Hex), ("base64", Encoding::Base64)],
                    );
                    Scheme::HmacSha256 {
                        header,
                        encoding,
                        prefix: v.prefix.clone().unwrap_or_default(),
                    }
                }
                other => {
                    self.err(
                        format!("{vp}.scheme"),
                        format!(
                            "expected one of standard_webhooks | stripe | hmac_sha256, found `{}`",
                            other.unwrap_or("nothing")
                        ),
                    );
                    Scheme::StandardWebhooks
                }
            };
            if !matches!(scheme, Scheme::HmacSha256 { .. })
                && (v.header.is_some() || v.encoding.is_some() || v.prefix.is_some())
            {
                self.err(
                    vp.clone(),
                    "header, encoding and prefix are only meaningful with scheme: hmac_sha256",
                );
            }
            let tolerance = self.duration(
                &format!("{vp}.tolerance"),
                v.tolerance.as_deref(),
                Duration::from_secs(300),
            );
            let secret = match v.secret_env.as_deref() {
                Some(env) if !env.is_empty() => match std::env::var(env) {
                    Ok(value) => match secret(&scheme, &value) {
                        Ok(s) => Ok(s),
                        Err(why) => {
                            self.err(format!("{vp}.secret_env"), format!("${env}: {why}"));
                            Err(why)
                        }
                    },
                    Err(_) => Err(format!("${env} is not set")),
                },
                _ => {
                    self.err(
                        format!("{vp}.secret_env"),
                        "missing: name the environment variable that holds the secret",
                    );
                    Err("no secret_env".into())
                }
            };
            Verify {
                scheme,
                secret,
                tolerance,
            }
        });
        let mut correlate = Vec::new();
        for (i, c) in w.correlate.into_iter().enumerate() {
            let cp = format!("{path}.correlate[{i}]");
            let to = match c.to.as_deref() {
                None | Some("execution_id") => CorrelateTo::ExecutionId,
                Some("external_id") => CorrelateTo::ExternalId,
                Some(other) => {
                    self.err(
                        format!("{cp}.to"),
                        format!("expected execution_id | external_id, found `{other}`"),
                    );
                    CorrelateTo::ExecutionId
                }
            };
            match c.json {
                Some(p) => {
                    self.pointer(&format!("{cp}.json"), &p);
                    correlate.push(Correlate { json: p, to });
                }
                None => self.err(
                    format!("{cp}.json"),
                    "missing (e.g. /request/idempotency_key)",
                ),
            }
        }
        let outcome = w.outcome.map(|o| {
            let status = o.status.unwrap_or_else(|| "/type".into());
            self.pointer(&format!("{path}.outcome.status"), &status);
            OutcomeSpec {
                status,
                succeeded: o.succeeded,
                failed: o.failed,
            }
        });
        if !correlate.is_empty() && verify.is_none() {
            self.err(
                format!("{path}.correlate"),
                "correlating events with calls needs `verify`: an unsigned event could otherwise write into any call's record",
            );
        }
        if outcome.as_ref().is_some_and(|o| !o.succeeded.is_empty()) {
            if verify.is_none() {
                self.err(
                    format!("{path}.outcome"),
                    "settling calls by event needs `verify`: an unsigned event could otherwise mark any call as committed",
                );
            }
            if correlate.is_empty() {
                self.err(
                    format!("{path}.outcome"),
                    "needs `correlate`: the pointers that name the call an event is about",
                );
            }
        }
        WebhookSpec {
            event_id,
            verify,
            correlate,
            outcome,
            store_body: w.store_body.unwrap_or(false),
        }
    }

    fn reconcile(
        &mut self,
        path: &str,
        rc: RawReconcile,
        route_path: &str,
        route_timeout: Duration,
    ) -> Option<ReconcileSpec> {
        if rc.tool.is_some() || rc.arguments.is_some() {
            self.err(
                format!("{path}.tool"),
                "`tool` and `arguments` are for MCP tools (upstreams with `protocol: mcp`)",
            );
        }
        let method = match rc.method.as_deref().unwrap_or("GET") {
            m @ ("GET" | "POST" | "HEAD") => {
                Method::from_bytes(m.as_bytes()).expect("literal methods")
            }
            other => {
                self.err(
                    format!("{path}.method"),
                    format!("expected GET | POST | HEAD, found `{other}`"),
                );
                Method::GET
            }
        };
        let Some(p) = rc.path.filter(|p| p.starts_with('/')) else {
            self.err(
                format!("{path}.path"),
                "missing or not starting with / (e.g. \"/messages?tag={execution_id}\")",
            );
            return None;
        };
        if let Err(e) = crate::policy::reconcile::check_template(&p, route_path) {
            self.err(
                format!("{path}.path"),
                format!("{e} (known: {{execution_id}}, {{key}} and the route's path parameters)"),
            );
        }
        let mut headers = Vec::new();
        for (k, v) in rc.headers {
            if let Some(h) = self.header(&format!("{path}.headers.{k}"), &k) {
                headers.push((h, v));
            }
        }
        let found = self.matcher(path, "found", rc.found, false);
        let not_found = self.matcher(path, "not_found", rc.not_found, false);
        if let Some(p) = &rc.external_id {
            self.pointer(&format!("{path}.external_id"), p);
        }
        let settle = self.duration(
            &format!("{path}.settle"),
            rc.settle.as_deref(),
            route_timeout.saturating_mul(2),
        );
        Some(ReconcileSpec {
            method,
            path: p,
            headers,
            found,
            not_found,
            external_id: rc.external_id,
            settle,
        })
    }
}

/// Values quoted in a message (between backticks) are cut to [`MAX_SHOWN`] characters: a
/// config value can be megabytes long, and `check` must still print a readable line.
const MAX_SHOWN: usize = 80;

fn cut_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(1024));
    let mut parts = message.split('`');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    for (i, part) in parts.enumerate() {
        out.push('`');
        // Odd pieces (0-based after the first) sit between a pair of backticks.
        if i % 2 == 0 && part.chars().count() > MAX_SHOWN {
            out.extend(part.chars().take(MAX_SHOWN - 20));
            out.push_str(&format!("… ({} bytes in all)", part.len()));
        } else {
            out.push_str(part);
        }
    }
    out
}

/// The first parameter a path template names twice (`/a/{id}/{id}`), if any.
/// A path `template` matches, each parameter a plain segment (to classify a template as
/// its requests would be).
fn sample_path(template: &str) -> String {
    template
        .split('/')
        .map(|seg| {
            if seg.starts_with('{') && seg.ends_with('}') {
                "x"
            } else {
                seg
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn repeated_param(template: &str) -> Option<String> {
    let mut seen = std::collections::HashSet::new();
    for segment in template.split('/') {
        let Some(name) = segment
            .strip_prefix('{')
            .and_then(|s| s.strip_suffix('}'))
            .map(|s| s.trim_start_matches('*'))
        else {
            continue;
        };
        if !seen.insert(name) {
            return Some(name.to_string());
        }
    }
    None
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}
