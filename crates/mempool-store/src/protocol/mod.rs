//! The memory store's wire protocol: its messages (`messages`) and their bytes (`codec`), pure
//! functions over bytes, tested without sockets (`tests`). The framing is its own (magic `MPMS`,
//! versions 2 and 3: `messages` says what each carries), on its own socket: nothing of the
//! exporter's protocol is shared.

pub(crate) mod codec;
pub(crate) mod messages;
#[cfg(test)]
mod tests;
