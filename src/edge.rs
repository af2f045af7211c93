//! The process and its routes: commands, settings, wiring, the HTTP API, the import.

pub mod cli;
pub mod config;
pub mod http;
pub mod import;
pub mod startup;
