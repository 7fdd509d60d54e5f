//! Containers that allocate through a [`crate::MemoryResource`]: an untyped buffer, a typed vector, a
//! scalar, and a round-robin pool of streams. Each is ordered on a stream: it allocates and frees there,
//! and its copies run there.

mod buffer;
mod stream_pool;
mod vec;

pub use buffer::DeviceBuffer;
pub use stream_pool::StreamPool;
pub use vec::{DeviceScalar, DeviceVec};
