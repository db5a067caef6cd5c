//! How the kernels store a bf16 moment: stochastic rounding with a counter-based random number.
//!
//! A bf16 has 8 significant bits, so an increment smaller than half a unit in the last place of
//! the moment is lost by rounding to nearest. For `exp_avg_sq` with β2 = 0.999 the increment is
//! `(1 - β2)(g² - v)`, a thousandth of the distance to `g²`: with round-to-nearest `v` could
//! never decrease (the largest decrement, `0.001 v`, is below half an ulp, `v / 512`), and grows
//! only when `g²` exceeds about `3 v`. Stochastic rounding rounds up with probability equal to the
//! fraction of the ulp, so every increment counts on average and the moment follows its fp32
//! trajectory without bias (the approach of torchao's `bf16_stochastic_round` and of the bf16
//! training studies that use it; Kahan summation would instead need a second buffer, which
//! defeats the saving).
//!
//! The random bits are a hash of (seed, element index): the seed is drawn from the optimizer step
//! and the moment, the index is the element's place in the partition plus the executor's
//! rounding offset (`CpuAdam::with_rounding_offset`; the engine gives the partition's start in
//! the model, so the index is the element's place in the model). So a result depends on neither
//! the thread count nor the chunking nor the ranges a step is taken in nor the number of ranks,
//! a run is bit-reproducible, and a resumed run draws what the uninterrupted one would have. The index is
//! taken modulo 2³²: elements 2³² apart in a partition share their draws, which correlates the
//! rounding noise of two unrelated parameters and nothing else.

use half::bf16;

/// The seeds of one optimizer step's rounding of each moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MomentSeeds {
    pub exp_avg: u32,
    pub exp_avg_sq: u32,
}

impl MomentSeeds {
    /// The seeds of optimizer step `step`.
    pub fn of_step(step: u64) -> Self {
        let bits = splitmix64(step);
        MomentSeeds { exp_avg: bits as u32, exp_avg_sq: (bits >> 32) as u32 }
    }
}

/// The 16 random bits that element `index` adds below a bf16's last place: the upper half of
/// `lowbias32(index ^ seed)` (Chris Wellons's 32-bit integer hash, a bijection).
#[inline(always)]
pub fn random_bits(seed: u32, index: usize) -> u32 {
    let mut x = (index as u32) ^ seed;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^= x >> 16;
    x >> 16
}

/// `x` rounded to bf16 stochastically with `random` (below 2¹⁶): the bits below the bf16's last
/// place plus `random` carry into it or not, so `x` rounds away from zero with probability equal
/// to the discarded fraction of an ulp. Exact values, zeros and infinities stay what they are;
/// NaN is kept quiet with its upper mantissa bits (as `bf16::from_f32` does).
#[inline(always)]
pub fn stochastic_bf16(x: f32, random: u32) -> bf16 {
    debug_assert!(random < 1 << 16);
    if x.is_nan() {
        return bf16::from_f32(x);
    }
    bf16::from_bits((x.to_bits().wrapping_add(random) >> 16) as u16)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stochastic rounding lands on one of the two bf16 neighbours of `x`, and on average on
    /// `x` itself: over 2¹⁶ consecutive indices the mean of the rounded values is within a
    /// hundredth of an ulp of `x`.
    #[test]
    fn stochastic_rounding_is_unbiased_between_the_two_neighbours() {
        for x in [1.0f32 + 0.3 / 128.0, -3.7e-7, 2.5e12, 1.0e-38] {
            let down = bf16::from_bits((x.to_bits() >> 16) as u16).to_f32();
            let up = bf16::from_bits((x.to_bits() >> 16) as u16 + 1).to_f32();
            let seed = MomentSeeds::of_step(7).exp_avg_sq;
            let mut sum = 0.0f64;
            for index in 0..1usize << 16 {
                let rounded = stochastic_bf16(x, random_bits(seed, index)).to_f32();
                assert!(rounded == down || rounded == up, "{x} rounded to {rounded}");
                sum += f64::from(rounded);
            }
            let mean = sum / f64::from(1u32 << 16);
            let ulp = f64::from(up) - f64::from(down);
            assert!((mean - f64::from(x)).abs() < 0.01 * ulp.abs(), "{x}: mean {mean}");
        }
    }

    /// Values a bf16 holds exactly, zeros, infinities and NaN come through unchanged.
    #[test]
    fn exact_values_and_specials_are_kept() {
        for x in [0.0f32, -0.0, 1.0, -2.5, f32::INFINITY, f32::NEG_INFINITY] {
            for random in [0, 1, 0x8000, 0xFFFF] {
                assert_eq!(stochastic_bf16(x, random).to_bits(), bf16::from_f32(x).to_bits());
            }
        }
        assert!(stochastic_bf16(f32::NAN, 0xFFFF).is_nan());
    }

    /// Different steps and the two moments draw different seeds.
    #[test]
    fn seeds_differ_by_step_and_moment() {
        let (a, b) = (MomentSeeds::of_step(1), MomentSeeds::of_step(2));
        assert_ne!(a, b);
        assert_ne!(a.exp_avg, a.exp_avg_sq);
    }
}
