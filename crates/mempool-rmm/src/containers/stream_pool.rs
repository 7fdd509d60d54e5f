//! [`StreamPool`]: a fixed set of streams handed out round-robin, RMM's `cuda_stream_pool`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mempool_core::{Context, Stream, StreamFlags};

use crate::error::{Error, Result};

/// A fixed set of streams handed out round-robin, so independent work spreads over streams without
/// creating one per task.
#[derive(Debug)]
pub struct StreamPool {
    streams: Vec<Stream>,
    next: AtomicUsize,
}

impl StreamPool {
    /// `n` non-blocking streams in `ctx`.
    pub fn new(ctx: &Arc<Context>, n: usize) -> Result<StreamPool> {
        if n == 0 {
            return Err(Error::Unsupported {
                resource: "StreamPool",
                reason: "a stream pool needs at least one stream".into(),
            });
        }
        let streams = (0..n)
            .map(|_| Stream::with_flags(ctx, StreamFlags::NON_BLOCKING))
            .collect::<mempool_core::Result<_>>()?;
        Ok(StreamPool {
            streams,
            next: AtomicUsize::new(0),
        })
    }

    /// The next stream, round-robin.
    pub fn get(&self) -> &Stream {
        &self.streams[self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len()]
    }

    /// Stream `i % len`.
    pub fn get_by_index(&self, i: usize) -> &Stream {
        &self.streams[i % self.streams.len()]
    }

    /// The number of streams.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Always false: a pool has at least one stream.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Waits for every stream.
    pub fn synchronize(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }
}
