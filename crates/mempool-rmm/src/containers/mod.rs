//! Containers that allocate through a [`crate::MemoryResource`]: an untyped buffer, a typed vector, a
//! scalar, and a round-robin pool of streams. Each is ordered on a stream: it allocates and frees there,
//! and its copies run there. With the `cudarc` feature, `CudarcBuffer` is typed memory from a resource
//! that cudarc's copies, launches and collectives take.

mod buffer;
#[cfg(feature = "cudarc")]
mod cudarc_buffer;
mod stream_pool;
mod vec;

pub use buffer::DeviceBuffer;
#[cfg(feature = "cudarc")]
pub use cudarc_buffer::{CudarcBuffer, CudarcView, CudarcViewMut};
pub use stream_pool::StreamPool;
pub use vec::{DeviceScalar, DeviceVec};
