// The prelude of every zeroflow kernel module: fixed-width types and bf16/f16 conversions.
//
// NVRTC has no CUDA headers of its own, and the machines that run zeroflow need not have the
// toolkit's include folder, so the kernels include nothing: bf16 and f16 values travel as their
// 16-bit patterns (`bf16_t`, `f16_t`) and are converted here, rounding to nearest even like
// `half::bf16::from_f32` and `half::f16::from_f32` on the CPU.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

typedef u16 bf16_t;
typedef u16 f16_t;

static __device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(((u32)x) << 16);
}

static __device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep the sign and make sure the result stays a NaN.
        return (bf16_t)((u >> 16) | 0x0040u);
    }
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + rounding) >> 16);
}

static __device__ __forceinline__ float f16_to_f32(f16_t x) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(x));
    return f;
}

static __device__ __forceinline__ f16_t f32_to_f16(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

// Element access for kernels written once for every floating type: `load_f32(p, i)` and
// `store_f32(p, i, v)` for `float*`, `bf16_t*` (as `Bf16*`) and `f16_t*` (as `F16*`).
struct Bf16 { bf16_t bits; };
struct F16 { f16_t bits; };

static __device__ __forceinline__ float to_f32(float x) { return x; }
static __device__ __forceinline__ float to_f32(Bf16 x) { return bf16_to_f32(x.bits); }
static __device__ __forceinline__ float to_f32(F16 x) { return f16_to_f32(x.bits); }

template <typename T> struct FromF32;
template <> struct FromF32<float> {
    static __device__ __forceinline__ float cvt(float x) { return x; }
};
template <> struct FromF32<Bf16> {
    static __device__ __forceinline__ Bf16 cvt(float x) { Bf16 b; b.bits = f32_to_bf16(x); return b; }
};
template <> struct FromF32<F16> {
    static __device__ __forceinline__ F16 cvt(float x) { F16 h; h.bits = f32_to_f16(x); return h; }
};

template <typename T> static __device__ __forceinline__ T from_f32(float x) {
    return FromF32<T>::cvt(x);
}

// Grid-stride loop over `n` elements with 64-bit indices.
#define FOR_EACH_INDEX(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); \
         i += (i64)gridDim.x * blockDim.x)
