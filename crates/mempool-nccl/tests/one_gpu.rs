//! One GPU: NCCL loads, a communicator of one rank is made, and an all-reduce over
//! mempool memory is a copy; a communicator attached to a `ServiceResource` has its registrations follow
//! the pool. `cargo test -p mempool-nccl --features gpu --test one_gpu`.
#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;

use mempool_core::{Device, Stream};
use mempool_nccl::{group, Attachment, Comm, Error, ReduceOp};
use mempool_rmm::{
    AsyncResource, Reclaim, ServiceOptions, ServiceResource, SharedResource, SleepMode, VmmOptions, VmmResource,
};

#[test]
fn one_rank_all_reduce_copies_and_arguments_are_checked() {
    let _serial = common::serial();
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
    let _serial = common::serial();
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

/// Checks that `att`'s registrations are exactly one per mapped physical allocation of `mr` (per tag),
/// that their bytes per tag are what the resource says it maps, and that nothing failed.
fn check_follows(what: &str, att: &Attachment, mr: &ServiceResource) {
    assert!(att.errors().is_empty(), "{what}: {:?}", att.errors());
    assert!(att.is_current(), "{what}: registrations wait: {att:?}");
    let reg = att.registered();
    assert_eq!(reg, att.mapped(), "{what}: one registration per mapped allocation");
    for t in mr.stats().tags {
        let bytes: u64 = reg.iter().filter(|r| r.tag == t.tag).map(|r| r.len as u64).sum();
        assert_eq!(
            bytes, t.mapped_bytes,
            "{what}: tag `{}`: registered bytes vs mapped bytes",
            t.name
        );
    }
    for w in reg.windows(2) {
        assert!(w[0].end() <= w[1].addr.0, "{what}: registrations overlap: {reg:?}");
    }
}

/// Whether one registration of `att` covers all of `buf`.
fn in_one_registration(att: &Attachment, buf: &mempool_core::BufferView<'_>) -> bool {
    att.registered().iter().any(|r| r.contains(buf.ptr(), buf.len()))
}

fn service(dev: &Device) -> Arc<ServiceResource> {
    ServiceResource::new(
        dev,
        ServiceOptions {
            region_size: Some(4 << 30),
            max_tags: 2,
            reclaim: Reclaim::OnOutOfMemory,
            ..ServiceOptions::default()
        },
    )
    .unwrap()
}

/// A communicator attached to a service resource: growth registers (one registration per physical
/// allocation, so a buffer that grew the pool lies in one registration), trim deregisters what it unmaps,
/// sleep deregisters and wake registers again, a growth inside a group waits for the group's end (the
/// collectives meanwhile refused), and the all-reduces over the memory are exact.
#[test]
fn one_rank_attached_registrations_follow_growth_trim_sleep_and_wake() {
    let _serial = common::serial();
    common::setup();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let comm = Comm::init_all(&[dev]).unwrap().pop().unwrap();
    let mr = service(&dev);
    let chunk = mr.chunk_size();
    let stream = Stream::new(&dev.context().unwrap()).unwrap();
    // SAFETY: one rank: every buffer it passes to a collective below comes from the attached resource.
    let att = unsafe { mempool_nccl::attach(comm, &mr) }.unwrap();
    assert!(att.registered().is_empty(), "nothing is mapped yet");
    check_follows("attached", &att, &mr);

    let shared: SharedResource = mr.clone();
    // i32s: 3 chunks exactly, so that the next buffer shares no chunk with it: the pool maps the chunks a
    // buffer needs as one physical allocation, one registration (a buffer across two allocations is not
    // in one registration, and runs unregistered).
    let n_a = 3 * chunk / 4;
    let a = common::buffer(&common::pattern(0, n_a), &stream, shared.clone());
    check_follows("first growth", &att, &mr);
    assert!(in_one_registration(&att, &a));
    let n_b = 5 * chunk / 4;
    let want_b = common::pattern(1, n_b);
    let b = common::buffer(&want_b, &stream, shared.clone()); // grows again, next to `a`'s chunks
    check_follows("second growth", &att, &mr);
    assert!(
        in_one_registration(&att, &b),
        "a buffer allocated after growth lies in one registration: {:?}, buffer at {} ({} bytes)",
        att.registered(),
        b.ptr(),
        b.len()
    );
    {
        let c = att.comm();
        c.all_reduce_in_place::<i32>(&b, ReduceOp::Sum, stream.as_ref())
            .unwrap();
        // Growth while this thread holds the communicator registers at once.
        let held = common::buffer(&common::pattern(2, chunk), &stream, shared.clone());
        check_follows("growth while the communicator is lent", &att, &mr);
        c.all_reduce_in_place::<i32>(&held, ReduceOp::Sum, stream.as_ref())
            .unwrap();
        common::check(
            "all-reduce over memory mapped while lent",
            &common::from_bytes(&held.to_host().unwrap()),
            &common::pattern(2, chunk),
        );
    }
    common::check(
        "all-reduce after growth",
        &common::from_bytes(&b.to_host().unwrap()),
        &want_b,
    );

    // Trim: `a`'s chunks go (those not shared with `b`), the registration is cut to what stays mapped.
    let mapped_before = mr.stats().mapped_bytes;
    drop(a);
    stream.synchronize().unwrap();
    let released = mr.trim().unwrap();
    assert!(released > 0, "trim released `a`'s chunks");
    assert_eq!(mr.stats().mapped_bytes, mapped_before - released);
    check_follows("trim", &att, &mr);
    assert!(in_one_registration(&att, &b), "`b` stays in one registration");
    att.comm()
        .all_reduce_in_place::<i32>(&b, ReduceOp::Max, stream.as_ref())
        .unwrap();
    common::check(
        "all-reduce after trim",
        &common::from_bytes(&b.to_host().unwrap()),
        &want_b,
    );

    // Sleep and wake a second tag: its registrations go with its memory and come back with it.
    let kv_tag = mr.tag("kv-cache").unwrap();
    let kv_mr: SharedResource = Arc::new(mr.tagged(kv_tag));
    let n_kv = 2 * chunk / 4;
    let want_kv = common::pattern(3, n_kv);
    let kv = common::buffer(&want_kv, &stream, kv_mr.clone());
    check_follows("growth of a second tag", &att, &mr);
    assert!(att.registered().iter().any(|r| r.tag == kv_tag));
    stream.synchronize().unwrap();
    mr.sleep(&[kv_tag], SleepMode::Offload, stream.as_ref()).unwrap();
    check_follows("sleep", &att, &mr);
    assert!(
        att.registered().iter().all(|r| r.tag != kv_tag),
        "a sleeping tag has no registration: {:?}",
        att.registered()
    );
    mr.wake(&[kv_tag], stream.as_ref()).unwrap();
    check_follows("wake", &att, &mr);
    assert!(in_one_registration(&att, &kv));
    att.comm()
        .all_reduce_in_place::<i32>(&kv, ReduceOp::Sum, stream.as_ref())
        .unwrap();
    common::check(
        "all-reduce after wake",
        &common::from_bytes(&kv.to_host().unwrap()),
        &want_kv,
    );

    // Growth inside a group: registration waits for the group's end; the communicator's collectives
    // are refused meanwhile (they would run over stale registrations).
    let grown = {
        let c = att.comm();
        let grown = group(|g| {
            let grown = common::buffer(&common::pattern(4, 3 * chunk), &stream, shared.clone());
            assert!(!att.is_current(), "the registration waits for the group's end");
            let e = g
                .all_reduce_in_place::<i32>(&c, &b, ReduceOp::Sum, stream.as_ref())
                .unwrap_err();
            assert!(e.to_string().contains("while a group is open"), "{e}");
            Ok(grown)
        })
        .unwrap();
        check_follows("growth inside a group, after the group", &att, &mr);
        c.all_reduce_in_place::<i32>(&grown, ReduceOp::Sum, stream.as_ref())
            .unwrap();
        grown
    };
    common::check(
        "all-reduce over memory mapped inside a group",
        &common::from_bytes(&grown.to_host().unwrap()),
        &common::pattern(4, 3 * chunk),
    );

    // Detach gives the communicator back with nothing registered; the resource keeps working.
    drop((b, kv, grown));
    stream.synchronize().unwrap();
    let comm = att.detach().unwrap();
    let again = common::buffer(&common::pattern(5, chunk), &stream, shared.clone());
    let vmm: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default()).unwrap());
    let plain = common::buffer(&common::pattern(5, chunk), &stream, vmm);
    comm.all_reduce_in_place::<i32>(&plain, ReduceOp::Sum, stream.as_ref())
        .unwrap();
    common::check(
        "the detached communicator",
        &common::from_bytes(&plain.to_host().unwrap()),
        &common::pattern(5, chunk),
    );
    drop((again, plain));
    comm.destroy().unwrap();
}

/// Either may go first: an attachment dropped before its resource deregisters everything and the
/// resource keeps allocating; a resource dropped before its attachment deregisters everything as it
/// unmaps, and the attachment then drops cleanly.
#[test]
fn one_rank_attachment_and_resource_drop_in_either_order() {
    let _serial = common::serial();
    common::setup();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let stream = Stream::new(&dev.context().unwrap()).unwrap();

    let mr = service(&dev);
    let comm = Comm::init_all(&[dev]).unwrap().pop().unwrap();
    // SAFETY: one rank: every buffer it passes to a collective comes from the attached resource.
    let att = unsafe { mempool_nccl::attach(comm, &mr) }.unwrap();
    let shared: SharedResource = mr.clone();
    let buf = common::buffer(&common::pattern(0, 1 << 20), &stream, shared.clone());
    check_follows("before the attachment goes", &att, &mr);
    assert!(!att.registered().is_empty());
    drop(att);
    let more = common::buffer(&common::pattern(1, 4 << 20), &stream, shared.clone());
    common::check(
        "after detaching",
        &common::from_bytes(&more.to_host().unwrap()),
        &common::pattern(1, 4 << 20),
    );
    drop((buf, more, shared, mr));
    assert!(mempool_core::take_drop_errors().is_empty());

    let mr = service(&dev);
    let comm = Comm::init_all(&[dev]).unwrap().pop().unwrap();
    // SAFETY: as above.
    let att = unsafe { mempool_nccl::attach(comm, &mr) }.unwrap();
    {
        let shared: SharedResource = mr.clone();
        let buf = common::buffer(&common::pattern(0, 1 << 20), &stream, shared);
        check_follows("before the resource goes", &att, &mr);
        drop(buf);
    }
    stream.synchronize().unwrap();
    drop(mr);
    assert!(att.resource().is_none(), "the attachment holds the resource weakly");
    assert!(
        att.registered().is_empty(),
        "everything was deregistered as the resource unmapped it"
    );
    assert!(att.mapped().is_empty());
    assert!(att.errors().is_empty(), "{:?}", att.errors());
    // The communicator still works (over memory of another resource).
    let vmm: SharedResource = Arc::new(VmmResource::new(&dev, VmmOptions::default()).unwrap());
    let plain = common::buffer(&common::pattern(2, 1 << 20), &stream, vmm);
    att.comm()
        .all_reduce_in_place::<i32>(&plain, ReduceOp::Sum, stream.as_ref())
        .unwrap();
    common::check(
        "after the resource went",
        &common::from_bytes(&plain.to_host().unwrap()),
        &common::pattern(2, 1 << 20),
    );
    drop(plain);
    drop(att);
}

/// A resource of another device than the communicator's is refused, naming both (checked where the
/// machine has a second GPU; with one GPU the test checks the single-device case attaches).
#[test]
fn one_rank_attach_to_another_device_is_refused() {
    let _serial = common::serial();
    common::setup();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let comm = Comm::init_all(&[dev]).unwrap().pop().unwrap();
    if Device::count().unwrap() >= 2 {
        let other = service(&Device::get(1).unwrap());
        // SAFETY: refused before anything is registered.
        let e = unsafe { mempool_nccl::attach(comm, &other) }.unwrap_err();
        assert!(e.to_string().contains("runs on"), "{e}");
    } else {
        let mr = service(&dev);
        // SAFETY: one rank; nothing is allocated, so no collective runs over the resource's memory.
        let att = unsafe { mempool_nccl::attach(comm, &mr) }.unwrap();
        assert_eq!(att.device(), dev);
        att.detach().unwrap().destroy().unwrap();
    }
}
