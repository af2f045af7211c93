//! What tenants do with numbers: documents and their outbox, the endpoints
//! their documents are delivered to, gaps and reconciliation.

pub mod documents;
pub mod endpoints;
pub mod gaps;
pub mod registers;
