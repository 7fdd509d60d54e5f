//! Tests of [`crate::observe::oom`] through the adaptors. A module of its own so that `oom`, which the
//! adaptors import, imports none of them.
#![allow(unsafe_code)] // the tests free what they allocate: `deallocate` is unsafe

use crate::adaptors::{LimitingAdaptor, StatisticsAdaptor, TrackingAdaptor};
use crate::error::{Error, OutOfMemoryReport};
use crate::resource::MemoryResource;
use crate::testing::SimResource;
use mempool_core::StreamRef;

#[test]
fn an_adaptor_stack_names_itself_top_down() {
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    let sim = unsafe { SimResource::with_capacity(4096) };
    let mr = StatisticsAdaptor::new(TrackingAdaptor::new(sim));
    let e = mr.allocate(10_000, StreamRef::LEGACY).unwrap_err();
    assert!(e.is_out_of_memory());
    let r = e.report().expect("a report");
    assert_eq!(r.requested, 10_000);
    assert_eq!(r.stack, ["StatisticsAdaptor", "TrackingAdaptor", "SimResource"]);
    assert_eq!(r.failed_at, "SimResource");
    let msg = e.to_string();
    assert!(
        msg.starts_with(
            "out of memory: StatisticsAdaptor > TrackingAdaptor > SimResource could not allocate 10000 bytes"
        ),
        "{msg}"
    );
}

#[test]
fn a_limit_keeps_its_own_error() {
    // SAFETY: the simulation's addresses are never dereferenced here (only allocated and freed).
    let mr = StatisticsAdaptor::new(LimitingAdaptor::new(unsafe { SimResource::new() }, 1000));
    let e = mr.allocate(5000, StreamRef::LEGACY).unwrap_err();
    assert!(matches!(e, Error::LimitExceeded { requested: 5000, .. }), "{e}");
}

#[test]
fn the_report_reads_fragmentation() {
    let r = OutOfMemoryReport {
        requested: 1000,
        stack: vec!["A", "B"],
        failed_at: "B",
        holder: Some("A"),
        held: Some(10_000),
        live: Some(8_000),
        free: Some(2_000),
        free_blocks: Some(4),
        largest_free: Some(500),
        ..Default::default()
    };
    assert!(r.fragmented());
    assert_eq!(r.fragmentation_percent(), Some(75));
    let msg = r.to_string();
    assert!(
        msg.contains("A holds 10000 bytes, 8000 bytes live, 2000 bytes free in 4 blocks"),
        "{msg}"
    );
    assert!(
        msg.contains("its largest free block is 500 bytes (free memory 75% fragmented)"),
        "{msg}"
    );
    assert!(msg.contains("no free block is large enough"), "{msg}");
}
