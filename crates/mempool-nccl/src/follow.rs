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

use mempool_core::{Device, DeviceAddr, StreamRef};
use mempool_rmm::{ChunkObserver, ChunkRange, ObserverId, ServiceResource, Tag};

use crate::comm::{BeforeCollective, Comm};
use crate::error::{Error, Result};
use crate::ranges::{plan, RangeSet, Span};
use crate::scope;
use crate::sys::{CommDeregisterFn, CommRegisterFn};

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
    /// Part of its memory was reported unmapping: it goes, even where the same addresses are mapped
    /// again (another physical allocation, which NCCL's registration does not reach).
    stale: bool,
}

/// Whether two spans share an address.
fn overlaps(a: Span, b: Span) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// What bringing the registrations up to date does outside the book: wait for the device, register and
/// deregister. Apart from NCCL and the driver, so that host tests drive [`Book::reconcile`].
trait Registrar {
    /// Waits until the device has finished the work queued so far (collectives that may use a
    /// registration about to go). An error, also where waiting is forbidden now, leaves those
    /// registrations in place.
    fn wait(&mut self) -> Result<()>;
    /// `ncclCommDeregister`.
    fn deregister(&mut self, handle: Handle) -> Result<()>;
    /// `ncclCommRegister` of a mapped run.
    fn register(&mut self, span: Span) -> Result<Handle>;
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

    /// The resource mapped `start..end` (one physical allocation) in `tag`'s region.
    fn mapped(&mut self, tag: Tag, start: u64, end: u64) {
        self.mapped.entry(tag).or_default().insert(start, end);
    }

    /// The resource is about to unmap `start..end` of `tag`'s region: every registration over any of it
    /// is stale from now on, even if the addresses are mapped again before it can be deregistered, and a
    /// failure there is forgotten (the run changed).
    fn unmapping(&mut self, tag: Tag, start: u64, end: u64) {
        if let Some(m) = self.mapped.get_mut(&tag) {
            m.remove(start, end);
            if m.is_empty() {
                self.mapped.remove(&tag);
            }
        }
        for h in self
            .held
            .iter_mut()
            .filter(|h| h.tag == tag && overlaps(h.span, (start, end)))
        {
            h.stale = true;
        }
        self.failed.retain(|&(t, f)| t != tag || !overlaps(f, (start, end)));
    }

    /// Everything is to go (the attachment detaches).
    fn unmap_all(&mut self) {
        self.mapped.clear();
        for h in &mut self.held {
            h.stale = true;
        }
    }

    /// Whether `h` is to go: stale, or no longer exactly one mapped run.
    fn goes(&self, h: &Held) -> bool {
        h.stale || !self.mapped.get(&h.tag).is_some_and(|m| m.spans().contains(&h.span))
    }

    /// Whether a collective may have used `h` (one was enqueued since it was registered).
    fn in_use(&self, h: &Held) -> bool {
        h.since != self.collectives
    }

    /// The plan of each tag that has anything to do (stale registrations are deregistered, and their
    /// runs registered anew where mapped).
    fn plans(&self) -> Vec<(Tag, crate::ranges::Plan)> {
        let mut tags: Vec<Tag> = self.mapped.keys().copied().collect();
        tags.extend(self.held.iter().map(|h| h.tag));
        tags.sort_unstable();
        tags.dedup();
        tags.into_iter()
            .filter_map(|t| {
                let wanted = self.mapped.get(&t).map_or(&[][..], RangeSet::spans);
                let live: Vec<Span> = self
                    .held
                    .iter()
                    .filter(|h| h.tag == t && !h.stale)
                    .map(|h| h.span)
                    .collect();
                let failed: Vec<Span> = self.failed.iter().filter(|f| f.0 == t).map(|f| f.1).collect();
                let mut p = plan(wanted, &live, &failed);
                p.deregister
                    .extend(self.held.iter().filter(|h| h.tag == t && h.stale).map(|h| h.span));
                p.deregister.sort_unstable();
                (!p.is_empty()).then_some((t, p))
            })
            .collect()
    }

    /// Makes the registrations equal to the mapped allocations: deregisters what is to go (after
    /// waiting for the device where a collective may still use it), then registers what is missing.
    ///
    /// Where the wait fails (or is forbidden: a stream being captured into a graph), the registrations
    /// a collective may still use stay registered, and the runs they cover stay unregistered: the next
    /// call tries again, and until one succeeds the plan is not empty, so collectives are refused
    /// (`before_collective`). NCCL may still be reading or writing that memory; it is never deregistered
    /// before a wait says the device is done with it. Every failure is recorded; the first is returned.
    fn reconcile(&mut self, r: &mut impl Registrar) -> Result<()> {
        let plans = self.plans();
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
        // Deregistering unmaps the peers' mappings at once, on the host: work still queued on the
        // ranges must finish first. A registration no collective was enqueued after cannot be in use:
        // growth in batches (wake) does not wait.
        let mut waited = true;
        if self.held.iter().any(|h| self.goes(h) && self.in_use(h)) {
            if let Err(e) = r.wait() {
                waited = false;
                fail(self, e);
            }
        }
        let mut i = 0;
        while i < self.held.len() {
            let h = &self.held[i];
            if !(self.goes(h) && (waited || !self.in_use(h))) {
                i += 1;
                continue;
            }
            let h = self.held.swap_remove(i);
            if let Err(e) = r.deregister(h.handle) {
                fail(self, e);
            }
        }
        for (tag, p) in &plans {
            for &span in &p.register {
                // Not over a registration still waiting to go: NCCL would find either for a buffer there.
                if self.held.iter().any(|h| overlaps(h.span, span)) {
                    continue;
                }
                match r.register(span) {
                    Ok(handle) => {
                        let since = self.collectives;
                        self.held.push(Held {
                            tag: *tag,
                            span,
                            handle,
                            since,
                            stale: false,
                        })
                    }
                    Err(e) => {
                        self.failed.push((*tag, span));
                        fail(self, e);
                    }
                }
            }
        }
        // A failed run that changed (grew, shrank, went) is tried again in its new shape.
        let Book { mapped, failed, .. } = self;
        failed.retain(|(t, s)| mapped.get(t).is_some_and(|m| m.spans().contains(s)));
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The registrar of a live communicator: NCCL's calls, and a device synchronize for the wait.
struct Nccl<'a, 's> {
    comm: &'a Comm,
    reg: CommRegisterFn,
    dereg: CommDeregisterFn,
    /// The stream of the collective about to be enqueued, where one is: while it is being captured into a
    /// CUDA graph, synchronizing the device is forbidden (it would invalidate the capture).
    stream: Option<StreamRef<'s>>,
}

impl Registrar for Nccl<'_, '_> {
    fn wait(&mut self) -> Result<()> {
        if let Some(s) = self.stream {
            if s.is_capturing()? {
                return Err(Error::InvalidArgument {
                    call: "ncclCommDeregister",
                    reason: "the collective's stream is being captured into a CUDA graph, where waiting for the \
                             device is forbidden: the registrations of memory the attached pool unmapped stay \
                             registered until a wait succeeds after the capture (collectives may still use \
                             them), and collectives on this communicator are refused until then"
                        .into(),
                });
            }
        }
        Ok(self.comm.ctx.synchronize()?)
    }

    fn deregister(&mut self, handle: Handle) -> Result<()> {
        // SAFETY: `handle` came from ncclCommRegister on this live communicator and is given up once (the
        // book let it go); the caller holds the communicator, so no other NCCL call on it runs meanwhile,
        // and no group is open on this thread. The book deregisters a registration a collective may use
        // only after a wait for the device succeeded.
        #[allow(unsafe_code)]
        let r = unsafe { (self.dereg)(self.comm.raw, handle.0) };
        self.comm.lib.check("ncclCommDeregister", r, self.comm.raw)
    }

    fn register(&mut self, span: Span) -> Result<Handle> {
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `span` is a run of chunks the resource reported mapped (with read-write access for this
        // device) and not since reported unmapping; it is deregistered before the resource unmaps any of it
        // (the observer is told first), or, where that thread cannot or the wait before it fails, before any
        // later collective on this communicator (`before_collective` refuses collectives while one waits).
        // The caller holds the communicator and no group is open on this thread. NCCL writes one handle.
        #[allow(unsafe_code)]
        let r = unsafe {
            (self.reg)(
                self.comm.raw,
                span.0 as usize as *mut c_void,
                (span.1 - span.0) as usize,
                &mut handle,
            )
        };
        self.comm.lib.check("ncclCommRegister", r, self.comm.raw)?;
        Ok(Handle(handle))
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

    /// Brings the registrations up to date ([`Book::reconcile`]) with `comm`, the context bound; `stream`
    /// is the collective's about to be enqueued, where one is. The caller holds the communicator (`lend`)
    /// and no group is open on this thread.
    fn reconcile(&self, comm: &Comm, book: &mut Book, stream: Option<StreamRef<'_>>) -> Result<()> {
        if book.plans().is_empty() {
            return Ok(());
        }
        let lib = comm.lib;
        let (reg, dereg) = match (lib.get(&lib.comm_register), lib.get(&lib.comm_deregister)) {
            (Ok(r), Ok(d)) => (r, d),
            (Err(e), _) | (_, Err(e)) => {
                book.record(e.clone());
                return Err(e);
            }
        };
        let bound = match comm.ctx.bind() {
            Ok(b) => b,
            Err(e) => {
                let e = Error::from(e);
                book.record(e.clone());
                return Err(e);
            }
        };
        let out = book.reconcile(&mut Nccl {
            comm,
            reg,
            dereg,
            stream,
        });
        drop(bound);
        out
    }
}

impl BeforeCollective for Follow {
    fn before_collective(&self, call: &'static str, comm: &Comm, stream: StreamRef<'_>) -> Result<()> {
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
            self.reconcile(comm, &mut book, Some(stream))
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
            let _ = self.follow.reconcile(&self.comm, &mut book, None);
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
        self.shared.follow.book().mapped(range.tag, range.addr.0, range.end());
        self.shared.sync_now();
    }

    fn unmapping(&self, range: ChunkRange) {
        if range.len == 0 {
            return;
        }
        self.shared
            .follow
            .book()
            .unmapping(range.tag, range.addr.0, range.end());
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
/// - Where the device wait before a deregistration fails, or is forbidden (the collective's stream is
///   being captured into a CUDA graph: the synchronize is not attempted), the registrations a collective
///   may still use stay registered (the memory mapped again at their addresses is not registered over
///   them) and every later bring-up-to-date waits again and deregisters them once a wait succeeds;
///   until then the communicator's collectives are refused with the wait's error. Memory NCCL may still
///   use is never deregistered.
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
            let _ = f.reconcile(&self.shared.comm, &mut book, None);
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
        let r = f.reconcile(&self.shared.comm, &mut f.book(), None);
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
        self.shared.follow.book().unmap_all();
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
            let _ = f.reconcile(&self.shared.comm, &mut book, None);
        }
        f.lend.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 2 << 20;

    /// A registrar without NCCL or a device: numbers its handles from 1, and its wait fails while
    /// `wait_fails` is set.
    #[derive(Default)]
    struct Fake {
        wait_fails: bool,
        waits: usize,
        registered: Vec<(Span, usize)>,
        deregistered: Vec<usize>,
    }

    impl Registrar for Fake {
        fn wait(&mut self) -> Result<()> {
            self.waits += 1;
            if self.wait_fails {
                return Err(Error::InvalidArgument {
                    call: "cuCtxSynchronize",
                    reason: "the test's device wait failed".into(),
                });
            }
            Ok(())
        }

        fn deregister(&mut self, handle: Handle) -> Result<()> {
            self.deregistered.push(handle.0.addr());
            Ok(())
        }

        fn register(&mut self, span: Span) -> Result<Handle> {
            let id = self.registered.len() + 1;
            self.registered.push((span, id));
            Ok(Handle(std::ptr::without_provenance_mut(id)))
        }
    }

    fn tag() -> Tag {
        Tag::DEFAULT
    }

    /// The registrations held: (span, handle, stale), in address order.
    fn held(book: &Book) -> Vec<(Span, usize, bool)> {
        let mut v: Vec<_> = book.held.iter().map(|h| (h.span, h.handle.0.addr(), h.stale)).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_failed_wait_keeps_what_a_collective_may_use_registered_until_a_wait_succeeds() {
        let mut book = Book::default();
        let mut nccl = Fake::default();
        book.mapped(tag(), 0, 2 * C);
        book.reconcile(&mut nccl).unwrap();
        assert_eq!(held(&book), [((0, 2 * C), 1, false)]);
        assert_eq!(nccl.waits, 0, "registering needs no wait");
        // A collective was enqueued over it, then the pool unmaps it.
        book.collectives += 1;
        book.unmapping(tag(), 0, 2 * C);
        nccl.wait_fails = true;
        for attempt in 1..=2 {
            let e = book.reconcile(&mut nccl).unwrap_err();
            assert!(e.to_string().contains("the test's device wait failed"), "{e}");
            assert_eq!(nccl.waits, attempt);
            assert!(nccl.deregistered.is_empty(), "deregistered after a failed wait");
            assert_eq!(held(&book), [((0, 2 * C), 1, true)], "kept, to go once a wait succeeds");
            assert!(
                !book.plans().is_empty(),
                "the deregistration waits: collectives are refused"
            );
        }
        assert_eq!(book.errors.len(), 2, "each failed wait is recorded");
        nccl.wait_fails = false;
        book.reconcile(&mut nccl).unwrap();
        assert_eq!(nccl.waits, 3);
        assert_eq!(nccl.deregistered, [1], "deregistered once the wait succeeded");
        assert!(book.held.is_empty() && book.plans().is_empty());
    }

    #[test]
    fn a_registration_no_collective_used_goes_without_a_wait() {
        let mut book = Book::default();
        let mut nccl = Fake {
            wait_fails: true,
            ..Fake::default()
        };
        book.mapped(tag(), 0, C);
        book.reconcile(&mut nccl).unwrap();
        book.unmapping(tag(), 0, C);
        book.reconcile(&mut nccl).unwrap();
        assert_eq!((nccl.waits, nccl.deregistered.as_slice()), (0, &[1][..]));
        assert!(book.held.is_empty() && book.plans().is_empty());
    }

    #[test]
    fn memory_mapped_again_under_a_waiting_registration_is_registered_after_it_goes() {
        let mut book = Book::default();
        let mut nccl = Fake::default();
        book.mapped(tag(), 0, 2 * C);
        book.reconcile(&mut nccl).unwrap();
        book.collectives += 1;
        // Unmapped and mapped again at the same addresses (another physical allocation, which the old
        // registration does not reach) before the deregistration could be made; and a run elsewhere.
        book.unmapping(tag(), 0, 2 * C);
        book.mapped(tag(), 0, 2 * C);
        book.mapped(tag(), 4 * C, 5 * C);
        nccl.wait_fails = true;
        assert!(book.reconcile(&mut nccl).is_err());
        assert!(nccl.deregistered.is_empty());
        assert_eq!(
            held(&book),
            [((0, 2 * C), 1, true), ((4 * C, 5 * C), 2, false)],
            "the stale registration is kept, nothing is registered over it; the run elsewhere is registered"
        );
        assert!(!book.plans().is_empty());
        nccl.wait_fails = false;
        book.reconcile(&mut nccl).unwrap();
        assert_eq!(nccl.deregistered, [1]);
        assert_eq!(
            held(&book),
            [((0, 2 * C), 3, false), ((4 * C, 5 * C), 2, false)],
            "the new allocation has a registration of its own"
        );
        assert!(book.plans().is_empty());
    }

    #[test]
    fn detaching_deregisters_everything_after_one_wait() {
        let mut book = Book::default();
        let mut nccl = Fake::default();
        book.mapped(tag(), 0, C);
        book.mapped(tag(), C, 3 * C);
        book.reconcile(&mut nccl).unwrap();
        book.collectives += 1;
        book.unmap_all();
        nccl.wait_fails = true;
        assert!(book.reconcile(&mut nccl).is_err());
        assert_eq!(book.held.len(), 2, "nothing deregistered after a failed wait");
        nccl.wait_fails = false;
        book.reconcile(&mut nccl).unwrap();
        nccl.deregistered.sort_unstable();
        assert_eq!((nccl.waits, nccl.deregistered.as_slice()), (2, &[1, 2][..]));
        assert!(book.held.is_empty());
    }
}
