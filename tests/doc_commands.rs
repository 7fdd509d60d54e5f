//! The `cargo run` commands of the README and `docs/` name something Cargo can run: a package with one
//! binary or a `default-run`, a binary the package declares (`--bin`), an example it has (`--example`).
//! `cargo run -p mempool-bench -- ...` failed with "could not determine which binary to run" once the
//! package had three binaries (issue 33). The documents and manifests are compiled in, so the test binary
//! needs no source tree (scripts/gpu-tests.sh runs it on another machine). A document added to `docs/`
//! belongs in `DOCS`, as in `src/lib.rs`'s doctest modules.

/// The documents whose commands are checked.
const DOCS: &[(&str, &str)] = &[
    ("README.md", include_str!("../README.md")),
    ("docs/architecture.md", include_str!("../docs/architecture.md")),
    ("docs/benchmarks.md", include_str!("../docs/benchmarks.md")),
    ("docs/core.md", include_str!("../docs/core.md")),
    ("docs/cudarc.md", include_str!("../docs/cudarc.md")),
    ("docs/dask.md", include_str!("../docs/dask.md")),
    ("docs/distributed.md", include_str!("../docs/distributed.md")),
    ("docs/ipc.md", include_str!("../docs/ipc.md")),
    ("docs/ipc-protocol.md", include_str!("../docs/ipc-protocol.md")),
    ("docs/measurements.md", include_str!("../docs/measurements.md")),
    ("docs/memory-store.md", include_str!("../docs/memory-store.md")),
    ("docs/nccl.md", include_str!("../docs/nccl.md")),
    ("docs/observe.md", include_str!("../docs/observe.md")),
    ("docs/python.md", include_str!("../docs/python.md")),
    ("docs/resources.md", include_str!("../docs/resources.md")),
    ("docs/rmm.md", include_str!("../docs/rmm.md")),
    ("docs/services.md", include_str!("../docs/services.md")),
    ("docs/testing.md", include_str!("../docs/testing.md")),
    ("docs/vmm.md", include_str!("../docs/vmm.md")),
];

/// Each package's manifest (the facade is `mempool`).
const MANIFESTS: &[(&str, &str)] = &[
    ("mempool", include_str!("../Cargo.toml")),
    ("mempool-bench", include_str!("../crates/mempool-bench/Cargo.toml")),
    ("mempool-capi", include_str!("../crates/mempool-capi/Cargo.toml")),
    ("mempool-core", include_str!("../crates/mempool-core/Cargo.toml")),
    ("mempool-ipc", include_str!("../crates/mempool-ipc/Cargo.toml")),
    ("mempool-nccl", include_str!("../crates/mempool-nccl/Cargo.toml")),
    ("mempool-py", include_str!("../crates/mempool-py/Cargo.toml")),
    ("mempool-rmm", include_str!("../crates/mempool-rmm/Cargo.toml")),
    ("mempool-socket", include_str!("../crates/mempool-socket/Cargo.toml")),
    ("mempool-store", include_str!("../crates/mempool-store/Cargo.toml")),
    (
        "mempool-store-server",
        include_str!("../crates/mempool-store-server/Cargo.toml"),
    ),
    (
        "mempool-suballoc",
        include_str!("../crates/mempool-suballoc/Cargo.toml"),
    ),
];

/// The examples a command may name, per package; `include_str!` makes a missing file a compile error.
const EXAMPLES: &[(&str, &str, &str)] = &[
    ("mempool", "cudarc_kernel", include_str!("../examples/cudarc_kernel.rs")),
    ("mempool", "ipc_pipeline", include_str!("../examples/ipc_pipeline.rs")),
    ("mempool", "ipc_serve", include_str!("../examples/ipc_serve.rs")),
    ("mempool", "peer_access", include_str!("../examples/peer_access.rs")),
    ("mempool", "pool_report", include_str!("../examples/pool_report.rs")),
    (
        "mempool-rmm",
        "random_workload",
        include_str!("../crates/mempool-rmm/examples/random_workload.rs"),
    ),
    (
        "mempool-suballoc",
        "binning_large_path",
        include_str!("../crates/mempool-suballoc/examples/binning_large_path.rs"),
    ),
];

/// What one `cargo run` asks for.
#[derive(Debug, Default, PartialEq)]
struct Run {
    package: Option<String>,
    bin: Option<String>,
    example: Option<String>,
}

/// The `cargo run` commands of `text`, each with the line it is on: Cargo's own arguments, up to the
/// `--` that starts the program's, a comment or the end of the inline code span. An inline span of
/// `cargo run` alone is prose about the command and is passed over.
fn runs(text: &str) -> Vec<(String, Run)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut rest = line;
        while let Some(at) = rest.find("cargo run") {
            rest = &rest[at + "cargo run".len()..];
            if rest.starts_with('`') {
                // Prose naming the command (`cargo run`), not a command.
                continue;
            }
            let args = rest.split('`').next().unwrap_or("");
            let mut run = Run::default();
            let mut words = args.split_whitespace();
            while let Some(w) = words.next() {
                match w {
                    "--" | "#" => break,
                    "-p" | "--package" => run.package = words.next().map(str::to_owned),
                    "--bin" => run.bin = words.next().map(str::to_owned),
                    "--example" => run.example = words.next().map(str::to_owned),
                    _ => {}
                }
            }
            out.push((line.trim().to_owned(), run));
        }
    }
    out
}

/// The `[[bin]]` names and the `default-run` of a manifest (no TOML parser: one key per line).
fn bins(manifest: &str) -> (Vec<String>, Option<String>) {
    let value = |l: &str, key: &str| {
        let l = l.trim();
        let v = l.strip_prefix(key)?.trim_start().strip_prefix('=')?.trim();
        Some(v.trim_matches('"').to_owned())
    };
    let (mut names, mut default_run, mut in_bin) = (Vec::new(), None, false);
    for l in manifest.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            in_bin = t == "[[bin]]";
        } else if in_bin {
            if let Some(n) = value(t, "name") {
                names.push(n);
            }
        } else if let Some(d) = value(t, "default-run") {
            default_run = Some(d);
        }
    }
    (names, default_run)
}

/// Why `run` cannot run, or `None`.
fn problem(run: &Run) -> Option<String> {
    let package = run.package.as_deref().unwrap_or("mempool");
    let Some(&(_, manifest)) = MANIFESTS.iter().find(|(p, _)| *p == package) else {
        return Some(format!("no package {package} (or it is missing from MANIFESTS)"));
    };
    if let Some(e) = &run.example {
        return (!EXAMPLES.iter().any(|(p, n, _)| *p == package && n == e))
            .then(|| format!("{package} has no example {e} (or it is missing from EXAMPLES)"));
    }
    let (names, default_run) = bins(manifest);
    if let Some(b) = &run.bin {
        return (!names.contains(b)).then(|| format!("{package} declares no binary {b} (its [[bin]]s: {names:?})"));
    }
    match default_run {
        Some(d) if names.contains(&d) => None,
        Some(d) => Some(format!("{package}'s default-run {d} is none of its binaries {names:?}")),
        None if names.len() == 1 => None,
        None => Some(format!(
            "{package} has {} declared binaries and no default-run: cargo cannot tell which to run \
             (name one with --bin, or set default-run)",
            names.len()
        )),
    }
}

#[test]
fn every_documented_cargo_run_names_something_cargo_can_run() {
    let mut bad = Vec::new();
    let mut seen = 0;
    for (doc, text) in DOCS {
        for (line, run) in runs(text) {
            seen += 1;
            if let Some(why) = problem(&run) {
                bad.push(format!("{doc}: `{line}`: {why}"));
            }
        }
    }
    assert!(seen >= 8, "the documents' cargo run commands were found ({seen})");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_readme_runs_the_benchmark_harness_by_its_default_binary() {
    let readme = DOCS[0].1;
    let found = runs(readme);
    let bench = found
        .iter()
        .find(|(line, _)| line.contains("query --scale"))
        .expect("the README's benchmark command");
    assert_eq!(
        bench.1,
        Run {
            package: Some("mempool-bench".into()),
            ..Run::default()
        }
    );
    let (names, default_run) = bins(MANIFESTS[1].1);
    assert_eq!(names, ["mempool-bench", "ipc_handoff", "store_attach"]);
    assert_eq!(default_run.as_deref(), Some("mempool-bench"));
}

#[test]
fn the_parser_reads_the_commands_as_cargo_does() {
    let text = "x `cargo run --release -p a --bin b -- --bin c` y, not `cargo run`\n\
                cargo run --release --example e -- 1 2   # -p z\n\
                cargo run -p q --config 'profile.dev.opt-level=3'";
    let r: Vec<Run> = runs(text).into_iter().map(|(_, r)| r).collect();
    assert_eq!(
        r,
        [
            Run {
                package: Some("a".into()),
                bin: Some("b".into()),
                example: None
            },
            Run {
                package: None,
                bin: None,
                example: Some("e".into())
            },
            Run {
                package: Some("q".into()),
                bin: None,
                example: None
            },
        ]
    );
    let (names, d) = bins("[package]\nname = \"p\"\ndefault-run = \"x\"\n[[bin]]\nname = \"x\"\npath = \"a.rs\"\n[[bin]]\nname=\"y\"\n[dependencies]\nname = \"no\"\n");
    assert_eq!(names, ["x", "y"]);
    assert_eq!(d.as_deref(), Some("x"));
}
