//! Normal(0, std) initial values for any family: each parameter draws from its own ChaCha8
//! stream (the seed, the parameter's index), in blocks that seek the stream, so that the values
//! depend neither on the flat layout nor on the number of threads. The values are drawn as f64
//! and converted by the caller's `of` into the buffer's own type (a run's bf16 weights are
//! written straight into their buffer, with no f32 copy beside it).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Elements of one parameter that one task draws (even: every block starts on a Box–Muller
/// pair). 2^20 keeps the largest parameters of an 8 B model (the 500 M-element token embedding
/// at width 4096) from being a single thread's tail.
pub const NORMAL_BLOCK: usize = 1 << 20;

/// ChaCha8 words (`u32`) one Box–Muller pair consumes: two `f64` draws of one `u64` each.
const WORDS_PER_PAIR: u128 = 4;

/// Fills `values`, parameter `index`'s normal(0, `std`) draws from `seed`, in parallel tasks of
/// `block` elements (even, non-zero), each converted by `of`: the values of one sequential pass
/// over the parameter's stream ([`normal_stream`], [`fill_normal`]) whatever the threads.
pub fn fill_normal_blocks<T: Send>(
    seed: u64,
    index: usize,
    std: f64,
    values: &mut [T],
    block: usize,
    of: &(impl Fn(f64) -> T + Sync),
) {
    debug_assert!(block > 0 && block.is_multiple_of(2), "blocks start on a Box–Muller pair");
    values.par_chunks_mut(block).enumerate().for_each(|(number, part)| {
        let mut rng = normal_stream(seed, index);
        rng.set_word_pos(WORDS_PER_PAIR * (number * block / 2) as u128);
        fill_normal(&mut rng, std, part, of);
    });
}

/// The stream parameter `index` draws its values from.
pub fn normal_stream(seed: u64, index: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(index as u64);
    rng
}

/// Fills `out` with normal(0, std) samples (Box–Muller, both outputs used), each converted by
/// `of`.
pub fn fill_normal<T>(rng: &mut ChaCha8Rng, std: f64, out: &mut [T], of: &impl Fn(f64) -> T) {
    for pair in out.chunks_mut(2) {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt() * std;
        let angle = std::f64::consts::TAU * u2;
        pair[0] = of(radius * angle.cos());
        if let Some(second) = pair.get_mut(1) {
            *second = of(radius * angle.sin());
        }
    }
}
