//! The control connection from the producer to each consumer (a Unix socket beside the exporter's,
//! `SOCKET.ctl`): an op byte and a little-endian u64 per message, answered with one byte or data.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::AnyResult;

/// How long either side waits for the other.
pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// Control messages from the producer to a consumer: an op byte and a little-endian u64.
pub(crate) const OP_EXIT: u8 = 0;
/// Receive and release this many buffers through mempool-ipc, then answer one byte.
pub(crate) const OP_IPC: u8 = 1;
/// Receive and release this many buffers with `Importer::recv_many`, then answer one byte.
pub(crate) const OP_IPC_MANY: u8 = 4;
/// Receive this many bytes, copy them to the device, answer one byte.
pub(crate) const OP_COPY: u8 = 2;
/// 1: start recording `mempool_ipc::trace`; 0: stop, and answer the records (a little-endian u64
/// count, then each record's bytes).
pub(crate) const OP_TRACE: u8 = 3;
/// 1: zero `mempool_ipc::trace`'s counters; 0: answer them (`Counters::WORDS` little-endian u64s).
pub(crate) const OP_COUNTERS: u8 = 5;

pub(crate) fn send_op(ctl: &mut UnixStream, op: u8, arg: u64) -> AnyResult<()> {
    let mut msg = [0u8; 9];
    msg[0] = op;
    msg[1..].copy_from_slice(&arg.to_le_bytes());
    ctl.write_all(&msg)?;
    Ok(())
}

pub(crate) fn recv_op(ctl: &mut UnixStream) -> AnyResult<(u8, u64)> {
    let mut msg = [0u8; 9];
    ctl.read_exact(&mut msg)?;
    Ok((msg[0], u64::from_le_bytes(msg[1..].try_into()?)))
}

pub(crate) fn ack(ctl: &mut UnixStream) -> AnyResult<()> {
    let mut b = [0u8; 1];
    ctl.read_exact(&mut b)?;
    Ok(())
}

pub(crate) fn ctl_path(socket: &Path) -> PathBuf {
    socket.with_extension("ctl")
}
