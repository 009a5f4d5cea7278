//! The YAML file as written: serde structs that reject unknown keys. Nothing here is
//! trusted yet; [`super::resolve`] turns it into the validated [`super::Config`].

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub admin: Option<RawAdmin>,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub limits: RawLimits,
    #[serde(default)]
    pub identity: RawIdentity,
    pub unmatched: Option<String>,
    #[serde(default)]
    pub timeouts: RawTimeouts,
    #[serde(default)]
    pub upstreams: Vec<RawUpstream>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    pub listen: Option<String>,
    pub token_env: Option<String>,
    pub tokens: Option<Vec<RawAdminToken>>,
    pub notify: Option<RawNotify>,
}

/// `admin.notify`: where signed notifications of calls that need a person go.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawNotify {
    pub url: Option<String>,
    pub secret_env: Option<String>,
    pub events: Option<Vec<String>>,
    pub timeout: Option<String>,
}

/// One named admin token: `{ name, token_env, scopes: [view, approve, ...] }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdminToken {
    pub name: Option<String>,
    pub token_env: Option<String>,
    pub scopes: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    pub backend: Option<String>,
    pub path: Option<String>,
    pub cache_bytes: Option<u64>,
    pub url_env: Option<String>,
    pub schema: Option<String>,
    pub retention: Option<String>,
    pub lease: Option<String>,
    pub gc_interval: Option<String>,
    pub reconcile_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_body_bytes: Option<u64>,
    pub max_key_bytes: Option<u64>,
    pub max_response_bytes: Option<u64>,
    pub replay_cache_bytes: Option<u64>,
    pub max_calls_in_flight: Option<u64>,
    pub max_header_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    pub key_header: Option<String>,
    pub derive_from: Option<Vec<String>>,
    pub tenant_from: Option<Vec<String>>,
    pub operation_from: Option<String>,
    pub tool_call_from: Option<String>,
    pub model_round_from: Option<String>,
    /// MCP: `params._meta` fields joined into a derived key (SPEC section 11).
    pub derive_from_meta: Option<Vec<String>>,
    /// MCP: one `params._meta` field holding a whole key.
    pub key_meta: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect: Option<String>,
    pub request: Option<String>,
    pub wait: Option<String>,
    pub client_header: Option<String>,
    pub client_body: Option<String>,
    pub upstream_body: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: Option<String>,
    pub url: Option<String>,
    pub mount: Option<String>,
    pub timeout: Option<String>,
    pub tls: Option<RawTls>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// `http` (default) or `mcp` (SPEC section 11).
    pub protocol: Option<String>,
    pub mcp: Option<RawMcp>,
}

/// `mcp: { unlisted, tools: { NAME: { class, tool_version, ... } } }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMcp {
    pub unlisted: Option<String>,
    #[serde(default)]
    pub tools: BTreeMap<String, RawRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<String>,
    #[serde(rename = "match")]
    pub matcher: Option<RawMatch>,
    pub class: Option<String>,
    pub tool_version: Option<String>,
    pub key_required: Option<bool>,
    pub downstream_key: Option<RawDownstreamKey>,
    pub fingerprint: Option<RawFingerprint>,
    pub on_5xx: Option<String>,
    pub concurrent: Option<String>,
    pub reconcile: Option<RawReconcile>,
    pub approval: Option<RawApproval>,
    pub retention: Option<String>,
    pub retry: Option<RawRetry>,
    pub timeout: Option<String>,
    pub external_id: Option<String>,
    pub webhook: Option<RawWebhook>,
    pub job: Option<RawJob>,
    pub batch: Option<RawBatch>,
}

/// `batch:` on a side-effect route (SPEC section 9.3).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBatch {
    pub items: Option<String>,
    pub mode: Option<String>,
    pub item_key: Option<String>,
    pub each: Option<RawEach>,
    pub max_items: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEach {
    pub method: Option<String>,
    pub path: Option<String>,
}

/// `job:` on a side-effect route (SPEC section 9.2).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJob {
    pub id: Option<String>,
    pub status: Option<RawJobStatus>,
}

/// `job.status`: how the job's state is read (observed polls, proactive polling).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJobStatus {
    pub method: Option<String>,
    pub path: Option<String>,
    pub state: Option<String>,
    #[serde(default)]
    pub succeeded: Vec<String>,
    #[serde(default)]
    pub failed: Vec<String>,
    pub every: Option<String>,
}

/// `webhook:` on a `class: webhook` route (SPEC section 9.1).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWebhook {
    pub event_id: Option<RawEventId>,
    pub verify: Option<RawVerify>,
    #[serde(default)]
    pub correlate: Vec<RawCorrelate>,
    pub outcome: Option<RawOutcome>,
    pub store_body: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEventId {
    pub header: Option<String>,
    pub json: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVerify {
    pub scheme: Option<String>,
    pub secret_env: Option<String>,
    pub tolerance: Option<String>,
    /// `hmac_sha256` only.
    pub header: Option<String>,
    pub encoding: Option<String>,
    pub prefix: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCorrelate {
    pub json: Option<String>,
    pub to: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutcome {
    pub status: Option<String>,
    #[serde(default)]
    pub succeeded: Vec<String>,
    #[serde(default)]
    pub failed: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub ca_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub method: Option<String>,
    pub path: Option<String>,
}

/// `downstream_key: none` or `{ header: ..., replays: ... }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawDownstreamKey {
    Word(String),
    Spec(RawDownstreamKeySpec),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDownstreamKeySpec {
    pub header: Option<String>,
    pub replays: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFingerprint {
    #[serde(default)]
    pub ignore_json: Vec<String>,
    #[serde(default)]
    pub headers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReconcile {
    pub method: Option<String>,
    pub path: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub found: Option<RawMatcher>,
    pub not_found: Option<RawMatcher>,
    pub external_id: Option<String>,
    pub settle: Option<String>,
    /// MCP tools: the read-only tool to call, and its arguments (`{execution_id}`, `{key}`).
    pub tool: Option<String>,
    pub arguments: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatcher {
    pub status: Option<u16>,
    pub json_nonempty: Option<String>,
    pub json_empty: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApproval {
    pub required: Option<bool>,
    #[serde(default)]
    pub preview: Vec<String>,
    pub expires: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    pub attempts: Option<u32>,
    pub backoff_ms: Option<u64>,
}
