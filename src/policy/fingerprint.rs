//! Canonical request fingerprint (args_hash). Placeholder until implemented.
