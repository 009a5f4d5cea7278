//! Everything the admin API can refuse, and its one mapping to RFC 9457 problems. Handlers
//! return [`AdminError`]; only [`AdminError::into_problem`] decides kinds and statuses.

use http::HeaderValue;

use super::actions::ActionError;
use crate::store::StoreError;
use crate::wire::problem::{Kind, Problem};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("this endpoint needs `Authorization: Bearer <token>` with an admin token (the value of a variable admin.token_env or admin.tokens names)")]
    Unauthorized,
    #[error(
        "the admin token `{token}` may not {what}: that needs a token with the `{needs}` scope"
    )]
    Forbidden {
        token: String,
        needs: &'static str,
        what: &'static str,
    },
    #[error("{0}")]
    BadRequest(String),
    /// A query parameter the endpoint does not take, or a value it cannot use: the
    /// problem names it (`parameter`).
    #[error("query parameter `{name}`: {why}")]
    BadParameter { name: String, why: String },
    #[error("the request body is larger than {0} bytes")]
    BodyTooLarge(usize),
    #[error("the client sent no more of the request body within timeouts.client_body")]
    RequestTimeout,
    #[error("no such endpoint: {0}")]
    NoEndpoint(String),
    #[error("{path} accepts {allow} only")]
    MethodNotAllowed { path: String, allow: &'static str },
    #[error(transparent)]
    Action(#[from] ActionError),
}

impl From<StoreError> for AdminError {
    fn from(e: StoreError) -> Self {
        AdminError::Action(ActionError::Store(e))
    }
}

impl AdminError {
    pub fn into_problem(self) -> Problem {
        let detail = self.to_string();
        match self {
            AdminError::Unauthorized => Problem::new(Kind::Unauthorized, detail).header(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemproxy-admin\""),
            ),
            AdminError::Forbidden { needs, .. } => {
                Problem::new(Kind::Forbidden, detail).with("scope", needs)
            }
            AdminError::BadRequest(_) => Problem::new(Kind::BadRequest, detail),
            AdminError::BadParameter { name, .. } => {
                Problem::new(Kind::BadRequest, detail).with("parameter", name)
            }
            AdminError::BodyTooLarge(_) => Problem::new(Kind::BodyTooLarge, detail),
            AdminError::RequestTimeout => Problem::new(Kind::RequestTimeout, detail),
            AdminError::NoEndpoint(_) => Problem::new(Kind::NotFound, detail),
            AdminError::MethodNotAllowed { allow, .. } => {
                Problem::new(Kind::MethodNotAllowed, detail)
                    .header(http::header::ALLOW, HeaderValue::from_static(allow))
            }
            AdminError::Action(a) => match a {
                ActionError::NotFound(id) => Problem::new(Kind::NotFound, detail).execution(&id),
                ActionError::WrongState { id, illegal, .. } => Problem::new(Kind::Conflict, detail)
                    .execution(&id)
                    .with("state", illegal.from.as_str()),
                ActionError::ApprovalMismatch { id, actual, .. } => {
                    Problem::new(Kind::ApprovalMismatch, detail)
                        .execution(&id)
                        .with("args_hash", actual.as_str())
                }
                ActionError::Contended(id) => Problem::new(Kind::Conflict, detail)
                    .execution(&id)
                    .header(http::header::RETRY_AFTER, HeaderValue::from_static("1")),
                ActionError::Store(StoreError::Corrupt { .. }) => {
                    Problem::new(Kind::Internal, detail)
                }
                ActionError::Store(StoreError::NotFound(id)) => {
                    Problem::new(Kind::NotFound, detail).execution(&id)
                }
                ActionError::Store(_) => Problem::new(Kind::StoreUnavailable, detail),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::identity::{ArgsHash, ExecutionId};
    use crate::policy::state::{Event, IllegalTransition, State};

    #[test]
    fn statuses() {
        let id = ExecutionId("ex_1".into());
        let cases: Vec<(AdminError, u16)> = vec![
            (AdminError::Unauthorized, 401),
            (
                AdminError::Forbidden {
                    token: "viewer".into(),
                    needs: "approve",
                    what: "approve calls",
                },
                403,
            ),
            (AdminError::BadRequest("x".into()), 400),
            (AdminError::BodyTooLarge(1), 413),
            (AdminError::RequestTimeout, 408),
            (AdminError::NoEndpoint("/x".into()), 404),
            (
                AdminError::MethodNotAllowed {
                    path: "/x".into(),
                    allow: "GET",
                },
                405,
            ),
            (ActionError::NotFound(id.clone()).into(), 404),
            (
                ActionError::WrongState {
                    id: id.clone(),
                    illegal: IllegalTransition {
                        from: State::Committed,
                        event: Event::Approve,
                    },
                    action: "approve",
                }
                .into(),
                409,
            ),
            (
                ActionError::ApprovalMismatch {
                    id: id.clone(),
                    given: "a".into(),
                    actual: ArgsHash("b".into()),
                }
                .into(),
                409,
            ),
            (ActionError::Contended(id).into(), 409),
            (StoreError::Backend("down".into()).into(), 503),
        ];
        for (e, status) in cases {
            let text = e.to_string();
            assert_eq!(e.into_problem().kind.status().as_u16(), status, "{text}");
        }
    }
}
