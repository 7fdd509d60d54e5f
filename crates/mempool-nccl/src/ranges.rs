//! The bookkeeping of registration that follows a pool, apart from NCCL so that host tests drive it: the
//! mapped address ranges of each tag ([`RangeSet`]: one per physical allocation the pool reported), and
//! the plan ([`plan`]) that turns the registrations held into one registration per range.
//!
//! Why one per physical allocation: NCCL looks a collective's buffer up in its registration cache
//! (`ncclRegFind`, src/include/register_inline.h) and uses a registration only when one entry covers the
//! whole buffer (`data + size <= reg->endAddr` of a single slot), and its registered transports are expected
//! to need the buffer inside one `cuMemCreate` allocation: registrations merged over neighbouring allocations
//! covered every buffer allocated after growth, and NCCL ran those all-reduces at unregistered speed
//! (docs/measurements.md, "NCCL registrations over the service pool"). The service pool maps the chunks an allocation needs as one physical allocation, so a buffer that
//! grew the pool lies in one registration; one that lies across two allocations (part of its memory mapped
//! earlier for a neighbour) is not covered and runs unregistered, with the right result.

/// A half-open address range `start..end`.
pub(crate) type Span = (u64, u64);

/// Disjoint, sorted ranges: ranges that touch stay apart (each is one physical allocation); ranges that
/// overlap are merged.
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

    /// Adds `start..end`, merging it with every range it overlaps (a range it only touches stays apart).
    pub(crate) fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        // The first range that ends after `start` (it overlaps).
        let lo = self.spans.partition_point(|&(_, e)| e <= start);
        // One past the last range that starts before `end`.
        let hi = self.spans.partition_point(|&(s, _)| s < end);
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

/// The plan that takes `held` (the registered spans, any order) to `wanted` (the mapped ranges).
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
    fn touching_ranges_stay_apart_and_overlapping_ones_merge() {
        let mut s = RangeSet::default();
        s.insert(0, C);
        s.insert(2 * C, 3 * C);
        s.insert(C, 2 * C);
        assert_eq!(
            s.spans(),
            [(0, C), (C, 2 * C), (2 * C, 3 * C)],
            "three neighbouring allocations are three ranges"
        );
        s.insert(5 * C, 6 * C);
        s.insert(4 * C, 7 * C);
        assert_eq!(
            s.spans(),
            [(0, C), (C, 2 * C), (2 * C, 3 * C), (4 * C, 7 * C)],
            "a range over another swallows it"
        );
        s.insert(C + 1, 5 * C);
        assert_eq!(s.spans(), [(0, C), (C, 7 * C)], "overlapping ranges merge");
        s.insert(9 * C, 9 * C);
        assert_eq!(s.spans(), [(0, C), (C, 7 * C)], "an empty range adds nothing");
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
    fn growth_next_to_a_registered_allocation_registers_the_new_one_alone() {
        let held = [(0, 2 * C)];
        let mapped = set(&[(0, 2 * C), (2 * C, 3 * C)]);
        let p = plan(mapped.spans(), &held, &[]);
        assert!(p.deregister.is_empty(), "the old registration stays");
        assert_eq!(p.register, [(2 * C, 3 * C)]);
        let mapped = set(&[(0, 2 * C), (5 * C, 6 * C)]);
        let p = plan(mapped.spans(), &held, &[]);
        assert!(p.deregister.is_empty());
        assert_eq!(p.register, [(5 * C, 6 * C)]);
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
        grown.remove(3 * C, 5 * C);
        grown.insert(3 * C, 6 * C);
        let p = plan(grown.spans(), &[(0, C)], &[(3 * C, 5 * C)]);
        assert_eq!(p.register, [(3 * C, 6 * C)], "the range changed: tried again");
    }

    #[test]
    fn random_changes_keep_the_plan_exact() {
        // A small deterministic generator: every step maps a free chunk range as one allocation or
        // unmaps one allocation, applies the plan, and checks that the registrations are exactly the
        // mapped allocations.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut mapped = RangeSet::default();
        let mut allocs: Vec<Span> = Vec::new();
        let mut held: Vec<Span> = Vec::new();
        for _ in 0..2000 {
            if next(2) == 0 || allocs.is_empty() {
                let a = next(32);
                let b = (a + 1 + next(6)).min(32);
                let (s, e) = (a * C, b * C);
                if allocs.iter().all(|&(x, y)| y <= s || x >= e) {
                    mapped.insert(s, e);
                    allocs.push((s, e));
                }
            } else {
                let (s, e) = allocs.swap_remove(next(allocs.len() as u64) as usize);
                mapped.remove(s, e);
            }
            let p = plan(mapped.spans(), &held, &[]);
            held.retain(|h| !p.deregister.contains(h));
            held.extend(&p.register);
            held.sort_unstable();
            let mut want = allocs.clone();
            want.sort_unstable();
            assert_eq!(mapped.spans(), want.as_slice());
            assert_eq!(held, want, "one registration per mapped allocation");
        }
    }
}
