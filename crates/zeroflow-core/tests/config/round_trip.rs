//! The resolved JSON is itself a valid config that resolves to the same values, with nothing left
//! to warn about or to fill in.

use zeroflow_core::config::{self, Overrides};

use super::{FIXTURES, context, fixture};

#[test]
fn every_fixture_round_trips_through_its_resolved_json() {
    for name in FIXTURES {
        for world_size in [1, 2, 4, 8] {
            let Ok(first) = config::resolve_file(
                &super::fixture_path(name),
                &context(world_size, Overrides::default()),
            ) else {
                continue; // Some batch sizes do not divide every world size.
            };
            let json = first.config.to_resolved_json();
            let again = config::resolve_str(&json, &context(world_size, Overrides::default()))
                .unwrap_or_else(|error| {
                    panic!("{name}: the resolved JSON is invalid: {error}\n{json}")
                });
            assert_eq!(again.config, first.config, "{name} at world size {world_size}");
            assert!(again.warnings.is_empty(), "{name}: {:?}", again.warnings);
            assert!(again.auto_values.is_empty(), "{name}: {:?}", again.auto_values);
        }
    }
}

#[test]
fn the_resolved_json_uses_deepspeed_key_names_with_defaults_filled_in() {
    let json = fixture("fp16_zero1_megatron.json", 1).config.to_json();
    assert_eq!(json["train_micro_batch_size_per_gpu"], 8);
    assert_eq!(json["fp16"]["initial_scale_power"], 16);
    assert_eq!(json["zero_optimization"]["reduce_bucket_size"], 500_000_000);
    assert_eq!(json["zero_optimization"]["overlap_comm"], false);
    assert_eq!(json["zero_optimization"]["offload_optimizer"]["device"], "none");
    assert_eq!(json["optimizer"]["type"], "AdamW");
    assert_eq!(json["optimizer"]["params"]["adam_w_mode"], true);
    assert_eq!(json["gradient_clipping"], 1.0);
    assert!(json.get("scheduler").is_none(), "no scheduler in the file, none in the output");
}

#[test]
fn the_resolved_json_of_an_all_auto_config_has_no_auto_left() {
    let text = fixture("hf_ds_config_zero2.json", 4).config.to_resolved_json();
    assert!(!text.contains("auto"), "{text}");
}
