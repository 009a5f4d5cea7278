//! redb store (placeholder).
