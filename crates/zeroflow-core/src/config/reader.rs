//! Reading JSON the way DeepSpeed reads its config: a strict parse (duplicate keys are errors),
//! then typed reads of one section at a time that know their JSON path, accept `"auto"`, accept
//! integral floats such as `5e8` where an integer is expected, and remember which keys were
//! understood so that every other key can be warned about.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::diagnostics::{AutoSource, DEEPSPEED_DEFAULT, Diagnostics, WarningKind};
use super::error::{ConfigError, ROOT};
use super::known_keys::{IgnoredKey, suggest};

/// Parses a whole config: JSON text whose top level is an object, without repeated keys.
pub(crate) fn parse_document(text: &str) -> Result<Map<String, Value>, ConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.trim().is_empty() {
        return Err(ConfigError::missing(
            ROOT,
            "the config is empty; expected a JSON object such as {\"train_batch_size\": 8}",
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value = UniqueKeys { path: "" }.deserialize(&mut deserializer).map_err(syntax_error)?;
    deserializer.end().map_err(syntax_error)?;
    match value {
        Value::Object(entries) => Ok(entries),
        other => Err(ConfigError::WrongType {
            path: ROOT.to_owned(),
            expected: "a JSON object",
            found: describe_type(&other),
        }),
    }
}

fn syntax_error(error: serde_json::Error) -> ConfigError {
    let (line, column) = (error.line(), error.column());
    let full = error.to_string();
    let location = format!(" at line {line} column {column}");
    let reason = full.strip_suffix(&location).unwrap_or(&full);
    let message = match error.classify() {
        serde_json::error::Category::Data => reason.to_owned(),
        _ => format!("not valid JSON: {reason}"),
    };
    ConfigError::Syntax { line, column, message }
}

/// Builds a `Value` like serde_json does, but fails on a key that appears twice in one object,
/// as DeepSpeed's loader (`dict_raise_error_on_duplicate_keys`) does.
struct UniqueKeys<'p> {
    path: &'p str,
}

impl<'de> DeserializeSeed<'de> for UniqueKeys<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueKeys<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // JSON has no NaN or infinity, so the conversion cannot fail; null is the safe fallback.
        Ok(Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Value, A::Error> {
        let mut values = Vec::new();
        while let Some(value) = items.next_element_seed(UniqueKeys { path: self.path })? {
            values.push(value);
        }
        Ok(Value::Array(values))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut entries: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = entries.next_key::<String>()? {
            let path = join(self.path, &key);
            if object.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "duplicate key {path} (DeepSpeed rejects repeated keys too)"
                )));
            }
            let value = entries.next_value_seed(UniqueKeys { path: &path })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// `parent.key`, or `key` at the top level.
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_owned() } else { format!("{parent}.{key}") }
}

/// A value as a message shows it after "found": the value itself, strings quoted.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(flag) => flag.to_string(),
        Value::Number(number) => number.to_string(),
        Value::String(text) => quote(text),
        Value::Array(_) => "a list".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

/// A value with its JSON type, for "expected a boolean, found the string "yes"".
pub(crate) fn describe_type(value: &Value) -> String {
    match value {
        Value::Number(number) => format!("the number {number}"),
        Value::String(text) => format!("the string {}", quote(text)),
        Value::Array(items) if items.len() == 1 => "a list of 1 value".to_owned(),
        Value::Array(items) => format!("a list of {} values", items.len()),
        other => describe(other),
    }
}

/// A string in double quotes, shortened when long.
pub(crate) fn quote(text: &str) -> String {
    const LONGEST: usize = 40;
    match text.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{:?}…", &text[..cut]),
        None => format!("{text:?}"),
    }
}

fn is_auto(value: &Value) -> bool {
    value.as_str() == Some("auto")
}

/// What the config says about one scalar key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Setting<T> {
    /// The key is not there, or is `null`.
    Absent,
    /// The value is the string `"auto"`: fill it in (Hugging Face's convention).
    Auto,
    Given(T),
}

impl<T: Copy + Into<Value>> Setting<T> {
    pub fn given(self) -> Option<T> {
        match self {
            Setting::Given(value) => Some(value),
            Setting::Absent | Setting::Auto => None,
        }
    }

    pub fn is_auto(self) -> bool {
        matches!(self, Setting::Auto)
    }

    /// The given value, or `default`. DeepSpeed drops `"auto"` entries from its typed sections,
    /// so `"auto"` means the default too; it is recorded as such.
    pub fn or_default(self, path: &str, default: T, diagnostics: &mut Diagnostics) -> T {
        self.or_override(path, default, None, diagnostics)
    }

    /// The given value; for `"auto"` the caller's `replacement` if any, else `default`.
    pub fn or_override(
        self,
        path: &str,
        default: T,
        replacement: Option<T>,
        diagnostics: &mut Diagnostics,
    ) -> T {
        match (self, replacement) {
            (Setting::Given(value), _) => value,
            (Setting::Absent, _) => default,
            (Setting::Auto, Some(value)) => {
                diagnostics.auto(path, value, AutoSource::Override);
                value
            }
            (Setting::Auto, None) => {
                diagnostics.auto(path, default, AutoSource::Default(DEEPSPEED_DEFAULT));
                default
            }
        }
    }
}

/// The integers a key accepts; `expected` describes them in messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IntRule {
    pub expected: &'static str,
    pub min: u64,
    pub max: u64,
}

pub(crate) const POSITIVE_INT: IntRule =
    IntRule { expected: "a positive integer", min: 1, max: u64::MAX };
pub(crate) const NON_NEGATIVE_INT: IntRule =
    IntRule { expected: "a non-negative integer", min: 0, max: u64::MAX };

/// The numbers a key accepts; `expected` describes them in messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NumberRule {
    pub expected: &'static str,
    pub accepts: fn(f64) -> bool,
}

pub(crate) const NON_NEGATIVE: NumberRule =
    NumberRule { expected: "a non-negative number", accepts: |x| x >= 0.0 };
pub(crate) const FRACTION: NumberRule =
    NumberRule { expected: "a number from 0 to 1", accepts: |x| (0.0..=1.0).contains(&x) };

/// Checks a number that did not come from the file (an override) against `rule`.
pub(crate) fn check_number(path: &str, value: f64, rule: NumberRule) -> Result<f64, ConfigError> {
    if value.is_finite() && (rule.accepts)(value) {
        Ok(value)
    } else {
        Err(ConfigError::bad_value(path, rule.expected, format!("{value} (given by the caller)")))
    }
}

/// One JSON object of the config, read key by key.
#[derive(Debug)]
pub(crate) struct Section<'a> {
    path: String,
    entries: &'a Map<String, Value>,
    asked: Vec<&'static str>,
}

impl<'a> Section<'a> {
    pub fn new(path: String, entries: &'a Map<String, Value>) -> Self {
        Section { path, entries, asked: Vec::new() }
    }

    /// The JSON path of `key` in this section.
    pub fn path_of(&self, key: &str) -> String {
        join(&self.path, key)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// The value of `key`, which is now understood; `null` reads as absent, as in DeepSpeed.
    pub fn value(&mut self, key: &'static str) -> Option<&'a Value> {
        self.asked.push(key);
        self.entries.get(key).filter(|value| !value.is_null())
    }

    pub fn bool(&mut self, key: &'static str) -> Result<Setting<bool>, ConfigError> {
        match self.value(key) {
            None => Ok(Setting::Absent),
            Some(value) if is_auto(value) => Ok(Setting::Auto),
            Some(Value::Bool(flag)) => Ok(Setting::Given(*flag)),
            Some(other) => Err(self.wrong_type(key, "a boolean (true or false)", other)),
        }
    }

    pub fn integer(
        &mut self,
        key: &'static str,
        rule: IntRule,
    ) -> Result<Setting<u64>, ConfigError> {
        match self.value(key) {
            None => Ok(Setting::Absent),
            Some(value) if is_auto(value) => Ok(Setting::Auto),
            Some(Value::Number(number)) => match integral(number) {
                Some(integer) if (rule.min..=rule.max).contains(&integer) => {
                    Ok(Setting::Given(integer))
                }
                _ => Err(ConfigError::bad_value(
                    self.path_of(key),
                    rule.expected,
                    number.to_string(),
                )),
            },
            Some(other) => Err(self.wrong_type(key, rule.expected, other)),
        }
    }

    pub fn number(
        &mut self,
        key: &'static str,
        rule: NumberRule,
    ) -> Result<Setting<f64>, ConfigError> {
        match self.value(key) {
            None => Ok(Setting::Absent),
            Some(value) if is_auto(value) => Ok(Setting::Auto),
            Some(Value::Number(number)) => match number.as_f64() {
                Some(x) if x.is_finite() && (rule.accepts)(x) => Ok(Setting::Given(x)),
                _ => Err(ConfigError::bad_value(
                    self.path_of(key),
                    rule.expected,
                    number.to_string(),
                )),
            },
            Some(other) => Err(self.wrong_type(key, rule.expected, other)),
        }
    }

    /// A string value, `"auto"` included (for keys where `"auto"` is a value of its own).
    pub fn string(&mut self, key: &'static str) -> Result<Option<&'a str>, ConfigError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(other) => Err(self.wrong_type(key, "a string", other)),
        }
    }

    /// One of `choices` by its exact spelling; `"auto"` reads as [`Setting::Auto`] unless it is
    /// one of the choices.
    pub fn choice<T: Copy>(
        &mut self,
        key: &'static str,
        choices: &[(&str, T)],
        expected: &str,
    ) -> Result<Setting<T>, ConfigError> {
        let Some(value) = self.value(key) else { return Ok(Setting::Absent) };
        let Value::String(text) = value else {
            return Err(ConfigError::bad_value(self.path_of(key), expected, describe_type(value)));
        };
        match choices.iter().find(|(name, _)| name == text) {
            Some(&(_, choice)) => Ok(Setting::Given(choice)),
            None if text == "auto" => Ok(Setting::Auto),
            None => Err(ConfigError::bad_value(self.path_of(key), expected, quote(text))),
        }
    }

    /// The object under `key`, if present.
    pub fn section(&mut self, key: &'static str) -> Result<Option<Section<'a>>, ConfigError> {
        match self.value(key) {
            None => Ok(None),
            Some(Value::Object(entries)) => Ok(Some(Section::new(self.path_of(key), entries))),
            Some(other) => Err(self.wrong_type(key, "an object", other)),
        }
    }

    pub fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> ConfigError {
        ConfigError::WrongType { path: self.path_of(key), expected, found: describe_type(found) }
    }

    /// [`Section::finish`] for a section DeepSpeed validates strictly: a key that is neither read
    /// nor in `ignored` is an error ([`ConfigError::UnknownKey`]), as in DeepSpeed; ignored keys
    /// still warn.
    pub fn finish_strict(
        self,
        ignored: &[IgnoredKey],
        diagnostics: &mut Diagnostics,
    ) -> Result<(), ConfigError> {
        let unknown = self.entries.keys().find(|key| {
            !self.asked.iter().any(|asked| asked == key) && !ignored.iter().any(|e| e.key == *key)
        });
        if let Some(key) = unknown {
            let known = self.asked.iter().copied().chain(ignored.iter().map(|e| e.key));
            let suggestion = suggest(key, known);
            return Err(ConfigError::UnknownKey { path: self.path_of(key), suggestion });
        }
        self.finish(ignored, diagnostics);
        Ok(())
    }

    /// Warns once about every key that was not read: as ignored when it is in `ignored` (a real
    /// DeepSpeed key with no meaning in zeroflow), as unknown otherwise.
    pub fn finish(self, ignored: &[IgnoredKey], diagnostics: &mut Diagnostics) {
        for key in self.entries.keys().filter(|key| !self.asked.iter().any(|asked| asked == key)) {
            let kind = match ignored.iter().find(|entry| entry.key == key) {
                Some(entry) => WarningKind::IgnoredKey { reason: entry.reason },
                None => {
                    let known = self.asked.iter().copied().chain(ignored.iter().map(|e| e.key));
                    WarningKind::UnknownKey { suggestion: suggest(key, known) }
                }
            };
            diagnostics.warn(self.path_of(key), kind);
        }
    }
}

/// The number as an unsigned integer, when it is one: `8`, `8.0` and `5e8` are; `-1` and `2.5`
/// are not.
fn integral(number: &Number) -> Option<u64> {
    const TWO_TO_64: f64 = 18_446_744_073_709_551_616.0;
    number.as_u64().or_else(|| {
        let x = number.as_f64()?;
        (x.fract() == 0.0 && (0.0..TWO_TO_64).contains(&x)).then_some(x as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section_of(text: &str) -> Map<String, Value> {
        parse_document(text).expect("test config parses")
    }

    #[test]
    fn integral_floats_read_as_integers_and_fractions_do_not() {
        let entries = section_of(r#"{"a": 5e8, "b": 8.0, "c": 2.5, "d": -1}"#);
        let mut section = Section::new(String::new(), &entries);
        assert_eq!(section.integer("a", POSITIVE_INT).unwrap(), Setting::Given(500_000_000));
        assert_eq!(section.integer("b", POSITIVE_INT).unwrap(), Setting::Given(8));
        assert!(section.integer("c", POSITIVE_INT).is_err());
        assert!(section.integer("d", NON_NEGATIVE_INT).is_err());
    }

    #[test]
    fn duplicate_keys_are_syntax_errors_naming_the_path_and_position() {
        let error = parse_document("{\"zero_optimization\": {\"stage\": 1,\n \"stage\": 2}}")
            .expect_err("a repeated key is rejected");
        let message = error.to_string();
        assert!(message.starts_with("line 2, column "), "{message}");
        assert!(message.contains("duplicate key zero_optimization.stage"), "{message}");
    }

    #[test]
    fn syntax_errors_report_line_and_column_without_the_serde_suffix() {
        let error = parse_document("{\n  \"a\": 1,\n  \"b\" 2\n}").expect_err("missing colon");
        let ConfigError::Syntax { line, message, .. } = &error else {
            panic!("expected a syntax error, got {error:?}")
        };
        assert_eq!(*line, 3);
        assert!(message.starts_with("not valid JSON: "), "{message}");
        assert!(!message.contains(" at line "), "{message}");
    }

    #[test]
    fn null_reads_as_absent_and_auto_as_auto() {
        let entries = section_of(r#"{"a": null, "b": "auto"}"#);
        let mut section = Section::new(String::new(), &entries);
        assert_eq!(section.bool("a").unwrap(), Setting::Absent);
        assert_eq!(section.bool("b").unwrap(), Setting::Auto);
    }

    #[test]
    fn unread_keys_warn_once_each_with_their_full_path() {
        let entries = section_of(r#"{"stage": 2, "sub_group_size": 1, "stagee": 1}"#);
        let mut section = Section::new("zero_optimization".to_owned(), &entries);
        section.integer("stage", NON_NEGATIVE_INT).unwrap();
        let mut diagnostics = Diagnostics::default();
        let ignored = [IgnoredKey { key: "sub_group_size", reason: "stage 3" }];
        section.finish(&ignored, &mut diagnostics);
        let paths: Vec<_> = diagnostics.warnings.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(paths, ["zero_optimization.sub_group_size", "zero_optimization.stagee"]);
        assert_eq!(
            diagnostics.warnings[1].kind,
            WarningKind::UnknownKey { suggestion: Some("stage") }
        );
    }
}
