//! Marks on parent operations (SPEC section 8). Cancelling an operation stores a mark;
//! the proxy refuses to send anything more under a marked operation, and the mark records
//! whether a side effect had already been committed (`cancelled_after_side_effect`), which
//! no cancellation can undo. The execution records themselves are never rewritten to say so.

use serde::{Deserialize, Serialize};

/// What is known about a cancelled operation. Ordered: a mark only ever moves forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperationState {
    /// Cancelled; no call of it is known to have committed.
    Cancelled,
    /// Cancelled after at least one call of it committed: that effect happened and stays
    /// (compensation is a new execution with its own key).
    CancelledAfterSideEffect,
}

impl OperationState {
    pub fn as_str(self) -> &'static str {
        match self {
            OperationState::Cancelled => "cancelled",
            OperationState::CancelledAfterSideEffect => "cancelled_after_side_effect",
        }
    }

    pub fn parse(s: &str) -> Option<OperationState> {
        [
            OperationState::Cancelled,
            OperationState::CancelledAfterSideEffect,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }
}

/// One operation's mark as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationMark {
    pub operation_id: String,
    pub state: OperationState,
    /// Who cancelled first (operator-supplied name, never a credential).
    pub by: String,
    pub cancelled_at_ms: i64,
    pub updated_at_ms: i64,
    /// Retention: the mark may be deleted after this instant.
    pub expires_at_ms: i64,
}

impl OperationMark {
    /// `incoming` written over `self` (what is stored): the state never moves back, the
    /// first cancellation keeps its author and time, retention only grows. Every store
    /// applies exactly this rule atomically in [`crate::store::Store::mark_operation`].
    pub fn merge(self, incoming: OperationMark) -> OperationMark {
        OperationMark {
            state: self.state.max(incoming.state),
            updated_at_ms: self.updated_at_ms.max(incoming.updated_at_ms),
            expires_at_ms: self.expires_at_ms.max(incoming.expires_at_ms),
            ..self
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a mark always serializes: all fields are plain data")
    }

    pub fn from_bytes(id: &str, bytes: &[u8]) -> Result<OperationMark, super::StoreError> {
        serde_json::from_slice(bytes).map_err(|e| super::StoreError::Corrupt {
            id: id.to_string(),
            reason: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(state: OperationState, by: &str, at: i64, expires: i64) -> OperationMark {
        OperationMark {
            operation_id: "op".into(),
            state,
            by: by.into(),
            cancelled_at_ms: at,
            updated_at_ms: at,
            expires_at_ms: expires,
        }
    }

    #[test]
    fn merge_only_moves_forward() {
        let first = mark(OperationState::CancelledAfterSideEffect, "alice", 10, 100);
        let later = mark(OperationState::Cancelled, "bob", 20, 50);
        let m = first.clone().merge(later);
        assert_eq!(m.state, OperationState::CancelledAfterSideEffect);
        assert_eq!((m.by.as_str(), m.cancelled_at_ms), ("alice", 10));
        assert_eq!((m.updated_at_ms, m.expires_at_ms), (20, 100));

        let up = mark(OperationState::Cancelled, "alice", 10, 100).merge(mark(
            OperationState::CancelledAfterSideEffect,
            "x",
            30,
            200,
        ));
        assert_eq!(up.state, OperationState::CancelledAfterSideEffect);
        assert_eq!((up.by.as_str(), up.expires_at_ms), ("alice", 200));
    }

    #[test]
    fn names_round_trip() {
        for s in [
            OperationState::Cancelled,
            OperationState::CancelledAfterSideEffect,
        ] {
            assert_eq!(OperationState::parse(s.as_str()), Some(s));
            assert_eq!(
                serde_json::to_string(&s).expect("serializes"),
                format!("\"{}\"", s.as_str())
            );
        }
    }
}
