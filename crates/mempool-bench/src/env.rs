//! What every report names: the device, the driver, the date, the command line.

use mempool_core::Device;
use serde::Serialize;

use crate::units::human_bytes;

/// The machine and the invocation a report was measured with.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Environment {
    /// The device's name (`none (host simulation)` without a GPU).
    pub device: String,
    /// Its UUID.
    pub device_uuid: String,
    /// Compute capability, `major.minor`.
    pub compute_capability: String,
    /// Total device memory.
    pub device_memory: String,
    /// Devices the driver sees (0: a host simulation, no GPU used).
    pub device_count: usize,
    /// The driver's CUDA version (`cuDriverGetVersion`).
    pub driver: String,
    /// The host CPU (its model name, and the CPUs this process may use): what a host simulation
    /// measures, and what the suballocators' cost depends on over a GPU.
    pub host_cpu: String,
    /// UTC, `YYYY-MM-DD HH:MM:SS UTC`.
    pub date: String,
    /// The command line, shell-quoted.
    pub command: String,
    /// This harness's version.
    pub mempool_version: String,
}

impl Environment {
    /// Describes `device` (or no device), now, for the current command line.
    pub(crate) fn detect(device: Option<&Device>) -> Environment {
        let command = shell_join(std::env::args());
        let mut env = Environment {
            device: "none (host simulation)".into(),
            device_uuid: "-".into(),
            compute_capability: "-".into(),
            device_memory: "-".into(),
            device_count: 0,
            driver: "-".into(),
            host_cpu: host_cpu(),
            date: utc_now(),
            command,
            mempool_version: env!("CARGO_PKG_VERSION").into(),
        };
        if let Some(d) = device {
            env.device = d.name().unwrap_or_else(|e| format!("? ({e})"));
            env.device_uuid = d.uuid().map(|u| u.to_string()).unwrap_or_else(|_| "?".into());
            env.compute_capability = d
                .compute_capability()
                .map(|(a, b)| format!("{a}.{b}"))
                .unwrap_or_else(|_| "?".into());
            env.device_memory = d
                .total_memory()
                .map(|b| human_bytes(b as u64))
                .unwrap_or_else(|_| "?".into());
            env.device_count = Device::count().unwrap_or(1); // at least the one in hand
            env.driver = mempool_core::driver_version()
                .map(|v| v.to_string())
                .unwrap_or_else(|e| format!("? ({e})"));
        }
        env
    }

    /// Whether a GPU was used (not a host simulation).
    fn has_device(&self) -> bool {
        self.device_count > 0
    }

    /// One line: `device: NAME (UUID), compute X.Y, N GiB; driver V; host CPU; DATE`, or for a host
    /// simulation `device: none (host simulation); host CPU; DATE`.
    pub(crate) fn summary(&self) -> String {
        if self.has_device() {
            format!(
                "device: {} ({}), compute {}, {}; driver {}; host {}; {}",
                self.device,
                self.device_uuid,
                self.compute_capability,
                self.device_memory,
                self.driver,
                self.host_cpu,
                self.date
            )
        } else {
            format!("device: none (host simulation); host {}; {}", self.host_cpu, self.date)
        }
    }

    /// The chart's subtitle: `NAME, driver V, DATE`, or `host simulation on CPU, DATE`.
    pub(crate) fn subtitle(&self) -> String {
        if self.has_device() {
            format!("{}, driver {}, {}", self.device, self.driver, self.date)
        } else {
            format!("host simulation on {}, {}", self.host_cpu, self.date)
        }
    }
}

/// The host CPU: `/proc/cpuinfo`'s model name (the architecture where there is none) and how many CPUs
/// this process may use.
fn host_cpu() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
    match std::thread::available_parallelism() {
        Ok(n) => format!("{model}, {n} CPUs"),
        Err(_) => model,
    }
}

/// Now, as `YYYY-MM-DD HH:MM:SS UTC`.
pub(crate) fn utc_now() -> String {
    format_utc(jiff::Timestamp::now())
}

/// A moment as `YYYY-MM-DD HH:MM:SS UTC`.
pub(crate) fn format_utc(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// Joins arguments into a command a POSIX shell reads back the same (single quotes where needed).
pub(crate) fn shell_join(args: impl IntoIterator<Item = String>) -> String {
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            // The program: its file name, as a user would type it.
            let a = if i == 0 {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
                    .unwrap_or(a)
            } else {
                a
            };
            let plain = !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "_-./=:,@%+".contains(c));
            if plain {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_commands() {
        let at = |secs| format_utc(jiff::Timestamp::from_second(secs).unwrap());
        assert_eq!(at(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(at(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(at(1_700_000_000), "2023-11-14 22:13:20 UTC");
        assert!(utc_now().ends_with(" UTC") && utc_now().len() == "2026-11-23 06:29:25 UTC".len());
        let cmd =
            shell_join(["/x/y/mempool-bench", "query", "-r", "pool(async,initial=1GiB)", "it's"].map(String::from));
        assert_eq!(cmd, r"mempool-bench query -r 'pool(async,initial=1GiB)' 'it'\''s'");
    }
}
