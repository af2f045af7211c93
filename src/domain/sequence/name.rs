//! Project and document-type codes: the two halves of a sequence's name.

use std::fmt;

/// Longest project or type code SPEC allows.
pub const MAX_CODE_LEN: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodeError {
    #[error("must be 1 to {MAX_CODE_LEN} characters, got {0}")]
    Length(usize),
    #[error("may contain only A-Z, a-z, 0-9 and _, found {0:?}")]
    Character(char),
}

fn validate(code: &str) -> Result<(), CodeError> {
    let len = code.chars().count();
    if len == 0 || len > MAX_CODE_LEN {
        return Err(CodeError::Length(len));
    }
    match code
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        Some(c) => Err(CodeError::Character(c)),
        None => Ok(()),
    }
}

macro_rules! code_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            pub fn parse(code: &str) -> Result<Self, CodeError> {
                validate(code).map(|()| Self(code.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

code_newtype!(
    /// A tenant's project code (`PROJ`).
    ProjectCode
);
code_newtype!(
    /// A document type code (`9012`).
    TypeCode
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_spec_examples() {
        assert_eq!(ProjectCode::parse("PROJ").unwrap().as_str(), "PROJ");
        assert_eq!(TypeCode::parse("9012").unwrap().as_str(), "9012");
        assert!(ProjectCode::parse("a_B_9").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_foreign_characters() {
        assert_eq!(ProjectCode::parse(""), Err(CodeError::Length(0)));
        assert_eq!(
            ProjectCode::parse(&"A".repeat(33)),
            Err(CodeError::Length(33))
        );
        assert_eq!(ProjectCode::parse("PR-OJ"), Err(CodeError::Character('-')));
        assert_eq!(TypeCode::parse("90:12"), Err(CodeError::Character(':')));
        assert_eq!(TypeCode::parse("{9}"), Err(CodeError::Character('{')));
        assert_eq!(TypeCode::parse("ü"), Err(CodeError::Character('ü')));
    }

    proptest! {
        #[test]
        fn valid_codes_round_trip(code in "[A-Za-z0-9_]{1,32}") {
            let parsed = ProjectCode::parse(&code).unwrap();
            prop_assert_eq!(parsed.as_str(), code.as_str());
        }

        #[test]
        fn codes_with_any_other_character_are_refused(
            head in "[A-Za-z0-9_]{0,10}",
            bad in "[^A-Za-z0-9_]",
            tail in "[A-Za-z0-9_]{0,10}",
        ) {
            let code = format!("{head}{bad}{tail}");
            prop_assert!(TypeCode::parse(&code).is_err());
        }
    }
}
