//! What resolving a config has to tell its caller besides the result: warnings about keys that
//! have no effect, and the values that `"auto"` entries became.

use std::fmt;

use serde_json::Value;

/// Something in the config that does not stop it from being used but that the user should know.
#[derive(Clone, Debug, PartialEq)]
pub struct Warning {
    /// The JSON path of the key, such as `zero_optimization.sub_group_size`.
    pub path: String,
    pub kind: WarningKind,
}

#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum WarningKind {
    /// Neither DeepSpeed nor zeroflow knows the key; it is ignored. `suggestion` is a known key of
    /// the same section with a similar spelling.
    UnknownKey { suggestion: Option<&'static str> },
    /// A real DeepSpeed key that has no meaning in zeroflow; it is ignored.
    IgnoredKey { reason: &'static str },
    /// A deprecated DeepSpeed key that is still honoured; `instead` says what to write.
    Deprecated { instead: &'static str },
    /// A value was accepted but is used differently from how it is written, as DeepSpeed does.
    Adjusted { message: String },
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = &self.path;
        match &self.kind {
            WarningKind::UnknownKey { suggestion: Some(known) } => {
                write!(f, "unknown key {path} (ignored; did you mean \"{known}\"?)")
            }
            WarningKind::UnknownKey { suggestion: None } => {
                write!(f, "unknown key {path} (ignored; not a DeepSpeed or zeroflow setting)")
            }
            WarningKind::IgnoredKey { reason } => write!(f, "ignored key {path} ({reason})"),
            WarningKind::Deprecated { instead } => write!(f, "{path} is deprecated: {instead}"),
            WarningKind::Adjusted { message } => write!(f, "{path}: {message}"),
        }
    }
}

/// One `"auto"` value of the config and what it became.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoValue {
    pub path: String,
    pub value: Value,
    pub source: AutoSource,
}

/// Where the value of an `"auto"` entry came from, in order of preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoSource {
    /// Computed from other values of the config; the text says from which.
    Derived(&'static str),
    /// Given by the caller in [`Overrides`](super::Overrides).
    Override,
    /// Neither derivable nor overridden: the default, the text says whose.
    Default(&'static str),
}

impl fmt::Display for AutoValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: \"auto\" became {} ({})", self.path, self.value, self.source)
    }
}

impl fmt::Display for AutoSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutoSource::Derived(from) => write!(f, "derived: {from}"),
            AutoSource::Override => f.write_str("given by the caller"),
            AutoSource::Default(whose) => write!(f, "{whose}"),
        }
    }
}

/// The text for [`AutoSource::Default`] when DeepSpeed's own default is used.
pub(crate) const DEEPSPEED_DEFAULT: &str = "DeepSpeed's default";

/// Collects warnings and auto values while a config is read.
#[derive(Debug, Default)]
pub(crate) struct Diagnostics {
    pub warnings: Vec<Warning>,
    pub auto_values: Vec<AutoValue>,
}

impl Diagnostics {
    pub fn warn(&mut self, path: impl Into<String>, kind: WarningKind) {
        self.warnings.push(Warning { path: path.into(), kind });
    }

    pub fn adjusted(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.warn(path, WarningKind::Adjusted { message: message.into() });
    }

    pub fn auto(&mut self, path: impl Into<String>, value: impl Into<Value>, source: AutoSource) {
        self.auto_values.push(AutoValue { path: path.into(), value: value.into(), source });
    }
}
