// Softmax + cross-entropy over the real vocabulary (the padded columns are masked), the mean
// loss, and the gradient of the logits. Rows are `padded_vocab` wide, a multiple of 64, and the
// pointers 16-byte aligned (checked on the host), so rows go in 16-byte vectors.

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
extern "C" __global__ void softmax_xent_forward(bf16_t* probs, float* losses, const bf16_t* logits,
                                                const u32* targets, u32 vocab, u32 padded_vocab) {
    __shared__ float maxes[WARP], sums[WARP];
    i64 row = blockIdx.x;
    const bf16_t* x = logits + row * padded_vocab;
    float m = NEG_INF, s = 0.0f;
    for (u32 i = threadIdx.x * 8; i < padded_vocab; i += blockDim.x * 8) {
        float v[8];
        load8(x + i, v);
        float top = NEG_INF;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if (i + k < vocab) top = fmaxf(top, v[k]);
        }
        if (top == NEG_INF) continue;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
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
    for (u32 i = threadIdx.x * 8; i < padded_vocab; i += blockDim.x * 8) {
        float v[8];
        load8(x + i, v);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = i + k < vocab ? expf(v[k] - m) * inverse : 0.0f;
        store8(p + i, v);
    }
    if (threadIdx.x == 0) losses[row] = logf(s) + m - load1(x + targets[row]);
}

// loss[0] = mean of losses[0..n] (one block; fixed summation order).
extern "C" __global__ void mean_loss(float* loss, const float* losses, u32 n) {
    __shared__ float scratch[WARP];
    float sum = 0.0f;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) sum += losses[i];
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) loss[0] = sum / (float)n;
}

// dlogits (+)= (probs - onehot(target)) * dloss over the real vocabulary; the padded columns are
// written 0 (or, accumulating, left alone).
extern "C" __global__ void softmax_xent_backward(bf16_t* dlogits, const bf16_t* probs,
                                                 const u32* targets, u32 rows, u32 vocab,
                                                 u32 padded_vocab, float dloss, u32 accumulate) {
    u32 per_row = padded_vocab / 8;
    FOR_EACH_INDEX(v, (i64)rows * per_row) {
        i64 row = v / per_row;
        u32 column = (u32)(v % per_row) * 8;
        i64 at = row * padded_vocab + column;
        u32 target = targets[row];
        float p[8], g[8];
        load8(probs + at, p);
        if (accumulate) {
            load8(dlogits + at, g);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) g[k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            u32 j = column + k;
            if (j < vocab) g[k] += (p[k] - (j == target ? 1.0f : 0.0f)) * dloss;
        }
        store8(dlogits + at, g);
    }
}
