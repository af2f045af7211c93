//! Reading the outbox as clients and operators see it: one document, and
//! pages of a project's or everyone's documents by a cursor.

use super::*;

/// One outbox row as operators and clients see it.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct DocumentView {
    #[schema(example = "PROJ-9012-1001")]
    pub id: String,
    #[schema(example = "PROJ")]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(example = "9012")]
    pub doc_type: String,
    #[schema(example = 1001)]
    pub seq: i64,
    pub status: DocumentStatus,
    /// Failed delivery attempts so far.
    pub retry_count: i32,
    pub last_error: Option<String>,
    /// When the next delivery attempt is due (pending documents only).
    pub next_retry_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// When it was delivered, dead-lettered or abandoned.
    pub processed_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    #[schema(ignore)]
    pub row_id: i64,
}

// `pending` spelt out: a constant needs a literal (DocumentStatus::Pending).
// A routed document has no due time of its own (its deliveries have
// theirs, `GET /api/v1/documents/{id}/deliveries`).
pub(super) const VIEW_COLUMNS: &str = "document_id AS id, tenant_code AS project, entity_type_id AS doc_type, \
     seq_number AS seq, status::text AS status, retry_count, last_error, \
     CASE WHEN status = 'pending' AND NOT routed THEN next_retry_at END AS next_retry_at, \
     created_at, processed_at, id AS row_id";

/// A document of one of `projects` (`None`: any project).
#[tracing::instrument(skip_all, level = "debug")]
pub async fn find(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<Option<DocumentView>, sqlx::Error> {
    let sql = format!(
        "SELECT {VIEW_COLUMNS} FROM id_outbox WHERE document_id = $1 \
         AND ($2::text[] IS NULL OR tenant_code = ANY($2))"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(document_id)
        .bind(projects)
        .fetch_optional(db)
        .await
}

pub struct ListFilter<'a> {
    pub status: Option<DocumentStatus>,
    /// The projects the caller may see; `None`: every project.
    pub projects: Option<&'a [String]>,
    pub project: Option<&'a str>,
    pub doc_type: Option<&'a str>,
    /// The document the previous page ended with.
    pub after: Option<&'a str>,
    pub limit: i64,
}

/// Why a page cannot be listed.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The cursor names no document the caller may see.
    #[error("the cursor is not one this API returned to this key")]
    Cursor,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// One page of documents.
///
/// A caller limited to some projects (or asking for one) gets them project
/// by project, each by type and then in the order they came, read from the
/// indexes that start with the tenant: each status asked for is walked from
/// the cursor for one page, and the walks are merged, so the page costs its
/// own size, whatever other tenants hold. An admin listing every project
/// walks the whole outbox in the order documents came.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list(db: &Db, filter: &ListFilter<'_>) -> Result<Vec<DocumentView>, ListError> {
    let projects: Option<Vec<String>> = match (filter.projects, filter.project) {
        (Some(scope), Some(one)) => Some(
            scope
                .iter()
                .filter(|p| p.as_str() == one)
                .cloned()
                .collect(),
        ),
        (Some(scope), None) => Some(scope.to_vec()),
        (None, Some(one)) => Some(vec![one.to_owned()]),
        (None, None) => None,
    };
    if projects.as_ref().is_some_and(Vec::is_empty) {
        return Ok(Vec::new());
    }
    let after = match filter.after {
        None => None,
        Some(document_id) => Some(
            cursor_position(db, document_id, projects.as_deref())
                .await?
                .ok_or(ListError::Cursor)?,
        ),
    };
    let Some(mut projects) = projects else {
        let after_row = after.map_or(0, |a| a.row);
        return Ok(list_everything(db, filter, after_row).await?);
    };
    projects.sort_unstable();
    projects.dedup();
    let limit = usize::try_from(filter.limit).unwrap_or(0);
    let mut page = Vec::new();
    for project in &projects {
        let start = match &after {
            Some(after) if after.project > *project => continue,
            Some(after) if after.project == *project => (after.doc_type.as_str(), after.row),
            _ => ("", 0),
        };
        let room = limit - page.len();
        if room == 0 {
            break;
        }
        page.extend(list_project(db, project, filter, start, room as i64).await?);
    }
    Ok(page)
}

/// Where a cursor's document stands in a project's listing.
pub(super) struct Position {
    project: String,
    doc_type: String,
    row: i64,
}

/// Up to `limit` documents of one project after `(type, row)`, by type and
/// then row: each status asked for walked on the index that starts with
/// the tenant (delivered documents and the others have one each), merged.
///
/// One statement per project, planned for the project it names (an
/// unnamed statement gets a plan for its values): a plan made for any
/// project could walk the whole outbox in row order, filtering, which costs
/// a small tenant the size of a large one.
pub(super) async fn list_project(
    db: &Db,
    project: &str,
    filter: &ListFilter<'_>,
    (after_type, after_row): (&str, i64),
    limit: i64,
) -> Result<Vec<DocumentView>, sqlx::Error> {
    let statuses: Vec<&str> = match filter.status {
        Some(status) => vec![status.as_str()],
        None => DocumentStatus::ALL.map(DocumentStatus::as_str).to_vec(),
    };
    let by_type = match filter.doc_type {
        Some(_) => "AND entity_type_id = $4",
        None => "AND $4::text IS NULL",
    };
    // Each status is one of four fixed words, spelt out so every branch
    // matches its partial index. The order is qualified: a bare `id` names
    // the output column (`document_id AS id`), which would sort by the
    // ID's text, unlike the cursor, and not along the index.
    let branches: Vec<String> = statuses
        .iter()
        .map(|status| {
            format!(
                "(SELECT {VIEW_COLUMNS} FROM id_outbox \
                  WHERE tenant_code = $1 AND status = '{status}' {by_type} \
                    AND (entity_type_id, id) > ($5, $2) \
                  ORDER BY id_outbox.entity_type_id, id_outbox.id LIMIT $3)"
            )
        })
        .collect();
    let sql = format!(
        "SELECT * FROM ({}) AS page ORDER BY doc_type, row_id LIMIT $3",
        branches.join(" UNION ALL ")
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .persistent(false)
        .bind(project)
        .bind(after_row)
        .bind(limit)
        .bind(filter.doc_type)
        .bind(after_type)
        .fetch_all(db)
        .await
}

/// Where the cursor's document stands, if the caller may see it (else the
/// cursor is refused exactly as one that names no document).
pub(super) async fn cursor_position(
    db: &Db,
    document_id: &str,
    projects: Option<&[String]>,
) -> Result<Option<Position>, sqlx::Error> {
    sqlx::query_as!(
        Position,
        "SELECT tenant_code AS project, entity_type_id AS doc_type, id AS row FROM id_outbox \
         WHERE document_id = $1 AND ($2::text[] IS NULL OR tenant_code = ANY($2))",
        document_id,
        projects,
    )
    .fetch_optional(db)
    .await
}

/// An admin's page of every project, in row order.
pub(super) async fn list_everything(
    db: &Db,
    filter: &ListFilter<'_>,
    after_row: i64,
) -> Result<Vec<DocumentView>, sqlx::Error> {
    // The status is spelt out in the SQL (it is one of four fixed words),
    // so the planner can use the index of unfinished documents for it.
    let status = match filter.status {
        Some(status) => format!("AND status = '{}'", status.as_str()),
        None => String::new(),
    };
    let sql = format!(
        "SELECT {VIEW_COLUMNS} FROM id_outbox \
         WHERE id > $1 {status} AND ($2::text IS NULL OR entity_type_id = $2) \
         ORDER BY id_outbox.id LIMIT $3"
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(after_row)
        .bind(filter.doc_type)
        .bind(filter.limit)
        .fetch_all(db)
        .await
}
