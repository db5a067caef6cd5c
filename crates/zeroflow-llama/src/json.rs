//! Typed reads of `config.json` fields, each error naming the field.

use serde_json::{Map, Value};

use crate::error::LlamaConfigError;

pub(crate) type Object = Map<String, Value>;

fn type_error(field: &str, expected: &'static str, found: &Value) -> LlamaConfigError {
    LlamaConfigError::Type { field: field.to_string(), expected, found: found.to_string() }
}

/// The field's value; absent and `null` are both `None` (`transformers` treats them alike).
fn present<'a>(map: &'a Object, field: &str) -> Option<&'a Value> {
    map.get(field).filter(|v| !v.is_null())
}

pub(crate) fn uint(map: &Object, field: &str) -> Result<Option<usize>, LlamaConfigError> {
    present(map, field)
        .map(|v| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| type_error(field, "a non-negative integer", v))
        })
        .transpose()
}

/// A required positive integer.
pub(crate) fn positive(map: &Object, field: &str) -> Result<usize, LlamaConfigError> {
    let value =
        uint(map, field)?.ok_or_else(|| LlamaConfigError::Missing { field: field.to_string() })?;
    positive_value(field, value)
}

pub(crate) fn positive_value(field: &str, value: usize) -> Result<usize, LlamaConfigError> {
    if value == 0 {
        return Err(LlamaConfigError::Invalid {
            field: field.into(),
            reason: "must be > 0".into(),
        });
    }
    Ok(value)
}

pub(crate) fn float(map: &Object, field: &str) -> Result<Option<f64>, LlamaConfigError> {
    present(map, field)
        .map(|v| v.as_f64().ok_or_else(|| type_error(field, "a number", v)))
        .transpose()
}

pub(crate) fn boolean(map: &Object, field: &str) -> Result<Option<bool>, LlamaConfigError> {
    present(map, field)
        .map(|v| v.as_bool().ok_or_else(|| type_error(field, "true or false", v)))
        .transpose()
}

pub(crate) fn string<'a>(
    map: &'a Object,
    field: &str,
) -> Result<Option<&'a str>, LlamaConfigError> {
    present(map, field)
        .map(|v| v.as_str().ok_or_else(|| type_error(field, "a string", v)))
        .transpose()
}

pub(crate) fn object<'a>(
    map: &'a Object,
    field: &str,
) -> Result<Option<&'a Object>, LlamaConfigError> {
    present(map, field)
        .map(|v| v.as_object().ok_or_else(|| type_error(field, "an object", v)))
        .transpose()
}
