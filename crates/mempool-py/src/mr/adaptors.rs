//! The adaptors: `StatisticsResourceAdaptor` (and its `Statistics`), `TrackingResourceAdaptor`,
//! `LoggingResourceAdaptor`, `LimitingResourceAdaptor`, `FailureCallbackResourceAdaptor`.

use std::fs::File;
use std::io::BufWriter;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

use mempool_rmm::adaptors::{
    Counters, FailureCallbackAdaptor, LimitingAdaptor, LoggingAdaptor, StatisticsAdaptor, TrackingAdaptor,
};
use mempool_rmm::SharedResource;

use super::base::PyResource;
use crate::errors::IntoPy;

/// Counters of bytes and allocations: current, peak and total (RMM's `Statistics`).
#[pyclass(module = "mempool.mr", frozen, get_all, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct Statistics {
    current_bytes: i64,
    current_count: i64,
    peak_bytes: i64,
    peak_count: i64,
    total_bytes: i64,
    total_count: i64,
}

impl From<Counters> for Statistics {
    fn from(c: Counters) -> Self {
        Statistics {
            current_bytes: c.bytes.current,
            current_count: c.allocations.current,
            peak_bytes: c.bytes.peak,
            peak_count: c.allocations.peak,
            total_bytes: c.bytes.total,
            total_count: c.allocations.total,
        }
    }
}

#[pymethods]
impl Statistics {
    fn __repr__(&self) -> String {
        format!(
            "Statistics(current_bytes={}, current_count={}, peak_bytes={}, peak_count={}, total_bytes={}, \
             total_count={})",
            self.current_bytes,
            self.current_count,
            self.peak_bytes,
            self.peak_count,
            self.total_bytes,
            self.total_count
        )
    }
}

/// Counts what passes through to the upstream: RMM's `StatisticsResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct StatisticsResourceAdaptor {
    typed: Arc<StatisticsAdaptor<SharedResource>>,
}

#[pymethods]
impl StatisticsResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>) -> PyClassInitializer<Self> {
        let typed = Arc::new(StatisticsAdaptor::new(upstream_mr.get().inner.clone()));
        // C code's handle to the current resource reads these counters when this adaptor is current.
        mempool_capi::ffi::register_statistics(&typed);
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(StatisticsResourceAdaptor { typed })
    }
    /// The counters of the innermost scope.
    #[getter]
    fn allocation_counts(&self) -> Statistics {
        self.typed.counters().into()
    }
    /// Starts a scope with zeroed counters; returns the counters before it.
    fn push_counters(&self) -> Statistics {
        self.typed.push_counters().into()
    }
    /// Ends the innermost scope and returns its counters (the outer scope absorbs them).
    fn pop_counters(&self) -> PyResult<Statistics> {
        self.typed
            .pop_counters()
            .map(Statistics::from)
            .ok_or_else(|| PyValueError::new_err("pop_counters: the outermost scope cannot be popped"))
    }
}

/// Records every outstanding allocation: RMM's `TrackingResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct TrackingResourceAdaptor {
    typed: Arc<TrackingAdaptor<SharedResource>>,
}

#[pymethods]
impl TrackingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, capture_stacks = false))]
    fn new(upstream_mr: &Bound<'_, PyResource>, capture_stacks: bool) -> PyClassInitializer<Self> {
        let _ = capture_stacks; // the Rust adaptor records each allocation's call site and thread always
        let typed = Arc::new(TrackingAdaptor::new(upstream_mr.get().inner.clone()));
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(TrackingResourceAdaptor { typed })
    }
    /// Bytes outstanding.
    fn get_allocated_bytes(&self) -> usize {
        self.typed.outstanding_bytes()
    }
    /// One line per outstanding allocation.
    fn get_outstanding_allocations_str(&self) -> String {
        self.typed.leak_report()
    }
    /// Prints the outstanding allocations.
    fn log_outstanding_allocations(&self) {
        println!("{}", self.typed.leak_report());
    }
}

type FileLogger = LoggingAdaptor<SharedResource, BufWriter<File>>;

/// Every logging adaptor alive, flushed by `_flush_logs` (which `mempool.mr` registers with `atexit`, as RMM
/// flushes its logs at exit: an adaptor kept as the current resource is never dropped).
static LOGGERS: Mutex<Vec<std::sync::Weak<FileLogger>>> = Mutex::new(Vec::new());

/// Flushes every live `LoggingResourceAdaptor`'s buffered lines to its file (registered with `atexit` by
/// `mempool.mr`). A failure to write is reported as a warning, not raised.
#[pyfunction]
pub fn _flush_logs(py: Python<'_>) -> PyResult<()> {
    let live: Vec<Arc<FileLogger>> = {
        let mut all = LOGGERS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(|w| w.upgrade()).collect()
    };
    for logger in live {
        if let Err(e) = py.detach(|| logger.flush()) {
            let warnings = py.import("warnings")?;
            warnings.call_method1("warn", (format!("mempool: could not flush a log file: {e}"),))?;
        }
    }
    Ok(())
}

/// `name` with `.dev{device}` before its extension (`log.csv` -> `log.dev0.csv`), as RMM's `_append_id`
/// (`os.path.splitext`: a leading dot is not an extension, and only the last dot of the file name counts).
fn append_device(name: &str, device: usize) -> String {
    let file_start = name.rfind('/').map_or(0, |i| i + 1);
    let file = &name[file_start..];
    let stem_len = file.len() - file.trim_start_matches('.').len();
    match file[stem_len..].rfind('.') {
        Some(dot) => {
            let at = file_start + stem_len + dot;
            format!("{}.dev{device}{}", &name[..at], &name[at..])
        }
        None => format!("{name}.dev{device}"),
    }
}

/// Writes every allocation and free as a CSV line (RMM's format): RMM's `LoggingResourceAdaptor`. The file
/// is `log_file_name`, else the environment variable `RMM_LOG_FILE`, with `.dev{N}` inserted before its
/// extension (N: the device the adaptor allocates on) and made absolute, as RMM names it; `get_file_name()`
/// returns the name used.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct LoggingResourceAdaptor {
    typed: Arc<FileLogger>,
    file_name: String,
}

#[pymethods]
impl LoggingResourceAdaptor {
    #[new]
    #[pyo3(signature = (upstream_mr, log_file_name = None))]
    fn new(upstream_mr: &Bound<'_, PyResource>, log_file_name: Option<String>) -> PyResult<PyClassInitializer<Self>> {
        let given = log_file_name.or_else(|| std::env::var("RMM_LOG_FILE").ok().filter(|f| !f.is_empty()));
        let Some(given) = given else {
            return Err(PyValueError::new_err(
                "LoggingResourceAdaptor needs log_file_name or the RMM_LOG_FILE environment variable",
            ));
        };
        let named = append_device(&given, upstream_mr.get().device);
        let file_name = std::path::absolute(&named)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or(named);
        let file = File::create(&file_name)
            .map_err(|e| PyErr::new::<pyo3::exceptions::PyOSError, _>(format!("cannot create {file_name}: {e}")))?;
        let typed = Arc::new(LoggingAdaptor::new(upstream_mr.get().inner.clone(), BufWriter::new(file)).py()?);
        LOGGERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&typed));
        let shared: SharedResource = typed.clone();
        Ok(PyResource::over(shared, upstream_mr).add_subclass(LoggingResourceAdaptor { typed, file_name }))
    }
    /// The log file's name.
    fn get_file_name(&self) -> String {
        self.file_name.clone()
    }
    /// Writes buffered lines to the file.
    fn flush(&self) -> PyResult<()> {
        self.typed.flush().py()
    }
}

/// Refuses allocations that would take more than `allocation_limit` bytes through it (an
/// `OutOfMemoryError` naming the size): RMM's `LimitingResourceAdaptor`.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct LimitingResourceAdaptor {
    typed: Arc<LimitingAdaptor<SharedResource>>,
}

#[pymethods]
impl LimitingResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>, allocation_limit: usize) -> PyClassInitializer<Self> {
        let typed = Arc::new(LimitingAdaptor::new(upstream_mr.get().inner.clone(), allocation_limit));
        let shared: SharedResource = typed.clone();
        PyResource::over(shared, upstream_mr).add_subclass(LimitingResourceAdaptor { typed })
    }
    /// Bytes allocated through the adaptor now.
    fn get_allocated_bytes(&self) -> usize {
        self.typed.used()
    }
    /// The limit.
    fn get_allocation_limit(&self) -> usize {
        self.typed.limit()
    }
}

/// Live failure-callback adaptors (on the Rust side): the only resources that run Python code, which they
/// do while their upstream may hold its lock. See [`calls_python`].
static PYTHON_CALLBACKS: AtomicUsize = AtomicUsize::new(0);

/// Whether any resource of the process can run Python code during an allocation or a free (a
/// `FailureCallbackResourceAdaptor` is alive). While none can, an allocating thread may keep the
/// interpreter: no lock a resource holds is ever held by a thread waiting for the interpreter.
pub(crate) fn calls_python() -> bool {
    PYTHON_CALLBACKS.load(Ordering::Acquire) != 0
}

/// Counts one live failure-callback adaptor in [`PYTHON_CALLBACKS`] for as long as it lives (its callback
/// closure owns it).
struct CountsAsPython;

impl CountsAsPython {
    fn new() -> CountsAsPython {
        PYTHON_CALLBACKS.fetch_add(1, Ordering::AcqRel);
        CountsAsPython
    }
}

impl Drop for CountsAsPython {
    fn drop(&mut self) {
        PYTHON_CALLBACKS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// On out-of-memory calls `callback(nbytes)`; a true result retries the allocation: RMM's
/// `FailureCallbackResourceAdaptor`. An exception in the callback is reported as unraisable and counts as
/// false.
///
/// The callback is held once, shared by this object and the Rust adaptor, and the garbage collector sees
/// it: a callback that refers to the adaptor forms a cycle the collector frees (clearing the callback;
/// the adaptor then refuses like its upstream).
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct FailureCallbackResourceAdaptor {
    callback: Arc<Mutex<Option<Py<PyAny>>>>,
}

#[pymethods]
impl FailureCallbackResourceAdaptor {
    #[new]
    fn new(upstream_mr: &Bound<'_, PyResource>, callback: Bound<'_, PyAny>) -> PyResult<PyClassInitializer<Self>> {
        if !callback.is_callable() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "callback must be callable: callback(nbytes) -> bool",
            ));
        }
        let slot = Arc::new(Mutex::new(Some(callback.unbind())));
        let cb = slot.clone();
        // Counted before the adaptor can be used: from now on allocations release the interpreter.
        let counted = CountsAsPython::new();
        // The closure takes the GIL to call the callback (allocations run with the GIL released while such
        // an adaptor lives, so an allocating Python thread does not hold it here); the slot's lock is not
        // held during the call.
        let f = move |bytes: usize, _attempt: u32| {
            let _counted = &counted;
            Python::attach(|py| {
                let callback = cb
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|c| c.clone_ref(py));
                let Some(callback) = callback else {
                    return false; // cleared by the garbage collector
                };
                match callback.call1(py, (bytes,)).and_then(|r| r.bind(py).is_truthy()) {
                    Ok(retry) => retry,
                    Err(e) => {
                        e.write_unraisable(py, None);
                        false
                    }
                }
            })
        };
        let mr: SharedResource = Arc::new(FailureCallbackAdaptor::new(upstream_mr.get().inner.clone(), f));
        Ok(PyResource::over(mr, upstream_mr).add_subclass(FailureCallbackResourceAdaptor { callback: slot }))
    }
    /// The callback (None once the garbage collector cleared it).
    #[getter]
    fn callback(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.callback
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|c| c.clone_ref(py))
    }
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(cb) = self.callback.try_lock() {
            visit.call(&*cb)?;
        }
        Ok(())
    }
    fn __clear__(&self) {
        let taken = self.callback.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken); // after the lock is released: dropping may run Python code
    }
}
