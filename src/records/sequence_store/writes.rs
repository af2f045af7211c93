//! Writing definitions: insert, update, and retiring a definition whose
//! IDs change (its numbers keep the IDs they were issued with).

use super::*;

/// A forced change of a sequence that printed IDs: the new format must not
/// print what any earlier format printed, and when the same format comes
/// back under another reset, counters start above every number taken so
/// far (a counter starting over would print the old IDs again).
pub(super) async fn retire(
    conn: &mut Tx<'_>,
    current: &Sequence,
    next: &Definition,
) -> Result<(), StoreError> {
    let (project, doc_type) = (current.project.as_str(), current.doc_type.as_str());
    let name = format!("{project}/{doc_type}");
    let mut printed: Vec<(String, String)> = sqlx::query!(
        "SELECT layout, format FROM sequence_formats WHERE sequence_id = $1",
        current.id,
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.layout, r.format))
    .collect();
    printed.push(printed_as(&current.definition));
    let new_pattern = next
        .pattern(project, doc_type)
        .map_err(DefinitionError::from)?;
    let same_as = |earlier: &(String, String)| *earlier == printed_as(next);
    for earlier in printed.iter().filter(|p| !same_as(p)) {
        let Some(pattern) = stored_pattern(&earlier.0, &earlier.1, project, doc_type, 19) else {
            continue;
        };
        if let Some(example) = new_pattern.common_example(&pattern) {
            let earlier = match earlier.0.as_str() {
                "int64" => format!("it printed under its earlier epoch {}", earlier.1),
                _ => format!("it printed with its earlier format {:?}", earlier.1),
            };
            return Err(StoreError::Conflict {
                sequence: name,
                other: earlier,
                example,
            });
        }
    }
    let (layout, format) = printed_as(&current.definition);
    sqlx::query!(
        "INSERT INTO sequence_formats (sequence_id, layout, format) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING",
        current.id,
        layout,
        format,
    )
    .execute(&mut *conn)
    .await?;
    let reprints = printed.iter().any(same_as);
    if reprints && current.definition.reset != next.reset {
        raise_counters_above_every_number_taken(conn, current.id).await?;
    }
    Ok(())
}

/// Every counter of the sequence, and those its periods create for a while
/// (`FLOOR_SPAN`), starts above the highest number taken so far.
async fn raise_counters_above_every_number_taken(
    conn: &mut Tx<'_>,
    sequence_id: i64,
) -> Result<(), sqlx::Error> {
    let floor = sqlx::query_scalar!(
        "SELECT max(next_seq) FROM counters WHERE sequence_id = $1",
        sequence_id,
    )
    .fetch_one(&mut *conn)
    .await?;
    let Some(floor) = floor else {
        return Ok(());
    };
    sqlx::query!(
        "UPDATE counters SET next_seq = GREATEST(next_seq, $2) WHERE sequence_id = $1",
        sequence_id,
        floor,
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query!(
        "UPDATE sequences SET counter_floor = GREATEST(coalesce(counter_floor, 0), $2), \
         floor_until = now() + make_interval(secs => $3) WHERE id = $1",
        sequence_id,
        floor,
        FLOOR_SPAN.num_seconds() as f64,
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes `next` over `current`. A change of identity is refused for a
/// sequence with issued numbers unless `force`, which retires the old
/// definition; returns the definition whose identity was replaced.
pub(super) async fn replace_definition(
    conn: &mut Tx<'_>,
    current: &Sequence,
    next: &Definition,
    force: bool,
) -> Result<Option<Arc<Sequence>>, PutError> {
    let changes_identity = current.definition.changes_identity(next);
    let mut replaced_identity = None;
    // A register's chain covers every number from the first: one begun
    // or ended part way would certify a history it never saw.
    if current.definition.register != next.register && numbers_taken(&mut *conn, current.id).await?
    {
        return Err(PutError::RegisterInUse);
    }
    // A gapless register keeps its numbering rules once it has numbers: a
    // new format, reset, time zone or start (forced or not) would leave
    // holes nobody could account for, or strand open reservations.
    let gapless_rules_change = current.definition.numbering == Numbering::Gapless
        && (changes_identity || current.definition.start != next.start);
    if gapless_rules_change && numbers_taken(&mut *conn, current.id).await? {
        return Err(PutError::GaplessInUse);
    }
    // PUT replaces the definition, and a left-out field takes its default:
    // a change of pool size sent without the `max` would silently end the
    // sequence's exhaustion (a 4-digit counter printing a fifth digit, a
    // gapless register numbering past its last invoice number). Removing a
    // max from a sequence with numbers is said with force.
    if let Some(max) = current.definition.max
        && next.max.is_none()
        && !force
        && numbers_taken(&mut *conn, current.id).await?
    {
        return Err(PutError::MaxDropped { max });
    }
    if changes_identity {
        if current.definition.numbering != next.numbering
            && numbers_taken(&mut *conn, current.id).await?
        {
            // Pooled numbers left in pools, or a gapless register continued
            // by pools: either way a hole nobody could account for.
            return Err(PutError::NumberingInUse);
        }
        let issued = numbers_issued(&mut *conn, current.id).await?;
        if issued && !force {
            return Err(PutError::InUse);
        }
        if issued {
            retire(&mut *conn, current, next).await?;
        }
        replaced_identity = Some(Arc::new(current.clone()));
    }
    update_definition(&mut *conn, current.id, next, changes_identity)
        .await
        .map_err(StoreError::from)?;
    Ok(replaced_identity)
}

/// Whether any number of the sequence was issued: recorded in the ledger
/// (pooled), or written with a document or reserved (gapless).
async fn numbers_issued(conn: &mut Tx<'_>, sequence_id: i64) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar!(
        "SELECT EXISTS (SELECT 1 FROM issuance_ledger WHERE sequence_id = $1) \
             OR EXISTS (SELECT 1 FROM id_outbox WHERE sequence_id = $1) \
             OR EXISTS (SELECT 1 FROM gapless_reservations WHERE sequence_id = $1) AS \"issued!\"",
        sequence_id,
    )
    .fetch_one(&mut *conn)
    .await?)
}

/// Whether any number of the sequence left its counter: issued, or
/// reserved for a pool or a caller (blocks).
async fn numbers_taken(conn: &mut Tx<'_>, sequence_id: i64) -> Result<bool, StoreError> {
    Ok(numbers_issued(&mut *conn, sequence_id).await?
        || sqlx::query_scalar!(
            "SELECT EXISTS (SELECT 1 FROM blocks WHERE sequence_id = $1) AS \"taken!\"",
            sequence_id,
        )
        .fetch_one(&mut *conn)
        .await?)
}

/// What decides the strings a definition prints, as kept in
/// `sequence_formats`: the format, or for the int64 layout its epoch (a new
/// epoch moves every day's base onto another day's).
pub(super) fn printed_as(d: &Definition) -> (String, String) {
    match d.layout {
        Layout::Text => ("text".into(), d.format.as_str().to_owned()),
        Layout::Int64 { epoch } => ("int64".into(), epoch.to_rfc3339()),
    }
}

/// `$query!($sql…)` (a query macro and its literal) binding `$before`,
/// then the ten columns of definition `$d` in the order both statements
/// below list them, then `$after`.
macro_rules! with_definition_columns {
    ($($query:ident)::+ ! ($($sql:tt),+), [$($before:expr),*], $d:expr, [$($after:expr),*]) => {
        $($query)::+!(
            $($sql),+,
            $($before,)*
            $d.format.as_str(),
            layout_name($d),
            $d.epoch(),
            $d.start,
            $d.max,
            $d.reset.as_str(),
            $d.timezone.name(),
            $d.pool_size as i32,
            $d.refill_at,
            $d.numbering.as_str(),
            $d.register.as_str(),
            $d.register.issuer()
            $(, $after)*
        )
    };
}

pub(super) async fn insert_definition(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    doc_type: &TypeCode,
    d: &Definition,
) -> Result<SequenceRow, StoreError> {
    Ok(with_definition_columns!(
        sequence_rows!(
            "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, max_seq, \
             reset, timezone, pool_size, refill_at, numbering, register, register_issuer) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) RETURNING",
            ""
        ),
        [project.as_str(), doc_type.as_str()],
        d,
        []
    )
    .fetch_one(&mut *conn)
    .await?)
}

pub(super) async fn update_definition(
    conn: &mut Tx<'_>,
    id: i64,
    d: &Definition,
    changes_identity: bool,
) -> Result<(), sqlx::Error> {
    with_definition_columns!(
        sqlx::query!(
            "UPDATE sequences SET format = $2, layout = $3, epoch = $4, start_seq = $5, \
             max_seq = $6, reset = $7, timezone = $8, pool_size = $9, refill_at = $10, \
             numbering = $11, register = $12, register_issuer = $13, version = version + 1, \
             identity_version = identity_version + $14::int, \
             updated_at = now() WHERE id = $1"
        ),
        [id],
        d,
        [i32::from(changes_identity)]
    )
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) fn layout_name(d: &Definition) -> &'static str {
    match d.layout {
        Layout::Text => "text",
        Layout::Int64 { .. } => "int64",
    }
}
