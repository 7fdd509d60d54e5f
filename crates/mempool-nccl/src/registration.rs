//! `ncclCommRegister` / `ncclCommDeregister`: a [`Registration`] borrows the communicator and the
//! buffer, and its deregistration runs before either can go, also when it is dropped inside a group.

use std::ffi::c_void;

use mempool_core::{BufferView, DeviceAddr};

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::scope;

impl Comm {
    /// Registers `view`'s memory with the communicator (`ncclCommRegister`, NCCL 2.19), so that
    /// collectives on it can use it in place of NCCL's staging buffers where NCCL supports that; the
    /// registration is dropped (`ncclCommDeregister`) before the memory or the communicator can be.
    ///
    /// NCCL decides what it can register: `cuMemCreate` memory (`mempool_rmm::VmmResource`) is the
    /// case NCCL documents; see docs/nccl.md for what the GPU tests observed for pool and `cuMemAlloc`
    /// memory. Refused while a [`group`](crate::group()) is open on this thread (a registration made
    /// inside a group could not be deregistered before the group ends).
    ///
    /// # Safety
    /// 1. Every rank of the communicator registers the buffers it passes to each collective that uses
    ///    this buffer while the registration lives (NCCL: if any rank passes registered buffers to a
    ///    collective, every rank must; mixing registered and unregistered buffers across ranks is
    ///    undefined behaviour).
    /// 2. The registration is dropped or [`deregister`](Registration::deregister)ed, not leaked
    ///    (`mem::forget`, an `Rc` cycle), before the buffer is freed: its borrow of the buffer ends
    ///    when it is forgotten, while NCCL keeps the range registered until `ncclCommDeregister`.
    #[allow(unsafe_code)]
    pub unsafe fn register<'a>(&'a self, view: &'a BufferView<'_>) -> Result<Registration<'a>> {
        let dev = view.context().device();
        if dev != self.device {
            return Err(Error::InvalidArgument {
                call: "ncclCommRegister",
                reason: format!(
                    "the buffer is memory of {dev}, the communicator runs on {}",
                    self.device
                ),
            });
        }
        // SAFETY: the view's range is live memory of this device while the view lives; the
        // registration borrows the view for 'a, so it is deregistered first (see `Registration`), or
        // it is leaked, which point 2 excludes: `register_raw`'s point 1. Its point 2 is point 1 here.
        unsafe { self.register_raw(view.ptr(), view.len()) }
    }

    /// [`register`](Self::register) for a raw range.
    ///
    /// # Safety
    /// 1. `addr..addr+len` is device memory of this communicator's device that stays allocated until
    ///    the returned registration is deregistered: until it is dropped, or, when it is dropped
    ///    inside a [`group`](crate::group()), until that `group` call returns (a registration that is
    ///    leaked is never deregistered).
    /// 2. As point 1 of [`register`](Self::register): every rank registers the buffers it passes to the
    ///    collectives that use this range.
    #[allow(unsafe_code)]
    pub unsafe fn register_raw(&self, addr: DeviceAddr, len: usize) -> Result<Registration<'_>> {
        if scope::is_open() {
            return Err(Error::InvalidArgument {
                call: "ncclCommRegister",
                reason: "a group is open on this thread: register before the group starts (a registration \
                         made inside it could not be deregistered until the group ends)"
                    .into(),
            });
        }
        let f = self.lib.get(&self.lib.comm_register)?;
        // Checked before the registration exists, so that its drop can always deregister.
        self.lib.get(&self.lib.comm_deregister)?;
        let _g = self.ctx.bind()?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: point 1 is the caller's; `raw` is live; NCCL writes one handle.
        let r = unsafe { f(self.raw, addr.0 as usize as *mut c_void, len, &mut handle) };
        self.lib.check("ncclCommRegister", r, self.raw)?;
        Ok(Registration {
            comm: self,
            handle,
            addr,
            len,
        })
    }
}

/// A range registered with a communicator (`ncclCommRegister`), deregistered on drop. It borrows the
/// communicator and the buffer for `'a`, so neither can go first.
///
/// Dropped (or [`deregister`](Self::deregister)ed) while a [`group`](crate::group()) is open on this
/// thread, where NCCL refuses `ncclCommDeregister` and the group's collectives may still use the range,
/// it is deregistered when the group ends: after `ncclGroupEnd`, before `group` returns. The buffer and
/// the communicator are still there then: a registration cannot be made inside a group, and it is not
/// `Send`, so one dropped inside a group was made before the group on this thread and reached the
/// group's closure through the closure's captures; every lifetime in the closure's type, `'a`
/// included, therefore lasts for the whole `group` call, and the buffer and the communicator stay
/// borrowed until `group` returns.
///
/// A registration cannot outlive its buffer:
///
/// ```compile_fail,E0597
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::Comm;
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// let reg = {
///     let buf = DeviceBuffer::new(1 << 20, &stream, mr)?;
///     // SAFETY: one rank: it registers what it passes (this does not compile: `buf` goes first).
///     unsafe { comms[0].register(&buf) }?
/// }; // error[E0597]: `buf` does not live long enough
/// drop(reg);
/// # Ok(())
/// # }
/// ```
///
/// nor can its buffer be dropped while the registration lives, inside a group or out:
///
/// ```compile_fail,E0505
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::Comm;
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// let buf = DeviceBuffer::new(1 << 20, &stream, mr)?;
/// // SAFETY: one rank: it registers what it passes; the registration is dropped, not leaked.
/// let reg = unsafe { comms[0].register(&buf) }?;
/// mempool_nccl::group(|_g| {
///     drop(reg); // deregistered at the group's end
///     drop(buf); // error[E0505]: cannot move out of `buf` because it is borrowed
///     Ok(())
/// })?;
/// # Ok(())
/// # }
/// ```
///
/// The allowed form: the buffer outlives the registration, which may end inside a group.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use mempool_core::{Device, Stream};
/// # use mempool_nccl::{Comm, ReduceOp};
/// # use mempool_rmm::{containers::DeviceBuffer, SharedResource, VmmOptions, VmmResource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dev = Device::get(0)?;
/// # let comms = Comm::init_all(&[dev])?;
/// # let stream = Stream::new(&dev.context()?)?;
/// # let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default())?);
/// let buf = DeviceBuffer::new(1 << 20, &stream, mr)?;
/// // SAFETY: one rank: it registers what it passes; the registration is dropped, not leaked.
/// let reg = unsafe { comms[0].register(&buf) }?;
/// mempool_nccl::group(|g| {
///     g.all_reduce_in_place::<f32>(&comms[0], &buf, ReduceOp::Sum, stream.as_ref())?;
///     drop(reg); // deregistered after ncclGroupEnd, before `group` returns
///     Ok(())
/// })?;
/// drop(buf);
/// # Ok(())
/// # }
/// ```
pub struct Registration<'a> {
    comm: &'a Comm,
    handle: *mut c_void,
    addr: DeviceAddr,
    len: usize,
}

impl std::fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("rank", &self.comm.rank)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl Registration<'_> {
    /// The registered address.
    pub fn addr(&self) -> DeviceAddr {
        self.addr
    }

    /// The registered length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Deregisters now, reporting an error that `Drop` could only print. Inside a
    /// [`group`](crate::group()) the deregistration waits for the group's end and this returns `Ok`;
    /// `group` then returns (or prints) its error.
    pub fn deregister(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.release()
    }

    /// Deregisters, now or (inside a group) at the group's end; called once, by `deregister` or `Drop`.
    fn release(&self) -> Result<()> {
        let lib = self.comm.lib;
        // Present: `register_raw` checked it before the registration existed.
        let f = lib.get(&lib.comm_deregister)?;
        let (raw, handle) = (self.comm.raw, self.handle);
        let ctx = self.comm.ctx.clone();
        let (addr, len, rank) = (self.addr, self.len, self.comm.rank);
        scope::run_or_defer(
            move || format!("deregistering {len} bytes at {addr} from rank {rank}"),
            move || {
                let _g = ctx.bind()?;
                // Deregistering unmaps the peers' mappings of the range at once, on the host:
                // collectives still running on it must finish first.
                ctx.synchronize()?;
                // SAFETY: `handle` came from ncclCommRegister on `raw`, and is given up once (`release`
                // runs once per registration). `raw` is live: this runs either now, while the
                // registration borrows its communicator, or at the end of the group open on this
                // thread, before `group` returns, while the borrow `'a` still holds (see
                // `Registration`).
                #[allow(unsafe_code)]
                let r = unsafe { f(raw, handle) };
                lib.check("ncclCommDeregister", r, raw)
            },
        )
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            eprintln!(
                "mempool-nccl: deregistering {} bytes at {} failed: {e}",
                self.len, self.addr
            );
        }
    }
}
