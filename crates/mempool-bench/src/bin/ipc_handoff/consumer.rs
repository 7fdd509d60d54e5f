//! A consumer process: an importer, and the ops the producer sends it over the control socket.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use mempool_core::{memory, DeviceAddr, Stream};
use mempool_ipc::trace::{self, Record};
use mempool_ipc::{Error, Importer, ImporterOptions};

use crate::control::{ctl_path, recv_op, OP_COPY, OP_COUNTERS, OP_IPC, OP_IPC_MANY, OP_TRACE, WAIT};
use crate::error::AnyResult;
use crate::pinned::Pinned;

pub(crate) fn run(socket: &Path, v1: bool, socket_only: bool, host_ready: bool) -> AnyResult<()> {
    let options = ImporterOptions {
        fast_release: !v1,
        rings: !socket_only,
        wait_ready_on_host: host_ready,
        release_on_host: host_ready,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(socket, options)?;
    if importer.fast_release() == v1 || importer.rings() != (!v1 && !socket_only) {
        return Err(format!(
            "asked for the fast release path: {}, got it: {}; asked for the rings: {}, got them: {}",
            !v1,
            importer.fast_release(),
            !v1 && !socket_only,
            importer.rings()
        )
        .into());
    }
    let dev = importer.device();
    let ctx = dev.context()?;
    let stream = Stream::new(&ctx)?;
    let mut ctl = UnixStream::connect(ctl_path(socket))?;
    let mut pinned: Option<Pinned> = None;
    let mut device: Option<(DeviceAddr, usize)> = None;
    loop {
        let (op, arg) = recv_op(&mut ctl)?;
        match op {
            OP_IPC => {
                for _ in 0..arg {
                    let buf = match importer.recv_timeout(stream.as_ref(), WAIT) {
                        Ok(buf) => buf,
                        Err(Error::ExporterGone { .. }) => return Ok(()),
                        Err(e) => return Err(e.into()),
                    };
                    buf.release()?;
                }
                ctl.write_all(&[1])?;
            }
            OP_IPC_MANY => {
                let mut left = arg as usize;
                while left > 0 {
                    let bufs = match importer.recv_many(stream.as_ref(), left.min(64), Some(WAIT)) {
                        Ok(bufs) => bufs,
                        Err(Error::ExporterGone { .. }) => return Ok(()),
                        Err(e) => return Err(e.into()),
                    };
                    left -= bufs.len();
                    for buf in bufs {
                        buf.release()?;
                    }
                }
                ctl.write_all(&[1])?;
            }
            OP_COPY => {
                let len = arg as usize;
                if pinned.as_ref().is_none_or(|p| p.len < len) {
                    pinned = Some(Pinned::new(&ctx, len)?);
                    if let Some((ptr, _)) = device.take() {
                        // SAFETY: allocated below with `device_alloc`, no work pending (every copy
                        // synchronized).
                        #[allow(unsafe_code)]
                        unsafe { memory::device_free(&ctx, ptr) }?;
                    }
                    device = Some((memory::device_alloc(&ctx, len)?, len));
                }
                let host = pinned.as_mut().expect("allocated above");
                let (dptr, _) = device.expect("allocated above");
                ctl.read_exact(&mut host.bytes()[..len])?;
                // SAFETY: `dptr` holds at least `len` bytes of device memory of `ctx`.
                #[allow(unsafe_code)]
                unsafe { memory::copy_to_device(&ctx, dptr, &host.bytes()[..len], stream.as_ref()) }?;
                ctl.write_all(&[1])?;
            }
            OP_COUNTERS if arg == 1 => {
                trace::reset_counters();
                ctl.write_all(&[1])?;
            }
            OP_COUNTERS => {
                let mut out = Vec::with_capacity(8 * trace::Counters::WORDS);
                for w in trace::counters().to_words() {
                    out.extend_from_slice(&w.to_le_bytes());
                }
                ctl.write_all(&out)?;
            }
            OP_TRACE if arg == 1 => {
                trace::enable();
                ctl.write_all(&[1])?;
            }
            OP_TRACE => {
                trace::disable();
                let records = trace::take();
                let mut out = Vec::with_capacity(8 + records.len() * Record::BYTES);
                out.extend_from_slice(&(records.len() as u64).to_le_bytes());
                for r in &records {
                    out.extend_from_slice(&r.to_bytes());
                }
                ctl.write_all(&out)?;
            }
            _ => break,
        }
    }
    if let Some((ptr, _)) = device {
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe { memory::device_free(&ctx, ptr) }?;
    }
    Ok(())
}
