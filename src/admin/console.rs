//! The operator console: one HTML page, a script and a style sheet, compiled into the
//! binary (no build step, nothing fetched from elsewhere). The page holds no data; it asks
//! for the admin token, keeps it in `sessionStorage` and calls the admin API with it.

use http::{header, HeaderValue, Response};

use crate::wire::body::{full, ProxyBody};

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// Scripts and styles only from this origin, no framing, no inline code: preview values
/// come from agents and are shown as text, and this policy is the second line behind that.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One of the console's files (the router only passes names it knows).
pub fn serve(file: &str) -> Response<ProxyBody> {
    if file == "favicon.ico" {
        // The console has no icon; answered so a browser's own request for one is not a
        // 401 (the page's console would report it as an error).
        let mut resp = Response::new(full(""));
        *resp.status_mut() = http::StatusCode::NO_CONTENT;
        return resp;
    }
    let (body, content_type) = match file {
        "console.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "console.css" => (STYLE, "text/css; charset=utf-8"),
        _ => (INDEX, "text/html; charset=utf-8"),
    };
    let mut resp = Response::new(full(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}
