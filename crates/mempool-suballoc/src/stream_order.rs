//! How engines order one stream after another (the host simulation is `crate::sim`).

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use crate::error::Error;

/// The stream operations an engine needs to hand free blocks from one stream to another.
///
/// The shape is CUDA's: an event is created once, re-recorded on a stream whenever the engine needs
/// a fresh point in that stream's order, and waited on by other streams. For real streams these are
/// [`cuEventCreate`], [`cuEventRecord`], [`cuStreamWaitEvent`] and [`cuStreamSynchronize`].
///
/// [`cuEventCreate`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html
/// [`cuEventRecord`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html
/// [`cuStreamWaitEvent`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html
/// [`cuStreamSynchronize`]: https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html
///
/// Implementations report failures as [`Error::Stream`].
pub trait StreamOrder {
    /// A stream's identity: the engine keys its per-stream free lists by it. Two values compare equal
    /// exactly when they name the same stream.
    type Stream: Copy + Eq + Hash + Debug;
    /// An event: a point in one stream's order that other streams can wait for.
    type Event;

    /// Creates an event that has not been recorded yet (waiting on it orders nothing).
    fn create_event(&self) -> Result<Self::Event, Error>;
    /// Makes `event` stand for everything issued on `stream` so far, replacing what it stood for.
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error>;
    /// Orders all work issued on `stream` after this call after the point `event` stands for,
    /// without blocking the host.
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error>;
    /// Blocks the host until everything issued on `stream` has completed. Work issued on any stream
    /// afterwards is thereby ordered after it.
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error>;
}

impl<T: StreamOrder + ?Sized> StreamOrder for &T {
    type Stream = T::Stream;
    type Event = T::Event;
    fn create_event(&self) -> Result<Self::Event, Error> {
        (**self).create_event()
    }
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error> {
        (**self).record(event, stream)
    }
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error> {
        (**self).wait(stream, event)
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error> {
        (**self).synchronize(stream)
    }
}

impl<T: StreamOrder + ?Sized> StreamOrder for Arc<T> {
    type Stream = T::Stream;
    type Event = T::Event;
    fn create_event(&self) -> Result<Self::Event, Error> {
        (**self).create_event()
    }
    fn record(&self, event: &mut Self::Event, stream: Self::Stream) -> Result<(), Error> {
        (**self).record(event, stream)
    }
    fn wait(&self, stream: Self::Stream, event: &Self::Event) -> Result<(), Error> {
        (**self).wait(stream, event)
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), Error> {
        (**self).synchronize(stream)
    }
}
