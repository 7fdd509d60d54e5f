//! `include/mempool.h` against the Rust definitions it declares, so that neither can drift from the other:
//! - the status enum against [`Status`] (names, codes, and each code's one-line summary);
//! - the function prototypes against the `#[no_mangle]` entry points of `src/ffi.rs`, `src/torch.rs` and
//!   `src/cupy.rs`
//!   (names, parameter names and C types, return types), both ways;
//! - its structs (`mempool_statistics_t`, the service resource's) against the `#[repr(C)]` structs of
//!   `src/ffi.rs`, and `mempool_sleep_mode_t` against mempool-capi's sleep mode codes;
//! - the Python package's exception classes (`mempool._errors`) against [`Status::python_exception`].
//!
//! It also checks that every entry point catches panics (its body runs inside `guard` or `catch_unwind`),
//! and that only `mempool_torch_alloc`, which throws PyTorch's C++ exception, may unwind.
//!
//! The files are read at compile time, so the test runs from any directory.

use std::collections::BTreeMap;

use mempool_capi::error::PythonException;
use mempool_capi::Status;

const HEADER: &str = include_str!("../include/mempool.h");
const SOURCES: [(&str, &str); 3] = [
    ("src/ffi.rs", include_str!("../src/ffi.rs")),
    ("src/torch.rs", include_str!("../src/torch.rs")),
    ("src/cupy.rs", include_str!("../src/cupy.rs")),
];
const PY_ERRORS: &str = include_str!("../../mempool-py/python/mempool/_errors.py");

/// The one entry point allowed to unwind (a C++ exception thrown for PyTorch; see `src/torch.rs`).
const UNWINDS: &[&str] = &["mempool_torch_alloc"];

/// A C function as declared or defined: name, parameters (name, C type), return type.
#[derive(Debug, PartialEq, Eq)]
struct Prototype {
    params: Vec<(String, String)>,
    ret: String,
}

/// `text` without its `/* ... */` and `// ...` comments.
fn strip_c_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b..].find("*/").expect("an unterminated comment in mempool.h");
                rest = &rest[b + end + 2..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |e| &rest[l + e..]);
            }
            (None, None) => {
                out.push_str(rest);
                return out;
            }
            (Some(_), None) => unreachable!(),
        }
    }
}

/// A C type with single spaces and the `*`s attached: `const mempool_resource_t*`.
fn normalize_c_type(t: &str) -> String {
    let spaced = t.replace('*', " * ");
    let words: Vec<&str> = spaced.split_whitespace().collect();
    words.join(" ").replace(" *", "*")
}

/// The text between `open` at `start` and its matching close, and the index after the close.
fn balanced(text: &str, start: usize, open: char, close: char) -> (&str, usize) {
    assert_eq!(text[start..].chars().next(), Some(open), "expected {open:?}");
    let mut depth = 0;
    for (i, c) in text[start..].char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                return (&text[start + 1..start + i], start + i + 1);
            }
        }
    }
    panic!("no matching {close:?}");
}

/// The status enum of the header: (name, code, summary), in order. Each enumerator must have its summary
/// in a `/* ... */` comment on the line above it.
fn header_statuses() -> Vec<(String, i32, String)> {
    let start = HEADER
        .find("typedef enum mempool_status {")
        .expect("mempool.h has no mempool_status enum");
    let (body, _) = balanced(HEADER, start + HEADER[start..].find('{').unwrap(), '{', '}');
    let mut out = Vec::new();
    let mut summary: Option<String> = None;
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(c) = line.strip_prefix("/*") {
            let c = c
                .strip_suffix("*/")
                .unwrap_or_else(|| panic!("a summary spans lines: {line}"));
            summary = Some(c.trim().to_string());
            continue;
        }
        let (name, code) = line
            .trim_end_matches(',')
            .split_once('=')
            .unwrap_or_else(|| panic!("an enumerator without an explicit value: {line}"));
        let name = name.trim().to_string();
        let summary = summary
            .take()
            .unwrap_or_else(|| panic!("{name} has no /* summary */ comment on the line above it"));
        out.push((name, code.trim().parse().unwrap(), summary));
    }
    out
}

/// The function prototypes of the header, by name.
fn header_prototypes() -> BTreeMap<String, Prototype> {
    // Without comments, without the `#ifdef __cplusplus` blocks (`extern "C" {` and its `}`), without the
    // other preprocessor lines.
    let mut text = strip_c_comments(HEADER);
    while let Some(start) = text.find("#ifdef __cplusplus") {
        let end = start
            + text[start..]
                .find("#endif")
                .expect("an #ifdef __cplusplus without #endif");
        text.replace_range(start..end + "#endif".len(), "");
    }
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = BTreeMap::new();
    // Declarations are the statements that end in `);` outside braces (typedefs have braces or no parens).
    let mut statement = String::new();
    let mut depth = 0;
    for c in text.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        statement.push(c);
        if c == ';' || c == '{' || c == '}' {
            let s = std::mem::take(&mut statement).replace('\n', " ");
            let s = s.trim();
            if depth == 0 && c == ';' && s.ends_with(");") && !s.starts_with("typedef") {
                let open = s.find('(').unwrap();
                let head = &s[..open];
                let name = head
                    .split(|c: char| c.is_whitespace() || c == '*')
                    .next_back()
                    .unwrap()
                    .to_string();
                let ret = normalize_c_type(&head[..head.len() - name.len()]);
                let (params, _) = balanced(s, open, '(', ')');
                let params = if params.trim() == "void" {
                    Vec::new()
                } else {
                    params
                        .split(',')
                        .map(|p| {
                            let p = p.trim();
                            let at = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap() + 1;
                            (p[at..].to_string(), normalize_c_type(&p[..at]))
                        })
                        .collect()
                };
                assert!(
                    out.insert(name.clone(), Prototype { params, ret }).is_none(),
                    "{name} declared twice"
                );
            }
        }
    }
    out
}

/// The C type a Rust FFI type is declared as in the header.
fn c_type_of(rust: &str) -> String {
    let rust = rust.trim();
    if let Some(inner) = rust.strip_prefix("*const ") {
        let inner = c_type_of(inner);
        return if inner.contains('*') {
            format!("{inner} const*")
        } else {
            format!("const {inner}*")
        };
    }
    if let Some(inner) = rust.strip_prefix("*mut ") {
        return format!("{}*", c_type_of(inner));
    }
    if let Some(array) = rust.strip_prefix('[').and_then(|a| a.strip_suffix(']')) {
        let (inner, len) = array.split_once(';').expect("an array type without a length");
        return format!("{}[{}]", c_type_of(inner), len.trim());
    }
    match rust {
        "" | "()" => "void",
        "c_int" => "int",
        "usize" => "size_t",
        "i64" => "int64_t",
        "u32" => "uint32_t",
        "u64" => "uint64_t",
        "c_void" => "void",
        "c_char" => "char",
        "ResourceHandle" => "mempool_resource_t",
        "Statistics" => "mempool_statistics_t",
        "ServiceSleepReport" => "mempool_service_sleep_report_t",
        "ServiceWakeReport" => "mempool_service_wake_report_t",
        "ServiceStatistics" => "mempool_service_stats_t",
        "ServiceTagStatistics" => "mempool_service_tag_stats_t",
        other => panic!("no C type known for the Rust type `{other}`: add it to c_type_of"),
    }
    .to_string()
}

/// An entry point of the Rust sources: its prototype in C terms, its ABI string and its body.
struct EntryPoint {
    file: &'static str,
    abi: String,
    prototype: Prototype,
    body: String,
}

/// Every `extern "C"` / `extern "C-unwind"` function defined in the sources, by name. Each must be
/// `#[no_mangle]`.
fn rust_entry_points() -> BTreeMap<String, EntryPoint> {
    let mut out = BTreeMap::new();
    for (file, text) in SOURCES {
        let mut from = 0;
        while let Some(at) = text[from..].find("extern \"C") {
            let at = from + at;
            from = at + 1;
            let quote = at + "extern ".len();
            let close = quote + 1 + text[quote + 1..].find('"').unwrap();
            let abi = text[quote + 1..close].to_string();
            let abi_end = close + 1;
            let after = text[abi_end..].trim_start();
            let Some(sig) = after.strip_prefix("fn ") else {
                continue; // an `extern "C-unwind" { ... }` block of imports
            };
            let name_len = sig.find('(').unwrap();
            let name = sig[..name_len].trim().to_string();
            let attrs_start = text[..at].rfind("\n\n").unwrap_or(0);
            assert!(
                text[attrs_start..at].contains("#[no_mangle]"),
                "{file}: extern \"{abi}\" fn {name} is not #[no_mangle]: it would not be exported under its name"
            );
            let open = text.len() - sig.len() + name_len;
            let (params, after_params) = balanced(text, open, '(', ')');
            let body_open = after_params + text[after_params..].find('{').unwrap();
            let ret = text[after_params..body_open].trim();
            let ret = ret.strip_prefix("->").map_or("()", str::trim);
            let (body, _) = balanced(text, body_open, '{', '}');
            let params = params
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (n, t) = p.split_once(':').unwrap();
                    (
                        n.trim().trim_start_matches('_').to_string(),
                        normalize_c_type(&c_type_of(t)),
                    )
                })
                .collect();
            let prototype = Prototype {
                params,
                ret: normalize_c_type(&c_type_of(ret)),
            };
            let e = EntryPoint {
                file,
                abi,
                prototype,
                body: body.to_string(),
            };
            assert!(out.insert(name.clone(), e).is_none(), "{name} defined twice");
        }
    }
    out
}

#[test]
fn the_status_enum_of_mempool_h_is_the_rust_table() {
    let header = header_statuses();
    let rust: Vec<(String, i32, String)> = Status::ALL
        .iter()
        .map(|s| (s.name().to_string(), *s as i32, s.summary().to_string()))
        .collect();
    let line = |(n, c, s): &(String, i32, String)| format!("  /* {s} */\n  {n} = {c},");
    assert_eq!(
        header,
        rust,
        "include/mempool.h's mempool_status_t differs from Status (src/error.rs); it should read:\n{}",
        rust.iter().map(line).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn status_codes_are_their_index_and_names_round_trip() {
    for (i, s) in Status::ALL.iter().enumerate() {
        assert_eq!(*s as usize, i, "{s:?}: Status::ALL is in code order, without gaps");
        assert_eq!(Status::from_code(*s as i32), Some(*s));
        assert_eq!(s.c_name().to_str().unwrap(), s.name());
        let name = mempool_capi::ffi::mempool_status_name(*s as i32);
        // SAFETY: `mempool_status_name` returns a static NUL-terminated string.
        let name = unsafe { std::ffi::CStr::from_ptr(name) };
        assert_eq!(name.to_str().unwrap(), s.name());
    }
    assert_eq!(Status::from_code(Status::ALL.len() as i32), None);
    assert_eq!(Status::from_code(-1), None);
    // SAFETY: as above.
    let unknown = unsafe { std::ffi::CStr::from_ptr(mempool_capi::ffi::mempool_status_name(12345)) };
    assert_eq!(unknown.to_str().unwrap(), "MEMPOOL_UNKNOWN_STATUS");
}

#[test]
fn every_entry_point_is_declared_in_mempool_h_with_the_same_parameters_and_vice_versa() {
    let header = header_prototypes();
    let rust = rust_entry_points();
    assert!(
        header.len() >= 18,
        "the header parser found only {} prototypes",
        header.len()
    );
    let mut problems = Vec::new();
    for (name, e) in &rust {
        match header.get(name) {
            None => problems.push(format!("{name} ({}) is exported but not declared in mempool.h", e.file)),
            Some(h) if *h != e.prototype => problems.push(format!(
                "{name}: mempool.h declares {h:?}, {} defines {:?}",
                e.file, e.prototype
            )),
            Some(_) => {}
        }
    }
    for name in header.keys() {
        if !rust.contains_key(name) {
            problems.push(format!(
                "{name} is declared in mempool.h but not defined in src/ffi.rs, src/torch.rs or src/cupy.rs"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_entry_point_lets_a_panic_unwind() {
    let all = rust_entry_points();
    assert!(
        all.len() >= 18,
        "the source parser found only {} entry points",
        all.len()
    );
    for (name, e) in all {
        match e.abi.as_str() {
            "C" => {}
            "C-unwind" => assert!(
                UNWINDS.contains(&name.as_str()),
                "{name} is extern \"C-unwind\": only {UNWINDS:?} may unwind (a C++ exception for PyTorch)"
            ),
            other => panic!("{name}: unexpected ABI {other:?}"),
        }
        let catches = ["guard(", "catch_unwind(", "alloc_guarded("]
            .iter()
            .any(|c| e.body.contains(c));
        assert!(
            catches,
            "{name} ({}) runs its body outside `guard`/`catch_unwind`: a panic would abort the caller's process",
            e.file
        );
    }
}

/// The fields of the header's `typedef struct {c_name} { ... }`: (name, C type), arrays as `char[65]`.
fn header_struct(c_name: &str) -> Vec<(String, String)> {
    let start = HEADER
        .find(&format!("typedef struct {c_name} {{"))
        .unwrap_or_else(|| panic!("mempool.h has no struct {c_name}"));
    let (body, _) = balanced(HEADER, start + HEADER[start..].find('{').unwrap(), '{', '}');
    let mut header = Vec::new();
    for decl in strip_c_comments(body)
        .split(';')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let (ty, names) = decl.split_once(char::is_whitespace).unwrap();
        for n in names.split(',') {
            let n = n.trim();
            match n.split_once('[') {
                Some((n, len)) => header.push((n.to_string(), format!("{ty}[{}", len.trim()))),
                None => header.push((n.to_string(), ty.to_string())),
            }
        }
    }
    header
}

/// The fields of `pub struct {rust_name}` in `src/ffi.rs`: (name, C type).
fn rust_struct(rust_name: &str) -> Vec<(String, String)> {
    let ffi = SOURCES[0].1;
    let start = ffi
        .find(&format!("pub struct {rust_name} {{"))
        .unwrap_or_else(|| panic!("no {rust_name} in src/ffi.rs"));
    let (body, _) = balanced(ffi, start + ffi[start..].find('{').unwrap(), '{', '}');
    body.lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("pub "))
        .map(|l| {
            let (n, t) = l.trim_end_matches(',').split_once(':').unwrap();
            (n.trim().to_string(), c_type_of(t))
        })
        .collect()
}

#[test]
fn the_structs_of_mempool_h_are_the_repr_c_structs_of_ffi_rs() {
    use mempool_capi::ffi::{
        ServiceSleepReport, ServiceStatistics, ServiceTagStatistics, ServiceWakeReport, Statistics,
    };
    let pairs = [
        ("mempool_statistics", "Statistics", std::mem::size_of::<Statistics>()),
        (
            "mempool_service_sleep_report",
            "ServiceSleepReport",
            std::mem::size_of::<ServiceSleepReport>(),
        ),
        (
            "mempool_service_wake_report",
            "ServiceWakeReport",
            std::mem::size_of::<ServiceWakeReport>(),
        ),
        (
            "mempool_service_stats",
            "ServiceStatistics",
            std::mem::size_of::<ServiceStatistics>(),
        ),
        (
            "mempool_service_tag_stats",
            "ServiceTagStatistics",
            std::mem::size_of::<ServiceTagStatistics>(),
        ),
    ];
    for (c_name, rust_name, size) in pairs {
        let header = header_struct(c_name);
        let rust = rust_struct(rust_name);
        assert!(!rust.is_empty(), "{rust_name} has no fields the parser found");
        assert_eq!(header, rust, "{c_name}_t differs from {rust_name} (src/ffi.rs)");
        // Every field is 8 bytes wide except the tag statistics' name, number and state, packed as C packs
        // them (65 + 4 + 4 bytes, padded to 80 before the first uint64_t).
        let expected = if rust_name == "ServiceTagStatistics" {
            80 + (rust.len() - 3) * 8
        } else {
            rust.len() * 8
        };
        assert_eq!(size, expected, "{rust_name}'s size");
    }
    assert_eq!(std::mem::offset_of!(ServiceTagStatistics, used_bytes), 80);
}

#[test]
fn mempool_sleep_mode_t_is_the_rust_codes() {
    let start = HEADER
        .find("typedef enum mempool_sleep_mode {")
        .expect("mempool.h has no mempool_sleep_mode enum");
    let (body, _) = balanced(HEADER, start + HEADER[start..].find('{').unwrap(), '{', '}');
    let header: Vec<(String, i32)> = strip_c_comments(body)
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (n, v) = e.split_once('=').expect("an enumerator without a value");
            (n.trim().to_string(), v.trim().parse().unwrap())
        })
        .collect();
    use mempool_capi::service::{SLEEP_DISCARD, SLEEP_OFFLOAD};
    assert_eq!(
        header,
        [
            ("MEMPOOL_SLEEP_DISCARD".to_string(), SLEEP_DISCARD),
            ("MEMPOOL_SLEEP_OFFLOAD".to_string(), SLEEP_OFFLOAD)
        ]
    );
    assert!(
        HEADER.contains("#define MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY (-1)"),
        "mempool_service_resource_create reads -1 as on out of memory"
    );
}

/// The classes `_errors.py` defines: name -> base classes.
fn python_classes() -> BTreeMap<String, Vec<String>> {
    PY_ERRORS
        .lines()
        .filter_map(|l| l.strip_prefix("class "))
        .map(|l| {
            let (name, rest) = l.split_once('(').expect("a class without bases");
            let bases = rest.split_once(')').unwrap().0;
            (
                name.to_string(),
                bases.split(',').map(|b| b.trim().to_string()).collect(),
            )
        })
        .collect()
}

/// Whether `class` is `ancestor` or derives from it in `_errors.py` (or a built-in it names).
fn derives(classes: &BTreeMap<String, Vec<String>>, class: &str, ancestor: &str) -> bool {
    class == ancestor
        || classes
            .get(class)
            .is_some_and(|bases| bases.iter().any(|b| derives(classes, b, ancestor)))
}

#[test]
fn every_status_has_its_python_exception_class() {
    let classes = python_classes();
    assert!(
        classes.contains_key("MempoolError"),
        "_errors.py defines no MempoolError"
    );
    for s in Status::ALL {
        match s.python_exception() {
            None => assert_eq!(*s, Status::Success, "{s:?} has no Python exception"),
            Some(PythonException {
                module: "builtins",
                class,
            }) => {
                assert_eq!(*s, Status::InvalidArgument, "{s:?} is a built-in {class}");
                assert_eq!(class, "ValueError");
            }
            Some(PythonException {
                module: "mempool._errors",
                class,
            }) => {
                assert!(
                    classes.contains_key(class),
                    "{s:?}'s Python class {class} is not defined in mempool-py/python/mempool/_errors.py"
                );
                assert!(
                    derives(&classes, class, "MempoolError"),
                    "{class} does not derive from MempoolError"
                );
                assert!(
                    derives(&classes, class, "RuntimeError"),
                    "{class} is not a RuntimeError"
                );
            }
            Some(other) => panic!("{s:?}: unexpected module {other:?}"),
        }
    }
    assert!(derives(&classes, "OutOfMemoryError", "MemoryError"));
}
