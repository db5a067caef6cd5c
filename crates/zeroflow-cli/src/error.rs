//! The error that means "the input was wrong": the binary prints it and exits with code 2.

use std::fmt;

/// A problem with what the user gave us (a config, a flag, a file), as opposed to a failure of the
/// machine or of zeroflow itself. `main` prints it without a backtrace and exits with code 2.
#[derive(Debug)]
pub struct InputError(pub String);

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InputError {}

impl InputError {
    /// Wraps any displayable error as an input error, keeping its message.
    pub fn from_display(err: impl fmt::Display) -> anyhow::Error {
        anyhow::Error::new(InputError(err.to_string()))
    }
}

/// A failure that ends the program with a given exit status, e.g. `zeroflow launch` passing on
/// the status of the rank that failed. `main` prints the message and exits with `code`.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}
