//! The workloads. Each takes the specs to compare and its parameters, runs every resource over the
//! same work, and returns a [`crate::report::Report`].

pub mod allreduce;
pub mod columns;
pub mod fragmentation;
pub mod grow;
pub mod multi_stream;
pub mod peer;
pub mod query;
pub mod random;
pub mod replay;
pub mod sleep;

use mempool_core::Device;

use crate::spec::ResourceSpec;

/// What every workload is given besides its own parameters.
#[derive(Clone, Debug)]
pub struct Common {
    /// The resources to compare, in order (baselines included when asked for).
    pub specs: Vec<ResourceSpec>,
    /// The GPU, or `None` for a host-only run (the `sim` resource).
    pub device: Option<Device>,
    /// No progress bar.
    pub quiet: bool,
}

/// Puts the two raw baselines first (unless already listed) when `with` is set.
pub fn with_baselines(mut specs: Vec<ResourceSpec>, with: bool) -> Vec<ResourceSpec> {
    if with {
        for b in [ResourceSpec::RawPool, ResourceSpec::RawCuda].into_iter() {
            if !specs.contains(&b) {
                specs.insert(0, b);
            }
        }
    }
    specs
}
