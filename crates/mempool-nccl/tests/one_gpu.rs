//! One GPU (runs on the H100): NCCL loads, a communicator of one rank is made, and an all-reduce over
//! mempool memory is a copy. `cargo test -p mempool-nccl --features gpu --test one_gpu`.
#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;

use mempool_core::{Device, Stream};
use mempool_nccl::{group, Comm, Error, ReduceOp};
use mempool_rmm::{AsyncResource, SharedResource, VmmOptions, VmmResource};

#[test]
fn one_rank_all_reduce_copies_and_arguments_are_checked() {
    common::setup();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let comms = Comm::init_all(&[dev]).unwrap();
    let comm = &comms[0];
    println!("{comm:?}");
    assert_eq!((comm.rank(), comm.nranks(), comm.device()), (0, 1, dev));
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let n = 1 << 20;
    for (name, mr) in [
        (
            "VmmResource",
            Arc::new(VmmResource::new(&dev, VmmOptions::default()).unwrap()) as SharedResource,
        ),
        (
            "AsyncResource",
            Arc::new(AsyncResource::default_pool(&dev).unwrap()) as SharedResource,
        ),
    ] {
        let want = common::pattern(0, n);
        let send = common::buffer(&want, &stream, mr.clone());
        let recv = common::buffer(&vec![0; n], &stream, mr.clone());
        comm.all_reduce::<i32>(&send, &recv, ReduceOp::Sum, stream.as_ref())
            .unwrap();
        common::check(
            &format!("{name}: one-rank all-reduce"),
            &common::from_bytes(&recv.to_host().unwrap()),
            &want,
        );
        comm.all_reduce_in_place::<i32>(&recv, ReduceOp::Max, stream.as_ref())
            .unwrap();
        common::check(
            &format!("{name}: in place"),
            &common::from_bytes(&recv.to_host().unwrap()),
            &want,
        );

        // Checked before NCCL: counts, element size, stream.
        let short = common::buffer(&vec![0; n - 1], &stream, mr.clone());
        let e = comm
            .all_reduce::<i32>(&send, &short, ReduceOp::Sum, stream.as_ref())
            .unwrap_err();
        assert!(e.to_string().contains("must be equal"), "{e}");
        let e = comm
            .all_reduce::<i64>(&short, &short, ReduceOp::Sum, stream.as_ref())
            .unwrap_err();
        assert!(e.to_string().contains("whole number of 8-byte"), "{e}");
        let other = Stream::new(&dev.context().unwrap()).unwrap();
        let e = comm
            .all_reduce::<i32>(&send, &recv, ReduceOp::Sum, other.as_ref())
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("buffer's stream"),
            "{e}"
        );
        let e = comm.broadcast::<i32>(&send, &recv, 1, stream.as_ref()).unwrap_err();
        assert!(e.to_string().contains("root 1"), "{e}");
    }
    drop(comms);
}

/// A group ends whatever its closure does: after an error and after a panic the communicator's own
/// methods run again (no group is left open); inside a group registering, the communicator's own
/// collectives and a nested group are refused, and a registration dropped there is deregistered when the
/// group ends (a failure would be `group`'s error).
#[test]
fn one_rank_group_ends_after_errors_and_panics_and_defers_deregistration() {
    common::setup();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let comms = Comm::init_all(&[dev]).unwrap();
    let comm = &comms[0];
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    let mr: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default()).unwrap());
    let n = 1 << 20;
    let want = common::pattern(0, n);
    let buf = common::buffer(&want, &stream, mr.clone());
    // SAFETY: one rank: it registers the buffer it passes to every collective below; `reg` is
    // dropped (in the last group) before the buffer.
    let reg = unsafe { comm.register(&buf) }.unwrap();

    let e = group(|g| {
        g.all_reduce_in_place::<i32>(comm, &buf, ReduceOp::Sum, stream.as_ref())?;
        g.broadcast_in_place::<i32>(comm, &buf, 1, stream.as_ref())
    })
    .unwrap_err();
    assert!(e.to_string().contains("root 1"), "the closure's error is returned: {e}");
    comm.all_reduce_in_place::<i32>(&buf, ReduceOp::Sum, stream.as_ref())
        .expect("the group ended after the closure's error");

    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        group(|g| -> mempool_nccl::Result<()> {
            g.all_reduce_in_place::<i32>(comm, &buf, ReduceOp::Sum, stream.as_ref())?;
            panic!("a panic inside the group (expected by the test)")
        })
    }));
    assert!(caught.is_err(), "the panic goes on after the group ended");
    comm.all_reduce_in_place::<i32>(&buf, ReduceOp::Sum, stream.as_ref())
        .expect("the group ended after the panic");

    group(|g| {
        g.all_reduce_in_place::<i32>(comm, &buf, ReduceOp::Max, stream.as_ref())?;
        // SAFETY: refused before NCCL is called, so nothing is registered.
        let e = unsafe { comm.register(&buf) }.unwrap_err();
        assert!(e.to_string().contains("group is open"), "{e}");
        let e = comm
            .all_reduce_in_place::<i32>(&buf, ReduceOp::Sum, stream.as_ref())
            .unwrap_err();
        assert!(e.to_string().contains("group is open"), "{e}");
        let e = group(|_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("already open"), "{e}");
        drop(reg); // deregistered after ncclGroupEnd, before `group` returns
        Ok(())
    })
    .unwrap();
    stream.synchronize().unwrap();
    common::check(
        "one-rank collectives through groups",
        &common::from_bytes(&buf.to_host().unwrap()),
        &want,
    );
    drop(buf);
    drop(comms);
}
