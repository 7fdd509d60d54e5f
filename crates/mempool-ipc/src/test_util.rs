//! The host tests' helpers (mempool-socket's `testing`), and the counting allocator their
//! allocation bounds read.

pub(crate) use mempool_socket::testing::*;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;
