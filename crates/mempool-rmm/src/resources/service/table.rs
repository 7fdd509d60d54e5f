//! The service resource's bookkeeping, free of CUDA so that host tests check it: which chunks of a range
//! live allocations touch and which are mapped ([`ChunkTable`], also the expandable resource's), which of a
//! sleeping tag's chunks its wake maps back ([`wake_runs`]), tag names, and the reclaim policy's arithmetic.

use std::ops::Range;

/// Which chunks of a range are mapped: one bit per chunk, so that the check an allocation makes (are the
/// chunks it lands on mapped?) reads a few bytes of a small bitmap. Which chunks live allocations touch is
/// not kept per chunk (that cost a cache miss per operation): it is computed from the engine's free blocks
/// when it is needed (trim, reclaim, sleep, export), with [`ChunkTable::free_chunks`].
#[derive(Debug)]
pub(crate) struct ChunkTable {
    base: u64,
    chunk: u64,
    /// `log2(chunk)` when the chunk is a power of two (the usual case): spans are then shifts, not
    /// divisions, on every allocation.
    shift: Option<u32>,
    len: usize,
    /// Bit `i` set: chunk `i` is mapped.
    mapped: Vec<u64>,
    mapped_count: usize,
}

impl ChunkTable {
    pub(crate) fn new(base: u64, size: u64, chunk: u64) -> ChunkTable {
        let len = size.div_ceil(chunk) as usize;
        ChunkTable {
            base,
            chunk,
            shift: chunk.is_power_of_two().then(|| chunk.trailing_zeros()),
            len,
            mapped: vec![0; len.div_ceil(64)],
            mapped_count: 0,
        }
    }

    /// How many chunks the range has.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The chunks `addr..addr+bytes` overlaps (`bytes > 0`, inside the range).
    pub(crate) fn span(&self, addr: u64, bytes: u64) -> Range<usize> {
        let (lo, hi) = (addr - self.base, addr - self.base + bytes - 1);
        let (first, last) = match self.shift {
            Some(k) => (lo >> k, hi >> k),
            None => (lo / self.chunk, hi / self.chunk),
        };
        first as usize..last as usize + 1
    }

    /// Whether `addr..addr+bytes` lies inside the range.
    pub(crate) fn contains(&self, addr: u64, bytes: u64) -> bool {
        let end = self.base + self.len as u64 * self.chunk;
        addr >= self.base && addr.checked_add(bytes).is_some_and(|e| e <= end)
    }

    /// The chunks of `span` that are not mapped.
    pub(crate) fn unmapped(&self, span: Range<usize>) -> Vec<usize> {
        span.filter(|&i| !self.is_mapped(i)).collect()
    }

    /// Whether every chunk of `span` is mapped: a word of the bitmap at a time (an allocation of 64 MiB
    /// lands on 32 chunks; testing them one by one was most of what the resource added per operation).
    pub(crate) fn all_mapped(&self, span: Range<usize>) -> bool {
        let (mut i, end) = (span.start, span.end);
        while i < end {
            let (w, lo) = (i / 64, i % 64);
            let hi = (end - w * 64).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            if self.mapped[w] & mask != mask {
                return false;
            }
            i = w * 64 + hi;
        }
        true
    }

    pub(crate) fn is_mapped(&self, i: usize) -> bool {
        self.mapped[i / 64] & (1 << (i % 64)) != 0
    }

    pub(crate) fn set_mapped(&mut self, i: usize, mapped: bool) {
        if self.is_mapped(i) != mapped {
            self.mapped[i / 64] ^= 1 << (i % 64);
            if mapped {
                self.mapped_count += 1;
            } else {
                self.mapped_count -= 1;
            }
        }
    }

    /// Every mapped chunk, in order.
    pub(crate) fn mapped_chunks(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.mapped_count);
        for (w, &bits) in self.mapped.iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                out.push(w * 64 + b.trailing_zeros() as usize);
                b &= b - 1;
            }
        }
        out
    }

    /// Chunks mapped now.
    pub(crate) fn mapped_count(&self) -> usize {
        self.mapped_count
    }

    /// The offset of chunk `i` in the range.
    pub(crate) fn offset(&self, i: usize) -> usize {
        (i as u64 * self.chunk) as usize
    }

    /// The address of chunk `i`.
    pub(crate) fn addr(&self, i: usize) -> u64 {
        self.base + i as u64 * self.chunk
    }

    /// Which chunks no live allocation touches, given every free range of the region (`start..end`, in any
    /// order; neighbouring ranges, such as free blocks of two streams, count as one): `free[i]` is true
    /// when chunk `i` lies wholly inside free space.
    pub(crate) fn free_chunks(&self, ranges: impl Iterator<Item = (u64, u64)>) -> Vec<bool> {
        let mut ranges: Vec<(u64, u64)> = ranges.filter(|(a, b)| b > a).collect();
        ranges.sort_unstable();
        let mut free = vec![false; self.len];
        let mut cur: Option<(u64, u64)> = None;
        let mut mark = |(a, b): (u64, u64)| {
            let lo = (a.saturating_sub(self.base)).div_ceil(self.chunk) as usize;
            let hi = ((b.saturating_sub(self.base)) / self.chunk).min(self.len as u64) as usize;
            for f in free.iter_mut().take(hi).skip(lo) {
                *f = true;
            }
        };
        for (a, b) in ranges {
            match cur {
                Some((ca, cb)) if a <= cb => cur = Some((ca, cb.max(b))),
                Some(c) => {
                    mark(c);
                    cur = Some((a, b));
                }
                None => cur = Some((a, b)),
            }
        }
        if let Some(c) = cur {
            mark(c);
        }
        free
    }

    /// The part of `start..end` covered by mapped chunks, as its largest contiguous piece: how a free
    /// block of the engine is usable without mapping anything.
    pub(crate) fn largest_mapped_piece(&self, start: u64, end: u64) -> u64 {
        if end <= start {
            return 0;
        }
        let (mut best, mut run_start) = (0u64, None::<u64>);
        let span = self.span(start, end - start);
        for i in span {
            let lo = self.addr(i).max(start);
            let hi = (self.addr(i) + self.chunk).min(end);
            if self.is_mapped(i) {
                let s = *run_start.get_or_insert(lo);
                best = best.max(hi - s);
            } else {
                run_start = None;
            }
        }
        best
    }
}

/// Splits sorted chunk indices into runs of consecutive ones.
pub(crate) fn runs(mut chunks: impl Iterator<Item = usize>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let Some(first) = chunks.next() else {
        return out;
    };
    let mut cur = first..first + 1;
    for i in chunks {
        if i == cur.end {
            cur.end += 1;
        } else {
            out.push(std::mem::replace(&mut cur, i..i + 1));
        }
    }
    out.push(cur);
    out
}

/// The chunks to map back when a tag wakes, as runs, each with the index in `saved` of its first chunk
/// (where an offload saved it: chunk `saved[k]` at `k` chunks into the host buffer). `saved` (sorted) are
/// the chunks live allocations touched when the tag fell asleep; `free[i]` says whether chunk `i` lies
/// wholly in free space now. A saved chunk that is free now held only allocations freed while the tag
/// slept: it stays unmapped, and its bytes in the host buffer are not copied back.
pub(crate) fn wake_runs(saved: &[usize], free: &[bool]) -> Vec<(Range<usize>, usize)> {
    let mut out: Vec<(Range<usize>, usize)> = Vec::new();
    for (k, &c) in saved.iter().enumerate() {
        if free.get(c).copied().unwrap_or(false) {
            continue;
        }
        match out.last_mut() {
            Some((run, first)) if run.end == c && *first + run.len() == k => run.end += 1,
            _ => out.push((c..c + 1, k)),
        }
    }
    out
}

/// The longest tag name.
pub const MAX_TAG_NAME: usize = 64;

/// Checks a tag name: 1 to [`MAX_TAG_NAME`] bytes of ASCII letters, digits, `_`, `-`, `.` and `:`.
pub(crate) fn check_tag_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TAG_NAME {
        return Err(format!(
            "a tag name has 1 to {MAX_TAG_NAME} characters; `{}` has {}",
            name.escape_debug(),
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
    {
        return Err(format!(
            "a tag name has only ASCII letters, digits, `_`, `-`, `.` and `:`; `{}` has {:?}",
            name.escape_debug(),
            c
        ));
    }
    Ok(())
}

/// Whether the watermark policy unmaps idle chunks before mapping `new` more bytes: when the bytes mapped
/// would pass `(100 + percent)%` of the reference, the most bytes ever live (this allocation's included).
pub(crate) fn over_watermark(mapped: u64, new: u64, peak_live: u64, percent: u32) -> bool {
    let limit = (peak_live as u128 * (100 + percent as u128)) / 100;
    (mapped as u128 + new as u128) > limit
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn spans_cover_the_chunks_a_block_touches() {
        let t = ChunkTable::new(1 << 40, 64 * MIB, 2 * MIB);
        assert_eq!(t.len(), 32);
        let b = 1u64 << 40;
        assert_eq!(t.span(b, 1), 0..1);
        assert_eq!(t.span(b, 2 * MIB), 0..1);
        assert_eq!(t.span(b, 2 * MIB + 1), 0..2);
        assert_eq!(t.span(b + 2 * MIB - 256, 512), 0..2, "a block across a chunk boundary");
        assert_eq!(t.span(b + 62 * MIB, 2 * MIB), 31..32);
        assert_eq!(t.offset(3), (6 * MIB) as usize);
        assert!(t.contains(b, 64 * MIB));
        assert!(!t.contains(b, 64 * MIB + 1));
        assert!(!t.contains(b - 1, 1));
        assert!(!t.contains(u64::MAX, 2), "no overflow");
        // A chunk that is not a power of two divides.
        let t = ChunkTable::new(0, 60 * MIB, 6 * MIB);
        assert_eq!(
            (t.len(), t.span(5 * MIB, 2 * MIB), t.span(12 * MIB, 6 * MIB)),
            (10, 0..2, 2..3)
        );
    }

    #[test]
    fn the_mapped_bitmap_counts_and_lists_chunks() {
        let mut t = ChunkTable::new(0, 200 * 2 * MIB, 2 * MIB);
        assert_eq!(t.unmapped(0..4), vec![0, 1, 2, 3]);
        for i in [0, 1, 2, 3, 63, 64, 130, 199] {
            t.set_mapped(i, true);
        }
        t.set_mapped(0, true); // idempotent
        assert_eq!(t.mapped_count(), 8);
        assert!(t.all_mapped(0..4) && t.all_mapped(63..65) && !t.all_mapped(3..5));
        assert_eq!(t.unmapped(62..66), vec![62, 65]);
        assert_eq!(t.mapped_chunks(), vec![0, 1, 2, 3, 63, 64, 130, 199]);
        t.set_mapped(64, false);
        t.set_mapped(64, false);
        assert_eq!(t.mapped_count(), 7);
        assert!(!t.is_mapped(64) && t.is_mapped(63));
    }

    #[test]
    fn all_mapped_tests_words_as_the_bits_one_by_one_would() {
        // Every span of a 200-chunk table over many random bitmaps (a fixed-seed xorshift).
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..40 {
            let mut t = ChunkTable::new(0, 200 * 2 * MIB, 2 * MIB);
            // Dense bitmaps in later rounds, so that long all-mapped spans occur.
            let density = round % 4;
            for i in 0..200 {
                if (0..=density).any(|_| next() % 4 != 0) {
                    t.set_mapped(i, true);
                }
            }
            for a in 0..200 {
                for b in a + 1..=200 {
                    let naive = (a..b).all(|i| t.is_mapped(i));
                    assert_eq!(t.all_mapped(a..b), naive, "round {round}, span {a}..{b}");
                }
            }
        }
        let mut t = ChunkTable::new(0, 128 * 2 * MIB, 2 * MIB);
        (0..128).for_each(|i| t.set_mapped(i, true));
        assert!(t.all_mapped(0..128) && t.all_mapped(64..128) && t.all_mapped(63..65));
        t.set_mapped(127, false);
        assert!(!t.all_mapped(0..128) && t.all_mapped(0..127));
    }

    #[test]
    fn free_chunks_are_those_wholly_inside_free_space() {
        let t = ChunkTable::new(1 << 30, 16 * MIB, 2 * MIB);
        let b = 1u64 << 30;
        // Free: [1 MiB, 7 MiB) as two neighbouring blocks (two streams' lists), and [10 MiB, 16 MiB).
        let free = t.free_chunks(
            [
                (b + 4 * MIB, b + 7 * MIB),
                (b + 10 * MIB, b + 16 * MIB),
                (b + MIB, b + 4 * MIB),
            ]
            .into_iter(),
        );
        let idle: Vec<usize> = (0..t.len()).filter(|&i| free[i]).collect();
        assert_eq!(
            idle,
            vec![1, 2, 5, 6, 7],
            "chunk 0 and 3 are partly live, 4 wholly live"
        );
        assert!(t.free_chunks(std::iter::empty()).iter().all(|f| !f));
        let all = t.free_chunks([(b, b + 16 * MIB)].into_iter());
        assert!(all.iter().all(|f| *f));
    }

    #[test]
    fn the_largest_mapped_piece_of_a_free_block_stops_at_unmapped_chunks() {
        let mut t = ChunkTable::new(0, 16 * MIB, 2 * MIB);
        for i in [0, 1, 3, 4, 5] {
            t.set_mapped(i, true);
        }
        assert_eq!(t.largest_mapped_piece(MIB, 5 * MIB), 3 * MIB, "chunks 0-1 from 1 MiB");
        assert_eq!(t.largest_mapped_piece(MIB, 12 * MIB), 6 * MIB, "chunks 3-5");
        assert_eq!(t.largest_mapped_piece(4 * MIB, 6 * MIB), 0, "chunk 2 is not mapped");
        assert_eq!(t.largest_mapped_piece(5 * MIB, 5 * MIB), 0);
    }

    #[test]
    fn wake_maps_back_the_saved_chunks_still_touched_with_their_saved_places() {
        // Saved at sleep: chunks 1, 2, 3, 7, 8, 9 (host slots 0..6). Since then, the allocations on
        // chunk 2 and on 8..10 were freed (bookkeeping while asleep): 2, 8 and 9 are free now.
        let saved = [1, 2, 3, 7, 8, 9];
        let mut free = vec![false; 12];
        for c in [0, 2, 4, 5, 6, 8, 9, 10, 11] {
            free[c] = true;
        }
        assert_eq!(wake_runs(&saved, &free), vec![(1..2, 0), (3..4, 2), (7..8, 3)]);
        // Nothing freed: one run per run of saved chunks, at their slots.
        assert_eq!(wake_runs(&saved, &[false; 12]), vec![(1..4, 0), (7..10, 3)]);
        // Everything freed: nothing to map.
        assert!(wake_runs(&saved, &[true; 12]).is_empty());
        assert!(wake_runs(&[], &free).is_empty());
        // The slots stay those of the saved list, whatever is skipped before them.
        assert_eq!(
            wake_runs(&[4, 5, 6], &[false, false, false, false, true, false, false]),
            vec![(5..7, 1)]
        );
    }

    #[test]
    fn runs_group_consecutive_chunks() {
        assert_eq!(runs([1, 2, 3, 7, 9, 10].into_iter()), vec![1..4, 7..8, 9..11]);
        assert!(runs(std::iter::empty()).is_empty());
    }

    #[test]
    fn tag_names_are_checked() {
        assert!(check_tag_name("kv-cache").is_ok());
        assert!(check_tag_name("weights.v2:layer_0").is_ok());
        assert!(check_tag_name("").unwrap_err().contains("1 to 64"));
        assert!(check_tag_name(&"x".repeat(65)).is_err());
        assert!(check_tag_name("a b").unwrap_err().contains("' '"));
        assert!(check_tag_name("é").is_err());
        assert!(
            check_tag_name(&"x".repeat(MAX_TAG_NAME)).is_ok(),
            "the longest name is allowed"
        );
    }

    #[test]
    fn the_watermark_allows_exactly_its_limit() {
        // 100 MiB peak at 15%: 115 MiB may be mapped, one byte more may not.
        assert!(!over_watermark(100 * MIB, 15 * MIB, 100 * MIB, 15));
        assert!(over_watermark(100 * MIB, 15 * MIB + 1, 100 * MIB, 15));
        // A zero percent watermark: nothing above the peak of live bytes.
        assert!(!over_watermark(0, 2 * MIB, 2 * MIB, 0));
        assert!(over_watermark(2 * MIB, 2 * MIB, 3 * MIB, 0));
    }

    #[test]
    fn the_watermark_compares_mapped_and_new_bytes_with_the_peak_of_live_bytes() {
        // 1.5 GiB mapped, 512 MiB more, peak live 1.5 GiB: 2 GiB > 1.65 GiB.
        assert!(over_watermark(1536 * MIB, 512 * MIB, 1536 * MIB, 10));
        assert!(!over_watermark(1536 * MIB, 100 * MIB, 1536 * MIB, 10));
        assert!(!over_watermark(0, 0, 0, 0));
        assert!(over_watermark(u64::MAX, u64::MAX, u64::MAX, 0), "no overflow");
    }
}
