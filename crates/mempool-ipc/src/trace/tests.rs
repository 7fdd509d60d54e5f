use super::*;

#[test]
fn every_point_round_trips_through_its_code_and_bytes() {
    for (i, point) in Point::ALL.into_iter().enumerate() {
        assert_eq!(Point::from_code(point.code()), Some(point), "{point:?}");
        assert!(
            Point::ALL[i + 1..].iter().all(|p| p.code() != point.code()),
            "{point:?}'s code is used twice"
        );
        let record = Record {
            point,
            buffer: 0x0102_0304_0506_0708 + i as u64,
            at_ns: u64::MAX - i as u64,
        };
        assert_eq!(Record::from_bytes(&record.to_bytes()), Some(record));
    }
    let codes: Vec<u8> = Point::ALL.iter().map(|p| p.code()).collect();
    for code in 0..=u8::MAX {
        assert_eq!(Point::from_code(code).is_some(), codes.contains(&code), "code {code}");
    }
    let mut bytes = [0u8; Record::BYTES];
    bytes[0] = 200;
    assert_eq!(Record::from_bytes(&bytes), None);
}

#[test]
fn clock_never_steps_back() {
    let mut last = now_ns();
    for _ in 0..10_000 {
        let now = now_ns();
        assert!(now >= last, "{now} < {last}");
        last = now;
    }
    // The system clock of this century, in nanoseconds.
    assert!(last > 1_600_000_000 * 1_000_000_000, "{last}");
}

/// The one test that turns recording on (the switch is process-wide; other tests running
/// meanwhile may add records of their own, so only this test's buffer ids are looked at).
#[test]
fn records_only_while_enabled_in_order() {
    const MINE: u64 = u64::MAX - 7;
    let mine = |records: Vec<Record>| -> Vec<Record> { records.into_iter().filter(|r| r.buffer == MINE).collect() };
    disable();
    mark(Point::ImporterRelease, MINE);
    assert!(mine(take()).is_empty(), "recorded while disabled");
    enable();
    assert!(is_enabled());
    mark(Point::ImporterRelease, MINE);
    mark(Point::ImporterRecorded, MINE);
    mark(Point::ImporterSent, MINE);
    disable();
    mark(Point::ImporterFrame, MINE);
    let got = mine(take());
    let points: Vec<Point> = got.iter().map(|r| r.point).collect();
    assert_eq!(
        points,
        [Point::ImporterRelease, Point::ImporterRecorded, Point::ImporterSent]
    );
    assert!(got.windows(2).all(|w| w[0].at_ns <= w[1].at_ns), "{got:?}");
    assert!(mine(take()).is_empty(), "take left records behind");
}
