// The Llama family's element-wise kernels: SwiGLU (out = silu(gate) · up, silu(g) = g · σ(g)) and
// its gradient, and the token embedding without positions. The element-wise ones take `n`
// elements and a `vec` flag (all pointers 16-byte aligned): the first n / 8 · 8 elements go in
// 16-byte vectors, the rest one by one. A gradient's `accumulate` flag: 1 adds to it (`+=`), 0
// overwrites it (the first launch of backward that writes that gradient).

// The logistic function 1 / (1 + e^−g): 0 where e^−g overflows, never NaN.
static __device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// out = gate · σ(gate) · up.
extern "C" __global__ void swiglu_forward(bf16_t* out, const bf16_t* gate, const bf16_t* up, u64 n,
                                          u32 vec) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float g[8], u[8];
            load8(gate + v * 8, g);
            load8(up + v * 8, u);
#pragma unroll
            for (int k = 0; k < 8; k++) g[k] = g[k] * sigmoid(g[k]) * u[k];
            store8(out + v * 8, g);
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        float g = load1(gate + i);
        store1(out + i, g * sigmoid(g) * load1(up + i));
    }
}

// dgate (+)= dout · up · σ(g) · (1 + g · (1 − σ(g))),  dup (+)= dout · silu(g).
static __device__ __forceinline__ void swiglu_grads(float d, float g, float u, float* dgate,
                                                    float* dup) {
    float s = sigmoid(g);
    *dgate = d * u * s * (1.0f + g * (1.0f - s));
    *dup = d * g * s;
}

extern "C" __global__ void swiglu_backward(bf16_t* dgate, bf16_t* dup, const bf16_t* dout,
                                           const bf16_t* gate, const bf16_t* up, u64 n, u32 vec,
                                           u32 accumulate_gate, u32 accumulate_up) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float d[8], g[8], u[8], dg[8], du[8], old[8];
#pragma unroll
            for (int k = 0; k < 8; k++) old[k] = 0.0f;
            load8(dout + v * 8, d);
            load8(gate + v * 8, g);
            load8(up + v * 8, u);
#pragma unroll
            for (int k = 0; k < 8; k++) swiglu_grads(d[k], g[k], u[k], &dg[k], &du[k]);
            if (accumulate_gate) {
                load8(dgate + v * 8, old);
#pragma unroll
                for (int k = 0; k < 8; k++) dg[k] += old[k];
            }
            if (accumulate_up) {
                load8(dup + v * 8, old);
#pragma unroll
                for (int k = 0; k < 8; k++) du[k] += old[k];
            }
            store8(dgate + v * 8, dg);
            store8(dup + v * 8, du);
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        float dg, du;
        swiglu_grads(load1(dout + i), load1(gate + i), load1(up + i), &dg, &du);
        store1(dgate + i, accumulate_gate ? load1(dgate + i) + dg : dg);
        store1(dup + i, accumulate_up ? load1(dup + i) + du : du);
    }
}

// out[r, :] = wte[tokens[r], :] for rows × c elements (token ids were checked against the
// vocabulary on the host when the batch was set). `vec`: pointers 16-byte aligned and c a
// multiple of 8.
extern "C" __global__ void embedding_forward(bf16_t* out, const u32* tokens, const bf16_t* wte,
                                             u32 rows, u32 c, u32 vec) {
    if (vec) {
        u32 per_row = c / 8;
        FOR_EACH_INDEX(v, (i64)rows * per_row) {
            i64 row = v / per_row;
            i64 column = (v % per_row) * 8;
            *reinterpret_cast<U32x4*>(out + row * c + column) =
                *reinterpret_cast<const U32x4*>(wte + (i64)tokens[row] * c + column);
        }
    } else {
        FOR_EACH_INDEX(i, (i64)rows * c) {
            i64 row = i / c, column = i % c;
            out[i] = wte[(i64)tokens[row] * c + column];
        }
    }
}
