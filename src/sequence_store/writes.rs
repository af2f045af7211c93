//! Writing definitions: insert, update, and retiring a definition whose
//! IDs change (its numbers keep the IDs they were issued with).

use super::*;

/// A forced change of a sequence that printed IDs: the new format must not
/// print what any earlier format printed, and when the same format comes
/// back under another reset, counters start above every number taken so
/// far (a counter starting over would print the old IDs again).
pub(super) async fn retire(
    conn: &mut PgConnection,
    current: &Sequence,
    next: &Definition,
) -> Result<(), StoreError> {
    let (project, doc_type) = (current.project.as_str(), current.doc_type.as_str());
    let name = format!("{project}/{doc_type}");
    let mut printed: Vec<(String, String)> =
        sqlx::query_as("SELECT layout, format FROM sequence_formats WHERE sequence_id = $1")
            .bind(current.id)
            .fetch_all(&mut *conn)
            .await?;
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
    sqlx::query(
        "INSERT INTO sequence_formats (sequence_id, layout, format) VALUES ($1, $2, $3) \
         ON CONFLICT DO NOTHING",
    )
    .bind(current.id)
    .bind(printed_as(&current.definition).0)
    .bind(printed_as(&current.definition).1)
    .execute(&mut *conn)
    .await?;
    let reprints = printed.iter().any(same_as);
    if reprints && current.definition.reset != next.reset {
        let floor: Option<i64> =
            sqlx::query_scalar("SELECT max(next_seq) FROM counters WHERE sequence_id = $1")
                .bind(current.id)
                .fetch_one(&mut *conn)
                .await?;
        if let Some(floor) = floor {
            sqlx::query(
                "UPDATE counters SET next_seq = GREATEST(next_seq, $2) WHERE sequence_id = $1",
            )
            .bind(current.id)
            .bind(floor)
            .execute(&mut *conn)
            .await?;
            sqlx::query(
                "UPDATE sequences SET counter_floor = GREATEST(coalesce(counter_floor, 0), $2), \
                 floor_until = now() + make_interval(secs => $3) WHERE id = $1",
            )
            .bind(current.id)
            .bind(floor)
            .bind(FLOOR_SPAN.num_seconds() as f64)
            .execute(&mut *conn)
            .await?;
        }
    }
    Ok(())
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

pub(super) const INSERT_SEQUENCE: &str = "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, \
     max_seq, reset, timezone, pool_size, refill_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

pub(super) async fn insert_definition(
    conn: &mut PgConnection,
    project: &ProjectCode,
    doc_type: &TypeCode,
    d: &Definition,
) -> Result<SequenceRow, StoreError> {
    let sql = format!("{INSERT_SEQUENCE} RETURNING {SELECT_COLUMNS}");
    let query = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(project.as_str())
        .bind(doc_type.as_str());
    Ok(bind_definition(query, d).fetch_one(&mut *conn).await?)
}

pub(super) async fn update_definition(
    conn: &mut PgConnection,
    id: i64,
    d: &Definition,
    changes_identity: bool,
) -> Result<(), sqlx::Error> {
    let query = sqlx::query_as::<_, (i64,)>(
        "UPDATE sequences SET format = $2, layout = $3, epoch = $4, start_seq = $5, max_seq = $6, \
         reset = $7, timezone = $8, pool_size = $9, refill_at = $10, version = version + 1, \
         identity_version = identity_version + $11::int, updated_at = now() WHERE id = $1 RETURNING id",
    )
    .bind(id);
    bind_definition(query, d)
        .bind(i32::from(changes_identity))
        .fetch_one(&mut *conn)
        .await?;
    Ok(())
}

/// The definition's nine columns, in the order both statements list them.
pub(super) fn bind_definition<'q, O>(
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    d: &'q Definition,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    query
        .bind(d.format.as_str())
        .bind(layout_name(d))
        .bind(d.epoch())
        .bind(d.start)
        .bind(d.max)
        .bind(d.reset.as_str())
        .bind(d.timezone.name())
        .bind(d.pool_size as i32)
        .bind(d.refill_at)
}

pub(super) fn layout_name(d: &Definition) -> &'static str {
    match d.layout {
        Layout::Text => "text",
        Layout::Int64 { .. } => "int64",
    }
}
