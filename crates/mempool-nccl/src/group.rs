//! `ncclGroupStart` ... `ncclGroupEnd` as a scope: [`group`] opens the group, runs a closure that
//! enqueues collectives through a [`Group`], and always ends it (also when the closure returns an error
//! or panics), before the borrows the closure handed to the group can end. Deregistrations asked for
//! while the group is open wait for its end (see [`Registration`](crate::Registration)).

use std::marker::PhantomData;

use mempool_core::{BufferView, StreamRef};

use crate::comm::{Coll, Comm};
use crate::error::Result;
use crate::scope::{is_open, nested, scoped};
use crate::sys;
use crate::types::{NcclType, ReduceOp};

/// Runs `f` inside `ncclGroupStart` ... `ncclGroupEnd`: collectives of several communicators driven
/// from one thread (one per GPU of [`Comm::init_all`]) must be enqueued in one group, or the first one
/// waits for the others forever. `f` enqueues through the [`Group`] it is given; the group ends when
/// `f` returns, also when it returns an error or panics (the panic then continues), and `group`
/// returns `f`'s result, or `ncclGroupEnd`'s error.
///
/// Like [`std::thread::scope`], every borrow handed to the group (communicator, buffers, stream) lives
/// for `'scope`, which ends only after `ncclGroupEnd` has launched the work, so no buffer the group
/// uses can be dropped, moved or mutably borrowed inside `f`; the buffers' stream-ordered frees then
/// follow the collectives on their stream. While the group is open:
///
/// - the communicators' own collective methods, [`Comm::init_all`], [`Comm::init_rank`],
///   [`Comm::register`] and a nested `group` are refused with an error naming the open group;
/// - a [`Registration`](crate::Registration) dropped (or [`deregister`](crate::Registration::deregister)ed)
///   is deregistered after `ncclGroupEnd`, before `group` returns; `group` returns its error (if `f`
///   and `ncclGroupEnd` succeeded) or prints it.
///
/// ```no_run
/// use std::sync::Arc;
/// use mempool_core::{Device, Stream};
/// use mempool_nccl::{Comm, ReduceOp};
/// use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let devices = Device::all()?;
/// let comms = Comm::init_all(&devices)?;
/// let streams = devices.iter().map(|d| Stream::new(&d.context()?)).collect::<Result<Vec<_>, _>>()?;
/// let mut bufs = Vec::new();
/// for (d, s) in devices.iter().zip(&streams) {
///     let mr: SharedResource = Arc::new(VmmResource::new(d, VmmOptions::default())?);
///     bufs.push(DeviceBuffer::from_host(&[1u8; 1024], s, mr)?);
/// }
/// mempool_nccl::group(|g| {
///     for ((c, b), s) in comms.iter().zip(&bufs).zip(&streams) {
///         g.all_reduce_in_place::<u8>(c, b, ReduceOp::Sum, s.as_ref())?;
///     }
///     Ok(())
/// })?;
/// drop(bufs); // after the group: the frees are ordered after the all-reduces on each stream
/// # Ok(())
/// # }
/// ```
///
/// A buffer the group borrowed cannot be dropped inside the closure:
///
/// ```compile_fail,E0505
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::{Comm, ReduceOp};
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// let buf = DeviceBuffer::from_host(&[1u8; 1024], &stream, mr)?;
/// mempool_nccl::group(|g| {
///     g.all_reduce_in_place::<u8>(&comms[0], &buf, ReduceOp::Sum, stream.as_ref())?;
///     drop(buf); // error[E0505]: cannot move out of `buf` because it is borrowed
///     Ok(())
/// })?;
/// # Ok(())
/// # }
/// ```
///
/// nor made inside it (it would be freed before `ncclGroupEnd`):
///
/// ```compile_fail,E0597
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::{Comm, ReduceOp};
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// mempool_nccl::group(|g| {
///     let buf = DeviceBuffer::from_host(&[1u8; 1024], &stream, mr).unwrap();
///     g.all_reduce_in_place::<u8>(&comms[0], &buf, ReduceOp::Sum, stream.as_ref())?;
///     Ok(())
/// })?; // error[E0597]: `buf` does not live long enough
/// # Ok(())
/// # }
/// ```
///
/// nor mutated inside it:
///
/// ```compile_fail,E0502
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::{Comm, ReduceOp};
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// let mut buf = DeviceBuffer::from_host(&[1u8; 1024], &stream, mr)?;
/// mempool_nccl::group(|g| {
///     g.all_reduce_in_place::<u8>(&comms[0], &buf, ReduceOp::Sum, stream.as_ref())?;
///     buf.resize(0).unwrap(); // error[E0502]: cannot borrow `buf` as mutable because it is also borrowed as immutable
///     Ok(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[allow(unsafe_code)]
pub fn group<'env, R>(f: impl for<'scope> FnOnce(&'scope Group<'scope, 'env>) -> Result<R>) -> Result<R> {
    if is_open() {
        return Err(nested());
    }
    let lib = sys::library()?;
    let start = lib.get(&lib.group_start)?;
    let end = lib.get(&lib.group_end)?;
    let g = Group {
        _scope: PhantomData,
        _env: PhantomData,
        _not_send: PhantomData,
    };
    scoped(
        || {
            // SAFETY: no arguments; `scoped` calls the matching ncclGroupEnd (below) on this thread
            // whatever the body does.
            let r = unsafe { start() };
            lib.check("ncclGroupStart", r, std::ptr::null_mut())
        },
        || {
            // SAFETY: matches the ncclGroupStart above, on the same thread (`scoped` runs both here).
            let r = unsafe { end() };
            lib.check("ncclGroupEnd", r, std::ptr::null_mut())
        },
        || f(&g),
    )
}

/// The open group handed to [`group`]'s closure: its methods enqueue collectives, which NCCL launches at
/// `ncclGroupEnd`. Everything they take is borrowed for `'scope`, which outlasts `ncclGroupEnd`.
///
/// `'scope` is invariant (as in [`std::thread::Scope`]), so the closure cannot shorten it to a borrow
/// of its own locals. Neither `Send` nor `Sync`: NCCL's group state belongs to the thread.
pub struct Group<'scope, 'env: 'scope> {
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Group<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Group")
    }
}

impl<'scope> Group<'scope, '_> {
    /// [`Comm::all_reduce`] inside the group.
    pub fn all_reduce<T: NcclType>(
        &self,
        comm: &'scope Comm,
        send: &'scope BufferView<'_>,
        recv: &'scope BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        comm.enqueue::<T>(Coll::AllReduce(op), Some(send), recv, stream)
    }

    /// [`Comm::all_reduce_in_place`] inside the group.
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        comm: &'scope Comm,
        buf: &'scope BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        comm.enqueue::<T>(Coll::AllReduce(op), None, buf, stream)
    }

    /// [`Comm::all_gather`] inside the group.
    pub fn all_gather<T: NcclType>(
        &self,
        comm: &'scope Comm,
        send: &'scope BufferView<'_>,
        recv: &'scope BufferView<'_>,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        comm.enqueue::<T>(Coll::AllGather, Some(send), recv, stream)
    }

    /// [`Comm::all_gather_in_place`] inside the group.
    pub fn all_gather_in_place<T: NcclType>(
        &self,
        comm: &'scope Comm,
        buf: &'scope BufferView<'_>,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        comm.enqueue::<T>(Coll::AllGather, None, buf, stream)
    }

    /// [`Comm::reduce_scatter`] inside the group.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        comm: &'scope Comm,
        send: &'scope BufferView<'_>,
        recv: &'scope BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        comm.enqueue::<T>(Coll::ReduceScatter(op), Some(send), recv, stream)
    }

    /// [`Comm::broadcast`] inside the group.
    pub fn broadcast<T: NcclType>(
        &self,
        comm: &'scope Comm,
        send: &'scope BufferView<'_>,
        recv: &'scope BufferView<'_>,
        root: usize,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        let root = comm.root("ncclBroadcast", root)?;
        comm.enqueue::<T>(Coll::Broadcast(root), Some(send), recv, stream)
    }

    /// [`Comm::broadcast_in_place`] inside the group.
    pub fn broadcast_in_place<T: NcclType>(
        &self,
        comm: &'scope Comm,
        buf: &'scope BufferView<'_>,
        root: usize,
        stream: StreamRef<'scope>,
    ) -> Result<()> {
        let root = comm.root("ncclBroadcast", root)?;
        comm.enqueue::<T>(Coll::Broadcast(root), None, buf, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::scope::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<String>>>;

    fn step(log: &Log, what: &str) -> impl FnOnce() -> Result<()> {
        let log = log.clone();
        let what = what.to_owned();
        move || {
            log.borrow_mut().push(what);
            Ok(())
        }
    }

    fn failing(log: &Log, what: &'static str) -> impl FnOnce() -> Result<()> {
        let log = log.clone();
        move || {
            log.borrow_mut().push(what.to_owned());
            Err(Error::InvalidArgument {
                call: what,
                reason: format!("{what} failed"),
            })
        }
    }

    fn entries(log: &Log) -> Vec<String> {
        log.borrow().clone()
    }

    #[test]
    fn the_group_ends_after_the_body_and_deferred_work_runs_after_the_end() {
        let log = Log::default();
        let out = scoped(step(&log, "start"), step(&log, "end"), || {
            assert!(is_open());
            log.borrow_mut().push("body".into());
            run_or_defer(|| "dereg a".into(), step(&log, "dereg a"))?;
            run_or_defer(|| "dereg b".into(), step(&log, "dereg b"))?;
            assert_eq!(entries(&log), ["start", "body"], "deferred work waits for the end");
            Ok(7)
        });
        assert_eq!(out, Ok(7));
        assert!(!is_open());
        assert_eq!(entries(&log), ["start", "body", "end", "dereg a", "dereg b"]);
        // Outside a group the work runs at once.
        run_or_defer(|| "now".into(), step(&log, "now")).unwrap();
        assert_eq!(entries(&log).last().map(String::as_str), Some("now"));
    }

    #[test]
    fn the_group_ends_when_the_body_fails_and_the_body_error_wins() {
        let log = Log::default();
        let out: Result<()> = scoped(step(&log, "start"), failing(&log, "end"), || {
            run_or_defer(|| "dereg".into(), step(&log, "dereg"))?;
            Err(Error::InvalidArgument {
                call: "body",
                reason: "the body failed".into(),
            })
        });
        let e = out.unwrap_err();
        assert!(e.to_string().contains("the body failed"), "{e}");
        assert_eq!(entries(&log), ["start", "end", "dereg"]);
        assert!(!is_open());
    }

    #[test]
    fn end_and_deferred_errors_are_returned_in_order() {
        let log = Log::default();
        let out = scoped(step(&log, "start"), failing(&log, "end"), || Ok(1));
        assert!(out.unwrap_err().to_string().contains("end failed"));
        let log = Log::default();
        let out = scoped(step(&log, "start"), step(&log, "end"), || {
            run_or_defer(|| "first".into(), failing(&log, "first"))?;
            run_or_defer(|| "second".into(), failing(&log, "second"))?;
            run_or_defer(|| "third".into(), step(&log, "third"))?;
            Ok(1)
        });
        let e = out.unwrap_err();
        assert!(e.to_string().contains("first failed"), "{e}");
        assert_eq!(
            entries(&log),
            ["start", "end", "first", "second", "third"],
            "every deferred work runs"
        );
    }

    #[test]
    fn the_group_ends_when_the_body_panics() {
        let log = Log::default();
        let l = log.clone();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scoped(step(&log, "start"), step(&log, "end"), || -> Result<()> {
                run_or_defer(|| "dereg".into(), step(&l, "dereg"))?;
                panic!("the body panicked")
            })
        }));
        assert!(caught.is_err(), "the panic goes on after the group ended");
        assert_eq!(entries(&log), ["start", "end", "dereg"]);
        assert!(!is_open());
        assert!(DEFERRED.with(|d| d.borrow().is_empty()));
    }

    #[test]
    fn nested_groups_are_refused_and_a_failed_start_opens_nothing() {
        let log = Log::default();
        let out = scoped(step(&log, "start"), step(&log, "end"), || {
            let inner = scoped(step(&log, "inner start"), step(&log, "inner end"), || Ok(()));
            let e = inner.unwrap_err();
            assert!(e.to_string().contains("already open"), "{e}");
            let e = group(|_| Ok(())).unwrap_err();
            assert!(e.to_string().contains("already open"), "{e}");
            Ok(())
        });
        assert_eq!(out, Ok(()));
        assert_eq!(entries(&log), ["start", "end"]);

        let log = Log::default();
        let out = scoped(failing(&log, "start"), step(&log, "end"), || Ok(()));
        assert!(out.unwrap_err().to_string().contains("start failed"));
        assert_eq!(entries(&log), ["start"], "neither the body nor the end runs");
        assert!(!is_open());
    }

    #[test]
    fn collectives_and_registration_are_refused_inside_a_group() {
        let log = Log::default();
        scoped(step(&log, "start"), step(&log, "end"), || {
            let e = Comm::init_all(&[]).unwrap_err();
            assert!(e.to_string().contains("group is open"), "{e}");
            Ok(())
        })
        .unwrap();
    }
}
