use super::*;
use proptest::prelude::*;

/// Lets in the first waiting place (the one `is_first` names), returning
/// its tenant.
fn admit_first(waiting: &mut Vec<(Option<u16>, Place<'_>)>) -> Option<Option<u16>> {
    let i = waiting.iter().position(|(_, p)| p.is_first())?;
    let (t, p) = waiting.remove(i);
    p.let_in();
    Some(t)
}

#[test]
fn one_tenant_is_first_come_first_served() {
    let a = Admission::new();
    let p1 = a.enter(Class::Flex, None, 1, 0).unwrap();
    let p2 = a.enter(Class::Flex, None, 1, 0).unwrap();
    assert!(p1.is_first() && !p2.is_first());
    assert_eq!(a.waiting(Class::Flex), 2);
    assert_eq!(a.waiting(Class::Default), 0);
    p1.let_in();
    assert!(p2.is_first());
    drop(p2);
    assert_eq!(a.waiting(Class::Flex), 0);
}

#[test]
fn a_place_given_up_frees_the_front_at_once() {
    let a = Admission::new();
    let p1 = a.enter(Class::Default, Some(0), 1, 0).unwrap();
    let p2 = a.enter(Class::Default, Some(0), 1, 0).unwrap();
    // The client of the first left: the second is first, the clock did not move.
    drop(p1);
    assert!(p2.is_first());
}

#[test]
fn each_tenants_queue_is_bounded() {
    let a = Admission::new();
    let held: Vec<_> = (0..3)
        .map(|_| a.enter(Class::Flex, Some(1), 1, 3).unwrap())
        .collect();
    assert!(a.enter(Class::Flex, Some(1), 1, 3).is_none(), "full");
    // Another tenant, and another class, have queues of their own.
    assert!(a.enter(Class::Flex, Some(2), 1, 3).is_some());
    assert!(a.enter(Class::Default, Some(1), 1, 3).is_some());
    drop(held);
    assert!(a.enter(Class::Flex, Some(1), 1, 3).is_some());
}

#[test]
fn a_small_tenant_is_not_behind_a_big_ones_backlog() {
    let a = Admission::new();
    // The big tenant queued 50 first; then the small one sends 5.
    let mut waiting: Vec<_> = (0..50)
        .map(|_| (Some(0), a.enter(Class::Flex, Some(0), 1, 0).unwrap()))
        .collect();
    waiting.extend((0..5).map(|_| (Some(1), a.enter(Class::Flex, Some(1), 1, 0).unwrap())));
    let order: Vec<_> = (0..10)
        .map(|_| admit_first(&mut waiting).unwrap())
        .collect();
    // Equal weights: they alternate from the start.
    assert_eq!(
        order.iter().filter(|t| **t == Some(1)).count(),
        5,
        "{order:?}"
    );
}

#[test]
fn an_idle_tenant_saves_no_credit() {
    let a = Admission::new();
    let mut waiting = Vec::new();
    // Tenant 0 alone for 100 admissions.
    for _ in 0..100 {
        waiting.push((Some(0), a.enter(Class::Flex, Some(0), 1, 0).unwrap()));
        admit_first(&mut waiting);
    }
    // Now both queue 10: tenant 1 gets no burst of 100 ahead of tenant 0.
    for _ in 0..10 {
        waiting.push((Some(0), a.enter(Class::Flex, Some(0), 1, 0).unwrap()));
        waiting.push((Some(1), a.enter(Class::Flex, Some(1), 1, 0).unwrap()));
    }
    let order: Vec<_> = (0..6).map(|_| admit_first(&mut waiting).unwrap()).collect();
    assert_eq!(
        order.iter().filter(|t| **t == Some(0)).count(),
        3,
        "{order:?}"
    );
}

proptest! {
    /// Two tenants with a backlog each: over any run of admissions, each
    /// gets its weight's share, within one request.
    #[test]
    fn backlogged_tenants_share_by_weight(
        w0 in 1u32..=10,
        w1 in 1u32..=10,
        n in 10usize..200,
    ) {
        let a = Admission::new();
        let mut waiting = Vec::new();
        for _ in 0..n {
            waiting.push((Some(0), a.enter(Class::Flex, Some(0), w0, 0).unwrap()));
            waiting.push((Some(1), a.enter(Class::Flex, Some(1), w1, 0).unwrap()));
        }
        let k = n / 2;
        let order: Vec<_> = (0..k).map(|_| admit_first(&mut waiting).unwrap()).collect();
        let got0 = order.iter().filter(|t| **t == Some(0)).count() as f64;
        let share0 = k as f64 * f64::from(w0) / f64::from(w0 + w1);
        prop_assert!((got0 - share0).abs() <= 1.5, "{got0} of {k}, expected {share0}");
    }

    /// Any interleaving of arrivals, admissions and departures: the
    /// counts return to zero, and the first place is always the smallest
    /// tag waiting.
    #[test]
    fn the_queue_stays_consistent(ops in proptest::collection::vec((0u8..3, 0u16..3), 1..200)) {
        let a = Admission::new();
        let mut waiting: Vec<(Option<u16>, Place<'_>)> = Vec::new();
        for (op, t) in ops {
            match op {
                0 => waiting.push((Some(t), a.enter(Class::Flex, Some(t), u32::from(t) + 1, 0).unwrap())),
                1 => { admit_first(&mut waiting); }
                _ => if !waiting.is_empty() {
                    let i = usize::from(t) % waiting.len();
                    drop(waiting.remove(i));
                },
            }
            prop_assert_eq!(a.waiting(Class::Flex), waiting.len());
            let firsts = waiting.iter().filter(|(_, p)| p.is_first()).count();
            prop_assert!(waiting.is_empty() || firsts >= 1);
        }
        drop(waiting);
        prop_assert_eq!(a.waiting(Class::Flex), 0);
        prop_assert!(a.enter(Class::Flex, None, 1, 0).unwrap().is_first());
    }
}
