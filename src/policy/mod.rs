//! Policy: what the proxy decides about a request, independent of how bytes move.
//! Classification (route table), identity, fingerprint, the execution state machine and
//! reconciliation each live in their own module.

pub mod batch;
pub mod classify;
pub mod fingerprint;
pub mod identity;
pub mod job;
pub mod mcp;
pub mod path;
pub mod reconcile;
pub mod state;
pub mod webhook;
