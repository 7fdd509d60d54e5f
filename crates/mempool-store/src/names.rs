//! Buffer names and tags: the rules, checked by both sides (the client before it sends, the
//! server on everything it receives).

use super::error::{Error, Result};

/// The longest name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// The longest tag, in bytes.
pub const MAX_TAG_LEN: usize = 256;

/// Checks a buffer name: 1 to [`MAX_NAME_LEN`] bytes of `A-Z a-z 0-9 . _ / -`, not starting with
/// `/`, with no `..` in it. Returns [`Error::BadName`] naming the rule broken.
///
/// ```
/// use mempool_store::validate_name;
/// assert!(validate_name("llama-70b/layer.0").is_ok());
/// assert!(validate_name("/abs").is_err());
/// assert!(validate_name("a/../b").is_err());
/// assert!(validate_name("").is_err());
/// ```
pub fn validate_name(name: &str) -> Result<()> {
    check_name_bytes(name.as_bytes())
}

/// [`validate_name`] on raw bytes (what the server receives).
pub(crate) fn check_name_bytes(name: &[u8]) -> Result<()> {
    let bad = |rule| Error::BadName {
        name: String::from_utf8_lossy(name).into_owned(),
        rule,
    };
    if name.is_empty() {
        return Err(bad("a name must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad("a name must be at most 128 bytes long"));
    }
    if !name
        .iter()
        .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-'))
    {
        return Err(bad("a name may hold only A-Z, a-z, 0-9, '.', '_', '/' and '-'"));
    }
    if name[0] == b'/' {
        return Err(bad("a name must not start with '/'"));
    }
    if name.windows(2).any(|w| w == b"..") {
        return Err(bad("a name must not contain '..'"));
    }
    Ok(())
}

/// Checks a tag: at most [`MAX_TAG_LEN`] bytes of UTF-8 (any characters).
pub(crate) fn check_tag(tag: &str) -> Result<()> {
    if tag.len() > MAX_TAG_LEN {
        return Err(Error::BadTag {
            len: tag.len(),
            max: MAX_TAG_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn good_names_pass() {
        for name in ["a", "A.b_c-d/e", "model/layer.0/w", "x.", "a/b/", "0", &"n".repeat(128)] {
            validate_name(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn each_rule_is_named() {
        let rule = |name: &str| match validate_name(name) {
            Err(Error::BadName { rule, .. }) => rule,
            other => panic!("{name:?}: {other:?}"),
        };
        assert!(rule("").contains("empty"));
        assert!(rule(&"n".repeat(129)).contains("128"));
        assert!(rule("a b").contains("only"));
        assert!(rule("é").contains("only"));
        assert!(rule("a\0").contains("only"));
        assert!(rule("/a").contains("start"));
        assert!(rule("..").contains(".."));
        assert!(rule("a/../b").contains(".."));
        assert!(rule("a..b").contains(".."));
    }

    #[test]
    fn tags_are_bounded() {
        assert!(check_tag("").is_ok());
        assert!(check_tag(&"t".repeat(256)).is_ok());
        assert!(matches!(
            check_tag(&"t".repeat(257)),
            Err(Error::BadTag { len: 257, max: 256 })
        ));
    }

    proptest! {
        #[test]
        fn validation_matches_the_rule(bytes in proptest::collection::vec(any::<u8>(), 0..140)) {
            let allowed = |b: u8| b.is_ascii_alphanumeric() || b"._/-".contains(&b);
            let expected = !bytes.is_empty()
                && bytes.len() <= 128
                && bytes.iter().all(|&b| allowed(b))
                && bytes[0] != b'/'
                && !bytes.windows(2).any(|w| w == b"..");
            prop_assert_eq!(check_name_bytes(&bytes).is_ok(), expected);
        }
    }
}
