//! How idpool speaks to Postgres, with or without a connection pooler in
//! between. Every statement goes through `Db`, `Conn` or `Tx`; none of them
//! hands out a bare sqlx connection, so no call site can forget the rules:
//!
//! - `none`: prepared statements are named and cached per connection (the
//!   fastest), limits are startup parameters of each connection.
//! - `session` (PgBouncer `pool_mode = session`): a pooler may refuse or
//!   drop startup parameters, so no limit rides on them: every transaction
//!   begins with `SET LOCAL` of each limit, and a statement outside a
//!   transaction runs in one of its own for that. A server connection
//!   handed to the next client keeps nothing of ours.
//! - `transaction` (PgBouncer `pool_mode = transaction`): as `session`, and
//!   every statement is unnamed: a named one would outlive its transaction
//!   on a server connection another client gets next. An unnamed statement
//!   is parsed and executed in two round trips, which stay on one server
//!   connection only inside a transaction; hence the transaction of its own.

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Connection, Describe, Either, Execute, Executor, PgPool, Postgres, Transaction};

/// What sits between idpool and Postgres (`IDPOOL_PG_POOLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Pooler {
    // Postgres itself (or a proxy that passes sessions through: HAProxy).
    #[default]
    None,
    // A pooler that gives a client one server connection for as long as
    // it stays connected.
    Session,
    // A pooler that gives a client a server connection per transaction.
    Transaction,
}

impl Pooler {
    /// Whether limits must be set in every transaction (startup
    /// parameters may not reach the server).
    fn limits_per_transaction(self) -> bool {
        self != Pooler::None
    }

    /// Whether statements must be unnamed.
    fn unnamed(self) -> bool {
        self == Pooler::Transaction
    }
}

/// How statements of one pool are shaped.
#[derive(Debug)]
pub(crate) struct Shape {
    pooler: Pooler,
    /// The statement that begins a transaction: `BEGIN`, followed where
    /// a pooler may sit by the `SET LOCAL` of every limit.
    begin: String,
    /// Whether limits are set per transaction, every statement in one.
    per_transaction: bool,
}

impl Shape {
    pub(crate) fn new(pooler: Pooler, limits: &super::Limits) -> Self {
        let per_transaction = pooler.limits_per_transaction();
        let begin = match per_transaction {
            true => format!("BEGIN; {}", limits.set_local()),
            false => "BEGIN".to_owned(),
        };
        Self {
            pooler,
            begin,
            per_transaction,
        }
    }

    /// The `BEGIN` of a transaction.
    fn begin(&self) -> String {
        self.begin.clone()
    }
}

/// A pool of connections to Postgres.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    shape: Arc<Shape>,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("pooler", &self.shape.pooler)
            .field("size", &self.pool.size())
            .finish()
    }
}

impl Db {
    pub(crate) fn new(pool: PgPool, shape: Shape) -> Self {
        Self {
            pool,
            shape: Arc::new(shape),
        }
    }

    pub fn pooler(&self) -> Pooler {
        self.shape.pooler
    }

    /// Another pool on the same server, as shaped as this one, opening
    /// connections only as its work needs them and closing them when they
    /// have sat unused for a while.
    pub async fn sibling(&self, max_connections: u32, limits: super::Limits) -> anyhow::Result<Db> {
        let options = limits.apply(self.connect_options(), self.pooler());
        let pool = super::pool_options(max_connections, &limits)
            .min_connections(0)
            .idle_timeout(super::SIBLING_IDLE)
            .connect_lazy_with(options);
        Ok(Db::new(pool, Shape::new(self.pooler(), &limits)))
    }

    /// The options this pool connects with (for another pool on the same
    /// server).
    pub fn connect_options(&self) -> sqlx::postgres::PgConnectOptions {
        (*self.pool.connect_options()).clone()
    }

    pub async fn close(&self) {
        self.pool.close().await
    }

    /// The sqlx pool, for what sqlx itself runs over a pool and shapes on
    /// its own (the test helpers' checks).
    pub fn raw(&self) -> &PgPool {
        &self.pool
    }

    pub async fn acquire(&self) -> Result<Conn, sqlx::Error> {
        Ok(Conn {
            conn: self.pool.acquire().await?,
            shape: self.shape.clone(),
        })
    }

    pub async fn begin(&self) -> Result<Tx<'static>, sqlx::Error> {
        let begin = self.shape.begin();
        Ok(Tx {
            inner: self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await?,
            shape: self.shape.clone(),
        })
    }
}

/// A connection checked out of a `Db`.
pub struct Conn {
    conn: PoolConnection<Postgres>,
    shape: Arc<Shape>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("pooler", &self.shape.pooler)
            .finish()
    }
}

impl Conn {
    pub async fn begin(&mut self) -> Result<Tx<'_>, sqlx::Error> {
        let begin = self.shape.begin();
        Ok(Tx {
            inner: Connection::begin_with(&mut *self.conn, sqlx::AssertSqlSafe(begin)).await?,
            shape: self.shape.clone(),
        })
    }

    /// The server session behind this connection, when it is ours alone
    /// (a commit in doubt waits for it to end before it is looked up).
    pub async fn session(&mut self) -> Option<super::Session> {
        // Behind a pooler the server session goes to other clients once
        // ours ends: it is neither ours to wait for nor to end.
        match self.shape.pooler {
            Pooler::None => super::session_of(self).await.ok(),
            _ => None,
        }
    }

    /// Closes the connection, without waiting, instead of returning it to
    /// the pool (it may be broken).
    pub fn discard(self) {
        drop(self.conn.detach());
    }
}

/// A transaction. Dropped without `commit`, it rolls back.
pub struct Tx<'c> {
    inner: Transaction<'c, Postgres>,
    shape: Arc<Shape>,
}

impl fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("pooler", &self.shape.pooler)
            .finish()
    }
}

impl Tx<'_> {
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.inner.commit().await
    }

    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.inner.rollback().await
    }

    /// Whether the server session behind this transaction stays ours
    /// after it ends (no pooler hands it to another client).
    pub fn is_ours(&self) -> bool {
        self.shape.pooler == Pooler::None
    }

    /// The server session behind this transaction, when it stays ours
    /// after the transaction ends.
    pub async fn session(&mut self) -> Option<super::Session> {
        match self.shape.pooler {
            Pooler::None => super::session_of(self).await.ok(),
            _ => None,
        }
    }
}

/// A statement shaped for where it runs: unnamed when asked.
struct Shaped<E> {
    statement: E,
    unnamed: bool,
}

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Shaped<E> {
    fn sql(self) -> sqlx::SqlStr {
        self.statement.sql()
    }

    fn statement(&self) -> Option<&PgStatement> {
        self.statement.statement()
    }

    fn take_arguments(
        &mut self,
    ) -> Result<Option<sqlx::postgres::PgArguments>, sqlx::error::BoxDynError> {
        self.statement.take_arguments()
    }

    fn persistent(&self) -> bool {
        !self.unnamed && self.statement.persistent()
    }
}

type StepOutput = Either<PgQueryResult, PgRow>;

/// Something statements run on: a checked-out connection (`Conn`) or a
/// transaction (`Tx`). Code that works on either takes `&mut impl Link`
/// and runs its statements on `link.statements()`.
pub trait Link: Send {
    fn statements(&mut self) -> Statements<'_>;
    /// A transaction: on a `Conn` a new one, in a `Tx` a savepoint.
    fn begin(&mut self) -> BoxFuture<'_, Result<Tx<'_>, sqlx::Error>>;
}

impl<L: Link + ?Sized> Link for &mut L {
    fn begin(&mut self) -> BoxFuture<'_, Result<Tx<'_>, sqlx::Error>> {
        (**self).begin()
    }

    fn statements(&mut self) -> Statements<'_> {
        (**self).statements()
    }
}

impl Link for Conn {
    fn begin(&mut self) -> BoxFuture<'_, Result<Tx<'_>, sqlx::Error>> {
        Box::pin(Conn::begin(self))
    }

    fn statements(&mut self) -> Statements<'_> {
        Statements {
            conn: &mut self.conn,
            shape: &self.shape,
            in_transaction: false,
        }
    }
}

impl Link for Tx<'_> {
    fn begin(&mut self) -> BoxFuture<'_, Result<Tx<'_>, sqlx::Error>> {
        Box::pin(async move {
            Ok(Tx {
                inner: Connection::begin(&mut *self.inner).await?,
                shape: self.shape.clone(),
            })
        })
    }

    fn statements(&mut self) -> Statements<'_> {
        Statements {
            conn: &mut self.inner,
            shape: &self.shape,
            in_transaction: true,
        }
    }
}

/// One connection's statements, shaped for where they run.
pub struct Statements<'a> {
    conn: &'a mut sqlx::PgConnection,
    shape: &'a Shape,
    in_transaction: bool,
}

impl fmt::Debug for Statements<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Statements")
            .field("pooler", &self.shape.pooler)
            .field("in_transaction", &self.in_transaction)
            .finish()
    }
}

impl Statements<'_> {
    /// Whether a statement must run in a transaction of its own: where
    /// limits are set per transaction.
    fn alone(&self) -> bool {
        !self.in_transaction && self.shape.per_transaction
    }
}

/// Runs `statement` in a transaction of its own on `conn`, every result
/// collected before the commit.
async fn alone<'q, E: 'q + Execute<'q, Postgres>>(
    conn: &mut sqlx::PgConnection,
    shape: &Shape,
    statement: E,
) -> Result<Vec<StepOutput>, sqlx::Error> {
    let begin = sqlx::AssertSqlSafe(shape.begin());
    let mut tx = Connection::begin_with(conn, begin).await?;
    let steps = (&mut *tx)
        .fetch_many(Shaped {
            statement,
            unnamed: shape.pooler.unnamed(),
        })
        .try_collect()
        .await;
    match steps {
        Ok(steps) => {
            tx.commit().await?;
            Ok(steps)
        }
        // Ended now: a dropped transaction only queues its ROLLBACK until
        // the connection is next used, and a connection kept between uses
        // (a writer's) would sit in an aborted transaction meanwhile.
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}

fn replay<'e>(
    steps: impl std::future::Future<Output = Result<Vec<StepOutput>, sqlx::Error>> + Send + 'e,
) -> BoxStream<'e, Result<StepOutput, sqlx::Error>> {
    futures::stream::once(steps)
        .flat_map(|steps| match steps {
            Ok(steps) => futures::stream::iter(steps.into_iter().map(Ok)).left_stream(),
            Err(e) => futures::stream::iter([Err(e)]).right_stream(),
        })
        .boxed()
}

fn first_row(steps: Vec<StepOutput>) -> Option<PgRow> {
    steps.into_iter().find_map(|step| step.right())
}

impl<'c> Executor<'c> for &'c Db {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<StepOutput, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.shape.per_transaction {
            return self.pool.fetch_many(query);
        }
        replay(async move {
            let mut conn = self.pool.acquire().await?;
            alone(&mut conn, &self.shape, query).await
        })
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if !self.shape.per_transaction {
            return self.pool.fetch_optional(query);
        }
        Box::pin(async move {
            let mut conn = self.pool.acquire().await?;
            Ok(first_row(alone(&mut conn, &self.shape, query).await?))
        })
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
    where
        'c: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.pool.describe(sql)
    }
}

impl<'c> Executor<'c> for Statements<'c> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<StepOutput, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if self.alone() {
            return replay(alone(self.conn, self.shape, query));
        }
        self.conn.fetch_many(Shaped {
            statement: query,
            unnamed: self.shape.pooler.unnamed(),
        })
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if self.alone() {
            return Box::pin(async move {
                let steps = alone(self.conn, self.shape, query).await?;
                Ok(first_row(steps))
            });
        }
        self.conn.fetch_optional(Shaped {
            statement: query,
            unnamed: self.shape.pooler.unnamed(),
        })
    }

    fn prepare_with<'e>(
        self,
        sql: sqlx::SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
    where
        'c: 'e,
    {
        self.conn.prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: sqlx::SqlStr,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.conn.describe(sql)
    }
}

/// `&mut conn` and `&mut tx` run statements as their `statements()` do.
macro_rules! executes_as_statements {
    ($($target:ty),*) => {$(
        impl<'c> Executor<'c> for &'c mut $target {
            type Database = Postgres;

            fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<StepOutput, sqlx::Error>>
            where
                'c: 'e,
                E: 'q + Execute<'q, Postgres>,
            {
                self.statements().fetch_many(query)
            }

            fn fetch_optional<'e, 'q: 'e, E>(
                self,
                query: E,
            ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
            where
                'c: 'e,
                E: 'q + Execute<'q, Postgres>,
            {
                self.statements().fetch_optional(query)
            }

            fn prepare_with<'e>(
                self,
                sql: sqlx::SqlStr,
                parameters: &'e [PgTypeInfo],
            ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
            where
                'c: 'e,
            {
                self.statements().prepare_with(sql, parameters)
            }

            fn describe<'e>(
                self,
                sql: sqlx::SqlStr,
            ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
            where
                'c: 'e,
            {
                self.statements().describe(sql)
            }
        }
    )*};
}

executes_as_statements!(Conn, Tx<'_>);
