//! `query`: a suite of gpu-bdb-style queries, pipelines of columnar operators (generate, filter and
//! compact, hash join, group-by aggregation, radix sort) over generated tables, with every intermediate
//! allocated and freed through the resource under test. Several workers (a thread and a stream each)
//! run queries at once, as a query engine's workers would. The resource is the only thing that changes
//! between runs.
//!
//! The tables, generated on the device from a hash of (column seed, row), after TPCx-BB's retail schema:
//! - `store_sales` (`fact` rows): `item_sk` < items, `customer_sk` < customers, `quantity` in 1..=100,
//!   `price` in 1..=1000, `date_sk` < 3650;
//! - `item` (fact / 100 rows): `item_sk` = row, `category` < 32, `brand` < 512;
//! - `customer` (fact / 40 rows): `customer_sk` = row, `birth_year` in 1930..2000, `state` < 50.
//!
//! Every query ends with a small sorted result read back to the host and checked against the same
//! query computed on the host ([`reference()`]).

use std::sync::{Barrier, Mutex};
use std::time::Instant;

use mempool_core::{Device, Stream};
use mempool_rmm::MemoryResource;

use crate::chart::{Chart, ChartKind, Series};
use crate::error::{Error, Result};
use crate::kernels::{hash2, load, QueryKernels};
use crate::progress::Progress;
use crate::report::{geomean, median, Cell, Column, Report};
use crate::spec::{build, ResourceSpec};
use crate::track::Tracked;
use crate::workloads::columns::{Col, Exec, Groups, Selection};
use crate::workloads::Common;

const S_ITEM: u32 = 1;
const S_CUSTOMER: u32 = 2;
const S_QUANTITY: u32 = 3;
const S_PRICE: u32 = 4;
const S_DATE: u32 = 5;
const S_CATEGORY: u32 = 11;
const S_BRAND: u32 = 12;
const S_BIRTH_YEAR: u32 = 21;
const S_STATE: u32 = 22;

const DAYS: u32 = 3650;
const CATEGORIES: u32 = 32;
const BRANDS: u32 = 512;
const STATES: u32 = 50;

/// Table sizes for a scale factor.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Scale {
    /// `store_sales` rows.
    pub fact: usize,
    /// `item` rows.
    pub items: usize,
    /// `customer` rows.
    pub customers: usize,
}

impl Scale {
    /// Scale factor 1 is 4M sales rows (80 MB of columns), 40k items, 100k customers.
    pub fn new(sf: f64) -> Scale {
        let fact = ((sf * 4_000_000.0).round() as usize).max(1024);
        Scale {
            fact,
            items: (fact / 100).max(64),
            customers: (fact / 40).max(64),
        }
    }
}

/// The queries of the suite.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Query {
    /// Revenue per item in a one-year date window: filter, compact, group-by, sort.
    Q1,
    /// Revenue per category over a filtered item dimension: hash join, gather, group-by, sort.
    Q2,
    /// Revenue per (brand, state): two hash joins, a composite key, group-by, HAVING, sort.
    Q3,
    /// Distinct customers of two years: filter, radix sort of (customer, revenue), run heads, compact.
    Q4,
    /// Customers who bought at least the average: group-by of high cardinality, HAVING, sort.
    Q5,
}

impl Query {
    /// Every query.
    pub const ALL: [Query; 5] = [Query::Q1, Query::Q2, Query::Q3, Query::Q4, Query::Q5];

    /// `q1` ... `q5`.
    pub fn name(self) -> &'static str {
        match self {
            Query::Q1 => "q1",
            Query::Q2 => "q2",
            Query::Q3 => "q3",
            Query::Q4 => "q4",
            Query::Q5 => "q5",
        }
    }

    /// What it does.
    pub fn description(self) -> &'static str {
        match self {
            Query::Q1 => "revenue per item in a date window (filter, group-by, sort)",
            Query::Q2 => "revenue per category (join to filtered items, group-by, sort)",
            Query::Q3 => "revenue per brand and state (two joins, group-by, having, sort)",
            Query::Q4 => "distinct customers in two years (filter, radix sort, run heads)",
            Query::Q5 => "customers at or above the average count (group-by, having, sort)",
        }
    }

    /// Parses `q1` ... `q5`.
    pub fn parse(s: &str) -> Option<Query> {
        Query::ALL.into_iter().find(|q| q.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// A query's result, reduced to what is compared: row count, an order-sensitive hash of the sorted
/// (key, value) rows, and a total.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Digest {
    /// Result rows.
    pub rows: u64,
    /// FNV-1a over the rows in order.
    pub(crate) hash: u64,
    /// The query's total (revenue).
    pub total: u64,
}

impl Digest {
    /// Digests sorted `keys` with their `vals` (empty: keys only) and `total`.
    pub fn of(keys: &[u32], vals: &[u32], total: u64) -> Digest {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: u32| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        for (i, &k) in keys.iter().enumerate() {
            eat(k);
            if let Some(&v) = vals.get(i) {
                eat(v);
            }
        }
        Digest {
            rows: keys.len() as u64,
            hash: h,
            total,
        }
    }
}

fn gen_host(seed: u32, i: usize, lo: u32, span: u32) -> u32 {
    lo + hash2(seed, i as u64) % span
}

/// The query computed on the host, for checking (a loop over the rows; seconds at scale 1 in a debug
/// build, well under one in release).
pub fn reference(q: Query, s: &Scale) -> Digest {
    let (f, n_items, n_cust) = (s.fact, s.items as u32, s.customers as u32);
    let item = |i| gen_host(S_ITEM, i, 0, n_items);
    let cust = |i| gen_host(S_CUSTOMER, i, 0, n_cust);
    let qty = |i| gen_host(S_QUANTITY, i, 1, 100);
    let price = |i| gen_host(S_PRICE, i, 1, 1000);
    let date = |i| gen_host(S_DATE, i, 0, DAYS);
    let rev = |i| u64::from(qty(i).wrapping_mul(price(i)));
    // Group-by results as sorted (key, count, sum).
    fn grouped(map: std::collections::BTreeMap<u32, (u32, u64)>, min_count: u32) -> (Vec<u32>, Vec<u32>, u64) {
        let kept: Vec<(u32, (u32, u64))> = map.into_iter().filter(|(_, (c, _))| *c >= min_count).collect();
        (
            kept.iter().map(|(k, _)| *k).collect(),
            kept.iter().map(|(_, (c, _))| *c).collect(),
            kept.iter().map(|(_, (_, s))| *s).fold(0u64, u64::wrapping_add),
        )
    }
    let mut map: std::collections::BTreeMap<u32, (u32, u64)> = Default::default();
    let mut add = |k: u32, v: u64| {
        let e = map.entry(k).or_insert((0, 0));
        e.0 += 1;
        e.1 = e.1.wrapping_add(v);
    };
    match q {
        Query::Q1 => {
            for i in 0..f {
                if (1000..1365).contains(&date(i)) {
                    add(item(i), rev(i));
                }
            }
            let (k, c, t) = grouped(map, 1);
            Digest::of(&k, &c, t)
        }
        Query::Q2 => {
            for i in 0..f {
                let it = item(i);
                let cat = gen_host(S_CATEGORY, it as usize, 0, CATEGORIES);
                if cat < 8 {
                    add(cat, rev(i));
                }
            }
            let (k, c, t) = grouped(map, 1);
            Digest::of(&k, &c, t)
        }
        Query::Q3 => {
            for i in 0..f {
                if !(1..51).contains(&qty(i)) {
                    continue;
                }
                let c = cust(i) as usize;
                if !(1960..1980).contains(&gen_host(S_BIRTH_YEAR, c, 1930, 70)) {
                    continue;
                }
                let brand = gen_host(S_BRAND, item(i) as usize, 0, BRANDS);
                let state = gen_host(S_STATE, c, 0, STATES);
                add(brand * 64 + state, rev(i));
            }
            let (k, c, t) = grouped(map, 2);
            Digest::of(&k, &c, t)
        }
        Query::Q4 => {
            let mut seen = std::collections::BTreeSet::new();
            let mut total = 0u64;
            for i in 0..f {
                if date(i) < 730 {
                    seen.insert(cust(i));
                    total = total.wrapping_add(rev(i));
                }
            }
            let keys: Vec<u32> = seen.into_iter().collect();
            Digest::of(&keys, &[], total)
        }
        Query::Q5 => {
            for i in 0..f {
                add(cust(i), rev(i));
            }
            let (k, c, t) = grouped(map, q5_min_count(s));
            Digest::of(&k, &c, t)
        }
    }
}

fn q5_min_count(s: &Scale) -> u32 {
    (s.fact / s.customers).max(1) as u32
}

/// The rows `sel` keeps of a generated column of `n` rows (the full column freed at once).
fn gen_kept<'a>(
    x: &'a Exec<'a>,
    n: usize,
    (seed, lo, span): (u32, u32, u32),
    sel: &Selection<'_, 'a>,
) -> Result<Col<'a, u32>> {
    let c = x.gen(n, seed, lo, span)?;
    x.compact(&c, sel)
}

/// The `f` sales with `date_sk` in `lo..hi`: their column generated as `key_column` and their revenue
/// (quantity * price).
fn sales_in_dates<'a>(
    x: &'a Exec<'a>,
    f: usize,
    (lo, hi): (u32, u32),
    key_column: (u32, u32, u32),
) -> Result<(Col<'a, u32>, Col<'a, u32>)> {
    let date = x.gen(f, S_DATE, 0, DAYS)?;
    let flags = x.flags_range(&date, lo, hi)?;
    drop(date);
    let sel = x.select(&flags)?;
    let key = gen_kept(x, f, key_column, &sel)?;
    let qty = gen_kept(x, f, (S_QUANTITY, 1, 100), &sel)?;
    let price = gen_kept(x, f, (S_PRICE, 1, 1000), &sel)?;
    drop(sel);
    drop(flags);
    let rev = x.mul(&qty, &price)?;
    drop((qty, price));
    Ok((key, rev))
}

/// HAVING count >= `min_count`: the groups kept.
fn having<'a>(x: &'a Exec<'a>, g: Groups<'a>, min_count: u32) -> Result<Groups<'a>> {
    let having = x.flags_range(&g.counts, min_count, u32::MAX)?;
    let sel = x.select(&having)?;
    let keys = x.compact(&g.keys, &sel)?;
    let counts = x.compact(&g.counts, &sel)?;
    let sums = x.compact_u64(&g.sums, &sel)?;
    drop(sel);
    drop((g, having));
    Ok(Groups { keys, sums, counts })
}

/// Runs `q` on `exec` and returns its digest (checked by the caller). Buffers come from and go back to
/// the Exec's resource as the pipeline moves on.
#[allow(unsafe_code)] // gathers by the rows its joins found (see the SAFETY lines)
pub(crate) fn run_query<'a>(q: Query, x: &'a Exec<'a>, s: &Scale) -> Result<Digest> {
    let (f, n_items, n_cust) = (s.fact, s.items as u32, s.customers as u32);
    // Q3's first join gathers row 0 for the sales whose item is not found: the dimensions are never empty.
    if n_items == 0 || n_cust == 0 || s.items > u32::MAX as usize || s.customers > u32::MAX as usize {
        return Err(Error::Usage(format!(
            "{}: {} items and {} customers: each dimension needs 1 to {} rows (Scale::new gives at least 64)",
            q.name(),
            s.items,
            s.customers,
            u32::MAX
        )));
    }
    // Sorted (key, count) rows and the total of the sums: the end of every group-by query.
    let finish_groups = |keys: Col<'a, u32>, counts: Col<'a, u32>, sums: Col<'a, u64>, bound: u64| -> Result<Digest> {
        let total = x.sum_u64(&sums)?;
        drop(sums);
        let (keys, counts) = x.sort_pairs(keys, Some(counts), bound)?;
        let counts = counts.expect("values were given");
        if x.count_unsorted(&keys)? != 0 {
            return Err(Error::Check(format!("{}: the sorted keys are out of order", q.name())));
        }
        Ok(Digest::of(&keys.download()?, &counts.download()?, total))
    };
    let digest = match q {
        Query::Q1 => {
            let (item, rev) = sales_in_dates(x, f, (1000, 1365), (S_ITEM, 0, n_items))?;
            let g = x.groupby(&item, &rev, n_items as usize)?;
            drop((item, rev));
            finish_groups(g.keys, g.counts, g.sums, u64::from(n_items))?
        }
        Query::Q2 => {
            // Build: items of categories 0..8.
            let (keys, cats) = {
                let cat = x.gen(n_items as usize, S_CATEGORY, 0, CATEGORIES)?;
                let key = x.iota(n_items as usize, 0)?;
                let flags = x.flags_range(&cat, 0, 8)?;
                let sel = x.select(&flags)?;
                (x.compact(&key, &sel)?, x.compact(&cat, &sel)?)
            };
            let table = x.hash_build(&keys)?;
            drop(keys);
            // Probe with every sale.
            let (rows, flags) = {
                let item = x.gen(f, S_ITEM, 0, n_items)?;
                x.probe(&table, &item)?
            };
            drop(table);
            let sel = x.select(&flags)?;
            let matched = x.compact(&rows, &sel)?;
            drop(rows);
            let qty = gen_kept(x, f, (S_QUANTITY, 1, 100), &sel)?;
            let price = gen_kept(x, f, (S_PRICE, 1, 1000), &sel)?;
            drop(sel);
            drop(flags);
            // SAFETY: point 1: `matched` holds build rows of the table built on `keys`, as long as `cats`
            // (both compacted by one selection): every row is below `cats.len()`.
            let cat = unsafe { x.gather(&cats, &matched) }?;
            drop((cats, matched));
            let rev = x.mul(&qty, &price)?;
            drop((qty, price));
            let g = x.groupby(&cat, &rev, CATEGORIES as usize)?;
            drop((cat, rev));
            finish_groups(g.keys, g.counts, g.sums, u64::from(CATEGORIES))?
        }
        Query::Q3 => {
            // Sales with quantity 1..=50.
            let qty_all = x.gen(f, S_QUANTITY, 1, 100)?;
            let flags = x.flags_range(&qty_all, 1, 51)?;
            let sel = x.select(&flags)?;
            let qty = x.compact(&qty_all, &sel)?;
            drop(qty_all);
            let item = gen_kept(x, f, (S_ITEM, 0, n_items), &sel)?;
            let cust = gen_kept(x, f, (S_CUSTOMER, 0, n_cust), &sel)?;
            let price = gen_kept(x, f, (S_PRICE, 1, 1000), &sel)?;
            drop(sel);
            drop(flags);
            // Join every item for its brand.
            let brand = {
                let brands = x.gen(n_items as usize, S_BRAND, 0, BRANDS)?;
                let keys = x.iota(n_items as usize, 0)?;
                let table = x.hash_build(&keys)?;
                drop(keys);
                let (rows, found) = x.probe(&table, &item)?;
                drop((table, found));
                // SAFETY: point 1: `rows` holds build rows of the table built on `keys` (`n_items` rows, as
                // many as `brands`), or 0 where the key was not found, below `n_items`, which is at
                // least 1 (checked at the top).
                unsafe { x.gather(&brands, &rows) }?
            };
            drop(item);
            // Join customers born 1960..1980 for their state.
            let (cust_keys, states) = {
                let year = x.gen(n_cust as usize, S_BIRTH_YEAR, 1930, 70)?;
                let flags = x.flags_range(&year, 1960, 1980)?;
                drop(year);
                let sel = x.select(&flags)?;
                let keys = {
                    let c = x.iota(n_cust as usize, 0)?;
                    x.compact(&c, &sel)?
                };
                let states = gen_kept(x, n_cust as usize, (S_STATE, 0, STATES), &sel)?;
                (keys, states)
            };
            let table = x.hash_build(&cust_keys)?;
            drop(cust_keys);
            let (rows, flags) = x.probe(&table, &cust)?;
            drop((table, cust));
            let sel = x.select(&flags)?;
            let matched = x.compact(&rows, &sel)?;
            drop(rows);
            let brand_m = x.compact(&brand, &sel)?;
            drop(brand);
            let qty_m = x.compact(&qty, &sel)?;
            drop(qty);
            let price_m = x.compact(&price, &sel)?;
            drop(sel);
            drop((price, flags));
            let (brand, qty, price) = (brand_m, qty_m, price_m);
            // SAFETY: point 1: `matched` holds build rows of the table built on `cust_keys`, as long as
            // `states` (both compacted by one selection): every row is below `states.len()`.
            let state = unsafe { x.gather(&states, &matched) }?;
            drop((states, matched));
            let key = x.combine(&brand, &state, 64)?;
            drop((brand, state));
            let rev = x.mul(&qty, &price)?;
            drop((qty, price));
            let g = x.groupby(&key, &rev, (BRANDS * 64) as usize)?;
            drop((key, rev));
            let g = having(x, g, 2)?;
            finish_groups(g.keys, g.counts, g.sums, u64::from(BRANDS * 64))?
        }
        Query::Q4 => {
            let (cust, rev) = sales_in_dates(x, f, (0, 730), (S_CUSTOMER, 0, n_cust))?;
            let (keys, rev) = x.sort_pairs(cust, Some(rev), u64::from(n_cust))?;
            let rev = rev.expect("values were given");
            if x.count_unsorted(&keys)? != 0 {
                return Err(Error::Check("q4: the sorted keys are out of order".into()));
            }
            let total = x.sum_u32(&rev)?;
            drop(rev);
            let heads = x.flags_head(&keys)?;
            let sel = x.select(&heads)?;
            let distinct = x.compact(&keys, &sel)?;
            drop(sel);
            drop((keys, heads));
            Digest::of(&distinct.download()?, &[], total)
        }
        Query::Q5 => {
            let cust = x.gen(f, S_CUSTOMER, 0, n_cust)?;
            let rev = {
                let qty = x.gen(f, S_QUANTITY, 1, 100)?;
                let price = x.gen(f, S_PRICE, 1, 1000)?;
                x.mul(&qty, &price)?
            };
            let g = x.groupby(&cust, &rev, n_cust as usize)?;
            drop((cust, rev));
            let g = having(x, g, q5_min_count(s))?;
            finish_groups(g.keys, g.counts, g.sums, u64::from(n_cust))?
        }
    };
    if let Some(e) = x.take_drop_error() {
        return Err(e);
    }
    Ok(digest)
}

/// Parameters of the `query` subcommand.
#[derive(Clone, Debug)]
pub struct QueryParams {
    /// Scale factor (1: 4M sales rows).
    pub scale: f64,
    /// Workers: threads, each with its own stream, running queries at once.
    pub workers: usize,
    /// Timed rounds; in each, every worker runs every query once (starting at a different one).
    pub rounds: usize,
    /// The queries.
    pub queries: Vec<Query>,
}

/// What one resource measured.
#[derive(Clone, Debug)]
pub(crate) struct ResourceRun {
    /// The resource's label.
    pub(crate) label: String,
    /// Per query: the times (seconds) of every run.
    pub(crate) times: Vec<Vec<f64>>,
    /// Wall time of each timed round, seconds.
    pub(crate) rounds: Vec<f64>,
    /// The most bytes live at once.
    pub(crate) peak_bytes: u64,
    /// Device memory in use after the last round minus before the resource existed (what it holds).
    pub(crate) held_bytes: i64,
    /// Buffers allocated per round (all workers).
    pub(crate) allocations_per_round: u64,
}

/// Runs `rounds` rounds (plus one warm-up) of the suite on `mr` with `workers` workers; checks every
/// result against `expected`.
pub fn run_suite(
    device: &Device,
    mr: &dyn MemoryResource,
    params: &QueryParams,
    expected: &[Digest],
    mut on_round: impl FnMut(),
) -> Result<(Vec<Vec<f64>>, Vec<f64>, u64)> {
    let ctx = device.context()?;
    let module = load(&ctx, "query.ptx")?;
    let kernels = QueryKernels::new(&module)?;
    let scale = Scale::new(params.scale);
    let workers = params.workers.max(1);
    let streams: Vec<Stream> = (0..workers).map(|_| Stream::new(&ctx)).collect::<Result<_, _>>()?;
    let nq = params.queries.len();
    let times: Mutex<Vec<Vec<f64>>> = Mutex::new(vec![Vec::new(); nq]);
    let mut round_times = Vec::new();
    let mut allocations = 0u64;
    for round in 0..=params.rounds {
        let barrier = Barrier::new(workers);
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let allocs = std::sync::atomic::AtomicU64::new(0);
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (w, stream) in streams.iter().enumerate() {
                let (barrier, kernels, times, first_error, allocs) =
                    (&barrier, &kernels, &times, &first_error, &allocs);
                let queries = &params.queries;
                scope.spawn(move || {
                    let exec = Exec::new(mr, stream.as_ref(), kernels);
                    // Every worker reaches the barrier, also one that cannot run.
                    barrier.wait();
                    let exec = match exec {
                        Ok(exec) => exec,
                        Err(e) => {
                            first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                            return;
                        }
                    };
                    for i in 0..nq {
                        let qi = (w + i) % nq;
                        let q = queries[qi];
                        let t = Instant::now();
                        let r = run_query(q, &exec, &scale);
                        let secs = t.elapsed().as_secs_f64();
                        match r {
                            Ok(d) if d == expected[qi] => {
                                if round > 0 {
                                    times.lock().unwrap_or_else(|p| p.into_inner())[qi].push(secs);
                                }
                            }
                            Ok(d) => {
                                first_error
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .get_or_insert(Error::Check(format!(
                                        "{} (worker {w}): got {d:?}, the host computed {:?}",
                                        q.name(),
                                        expected[qi]
                                    )));
                                return;
                            }
                            Err(e) => {
                                first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                                return;
                            }
                        }
                    }
                    allocs.fetch_add(exec.allocations(), std::sync::atomic::Ordering::Relaxed);
                });
            }
        });
        let wall = start.elapsed().as_secs_f64();
        if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        if round > 0 {
            round_times.push(wall);
        }
        allocations = allocs.into_inner();
        on_round();
    }
    for s in &streams {
        s.synchronize()?;
    }
    Ok((
        times.into_inner().unwrap_or_else(|p| p.into_inner()),
        round_times,
        allocations,
    ))
}

/// The targets for the query suite, as findings: `async` (and every `async(...)`) at least 2x
/// the cuMemAlloc baseline (geometric mean over the queries), and every suballocator over a driver pool
/// at least as fast as plain `async`.
fn target_notes(
    runs: &[ResourceRun],
    base: &Option<Vec<f64>>,
    medians: &dyn Fn(&ResourceRun) -> Vec<f64>,
) -> Vec<String> {
    let Some(base) = base else {
        return vec!["targets not evaluated: the cuMemAlloc baseline was not in the run".into()];
    };
    let gm = |r: &ResourceRun| geomean(medians(r).iter().zip(base).map(|(t, b)| b / t));
    let mut notes = Vec::new();
    let plain_async = runs.iter().find(|r| r.label == "async").and_then(gm);
    for r in runs {
        let Some(g) = gm(r) else { continue };
        if r.label.starts_with("async") {
            notes.push(format!(
                "target `{}` >= 2x cuMemAlloc (geomean): {} ({g:.2}x)",
                r.label,
                if g >= 2.0 { "met" } else { "MISSED" }
            ));
        } else if r.label.contains("(async") {
            if let Some(a) = plain_async {
                notes.push(format!(
                    "target `{}` at least as fast as `async` (geomean speed-up {g:.2}x vs {a:.2}x): {}",
                    r.label,
                    if g >= a { "met" } else { "MISSED" }
                ));
            }
        }
    }
    notes
}

/// Runs the suite over every resource of `common`; reports each query's median time, its speed-up over
/// the `cuMemAlloc` baseline, and peak memory.
pub fn bench(common: &Common, params: &QueryParams) -> Result<Report> {
    let device = common
        .device
        .ok_or_else(|| Error::Usage("the query workload needs a GPU".into()))?;
    if common.specs.iter().any(ResourceSpec::is_host_only) {
        return Err(Error::Usage(
            "`sim` cannot run the query workload: its kernels need real memory".into(),
        ));
    }
    let scale = Scale::new(params.scale);
    let expected: Vec<Digest> = params.queries.iter().map(|&q| reference(q, &scale)).collect();
    let env = crate::env::Environment::detect(Some(&device));
    let mut report = Report::new(
        "query",
        "gpu-bdb-style queries (generate, filter, join, group-by, sort), several workers at once",
        env,
    );
    report.param("scale", params.scale);
    report.param("fact_rows", scale.fact);
    report.param("item_rows", scale.items);
    report.param("customer_rows", scale.customers);
    report.param("workers", params.workers);
    report.param("rounds", params.rounds);
    report.param(
        "queries",
        params.queries.iter().map(|q| q.name()).collect::<Vec<_>>().join(","),
    );
    report.columns = vec![
        Column::new("resource", 0),
        Column::new("query", 0),
        Column::new("median ms", 3),
        Column::new("speed-up vs cuMemAlloc", 2),
        Column::new("peak live bytes", 0),
        Column::new("held bytes", 0),
        Column::new("allocations/round", 0),
    ];
    let ctx = device.context()?;
    let mut progress = Progress::new((common.specs.len() * (params.rounds + 1)) as u64, common.quiet);
    let mut runs: Vec<ResourceRun> = Vec::new();
    for spec in &common.specs {
        progress.set_label(format!("{spec}"));
        let used_before = ctx.memory_info()?;
        let built = build(spec, Some(&device))?;
        let tracked = Tracked::new(built.resource.clone());
        let (times, rounds, allocs) = run_suite(&device, &tracked, params, &expected, || progress.inc())?;
        let used_after = ctx.memory_info()?;
        let held = used_before.free as i64 - used_after.free as i64;
        runs.push(ResourceRun {
            label: built.label.clone(),
            times,
            rounds,
            peak_bytes: tracked.stats().peak,
            held_bytes: held,
            allocations_per_round: allocs,
        });
        drop(tracked);
        drop(built);
    }
    progress.finish();
    let baseline = runs
        .iter()
        .find(|r| r.label == ResourceSpec::RawCuda.to_string())
        .cloned();
    let medians = |r: &ResourceRun| -> Vec<f64> { r.times.iter().map(|t| median(t).unwrap_or(f64::NAN)).collect() };
    let base_medians = baseline.as_ref().map(medians);
    let base_round = baseline.as_ref().and_then(|b| median(&b.rounds));
    let mut chart_series = Vec::new();
    for r in &runs {
        let m = medians(r);
        let speedups: Vec<Option<f64>> = m
            .iter()
            .enumerate()
            .map(|(i, t)| base_medians.as_ref().map(|b| b[i] / t))
            .collect();
        for (i, q) in params.queries.iter().enumerate() {
            report.row(vec![
                Cell::from(r.label.as_str()),
                Cell::from(q.name()),
                Cell::from(m[i] * 1e3),
                Cell::from(speedups[i]),
                Cell::from(r.peak_bytes),
                Cell::Int(r.held_bytes),
                Cell::from(r.allocations_per_round),
            ]);
        }
        let gm = geomean(speedups.iter().flatten().copied());
        report.row(vec![
            Cell::from(r.label.as_str()),
            Cell::from("geomean"),
            Cell::from(geomean(m.iter().copied()).map(|v| v * 1e3)),
            Cell::from(gm),
            Cell::from(r.peak_bytes),
            Cell::Int(r.held_bytes),
            Cell::from(r.allocations_per_round),
        ]);
        let round = median(&r.rounds);
        report.row(vec![
            Cell::from(r.label.as_str()),
            Cell::from("round (wall)"),
            Cell::from(round.map(|v| v * 1e3)),
            Cell::from(base_round.zip(round).map(|(b, t)| b / t)),
            Cell::from(r.peak_bytes),
            Cell::Int(r.held_bytes),
            Cell::from(r.allocations_per_round),
        ]);
        let mut values = speedups.clone();
        values.push(gm);
        chart_series.push(Series {
            name: r.label.clone(),
            values,
        });
    }
    report.notes.push(format!(
        "every result was checked against the host's computation of the same query ({} queries x {} workers x {} rounds per resource, plus a warm-up round)",
        params.queries.len(),
        params.workers,
        params.rounds
    ));
    report.notes.push(
        "median ms: one query's wall time on its worker, concurrent with the other workers; speed-up: the \
         cuMemAlloc baseline's median over this resource's; geomean: over the queries; round (wall): every \
         worker running every query once."
            .into(),
    );
    report.notes.push(
        "peak live bytes: most bytes allocated and not yet freed at once; held bytes: device memory in use after \
         the run (resource still alive) minus before it was built (what a pool keeps)."
            .into(),
    );
    report.notes.extend(target_notes(&runs, &base_medians, &medians));
    let mut categories: Vec<String> = params.queries.iter().map(|q| q.name().to_owned()).collect();
    categories.push("geomean".into());
    report.chart = Some(Chart {
        title: "Query suite: speed-up over cuMemAlloc (higher is better)".into(),
        kind: ChartKind::Bars,
        x_label: format!("query (scale {}, {} workers)", params.scale, params.workers),
        y_label: "speed-up over cuMemAlloc".into(),
        categories,
        series: chart_series,
        log_y: false,
    });
    Ok(report)
}
