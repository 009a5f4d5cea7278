//! The request path as routes are matched on it (SPEC section 4): one spelling per
//! resource, so `/mail/send`, `/mail//send`, `/mail/./send`, `/mail/x/../send` and
//! `/mail/%73end` are one route and one execution, never five. The normalised path is
//! also what goes downstream: the proxy never forwards one path while having matched
//! another.
//!
//! The rules (docs/IDENTITY.md, "Paths"):
//! 1. percent-encoded unreserved characters (RFC 3986 §2.3: `A-Z a-z 0-9 - . _ ~`) are
//!    decoded, and every other percent-encoding is written with upper-case hex digits
//!    (§6.2.2.1, §6.2.2.2); a `%` not followed by two hex digits is refused;
//! 2. runs of `/` become one `/`;
//! 3. dot segments are removed (§5.2.4; `..` above the root stays at the root).
//!
//! Trailing slashes are not removed here: whether `/send/` is the route `/send` is the
//! route table's decision (`policy::classify`), made against the route's template.

use std::borrow::Cow;

/// Why a path cannot be normalised; the request is refused with 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadPath(pub &'static str);

/// The normal form of `path` (an origin-form path without its query), borrowed when the
/// path is already in normal form, which is every path a well-behaved client sends.
pub fn normalise(path: &str) -> Result<Cow<'_, str>, BadPath> {
    if !path.starts_with('/') {
        // `*` (OPTIONS) and the like name no resource under a mount; left as they are.
        return Ok(Cow::Borrowed(path));
    }
    if is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    Ok(Cow::Owned(remove_dot_segments(&decoded)))
}

/// Whether `p` is in normal form. Every request pays this, so the common case is a scan
/// eight bytes at a time: a path with no `%`, no `//` and no `/.` is normal; only the
/// others are looked at closely ([`is_normal_slow`]). The word test may flag a byte that
/// is not one of those (the zero-byte trick's borrow), never miss one: a flag only sends
/// the path to the exact test.
fn is_normal(p: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of every byte of `x` that may equal `b` (every byte that does is set).
    let eq = |x: u64, b: u8| {
        let v = x ^ (ONES * u64::from(b));
        v.wrapping_sub(ONES) & !v & HIGH
    };
    // The high bit of byte 0 when the previous word ended in `/`.
    let mut carry = 0u64;
    let mut words = p.chunks_exact(8);
    for word in &mut words {
        let Ok(bytes) = <[u8; 8]>::try_from(word) else {
            return is_normal_slow(p);
        };
        let x = u64::from_le_bytes(bytes);
        let slash = eq(x, b'/');
        let pair = ((slash << 8) | carry) & (slash | eq(x, b'.'));
        if eq(x, b'%') | pair != 0 {
            return is_normal_slow(p);
        }
        carry = slash >> 56;
    }
    let mut prev = if carry != 0 { b'/' } else { 0 };
    for &c in words.remainder() {
        if c == b'%' || (prev == b'/' && (c == b'/' || c == b'.')) {
            return is_normal_slow(p);
        }
        prev = c;
    }
    true
}

/// No `%` but upper-case escapes of reserved characters, no `//`, and no `.` or `..`
/// segment (a `.` that starts a name, as in `/.well-known`, is a name).
fn is_normal_slow(p: &[u8]) -> bool {
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            b'%' => {
                // Normal: two upper-case hex digits of a character that is not unreserved.
                let upper =
                    |b: Option<&u8>| b.is_some_and(|b| matches!(b, b'0'..=b'9' | b'A'..=b'F'));
                if !(upper(p.get(i + 1)) && upper(p.get(i + 2))) {
                    return false;
                }
                let byte = hex(p[i + 1]).unwrap_or(0) << 4 | hex(p[i + 2]).unwrap_or(0);
                if unreserved(byte) {
                    return false;
                }
                i += 3;
                continue;
            }
            b'/' => {
                let rest = &p[i + 1..];
                if rest.first() == Some(&b'/')
                    || rest == b"."
                    || rest.starts_with(b"./")
                    || rest == b".."
                    || rest.starts_with(b"../")
                {
                    return false;
                }
            }
            _ => {}
        }
        i += 1;
    }
    true
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Rule 1: decode `%XX` of unreserved characters, upper-case the rest.
fn decode_unreserved(path: &str) -> Result<String, BadPath> {
    let p = path.as_bytes();
    let mut out = Vec::with_capacity(p.len());
    let mut i = 0;
    while i < p.len() {
        if p[i] != b'%' {
            out.push(p[i]);
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            p.get(i + 1).copied().and_then(hex),
            p.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(BadPath(
                "a `%` in the path is not followed by two hex digits",
            ));
        };
        let byte = hi << 4 | lo;
        if unreserved(byte) {
            out.push(byte);
        } else {
            out.extend_from_slice(&[
                b'%',
                b"0123456789ABCDEF"[usize::from(hi)],
                b"0123456789ABCDEF"[usize::from(lo)],
            ]);
        }
        i += 3;
    }
    // Only ASCII was written in place of escapes; every other byte is the input's own, so
    // the result is UTF-8 whenever the input was.
    String::from_utf8(out).map_err(|_| BadPath("the path is not UTF-8"))
}

/// Rules 2 and 3 on a path that starts with `/`: segments split on `/` (empty ones, from
/// repeated slashes, dropped), `.` dropped, `..` pops one. A path that ended in `/` (or in
/// a dot segment, which names a directory) keeps one trailing `/`.
fn remove_dot_segments(path: &str) -> String {
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing = false;
    for seg in path.split('/').skip(1) {
        trailing = false;
        match seg {
            "" => trailing = true,
            "." => trailing = true,
            ".." => {
                segments.pop();
                trailing = true;
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if trailing || out.is_empty() {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> String {
        normalise(p).expect("valid").into_owned()
    }

    #[test]
    fn variants_of_one_path_are_one_path() {
        for p in [
            "/mail/send",
            "/mail//send",
            "//mail///send",
            "/mail/./send",
            "/mail/x/../send",
            "/mail/%73end",
            "/mail/%73%65%6E%64",
            "/%6d%61%69%6c/send",
            "/mail/x/y/../../send",
            "/../mail/send",
            "/mail/%2e/send",
            "/mail/x/%2E%2E/send",
        ] {
            assert_eq!(n(p), "/mail/send", "{p}");
        }
    }

    #[test]
    fn trailing_slashes_and_roots() {
        assert_eq!(n("/mail/send/"), "/mail/send/");
        assert_eq!(n("/mail/send//"), "/mail/send/");
        assert_eq!(n("/mail/send/."), "/mail/send/");
        assert_eq!(n("/mail/send/x/.."), "/mail/send/");
        assert_eq!(n("/"), "/");
        assert_eq!(n("//"), "/");
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/./"), "/");
    }

    #[test]
    fn reserved_encodings_stay_encoded_in_upper_case() {
        assert_eq!(n("/mail%2fsend"), "/mail%2Fsend");
        assert_eq!(n("/a%20b"), "/a%20b");
        assert_eq!(n("/caf%c3%a9"), "/caf%C3%A9");
        assert_eq!(n("/a%2E%2Fb"), "/a.%2Fb");
        assert_eq!(n("/caf\u{e9}/%41"), "/caf\u{e9}/A");
    }

    #[test]
    fn dots_inside_names_are_names() {
        for p in ["/a/.b", "/a/..b", "/a/b.", "/a/...", "/v1.2/x"] {
            assert!(matches!(normalise(p), Ok(Cow::Borrowed(_))), "{p}");
        }
    }

    #[test]
    fn normal_paths_are_borrowed() {
        for p in [
            "/",
            "/mail/send",
            "/mail/send/",
            "/a-b_c~d/e.f",
            "*",
            "/a%2Fb%C3%A9",
        ] {
            assert!(matches!(normalise(p), Ok(Cow::Borrowed(_))), "{p}");
        }
    }

    #[test]
    fn broken_percent_encodings_are_refused() {
        for p in ["/a%", "/a%2", "/a%zz", "/a%g0/b"] {
            assert!(normalise(p).is_err(), "{p}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2048, ..Default::default() })]

        /// The word-at-a-time scan never calls a path normal that the exact test does not.
        #[test]
        fn the_fast_scan_agrees_with_the_exact_test(p in "/[a/.%0-9A-F~]{0,40}") {
            proptest::prop_assert_eq!(is_normal(p.as_bytes()), is_normal_slow(p.as_bytes()), "{}", p);
        }
    }

    #[test]
    fn normalising_is_idempotent() {
        for p in [
            "/a//b/../c/./d/",
            "/%7e%41/%2f",
            "/x/%2e%2e/%2e%2e/y",
            "/a/b/c/../../..//..",
        ] {
            let once = n(p);
            assert_eq!(n(&once), once, "{p}");
            assert!(matches!(normalise(&once), Ok(Cow::Borrowed(_))), "{p}");
        }
    }
}
