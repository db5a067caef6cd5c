// The synthetic model's backward on the GPU: the same gradients as `synthetic::grad` on the CPU,
// bit for bit (no fused multiply-adds: every product and sum is rounded as the CPU rounds it).

static __device__ __forceinline__ float hash01(u64 a, u64 b, u64 c) {
    u64 x = (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full) ^ (c + 0x165667B19E3779F9ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return (float)(x >> 40) / (float)(1ull << 24);
}

template <typename P>
static __device__ void synthetic_backward(const P* w, P* g, u64 start, u64 n, u64 rank, u64 k,
                                          float scale) {
    FOR_EACH_INDEX(j, n) {
        u64 i = start + (u64)j;
        float a = __fadd_rn(0.5f, hash01(i, 0, 1));
        float b = __fadd_rn(1.0f, hash01(i, rank + 7, k + 3));
        float grad = __fsub_rn(__fmul_rn(a, to_f32(w[j])), b);
        g[j] = from_f32<P>(__fadd_rn(to_f32(g[j]), __fmul_rn(scale, grad)));
    }
}

extern "C" __global__ void synthetic_backward_f32(const float* w, float* g, u64 start, u64 n,
                                                  u64 rank, u64 k, float scale) {
    synthetic_backward<float>(w, g, start, n, rank, k, scale);
}

extern "C" __global__ void synthetic_backward_bf16(const Bf16* w, Bf16* g, u64 start, u64 n,
                                                   u64 rank, u64 k, float scale) {
    synthetic_backward<Bf16>(w, g, start, n, rank, k, scale);
}

extern "C" __global__ void synthetic_backward_f16(const F16* w, F16* g, u64 start, u64 n,
                                                  u64 rank, u64 k, float scale) {
    synthetic_backward<F16>(w, g, start, n, rank, k, scale);
}
