//! The one Idempotency-Key flow every keyed route runs: claim the keys,
//! replay what was answered before, do the rest of the work, store its
//! answers, commit — all in one transaction, so a retry gets the same
//! answer and burns nothing.

use std::collections::HashMap;

use crate::infra::db::Tx;
use axum::extract::FromRequestParts;
use axum::http::HeaderValue;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::AppState;
use super::problem::{ApiError, db_error, key_reused};
use crate::records::idempotency::{self, ClaimWitness, Claimed, Owner};

/// The `Idempotency-Key` header, validated, if sent.
pub struct IdempotencyKey(pub Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let mut sent = parts.headers.get_all("idempotency-key").iter();
        let Some(value) = sent.next() else {
            return Ok(Self(None));
        };
        // Two keys: which one the client meant is a guess, and a wrong
        // guess replays another request's answer.
        if sent.next().is_some() {
            return Err(ApiError::bad_request(
                "invalid_idempotency_key",
                "send one Idempotency-Key header, not several",
            ));
        }
        let key = value
            .to_str()
            .map_err(|_| idempotency::IdempotencyKeyError::Malformed)?;
        idempotency::validate_key(key)?;
        Ok(Self(Some(key.to_owned())))
    }
}

/// An item's key and the fingerprint of what it asks.
pub struct Keyed {
    pub key: String,
    pub fingerprint: Vec<u8>,
}

/// One item's answer, and whether it repeats an earlier one.
pub struct Answer {
    pub body: Value,
    pub replayed: bool,
}

/// Says on `response` that it answers a retry, when it does.
pub fn mark_replayed(response: &mut Response, replayed: bool) {
    if replayed {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
}

/// The answer of a request of one item, as sent: 200 with its body.
pub fn only_answer(answers: Vec<Answer>) -> Result<Response, ApiError> {
    let Some(Answer { body, replayed }) = answers.into_iter().next() else {
        return Err(ApiError::internal("no answer"));
    };
    let mut response = axum::Json(body).into_response();
    mark_replayed(&mut response, replayed);
    Ok(response)
}

/// What becomes of an item.
enum Fate {
    Work,
    Replay(Value),
    /// The same key and request as an earlier item of this request.
    Mirror(usize),
}

/// Runs `work` in one transaction for the items that are not answered
/// already, and returns every item's answer, in order. `work` gets the
/// indexes of the items to do and returns their answers in that order
/// (`replayed` when it found one made earlier, by a source id);
/// they are stored under the items' keys (with `status`) in the same
/// commit. `itemized` names the item at fault in errors (a batch).
pub async fn run<W>(
    state: &AppState,
    caller: &Owner,
    keys: &[Option<Keyed>],
    status: u16,
    itemized: bool,
    work: W,
) -> Result<Vec<Answer>, ApiError>
where
    W: AsyncFnOnce(&mut Tx<'_>, &[usize]) -> Result<Vec<Answer>, ApiError>,
{
    let at = |e: ApiError, index: usize| if itemized { e.at_index(index) } else { e };
    let (fates, to_claim) = fates(keys).map_err(|index| at(key_reused(), index))?;
    // An error answer means nothing was written: see `answer_in_transaction`.
    let witness = ClaimWitness::new(
        caller,
        to_claim
            .iter()
            .filter_map(|i| keys[*i].as_ref())
            .map(|k| k.key.as_str())
            .collect(),
    );
    let (answers, fates) = state
        .issuer
        .transaction(&witness, async |tx| {
            claim_and_work(tx, caller, keys, status, fates, &to_claim, at, work).await
        })
        .await?;
    complete(answers, fates)
}

/// The body of [`run`]'s transaction: claims, the work, the stored answers.
#[allow(clippy::too_many_arguments)]
async fn claim_and_work<W>(
    tx: &mut Tx<'_>,
    caller: &Owner,
    keys: &[Option<Keyed>],
    status: u16,
    mut fates: Vec<Fate>,
    to_claim: &[usize],
    at: impl Fn(ApiError, usize) -> ApiError,
    work: W,
) -> Result<(Vec<Option<Answer>>, Vec<Fate>), ApiError>
where
    W: AsyncFnOnce(&mut Tx<'_>, &[usize]) -> Result<Vec<Answer>, ApiError>,
{
    if !to_claim.is_empty() {
        let claims: Vec<(String, Vec<u8>)> = to_claim
            .iter()
            .filter_map(|i| keys[*i].as_ref())
            .map(|k| (k.key.clone(), k.fingerprint.clone()))
            .collect();
        let claimed = claim(tx, caller, &claims).await?;
        for (claimed, index) in claimed.into_iter().zip(to_claim) {
            match claimed {
                Claimed::New => {}
                Claimed::Replay(stored) => fates[*index] = Fate::Replay(stored.response),
                Claimed::Mismatch => return Err(at(key_reused(), *index)),
            }
        }
    }
    let fresh: Vec<usize> = (0..keys.len())
        .filter(|i| matches!(fates[*i], Fate::Work))
        .collect();
    let done = if fresh.is_empty() {
        Vec::new()
    } else {
        work(tx, &fresh).await?
    };
    let mut answers: Vec<Option<Answer>> = (0..keys.len()).map(|_| None).collect();
    for (index, answer) in fresh.iter().zip(done) {
        answers[*index] = Some(answer);
    }
    let stored: Vec<(&str, u16, Value)> = fresh
        .iter()
        .filter_map(|i| {
            Some((
                keys[*i].as_ref()?.key.as_str(),
                status,
                answers[*i].as_ref()?.body.clone(),
            ))
        })
        .collect();
    idempotency::store(tx, caller, &stored)
        .await
        .map_err(db_error)?;
    Ok((answers, fates))
}

/// Claims the keys in the caller's transaction, after twins of this
/// request (the same key sent twice at once) had a moment to commit.
async fn claim(
    tx: &mut Tx<'_>,
    caller: &Owner,
    claims: &[(String, Vec<u8>)],
) -> Result<Vec<Claimed>, ApiError> {
    idempotency::wait_for_twins_briefly(tx)
        .await
        .map_err(db_error)?;
    Ok(idempotency::claim(tx, caller, claims).await?)
}

/// Every item's answer: the worked ones as given, the others replayed or
/// mirrored.
fn complete(mut answers: Vec<Option<Answer>>, fates: Vec<Fate>) -> Result<Vec<Answer>, ApiError> {
    for (index, fate) in fates.into_iter().enumerate() {
        answers[index] = match fate {
            Fate::Work => continue,
            Fate::Replay(body) => Some(Answer {
                body,
                replayed: true,
            }),
            // It repeats the first: said so, as for a key sent again later.
            Fate::Mirror(first) => answers[first].as_ref().map(|a| Answer {
                body: a.body.clone(),
                replayed: true,
            }),
        };
    }
    answers
        .into_iter()
        .map(|a| a.ok_or_else(|| ApiError::internal("an item without an answer")))
        .collect()
}

/// Each item's fate before the claim, and the items whose keys are claimed;
/// `Err(index)` when an item reuses an earlier item's key for another
/// request.
fn fates(keys: &[Option<Keyed>]) -> Result<(Vec<Fate>, Vec<usize>), usize> {
    let mut first_with_key: HashMap<&str, usize> = HashMap::new();
    let mut to_claim = Vec::new();
    let mut fates = Vec::with_capacity(keys.len());
    for (index, keyed) in keys.iter().enumerate() {
        let Some(keyed) = keyed else {
            fates.push(Fate::Work);
            continue;
        };
        match first_with_key.get(keyed.key.as_str()) {
            Some(&first) => match &keys[first] {
                Some(earlier) if earlier.fingerprint == keyed.fingerprint => {
                    fates.push(Fate::Mirror(first))
                }
                _ => return Err(index),
            },
            None => {
                first_with_key.insert(&keyed.key, index);
                to_claim.push(index);
                fates.push(Fate::Work);
            }
        }
    }
    Ok((fates, to_claim))
}
