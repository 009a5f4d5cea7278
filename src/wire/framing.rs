//! Message framing: how a body is delimited on the wire, decided here and nowhere else.
//!
//! - **An upstream answer is framed by its reader** (RFC 9112 section 6.3): no body for
//!   `HEAD`, 1xx, 204 and 304; `Transfer-Encoding` wins over `Content-Length` (and a
//!   connection that sent both is not used again); then `Content-Length`; else the body
//!   runs to the connection's end. [`answer`] is that decision for the hand-written client
//!   (`wire::h1`); hyper's client (every `https://` upstream, `Http1Pool`) makes the same
//!   one (hyper's `Client::decoder`); `tests/framing.rs` holds every client path to it.
//! - **An upstream's framing fields never cross the proxy.** `Transfer-Encoding` is
//!   hop-by-hop ([`super::headers::strip_hop_by_hop`]); `Content-Length` goes with it when
//!   both came ([`super::headers::strip_hop_by_hop`] removes it then), and a stored answer
//!   keeps neither ([`is_framing_name`]: `proxy::downstream::stored_headers` when one is
//!   stored, `proxy::replay::response_head` when stored fields become an answer, so records
//!   stored before this rule replay safely too). The writer that sends an answer (hyper's
//!   server, or `wire::fast`'s `encode_head`) frames it from its body: a known length is
//!   `Content-Length`, an unknown one chunked. An answer's `Content-Length` survives only
//!   where it is the only framing the answer had and its body was read by it (so the two
//!   agree), or where there is no body to frame (`HEAD`, 304).
//! - **Values are read strictly**, as hyper reads them: a `Content-Length` is digits only
//!   (no sign, no spaces inside), a list of them only if all are equal ([`content_length`]).

/// How an upstream answer's body is delimited ([`answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (`HEAD`, 204, 304).
    Empty,
    Length(u64),
    Chunked,
    /// The body runs to the connection's end.
    UntilClose,
}

/// Whether a field named `name` (any case) frames a message: `Content-Length` or
/// `Transfer-Encoding`. Neither is stored nor replayed: the writer frames from the body.
pub fn is_framing_name(name: &[u8]) -> bool {
    match name.len() {
        14 => name.eq_ignore_ascii_case(b"content-length"),
        17 => name.eq_ignore_ascii_case(b"transfer-encoding"),
        _ => false,
    }
}

/// A `Content-Length` value as hyper's client reads it: `1*DIGIT`, or a comma list of
/// equal such values (RFC 9110 section 8.6), blanks around each; `None` for anything else
/// (`+36`, `-1`, `0x10`, `3 4`, an empty value, a value past `u64`).
pub fn content_length(value: &[u8]) -> Option<u64> {
    let mut found: Option<u64> = None;
    for part in value.split(|b| *b == b',') {
        let n = digits(part.trim_ascii())?;
        if found.is_some_and(|f| f != n) {
            return None;
        }
        found = Some(n);
    }
    found
}

/// `1*DIGIT` as a number; `None` for anything else or a number past `u64`.
pub fn digits(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 20 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The framing of an upstream answer with status `status` to a request that was `HEAD`
/// when `is_head`, whose `Content-Length` (already checked equal if repeated) is
/// `length` and whose last transfer coding is `chunked` when `transfer_encoding` is
/// `Some(true)` (`Some(false)`: another coding). Also: whether the connection may carry
/// another request after it (as far as framing goes), and whether the answer's
/// `Content-Length` fields must be dropped (they came with a `Transfer-Encoding`).
pub fn answer(
    is_head: bool,
    status: u16,
    length: Option<u64>,
    transfer_encoding: Option<bool>,
) -> Answer {
    if is_head || status == 204 || status == 304 || (100..200).contains(&status) {
        return Answer {
            framing: Framing::Empty,
            reusable: true,
            drop_length: false,
        };
    }
    match (transfer_encoding, length) {
        // Both: the transfer coding wins and the connection is not trusted again.
        (Some(chunked), l) => Answer {
            framing: if chunked {
                Framing::Chunked
            } else {
                Framing::UntilClose
            },
            reusable: chunked && l.is_none(),
            drop_length: l.is_some(),
        },
        (None, Some(n)) => Answer {
            framing: Framing::Length(n),
            reusable: true,
            drop_length: false,
        },
        (None, None) => Answer {
            framing: Framing::UntilClose,
            reusable: false,
            drop_length: false,
        },
    }
}

/// What [`answer`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub framing: Framing,
    /// Framing allows another request on the connection after this answer.
    pub reusable: bool,
    /// The answer's `Content-Length` fields go (a `Transfer-Encoding` came too).
    pub drop_length: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_lengths_are_digits_or_lists_of_equal_digits() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b"36"), Some(36));
        assert_eq!(content_length(b" 36 "), Some(36));
        assert_eq!(content_length(b"36, 36"), Some(36));
        for bad in [
            &b""[..],
            b"+36",
            b"-1",
            b"0x10",
            b"3 6",
            b"36, 37",
            b"36,",
            b",",
            b"99999999999999999999",
            b"18446744073709551616",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(content_length(b"18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn transfer_encoding_wins_and_the_connection_is_not_reused() {
        let both = answer(false, 200, Some(3), Some(true));
        assert_eq!(both.framing, Framing::Chunked);
        assert!(both.drop_length && !both.reusable);
        let chunked = answer(false, 200, None, Some(true));
        assert_eq!(chunked.framing, Framing::Chunked);
        assert!(!chunked.drop_length && chunked.reusable);
        assert_eq!(
            answer(false, 200, None, Some(false)).framing,
            Framing::UntilClose
        );
        assert_eq!(
            answer(false, 200, Some(5), None).framing,
            Framing::Length(5)
        );
        assert_eq!(answer(true, 200, Some(5), None).framing, Framing::Empty);
        assert_eq!(answer(false, 304, Some(5), None).framing, Framing::Empty);
        assert_eq!(answer(false, 204, None, Some(true)).framing, Framing::Empty);
        let until_close = answer(false, 200, None, None);
        assert_eq!(until_close.framing, Framing::UntilClose);
        assert!(!until_close.reusable);
    }

    #[test]
    fn framing_names_in_any_case() {
        for n in ["content-length", "Content-Length", "TRANSFER-ENCODING"] {
            assert!(is_framing_name(n.as_bytes()), "{n}");
        }
        for n in ["content-type", "transfer-encodings", "te", "trailer"] {
            assert!(!is_framing_name(n.as_bytes()), "{n}");
        }
    }
}
