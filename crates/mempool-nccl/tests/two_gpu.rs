//! Two GPUs, one process, one communicator per GPU (`ncclCommInitAll`), collectives over mempool memory:
//! registered VMM memory (`VmmResource`, and the pool engine over it), unregistered stream-ordered pool
//! memory, what NCCL says when asked to register pool and `cuMemAlloc` memory, and service pools with
//! their communicators attached (registration that follows growth, trim, sleep and wake). Values are integers,
//! checked exactly. NCCL_NVLS_ENABLE=0 is set before the first communicator.
//! `cargo test -p mempool-nccl --features gpu --test two_gpu -- --nocapture` (read the FINDING lines).
#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;

use mempool_core::{Device, Stream};
use mempool_nccl::{attach, group, Attachment, Comm, ReduceOp, Registration};
use mempool_rmm::containers::DeviceBuffer;
use mempool_rmm::suballoc::PoolOptions;
use mempool_rmm::{
    AsyncOptions, AsyncResource, CudaResource, PoolResource, ServiceOptions, ServiceResource, SharedResource,
    SleepMode, Tag, VmmOptions, VmmResource,
};

const N: usize = 4 << 20; // 16 MiB of i32 per buffer: large enough for NCCL's registered paths.

struct Rank {
    dev: Device,
    stream: Stream,
}

fn ranks() -> (Vec<Comm>, Vec<Rank>) {
    common::setup();
    let (d0, d1) = common::two_gpus();
    let comms = Comm::init_all(&[d0, d1]).unwrap();
    let ranks = [d0, d1]
        .into_iter()
        .map(|dev| Rank {
            dev,
            stream: Stream::new(&dev.context().unwrap()).unwrap(),
        })
        .collect();
    (comms, ranks)
}

/// All-reduce (sum) and all-gather over buffers from `mrs[rank]`, registering them first when
/// `register` is set. Returns what each registration call returned, per rank.
fn sum_and_gather(
    what: &str,
    comms: &[Comm],
    ranks: &[Rank],
    mrs: &[SharedResource],
    register: bool,
) -> (Vec<Result<(), String>>, Result<(), String>) {
    let sends: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&common::pattern(r, N), &rk.stream, mrs[r].clone()))
        .collect();
    let recvs: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&vec![-1; N], &rk.stream, mrs[r].clone()))
        .collect();
    let gathers: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&vec![-1; 2 * N], &rk.stream, mrs[r].clone()))
        .collect();
    let mut regs: Vec<Registration> = Vec::new();
    let mut outcomes = Vec::new();
    if register {
        for (r, comm) in comms.iter().enumerate() {
            let mut outcome = Ok(());
            for b in [&sends[r], &recvs[r], &gathers[r]] {
                // SAFETY: every rank registers its three buffers, and when any registration fails all
                // are dropped below before a collective runs, so no collective mixes registered and
                // unregistered buffers across ranks; `regs` is dropped before the buffers.
                match unsafe { comm.register(b) } {
                    Ok(reg) => regs.push(reg),
                    Err(e) => outcome = Err(e.to_string()),
                }
            }
            outcomes.push(outcome);
        }
        if outcomes.iter().any(|o| o.is_err()) {
            regs.clear();
        }
    }

    let run = || -> mempool_nccl::Result<()> {
        group(|g| {
            for (r, comm) in comms.iter().enumerate() {
                g.all_reduce::<i32>(comm, &sends[r], &recvs[r], ReduceOp::Sum, ranks[r].stream.as_ref())?;
            }
            Ok(())
        })?;
        group(|g| {
            for (r, comm) in comms.iter().enumerate() {
                g.all_gather::<i32>(comm, &sends[r], &gathers[r], ranks[r].stream.as_ref())?;
            }
            Ok(())
        })
    };
    if let Err(e) = run() {
        drop(regs);
        return (outcomes, Err(e.to_string()));
    }
    let sum: Vec<i32> = (0..N).map(|j| 3 * (j % 1000) as i32).collect();
    let gathered: Vec<i32> = common::pattern(0, N).into_iter().chain(common::pattern(1, N)).collect();
    for (r, rk) in ranks.iter().enumerate() {
        rk.stream.synchronize().unwrap();
        common::check(
            &format!("{what}: all-reduce on rank {r} ({})", rk.dev),
            &common::from_bytes(&recvs[r].to_host().unwrap()),
            &sum,
        );
        common::check(
            &format!("{what}: all-gather on rank {r} ({})", rk.dev),
            &common::from_bytes(&gathers[r].to_host().unwrap()),
            &gathered,
        );
    }
    drop(regs);
    (outcomes, Ok(()))
}

#[test]
fn two_gpu_registered_vmm_memory_all_reduce_and_all_gather() {
    let _serial = common::serial();
    let (comms, ranks) = ranks();
    let vmm: Vec<SharedResource> = ranks
        .iter()
        .map(|r| Arc::new(VmmResource::new(&r.dev, VmmOptions::default()).unwrap()) as SharedResource)
        .collect();
    let (outcomes, ran) = sum_and_gather("VmmResource, registered", &comms, &ranks, &vmm, true);
    println!("FINDING: ncclCommRegister of VmmResource memory: {outcomes:?}; collectives: {ran:?}");
    ran.unwrap();
    // NCCL documents user buffer registration for cuMem* memory (what ncclMemAlloc returns).
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");

    let pooled: Vec<SharedResource> = ranks
        .iter()
        .map(|r| {
            let vmm = VmmResource::new(&r.dev, VmmOptions::default()).unwrap();
            Arc::new(PoolResource::new(vmm, &r.dev, PoolOptions::default()).unwrap()) as SharedResource
        })
        .collect();
    let (outcomes, ran) = sum_and_gather(
        "PoolResource over VmmResource, registered",
        &comms,
        &ranks,
        &pooled,
        true,
    );
    println!(
        "FINDING: ncclCommRegister of pool(vmm) suballocations (sub-ranges of cuMemCreate memory): {outcomes:?}; \
         collectives: {ran:?}"
    );
    ran.unwrap();
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    drop((vmm, pooled));
    for c in comms {
        c.destroy().unwrap();
    }
}

#[test]
fn two_gpu_unregistered_pool_memory_all_reduce_and_all_gather() {
    let _serial = common::serial();
    let (comms, ranks) = ranks();
    let pools: Vec<SharedResource> = ranks
        .iter()
        .map(|r| Arc::new(AsyncResource::new(&r.dev, AsyncOptions::default()).unwrap()) as SharedResource)
        .collect();
    let (_, ran) = sum_and_gather(
        "AsyncResource (cuMemAllocFromPoolAsync), unregistered",
        &comms,
        &ranks,
        &pools,
        false,
    );
    ran.unwrap();
    drop(pools);
    for c in comms {
        c.destroy().unwrap();
    }
}

/// Registrations dropped inside a group (where NCCL refuses `ncclCommDeregister`) are deregistered when
/// the group ends: `group` returns `Ok` (it returns a failed deferred deregistration's error), the
/// values are exact, and inside the group registering, the communicators' own collectives and a nested
/// group are refused.
#[test]
fn two_gpu_registrations_dropped_inside_a_group_are_deregistered_at_its_end() {
    let _serial = common::serial();
    let (comms, ranks) = ranks();
    let mrs: Vec<SharedResource> = ranks
        .iter()
        .map(|r| Arc::new(VmmResource::new(&r.dev, VmmOptions::default()).unwrap()) as SharedResource)
        .collect();
    let bufs: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&common::pattern(r, N), &rk.stream, mrs[r].clone()))
        .collect();
    let regs: Vec<Registration> = comms
        .iter()
        .zip(&bufs)
        // SAFETY: every rank registers the buffer it passes to the all-reduce; `regs` is dropped in
        // the group, before the buffers.
        .map(|(c, b)| unsafe { c.register(b) }.unwrap())
        .collect();
    group(|g| {
        for (r, comm) in comms.iter().enumerate() {
            g.all_reduce_in_place::<i32>(comm, &bufs[r], ReduceOp::Sum, ranks[r].stream.as_ref())?;
        }
        // SAFETY: refused before NCCL is called, so nothing is registered.
        let e = unsafe { comms[0].register(&bufs[0]) }.unwrap_err();
        assert!(e.to_string().contains("group is open"), "{e}");
        let e = comms[0]
            .all_reduce_in_place::<i32>(&bufs[0], ReduceOp::Sum, ranks[0].stream.as_ref())
            .unwrap_err();
        assert!(e.to_string().contains("group is open"), "{e}");
        let e = group(|_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("already open"), "{e}");
        drop(regs); // deregistered after ncclGroupEnd, before `group` returns
        Ok(())
    })
    .unwrap();
    let sum: Vec<i32> = (0..N).map(|j| 3 * (j % 1000) as i32).collect();
    for (r, rk) in ranks.iter().enumerate() {
        rk.stream.synchronize().unwrap();
        common::check(
            &format!("all-reduce in place, registrations dropped in the group, rank {r}"),
            &common::from_bytes(&bufs[r].to_host().unwrap()),
            &sum,
        );
    }
    drop((bufs, mrs));
    for c in comms {
        c.destroy().unwrap();
    }
}

/// The question: which memory can NCCL register? Each kind is registered, then used in the
/// collectives (whose results are checked whatever registration said). Only the VMM case is asserted
/// (above): for the others the test prints what NCCL answered.
#[test]
fn two_gpu_which_memory_nccl_registers() {
    let _serial = common::serial();
    let (comms, ranks) = ranks();
    let kinds: Vec<(&str, Vec<SharedResource>)> = vec![
        (
            "stream-ordered pool memory (AsyncResource, cuMemAllocFromPoolAsync)",
            ranks
                .iter()
                .map(|r| Arc::new(AsyncResource::new(&r.dev, AsyncOptions::default()).unwrap()) as SharedResource)
                .collect(),
        ),
        (
            "cuMemAlloc memory (CudaResource)",
            ranks
                .iter()
                .map(|r| Arc::new(CudaResource::new(&r.dev).unwrap()) as SharedResource)
                .collect(),
        ),
        (
            "cuMemCreate memory (VmmResource)",
            ranks
                .iter()
                .map(|r| Arc::new(VmmResource::new(&r.dev, VmmOptions::default()).unwrap()) as SharedResource)
                .collect(),
        ),
    ];
    let mut findings = Vec::new();
    for (what, mrs) in &kinds {
        let (outcomes, ran) = sum_and_gather(what, &comms, &ranks, mrs, true);
        println!("FINDING: ncclCommRegister of {what}: {outcomes:?}; collectives afterwards (values checked when Ok): {ran:?}");
        findings.push((what.to_string(), outcomes, ran));
    }
    println!("FINDINGS (NCCL {}):", mempool_nccl::library_version().unwrap());
    for (what, o, ran) in &findings {
        println!("  {what}: register {o:?}, collectives {ran:?}");
    }
    // Collectives on registered cuMemCreate memory are documented to work.
    assert!(findings[2].2.is_ok(), "{findings:?}");
    drop(kinds);
    for c in comms {
        c.destroy().unwrap();
    }
}

/// The case: each rank has a `ServiceResource` with its communicator attached; buffers are
/// allocated after the pool grew (and grow it again, next to what is mapped), so each lies in one
/// registration made with no call of the test; the all-reduce and all-gather over them give the exact
/// values. Then a trim and a sleep/wake cycle, and the all-reduce again.
#[test]
fn two_gpu_attached_service_pools_all_reduce_after_growth() {
    let _serial = common::serial();
    let (comms, ranks) = ranks();
    let mrs: Vec<Arc<ServiceResource>> = ranks
        .iter()
        .map(|r| {
            ServiceResource::new(
                &r.dev,
                ServiceOptions {
                    region_size: Some(4 << 30),
                    max_tags: 2,
                    ..ServiceOptions::default()
                },
            )
            .unwrap()
        })
        .collect();
    let atts: Vec<Attachment> = comms
        .into_iter()
        .zip(&mrs)
        // SAFETY: every rank attaches its communicator to the resource every collective buffer below
        // comes from, and the test asserts that no registration failed before the collectives.
        .map(|(c, mr)| unsafe { attach(c, mr) }.unwrap())
        .collect();
    let shared: Vec<SharedResource> = mrs.iter().map(|m| m.clone() as SharedResource).collect();
    // The pool grows a first time...
    let warm: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&vec![7; 1 << 20], &rk.stream, shared[r].clone()))
        .collect();
    // ...and the collective buffers come after it, growing it again next to the first chunks.
    let sends: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&common::pattern(r, N), &rk.stream, shared[r].clone()))
        .collect();
    let recvs: Vec<DeviceBuffer> = ranks
        .iter()
        .enumerate()
        .map(|(r, rk)| common::buffer(&vec![-1; N], &rk.stream, shared[r].clone()))
        .collect();
    for (r, att) in atts.iter().enumerate() {
        assert!(att.errors().is_empty(), "rank {r}: {:?}", att.errors());
        assert!(att.is_current(), "rank {r}");
        let regs = att.registered();
        println!(
            "rank {r}: registrations {regs:?}; mapped {}",
            mrs[r].stats().mapped_bytes
        );
        for (what, b) in [("send", &sends[r]), ("receive", &recvs[r]), ("first", &warm[r])] {
            assert!(
                regs.iter().any(|g| g.contains(b.ptr(), b.len())),
                "rank {r}: the {what} buffer ({} bytes at {}) lies in one registration: {regs:?}",
                b.len(),
                b.ptr()
            );
        }
    }
    let sum: Vec<i32> = (0..N).map(|j| 3 * (j % 1000) as i32).collect();
    let run_and_check = |what: &str| {
        let guards: Vec<_> = atts.iter().map(|a| a.comm()).collect();
        group(|g| {
            for (r, c) in guards.iter().enumerate() {
                g.all_reduce::<i32>(c, &sends[r], &recvs[r], ReduceOp::Sum, ranks[r].stream.as_ref())?;
            }
            Ok(())
        })
        .unwrap();
        drop(guards);
        for (r, rk) in ranks.iter().enumerate() {
            rk.stream.synchronize().unwrap();
            common::check(
                &format!("{what}: all-reduce on rank {r} ({})", rk.dev),
                &common::from_bytes(&recvs[r].to_host().unwrap()),
                &sum,
            );
        }
    };
    run_and_check("attached service pools, after growth");

    // Trim (the first buffer's chunks go) and sleep/wake of the default tag with offload: the
    // registrations follow; the next all-reduce is exact again.
    drop(warm);
    for (r, mr) in mrs.iter().enumerate() {
        ranks[r].stream.synchronize().unwrap();
        mr.trim().unwrap();
        mr.sleep(&[Tag::DEFAULT], SleepMode::Offload, ranks[r].stream.as_ref())
            .unwrap();
        assert!(atts[r].registered().is_empty(), "rank {r}: asleep, nothing registered");
        mr.wake(&[Tag::DEFAULT], ranks[r].stream.as_ref()).unwrap();
        assert!(atts[r].errors().is_empty(), "rank {r}: {:?}", atts[r].errors());
        assert!(atts[r].is_current(), "rank {r}");
        assert_eq!(atts[r].registered(), atts[r].mapped(), "rank {r}");
        let regs = atts[r].registered();
        assert!(
            regs.iter().any(|g| g.contains(sends[r].ptr(), sends[r].len())),
            "{regs:?}"
        );
    }
    // Overwrite the receive buffers so the check sees this run's result.
    let minus: Vec<u8> = common::to_bytes(&vec![-1; N]);
    for (r, rk) in ranks.iter().enumerate() {
        rk.stream.synchronize().unwrap();
        recvs[r].copy_from_host(0, &minus).unwrap();
    }
    run_and_check("attached service pools, after trim, sleep and wake");

    drop((sends, recvs, shared));
    for a in atts {
        a.detach().unwrap().destroy().unwrap();
    }
    drop(mrs);
}
