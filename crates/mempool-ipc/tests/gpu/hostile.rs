//! A hostile exporter, written by hand: what the importer checks before it trusts a peer's word.

use std::io::{IoSlice, Read};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;

use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use crate::harness::*;

/// The message type in a frame header.
fn message_type(header: &[u8]) -> u16 {
    u16::from_le_bytes([header[6], header[7]])
}

/// An exporter that names a real allocation of its pool but claims a block twice its size (and a
/// buffer that is all of it): the importer imports the pointer, finds the allocation smaller than
/// the claim (`cuMemGetAddressRange`), frees the import, refuses the buffer with an error naming
/// both sizes and tells the exporter with a `Release`. Without that check the importer would hand
/// out a buffer reaching past the allocation it imported.
#[test]
fn a_block_larger_than_the_allocation_its_pointer_names_is_refused_by_the_importer() {
    let test = this_test!();
    if role().is_some() {
        let options = ImporterOptions {
            fast_release: false,
            accept_vmm: false,
            ..ImporterOptions::default()
        };
        let importer = Importer::connect(child_socket(), options).expect("connect to the hand-written exporter");
        let stream = Stream::new(&importer.device().context().unwrap()).unwrap();
        let err = importer
            .recv_timeout(stream.as_ref(), WAIT)
            .expect_err("a block larger than its allocation is refused");
        let text = err.to_string();
        println!("importer: {text}");
        let claimed = hear_claim();
        assert!(
            text.contains(&format!("claims {claimed} bytes")) && text.contains("the allocation the driver imported"),
            "{text}"
        );
        assert_eq!((importer.held(), importer.imported_blocks()), (0, 0));
        drop(importer);
        no_drop_errors("importer");
        tell_parent("REFUSED");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let pool = exportable_pool(&dev);
    let stream = Stream::new(&ctx).unwrap();
    let ptr = pool.allocate(MIB, stream.as_ref()).unwrap();
    stream.synchronize().unwrap();
    // The pool is exported before its pointer, as the exporter does (and core's IPC test): on a pool not
    // yet exported, `cuMemPoolExportPointer` failed with CUDA_ERROR_INVALID_VALUE (docs/measurements.md,
    // "Which machines ran which tests").
    // The range the driver reports may be more than the allocation (the pool's mapped chunk), so the claim
    // is twice that range, which no import of `ptr` can hold.
    let pool_fd = pool.export_fd().unwrap();
    let (_base, size) = memory::address_range(&ctx, ptr).unwrap();
    let pointer = pool.export_pointer(ptr).unwrap();
    let sock = socket_path("hostile-block");
    let listener = UnixListener::bind(&sock).unwrap();
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();

    let mut hello = [0u8; 12];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(message_type(&hello), 1, "expected Hello: {hello:?}");
    let pool_id = [0xab; 16];
    s.write_all(&frame(2, &[dev.uuid().unwrap().0, pool_id].concat()))
        .unwrap();
    let mut ready = [0u8; 12 + 16];
    s.read_exact(&mut ready).unwrap();
    assert_eq!(message_type(&ready), 3, "expected Ready: {ready:?}");
    // PoolDescriptor, with the pool's descriptor attached.
    let body = [&pool_id[..], &1u32.to_le_bytes(), &0u32.to_le_bytes()].concat();
    let bytes = frame(4, &body);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [pool_fd.as_fd()];
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    let sent = sendmsg(&s, &[IoSlice::new(&bytes)], &mut control, SendFlags::NOSIGNAL).unwrap();
    assert_eq!(sent, bytes.len());
    // Buffer #1 in block #1: the block (and the buffer) claims twice the allocation.
    let claimed = 2 * size as u64;
    let mut body = Vec::new();
    for field in [1u64, 1, claimed, 0, claimed] {
        body.extend_from_slice(&field.to_le_bytes());
    }
    body.extend_from_slice(&0u32.to_le_bytes()); // flags: no ready event (synchronized above)
    body.extend_from_slice(&0u32.to_le_bytes()); // reserved
    body.extend_from_slice(&pointer.0);
    body.extend_from_slice(&[0; 64]);
    s.write_all(&frame(5, &body)).unwrap();
    child.say(&claimed.to_string());
    // The importer does not hold it and says so.
    let mut release = [0u8; 12 + 8];
    s.read_exact(&mut release).unwrap();
    assert_eq!(message_type(&release), 6, "expected Release: {release:?}");
    assert_eq!(u64::from_le_bytes(release[12..20].try_into().unwrap()), 1);
    child.expect("REFUSED");
    child.succeeds();
    drop((s, listener));
    let _ = std::fs::remove_file(&sock);
    // SAFETY: `ptr` came from `pool.allocate` on `stream` and is freed once; the importer freed its
    // import of it (it refused the block) and its process is gone.
    unsafe { pool.free_async(ptr, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    no_drop_errors("exporter");
}

/// In the child: the block size the parent claimed, read from stdin.
fn hear_claim() -> u64 {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    line.trim_end().parse().expect("the claimed block size")
}
