//! Sizes and the statistics of the tables: medians, means, percentiles, the best column.

pub(crate) const KIB: usize = 1 << 10;
pub(crate) const MIB: usize = 1 << 20;

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

pub(crate) fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

pub(crate) fn human(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

pub(crate) fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// The best of `columns` (name, value) by `pick` (`f64::max` for rates, `f64::min` for times),
/// leaving out those not measured (NaN).
pub(crate) fn best_of<'a>(
    columns: impl IntoIterator<Item = (&'a str, f64)>,
    pick: fn(f64, f64) -> f64,
) -> (&'a str, f64) {
    columns
        .into_iter()
        .filter(|(_, v)| v.is_finite())
        .reduce(|a, b| if pick(a.1, b.1) == b.1 && b.1 != a.1 { b } else { a })
        .unwrap_or(("none", f64::NAN))
}
