//! Resource specs: the strings that name what a run compares, e.g. `cuda`, `async(threshold=max)`,
//! `pool(async,initial=1GiB)`, `binning(pool(async))`, `arena(cuda)`.
//!
//! Parsing and checking need no GPU ([`parse`], [`parse_list`]); [`build`] turns a checked spec into a
//! [`SharedResource`](mempool_rmm::SharedResource) on a device. A spec composes: a suballocator's first
//! argument is its upstream, itself a spec. Errors point at the offending character and list everything
//! that is accepted ([`ACCEPTED`]).
//!
//! The module is split in two below it, with the crate's [`Error`](crate::Error) between them (it wraps a
//! [`SpecError`], and [`build`] returns it): `lang`, the language (parsing, checking, printing), and
//! `resource`, the building. This module only re-exports them.

pub(crate) mod lang;
pub(crate) mod resource;

pub use lang::{parse, parse_list, AsyncSpec, ResourceSpec, SpecError, ACCEPTED};
pub use resource::{build, Built};
