//! Reconciliation of gapless sequences: every number below a period's
//! counter must be a document or a reservation (confirmed, open or voided).
//! Anything else is a broken promise: counted
//! (`idpool_gapless_violations_total`) and logged as an error, never
//! recorded as an explained gap.

use crate::infra::db::Link;

use super::store::{self, GaplessPeriod};
use crate::domain::numbers::runs;
use crate::domain::sequence::Sequence;

/// Most numbers one run checks per period (the rest wait for the next).
const CHECK_SPAN: i64 = 100_000;

/// What one period's check found.
pub(super) struct Checked {
    /// Numbers looked at.
    pub numbers: i64,
    /// Of them, neither a document nor a reservation.
    pub violations: i64,
}

/// Checks the numbers of `period` of gapless `sequence` taken since the
/// last run (at most `CHECK_SPAN`), logs any that are neither a document
/// nor a reservation, and moves the period's checkpoint past them.
pub(super) async fn check_period(
    conn: &mut impl Link,
    sequence: &Sequence,
    period: &GaplessPeriod,
) -> Result<Checked, sqlx::Error> {
    let from = match period.checked_below {
        Some(checked) => checked,
        None => first_number(sequence, period),
    };
    let to = period.next_seq.min(from.saturating_add(CHECK_SPAN));
    let holes = store::gapless_holes(conn, period, (from, to), CHECK_SPAN).await?;
    if !holes.is_empty() {
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
    store::move_gapless_checkpoint(conn, period, to).await?;
    Ok(Checked {
        numbers: (to - from).max(0),
        violations: holes.len() as i64,
    })
}

/// Where the period's counter started.
fn first_number(sequence: &Sequence, period: &GaplessPeriod) -> i64 {
    let definition = &sequence.definition;
    definition
        .reset
        .period_named(definition.timezone, &period.period)
        .map_or(definition.start, |p| sequence.first_number(&p))
}
