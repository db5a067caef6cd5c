// GPT-2's GELU (tanh approximation, `gelu` and `gelu_grad` of common.cuh) and its gradient. Each
// takes `n` elements and a `vec` flag (all pointers 16-byte aligned): the first n / 8 * 8 elements
// go in 16-byte vectors, the rest one by one. The gradient kernel takes an `accumulate` flag: 1
// adds to it (`+=`), 0 overwrites it (the first launch of backward that writes that gradient).

// out = gelu(inp).
extern "C" __global__ void gelu_forward(bf16_t* out, const bf16_t* inp, u64 n, u32 vec) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float x[8];
            load8(inp + v * 8, x);
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] = gelu(x[k]);
            store8(out + v * 8, x);
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        store1(out + i, gelu(load1(inp + i)));
    }
}

// dinp (+)= gelu'(inp) * dout.
extern "C" __global__ void gelu_backward(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout,
                                         u64 n, u32 vec, u32 accumulate) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float x[8], d[8], g[8];
            load8(inp + v * 8, x);
            load8(dout + v * 8, d);
            if (accumulate) {
                load8(dinp + v * 8, g);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) g[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) g[k] += gelu_grad(x[k]) * d[k];
            store8(dinp + v * 8, g);
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        float g = gelu_grad(load1(inp + i)) * load1(dout + i);
        store1(dinp + i, accumulate ? load1(dinp + i) + g : g);
    }
}
