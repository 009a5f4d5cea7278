//! Wire plumbing: how bytes move. The hyper server and pooled rustls client, header
//! hygiene, the one body type, and RFC 9457 problem answers. No policy lives here.

pub mod body;
pub mod client;
pub mod fast;
pub mod framing;
pub mod h1;
pub mod headers;
pub mod problem;
pub mod raw;
pub mod server;
