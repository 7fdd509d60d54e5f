//! The producer's side: its consumers (processes it started, each with an importer connection and a
//! control socket), how it makes buffers, and the exporter's spins.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use mempool_core::{DeviceAddr, StreamRef};
use mempool_ipc::{ExportedBuffer, Exporter, ImporterId};
use mempool_rmm::{AsyncResource, MemoryResource, PoolResource};

use crate::control::WAIT;
use crate::error::AnyResult;

pub(crate) struct Consumer {
    pub(crate) child: Child,
    pub(crate) ctl: UnixStream,
    pub(crate) importer: ImporterId,
    /// Whether it asked for the fast release path.
    pub(crate) fast: bool,
}

/// How the producer makes buffers: whole pool allocations, or suballocations from a
/// `PoolResource` over the exporter's pool (adopted by the exporter).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Make {
    Alloc,
    Sub,
}

pub(crate) struct Producer {
    pub(crate) exporter: Exporter,
    pub(crate) sub: Arc<PoolResource<Arc<AsyncResource>>>,
}

impl Producer {
    #[allow(unsafe_code)]
    pub(crate) fn make<'s>(&self, make: Make, size: usize, stream: StreamRef<'s>) -> AnyResult<ExportedBuffer<'s>> {
        match make {
            Make::Alloc => Ok(self.exporter.alloc(size, stream)?),
            Make::Sub => {
                let ptr = self.sub.allocate(size, stream)?;
                let mr = self.sub.clone();
                // SAFETY: the exporter calls this once, after the last holder let go, with the range
                // adopted below (an allocation of `mr` on `stream`).
                let free = move |p: DeviceAddr, n: usize, s: StreamRef<'_>| unsafe { mr.deallocate(p, n, s) };
                // SAFETY: `ptr` is a fresh `size`-byte allocation of `self.sub` on `stream`, used only
                // through the returned buffer; `free` gives exactly it back.
                Ok(unsafe { self.exporter.adopt(ptr, size, stream, free) }?)
            }
        }
    }
}

pub(crate) fn spawn_consumers(
    exporter: &Exporter,
    ctl_listener: &UnixListener,
    socket: &Path,
    count: usize,
    flag: Option<&str>,
    all: &mut Vec<Consumer>,
) -> AnyResult<()> {
    let exe = std::env::current_exe()?;
    for _ in 0..count {
        let mut command = Command::new(&exe);
        command.arg("consumer").arg(socket);
        command.args(flag);
        let child = command.spawn()?;
        let (ctl, _) = ctl_listener.accept()?;
        let pid = mempool_ipc::peer_credentials(&ctl)?.pid;
        let importers = exporter.wait_for_importers(all.len() + 1, WAIT)?;
        let importer = importers
            .iter()
            .find(|i| i.credentials.pid == pid)
            .ok_or("the consumer's importer connection is missing")?
            .id;
        all.push(Consumer {
            child,
            ctl,
            importer,
            fast: flag != Some("--v1"),
        });
    }
    Ok(())
}

/// Which of the exporter's spins run (`Exporter::set_spin`: the serving thread's over the rings;
/// `Exporter::set_wait_spin`: `wait_released`'s), each at its default or off.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Spins {
    Both,
    Loop,
    Wait,
    Neither,
}

impl Spins {
    /// The column's name in the tables.
    pub(crate) fn column(self) -> &'static str {
        match self {
            Spins::Both => "v3 sub",
            Spins::Loop => "loop spin only",
            Spins::Wait => "wait spin only",
            Spins::Neither => "no spin",
        }
    }
}

/// Runs `f` with the spins `which` names at their defaults and the others off, then puts the
/// settings back as they were.
pub(crate) fn with_spins<T>(producer: &Producer, which: Spins, f: impl FnOnce() -> AnyResult<T>) -> AnyResult<T> {
    let e = &producer.exporter;
    let (spin, wait_spin) = (e.spin(), e.wait_spin());
    let on = |yes: bool, default: Duration| if yes { default } else { Duration::ZERO };
    e.set_spin(on(matches!(which, Spins::Both | Spins::Loop), Exporter::DEFAULT_SPIN));
    e.set_wait_spin(on(
        matches!(which, Spins::Both | Spins::Wait),
        Exporter::DEFAULT_WAIT_SPIN,
    ));
    let result = f();
    e.set_spin(spin);
    e.set_wait_spin(wait_spin);
    result
}
