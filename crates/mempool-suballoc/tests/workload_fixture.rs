//! Pins the standard random workload in a text file that the Python port of the generator
//! (`crates/mempool-py/python/mempool/benchmarks/random_workload.py`) is checked against by
//! `crates/mempool-py/tests/test_workload.py`: both sides compare against this one file.
//!
//! Check: `cargo test -p mempool-suballoc --test workload_fixture`.
//! Rewrite it (only when the sequences are meant to change, which changes every published number):
//! `MEMPOOL_BLESS=1 cargo test -p mempool-suballoc --test workload_fixture`.

use std::fmt::Write as _;

use mempool_suballoc::workload::{random_workload, RandomOp, SplitMix64};

/// The fixture as committed (read at compile time, so the test reads no file at run time).
const FIXTURE: &str = include_str!("data/random_workload.txt");

/// The standard points of `mempool-bench random` (seed 42 + point index).
const STANDARD: [(usize, usize, usize, u64); 3] = [
    (200_000, 64 << 10, 4 << 30, 42),
    (100_000, 1 << 20, 16 << 30, 43),
    (20_000, 64 << 20, 16 << 30, 44),
];

fn op(o: &RandomOp) -> String {
    match *o {
        RandomOp::Alloc(n) => format!("a{n}"),
        RandomOp::Free(i) => format!("f{i}"),
    }
}

/// FNV-1a over (kind, value) pairs, kind 1 for an allocation and 2 for a free (as the unit test in
/// `src/workload.rs` hashes).
fn fnv(ops: &[RandomOp]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for o in ops {
        let (kind, v) = match *o {
            RandomOp::Alloc(n) => (1u64, n as u64),
            RandomOp::Free(i) => (2u64, i as u64),
        };
        for x in [kind, v] {
            h = (h ^ x).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

fn join(ops: &[RandomOp]) -> String {
    ops.iter().map(op).collect::<Vec<_>>().join(",")
}

fn render() -> String {
    let mut s = String::new();
    s.push_str(
        "# The standard random workload (crates/mempool-suballoc/src/workload.rs), pinned for its Python port\n\
         # (mempool.benchmarks.random_workload, checked by crates/mempool-py/tests/test_workload.py).\n\
         # Checked by:  cargo test -p mempool-suballoc --test workload_fixture\n\
         # Written by:  MEMPOOL_BLESS=1 cargo test -p mempool-suballoc --test workload_fixture\n\
         # splitmix64 SEED: the first 8 outputs of SplitMix64(SEED), hex.\n\
         # full N MAX_SIZE MAX_USAGE SEED LEN FNV OPS: every op (aN: allocate N bytes; fI: free live[I], swap_remove).\n\
         # point N MAX_SIZE MAX_USAGE SEED LEN FNV FIRST LAST: the first 100 and last 20 ops.\n\
         # FNV: FNV-1a 64 over (1, N) for an allocation and (2, I) for a free.\n",
    );
    for seed in [0u64, 42, 0xFFFF_FFFF_FFFF_FFFF] {
        let mut r = SplitMix64(seed);
        let v: Vec<String> = (0..8).map(|_| format!("{:016x}", r.next_u64())).collect();
        writeln!(s, "splitmix64 {seed} {}", v.join(" ")).unwrap();
    }
    // Small cases written out in full: the pinned one of src/workload.rs, one whose max_usage is below
    // max_size (the draws that can never fit are dropped, so fewer ops than n come out), one tight.
    for (n, max_size, max_usage, seed) in [
        (12usize, 4096usize, 10_000usize, 42u64),
        (300, 4096, 3000, 7),
        (500, 1000, 5000, 1),
    ] {
        let ops = random_workload(n, max_size, max_usage, seed);
        writeln!(
            s,
            "full {n} {max_size} {max_usage} {seed} {} {:016x} {}",
            ops.len(),
            fnv(&ops),
            join(&ops)
        )
        .unwrap();
    }
    for (n, max_size, max_usage, seed) in STANDARD {
        let ops = random_workload(n, max_size, max_usage, seed);
        writeln!(
            s,
            "point {n} {max_size} {max_usage} {seed} {} {:016x} {} {}",
            ops.len(),
            fnv(&ops),
            join(&ops[..100]),
            join(&ops[ops.len() - 20..])
        )
        .unwrap();
    }
    s
}

#[test]
fn the_python_fixture_matches_the_generator() {
    let now = render();
    if std::env::var_os("MEMPOOL_BLESS").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/random_workload.txt");
        std::fs::write(path, &now).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        return;
    }
    if now != FIXTURE {
        let line = now
            .lines()
            .zip(FIXTURE.lines())
            .position(|(a, b)| a != b)
            .map_or_else(|| "the line count".to_string(), |i| format!("line {}", i + 1));
        panic!(
            "tests/data/random_workload.txt differs from what random_workload generates ({line} first differs). \
             The published benchmark numbers and the Python port depend on these sequences; if the change is \
             intended, rewrite it with MEMPOOL_BLESS=1 cargo test -p mempool-suballoc --test workload_fixture"
        );
    }
}
