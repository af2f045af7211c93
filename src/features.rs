//! What tenants do with numbers: documents and their outbox, gaps and reconciliation.

pub mod documents;
pub mod gaps;
