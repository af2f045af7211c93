//! The concepts, with no I/O: sequences and their formats, numbers, the clock,
//! VERI*FACTU's record fingerprints.

pub mod clock;
pub mod json_number;
pub mod merkle;
pub mod numbers;
pub mod sequence;
pub mod signed_note;
pub mod text;
pub mod verifactu;
