//! Execution identity: who a call belongs to (tenant), what logical action it is (scoped
//! key → `ExecutionId`), and what exactly it asked for (`ArgsHash`). Types, not strings, so
//! a tenant hash can never be passed where an execution id is expected.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Stable, URL-safe id of one logical execution, derived from the scoped key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExecutionId(pub String);

/// SHA-256 (lower-case hex) of the canonical request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ArgsHash(pub String);

/// SHA-256 (lower-case hex) of the tenant credential header values.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantScope(pub String);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl $t {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
    )*};
}
display_inner!(ExecutionId, ArgsHash, TenantScope);
