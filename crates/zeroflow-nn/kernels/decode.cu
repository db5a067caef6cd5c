// Attention with a key/value cache (inference): the kernels of `src/cuda/decode.rs`, whose CPU
// twins are `src/infer/decode_attention.rs` (same partition of the work, same order of the
// online-softmax updates).
//
// One layer's cache is `keys, values [B, KVH, L, hs]`: B sequences, KVH key/value heads, room for
// L positions, hs the head size, bf16. A step has `rows` token rows, row r being sequence
// `row_seq[r]` at position `row_pos[r]`; its `qkv` row (stride `qkv_stride`) holds the query
// heads at columns `h·hs ..` and the key and value heads at `q_width + j·hs ..` and
// `q_width + KV + j·hs ..`, `KV = KVH·hs`. Query head h reads key/value head `h / (NH / KVH)`.
// Storage is bf16, arithmetic f32.

#define DECODE_THREADS 128
#define DECODE_WARPS (DECODE_THREADS / WARP)
#define DECODE_MAX_HEAD_DIM 256
#define DECODE_DIMS_PER_LANE (DECODE_MAX_HEAD_DIM / WARP)

// Stores each row's key and value heads in the cache at its sequence and position. A grid-stride
// loop over the `rows · KV` elements of the keys (and as many of the values).
extern "C" __global__ void kv_write(bf16_t* __restrict__ keys, bf16_t* __restrict__ values,
                                    const bf16_t* __restrict__ qkv, const u32* __restrict__ row_seq,
                                    const u32* __restrict__ row_pos, u32 rows, u32 qkv_stride,
                                    u32 q_width, u32 n_kv_head, u32 head_dim, u32 capacity) {
    const u64 kv_width = (u64)n_kv_head * head_dim;
    const u64 total = (u64)rows * kv_width;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / kv_width, c = i % kv_width;
        const u64 j = c / head_dim, d = c % head_dim;
        const u64 slot = (((u64)row_seq[r] * n_kv_head + j) * capacity + row_pos[r]) * head_dim + d;
        const bf16_t* row = qkv + r * qkv_stride;
        keys[slot] = row[q_width + c];
        values[slot] = row[q_width + kv_width + c];
    }
}

// Row r's query head h over positions 0 ..= row_pos[r] of its sequence's key/value head, into
// columns `h·hs ..` of row r of `out` (stride `out_stride`). One block of DECODE_THREADS per
// (row, head), `blockIdx.x = r·NH + h`: warp w takes the positions t ≡ w (mod DECODE_WARPS) in
// increasing order, lane l the dimensions `l + 32·i`; each warp keeps an online softmax (running
// max m, sum s, weighted values acc), then the warps are merged through shared memory.
// hs ≤ DECODE_MAX_HEAD_DIM (checked by the host).
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
    decode_attention(bf16_t* __restrict__ out, const bf16_t* __restrict__ qkv,
                     const bf16_t* __restrict__ keys, const bf16_t* __restrict__ values,
                     const u32* __restrict__ row_seq, const u32* __restrict__ row_pos, u32 n_head,
                     u32 n_kv_head, u32 head_dim, u32 capacity, u32 qkv_stride, u32 out_stride,
                     float scale) {
    __shared__ float warp_max_of[DECODE_WARPS], warp_sum_of[DECODE_WARPS];
    __shared__ float warp_acc[DECODE_WARPS][DECODE_MAX_HEAD_DIM];
    const u32 r = blockIdx.x / n_head, h = blockIdx.x % n_head;
    const u32 kv_head = h / (n_head / n_kv_head);
    const u32 lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const u32 len = row_pos[r] + 1;
    const bf16_t* q = qkv + (u64)r * qkv_stride + (u64)h * head_dim;
    const u64 head = ((u64)row_seq[r] * n_kv_head + kv_head) * capacity * head_dim;
    float qv[DECODE_DIMS_PER_LANE], acc[DECODE_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DECODE_DIMS_PER_LANE; i++) {
        const u32 d = lane + WARP * i;
        qv[i] = d < head_dim ? bf16_to_f32(q[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, s = 0.0f;
    for (u32 t = warp; t < len; t += DECODE_WARPS) {
        const bf16_t* k = keys + head + (u64)t * head_dim;
        const bf16_t* v = values + head + (u64)t * head_dim;
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < DECODE_DIMS_PER_LANE; i++) {
            const u32 d = lane + WARP * i;
            if (d < head_dim) partial += qv[i] * bf16_to_f32(k[d]);
        }
        const float score = warp_sum(partial) * scale;
        const float m_new = fmaxf(m, score);
        // exp(−∞) is 0: the first position drops the empty state.
        const float keep = expf(m - m_new), weight = expf(score - m_new);
        s = s * keep + weight;
#pragma unroll
        for (int i = 0; i < DECODE_DIMS_PER_LANE; i++) {
            const u32 d = lane + WARP * i;
            if (d < head_dim) acc[i] = acc[i] * keep + weight * bf16_to_f32(v[d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_max_of[warp] = m;
        warp_sum_of[warp] = s;
    }
#pragma unroll
    for (int i = 0; i < DECODE_DIMS_PER_LANE; i++) {
        const u32 d = lane + WARP * i;
        if (d < head_dim) warp_acc[warp][d] = acc[i];
    }
    __syncthreads();
    // A warp that saw no position (len < DECODE_WARPS) has m = −∞ and adds nothing.
    float max = NEG_INF;
    for (int w = 0; w < DECODE_WARPS; w++) max = fmaxf(max, warp_max_of[w]);
    float total = 0.0f;
    for (int w = 0; w < DECODE_WARPS; w++) {
        if (warp_max_of[w] != NEG_INF) total += warp_sum_of[w] * expf(warp_max_of[w] - max);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < DECODE_WARPS; w++) {
            if (warp_max_of[w] != NEG_INF) o += warp_acc[w][d] * expf(warp_max_of[w] - max);
        }
        out[(u64)r * out_stride + (u64)h * head_dim + d] = f32_to_bf16(o / total);
    }
}
