//! `ServiceMemoryResource` (mempool-rmm's `ServiceResource`: one pool per device with tags, sleep and
//! wake) and `TaggedMemoryResource` (the resource seen as one that allocates under one tag).

use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

use mempool_core::StreamRef;
use mempool_rmm::{ServiceResource, SharedResource, Tag};

use super::base::{device_or_current, PyResource};
use crate::errors::IntoPy;
use crate::stream::{self, StreamArg};

/// One pool for GPU services (mempool-rmm's `ServiceResource`): a virtual reservation on the device,
/// divided into a region per tag, each suballocated stream-ordered and backed by physical chunks mapped
/// where allocations land, so that growth never moves an address. Allocations through it are of the tag
/// `"default"`; `tagged(name)` gives a resource per tag. `sleep(tags)` releases the physical memory of
/// whole tags, keeping their addresses (and live buffers) reserved, after offloading the contents to
/// pinned host memory or discarding them; `wake(tags)` maps memory back at the same addresses and restores
/// the contents. `watermark` bounds what it keeps mapped above the peak of live bytes, in percent (None:
/// idle memory is unmapped only when mapping runs out of memory, and by `trim`).
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct ServiceMemoryResource {
    typed: Arc<ServiceResource>,
}

/// The `ServiceResource` behind a Python object: `Some` for a `ServiceMemoryResource` or a
/// `TaggedMemoryResource` of one (what `mempool.ipc`'s `Exporter.share_range` shares), `None` otherwise.
pub(crate) fn service_of(obj: &Bound<'_, PyAny>) -> Option<Arc<ServiceResource>> {
    if let Ok(s) = obj.cast::<ServiceMemoryResource>() {
        return Some(s.get().typed.clone());
    }
    obj.cast::<TaggedMemoryResource>().ok().map(|t| t.get().service.clone())
}

/// A tag given by name (an existing tag) or by number.
fn one_tag(mr: &ServiceResource, obj: &Bound<'_, PyAny>) -> PyResult<Tag> {
    if let Ok(name) = obj.cast::<PyString>() {
        return mempool_capi::service::tag_by_name(mr, &name.to_cow()?).py();
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        let n: i128 = obj.extract()?;
        let n = u64::try_from(n).map_err(|_| PyValueError::new_err(format!("tag {n} is negative")))?;
        return mempool_capi::service::tag_by_number(mr, n).py();
    }
    Err(PyTypeError::new_err(format!(
        "a tag is a name (str) or a tag number (int), not a {}",
        obj.get_type().name()?
    )))
}

/// `tags=` of `sleep` and `wake`: one tag (a name or a number) or an iterable of tags.
fn tag_list(mr: &ServiceResource, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Tag>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyInt>() {
        return Ok(vec![one_tag(mr, obj)?]);
    }
    let items = obj.try_iter().map_err(|_| {
        PyTypeError::new_err("tags must be a tag (a name or a number) or an iterable of tags".to_string())
    })?;
    items.map(|item| one_tag(mr, &item?)).collect()
}

/// A stream argument as a stream of the primary context of `device`.
///
/// # Safety
/// 1. The stream (`s.handle`) is live while the returned view is used: `s.owner` is held by the caller
///    across the call, and a raw integer (or None, the legacy stream) is the caller's documented promise.
/// 2. It is a stream of `device`'s primary context (or a special handle).
#[allow(unsafe_code)]
unsafe fn stream_of<'c>(s: &StreamArg, ctx: &'c Arc<mempool_core::Context>) -> StreamRef<'c> {
    // SAFETY: points 1 and 2.
    unsafe { StreamRef::from_raw(s.handle as mempool_core::RawStream) }.in_context(ctx)
}

#[pymethods]
impl ServiceMemoryResource {
    #[new]
    #[pyo3(signature = (
        device = None, *, max_tags = 8, chunk_size = None, region_size = None, watermark = Some(15), shareable = None
    ))]
    #[pyo3(
        text_signature = "(device=None, *, max_tags=8, chunk_size=None, region_size=None, watermark=15, shareable=None)"
    )]
    fn new(
        device: Option<usize>,
        max_tags: usize,
        chunk_size: Option<usize>,
        region_size: Option<usize>,
        watermark: Option<u32>,
        shareable: Option<bool>,
    ) -> PyResult<PyClassInitializer<Self>> {
        if max_tags == 0 {
            return Err(PyValueError::new_err(
                "max_tags must be at least 1 (the default tag is one)",
            ));
        }
        if chunk_size == Some(0) {
            return Err(PyValueError::new_err(
                "chunk_size must be positive (None: the recommended granularity, at least 2 MiB)",
            ));
        }
        if region_size == Some(0) {
            return Err(PyValueError::new_err(
                "region_size must be positive (None: twice the device's memory)",
            ));
        }
        if let Some(w) = watermark {
            if w > 10_000 {
                return Err(PyValueError::new_err(format!(
                    "watermark={w}: at most 10000 (percent above the peak of live bytes), or None to unmap idle \
                     memory only on out of memory"
                )));
            }
        }
        let d = device_or_current(device)?;
        let options = mempool_capi::service::options(max_tags, chunk_size, region_size, watermark, shareable);
        let typed = mempool_capi::service::create(d, options).py()?;
        let shared: SharedResource = typed.clone();
        Ok(PyResource::leaf(shared, d).add_subclass(ServiceMemoryResource { typed }))
    }

    /// The number of the tag named `name`, made now if there is none (1 to 64 ASCII letters, digits, `_`,
    /// `-`, `.` or `:`). `ValueError` for another name, or one tag more than `max_tags`.
    fn tag(&self, name: &str) -> PyResult<u32> {
        let tag = mempool_capi::service::tag_or_new(&self.typed, name).py()?;
        Ok(tag.index() as u32)
    }

    /// A resource that allocates under `tag` (a name: made now if there is none; or a tag number), usable
    /// wherever a resource is (`DeviceBuffer(mr=)`, `set_current_device_resource`, the PyTorch allocator).
    /// Its buffers are freed into whichever tag they belong to.
    fn tagged(slf: &Bound<'_, Self>, tag: &Bound<'_, PyAny>) -> PyResult<Py<TaggedMemoryResource>> {
        let mr = &slf.get().typed;
        let tag = match tag.cast::<PyString>() {
            Ok(name) => mempool_capi::service::tag_or_new(mr, &name.to_cow()?).py()?,
            Err(_) => one_tag(mr, tag)?,
        };
        let shared: SharedResource = Arc::new(mr.tagged(tag));
        let init = PyResource::over(shared, slf.as_super()).add_subclass(TaggedMemoryResource {
            service: mr.clone(),
            tag,
        });
        Py::new(slf.py(), init)
    }

    /// Releases the physical memory of `tags` (a name, a tag number, or an iterable of them), keeping their
    /// addresses and live buffers: `mode="offload"` copies the contents to pinned host memory first
    /// (ordered on `stream`), `mode="discard"` loses them. Returns `{"released_bytes", "offloaded_bytes"}`.
    /// It waits for the frees into the tags still in flight (on any stream), and, where a tag still has
    /// live buffers, for the whole device (their users' streams are unknown to it); a tag with nothing
    /// live does not wait for the device. Refused with nothing changed (`UnsupportedError`): a tag already asleep or shared with
    /// another process, `stream` with work still queued. Until `wake`, allocating from a sleeping tag
    /// raises `UnsupportedError`; a buffer freed meanwhile goes back to the tag (its memory is not mapped
    /// back by `wake` unless a live buffer shares it). Runs with the interpreter released.
    #[pyo3(signature = (tags, mode = "offload", stream = None))]
    fn sleep<'py>(
        &self,
        py: Python<'py>,
        tags: &Bound<'py, PyAny>,
        mode: &str,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mode = mempool_capi::service::mode_of_name(mode).py()?;
        let tags = tag_list(&self.typed, tags)?;
        let s = stream::extract(stream)?;
        let ctx = mempool_capi::device::context(self.typed.device().ordinal()).py()?;
        // SAFETY: point 1: the stream's object (`stream`) is held by the caller across this call, and the
        // view does not outlive it; a raw integer or None is the caller's documented promise. Point 2: a
        // stream passed for this resource's device (the documented contract).
        #[allow(unsafe_code)]
        let sref = unsafe { stream_of(&s, &ctx) };
        let mr = &self.typed;
        let r = py.detach(|| mr.sleep(&tags, mode, sref)).py()?;
        let d = PyDict::new(py);
        d.set_item("released_bytes", r.released_bytes)?;
        d.set_item("offloaded_bytes", r.offloaded_bytes)?;
        Ok(d)
    }

    /// Maps the memory of the sleeping tags among `tags` back at the same addresses and, for offloaded
    /// ones, copies the contents back, ordered on `stream`; returns once `stream` is done, with
    /// `{"mapped_bytes", "restored_bytes"}`. Awake tags are skipped. On out of memory (`OutOfMemoryError`)
    /// the failing tag stays asleep with its contents: free memory and call again.
    #[pyo3(signature = (tags, stream = None))]
    fn wake<'py>(
        &self,
        py: Python<'py>,
        tags: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tags = tag_list(&self.typed, tags)?;
        let s = stream::extract(stream)?;
        let ctx = mempool_capi::device::context(self.typed.device().ordinal()).py()?;
        // SAFETY: as in `sleep`.
        #[allow(unsafe_code)]
        let sref = unsafe { stream_of(&s, &ctx) };
        let mr = &self.typed;
        let r = py.detach(|| mr.wake(&tags, sref)).py()?;
        let d = PyDict::new(py);
        d.set_item("mapped_bytes", r.mapped_bytes)?;
        d.set_item("restored_bytes", r.restored_bytes)?;
        Ok(d)
    }

    /// Waits for the frees still in flight, then unmaps every chunk of an awake tag that no live buffer
    /// touches. Returns the bytes released. Runs with the interpreter released.
    fn trim(&self, py: Python<'_>) -> PyResult<u64> {
        let mr = &self.typed;
        py.detach(|| mr.trim()).py()
    }

    /// What it holds: `mapped_bytes`, `peak_mapped_bytes`, `used_bytes`, `peak_used_bytes`,
    /// `reservation_bytes`, `chunk_size`, `reclaims`, `reclaimed_bytes`, and `tags`: per tag name, its
    /// `tag` number, `asleep` (None, `"offload"` or `"discard"`), `used_bytes`, `peak_used_bytes`,
    /// `live_allocations`, `allocations`, `frees`, `mapped_bytes`, `offloaded_bytes`,
    /// `largest_free_mapped` and `exports`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.typed.stats();
        let d = PyDict::new(py);
        d.set_item("mapped_bytes", s.mapped_bytes)?;
        d.set_item("peak_mapped_bytes", s.peak_mapped_bytes)?;
        d.set_item("used_bytes", s.used_bytes)?;
        d.set_item("peak_used_bytes", s.peak_used_bytes)?;
        d.set_item("reservation_bytes", s.reservation_bytes)?;
        d.set_item("chunk_size", s.chunk_size)?;
        d.set_item("reclaims", s.reclaims)?;
        d.set_item("reclaimed_bytes", s.reclaimed_bytes)?;
        let tags = PyDict::new(py);
        for t in &s.tags {
            let row = PyDict::new(py);
            row.set_item("tag", t.tag.index())?;
            row.set_item("asleep", t.asleep.map(mempool_capi::service::mode_name))?;
            row.set_item("used_bytes", t.used_bytes)?;
            row.set_item("peak_used_bytes", t.peak_used_bytes)?;
            row.set_item("live_allocations", t.live_allocations)?;
            row.set_item("allocations", t.allocations)?;
            row.set_item("frees", t.frees)?;
            row.set_item("mapped_bytes", t.mapped_bytes)?;
            row.set_item("offloaded_bytes", t.offloaded_bytes)?;
            row.set_item("largest_free_mapped", t.largest_free_mapped)?;
            row.set_item("exports", t.exports)?;
            tags.set_item(&t.name, row)?;
        }
        d.set_item("tags", tags)?;
        Ok(d)
    }

    /// Sets every peak (the resource's and each tag's) to the current value; the watermark follows the
    /// peak of live bytes, so the resource may hold less from now on.
    fn reset_peaks(&self) {
        self.typed.reset_peaks();
    }

    /// Bytes per physical chunk (what is mapped and unmapped at a time).
    #[getter]
    fn chunk_size(&self) -> usize {
        self.typed.chunk_size()
    }

    /// Bytes of address space per tag.
    #[getter]
    fn region_size(&self) -> usize {
        self.typed.region_size()
    }

    /// The names of the tags, in tag order (the tag number is the position).
    #[getter]
    fn tag_names(&self) -> Vec<String> {
        mempool_capi::service::tag_names(&self.typed)
    }
}

/// A `ServiceMemoryResource` seen as a resource that allocates under one tag (made by
/// `ServiceMemoryResource.tagged`); its `upstream_mr` is the service resource.
#[pyclass(module = "mempool.mr", extends = PyResource, frozen)]
pub struct TaggedMemoryResource {
    service: Arc<ServiceResource>,
    tag: Tag,
}

#[pymethods]
impl TaggedMemoryResource {
    /// The tag's number.
    #[getter]
    fn tag(&self) -> u32 {
        self.tag.index() as u32
    }

    /// The tag's name.
    #[getter]
    fn tag_name(&self) -> String {
        self.service.tag_name(self.tag).unwrap_or_default()
    }
}
