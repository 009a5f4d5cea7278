//! The execution state machine (SPEC section 5). [`transition`] is the only place that
//! decides whether a state may follow another; [`crate::store::Record::apply`] is the only
//! code that writes a record's state, and it goes through here. An illegal move is an
//! error, never a silent overwrite: a delivery failure can never turn `committed` into
//! `failed_before_commit`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where one execution stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Intent recorded; nothing sent.
    Prepared,
    /// Waiting for an operator to approve these exact arguments.
    AwaitingApproval,
    /// Approved for (execution_id, args_hash); not yet sent.
    Approved,
    /// Durably marked before the first byte goes downstream; owned by a lease.
    Executing,
    /// The downstream's answer is stored; replays return it.
    Committed,
    /// The committed answer reached the client at least once.
    ResultDelivered,
    /// An operator refused the call; it will never be sent.
    Rejected,
    /// Known not to have reached the downstream (or the downstream said so): may run again.
    FailedBeforeCommit,
    /// The request may or may not have taken effect: reconcile before anything is re-sent.
    OutcomeUnknown,
    /// The parent operation was cancelled before this call was sent.
    CancelledBeforeCommit,
}

impl State {
    pub const ALL: [State; 10] = [
        State::Prepared,
        State::AwaitingApproval,
        State::Approved,
        State::Executing,
        State::Committed,
        State::ResultDelivered,
        State::Rejected,
        State::FailedBeforeCommit,
        State::OutcomeUnknown,
        State::CancelledBeforeCommit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Prepared => "prepared",
            State::AwaitingApproval => "awaiting_approval",
            State::Approved => "approved",
            State::Executing => "executing",
            State::Committed => "committed",
            State::ResultDelivered => "result_delivered",
            State::Rejected => "rejected",
            State::FailedBeforeCommit => "failed_before_commit",
            State::OutcomeUnknown => "outcome_unknown",
            State::CancelledBeforeCommit => "cancelled_before_commit",
        }
    }

    /// A stored result exists and is the answer to every retry.
    pub fn has_result(self) -> bool {
        matches!(self, State::Committed | State::ResultDelivered)
    }

    /// Stable small integer for on-disk indexes (never reorder).
    pub fn code(self) -> u8 {
        match self {
            State::Prepared => 0,
            State::AwaitingApproval => 1,
            State::Approved => 2,
            State::Executing => 3,
            State::Committed => 4,
            State::ResultDelivered => 5,
            State::Rejected => 6,
            State::FailedBeforeCommit => 7,
            State::OutcomeUnknown => 8,
            State::CancelledBeforeCommit => 9,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for State {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<_> = State::ALL.iter().map(|s| s.as_str()).collect();
                format!(
                    "unknown status `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// What happened to an execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The route needs an approval before anything is sent.
    RequestApproval,
    /// An operator approved (execution_id, args_hash).
    Approve,
    /// An operator rejected the call.
    Reject,
    /// The proxy is about to send the request downstream.
    Start,
    /// The downstream answered and the answer counts as the committed result.
    Commit,
    /// The committed answer was written to the client.
    Deliver,
    /// Failure known to precede any effect (connect/TLS error, or `on_5xx: failed_before_commit`).
    FailBeforeCommit,
    /// Connection lost / timeout after sending, or the owning instance died.
    LoseOutcome,
    /// Reconciliation or an operator established that the effect happened.
    ResolveCommitted,
    /// Reconciliation or an operator established that the effect did not happen.
    ResolveNotCommitted,
    /// Re-send under the same downstream key to a downstream that replays keyed requests.
    Resend,
    /// The parent operation was cancelled.
    Cancel,
    /// The approval no longer covers the call (it expired, or the record holds none for
    /// its arguments): an operator must approve again before anything is sent.
    ApprovalLapsed,
    /// A verified webhook event correlated to the call says its effect happened (SPEC
    /// section 9.1): the event is the evidence, and its data is the stored answer.
    SettleByWebhook,
}

impl Event {
    pub fn as_str(self) -> &'static str {
        match self {
            Event::RequestApproval => "request_approval",
            Event::Approve => "approve",
            Event::Reject => "reject",
            Event::Start => "start",
            Event::Commit => "commit",
            Event::Deliver => "deliver",
            Event::FailBeforeCommit => "fail_before_commit",
            Event::LoseOutcome => "lose_outcome",
            Event::ResolveCommitted => "resolve_committed",
            Event::ResolveNotCommitted => "resolve_not_committed",
            Event::Resend => "resend",
            Event::Cancel => "cancel",
            Event::ApprovalLapsed => "approval_lapsed",
            Event::SettleByWebhook => "settle_by_webhook",
        }
    }
}

/// A move the state machine does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition: `{event}` is not allowed in state `{from}`", event = .event.as_str())]
pub struct IllegalTransition {
    pub from: State,
    pub event: Event,
}

/// The one transition function. Every legal (state, event) pair is listed; everything
/// else is an [`IllegalTransition`].
pub fn transition(from: State, event: Event) -> Result<State, IllegalTransition> {
    use Event as E;
    use State as S;
    let to = match (from, event) {
        (S::Prepared, E::RequestApproval) => S::AwaitingApproval,
        (S::AwaitingApproval, E::Approve) => S::Approved,
        (S::Prepared | S::AwaitingApproval | S::Approved, E::Reject) => S::Rejected,
        // A failed attempt may run again under the same identity (and the same approval).
        (S::Prepared | S::Approved | S::FailedBeforeCommit, E::Start) => S::Executing,
        (S::Executing, E::Commit) => S::Committed,
        (S::Committed, E::Deliver) => S::ResultDelivered,
        (S::Executing, E::FailBeforeCommit) => S::FailedBeforeCommit,
        (S::Executing, E::LoseOutcome) => S::OutcomeUnknown,
        (S::OutcomeUnknown, E::ResolveCommitted) => S::Committed,
        // Only an unknown outcome is settled by an event: a decided record keeps its answer
        // (a `committed` record's stored result is history), and an executing one is still
        // owned by the attempt that will learn the answer itself.
        (S::OutcomeUnknown, E::SettleByWebhook) => S::Committed,
        (S::OutcomeUnknown, E::ResolveNotCommitted) => S::FailedBeforeCommit,
        // Only safe when the downstream dedups keyed requests; policy decides, see reconcile.
        (S::OutcomeUnknown, E::Resend) => S::Executing,
        (S::Prepared | S::AwaitingApproval | S::Approved | S::FailedBeforeCommit, E::Cancel) => {
            S::CancelledBeforeCommit
        }
        // Nothing was sent under the lapsed approval (an approved call that failed before
        // commit also qualifies): ask again rather than run on a stale decision.
        (S::Approved | S::FailedBeforeCommit, E::ApprovalLapsed) => S::AwaitingApproval,
        (from, event) => return Err(IllegalTransition { from, event }),
    };
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVENTS: [Event; 14] = [
        Event::RequestApproval,
        Event::Approve,
        Event::Reject,
        Event::Start,
        Event::Commit,
        Event::Deliver,
        Event::FailBeforeCommit,
        Event::LoseOutcome,
        Event::ResolveCommitted,
        Event::ResolveNotCommitted,
        Event::Resend,
        Event::Cancel,
        Event::ApprovalLapsed,
        Event::SettleByWebhook,
    ];

    /// The full table, written independently of `transition` so the test can fail.
    fn expected(from: State, ev: Event) -> Option<State> {
        use Event as E;
        use State as S;
        let table: &[(S, E, S)] = &[
            (S::Prepared, E::RequestApproval, S::AwaitingApproval),
            (S::Prepared, E::Reject, S::Rejected),
            (S::Prepared, E::Start, S::Executing),
            (S::Prepared, E::Cancel, S::CancelledBeforeCommit),
            (S::AwaitingApproval, E::Approve, S::Approved),
            (S::AwaitingApproval, E::Reject, S::Rejected),
            (S::AwaitingApproval, E::Cancel, S::CancelledBeforeCommit),
            (S::Approved, E::Reject, S::Rejected),
            (S::Approved, E::Start, S::Executing),
            (S::Approved, E::Cancel, S::CancelledBeforeCommit),
            (S::Approved, E::ApprovalLapsed, S::AwaitingApproval),
            (S::Executing, E::Commit, S::Committed),
            (S::Executing, E::FailBeforeCommit, S::FailedBeforeCommit),
            (S::Executing, E::LoseOutcome, S::OutcomeUnknown),
            (S::Committed, E::Deliver, S::ResultDelivered),
            (S::FailedBeforeCommit, E::Start, S::Executing),
            (S::FailedBeforeCommit, E::Cancel, S::CancelledBeforeCommit),
            (
                S::FailedBeforeCommit,
                E::ApprovalLapsed,
                S::AwaitingApproval,
            ),
            (S::OutcomeUnknown, E::ResolveCommitted, S::Committed),
            (
                S::OutcomeUnknown,
                E::ResolveNotCommitted,
                S::FailedBeforeCommit,
            ),
            (S::OutcomeUnknown, E::Resend, S::Executing),
            (S::OutcomeUnknown, E::SettleByWebhook, S::Committed),
        ];
        table
            .iter()
            .find(|(f, e, _)| *f == from && *e == ev)
            .map(|(_, _, t)| *t)
    }

    #[test]
    fn every_pair_matches_the_table() {
        let mut legal = 0;
        for from in State::ALL {
            for ev in EVENTS {
                match (transition(from, ev), expected(from, ev)) {
                    (Ok(to), Some(want)) => {
                        assert_eq!(to, want, "{from} --{}-->", ev.as_str());
                        legal += 1;
                    }
                    (Err(e), None) => assert_eq!(e, IllegalTransition { from, event: ev }),
                    (got, want) => panic!("{from} --{}--> got {got:?}, want {want:?}", ev.as_str()),
                }
            }
        }
        assert_eq!(legal, 22);
    }

    #[test]
    fn committed_is_never_overwritten_by_a_failure() {
        for ev in [
            Event::FailBeforeCommit,
            Event::LoseOutcome,
            Event::Cancel,
            Event::Start,
        ] {
            assert!(transition(State::Committed, ev).is_err());
            assert!(transition(State::ResultDelivered, ev).is_err());
        }
    }

    #[test]
    fn a_lapsed_approval_never_reopens_a_sent_call() {
        // Only calls known not to have reached the downstream go back to approval.
        for from in [
            State::Executing,
            State::OutcomeUnknown,
            State::Committed,
            State::ResultDelivered,
            State::Rejected,
            State::CancelledBeforeCommit,
        ] {
            assert!(transition(from, Event::ApprovalLapsed).is_err(), "{from}");
        }
        let again = transition(State::Approved, Event::ApprovalLapsed);
        assert_eq!(again, Ok(State::AwaitingApproval));
        assert_eq!(
            again.and_then(|s| transition(s, Event::Approve)),
            Ok(State::Approved)
        );
    }

    #[test]
    fn outcome_unknown_never_becomes_failed_silently() {
        // Only an explicit resolution may move it; a plain retry (`Start`) may not.
        assert!(transition(State::OutcomeUnknown, Event::Start).is_err());
        assert!(transition(State::OutcomeUnknown, Event::FailBeforeCommit).is_err());
    }

    #[test]
    fn a_webhook_settles_only_an_unknown_outcome() {
        for from in State::ALL {
            let got = transition(from, Event::SettleByWebhook);
            if from == State::OutcomeUnknown {
                assert_eq!(got, Ok(State::Committed));
            } else {
                assert!(got.is_err(), "{from}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>(), Ok(s));
            let json = serde_json::to_string(&s).expect("state serializes");
            assert_eq!(json, format!("\"{}\"", s.as_str()));
        }
        assert!("done".parse::<State>().is_err());
        let mut codes: Vec<u8> = State::ALL.iter().map(|s| s.code()).collect();
        codes.dedup();
        assert_eq!(codes.len(), State::ALL.len());
    }
}
