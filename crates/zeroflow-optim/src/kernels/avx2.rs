//! The AVX2 + FMA kernel: 8 lanes, fused multiply-adds, bf16 widened and rounded with integer ops.
//! It computes exactly what the AVX-512 kernel computes, 8 lanes at a time.

use std::arch::x86_64::*;

use half::bf16;

use crate::config::StepScalars;
use crate::kernels::PREFETCH_DISTANCE;
use crate::piece::{GradElem, MomentElem, Piece, Split, for_each_lanes, split_for_streaming};
use crate::rounding::MomentSeeds;

const LANES: usize = 8;
/// Bytes of one vector of bf16 copies: the alignment their streaming store needs.
const COPY_BYTES: usize = LANES * 2;
/// Bytes of one vector of f32: the alignment their streaming store needs.
const F32_BYTES: usize = LANES * 4;

/// The step's scalars broadcast to all lanes, once per kernel call.
struct Broadcast {
    grad_scale: __m256,
    l2: __m256,
    one_minus_beta1: __m256,
    one_minus_beta2: __m256,
    inv_sqrt_bias_correction2: __m256,
    eps: __m256,
    neg_lr_weight_decay: __m256,
    neg_step_size: __m256,
    /// The rounding seeds of bf16 moments.
    seed_exp_avg: __m256i,
    seed_exp_avg_sq: __m256i,
}

/// AdamW over one piece whose first element is element `start` of the partition; with
/// `stream_copy`, the bf16 copy's aligned body is written with streaming stores (it is
/// write-only: this saves reading its lines before writing them).
#[target_feature(enable = "avx2,fma")]
pub(super) fn adamw<G: GradElem, M: MomentElem>(
    s: &StepScalars,
    seeds: MomentSeeds,
    stream_copy: bool,
    start: usize,
    piece: Piece<'_, G, M>,
) {
    let k = Broadcast {
        grad_scale: _mm256_set1_ps(s.grad_scale),
        l2: _mm256_set1_ps(s.l2),
        one_minus_beta1: _mm256_set1_ps(s.one_minus_beta1),
        one_minus_beta2: _mm256_set1_ps(s.one_minus_beta2),
        inv_sqrt_bias_correction2: _mm256_set1_ps(s.inv_sqrt_bias_correction2),
        eps: _mm256_set1_ps(s.eps),
        neg_lr_weight_decay: _mm256_set1_ps(s.neg_lr_weight_decay),
        neg_step_size: _mm256_set1_ps(s.neg_step_size),
        seed_exp_avg: _mm256_set1_epi32(seeds.exp_avg as i32),
        seed_exp_avg_sq: _mm256_set1_epi32(seeds.exp_avg_sq as i32),
    };
    let Some(out_addr) = piece.out_addr().filter(|_| stream_copy) else {
        return adamw_lanes::<G, M, false>(&k, start, piece);
    };
    let [head, body, tail] = split_for_streaming(piece, out_addr, 2, COPY_BYTES, LANES);
    let (body_start, tail_start) = (start + head.len(), start + head.len() + body.len());
    adamw_lanes::<G, M, false>(&k, start, head);
    adamw_lanes::<G, M, true>(&k, body_start, body);
    _mm_sfence(); // Streaming stores are weakly ordered: fence them before the data is handed on.
    adamw_lanes::<G, M, false>(&k, tail_start, tail);
}

/// AdamW over one piece starting at element `start` of the partition. With `STREAM_COPY`, the
/// piece's bf16 copy must start `COPY_BYTES`-aligned and its length be a multiple of `LANES`
/// (checked), and it is written with streaming stores.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn adamw_lanes<G: GradElem, M: MomentElem, const STREAM_COPY: bool>(
    k: &Broadcast,
    start: usize,
    piece: Piece<'_, G, M>,
) {
    if STREAM_COPY {
        assert_streamable(piece.out_addr(), COPY_BYTES, piece.len());
    }
    for_each_lanes::<G, M, LANES>(piece, |index, p, g, m, v, out| {
        prefetch_ahead(p, g, m, v);
        let p0 = load(p);
        let m0 = load_moment(m);
        let v0 = load_moment(v);
        let grad = _mm256_fmadd_ps(p0, k.l2, _mm256_mul_ps(load_grad(g), k.grad_scale));
        let m1 = _mm256_fmadd_ps(k.one_minus_beta1, _mm256_sub_ps(grad, m0), m0);
        let v1 = _mm256_fmadd_ps(k.one_minus_beta2, _mm256_fmsub_ps(grad, grad, v0), v0);
        let denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v1), k.inv_sqrt_bias_correction2, k.eps);
        let decayed = _mm256_fmadd_ps(p0, k.neg_lr_weight_decay, p0);
        let p1 = _mm256_fmadd_ps(_mm256_div_ps(m1, denom), k.neg_step_size, decayed);
        store(p, p1);
        if M::IS_BF16 {
            let element = start + index;
            store_moment::<M, false>(m, m1, Some(random_bits(k.seed_exp_avg, element)));
            store_moment::<M, false>(v, v1, Some(random_bits(k.seed_exp_avg_sq, element)));
        } else {
            store_moment::<M, false>(m, m1, None);
            store_moment::<M, false>(v, v1, None);
        }
        if let Some(out) = out {
            store_copy::<STREAM_COPY>(out, round_to_bf16(p1));
        }
    });
}

/// The roofline's update over one piece: `t = c g; p += t; m += t; v += t`, and the bf16 copy
/// (truncated) if the piece has one.
///
/// With `prefetch`, it asks for the lines ahead as the AdamW kernel does. With `stream_state`,
/// the weights and both moments are written with streaming stores where
/// all three are aligned (from the weights' first aligned element on; large allocations are
/// equally aligned); with `stream_copy`, the copy where it is aligned at the same place (or from
/// its own first aligned element when the state is not streamed). Ordinary stores elsewhere.
#[target_feature(enable = "avx2,fma")]
pub(super) fn stream<G: GradElem, M: MomentElem>(
    c: f32,
    stream_state: bool,
    stream_copy: bool,
    prefetch: bool,
    piece: Piece<'_, G, M>,
) {
    let c = _mm256_set1_ps(c);
    let anchor = if stream_state {
        Some((piece.params.as_ptr() as usize, 4, F32_BYTES))
    } else if stream_copy {
        piece.out_addr().map(|addr| (addr, 2, COPY_BYTES))
    } else {
        None
    };
    let Some((addr, elem_size, align)) = anchor else {
        return stream_lanes::<G, M, false, false>(c, prefetch, piece);
    };
    let [head, body, tail] = split_for_streaming(piece, addr, elem_size, align, LANES);
    stream_lanes::<G, M, false, false>(c, prefetch, head);
    let aligned = |addr: usize, align: usize| addr.is_multiple_of(align);
    let state_aligned = stream_state
        && aligned(body.params.as_ptr() as usize, F32_BYTES)
        && [body.exp_avg.as_ptr(), body.exp_avg_sq.as_ptr()]
            .into_iter()
            .all(|ptr| aligned(ptr as usize, moment_bytes::<M>()));
    let copy_aligned = stream_copy && body.out_addr().is_some_and(|addr| aligned(addr, COPY_BYTES));
    match (state_aligned, copy_aligned) {
        (true, true) => stream_lanes::<G, M, true, true>(c, prefetch, body),
        (true, false) => stream_lanes::<G, M, true, false>(c, prefetch, body),
        (false, true) => stream_lanes::<G, M, false, true>(c, prefetch, body),
        (false, false) => stream_lanes::<G, M, false, false>(c, prefetch, body),
    }
    _mm_sfence();
    stream_lanes::<G, M, false, false>(c, prefetch, tail);
}

/// Bytes of one vector of moments: the alignment their streaming store needs.
const fn moment_bytes<M: MomentElem>() -> usize {
    LANES * size_of::<M>()
}

/// The roofline's update with streaming stores for the weights and moments (`STREAM_STATE`:
/// they must start `F32_BYTES`- and `moment_bytes`-aligned) and for the copy (`STREAM_COPY`: it must start
/// `COPY_BYTES`-aligned); with either, the length must be a multiple of `LANES` (all checked).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn stream_lanes<G: GradElem, M: MomentElem, const STREAM_STATE: bool, const STREAM_COPY: bool>(
    c: __m256,
    prefetch: bool,
    piece: Piece<'_, G, M>,
) {
    if STREAM_STATE {
        assert_streamable(Some(piece.params.as_ptr() as usize), F32_BYTES, piece.len());
        for addr in [piece.exp_avg.as_ptr(), piece.exp_avg_sq.as_ptr()] {
            assert_streamable(Some(addr as usize), moment_bytes::<M>(), piece.len());
        }
    }
    if STREAM_COPY {
        assert_streamable(piece.out_addr(), COPY_BYTES, piece.len());
    }
    for_each_lanes::<G, M, LANES>(piece, |_, p, g, m, v, out| {
        if prefetch {
            prefetch_ahead(p, g, m, v);
        }
        let t = _mm256_mul_ps(load_grad(g), c);
        let p1 = _mm256_add_ps(load(p), t);
        store_state::<STREAM_STATE>(p, p1);
        store_moment::<M, STREAM_STATE>(m, _mm256_add_ps(load_moment(m), t), None);
        store_moment::<M, STREAM_STATE>(v, _mm256_add_ps(load_moment(v), t), None);
        if let Some(out) = out {
            let upper = _mm256_srli_epi32::<16>(_mm256_castps_si256(p1));
            let truncated = _mm_packus_epi32(
                _mm256_castsi256_si128(upper),
                _mm256_extracti128_si256::<1>(upper),
            );
            store_copy::<STREAM_COPY>(out, truncated);
        }
    });
}

/// Panics unless the buffer at `addr` is empty, or `align`-byte aligned with `len` a multiple of
/// `LANES`: then every `LANES`-element array of it that `for_each_lanes` hands out is aligned too
/// (and none comes from its unaligned tail scratch), which streaming stores require.
#[inline]
fn assert_streamable(addr: Option<usize>, align: usize, len: usize) {
    assert!(
        len == 0
            || (addr.is_some_and(|addr| addr.is_multiple_of(align)) && len.is_multiple_of(LANES)),
        "a streamed buffer starts {align}-byte aligned and has whole vectors"
    );
}

/// Asks for the lines `PREFETCH_DISTANCE` elements ahead of each input stream (a prefetch
/// never faults, so running past the end of the buffer is harmless).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_ahead<G, M>(p: &[f32; LANES], g: &[G; LANES], m: &[M; LANES], v: &[M; LANES]) {
    _mm_prefetch::<_MM_HINT_T0>(p.as_ptr().wrapping_add(PREFETCH_DISTANCE).cast::<i8>());
    _mm_prefetch::<_MM_HINT_T0>(g.as_ptr().wrapping_add(PREFETCH_DISTANCE).cast::<i8>());
    _mm_prefetch::<_MM_HINT_T0>(m.as_ptr().wrapping_add(PREFETCH_DISTANCE).cast::<i8>());
    _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().wrapping_add(PREFETCH_DISTANCE).cast::<i8>());
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn load(x: &[f32; LANES]) -> __m256 {
    // SAFETY: the array is 8 f32, exactly the 32 bytes an unaligned 256-bit load reads.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// Copies `from` (f32, or bf16 widened exactly) into `into`, with streaming stores for the
/// 32-byte aligned body of `into`: a copy only written is not read into the cache first (12
/// bytes per element of a state's save, not 24). Fenced at the end, as the kernels are.
#[target_feature(enable = "avx2,fma")]
pub(super) fn save<M: MomentElem>(from: &[M], into: &mut [f32]) {
    assert_eq!(from.len(), into.len(), "a save copies as many elements as it reads");
    let head = ((F32_BYTES - into.as_ptr() as usize % F32_BYTES) % F32_BYTES / 4).min(into.len());
    let (into_head, into_rest) = into.split_at_mut(head);
    let (from_head, from_rest) = from.split_at(head);
    super::scalar::save(from_head, into_head);
    let (into_body, into_tail) = into_rest.as_chunks_mut::<LANES>();
    let (from_body, from_tail) = from_rest.as_chunks::<LANES>();
    for (x, y) in from_body.iter().zip(into_body) {
        let value = load_moment(x);
        // SAFETY: `y` is 8 f32 (32 bytes) held mutably, and 32-byte aligned: the head was cut
        // where `into` reaches that alignment, and the body is whole arrays from there.
        unsafe { _mm256_stream_ps(y.as_mut_ptr(), value) }
    }
    super::scalar::save(from_tail, into_tail);
    _mm_sfence(); // Streaming stores are weakly ordered: fence them before the data is handed on.
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn store(x: &mut [f32; LANES], value: __m256) {
    // SAFETY: the array is 8 f32, exactly the 32 bytes an unaligned 256-bit store writes, and
    // we hold it mutably.
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), value) }
}

/// An ordinary store, or with `STREAM` a streaming one into an array that the caller guarantees
/// (through `assert_streamable`) to be 32-byte aligned.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store_state<const STREAM: bool>(x: &mut [f32; LANES], value: __m256) {
    if STREAM {
        // SAFETY: the array is 8 f32 (32 bytes) and held mutably; `stream_lanes` checked that
        // its buffer starts 32-byte aligned with a whole number of arrays, so this array is
        // 32-byte aligned as the streaming store requires.
        unsafe { _mm256_stream_ps(x.as_mut_ptr(), value) }
    } else {
        store(x, value);
    }
}

/// Stores eight packed bf16: ordinary, or with `STREAM` streaming into an array that the caller
/// guarantees (through `assert_streamable`) to be 16-byte aligned.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store_copy<const STREAM: bool>(out: &mut [bf16; LANES], halves: __m128i) {
    let ptr = out.as_mut_ptr().cast::<__m128i>();
    if STREAM {
        // SAFETY: the array is 8 bf16 (16 bytes) and held mutably; the kernel checked that its
        // buffer starts 16-byte aligned with a whole number of arrays, so this array is 16-byte
        // aligned as the streaming store requires.
        unsafe { _mm_stream_si128(ptr, halves) }
    } else {
        // SAFETY: the array is 8 bf16, exactly the 16 bytes an unaligned 128-bit store writes,
        // and we hold it mutably.
        unsafe { _mm_storeu_si128(ptr, halves) }
    }
}

/// Eight gradients as f32: loaded directly, or widened from bf16 by a 16-bit left shift.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_grad<G: GradElem>(g: &[G; LANES]) -> __m256 {
    const { assert!(size_of::<G>() == if G::IS_BF16 { 2 } else { 4 }) };
    if G::IS_BF16 {
        // SAFETY: `G` is bf16 (the sealed trait's flag, size checked above): the array is 8
        // 2-byte values, exactly the 16 bytes of an unaligned 128-bit load.
        let bits = unsafe { _mm_loadu_si128(g.as_ptr().cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    } else {
        // SAFETY: `G` is f32 (size checked above): the array is 8 f32, the 32 bytes of an
        // unaligned 256-bit load.
        unsafe { _mm256_loadu_ps(g.as_ptr().cast::<f32>()) }
    }
}

/// Rounds eight f32 to bf16 like `half::bf16::from_f32`: to nearest even, NaN kept quiet with
/// its upper mantissa bits. Returns them packed in 128 bits.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn round_to_bf16(x: __m256) -> __m128i {
    let bits = _mm256_castps_si256(x);
    let upper = _mm256_srli_epi32::<16>(bits);
    let lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
    let quiet_nan = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let words = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Every 32-bit word is at most 0xFFFF, so the unsigned saturating pack is exact; packing the
    // two 128-bit halves against each other keeps the lanes in order.
    _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256::<1>(words))
}

/// Eight moments as f32: loaded directly, or widened from bf16 by a 16-bit left shift.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load_moment<M: MomentElem>(x: &[M; LANES]) -> __m256 {
    const { assert!(size_of::<M>() == if M::IS_BF16 { 2 } else { 4 }) };
    if M::IS_BF16 {
        // SAFETY: `M` is bf16 (the sealed trait's flag, size checked above): the array is 8
        // 2-byte values, exactly the 16 bytes of an unaligned 128-bit load.
        let bits = unsafe { _mm_loadu_si128(x.as_ptr().cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    } else {
        // SAFETY: `M` is f32 (size checked above): the array is 8 f32, the 32 bytes of an
        // unaligned 256-bit load.
        unsafe { _mm256_loadu_ps(x.as_ptr().cast::<f32>()) }
    }
}

/// Stores eight moments: f32 as they are; bf16 rounded stochastically with `random` (16 bits per
/// lane) where given, else truncated (the roofline). With `STREAM`, a streaming store into an
/// array the caller guarantees (through `assert_streamable`) to be `moment_bytes`-aligned.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store_moment<M: MomentElem, const STREAM: bool>(
    x: &mut [M; LANES],
    value: __m256,
    random: Option<__m256i>,
) {
    const { assert!(size_of::<M>() == if M::IS_BF16 { 2 } else { 4 }) };
    if !M::IS_BF16 {
        // SAFETY: `M` is f32 (size checked above), so the array is 8 f32.
        let x = unsafe { &mut *x.as_mut_ptr().cast::<[f32; LANES]>() };
        return store_state::<STREAM>(x, value);
    }
    let halves = match random {
        Some(random) => round_stochastically(value, random),
        None => {
            let upper = _mm256_srli_epi32::<16>(_mm256_castps_si256(value));
            _mm_packus_epi32(_mm256_castsi256_si128(upper), _mm256_extracti128_si256::<1>(upper))
        }
    };
    // SAFETY: `M` is bf16 (size checked above), so the array is 8 bf16, held mutably.
    let x = unsafe { &mut *x.as_mut_ptr().cast::<[bf16; LANES]>() };
    store_copy::<STREAM>(x, halves);
}

/// The random bits of the eight elements from `element` on: `rounding::random_bits`, lane by lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn random_bits(seed: __m256i, element: usize) -> __m256i {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let index = _mm256_add_epi32(_mm256_set1_epi32(element as u32 as i32), lanes);
    let mut x = _mm256_xor_si256(index, seed);
    x = _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB_352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32::<15>(x));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x846C_A68B_u32 as i32));
    x = _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x));
    _mm256_srli_epi32::<16>(x)
}

/// Rounds eight f32 to bf16 stochastically like `rounding::stochastic_bf16`: `random` added
/// below the last place, then truncated; NaN kept quiet with its upper mantissa bits. Returns
/// them packed in 128 bits.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn round_stochastically(x: __m256, random: __m256i) -> __m128i {
    let bits = _mm256_castps_si256(x);
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, random));
    let quiet_nan = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let words = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Every word is at most 0xFFFF, so the unsigned saturating pack is exact.
    _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256::<1>(words))
}
