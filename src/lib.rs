//! idemproxy: a forward idempotency proxy.
//!
//! The module tree is the architecture:
//! - [`wire`]: bytes on the network (hyper server, pooled rustls client, header hygiene,
//!   problem+json answers);
//! - [`policy`]: decisions (route classification, identity, fingerprint, state machine,
//!   reconciliation);
//! - [`store`]: durable execution records behind one trait (redb, PostgreSQL);
//! - [`proxy`]: the request lifecycle that ties the three together;
//! - [`config`]: the YAML contract, validated once into the form the hot path uses;
//! - [`admin`]: the operator surface (admin API, console, metrics) on its own listener.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod config;
pub mod failpoint;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod store;
pub mod wire;
