//! `mempool.ipc`: sharing device buffers between processes, over mempool-ipc.
//!
//! - [`PyExporter`] (`mempool.ipc.Exporter`) serves an exportable pool on a Unix socket and shares
//!   [`PyExportedBuffer`]s (`mempool.ipc.ExportedBuffer`) with the importers connected to it.
//! - [`PyImporter`] (`mempool.ipc.Importer`) connects to a socket path and receives
//!   [`PyImportedBuffer`]s (`mempool.ipc.ImportedBuffer`): views of the exporter's memory whose lease is
//!   released when the object and every view made from it (DLPack, CUDA array interface) are gone.
//!
//! Every blocking call (connecting, waiting for importers or buffers, shutting down, releasing a buffer)
//! runs with the GIL released. None of these objects can be pickled: what crosses to another process is
//! the socket path.

//! Files: `exporter.rs` (`Exporter`), `importer.rs` (`Importer`), `buffers.rs` (the two buffer classes,
//! whose shared surface is [`crate::view`]'s), `service.rs` (`ImportedRange`, a service resource's range
//! received from `Exporter.share_range`, and how the service resource behind a `mempool.mr` object is
//! found), `store.rs` (the memory store: `Client`, `CreatedBuffer`, `AttachedBuffer`, `BufferInfo`,
//! `MemoryStoreServer` and `serve`, over `mempool_store`), `common.rs` (argument checks shared by all of
//! them).

mod buffers;
mod common;
mod exporter;
mod importer;
mod service;
mod store;

pub(crate) use buffers::{PyExportedBuffer, PyImportedBuffer};
pub(crate) use exporter::PyExporter;
pub(crate) use importer::PyImporter;
pub(crate) use service::PyImportedRange;
pub(crate) use store::{
    serve, validate_name, PyAttachedBuffer, PyBufferInfo, PyClient, PyCreatedBuffer, PyStoreServer,
};
