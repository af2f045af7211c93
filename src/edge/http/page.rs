//! Paging of list routes: `limit` (1 to 1000, default 100) and an opaque
//! `cursor`, which is the key of the last item of the previous page.

use super::problem::ApiError;

const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

/// A checked page request: how many items, and after which key.
#[derive(Debug)]
pub struct Page<K> {
    pub limit: i64,
    pub after: Option<K>,
}

impl<K> Page<K> {
    /// Checks `limit` and reads `cursor` with `key_of` (None: not a cursor
    /// this API returned).
    pub fn parse<'a>(
        limit: Option<i64>,
        cursor: Option<&'a str>,
        key_of: impl FnOnce(&'a str) -> Option<K>,
    ) -> Result<Self, ApiError> {
        Self::with_limit(Self::limit(limit)?, cursor, key_of)
    }

    /// The same with a limit [`Page::limit`] already checked.
    pub fn with_limit<'a>(
        limit: i64,
        cursor: Option<&'a str>,
        key_of: impl FnOnce(&'a str) -> Option<K>,
    ) -> Result<Self, ApiError> {
        let after = match cursor {
            None => None,
            Some(cursor) => Some(key_of(cursor).ok_or_else(invalid_cursor)?),
        };
        Ok(Self { limit, after })
    }

    /// Only the limit, for a route that checks other parameters before the
    /// cursor.
    pub fn limit(limit: Option<i64>) -> Result<i64, ApiError> {
        let limit = limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::bad_request(
                "invalid_limit",
                format!("limit must be between 1 and {MAX_LIMIT}, got {limit}"),
            ));
        }
        Ok(limit)
    }

    /// The cursor of the page after `items`: none when this page was not
    /// full (it is the last).
    pub fn next_cursor<T>(
        &self,
        items: &[T],
        cursor_of: impl FnOnce(&T) -> String,
    ) -> Option<String> {
        if items.len() as i64 != self.limit {
            return None;
        }
        items.last().map(cursor_of)
    }
}

/// A cursor not of the form this API returns.
fn invalid_cursor() -> ApiError {
    ApiError::bad_request("invalid_cursor", "cursor is not one this API returned")
}
