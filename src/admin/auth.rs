//! The admin bearer tokens. Each is read once from the environment variable the config
//! names (never from the file), kept only as a SHA-256 digest, and compared in constant
//! time: both sides are hashed first, so neither the content nor the length of a secret
//! leaks through timing, and every token is compared, so neither does which one matched.
//! A token has a name (recorded with every decision it makes) and scopes (what it may do).

use http::header::AUTHORIZATION;
use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::AdminToken;

/// Shorter secrets are accepted with a warning; they are guessable.
const RECOMMENDED_MIN_BYTES: usize = 16;

/// Why no token could be read.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error(
        "admin.token_env names the environment variable {0}, but it is not set: set it to a \
         long random secret (e.g. `export {0}=$(openssl rand -hex 32)`) or remove the \
         `admin` block to run without the admin listener"
    )]
    Unset(String),
    #[error("the environment variable {0} (admin.token_env) is empty; the admin token must be a long random secret")]
    Empty(String),
    #[error("the environment variable {0} (admin.token_env) is not valid UTF-8")]
    NotUnicode(String),
    #[error(
        "admin tokens `{0}` and `{1}` have the same secret: a request could not tell which \
         of them made a decision; give each its own"
    )]
    Shared(String, String),
    #[error(
        "admin.notify.secret_env names the environment variable {0}, but {1}: set it to the \
         receiver's signing secret, `whsec_` + base64 (Standard Webhooks)"
    )]
    NotifySecret(String, &'static str),
}

/// The signing secret of `admin.notify`, read once from its variable: `whsec_` + base64.
pub fn notify_secret(var: &str) -> Result<Vec<u8>, TokenError> {
    let value = match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v,
        Ok(_) => return Err(TokenError::NotifySecret(var.into(), "it is empty")),
        Err(_) => return Err(TokenError::NotifySecret(var.into(), "it is not set")),
    };
    if !value.trim().starts_with("whsec_") {
        return Err(TokenError::NotifySecret(
            var.into(),
            "its value does not start with `whsec_`",
        ));
    }
    crate::policy::webhook::secret(&crate::policy::webhook::Scheme::StandardWebhooks, &value)
        .map_err(|_| TokenError::NotifySecret(var.into(), "its value is not base64 after `whsec_`"))
}

/// The admin tokens of a config: who a request is, and what it may do.
#[derive(Clone, Debug)]
pub struct Tokens {
    tokens: Vec<(AdminToken, Token)>,
}

impl Tokens {
    /// Read every token's secret from its environment variable; refuses an unset or empty
    /// variable, and two tokens with one secret.
    pub fn from_env(specs: &[AdminToken]) -> Result<Tokens, TokenError> {
        let mut tokens: Vec<(AdminToken, Token)> = Vec::with_capacity(specs.len());
        for spec in specs {
            let token = Token::from_env(&spec.token_env)?;
            if let Some((other, _)) = tokens.iter().find(|(_, t)| t.digest == token.digest) {
                return Err(TokenError::Shared(other.name.clone(), spec.name.clone()));
            }
            tokens.push((spec.clone(), token));
        }
        Ok(Tokens { tokens })
    }

    /// Tokens with known secrets (tests, the demo).
    pub fn new(tokens: Vec<(AdminToken, &str)>) -> Tokens {
        Tokens {
            tokens: tokens
                .into_iter()
                .map(|(spec, secret)| (spec, Token::new(secret)))
                .collect(),
        }
    }

    /// The token the request's `Authorization: Bearer` names, if any. Every token is
    /// compared in constant time, whichever matches (secrets are unique, so at most one).
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<&AdminToken> {
        let presented = presented_digest(headers)?;
        let mut found = None;
        for (spec, token) in &self.tokens {
            if bool::from(presented.ct_eq(&token.digest)) {
                found = Some(spec);
            }
        }
        found
    }
}

/// The SHA-256 of the bearer token a request presents (exactly one `Authorization`
/// header, scheme matched case-insensitively).
fn presented_digest(headers: &HeaderMap) -> Option<[u8; 32]> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())?;
    Some(Sha256::digest(presented.as_bytes()).into())
}

/// The expected token, as a digest. `Debug` shows nothing of it.
#[derive(Clone)]
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    pub fn new(secret: &str) -> Token {
        Token {
            digest: Sha256::digest(secret.as_bytes()).into(),
        }
    }

    /// Read the token from `var`; refuses an unset or empty variable.
    pub fn from_env(var: &str) -> Result<Token, TokenError> {
        let secret = match std::env::var(var) {
            Ok(s) => s,
            Err(std::env::VarError::NotPresent) => return Err(TokenError::Unset(var.into())),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(TokenError::NotUnicode(var.into()))
            }
        };
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(TokenError::Empty(var.into()));
        }
        if secret.len() < RECOMMENDED_MIN_BYTES {
            tracing::warn!(
                env = var,
                "the admin token is shorter than {RECOMMENDED_MIN_BYTES} bytes; use a long random secret"
            );
        }
        Ok(Token::new(secret))
    }

    /// Whether the request carries `Authorization: Bearer <token>` (scheme matched
    /// case-insensitively, exactly one Authorization header).
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        presented_digest(headers).is_some_and(|d| d.ct_eq(&self.digest).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scope;
    use http::HeaderValue;

    fn headers(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn admits_only_the_exact_bearer_token() {
        let t = Token::new("s3cret-token-0123456789");
        assert!(t.admits(&headers(&["Bearer s3cret-token-0123456789"])));
        assert!(t.admits(&headers(&["bearer s3cret-token-0123456789"])));
        for bad in [
            "Bearer s3cret-token-012345678",
            "Bearer s3cret-token-01234567890",
            "Basic s3cret-token-0123456789",
            "s3cret-token-0123456789",
            "Bearer",
            "Bearer ",
        ] {
            assert!(!t.admits(&headers(&[bad])), "{bad:?} must be refused");
        }
        assert!(!t.admits(&HeaderMap::new()));
        assert!(
            !t.admits(&headers(&[
                "Bearer s3cret-token-0123456789",
                "Bearer s3cret-token-0123456789"
            ])),
            "two Authorization headers are ambiguous"
        );
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let t = Token::new("do-not-print-me");
        assert_eq!(format!("{t:?}"), "Token(..)");
    }

    #[test]
    fn unset_and_empty_variables_are_refused() {
        let unset = "IDEMPROXY_TEST_SURELY_UNSET_TOKEN_VAR";
        let err = Token::from_env(unset).expect_err("unset");
        assert!(err.to_string().contains(unset), "{err}");
    }

    fn spec(name: &str, scopes: &[Scope]) -> AdminToken {
        AdminToken {
            name: name.into(),
            token_env: format!("{}_TOKEN", name.to_uppercase()),
            scopes: scopes.to_vec(),
        }
    }

    #[test]
    fn named_tokens_say_who_asked_and_what_they_may_do() {
        let tokens = Tokens::new(vec![
            (spec("admin", &[Scope::Admin]), "admin-secret-0123456789"),
            (spec("viewer", &[Scope::View]), "viewer-secret-0123456789"),
            (spec("stop", &[Scope::Cancel]), "stop-secret-0123456789"),
        ]);
        let who = |v: &'static str| tokens.authenticate(&headers(&[v])).map(|t| t.name.clone());
        assert_eq!(
            who("Bearer viewer-secret-0123456789").as_deref(),
            Some("viewer")
        );
        assert_eq!(
            who("Bearer stop-secret-0123456789").as_deref(),
            Some("stop")
        );
        assert_eq!(
            who("Bearer admin-secret-0123456789").as_deref(),
            Some("admin")
        );
        assert_eq!(who("Bearer nobody-0123456789"), None);
        assert_eq!(
            tokens.authenticate(&HeaderMap::new()).map(|t| &t.name),
            None
        );
        let viewer = spec("viewer", &[Scope::View]);
        assert!(viewer.allows(Scope::View));
        assert!(!viewer.allows(Scope::Approve));
        let admin = spec("admin", &[Scope::Admin]);
        for s in Scope::ALL {
            assert!(admin.allows(s), "{s:?}");
        }
    }
}
