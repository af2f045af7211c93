//! Where the numbers of a request come from, decided once per request and
//! shared by the stages that serve it.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::domain::sequence::{IdShape, Period, Sequence};
use crate::records::pool::PoolRef;

/// Where numbers of a sequence issued now come from, and how they read.
#[derive(Clone)]
pub struct Placement {
    pub sequence: Arc<Sequence>,
    pub period: Period,
    pub pool: PoolRef,
    pub shape: IdShape,
    pub at: DateTime<Utc>,
}
