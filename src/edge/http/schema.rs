//! Schemas the derive cannot state: document metadata, a JSON object in
//! which no key or string, at any depth, holds NUL (Postgres cannot store
//! it). The schema refers to itself for nested objects, the one form of
//! recursion the generated clients (openapi-python-client) read; arrays
//! nest inline, up to [`ARRAY_DEPTH`] directly inside each other.

use std::borrow::Cow;

use utoipa::openapi::schema::{
    AdditionalProperties, AnyOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type,
};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

/// Text Postgres can store: no NUL.
pub const NO_NUL: &str = r"^[^\u0000]*$";

/// Arrays directly inside arrays the document describes (an object inside
/// starts again).
pub const ARRAY_DEPTH: usize = 4;

/// A document's metadata: a JSON object of at most 256 KiB.
pub struct Metadata;

/// A value inside metadata: a string without NUL, a number, a boolean,
/// null, metadata again (an object), or an array of such values.
fn value(arrays_left: usize) -> RefOr<Schema> {
    // anyOf, not oneOf: an integer is also a number.
    let mut any_of = AnyOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(NO_NUL)),
        )
        .item(ObjectBuilder::new().schema_type(Type::Number))
        .item(ObjectBuilder::new().schema_type(Type::Boolean))
        .item(ObjectBuilder::new().schema_type(Type::Null))
        .item(Ref::from_schema_name("Metadata"));
    if arrays_left > 0 {
        any_of = any_of.item(ArrayBuilder::new().items(value(arrays_left - 1)));
    }
    RefOr::T(Schema::AnyOf(any_of.build()))
}

impl PartialSchema for Metadata {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some(
                "A JSON object of at most 256 KiB. No key or string, at any depth, may hold \
                 NUL (\\u0000) or half a UTF-16 surrogate pair: Postgres cannot store them \
                 (400 invalid_character). This document describes arrays nested up to four \
                 deep directly inside each other; the server takes deeper ones too",
            ))
            .property_names(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(NO_NUL)),
            ))
            .additional_properties(Some(AdditionalProperties::RefOr(value(ARRAY_DEPTH))))
            .examples([serde_json::json!({"title": "Level 3 drawing", "rev": 2})])
            .build()
            .into()
    }
}

impl ToSchema for Metadata {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Metadata")
    }
}

/// A project code, in a request or an answer: `[A-Za-z0-9_]{1,32}`.
pub fn project_code() -> utoipa::openapi::schema::Object {
    code("Project code, `[A-Za-z0-9_]{1,32}`.", "PROJ")
}

/// A document type code, in a request or an answer: `[A-Za-z0-9_]{1,32}`.
pub fn type_code() -> utoipa::openapi::schema::Object {
    code("Document type code, `[A-Za-z0-9_]{1,32}`.", "9012")
}

/// The schema of a code (`ProjectCode`, `TypeCode`): one to 32 letters,
/// digits or underscores.
fn code(description: &str, example: &str) -> utoipa::openapi::schema::Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(description))
        .examples([serde_json::json!(example)])
        .pattern(Some(r"^[A-Za-z0-9_]{1,32}$"))
        .min_length(Some(1))
        .max_length(Some(32))
        .build()
}
