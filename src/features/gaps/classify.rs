//! Judging numbers: what every number of a window became, from the sources
//! of truth, as ranges. Pure functions, so they are tested on their own.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::domain::numbers::{SeqRange, subtract};
use crate::records::ledger::outbox_rows::DocumentStatus;

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
    strum::EnumString,
    strum::VariantArray,
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
    pub const ALL: &[Reason] = <Reason as strum::VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<Self> {
        s.parse().ok()
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
mod tests;

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
mod plan_tests;
