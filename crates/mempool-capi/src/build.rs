//! Resources the C ABI and the Python package build the same way (RMM's constructors, with RMM's argument
//! rules), so that both refuse the same arguments with the same message.

use std::sync::Arc;

use mempool_core::Device;
use mempool_rmm::adaptors::AddedBinsAdaptor;
use mempool_rmm::suballoc::BinningOptions;
use mempool_rmm::{BinningResource, SharedResource};

use crate::error::{Error, Result};

/// RMM's `binning_memory_resource(upstream, min_size_exponent, max_size_exponent)` on `device`: power-of-two
/// bins of fixed-size blocks, `2^min_size_exponent` to `2^max_size_exponent` bytes (exponents under 8 give
/// the one 256-byte bin, as RMM rounds bin sizes up to 256), larger requests to `upstream`; bins of other
/// sizes can be added in front ([`AddedBinsAdaptor::add_bin`]). `0 <= min <= max <= 40`, else
/// [`Error::InvalidArgument`] naming the exponents.
pub fn rmm_binning(
    upstream: SharedResource,
    device: &Device,
    min_size_exponent: i32,
    max_size_exponent: i32,
) -> Result<AddedBinsAdaptor<SharedResource>> {
    if min_size_exponent < 0 || min_size_exponent > max_size_exponent || max_size_exponent > 40 {
        return Err(Error::InvalidArgument(format!(
            "bin exponents {min_size_exponent}..={max_size_exponent}: need 0 <= min <= max <= 40"
        )));
    }
    let options = BinningOptions {
        min_size_exponent: min_size_exponent.max(8) as u32,
        max_size_exponent: max_size_exponent.max(8) as u32,
        blocks_per_chunk: 128,
        ..BinningOptions::default()
    };
    let bins: SharedResource = Arc::new(BinningResource::new(upstream, device, options)?);
    Ok(AddedBinsAdaptor::over_binning(bins, &options))
}
