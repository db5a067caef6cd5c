//! Parameter names, shapes, initialisation and the Hugging Face mapping.

use zeroflow_core::layout::{Alignment, FlatLayout};
use zeroflow_gpt::{GptConfig, hf_tensors, init_params, param_specs};

fn std_dev(values: &[f32]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    (values.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// Weights are normal(0, 0.02), residual projections 0.02/sqrt(2·n_layer), LayerNorm weights 1,
/// biases 0, padded embedding rows 0; and the values do not depend on the layout's world size or
/// alignment, only on the seed.
#[test]
fn initialisation_follows_gpt2_and_is_deterministic_across_layouts() {
    let config = GptConfig { n_layer: 4, n_head: 4, d_model: 64, vocab_size: 100, context: 32 };
    let specs = param_specs(&config);
    let one = FlatLayout::new(&specs, 1, Alignment::default()).unwrap();
    let three = FlatLayout::new(&specs, 3, Alignment { param: 8, partition: 2 }).unwrap();
    let mut a = vec![0.0f32; one.padded_len()];
    let mut b = vec![0.0f32; three.padded_len()];
    init_params(&config, &one, 9, &mut a).unwrap();
    init_params(&config, &three, 9, &mut b).unwrap();
    let mut c = vec![0.0f32; one.padded_len()];
    init_params(&config, &one, 10, &mut c).unwrap();
    assert_ne!(a, c, "another seed gives other weights");
    for view in one.params() {
        let other = three.param(&view.name).unwrap();
        let values = &a[view.flat_range()];
        assert_eq!(values, &b[other.flat_range()], "{} is layout-independent", view.name);
        let name = view.name.as_str();
        if name.ends_with(".bias") {
            assert!(values.iter().all(|&x| x == 0.0), "{name}");
        } else if name.contains("ln_") {
            assert!(values.iter().all(|&x| x == 1.0), "{name}");
        } else if name == "transformer.wte.weight" {
            let (real, padded) = values.split_at(100 * 64);
            assert!((std_dev(real) - 0.02).abs() < 0.001, "{name}");
            assert!(padded.iter().all(|&x| x == 0.0), "padded rows start at zero");
        } else {
            let expected = if name.ends_with("c_proj.weight") { 0.02 / 8f64.sqrt() } else { 0.02 };
            let measured = std_dev(values);
            assert!(
                (measured / expected - 1.0).abs() < 0.1,
                "{name}: std {measured}, expected {expected}"
            );
        }
    }
    for range in one.padding_ranges() {
        assert!(a[range].iter().all(|&x| x == 0.0), "flat padding stays zero");
    }
}

/// The export mapping has Hugging Face GPT-2's names and shapes; the token embedding drops the
/// padded rows.
#[test]
fn the_hugging_face_mapping_has_gpt2_names_and_shapes() {
    let config = GptConfig::named("gpt2-124m").unwrap();
    let layout = FlatLayout::new(&param_specs(&config), 1, Alignment::default()).unwrap();
    let tensors = hf_tensors(&config, &layout).unwrap();
    let shape = |name: &str| tensors.iter().find(|t| t.name == name).unwrap().shape.clone();
    assert_eq!(tensors.len(), 2 + 12 * 12 + 2);
    assert_eq!(shape("transformer.wte.weight"), [50257, 768]);
    assert_eq!(shape("transformer.wpe.weight"), [1024, 768]);
    assert_eq!(shape("transformer.h.0.attn.c_attn.weight"), [768, 2304]);
    assert_eq!(shape("transformer.h.11.attn.c_proj.weight"), [768, 768]);
    assert_eq!(shape("transformer.h.3.mlp.c_fc.weight"), [768, 3072]);
    assert_eq!(shape("transformer.h.3.mlp.c_proj.weight"), [3072, 768]);
    assert_eq!(shape("transformer.ln_f.bias"), [768]);
    let total: usize = tensors.iter().map(|t| t.flat_range.len()).sum();
    assert_eq!(total, config.num_params());
    let wte = layout.param("transformer.wte.weight").unwrap();
    let exported = &tensors[0];
    assert_eq!(exported.flat_range, wte.offset..wte.offset + 50257 * 768);
}
