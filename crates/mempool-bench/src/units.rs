//! Sizes with binary units (`64KiB`, `1.5GiB`, `max`), and their display.

use std::fmt;

/// A size that cannot be parsed, with what is accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad size `{text}`: expected a byte count with an optional unit (B, KiB, MiB, GiB, TiB; KB, MB, GB, TB are read as the binary units too), e.g. 4096, 64KiB, 1.5GiB, or `max`")]
pub struct SizeError {
    /// The text as given.
    pub(crate) text: String,
}

/// Parses a byte count: a number (decimal fractions allowed) with an optional binary unit, or `max`
/// (`u64::MAX`). Units are case-insensitive; `K`, `M`, `G`, `T` alone mean KiB, MiB, GiB, TiB.
///
/// ```
/// use mempool_bench::units::parse_size;
/// assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
/// assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
/// assert_eq!(parse_size("max").unwrap(), u64::MAX);
/// assert!(parse_size("12 parsecs").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let err = || SizeError { text: text.to_owned() };
    let t = text.trim();
    if t.eq_ignore_ascii_case("max") {
        return Ok(u64::MAX);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    if num.is_empty() {
        return Err(err());
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(err()),
    };
    if let Ok(whole) = num.parse::<u64>() {
        return whole.checked_mul(1u64 << shift).ok_or_else(err);
    }
    let v: f64 = num.parse().map_err(|_| err())?;
    let bytes = v * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 || bytes.fract() != 0.0 {
        return Err(err());
    }
    Ok(bytes as u64)
}

/// Displays a byte count with the largest binary unit that divides it exactly (`64KiB`, `1GiB`,
/// `1000B`), or `max` for `u64::MAX`; round-trips through [`parse_size`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b == u64::MAX {
            return f.write_str("max");
        }
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b != 0 && b.is_multiple_of(1u64 << shift) {
                return write!(f, "{}{unit}", b >> shift);
            }
        }
        write!(f, "{b}B")
    }
}

/// A byte count for people: three significant digits and a binary unit (`1.50 GiB`, `812 KiB`).
pub(crate) fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < units.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else if v >= 100.0 {
        format!("{v:.0} {}", units[u])
    } else if v >= 10.0 {
        format!("{v:.1} {}", units[u])
    } else {
        format!("{v:.2} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_display() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("64KiB", 64 << 10),
            ("64kb", 64 << 10),
            ("1M", 1 << 20),
            ("16GiB", 16 << 30),
            ("0.5KiB", 512),
            ("1_000", 1000),
            ("MAX", u64::MAX),
        ] {
            assert_eq!(parse_size(text).unwrap(), bytes, "{text}");
        }
        for bad in ["", "KiB", "1.2.3", "-1", "12 parsecs", "0.3B", "99999999999TiB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains("64KiB"), "{e}");
        }
        assert_eq!(Size(64 << 10).to_string(), "64KiB");
        assert_eq!(Size(3 << 29).to_string(), "1536MiB");
        assert_eq!(Size(1000).to_string(), "1000B");
        assert_eq!(Size(u64::MAX).to_string(), "max");
        assert_eq!(human_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(human_bytes(100), "100 B");
    }
}
