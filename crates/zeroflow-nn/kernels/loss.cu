#define IGNORE 0xffffffffu

// Softmax + cross-entropy over the real vocabulary (the padded columns are masked), the mean
// loss, and the gradient of the logits. Rows are `padded_vocab` wide. `vec`: the width a multiple
// of 8 and the pointers 16-byte aligned (the host checks), so rows go in 16-byte vectors (GPT-2's
// padded vocabulary); else one element at a time (a vocabulary of any size). Each kernel is one
// template over the values a thread moves at a time, W = 8 or 1. A target of IGNORE (the Rust
// side's `loss::IGNORE`) is a position whose loss does not count: loss 0, no gradient, not in the
// mean (the ignored ones are counted in a float: exact up to 2^24 of them). With no target
// ignored every kernel computes exactly what it did before IGNORE existed.

// W values of `p` (16-byte aligned when W = 8) as f32, and their store.
template <int W> static __device__ __forceinline__ void load_w(const bf16_t* p, float v[W]) {
    if constexpr (W == 8) {
        load8(p, v);
    } else {
        v[0] = load1(p);
    }
}

template <int W> static __device__ __forceinline__ void store_w(bf16_t* p, const float v[W]) {
    if constexpr (W == 8) {
        store8(p, v);
    } else {
        store1(p, v[0]);
    }
}

// Folds (m2, s2) into the running softmax (m, s): s is Σ exp(x - m).
static __device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2;
        s = s2;
        return;
    }
    float top = fmaxf(m, m2);
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}

// One block per row: probs = softmax(logits[:vocab]) (0 in the padded columns), losses[row] =
// log Σ exp(logits) - logits[target] (f32). Block size a multiple of 32, at most 1024.
template <int W>
static __device__ void softmax_xent_rows(bf16_t* probs, float* losses, const bf16_t* logits,
                                         const u32* targets, u32 vocab, u32 padded_vocab) {
    __shared__ float maxes[WARP], sums[WARP];
    i64 row = blockIdx.x;
    const bf16_t* x = logits + row * padded_vocab;
    float m = NEG_INF, s = 0.0f;
    for (u32 i = threadIdx.x * W; i < padded_vocab; i += blockDim.x * W) {
        float v[W];
        load_w<W>(x + i, v);
        float top = NEG_INF;
#pragma unroll
        for (int k = 0; k < W; k++) {
            if (i + k < vocab) top = fmaxf(top, v[k]);
        }
        if (top == NEG_INF) continue;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < W; k++) {
            if (i + k < vocab) sum += expf(v[k] - top);
        }
        softmax_merge(m, s, top, sum);
    }
    // Warp, then block: every thread ends with the row's (max, sum).
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        softmax_merge(m, s, m2, s2);
    }
    u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    if (lane == 0) {
        maxes[warp] = m;
        sums[warp] = s;
    }
    __syncthreads();
    m = NEG_INF;
    s = 0.0f;
    for (u32 w = 0; w < warps; w++) softmax_merge(m, s, maxes[w], sums[w]);
    float inverse = 1.0f / s;
    bf16_t* p = probs + row * padded_vocab;
    for (u32 i = threadIdx.x * W; i < padded_vocab; i += blockDim.x * W) {
        float v[W];
        load_w<W>(x + i, v);
#pragma unroll
        for (int k = 0; k < W; k++) v[k] = i + k < vocab ? expf(v[k] - m) * inverse : 0.0f;
        store_w<W>(p + i, v);
    }
    u32 target = targets[row];
    if (threadIdx.x == 0) losses[row] = target == IGNORE ? 0.0f : logf(s) + m - load1(x + target);
}

extern "C" __global__ void softmax_xent_forward(bf16_t* probs, float* losses, const bf16_t* logits,
                                                const u32* targets, u32 vocab, u32 padded_vocab,
                                                u32 vec) {
    if (vec) {
        softmax_xent_rows<8>(probs, losses, logits, targets, vocab, padded_vocab);
    } else {
        softmax_xent_rows<1>(probs, losses, logits, targets, vocab, padded_vocab);
    }
}

// loss[0] = mean of losses[0..n] over the positions whose target is not IGNORE, 0 where none is
// (one block; fixed summation order). With nothing ignored it is exactly the plain mean: the same
// additions in the same order, divided by (float)n.
extern "C" __global__ void mean_loss(float* loss, const float* losses, const u32* targets, u32 n) {
    __shared__ float scratch[WARP];
    float sum = 0.0f, ignored = 0.0f;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        if (targets[i] != IGNORE) {
            sum += losses[i];
        } else {
            ignored += 1.0f;
        }
    }
    sum = block_sum(sum, scratch);
    ignored = block_sum(ignored, scratch);
    if (threadIdx.x == 0) {
        float counted = ignored == 0.0f ? (float)n : (float)n - ignored;
        loss[0] = counted <= 0.0f ? 0.0f : sum / counted;
    }
}

// dlogits (+)= (probs - onehot(target)) * dloss over the real vocabulary; the padded columns, and
// the rows whose target is IGNORE, get no gradient (written 0 or, accumulating, left alone).
template <int W>
static __device__ void softmax_xent_grads(bf16_t* dlogits, const bf16_t* probs, const u32* targets,
                                          u32 rows, u32 vocab, u32 padded_vocab, float dloss,
                                          u32 accumulate) {
    u32 per_row = padded_vocab / W;
    FOR_EACH_INDEX(v, (i64)rows * per_row) {
        i64 row = v / per_row;
        u32 column = (u32)(v % per_row) * W;
        i64 at = row * padded_vocab + column;
        u32 target = targets[row];
        float p[W], g[W];
        load_w<W>(probs + at, p);
        if (accumulate) {
            load_w<W>(dlogits + at, g);
        } else {
#pragma unroll
            for (int k = 0; k < W; k++) g[k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < W; k++) {
            u32 j = column + k;
            if (j < vocab && target != IGNORE) g[k] += (p[k] - (j == target ? 1.0f : 0.0f)) * dloss;
        }
        store_w<W>(dlogits + at, g);
    }
}

extern "C" __global__ void softmax_xent_backward(bf16_t* dlogits, const bf16_t* probs,
                                                 const u32* targets, u32 rows, u32 vocab,
                                                 u32 padded_vocab, float dloss, u32 accumulate,
                                                 u32 vec) {
    if (vec) {
        softmax_xent_grads<8>(dlogits, probs, targets, rows, vocab, padded_vocab, dloss,
                              accumulate);
    } else {
        softmax_xent_grads<1>(dlogits, probs, targets, rows, vocab, padded_vocab, dloss,
                              accumulate);
    }
}
