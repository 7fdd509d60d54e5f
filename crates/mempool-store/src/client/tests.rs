//! The client against a fake server speaking the protocol over a real socket: one that never
//! stops listing is cut off at the client's bound.

use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use super::*;
use crate::protocol::messages::MAX_LIST_PAGE;
use crate::test_util::unique_name;
use crate::types::BufferState;

const WAIT: Duration = Duration::from_secs(20);
/// Pages the fake server sends before it gives up.
const PAGES: usize = 50;

fn info(name: String) -> BufferInfo {
    BufferInfo {
        name,
        size: 4096,
        device: DeviceUuid([1; 16]),
        tag: String::new(),
        state: BufferState::Published,
        owner_uid: 0,
        owner_pid: 1,
        attachments: 0,
        expires_in: None,
    }
}

/// A server at a fresh path that welcomes one client and answers `List` with full pages of
/// names that always increase and `more = true`, counting the pages, until the client goes (or,
/// so that a client without a bound fails the test instead of hanging it, until `PAGES` pages,
/// then a last empty one).
fn endless_lister(pages: Arc<AtomicUsize>) -> (std::path::PathBuf, JoinHandle<()>) {
    let path = std::env::temp_dir().join(format!("{}.sock", unique_name("endless")));
    let listener = UnixListener::bind(&path).unwrap();
    let thread = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut framed = Connection::new(stream, true, None, WAIT).unwrap();
        let (hello, _, version) = framed.recv_versioned(Some(WAIT), WAIT).unwrap();
        assert_eq!(hello, Message::Hello);
        framed.set_version(version);
        framed
            .send(
                &Message::Welcome {
                    pid: 1,
                    devices: vec![(DeviceUuid([1; 16]), 4096)],
                },
                None,
            )
            .unwrap();
        let mut next = 0u64;
        while let Ok((Message::List { .. }, _)) = framed.recv(Some(WAIT), WAIT) {
            let page = pages.fetch_add(1, Ordering::SeqCst) + 1;
            let count = if page > PAGES { 0 } else { MAX_LIST_PAGE };
            let entries = (0..count)
                .map(|_| {
                    next += 1;
                    info(format!("n{next:012}"))
                })
                .collect();
            let more = page <= PAGES;
            if framed.send(&Message::ListPage { more, entries }, None).is_err() {
                break;
            }
        }
    });
    (path, thread)
}

#[test]
fn a_server_that_never_stops_listing_is_cut_off() {
    let pages = Arc::new(AtomicUsize::new(0));
    let (path, server) = endless_lister(pages.clone());
    let client = Client::connect(&path).unwrap();
    let limit = 5 * MAX_LIST_PAGE + 1;
    match client.list_at_most(limit) {
        Err(Error::Protocol { reason }) => {
            assert!(reason.contains(&format!("more than {limit} buffers")), "{reason}")
        }
        other => panic!("expected a protocol error, got {:?}", other.map(|l| l.len())),
    }
    // Five pages fit the bound; the sixth passes it and ends the listing.
    assert_eq!(pages.load(Ordering::SeqCst), 6);
    drop(client);
    server.join().unwrap();
    let _ = std::fs::remove_file(&path);
}
