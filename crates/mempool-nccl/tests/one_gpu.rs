//! One GPU (runs on the H100): NCCL loads, a communicator of one rank is made, and an all-reduce over
//! mempool memory is a copy. `cargo test -p mempool-nccl --features gpu --test one_gpu`.
#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;

use mempool_core::{Device, Stream};
use mempool_nccl::{Comm, Error, ReduceOp};
use mempool_rmm::{AsyncResource, SharedResource, VmmResource};

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
            Arc::new(VmmResource::new(dev).unwrap()) as SharedResource,
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
