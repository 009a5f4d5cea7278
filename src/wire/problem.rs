//! RFC 9457 problem details: every error the proxy itself answers is one of these, with
//! `type` = `urn:idemproxy:problem:NAME`. The mapping from a problem name to its HTTP status
//! lives here and nowhere else.

use http::{HeaderName, HeaderValue, Response, StatusCode};
use serde_json::{json, Map, Value};

use super::body::{full, ProxyBody};
use crate::policy::identity::ExecutionId;

/// The problems the proxy answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    KeyMissing,
    KeyInvalid,
    KeyMismatch,
    InFlight,
    OutcomeUnknown,
    OutcomeUnknownTimeout,
    /// A retry of an execution whose outcome is still unknown (409, not re-sent).
    OutcomeUnknownPending,
    BodyTooLarge,
    /// A JSON body with a repeated object member name: the proxy's reading and the
    /// downstream's could differ.
    BodyAmbiguous,
    ResponseTooLarge,
    ApprovalRequired,
    Rejected,
    Cancelled,
    UpstreamUnavailable,
    UpstreamTimeout,
    NoRoute,
    RouteUnmatched,
    StoreUnavailable,
    BadRequest,
    Unauthorized,
    /// An admin token without the scope an endpoint needs.
    Forbidden,
    NotFound,
    MethodNotAllowed,
    Conflict,
    /// An approval named arguments other than the execution's own.
    ApprovalMismatch,
    /// A request framed in a way the proxy cannot pass on (a transfer coding other than
    /// `chunked`).
    NotImplemented,
    /// The client sent its request too slowly (`timeouts.client_body`).
    RequestTimeout,
    /// A webhook delivery whose signature is missing, wrong or outside the tolerance: 401,
    /// nothing recorded or forwarded (SPEC section 9.1).
    WebhookSignature,
    /// A batch body without an array at `batch.items`, or an item without its key (400).
    BatchInvalid,
    /// More items than `batch.max_items` (413).
    BatchTooLarge,
    /// Two items of one batch with the same item key (422).
    BatchDuplicateItem,
    Internal,
}

impl Kind {
    /// What a request body that could not be read means: the client was too slow (408),
    /// else it framed the body wrongly (400).
    pub fn of_request_body_error(e: &(dyn std::error::Error + 'static)) -> Kind {
        if super::body::caused_by::<super::body::TimedOut>(e) {
            Kind::RequestTimeout
        } else {
            Kind::BadRequest
        }
    }

    /// What a failed upstream exchange means for its client: the client's own request
    /// body failed it (408 or 400, [`Kind::of_request_body_error`]), else the upstream
    /// did (502).
    pub fn of_send_error(e: &(dyn std::error::Error + 'static)) -> Kind {
        if super::body::caused_by::<super::body::TimedOut>(e) {
            Kind::RequestTimeout
        } else if super::body::caused_by::<super::body::ClientBody>(e) {
            Kind::BadRequest
        } else {
            Kind::UpstreamUnavailable
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::KeyMissing => "key-missing",
            Kind::KeyInvalid => "key-invalid",
            Kind::KeyMismatch => "key-mismatch",
            Kind::InFlight => "in-flight",
            Kind::OutcomeUnknown | Kind::OutcomeUnknownTimeout | Kind::OutcomeUnknownPending => {
                "outcome-unknown"
            }
            Kind::BodyTooLarge => "body-too-large",
            Kind::BodyAmbiguous => "body-ambiguous",
            Kind::ResponseTooLarge => "response-too-large",
            Kind::ApprovalRequired => "approval-required",
            Kind::Rejected => "rejected",
            Kind::Cancelled => "cancelled",
            Kind::UpstreamUnavailable => "upstream-unavailable",
            Kind::UpstreamTimeout => "upstream-timeout",
            Kind::NoRoute => "no-route",
            Kind::RouteUnmatched => "route-unmatched",
            Kind::StoreUnavailable => "store-unavailable",
            Kind::BadRequest => "bad-request",
            Kind::Unauthorized => "unauthorized",
            Kind::Forbidden => "forbidden",
            Kind::NotFound => "not-found",
            Kind::MethodNotAllowed => "method-not-allowed",
            Kind::Conflict => "conflict",
            Kind::ApprovalMismatch => "approval-mismatch",
            Kind::NotImplemented => "not-implemented",
            Kind::RequestTimeout => "request-timeout",
            Kind::WebhookSignature => "webhook-signature",
            Kind::BatchInvalid => "batch-invalid",
            Kind::BatchTooLarge => "batch-too-large",
            Kind::BatchDuplicateItem => "batch-duplicate-item",
            Kind::Internal => "internal",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Kind::KeyMissing
            | Kind::KeyInvalid
            | Kind::BodyAmbiguous
            | Kind::BadRequest
            | Kind::BatchInvalid => StatusCode::BAD_REQUEST,
            Kind::KeyMismatch | Kind::BatchDuplicateItem => StatusCode::UNPROCESSABLE_ENTITY,
            Kind::InFlight
            | Kind::Cancelled
            | Kind::Conflict
            | Kind::ApprovalMismatch
            | Kind::OutcomeUnknownPending => StatusCode::CONFLICT,
            Kind::OutcomeUnknown | Kind::UpstreamUnavailable | Kind::ResponseTooLarge => {
                StatusCode::BAD_GATEWAY
            }
            Kind::OutcomeUnknownTimeout | Kind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Kind::BodyTooLarge | Kind::BatchTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::ApprovalRequired => StatusCode::PRECONDITION_REQUIRED,
            Kind::Rejected | Kind::Forbidden => StatusCode::FORBIDDEN,
            Kind::NoRoute | Kind::RouteUnmatched | Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Kind::Unauthorized | Kind::WebhookSignature => StatusCode::UNAUTHORIZED,
            Kind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Kind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            Kind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Kind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn title(self) -> &'static str {
        match self {
            Kind::KeyMissing => "Idempotency key missing",
            Kind::KeyInvalid => "Idempotency key invalid",
            Kind::KeyMismatch => "Idempotency key reused with different arguments",
            Kind::InFlight => "Execution in flight",
            Kind::OutcomeUnknown | Kind::OutcomeUnknownTimeout | Kind::OutcomeUnknownPending => {
                "Outcome unknown"
            }
            Kind::BodyTooLarge => "Request body too large",
            Kind::BodyAmbiguous => "Request body is ambiguous",
            Kind::ResponseTooLarge => "Upstream response too large",
            Kind::ApprovalRequired => "Approval required",
            Kind::Rejected => "Execution rejected",
            Kind::Cancelled => "Operation cancelled",
            Kind::UpstreamUnavailable => "Upstream unavailable",
            Kind::UpstreamTimeout => "Upstream timed out",
            Kind::NoRoute => "No upstream for this path",
            Kind::RouteUnmatched => "No route matches",
            Kind::StoreUnavailable => "Execution store unavailable",
            Kind::BadRequest => "Bad request",
            Kind::Unauthorized => "Unauthorized",
            Kind::Forbidden => "Forbidden",
            Kind::NotFound => "Not found",
            Kind::MethodNotAllowed => "Method not allowed",
            Kind::Conflict => "Conflict",
            Kind::ApprovalMismatch => "Approval does not match the execution's arguments",
            Kind::NotImplemented => "Not implemented",
            Kind::RequestTimeout => "Request timed out",
            Kind::WebhookSignature => "Webhook signature not verified",
            Kind::BatchInvalid => "Batch items not found",
            Kind::BatchTooLarge => "Batch has too many items",
            Kind::BatchDuplicateItem => "Batch item key repeated",
            Kind::Internal => "Internal error",
        }
    }
}

/// One problem answer under construction.
#[derive(Debug)]
pub struct Problem {
    pub kind: Kind,
    pub detail: String,
    pub execution_id: Option<ExecutionId>,
    pub extra: Map<String, Value>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Problem {
    pub fn new(kind: Kind, detail: impl Into<String>) -> Problem {
        Problem {
            kind,
            detail: detail.into(),
            execution_id: None,
            extra: Map::new(),
            headers: Vec::new(),
        }
    }

    pub fn execution(mut self, id: &ExecutionId) -> Problem {
        self.execution_id = Some(id.clone());
        self
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Problem {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Problem {
        self.headers.push((name, value));
        self
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.kind.status();
        let mut body = json!({
            "type": format!("urn:idemproxy:problem:{}", self.kind.name()),
            "title": self.kind.title(),
            "status": status.as_u16(),
            "detail": self.detail,
        });
        let obj = body.as_object_mut().expect("built as an object above");
        if let Some(id) = &self.execution_id {
            obj.insert("execution_id".into(), Value::String(id.to_string()));
        }
        obj.extend(self.extra);
        let bytes = serde_json::to_vec(&body).expect("JSON values always serialize");
        let mut resp = Response::new(full(bytes));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        );
        if let Some(id) = &self.execution_id {
            if let Ok(v) = HeaderValue::from_str(id.as_str()) {
                h.insert(super::headers::EXECUTION_ID, v);
            }
        }
        for (name, value) in self.headers {
            h.insert(name, value);
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn renders_rfc9457() {
        let resp = Problem::new(Kind::KeyMismatch, "different arguments")
            .execution(&ExecutionId("ex_1".into()))
            .with("args_hash", "ab")
            .into_response();
        assert_eq!(resp.status(), 422);
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
        assert_eq!(resp.headers()["idempotency-execution-id"], "ex_1");
        let body = resp
            .into_body()
            .collect()
            .await
            .expect("full body")
            .to_bytes();
        let v: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["type"], "urn:idemproxy:problem:key-mismatch");
        assert_eq!(v["status"], 422);
        assert_eq!(v["execution_id"], "ex_1");
        assert_eq!(v["args_hash"], "ab");
    }
}
