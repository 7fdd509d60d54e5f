//! The exporter's connection threads: one accepts importers, one per importer runs the
//! handshake and then takes its `Release` messages until it leaves; and the shutdown that says
//! `Goodbye` to them all and waits for their releases.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::state::{lock_plain, Inner, Peer};
use crate::conn::Connection;
use crate::cred::PeerCredentials;
use crate::error::{record_drop_error, Error};
use crate::lease::ImporterId;
use crate::listener::Listener;
use crate::session::{ExporterSession, ImporterEvent};

/// Accepts importers until the exporter shuts down, and starts a thread for each.
pub(super) fn accept_loop(inner: Arc<Inner>, listener: Listener) {
    while !inner.shutting_down.load(Ordering::Acquire) {
        let (conn, credentials) = match listener.accept_timeout(Duration::from_millis(100)) {
            Ok(accepted) => accepted,
            Err(Error::Timeout { .. }) | Err(Error::PeerCredentials { .. }) => continue,
            Err(e) => {
                record_drop_error(e);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = {
            let mut state = inner.lock();
            let id = ImporterId(state.next_importer);
            state.next_importer += 1;
            state.serving += 1;
            id
        };
        // Opened now, while the peer is surely alive, so a recycled pid cannot fool the wait.
        let pidfd = rustix::process::Pid::from_raw(credentials.pid)
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        let serve_inner = inner.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("mempool-ipc-importer-{}", id.0))
            .spawn(move || serve(serve_inner, id, conn, credentials, pidfd));
        match spawned {
            Ok(thread) => {
                let mut threads = lock_plain(&inner.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(thread);
            }
            Err(e) => {
                inner.lock().serving -= 1;
                record_drop_error(e.into());
            }
        }
    }
}

/// Serves one importer: the handshake, then its releases until it leaves.
fn serve(inner: Arc<Inner>, id: ImporterId, conn: Connection, credentials: PeerCredentials, pidfd: Option<OwnedFd>) {
    let session = match ExporterSession::handshake(conn, inner.announcement, inner.pool_fd.as_fd()) {
        Ok(session) => Arc::new(session),
        Err(e) => {
            inner.lock().serving -= 1;
            inner.changed.notify_all();
            if !matches!(e, Error::Closed) {
                record_drop_error(e);
            }
            return;
        }
    };
    {
        let mut state = inner.lock();
        state.importers.insert(
            id,
            Peer {
                session: session.clone(),
                credentials,
            },
        );
    }
    inner.changed.notify_all();
    if inner.shutting_down.load(Ordering::Acquire) {
        let _ = session.goodbye();
    }

    let clean = loop {
        match session.recv() {
            Ok(ImporterEvent::Release(buffer)) => {
                let released = inner.lock().leases.release(buffer, id);
                match released {
                    Ok(freed) => {
                        inner.finish_deferred(freed.map(|s| (buffer, s)).into_iter().collect());
                        inner.changed.notify_all();
                    }
                    Err(e) => {
                        // A release of something it does not hold: the importer is broken.
                        // Treat it as gone, but it may still use what it holds: wait for it.
                        record_drop_error(session.reject(e.into()));
                        break false;
                    }
                }
            }
            Ok(ImporterEvent::Goodbye) => break true,
            Err(_) => break false,
        }
    };
    inner.lock().importers.remove(&id);
    inner.changed.notify_all();
    session.connection().shutdown();

    inner.importer_gone(id, clean, credentials.pid, pidfd.as_ref());
}

/// Shuts the exporter down (dropping it, or [`Exporter::shutdown`](crate::Exporter::shutdown)):
/// no new connections, `Goodbye` to every importer, a wait (at most the shutdown timeout) for
/// them to release what they hold, then every connection closes and its thread is joined.
pub(super) fn shut_down(inner: &Inner, accept: JoinHandle<()>) {
    *lock_plain(&inner.shutdown_deadline) = Some(Instant::now() + inner.shutdown_timeout);
    inner.shutting_down.store(true, Ordering::Release);
    let _ = accept.join();
    let deadline = Instant::now() + inner.shutdown_timeout;
    let sessions: Vec<_> = inner.lock().importers.values().map(|p| p.session.clone()).collect();
    for session in &sessions {
        let _ = session.goodbye();
    }
    // Importers release what they hold (or disconnect); wait for that, bounded.
    let mut state = inner.lock();
    while state.leases.importers().next().is_some() {
        match inner.wait(state, deadline) {
            Some(s) => state = s,
            None => {
                state = inner.lock();
                break;
            }
        }
    }
    let sessions: Vec<_> = state.importers.values().map(|p| p.session.clone()).collect();
    drop(state);
    for session in sessions {
        session.connection().shutdown();
    }
    let threads = std::mem::take(&mut *lock_plain(&inner.threads));
    for thread in threads {
        let _ = thread.join();
    }
}
