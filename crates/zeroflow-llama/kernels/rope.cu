// Rotary position embeddings in `transformers`' rotate_half convention, fused with the packing of
// the q, k and v projections into attention's row qkv = [rope(q) | rope(k) | v]. Each head of
// d = head_dim channels is rotated pair-wise on (x[i], x[i + d/2]), i < d/2, by the angle of its
// token's position p = row % t, or with packed rows (the `_packed` kernels) p = positions[row],
// its position in its document (checked on the host when the batch was set: below t):
//   out[i] = x[i]·cos − x[i + d/2]·sin,  out[i + d/2] = x[i + d/2]·cos + x[i]·sin.
// `table` holds cos then sin of every (position, pair): table[p · d/2 + i] and
// table[t · d/2 + p · d/2 + i], f32, made on the host as the CPU twin makes them (the angle
// f32(inv_freq) · f32(p), then its cosine and sine in f32). One thread per work item of a row:
// a pair of a query head, a pair of a key head, or an element of the values.

// qkv [rows, W] (W = (n_head + 2 n_kv_head) · d) from q [rows, n_head · d], k and v
// [rows, n_kv_head · d].
template <bool PACKED>
static __device__ __forceinline__ void rope_rows(bf16_t* qkv, const bf16_t* q, const bf16_t* k,
                                                 const bf16_t* v, const u32* positions,
                                                 const float* table, u32 rows, u32 t, u32 n_head,
                                                 u32 n_kv_head, u32 head_dim) {
    const u32 half = head_dim / 2;
    const u32 q_pairs = n_head * half, k_pairs = n_kv_head * half;
    const u32 q_width = n_head * head_dim, kv_width = n_kv_head * head_dim;
    const u32 per_row = q_pairs + k_pairs + kv_width;
    const i64 width = (i64)q_width + 2 * (i64)kv_width;
    FOR_EACH_INDEX(item, (i64)rows * per_row) {
        const i64 row = item / per_row;
        const u32 j = item % per_row;
        bf16_t* out = qkv + row * width;
        if (j < q_pairs + k_pairs) {
            const bool is_q = j < q_pairs;
            const u32 pair = is_q ? j : j - q_pairs;
            const u32 at = pair / half * head_dim + pair % half;
            const bf16_t* x = is_q ? q + row * q_width : k + row * kv_width;
            bf16_t* y = is_q ? out : out + q_width;
            const i64 p = PACKED ? (i64)positions[row] : row % t;
            const i64 angle = p * half + pair % half;
            const float cosine = table[angle], sine = table[(i64)t * half + angle];
            const float a = load1(x + at), b = load1(x + at + half);
            store1(y + at, a * cosine - b * sine);
            store1(y + at + half, b * cosine + a * sine);
        } else {
            const u32 e = j - q_pairs - k_pairs;
            store1(out + q_width + kv_width + e, load1(v + row * kv_width + e));
        }
    }
}

extern "C" __global__ void rope_forward(bf16_t* qkv, const bf16_t* q, const bf16_t* k,
                                        const bf16_t* v, const float* table, u32 rows, u32 t,
                                        u32 n_head, u32 n_kv_head, u32 head_dim) {
    rope_rows<false>(qkv, q, k, v, nullptr, table, rows, t, n_head, n_kv_head, head_dim);
}

extern "C" __global__ void rope_forward_packed(bf16_t* qkv, const bf16_t* q, const bf16_t* k,
                                               const bf16_t* v, const u32* positions,
                                               const float* table, u32 rows, u32 t, u32 n_head,
                                               u32 n_kv_head, u32 head_dim) {
    rope_rows<true>(qkv, q, k, v, positions, table, rows, t, n_head, n_kv_head, head_dim);
}

// dq, dk (+)= the rotation's transpose (by the opposite angle) of the q and k parts of dqkv, dv
// (+)= its v part; `accumulate_*` 1 adds to that gradient, 0 overwrites it.
template <bool PACKED>
static __device__ __forceinline__ void rope_back_rows(bf16_t* dq, bf16_t* dk, bf16_t* dv,
                                                      const bf16_t* dqkv, const u32* positions,
                                                      const float* table, u32 rows, u32 t,
                                                      u32 n_head, u32 n_kv_head, u32 head_dim,
                                                      u32 accumulate_q, u32 accumulate_k,
                                                      u32 accumulate_v) {
    const u32 half = head_dim / 2;
    const u32 q_pairs = n_head * half, k_pairs = n_kv_head * half;
    const u32 q_width = n_head * head_dim, kv_width = n_kv_head * head_dim;
    const u32 per_row = q_pairs + k_pairs + kv_width;
    const i64 width = (i64)q_width + 2 * (i64)kv_width;
    FOR_EACH_INDEX(item, (i64)rows * per_row) {
        const i64 row = item / per_row;
        const u32 j = item % per_row;
        const bf16_t* dy = dqkv + row * width;
        if (j < q_pairs + k_pairs) {
            const bool is_q = j < q_pairs;
            const u32 pair = is_q ? j : j - q_pairs;
            const u32 at = pair / half * head_dim + pair % half;
            bf16_t* dx = is_q ? dq + row * q_width : dk + row * kv_width;
            const bf16_t* d = is_q ? dy : dy + q_width;
            const bool accumulate = is_q ? accumulate_q : accumulate_k;
            const i64 p = PACKED ? (i64)positions[row] : row % t;
            const i64 angle = p * half + pair % half;
            const float cosine = table[angle], sine = table[(i64)t * half + angle];
            const float a = load1(d + at), b = load1(d + at + half);
            float lo = a * cosine + b * sine, hi = b * cosine - a * sine;
            if (accumulate) {
                lo += load1(dx + at);
                hi += load1(dx + at + half);
            }
            store1(dx + at, lo);
            store1(dx + at + half, hi);
        } else {
            const u32 e = j - q_pairs - k_pairs;
            const float g = load1(dy + q_width + kv_width + e);
            bf16_t* out = dv + row * kv_width + e;
            store1(out, accumulate_v ? load1(out) + g : g);
        }
    }
}

extern "C" __global__ void rope_backward(bf16_t* dq, bf16_t* dk, bf16_t* dv, const bf16_t* dqkv,
                                         const float* table, u32 rows, u32 t, u32 n_head,
                                         u32 n_kv_head, u32 head_dim, u32 accumulate_q,
                                         u32 accumulate_k, u32 accumulate_v) {
    rope_back_rows<false>(dq, dk, dv, dqkv, nullptr, table, rows, t, n_head, n_kv_head, head_dim,
                          accumulate_q, accumulate_k, accumulate_v);
}

extern "C" __global__ void rope_backward_packed(bf16_t* dq, bf16_t* dk, bf16_t* dv,
                                                const bf16_t* dqkv, const u32* positions,
                                                const float* table, u32 rows, u32 t, u32 n_head,
                                                u32 n_kv_head, u32 head_dim, u32 accumulate_q,
                                                u32 accumulate_k, u32 accumulate_v) {
    rope_back_rows<true>(dq, dk, dv, dqkv, positions, table, rows, t, n_head, n_kv_head, head_dim,
                         accumulate_q, accumulate_k, accumulate_v);
}
