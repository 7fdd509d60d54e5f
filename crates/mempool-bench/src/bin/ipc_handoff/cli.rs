//! The command line: the producer's (`[consumers] [--no-trace] [--sub-first]`) or a consumer's, as
//! the producer starts it. Checked before the driver is loaded.

use std::path::PathBuf;

/// What the command line asks for.
pub(crate) enum Role {
    /// `[consumers] [--no-trace] [--sub-first]`: the producer, which starts the consumers.
    Producer {
        consumers: usize,
        diagnose: bool,
        sub_first: bool,
    },
    /// `consumer SOCKET [--v1 | --v2 | --host-ready]`: one consumer, started by the producer.
    Consumer {
        socket: PathBuf,
        v1: bool,
        /// `--v2`: the fast release path over the socket (no rings).
        socket_only: bool,
        host_ready: bool,
    },
}

/// The command line, or why it cannot be run (checked before the driver is loaded).
pub(crate) fn parse_args(args: &[String]) -> Result<Role, String> {
    if args.first().map(String::as_str) == Some("consumer") {
        let socket = args.get(1).ok_or("consumer: the exporter's socket path is missing")?;
        let flag = args.get(2).map(String::as_str);
        if let Some(extra) = args.get(if flag.is_some() { 3 } else { 2 }) {
            return Err(format!("consumer: unexpected argument `{extra}`"));
        }
        return match flag {
            None | Some("--v1") | Some("--v2") | Some("--host-ready") => Ok(Role::Consumer {
                socket: PathBuf::from(socket),
                v1: flag == Some("--v1"),
                socket_only: flag == Some("--v2"),
                host_ready: flag == Some("--host-ready"),
            }),
            Some(other) => Err(format!("consumer: unknown flag `{other}` (--v1, --v2, --host-ready)")),
        };
    }
    let (mut consumers, mut diagnose, mut sub_first) = (None, true, false);
    for a in args {
        match a.as_str() {
            "--no-trace" => diagnose = false,
            "--sub-first" => sub_first = true,
            flag if flag.starts_with("--") => {
                return Err(format!(
                    "unknown flag `{flag}`: usage: ipc_handoff [consumers] [--no-trace] [--sub-first]"
                ))
            }
            n if consumers.is_none() => match n.parse::<usize>() {
                Ok(c) if c > 0 => consumers = Some(c),
                _ => return Err(format!("`{n}` is not a consumer count (a whole number, 1 or more)")),
            },
            extra => return Err(format!("unexpected argument `{extra}`: one consumer count at most")),
        }
    }
    Ok(Role::Producer {
        consumers: consumers.unwrap_or(4),
        diagnose,
        sub_first,
    })
}
