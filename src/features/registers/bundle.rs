//! The evidence bundle: everything an auditor needs to check a project's
//! registers with no database. JSON Lines: a header (the project, its
//! log's origin, every key that signed, every checkpoint), then every
//! entry in log order.
//!
//! The offline check reads it once: each entry's index, each chain link
//! by link ([`ChainCheck`]), the tree grown leaf by leaf, and at every
//! checkpoint's size the tree's root against the checkpoint's, whose
//! signature must verify by the key it names.

use std::collections::HashMap;
use std::io::{BufRead, Write};

use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::domain::merkle::Frontier;
use crate::domain::signed_note::{Checkpoint, NoteVerifier};
use crate::infra::db::Db;

use super::store;
use super::verify::{ChainCheck, Entry};

pub const FORMAT: &str = "idpool-register-bundle/1";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub project: String,
    pub keys: Vec<BundleKey>,
    pub checkpoints: Vec<BundleCheckpoint>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleKey {
    /// `<name>+<hash>+<base64>`.
    pub verifier: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BundleCheckpoint {
    pub size: i64,
    /// The signed note.
    pub note: String,
}

/// Writes project `project`'s bundle to `out`; the entries written.
pub async fn export(db: &Db, project: &str, out: &mut impl Write) -> anyhow::Result<u64> {
    // Checkpoints first: entries are only ever appended, so every
    // checkpoint read now is covered by the entries read after.
    let checkpoints = store::all_checkpoints(db, project).await?;
    let keys = store::keys(db).await?;
    let header = Header {
        format: FORMAT.into(),
        project: project.into(),
        keys: keys
            .into_iter()
            .map(|k| BundleKey {
                verifier: k.verifier,
            })
            .collect(),
        checkpoints: checkpoints
            .into_iter()
            .map(|c| BundleCheckpoint {
                size: c.size,
                note: c.note,
            })
            .collect(),
    };
    serde_json::to_writer(&mut *out, &header)?;
    out.write_all(b"\n")?;
    let mut written = 0;
    let mut entries = store::project_entries(db, project);
    while let Some(row) = entries.try_next().await? {
        serde_json::to_writer(&mut *out, &Entry::from(row))?;
        out.write_all(b"\n")?;
        written += 1;
    }
    out.flush()?;
    Ok(written)
}

/// What a bundle holds, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub entries: u64,
    pub chains: usize,
    /// Checkpoints whose signature and root held.
    pub checkpoints: usize,
    /// The size of the largest of them: entries past it are chained but
    /// not yet signed.
    pub signed_size: u64,
}

/// Why a bundle does not verify: it is wrong (evidence of a change), or
/// it, or what came with it, cannot be used (an unreadable file, a key
/// that is no key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    #[error("{0}")]
    Bad(String),
    #[error("{0}")]
    Unusable(String),
}

fn bad(why: String) -> Fault {
    Fault::Bad(why)
}

/// Checks a bundle read from `input`. With `trusted` keys (verifier
/// texts), every checkpoint must be signed by one of them; without, by one
/// of the bundle's own. `kept` are signed checkpoints the auditor kept
/// from before: the bundle must reach each one's size with its root (a
/// bundle rebuilt with fewer or other checkpoints does not).
pub fn verify(input: impl BufRead, trusted: &[String], kept: &[String]) -> Result<Checked, Fault> {
    let mut lines = input.lines();
    let header_line = lines
        .next()
        .ok_or_else(|| bad("the bundle is empty".into()))?
        .map_err(|e| Fault::Unusable(format!("reading the bundle: {e}")))?;
    let header: Header =
        serde_json::from_str(&header_line).map_err(|e| bad(format!("the bundle's header: {e}")))?;
    if header.format != FORMAT {
        return Err(bad(format!("not a bundle of format {FORMAT}")));
    }
    let key_texts: Vec<&String> = match trusted.is_empty() {
        true => header.keys.iter().map(|k| &k.verifier).collect(),
        false => trusted.iter().collect(),
    };
    let verifiers: Vec<NoteVerifier> = key_texts
        .iter()
        .map(|k| {
            NoteVerifier::parse(k).map_err(|e| match trusted.is_empty() {
                true => bad(format!("the bundle's key {k}: {e}")),
                false => Fault::Unusable(format!("--key {k}: {e}")),
            })
        })
        .collect::<Result<_, _>>()?;
    let signed_by_trusted = |note: &str, what: &str| -> Result<Checkpoint, Fault> {
        let text = verifiers
            .iter()
            .find_map(|v| v.verify(note).ok())
            .ok_or_else(|| bad(format!("{what}: no trusted key's signature verifies")))?;
        let signed = Checkpoint::parse(text).map_err(|e| bad(format!("{what}: {e}")))?;
        if !signed.origin.ends_with(&format!("/{}", header.project)) {
            return Err(bad(format!(
                "{what}: its origin {} is not project {}'s log",
                signed.origin, header.project
            )));
        }
        Ok(signed)
    };
    let mut checkpoints: Vec<(u64, Checkpoint)> = Vec::new();
    for c in &header.checkpoints {
        let signed = signed_by_trusted(&c.note, &format!("checkpoint {}", c.size))?;
        if signed.size != c.size as u64 {
            return Err(bad(format!(
                "checkpoint {}: its note says size {}",
                c.size, signed.size
            )));
        }
        checkpoints.push((signed.size, signed));
    }
    for (n, note) in kept.iter().enumerate() {
        let signed = signed_by_trusted(note, &format!("kept checkpoint {}", n + 1)).map_err(
            |e| match e {
                Fault::Bad(why) => Fault::Unusable(why),
                other => other,
            },
        )?;
        checkpoints.push((signed.size, signed));
    }
    checkpoints.sort_by_key(|(size, _)| *size);
    let mut next_checkpoint = checkpoints.iter().peekable();
    let mut tree = Frontier::default();
    let mut chains: HashMap<String, ChainCheck> = HashMap::new();
    let mut verified = 0;
    for line in lines {
        let line = line.map_err(|e| Fault::Unusable(format!("reading the bundle: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let index = tree.size();
        let entry: Entry = serde_json::from_str(&line)
            .map_err(|e| bad(format!("entry at index {index}: not an entry: {e}")))?;
        if entry.index as u64 != index {
            return Err(bad(format!(
                "index {index}: the entry there says index {} (an entry removed or moved)",
                entry.index
            )));
        }
        let check = chains
            .entry(entry.chain.clone())
            .or_insert_with(|| ChainCheck::new(&entry.chain));
        if let Err(broken) = check.check(&entry) {
            return Err(bad(format!(
                "chain {} entry {}{}: {}",
                entry.chain,
                broken.seq,
                broken.id.map(|id| format!(" ({id})")).unwrap_or_default(),
                broken.why
            )));
        }
        tree.push(entry.body.as_bytes());
        while let Some((size, checkpoint)) = next_checkpoint.peek() {
            if *size != tree.size() {
                break;
            }
            if tree.root() != checkpoint.root {
                return Err(bad(format!(
                    "the tree of the first {size} entries does not have checkpoint {size}'s root \
                     (an entry before index {size} was changed)"
                )));
            }
            verified += 1;
            next_checkpoint.next();
        }
    }
    if let Some((size, _)) = next_checkpoint.next() {
        return Err(bad(format!(
            "checkpoint {size} covers more entries than the bundle's {} (entries removed)",
            tree.size()
        )));
    }
    // Nothing signed proves nothing, an empty register included: a bundle
    // stripped of every entry and checkpoint would read as one.
    if checkpoints.is_empty() {
        return Err(bad(format!(
            "no signed checkpoint covers any of the bundle's {} entries",
            tree.size()
        )));
    }
    Ok(Checked {
        entries: tree.size(),
        chains: chains.len(),
        checkpoints: verified,
        signed_size: checkpoints.last().map(|(s, _)| *s).unwrap_or(0),
    })
}
