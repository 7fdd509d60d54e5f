//! The state of a thread's open NCCL group, apart from NCCL so that host tests can drive it: whether a
//! group is open, the work deferred to its end, and the protocol that opens and always ends it
//! ([`scoped`]). [`crate::group`] runs NCCL's group through it; the communicators and registrations ask
//! it whether a group is open.

use std::cell::{Cell, RefCell};

use crate::error::{Error, Result};

thread_local! {
    /// Whether a group is open on this thread: NCCL's group state is per thread.
    static OPEN: Cell<bool> = const { Cell::new(false) };
    /// What waits for the open group's end, in the order it was asked for.
    pub(crate) static DEFERRED: RefCell<Vec<Deferred>> = const { RefCell::new(Vec::new()) };
}

/// Work that must not run while a group is open on this thread (a deregistration: NCCL refuses
/// `ncclCommDeregister` inside a group), kept until the group ends.
pub(crate) struct Deferred {
    /// What the work is, for the message of its error.
    what: String,
    run: Box<dyn FnOnce() -> Result<()>>,
}

/// Whether a group is open on this thread.
pub(crate) fn is_open() -> bool {
    OPEN.with(Cell::get)
}

/// Runs `run` now when no group is open on this thread, and returns its result; inside a group, keeps
/// it for the group's end (where [`group`] runs it after `ncclGroupEnd`, before it returns, and
/// returns or prints its error) and returns `Ok`.
pub(crate) fn run_or_defer(what: impl FnOnce() -> String, run: impl FnOnce() -> Result<()> + 'static) -> Result<()> {
    if !is_open() {
        return run();
    }
    DEFERRED.with(|d| {
        d.borrow_mut().push(Deferred {
            what: what(),
            run: Box::new(run),
        })
    });
    Ok(())
}

/// The error of a group opened inside another.
pub(crate) fn nested() -> Error {
    Error::InvalidArgument {
        call: "ncclGroupStart",
        reason: "a group is already open on this thread: NCCL launches a nested group's work only when the \
                 outermost group ends; enqueue everything in one group"
            .into(),
    }
}

/// Ends the open group: `end` (`ncclGroupEnd`), then the deferred work, in order. Dropping it while it
/// still holds `end` (the closure panicked) does the same and prints the errors.
struct Ending<E: FnOnce() -> Result<()>> {
    end: Option<E>,
}

impl<E: FnOnce() -> Result<()>> Ending<E> {
    /// Ends the group once: `end`'s error first, else the first deferred work's error; the later
    /// deferred errors are printed (the work itself always runs).
    fn finish(&mut self) -> Result<()> {
        let Some(end) = self.end.take() else {
            return Ok(());
        };
        let ended = end();
        OPEN.with(|o| o.set(false));
        let deferred = DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()));
        let mut first = ended;
        for Deferred { what, run } in deferred {
            if let Err(e) = run() {
                if first.is_ok() {
                    first = Err(e);
                } else {
                    eprintln!("mempool-nccl: {what} at the group's end failed: {e}");
                }
            }
        }
        first
    }
}

impl<E: FnOnce() -> Result<()>> Drop for Ending<E> {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            eprintln!("mempool-nccl: ending the group after its closure panicked: {e}");
        }
    }
}

/// The group protocol, apart from NCCL so that host tests can drive it: refuses a nested group, calls
/// `start`, then `body`, then (always, also when `body` fails or panics) `end` and the work deferred
/// meanwhile. The result is `body`'s error, else `end`'s, else the first deferred error.
pub(crate) fn scoped<R>(
    start: impl FnOnce() -> Result<()>,
    end: impl FnOnce() -> Result<()>,
    body: impl FnOnce() -> Result<R>,
) -> Result<R> {
    if is_open() {
        return Err(nested());
    }
    start()?;
    OPEN.with(|o| o.set(true));
    let mut ending = Ending { end: Some(end) };
    let out = body();
    let ended = ending.finish();
    match (out, ended) {
        (Ok(v), Ok(())) => Ok(v),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(later)) => {
            eprintln!("mempool-nccl: ending the group after its closure failed ({e}): {later}");
            Err(e)
        }
    }
}
