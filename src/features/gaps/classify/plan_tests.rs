use super::*;
use chrono::{DateTime, Duration, Utc};

fn r(a: i64, b: i64) -> SeqRange {
    SeqRange::new(a, b)
}

fn gap(row_id: i64, range: SeqRange, reason: Reason, at: DateTime<Utc>) -> OpenGap {
    OpenGap {
        row_id,
        range,
        reason,
        detected_at: at,
    }
}

#[test]
fn new_gaps_next_to_old_ones_become_one_row() {
    let then = Utc::now() - Duration::hours(1);
    let now = Utc::now();
    let existing = [gap(1, r(10, 20), Reason::IssuedUnattached, then)];
    let judged = [Judged {
        range: r(20, 25),
        reason: Some(Reason::IssuedUnattached),
    }];
    let plan = plan(&[r(20, 25)], &judged, &existing, now);
    assert_eq!(plan.resolve, vec![1]);
    assert_eq!(
        plan.insert,
        vec![GapPiece {
            range: r(10, 25),
            reason: Reason::IssuedUnattached,
            detected_at: then
        }]
    );
    assert_eq!(plan.added.get(&Reason::IssuedUnattached), Some(&5));
    assert!(plan.resolved.is_empty());
}

#[test]
fn a_number_that_got_its_document_leaves_the_row_split() {
    let then = Utc::now() - Duration::hours(1);
    let existing = [gap(7, r(10, 20), Reason::IssuedUnattached, then)];
    let judged = [Judged {
        range: r(15, 16),
        reason: None,
    }];
    let plan = plan(&[r(15, 16)], &judged, &existing, Utc::now());
    assert_eq!(plan.resolve, vec![7]);
    assert_eq!(
        plan.insert,
        vec![
            GapPiece {
                range: r(10, 15),
                reason: Reason::IssuedUnattached,
                detected_at: then
            },
            GapPiece {
                range: r(16, 20),
                reason: Reason::IssuedUnattached,
                detected_at: then
            },
        ]
    );
    assert_eq!(plan.resolved.get(&Reason::IssuedUnattached), Some(&1));
}

#[test]
fn an_unchanged_verdict_touches_nothing() {
    let then = Utc::now() - Duration::hours(1);
    let existing = [gap(3, r(10, 12), Reason::OutboxDlq, then)];
    let judged = [Judged {
        range: r(10, 12),
        reason: Some(Reason::OutboxDlq),
    }];
    let plan = plan(&[r(10, 12)], &judged, &existing, Utc::now());
    assert_eq!(plan, GapPlan::default());
}

#[test]
fn a_dead_letter_abandoned_changes_reason() {
    let then = Utc::now() - Duration::hours(1);
    let now = Utc::now();
    let existing = [gap(4, r(10, 11), Reason::OutboxDlq, then)];
    let judged = [Judged {
        range: r(10, 11),
        reason: Some(Reason::Abandoned),
    }];
    let plan = plan(&[r(10, 11)], &judged, &existing, now);
    assert_eq!(plan.resolve, vec![4]);
    assert_eq!(
        plan.insert,
        vec![GapPiece {
            range: r(10, 11),
            reason: Reason::Abandoned,
            detected_at: now
        }]
    );
    assert_eq!(plan.added.get(&Reason::Abandoned), Some(&1));
    assert_eq!(plan.resolved.get(&Reason::OutboxDlq), Some(&1));
}
