// The ZeRO engine's element-wise kernels: casts, scale, accumulate, sum of squares, non-finite
// counts, AdamW, column gather/scatter, and column sums of absolute values. Compiled after
// `prelude.cuh` (nothing is included).
//
// Every kernel is written once as a template over its element types and exported under an
// explicit name (`cast_bf16_f32`, `adamw_bf16`, ...), the names `src/cuda/kernels.rs` loads.
//
// Element-wise kernels take `n` and `head`: the first `head` elements and the tail after the last
// whole pack of 8 are done one at a time, the rest 8 at a time with 16-byte loads and stores. The
// host picks `head` so that every pointer is 16-byte aligned at element `head`, or passes
// `head = n` (everything one at a time) where the pointers' alignments disagree.
//
// Arithmetic that has a CPU twin uses the `__f*_rn` intrinsics, so that NVRTC cannot contract a
// multiply and an add into an FMA the CPU does not do (or the reverse): results match bit for bit.
//
// The reductions (`sum_squares_*`, `nonfinite_*`) are deterministic: each block writes one
// partial to a scratch slot in a fixed order, and a second one-block kernel adds the partials in
// a fixed order. Every kernel is launched with BLOCK threads per block (`column_abs_sums` as
// 32 x 8 = BLOCK threads).

#define BLOCK 256

// ---- Packs of 8 elements, loaded and stored as 16-byte (16-bit types) or 2 x 16-byte (f32) ----

template <typename T> struct Pack8 {
    // T is Bf16 or F16: 8 elements are one uint4; element 2k is the low half of word k.
    static __device__ __forceinline__ void load(const T* __restrict__ p, float* v) {
        const uint4 a = *reinterpret_cast<const uint4*>(p);
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            T lo, hi;
            lo.bits = (u16)(w[k] & 0xffffu);
            hi.bits = (u16)(w[k] >> 16);
            v[2 * k] = to_f32(lo);
            v[2 * k + 1] = to_f32(hi);
        }
    }
    static __device__ __forceinline__ void store(T* __restrict__ p, const float* v) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[k] = (u32)from_f32<T>(v[2 * k]).bits | ((u32)from_f32<T>(v[2 * k + 1]).bits << 16);
        }
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
};

template <> struct Pack8<float> {
    static __device__ __forceinline__ void load(const float* __restrict__ p, float* v) {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    static __device__ __forceinline__ void store(float* __restrict__ p, const float* v) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
};

// How an element-wise kernel splits `n` elements: `packs` packs of 8 starting at `head`, and
// `scalars` single elements (the head, then the tail after the last pack).
struct Split {
    i64 head;
    i64 packs;
    i64 scalars;
};

static __device__ __forceinline__ Split split(i64 n, i64 head) {
    Split s;
    s.head = head < n ? head : n;
    s.packs = (n - s.head) / 8;
    s.scalars = n - 8 * s.packs;
    return s;
}

// The element index of single element `k` (0 <= k < s.scalars).
static __device__ __forceinline__ i64 scalar_index(const Split& s, i64 k) {
    return k < s.head ? k : k + 8 * s.packs;
}

static __device__ __forceinline__ i64 pack_index(const Split& s, i64 k) {
    return s.head + 8 * k;
}

// acc + x * x with one rounding, in the accumulator's precision.
static __device__ __forceinline__ float add_square(float x, float acc) { return __fmaf_rn(x, x, acc); }
static __device__ __forceinline__ double add_square(double x, double acc) { return __fma_rn(x, x, acc); }

static __device__ __forceinline__ bool nonfinite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// ---- cast: dst[i] = T(src[i]) (through f32, round to nearest even) ----

template <typename S, typename T>
static __device__ void cast_impl(const S* __restrict__ src, T* __restrict__ dst, i64 n, i64 head) {
    const Split s = split(n, head);
    FOR_EACH_INDEX(k, s.packs) {
        const i64 i = pack_index(s, k);
        float v[8];
        Pack8<S>::load(src + i, v);
        Pack8<T>::store(dst + i, v);
    }
    FOR_EACH_INDEX(k, s.scalars) {
        const i64 i = scalar_index(s, k);
        dst[i] = from_f32<T>(to_f32(src[i]));
    }
}

// ---- scale: buf[i] = S(alpha * buf[i]) ----

template <typename S>
static __device__ void scale_impl(S* __restrict__ buf, i64 n, i64 head, float alpha) {
    const Split s = split(n, head);
    FOR_EACH_INDEX(k, s.packs) {
        const i64 i = pack_index(s, k);
        float v[8];
        Pack8<S>::load(buf + i, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(alpha, v[j]);
        Pack8<S>::store(buf + i, v);
    }
    FOR_EACH_INDEX(k, s.scalars) {
        const i64 i = scalar_index(s, k);
        buf[i] = from_f32<S>(__fmul_rn(alpha, to_f32(buf[i])));
    }
}

// ---- accumulate: dst[i] += scale * src[i], in f32 ----

template <typename S>
static __device__ void accumulate_impl(const S* __restrict__ src, float* __restrict__ dst, i64 n,
                                       i64 head, float scale) {
    const Split s = split(n, head);
    FOR_EACH_INDEX(k, s.packs) {
        const i64 i = pack_index(s, k);
        float x[8], d[8];
        Pack8<S>::load(src + i, x);
        Pack8<float>::load(dst + i, d);
#pragma unroll
        for (int j = 0; j < 8; ++j) d[j] = __fadd_rn(d[j], __fmul_rn(scale, x[j]));
        Pack8<float>::store(dst + i, d);
    }
    FOR_EACH_INDEX(k, s.scalars) {
        const i64 i = scalar_index(s, k);
        dst[i] = __fadd_rn(dst[i], __fmul_rn(scale, to_f32(src[i])));
    }
}

// ---- deterministic block reduction (blockDim.x == BLOCK) ----

template <typename A>
static __device__ __forceinline__ A block_sum(A x, A* shared) {
    shared[threadIdx.x] = x;
    __syncthreads();
#pragma unroll
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    return shared[0];
}

// ---- sum of squares: partials[block] = sum of src[i]^2 over the block's elements ----
//
// `Acc` is the per-thread accumulator (double, or float for the f32 variant); blocks and the
// final sum always add in double. A non-finite element makes its thread's sum non-finite, and
// that propagates (squares are never negative, so inf - inf cannot happen).

template <typename S, typename Acc>
static __device__ void sum_squares_impl(const S* __restrict__ src, i64 n, i64 head,
                                        double* __restrict__ partials) {
    __shared__ double shared[BLOCK];
    const Split s = split(n, head);
    Acc acc = 0;
    FOR_EACH_INDEX(k, s.packs) {
        float v[8];
        Pack8<S>::load(src + pack_index(s, k), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = add_square((Acc)v[j], acc);
    }
    FOR_EACH_INDEX(k, s.scalars) {
        acc = add_square((Acc)to_f32(src[scalar_index(s, k)]), acc);
    }
    const double total = block_sum<double>((double)acc, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// out[0] = (float) sum of partials[0..count), in a fixed order; one block.
extern "C" __global__ void sum_squares_finish(const double* __restrict__ partials, u32 count,
                                              float* __restrict__ out) {
    __shared__ double shared[BLOCK];
    double acc = 0.0;
    for (u32 b = threadIdx.x; b < count; b += BLOCK) acc += partials[b];
    const double total = block_sum<double>(acc, shared);
    if (threadIdx.x == 0) out[0] = (float)total;
}

// ---- non-finite count: partials[block] = number of inf/nan elements in the block's share ----

template <typename S>
static __device__ void nonfinite_impl(const S* __restrict__ src, i64 n, i64 head,
                                      u64* __restrict__ partials) {
    __shared__ u64 shared[BLOCK];
    const Split s = split(n, head);
    u64 count = 0;
    FOR_EACH_INDEX(k, s.packs) {
        float v[8];
        Pack8<S>::load(src + pack_index(s, k), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) count += nonfinite_f32(v[j]) ? 1 : 0;
    }
    FOR_EACH_INDEX(k, s.scalars) {
        count += nonfinite_f32(to_f32(src[scalar_index(s, k)])) ? 1 : 0;
    }
    const u64 total = block_sum<u64>(count, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// out[0] = sum of partials[0..count), saturating at u32 max; one block.
extern "C" __global__ void nonfinite_finish(const u64* __restrict__ partials, u32 count,
                                            u32* __restrict__ out) {
    __shared__ u64 shared[BLOCK];
    u64 acc = 0;
    for (u32 b = threadIdx.x; b < count; b += BLOCK) acc += partials[b];
    const u64 total = block_sum<u64>(acc, shared);
    if (threadIdx.x == 0) out[0] = total > 0xffffffffull ? 0xffffffffu : (u32)total;
}

// ---- AdamW over fp32 master weights and moments, f32 gradients, weights written as P ----
//
// The same arithmetic as zeroflow-optim's AVX2/AVX-512 kernels, with the same fused operations:
//   g = fma(p, l2, g * grad_scale)                  (l2 = wd in L2 mode, else 0)
//   m = fma(1 - b1, g - m, m)
//   v = fma(1 - b2, fma(g, g, -v), v)
//   p = fma(m / fma(sqrt(v), 1 / sqrt(bc2), eps), -lr / bc1, fma(p, -lr wd, p))
// (-lr wd = 0 outside decoupled mode). Division and square root are correctly rounded, as on
// the CPU.

struct AdamWScalars {
    float grad_scale, l2, one_minus_beta1, one_minus_beta2, inv_sqrt_bias_correction2, eps,
        neg_lr_weight_decay, neg_step_size;

    __device__ __forceinline__ void update(float& p, float& m, float& v, float g) const {
        const float grad = __fmaf_rn(p, l2, __fmul_rn(g, grad_scale));
        m = __fmaf_rn(one_minus_beta1, __fsub_rn(grad, m), m);
        v = __fmaf_rn(one_minus_beta2, __fmaf_rn(grad, grad, -v), v);
        const float denom = __fmaf_rn(__fsqrt_rn(v), inv_sqrt_bias_correction2, eps);
        const float decayed = __fmaf_rn(p, neg_lr_weight_decay, p);
        p = __fmaf_rn(__fdiv_rn(m, denom), neg_step_size, decayed);
    }
};

template <typename P>
static __device__ void adamw_impl(float* __restrict__ master, float* __restrict__ exp_avg,
                                  float* __restrict__ exp_avg_sq, const float* __restrict__ grads,
                                  P* __restrict__ out, i64 n, i64 head, const AdamWScalars& a) {
    const Split s = split(n, head);
    FOR_EACH_INDEX(k, s.packs) {
        const i64 i = pack_index(s, k);
        float p[8], m[8], v[8], g[8];
        Pack8<float>::load(master + i, p);
        Pack8<float>::load(exp_avg + i, m);
        Pack8<float>::load(exp_avg_sq + i, v);
        Pack8<float>::load(grads + i, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) a.update(p[j], m[j], v[j], g[j]);
        Pack8<float>::store(master + i, p);
        Pack8<float>::store(exp_avg + i, m);
        Pack8<float>::store(exp_avg_sq + i, v);
        Pack8<P>::store(out + i, p);
    }
    FOR_EACH_INDEX(k, s.scalars) {
        const i64 i = scalar_index(s, k);
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        a.update(p, m, v, grads[i]);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        out[i] = from_f32<P>(p);
    }
}

// ---- columns of a row-major [rows, cols] matrix selected by an index list ----
//
// gather:  dst[r, j] = src[r, index[j]]   (dst is [rows, k]; an index >= cols gives NaN)
// scatter: dst[r, index[j]] = src[r, j]   (src is [rows, k]; an index >= cols is skipped;
//                                          duplicate indices leave one of the values)
// Grid: y strides over rows, x over the k selected columns.

template <typename T>
static __device__ void gather_columns_impl(const T* __restrict__ src, i64 rows, i64 cols,
                                           const u32* __restrict__ index, i64 k,
                                           T* __restrict__ dst) {
    const T nan = from_f32<T>(__int_as_float(0x7fffffff));
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k;
             j += (i64)gridDim.x * blockDim.x) {
            const u32 c = index[j];
            dst[r * k + j] = (i64)c < cols ? src[r * cols + c] : nan;
        }
    }
}

template <typename T>
static __device__ void scatter_columns_impl(const T* __restrict__ src, i64 rows, i64 cols,
                                            const u32* __restrict__ index, i64 k,
                                            T* __restrict__ dst) {
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k;
             j += (i64)gridDim.x * blockDim.x) {
            const u32 c = index[j];
            if ((i64)c < cols) dst[r * cols + c] = src[r * k + j];
        }
    }
}

// ---- column sums of absolute values: out[c] += sum over r of |src[r, c]|, in f32 ----
//
// Deterministic: one block of COLUMN_STRIPE x COLUMN_GROUPS threads per stripe of COLUMN_STRIPE
// consecutive columns. Thread (tx, ty) sums column c0 + tx over the rows ty, ty + 8, ty + 16, ...
// in increasing order (a warp reads COLUMN_STRIPE consecutive elements of a row); thread ty == 0
// then adds the COLUMN_GROUPS partials in the order ty = 0, 1, ..., 7 and adds the total to out.
// Stripes are numbered blockIdx.y * gridDim.x + blockIdx.x and the grid strides over the rest.

#define COLUMN_STRIPE 32
#define COLUMN_GROUPS 8

template <typename S>
static __device__ void column_abs_sums_impl(const S* __restrict__ src, i64 rows, i64 cols,
                                            float* __restrict__ out) {
    __shared__ float partials[COLUMN_GROUPS][COLUMN_STRIPE];
    const i64 stripes = (cols + COLUMN_STRIPE - 1) / COLUMN_STRIPE;
    const i64 grid = (i64)gridDim.x * gridDim.y;
    // The stripe is the same for every thread of the block, so every thread reaches the barriers.
    for (i64 stripe = (i64)blockIdx.y * gridDim.x + blockIdx.x; stripe < stripes; stripe += grid) {
        const i64 c = stripe * COLUMN_STRIPE + threadIdx.x;
        float acc = 0.0f;
        if (c < cols) {
            const S* column = src + c;
            i64 r = threadIdx.y;
            // Four loads in flight before their additions, which stay in increasing row order.
            for (; r + 3 * COLUMN_GROUPS < rows; r += 4 * COLUMN_GROUPS) {
                const float x0 = to_f32(column[r * cols]);
                const float x1 = to_f32(column[(r + COLUMN_GROUPS) * cols]);
                const float x2 = to_f32(column[(r + 2 * COLUMN_GROUPS) * cols]);
                const float x3 = to_f32(column[(r + 3 * COLUMN_GROUPS) * cols]);
                acc = __fadd_rn(acc, fabsf(x0));
                acc = __fadd_rn(acc, fabsf(x1));
                acc = __fadd_rn(acc, fabsf(x2));
                acc = __fadd_rn(acc, fabsf(x3));
            }
            for (; r < rows; r += COLUMN_GROUPS) {
                acc = __fadd_rn(acc, fabsf(to_f32(column[r * cols])));
            }
        }
        partials[threadIdx.y][threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.y == 0 && c < cols) {
            float total = partials[0][threadIdx.x];
#pragma unroll
            for (int g = 1; g < COLUMN_GROUPS; ++g) {
                total = __fadd_rn(total, partials[g][threadIdx.x]);
            }
            out[c] = __fadd_rn(out[c], total);
        }
        // The partials are read before the next stripe overwrites them.
        __syncthreads();
    }
}

// ---- exported names ----

#define CAST(SN, S, TN, T)                                                                  \
    extern "C" __global__ void cast_##SN##_##TN(const S* src, T* dst, i64 n, i64 head) {    \
        cast_impl<S, T>(src, dst, n, head);                                                 \
    }
#define CAST_FROM(SN, S) CAST(SN, S, f32, float) CAST(SN, S, bf16, Bf16) CAST(SN, S, f16, F16)
CAST_FROM(f32, float)
CAST_FROM(bf16, Bf16)
CAST_FROM(f16, F16)

#define PER_TYPE(N, S)                                                                       \
    extern "C" __global__ void scale_##N(S* buf, i64 n, i64 head, float alpha) {            \
        scale_impl<S>(buf, n, head, alpha);                                                  \
    }                                                                                        \
    extern "C" __global__ void accumulate_##N(const S* src, float* dst, i64 n, i64 head,    \
                                              float scale) {                                 \
        accumulate_impl<S>(src, dst, n, head, scale);                                        \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                      \
        sum_squares_f64_##N(const S* src, i64 n, i64 head, double* partials) {               \
        sum_squares_impl<S, double>(src, n, head, partials);                                 \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                      \
        sum_squares_f32_##N(const S* src, i64 n, i64 head, double* partials) {               \
        sum_squares_impl<S, float>(src, n, head, partials);                                  \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                      \
        nonfinite_##N(const S* src, i64 n, i64 head, u64* partials) {                        \
        nonfinite_impl<S>(src, n, head, partials);                                           \
    }                                                                                        \
    extern "C" __global__ void adamw_##N(float* master, float* exp_avg, float* exp_avg_sq,  \
                                         const float* grads, S* out, i64 n, i64 head,        \
                                         float grad_scale, float l2, float one_minus_beta1,  \
                                         float one_minus_beta2,                              \
                                         float inv_sqrt_bias_correction2, float eps,         \
                                         float neg_lr_weight_decay, float neg_step_size) {   \
        const AdamWScalars a = {grad_scale, l2, one_minus_beta1, one_minus_beta2,            \
                                inv_sqrt_bias_correction2, eps, neg_lr_weight_decay,         \
                                neg_step_size};                                              \
        adamw_impl<S>(master, exp_avg, exp_avg_sq, grads, out, n, head, a);                  \
    }                                                                                        \
    extern "C" __global__ void gather_columns_##N(const S* src, i64 rows, i64 cols,         \
                                                  const u32* index, i64 k, S* dst) {         \
        gather_columns_impl<S>(src, rows, cols, index, k, dst);                              \
    }                                                                                        \
    extern "C" __global__ void scatter_columns_##N(const S* src, i64 rows, i64 cols,        \
                                                   const u32* index, i64 k, S* dst) {        \
        scatter_columns_impl<S>(src, rows, cols, index, k, dst);                             \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                      \
        column_abs_sums_##N(const S* src, i64 rows, i64 cols, float* out) {                  \
        column_abs_sums_impl<S>(src, rows, cols, out);                                       \
    }
PER_TYPE(f32, float)
PER_TYPE(bf16, Bf16)
PER_TYPE(f16, F16)
