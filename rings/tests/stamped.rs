//! The stamped ring (`shmhca_rings::ring::stamped_ring`, the engine's completion queues):
//! values come out in order, each once, across many laps of the stamps; the producer finds
//! the ring full exactly when every slot holds a value not taken, and room again after a
//! take; a take of at most `max` leaves the rest.

use shmhca_rings::ring::{CapacityError, stamped_ring};

#[test]
fn values_come_out_in_order_across_many_laps() {
    for capacity in [1usize, 2, 4, 8] {
        let (mut p, mut c) = stamped_ring::<u64>(capacity).unwrap();
        assert_eq!(p.capacity(), capacity);
        assert_eq!(c.capacity(), capacity);
        let (mut pushed, mut taken) = (0u64, 0u64);
        for round in 0..50 {
            // Fill: exactly `capacity` values fit.
            while p.has_room() {
                p.push(pushed).unwrap();
                pushed += 1;
            }
            assert_eq!(
                pushed - taken,
                capacity as u64,
                "round {round}: full when all taken"
            );
            assert_eq!(p.push(999), Err(999), "a full ring gives the value back");
            assert_eq!(p.free_slots(), 0);
            // Take at most `round % capacity + 1` of them, in order.
            let max = round % capacity + 1;
            let n = c.pop_each(max, |v| {
                assert_eq!(v, taken, "in order, each once");
                taken += 1;
            });
            assert_eq!(n, max);
            assert_eq!(p.free_slots(), max, "what was taken is free again");
        }
        // The rest, then nothing.
        while let Some(v) = c.pop() {
            assert_eq!(v, taken);
            taken += 1;
        }
        assert_eq!(taken, pushed);
        assert!(c.looks_empty());
        let mut out = [0u64; 4];
        assert_eq!(c.pop_burst(&mut out), 0);
    }
}

#[test]
fn a_burst_takes_no_more_than_its_array_holds() {
    let (mut p, mut c) = stamped_ring::<u32>(8).unwrap();
    for v in 0..5 {
        p.push(v).unwrap();
    }
    let mut out = [0u32; 3];
    assert_eq!(c.pop_burst(&mut out), 3);
    assert_eq!(out, [0, 1, 2]);
    assert!(!c.looks_empty());
    assert_eq!(c.pop_burst(&mut out), 2);
    assert_eq!(&out[..2], &[3, 4]);
    assert!(c.looks_empty());
}

/// A `pop_each` whose closure panics has taken the values it handed out, the one it
/// panicked on included: their slots are released to the producer as it unwinds, and the
/// next pop goes on after them.
#[test]
fn a_pop_whose_closure_panics_releases_what_it_handed_out() {
    let (mut p, mut c) = stamped_ring::<u32>(2).unwrap();
    p.push(1).unwrap();
    p.push(2).unwrap();
    assert_eq!(p.push(3), Err(3), "full");
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.pop_each(2, |v| {
            assert_ne!(v, 1, "the closure panics on the first value")
        })
    }));
    assert!(unwound.is_err());
    p.push(3).unwrap();
    let mut seen = Vec::new();
    assert_eq!(c.pop_each(4, |v| seen.push(v)), 2);
    assert_eq!(seen, [2, 3]);
}

/// A reservation (`StampedProducer::reserve`) is the next slot: written, it is the next
/// value out; dropped unwritten, the ring is as it was (nothing to take, the same room),
/// and the next reservation is that slot again. A full ring gives none.
#[test]
fn a_reservation_dropped_unwritten_leaves_the_ring_as_it_was() {
    let (mut p, mut c) = stamped_ring::<u64>(2).unwrap();
    assert!(
        p.reserve().is_some(),
        "room: a reservation, dropped unwritten"
    );
    assert!(c.looks_empty());
    assert_eq!(p.free_slots(), 2);
    p.reserve().unwrap().write(1);
    assert!(
        p.reserve().is_some(),
        "room: a reservation, dropped unwritten"
    );
    p.reserve().unwrap().write(2);
    assert!(p.reserve().is_none(), "full");
    assert_eq!(p.free_slots(), 0);
    assert_eq!(c.pop(), Some(1));
    p.reserve().unwrap().write(3);
    let mut out = [0; 4];
    assert_eq!(c.pop_burst(&mut out), 2);
    assert_eq!(&out[..2], &[2, 3]);
    assert!(c.looks_empty());
}

#[test]
fn capacities_are_checked() {
    assert_eq!(stamped_ring::<u8>(0).unwrap_err(), CapacityError::Zero);
    assert_eq!(
        stamped_ring::<u8>(3).unwrap_err(),
        CapacityError::NotPowerOfTwo { capacity: 3 }
    );
}

/// The two ends on two threads: every value arrives whole and in order.
#[test]
fn two_threads() {
    const COUNT: u64 = if cfg!(miri) { 200 } else { 20_000 };
    let (mut p, mut c) = stamped_ring::<[u64; 5]>(4).unwrap();
    let producer = std::thread::spawn(move || {
        for i in 0..COUNT {
            let mut v = [i, !i, i ^ 0x55, i + 1, i * 3];
            while let Err(back) = p.push(v) {
                v = back;
                std::hint::spin_loop();
            }
        }
    });
    let mut next = 0;
    while next < COUNT {
        c.pop_each(3, |v| {
            assert_eq!(v, [next, !next, next ^ 0x55, next + 1, next * 3]);
            next += 1;
        });
    }
    producer.join().unwrap();
    assert!(c.pop().is_none());
}
