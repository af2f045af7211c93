//! Removes what test runs leave on the shared servers: the databases
//! `idpool_test_*` on DATABASE_URL's Postgres and the keys of test prefixes
//! (`t` and 12 hex digits, or `t` and a test database's name) on
//! REDIS_URL's Redis. `make test` runs it before
//! and after the suite; it needs no `psql` or `redis-cli`.

use fred::prelude::*;
use sqlx::Connection;

/// Deletes, in one pass over the keyspace, the keys a test prefix starts.
const DELETE_TEST_KEYS: &str = r#"
local cursor, deleted = "0", 0
repeat
  local page = redis.call("SCAN", cursor, "MATCH", "t*", "COUNT", 1000)
  cursor = page[1]
  for _, key in ipairs(page[2]) do
    if string.match(key, "^t%x%x%x%x%x%x%x%x%x%x%x%x:")
        or string.match(key, "^tidpool_test_%x+:") then
      redis.call("UNLINK", key)
      deleted = deleted + 1
    end
  end
until cursor == "0"
return deleted
"#;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/idpool".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());

    let admin: sqlx::postgres::PgConnectOptions = database_url.parse()?;
    let mut conn = sqlx::PgConnection::connect_with(&admin.database("postgres")).await?;
    let databases: Vec<String> = sqlx::query_scalar(
        "SELECT datname FROM pg_database WHERE datname LIKE 'idpool\\_test\\_%'",
    )
    .fetch_all(&mut conn)
    .await?;
    for database in &databases {
        // A name Postgres listed as `idpool_test_*`, quoted as an identifier.
        let drop = format!(
            "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
            database.replace('"', "\"\"")
        );
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&mut conn)
            .await
        {
            eprintln!("clean_test_data: {database}: {e}");
        }
    }

    let client = Builder::from_config(Config::from_url(&redis_url)?).build()?;
    client.init().await?;
    let keys: i64 = client
        .eval(DELETE_TEST_KEYS, Vec::<String>::new(), Vec::<String>::new())
        .await?;
    client.quit().await?;
    eprintln!(
        "clean_test_data: {} test databases dropped, {keys} test Redis keys removed",
        databases.len()
    );
    Ok(())
}
