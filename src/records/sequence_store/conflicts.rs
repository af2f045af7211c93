//! Two sequences must never print the same ID: a definition is checked
//! against the project's others and every other project's before it is
//! stored.

use super::*;

/// The pattern of a stored (or retired) definition. One stored before the
/// reading rule existed still tells what it could print.
pub(super) fn stored_pattern(
    layout: &str,
    format: &str,
    project: &str,
    doc_type: &str,
    max_digits: usize,
) -> Option<Pattern> {
    if layout == "int64" {
        return Some(Pattern::number(19, "the int64 layout"));
    }
    let template = Template::parse(format).ok()?;
    Some(Pattern::loose(
        template.parts(project, doc_type, max_digits),
    ))
}

/// Every pattern the project's sequences print or printed. With
/// `skip_default`, sequences printing the default format are left out: two
/// of them never print alike (a code holds no `-`), so a project of
/// default sequences costs nothing to check.
pub(super) async fn project_patterns(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    skip_default: bool,
) -> Result<Vec<Printed>, StoreError> {
    let rows: Vec<(i64, String, String, String, Option<i64>, bool)> = sqlx::query!(
        "SELECT s.id AS \"id!\", s.doc_type AS \"doc_type!\", s.layout AS \"layout!\", \
                s.format AS \"format!\", s.max_seq, true AS \"current!\" FROM sequences s \
          WHERE s.project = $1 AND NOT ($2 AND s.layout = 'text' AND s.format = $3) \
         UNION ALL \
         SELECT s.id, s.doc_type, f.layout, f.format, NULL, false FROM sequence_formats f \
           JOIN sequences s ON s.id = f.sequence_id \
          WHERE s.project = $1 AND NOT ($2 AND f.layout = 'text' AND f.format = $3)",
        project.as_str(),
        skip_default,
        DEFAULT_FORMAT,
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.id, r.doc_type, r.layout, r.format, r.max_seq, r.current))
    .collect();
    Ok(rows
        .into_iter()
        .filter_map(|(id, doc_type, layout, format, max, current)| {
            let digits = max.map_or(19, |m| m.max(0).to_string().len());
            let pattern = stored_pattern(&layout, &format, project.as_str(), &doc_type, digits)?;
            let name = if current {
                format!("{project}/{doc_type}")
            } else {
                format!("{project}/{doc_type} printed with its earlier format {format:?}")
            };
            Some(Printed {
                sequence_id: id,
                name,
                pattern,
            })
        })
        .collect())
}

/// [`project_patterns`] of many projects at once, without their default
/// sequences (what a new default sequence is checked against), by project.
pub(super) async fn non_default_patterns(
    conn: &mut Tx<'_>,
    projects: &[&str],
) -> Result<std::collections::HashMap<String, Vec<Printed>>, StoreError> {
    let rows = sqlx::query!(
        "SELECT s.project AS \"project!\", s.id AS \"id!\", s.doc_type AS \"doc_type!\", \
                s.layout AS \"layout!\", s.format AS \"format!\", s.max_seq, true AS \"current!\" \
           FROM sequences s \
          WHERE s.project = ANY($1) AND NOT (s.layout = 'text' AND s.format = $2) \
         UNION ALL \
         SELECT s.project, s.id, s.doc_type, f.layout, f.format, NULL, false FROM sequence_formats f \
           JOIN sequences s ON s.id = f.sequence_id \
          WHERE s.project = ANY($1) AND NOT (f.layout = 'text' AND f.format = $2)",
        projects as &[&str],
        DEFAULT_FORMAT,
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut by_project: std::collections::HashMap<String, Vec<Printed>> =
        std::collections::HashMap::new();
    for r in rows {
        let digits = r.max_seq.map_or(19, |m| m.max(0).to_string().len());
        let Some(pattern) = stored_pattern(&r.layout, &r.format, &r.project, &r.doc_type, digits)
        else {
            continue;
        };
        let name = if r.current {
            format!("{}/{}", r.project, r.doc_type)
        } else {
            format!(
                "{}/{} printed with its earlier format {:?}",
                r.project, r.doc_type, r.format
            )
        };
        by_project.entry(r.project).or_default().push(Printed {
            sequence_id: r.id,
            name,
            pattern,
        });
    }
    Ok(by_project)
}

/// Refuses `definition` for `project`/`doc_type` when its IDs could read
/// like IDs another sequence of the project prints or printed. The
/// sequence's own earlier formats are checked when it is changed.
pub(super) async fn check_against_project(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    doc_type: &TypeCode,
    own_id: Option<i64>,
    definition: &Definition,
) -> Result<(), StoreError> {
    let pattern = definition
        .pattern(project.as_str(), doc_type.as_str())
        .map_err(DefinitionError::from)?;
    let is_default =
        definition.layout == Layout::Text && definition.format.as_str() == DEFAULT_FORMAT;
    for printed in project_patterns(conn, project, is_default).await? {
        if Some(printed.sequence_id) == own_id {
            continue;
        }
        if let Some(example) = pattern.common_example(&printed.pattern) {
            return Err(StoreError::Conflict {
                sequence: format!("{project}/{doc_type}"),
                other: format!("of {}", printed.name),
                example,
            });
        }
    }
    Ok(())
}

/// What any project's default sequences print: `{project}-{type}-{seq}`
/// with any codes. A code holds no `-`, so the text before the first `-`
/// names the project.
pub(super) fn default_of_any_project() -> Pattern {
    use crate::domain::sequence::pattern::{CharSet, Field, Part};
    let code = |label: &str| {
        Part::Field(Field {
            min: 1,
            max: crate::domain::sequence::name::MAX_CODE_LEN,
            chars: CharSet::LETTERS
                .union(CharSet::DIGITS)
                .union(CharSet::of(b"_")),
            seq: None,
            label: label.to_owned(),
        })
    };
    Pattern::loose(vec![
        code("{project}"),
        Part::Text("-".into()),
        code("{type}"),
        Part::Text("-".into()),
        Part::Field(Field {
            min: 1,
            max: 19,
            chars: CharSet::DIGITS,
            seq: Some(0),
            label: "{seq}".into(),
        }),
    ])
}

/// Serialises every definition that could clash across projects, so two
/// of them saved at once cannot each pass the check against the other's
/// old state.
pub(super) async fn lock_formats(conn: &mut Tx<'_>) -> Result<(), StoreError> {
    sqlx::query_scalar!("SELECT pg_advisory_xact_lock(hashtextextended('idpool:formats', 0))")
        .fetch_one(&mut *conn)
        .await?;
    Ok(())
}

/// Refuses `definition` when its IDs could read like IDs of another
/// project: like those its default sequences print (now or once they are
/// first used), or like those its other sequences print or printed. Then
/// a document ID never blocks or reveals another tenant's. Definitions
/// with the default format pass: what they print starts with their own
/// project code and a `-`, and every other definition was checked against
/// that when it was saved.
pub(super) async fn check_against_other_projects(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    doc_type: &TypeCode,
    definition: &Definition,
) -> Result<(), StoreError> {
    if definition.layout == Layout::Text && definition.format.as_str() == DEFAULT_FORMAT {
        return Ok(());
    }
    lock_formats(conn).await?;
    let sequence = format!("{project}/{doc_type}");
    let pattern = definition
        .pattern(project.as_str(), doc_type.as_str())
        .map_err(DefinitionError::from)?;
    let own_prefix = format!("{project}-");
    let starts_with_own_code = matches!(pattern.parts().first(),
        Some(Part::Text(text)) if text.starts_with(&own_prefix));
    if !starts_with_own_code
        && let Some(example) = pattern.common_example(&default_of_any_project())
    {
        return Err(StoreError::Conflict {
            sequence,
            other: format!(
                "another project's sequences print with the default format {DEFAULT_FORMAT} \
                 (start the format with {{project}}- to keep this project's IDs its own)"
            ),
            example,
        });
    }
    let offsets = definition.int64_day_offsets();
    // Two formats that each begin with their own project's code and a `-`
    // never print alike (a code holds no `-`): with such a format, those of
    // other projects are not even read, so a PUT costs what the
    // installation's other kinds of formats number, not its projects.
    for other in other_projects_definitions(conn, project, starts_with_own_code).await? {
        let clash = match (&offsets, other.int64_offsets()) {
            // Two int64 layouts clash only if their days can start at the
            // same time of day after their epochs.
            (Some(mine), Some(theirs)) => {
                if mine.is_disjoint(&theirs) {
                    None
                } else {
                    Some(int64_example(definition, &theirs))
                }
            }
            _ => other
                .pattern
                .as_ref()
                .and_then(|p| pattern.common_example(p)),
        };
        if let Some(example) = clash {
            return Err(StoreError::Conflict {
                sequence,
                other: format!("of {} (another project)", other.name),
                example,
            });
        }
    }
    Ok(())
}

/// A sequence of another project, as the cross-project check sees it.
pub(super) struct OtherDefinition {
    name: String,
    pattern: Option<Pattern>,
    /// Its definition when it has the int64 layout (current, not retired).
    int64: Option<Definition>,
}

impl OtherDefinition {
    fn int64_offsets(&self) -> Option<std::collections::BTreeSet<i64>> {
        self.int64.as_ref().and_then(Definition::int64_day_offsets)
    }
}

/// Every definition of other projects that does not print the default
/// format, with the formats they printed before a forced change; with
/// `skip_own_prefixed`, none whose format begins with `{project}-`.
pub(super) async fn other_projects_definitions(
    conn: &mut Tx<'_>,
    project: &ProjectCode,
    skip_own_prefixed: bool,
) -> Result<Vec<OtherDefinition>, StoreError> {
    let current = sequence_rows!(
        "SELECT",
        "FROM sequences WHERE project <> $1 AND NOT (layout = 'text' AND format = $2) \
           AND NOT ($3 AND layout = 'text' AND starts_with(format, '{project}-'))",
        project.as_str(),
        DEFAULT_FORMAT,
        skip_own_prefixed,
    )
    .fetch_all(&mut *conn)
    .await?;
    let retired: Vec<(String, String, String, String)> = sqlx::query!(
        "SELECT s.project, s.doc_type, f.layout, f.format FROM sequence_formats f \
         JOIN sequences s ON s.id = f.sequence_id \
         WHERE s.project <> $1 AND NOT (f.layout = 'text' AND f.format = $2) \
           AND NOT ($3 AND f.layout = 'text' AND starts_with(f.format, '{project}-'))",
        project.as_str(),
        DEFAULT_FORMAT,
        skip_own_prefixed,
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| (r.project, r.doc_type, r.layout, r.format))
    .collect();
    let mut others = Vec::with_capacity(current.len() + retired.len());
    for row in current {
        let sequence = row.into_sequence()?;
        let name = format!("{}/{}", sequence.project, sequence.doc_type);
        let pattern = sequence
            .definition
            .pattern(sequence.project.as_str(), sequence.doc_type.as_str())
            .ok();
        let int64 = matches!(sequence.definition.layout, Layout::Int64 { .. })
            .then(|| sequence.definition.clone());
        others.push(OtherDefinition {
            name,
            pattern,
            int64,
        });
    }
    for (other_project, other_type, layout, format) in retired {
        others.push(OtherDefinition {
            name: format!(
                "{other_project}/{other_type} printed with its earlier format {format:?}"
            ),
            pattern: stored_pattern(&layout, &format, &other_project, &other_type, 19),
            int64: None,
        });
    }
    Ok(others)
}

/// A number both int64 definitions could print: the first number of a day
/// whose start lies at a time of day `theirs` holds too.
pub(super) fn int64_example(
    definition: &Definition,
    theirs: &std::collections::BTreeSet<i64>,
) -> String {
    let mine = definition.int64_day_offsets().unwrap_or_default();
    let shared = mine.intersection(theirs).next().copied().unwrap_or(0);
    ((shared << 32) | definition.start.max(1)).to_string()
}
