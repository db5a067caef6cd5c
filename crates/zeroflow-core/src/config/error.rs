//! What can be wrong with a config. Every error but an unreadable file names the JSON path it is
//! about, written the way DeepSpeed's documentation writes keys: `zero_optimization.stage`,
//! `optimizer.params.betas[1]`.

use std::{io, path::PathBuf};

/// The path used in messages about the document as a whole (empty, or not an object).
pub const ROOT: &str = "(top level)";

/// Why a config was rejected.
///
/// `Display` is `<json.path>: <what was wrong and what is allowed>`, ready to show to a user.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("{}: cannot read the config file: {error}", file.display())]
    Unreadable { file: PathBuf, error: io::Error },
    /// The text is not JSON, or it repeats a key (which DeepSpeed also rejects).
    #[error("line {line}, column {column}: {message}")]
    Syntax { line: usize, column: usize, message: String },
    /// A value has the wrong JSON type; `expected` names the type.
    #[error("{path}: expected {expected}, found {found}")]
    WrongType { path: String, expected: &'static str, found: String },
    /// A value has the right type but lies outside what is allowed.
    #[error("{path}: expected {expected}, found {found}")]
    BadValue { path: String, expected: String, found: String },
    /// A valid DeepSpeed setting that zeroflow does not implement (stage 3, NVMe offload, …).
    #[error("{path}: {message}")]
    Unsupported { path: String, message: String },
    /// A value that must be given is absent.
    #[error("{path}: {message}")]
    Missing { path: String, message: String },
    /// Values that are each fine but contradict one another.
    #[error("{path}: {message}")]
    Conflict { path: String, message: String },
    /// A key that no DeepSpeed version knows, in a section that DeepSpeed validates strictly
    /// (`zero_optimization` and its offload and ZenFlow sections, `bf16`, `fp16`: pydantic models
    /// that forbid extra keys). `suggestion`: a known key of the section spelled alike.
    #[error(
        "{path}: unknown key (DeepSpeed refuses unknown keys in this section too){}",
        suggestion.map_or(String::new(), |known| format!("; did you mean \"{known}\"?"))
    )]
    UnknownKey { path: String, suggestion: Option<&'static str> },
}

impl ConfigError {
    /// The JSON path the error is about; `None` for an unreadable file or a syntax error, which
    /// are located by file name or by line and column instead.
    pub fn path(&self) -> Option<&str> {
        match self {
            ConfigError::Unreadable { .. } | ConfigError::Syntax { .. } => None,
            ConfigError::WrongType { path, .. }
            | ConfigError::BadValue { path, .. }
            | ConfigError::Unsupported { path, .. }
            | ConfigError::Missing { path, .. }
            | ConfigError::Conflict { path, .. }
            | ConfigError::UnknownKey { path, .. } => Some(path),
        }
    }

    pub(crate) fn bad_value(
        path: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        ConfigError::BadValue { path: path.into(), expected: expected.into(), found: found.into() }
    }

    pub(crate) fn unsupported(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Unsupported { path: path.into(), message: message.into() }
    }

    pub(crate) fn missing(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Missing { path: path.into(), message: message.into() }
    }

    pub(crate) fn conflict(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Conflict { path: path.into(), message: message.into() }
    }
}
