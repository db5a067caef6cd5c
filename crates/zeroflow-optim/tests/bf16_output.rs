//! The bf16 copy written in the AdamW pass is exactly `half::bf16::from_f32` of the weights.

use rand::Rng;
use zeroflow_optim::{AdamWConfig, AdamWStep, CpuAdam, Grads, Output, SimdLevel, bf16};

use crate::support::{State, rng};

/// f32 values whose rounding to bf16 is delicate: ties (to even, both ways), values just above
/// and below ties, the largest finite values (which round to infinity), infinities, NaNs with
/// payloads, signed zeros, subnormals.
fn delicate_values() -> Vec<f32> {
    let bits: [u32; 20] = [
        0x3F80_8000, // 1 + half an ulp of bf16: a tie, rounds down to even
        0x3F81_8000, // a tie that rounds up to even
        0x3F80_8001, // just above a tie
        0x3F80_7FFF, // just below a tie
        0x7F7F_FFFF, // f32::MAX: rounds to infinity
        0x7F7F_7FFF, // stays finite
        0xFF7F_FFFF, // -f32::MAX
        0x7F80_0000, // +inf
        0xFF80_0000, // -inf
        0x7FC0_0000, // quiet NaN
        0x7F80_0001, // signalling NaN with a low payload
        0xFFA0_1234, // negative NaN with a payload
        0x0000_0000, // +0
        0x8000_0000, // -0
        0x0000_0001, // smallest subnormal
        0x0000_8000, // subnormal tie
        0x007F_FFFF, // largest subnormal: rounds up to the smallest normal
        0x8040_8000, // negative subnormal tie
        0x3EAA_AAAB, // 1/3
        0xC2F6_E979, // -123.456
    ];
    bits.into_iter().map(f32::from_bits).collect()
}

/// Steps `weights` with zero gradients and returns the weights after the step and the bf16 copy
/// the kernel wrote of them.
fn step_and_copy(
    level: SimdLevel,
    config: &AdamWConfig,
    weights: &[f32],
    exp_avg: Vec<f32>,
) -> (Vec<f32>, Vec<bf16>) {
    let step = AdamWStep::new(config, 1, 1.0).expect("valid");
    let len = weights.len();
    let mut state = State { params: weights.to_vec(), exp_avg, exp_avg_sq: vec![0.0; len] };
    let grads = vec![0.0f32; len];
    let mut copy = vec![bf16::ZERO; len];
    let adam = CpuAdam::new(1, level).expect("available");
    adam.step(&step, state.view(), Grads::F32(&grads), Output::AlsoBf16(&mut copy))
        .expect("lengths match");
    (state.params, copy)
}

/// Asserts that every copy has exactly the bits of `bf16::from_f32` of its weight.
fn assert_copies_match(level: SimdLevel, weights: &[f32], copy: &[bf16]) {
    for (c, w) in copy.iter().zip(weights) {
        let expected = bf16::from_f32(*w);
        assert_eq!(
            c.to_bits(),
            expected.to_bits(),
            "{level}: f32 {:#010x} gave bf16 {:#06x}, from_f32 gives {:#06x}",
            w.to_bits(),
            c.to_bits(),
            expected.to_bits()
        );
    }
}

/// For every SIMD level, the bf16 copy of ties, near-ties, values that round up to infinity,
/// NaNs with payloads, signed zeros, subnormals and 100 000 random bit patterns of every
/// exponent, in body and tail positions, has exactly the bits of `bf16::from_f32` of the f32
/// weight. (lr = 0, no decay, zero gradients and moments and eps = 1 make the step an identity on
/// finite weights, so these values reach the bf16 writer unchanged.)
#[test]
fn bf16_copy_equals_half_from_f32_for_every_class_of_value() {
    let mut rng = rng(5);
    let mut weights = delicate_values();
    weights.extend((0..100_000).map(|_| f32::from_bits(rng.random::<u32>())));
    weights.extend(delicate_values()); // again at the end, in the tail
    let identity = AdamWConfig { lr: 0.0, eps: 1.0, weight_decay: 0.0, ..AdamWConfig::default() };
    for level in SimdLevel::available() {
        let (after, copy) = step_and_copy(level, &identity, &weights, vec![0.0; weights.len()]);
        for (after, before) in after.iter().zip(&weights).filter(|(_, w)| w.is_finite()) {
            assert_eq!(after.to_bits(), before.to_bits(), "{level}: the identity step moved");
        }
        assert_copies_match(level, &after, &copy);
    }
}

/// Weights that the step pushes past the largest f32 are copied as bf16 infinities of the right
/// sign (`from_f32` of the f32 infinities).
#[test]
fn weights_overflowing_to_infinity_are_copied_as_infinities() {
    let weights = vec![f32::MAX, -f32::MAX, f32::MAX, -f32::MAX, 1.0];
    // p = p - lr m / (sqrt(v) + eps) with lr = 1, eps = 1, v = 0 and m = 0.9 m0 (zero gradient).
    let exp_avg = vec![-3e38, 3e38, -3e38, 3e38, 0.0];
    let config = AdamWConfig {
        lr: 1.0,
        eps: 1.0,
        weight_decay: 0.0,
        bias_correction: false,
        ..AdamWConfig::default()
    };
    for level in SimdLevel::available() {
        let (after, copy) = step_and_copy(level, &config, &weights, exp_avg.clone());
        assert_eq!(
            &after[..4],
            [f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY, f32::NEG_INFINITY]
        );
        assert_copies_match(level, &after, &copy);
        assert_eq!(copy[0], bf16::INFINITY, "{level}");
        assert_eq!(copy[1], bf16::NEG_INFINITY, "{level}");
    }
}

/// After a real step, the bf16 copy equals `bf16::from_f32` of the updated fp32 weights (the
/// copy is of the new weights, not the old ones).
#[test]
fn bf16_copy_is_of_the_updated_weights() {
    let mut rng = rng(6);
    let len = 1037;
    let start = State::random(&mut rng, len);
    let grads: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let config = AdamWConfig { lr: 0.05, ..AdamWConfig::default() };
    let step = AdamWStep::new(&config, 1, 1.0).expect("valid");
    for level in SimdLevel::available() {
        let mut state = start.clone();
        let mut copy = vec![bf16::ZERO; len];
        let adam = CpuAdam::new(1, level).expect("available");
        adam.step(&step, state.view(), Grads::F32(&grads), Output::AlsoBf16(&mut copy))
            .expect("lengths match");
        let expected: Vec<bf16> = state.params.iter().map(|&p| bf16::from_f32(p)).collect();
        let stale: Vec<bf16> = start.params.iter().map(|&p| bf16::from_f32(p)).collect();
        assert_eq!(copy, expected, "{level}");
        assert_ne!(copy, stale, "{level}: the step moved the weights by more than a bf16 ulp");
    }
}
