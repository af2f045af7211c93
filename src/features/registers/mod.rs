//! Registers an auditor can verify (SPEC "Registers an auditor can
//! verify"): gapless sequences whose every event appends a hash-chained
//! entry (the triggers of `0016_registers.sql` write them, in the commit of
//! the event), each project's entries the leaves of an RFC 6962 tree whose
//! checkpoints are signed here ([`Registers::sign_checkpoints`]), with
//! proofs, online verification, and an evidence bundle checked offline
//! ([`bundle`]).

pub mod bundle;
pub mod store;
pub mod verify;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::domain::merkle::{self, Hash, NodeId, Nodes, NodesWanted};
use crate::domain::sequence::{Register, Sequence};
use crate::domain::signed_note::{Checkpoint, NoteSigner, NoteVerifier};
use crate::infra::backoff::Backoff;
use crate::infra::db::Db;
use crate::infra::fair::{FairSlots, Turn};
use crate::infra::retrying::Retrying;
use verify::{ChainCheck, Entry};

/// Where the signing key comes from (`IDPOOL_REGISTER_KEY_FILE`,
/// `IDPOOL_REGISTER_KEY`): a note signer's private key text. Without one,
/// the installation makes a key and keeps it in Postgres.
#[derive(Debug, Clone, Default)]
pub struct RegisterSettings {
    pub key: Option<String>,
    /// The first part of every log's origin line: `<origin>/<project>`.
    pub origin: String,
    pub checkpoint_interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("{0}")]
    Invalid(String),
    #[error("the project's log has {size} entries; {what}")]
    OutOfRange { size: i64, what: String },
    #[error("the register's data is incomplete: {0}")]
    Incomplete(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// An entry as the API shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EntryView {
    /// Its position in its chain (1, 2, ...).
    pub seq: i64,
    /// The ID the event is about.
    pub id: String,
    /// The number it prints.
    pub number: i64,
    /// `attached`, `voided`, `expired` or `annulled` (VERI*FACTU).
    pub event: String,
    /// The exact bytes hashed (RFC 8785 JSON, or AEAT's text).
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
    /// Its leaf's index in the project's tree.
    pub index: i64,
    pub at: DateTime<Utc>,
}

impl From<store::EntryRow> for EntryView {
    fn from(row: store::EntryRow) -> Self {
        Self {
            seq: row.seq,
            id: row.id,
            number: row.number,
            event: row.event,
            body: row.body,
            prev_hash: row.prev_hash,
            hash: row.hash,
            index: row.log_index,
            at: row.at,
        }
    }
}

/// What verifying a chain found.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Verification {
    pub ok: bool,
    /// Entries checked and found good.
    pub entries: i64,
    /// The last good entry's hash (empty when there is none).
    pub head: String,
    /// The first entry that is not what it should be.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_bad_seq: Option<i64>,
    /// The ID of that entry, when it is there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_bad_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// A signing key as published.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PublicKey {
    /// The key's name, as checkpoint signatures name it.
    pub name: String,
    /// The verifier key, `<name>+<hash>+<base64>` (Go's `note` format).
    #[schema(example = "idpool+1a2b3c4d+AQ...")]
    pub verifier: String,
    /// When the installation first signed with it.
    pub first_used: DateTime<Utc>,
    /// Whether it signs new checkpoints.
    pub current: bool,
}

/// The chain a register's sequence links into.
pub fn chain_of(sequence: &Sequence) -> Option<String> {
    match &sequence.definition.register {
        Register::None => None,
        Register::Chain => Some(format!("s:{}", sequence.id)),
        Register::Verifactu { issuer } => Some(format!("v:{issuer}")),
    }
}

pub struct Registers {
    /// Requests' reads.
    db: Db,
    /// The checkpoints' signing.
    background_db: Db,
    /// `IDPOOL_REGISTER_KEY(_FILE)`'s key, if one was given.
    configured: Option<NoteSigner>,
    /// The key that signs, once recorded (at the first checkpoint).
    signer: tokio::sync::OnceCell<NoteSigner>,
    origin: String,
    /// Verifications running at once on this instance (each reads a
    /// project's whole log): 2 in all, one per key, handed out fairly.
    verifying: Arc<FairSlots>,
    /// The published keys, read again at most every few seconds: the route
    /// is open to anyone, so no caller makes it read Postgres more often.
    published: tokio::sync::Mutex<Option<(std::time::Instant, Vec<PublicKey>)>>,
}

/// How long the published keys are served from memory.
const PUBLISHED_FOR: Duration = Duration::from_secs(10);

impl Registers {
    /// The service. A configured key is read now (a malformed one stops
    /// the start); nothing is written to Postgres until the first
    /// checkpoint is signed, so an instance starts on a standby.
    pub fn new(db: Db, background_db: Db, settings: &RegisterSettings) -> anyhow::Result<Self> {
        let configured = match &settings.key {
            Some(text) => Some(
                NoteSigner::parse(text)
                    .map_err(|e| anyhow::anyhow!("IDPOOL_REGISTER_KEY(_FILE): {e}"))?,
            ),
            None => None,
        };
        // A name made now, checked now: a key the installation makes
        // carries it.
        NoteSigner::from_seed(&settings.origin, [0; 32])
            .map_err(|e| anyhow::anyhow!("IDPOOL_REGISTER_ORIGIN: {e}"))?;
        Ok(Self {
            db,
            background_db,
            configured,
            signer: tokio::sync::OnceCell::new(),
            origin: settings.origin.clone(),
            verifying: FairSlots::new(2, 1),
            published: tokio::sync::Mutex::new(None),
        })
    }

    /// The signing key, once recorded: the configured one, or the
    /// installation's own (made once, kept in Postgres; two instances
    /// making one at once keep the first). A key not seen before is
    /// published from then on beside the older ones.
    async fn signer(&self) -> Result<&NoteSigner, RegisterError> {
        self.signer
            .get_or_try_init(|| async {
                let db = &self.background_db;
                let signer = match &self.configured {
                    Some(signer) => signer.clone(),
                    None => {
                        if store::generated_key(db).await?.is_none() {
                            let made = NoteSigner::from_seed(&self.origin, rand::random())
                                .map_err(|e| RegisterError::Invalid(e.to_string()))?;
                            store::record_key(
                                db,
                                &key_id(&made),
                                &made.verifier().text(),
                                Some(&made.private_text()),
                            )
                            .await?;
                        }
                        let kept = store::generated_key(db).await?.ok_or_else(|| {
                            RegisterError::Incomplete("the register key was not kept".into())
                        })?;
                        NoteSigner::parse(kept.private_key.as_deref().unwrap_or_default())
                            .map_err(|e| RegisterError::Incomplete(e.to_string()))?
                    }
                };
                store::record_key(db, &key_id(&signer), &signer.verifier().text(), None).await?;
                Ok(signer)
            })
            .await
    }

    fn origin_of(&self, project: &str) -> String {
        format!("{}/{project}", self.origin)
    }

    /// Up to `limit` entries of the sequence's chain from position `from`.
    pub async fn entries(
        &self,
        sequence: &Sequence,
        from: i64,
        limit: i64,
    ) -> Result<Vec<EntryView>, RegisterError> {
        let Some(chain) = chain_of(sequence) else {
            return Ok(Vec::new());
        };
        let rows =
            store::chain_page(&self.db, sequence.project.as_str(), &chain, from, limit).await?;
        Ok(rows.into_iter().map(EntryView::from).collect())
    }

    /// Checks the sequence's chain from its first entry (each entry's
    /// position, hash, link and body) while it reads the whole project's
    /// log in order, growing its tree as an auditor's verifier does: the
    /// tree of the latest checkpoint's size must have the checkpoint's
    /// root, and the checkpoint a signature by the key it names. So an
    /// entry changed and its chain rehashed after it shows too.
    /// A turn to verify, for the key `caller`: taken before anything else
    /// of the request (a database turn), so a key's queued verifications
    /// hold nothing another key needs.
    pub async fn verify_turn(&self, caller: &str) -> Turn {
        self.verifying.acquire(caller).await
    }

    pub async fn verify(&self, sequence: &Sequence) -> Result<Verification, RegisterError> {
        let Some(chain) = chain_of(sequence) else {
            return Err(RegisterError::Invalid("not a register".into()));
        };
        let project = sequence.project.as_str();
        let signed = self.signed_checkpoint(project).await?;
        let mut check = ChainCheck::new(&chain);
        let mut tree = merkle::Frontier::default();
        let mut tree_problem = None;
        let mut entries = store::project_entries(&self.db, project);
        while let Some(row) = entries.try_next().await? {
            tree.push(row.body.as_bytes());
            if let Ok(Some(signed)) = &signed
                && tree.size() == signed.size
                && tree.root() != signed.root
            {
                tree_problem = Some(format!(
                    "the tree of the project's first {} entries does not have the signed \
                     checkpoint's root: an entry before index {} was changed",
                    signed.size, signed.size
                ));
            }
            if row.chain != chain {
                continue;
            }
            let entry = Entry::from(row);
            if let Err(broken) = check.check(&entry) {
                return Ok(self.broken(&check, broken.seq, broken.id, broken.why));
            }
        }
        let problem = match signed {
            Err(why) => Some(why),
            Ok(Some(signed)) if tree.size() < signed.size => Some(format!(
                "the signed checkpoint covers {} entries; the log holds {}: entries were removed",
                signed.size,
                tree.size()
            )),
            Ok(_) => tree_problem,
        };
        Ok(Verification {
            ok: problem.is_none(),
            entries: check.checked(),
            head: check.head().to_owned(),
            first_bad_seq: None,
            first_bad_id: None,
            why: problem,
        })
    }

    fn broken(
        &self,
        check: &ChainCheck,
        seq: i64,
        id: Option<String>,
        why: String,
    ) -> Verification {
        Verification {
            ok: false,
            entries: check.checked(),
            head: check.head().to_owned(),
            first_bad_seq: Some(seq),
            first_bad_id: id,
            why: Some(why),
        }
    }

    /// The project's latest checkpoint as signed (None before the first),
    /// or what is wrong with it: a signature that does not verify by the
    /// key it names, or a checkpoint of another log.
    async fn signed_checkpoint(
        &self,
        project: &str,
    ) -> Result<Result<Option<Checkpoint>, String>, RegisterError> {
        let Some(latest) = store::latest_checkpoint(&self.db, project).await? else {
            return Ok(Ok(None));
        };
        let keys = store::keys(&self.db).await?;
        let Some(key) = keys.iter().find(|k| k.key_name == latest.key_name) else {
            return Ok(Err(format!(
                "checkpoint {} names an unknown key",
                latest.size
            )));
        };
        let Ok(verifier) = NoteVerifier::parse(&key.verifier) else {
            return Ok(Err(format!(
                "the key of checkpoint {} is not a key",
                latest.size
            )));
        };
        let signed = verifier
            .verify(&latest.note)
            .ok()
            .and_then(|text| Checkpoint::parse(text).ok())
            .filter(|c| c.size == latest.size as u64 && c.origin == self.origin_of(project));
        Ok(match signed {
            Some(signed) => Ok(Some(signed)),
            None => Err(format!(
                "checkpoint {}'s signature does not verify, or it is not this log's",
                latest.size
            )),
        })
    }

    /// Computes from stored perfect subtrees (two round trips: which
    /// nodes, then the computation).
    async fn computed_from_nodes<T>(
        &self,
        project: &str,
        compute: impl Fn(&mut dyn FnMut(NodeId) -> Option<Hash>) -> Option<T>,
    ) -> Result<T, RegisterError> {
        let mut wanted = NodesWanted::default();
        compute(&mut |id| wanted.node(id));
        let mut found = store::nodes(&self.db, project, &wanted.0).await?;
        compute(&mut |id| found.node(id))
            .ok_or_else(|| RegisterError::Incomplete("a node of the tree is missing".into()))
    }

    async fn log_size(&self, project: &str) -> Result<i64, RegisterError> {
        Ok(store::log_size(&self.db, project).await?.unwrap_or(0))
    }

    /// The inclusion proof of leaf `index` in the tree of `size` leaves.
    pub async fn inclusion(
        &self,
        project: &str,
        index: i64,
        size: i64,
    ) -> Result<Vec<Hash>, RegisterError> {
        let log = self.log_size(project).await?;
        if !(0 <= index && index < size && size <= log) {
            return Err(RegisterError::OutOfRange {
                size: log,
                what: "index must be below tree_size, and tree_size at most that".into(),
            });
        }
        self.computed_from_nodes(project, |nodes| {
            merkle::inclusion_proof(&mut FnNodes(nodes), index as u64, size as u64)
        })
        .await
    }

    /// The consistency proof from the tree of `from` leaves to `to`.
    pub async fn consistency(
        &self,
        project: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<Hash>, RegisterError> {
        let log = self.log_size(project).await?;
        if !(0 < from && from <= to && to <= log) {
            return Err(RegisterError::OutOfRange {
                size: log,
                what: "0 < from ≤ to ≤ that".into(),
            });
        }
        self.computed_from_nodes(project, |nodes| {
            merkle::consistency_proof(&mut FnNodes(nodes), from as u64, to as u64)
        })
        .await
    }

    /// The project's latest signed checkpoint (the note's text).
    pub async fn checkpoint(&self, project: &str) -> Result<Option<String>, RegisterError> {
        Ok(store::latest_checkpoint(&self.db, project)
            .await?
            .map(|c| c.note))
    }

    /// Every key that ever signed, the current one marked.
    pub async fn public_keys(&self) -> Result<Vec<PublicKey>, RegisterError> {
        let mut published = self.published.lock().await;
        if let Some((at, keys)) = &*published
            && at.elapsed() < PUBLISHED_FOR
        {
            return Ok(keys.clone());
        }
        let keys = self.read_public_keys().await?;
        *published = Some((std::time::Instant::now(), keys.clone()));
        Ok(keys)
    }

    async fn read_public_keys(&self) -> Result<Vec<PublicKey>, RegisterError> {
        // The key that will sign is published before its first checkpoint
        // (on a standby nothing can be recorded: the keys recorded so far).
        if let Err(e) = self.signer().await {
            tracing::debug!(error = %e, "the register key is not recorded yet");
        }
        // Which key signs: the one in use, the configured one, or the
        // installation's own.
        let current = match (self.signer.get(), &self.configured) {
            (Some(signer), _) | (None, Some(signer)) => Some(key_id(signer)),
            (None, None) => store::generated_key(&self.db).await?.map(|k| k.key_name),
        };
        Ok(store::keys(&self.db)
            .await?
            .into_iter()
            .map(|k| PublicKey {
                current: Some(&k.key_name) == current.as_ref(),
                name: NoteVerifier::parse(&k.verifier)
                    .map(|v| v.name().to_owned())
                    .unwrap_or_default(),
                verifier: k.verifier,
                first_used: k.first_used,
            })
            .collect())
    }

    /// Signs a checkpoint of every project whose log grew since its last
    /// one; how many were signed.
    pub async fn sign_checkpoints(&self) -> Result<usize, RegisterError> {
        let mut signed = 0;
        loop {
            let logs = store::logs_to_checkpoint(&self.background_db, 500).await?;
            if logs.is_empty() {
                return Ok(signed);
            }
            for (project, size, frontier) in logs {
                let checkpoint = Checkpoint {
                    origin: self.origin_of(&project),
                    size: size as u64,
                    root: root_of_frontier(&frontier),
                };
                let signer = self.signer().await?;
                let note = signer.sign(&checkpoint.text());
                store::insert_checkpoint(
                    &self.background_db,
                    &project,
                    size,
                    &checkpoint.root,
                    &note,
                    &key_id(signer),
                )
                .await?;
                signed += 1;
            }
        }
    }

    /// Signs checkpoints every `interval` while entries arrive (woken
    /// early by appends' notifications), until `stop`.
    pub async fn run_checkpoints(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = Retrying::with(
            "signing register checkpoints failed; next try in an interval",
            Backoff::between(interval, interval.max(Duration::from_secs(10))),
        );
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.sign_checkpoints().await {
                Ok(_) => failures.succeeded(),
                Err(e) => {
                    // Failing: tried again after a growing pause, not at
                    // every tick.
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(failures.failed(&e)) => {}
                    }
                    tick.reset();
                }
            }
        }
    }

    pub fn db(&self) -> &Db {
        &self.db
    }
}

/// A key's row name: its verifier's name and hash (a rotated key of the
/// same name is another key).
fn key_id(signer: &NoteSigner) -> String {
    let text = signer.verifier().text();
    let mut parts = text.splitn(3, '+');
    format!(
        "{}+{}",
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default()
    )
}

/// The root from a log's frontier as stored (`frontier[l]`: the perfect
/// subtree of 2^l leaves, where bit l of the size is set).
fn root_of_frontier(frontier: &[Option<Vec<u8>>]) -> Hash {
    let mut acc: Option<Hash> = None;
    for subtree in frontier.iter().flatten() {
        let Ok(subtree) = Hash::try_from(subtree.as_slice()) else {
            continue;
        };
        acc = Some(match acc {
            None => subtree,
            Some(right) => merkle::node_hash(&subtree, &right),
        });
    }
    acc.unwrap_or_else(merkle::empty_root)
}

/// A closure as a node source.
struct FnNodes<'a>(&'a mut dyn FnMut(NodeId) -> Option<Hash>);

impl Nodes for FnNodes<'_> {
    fn node(&mut self, id: NodeId) -> Option<Hash> {
        (self.0)(id)
    }
}
