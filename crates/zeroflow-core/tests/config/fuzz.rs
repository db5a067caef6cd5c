//! Fuzzing the config reader: mutations of the realistic fixtures and arbitrary bytes give a
//! resolved config or a typed error, never a panic, and every error but a syntax or I/O error
//! names a JSON path.
//!
//! CI runs a bounded number of cases. For a long run (the figures in the verification notes):
//! `ZEROFLOW_FUZZ_CASES=2000000 cargo test --release -p zeroflow-core --test config fuzz`.

use std::num::NonZeroU32;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use serde_json::{Map, Value, json};
use zeroflow_core::config::{self, ConfigError, Context};

use super::{FIXTURES, fixture_path};

fn cases() -> u32 {
    std::env::var("ZEROFLOW_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(3000)
}

fn fixtures() -> Vec<Value> {
    FIXTURES
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(fixture_path(name)).expect("fixture readable");
            serde_json::from_str(&text).expect("fixture is JSON")
        })
        .collect()
}

/// Values that break types and ranges in every way a config can.
fn wild_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|x| json!(x)),
        any::<f64>().prop_filter("JSON has no NaN/inf", |x| x.is_finite()).prop_map(|x| json!(x)),
        prop_oneof![Just(0.0), Just(-1.0), Just(1e300), Just(-1e-300), Just(5e8), Just(0.5)]
            .prop_map(|x| json!(x)),
        Just(json!(u64::MAX)),
        "[a-z_]{0,12}".prop_map(Value::String),
        Just(json!("auto")),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, "x", null])),
        Just(json!({"enabled": "yes", "stage": 3})),
    ]
}

/// One edit somewhere in the tree: replace a value, delete a key, or add a key.
#[derive(Clone, Debug)]
enum Edit {
    Replace(Value),
    Delete,
    Insert(String, Value),
}

fn edit() -> impl Strategy<Value = (Vec<prop::sample::Index>, Edit)> {
    let key = prop_oneof![
        "[a-z_]{1,20}",
        Just("stage".to_string()),
        Just("enabled".to_string()),
        Just("offload_optimizer".to_string()),
        Just("zenflow".to_string()),
        Just("train_batch_size".to_string()),
    ];
    (
        prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        prop_oneof![
            wild_value().prop_map(Edit::Replace),
            Just(Edit::Delete),
            (key, wild_value()).prop_map(|(k, v)| Edit::Insert(k, v)),
        ],
    )
}

/// Applies `edit` at the node reached by following `path` (each index picks a child).
fn apply(value: &mut Value, path: &[prop::sample::Index], edit: Edit) {
    let children = match value {
        Value::Object(map) => map.len(),
        Value::Array(items) => items.len(),
        _ => 0,
    };
    if let (Some((first, rest)), true) = (path.split_first(), children > 0) {
        let i = first.index(children);
        let child = match value {
            Value::Object(map) => map.values_mut().nth(i),
            Value::Array(items) => items.get_mut(i),
            _ => None,
        };
        if let Some(child) = child
            && (rest.is_empty() || matches!(child, Value::Object(_) | Value::Array(_)))
        {
            return apply(child, rest, edit);
        }
    }
    match (value, edit) {
        (value, Edit::Replace(new)) => *value = new,
        (Value::Object(map), Edit::Delete) => {
            let key = map.keys().next().cloned();
            key.map(|k| map.remove(&k));
        }
        (Value::Object(map), Edit::Insert(k, v)) => {
            map.insert(k, v);
        }
        (value, Edit::Insert(k, v)) => *value = Value::Object(Map::from_iter([(k, v)])),
        (_, Edit::Delete) => {}
    }
}

/// The property: no panic, and a path on every error that should have one. Returns whether the
/// text resolved.
fn check(text: &str, world: u32) -> Result<bool, TestCaseError> {
    let context =
        Context { world_size: NonZeroU32::new(world).expect("positive"), ..Context::default() };
    let outcome = std::panic::catch_unwind(|| config::resolve_str(text, &context));
    let result = outcome.map_err(|_| TestCaseError::fail(format!("panicked on {text}")))?;
    if let Err(error) = result {
        let pathless = matches!(error, ConfigError::Syntax { .. } | ConfigError::Unreadable { .. });
        prop_assert!(pathless || error.path().is_some(), "no path: {error} for {text}");
        prop_assert!(!error.to_string().is_empty());
        return Ok(false);
    }
    Ok(true)
}

#[test]
fn mutated_realistic_configs_never_panic_and_errors_name_a_path() {
    let fixtures = fixtures();
    let mut runner = TestRunner::new(RunnerConfig { cases: cases(), ..RunnerConfig::default() });
    let strategy = (
        0..fixtures.len(),
        prop::collection::vec(edit(), 1..4),
        prop_oneof![Just(1u32), Just(2), Just(3), Just(8), Just(64)],
    );
    let (resolved, refused) = (std::cell::Cell::new(0u32), std::cell::Cell::new(0u32));
    runner
        .run(&strategy, |(which, edits, world)| {
            let mut config = fixtures[which].clone();
            for (path, edit) in edits {
                apply(&mut config, &path, edit);
            }
            let counter = if check(&config.to_string(), world)? { &resolved } else { &refused };
            counter.set(counter.get() + 1);
            Ok(())
        })
        .unwrap();
    // The mutations reach both outcomes: the fuzzer explores, it does not only hit one wall.
    let (resolved, refused) = (resolved.get(), refused.get());
    assert!(
        resolved > cases() / 20 && refused > cases() / 20,
        "{resolved} resolved, {refused} refused"
    );
    eprintln!("mutated configs: {resolved} resolved, {refused} refused");
}

#[test]
fn arbitrary_and_truncated_text_never_panics() {
    let fixtures: Vec<String> = fixtures().iter().map(Value::to_string).collect();
    let mut runner = TestRunner::new(RunnerConfig { cases: cases(), ..RunnerConfig::default() });
    let strategy = prop_oneof![
        ".{0,200}".prop_map(|s: String| s),
        (0..fixtures.len(), any::<prop::sample::Index>()).prop_map(move |(i, cut)| {
            let f = &fixtures[i];
            f.get(..cut.index(f.len())).unwrap_or(f).to_string()
        }),
    ];
    runner.run(&strategy, |text| check(&text, 1).map(drop)).unwrap();
}
