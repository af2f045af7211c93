//! Reconciliation of gapless sequences: every number below a period's
//! counter must be a document or a reservation (confirmed, open or voided).
//! Anything else is a broken promise: counted
//! (`idpool_gapless_violations_total`) and logged as an error, never
//! recorded as an explained gap.

use std::collections::HashMap;
use std::sync::Arc;

use crate::infra::db::Link;

use super::reconcile::{ReconcileError, Reconciler};
use super::store::{self, GaplessPeriod};
use crate::domain::numbers::runs;
use crate::domain::sequence::Sequence;

/// Most numbers one run checks per period (the rest wait for the next).
const CHECK_SPAN: i64 = 100_000;

/// A step of `reconciler`'s run: checks the numbers of gapless periods
/// taken since the last run; returns how many were neither a document nor
/// a reservation.
pub(super) async fn check_gapless(
    reconciler: &Reconciler,
    conn: &mut impl Link,
    sequences: &mut HashMap<i64, Arc<Sequence>>,
    summary: &mut super::reconcile::RunSummary,
) -> Result<i64, ReconcileError> {
    let mut violations = 0;
    for period in store::gapless_periods(conn).await? {
        let Some(sequence) = reconciler
            .sequence(conn, sequences, period.sequence_id)
            .await?
        else {
            continue;
        };
        let from = match period.checked_below {
            Some(checked) => checked,
            None => first_number(&sequence, &period),
        };
        let to = period.next_seq.min(from.saturating_add(CHECK_SPAN));
        let holes = store::gapless_holes(conn, &period, (from, to), CHECK_SPAN).await?;
        summary.periods_scanned += 1;
        summary.numbers_checked += (to - from).max(0);
        if !holes.is_empty() {
            violations += holes.len() as i64;
            let ranges: Vec<String> = runs(&holes)
                .iter()
                .map(|r| format!("{}..={}", r.start, r.end - 1))
                .collect();
            tracing::error!(
                project = %sequence.project, doc_type = %sequence.doc_type,
                period = %period.period, numbers = %ranges.join(","),
                "gapless sequence has numbers that are neither a document nor a void"
            );
        }
        store::move_gapless_checkpoint(conn, &period, to).await?;
    }
    reconciler.count_gapless_violations(violations);
    Ok(violations)
}

/// Where the period's counter started.
fn first_number(sequence: &Sequence, period: &GaplessPeriod) -> i64 {
    let definition = &sequence.definition;
    definition
        .reset
        .period_named(definition.timezone, &period.period)
        .map_or(definition.start, |p| sequence.first_number(&p))
}
