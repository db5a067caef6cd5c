// Shared by the GPT kernels (prepended to each of their sources after the device prelude): vectors
// of eight bf16 moved as one 16-byte load or store, and warp and block reductions in f32.
//
// Storage is bf16, arithmetic f32. A vector path is taken only where the host checked that every
// pointer is 16-byte aligned and the row width a multiple of 8 (the `vec` flag of the kernels).

#define WARP 32
#define NEG_INF (-__int_as_float(0x7f800000))

struct alignas(16) U32x4 {
    u32 x, y, z, w;
};

// Eight bf16 at `p` (16-byte aligned) as f32.
static __device__ __forceinline__ void load8(const bf16_t* p, float v[8]) {
    U32x4 raw = *reinterpret_cast<const U32x4*>(p);
    u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        // Little endian: the element at the lower address is the low half of the word.
        v[2 * k] = __uint_as_float(words[k] << 16);
        v[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
    }
}

// Stores eight f32 as bf16 (rounded to nearest even) at `p` (16-byte aligned).
static __device__ __forceinline__ void store8(bf16_t* p, const float v[8]) {
    u32 words[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        words[k] = (u32)f32_to_bf16(v[2 * k]) | ((u32)f32_to_bf16(v[2 * k + 1]) << 16);
    }
    U32x4 raw;
    raw.x = words[0];
    raw.y = words[1];
    raw.z = words[2];
    raw.w = words[3];
    *reinterpret_cast<U32x4*>(p) = raw;
}

static __device__ __forceinline__ float load1(const bf16_t* p) { return bf16_to_f32(*p); }
static __device__ __forceinline__ void store1(bf16_t* p, float v) { *p = f32_to_bf16(v); }

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The sum of `v` over the block (every thread gets it). `scratch` holds one float per warp; the
// block's size is a multiple of 32 and at most 1024. The order of the additions is fixed, so the
// result does not change from run to run.
static __device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// GELU with the tanh approximation (GPT-2's "gelu_new") and its derivative.
#define GELU_SCALE 0.7978845608028654f
#define GELU_CUBIC 0.044715f

static __device__ __forceinline__ float gelu(float x) {
    float inner = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

static __device__ __forceinline__ float gelu_grad(float x) {
    float inner = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
    float t = tanhf(inner);
    float sech2 = 1.0f - t * t;
    return 0.5f * (1.0f + t) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * x * x);
}
