//! The socket file and who may connect to it.

use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use super::{Listener, ListenerOptions};
use crate::cred::AccessPolicy;
use crate::error::{Error, Result};
use crate::testing::TempDir;

fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn mode_of(path: &std::path::Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

/// The directory holds exactly these names: no private directory or socket left behind.
fn assert_dir_holds(dir: &TempDir, names: &[&str]) {
    let mut found: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, names);
}

#[test]
fn socket_file_is_created_0600() {
    let dir = TempDir::new("perm");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(mode_of(&path), 0o600);
    assert_eq!(listener.path(), path);
    assert_dir_holds(&dir, &["pool.sock"]);
    drop(listener);
    assert_dir_holds(&dir, &[]);
}

#[test]
fn socket_mode_can_be_widened_explicitly() {
    let dir = TempDir::new("mode");
    let path = dir.join("group.sock");
    let options = ListenerOptions {
        mode: 0o660,
        ..ListenerOptions::default()
    };
    let _listener = Listener::bind_with(&path, options).unwrap();
    assert_eq!(mode_of(&path), 0o660);

    let bad = ListenerOptions {
        mode: 0o4600,
        ..ListenerOptions::default()
    };
    assert!(matches!(
        Listener::bind_with(dir.join("setuid.sock"), bad).unwrap_err(),
        Error::SocketPath { .. }
    ));
}

#[test]
fn accepts_a_peer_of_the_same_user() {
    let dir = TempDir::new("accept");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let mut client = UnixStream::connect(&path).unwrap();
    let (mut server, peer) = listener.accept().unwrap();
    assert_eq!(peer.uid, own_uid());
    client.write_all(b"hi").unwrap();
    let mut got = [0u8; 2];
    server.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hi");
}

#[test]
fn rejects_a_peer_outside_the_allow_list_and_hands_it_back() {
    let dir = TempDir::new("reject");
    let path = dir.join("pool.sock");
    let options = ListenerOptions {
        policy: AccessPolicy::allow_uids([own_uid().wrapping_add(1)]),
        ..ListenerOptions::default()
    };
    let listener = Listener::bind_with(&path, options).unwrap();
    let mut client = UnixStream::connect(&path).unwrap();
    let refused = listener.accept().unwrap_err();
    let err = refused.error;
    assert!(
        matches!(err, Error::PeerCredentials { uid, .. } if uid == own_uid()),
        "{err}"
    );
    // The caller gets the connection to tell the peer why in its protocol; dropping it closes it.
    drop(refused.stream.expect("the refused peer's connection"));
    let mut rest = Vec::new();
    assert_eq!(client.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn accept_timeout() {
    let dir = TempDir::new("accept-timeout");
    let listener = Listener::bind(dir.join("s")).unwrap();
    let err = listener.accept_timeout(Duration::from_millis(20)).unwrap_err().error;
    assert!(matches!(err, Error::Timeout { during: "accept" }), "{err}");
    let _client = UnixStream::connect(listener.path()).unwrap();
    assert!(listener.accept_timeout(Duration::from_millis(200)).is_ok());
}

#[test]
fn stale_socket_is_replaced() {
    let dir = TempDir::new("stale");
    let path = dir.join("pool.sock");
    // A socket file whose listener is gone: what a crashed exporter leaves behind.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let listener = Listener::bind(&path).unwrap();
    assert_eq!(mode_of(&path), 0o600);
    let _client = UnixStream::connect(&path).unwrap();
    assert!(listener.accept().is_ok());
}

#[test]
fn stale_socket_is_kept_if_asked() {
    let dir = TempDir::new("stale-keep");
    let path = dir.join("pool.sock");
    drop(UnixListener::bind(&path).unwrap());
    let options = ListenerOptions {
        replace_stale: false,
        ..ListenerOptions::default()
    };
    assert!(matches!(
        Listener::bind_with(&path, options).unwrap_err(),
        Error::SocketPath { .. }
    ));
    assert!(path.exists());
}

#[test]
fn live_socket_is_not_stolen() {
    let dir = TempDir::new("live");
    let path = dir.join("pool.sock");
    let first = Listener::bind(&path).unwrap();
    let err = Listener::bind(&path).unwrap_err();
    assert!(
        matches!(&err, Error::SocketPath { reason, .. } if reason.contains("listening")),
        "{err}"
    );
    // The first listener still owns the path.
    let _client = UnixStream::connect(&path).unwrap();
    assert!(first.accept().is_ok());
    assert_dir_holds(&dir, &["pool.sock"]);
}

#[test]
fn other_files_are_never_removed() {
    let dir = TempDir::new("regular");
    let path = dir.join("important.txt");
    std::fs::write(&path, b"precious").unwrap();
    let err = Listener::bind(&path).unwrap_err();
    assert!(
        matches!(&err, Error::SocketPath { reason, .. } if reason.contains("not a socket")),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    assert_dir_holds(&dir, &["important.txt"]);
}

#[test]
fn drop_leaves_a_replacement_alone() {
    let dir = TempDir::new("replaced");
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    // Someone else took the path over after us.
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"theirs").unwrap();
    drop(listener);
    assert_eq!(std::fs::read(&path).unwrap(), b"theirs");
}

#[test]
fn missing_directory_is_an_error() {
    let dir = TempDir::new("missing");
    let err = Listener::bind(dir.join("no/such/dir/pool.sock")).unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err}");
}

/// The module documentation's example (a doctest until the module became private): the socket file
/// is 0600 while bound and gone after the drop.
#[test]
fn bind_then_drop() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("mempool-ipc-doc-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path)?;
    assert_eq!(std::fs::metadata(&path)?.permissions().mode() & 0o777, 0o600);
    drop(listener);
    assert!(!path.exists());
    std::fs::remove_dir(&dir)?;
    Ok(())
}
