//! DeepSpeed's batch rule, `train = micro × accumulation × world`, as a property: any two of the
//! three fix the third, and a wrong third is rejected.

use std::num::NonZeroU32;

use proptest::prelude::*;
use zeroflow_core::config::{BatchSizes, ConfigError, derive_batch_sizes};

fn world(size: u32) -> NonZeroU32 {
    NonZeroU32::new(size).expect("generated world sizes are positive")
}

fn is_conflict(result: &Result<BatchSizes, ConfigError>) -> bool {
    matches!(result, Err(ConfigError::Conflict { .. }))
}

proptest! {
    #[test]
    fn any_two_sizes_derive_the_third(micro in 1u64..=64, accumulation in 1u64..=64, ranks in 1u32..=64) {
        let train = micro * accumulation * u64::from(ranks);
        let expected = BatchSizes {
            train_batch_size: train,
            micro_batch_size_per_gpu: micro,
            gradient_accumulation_steps: accumulation,
        };
        let world = world(ranks);
        prop_assert_eq!(derive_batch_sizes(Some(train), Some(micro), None, world)?, expected);
        prop_assert_eq!(derive_batch_sizes(Some(train), None, Some(accumulation), world)?, expected);
        prop_assert_eq!(derive_batch_sizes(None, Some(micro), Some(accumulation), world)?, expected);
        prop_assert_eq!(derive_batch_sizes(Some(train), Some(micro), Some(accumulation), world)?, expected);
    }

    #[test]
    fn a_wrong_third_size_is_rejected(
        micro in 1u64..=64,
        accumulation in 1u64..=64,
        ranks in 1u32..=64,
        offset in 1u64..=1000,
    ) {
        let train = micro * accumulation * u64::from(ranks);
        let world = world(ranks);
        let wrong_train = derive_batch_sizes(Some(train + offset), Some(micro), Some(accumulation), world);
        prop_assert!(is_conflict(&wrong_train), "{:?}", wrong_train);
        let wrong_micro = derive_batch_sizes(Some(train), Some(micro + offset), Some(accumulation), world);
        prop_assert!(is_conflict(&wrong_micro), "{:?}", wrong_micro);
        let wrong_accumulation = derive_batch_sizes(Some(train), Some(micro), Some(accumulation + offset), world);
        prop_assert!(is_conflict(&wrong_accumulation), "{:?}", wrong_accumulation);
    }

    #[test]
    fn a_train_batch_that_does_not_divide_derives_nothing(
        micro in 1u64..=64,
        accumulation in 1u64..=64,
        ranks in 1u32..=64,
        remainder_seed in any::<u64>(),
    ) {
        let step = micro * u64::from(ranks);
        prop_assume!(step > 1);
        let remainder = 1 + remainder_seed % (step - 1);
        let train = step * accumulation + remainder;
        let result = derive_batch_sizes(Some(train), Some(micro), None, world(ranks));
        prop_assert!(is_conflict(&result), "{:?}", result);
    }

    #[test]
    fn the_train_batch_alone_splits_over_ranks_with_one_accumulation_step(
        per_rank in 1u64..=256,
        ranks in 1u32..=64,
    ) {
        let train = per_rank * u64::from(ranks);
        let sizes = derive_batch_sizes(Some(train), None, None, world(ranks))?;
        prop_assert_eq!(sizes.micro_batch_size_per_gpu, per_rank);
        prop_assert_eq!(sizes.gradient_accumulation_steps, 1);
    }
}
