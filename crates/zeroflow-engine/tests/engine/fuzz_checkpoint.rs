//! Fuzzing checkpoint reading: a real checkpoint of two ranks, its files truncated, bit-flipped,
//! overwritten with random runs, given rewritten safetensors headers (wrong dtypes, shapes,
//! offsets, lengths and flat ranges) or a mutated `state.json` (wrong types, missing fields,
//! absurd world sizes and counters, negative numbers), or deleted. Everything the trainer reads a
//! checkpoint with (`load` for `--resume`, `flat_weights`, `weights_from_master` for `zeroflow
//! export`, `read_tensors` for `--init-from`) gives a value or a `CheckpointError`, never a panic;
//! every error of `load` names the checkpoint; and whatever loads is consistent, with nothing
//! sized larger than the bytes it came from (a header claiming 1e12 elements is refused before
//! anything is allocated for it).
//!
//! CI runs a bounded number of cases. For a long run, where the address-space limit makes any
//! oversized allocation abort the run:
//! `(ulimit -v 8000000; ZEROFLOW_FUZZ_CASES=1000000 cargo test --release -p zeroflow-engine
//! --test engine fuzz_checkpoint -- --nocapture)`.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{Map, Value, json};
use zeroflow_core::bf16;
use zeroflow_engine::checkpoint::{self, CheckpointError, Loaded, NamedTensor};
use zeroflow_engine::synthetic::layout;
use zeroflow_engine::{DynamicScaler, LossScaler, OptimizerPart, Stage};

use crate::checkpoint::{save, tensors};
use crate::harness::{Setup, train_from};

fn cases() -> u32 {
    std::env::var("ZEROFLOW_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(400)
}

/// The files of a checkpoint saved by two ranks.
const FILES: [&str; 4] =
    ["state.json", "model.safetensors", "optim/rank-0.safetensors", "optim/rank-1.safetensors"];

/// A real checkpoint, as bytes, and the run it belongs to.
struct Fixture {
    files: [Vec<u8>; 4],
    tensors: Vec<NamedTensor>,
    padded_len: usize,
}

/// Trains the synthetic model one step on two ranks and saves it; `state.json` then gets a
/// dynamic loss scaler, so that its fields are there to be mutated too.
fn fixture() -> Fixture {
    let setup = Setup { steps: 1, ..Setup::new(Stage::Zero1, 2, 1, true) };
    let out = train_from::<f32>(&setup, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt");
    save(&path, &setup, &out);
    let mut files = FILES.map(|file| std::fs::read(path.join(file)).unwrap());
    let mut state: Value = serde_json::from_slice(&files[0]).unwrap();
    let scaler = LossScaler::Dynamic(DynamicScaler::new(16, 1000, 1.0, 2, false));
    state["scaler"] = serde_json::to_value(scaler).unwrap();
    files[0] = serde_json::to_vec_pretty(&state).unwrap();
    Fixture { files, tensors: tensors(2), padded_len: layout(2).padded_len() }
}

/// Numbers at and around every limit a reader might trip on.
fn wild_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..5000u64,
        Just(1_000_000_000_000),
        Just(4_000_000_000_000),
        Just(1 << 32),
        Just((1 << 62) + 1),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        any::<u64>(),
    ]
}

/// JSON values that break types and ranges in every way `state.json` can.
fn wild_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|x| json!(x)),
        wild_u64().prop_map(|x| json!(x)),
        prop_oneof![Just(-1.0), Just(0.0), Just(0.5), Just(-0.0), Just(1e300), Just(3.4e38)]
            .prop_map(|x| json!(x)),
        Just(json!(-1)),
        "[a-zA-Z0-9_]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("F32"),
            Just("BF16"),
            Just("F16"),
            Just("bf16"),
            Just("None"),
            Just("zeroflow-checkpoint")
        ]
        .prop_map(|s| json!(s)),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, "x", null])),
        Just(json!({"Static": 0.0})),
        Just(json!({"Static": -4.0})),
        Just(json!([{"name": "w0", "shape": [1_000_000_000_000_u64], "offset": u64::MAX}])),
    ]
}

/// One edit of a JSON tree at the node a path of indices leads to.
#[derive(Clone, Debug)]
enum JsonEdit {
    Replace(Value),
    Delete,
    Insert(String, Value),
}

fn json_edit() -> impl Strategy<Value = (Vec<Index>, JsonEdit)> {
    let key = prop_oneof![
        "[a-z_]{1,12}",
        prop_oneof![
            Just("world_size"),
            Just("optimizer_steps"),
            Just("micro_steps"),
            Just("weights_dtype"),
            Just("optimizer_state_dtype"),
            Just("params"),
            Just("scaler"),
            Just("format"),
            Just("version"),
            Just("offset"),
            Just("shape"),
            Just("window"),
            Just("iteration"),
            Just("last_overflow"),
            Just("scale"),
        ]
        .prop_map(String::from),
    ];
    (
        prop::collection::vec(any::<Index>(), 0..4),
        prop_oneof![
            wild_value().prop_map(JsonEdit::Replace),
            Just(JsonEdit::Delete),
            (key, wild_value()).prop_map(|(k, v)| JsonEdit::Insert(k, v)),
        ],
    )
}

/// Applies `edit` at the node reached by following `path` (each index picks a child).
fn apply(value: &mut Value, path: &[Index], edit: JsonEdit) {
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
        (value, JsonEdit::Replace(new)) => *value = new,
        (Value::Object(map), JsonEdit::Delete) => {
            let key = map.keys().next().cloned();
            key.map(|k| map.remove(&k));
        }
        (Value::Array(items), JsonEdit::Delete) => {
            items.pop();
        }
        (Value::Object(map), JsonEdit::Insert(k, v)) => {
            map.insert(k, v);
        }
        (value, JsonEdit::Insert(k, v)) => *value = Value::Object(Map::from_iter([(k, v)])),
        (_, JsonEdit::Delete) => {}
    }
}

/// One rewrite of a safetensors header (the JSON after the 8-byte length), which is then written
/// back with its length updated, so the reader gets past the framing to the contents.
#[derive(Clone, Debug)]
enum HeaderEdit {
    Dtype(Index, &'static str),
    Shape(Index, Vec<u64>),
    Offsets(Index, [u64; 2]),
    /// Claims 1e12 `F32` elements, with offsets that agree.
    Huge(Index),
    Metadata(&'static str, String),
    Remove(Index),
    Rename(Index, String),
    Json(Vec<Index>, JsonEdit),
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let dtype = prop_oneof![
        Just("F32"),
        Just("BF16"),
        Just("F16"),
        Just("F64"),
        Just("I8"),
        Just("BOOL"),
        Just("F8_E4M3"),
        Just("F4"),
        Just("Q8"),
    ];
    let bound = prop_oneof![
        wild_u64().prop_map(|x| x.to_string()),
        Just("-1".to_string()),
        Just("1e12".to_string()),
        Just("99999999999999999999999".to_string()),
        "[0-9a-z -]{0,6}",
    ];
    let key = prop_oneof![Just("flat_start"), Just("flat_end"), Just("other")];
    prop_oneof![
        (any::<Index>(), dtype).prop_map(|(i, d)| HeaderEdit::Dtype(i, d)),
        (any::<Index>(), prop::collection::vec(wild_u64(), 0..4))
            .prop_map(|(i, s)| HeaderEdit::Shape(i, s)),
        (any::<Index>(), [wild_u64(), wild_u64()]).prop_map(|(i, o)| HeaderEdit::Offsets(i, o)),
        any::<Index>().prop_map(HeaderEdit::Huge),
        (key, bound).prop_map(|(k, v)| HeaderEdit::Metadata(k, v)),
        any::<Index>().prop_map(HeaderEdit::Remove),
        (any::<Index>(), prop_oneof![Just("master".to_string()), "[a-z._0-9]{0,10}"])
            .prop_map(|(i, n)| HeaderEdit::Rename(i, n)),
        json_edit().prop_map(|(p, e)| HeaderEdit::Json(p, e)),
    ]
}

/// One damage to one of [`FILES`] (an index into it).
#[derive(Clone, Debug)]
enum Mutation {
    Truncate(usize, Index),
    FlipBits(usize, Index, u8),
    Overwrite(usize, Index, Vec<u8>),
    Insert(usize, Index, Vec<u8>),
    Garbage(usize, Vec<u8>),
    Delete(usize),
    /// Sets the 8-byte header length of a safetensors file.
    HeaderLength(usize, u64),
    Header(usize, HeaderEdit),
    /// Rewrites a rank's file, validly framed, for the flat range `start..end` (its arrays
    /// resized to match where that is small, so that only the range is wrong).
    PartRange(usize, u64, u64),
    /// Rewrites one tensor of the model file, validly framed, with `shape` and as many elements.
    Reshape(Index, Vec<u64>),
    State(Vec<Index>, JsonEdit),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let file = 0..FILES.len();
    let tensor_file = 1..FILES.len();
    let run = prop::collection::vec(any::<u8>(), 1..64);
    let length = prop_oneof![wild_u64(), 0..400u64];
    let flip = (file.clone(), any::<Index>(), 1..=255u8);
    let delta = prop_oneof![Just(0u64), 0..200u64, wild_u64()];
    let part_range = (2..FILES.len(), wild_u64(), delta, any::<bool>()).prop_map(
        |(f, start, delta, inverted)| {
            let end =
                if inverted { start.saturating_sub(delta) } else { start.saturating_add(delta) };
            Mutation::PartRange(f, start, end)
        },
    );
    prop_oneof![
        1 => (file.clone(), any::<Index>()).prop_map(|(f, i)| Mutation::Truncate(f, i)),
        1 => flip.prop_map(|(f, i, m)| Mutation::FlipBits(f, i, m)),
        1 => (file.clone(), any::<Index>(), run.clone())
            .prop_map(|(f, i, r)| Mutation::Overwrite(f, i, r)),
        1 => (file.clone(), any::<Index>(), run).prop_map(|(f, i, r)| Mutation::Insert(f, i, r)),
        1 => (file.clone(), prop::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(f, b)| Mutation::Garbage(f, b)),
        1 => file.prop_map(Mutation::Delete),
        1 => (tensor_file.clone(), length).prop_map(|(f, n)| Mutation::HeaderLength(f, n)),
        3 => (tensor_file, header_edit()).prop_map(|(f, e)| Mutation::Header(f, e)),
        2 => part_range,
        1 => (any::<Index>(), prop::collection::vec(prop_oneof![0..40u64, wild_u64()], 0..4))
            .prop_map(|(i, shape)| Mutation::Reshape(i, shape)),
        3 => json_edit().prop_map(|(p, e)| Mutation::State(p, e)),
    ]
}

/// Applies `mutation` to `files` (`None`: deleted).
fn mutate(files: &mut [Option<Vec<u8>>; 4], mutation: Mutation) {
    match mutation {
        Mutation::Truncate(f, at) => {
            edit_bytes(&mut files[f], |b| b.truncate(at.index(b.len() + 1)));
        }
        Mutation::FlipBits(f, at, mask) => edit_bytes(&mut files[f], |b| {
            if !b.is_empty() {
                let i = at.index(b.len());
                b[i] ^= mask;
            }
        }),
        Mutation::Overwrite(f, at, run) => edit_bytes(&mut files[f], |b| {
            let start = at.index(b.len() + 1);
            let end = (start + run.len()).min(b.len());
            b.splice(start..end, run);
        }),
        Mutation::Insert(f, at, run) => edit_bytes(&mut files[f], |b| {
            let at = at.index(b.len() + 1);
            b.splice(at..at, run);
        }),
        Mutation::Garbage(f, bytes) => files[f] = Some(bytes),
        Mutation::Delete(f) => files[f] = None,
        Mutation::HeaderLength(f, n) => edit_bytes(&mut files[f], |b| {
            if b.len() >= 8 {
                b[..8].copy_from_slice(&n.to_le_bytes());
            }
        }),
        Mutation::Header(f, edit) => edit_bytes(&mut files[f], |b| rewrite_header(b, edit)),
        Mutation::PartRange(f, start, end) => edit_bytes(&mut files[f], |b| {
            rebuild(b, |tensors, metadata| {
                metadata.insert("flat_start".into(), start.to_string());
                metadata.insert("flat_end".into(), end.to_string());
                let len = end.saturating_sub(start);
                if len <= 4096 {
                    for (_, shape, data) in tensors {
                        *shape = vec![len as usize];
                        data.resize(len as usize * 4, 0);
                    }
                }
            });
        }),
        Mutation::Reshape(i, shape) => edit_bytes(&mut files[1], |b| {
            rebuild(b, |tensors, _| {
                let numel = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
                let Some(numel) = numel.filter(|&n| n <= 1 << 16) else { return };
                if let Some(index) = (!tensors.is_empty()).then(|| i.index(tensors.len())) {
                    let (_, old_shape, data) = &mut tensors[index];
                    *old_shape = shape.iter().map(|&d| d as usize).collect();
                    data.resize(numel as usize * 4, 0);
                }
            });
        }),
        Mutation::State(path, edit) => edit_bytes(&mut files[0], |b| {
            // A state.json that earlier mutations made invalid JSON is left as it is.
            if let Ok(mut state) = serde_json::from_slice::<Value>(b) {
                apply(&mut state, &path, edit);
                *b = serde_json::to_vec_pretty(&state).unwrap();
            }
        }),
    }
}

fn edit_bytes(file: &mut Option<Vec<u8>>, edit: impl FnOnce(&mut Vec<u8>)) {
    if let Some(bytes) = file {
        edit(bytes);
    }
}

/// Rewrites the header of the safetensors file `bytes`, keeping the data after it; a file whose
/// header no longer parses is left as it is.
fn rewrite_header(bytes: &mut Vec<u8>, edit: HeaderEdit) {
    let Some(len) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())) else {
        return;
    };
    let Some(end) = usize::try_from(len).ok().and_then(|n| n.checked_add(8)) else { return };
    let Some(Ok(Value::Object(mut header))) =
        bytes.get(8..end).map(serde_json::from_slice::<Value>)
    else {
        return;
    };
    let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
    let pick = |i: &Index| (!names.is_empty()).then(|| names[i.index(names.len())].clone());
    let tensor = |header: &mut Map<String, Value>, i: &Index| {
        pick(i).and_then(|name| header.get_mut(&name).and_then(Value::as_object_mut).cloned())
    };
    match edit {
        HeaderEdit::Dtype(i, dtype) => set_field(&mut header, pick(&i), "dtype", json!(dtype)),
        HeaderEdit::Shape(i, shape) => set_field(&mut header, pick(&i), "shape", json!(shape)),
        HeaderEdit::Offsets(i, offsets) => {
            set_field(&mut header, pick(&i), "data_offsets", json!(offsets));
        }
        HeaderEdit::Huge(i) => {
            let start = tensor(&mut header, &i)
                .and_then(|t| t.get("data_offsets")?.get(0)?.as_u64())
                .unwrap_or(0);
            let elements = 1_000_000_000_000u64;
            set_field(&mut header, pick(&i), "dtype", json!("F32"));
            set_field(&mut header, pick(&i), "shape", json!([elements]));
            // A start that an earlier edit made huge must not overflow the test itself.
            let offsets = json!([start, start.saturating_add(4 * elements)]);
            set_field(&mut header, pick(&i), "data_offsets", offsets);
        }
        HeaderEdit::Metadata(key, value) => {
            let metadata = header.entry("__metadata__").or_insert_with(|| json!({}));
            if let Value::Object(metadata) = metadata {
                metadata.insert(key.to_string(), Value::String(value));
            }
        }
        HeaderEdit::Remove(i) => {
            pick(&i).map(|name| header.remove(&name));
        }
        HeaderEdit::Rename(i, new) => {
            if let Some(value) = pick(&i).and_then(|name| header.remove(&name)) {
                header.insert(new, value);
            }
        }
        HeaderEdit::Json(path, edit) => {
            let mut value = Value::Object(header);
            apply(&mut value, &path, edit);
            let text = serde_json::to_vec(&value).unwrap();
            bytes.splice(..end, (text.len() as u64).to_le_bytes().into_iter().chain(text));
            return;
        }
    }
    let text = serde_json::to_vec(&Value::Object(header)).unwrap();
    bytes.splice(..end, (text.len() as u64).to_le_bytes().into_iter().chain(text));
}

/// The tensors of an F32 safetensors file: name, shape and bytes.
type F32Tensors = Vec<(String, Vec<usize>, Vec<u8>)>;

/// Re-encodes the F32 safetensors file `bytes` after `edit` has changed its tensors and metadata;
/// a file that no longer parses is left as it is.
fn rebuild(bytes: &mut Vec<u8>, edit: impl FnOnce(&mut F32Tensors, &mut HashMap<String, String>)) {
    let Ok((_, header)) = SafeTensors::read_metadata(bytes) else { return };
    let mut metadata = header.metadata().clone().unwrap_or_default();
    let Ok(file) = SafeTensors::deserialize(bytes) else { return };
    let mut tensors: F32Tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec(), view.data().to_vec()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors, &mut metadata);
    let views = tensors.iter().map(|(name, shape, data)| {
        TensorView::new(Dtype::F32, shape.clone(), data).map(|view| (name.clone(), view))
    });
    if let Ok(views) = views.collect::<Result<Vec<_>, _>>() {
        *bytes = safetensors::serialize(views, Some(metadata)).unwrap();
    }
}

fn set_field(header: &mut Map<String, Value>, name: Option<String>, key: &str, value: Value) {
    if let Some(Value::Object(tensor)) = name.and_then(|name| header.get_mut(&name)) {
        tensor.insert(key.to_string(), value);
    }
}

/// How one case ended, for the tally that shows the fuzzer reaches every outcome.
fn outcome_name(result: &Result<Loaded<f32>, CheckpointError>) -> &'static str {
    match result {
        Ok(_) => "loaded",
        Err(CheckpointError::Io { .. }) => "io",
        Err(CheckpointError::Foreign { .. }) => "foreign",
        Err(CheckpointError::Corrupt { .. }) => "corrupt",
        Err(CheckpointError::Mismatch { .. }) => "mismatch",
        Err(CheckpointError::AlreadyExists(_)) => "already-exists",
        // Loading reads files, never a device or the free space: write-side errors.
        Err(CheckpointError::Source { .. }) => "source",
        Err(CheckpointError::NoSpace { .. }) => "no-space",
    }
}

/// Writes `files` into `dir` (deleting the ones that are `None`) and reads them every way the
/// trainer does. Returns how `load` ended; fails on a panic or a broken promise.
fn check(
    fixture: &Fixture,
    dir: &Path,
    files: &[Option<Vec<u8>>; 4],
) -> Result<&'static str, TestCaseError> {
    for (name, bytes) in FILES.iter().zip(files) {
        let path = dir.join(name);
        match bytes {
            Some(bytes) => std::fs::write(&path, bytes).unwrap(),
            None => std::fs::remove_file(&path).or_else(ignore_missing).unwrap(),
        }
    }
    std::fs::remove_file(dir.join("export.safetensors")).or_else(ignore_missing).unwrap();
    let outcome = catch_unwind(AssertUnwindSafe(|| read_every_way(fixture, dir, files)));
    outcome.map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        TestCaseError::fail(format!("panicked: {message}"))
    })?
}

fn ignore_missing(error: std::io::Error) -> std::io::Result<()> {
    if error.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(error) }
}

fn read_every_way(
    fixture: &Fixture,
    dir: &Path,
    files: &[Option<Vec<u8>>; 4],
) -> Result<&'static str, TestCaseError> {
    let input_bytes: usize = files.iter().flatten().map(Vec::len).sum();
    // `--init-from`: the model file alone, as f32 and as another type.
    if let Some(model) = &files[1] {
        let path = dir.join("model.safetensors");
        if let Ok(tensors) = checkpoint::read_tensors::<f32>(model, &path) {
            for (name, (shape, values)) in &tensors {
                let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
                prop_assert_eq!(numel, Some(values.len()), "{}: shape and elements", name);
            }
        }
        let _ = checkpoint::read_tensors::<bf16>(model, &path);
    }
    let _ = checkpoint::load::<bf16>(dir);
    // `--resume` and `zeroflow export`.
    let loaded = checkpoint::load::<f32>(dir);
    let outcome = outcome_name(&loaded);
    let loaded = match loaded {
        Ok(loaded) => loaded,
        Err(error) => {
            let text = error.to_string();
            prop_assert!(text.contains(&dir.display().to_string()), "unnamed: {}", text);
            return Ok(outcome);
        }
    };
    let mut next = 0;
    for part in &loaded.parts {
        prop_assert_eq!(part.flat.start, next, "the parts tile the flat buffer");
        next = part.flat.end;
        for array in [&part.master, &part.exp_avg, &part.exp_avg_sq] {
            prop_assert_eq!(array.len(), part.flat.len());
        }
    }
    let loaded_elements = next + loaded.tensors.values().map(|(_, v)| v.len()).sum::<usize>();
    prop_assert!(loaded_elements * 4 <= input_bytes, "more elements than bytes read");
    match checkpoint::flat_weights(&loaded, &fixture.tensors, fixture.padded_len, dir) {
        Ok(flat) => prop_assert_eq!(flat.len(), fixture.padded_len),
        Err(error) => prop_assert!(error.to_string().contains(&dir.display().to_string())),
    }
    // `--resume` and `zeroflow export` open it and read the weights and the optimizer's master
    // weights a piece at a time: what loads opens, and reads the same elements.
    let opened = checkpoint::open(dir);
    prop_assert!(opened.is_ok(), "loads but does not open: {:?}", opened.err());
    let opened = opened.unwrap();
    // Compared bit for bit: a mutation can make an element NaN, which equals nothing.
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let read = opened.flat_weights::<f32>(&fixture.tensors, fixture.padded_len);
    let whole = checkpoint::flat_weights(&loaded, &fixture.tensors, fixture.padded_len, dir);
    let (read, whole) = (read.ok().map(|r| bits(&r)), whole.ok().map(|w| bits(&w)));
    prop_assert_eq!(read, whole, "the weights opened and loaded");
    for (opened, loaded) in opened.parts.iter().zip(&loaded.parts) {
        let part_bits = |p: &OptimizerPart| {
            (p.flat.clone(), p.moments, [&p.master, &p.exp_avg, &p.exp_avg_sq].map(|a| bits(a)))
        };
        let opened = opened.to_part().ok();
        prop_assert!(
            opened.as_ref().map(part_bits) == Some(part_bits(loaded)),
            "a part opened and loaded"
        );
    }
    if let Ok((flat, tensors)) = checkpoint::weights_from_master::<f32>(&opened) {
        prop_assert_eq!(flat.len(), next, "export's weights are the optimizer's range");
        for tensor in &tensors {
            prop_assert!(tensor.flat.end <= flat.len(), "{} lies outside", tensor.name);
        }
        let export = dir.join("export.safetensors");
        let flat = checkpoint::Elements::lent(&flat);
        let _ = checkpoint::write_model(&export, &loaded.meta, &flat, &tensors);
    }
    Ok(outcome)
}

#[test]
fn damaged_checkpoints_load_or_give_typed_errors_and_never_panic() {
    let fixture = fixture();
    let (_scratch, dir) = checkpoint_dir();
    let untouched = || fixture.files.clone().map(Some);
    assert_eq!(check(&fixture, &dir, &untouched()).unwrap(), "loaded", "the fixture loads");

    let tally = std::cell::RefCell::new(BTreeMap::<&str, u32>::new());
    let ran = Cell::new(0u32);
    let started = std::time::Instant::now();
    let config =
        RunnerConfig { cases: cases(), failure_persistence: None, ..RunnerConfig::default() };
    let mut runner = TestRunner::new(config);
    runner
        .run(&prop::collection::vec(mutation(), 1..4), |mutations| {
            let mut files = untouched();
            for mutation in mutations {
                mutate(&mut files, mutation);
            }
            let outcome = check(&fixture, &dir, &files)?;
            *tally.borrow_mut().entry(outcome).or_default() += 1;
            ran.set(ran.get() + 1);
            Ok(())
        })
        .unwrap();
    let tally = tally.into_inner();
    eprintln!(
        "checkpoint fuzz: {} cases in {:.1} s: {tally:?}",
        ran.get(),
        started.elapsed().as_secs_f64()
    );
    // The mutations reach both sides: the fuzzer explores, it does not only hit one wall.
    let loaded = tally.get("loaded").copied().unwrap_or(0);
    assert!(loaded > cases() / 50 && ran.get() - loaded > cases() / 50, "{tally:?}");
}

/// An empty checkpoint directory (with its `optim/`) in a scratch directory that lives as long
/// as the first value.
fn checkpoint_dir() -> (tempfile::TempDir, std::path::PathBuf) {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("step-00000001");
    std::fs::create_dir_all(dir.join("optim")).unwrap();
    (scratch, dir)
}

/// Loads the fixture after `mutations` and returns the error `load` gives.
fn load_error(mutations: Vec<Mutation>) -> CheckpointError {
    let fixture = fixture();
    let (_scratch, dir) = checkpoint_dir();
    let mut files = fixture.files.clone().map(Some);
    for mutation in mutations {
        mutate(&mut files, mutation);
    }
    check(&fixture, &dir, &files).unwrap();
    checkpoint::load::<f32>(&dir).unwrap_err()
}

/// Found by the fuzzer (2026-12-03): bytes written over a weight of `model.safetensors` that
/// make it NaN. It opens and loads alike, and the check compares them bit for bit (a NaN equals
/// nothing, so comparing the values failed although both reads were the same).
#[test]
fn a_weight_made_nan_opens_as_it_loads() {
    let fixture = fixture();
    let (_scratch, dir) = checkpoint_dir();
    let mut files = fixture.files.clone().map(Some);
    // The fuzzer's bytes over the sixth f32 weight's upper three: 0x7f80_00xx, a NaN.
    let model = files[1].as_mut().unwrap();
    let data = 8 + u64::from_le_bytes(model[..8].try_into().unwrap()) as usize;
    model[data + 4 * 5 + 1..data + 4 * 6].copy_from_slice(&[0, 128, 127]);
    assert_eq!(check(&fixture, &dir, &files).unwrap(), "loaded");
    let loaded = checkpoint::load::<f32>(&dir).unwrap();
    let weights = checkpoint::flat_weights(&loaded, &fixture.tensors, fixture.padded_len, &dir);
    assert!(weights.unwrap().iter().any(|w| w.is_nan()), "the mutation makes a weight NaN");
}

/// Found by the fuzzer: `optim/rank-0` claiming the range 1..0 (arrays empty) loaded, and
/// `weights_from_master` then panicked slicing it; a range far beyond the model (10¹⁵) made it
/// allocate 4 PB. The parts must now tile the flat buffer from 0.
#[test]
fn optimizer_parts_with_inverted_or_detached_ranges_are_corrupt() {
    for (start, end) in [(1, 0), (1_000_000_000_000_000, 1_000_000_000_000_000), (5, 70)] {
        let error = load_error(vec![Mutation::PartRange(2, start, end)]);
        assert!(matches!(error, CheckpointError::Corrupt { .. }), "{start}..{end}: {error}");
        assert!(error.to_string().contains("rank-0"), "{error}");
    }
}

#[test]
fn a_header_claiming_1e12_elements_is_refused_before_allocating() {
    for (file, name) in FILES.iter().enumerate().skip(1) {
        let tensor = any::<Index>().new_tree(&mut TestRunner::deterministic()).unwrap().current();
        let error = load_error(vec![Mutation::Header(file, HeaderEdit::Huge(tensor))]);
        assert!(matches!(error, CheckpointError::Corrupt { .. }), "{name}: {error}");
    }
}

/// A loss scaler whose next update would divide by zero or overflow is refused at load.
#[test]
fn a_scaler_that_would_fail_its_next_update_is_corrupt() {
    for (field, value) in
        [("window", json!(0)), ("iteration", json!(u64::MAX)), ("scale", json!(-1))]
    {
        let mut state: Value = serde_json::from_slice(&fixture().files[0]).unwrap();
        state["scaler"]["Dynamic"][field] = value.clone();
        let error = load_error(vec![Mutation::Garbage(0, serde_json::to_vec(&state).unwrap())]);
        assert!(matches!(error, CheckpointError::Corrupt { .. }), "{field} {value}: {error}");
        assert!(error.to_string().contains("scaler"), "{error}");
    }
}
