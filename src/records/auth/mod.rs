//! Who may do what: API keys, the caller of a request, and the rate limit
//! per key.

pub mod keys;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

pub use keys::{ApiKey, KeyStore, Rejected};

/// Who is asking: set by the authentication layer on every protected
/// request, and the only thing handlers ask about scope.
#[derive(Debug, Clone)]
pub enum Caller {
    Key(Arc<ApiKey>),
    /// `IDPOOL_AUTH=off`: one caller that may do anything.
    Anyone,
}

impl Caller {
    /// The key's id (`anonymous` with authentication off): what logs and
    /// idempotency records name.
    pub fn id(&self) -> &str {
        match self {
            Caller::Key(key) => &key.id,
            Caller::Anyone => "anonymous",
        }
    }

    pub fn is_admin(&self) -> bool {
        match self {
            Caller::Key(key) => key.admin,
            Caller::Anyone => true,
        }
    }

    pub fn may_use(&self, project: &str) -> bool {
        match self {
            Caller::Key(key) => key.may_use(project),
            Caller::Anyone => true,
        }
    }

    /// The projects the caller may reach; `None`: every project.
    pub fn projects(&self) -> Option<&[String]> {
        match self {
            Caller::Key(key) if !key.admin => Some(&key.projects),
            _ => None,
        }
    }
}

/// What a protected request's credentials came to.
#[derive(Debug)]
pub enum Verdict {
    Allowed(Caller),
    /// No usable `Authorization: Bearer` header.
    Missing,
    Rejected(Rejected),
    /// Over the key's rate; may try again after this long.
    Limited(Duration),
}

/// What each key may spend per second beside its requests.
#[derive(Debug, Clone, Copy)]
pub struct Budgets {
    pub rows_per_second: u32,
    pub numbers_per_second: u32,
}

type KeyedLimiter = governor::DefaultKeyedRateLimiter<String>;

pub struct Authenticator {
    keys: Arc<KeyStore>,
    /// `None` with authentication off.
    limiter: Option<KeyedLimiter>,
    /// Rows of lists each key may read per second.
    rows: KeyBudget,
    /// Numbers each key may take per second.
    numbers: KeyBudget,
}

/// Work of one kind each key may spend per second, a second's worth at
/// once; a key in debt waits before its next request of the kind. Work is
/// charged before it runs (a list its `limit`, a `POST /ids` its `count`),
/// so a key's requests in flight never spend much more than its budget,
/// however many it sends at once; a list gets back what its page did not
/// use, so a page of three rows costs three and a thousand a thousand. So one key's largest listings or `count`s
/// cannot take the processors, Redis or Postgres from everybody else.
pub struct KeyBudget {
    per_second: f64,
    burst: f64,
    keys: std::sync::Mutex<std::collections::HashMap<String, (f64, std::time::Instant)>>,
}

impl KeyBudget {
    /// `per_second` a key (0: no budget).
    pub fn new(per_second: u32) -> Self {
        Self {
            per_second: f64::from(per_second),
            // A second's worth at once, no more: the bucket refills
            // between a flood's rounds, and a larger burst is what another
            // tenant's slowest requests would pay for.
            burst: f64::from(per_second),
            keys: Default::default(),
        }
    }

    /// Adds `change` to a key's tokens after refilling them for the time
    /// since it last spent; the tokens it had before the change.
    fn adjust(&self, key: &str, change: impl FnOnce(f64) -> f64) -> f64 {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        if !keys.contains_key(key) {
            keys.insert(key.to_owned(), (self.burst, now));
        }
        let Some((tokens, at)) = keys.get_mut(key) else {
            return self.burst;
        };
        let had =
            (*tokens + self.per_second * now.duration_since(*at).as_secs_f64()).min(self.burst);
        *tokens = change(had).min(self.burst);
        *at = now;
        had
    }

    /// Waits until `caller` is out of debt, then charges it `amount`, in
    /// one look at its tokens per try.
    pub async fn take(&self, caller: &Caller, amount: usize) {
        if self.per_second <= 0.0 {
            return;
        }
        loop {
            let had = self.adjust(caller.id(), |had| {
                if had > 0.0 { had - amount as f64 } else { had }
            });
            if had > 0.0 {
                return;
            }
            tokio::time::sleep(Duration::from_secs_f64(-had / self.per_second + 0.001)).await;
        }
    }

    /// Runs a list of at most `limit` rows for `caller`: charged `limit`
    /// before it runs, given back what its page (or its failure) did not
    /// use.
    pub async fn charged<T, E>(
        &self,
        caller: &Caller,
        limit: usize,
        list: impl std::future::Future<Output = Result<Vec<T>, E>>,
    ) -> Result<Vec<T>, E> {
        self.take(caller, limit).await;
        let listed = list.await;
        let returned = listed.as_ref().map_or(0, Vec::len);
        let unused = limit.saturating_sub(returned);
        if self.per_second > 0.0 && unused > 0 {
            self.adjust(caller.id(), |had| had + unused as f64);
        }
        listed
    }

    /// Forgets keys whose budget is full again.
    fn tidy(&self) {
        let full = self.burst;
        let per_second = self.per_second;
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.retain(|_, (tokens, at)| *tokens + per_second * at.elapsed().as_secs_f64() < full);
    }
}

impl Authenticator {
    /// Keys checked against `keys`, each allowed `per_second` requests a
    /// second with a burst of twice that, `budgets` the rows and numbers
    /// each may take a second (a second's worth at once).
    pub fn new(keys: Arc<KeyStore>, per_second: u32, budgets: Budgets) -> Self {
        let rate = NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(per_second.saturating_mul(2)).unwrap_or(rate);
        Self {
            keys,
            limiter: Some(governor::RateLimiter::keyed(
                governor::Quota::per_second(rate).allow_burst(burst),
            )),
            rows: KeyBudget::new(budgets.rows_per_second),
            numbers: KeyBudget::new(budgets.numbers_per_second),
        }
    }

    /// Everyone may do everything (local development).
    pub fn off(keys: Arc<KeyStore>) -> Self {
        Self {
            keys,
            limiter: None,
            rows: KeyBudget::new(0),
            numbers: KeyBudget::new(0),
        }
    }

    /// The rows of lists each key may read.
    pub fn rows(&self) -> &KeyBudget {
        &self.rows
    }

    /// The numbers each key may take.
    pub fn numbers(&self) -> &KeyBudget {
        &self.numbers
    }

    pub fn is_on(&self) -> bool {
        self.limiter.is_some()
    }

    pub fn keys(&self) -> &Arc<KeyStore> {
        &self.keys
    }

    /// Judges the `Authorization` header of a protected request.
    pub async fn check(&self, authorization: Option<&[u8]>) -> Verdict {
        let Some(limiter) = &self.limiter else {
            return Verdict::Allowed(Caller::Anyone);
        };
        let Some(token) = authorization.and_then(bearer_token) else {
            return Verdict::Missing;
        };
        let key = match self.keys.authenticate(token).await {
            Ok(key) => key,
            Err(rejected) => return Verdict::Rejected(rejected),
        };
        if let Err(not_until) = limiter.check_key(&key.id) {
            let now = governor::clock::Clock::now(limiter.clock());
            return Verdict::Limited(not_until.wait_time_from(now));
        }
        Verdict::Allowed(Caller::Key(key))
    }

    /// Forgets rate state of keys idle long enough to be full again.
    pub fn tidy(&self) {
        if let Some(limiter) = &self.limiter {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        self.rows.tidy();
        self.numbers.tidy();
    }
}

/// Until `stop`: writes which keys were used, reads the keys again when
/// notifications may have been missed, and forgets the rate state of idle
/// keys.
pub async fn maintain_keys(auth: Arc<Authenticator>, stop: tokio_util::sync::CancellationToken) {
    while auth.keys.maintain(&stop).await {
        auth.tidy();
    }
    if let Err(e) = auth.keys.record_use().await {
        tracing::warn!(error = %e, "could not record when keys were last used");
    }
}

/// The token of `Bearer <token>` (the scheme in any case).
fn bearer_token(header: &[u8]) -> Option<&str> {
    let header = std::str::from_utf8(header).ok()?;
    let (scheme, token) = header.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::{KeyBudget, bearer_token};

    /// Keys that stopped spending are forgotten once their budget is full
    /// again (a full budget is what a key never seen gets); a key still in
    /// debt is kept, and so is its debt.
    #[test]
    fn the_budgets_of_idle_keys_are_forgotten_and_a_debt_is_kept() {
        let budget = KeyBudget::new(1_000_000);
        for key in 0..100 {
            budget.adjust(&format!("k{key}"), |had| had - 1.0);
        }
        // Two seconds of debt.
        budget.adjust("debtor", |had| had - 3_000_000.0);
        let tracked = || budget.keys.lock().expect("keys").len();
        assert_eq!(tracked(), 101);
        // Each idle key refills its one token within a microsecond.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while tracked() > 1 && std::time::Instant::now() < deadline {
            budget.tidy();
        }
        let keys = budget.keys.lock().expect("keys");
        assert_eq!(keys.keys().collect::<Vec<_>>(), ["debtor"]);
        assert!(keys["debtor"].0 < -1_000_000.0, "{:?}", keys["debtor"]);
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        assert_eq!(bearer_token(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer_token(b"bearer  abc "), Some("abc"));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bearer\xff"), None);
    }
}
