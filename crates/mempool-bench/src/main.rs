//! `mempool-bench`: see the crate's library documentation.

fn main() {}
