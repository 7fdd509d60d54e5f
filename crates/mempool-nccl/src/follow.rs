//! Registration that follows a pool: [`attach`] a communicator to a [`ServiceResource`], and every
//! physical allocation the resource maps is registered with the communicator (`ncclCommRegister`), and
//! deregistered (`ncclCommDeregister`) before it is unmapped, through growth, trimming, reclaim, sleep
//! and wake, with no call from the user. The [`Attachment`] owns the communicator and lends it
//! ([`Attachment::comm`]) for collectives.
//!
//! One registration per physical allocation (see `crate::ranges`: NCCL uses a registration only when one
//! covers the whole buffer, and its registered transports are expected to need the buffer inside one
//! `cuMemCreate` allocation); the pool maps the chunks an allocation needs as one physical allocation, so a
//! buffer that grew the pool lies in one registration.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::ThreadId;

use mempool_core::{Device, DeviceAddr};
use mempool_rmm::{ChunkObserver, ChunkRange, ObserverId, ServiceResource, Tag};

use crate::comm::{BeforeCollective, Comm};
use crate::error::{Error, Result};
use crate::ranges::{plan, RangeSet, Span};
use crate::scope;

/// The most errors an attachment keeps; later ones are counted, not kept.
const MAX_ERRORS: usize = 64;

/// Who holds the communicator: one thread at a time, any number of times over (a thread that holds it
/// and calls into the resource, whose observer then registers, uses it again).
#[derive(Default)]
struct Lend {
    owner: Mutex<Option<(ThreadId, usize)>>,
    freed: Condvar,
}

impl Lend {
    fn owner(&self) -> MutexGuard<'_, Option<(ThreadId, usize)>> {
        self.owner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes it when it is free or this thread holds it already; never waits.
    fn try_enter(&self) -> bool {
        let me = std::thread::current().id();
        let mut o = self.owner();
        match &mut *o {
            None => {
                *o = Some((me, 1));
                true
            }
            Some((t, depth)) if *t == me => {
                *depth += 1;
                true
            }
            Some(_) => false,
        }
    }

    /// Takes it, waiting while another thread holds it.
    fn enter(&self) {
        let me = std::thread::current().id();
        let mut o = self.owner();
        loop {
            match &mut *o {
                None => {
                    *o = Some((me, 1));
                    return;
                }
                Some((t, depth)) if *t == me => {
                    *depth += 1;
                    return;
                }
                Some(_) => o = self.freed.wait(o).unwrap_or_else(PoisonError::into_inner),
            }
        }
    }

    /// Whether this thread holds it once (its next `leave` lets it go).
    fn outermost(&self) -> bool {
        let me = std::thread::current().id();
        matches!(*self.owner(), Some((t, 1)) if t == me)
    }

    /// Gives back one `enter` of this thread.
    fn leave(&self) {
        let mut o = self.owner();
        if let Some((_, depth)) = &mut *o {
            *depth -= 1;
            if *depth == 0 {
                *o = None;
                self.freed.notify_all();
            }
        }
    }
}

/// An `ncclCommRegister` handle (NULL where NCCL skipped the registration, which deregisters as nothing).
struct Handle(*mut c_void);

// SAFETY: a registration handle is an opaque token of its communicator, used (deregistered) only by the
// thread that holds the communicator (`Lend`), which may be any thread.
#[allow(unsafe_code)]
unsafe impl Send for Handle {}

/// One registration held: one mapped physical allocation of one tag.
struct Held {
    tag: Tag,
    span: Span,
    handle: Handle,
    /// `Book::collectives` when it was registered: while they are equal no collective can use it.
    since: u64,
}

/// What the attachment knows: what is mapped (from the resource's calls), what is registered, what
/// failed.
#[derive(Default)]
struct Book {
    /// Mapped ranges per tag, one per physical allocation.
    mapped: BTreeMap<Tag, RangeSet>,
    held: Vec<Held>,
    /// Runs whose registration failed: not tried again until they change.
    failed: Vec<(Tag, Span)>,
    errors: Vec<Error>,
    errors_dropped: u64,
    /// A bring-up-to-date waits for the end of the group open on some thread.
    deferred: bool,
    /// Collectives enqueued on the communicator so far.
    collectives: u64,
}

impl Book {
    fn record(&mut self, e: Error) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(e);
        } else {
            self.errors_dropped += 1;
        }
    }

    /// The plan of each tag that has anything to do.
    fn plans(&self) -> Vec<(Tag, crate::ranges::Plan)> {
        let mut tags: Vec<Tag> = self.mapped.keys().copied().collect();
        tags.extend(self.held.iter().map(|h| h.tag));
        tags.sort_unstable();
        tags.dedup();
        tags.into_iter()
            .filter_map(|t| {
                let wanted = self.mapped.get(&t).map_or(&[][..], RangeSet::spans);
                let held: Vec<Span> = self.held.iter().filter(|h| h.tag == t).map(|h| h.span).collect();
                let failed: Vec<Span> = self.failed.iter().filter(|f| f.0 == t).map(|f| f.1).collect();
                let p = plan(wanted, &held, &failed);
                (!p.is_empty()).then_some((t, p))
            })
            .collect()
    }
}

/// The state the observer, the attachment and the communicator share (the communicator itself aside).
struct Follow {
    lend: Lend,
    book: Mutex<Book>,
}

impl Follow {
    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes the registrations equal to the mapped allocations: deregisters what is stale (after
    /// waiting for the device: collectives may still use it), then registers what is missing. Every
    /// failure is recorded; the first is returned. The caller holds the communicator (`lend`) and no
    /// group is open on this thread.
    fn reconcile(&self, comm: &Comm, book: &mut Book) -> Result<()> {
        let plans = book.plans();
        if plans.is_empty() {
            return Ok(());
        }
        let mut first: Option<Error> = None;
        let mut fail = |book: &mut Book, e: Error| {
            if first.is_none() {
                first = Some(e.clone());
            }
            book.record(e);
        };
        let lib = comm.lib;
        let (reg, dereg) = match (lib.get(&lib.comm_register), lib.get(&lib.comm_deregister)) {
            (Ok(r), Ok(d)) => (r, d),
            (Err(e), _) | (_, Err(e)) => {
                book.record(e.clone());
                return Err(e);
            }
        };
        let bound = comm.ctx.bind();
        if let Err(e) = bound {
            let e = Error::from(e);
            book.record(e.clone());
            return Err(e);
        }
        let used = |tag: Tag, span: &Span| {
            book.held
                .iter()
                .any(|h| h.tag == tag && h.span == *span && h.since != book.collectives)
        };
        if plans.iter().any(|(t, p)| p.deregister.iter().any(|s| used(*t, s))) {
            // Deregistering unmaps the peers' mappings at once, on the host: work still queued on the
            // ranges must finish first (an unmapping has waited already; a merge has not). A
            // registration no collective was enqueued after cannot be in use: growth in batches (wake)
            // does not wait.
            if let Err(e) = comm.ctx.synchronize() {
                fail(book, e.into());
            }
        }
        for (tag, p) in &plans {
            for span in &p.deregister {
                let Some(i) = book.held.iter().position(|h| h.tag == *tag && h.span == *span) else {
                    continue;
                };
                let h = book.held.swap_remove(i);
                // SAFETY: `h.handle` came from ncclCommRegister on this live communicator and is given
                // up once (it left `held` above); the caller holds the communicator, so no other NCCL
                // call on it runs meanwhile, and no group is open on this thread.
                #[allow(unsafe_code)]
                let r = unsafe { dereg(comm.raw, h.handle.0) };
                if let Err(e) = lib.check("ncclCommDeregister", r, comm.raw) {
                    fail(book, e);
                }
            }
        }
        for (tag, p) in &plans {
            for &span in &p.register {
                let mut handle: *mut c_void = std::ptr::null_mut();
                // SAFETY: `span` is a run of chunks the resource reported mapped (with read-write access
                // for this device) and not since reported unmapping; it is deregistered above, before
                // the resource unmaps any of it (the observer is told first), or, where it could not be,
                // before any later collective on this communicator (`before_collective`). The caller
                // holds the communicator and no group is open on this thread. NCCL writes one handle.
                #[allow(unsafe_code)]
                let r = unsafe {
                    reg(
                        comm.raw,
                        span.0 as usize as *mut c_void,
                        (span.1 - span.0) as usize,
                        &mut handle,
                    )
                };
                match lib.check("ncclCommRegister", r, comm.raw) {
                    Ok(()) => {
                        let since = book.collectives;
                        book.held.push(Held {
                            tag: *tag,
                            span,
                            handle: Handle(handle),
                            since,
                        })
                    }
                    Err(e) => {
                        book.failed.push((*tag, span));
                        fail(book, e);
                    }
                }
            }
        }
        // A failed run that changed (grew, shrank, went) is tried again in its new shape.
        let Book { mapped, failed, .. } = &mut *book;
        failed.retain(|(t, s)| mapped.get(t).is_some_and(|m| m.spans().contains(s)));
        drop(bound);
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl BeforeCollective for Follow {
    fn before_collective(&self, call: &'static str, comm: &Comm) -> Result<()> {
        // The communicator of an attachment is reachable only through a `CommGuard` (not `Send`) or the
        // observer, both holding `lend` on this thread.
        let mut book = self.book();
        let result = if book.plans().is_empty() {
            Ok(())
        } else if scope::is_open() {
            return Err(Error::InvalidArgument {
                call,
                reason: "the pool attached to this communicator mapped or unmapped memory while a group is \
                         open on this thread, and its registrations can change only after the group ends: \
                         allocate (and free) the group's buffers before the group starts"
                    .into(),
            });
        } else {
            self.reconcile(comm, &mut book)
        };
        // Counted after the registrations it may use were made: those are in use from now on.
        book.collectives += 1;
        result
    }
}

/// The communicator and the follow state, shared by the attachment, the observer the resource holds,
/// and work deferred to a group's end.
struct Shared {
    comm: Comm,
    follow: Arc<Follow>,
    device: Device,
}

// SAFETY: `Comm` is `Send` but not `Sync` (NCCL allows one call at a time on a communicator). `comm` is
// used only by the thread that holds `follow.lend` (the observer's calls take it with `try_enter`; a
// `CommGuard`, which is not `Send` and whose `&Comm` is not `Send`, holds it while it lives), so no two
// threads use it at once. Everything else in `Shared` is `Sync`.
#[allow(unsafe_code)]
unsafe impl Sync for Shared {}

impl Shared {
    /// Brings the registrations up to date now if this thread can take the communicator and no group is
    /// open on it; inside a group, once the group ends; else (another thread holds the communicator)
    /// that thread does it, before its next collective or when it lets the communicator go.
    fn sync_now(self: &Arc<Self>) {
        if !self.follow.lend.try_enter() {
            return;
        }
        if scope::is_open() {
            let mut book = self.follow.book();
            if !book.deferred {
                book.deferred = true;
                drop(book);
                let shared = self.clone();
                let deferred = scope::run_or_defer(
                    || "bringing NCCL registrations up to date with the attached pool".into(),
                    move || {
                        shared.follow.book().deferred = false;
                        shared.sync_now();
                        Ok(())
                    },
                );
                // Only a group being open reaches here, where `run_or_defer` keeps the work.
                debug_assert!(deferred.is_ok());
            }
        } else {
            let mut book = self.follow.book();
            // Failures are recorded in the book.
            let _ = self.follow.reconcile(&self.comm, &mut book);
        }
        self.follow.lend.leave();
    }
}

/// The observer the resource holds: records each change, then registers or deregisters (`sync_now`).
struct Observer {
    shared: Arc<Shared>,
}

impl ChunkObserver for Observer {
    fn mapped(&self, range: ChunkRange) {
        if range.addr.0 == 0 || range.len == 0 {
            return;
        }
        self.shared
            .follow
            .book()
            .mapped
            .entry(range.tag)
            .or_default()
            .insert(range.addr.0, range.end());
        self.shared.sync_now();
    }

    fn unmapping(&self, range: ChunkRange) {
        if range.len == 0 {
            return;
        }
        {
            let mut book = self.shared.follow.book();
            if let Some(m) = book.mapped.get_mut(&range.tag) {
                m.remove(range.addr.0, range.end());
                if m.is_empty() {
                    book.mapped.remove(&range.tag);
                }
            }
        }
        self.shared.sync_now();
    }
}

/// One registration an [`Attachment`] holds: one mapped physical allocation of one tag.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct RegisteredRange {
    /// The tag whose region it lies in.
    pub tag: Tag,
    /// Its first address.
    pub addr: DeviceAddr,
    /// Its length in bytes.
    pub len: usize,
}

impl RegisteredRange {
    /// One past its last address.
    pub fn end(&self) -> u64 {
        self.addr.0 + self.len as u64
    }

    /// Whether `addr..addr+len` lies inside it.
    pub fn contains(&self, addr: DeviceAddr, len: usize) -> bool {
        addr.0 >= self.addr.0 && addr.0.saturating_add(len as u64) <= self.end()
    }
}

/// Attaches `comm` to `resource`: every run of chunks the resource has mapped is registered with `comm`
/// now, every run it maps later as it is mapped, and each registration is deregistered before any of
/// its memory is unmapped (growth, trim, reclaim, sleep, wake, the resource's drop), with no call from
/// the user. Adjacent runs of a tag are one registration (NCCL uses a registration only when one covers
/// the whole buffer), so a buffer allocated after the pool grew lies in one registration.
///
/// The [`Attachment`] owns the communicator: [`Attachment::comm`] lends it for collectives, and
/// dropping the attachment detaches it (deregistering everything) and destroys the communicator
/// ([`Attachment::detach`] gives it back instead). The attachment holds the resource weakly: either may
/// go first.
///
/// What happens where a registration cannot be made at once:
/// - Inside a [`group`](crate::group()) open on the thread that makes the pool map or unmap (an
///   allocation inside the group's closure), registering and deregistering wait for the group's end
///   (after `ncclGroupEnd`, before `group` returns); meanwhile the communicator's collectives are
///   refused with an error naming the cause, so none runs over stale registrations. Allocate the
///   group's buffers before the group.
/// - While another thread holds the communicator (a [`CommGuard`]), the change waits for that thread:
///   it is made before that thread's next collective on the communicator, or when it lets the
///   communicator go. Memory unmapped meanwhile stays registered until then (NCCL keeps what it
///   imported alive), and no collective on the communicator runs before it is deregistered.
/// - A failed `ncclCommRegister` leaves the run unregistered (tried again when the run changes) and a
///   failed `ncclCommDeregister` drops the registration; both are recorded in
///   [`Attachment::errors`], never panic. The collective that triggered the work returns the failure.
///
/// Refused, and `comm` destroyed with the error: a resource of another device than the communicator's,
/// a group open on this thread (the communicator is then destroyed when the group ends), an NCCL without
/// `ncclCommRegister` (before 2.19).
///
/// # Safety
///
/// 1. As point 1 of [`Comm::register`]: NCCL requires that when any rank passes registered buffers to a
///    collective every rank does. Every rank of the communicator attaches it to the resource its
///    collective buffers come from (or registers them otherwise), and checks [`Attachment::errors`]
///    where a registration failure would leave one rank's buffer unregistered.
#[allow(unsafe_code)]
pub unsafe fn attach(mut comm: Comm, resource: &Arc<ServiceResource>) -> Result<Attachment> {
    let call = "ncclCommRegister";
    if resource.device() != comm.device() {
        return Err(Error::InvalidArgument {
            call,
            reason: format!(
                "the resource hands out memory of {}, the communicator (rank {}) runs on {}",
                resource.device(),
                comm.rank(),
                comm.device()
            ),
        });
    }
    if scope::is_open() {
        // Destroyed when the group ends, not inside it.
        let rank = comm.rank();
        scope::run_or_defer(
            move || format!("destroying the communicator of rank {rank} refused by attach"),
            move || comm.destroy(),
        )?;
        return Err(Error::InvalidArgument {
            call,
            reason: "a group is open on this thread: attach before the group starts (registrations cannot be \
                     made inside it); the communicator is destroyed when the group ends"
                .into(),
        });
    }
    if comm.before.is_some() {
        return Err(Error::InvalidArgument {
            call,
            reason: "the communicator is attached already".into(),
        });
    }
    comm.lib.get(&comm.lib.comm_register)?;
    comm.lib.get(&comm.lib.comm_deregister)?;
    let follow = Arc::new(Follow {
        lend: Lend::default(),
        book: Mutex::new(Book::default()),
    });
    comm.before = Some(follow.clone() as Arc<dyn BeforeCollective>);
    let device = comm.device();
    let shared = Arc::new(Shared { comm, follow, device });
    // The resource reports what is mapped now at once: registered here, on this thread.
    let id = resource.attach(Arc::new(Observer { shared: shared.clone() }));
    Ok(Attachment {
        shared,
        resource: Arc::downgrade(resource),
        id,
    })
}

/// A communicator attached to a [`ServiceResource`] ([`attach`]): it owns the communicator, keeps its
/// registrations equal to the resource's mapped runs, and on drop detaches (every registration is
/// deregistered) and destroys the communicator.
pub struct Attachment {
    shared: Arc<Shared>,
    resource: Weak<ServiceResource>,
    id: ObserverId,
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attachment")
            .field("device", &self.shared.device.ordinal())
            .field("registered", &self.registered().len())
            .finish()
    }
}

impl Attachment {
    /// Lends the communicator to this thread for collectives, waiting while another thread holds it;
    /// a thread may hold it several times over. Registrations are brought up to date first (outside a
    /// group), and again when the last guard of this thread is dropped.
    ///
    /// While a thread holds it, the resource's changes made on other threads wait for it (see
    /// [`attach`]); a thread that holds it may allocate from and free into the resource.
    pub fn comm(&self) -> CommGuard<'_> {
        let f = &self.shared.follow;
        f.lend.enter();
        if f.lend.outermost() && !scope::is_open() {
            let mut book = f.book();
            // Recorded in the book; the next collective returns it if the work is still to do.
            let _ = f.reconcile(&self.shared.comm, &mut book);
        }
        CommGuard {
            shared: &self.shared,
            _not_send: PhantomData,
        }
    }

    /// Brings the registrations up to date now (waiting for the communicator if another thread holds
    /// it) and returns the first failure of this attempt. Refused inside a group.
    pub fn sync(&self) -> Result<()> {
        if scope::is_open() {
            return Err(Error::InvalidArgument {
                call: "ncclCommRegister",
                reason: "a group is open on this thread: registrations change after it ends".into(),
            });
        }
        let f = &self.shared.follow;
        f.lend.enter();
        let r = f.reconcile(&self.shared.comm, &mut f.book());
        f.lend.leave();
        r
    }

    /// The registrations held now, in address order: one per mapped physical allocation of a tag,
    /// unless a change waits (see [`is_current`](Self::is_current)) or a registration failed.
    pub fn registered(&self) -> Vec<RegisteredRange> {
        let book = self.shared.follow.book();
        let mut v: Vec<RegisteredRange> = book
            .held
            .iter()
            .map(|h| RegisteredRange {
                tag: h.tag,
                addr: DeviceAddr(h.span.0),
                len: (h.span.1 - h.span.0) as usize,
            })
            .collect();
        v.sort_unstable_by_key(|r| r.addr.0);
        v
    }

    /// The physical allocations the resource reported mapped, in address order, per tag.
    pub fn mapped(&self) -> Vec<RegisteredRange> {
        let book = self.shared.follow.book();
        let mut v: Vec<RegisteredRange> = book
            .mapped
            .iter()
            .flat_map(|(&tag, set)| {
                set.spans().iter().map(move |&(s, e)| RegisteredRange {
                    tag,
                    addr: DeviceAddr(s),
                    len: (e - s) as usize,
                })
            })
            .collect();
        v.sort_unstable_by_key(|r| r.addr.0);
        v
    }

    /// Whether the registrations are exactly one per mapped allocation, with nothing waiting (runs
    /// whose registration failed are not waiting: see [`errors`](Self::errors)).
    pub fn is_current(&self) -> bool {
        self.shared.follow.book().plans().is_empty()
    }

    /// The failures recorded so far (the first 64; a count of the rest is in
    /// [`errors_dropped`](Self::errors_dropped)).
    pub fn errors(&self) -> Vec<Error> {
        self.shared.follow.book().errors.clone()
    }

    /// How many failures were not kept.
    pub fn errors_dropped(&self) -> u64 {
        self.shared.follow.book().errors_dropped
    }

    /// The recorded failures, emptying the record.
    pub fn take_errors(&self) -> Vec<Error> {
        let mut book = self.shared.follow.book();
        book.errors_dropped = 0;
        std::mem::take(&mut book.errors)
    }

    /// The device of the communicator and the resource.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// The resource, while it lives.
    pub fn resource(&self) -> Option<Arc<ServiceResource>> {
        self.resource.upgrade()
    }

    /// Detaches from the resource (which reports every mapped run unmapping, so everything is
    /// deregistered) and with the resource gone, deregisters what is left.
    fn detach_inner(&self) {
        if let Some(r) = self.resource.upgrade() {
            r.detach(self.id);
        }
        let f = &self.shared.follow;
        f.book().mapped.clear();
        self.shared.sync_now();
    }

    /// Detaches (deregistering everything) and gives the communicator back. Refused inside a group
    /// (the attachment is then dropped: detached, with the deregistrations at the group's end, and the
    /// communicator destroyed after them). Returns the first deregistration failure instead of the
    /// communicator, which is then destroyed.
    pub fn detach(self) -> Result<Comm> {
        if scope::is_open() {
            return Err(Error::InvalidArgument {
                call: "ncclCommDeregister",
                reason: "a group is open on this thread: detach after it ends".into(),
            });
        }
        let before = self.shared.follow.book().errors.len();
        self.detach_inner();
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used again nor dropped; each field is read out once.
        #[allow(unsafe_code)]
        let (shared, resource) = unsafe { (std::ptr::read(&this.shared), std::ptr::read(&this.resource)) };
        drop(resource);
        let mut errors = {
            let mut book = shared.follow.book();
            let at = before.min(book.errors.len());
            book.errors.split_off(at)
        };
        let Shared { mut comm, .. } = match Arc::try_unwrap(shared) {
            Ok(s) => s,
            Err(_) => {
                return Err(Error::InvalidArgument {
                    call: "ncclCommDeregister",
                    reason: "the communicator is still shared (work deferred to a group's end holds it)".into(),
                })
            }
        };
        comm.before = None;
        if !errors.is_empty() {
            return Err(errors.swap_remove(0));
        }
        Ok(comm)
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.detach_inner();
    }
}

/// The communicator of an [`Attachment`], lent to this thread ([`Attachment::comm`]); derefs to
/// [`Comm`]. Not `Send`: the thread that took it uses it and gives it back.
pub struct CommGuard<'a> {
    shared: &'a Arc<Shared>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for CommGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CommGuard").field(&self.shared.comm).finish()
    }
}

impl std::ops::Deref for CommGuard<'_> {
    type Target = Comm;

    fn deref(&self) -> &Comm {
        &self.shared.comm
    }
}

impl Drop for CommGuard<'_> {
    fn drop(&mut self) {
        let f = &self.shared.follow;
        if f.lend.outermost() && !scope::is_open() {
            let mut book = f.book();
            // Recorded in the book.
            let _ = f.reconcile(&self.shared.comm, &mut book);
        }
        f.lend.leave();
    }
}
