//! Integration tests of the device contract, compiled as one test binary.

mod comm;
mod ordering;
