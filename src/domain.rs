//! The concepts, with no I/O: sequences and their formats, numbers, the clock.

pub mod clock;
pub mod json_number;
pub mod numbers;
pub mod sequence;
pub mod text;
