use std::path::Path;

use super::*;

fn errors(yaml: &str) -> String {
    from_yaml(yaml, Path::new("cfg.yaml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn unknown_key_names_file_path_and_line() {
    let text = errors(
        "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    routes:\n      - name: a\n        match: { method: POST, path: /a }\n        colour: blue\n",
    );
    assert!(
        text.starts_with("cfg.yaml:7: upstreams[0].routes[0]"),
        "{text}"
    );
    assert!(text.contains("unknown field `colour`"), "{text}");
    // The path is printed once, not again by the YAML parser's own message.
    assert_eq!(text.matches("upstreams[0].routes[0]").count(), 1, "{text}");
}

#[test]
fn every_unknown_field_is_reported_at_once() {
    let text = errors(
        "listen: 127.0.0.1:1\ncolour: blue\nupstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    shape: round\n    routes:\n      - { name: a, match: { method: POST, path: /a }, flavour: x }\n",
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].starts_with("cfg.yaml:2: colour: unknown field `colour`"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("cfg.yaml:6: upstreams[0].shape: unknown field `shape`"),
        "{text}"
    );
    assert!(
        lines[2].starts_with("cfg.yaml:8: upstreams[0].routes[0].flavour: unknown field `flavour`"),
        "{text}"
    );
}

#[test]
fn bad_values_are_all_reported_with_paths() {
    let text = errors(
        "upstreams:\n  - name: mail\n    url: ftp://x\n  - name: pay\n    url: http://127.0.0.1:1\n    routes:\n      - name: a\n        match: { method: POST, path: /a }\n        on_5xx: maybe\n        timeout: soon\n",
    );
    assert!(
        text.contains("cfg.yaml: upstreams[0].url: expected an absolute http:// or https:// URL"),
        "{text}"
    );
    assert!(text.contains("cfg.yaml: upstreams[1].routes[0].on_5xx: expected one of outcome_unknown | failed_before_commit | committed, found `maybe`"), "{text}");
    assert!(
        text.contains("upstreams[1].routes[0].timeout: expected a duration"),
        "{text}"
    );
}

#[test]
fn defaults_follow_the_spec() {
    let cfg = from_yaml(
        "upstreams:\n  - name: mail\n    url: https://api.example.com/v2/\n    routes:\n      - { name: send, match: { method: POST, path: /send } }\n      - { name: get, match: { method: GET, path: /m } }\n",
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let up = &cfg.upstreams[0];
    assert_eq!(up.mount, "/mail");
    assert_eq!(up.base_path, "/v2");
    let send = &up.routes[0];
    assert_eq!(send.class, Class::SideEffect);
    assert!(send.key_required);
    assert_eq!(send.on_5xx, On5xx::OutcomeUnknown);
    assert_eq!(
        send.downstream_key.as_ref().map(|k| k.header.as_str()),
        Some("idempotency-key")
    );
    assert_eq!(up.routes[1].class, Class::ReadOnly);
    assert_eq!(cfg.limits.max_body_bytes, 1024 * 1024);
    assert_eq!(cfg.limits.max_key_bytes, 255);
    assert_eq!(cfg.limits.max_header_bytes, 8192);
    assert!(matches!(cfg.store.backend, StoreBackend::Redb { .. }));
}

#[test]
fn max_header_bytes_is_bounded_by_what_the_server_can_read() {
    let yaml = |n: u64| {
        format!(
            "limits: {{ max_header_bytes: {n} }}\nupstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - {{ name: s, match: {{ method: POST, path: /s }} }}\n"
        )
    };
    let cfg = from_yaml(&yaml(65536), Path::new("cfg.yaml")).expect("valid");
    assert_eq!(cfg.limits.max_header_bytes, 65536);
    for (n, why) in [(4096, "at least 8192"), (2 << 20, "at most 1048576")] {
        let text = errors(&yaml(n));
        assert!(text.contains("cfg.yaml"), "{text}");
        assert!(text.contains("limits.max_header_bytes"), "{text}");
        assert!(text.contains(why), "{text}");
    }
}

#[test]
fn downstream_key_none_and_postgres_backend() {
    let cfg = from_yaml(
        "store: { backend: postgres, url_env: PG_URL }\nupstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - { name: s, match: { method: POST, path: /s }, downstream_key: none }\n",
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    assert!(cfg.upstreams[0].routes[0].downstream_key.is_none());
    assert!(
        matches!(&cfg.store.backend, StoreBackend::Postgres { url_env, .. } if url_env == "PG_URL")
    );
    let text = errors("upstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - { name: s, match: { method: POST, path: /s }, downstream_key: always }\n");
    assert!(
        text.contains("upstreams[0].routes[0].downstream_key: expected `none`"),
        "{text}"
    );
}

#[test]
fn reconcile_settle_defaults_to_twice_the_timeout_and_templates_are_checked() {
    let cfg = from_yaml(
        "upstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - name: s\n        match: { method: POST, path: \"/orders/{order}/pay\" }\n        timeout: 2s\n        retry: { attempts: 3, backoff_ms: 10 }\n        reconcile: { path: \"/pay?o={order}&k={key}\", found: { status: 200 }, not_found: { status: 404 } }\n",
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let route = &cfg.upstreams[0].routes[0];
    let rc = route.reconcile.as_ref().expect("reconcile");
    assert_eq!(rc.settle, Duration::from_secs(4));
    assert_eq!(
        route.retry.attempts, 3,
        "side effects may retry connect failures"
    );
    assert_eq!(cfg.store.reconcile_interval, Duration::from_secs(10));
    let text = errors(
        "upstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - name: s\n        match: { method: POST, path: /send }\n        reconcile: { path: \"/m?t={tag}\", settle: 1s, found: {}, not_found: { status: 404 } }\n",
    );
    assert!(
        text.contains("upstreams[0].routes[0].reconcile.path: unknown placeholder `{tag}`"),
        "{text}"
    );
    assert!(
        text.contains("upstreams[0].routes[0].reconcile.found: needs at least one of"),
        "{text}"
    );
}

#[test]
fn redb_page_cache_is_set_checked_and_redb_only() {
    let ups = "upstreams:\n  - name: m\n    url: http://127.0.0.1:1\n    routes:\n      - { name: s, match: { method: POST, path: /s } }\n";
    let cfg = from_yaml(
        &format!("store: {{ cache_bytes: 8388608 }}\n{ups}"),
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    assert!(matches!(
        cfg.store.backend,
        StoreBackend::Redb {
            cache_bytes: 8388608,
            ..
        }
    ));
    let text = errors(&format!("store: {{ cache_bytes: 1000 }}\n{ups}"));
    assert!(
        text.contains("store.cache_bytes: expected at least 1048576 (1 MiB), found 1000"),
        "{text}"
    );
    let text = errors(&format!(
        "store: {{ backend: postgres, cache_bytes: 8388608 }}\n{ups}"
    ));
    assert!(
        text.contains("store.cache_bytes: only used with `backend: redb`"),
        "{text}"
    );
}

#[test]
fn mounts_and_templates_must_be_normalised_paths() {
    let text = errors(
        "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    mount: /a//mail\n    routes:\n      - { name: a, match: { method: POST, path: /x/./send } }\n      - { name: b, match: { method: POST, path: /%73end } }\n      - { name: c, match: { method: POST, path: /bad%zz } }\n",
    );
    assert!(
        text.contains("cfg.yaml: upstreams[0].mount: `/a//mail` is not a normalised path"),
        "{text}"
    );
    assert!(text.contains("write `/x/send`"), "{text}");
    assert!(text.contains("upstreams[0].routes[1].match.path: `/%73end` is not a normalised path and no request could match it (requests are matched on normalised paths); write `/send`"), "{text}");
    assert!(
        text.contains("upstreams[0].routes[2].match.path: `/bad%zz`: a `%` in the path"),
        "{text}"
    );
}

#[test]
fn admin_tokens_are_named_scoped_and_checked() {
    let base = "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n";
    let cfg = from_yaml(
        &format!("admin:\n  tokens:\n    - {{ name: ops, token_env: OPS, scopes: [view, approve] }}\n{base}"),
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let admin = cfg.admin.expect("admin");
    assert_eq!(admin.tokens.len(), 1, "no implicit token beside named ones");
    assert_eq!(admin.tokens[0].name, "ops");
    assert_eq!(admin.tokens[0].scopes, vec![Scope::View, Scope::Approve]);
    let single = from_yaml(
        &format!("admin: {{ token_env: T }}\n{base}"),
        Path::new("c.yaml"),
    )
    .expect("valid")
    .admin
    .expect("admin");
    assert_eq!(single.tokens[0].name, "admin");
    assert!(single.tokens[0].allows(Scope::Cancel));
    let text = errors(&format!(
        "admin:\n  token_env: \"\"\n  tokens:\n    - {{ name: ops, token_env: A, scopes: [view, delete] }}\n    - {{ name: ops, token_env: B, scopes: [] }}\n    - {{ name: \"a b\", token_env: C, scopes: [view] }}\n{base}"
    ));
    assert!(text.contains("admin.token_env: is empty"), "{text}");
    assert!(text.contains("admin.tokens[0].scopes[1]: expected one of view | approve | resolve | cancel | admin, found `delete`"), "{text}");
    assert!(
        text.contains("admin.tokens[1].name: another admin token is named `ops`"),
        "{text}"
    );
    assert!(
        text.contains("admin.tokens[1].scopes: missing or empty"),
        "{text}"
    );
    assert!(
        text.contains("admin.tokens[2].name: `a b` is not a token name"),
        "{text}"
    );
}

#[test]
fn connection_deadlines_have_defaults_and_are_read_with_their_paths() {
    let up = "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n";
    let cfg = from_yaml(up, Path::new("cfg.yaml")).expect("valid");
    assert_eq!(cfg.timeouts.client_header, Duration::from_secs(30));
    assert_eq!(cfg.timeouts.client_body, Duration::from_secs(60));
    assert_eq!(cfg.timeouts.upstream_body, Duration::from_secs(60));
    let cfg = from_yaml(
        &format!("timeouts: {{ client_header: 2s, client_body: 3s, upstream_body: 4s }}\n{up}"),
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    assert_eq!(cfg.timeouts.client_header, Duration::from_secs(2));
    assert_eq!(cfg.timeouts.client_body, Duration::from_secs(3));
    assert_eq!(cfg.timeouts.upstream_body, Duration::from_secs(4));
    let text = errors(&format!("timeouts: {{ client_body: 0s }}\n{up}"));
    assert!(
        text.contains("cfg.yaml: timeouts.client_body: expected a positive duration"),
        "{text}"
    );
}

/// Issue 34: `check` refuses an empty `url_env` and a template naming a parameter twice,
/// and cuts long values in its messages.
#[test]
fn empty_url_env_repeated_params_and_long_values() {
    let pg = "store: { backend: postgres, url_env: \"\" }\nupstreams: []\n";
    let err = from_yaml(pg, Path::new("t.yaml")).expect_err("empty url_env");
    assert!(err.to_string().contains("store.url_env"), "{err}");

    let twice = "store: { backend: redb, path: x.redb }\nupstreams:\n  - name: a\n    url: http://127.0.0.1:1\n    mount: /a\n    routes:\n      - { name: r, match: { method: POST, path: \"/a/{id}/{id}\" } }\n";
    let err = from_yaml(twice, Path::new("t.yaml")).expect_err("repeated param");
    assert!(err.to_string().contains("`id` more than once"), "{err}");

    let long = "x".repeat(10 << 20);
    let yaml =
        format!("listen: \"{long}\"\nstore: {{ backend: redb, path: x.redb }}\nupstreams: []\n");
    let err = from_yaml(&yaml, Path::new("t.yaml")).expect_err("bad listen");
    let text = err.to_string();
    assert!(text.len() < 2000, "{} bytes", text.len());
    assert!(text.contains("bytes in all"), "{text}");
}

#[test]
fn webhook_routes_fix_the_core_settings_and_refuse_unsafe_settling() {
    let cfg = from_yaml(
        "upstreams:\n  - name: app\n    url: http://127.0.0.1:1\n    routes:\n      - name: hooks\n        match: { method: POST, path: /hooks }\n        class: webhook\n        webhook: { event_id: { json: /id } }\n",
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let r = &cfg.upstreams[0].routes[0];
    assert_eq!(r.class, Class::Webhook);
    assert_eq!(r.on_5xx, On5xx::FailedBeforeCommit);
    let dk = r.downstream_key.as_ref().expect("a downstream key");
    assert_eq!(dk.header.as_str(), "idempotency-key");
    assert!(
        dk.replays,
        "a timed-out delivery is re-sent under the same key"
    );
    assert!(r.external_id.is_none());
    let w = r.webhook.as_ref().expect("webhook spec");
    assert_eq!(
        w.event_id,
        crate::policy::webhook::EventIdFrom::Json("/id".into())
    );

    let text = errors(
        "upstreams:\n  - name: app\n    url: http://127.0.0.1:1\n    routes:\n      - name: a\n        match: { method: POST, path: /a }\n        class: webhook\n      - name: b\n        match: { method: POST, path: /b }\n        class: webhook\n        on_5xx: committed\n        webhook:\n          correlate: [{ json: /x, to: external_id }, { json: /y, to: job }]\n          outcome: { succeeded: [ok] }\n      - name: c\n        match: { method: POST, path: /c }\n        class: webhook\n        webhook: { verify: { scheme: pgp, secret_env: S } }\n      - name: d\n        match: { method: POST, path: /d }\n        webhook: { event_id: { header: x } }\n",
    );
    for want in [
        "upstreams[0].routes[0].webhook: missing",
        "upstreams[0].routes[1].on_5xx: not configurable on a webhook route",
        "upstreams[0].routes[1].webhook.correlate[1].to: expected execution_id | external_id, found `job`",
        "upstreams[0].routes[1].webhook.outcome: settling calls by event needs `verify`",
        "upstreams[0].routes[1].webhook.correlate: correlating events with calls needs `verify`",
        "upstreams[0].routes[2].webhook.verify.scheme: expected one of standard_webhooks | stripe | hmac_sha256, found `pgp`",
        "upstreams[0].routes[3].webhook: only meaningful on class: webhook routes",
    ] {
        assert!(text.contains(want), "missing `{want}` in\n{text}");
    }
}

#[test]
fn batch_routes_are_read_and_checked() {
    let cfg = from_yaml(
        "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    routes:\n      - name: many\n        match: { method: POST, path: /many }\n        approval: { preview: [/memo] }\n        fingerprint: { ignore_json: [/client_ts] }\n        batch: { items: /messages, mode: independent, item_key: /to, each: { path: /send } }\n",
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let r = &cfg.upstreams[0].routes[0];
    let b = r.batch.as_ref().expect("batch spec");
    assert_eq!(b.mode(), crate::policy::batch::Mode::Independent);
    assert_eq!(b.max_items, 100);
    let each = b.each.as_ref().expect("the item route");
    assert_eq!(
        (each.method.as_ref(), each.path.as_str()),
        (Some(&Method::POST), "/send")
    );
    assert_eq!(each.name, "many", "items are the route's executions");
    assert!(
        each.approval.is_none(),
        "the batch's approval covers the items"
    );
    assert!(
        each.fingerprint.ignore_json.is_empty(),
        "the batch body's pointers do not apply"
    );

    let text = errors(
        "upstreams:\n  - name: mail\n    url: http://127.0.0.1:1\n    routes:\n      - name: a\n        match: { method: POST, path: /a }\n        batch: { items: /m, mode: independent }\n      - name: b\n        match: { method: POST, path: /b }\n        batch: { items: m, mode: atomic, each: { path: /x }, max_items: 0 }\n      - name: c\n        match: { method: GET, path: /c }\n        batch: { items: /m, mode: atomic }\n      - name: d\n        match: { method: POST, path: /d }\n        batch: { items: /m, mode: independent, each: { method: GET, path: \"/x/{id}\" } }\n      - name: e\n        match: { method: POST, path: /e }\n        batch: { mode: sometimes }\n",
    );
    for want in [
        "upstreams[0].routes[0].batch.each: missing",
        "upstreams[0].routes[1].batch.items:",
        "upstreams[0].routes[1].batch.each: only meaningful in independent mode",
        "upstreams[0].routes[1].batch.max_items: expected 1..=10000 items, found 0",
        "upstreams[0].routes[2].batch: only meaningful on side_effect routes",
        "upstreams[0].routes[3].batch.each.method: expected POST | PUT | PATCH | DELETE, found `GET`",
        "upstreams[0].routes[3].batch.each.path: expected a literal path",
        "upstreams[0].routes[4].batch.items: missing",
    ] {
        assert!(text.contains(want), "missing `{want}` in\n{text}");
    }
}

#[test]
fn a_bad_model_round_header_names_its_path() {
    let text = errors(
        "identity: { model_round_from: \"X Round\" }\nupstreams:\n  - { name: m, url: http://127.0.0.1:1, routes: [] }\n",
    );
    assert!(text.contains("identity.model_round_from"), "{text}");
}

#[test]
fn job_status_endpoints_are_observed_by_the_read_only_route_that_carries_them() {
    let yaml = "upstreams:\n  - name: app\n    url: http://127.0.0.1:1\n    routes:\n      - name: start\n        match: { method: POST, path: /exports }\n        job: { id: /id, status: { path: \"/exports/{job_id}\", succeeded: [done], every: 2s } }\n      - { name: show, match: { method: GET, path: \"/exports/{id}\" } }\n      - name: run\n        match: { method: POST, path: /runs }\n        job: { id: /id, status: { path: \"/runs/{job_id}/state\", failed: [failed] } }\n      - { name: other, match: { method: GET, path: /health } }\n";
    let cfg = from_yaml(yaml, Path::new("cfg.yaml")).expect("valid");
    let up = &cfg.upstreams[0];
    let status = up.routes[0]
        .job
        .as_ref()
        .and_then(|j| j.status.as_ref())
        .expect("status");
    assert_eq!(status.every, Some(Duration::from_secs(2)));
    assert_eq!(status.state, "/status");
    // The declared GET route carries the first; the unmatched read-only fallback the second.
    let watch = up.routes[1].observes.as_ref().expect("observed");
    let (job, ws) = watch
        .matching(&Method::GET, "/exports/j%201")
        .expect("a status poll");
    assert_eq!((job.as_str(), ws[0].route.as_str()), ("j 1", "start"));
    assert!(watch.matching(&Method::HEAD, "/exports/j1").is_none());
    let fallback = up.fallback_read_only.observes.as_ref().expect("observed");
    assert!(fallback.matching(&Method::GET, "/runs/r1/state").is_some());
    assert!(fallback.matching(&Method::GET, "/other").is_none());
    for r in [&up.routes[0], &up.routes[2], &up.routes[3]] {
        assert!(r.observes.is_none(), "{}", r.name);
    }
    // External ids are indexed only while a webhook route correlates to them.
    assert!(up.routes.iter().all(|r| !r.index_external_id));
    let hooked = from_yaml(
        &format!("{yaml}      - name: hook\n        match: {{ method: POST, path: /hook }}\n        class: webhook\n        webhook:\n          verify: {{ scheme: standard_webhooks, secret_env: CFG_TEST_UNSET_HOOK_SECRET }}\n          correlate: [{{ json: /data/id, to: external_id }}]\n"),
        Path::new("cfg.yaml"),
    )
    .expect("valid");
    let up = &hooked.upstreams[0];
    assert!(up.routes.iter().all(|r| r.index_external_id));
    assert!(up.fallback_side_effect.index_external_id);

    let text = errors(
        "upstreams:\n  - name: app\n    url: http://127.0.0.1:1\n    routes:\n      - name: a\n        match: { method: POST, path: /a }\n        job: { id: /id, status: { path: /jobs, succeeded: [ok] } }\n      - name: b\n        match: { method: POST, path: /b }\n        job: { id: /id, status: { method: DELETE, path: \"/b/{job_id}\", every: 1ms } }\n      - name: c\n        match: { method: POST, path: /c }\n        job: { id: /id, status: { path: \"/c/{job_id}\", succeeded: [ok] } }\n      - { name: c_poll, match: { path: \"/c/{x}\" }, class: side_effect }\n",
    );
    for want in [
        "upstreams[0].routes[0].job.status.path: `/jobs` does not name the job",
        "upstreams[0].routes[1].job.status.method: expected GET",
        "upstreams[0].routes[1].job.status.succeeded: name the states",
        "upstreams[0].routes[1].job.status.every: at least 100ms",
        "upstreams[0].routes[2].job.status.path: GET /c/{job_id} is classified as the side_effect route `c_poll`",
    ] {
        assert!(text.contains(want), "missing `{want}` in\n{text}");
    }
}
