// Causal multi-head attention around cuBLASLt's strided-batched matmuls (llm.c's design).
//
// The heads of q, k and v are gathered from the fused row `qkv [B, T, 3C]` into head-major
// `[B, NH, T, hs]` tensors (`rows_to_heads`), the scores `q·kᵀ` and the product `att·v` are
// batched matmuls over the B·NH heads, the causal softmax and its backward are the row kernels
// here (one warp per row of `att`), and the result is scattered back into rows (`heads_to_rows`).
// `copy_packs` copies att into the scratch the matmuls read (see `src/cuda/attention.rs`).
//
// Every tensor is bf16; sums and the softmax are fp32. `VEC` is the number of bf16 values a thread
// moves per load or store: 8 (16 bytes) where the sizes and addresses allow it, else 4, 2 or 1.
// The host picks the widest `VEC` that divides the row lengths and the addresses' alignment.

template <int N> struct alignas(2 * N) Bf16Pack {
    bf16_t v[N];
};

template <int N> static __device__ __forceinline__ Bf16Pack<N> load_pack(const bf16_t* p) {
    return *reinterpret_cast<const Bf16Pack<N>*>(p);
}

template <int N> static __device__ __forceinline__ void store_pack(bf16_t* p, Bf16Pack<N> pack) {
    *reinterpret_cast<Bf16Pack<N>*>(p) = pack;
}

// Head `h` of row `r = b·T + t` of a row-major tensor (row stride `row_stride`, the head's columns
// `h·hs .. (h+1)·hs`) is row `t` of head `(b, h)` in the head-major tensor `[B, NH, T, hs]`.
// One block per row; the threads stride over the row's `C / VEC` packs.
template <int VEC>
static __device__ void rows_to_heads(bf16_t* __restrict__ heads, const bf16_t* __restrict__ rows,
                                     u32 row_stride, u32 seq, u32 n_head, u32 head_size) {
    const u32 row = blockIdx.x;
    const u32 b = row / seq, t = row % seq;
    const u32 packs_per_head = head_size / VEC;
    const u32 packs = n_head * packs_per_head;
    const bf16_t* src = rows + (i64)row * row_stride;
    for (u32 p = threadIdx.x; p < packs; p += blockDim.x) {
        const u32 h = p / packs_per_head, d = (p % packs_per_head) * VEC;
        const i64 dst = (((i64)b * n_head + h) * seq + t) * head_size + d;
        store_pack<VEC>(heads + dst, load_pack<VEC>(src + (i64)h * head_size + d));
    }
}

// The inverse of `rows_to_heads`: row `t` of head `(b, h)` into columns `h·hs ..` of row `b·T + t`.
template <int VEC>
static __device__ void heads_to_rows(bf16_t* __restrict__ rows, const bf16_t* __restrict__ heads,
                                     u32 row_stride, u32 seq, u32 n_head, u32 head_size) {
    const u32 row = blockIdx.x;
    const u32 b = row / seq, t = row % seq;
    const u32 packs_per_head = head_size / VEC;
    const u32 packs = n_head * packs_per_head;
    bf16_t* dst = rows + (i64)row * row_stride;
    for (u32 p = threadIdx.x; p < packs; p += blockDim.x) {
        const u32 h = p / packs_per_head, d = (p % packs_per_head) * VEC;
        const i64 src = (((i64)b * n_head + h) * seq + t) * head_size + d;
        store_pack<VEC>(dst + (i64)h * head_size + d, load_pack<VEC>(heads + src));
    }
}

static __device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// `sum · 2^((from − to)·k)`, where a zero sum stays zero (its `from` may be −∞).
static __device__ __forceinline__ float rescale(float sum, float from, float to, float k) {
    return sum == 0.0f ? 0.0f : sum * exp2f((from - to) * k);
}

// The first key query row `row` of `scores [B, NH, T, T]` attends: 0, or with packed rows
// (`PACKED`) its document's first token, `t1 − positions[b, t1]` (`t1 = row % T`, `b = row /
// (NH·T)`; a position past `t1` counts as `t1`, as the CPU twin's saturating subtraction does).
template <bool PACKED>
static __device__ __forceinline__ u32 first_key(const u32* positions, u32 row, u32 seq,
                                                u32 n_head) {
    if (!PACKED) return 0;
    const u32 t1 = row % seq, b = row / seq / n_head;
    return t1 - min(positions[(i64)b * seq + t1], t1);
}

// Row `row` of `scores [rows, T]` holds the raw scores q·kᵀ of query `t1 = row % T`; it becomes
// `softmax(scale · scores[first..=t1])` with zeros elsewhere (`first` from `first_key`: 0 unless
// `PACKED`), and so does the same row of `att` unless `att` is null. One warp per row: an online
// max and sum over the unmasked scores, then a second pass (the row is in L1 by then) writes the
// weights.
template <int VEC, bool PACKED>
static __device__ void causal_softmax_forward(bf16_t* scores, bf16_t* att, const u32* positions,
                                              u32 rows, u32 seq, u32 n_head, float scale) {
    const u32 lane = threadIdx.x % 32;
    const u32 row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const u32 valid = row % seq + 1;
    const u32 first = first_key<PACKED>(positions, row, seq, n_head);
    bf16_t* p = scores + (i64)row * seq;
    bf16_t* out = att == nullptr ? nullptr : att + (i64)row * seq;
    const float k = scale * 1.4426950408889634f;  // exp(scale·x) = 2^(k·x)
    float max = -__int_as_float(0x7f800000), sum = 0.0f;
    for (u32 base = lane * VEC; base < valid; base += 32 * VEC) {
        const Bf16Pack<VEC> pack = load_pack<VEC>(p + base);
        float x[VEC];
        float pack_max = max;
        for (int i = 0; i < VEC; i++) {
            x[i] = bf16_to_f32(pack.v[i]);
            if (base + i < valid && (!PACKED || base + i >= first)) {
                pack_max = fmaxf(pack_max, x[i]);
            }
        }
        sum = rescale(sum, max, pack_max, k);
        max = pack_max;
        for (int i = 0; i < VEC; i++) {
            if (base + i < valid && (!PACKED || base + i >= first)) {
                sum += exp2f((x[i] - max) * k);
            }
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_max = __shfl_xor_sync(0xffffffffu, max, offset);
        const float other_sum = __shfl_xor_sync(0xffffffffu, sum, offset);
        const float joint = fmaxf(max, other_max);
        sum = rescale(sum, max, joint, k) + rescale(other_sum, other_max, joint, k);
        max = joint;
    }
    const float inverse = 1.0f / sum;
    for (u32 base = lane * VEC; base < seq; base += 32 * VEC) {
        Bf16Pack<VEC> pack;
        if (base < valid) {
            pack = load_pack<VEC>(p + base);
            for (int i = 0; i < VEC; i++) {
                const float x = bf16_to_f32(pack.v[i]);
                const bool in = base + i < valid && (!PACKED || base + i >= first);
                const float a = in ? exp2f((x - max) * k) * inverse : 0.0f;
                pack.v[i] = f32_to_bf16(a);
            }
        } else {
            for (int i = 0; i < VEC; i++) pack.v[i] = 0;
        }
        store_pack<VEC>(p + base, pack);
        if (out != nullptr) store_pack<VEC>(out + base, pack);
    }
}

// `dst[0..n) = src[0..n)`, `n` a multiple of `VEC`.
template <int VEC>
static __device__ void copy_packs(bf16_t* __restrict__ dst, const bf16_t* __restrict__ src, u64 n) {
    FOR_EACH_INDEX(i, n / VEC) {
        store_pack<VEC>(dst + i * VEC, load_pack<VEC>(src + i * VEC));
    }
}

// Row `row` of `dscores [rows, T]` holds d(loss)/d(att) of query `t1 = row % T`; it becomes the
// gradient of the raw scores: `scale · att ⊙ (datt − Σ att ⊙ datt)` over `first..=t1` (`first`
// as in the forward), zeros elsewhere.
template <int VEC, bool PACKED>
static __device__ void causal_softmax_backward(bf16_t* dscores, const bf16_t* __restrict__ att,
                                               const u32* positions, u32 rows, u32 seq,
                                               u32 n_head, float scale) {
    const u32 lane = threadIdx.x % 32;
    const u32 row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const u32 valid = row % seq + 1;
    const u32 first = first_key<PACKED>(positions, row, seq, n_head);
    bf16_t* g = dscores + (i64)row * seq;
    const bf16_t* a = att + (i64)row * seq;
    float dot = 0.0f;
    for (u32 base = lane * VEC; base < valid; base += 32 * VEC) {
        const Bf16Pack<VEC> weights = load_pack<VEC>(a + base);
        const Bf16Pack<VEC> grads = load_pack<VEC>(g + base);
        for (int i = 0; i < VEC; i++) {
            if (base + i < valid && (!PACKED || base + i >= first)) {
                dot += bf16_to_f32(weights.v[i]) * bf16_to_f32(grads.v[i]);
            }
        }
    }
    dot = warp_sum(dot);
    for (u32 base = lane * VEC; base < seq; base += 32 * VEC) {
        Bf16Pack<VEC> out;
        if (base < valid) {
            const Bf16Pack<VEC> weights = load_pack<VEC>(a + base);
            const Bf16Pack<VEC> grads = load_pack<VEC>(g + base);
            for (int i = 0; i < VEC; i++) {
                const float w = bf16_to_f32(weights.v[i]), d = bf16_to_f32(grads.v[i]);
                const bool in = base + i < valid && (!PACKED || base + i >= first);
                out.v[i] = f32_to_bf16(in ? scale * w * (d - dot) : 0.0f);
            }
        } else {
            for (int i = 0; i < VEC; i++) out.v[i] = 0;
        }
        store_pack<VEC>(g + base, out);
    }
}

#define ATTENTION_KERNELS(VEC)                                                                    \
    extern "C" __global__ void rows_to_heads_##VEC(bf16_t* heads, const bf16_t* rows,            \
                                                   u32 row_stride, u32 seq, u32 n_head,          \
                                                   u32 head_size) {                              \
        rows_to_heads<VEC>(heads, rows, row_stride, seq, n_head, head_size);                     \
    }                                                                                             \
    extern "C" __global__ void heads_to_rows_##VEC(bf16_t* rows, const bf16_t* heads,            \
                                                   u32 row_stride, u32 seq, u32 n_head,          \
                                                   u32 head_size) {                              \
        heads_to_rows<VEC>(rows, heads, row_stride, seq, n_head, head_size);                     \
    }                                                                                             \
    extern "C" __global__ void causal_softmax_forward_##VEC(bf16_t* scores, bf16_t* att,         \
                                                            u32 rows, u32 seq, float scale) {    \
        causal_softmax_forward<VEC, false>(scores, att, nullptr, rows, seq, 1, scale);            \
    }                                                                                             \
    extern "C" __global__ void causal_softmax_backward_##VEC(bf16_t* dscores, const bf16_t* att, \
                                                             u32 rows, u32 seq, float scale) {   \
        causal_softmax_backward<VEC, false>(dscores, att, nullptr, rows, seq, 1, scale);          \
    }                                                                                             \
    extern "C" __global__ void causal_softmax_forward_packed_##VEC(                               \
        bf16_t* scores, bf16_t* att, const u32* positions, u32 rows, u32 seq, u32 n_head,         \
        float scale) {                                                                            \
        causal_softmax_forward<VEC, true>(scores, att, positions, rows, seq, n_head, scale);      \
    }                                                                                             \
    extern "C" __global__ void causal_softmax_backward_packed_##VEC(                              \
        bf16_t* dscores, const bf16_t* att, const u32* positions, u32 rows, u32 seq, u32 n_head,  \
        float scale) {                                                                            \
        causal_softmax_backward<VEC, true>(dscores, att, positions, rows, seq, n_head, scale);    \
    }                                                                                             \
    extern "C" __global__ void copy_packs_##VEC(bf16_t* dst, const bf16_t* src, u64 n) {          \
        copy_packs<VEC>(dst, src, n);                                                             \
    }

ATTENTION_KERNELS(1)
ATTENTION_KERNELS(2)
ATTENTION_KERNELS(4)
ATTENTION_KERNELS(8)
