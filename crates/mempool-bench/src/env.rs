//! What every report names: the device, the driver, the date, the command line.

use std::time::{SystemTime, UNIX_EPOCH};

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
    /// Devices the driver sees.
    pub device_count: usize,
    /// The driver's CUDA version (`cuDriverGetVersion`).
    pub driver: String,
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
            env.device_count = Device::count().unwrap_or(0);
            env.driver = mempool_core::driver_version()
                .map(|v| v.to_string())
                .unwrap_or_else(|e| format!("? ({e})"));
        }
        env
    }

    /// One line: `device: NAME (UUID), compute X.Y, N GiB; driver V; DATE`.
    pub(crate) fn summary(&self) -> String {
        format!(
            "device: {} ({}), compute {}, {}; driver {}; {}",
            self.device, self.device_uuid, self.compute_capability, self.device_memory, self.driver, self.date
        )
    }
}

/// Now, as `YYYY-MM-DD HH:MM:SS UTC`.
pub(crate) fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(secs)
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM:SS UTC` (proleptic Gregorian calendar).
pub(crate) fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(format_utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
        let cmd =
            shell_join(["/x/y/mempool-bench", "query", "-r", "pool(async,initial=1GiB)", "it's"].map(String::from));
        assert_eq!(cmd, r"mempool-bench query -r 'pool(async,initial=1GiB)' 'it'\''s'");
    }
}
