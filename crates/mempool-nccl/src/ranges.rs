//! The bookkeeping of registration that follows a pool, apart from NCCL so that host tests drive it: the
//! mapped address ranges of each tag ([`RangeSet`], coalesced), and the plan ([`plan`]) that turns the
//! registrations held into one registration per maximal mapped run.
//!
//! Why one per maximal run: NCCL looks a collective's buffer up in its registration cache
//! (`ncclRegFind`, src/include/register_inline.h) and uses a registration only when one entry covers
//! the whole buffer (`data + size <= reg->endAddr` of a single slot); a buffer that spans two
//! registrations is treated as unregistered. A pool that grows maps chunks next to mapped ones, and a
//! buffer allocated after the growth may lie across both, so adjacent runs are merged into one
//! registration, and a run cut by an unmapping is re-registered as the pieces that stay mapped.

/// A half-open address range `start..end`.
pub(crate) type Span = (u64, u64);

/// Disjoint, sorted, coalesced ranges: two ranges that touch are one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RangeSet {
    spans: Vec<Span>,
}

impl RangeSet {
    /// The ranges, in address order.
    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Whether it holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Adds `start..end`, merging it with every range it overlaps or touches.
    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        // The first range that ends at or after `start` (it may touch or overlap).
        let lo = self.spans.partition_point(|&(_, e)| e < start);
        // One past the last range that starts at or before `end`.
        let hi = self.spans.partition_point(|&(s, _)| s <= end);
        let (mut s, mut e) = (start, end);
        if lo < hi {
            s = s.min(self.spans[lo].0);
            e = e.max(self.spans[hi - 1].1);
        }
        self.spans.splice(lo..hi, [(s, e)]);
    }

    /// Removes `start..end`, cutting the ranges it overlaps.
    pub(crate) fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut out = Vec::with_capacity(self.spans.len() + 1);
        for &(s, e) in &self.spans {
            if e <= start || s >= end {
                out.push((s, e));
                continue;
            }
            if s < start {
                out.push((s, start));
            }
            if e > end {
                out.push((end, e));
            }
        }
        self.spans = out;
    }
}

/// What to do to make the registrations held equal to the wanted ones: deregister every held span that
/// is not wanted exactly (stale: it covers memory no longer mapped, or a piece of a run that grew), then
/// register every wanted span not held, except those that failed before (`failed`: not retried until
/// the run changes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Held spans to deregister, in address order.
    pub(crate) deregister: Vec<Span>,
    /// Wanted spans to register, in address order.
    pub(crate) register: Vec<Span>,
}

impl Plan {
    /// Whether nothing needs doing.
    pub(crate) fn is_empty(&self) -> bool {
        self.deregister.is_empty() && self.register.is_empty()
    }
}

/// The plan that takes `held` (the registered spans, any order) to `wanted` (the maximal mapped runs).
pub(crate) fn plan(wanted: &[Span], held: &[Span], failed: &[Span]) -> Plan {
    let mut deregister: Vec<Span> = held.iter().copied().filter(|h| !wanted.contains(h)).collect();
    deregister.sort_unstable();
    let register = wanted
        .iter()
        .copied()
        .filter(|w| !held.contains(w) && !failed.contains(w))
        .collect();
    Plan { deregister, register }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 2 << 20;

    fn set(spans: &[Span]) -> RangeSet {
        let mut s = RangeSet::default();
        for &(a, b) in spans {
            s.insert(a, b);
        }
        s
    }

    #[test]
    fn touching_and_overlapping_ranges_coalesce() {
        let mut s = RangeSet::default();
        s.insert(0, C);
        s.insert(2 * C, 3 * C);
        assert_eq!(s.spans(), [(0, C), (2 * C, 3 * C)], "a hole keeps them apart");
        s.insert(C, 2 * C);
        assert_eq!(s.spans(), [(0, 3 * C)], "filling the hole joins all three");
        s.insert(5 * C, 6 * C);
        s.insert(4 * C, 7 * C);
        assert_eq!(
            s.spans(),
            [(0, 3 * C), (4 * C, 7 * C)],
            "a range over another swallows it"
        );
        s.insert(C, 5 * C);
        assert_eq!(s.spans(), [(0, 7 * C)]);
        s.insert(9 * C, 9 * C);
        assert_eq!(s.spans(), [(0, 7 * C)], "an empty range adds nothing");
    }

    #[test]
    fn removing_cuts_the_ranges_it_overlaps() {
        let mut s = set(&[(0, 4 * C), (6 * C, 8 * C)]);
        s.remove(C, 2 * C);
        assert_eq!(
            s.spans(),
            [(0, C), (2 * C, 4 * C), (6 * C, 8 * C)],
            "a middle chunk splits a run"
        );
        s.remove(3 * C, 7 * C);
        assert_eq!(s.spans(), [(0, C), (2 * C, 3 * C), (7 * C, 8 * C)], "across two runs");
        s.remove(0, 10 * C);
        assert!(s.is_empty());
        s.remove(0, C);
        assert!(s.is_empty(), "removing what is not there is nothing");
    }

    #[test]
    fn growth_next_to_a_registered_run_replaces_it_by_the_union() {
        // Registered: one run. The pool grows at its end: the run is deregistered and the union
        // registered, so that a buffer across the old end lies in one registration.
        let held = [(0, 2 * C)];
        let mapped = set(&[(0, 2 * C), (2 * C, 3 * C)]);
        let p = plan(mapped.spans(), &held, &[]);
        assert_eq!(p.deregister, [(0, 2 * C)]);
        assert_eq!(p.register, [(0, 3 * C)]);
        // Growth apart from it registers the new run alone.
        let mapped = set(&[(0, 2 * C), (5 * C, 6 * C)]);
        let p = plan(mapped.spans(), &held, &[]);
        assert!(p.deregister.is_empty());
        assert_eq!(p.register, [(5 * C, 6 * C)]);
        // Growth that fills a hole joins three registrations into one.
        let held = [(0, C), (2 * C, 3 * C)];
        let mapped = set(&[(0, C), (C, 2 * C), (2 * C, 3 * C)]);
        let p = plan(mapped.spans(), &held, &[]);
        assert_eq!(p.deregister, [(0, C), (2 * C, 3 * C)]);
        assert_eq!(p.register, [(0, 3 * C)]);
    }

    #[test]
    fn unmapping_deregisters_the_overlap_and_re_registers_what_stays_mapped() {
        let held = [(0, 4 * C), (6 * C, 7 * C)];
        let mut mapped = set(&held);
        mapped.remove(C, 2 * C);
        let p = plan(mapped.spans(), &held, &[]);
        assert_eq!(p.deregister, [(0, 4 * C)], "only the registration the unmapping cuts");
        assert_eq!(p.register, [(0, C), (2 * C, 4 * C)]);
        // The whole run goes: deregistered, nothing registered in its place.
        let mut mapped = set(&held);
        mapped.remove(6 * C, 7 * C);
        let p = plan(mapped.spans(), &held, &[]);
        assert_eq!(p.deregister, [(6 * C, 7 * C)]);
        assert!(p.register.is_empty());
    }

    #[test]
    fn a_plan_applied_is_empty_and_failures_are_not_retried() {
        let mapped = set(&[(0, C), (3 * C, 5 * C)]);
        let p = plan(mapped.spans(), &[], &[]);
        assert_eq!(p.register, [(0, C), (3 * C, 5 * C)]);
        assert!(
            plan(mapped.spans(), &p.register, &[]).is_empty(),
            "applied, nothing is left"
        );
        let p = plan(mapped.spans(), &[(0, C)], &[(3 * C, 5 * C)]);
        assert!(p.is_empty(), "a failed run waits until it changes");
        let mut grown = mapped.clone();
        grown.insert(5 * C, 6 * C);
        let p = plan(grown.spans(), &[(0, C)], &[(3 * C, 5 * C)]);
        assert_eq!(p.register, [(3 * C, 6 * C)], "the run changed: tried again");
    }

    #[test]
    fn random_changes_keep_the_plan_exact() {
        // A small deterministic generator: every step maps or unmaps a random chunk range, applies the
        // plan, and checks that the registrations are exactly the maximal mapped runs.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut mapped = RangeSet::default();
        let mut chunks = [false; 32];
        let mut held: Vec<Span> = Vec::new();
        for _ in 0..2000 {
            let a = next(32);
            let b = (a + 1 + next(6)).min(32);
            let on = next(2) == 0;
            if on {
                mapped.insert(a * C, b * C);
            } else {
                mapped.remove(a * C, b * C);
            }
            chunks[a as usize..b as usize].iter_mut().for_each(|c| *c = on);
            let p = plan(mapped.spans(), &held, &[]);
            held.retain(|h| !p.deregister.contains(h));
            held.extend(&p.register);
            held.sort_unstable();
            // The runs of `chunks`, computed the slow way.
            let mut runs = Vec::new();
            let mut i = 0;
            while i < 32 {
                if chunks[i] {
                    let s = i;
                    while i < 32 && chunks[i] {
                        i += 1;
                    }
                    runs.push((s as u64 * C, i as u64 * C));
                } else {
                    i += 1;
                }
            }
            assert_eq!(mapped.spans(), runs.as_slice());
            assert_eq!(held, runs, "one registration per maximal mapped run");
        }
    }
}
