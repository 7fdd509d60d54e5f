//! Benchmark: handing a GPU buffer from a producer process to consumer processes and back, with
//! mempool-ipc (the pool's descriptor once, then 176-byte buffer messages and an IPC event),
//! against a baseline measured in the same run: copying the same bytes through the host
//! (device -> pinned host -> Unix socket -> pinned host -> device, acknowledged).
//!
//! Ways through mempool-ipc, measured in the same run with separate consumer processes:
//!
//! - `v1 alloc`: protocol version 1 (`ImporterOptions::fast_release = false`), a whole pool
//!   allocation per buffer: the importer imports each buffer, and its release frees the import
//!   and synchronizes its stream (the path measured before the fast release path existed);
//! - `v2 alloc`: the fast release path, a whole pool allocation per buffer (still one import per
//!   buffer, but releases are ordered by the importer's event and batched);
//! - `v2 sub`: the fast release path over the socket (`ImporterOptions::rings = false`: the path
//!   before protocol version 3) with buffers suballocated (a `PoolResource` over the exporter's
//!   pool, `Exporter::adopt`) from blocks the importer keeps imported: after the first buffer, no
//!   import, no synchronize, and releases ordered by an event;
//! - `v3 alloc` and `v3 sub`: the same through the connection's shared-memory rings (protocol
//!   version 3, the default): buffers and releases cost no system call while both sides are
//!   awake, and a release goes out as soon as the buffer is let go;
//! - the exporter's two spins, in the same run (`v3 sub` runs with both, the default): `loop spin
//!   only` (`Exporter::set_wait_spin(0)`: `wait_released` parks at once), `wait spin only`
//!   (`Exporter::set_spin(0)`: the serving thread sleeps as soon as the rings are empty, so every
//!   release that finds it asleep rings its doorbell) and `no spin` (both 0), each `v3 sub` otherwise;
//! - `v3 sub x8` (sustained only): `v3 sub` with the producer sharing 8 buffers per
//!   `Exporter::share_many` and the consumer taking them with `Importer::recv_many`.
//!
//! - Round trip, one consumer: the producer makes a buffer, shares it, and waits until the
//!   consumer has received it (waiting on the producer's event) and released it.
//!   Baseline: device-to-host copy, the bytes over the socket, host-to-device copy in the
//!   consumer, one byte back.
//! - Sustained, several consumers: one producer thread per consumer keeps 4 buffers in flight,
//!   each freshly made and filled on the GPU (the baseline fills and copies it out); buffers
//!   per second over all consumers. For 64 KiB it also prints the system calls and wake-ups per
//!   buffer of `v2 sub`, `v3 sub` and each setting of the spins (`mempool_ipc::trace::counters`, added up
//!   over the producer and the consumers).
//!
//! A diagnosis comes with it (skipped with `--no-trace`): a 4 KiB `v3 sub` round trip before the
//! tables, then after them, for `v3 sub` (the rings), `v2 sub` (the socket) and `v3 sub host`, the
//! 4 KiB and 64 KiB round trips and the sustained 64 KiB run again, untraced and with
//! `mempool_ipc::trace` recording in the producer and the consumers. Each step of a buffer's way
//! (producer share, ring push or socket write, the consumer's spin, sleep on the doorbell and wake,
//! its event wait, view and release, the release's push into the ring and any `RingBell`, the
//! exporter's loop waking or its spin finding the release, the lease released, `wait_released`
//! woken) is printed with its median, 90th percentile and count, joined across the processes by
//! buffer id (steps fewer than a tenth of the buffers took are left out; step tables for the rings'
//! runs and the socket's sustained run only, summaries for the rest); also how often a ready or
//! release event was still pending on the GPU, how often the producer's stream was still busy when
//! the release arrived, the round trip when the producer synchronizes its stream each time, and the
//! system calls per buffer of the sustained run. The third set of consumers waits on the host for
//! pending ready events (`ImporterOptions::wait_ready_on_host`) and for its own work before each
//! release (`ImporterOptions::release_on_host`), so that no stream waits for another process's event.
//!
//! Run on a GPU: `cargo run --release -p mempool-bench --bin ipc_handoff -- [consumers]
//! [--no-trace] [--sub-first]` (default 4 consumers; `--sub-first` measures each row's sub columns
//! before its alloc columns). The producer re-executes this program for each consumer (a
//! version-1, a version-2 and a version-3 set, and the diagnosis' set). It prints the device, the
//! host CPU, whether CUDA MPS is in use (`CUDA_MPS_PIPE_DIRECTORY`; `scripts/ipc-mps-bench.sh`
//! runs it with and without), every baseline and the ratios the targets of issue 25 name.
//! Without a GPU it says why and exits with status 2.
//!
//! One of mempool-bench's workloads, as its own binary rather than a `mempool-bench` subcommand: it
//! runs several processes (the producer re-executes itself as each consumer) and prints its own
//! tables, not a report of resources side by side.
//!
//! The modules, each over those before it: `error` (the result type) and `stats` (medians, sizes);
//! `control` (the producer's control messages to a consumer, beside the IPC connection); `pinned`
//! (pinned host memory, the baseline's); `cli` (the command line); `consumer` (a consumer process);
//! `producer` (the producer's consumers, how it makes buffers, the exporter's spins); `measure` (one
//! round trip or sustained run, through mempool-ipc or the host); `diagnosis` (the traced runs and
//! their step tables); `tables` (the producer's run: the tables, the targets, the diagnosis).

#![deny(unsafe_code)]

mod cli;
mod consumer;
mod control;
mod diagnosis;
mod error;
mod measure;
mod pinned;
mod producer;
mod stats;
mod tables;

use std::process::ExitCode;

use crate::cli::{parse_args, Role};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = match parse_args(&args) {
        Ok(role) => role,
        Err(e) => {
            eprintln!("ipc_handoff: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(missing) = mempool_core::require_gpus(1) {
        return missing.exit("ipc_handoff");
    }
    let result = match role {
        Role::Consumer {
            socket,
            v1,
            socket_only,
            host_ready,
        } => consumer::run(&socket, v1, socket_only, host_ready),
        Role::Producer {
            consumers,
            diagnose,
            sub_first,
        } => tables::run(consumers, diagnose, sub_first),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc_handoff: {e}");
            ExitCode::FAILURE
        }
    }
}
