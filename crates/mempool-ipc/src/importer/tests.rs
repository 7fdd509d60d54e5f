//! The importer's failure paths that need no GPU: an exporter whose GPU this process cannot use
//! (no driver here, or no GPU with that UUID) gets a clear error on both sides, and no descriptor
//! leaks.

use std::os::fd::AsFd;

use mempool_core::DeviceAddr;

use super::{check_block_in_allocation, Importer, ImporterOptions};
use crate::error::Error;
use crate::protocol::testing::buffer;
use crate::protocol::{BufferDescriptor, DeviceUuid, ErrorCode, PoolId, ProtocolError};
use crate::session::{ExporterSession, PoolAnnouncement};
use crate::test_util::{memfd_with, open_fds_named, unique_name};
use mempool_socket::listener::Listener;

/// A hostile exporter's block size: larger than the allocation the driver imported, or a pointer
/// outside it. Refused, naming the sizes, before any view of the block exists.
#[test]
fn a_block_larger_than_the_imported_allocation_is_refused() {
    const MIB: u64 = 1 << 20;
    let at = |a: u64| DeviceAddr(a);
    let block = |block_size| BufferDescriptor {
        block_size,
        offset: 0,
        size: block_size,
        ..buffer(5)
    };
    // Exactly the allocation, or inside it: accepted.
    assert_eq!(
        check_block_in_allocation(&block(2 * MIB), at(0x10_0000_0000), at(0x10_0000_0000), 2 << 20),
        Ok(())
    );
    assert_eq!(
        check_block_in_allocation(&block(MIB), at(0x10_0010_0000), at(0x10_0000_0000), 2 << 20),
        Ok(())
    );
    let refused = [
        // One byte more than the allocation.
        (block(2 * MIB + 1), 0x10_0000_0000, 0x10_0000_0000),
        // Inside at its start, past its end.
        (block(2 * MIB), 0x10_0010_0000, 0x10_0000_0000),
        // A pointer before the allocation the driver names.
        (block(MIB), 0x0f_ffff_f000, 0x10_0000_0000),
        // A size that overflows the address space.
        (block(u64::MAX), 0x10_0000_0000, 0x10_0000_0000),
    ];
    for (d, imported, base) in refused {
        let err = check_block_in_allocation(&d, at(imported), at(base), 2 << 20).unwrap_err();
        let ProtocolError::Violation { reason } = &err else {
            panic!("expected a protocol violation, got {err:?}");
        };
        assert!(
            reason.contains(&format!("claims {} bytes", d.block_size)) && reason.contains("holds 2097152 bytes"),
            "{reason}"
        );
    }
}

#[test]
fn an_importer_that_cannot_use_the_exporters_gpu_fails_clearly_on_both_sides() {
    let dir = std::env::temp_dir().join(unique_name("importer"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool.sock");
    let listener = Listener::bind(&path).unwrap();
    let fd_name = unique_name("pool");
    let exporter = std::thread::spawn(move || {
        let pool_fd = memfd_with(&fd_name, b"pool");
        let (conn, _) = crate::connection::accept(&listener).unwrap();
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
