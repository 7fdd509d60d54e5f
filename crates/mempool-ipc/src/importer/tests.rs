//! The importer's failure paths that need no GPU: an exporter whose GPU this process cannot use
//! (no driver here, or no GPU with that UUID) gets a clear error on both sides, and no descriptor
//! leaks.

use std::os::fd::AsFd;

use super::{Importer, ImporterOptions};
use crate::error::Error;
use crate::listener::Listener;
use crate::session::{ExporterSession, PoolAnnouncement};
use crate::test_util::{memfd_with, open_fds_named, unique_name};
use crate::wire::{DeviceUuid, ErrorCode, PoolId};

#[test]
fn an_importer_that_cannot_use_the_exporters_gpu_fails_clearly_on_both_sides() {
    let dir = std::env::temp_dir().join(unique_name("importer"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let fd_name = unique_name("pool");
    let exporter = std::thread::spawn(move || {
        let pool_fd = memfd_with(&fd_name, b"pool");
        let (conn, _) = listener.accept().unwrap();
        // A GPU no machine has: all 0xee.
        let announcement = PoolAnnouncement {
            device_uuid: DeviceUuid([0xee; 16]),
            pool_id: PoolId::generate(),
        };
        let result = ExporterSession::handshake(conn, announcement, pool_fd.as_fd());
        (result.map(|_| ()), fd_name)
    });

    let err = Importer::connect(&path, ImporterOptions::default()).unwrap_err();
    // Without a driver the device lookup fails first; with one, the UUID is not among the GPUs.
    match &err {
        Error::Core(mempool_core::Error::DriverNotFound) => {}
        Error::DeviceNotVisible { uuid } => assert_eq!(*uuid, DeviceUuid([0xee; 16])),
        other => panic!("unexpected error: {other:?}"),
    }
    assert!(!err.to_string().is_empty());

    let (exporter_result, fd_name) = exporter.join().unwrap();
    match exporter_result.unwrap_err() {
        Error::Remote { code, text } => {
            assert!(matches!(code, ErrorCode::WrongDevice | ErrorCode::Internal), "{code:?}");
            assert!(!text.is_empty());
        }
        other => panic!("the exporter should hear the importer's error, got {other:?}"),
    }
    assert_eq!(open_fds_named(&fd_name), 0, "no pool descriptor leaked");
    std::fs::remove_dir_all(&dir).unwrap();
}
