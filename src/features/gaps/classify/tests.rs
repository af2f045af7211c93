use super::*;
use proptest::prelude::*;

fn r(a: i64, b: i64) -> SeqRange {
    SeqRange::new(a, b)
}

#[test]
fn every_reason_from_its_evidence() {
    let evidence = Evidence {
        taken: vec![r(1, 21)],
        issued: vec![r(1, 9)],
        documents: vec![
            (1, DocumentStatus::Committed),
            (2, DocumentStatus::Pending),
            (3, DocumentStatus::DeadLetter),
            (4, DocumentStatus::Abandoned),
        ],
        discarded: vec![r(12, 16)],
        ..Default::default()
    };
    let judged = judge(r(1, 21), &evidence);
    assert_eq!(
        judged,
        vec![
            Judged {
                range: r(1, 3),
                reason: None
            },
            Judged {
                range: r(3, 4),
                reason: Some(Reason::OutboxDlq)
            },
            Judged {
                range: r(4, 5),
                reason: Some(Reason::Abandoned)
            },
            Judged {
                range: r(5, 9),
                reason: Some(Reason::IssuedUnattached)
            },
            Judged {
                range: r(9, 12),
                reason: Some(Reason::UntrackedLoss)
            },
            Judged {
                range: r(12, 16),
                reason: Some(Reason::PoolDiscarded)
            },
            Judged {
                range: r(16, 21),
                reason: Some(Reason::UntrackedLoss)
            },
        ]
    );
}

#[test]
fn lease_numbers_are_judged_by_what_their_instance_reported() {
    // 1..=10 leased: 1-2 carry documents, 3-4 reported handed out,
    // 5-6 given back, 7-10 never reported (the instance died).
    let evidence = Evidence {
        taken: vec![r(1, 11)],
        leased: vec![r(1, 11)],
        documents: vec![(1, DocumentStatus::Pending), (2, DocumentStatus::Committed)],
        handed_out: vec![r(3, 5)],
        discarded: vec![r(5, 7)],
        ..Default::default()
    };
    assert_eq!(
        judge(r(1, 11), &evidence),
        vec![
            Judged {
                range: r(1, 3),
                reason: None
            },
            Judged {
                range: r(3, 5),
                reason: Some(Reason::IssuedUnattached)
            },
            Judged {
                range: r(5, 7),
                reason: Some(Reason::PoolDiscarded)
            },
            Judged {
                range: r(7, 11),
                reason: Some(Reason::LeaseLost)
            },
        ]
    );
}

#[test]
fn numbers_never_taken_are_not_judged() {
    let evidence = Evidence {
        taken: vec![r(10, 12), r(20, 22)],
        ..Default::default()
    };
    let judged = judge(r(0, 30), &evidence);
    assert_eq!(
        judged,
        vec![
            Judged {
                range: r(10, 12),
                reason: Some(Reason::UntrackedLoss)
            },
            Judged {
                range: r(20, 22),
                reason: Some(Reason::UntrackedLoss)
            },
        ]
    );
}

#[test]
fn a_million_issued_numbers_are_one_stretch() {
    let evidence = Evidence {
        taken: vec![r(1, 1_000_001)],
        issued: vec![r(1, 1_000_001)],
        ..Default::default()
    };
    assert_eq!(
        judge(r(1, 1_000_001), &evidence),
        vec![Judged {
            range: r(1, 1_000_001),
            reason: Some(Reason::IssuedUnattached)
        }]
    );
}

proptest! {
    /// Judging number by number and judging in stretches agree, and the
    /// stretches cover exactly the taken numbers of the window.
    #[test]
    fn stretches_match_a_number_by_number_verdict(
        issued in proptest::collection::vec(0i64..60, 0..30),
        leased in proptest::collection::vec(0i64..60, 0..30),
        handed in proptest::collection::vec(0i64..60, 0..30),
        discarded in proptest::collection::vec(0i64..60, 0..20),
        docs in proptest::collection::btree_map(0i64..60, 0u8..4, 0..20),
        lo in 0i64..30,
        len in 1i64..40,
    ) {
        let window = r(lo, lo + len);
        let evidence = Evidence {
            taken: vec![r(0, 50)],
            issued: crate::domain::numbers::runs(&issued),
            documents: docs.iter().map(|(s, k)| (*s, match k {
                0 => DocumentStatus::Pending,
                1 => DocumentStatus::Committed,
                2 => DocumentStatus::DeadLetter,
                _ => DocumentStatus::Abandoned,
            })).collect(),
            discarded: crate::domain::numbers::runs(&discarded),
            leased: crate::domain::numbers::runs(&leased),
            handed_out: crate::domain::numbers::runs(&handed),
        };
        let judged = judge(window, &evidence);
        let expanded: Vec<(i64, Option<Reason>)> = judged
            .iter()
            .flat_map(|j| j.range.iter().map(move |s| (s, j.reason)))
            .collect();
        let expected: Vec<(i64, Option<Reason>)> = window
            .iter()
            .filter(|s| *s < 50)
            .map(|s| {
                let handed_or_issued = issued.contains(&s) || handed.contains(&s);
                let reason = if handed_or_issued || leased.contains(&s) {
                    match docs.get(&s) {
                        Some(0) | Some(1) => None,
                        Some(2) => Some(Reason::OutboxDlq),
                        Some(_) => Some(Reason::Abandoned),
                        None if handed_or_issued => Some(Reason::IssuedUnattached),
                        None if discarded.contains(&s) => Some(Reason::PoolDiscarded),
                        None => Some(Reason::LeaseLost),
                    }
                } else if discarded.contains(&s) {
                    Some(Reason::PoolDiscarded)
                } else {
                    Some(Reason::UntrackedLoss)
                };
                (s, reason)
            })
            .collect();
        prop_assert_eq!(expanded, expected);
        for pair in judged.windows(2) {
            prop_assert!(!(pair[0].range.end == pair[1].range.start && pair[0].reason == pair[1].reason));
        }
    }
}
