//! What people read: text an auditor or a customer must see as it was
//! written.

/// Characters that print nothing yet change what a reader sees (soft
/// hyphen, zero-width spaces and joiners, direction marks and overrides,
/// line separators, fillers and blank patterns, variation selectors, the
/// byte-order mark): a void's reason and an ID are read as written. The
/// same ranges as the void reason's schema pattern, which can name only
/// the Basic Multilingual Plane (tag characters, U+E0000 on, are not
/// refused).
const INVISIBLE: [(char, char); 20] = [
    ('\u{00AD}', '\u{00AD}'),
    ('\u{034F}', '\u{034F}'),
    ('\u{0600}', '\u{0605}'),
    ('\u{061C}', '\u{061C}'),
    ('\u{06DD}', '\u{06DD}'),
    ('\u{070F}', '\u{070F}'),
    ('\u{0890}', '\u{0891}'),
    ('\u{08E2}', '\u{08E2}'),
    ('\u{115F}', '\u{1160}'),
    ('\u{17B4}', '\u{17B5}'),
    ('\u{180E}', '\u{180E}'),
    ('\u{200B}', '\u{200F}'),
    ('\u{2028}', '\u{202E}'),
    ('\u{2060}', '\u{206F}'),
    ('\u{2800}', '\u{2800}'),
    ('\u{3164}', '\u{3164}'),
    ('\u{FE00}', '\u{FE0F}'),
    ('\u{FEFF}', '\u{FEFF}'),
    ('\u{FFA0}', '\u{FFA0}'),
    ('\u{FFF9}', '\u{FFFB}'),
];

/// Whether `c` prints nothing yet changes what a reader sees.
pub fn invisible(c: char) -> bool {
    INVISIBLE
        .iter()
        .any(|(low, high)| (*low..=*high).contains(&c))
}
