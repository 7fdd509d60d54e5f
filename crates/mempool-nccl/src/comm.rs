//! Communicators ([`Comm`], [`UniqueId`]) and their collectives on mempool buffers.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::sync::Arc;

use mempool_core::{BufferView, Context, Device, DeviceAddr, StreamRef};

use crate::error::{Error, Result};
use crate::scope;
use crate::sys::{self, Library, RawComm, RawUniqueId, UNIQUE_ID_BYTES};
use crate::types::{NcclType, ReduceOp};

/// The bytes every rank of a communicator is initialized with (`ncclUniqueId`, 128 bytes): made once
/// ([`UniqueId::new`]) and sent to the other ranks by any means (a socket, a file, a shared variable).
#[derive(Copy, Clone, PartialEq, Eq)]
pub struct UniqueId(RawUniqueId);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// A new id (`ncclGetUniqueId`), which also starts NCCL's bootstrap listener in this process.
    pub fn new() -> Result<UniqueId> {
        let lib = sys::library()?;
        let f = lib.get(&lib.get_unique_id)?;
        let mut raw = RawUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `ncclGetUniqueId` writes one ncclUniqueId.
        #[allow(unsafe_code)]
        let r = unsafe { f(&mut raw) };
        lib.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(UniqueId(raw))
    }

    /// The bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0.internal
    }

    /// An id received from the rank that made it.
    pub fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(RawUniqueId { internal: bytes })
    }
}

/// An NCCL communicator: one rank on one device (`ncclComm_t`), destroyed (`ncclCommDestroy`) on drop.
///
/// Collectives take mempool buffers (anything that derefs to [`BufferView`]: `DeviceBuffer`,
/// `PoolBuffer`, ...) of the communicator's device, run on the buffers' stream (so that a buffer's
/// stream-ordered free comes after the collective), and check lengths before NCCL is called. Outside a
/// [`group`](crate::group()) each call is enqueued at once; inside one, use the [`Group`](crate::Group)'s
/// methods.
///
/// `Send`, not `Sync`: NCCL does not allow concurrent calls on one communicator.
pub struct Comm {
    pub(crate) raw: RawComm,
    pub(crate) lib: &'static Library,
    pub(crate) device: Device,
    pub(crate) ctx: Arc<Context>,
    pub(crate) rank: usize,
    nranks: usize,
    /// Work run before each collective: an attachment's registrations brought up to date
    /// (`crate::follow`); set while the communicator is attached to a pool.
    pub(crate) before: Option<Arc<dyn BeforeCollective>>,
    _not_sync: PhantomData<Cell<()>>,
}

/// What a communicator runs before it enqueues a collective (at the top of every collective, raw ones
/// included), on the thread that calls it: an attached pool's registrations brought up to date, or an
/// error naming why they cannot be.
pub(crate) trait BeforeCollective: Send + Sync {
    /// Runs before the collective `call` on `comm`, which will run on `stream` (while it is being
    /// captured into a CUDA graph, waiting for the device is forbidden).
    fn before_collective(&self, call: &'static str, comm: &Comm, stream: StreamRef<'_>) -> Result<()>;
}

// SAFETY: an ncclComm_t may be used from any thread, one at a time (NCCL's documented rule); `Comm` is
// not `Sync`, so safe code cannot call it from two threads at once.
#[allow(unsafe_code)]
unsafe impl Send for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("device", &self.device.ordinal())
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .finish()
    }
}

/// The number of `T` in `view`, refusing a length that is not a whole number of elements.
fn elements<T>(call: &'static str, what: &str, view: &BufferView<'_>) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    if !view.len().is_multiple_of(size) {
        return Err(Error::InvalidArgument {
            call,
            reason: format!(
                "the {what} buffer has {} bytes, not a whole number of {}-byte {} elements",
                view.len(),
                size,
                std::any::type_name::<T>()
            ),
        });
    }
    Ok(view.len() / size)
}

/// The shape of a collective: which counts must agree, given the communicator's size.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Send and receive hold the same count (all-reduce, broadcast).
    Same,
    /// Receive holds `nranks` times the send count (all-gather).
    Gather,
    /// Send holds `nranks` times the receive count (reduce-scatter).
    Scatter,
}

/// The count NCCL is called with (the send count for all-gather, the receive count for reduce-scatter,
/// else the common count), or the reason the counts do not fit.
pub(crate) fn collective_count(
    shape: Shape,
    send: usize,
    recv: usize,
    nranks: usize,
) -> std::result::Result<usize, String> {
    let ok = match shape {
        Shape::Same => send == recv,
        Shape::Gather => send.checked_mul(nranks) == Some(recv),
        Shape::Scatter => recv.checked_mul(nranks) == Some(send),
    };
    if !ok {
        return Err(match shape {
            Shape::Same => format!("send holds {send} elements and receive {recv}: they must be equal"),
            Shape::Gather => {
                format!("send holds {send} elements, so receive must hold {nranks} x {send}, but it holds {recv}")
            }
            Shape::Scatter => {
                format!("receive holds {recv} elements, so send must hold {nranks} x {recv}, but it holds {send}")
            }
        });
    }
    Ok(match shape {
        Shape::Same | Shape::Gather => send,
        Shape::Scatter => recv,
    })
}

/// Which collective to enqueue.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Coll {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce(_) => "ncclAllReduce",
            Coll::ReduceScatter(_) => "ncclReduceScatter",
            Coll::AllGather => "ncclAllGather",
            Coll::Broadcast(_) => "ncclBroadcast",
        }
    }

    fn shape(self) -> Shape {
        match self {
            Coll::AllReduce(_) | Coll::Broadcast(_) => Shape::Same,
            Coll::ReduceScatter(_) => Shape::Scatter,
            Coll::AllGather => Shape::Gather,
        }
    }
}

impl Comm {
    /// One communicator per device, all in this process (`ncclCommInitAll`): `comms[i]` is rank `i` on
    /// `devices[i]`. Refuses an empty list and a device listed twice.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Comm>> {
        let call = "ncclCommInitAll";
        // Inside a group NCCL defers the initialization, and the communicators are not usable yet.
        Self::not_in_group(call)?;
        if devices.is_empty() {
            return Err(Error::InvalidArgument {
                call,
                reason: "no devices given".into(),
            });
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::InvalidArgument {
                    call,
                    reason: format!("{d} is listed twice: one communicator per device"),
                });
            }
        }
        let lib = sys::library()?;
        let f = lib.get(&lib.comm_init_all)?;
        let ctxs = devices
            .iter()
            .map(|d| d.context())
            .collect::<mempool_core::Result<Vec<_>>>()?;
        let list: Vec<c_int> = devices.iter().map(|d| d.ordinal() as c_int).collect();
        let mut raw: Vec<RawComm> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `raw` has room for one communicator per device of `list`, which holds `len` ordinals.
        #[allow(unsafe_code)]
        let r = unsafe { f(raw.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        lib.check(call, r, std::ptr::null_mut())?;
        let n = devices.len();
        let comms: Vec<Comm> = raw
            .into_iter()
            .zip(devices.iter().zip(ctxs))
            .enumerate()
            .map(|(rank, (raw, (&device, ctx)))| Comm {
                raw,
                lib,
                device,
                ctx,
                rank,
                nranks: n,
                before: None,
                _not_sync: PhantomData,
            })
            .collect();
        for c in &comms {
            c.verify()?;
        }
        Ok(comms)
    }

    /// Checks that NCCL's view of the communicator (`ncclCommUserRank`, `ncclCommCount`,
    /// `ncclCommCuDevice`) is the one this value records.
    fn verify(&self) -> Result<()> {
        let ask = |sym: &sys::Sym<sys::CommIntFn>, call| -> Result<usize> {
            let f = self.lib.get(sym)?;
            let mut v: c_int = -1;
            // SAFETY: `raw` is live; the call writes one int.
            #[allow(unsafe_code)]
            let r = unsafe { f(self.raw, &mut v) };
            self.lib.check(call, r, self.raw)?;
            Ok(v as usize)
        };
        let got = (
            ask(&self.lib.comm_user_rank, "ncclCommUserRank")?,
            ask(&self.lib.comm_count, "ncclCommCount")?,
            ask(&self.lib.comm_cu_device, "ncclCommCuDevice")?,
        );
        let want = (self.rank, self.nranks, self.device.ordinal());
        if got != want {
            return Err(Error::InvalidArgument {
                call: "ncclCommUserRank",
                reason: format!("NCCL reports (rank, nranks, device) {got:?} for a communicator made as {want:?}"),
            });
        }
        Ok(())
    }

    /// Rank `rank` of `nranks` on `device` (`ncclCommInitRank`), joining the ranks that use the same
    /// `id`, in this process (one thread per rank; for several ranks from one thread use
    /// [`init_all`](Self::init_all)) or in others. Blocks until every rank has joined. Refused while a
    /// [`group`](crate::group()) is open on this thread (NCCL would defer the initialization).
    pub fn init_rank(device: Device, id: &UniqueId, nranks: usize, rank: usize) -> Result<Comm> {
        let call = "ncclCommInitRank";
        Self::not_in_group(call)?;
        if nranks == 0 || rank >= nranks || nranks > c_int::MAX as usize {
            return Err(Error::InvalidArgument {
                call,
                reason: format!("rank {rank} of {nranks}: need 0 <= rank < nranks"),
            });
        }
        let lib = sys::library()?;
        let f = lib.get(&lib.comm_init_rank)?;
        let ctx = device.context()?;
        let _g = ctx.bind()?;
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: writes one communicator; the id is passed by value as nccl.h declares; the device's
        // primary context is current, which is the device NCCL takes (the runtime's current device).
        #[allow(unsafe_code)]
        let r = unsafe { f(&mut raw, nranks as c_int, id.0, rank as c_int) };
        lib.check(call, r, std::ptr::null_mut())?;
        drop(_g);
        let comm = Comm {
            raw,
            lib,
            device,
            ctx,
            rank,
            nranks,
            before: None,
            _not_sync: PhantomData,
        };
        comm.verify()?;
        Ok(comm)
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Its rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The raw `ncclComm_t`, valid while `self` lives.
    pub fn as_raw(&self) -> RawComm {
        self.raw
    }

    /// Destroys it (`ncclCommDestroy`, which first completes its queued operations), reporting an error
    /// that `Drop` could only print.
    pub fn destroy(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.finish(false)
    }

    /// Aborts it (`ncclCommAbort`): stops its operations and frees its resources, for a communicator
    /// that is stuck or whose peers failed.
    pub fn abort(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.finish(true)
    }

    fn finish(&self, abort: bool) -> Result<()> {
        let (sym, call) = if abort {
            (&self.lib.comm_abort, "ncclCommAbort")
        } else {
            (&self.lib.comm_destroy, "ncclCommDestroy")
        };
        let f = self.lib.get(sym)?;
        let _g = self.ctx.bind()?;
        // SAFETY: `raw` is this value's live communicator, given up once (the callers make sure `Drop`
        // does not run again); no registration borrows it (they borrow `self`).
        #[allow(unsafe_code)]
        let r = unsafe { f(self.raw) };
        self.lib.check(call, r, std::ptr::null_mut())
    }

    /// Checks that `view` is memory of this communicator's device, on `stream`.
    fn check_view(&self, call: &'static str, what: &str, view: &BufferView<'_>, stream: StreamRef<'_>) -> Result<()> {
        let dev = view.context().device();
        if dev != self.device {
            return Err(Error::InvalidArgument {
                call,
                reason: format!(
                    "the {what} buffer is memory of {dev}, the communicator (rank {}) runs on {}",
                    self.rank, self.device
                ),
            });
        }
        if view.stream() != stream {
            return Err(Error::InvalidArgument {
                call,
                reason: format!(
                    "the {what} buffer is ordered on stream {:#x}, the collective was asked to run on {:#x}: it \
                     must run on the buffer's stream, so that the buffer's stream-ordered free follows it \
                     (use the unsafe all_reduce_raw for other streams)",
                    view.stream().handle(),
                    stream.handle()
                ),
            });
        }
        Ok(())
    }

    fn not_in_group(call: &'static str) -> Result<()> {
        if scope::is_open() {
            return Err(Error::InvalidArgument {
                call,
                reason: "a group is open on this thread: enqueue through the group's methods, which keep the \
                         buffers borrowed until ncclGroupEnd launches the work"
                    .into(),
            });
        }
        Ok(())
    }

    /// Checks and enqueues one collective. `send` is `None` for the in-place forms, whose input lies
    /// in `recv` where NCCL expects it.
    pub(crate) fn enqueue<T: NcclType>(
        &self,
        coll: Coll,
        send: Option<&BufferView<'_>>,
        recv: &BufferView<'_>,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let call = coll.name();
        self.check_view(call, "receive", recv, stream)?;
        let recv_n = elements::<T>(call, "receive", recv)?;
        let (send_addr, send_n) = match send {
            Some(s) => {
                self.check_view(call, "send", s, stream)?;
                (s.ptr(), elements::<T>(call, "send", s)?)
            }
            None => match coll.shape() {
                Shape::Same => (recv.ptr(), recv_n),
                // In place: the rank's slice of the receive buffer is the input.
                Shape::Gather => {
                    if !recv_n.is_multiple_of(self.nranks) {
                        return Err(Error::InvalidArgument {
                            call,
                            reason: format!(
                                "in-place all-gather: the buffer's {recv_n} elements are not {} equal slices",
                                self.nranks
                            ),
                        });
                    }
                    let per = recv_n / self.nranks;
                    (recv.ptr().offset(self.rank * per * std::mem::size_of::<T>()), per)
                }
                Shape::Scatter => {
                    return Err(Error::InvalidArgument {
                        call,
                        reason: "reduce-scatter in place is reduce_scatter_in_place".into(),
                    })
                }
            },
        };
        let count = collective_count(coll.shape(), send_n, recv_n, self.nranks)
            .map_err(|reason| Error::InvalidArgument { call, reason })?;
        // SAFETY: both ranges are live memory of this communicator's device for the views' lifetime and
        // their uses are ordered on `stream`, the views' stream (checked), so the owners' stream-ordered
        // frees follow the collective; the counts fit the buffers (checked above).
        #[allow(unsafe_code)]
        unsafe {
            self.enqueue_raw::<T>(coll, send_addr, recv.ptr(), count, stream)
        }
    }

    /// # Safety
    /// 1. `send` and `recv` are device memory NCCL may access on this communicator's device, holding
    ///    what `coll` reads and writes for `count` elements of `T` (see nccl.h), live until the work on
    ///    `stream` completes.
    /// 2. `stream` is a live stream of the communicator's device.
    #[allow(unsafe_code)]
    unsafe fn enqueue_raw<T: NcclType>(
        &self,
        coll: Coll,
        send: DeviceAddr,
        recv: DeviceAddr,
        count: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let call = coll.name();
        if let Some(before) = &self.before {
            before.before_collective(call, self, stream)?;
        }
        let dt = T::DATA_TYPE.to_raw();
        let (s, r) = (send.0 as usize as *const c_void, recv.0 as usize as *mut c_void);
        let st = stream.as_raw() as sys::RawStream;
        let lib = self.lib;
        let _g = self.ctx.bind()?;
        // The three calls below share one argument: points 1 and 2 are the caller's; `raw` is this live
        // communicator; the signatures are nccl.h's.
        let code = match coll {
            Coll::AllReduce(op) | Coll::ReduceScatter(op) => {
                if lib.version_code() < op.since() {
                    return Err(Error::InvalidArgument {
                        call,
                        reason: format!("{op:?} needs NCCL 2.10; the loaded NCCL is {}", lib.version_string()),
                    });
                }
                let f = if matches!(coll, Coll::AllReduce(_)) {
                    lib.get(&lib.all_reduce)?
                } else {
                    lib.get(&lib.reduce_scatter)?
                };
                // SAFETY: see above the `match`.
                unsafe { f(s, r, count, dt, op.to_raw(), self.raw, st) }
            }
            Coll::AllGather => {
                let f = lib.get(&lib.all_gather)?;
                // SAFETY: see above the `match`.
                unsafe { f(s, r, count, dt, self.raw, st) }
            }
            Coll::Broadcast(root) => {
                let f = lib.get(&lib.broadcast)?;
                // SAFETY: see above the `match`.
                unsafe { f(s, r, count, dt, root as c_int, self.raw, st) }
            }
        };
        lib.check(call, code, self.raw)
    }

    pub(crate) fn root(&self, call: &'static str, root: usize) -> Result<usize> {
        if root >= self.nranks {
            return Err(Error::InvalidArgument {
                call,
                reason: format!("root {root} is not a rank of a communicator of {} ranks", self.nranks),
            });
        }
        Ok(root)
    }

    /// `recv = op(send of every rank)` (`ncclAllReduce`); both buffers hold the same number of `T`.
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &BufferView<'_>,
        recv: &BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclAllReduce")?;
        self.enqueue::<T>(Coll::AllReduce(op), Some(send), recv, stream)
    }

    /// [`all_reduce`](Self::all_reduce) in place: `buf` is both input and output.
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclAllReduce")?;
        self.enqueue::<T>(Coll::AllReduce(op), None, buf, stream)
    }

    /// Every rank's `send` concatenated in rank order into `recv` (`ncclAllGather`); `recv` holds
    /// `nranks` times the elements of `send`.
    pub fn all_gather<T: NcclType>(
        &self,
        send: &BufferView<'_>,
        recv: &BufferView<'_>,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclAllGather")?;
        self.enqueue::<T>(Coll::AllGather, Some(send), recv, stream)
    }

    /// [`all_gather`](Self::all_gather) in place: `buf` holds `nranks` equal slices and this rank's
    /// slice (at `rank * len / nranks`) is its input.
    pub fn all_gather_in_place<T: NcclType>(&self, buf: &BufferView<'_>, stream: StreamRef<'_>) -> Result<()> {
        Self::not_in_group("ncclAllGather")?;
        self.enqueue::<T>(Coll::AllGather, None, buf, stream)
    }

    /// Reduces every rank's `send` and leaves slice `rank` of the result in `recv`
    /// (`ncclReduceScatter`); `send` holds `nranks` times the elements of `recv`.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &BufferView<'_>,
        recv: &BufferView<'_>,
        op: ReduceOp,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclReduceScatter")?;
        self.enqueue::<T>(Coll::ReduceScatter(op), Some(send), recv, stream)
    }

    /// Copies rank `root`'s `send` into every rank's `recv` (`ncclBroadcast`; `send` is read on the
    /// root only, but checked on every rank).
    pub fn broadcast<T: NcclType>(
        &self,
        send: &BufferView<'_>,
        recv: &BufferView<'_>,
        root: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclBroadcast")?;
        let root = self.root("ncclBroadcast", root)?;
        self.enqueue::<T>(Coll::Broadcast(root), Some(send), recv, stream)
    }

    /// [`broadcast`](Self::broadcast) in place: the root's `buf` is copied into every rank's `buf`.
    pub fn broadcast_in_place<T: NcclType>(
        &self,
        buf: &BufferView<'_>,
        root: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Self::not_in_group("ncclBroadcast")?;
        let root = self.root("ncclBroadcast", root)?;
        self.enqueue::<T>(Coll::Broadcast(root), None, buf, stream)
    }

    /// `ncclAllReduce` on raw addresses and any stream of the device, for memory mempool did not
    /// allocate (another framework's tensors). Inside a [`group`](crate::group()) too: the caller keeps the
    /// memory live, as point 1 says.
    ///
    /// # Safety
    /// 1. `send` and `recv` each hold `count` elements of `T` of device memory this communicator's
    ///    device may access, live and not reused until the collective on `stream` completes.
    /// 2. `stream` is a live stream of the communicator's device.
    /// 3. Nothing else writes either range while the collective may run.
    #[allow(unsafe_code)]
    pub unsafe fn all_reduce_raw<T: NcclType>(
        &self,
        send: DeviceAddr,
        recv: DeviceAddr,
        count: usize,
        op: ReduceOp,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: points 1-3 are the caller's, and are what `enqueue_raw` requires.
        unsafe { self.enqueue_raw::<T>(Coll::AllReduce(op), send, recv, count, stream) }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if let Err(e) = self.finish(false) {
            eprintln!(
                "mempool-nccl: destroying the communicator of rank {} failed: {e}",
                self.rank
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_collective_shape() {
        assert_eq!(collective_count(Shape::Same, 10, 10, 4), Ok(10));
        assert!(collective_count(Shape::Same, 10, 11, 4)
            .unwrap_err()
            .contains("must be equal"));
        assert_eq!(collective_count(Shape::Gather, 10, 40, 4), Ok(10));
        let e = collective_count(Shape::Gather, 10, 30, 4).unwrap_err();
        assert!(e.contains("4 x 10") && e.contains("holds 30"), "{e}");
        assert_eq!(collective_count(Shape::Scatter, 40, 10, 4), Ok(10));
        assert!(collective_count(Shape::Scatter, 41, 10, 4).is_err());
        assert!(
            collective_count(Shape::Gather, usize::MAX, 0, 2).is_err(),
            "overflow is refused"
        );
    }

    #[test]
    fn unique_ids_round_trip_their_bytes() {
        let mut b = [0u8; 128];
        b[0] = 1;
        b[127] = 0xff;
        let id = UniqueId::from_bytes(b);
        assert_eq!(id.as_bytes(), &b);
        assert_eq!(format!("{id:?}"), "UniqueId(..)", "the bytes are not printed");
    }
}
