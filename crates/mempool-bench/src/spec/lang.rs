//! The spec language: what a spec may say ([`ACCEPTED`]), the checked [`ResourceSpec`] and its canonical
//! printing, and the parser and checker ([`parse`], [`parse_list`]) with their [`SpecError`]s.

use std::fmt;

use mempool_rmm::{Reclaim, ServiceOptions};

use crate::units::{parse_size, Size};

/// What a spec may say, shown with every spec error and by `mempool-bench resources`.
pub const ACCEPTED: &str = "\
accepted resource specs (they compose: an UPSTREAM is itself a spec):
  cuda                          cuMemAlloc/cuMemFree through mempool's CudaResource (a free waits for its stream)
  managed                       cuMemAllocManaged (ManagedResource)
  async[(OPTIONS)]              a new driver pool, cuMemAllocFromPoolAsync (AsyncResource); options:
                                  threshold=SIZE|max  release threshold (default max: keep everything, as
                                                      RMM; 0 is the driver's: give unused memory back at
                                                      each synchronize)
                                  initial=SIZE        reserve this much up front
                                  max_size=SIZE       the pool's maximum size
                                  pool=new|default    a new pool (default) or the device's default pool
                                                      (a threshold given is put back on drop)
  async_managed[(OPTIONS)]      managed memory from a stream-ordered pool (AsyncManagedResource, CUDA 13.0
                                and concurrent managed access); options threshold=, initial= and pool= as
                                for async; pool=default is RMM's cuda_async_managed_memory_resource
  system                        malloc'd host memory the GPU reaches by pageable memory access (HMM or ATS;
                                SystemResource)
  sam_headroom(headroom=SIZE)   system memory advised to the GPU while SIZE of its memory stays free, to
                                the host beyond (SamHeadroomResource)
  expandable[(OPTIONS)]         ExpandableResource: one reserved range, chunks mapped on demand (VMM),
                                suballocated as one segment; options: chunk=SIZE (default: recommended
                                granularity, at least 2MiB), reserve=SIZE (default: twice device memory),
                                reclaim=oom|growth (unmap idle chunks only when out of memory, the
                                default, or before every growth)
  service[(OPTIONS)]            ServiceResource (issue 23): one reservation, a region per tag, each suballocated
                                as one segment over chunks mapped where allocations land (VMM); the bench
                                allocates under the default tag; options: chunk=SIZE (default: recommended
                                granularity, at least 2MiB), region=SIZE (address space per tag, default:
                                twice device memory), tags=N (default 8), watermark=PERCENT|oom|growth (unmap
                                idle chunks before a growth that would map more than PERCENT above the peak
                                of live bytes, default 15; oom: only when out of memory; growth: before every
                                growth)
  vmm[(peers=all|none)]         VmmResource: one cuMemCreate allocation mapped per request, as NCCL's
                                ncclMemAlloc does (POSIX fd handles, recommended granularity); peers=all
                                (default) grants every peer-capable device access, none only the owner
  pool(UPSTREAM[,OPTIONS])      PoolResource, coalescing best fit; options: initial=SIZE, max=SIZE|max
  binning(UPSTREAM[,OPTIONS])   BinningResource, power-of-two bins; options: min=SIZE, max=SIZE (powers of
                                two from 256B to 1TiB; defaults 256B and 1MiB), blocks=N (per chunk, default 128)
  arena(UPSTREAM[,OPTIONS])     ArenaResource; options: superblock=SIZE (default 1MiB), initial=SIZE, max=SIZE|max
  fixed(UPSTREAM[,OPTIONS])     FixedSizeResource; options: block=SIZE (default 1MiB), blocks=N (default 128)
  history(UPSTREAM[,capacity=N]) HistoryResource (issue 26): records every allocation and free of UPSTREAM
                                in a bounded ring of N events (default 65536), as the registry's default
                                resource does; `random -r 'pool(async),history(pool(async))'` measures its cost
  cuMemAlloc                    baseline: raw cuMemAlloc/cuMemFree, as RMM's cuda_memory_resource (alias raw-cuda)
  cuMemAllocFromPoolAsync       baseline: raw cuMemAllocFromPoolAsync/cuMemFreeAsync on a pool of its own that
                                keeps its memory (alias raw-pool)
  sim                           host simulation without a GPU: fake addresses, never touched (random, replay)
SIZE: a byte count with an optional unit (B, KiB, MiB, GiB, TiB), e.g. 4096, 64KiB, 1.5GiB; `max` = unlimited.
Lists separate specs with commas: cuda,async(threshold=0),pool(async,initial=1GiB),binning(pool(async)),arena(cuda)";

/// A spec that does not parse or names something unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// The whole spec as given.
    pub spec: String,
    /// Byte offset of the problem in `spec`.
    pub pos: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let caret_at = self.spec[..self.pos.min(self.spec.len())].chars().count();
        writeln!(f, "bad resource spec `{}`: {}", self.spec, self.message)?;
        writeln!(f, "    {}", self.spec)?;
        writeln!(f, "    {}^", " ".repeat(caret_at))?;
        f.write_str(ACCEPTED)
    }
}

impl std::error::Error for SpecError {}

/// Options of a driver pool resource (`async`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncSpec {
    /// Release threshold as given (`u64::MAX` for `max`). `None`: not given, so a new pool keeps
    /// everything (RMM's default, [`ReleaseThreshold::KeepAll`](mempool_rmm::ReleaseThreshold)) and the
    /// default pool keeps whatever it has. `Some(0)` is the driver's own default on a new pool.
    pub threshold: Option<u64>,
    /// Bytes reserved up front.
    pub initial: Option<u64>,
    /// The pool's maximum size.
    pub max_size: Option<u64>,
    /// Use the device's default pool instead of a new one.
    pub default_pool: bool,
}

/// A checked resource spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResourceSpec {
    /// `cuda`: [`CudaResource`](mempool_rmm::CudaResource).
    Cuda,
    /// `managed`: [`ManagedResource`](mempool_rmm::ManagedResource).
    Managed,
    /// `async(...)`: [`AsyncResource`](mempool_rmm::AsyncResource).
    Async(AsyncSpec),
    /// `async_managed(...)`: [`AsyncManagedResource`](mempool_rmm::AsyncManagedResource); `max_size` is
    /// never set (managed pools take none).
    AsyncManaged(AsyncSpec),
    /// `system`: [`SystemResource`](mempool_rmm::SystemResource).
    System,
    /// `sam_headroom(headroom=SIZE)`: [`SamHeadroomResource`](mempool_rmm::SamHeadroomResource).
    SamHeadroom {
        /// Bytes of GPU memory kept free.
        headroom: u64,
    },
    /// `expandable(...)`: [`ExpandableResource`](mempool_rmm::ExpandableResource).
    Expandable {
        /// Chunk size; `None`: the resource's default.
        chunk: Option<u64>,
        /// Reserved address range; `None`: the resource's default.
        reserve: Option<u64>,
        /// `reclaim=growth`: unmap idle chunks before every growth ([`mempool_rmm::Reclaim::BeforeGrowth`]);
        /// `false` (`reclaim=oom`, the default): only when out of memory.
        reclaim_before_growth: bool,
    },
    /// `service(...)`: [`ServiceResource`](mempool_rmm::ServiceResource), allocating under its default tag.
    Service {
        /// Chunk size; `None`: the resource's default.
        chunk: Option<u64>,
        /// Address space per tag; `None`: the resource's default.
        region: Option<u64>,
        /// How many tags the resource can have ([`ServiceOptions::max_tags`]); default 8.
        tags: u64,
        /// When idle chunks are unmapped (`watermark=`); default [`ServiceOptions::DEFAULT_RECLAIM`].
        reclaim: Reclaim,
    },
    /// `vmm[(peers=all|none)]`: [`VmmResource`](mempool_rmm::VmmResource).
    Vmm {
        /// `peers=none`: only the owning device has access; `false` (`peers=all`, the default): every
        /// peer-capable device.
        owner_only: bool,
    },
    /// `pool(UPSTREAM, ...)`: [`PoolResource`](mempool_rmm::PoolResource).
    Pool {
        /// The upstream.
        upstream: Box<ResourceSpec>,
        /// Initial reservation.
        initial: u64,
        /// Maximum size.
        max: Option<u64>,
    },
    /// `binning(UPSTREAM, ...)`: [`BinningResource`](mempool_rmm::BinningResource).
    Binning {
        /// The upstream.
        upstream: Box<ResourceSpec>,
        /// Smallest bin, a power of two.
        min: u64,
        /// Largest bin, a power of two.
        max: u64,
        /// Blocks per upstream chunk.
        blocks: u64,
    },
    /// `arena(UPSTREAM, ...)`: [`ArenaResource`](mempool_rmm::ArenaResource).
    Arena {
        /// The upstream.
        upstream: Box<ResourceSpec>,
        /// Superblock size.
        superblock: u64,
        /// Initial reservation of the global arena.
        initial: u64,
        /// Maximum size of the global arena.
        max: Option<u64>,
    },
    /// `fixed(UPSTREAM, ...)`: [`FixedSizeResource`](mempool_rmm::FixedSizeResource).
    Fixed {
        /// The upstream.
        upstream: Box<ResourceSpec>,
        /// Block size.
        block: u64,
        /// Blocks per upstream chunk.
        blocks: u64,
    },
    /// `history(UPSTREAM, capacity=N)`: [`HistoryResource`](mempool_rmm::observe::HistoryResource).
    History {
        /// The upstream.
        upstream: Box<ResourceSpec>,
        /// Events kept.
        capacity: u64,
    },
    /// `cuMemAlloc`: the raw baseline.
    RawCuda,
    /// `cuMemAllocFromPoolAsync`: the raw pool baseline.
    RawPool,
    /// `sim`: host simulation.
    Sim,
}

/// The default capacity of a `history` spec, as `mempool_rmm::observe::DEFAULT_CAPACITY`.
const HISTORY_CAPACITY: u64 = mempool_rmm::observe::DEFAULT_CAPACITY as u64;

// The defaults of mempool-rmm's `BinningOptions`, spelled out so specs print them the same way.
const BIN_MIN: u64 = 256;
const BIN_MAX: u64 = 1 << 20;
const BIN_BLOCKS: u64 = 128;

/// The default tag count of a `service` spec, as `ServiceOptions::default().max_tags`.
const SERVICE_TAGS: u64 = 8;
/// The largest watermark a `service` spec takes, as `ServiceResource::new` checks it.
const MAX_WATERMARK: u32 = 10_000;

impl ResourceSpec {
    /// Whether this is one of the raw baselines.
    pub fn is_baseline(&self) -> bool {
        matches!(self, ResourceSpec::RawCuda | ResourceSpec::RawPool)
    }

    /// Whether it can run without a GPU.
    pub fn is_host_only(&self) -> bool {
        match self {
            ResourceSpec::Sim => true,
            ResourceSpec::History { upstream, .. } => upstream.is_host_only(),
            _ => false,
        }
    }
}

impl fmt::Display for ResourceSpec {
    /// The canonical spec: parses back to the same value, options left out where they are defaults.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        /// `name`, or `name(upstream,key=value,...)` with the options that are set (`Some`); no
        /// parentheses when there is nothing to put in them.
        fn args(
            f: &mut fmt::Formatter<'_>,
            name: &str,
            upstream: Option<&ResourceSpec>,
            options: &[(&str, Option<String>)],
        ) -> fmt::Result {
            let items: Vec<String> = upstream
                .map(ToString::to_string)
                .into_iter()
                .chain(
                    options
                        .iter()
                        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}"))),
                )
                .collect();
            if items.is_empty() {
                f.write_str(name)
            } else {
                write!(f, "{name}({})", items.join(","))
            }
        }
        /// A size option, set unless it is `default`.
        fn size(value: u64, default: u64) -> Option<String> {
            (value != default).then(|| Size(value).to_string())
        }
        /// An optional size option (`max`), set when given.
        fn limit(value: Option<u64>) -> Option<String> {
            value.map(|v| Size(v).to_string())
        }
        match self {
            ResourceSpec::Cuda => f.write_str("cuda"),
            ResourceSpec::Managed => f.write_str("managed"),
            ResourceSpec::RawCuda => f.write_str("cuMemAlloc"),
            ResourceSpec::RawPool => f.write_str("cuMemAllocFromPoolAsync"),
            ResourceSpec::Sim => f.write_str("sim"),
            ResourceSpec::Async(a) | ResourceSpec::AsyncManaged(a) => args(
                f,
                if matches!(self, ResourceSpec::Async(_)) {
                    "async"
                } else {
                    "async_managed"
                },
                None,
                &[
                    ("threshold", limit(a.threshold)),
                    ("initial", limit(a.initial)),
                    ("max_size", limit(a.max_size)),
                    ("pool", a.default_pool.then(|| "default".to_owned())),
                ],
            ),
            ResourceSpec::System => f.write_str("system"),
            ResourceSpec::SamHeadroom { headroom } => args(
                f,
                "sam_headroom",
                None,
                &[("headroom", Some(Size(*headroom).to_string()))],
            ),
            ResourceSpec::Expandable {
                chunk,
                reserve,
                reclaim_before_growth,
            } => args(
                f,
                "expandable",
                None,
                &[
                    ("chunk", limit(*chunk)),
                    ("reserve", limit(*reserve)),
                    ("reclaim", reclaim_before_growth.then(|| "growth".to_owned())),
                ],
            ),
            ResourceSpec::Service {
                chunk,
                region,
                tags,
                reclaim,
            } => args(
                f,
                "service",
                None,
                &[
                    ("chunk", limit(*chunk)),
                    ("region", limit(*region)),
                    ("tags", (*tags != SERVICE_TAGS).then(|| tags.to_string())),
                    (
                        "watermark",
                        (*reclaim != ServiceOptions::DEFAULT_RECLAIM).then(|| match reclaim {
                            Reclaim::Watermark { percent } => percent.to_string(),
                            Reclaim::OnOutOfMemory => "oom".to_owned(),
                            Reclaim::BeforeGrowth => "growth".to_owned(),
                        }),
                    ),
                ],
            ),
            ResourceSpec::Vmm { owner_only } => {
                args(f, "vmm", None, &[("peers", owner_only.then(|| "none".to_owned()))])
            }
            ResourceSpec::History { upstream, capacity } => args(
                f,
                "history",
                Some(upstream),
                &[(
                    "capacity",
                    (*capacity != HISTORY_CAPACITY).then(|| capacity.to_string()),
                )],
            ),
            ResourceSpec::Pool { upstream, initial, max } => args(
                f,
                "pool",
                Some(upstream),
                &[("initial", size(*initial, 0)), ("max", limit(*max))],
            ),
            ResourceSpec::Binning {
                upstream,
                min,
                max,
                blocks,
            } => args(
                f,
                "binning",
                Some(upstream),
                &[
                    ("min", size(*min, BIN_MIN)),
                    ("max", size(*max, BIN_MAX)),
                    ("blocks", (*blocks != BIN_BLOCKS).then(|| blocks.to_string())),
                ],
            ),
            ResourceSpec::Arena {
                upstream,
                superblock,
                initial,
                max,
            } => args(
                f,
                "arena",
                Some(upstream),
                &[
                    ("superblock", size(*superblock, 1 << 20)),
                    ("initial", size(*initial, 0)),
                    ("max", limit(*max)),
                ],
            ),
            ResourceSpec::Fixed {
                upstream,
                block,
                blocks,
            } => args(
                f,
                "fixed",
                Some(upstream),
                &[
                    ("block", size(*block, 1 << 20)),
                    ("blocks", (*blocks != 128).then(|| blocks.to_string())),
                ],
            ),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Syntax

#[derive(Debug)]
struct Node {
    name: String,
    pos: usize,
    items: Vec<Item>,
    /// Whether the name was followed by parentheses.
    parens: bool,
}

#[derive(Debug)]
enum Item {
    Resource(Node),
    Option { key: String, value: String, pos: usize },
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, pos: usize, message: impl Into<String>) -> SpecError {
        SpecError {
            spec: self.text.to_owned(),
            pos,
            message: message.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn word(&mut self) -> &'a str {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '%'))
        {
            self.pos += 1;
        }
        &self.text[start..self.pos]
    }

    fn node(&mut self) -> Result<Node, SpecError> {
        self.skip_ws();
        let pos = self.pos;
        let name = self.word();
        if name.is_empty() {
            return Err(match self.peek() {
                None => self.err(pos, "expected a resource name, found the end"),
                Some(c) => self.err(pos, format!("expected a resource name, found `{c}`")),
            });
        }
        let mut node = Node {
            name: name.to_owned(),
            pos,
            items: Vec::new(),
            parens: false,
        };
        self.skip_ws();
        if self.peek() == Some('(') {
            node.parens = true;
            self.pos += 1;
            self.skip_ws();
            if self.peek() == Some(')') {
                self.pos += 1;
                return Ok(node);
            }
            loop {
                self.skip_ws();
                let item_pos = self.pos;
                let save = self.pos;
                let word = self.word();
                self.skip_ws();
                if !word.is_empty() && self.peek() == Some('=') {
                    self.pos += 1;
                    self.skip_ws();
                    let value_pos = self.pos;
                    let value = self.word();
                    if value.is_empty() {
                        return Err(self.err(value_pos, format!("expected a value for `{word}`")));
                    }
                    node.items.push(Item::Option {
                        key: word.to_owned(),
                        value: value.to_owned(),
                        pos: item_pos,
                    });
                } else {
                    self.pos = save;
                    node.items.push(Item::Resource(self.node()?));
                }
                self.skip_ws();
                match self.peek() {
                    Some(',') => self.pos += 1,
                    Some(')') => {
                        self.pos += 1;
                        break;
                    }
                    None => return Err(self.err(self.pos, "expected `,` or `)`, found the end")),
                    Some(c) => return Err(self.err(self.pos, format!("expected `,` or `)`, found `{c}`"))),
                }
            }
        }
        Ok(node)
    }
}

// ------------------------------------------------------------------------------------------------
// Meaning

/// An option of a spec: key, value, and the key's position.
type OptionItem<'n> = (&'n str, &'n str, usize);

struct Checker<'a> {
    text: &'a str,
}

impl Checker<'_> {
    fn err(&self, pos: usize, message: impl Into<String>) -> SpecError {
        SpecError {
            spec: self.text.to_owned(),
            pos,
            message: message.into(),
        }
    }

    fn size(&self, value: &str, pos: usize, key: &str) -> Result<u64, SpecError> {
        parse_size(value).map_err(|e| self.err(pos, format!("{key}: {e}")))
    }

    fn limit(&self, value: &str, pos: usize, key: &str) -> Result<Option<u64>, SpecError> {
        let v = self.size(value, pos, key)?;
        Ok((v != u64::MAX).then_some(v))
    }

    fn count(&self, value: &str, pos: usize, key: &str) -> Result<u64, SpecError> {
        match value.parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(self.err(pos, format!("{key}: expected a positive whole number, found `{value}`"))),
        }
    }

    fn pow2(&self, value: &str, pos: usize, key: &str) -> Result<u64, SpecError> {
        let v = self.size(value, pos, key)?;
        if !v.is_power_of_two() || !(256..=1 << 40).contains(&v) {
            return Err(self.err(
                pos,
                format!("{key}: a bin size must be a power of two from 256B to 1TiB, found `{value}`"),
            ));
        }
        Ok(v)
    }

    /// Splits a suballocator's items into its upstream and its options.
    fn upstream_and_options<'n>(
        &self,
        node: &'n Node,
        keys: &[&str],
    ) -> Result<(ResourceSpec, Vec<OptionItem<'n>>), SpecError> {
        let mut upstream = None;
        let mut options = Vec::new();
        for (i, item) in node.items.iter().enumerate() {
            match item {
                Item::Resource(r) if i == 0 => upstream = Some(self.resource(r)?),
                Item::Resource(r) => {
                    return Err(self.err(
                        r.pos,
                        format!("`{}` takes one upstream resource, as its first argument", node.name),
                    ))
                }
                Item::Option { key, value, pos } => {
                    if !keys.contains(&key.as_str()) {
                        return Err(self.err(
                            *pos,
                            format!(
                                "`{}` has no option `{key}` (its options: {})",
                                node.name,
                                keys.join(", ")
                            ),
                        ));
                    }
                    if options.iter().any(|(k, _, _)| k == key) {
                        return Err(self.err(*pos, format!("option `{key}` given twice")));
                    }
                    options.push((key.as_str(), value.as_str(), *pos));
                }
            }
        }
        let upstream = upstream.ok_or_else(|| {
            self.err(
                node.pos,
                format!(
                    "`{}` needs an upstream resource as its first argument, e.g. `{}(async)`",
                    node.name, node.name
                ),
            )
        })?;
        if upstream.is_host_only() {
            return Err(self.err(
                node.pos,
                "`sim` cannot be an upstream: suballocators need a GPU context",
            ));
        }
        Ok((upstream, options))
    }

    /// The options of a driver pool resource (`async`, `async_managed`), of which `keys` are allowed.
    fn pool_options(&self, node: &Node, keys: &[&str]) -> Result<AsyncSpec, SpecError> {
        let name = node.name.as_str();
        let mut a = AsyncSpec::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in &node.items {
            match item {
                Item::Resource(r) => {
                    return Err(self.err(
                        r.pos,
                        format!("`{name}` takes options only, no upstream (it is the driver)"),
                    ))
                }
                Item::Option { key, value, pos } => {
                    if seen.contains(&key.as_str()) {
                        return Err(self.err(*pos, format!("option `{key}` given twice")));
                    }
                    seen.push(key);
                    if !keys.contains(&key.as_str()) {
                        return Err(self.err(
                            *pos,
                            format!("`{name}` has no option `{key}` (its options: {})", keys.join(", ")),
                        ));
                    }
                    match key.as_str() {
                        "threshold" => a.threshold = Some(self.size(value, *pos, key)?),
                        "initial" => a.initial = Some(self.size(value, *pos, key)?),
                        "max_size" => a.max_size = self.limit(value, *pos, key)?,
                        "pool" => {
                            a.default_pool = match value.as_str() {
                                "new" => false,
                                "default" => true,
                                _ => {
                                    return Err(
                                        self.err(*pos, format!("pool: expected `new` or `default`, found `{value}`"))
                                    )
                                }
                            }
                        }
                        _ => unreachable!("checked against `keys` above"),
                    }
                }
            }
        }
        if a.default_pool && (a.initial.is_some() || a.max_size.is_some()) {
            return Err(self.err(
                node.pos,
                format!("`{name}(pool=default)` takes only `threshold`: the default pool exists already"),
            ));
        }
        Ok(a)
    }

    /// `service(chunk=SIZE,region=SIZE,tags=N,watermark=PERCENT|oom|growth)`.
    fn service(&self, node: &Node) -> Result<ResourceSpec, SpecError> {
        const KEYS: &str = "chunk, region, tags, watermark";
        let (mut chunk, mut region, mut tags, mut reclaim) = (None, None, None, None);
        let mut seen: Vec<&str> = Vec::new();
        for item in &node.items {
            let (key, value, pos) = match item {
                Item::Option { key, value, pos } => (key.as_str(), value.as_str(), *pos),
                Item::Resource(r) => {
                    return Err(self.err(
                        r.pos,
                        "`service` takes options only, no upstream (it maps physical memory itself)",
                    ))
                }
            };
            if !["chunk", "region", "tags", "watermark"].contains(&key) {
                return Err(self.err(pos, format!("`service` has no option `{key}` (its options: {KEYS})")));
            }
            if seen.contains(&key) {
                return Err(self.err(pos, format!("option `{key}` given twice")));
            }
            seen.push(key);
            match key {
                "chunk" | "region" => {
                    let v = self.size(value, pos, key)?;
                    if v == 0 || v == u64::MAX {
                        return Err(self.err(pos, format!("`service`: {key} must be a size above 0, found `{value}`")));
                    }
                    *(if key == "chunk" { &mut chunk } else { &mut region }) = Some(v);
                }
                "tags" => {
                    let n = self.count(value, pos, key)?;
                    if n > u64::from(u32::MAX) {
                        return Err(self.err(pos, format!("tags: at most {} tags, found `{value}`", u32::MAX)));
                    }
                    tags = Some(n);
                }
                _ => {
                    reclaim = Some(match value {
                        "oom" => Reclaim::OnOutOfMemory,
                        "growth" => Reclaim::BeforeGrowth,
                        _ => match value.strip_suffix('%').unwrap_or(value).parse::<u32>() {
                            Ok(percent) if percent <= MAX_WATERMARK => Reclaim::Watermark { percent },
                            _ => {
                                return Err(self.err(
                                    pos,
                                    format!(
                                        "watermark: expected a percentage from 0 to {MAX_WATERMARK} (e.g. 15), \
                                         `oom` or `growth`, found `{value}`"
                                    ),
                                ))
                            }
                        },
                    });
                }
            }
        }
        Ok(ResourceSpec::Service {
            chunk,
            region,
            tags: tags.unwrap_or(SERVICE_TAGS),
            reclaim: reclaim.unwrap_or(ServiceOptions::DEFAULT_RECLAIM),
        })
    }

    fn no_args(&self, node: &Node) -> Result<(), SpecError> {
        if node.parens && !node.items.is_empty() {
            return Err(self.err(node.pos, format!("`{}` takes no arguments", node.name)));
        }
        Ok(())
    }

    fn resource(&self, node: &Node) -> Result<ResourceSpec, SpecError> {
        let spec = match node.name.as_str() {
            "cuda" => {
                self.no_args(node)?;
                ResourceSpec::Cuda
            }
            "managed" => {
                self.no_args(node)?;
                ResourceSpec::Managed
            }
            "cuMemAlloc" | "raw-cuda" => {
                self.no_args(node)?;
                ResourceSpec::RawCuda
            }
            "cuMemAllocFromPoolAsync" | "raw-pool" => {
                self.no_args(node)?;
                ResourceSpec::RawPool
            }
            "sim" => {
                self.no_args(node)?;
                ResourceSpec::Sim
            }
            "async" => ResourceSpec::Async(self.pool_options(node, &["threshold", "initial", "max_size", "pool"])?),
            "async_managed" => ResourceSpec::AsyncManaged(self.pool_options(node, &["threshold", "initial", "pool"])?),
            "system" => {
                self.no_args(node)?;
                ResourceSpec::System
            }
            "sam_headroom" => {
                let mut headroom = None;
                for item in &node.items {
                    match item {
                        Item::Option { key, value, pos } if key == "headroom" => {
                            if headroom.is_some() {
                                return Err(self.err(*pos, "option `headroom` given twice"));
                            }
                            headroom = Some(self.size(value, *pos, key)?);
                        }
                        Item::Option { key, pos, .. } => {
                            return Err(self.err(
                                *pos,
                                format!("`sam_headroom` has no option `{key}` (its option: headroom)"),
                            ))
                        }
                        Item::Resource(r) => {
                            return Err(self.err(
                                r.pos,
                                "`sam_headroom` takes options only, no upstream (it is system memory)",
                            ))
                        }
                    }
                }
                let headroom = headroom.ok_or_else(|| {
                    self.err(
                        node.pos,
                        "`sam_headroom` needs `headroom=SIZE`: the GPU memory to keep free",
                    )
                })?;
                ResourceSpec::SamHeadroom { headroom }
            }
            "expandable" => {
                let (mut chunk, mut reserve, mut reclaim) = (None, None, None);
                for item in &node.items {
                    match item {
                        Item::Option { key, value, pos } if key == "reclaim" => {
                            if reclaim.is_some() {
                                return Err(self.err(*pos, "option `reclaim` given twice"));
                            }
                            reclaim = Some(match value.as_str() {
                                "oom" => false,
                                "growth" => true,
                                _ => {
                                    return Err(self.err(
                                        *pos,
                                        format!("reclaim: expected `oom` or `growth`, found `{value}`"),
                                    ))
                                }
                            });
                        }
                        Item::Option { key, value, pos } if key == "chunk" || key == "reserve" => {
                            let slot = if key == "chunk" { &mut chunk } else { &mut reserve };
                            if slot.is_some() {
                                return Err(self.err(*pos, format!("option `{key}` given twice")));
                            }
                            let v = self.size(value, *pos, key)?;
                            if v == 0 {
                                return Err(self.err(*pos, format!("`expandable`: {key} must not be 0")));
                            }
                            *slot = Some(v);
                        }
                        Item::Option { key, pos, .. } => {
                            return Err(self.err(
                                *pos,
                                format!("`expandable` has no option `{key}` (its options: chunk, reserve, reclaim)"),
                            ))
                        }
                        Item::Resource(r) => {
                            return Err(self.err(
                                r.pos,
                                "`expandable` takes options only, no upstream (it maps physical memory itself)",
                            ))
                        }
                    }
                }
                ResourceSpec::Expandable {
                    chunk,
                    reserve,
                    reclaim_before_growth: reclaim.unwrap_or(false),
                }
            }
            "service" => self.service(node)?,
            "vmm" => {
                let mut owner_only = None;
                for item in &node.items {
                    match item {
                        Item::Option { key, value, pos } if key == "peers" => {
                            if owner_only.is_some() {
                                return Err(self.err(*pos, "option `peers` given twice"));
                            }
                            owner_only = Some(match value.as_str() {
                                "all" => false,
                                "none" => true,
                                _ => {
                                    return Err(self.err(
                                        *pos,
                                        format!("peers: expected `all` or `none`, found `{value}`"),
                                    ))
                                }
                            });
                        }
                        Item::Option { key, pos, .. } => {
                            return Err(self.err(*pos, format!("`vmm` has no option `{key}` (its option: peers)")))
                        }
                        Item::Resource(r) => {
                            return Err(self.err(
                                r.pos,
                                "`vmm` takes options only, no upstream (it maps physical memory itself)",
                            ))
                        }
                    }
                }
                ResourceSpec::Vmm {
                    owner_only: owner_only.unwrap_or(false),
                }
            }
            "pool" => {
                let (upstream, opts) = self.upstream_and_options(node, &["initial", "max"])?;
                let (mut initial, mut max) = (0, None);
                for (k, v, pos) in opts {
                    match k {
                        "initial" => initial = self.size(v, pos, k)?,
                        _ => max = self.limit(v, pos, k)?,
                    }
                }
                if max.is_some_and(|m| m < initial) {
                    return Err(self.err(node.pos, "`pool`: initial is larger than max"));
                }
                ResourceSpec::Pool {
                    upstream: Box::new(upstream),
                    initial,
                    max,
                }
            }
            "history" => {
                // An adaptor, not a suballocator: `sim` is a fine upstream (the host can measure it).
                let mut upstream = None;
                let mut capacity = HISTORY_CAPACITY;
                for (i, item) in node.items.iter().enumerate() {
                    match item {
                        Item::Resource(r) if i == 0 => upstream = Some(self.resource(r)?),
                        Item::Resource(r) => {
                            return Err(self.err(r.pos, "`history` takes one upstream resource, as its first argument"))
                        }
                        Item::Option { key, value, pos } if key == "capacity" => {
                            capacity = self.count(value, *pos, key)?
                        }
                        Item::Option { key, pos, .. } => {
                            return Err(self.err(*pos, format!("`history` has no option `{key}` (its options: capacity)")))
                        }
                    }
                }
                let upstream = upstream.ok_or_else(|| {
                    self.err(
                        node.pos,
                        "`history` needs an upstream resource as its first argument, e.g. `history(pool(async))`",
                    )
                })?;
                ResourceSpec::History {
                    upstream: Box::new(upstream),
                    capacity,
                }
            }
            "binning" => {
                let (upstream, opts) = self.upstream_and_options(node, &["min", "max", "blocks"])?;
                let (mut min, mut max, mut blocks) = (BIN_MIN, BIN_MAX, BIN_BLOCKS);
                for (k, v, pos) in opts {
                    match k {
                        "min" => min = self.pow2(v, pos, k)?,
                        "max" => max = self.pow2(v, pos, k)?,
                        _ => blocks = self.count(v, pos, k)?,
                    }
                }
                if min > max {
                    return Err(self.err(node.pos, "`binning`: min is larger than max"));
                }
                ResourceSpec::Binning {
                    upstream: Box::new(upstream),
                    min,
                    max,
                    blocks,
                }
            }
            "arena" => {
                let (upstream, opts) = self.upstream_and_options(node, &["superblock", "initial", "max"])?;
                let (mut superblock, mut initial, mut max) = (1u64 << 20, 0, None);
                for (k, v, pos) in opts {
                    match k {
                        "superblock" => superblock = self.size(v, pos, k)?.max(1),
                        "initial" => initial = self.size(v, pos, k)?,
                        _ => max = self.limit(v, pos, k)?,
                    }
                }
                ResourceSpec::Arena {
                    upstream: Box::new(upstream),
                    superblock,
                    initial,
                    max,
                }
            }
            "fixed" => {
                let (upstream, opts) = self.upstream_and_options(node, &["block", "blocks"])?;
                let (mut block, mut blocks) = (1u64 << 20, 128);
                for (k, v, pos) in opts {
                    match k {
                        "block" => block = self.size(v, pos, k)?.max(1),
                        _ => blocks = self.count(v, pos, k)?,
                    }
                }
                ResourceSpec::Fixed {
                    upstream: Box::new(upstream),
                    block,
                    blocks,
                }
            }
            other => {
                return Err(self.err(
                    node.pos,
                    format!(
                        "unknown resource `{other}` (known: cuda, managed, async, async_managed, system, \
                         sam_headroom, expandable, service, vmm, pool, binning, arena, fixed, history, cuMemAlloc, cuMemAllocFromPoolAsync, sim)"
                    ),
                ))
            }
        };
        Ok(spec)
    }
}

/// Parses and checks one spec.
///
/// ```
/// use mempool_bench::spec::parse;
/// let s = parse("pool( async , initial=1GiB)").unwrap();
/// assert_eq!(s.to_string(), "pool(async,initial=1GiB)");
/// let e = parse("pool(asink)").unwrap_err();
/// assert!(e.to_string().contains("unknown resource `asink`"));
/// ```
pub fn parse(text: &str) -> Result<ResourceSpec, SpecError> {
    let mut p = Parser { text, pos: 0 };
    let node = p.node()?;
    p.skip_ws();
    if let Some(c) = p.peek() {
        return Err(p.err(
            p.pos,
            format!("unexpected `{c}` after the spec (separate several specs with commas)"),
        ));
    }
    Checker { text }.resource(&node)
}

/// Splits a comma-separated list of specs at the commas outside parentheses and parses each.
///
/// ```
/// use mempool_bench::spec::parse_list;
/// let specs = parse_list("cuda, pool(async,initial=1GiB),binning(pool(async))").unwrap();
/// assert_eq!(specs.len(), 3);
/// ```
pub fn parse_list(text: &str) -> Result<Vec<ResourceSpec>, SpecError> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push((start, &text[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push((start, &text[start..]));
    for (offset, part) in parts {
        if part.trim().is_empty() {
            return Err(SpecError {
                spec: text.to_owned(),
                pos: offset,
                message: "empty spec in the list".into(),
            });
        }
        out.push(parse(part).map_err(|e| SpecError {
            spec: text.to_owned(),
            pos: offset + e.pos,
            message: e.message,
        })?);
    }
    Ok(out)
}
