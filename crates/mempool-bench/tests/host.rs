//! Host tests: everything that needs no GPU (CI has none). Spec parsing, report writing, the replay
//! parser and the host-simulated workloads, and the binary's behaviour without a driver.

use std::process::Command;

use mempool_bench::env::Environment;
use mempool_bench::kernels::{check_ptx, hash2, mix32};
use mempool_bench::report::{geomean, median, Cell, Chart, ChartKind, Column, Report, Series};
use mempool_bench::spec::{build, parse, parse_list, AsyncSpec, ResourceSpec, ACCEPTED};
use mempool_bench::workloads::query::{reference, Digest, Query, Scale};
use mempool_bench::workloads::random::{generate, run, Op, Point, STANDARD_POINTS};
use mempool_bench::workloads::replay::{self, Step};
use mempool_bench::Error;
use mempool_rmm::testing::SimResource;

mod common;

// ---------------------------------------------------------------------------------------------------
// Specs

#[test]
fn specs_parse_to_their_canonical_form() {
    let cases = [
        ("cuda", "cuda"),
        ("async", "async"),
        ("async()", "async"),
        ("async(threshold=max)", "async(threshold=max)"),
        // The driver's default threshold, now that `async` keeps everything as RMM's resource does.
        ("async(threshold=0)", "async(threshold=0B)"),
        ("async_managed", "async_managed"),
        (
            "async_managed(pool=default, threshold=0)",
            "async_managed(threshold=0B,pool=default)",
        ),
        ("async_managed(initial=1GiB)", "async_managed(initial=1GiB)"),
        ("system", "system"),
        ("sam_headroom(headroom=1GiB)", "sam_headroom(headroom=1GiB)"),
        ("sam_headroom( headroom = 0 )", "sam_headroom(headroom=0B)"),
        ("binning(async,max=4MiB)", "binning(async,max=4MiB)"),
        ("pool(system)", "pool(system)"),
        (
            "async( threshold = 1GiB , initial=256MiB )",
            "async(threshold=1GiB,initial=256MiB)",
        ),
        ("async(pool=default,threshold=0)", "async(threshold=0B,pool=default)"),
        ("pool(async,initial=1GiB)", "pool(async,initial=1GiB)"),
        ("pool(async,initial=1GiB,max=max)", "pool(async,initial=1GiB)"),
        ("pool(cuda,max=8GiB)", "pool(cuda,max=8GiB)"),
        ("binning(pool(async))", "binning(pool(async))"),
        (
            "binning(async,min=512B,max=4MiB,blocks=64)",
            "binning(async,min=512B,max=4MiB,blocks=64)",
        ),
        ("binning(async,min=256,max=1MiB,blocks=128)", "binning(async)"),
        ("arena(cuda)", "arena(cuda)"),
        (
            "arena(async(threshold=max),superblock=4MiB)",
            "arena(async(threshold=max),superblock=4MiB)",
        ),
        ("fixed(async,block=64KiB)", "fixed(async,block=64KiB)"),
        ("managed", "managed"),
        ("raw-cuda", "cuMemAlloc"),
        ("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync"),
        ("sim", "sim"),
        ("expandable", "expandable"),
        ("expandable()", "expandable"),
        (
            "expandable(reserve=64GiB, chunk=2MiB)",
            "expandable(chunk=2MiB,reserve=64GiB)",
        ),
        ("expandable(reclaim=oom)", "expandable"),
        ("expandable(reclaim=growth)", "expandable(reclaim=growth)"),
        ("service", "service"),
        ("service()", "service"),
        ("service(watermark=15)", "service"),
        ("service(watermark=10)", "service(watermark=10)"),
        ("service(watermark=10%)", "service(watermark=10)"),
        ("service(watermark=0)", "service(watermark=0)"),
        ("service(watermark=oom)", "service(watermark=oom)"),
        ("service(watermark=growth)", "service(watermark=growth)"),
        ("service(tags=8)", "service"),
        (
            "service( watermark=growth, tags=2, region=64GiB, chunk=4MiB )",
            "service(chunk=4MiB,region=64GiB,tags=2,watermark=growth)",
        ),
        ("vmm", "vmm"),
        ("vmm(peers=all)", "vmm"),
        ("vmm(peers=none)", "vmm(peers=none)"),
        ("pool(vmm,initial=1GiB)", "pool(vmm,initial=1GiB)"),
    ];
    for (text, canonical) in cases {
        let spec = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(spec.to_string(), canonical, "{text}");
        assert_eq!(parse(canonical).unwrap(), spec, "{canonical} round-trips");
    }
    assert_eq!(
        parse("pool(async(threshold=max),initial=1GiB)").unwrap(),
        ResourceSpec::Pool {
            upstream: Box::new(ResourceSpec::Async(AsyncSpec {
                threshold: Some(u64::MAX),
                ..Default::default()
            })),
            initial: 1 << 30,
            max: None,
        }
    );
}

#[test]
fn bad_specs_say_where_and_what_is_accepted() {
    let cases = [
        ("", 0, "expected a resource name"),
        ("asink", 0, "unknown resource `asink`"),
        ("pool(asink)", 5, "unknown resource `asink`"),
        ("pool", 0, "needs an upstream"),
        ("pool()", 0, "needs an upstream"),
        ("pool(async,initial=lots)", 11, "initial: bad size `lots`"),
        (
            "pool(async,intial=1GiB)",
            11,
            "no option `intial` (its options: initial, max)",
        ),
        ("pool(async,initial=1GiB,initial=2GiB)", 24, "given twice"),
        ("pool(async,cuda)", 11, "one upstream"),
        ("pool(async,initial=2GiB,max=1GiB)", 0, "initial is larger than max"),
        ("pool(async", 10, "expected `,` or `)`, found the end"),
        ("pool(async))", 11, "unexpected `)`"),
        ("pool(async initial=1GiB)", 11, "expected `,` or `)`"),
        ("async(cuda)", 6, "options only"),
        ("async(threshold=)", 16, "expected a value"),
        ("async(threshold=1GiB,threshold=1GiB)", 21, "given twice"),
        ("async(pool=mine)", 6, "expected `new` or `default`"),
        ("async(pool=default,initial=1GiB)", 0, "takes only `threshold`"),
        ("async(depth=3)", 6, "no option `depth`"),
        ("cuda(threshold=max)", 0, "takes no arguments"),
        ("binning(async,min=300)", 14, "power of two"),
        ("binning(async,min=1MiB,max=4KiB)", 0, "min is larger than max"),
        ("binning(async,blocks=0)", 14, "positive whole number"),
        ("pool(sim)", 0, "cannot be an upstream"),
        ("pool(async,initial=1.5)", 11, "bad size"),
        ("async_managed(max_size=1GiB)", 14, "no option `max_size`"),
        ("async_managed(cuda)", 14, "options only"),
        ("async_managed(pool=default,initial=1GiB)", 0, "takes only `threshold`"),
        ("system(headroom=1GiB)", 0, "takes no arguments"),
        ("sam_headroom", 0, "needs `headroom=SIZE`"),
        ("sam_headroom(headroom=lots)", 13, "headroom: bad size"),
        ("sam_headroom(margin=1GiB)", 13, "no option `margin`"),
        ("sam_headroom(async)", 13, "options only"),
        ("sam_headroom(headroom=1GiB,headroom=2GiB)", 27, "given twice"),
        ("expandable(async)", 11, "options only"),
        (
            "expandable(size=1GiB)",
            11,
            "no option `size` (its options: chunk, reserve, reclaim)",
        ),
        ("expandable(reclaim=never)", 11, "expected `oom` or `growth`"),
        ("expandable(chunk=0)", 11, "chunk must not be 0"),
        ("expandable(chunk=2MiB,chunk=4MiB)", 22, "given twice"),
        ("service(async)", 8, "options only"),
        (
            "service(reserve=1GiB)",
            8,
            "no option `reserve` (its options: chunk, region, tags, watermark)",
        ),
        ("service(watermark=never)", 8, "expected a percentage from 0 to 10000"),
        ("service(watermark=10001)", 8, "expected a percentage"),
        ("service(watermark=-5)", 8, "expected a percentage"),
        ("service(watermark=1.5)", 8, "expected a percentage"),
        ("service(chunk=0)", 8, "chunk must be a size above 0"),
        ("service(region=max)", 8, "region must be a size above 0"),
        ("service(region=lots)", 8, "region: bad size"),
        ("service(tags=0)", 8, "tags: expected a positive whole number"),
        ("service(tags=4294967296)", 8, "at most 4294967295 tags"),
        ("service(tags=2,tags=4)", 15, "given twice"),
        ("service(watermark=oom,watermark=10)", 22, "given twice"),
        ("vmm(async)", 4, "options only"),
        ("vmm(peers=some)", 4, "expected `all` or `none`"),
        ("vmm(size=1GiB)", 4, "no option `size`"),
        ("vmm(peers=all,peers=none)", 14, "given twice"),
    ];
    for (text, pos, what) in cases {
        let e = parse(text).unwrap_err();
        assert_eq!(e.pos, pos, "{text:?}: {e}");
        assert!(e.message.contains(what), "{text:?}: {}", e.message);
        let shown = e.to_string();
        assert!(shown.contains(ACCEPTED), "{text:?}: the error lists what is accepted");
        // The caret line points under the offending character.
        let caret = shown.lines().nth(2).unwrap();
        assert_eq!(
            caret.find('^'),
            Some(4 + text[..pos].chars().count()),
            "{text:?}\n{shown}"
        );
    }
    for name in [
        "cuda",
        "managed",
        "async",
        "async_managed",
        "system",
        "sam_headroom",
        "pool",
        "binning",
        "arena",
        "fixed",
        "cuMemAlloc",
        "sim",
        "service",
        "expandable",
    ] {
        assert!(ACCEPTED.contains(name), "{name} is listed");
    }
    for option in [
        "threshold=",
        "initial=",
        "max_size=",
        "headroom=",
        "superblock=",
        "blocks=",
        "block=",
        "region=",
        "tags=",
        "watermark=",
    ] {
        assert!(ACCEPTED.contains(option), "{option} is listed");
    }
}

#[test]
fn service_specs_carry_the_resource_options() {
    use mempool_rmm::{Reclaim, ServiceOptions};
    // The defaults a bare `service` stands for are the resource's own.
    let ResourceSpec::Service {
        chunk,
        region,
        tags,
        reclaim,
    } = parse("service").unwrap()
    else {
        panic!("`service` parses to ResourceSpec::Service");
    };
    let d = ServiceOptions::default();
    assert_eq!((chunk, region), (None, None));
    assert_eq!(tags, d.max_tags as u64);
    assert_eq!(reclaim, d.reclaim);
    assert_eq!(
        parse("service(chunk=4MiB,region=1TiB,tags=3,watermark=10)").unwrap(),
        ResourceSpec::Service {
            chunk: Some(4 << 20),
            region: Some(1 << 40),
            tags: 3,
            reclaim: Reclaim::Watermark { percent: 10 },
        }
    );
    for (text, reclaim) in [
        ("service(watermark=oom)", Reclaim::OnOutOfMemory),
        ("service(watermark=growth)", Reclaim::BeforeGrowth),
        ("service(watermark=10000)", Reclaim::Watermark { percent: 10_000 }),
    ] {
        assert!(
            matches!(parse(text).unwrap(), ResourceSpec::Service { reclaim: r, .. } if r == reclaim),
            "{text}"
        );
    }
    // The list the issue's commands use.
    let specs = parse_list("pool(async),service,service(watermark=10),expandable,expandable(reclaim=growth)").unwrap();
    let names: Vec<String> = specs.iter().map(ToString::to_string).collect();
    assert_eq!(
        names,
        [
            "pool(async)",
            "service",
            "service(watermark=10)",
            "expandable",
            "expandable(reclaim=growth)"
        ]
    );
    // Without a GPU it is refused at build time with the reason, like every GPU spec.
    let e = build(&specs[1], None).unwrap_err().to_string();
    assert!(e.contains("`service` needs a GPU"), "{e}");
}

#[test]
fn spec_lists_split_outside_parentheses() {
    let specs = parse_list("cuda, pool(async,initial=1GiB),binning(pool(async,max=8GiB)) ,arena(cuda)").unwrap();
    let names: Vec<String> = specs.iter().map(ToString::to_string).collect();
    assert_eq!(
        names,
        [
            "cuda",
            "pool(async,initial=1GiB)",
            "binning(pool(async,max=8GiB))",
            "arena(cuda)"
        ]
    );
    let e = parse_list("cuda,,async").unwrap_err();
    assert_eq!((e.pos, e.message.as_str()), (5, "empty spec in the list"));
    let e = parse_list("cuda,pool(asink)").unwrap_err();
    assert_eq!(e.pos, 10, "positions count from the start of the list");
    assert_eq!(e.spec, "cuda,pool(asink)");
}

#[test]
fn building_needs_a_gpu_except_for_the_simulation() {
    let sim = build(&ResourceSpec::Sim, None).unwrap();
    assert_eq!(sim.label, "sim");
    assert_eq!(sim.resource.name(), "SimResource");
    let e = build(&parse("pool(async)").unwrap(), None).unwrap_err();
    assert!(matches!(e, Error::Usage(ref m) if m.contains("needs a GPU")), "{e}");
}

// ---------------------------------------------------------------------------------------------------
// Reports

fn sample_report() -> Report {
    let env = Environment {
        device: "NVIDIA H100 80GB HBM3".into(),
        device_uuid: "GPU-1234".into(),
        compute_capability: "9.0".into(),
        device_memory: "79.1 GiB".into(),
        device_count: 1,
        driver: "13.0".into(),
        host_cpu: "Intel(R) Xeon(R) Processor, 16 CPUs".into(),
        date: "2026-11-22 10:00:00 UTC".into(),
        command: "mempool-bench query --scale 1".into(),
        mempool_version: "0.1.0".into(),
    };
    let mut r = Report::new("query", "a test report", env);
    r.param("scale", 1.0);
    r.param("workers", 4);
    r.columns = vec![
        Column::new("resource", 0),
        Column::new("ms", 2),
        Column::new("count", 0),
    ];
    r.row(vec![
        Cell::from("pool(async,initial=1GiB)"),
        Cell::from(1.23456),
        Cell::from(7usize),
    ]);
    r.row(vec![Cell::from("cuda"), Cell::from(123.4), Cell::Empty]);
    r.row(vec![Cell::from("say \"hi\""), Cell::from(f64::NAN), Cell::Int(-3)]);
    r.notes.push("target met".into());
    r.chart = Some(Chart {
        title: "Speed-up <vs> cuMemAlloc & co".into(),
        kind: ChartKind::Bars,
        x_label: "query".into(),
        y_label: "speed-up".into(),
        categories: vec!["q1".into(), "q2".into()],
        series: vec![
            Series {
                name: "pool(async)".into(),
                values: vec![Some(2.5), Some(3.0)],
            },
            Series {
                name: "cuda".into(),
                values: vec![Some(1.0), None],
            },
        ],
        log_y: false,
    });
    r
}

#[test]
fn the_table_is_aligned_and_names_device_driver_date_command_parameters() {
    let r = sample_report();
    let text = r.render_text();
    for needle in [
        "device: NVIDIA H100 80GB HBM3 (GPU-1234), compute 9.0, 79.1 GiB; driver 13.0; host Intel(R) Xeon(R) \
         Processor, 16 CPUs; 2026-11-22 10:00:00 UTC",
        "command: mempool-bench query --scale 1",
        "parameters: scale=1, workers=4",
        "target met",
    ] {
        assert!(text.contains(needle), "{needle}\n{text}");
    }
    let table = r.table_text();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 5, "{table}");
    assert!(lines[1].starts_with("------------------------  "), "{table}");
    // Numbers right-aligned in their column, with the column's precision; missing values as `-`.
    let ms_end = lines[0].find("ms").unwrap() + 2;
    assert_eq!(&lines[2][ms_end - 4..ms_end], "1.23");
    assert_eq!(&lines[3][ms_end - 6..ms_end], "123.40");
    assert!(lines[4].contains('-'));
    assert!(lines[2].starts_with("pool(async,initial=1GiB)"));
}

#[test]
fn json_has_the_environment_parameters_and_rows_by_column() {
    let r = sample_report();
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["workload"], "query");
    assert_eq!(v["environment"]["device"], "NVIDIA H100 80GB HBM3");
    assert_eq!(v["environment"]["driver"], "13.0");
    assert_eq!(v["environment"]["date"], "2026-11-22 10:00:00 UTC");
    assert_eq!(v["environment"]["command"], "mempool-bench query --scale 1");
    assert_eq!(v["parameters"]["workers"], "4");
    assert_eq!(v["rows"][0]["resource"], "pool(async,initial=1GiB)");
    assert_eq!(v["rows"][0]["ms"], 1.23456);
    assert_eq!(v["rows"][0]["count"], 7);
    assert!(v["rows"][1]["count"].is_null());
    assert!(v["rows"][2]["ms"].is_null(), "NaN becomes null");
    assert_eq!(v["chart"]["series"][1]["values"][1], serde_json::Value::Null);
}

#[test]
fn csv_quotes_what_needs_quoting() {
    let csv = sample_report().to_csv();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "resource,ms,count");
    assert_eq!(lines[1], "\"pool(async,initial=1GiB)\",1.23456,7");
    assert_eq!(lines[2], "cuda,123.4,");
    assert_eq!(lines[3], "\"say \"\"hi\"\"\",,-3");
}

#[test]
fn svg_draws_every_series_with_escaped_text() {
    let r = sample_report();
    let svg = r.to_svg().unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("Speed-up &lt;vs&gt; cuMemAlloc &amp; co"));
    assert!(svg.contains("NVIDIA H100 80GB HBM3, driver 13.0, 2026-11-22 10:00:00 UTC"));
    assert_eq!(
        svg.matches("<rect x=").count(),
        3 + 2,
        "three bars (one value missing) and two legend boxes"
    );
    for name in ["pool(async)", "cuda", "q1", "q2"] {
        assert!(svg.contains(&format!(">{name}<")), "{name}");
    }
    // Every bar carries its value.
    for value in ["2.50", "3.00", "1.00"] {
        assert!(svg.contains(&format!(">{value}</text>")), "{value}\n{svg}");
    }
    // Bars stay on a linear axis (their lengths compare) even when a log axis is asked for.
    let mut log_bars = r.clone();
    log_bars.chart.as_mut().unwrap().log_y = true;
    let svg_log = log_bars.to_svg().unwrap();
    assert!(!svg_log.contains("(log scale)"));
    assert_eq!(svg_log, svg);
    // A bar's length is its value: the 3.0 bar is 1.2 times the 2.5 bar, the 1.0 bar 0.4 times.
    let heights: Vec<f64> = svg
        .lines()
        .filter(|l| l.starts_with("<rect x=") && l.contains("<title>"))
        .map(|l| {
            l.split("height=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(heights.len(), 3);
    assert!((heights[1] / heights[0] - 1.2).abs() < 0.01, "{heights:?}");
    assert!((heights[2] / heights[0] - 0.4).abs() < 0.01, "{heights:?}");
    // Lines and a log axis render too.
    let mut lines = r.clone();
    let chart = lines.chart.as_mut().unwrap();
    chart.kind = ChartKind::Lines;
    chart.log_y = true;
    let svg = lines.to_svg().unwrap();
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert!(svg.contains("(log scale)"));
    let mut none = r;
    none.chart = None;
    assert!(none.to_svg().is_none());
}

#[test]
fn report_files_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let (json, csv, svg) = (
        dir.path().join("r.json"),
        dir.path().join("r.csv"),
        dir.path().join("r.svg"),
    );
    let r = sample_report();
    r.write_files(Some(&json), Some(&csv), Some(&svg)).unwrap();
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["title"], "a test report");
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), r.to_csv());
    assert!(std::fs::read_to_string(&svg).unwrap().contains("</svg>"));
    let e = r
        .write_files(Some(&dir.path().join("missing/dir/r.json")), None, None)
        .unwrap_err();
    assert!(e.to_string().contains("missing/dir/r.json"), "{e}");
}

#[test]
fn medians_and_geometric_means() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&[]), None);
    assert!((geomean([2.0, 8.0]).unwrap() - 4.0).abs() < 1e-12);
    assert_eq!(geomean([f64::NAN, -1.0]), None);
}

// ---------------------------------------------------------------------------------------------------
// Replay

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

#[test]
fn replay_reads_rmm_logs() {
    // As RMM 26.10's logging_resource_adaptor writes it: OS thread ids, HH:MM:SS.ffffff, `(nil)` for the
    // failed allocation's pointer, `free`, `0` for the null stream (a blank line is skipped).
    let log = format!(
        "{HEADER}\n\
         48213,12:34:56.000100,allocate,0x7f8a40000000,1024,0x55d0c8a3f2b0\n\
         48214,12:34:56.000200,allocate,0x7f8a40000400,4096,0x55d0c8a3f2b0\n\
         48213,12:34:56.000300,allocate failure,(nil),1099511627776,0x55d0c8a3f2b0\n\
         \n\
         48214,12:34:56.000400,free,0x7f8a40000000,1024,0x55d0c8a3f2b0\n\
         48213,12:34:56.000500,allocate,0x7f8a40000000,512,0\n"
    );
    let plan = replay::parse("rmm.csv", log.as_bytes()).unwrap();
    assert_eq!(plan.threads, vec![48213, 48214]);
    assert_eq!(
        plan.steps,
        vec![
            Step::Alloc { slot: 0, size: 1024 },
            Step::Alloc { slot: 1, size: 4096 },
            Step::Free { slot: 0, size: 1024 },
            Step::Alloc { slot: 2, size: 512 },
        ]
    );
    assert_eq!(
        plan.thread_of,
        vec![0, 1, 1, 0],
        "a pointer may be freed by another thread"
    );
    assert_eq!(plan.logged_failures, 1);
    assert_eq!(plan.logged_peak, 5120);
    assert_eq!(plan.unfreed, vec![(1, 4096, 1), (2, 512, 0)]);
}

#[test]
fn malformed_logs_name_the_file_and_line() {
    let cases = [
        ("Thread,Time,Action\n".to_owned(), 1, "header"),
        (format!("{HEADER}\n1,2,allocate,0x10,5\n"), 2, "expected 6 fields"),
        (
            format!("{HEADER}\n1,2,allocate,0x100,5,0x0\n\n\n1,2,release,0x100,5,0x0\n"),
            5,
            "bad action `release`",
        ),
        (format!("{HEADER}\nx,2,allocate,0x100,5,0x0\n"), 2, "bad thread"),
        (format!("{HEADER}\n1,2,allocate,256,5,0x0\n"), 2, "bad pointer"),
        (format!("{HEADER}\n1,2,allocate,0x100,-5,0x0\n"), 2, "bad size"),
        (format!("{HEADER}\n1,yesterday,allocate,0x100,5,0x0\n"), 2, "bad time"),
        // Lines that parse but cannot be replayed; blank lines still count.
        (
            format!("{HEADER}\n1,2,allocate,0x100,5,0x0\n\n1,2,free,0x200,5,0x0\n"),
            4,
            "no earlier line allocated",
        ),
        (
            format!("{HEADER}\n1,2,allocate,0x100,5,0x0\n1,2,free,0x100,5,0x0\n1,2,free,0x100,5,0x0\n"),
            4,
            "freed already",
        ),
        (
            format!("{HEADER}\n1,2,allocate,0x100,5,0x0\n1,2,free,0x100,6,0x0\n"),
            3,
            "allocated with 5",
        ),
        (
            format!("{HEADER}\n1,2,allocate,0x100,5,0x0\n2,2,allocate,0x100,5,0x0\n"),
            3,
            "allocated again",
        ),
        (format!("{HEADER}\n1,2,allocate,0x0,5,0x0\n"), 2, "null pointer"),
    ];
    for (text, line, what) in cases {
        let e = replay::parse("trace.csv", text.as_bytes()).unwrap_err();
        match &e {
            Error::Log { path, line: l, reason } => {
                assert_eq!(path, "trace.csv");
                assert_eq!(*l, line, "{text:?}: {e}");
                assert!(reason.contains(what), "{text:?}: {e}");
            }
            other => panic!("{text:?}: {other}"),
        }
        assert!(e.to_string().starts_with(&format!("trace.csv:{line}: ")), "{e}");
    }
    let e = replay::load(std::path::Path::new("/nonexistent/trace.csv")).unwrap_err();
    assert!(e.to_string().starts_with("/nonexistent/trace.csv: "), "{e}");
}

#[test]
fn replay_runs_threads_in_the_logged_order_on_the_simulation() {
    // Three threads interleaved, frees crossing threads.
    let mut log = String::from(HEADER);
    log.push('\n');
    let mut live: Vec<(u64, usize)> = Vec::new();
    let mut rng = mempool_rmm::workload::SplitMix64(7);
    let mut next = 0x1000u64;
    for _ in 0..3000 {
        let thread = 1 + rng.below(3);
        if live.is_empty() || rng.below(100) < 60 {
            let size = 1 + rng.below(100_000) as usize;
            log.push_str(&format!("{thread},00:00:00.000000,allocate,{next:#x},{size},0\n"));
            live.push((next, size));
            next += 0x100000;
        } else {
            let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
            log.push_str(&format!("{thread},00:00:00.000000,free,{p:#x},{size},0\n"));
        }
    }
    let plan = replay::parse("generated", log.as_bytes()).unwrap();
    assert_eq!(plan.threads.len(), 3);
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let sim = unsafe { SimResource::new() };
    let stats = replay::run(&plan, &sim, None).unwrap();
    assert_eq!(stats.failures, 0);
    assert_eq!(
        stats.peak_bytes, plan.logged_peak,
        "the replay reaches the log's peak exactly"
    );
    assert_eq!(sim.live_allocations(), 0, "everything is freed at the end");
    // With a capacity below the peak, allocations fail and are counted; their frees are skipped.
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let small = unsafe { SimResource::with_capacity((plan.logged_peak / 2) as usize) };
    let stats = replay::run(&plan, &small, None).unwrap();
    assert!(stats.failures > 0);
    assert_eq!(small.live_allocations(), 0);
}

#[test]
fn the_shipped_sample_log_replays_in_both_formats() {
    // The sample in RMM 26.10's format, and the same run as mempool-rmm logged it before it matched RMM
    // (seconds since the epoch, `deallocate`, `0x0` streams): both read, to the same plan.
    let text = include_str!("../data/sample-random.csv");
    let old = include_str!("../data/sample-random-old-format.csv");
    assert!(
        text.lines().nth(1).unwrap().contains(":"),
        "the sample is in RMM's time-of-day format"
    );
    assert!(old.contains(",deallocate,") && !text.contains(",deallocate,"));
    let plan = replay::parse("sample-random.csv", text.as_bytes()).unwrap();
    let old_plan = replay::parse("sample-random-old-format.csv", old.as_bytes()).unwrap();
    assert!(plan.steps.len() > 1000);
    assert_eq!((&plan.steps, plan.logged_peak), (&old_plan.steps, old_plan.logged_peak));
    for plan in [plan, old_plan] {
        // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
        #[allow(unsafe_code)]
        let sim = unsafe { SimResource::new() };
        let stats = replay::run(&plan, &sim, None).unwrap();
        assert_eq!((stats.failures, stats.peak_bytes), (0, plan.logged_peak));
    }
}

// ---------------------------------------------------------------------------------------------------
// Workloads on the host

#[test]
fn the_random_workload_matches_the_standard_shape() {
    assert_eq!(
        STANDARD_POINTS.map(|p| (p.n, p.max_size, p.max_usage)),
        [
            (200_000, 64 << 10, 4 << 30),
            (100_000, 1 << 20, 16 << 30),
            (20_000, 64 << 20, 16 << 30)
        ]
    );
    let p = Point {
        n: 20_000,
        max_size: 64 << 10,
        max_usage: 32 << 20,
    };
    let ops = generate(&p, 42);
    assert_eq!(ops, generate(&p, 42), "deterministic");
    assert_ne!(ops, generate(&p, 43));
    let allocs = ops.iter().filter(|o| matches!(o, Op::Alloc(_))).count();
    assert!(allocs > ops.len() / 2, "{allocs} of {}", ops.len());
    assert_eq!(p.label(), "20k ops, <= 64KiB, 32MiB");
    for (n, ops) in [(500, "500 ops"), (2500, "2500 ops"), (2000, "2k ops"), (1, "1 ops")] {
        assert_eq!(Point { n, ..p }.label(), format!("{ops}, <= 64KiB, 32MiB"));
    }
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let sim = unsafe { SimResource::new() };
    let stats = run(&ops, &sim, None).unwrap();
    assert!(stats.peak_bytes <= p.max_usage as u64 && stats.peak_bytes > (p.max_usage / 2) as u64);
    assert!(stats.peak_allocations > 100);
    assert_eq!(sim.live_allocations(), 0);
    // An allocation failure is reported, and what was allocated is still freed.
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    #[allow(unsafe_code)]
    let small = unsafe { SimResource::with_capacity(1 << 20) };
    assert!(run(&ops, &small, None).is_err());
    assert_eq!(small.live_allocations(), 0);
}

#[test]
fn query_references_are_deterministic_and_sized_by_scale() {
    let s = Scale::new(0.001);
    assert_eq!((s.fact, s.items, s.customers), (4000, 64, 100));
    assert_eq!(Scale::new(1.0).fact, 4_000_000);
    for q in Query::ALL {
        let d = reference(q, &s);
        assert_eq!(d, reference(q, &s));
        assert!(d.rows > 0 && d.total > 0, "{q:?}: {d:?}");
        assert_eq!(Query::parse(q.name()), Some(q));
    }
    assert_eq!(Query::parse("Q9"), None);
    assert_eq!(Digest::of(&[1, 2], &[3, 4], 5).rows, 2);
    assert_ne!(
        Digest::of(&[1, 2], &[3, 4], 5),
        Digest::of(&[2, 1], &[4, 3], 5),
        "order matters"
    );
}

#[test]
fn kernels_host_twins_and_empty_ptx() {
    // lowbias32 (values from an independent Python implementation), and the composition hash2 uses.
    assert_eq!(mix32(0), 0);
    assert_eq!(mix32(1), 0x6889_90c0);
    assert_eq!(mix32(0xdead_beef), 0xe628_c683);
    assert_eq!(hash2(3, 5), mix32(5 ^ mix32(3 ^ mix32(0))));
    assert_eq!(hash2(3, (1 << 32) + 5), mix32(5 ^ mix32(3 ^ mix32(1))));
    let e = check_ptx("query.ptx", "").unwrap_err();
    assert!(matches!(e, Error::EmptyPtx { file: "query.ptx" }));
    assert!(e.to_string().contains("run kernels/build-ptx.sh"), "{e}");
    assert!(check_ptx("x.ptx", "// a comment only\n\n").is_err());
    assert!(check_ptx("x.ptx", ".version 8.0\n").is_ok());
}

// ---------------------------------------------------------------------------------------------------
// The binary

/// The binary Cargo built; where the test binaries were packed for a GPU machine (`.gpu/tests/`), the
/// packed one beside them (`.gpu/bin/`).
fn bench() -> Command {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_mempool-bench"));
    if built.exists() {
        return Command::new(built);
    }
    let exe = std::env::current_exe().unwrap();
    let packed = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("bin/mempool-bench"));
    Command::new(packed.filter(|p| p.exists()).unwrap_or(built))
}

#[test]
fn the_binary_lists_specs_and_rejects_bad_ones() {
    let out = bench().arg("resources").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("binning(UPSTREAM[,OPTIONS])"));
    let out = bench().args(["random", "-r", "pool(asink)"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown resource `asink`") && err.contains("accepted resource specs"),
        "{err}"
    );
}

#[test]
fn the_binary_runs_the_simulation_and_writes_every_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| dir.path().join(f).display().to_string();
    let out = bench()
        .args([
            "random",
            "-r",
            "sim",
            "--n",
            "2000",
            "--max-size",
            "64KiB",
            "--max-usage",
            "8MiB",
        ])
        .args([
            "--repeats",
            "1",
            "--json",
            &p("r.json"),
            "--csv",
            &p("r.csv"),
            "--plot",
            &p("r.svg"),
        ])
        .args(["--log", &p("log.csv")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("2k ops, <= 64KiB, 8MiB"), "{stdout}");
    // The header names no device, driver or baseline it did not use.
    let device_line = stdout.lines().nth(1).unwrap();
    assert!(
        device_line.starts_with("device: none (host simulation); host "),
        "{stdout}"
    );
    assert!(
        !device_line.contains("driver") && !device_line.contains(" -"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("vs cuMemAlloc") && !stdout.contains("synchronize"),
        "{stdout}"
    );
    assert!(
        out.stderr.is_empty() || !String::from_utf8_lossy(&out.stderr).contains('\r'),
        "no progress bar off a terminal"
    );
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p("r.json")).unwrap()).unwrap();
    assert_eq!(json["rows"][0]["resource"], "sim");
    assert!(std::fs::read_to_string(p("r.csv"))
        .unwrap()
        .starts_with("point,resource,ns/op"));
    assert!(std::fs::read_to_string(p("r.svg")).unwrap().contains("</svg>"));
    // The log replays.
    let out = bench()
        .args(["replay", "-r", "sim", "--repeats", "1", &p("log.csv")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("failed allocations"));
}

/// Runs the binary with `args`; returns its exit status and stderr.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = bench().args(args).output().unwrap();
    assert!(
        out.stdout.is_empty(),
        "{args:?} ran: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn values_that_make_no_sense_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.csv");
    std::fs::write(&empty, format!("{HEADER}\n")).unwrap();
    let failed_only = dir.path().join("failed.csv");
    std::fs::write(&failed_only, format!("{HEADER}\n1,0,allocate failure,0x0,5,0x0\n")).unwrap();
    let (empty, failed_only) = (empty.display().to_string(), failed_only.display().to_string());
    let positive = "must be a positive whole number";
    let size = "must be a positive size";
    // Checked before the driver is loaded: the same answer with or without a GPU.
    let cases: &[(&[&str], &str)] = &[
        (&["random", "-r", "sim", "--n", "0"], positive),
        (&["random", "-r", "sim", "--n", "-1"], positive),
        (&["random", "-r", "sim", "--repeats", "0"], positive),
        (&["random", "-r", "sim", "--max-size", "0"], size),
        (&["random", "-r", "sim", "--max-size", "-5"], size),
        (&["random", "-r", "sim", "--max-size", "-5KiB"], size),
        (&["random", "-r", "sim", "--max-usage", "0"], size),
        (
            &["random", "-r", "sim", "--max-size", "max"],
            "`max`, unlimited, is not a size here",
        ),
        (
            &["random", "-r", "sim", "--max-size", "12 parsecs"],
            "bad size `12 parsecs`",
        ),
        (
            &["random", "-r", "sim", "--max-size", "64KiB", "--max-usage", "1KiB"],
            "--max-usage (1KiB) is smaller than --max-size (64KiB)",
        ),
        (
            &["random", "-r", "sim", "--seed", "-1"],
            "must be a whole number from 0",
        ),
        (&["random", "--device", "-1"], "must be a device ordinal"),
        (&["replay", "-r", "sim", "--repeats", "0", "x.csv"], positive),
        (&["replay", "/nonexistent/trace.csv"], "/nonexistent/trace.csv: "),
        (
            &["replay", &empty],
            "no allocation to replay: the log has no event after its header",
        ),
        (
            &["replay", "-r", "sim", &failed_only],
            "its 1 event(s) are all failed allocations",
        ),
        (&["multi-stream", "--streams", "1,0"], positive),
        (&["multi-stream", "--streams", "-2"], positive),
        (&["multi-stream", "--iterations", "0"], positive),
        (&["multi-stream", "--elements", "0"], positive),
        (&["multi-stream", "--repeats", "0"], positive),
        (&["multi-stream", "--rounds", "-1"], "must be a whole number of rounds"),
        (
            &["multi-stream", "-r", "sim"],
            "`sim` cannot run the multi-stream workload",
        ),
        (&["query", "--scale", "0"], "must be a positive number"),
        (&["query", "--scale", "-1"], "must be a positive number"),
        (&["query", "--workers", "0"], positive),
        (&["query", "--rounds", "0"], positive),
        (&["query", "--queries", "q1,q9"], "unknown query `q9`"),
        (&["query", "-r", "sim"], "`sim` cannot run the query workload"),
        (&["peer", "--bytes", "0"], size),
        (&["peer", "--bytes", "-1"], size),
        (&["peer", "--bytes", "17"], "--bytes (17) must be a multiple of 16"),
        (&["peer", "--repeats", "0"], positive),
        (&["sleep", "--size", "0"], size),
        (&["sleep", "--size", "-1"], size),
        (&["sleep", "--size", "max"], "`max`, unlimited, is not a size here"),
        (
            &["sleep", "--size", "6"],
            "--size (6) must be a positive multiple of 4 bytes",
        ),
        (&["sleep", "--repeats", "0"], positive),
        (&["sleep", "--device", "-1"], "must be a device ordinal"),
        (&["peer", "-r", "async"], "-r/--resources does not apply to peer"),
        (&["peer", "--no-baselines"], "--no-baselines does not apply to peer"),
        (
            &["peer", "--device", "1"],
            "--device does not apply to peer: peer always reads device 0's memory",
        ),
    ];
    for (args, what) in cases {
        let (status, err) = refused(args);
        assert_eq!(status, Some(2), "{args:?}: {err}");
        assert!(err.contains(what), "{args:?}: {err}");
        assert!(
            !err.contains("CUDA driver") && !err.contains("unexpected argument"),
            "{args:?}: {err}"
        );
    }
}

/// Every GPU workload on every machine: without the GPUs it needs it says so (`mempool-bench WORKLOAD:
/// needs a GPU: WHY`, with what runs instead) and exits with status 2; with them, a small run succeeds.
#[test]
fn gpu_workloads_need_their_gpus_or_run() {
    // A readable log: the file is checked before the driver, so a missing one would be refused first.
    let sample = common::data("sample-random.csv");
    let sample = sample.to_str().unwrap();
    let small_random = [
        "--n",
        "200",
        "--max-size",
        "4KiB",
        "--max-usage",
        "64KiB",
        "--repeats",
        "1",
    ];
    for (args, small, first, hint) in [
        (
            &["random"][..],
            &small_random[..],
            "random",
            "`-r sim` runs the random workload on a host simulation",
        ),
        (
            &["random", "-r", "sim,pool(async)"],
            &small_random[..],
            "random",
            "mempool-bench random -r sim",
        ),
        (
            &["replay", sample],
            &["--repeats", "1"],
            "replay",
            "mempool-bench replay -r sim FILE",
        ),
        (
            &["query", "--scale", "0.01"],
            &["--workers", "1", "--rounds", "1", "--queries", "q1"],
            "query",
            "runs kernels on the GPU; there is no host simulation",
        ),
        (
            &["multi-stream"],
            &[
                "--streams",
                "1",
                "--iterations",
                "4",
                "--elements",
                "1024",
                "--repeats",
                "1",
            ],
            "multi-stream",
            "runs kernels on the GPU; there is no host simulation",
        ),
        (
            &["sleep"],
            &["--size", "64MiB", "--repeats", "1"],
            "sleep",
            "needs a GPU with virtual memory management; there is no host simulation",
        ),
    ] {
        match mempool_core::require_gpus(1) {
            Err(missing) => {
                let (status, err) = refused(args);
                assert_eq!(status, Some(2), "{args:?}: {err}");
                assert!(
                    err.starts_with(&format!("mempool-bench {first}: {missing}")),
                    "{args:?}: {err}"
                );
                assert!(
                    err.starts_with(&format!("mempool-bench {first}: needs a GPU: ")),
                    "{args:?}: {err}"
                );
                assert!(err.contains(hint), "{args:?}: {err}");
            }
            Ok(_) => {
                let out = bench().args(args).args(small).arg("-q").output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(
                    out.status.success(),
                    "{args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(stdout.contains("device: "), "{args:?} reports its device: {stdout}");
            }
        }
    }
    match mempool_core::require_gpus(2) {
        Err(missing) => {
            let (status, err) = refused(&["peer"]);
            assert_eq!(status, Some(2), "{err}");
            assert!(err.starts_with(&format!("mempool-bench peer: {missing}")), "{err}");
            assert!(err.starts_with("mempool-bench peer: needs 2 GPUs: "), "{err}");
        }
        Ok(_) => {
            let out = bench()
                .args(["peer", "--bytes", "1MiB", "--repeats", "1", "-q"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            assert!(String::from_utf8_lossy(&out.stdout).contains("device: "));
        }
    }
}

#[test]
fn history_specs_wrap_any_upstream_and_print_their_capacity() {
    assert_eq!(
        parse("history(pool(async))").unwrap().to_string(),
        "history(pool(async))"
    );
    assert_eq!(
        parse("history(sim, capacity=1000)").unwrap().to_string(),
        "history(sim,capacity=1000)"
    );
    assert_eq!(
        parse("history(async,capacity=65536)").unwrap().to_string(),
        "history(async)",
        "the default capacity is left out"
    );
    assert!(parse("history(sim)").unwrap().is_host_only());
    assert!(!parse("history(async)").unwrap().is_host_only());
    let e = parse("history").unwrap_err().to_string();
    assert!(e.contains("`history` needs an upstream resource"), "{e}");
    let e = parse("history(async,size=3)").unwrap_err().to_string();
    assert!(e.contains("`history` has no option `size`"), "{e}");
    let built = build(&parse("history(sim)").unwrap(), None).unwrap();
    assert_eq!(built.resource.name(), "HistoryResource");
    let p = built.resource.allocate(1000, mempool_core::StreamRef::LEGACY).unwrap();
    // SAFETY: `p` came from this resource with this size and is freed once; `sim` addresses are never
    // dereferenced.
    #[allow(unsafe_code)]
    unsafe { built.resource.deallocate(p, 1000, mempool_core::StreamRef::LEGACY) }.unwrap();
    let snap = mempool_rmm::observe::snapshot(&*built.resource, "rust");
    assert_eq!(snap.history.op, [0, 1]);
}

#[test]
fn replay_writes_the_snapshot_and_the_page_of_a_small_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("small.csv");
    std::fs::write(
        &log,
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,10:00:00.000000,allocate,0x7f0000000000,1024,0x0\n\
         1,10:00:00.000100,allocate,0x7f0000100000,4096,0x0\n\
         2,10:00:00.000200,free,0x7f0000000000,1024,0x0\n\
         2,10:00:00.000300,allocate failure,0x0,1073741824,0x0\n",
    )
    .unwrap();
    let (json, html) = (dir.path().join("s.json"), dir.path().join("s.html"));
    let out = bench()
        .arg("replay")
        .arg(&log)
        .arg("--snapshot")
        .arg(&json)
        .arg("--html")
        .arg(&html)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&json).unwrap();
    let snap = mempool_rmm::observe::read_json(&text).unwrap();
    assert_eq!(snap.source, "replay:small.csv");
    assert_eq!(snap.history.op, [0, 0, 1, 2]);
    assert_eq!(snap.history.t_ns, [0, 100_000, 200_000, 300_000]);
    assert_eq!(snap.resources[0].stats.live_bytes, Some(4096));
    assert_eq!(snap.resources[0].stats.peak_live_bytes, Some(5120));
    let live: Vec<(u64, u64)> = snap.live.iter().map(|l| (l.address, l.size)).collect();
    assert_eq!(live, [(0x7f0000100000, 4096)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains(&text.replace('<', "\\u003c")),
        "the page embeds the snapshot"
    );
    assert!(!page.contains(mempool_rmm::observe::MARKER));
}

/// A snapshot file of a small log, as `replay --snapshot` writes it.
fn snapshot_file(dir: &std::path::Path, name: &str, csv: &str) -> std::path::PathBuf {
    let log = dir.join(format!("{name}.csv"));
    std::fs::write(&log, format!("Thread,Time,Action,Pointer,Size,Stream\n{csv}")).unwrap();
    let json = dir.join(format!("{name}.json"));
    let out = bench()
        .arg("replay")
        .arg(&log)
        .arg("--snapshot")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    json
}

#[test]
fn cluster_merges_snapshot_files_as_docs_observe_md_shows() {
    // the command of docs/observe.md, "Cluster snapshots", run as it stands in a directory holding its files
    let docs = include_str!("../../../docs/observe.md");
    let line = docs
        .lines()
        .find(|l| l.starts_with("mempool-bench cluster "))
        .expect("docs/observe.md shows a `mempool-bench cluster` command");
    let dir = tempfile::tempdir().unwrap();
    let w0 = snapshot_file(
        dir.path(),
        "worker-0",
        "1,10:00:00.000000,allocate,0x7f0000000000,1024,0x0\n\
         1,10:00:00.000100,allocate,0x7f0000100000,4096,0x0\n\
         1,10:00:00.000200,free,0x7f0000000000,1024,0x0\n",
    );
    let w1 = snapshot_file(
        dir.path(),
        "worker-1",
        "1,10:00:00.000000,allocate,0x7e0000000000,65536,0x0\n\
         1,10:00:00.000100,allocate failure,0x0,1073741824,0x0\n",
    );
    let out = bench()
        .args(line.split_whitespace().skip(1))
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{line}: {}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(dir.path().join("cluster.json")).unwrap();
    let cluster = mempool_rmm::observe::read_cluster_json(&text).unwrap();
    assert_eq!(cluster.source, "mempool-bench");
    let names: Vec<&str> = cluster.workers.iter().map(|w| w.identity.name.as_str()).collect();
    assert_eq!(names, ["worker-0", "worker-1"]);
    // each worker's snapshot is its file's, unchanged
    for (w, file) in cluster.workers.iter().zip([&w0, &w1]) {
        let single = mempool_rmm::observe::read_json(&std::fs::read_to_string(file).unwrap()).unwrap();
        assert_eq!(w.snapshot, single);
    }
    assert_eq!(cluster.workers[0].snapshot.resources[0].stats.live_bytes, Some(4096));
    assert_eq!(cluster.workers[1].snapshot.history.op, [0, 2]);
    let page = std::fs::read_to_string(dir.path().join("cluster.html")).unwrap();
    assert!(
        page.contains(&text.replace('<', "\\u003c")),
        "the page embeds the cluster document"
    );
    assert!(!page.contains(mempool_rmm::observe::MARKER));
}

#[test]
fn cluster_says_what_is_wrong_with_its_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let w0 = snapshot_file(dir.path(), "w0", "1,10:00:00.000000,allocate,0x1000,64,0x0\n");
    let log = dir.path().join("w0.csv");
    let html = dir.path().join("c.html");
    let run = |args: &[&std::ffi::OsStr]| {
        let out = bench().arg("cluster").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!html.exists(), "{args:?} wrote the page");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let os = |s: &str| std::ffi::OsString::from(s);
    let worker = |name: &str, p: &std::path::Path| {
        let mut s = os(&format!("--worker={name}="));
        s.push(p);
        s
    };
    let h = html.as_os_str().to_owned();
    let cases: Vec<(Vec<std::ffi::OsString>, String)> = vec![
        (
            vec![worker("a", &w0), worker("a", &w0), os("--html"), h.clone()],
            "--worker: workers[0] and workers[1] are both named `a`: worker names must be unique".into(),
        ),
        (
            vec![worker("a", &w0), worker("b", &log), os("--html"), h.clone()],
            format!("--worker b={}: not a mempool snapshot: not JSON: ", log.display()),
        ),
        (
            vec![worker("a", &dir.path().join("missing.json")), os("--html"), h.clone()],
            format!(
                "{}: No such file or directory",
                dir.path().join("missing.json").display()
            ),
        ),
        (
            vec![worker("a", &w0)],
            "nothing to write: give --json FILE (the cluster document), --html FILE (its page), or both".into(),
        ),
        (
            vec![os("--worker"), os("w0.json"), os("--html"), h.clone()],
            "`w0.json` is not NAME=FILE".into(),
        ),
        (vec![os("--html"), h.clone()], "--worker <NAME=FILE>".into()),
    ];
    for (args, expected) in cases {
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let e = run(&refs);
        assert!(e.contains(&expected), "{args:?}: expected `{expected}` in:\n{e}");
    }
    // a snapshot whose history columns differ in length is named with the reason
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&w0).unwrap()).unwrap();
    v["history"]["size"] = serde_json::json!([]);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, v.to_string()).unwrap();
    let args = [worker("a", &w0), worker("b", &bad), os("--html"), h];
    let e = run(&args.iter().map(|a| a.as_os_str()).collect::<Vec<_>>());
    assert!(
        e.contains("history columns differ in length: `size` has 0 entries, `t_ns` has 1"),
        "{e}"
    );
}
