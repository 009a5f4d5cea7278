//! Header hygiene for a forward proxy: hop-by-hop headers (RFC 9110 section 7.6.1) never
//! cross the proxy in either direction, and the downstream sees `Host`, `X-Forwarded-*`
//! the way a well-behaved reverse proxy sets them.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

pub const EXECUTION_ID: &str = "idempotency-execution-id";
pub const REPLAYED: &str = "idempotent-replayed";
pub const STATUS: &str = "idempotency-status";
/// On a result that came from a reconciliation lookup rather than the original answer.
pub const RECONCILED: &str = "idempotency-reconciled";

const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Remove hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Most messages carry none: one pass over the names is cheaper than the nine hashed
    // removals below (they showed in the pass-through profile).
    if !h.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named.iter().chain(HOP_BY_HOP.iter()) {
        h.remove(n);
    }
    h.remove(header::UPGRADE);
}

pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name == header::UPGRADE
}

/// Set the headers a downstream expects from a proxy: `Host` is the upstream's authority
/// (APIs route on it), the original host goes to `X-Forwarded-Host`, the client address is
/// appended to `X-Forwarded-For`.
pub fn set_forwarded(
    h: &mut HeaderMap,
    upstream_host: &HeaderValue,
    client: SocketAddr,
    original_host: Option<HeaderValue>,
) {
    if let Some(host) = original_host {
        h.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    h.insert(header::HOST, upstream_host.clone());
    let mut ip = [0u8; 39];
    let ip = ip_text(client.ip(), &mut ip);
    let xff = HeaderName::from_static("x-forwarded-for");
    let value = match h.get(&xff).map(HeaderValue::as_bytes) {
        Some(prev) if !prev.is_empty() => HeaderValue::from_bytes(&[prev, b", ", ip].concat()),
        _ => HeaderValue::from_bytes(ip),
    };
    if let Ok(v) = value {
        h.insert(xff, v);
    }
    h.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
}

/// `ip` as text in `buf`, without a heap string per forwarded request. 39 bytes hold the
/// longest text form of an IPv6 address.
fn ip_text(ip: std::net::IpAddr, buf: &mut [u8; 39]) -> &[u8] {
    use std::io::Write;
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cursor, "{ip}");
    let n = cursor.position() as usize;
    &buf[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn forwarded_headers_append() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        set_forwarded(
            &mut h,
            &HeaderValue::from_static("api.example.com"),
            "127.0.0.9:5".parse().expect("addr"),
            Some(HeaderValue::from_static("proxy:8080")),
        );
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h["host"], "api.example.com");
        assert_eq!(h["x-forwarded-host"], "proxy:8080");
    }

    #[test]
    fn client_addresses_are_written_as_text() {
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.20.30.40",
            "255.255.255.255",
            "192.168.100.9",
            "::1",
            "2001:db8:85a3::8a2e:370:7334",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let addr: std::net::IpAddr = ip.parse().expect("ip");
            let mut buf = [0u8; 39];
            assert_eq!(ip_text(addr, &mut buf), ip.as_bytes());
        }
    }
}
