//! Directories written by `save` read back to the same tensors (exactly in F32, rounded to
//! bfloat16 in BF16), whole or in shards, and files in each dtype read as f32.

use std::collections::HashMap;

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;
use zeroflow_hf::{
    DirLayout, HfCheckpoint, SaveDtype, SaveOptions, TokenizerSource, plan_shards, save, save_with,
};

use crate::{Scratch, out_tensors, sample_tensors};

fn options(dtype: SaveDtype, max_shard_bytes: u64) -> SaveOptions {
    SaveOptions { dtype, max_shard_bytes, tokenizer_from: None }
}

#[test]
fn f32_single_file_round_trip_is_exact_and_records_the_dtype() {
    let scratch = Scratch::new("f32-single");
    let dir = scratch.0.join("out");
    let tensors = sample_tensors();
    let config = json!({"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"});
    let saved =
        save(&dir, &config, &out_tensors(&tensors), &options(SaveDtype::F32, u64::MAX)).unwrap();
    assert_eq!(saved.weight_files, ["model.safetensors"]);
    assert!(!dir.join("model.safetensors.index.json").exists());
    let read = HfCheckpoint::open(&dir).unwrap();
    assert_eq!(read.config().unwrap()["torch_dtype"], "float32");
    assert_eq!(read.config().unwrap()["architectures"][0], "LlamaForCausalLM");
    for (name, shape, values) in &tensors {
        let entry = read.tensor(name).unwrap();
        assert_eq!((&entry.shape, entry.dtype), (shape, Dtype::F32));
        assert_eq!(&read.read_f32(name).unwrap(), values, "{name}");
    }
    assert_eq!(read.names().count(), tensors.len());
}

/// A run's own bf16 tensors are written as BF16 with their bits kept, and as F32 widened exactly:
/// the same files as their f32 values would give.
#[test]
fn bf16_tensors_write_as_their_f32_values_would() {
    let scratch = Scratch::new("bf16-in");
    let tensors = sample_tensors();
    let narrow: Vec<Vec<zeroflow_core::bf16>> = tensors
        .iter()
        .map(|t| t.2.iter().map(|&v| zeroflow_core::bf16::from_f32(v)).collect())
        .collect();
    let wide: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .zip(&narrow)
        .map(|(t, n)| (t.0.clone(), t.1.clone(), n.iter().map(|v| v.to_f32()).collect()))
        .collect();
    let narrow_out: Vec<zeroflow_hf::OutTensor<'_, zeroflow_core::bf16>> = tensors
        .iter()
        .zip(&narrow)
        .map(|(t, values)| zeroflow_hf::OutTensor { name: &t.0, shape: &t.1, values })
        .collect();
    for dtype in [SaveDtype::Bf16, SaveDtype::F32] {
        let (from_narrow, from_wide) =
            (scratch.0.join(format!("{dtype:?}-bf16")), scratch.0.join(format!("{dtype:?}-f32")));
        save(&from_narrow, &json!({}), &narrow_out, &options(dtype, 100)).unwrap();
        let saved =
            save(&from_wide, &json!({}), &out_tensors(&wide), &options(dtype, 100)).unwrap();
        for file in &saved.weight_files {
            let bytes = |dir: &std::path::Path| std::fs::read(dir.join(file)).unwrap();
            assert!(bytes(&from_narrow) == bytes(&from_wide), "{dtype:?}: {file}");
        }
    }
}

#[test]
fn bf16_sharded_round_trip_rounds_each_value_to_bfloat16() {
    let scratch = Scratch::new("bf16-sharded");
    let dir = scratch.0.join("out");
    let tensors = sample_tensors();
    // 100 bytes per shard: every tensor but the small ones alone in a shard.
    let saved = save(
        &dir,
        &json!({"dtype": "float32"}),
        &out_tensors(&tensors),
        &options(SaveDtype::Bf16, 100),
    )
    .unwrap();
    let n = saved.weight_files.len();
    assert!(n >= 3, "{:?}", saved.weight_files);
    for (i, file) in saved.weight_files.iter().enumerate() {
        assert_eq!(file, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let elements: usize = tensors.iter().map(|t| t.2.len()).sum();
    assert_eq!(index["metadata"]["total_size"], (elements * 2) as u64);
    assert_eq!(saved.total_size, (elements * 2) as u64);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), tensors.len());
    let read = HfCheckpoint::open(&dir).unwrap();
    let config = read.config().unwrap();
    assert_eq!(
        (config["torch_dtype"].as_str(), config["dtype"].as_str()),
        (Some("bfloat16"), Some("bfloat16"))
    );
    for (name, shape, values) in &tensors {
        let entry = read.tensor(name).unwrap();
        assert_eq!((&entry.shape, entry.dtype), (shape, Dtype::BF16));
        assert_eq!(read.file_of(entry).file_name().unwrap().to_str(), map[name].as_str());
        let rounded: Vec<f32> = values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        let back = read.read_f32(name).unwrap();
        assert_eq!(back, rounded, "{name}");
        assert_ne!(&back, values, "{name}: the values must not be exact in bfloat16");
    }
    // Every tensor at once, in reverse order, over the shards: as read one at a time.
    let mut outs: Vec<Vec<f32>> = tensors.iter().rev().map(|t| vec![f32::NAN; t.2.len()]).collect();
    let wanted = tensors
        .iter()
        .rev()
        .zip(outs.iter_mut())
        .map(|((name, shape, _), out)| (name.as_str(), &shape[..], &mut out[..]))
        .collect();
    read.read_tensors_into(wanted).unwrap();
    for ((name, ..), out) in tensors.iter().rev().zip(&outs) {
        assert_eq!(*out, read.read_f32(name).unwrap(), "{name}");
    }
    // A shape that disagrees is refused, naming the tensor.
    let (name, shape, values) = &tensors[1];
    let mut out = vec![0.0; values.len()];
    let wrong = [shape[0] * shape[1]];
    let error = read.read_tensors_into(vec![(name.as_str(), &wrong[..], &mut out[..])]);
    assert!(error.unwrap_err().to_string().contains(name.as_str()));
}

#[test]
fn safetensors_files_carry_the_pt_format_metadata() {
    let scratch = Scratch::new("format-pt");
    let dir = scratch.0.join("out");
    let tensors = sample_tensors();
    let saved =
        save(&dir, &json!({}), &out_tensors(&tensors), &options(SaveDtype::Bf16, 100)).unwrap();
    for file in &saved.weight_files {
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let format = metadata.metadata().as_ref().and_then(|m| m.get("format")).cloned();
        assert_eq!(format.as_deref(), Some("pt"), "{file}");
    }
}

#[test]
fn weight_files_get_the_permissions_of_config_json() {
    let scratch = Scratch::new("permissions");
    let dir = scratch.0.join("out");
    let tensors = sample_tensors();
    let saved =
        save(&dir, &json!({}), &out_tensors(&tensors), &options(SaveDtype::Bf16, 100)).unwrap();
    let config = std::fs::metadata(dir.join("config.json")).unwrap().permissions();
    for file in &saved.weight_files {
        assert_eq!(std::fs::metadata(dir.join(file)).unwrap().permissions(), config, "{file}");
    }
}

#[test]
fn shards_split_where_the_next_tensor_does_not_fit() {
    assert_eq!(plan_shards(&[40, 40, 40], 100), [0..2, 2..3]);
    assert_eq!(plan_shards(&[40, 200, 10], 100), [0..1, 1..2, 2..3]);
    assert_eq!(plan_shards(&[50, 50], 100), vec![(0..2)]);
    assert_eq!(plan_shards(&[], 100), vec![(0..0)]);
}

#[test]
fn tokenizer_files_present_in_the_source_are_copied_and_others_ignored() {
    let scratch = Scratch::new("tokenizer");
    let source = scratch.0.join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("tokenizer.json"), "{\"model\": 1}").unwrap();
    std::fs::write(source.join("generation_config.json"), "{\"eos\": 2}").unwrap();
    std::fs::write(source.join("README.md"), "not copied").unwrap();
    let dir = scratch.0.join("out");
    let tensors = sample_tensors();
    let options = SaveOptions { tokenizer_from: Some(source.clone()), ..SaveOptions::default() };
    let saved = save(&dir, &json!({}), &out_tensors(&tensors), &options).unwrap();
    assert_eq!(saved.tokenizer_files, ["tokenizer.json", "generation_config.json"]);
    assert_eq!(std::fs::read_to_string(dir.join("tokenizer.json")).unwrap(), "{\"model\": 1}");
    assert!(dir.join("generation_config.json").is_file());
    assert!(!dir.join("README.md").exists());
    assert!(!dir.join("special_tokens_map.json").exists());
}

#[test]
fn an_existing_empty_directory_is_replaced_and_no_temporary_is_left() {
    let scratch = Scratch::new("empty-out");
    let dir = scratch.0.join("out");
    std::fs::create_dir_all(&dir).unwrap();
    let tensors = sample_tensors();
    save(&dir, &json!({}), &out_tensors(&tensors), &SaveOptions::default()).unwrap();
    let names: Vec<String> = std::fs::read_dir(&scratch.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["out"]);
    assert!(HfCheckpoint::open(&dir).is_ok());
}

/// Writes a single `model.safetensors` in `dir` holding `tensors` (name, dtype, shape, bytes).
pub fn write_raw(dir: &std::path::Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (name.to_string(), TensorView::new(*dtype, shape.clone(), bytes).unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

#[test]
fn bf16_f16_and_f32_files_read_as_the_same_f32_values() {
    let scratch = Scratch::new("dtypes");
    // Values exact in all three dtypes.
    let values = [1.5f32, -0.25, 3.0, 0.0, -96.0, 0.0078125];
    let bf16: Vec<u8> =
        values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let f16: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let f32: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_raw(
        &scratch.0,
        &[
            ("a.bf16", Dtype::BF16, vec![2, 3], bf16),
            ("b.f16", Dtype::F16, vec![3, 2], f16),
            ("c.f32", Dtype::F32, vec![6], f32),
        ],
    );
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    assert!(read.config().is_none());
    for (name, dtype) in [("a.bf16", Dtype::BF16), ("b.f16", Dtype::F16), ("c.f32", Dtype::F32)] {
        assert_eq!(read.tensor(name).unwrap().dtype, dtype);
        assert_eq!(read.read_f32(name).unwrap(), values, "{name}");
    }
    let mut out = [0.0f32; 6];
    read.read_into("a.bf16", &[2, 3], &mut out).unwrap();
    assert_eq!(out, values);
    // A value that only f16 holds exactly reads back exactly from f16 (not via bfloat16).
    let fine = 1.0f32 + 1.0 / 1024.0;
    write_raw(
        &scratch.0.join("fine"),
        &[("x", Dtype::F16, vec![1], half::f16::from_f32(fine).to_le_bytes().to_vec())],
    );
    let fine_read = HfCheckpoint::open(&scratch.0.join("fine")).unwrap();
    assert_eq!(fine_read.read_f32("x").unwrap(), [fine]);
}

/// Tensors stored as BF16, F16 or F32 read into bf16, f16 and f32 as their f32 values
/// converted (a run's bf16 weights read straight into their buffer are the f32 ones rounded,
/// bit for bit): values that round, ties, f16 subnormals and values past f16's range, through the
/// directory's reader and a file's range reader.
#[test]
fn every_stored_dtype_reads_into_every_type_as_its_f32_value_converted() {
    use zeroflow_core::{Float, bf16, f16};

    let scratch = Scratch::new("into");
    let values: Vec<f32> = [1.0f32 + 1.0 / 512.0, 1.0 + 3.0 / 256.0, -2.7182817, 6.1e-6, 1e-7]
        .into_iter()
        .chain([70_000.0, -1e30, 0.0, -0.0, 0.1, 3.0e-39])
        .chain((0..37).map(|i| (i as f32 * 0.731).sin() * 10f32.powi(i % 7 - 3)))
        .collect();
    let n = values.len();
    let bytes = |bits: &dyn Fn(f32) -> Vec<u8>| values.iter().flat_map(|&v| bits(v)).collect();
    write_raw(
        &scratch.0,
        &[
            ("a", Dtype::BF16, vec![n], bytes(&|v| bf16::from_f32(v).to_le_bytes().to_vec())),
            ("b", Dtype::F16, vec![n], bytes(&|v| f16::from_f32(v).to_le_bytes().to_vec())),
            ("c", Dtype::F32, vec![n], bytes(&|v| v.to_le_bytes().to_vec())),
        ],
    );
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    let file = zeroflow_hf::SafetensorsFile::open(read.file_of(read.tensor("a").unwrap())).unwrap();
    fn check<T: Float>(read: &HfCheckpoint, file: &zeroflow_hf::SafetensorsFile, n: usize) {
        for name in ["a", "b", "c"] {
            let want: Vec<u64> = read
                .read_f32(name)
                .unwrap()
                .iter()
                .map(|&v| T::from_f32(v).to_f64().to_bits())
                .collect();
            let bits =
                |values: &[T]| values.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
            let mut out = vec![T::default(); n];
            read.read_tensors_into(vec![(name, &[n][..], &mut out[..])]).unwrap();
            assert_eq!(bits(&out), want, "{name} into {:?}", T::DTYPE);
            let mut part = vec![T::default(); n - 3];
            file.read_range(name, 2..n - 1, &mut part).unwrap();
            assert_eq!(bits(&part), want[2..n - 1], "{name}'s range into {:?}", T::DTYPE);
        }
    }
    check::<f32>(&read, &file, n);
    check::<bf16>(&read, &file, n);
    check::<f16>(&read, &file, n);
}

#[test]
fn check_accepts_the_expected_names_and_shapes_and_skips_ignored_buffers() {
    let scratch = Scratch::new("check-ok");
    let f32 = |n: usize| vec![0u8; 4 * n];
    write_raw(
        &scratch.0,
        &[
            ("w", Dtype::F32, vec![2, 3], f32(6)),
            ("b", Dtype::F32, vec![3], f32(3)),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::F32, vec![2], f32(2)),
        ],
    );
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    let expected: [(&str, &[usize]); 2] = [("w", &[2, 3]), ("b", &[3])];
    read.check(expected, |name| name.ends_with("rotary_emb.inv_freq")).unwrap();
    assert!(read.check(expected, |_| false).is_err(), "the buffer is unexpected unless ignored");
}

/// One safetensors file opened by its header alone reads any range of a tensor's elements, in
/// each dtype, as the whole tensor read and sliced, and its `__metadata__` by key; a range past
/// the tensor, or an `out` of another length, is an error, and a file cut short does not open.
#[test]
fn a_safetensors_file_reads_any_range_of_a_tensor() {
    let scratch = Scratch::new("file-ranges");
    let tensors = sample_tensors();
    for dtype in [SaveDtype::F32, SaveDtype::Bf16] {
        let dir = scratch.0.join(format!("{dtype:?}"));
        save(&dir, &json!({}), &out_tensors(&tensors), &options(dtype, u64::MAX)).unwrap();
        let path = dir.join("model.safetensors");
        let whole = HfCheckpoint::open(&dir).unwrap();
        let file = zeroflow_hf::SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.tensors().count(), tensors.len());
        for (name, _, values) in &tensors {
            let expected = whole.read_f32(name).unwrap();
            let n = values.len();
            for range in [0..n, 0..0, 1..n, 3..n - 2, n - 1..n] {
                let mut out = vec![f32::NAN; range.len()];
                file.read_range(name, range.clone(), &mut out).unwrap();
                assert_eq!(out, expected[range.clone()], "{dtype:?} {name} {range:?}");
            }
            let mut out = vec![0.0; 2];
            assert!(file.read_range(name, n - 1..n + 1, &mut out).is_err(), "past the end");
            assert!(file.read_range(name, 0..3, &mut out).is_err(), "out of another length");
        }
    }
    // The metadata by key, as a file with `__metadata__` carries it.
    let path = scratch.0.join("meta.safetensors");
    let data: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![2], &data).unwrap();
    let metadata = HashMap::from([("flat_start".to_string(), "7".to_string())]);
    safetensors::serialize_to_file([("x", view)], Some(metadata), &path).unwrap();
    let file = zeroflow_hf::SafetensorsFile::open(&path).unwrap();
    assert_eq!((file.metadata("flat_start"), file.metadata("other")), (Some("7"), None));
    let mut out = [0.0f32; 1];
    file.read_range("x", 1..2, &mut out).unwrap();
    assert_eq!(out, [-2.0]);
    // Cut short by a byte: the header no longer matches the file.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let error = zeroflow_hf::SafetensorsFile::open(&path).unwrap_err().to_string();
    assert!(error.contains("meta.safetensors") && error.contains("bytes of data"), "{error}");
}

/// `read_tensors` reads every tensor, in any order asked, of every dtype (odd lengths, so that
/// tensors start off their element's alignment) and one spanning several of a read's pieces, as
/// `read_range` reads each alone; a wrong length or a missing name is refused before anything is
/// read.
#[test]
fn read_tensors_reads_each_tensor_as_read_range_does() {
    let scratch = Scratch::new("read-tensors");
    let large = 2 * zeroflow_hf::direct::READ_BUFFER_BYTES / 4 + 1001;
    let value = |i: usize| (i as f32 * 0.61).sin() * 3.0;
    let bf16: Vec<u8> = (0..7).flat_map(|i| half::bf16::from_f32(value(i)).to_le_bytes()).collect();
    let f16: Vec<u8> = (0..3).flat_map(|i| half::f16::from_f32(value(i)).to_le_bytes()).collect();
    let f32s: Vec<u8> = (0..5).flat_map(|i| value(i).to_le_bytes()).collect();
    let big: Vec<u8> = (0..large).flat_map(|i| value(i).to_le_bytes()).collect();
    write_raw(
        &scratch.0,
        &[
            ("a", Dtype::BF16, vec![7], bf16),
            ("b", Dtype::F16, vec![3], f16),
            ("c", Dtype::F32, vec![5], f32s),
            ("d", Dtype::F32, vec![large], big),
            ("e", Dtype::BF16, vec![1], half::bf16::from_f32(2.5).to_le_bytes().to_vec()),
        ],
    );
    let path = scratch.0.join("model.safetensors");
    for direct in [true, false] {
        let file = zeroflow_hf::SafetensorsFile::open_with(&path, direct).unwrap();
        let names = ["d", "b", "e", "a", "c"];
        let alone: Vec<Vec<f32>> = names
            .iter()
            .map(|name| {
                let mut out = vec![0.0; file.tensor(name).unwrap().numel()];
                file.read_range(name, 0..out.len(), &mut out).unwrap();
                out
            })
            .collect();
        assert_eq!(alone[0][large - 1], value(large - 1));
        let mut together: Vec<Vec<f32>> = alone.iter().map(|t| vec![f32::NAN; t.len()]).collect();
        let wanted = names.iter().copied().zip(together.iter_mut().map(|t| &mut t[..])).collect();
        file.read_tensors(wanted).unwrap();
        assert!(together == alone, "direct {direct}: read_tensors differs from read_range");

        let mut short = [0.0; 4];
        let error = file.read_tensors(vec![("c", &mut short[..])]).unwrap_err();
        assert!(matches!(error, zeroflow_hf::HfError::DataLength { .. }), "{error}");
        let error = file.read_tensors(vec![("z", &mut short[..])]).unwrap_err();
        assert!(matches!(error, zeroflow_hf::HfError::NoSuchTensor { .. }), "{error}");
    }
}

/// A source with its template in `chat_template.jinja`, named ones beside it, and a list of named
/// templates in its `tokenizer_config.json`: copied as they are, and with the template a model
/// was trained with, that one in `chat_template.jinja` and as the config's default, the named
/// ones kept.
#[test]
fn chat_templates_are_copied_and_the_trained_one_replaces_the_default() {
    let scratch = Scratch::new("chat-templates");
    let source = scratch.0.join("source");
    std::fs::create_dir_all(source.join("additional_chat_templates")).unwrap();
    std::fs::write(source.join("tokenizer.json"), "{}").unwrap();
    let named = json!({"eos_token": "<e>", "chat_template": [
        {"name": "default", "template": "OLD"}, {"name": "tool_use", "template": "TOOL"}]});
    std::fs::write(source.join("tokenizer_config.json"), named.to_string()).unwrap();
    std::fs::write(source.join("chat_template.jinja"), "OLD").unwrap();
    std::fs::write(source.join("additional_chat_templates/tool_use.jinja"), "TOOL").unwrap();
    let write = |dir: &std::path::Path, chat_template: Option<&str>| {
        let tokenizer = TokenizerSource { dir: Some(&source), chat_template, turn_end: None };
        let layout = DirLayout { torch_dtype: "float32", max_shard_bytes: u64::MAX, tokenizer };
        let write = |path: &std::path::Path, _| std::fs::write(path, b"weights").map_err(io);
        save_with(dir, &json!({}), &[("w", 7)], &layout, write).unwrap()
    };
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).unwrap();
    let config = |dir: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&read(dir.join("tokenizer_config.json"))).unwrap()
    };
    let copied = scratch.0.join("copied");
    let saved = write(&copied, None);
    let files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];
    let mut all = files.map(String::from).to_vec();
    all.push("additional_chat_templates/tool_use.jinja".into());
    assert_eq!(saved.tokenizer_files, all);
    assert_eq!(config(&copied), named);
    assert_eq!(read(copied.join("chat_template.jinja")), "OLD");
    assert_eq!(read(copied.join("additional_chat_templates/tool_use.jinja")), "TOOL");

    let trained = scratch.0.join("trained");
    assert_eq!(write(&trained, Some("NEW")).tokenizer_files, all);
    assert_eq!(read(trained.join("chat_template.jinja")), "NEW");
    assert_eq!(read(trained.join("additional_chat_templates/tool_use.jinja")), "TOOL");
    let mut want = named.clone();
    want["chat_template"][0]["template"] = "NEW".into();
    assert_eq!(config(&trained), want);

    // A tokenizer_config.json whose template is a string, and a source without the file: the
    // template is written all the same.
    std::fs::remove_file(source.join("chat_template.jinja")).unwrap();
    std::fs::remove_dir_all(source.join("additional_chat_templates")).unwrap();
    let plain = json!({"chat_template": "OLD", "eos_token": "<e>"});
    std::fs::write(source.join("tokenizer_config.json"), plain.to_string()).unwrap();
    let string = scratch.0.join("string");
    let saved = write(&string, Some("NEW"));
    assert_eq!(saved.tokenizer_files, files);
    assert_eq!(config(&string), json!({"chat_template": "NEW", "eos_token": "<e>"}));
    assert_eq!(read(string.join("chat_template.jinja")), "NEW");
}

/// A template's turn end joins the end-of-text ids of the copied generation config (its other
/// settings kept), or of one made from config.json's ids where the source has none; where it is
/// among them already, the file is copied as it is.
#[test]
fn a_turn_end_is_added_to_the_generation_configs_end_of_text() {
    let scratch = Scratch::new("turn-end");
    let source = scratch.0.join("source");
    std::fs::create_dir_all(&source).unwrap();
    let write = |name: &str, config: serde_json::Value, turn_end: u32| {
        let dir = scratch.0.join(name);
        let tokenizer =
            TokenizerSource { dir: Some(&source), turn_end: Some(turn_end), ..Default::default() };
        let layout = DirLayout { torch_dtype: "float32", max_shard_bytes: u64::MAX, tokenizer };
        let write = |path: &std::path::Path, _| std::fs::write(path, b"weights").map_err(io);
        let saved = save_with(&dir, &config, &[("w", 7)], &layout, write).unwrap();
        let text = std::fs::read_to_string(dir.join("generation_config.json")).ok();
        (
            saved.tokenizer_files,
            text.map(|t| serde_json::from_str::<serde_json::Value>(&t).unwrap()),
        )
    };
    let config = json!({"bos_token_id": 1, "eos_token_id": 5, "pad_token_id": null});
    // No generation config: one made from config.json's ids.
    let (files, made) = write("made", config.clone(), 7);
    assert_eq!(files, ["generation_config.json"]);
    assert_eq!(made, Some(json!({"bos_token_id": 1, "eos_token_id": [5, 7]})));
    // A generation config: the id added, its settings kept.
    let own = json!({"eos_token_id": 5, "temperature": 0.6, "top_p": 0.9});
    std::fs::write(source.join("generation_config.json"), own.to_string()).unwrap();
    let (files, added) = write("added", config.clone(), 7);
    assert_eq!(files, ["generation_config.json"]);
    assert_eq!(added, Some(json!({"eos_token_id": [5, 7], "temperature": 0.6, "top_p": 0.9})));
    // Already there: copied as it is.
    let (_, kept) = write("kept", config, 5);
    assert_eq!(kept, Some(own));
}

fn io(error: std::io::Error) -> zeroflow_hf::HfError {
    zeroflow_hf::HfError::Io { path: "weights".into(), source: error }
}
