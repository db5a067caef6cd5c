// RMSNorm over rows of width c (`transformers`' LlamaRMSNorm): out = x · rstd · weight with
// rstd = 1 / sqrt(mean(x²) + eps), one warp per row, statistics in f32. Blocks of 256 threads:
// eight rows each. `vec`: every bf16 pointer 16-byte aligned and c a multiple of 8. The same
// kernels are the per-layer and final norms (rows of hidden_size) and Qwen3's per-head q/k norm
// (rows of head_dim: the [tokens, heads, head_dim] queries or keys as tokens · heads rows).

// out = inp · rstd · weight; saves rstd (f32) for backward.
extern "C" __global__ void rmsnorm_forward(bf16_t* out, float* rstd, const bf16_t* inp,
                                           const bf16_t* weight, u32 rows, u32 c, u32 vec,
                                           float eps) {
    u32 lane = threadIdx.x % WARP;
    i64 row = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    const bf16_t* x = inp + row * c;
    bf16_t* y = out + row * c;
    float squares = 0.0f;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8];
            load8(x + i, v);
#pragma unroll
            for (int k = 0; k < 8; k++) squares += v[k] * v[k];
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            float v = load1(x + i);
            squares += v * v;
        }
    }
    float s = rsqrtf(warp_sum(squares) / (float)c + eps);
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8], w[8];
            load8(x + i, v);
            load8(weight + i, w);
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = v[k] * s * w[k];
            store8(y + i, v);
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) store1(y + i, load1(x + i) * s * load1(weight + i));
    }
    if (lane == 0) rstd[row] = s;
}

// dinp (+)= rstd · (weight · dout − x · rstd² · mean(weight · dout · x)).
extern "C" __global__ void rmsnorm_backward_input(bf16_t* dinp, const bf16_t* dout,
                                                  const bf16_t* inp, const bf16_t* weight,
                                                  const float* rstd, u32 rows, u32 c, u32 vec,
                                                  u32 accumulate) {
    u32 lane = threadIdx.x % WARP;
    i64 row = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    const bf16_t* x = inp + row * c;
    const bf16_t* dy = dout + row * c;
    bf16_t* dx = dinp + row * c;
    float s = rstd[row];
    float weighted = 0.0f;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8], w[8], d[8];
            load8(x + i, v);
            load8(weight + i, w);
            load8(dy + i, d);
#pragma unroll
            for (int k = 0; k < 8; k++) weighted += w[k] * d[k] * v[k];
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            weighted += load1(weight + i) * load1(dy + i) * load1(x + i);
        }
    }
    float mean = warp_sum(weighted) / (float)c;
    float x_scale = s * s * mean;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8], w[8], d[8], g[8];
            load8(x + i, v);
            load8(weight + i, w);
            load8(dy + i, d);
            if (accumulate) {
                load8(dx + i, g);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) g[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) g[k] += s * (w[k] * d[k] - v[k] * x_scale);
            store8(dx + i, g);
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            float g = s * (load1(weight + i) * load1(dy + i) - load1(x + i) * x_scale);
            store1(dx + i, accumulate ? load1(dx + i) + g : g);
        }
    }
}

// The weight gradient, step one of two (step two is `column_sum_finish`, which adds to the bf16
// gradient): block (32, 8), grid (ceil(c / 32), chunks); block (x, y) sums rows
// [y · rows_per_chunk, (y + 1) · rows_per_chunk) of columns [32x, 32x + 32):
// partial[y · c + j] = Σ x · rstd · dout, in a fixed order.
extern "C" __global__ void rmsnorm_weight_grad_partial(float* partial, const bf16_t* dout,
                                                       const bf16_t* inp, const float* rstd,
                                                       u32 rows, u32 c, u32 rows_per_chunk) {
    __shared__ float sums[8][WARP + 1];
    u32 column = blockIdx.x * WARP + threadIdx.x;
    u32 first = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, first + rows_per_chunk);
    float dweight = 0.0f;
    if (column < c) {
        for (u32 row = first + threadIdx.y; row < end; row += 8) {
            i64 at = (i64)row * c + column;
            dweight += load1(inp + at) * rstd[row] * load1(dout + at);
        }
    }
    sums[threadIdx.y][threadIdx.x] = dweight;
    __syncthreads();
    if (threadIdx.y == 0 && column < c) {
        float total = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) total += sums[y][threadIdx.x];
        partial[(i64)blockIdx.y * c + column] = total;
    }
}
