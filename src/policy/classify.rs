//! Classification: which upstream and route a request belongs to, and therefore whether
//! it is a side effect. Mounts are matched by longest path-segment prefix; routes inside a
//! mount by matchit (axum's router) path templates such as `/v1/customers/{id}`. Both are
//! matched on the normalised path (`policy::path`), and the path a target carries, the one
//! that is fingerprinted and forwarded, is the path that matched.

use http::Method;

use crate::policy::path;

use crate::config::{Class, Issue, Route, Unmatched, Upstream};

#[derive(Debug)]
pub struct RouteTable {
    /// (mount, upstream index), longest mount first.
    mounts: Vec<(String, usize)>,
    /// Per upstream: template → indices of the routes on it (one per method).
    routers: Vec<matchit::Router<Vec<usize>>>,
}

/// Which route of an upstream a request hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteRef {
    Declared(usize),
    /// Under the mount, no route matched; the method decided (`unmatched: by_method`).
    FallbackSideEffect,
    FallbackReadOnly,
}

#[derive(Debug)]
pub enum Classified<'a> {
    /// No mount covers the path.
    NoUpstream,
    /// Under a mount, no route matched, and `unmatched: reject`.
    Unmatched {
        upstream: &'a Upstream,
    },
    /// The path has no normal form (a broken percent-encoding); refused with 400.
    BadPath(path::BadPath),
    Matched(Target<'a>),
}

#[derive(Debug)]
pub struct Target<'a> {
    pub upstream_index: usize,
    pub upstream: &'a Upstream,
    pub route_ref: RouteRef,
    pub route: &'a Route,
    /// Path after the mount (always starts with `/`), normalised (`policy::path`) and, for
    /// a declared route, spelt with or without a trailing slash as its template is: what
    /// is fingerprinted and what is forwarded.
    pub rel_path: String,
    pub params: Vec<(String, String)>,
}

impl<'a> Target<'a> {
    /// [`Target::to_owned_ref`], moving the path and parameters instead of copying them.
    pub fn into_owned(self) -> OwnedTarget {
        OwnedTarget {
            upstream_index: self.upstream_index,
            route_ref: self.route_ref,
            rel_path: self.rel_path,
            params: self.params,
        }
    }

    /// An owned handle, for work that must outlive the request's borrow of the config.
    pub fn to_owned_ref(&self) -> OwnedTarget {
        OwnedTarget {
            upstream_index: self.upstream_index,
            route_ref: self.route_ref,
            rel_path: self.rel_path.clone(),
            params: self.params.clone(),
        }
    }
}

/// A classification result detached from the config borrow (see [`Target::to_owned_ref`]).
#[derive(Debug, Clone)]
pub struct OwnedTarget {
    pub upstream_index: usize,
    pub route_ref: RouteRef,
    pub rel_path: String,
    pub params: Vec<(String, String)>,
}

impl RouteRef {
    /// The upstream and route this refers to, in the config it was classified against.
    pub fn resolve(self, upstreams: &[Upstream], upstream_index: usize) -> (&Upstream, &Route) {
        let upstream = &upstreams[upstream_index];
        let route = match self {
            RouteRef::Declared(i) => &upstream.routes[i],
            RouteRef::FallbackSideEffect => &upstream.fallback_side_effect,
            RouteRef::FallbackReadOnly => &upstream.fallback_read_only,
        };
        (upstream, route)
    }
}

impl OwnedTarget {
    /// Borrow the target again from the same config it was classified against.
    pub fn bind<'a>(&self, upstreams: &'a [Upstream]) -> Target<'a> {
        self.clone().into_bound(upstreams)
    }

    /// [`OwnedTarget::bind`], moving the path and parameters instead of copying them.
    pub fn into_bound(self, upstreams: &[Upstream]) -> Target<'_> {
        let (upstream, route) = self.route_ref.resolve(upstreams, self.upstream_index);
        Target {
            upstream_index: self.upstream_index,
            upstream,
            route_ref: self.route_ref,
            route,
            rel_path: self.rel_path,
            params: self.params,
        }
    }
}

impl RouteTable {
    pub fn build(upstreams: &[Upstream]) -> Result<RouteTable, Vec<Issue>> {
        let mut issues = Vec::new();
        let mut mounts: Vec<(String, usize)> = Vec::new();
        let mut routers = Vec::new();
        for (ui, up) in upstreams.iter().enumerate() {
            if let Some((_, other)) = mounts.iter().find(|(m, _)| *m == up.mount) {
                issues.push(Issue {
                    path: format!("upstreams[{ui}].mount"),
                    line: None,
                    message: format!(
                        "mount `{}` is already used by upstream `{}`",
                        display_mount(&up.mount),
                        upstreams[*other].name
                    ),
                });
            }
            mounts.push((up.mount.clone(), ui));
            let mut router: matchit::Router<Vec<usize>> = matchit::Router::new();
            let mut templates: Vec<(String, Vec<usize>)> = Vec::new();
            for (ri, r) in up.routes.iter().enumerate() {
                match templates.iter_mut().find(|(t, _)| *t == r.path) {
                    Some((_, list)) => {
                        let clash = list.iter().find(|&&other| {
                            let o = &up.routes[other];
                            o.method.is_none() || r.method.is_none() || o.method == r.method
                        });
                        if let Some(&other) = clash {
                            issues.push(Issue {
                                path: format!("upstreams[{ui}].routes[{ri}].match"),
                                line: None,
                                message: format!(
                                    "same method and path as route `{}`",
                                    up.routes[other].name
                                ),
                            });
                        }
                        list.push(ri);
                    }
                    None => templates.push((r.path.clone(), vec![ri])),
                }
            }
            for (t, list) in templates {
                if let Err(e) = router.insert(t.clone(), list.clone()) {
                    issues.push(Issue {
                        path: format!("upstreams[{ui}].routes[{}].match.path", list[0]),
                        line: None,
                        message: format!("path template `{t}` cannot be used: {e}"),
                    });
                }
            }
            routers.push(router);
        }
        if !issues.is_empty() {
            return Err(issues);
        }
        mounts.sort_by_key(|m| std::cmp::Reverse(m.0.len()));
        Ok(RouteTable { mounts, routers })
    }

    /// Classify one request. `path` is the request path without query, as received.
    pub fn classify<'a>(
        &self,
        upstreams: &'a [Upstream],
        unmatched: Unmatched,
        method: &Method,
        path: &str,
    ) -> Classified<'a> {
        let path = match path::normalise(path) {
            Ok(p) => p,
            Err(bad) => return Classified::BadPath(bad),
        };
        let Some((mount, ui)) = self.mounts.iter().find(|(m, _)| {
            path.strip_prefix(m.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        }) else {
            return Classified::NoUpstream;
        };
        let upstream = &upstreams[*ui];
        let rel = &path[mount.len()..];
        let mut rel_path = if rel.is_empty() {
            "/".to_string()
        } else {
            rel.to_string()
        };
        let declared = |rel_path: &str| {
            let m = self.routers[*ui].at(rel_path).ok()?;
            let ri = m.value.iter().copied().find(|&ri| {
                upstream.routes[ri].method.as_ref().is_none_or(|rm| {
                    rm == method || (*method == Method::HEAD && *rm == Method::GET)
                })
            })?;
            let params: Vec<(String, String)> = m
                .params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Some((ri, params))
        };
        // A trailing slash does not make another route: `/send/` is the route `/send`
        // (and `/send` the route `/send/`), spelt as the template is when forwarded.
        let mut hit = declared(&rel_path);
        if hit.is_none() && rel_path.len() > 1 {
            let toggled = match rel_path.strip_suffix('/') {
                Some(stripped) => stripped.to_string(),
                None => format!("{rel_path}/"),
            };
            hit = declared(&toggled);
            if hit.is_some() {
                rel_path = toggled;
            }
        }
        if let Some((ri, params)) = hit {
            return Classified::Matched(Target {
                upstream_index: *ui,
                upstream,
                route_ref: RouteRef::Declared(ri),
                route: &upstream.routes[ri],
                rel_path,
                params,
            });
        }
        // An MCP upstream has no HTTP routes: its requests are judged by `proxy::mcp`.
        if unmatched == Unmatched::Reject && upstream.mcp.is_none() {
            return Classified::Unmatched { upstream };
        }
        let read_only = matches!(
            *method,
            Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
        );
        let (route_ref, route) = if read_only {
            (RouteRef::FallbackReadOnly, &upstream.fallback_read_only)
        } else {
            (RouteRef::FallbackSideEffect, &upstream.fallback_side_effect)
        };
        debug_assert_eq!(route.class == Class::ReadOnly, read_only);
        Classified::Matched(Target {
            upstream_index: *ui,
            upstream,
            route_ref,
            route,
            rel_path,
            params: Vec::new(),
        })
    }
}

fn display_mount(m: &str) -> &str {
    if m.is_empty() {
        "/"
    } else {
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_yaml;
    use std::path::Path;

    const YAML: &str = r#"
upstreams:
  - name: mail
    url: http://127.0.0.1:9001/api
    mount: /mail
    routes:
      - { name: send_email, match: { method: POST, path: /send } }
      - { name: get_message, match: { method: GET, path: "/messages/{id}" }, class: read_only }
      - { name: search, match: { method: POST, path: /search }, class: read_only }
  - name: pay
    url: https://pay.example.com
    mount: /
    routes: []
"#;

    fn classify<'a>(cfg: &'a crate::config::Config, m: Method, p: &str) -> Classified<'a> {
        cfg.routes.classify(&cfg.upstreams, cfg.unmatched, &m, p)
    }

    #[test]
    fn matches_routes_params_and_mounts() {
        let cfg = from_yaml(YAML, Path::new("t.yaml")).expect("valid");
        match classify(&cfg, Method::GET, "/mail/messages/m1") {
            Classified::Matched(t) => {
                assert_eq!(t.route.name, "get_message");
                assert_eq!(t.params, vec![("id".into(), "m1".into())]);
                assert_eq!(t.rel_path, "/messages/m1");
            }
            other => panic!("{other:?}"),
        }
        match classify(&cfg, Method::POST, "/mail/search") {
            Classified::Matched(t) => assert_eq!(t.route.class, Class::ReadOnly),
            other => panic!("{other:?}"),
        }
        // `/mailbox` is not under `/mail`: it falls to the `/` mount.
        match classify(&cfg, Method::POST, "/mailbox") {
            Classified::Matched(t) => {
                assert_eq!(t.upstream.name, "pay");
                assert_eq!(t.route_ref, RouteRef::FallbackSideEffect);
            }
            other => panic!("{other:?}"),
        }
        match classify(&cfg, Method::GET, "/mail/send") {
            Classified::Matched(t) => assert_eq!(t.route_ref, RouteRef::FallbackReadOnly),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn routes_match_the_normalised_path_spelt_as_their_template() {
        let yaml = YAML.replace(
            "      - { name: search,",
            "      - { name: dir, match: { method: POST, path: /dir/ } }\n      - { name: search,",
        );
        let cfg = from_yaml(&yaml, Path::new("t.yaml")).expect("valid");
        for (path, route, rel) in [
            ("/mail/send", "send_email", "/send"),
            ("/mail/send/", "send_email", "/send"),
            ("/mail//send//", "send_email", "/send"),
            ("/x/../mail/./%73end", "send_email", "/send"),
            ("/mail/dir", "dir", "/dir/"),
            ("/mail/dir/", "dir", "/dir/"),
        ] {
            match classify(&cfg, Method::POST, path) {
                Classified::Matched(t) => {
                    assert_eq!(
                        (t.route.name.as_str(), t.rel_path.as_str()),
                        (route, rel),
                        "{path}"
                    )
                }
                other => panic!("{path}: {other:?}"),
            }
        }
        match classify(&cfg, Method::GET, "/mail/messages/%6d1/") {
            Classified::Matched(t) => {
                assert_eq!(t.route.name, "get_message");
                assert_eq!(t.params, vec![("id".into(), "m1".into())]);
                assert_eq!(t.rel_path, "/messages/m1");
            }
            other => panic!("{other:?}"),
        }
        // Undeclared paths keep their (normalised) spelling, trailing slash included.
        match classify(&cfg, Method::POST, "/mail/other//") {
            Classified::Matched(t) => assert_eq!(t.rel_path, "/other/"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            classify(&cfg, Method::POST, "/mail/s%zz"),
            Classified::BadPath(_)
        ));
    }

    #[test]
    fn reject_mode_and_no_upstream() {
        let yaml = YAML
            .replace("upstreams:", "unmatched: reject\nupstreams:")
            .replace("    mount: /\n", "    mount: /pay\n");
        let cfg = from_yaml(&yaml, Path::new("t.yaml")).expect("valid");
        assert!(matches!(
            classify(&cfg, Method::POST, "/mail/other"),
            Classified::Unmatched { .. }
        ));
        assert!(matches!(
            classify(&cfg, Method::POST, "/nothing"),
            Classified::NoUpstream
        ));
    }

    #[test]
    fn duplicate_method_and_path_is_a_config_error() {
        let yaml = r#"
upstreams:
  - name: a
    url: http://127.0.0.1:1
    routes:
      - { name: one, match: { method: POST, path: /x } }
      - { name: two, match: { method: POST, path: /x } }
"#;
        let err = from_yaml(yaml, Path::new("dup.yaml")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(
                "dup.yaml: upstreams[0].routes[1].match: same method and path as route `one`"
            ),
            "{text}"
        );
    }
}
