//! The admin bearer token. It is read once from the environment variable the config
//! names (never from the file), kept only as a SHA-256 digest, and compared in constant
//! time: both sides are hashed first, so neither the content nor the length of the secret
//! leaks through timing.

use http::header::AUTHORIZATION;
use http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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
        let mut values = headers.get_all(AUTHORIZATION).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return false;
        };
        let Some(presented) = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
        else {
            return false;
        };
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        digest.ct_eq(&self.digest).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
