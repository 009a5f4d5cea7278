//! Canonical request fingerprint (args_hash). Placeholder until implemented.
#[derive(Clone, Debug, Default)]
pub struct FingerprintSpec {
    pub ignore_json: Vec<String>,
    pub headers: Vec<http::HeaderName>,
}
pub fn validate_pointer(p: &str) -> Result<(), String> {
    if p.is_empty() || p.starts_with('/') { Ok(()) } else { Err(format!("`{p}` is not a JSON pointer")) }
}
