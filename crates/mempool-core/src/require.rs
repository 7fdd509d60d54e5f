//! Programs that need GPUs, on a machine that has too few: one check, one message and one exit status,
//! shared by every example and tool of the workspace so that each says the same thing the same way.

use std::fmt;
use std::process::ExitCode;

use crate::types::Device;

/// The exit status of a program that cannot run because this machine lacks the GPUs it needs: 2, as for
/// a usage error (the command cannot work here as given), so that scripts tell it from 1 (it ran and
/// failed).
pub const NO_GPU_EXIT_STATUS: u8 = 2;

/// Why a program that needs GPUs cannot run on this machine: how many it needs and what the driver
/// said (no driver, no device, fewer devices than needed, no peer access between them).
///
/// Shown as `needs a GPU: REASON` (or `needs 2 GPUs: REASON`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingGpus {
    needed: usize,
    reason: String,
}

impl MissingGpus {
    /// A program needing `needed` GPUs that cannot run, for `reason` (e.g. `device 1 cannot access
    /// device 0's memory`).
    pub fn new(needed: usize, reason: impl Into<String>) -> MissingGpus {
        MissingGpus {
            needed,
            reason: reason.into(),
        }
    }

    /// The GPUs the program needs.
    pub fn needed(&self) -> usize {
        self.needed
    }

    /// Why this machine cannot provide them.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// For `main`: prints `PROGRAM: needs a GPU: REASON` on stderr and returns
    /// [`NO_GPU_EXIT_STATUS`].
    ///
    /// ```no_run
    /// use std::process::ExitCode;
    ///
    /// fn main() -> ExitCode {
    ///     let devices = match mempool_core::require_gpus(1) {
    ///         Ok(devices) => devices,
    ///         Err(missing) => return missing.exit("my_tool"),
    ///     };
    ///     println!("running on {}", devices[0]);
    ///     ExitCode::SUCCESS
    /// }
    /// ```
    pub fn exit(&self, program: &str) -> ExitCode {
        eprintln!("{program}: {self}");
        ExitCode::from(NO_GPU_EXIT_STATUS)
    }
}

impl fmt::Display for MissingGpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.needed {
            1 => write!(f, "needs a GPU: {}", self.reason),
            n => write!(f, "needs {n} GPUs: {}", self.reason),
        }
    }
}

impl std::error::Error for MissingGpus {}

/// The visible devices, in ordinal order, when there are at least `needed`; otherwise why not: the
/// driver's error when it cannot be loaded or sees no device ([`Error::DriverNotFound`],
/// [`Error::NoDevice`]), or the count found.
///
/// [`Error::DriverNotFound`]: crate::error::Error::DriverNotFound
/// [`Error::NoDevice`]: crate::error::Error::NoDevice
pub fn require_gpus(needed: usize) -> Result<Vec<Device>, MissingGpus> {
    let devices = Device::all().map_err(|e| MissingGpus::new(needed, e.to_string()))?;
    if devices.len() < needed {
        return Err(MissingGpus::new(
            needed,
            format!("the CUDA driver sees {} device(s)", devices.len()),
        ));
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_count_and_the_reason() {
        assert_eq!(
            MissingGpus::new(1, "no CUDA driver found").to_string(),
            "needs a GPU: no CUDA driver found"
        );
        let two = MissingGpus::new(2, "the CUDA driver sees 1 device(s)");
        assert_eq!(two.to_string(), "needs 2 GPUs: the CUDA driver sees 1 device(s)");
        assert_eq!((two.needed(), two.reason()), (2, "the CUDA driver sees 1 device(s)"));
    }

    #[test]
    fn without_a_driver_the_reason_is_the_drivers_error() {
        if crate::raw::library_present() {
            return; // the GPU tests cover a machine with a driver
        }
        let missing = require_gpus(1).unwrap_err();
        assert_eq!(missing.reason(), crate::error::Error::DriverNotFound.to_string());
        assert!(
            missing.to_string().starts_with("needs a GPU: no CUDA driver found"),
            "{missing}"
        );
    }
}
