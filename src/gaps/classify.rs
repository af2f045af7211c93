//! Judging numbers: what every number of a window became, from the sources
//! of truth, as ranges. Pure functions, so they are tested on their own.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::ledger::outbox::DocumentStatus;
use crate::numbers::{SeqRange, subtract};

#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    ToSchema,
    sqlx::Type,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Reason {
    /// Handed out by `POST /ids`, no document attached (yet).
    IssuedUnattached,
    /// Its document is dead-lettered.
    OutboxDlq,
    /// Its document was abandoned by an operator.
    Abandoned,
    /// Was in a pool that was discarded, and so was never issued.
    PoolDiscarded,
    /// Taken from the counter, found nowhere else.
    UntrackedLoss,
    /// Recorded as leased to an instance that stopped before reporting
    /// whether it handed the number out.
    LeaseLost,
    /// Gapless sequences: reserved by `POST /ids`, voided by the caller
    /// (their reason is the gap's `note`).
    Voided,
    /// Gapless sequences: reserved by `POST /ids`, neither confirmed nor
    /// voided by its deadline.
    ReservationExpired,
}

impl Reason {
    pub const ALL: [Reason; 8] = [
        Reason::IssuedUnattached,
        Reason::OutboxDlq,
        Reason::Abandoned,
        Reason::PoolDiscarded,
        Reason::UntrackedLoss,
        Reason::LeaseLost,
        Reason::Voided,
        Reason::ReservationExpired,
    ];

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<Self> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// The sources of truth for one window of one sequence period, each sorted
/// by position.
#[derive(Debug, Default, Clone)]
pub struct Evidence {
    /// Blocks taken from the counter.
    pub taken: Vec<SeqRange>,
    /// Issued ranges (ledger, per request).
    pub issued: Vec<SeqRange>,
    /// Ranges leased to an instance (ledger, via lease).
    pub leased: Vec<SeqRange>,
    /// Lease numbers their instance reported handing to `POST /ids`.
    pub handed_out: Vec<SeqRange>,
    /// Documents attached to numbers: (seq, status).
    pub documents: Vec<(i64, DocumentStatus)>,
    /// Numbers removed from pools unissued.
    pub discarded: Vec<SeqRange>,
}

/// A judged stretch: every number in `range` has `reason` (None: attached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judged {
    pub range: SeqRange,
    pub reason: Option<Reason>,
}

fn covers(ranges: &[SeqRange], seq: i64) -> bool {
    // Ranges are few per window; a binary search keeps big windows cheap.
    let i = ranges.partition_point(|r| r.end <= seq);
    ranges.get(i).is_some_and(|r| r.contains(seq))
}

/// Judges every number of `window` that was taken from the counter.
/// Stretches are cut at every boundary of the evidence and neighbours with
/// the same verdict merged, so the cost follows the evidence, not the
/// width of the window.
pub fn judge(window: SeqRange, evidence: &Evidence) -> Vec<Judged> {
    let mut cuts: BTreeSet<i64> = BTreeSet::new();
    cuts.insert(window.start);
    cuts.insert(window.end);
    let mut add = |r: &SeqRange| {
        for point in [r.start, r.end] {
            if window.start < point && point < window.end {
                cuts.insert(point);
            }
        }
    };
    evidence.taken.iter().for_each(&mut add);
    evidence.issued.iter().for_each(&mut add);
    evidence.leased.iter().for_each(&mut add);
    evidence.handed_out.iter().for_each(&mut add);
    evidence.discarded.iter().for_each(&mut add);
    for (seq, _) in &evidence.documents {
        add(&SeqRange::single(*seq));
    }
    let cuts: Vec<i64> = cuts.into_iter().collect();
    let mut out: Vec<Judged> = Vec::new();
    for pair in cuts.windows(2) {
        let piece = SeqRange::new(pair[0], pair[1]);
        if !covers(&evidence.taken, piece.start) {
            continue;
        }
        // A reported handout is evidence of issue even where its lease's
        // record is gone (it went with a failed Postgres primary).
        let issued =
            covers(&evidence.issued, piece.start) || covers(&evidence.handed_out, piece.start);
        let leased = !issued && covers(&evidence.leased, piece.start);
        let reason = if issued || leased {
            let document = evidence
                .documents
                .binary_search_by_key(&piece.start, |(seq, _)| *seq)
                .ok()
                .map(|i| evidence.documents[i].1);
            match document {
                Some(DocumentStatus::Pending | DocumentStatus::Committed) => None,
                Some(DocumentStatus::DeadLetter) => Some(Reason::OutboxDlq),
                Some(DocumentStatus::Abandoned) => Some(Reason::Abandoned),
                None if issued => Some(Reason::IssuedUnattached),
                // Leased, never reported: given back, or lost with its instance.
                None if covers(&evidence.discarded, piece.start) => Some(Reason::PoolDiscarded),
                None => Some(Reason::LeaseLost),
            }
        } else if covers(&evidence.discarded, piece.start) {
            Some(Reason::PoolDiscarded)
        } else {
            Some(Reason::UntrackedLoss)
        };
        match out.last_mut() {
            Some(last) if last.range.end == piece.start && last.reason == reason => {
                last.range.end = piece.end
            }
            _ => out.push(Judged {
                range: piece,
                reason,
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
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
                issued: crate::numbers::runs(&issued),
                documents: docs.iter().map(|(s, k)| (*s, match k {
                    0 => DocumentStatus::Pending,
                    1 => DocumentStatus::Committed,
                    2 => DocumentStatus::DeadLetter,
                    _ => DocumentStatus::Abandoned,
                })).collect(),
                discarded: crate::numbers::runs(&discarded),
                leased: crate::numbers::runs(&leased),
                handed_out: crate::numbers::runs(&handed),
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
}

/// An open row of `id_gaps`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenGap {
    pub row_id: i64,
    pub range: SeqRange,
    pub reason: Reason,
    pub detected_at: chrono::DateTime<chrono::Utc>,
}

/// A gap range to write.
#[derive(Debug, Clone, PartialEq)]
pub struct GapPiece {
    pub range: SeqRange,
    pub reason: Reason,
    pub detected_at: chrono::DateTime<chrono::Utc>,
}

/// How `id_gaps` changes for a set of re-judged windows.
#[derive(Debug, Default, PartialEq)]
pub struct GapPlan {
    /// Open rows that no longer hold as they are.
    pub resolve: Vec<i64>,
    /// Rows to insert (pieces of resolved rows that still hold, and new gaps).
    pub insert: Vec<GapPiece>,
    /// Numbers that became gaps, per reason.
    pub added: std::collections::BTreeMap<Reason, i64>,
    /// Numbers that stopped being gaps of a reason.
    pub resolved: std::collections::BTreeMap<Reason, i64>,
}

/// Merges `windows` (sorted, disjoint) judged as `judged` into the open gaps
/// `existing` (every open row overlapping or touching a window). Numbers
/// outside the windows keep their rows; contiguous numbers with one reason
/// end in one row; a gap keeps the time it was first detected.
pub fn plan(
    windows: &[SeqRange],
    judged: &[Judged],
    existing: &[OpenGap],
    now: chrono::DateTime<chrono::Utc>,
) -> GapPlan {
    let mut plan = GapPlan::default();
    let mut pieces = pieces_outside(existing, windows);
    for stretch in judged {
        if let Some(reason) = stretch.reason {
            pieces.extend(pieces_of_stretch(
                stretch.range,
                reason,
                existing,
                now,
                &mut plan,
            ));
        }
    }
    count_resolved(windows, judged, existing, &mut plan);
    let mut merged = merge_adjacent(pieces);
    // Rows that come out exactly as they were stay untouched.
    for row in existing {
        let same = merged
            .iter()
            .position(|p| p.range == row.range && p.reason == row.reason);
        match same {
            Some(i) => {
                merged.remove(i);
            }
            None => plan.resolve.push(row.row_id),
        }
    }
    plan.insert = merged;
    plan
}

/// The parts of open rows outside every window, as they are.
fn pieces_outside(existing: &[OpenGap], windows: &[SeqRange]) -> Vec<GapPiece> {
    let mut pieces = Vec::new();
    for row in existing {
        for outside in subtract(row.range, windows) {
            pieces.push(GapPiece {
                range: outside,
                reason: row.reason,
                detected_at: row.detected_at,
            });
        }
    }
    pieces
}

/// A stretch judged a gap of `reason`: the parts an open row of that reason
/// already held keep its detection time, the rest is new (counted in
/// `plan.added`).
fn pieces_of_stretch(
    stretch: SeqRange,
    reason: Reason,
    existing: &[OpenGap],
    now: chrono::DateTime<chrono::Utc>,
    plan: &mut GapPlan,
) -> Vec<GapPiece> {
    let mut pieces = Vec::new();
    let mut known: Vec<SeqRange> = Vec::new();
    for row in existing.iter().filter(|e| e.reason == reason) {
        if let Some(part) = row.range.intersect(stretch) {
            pieces.push(GapPiece {
                range: part,
                reason,
                detected_at: row.detected_at,
            });
            known.push(part);
        }
    }
    known.sort();
    for fresh in subtract(stretch, &known) {
        *plan.added.entry(reason).or_default() += fresh.len();
        pieces.push(GapPiece {
            range: fresh,
            reason,
            detected_at: now,
        });
    }
    pieces
}

/// Counts, per reason, the numbers of open rows inside the windows that
/// the judgement no longer gives that reason.
fn count_resolved(
    windows: &[SeqRange],
    judged: &[Judged],
    existing: &[OpenGap],
    plan: &mut GapPlan,
) {
    for row in existing {
        for inside in windows.iter().filter_map(|w| w.intersect(row.range)) {
            let kept: i64 = judged
                .iter()
                .filter(|j| j.reason == Some(row.reason))
                .filter_map(|j| j.range.intersect(inside))
                .map(|r| r.len())
                .sum();
            if inside.len() > kept {
                *plan.resolved.entry(row.reason).or_default() += inside.len() - kept;
            }
        }
    }
}

/// Pieces in order, contiguous ones of one reason joined (keeping the
/// earliest detection time).
fn merge_adjacent(mut pieces: Vec<GapPiece>) -> Vec<GapPiece> {
    pieces.sort_by_key(|p| p.range.start);
    let mut merged: Vec<GapPiece> = Vec::new();
    for piece in pieces {
        match merged.last_mut() {
            Some(last) if last.range.end == piece.range.start && last.reason == piece.reason => {
                last.range.end = piece.range.end;
                last.detected_at = last.detected_at.min(piece.detected_at);
            }
            _ => merged.push(piece),
        }
    }
    merged
}

#[cfg(test)]
mod plan_tests {
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
}
