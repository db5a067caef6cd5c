// LayerNorm over rows of width c (eps 1e-5), one warp per row, statistics in f32. Blocks of 256
// threads: eight rows each. `vec`: every pointer 16-byte aligned and c a multiple of 8.

#define LN_EPS 1e-5f

// out = (inp - mean) * rstd * weight + bias; saves mean and rstd (f32) for backward.
extern "C" __global__ void layernorm_forward(bf16_t* out, float* mean, float* rstd,
                                             const bf16_t* inp, const bf16_t* weight,
                                             const bf16_t* bias, u32 rows, u32 c, u32 vec) {
    u32 lane = threadIdx.x % WARP;
    i64 row = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    const bf16_t* x = inp + row * c;
    bf16_t* y = out + row * c;
    float sum = 0.0f;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8];
            load8(x + i, v);
#pragma unroll
            for (int k = 0; k < 8; k++) sum += v[k];
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) sum += load1(x + i);
    }
    float mu = warp_sum(sum) / (float)c;
    float squares = 0.0f;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8];
            load8(x + i, v);
#pragma unroll
            for (int k = 0; k < 8; k++) squares += (v[k] - mu) * (v[k] - mu);
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            float d = load1(x + i) - mu;
            squares += d * d;
        }
    }
    float s = rsqrtf(warp_sum(squares) / (float)c + LN_EPS);
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8], w[8], b[8];
            load8(x + i, v);
            load8(weight + i, w);
            load8(bias + i, b);
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = (v[k] - mu) * s * w[k] + b[k];
            store8(y + i, v);
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            store1(y + i, (load1(x + i) - mu) * s * load1(weight + i) + load1(bias + i));
        }
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = s;
    }
}

// dinp (+)= (weight * dout - mean(weight * dout) - norm * mean(weight * dout * norm)) * rstd,
// norm = (inp - mean) * rstd.
extern "C" __global__ void layernorm_backward_input(bf16_t* dinp, const bf16_t* dout,
                                                    const bf16_t* inp, const bf16_t* weight,
                                                    const float* mean, const float* rstd, u32 rows,
                                                    u32 c, u32 vec, u32 accumulate) {
    u32 lane = threadIdx.x % WARP;
    i64 row = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    const bf16_t* x = inp + row * c;
    const bf16_t* dy = dout + row * c;
    bf16_t* dx = dinp + row * c;
    float mu = mean[row], s = rstd[row];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    if (vec) {
        for (u32 i = lane * 8; i < c; i += WARP * 8) {
            float v[8], w[8], d[8];
            load8(x + i, v);
            load8(weight + i, w);
            load8(dy + i, d);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float dnorm = w[k] * d[k];
                dnorm_sum += dnorm;
                dnorm_norm_sum += dnorm * (v[k] - mu) * s;
            }
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            float dnorm = load1(weight + i) * load1(dy + i);
            dnorm_sum += dnorm;
            dnorm_norm_sum += dnorm * (load1(x + i) - mu) * s;
        }
    }
    float dnorm_mean = warp_sum(dnorm_sum) / (float)c;
    float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / (float)c;
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
            for (int k = 0; k < 8; k++) {
                float norm = (v[k] - mu) * s;
                g[k] += (w[k] * d[k] - dnorm_mean - norm * dnorm_norm_mean) * s;
            }
            store8(dx + i, g);
        }
    } else {
        for (u32 i = lane; i < c; i += WARP) {
            float norm = (load1(x + i) - mu) * s;
            float g = (load1(weight + i) * load1(dy + i) - dnorm_mean - norm * dnorm_norm_mean) * s;
            store1(dx + i, accumulate ? load1(dx + i) + g : g);
        }
    }
}

// The weight and bias gradients, step one of two (step two is `column_sum_finish`): block (32, 8),
// grid (ceil(c / 32), chunks); block (x, y) sums rows [y * rows_per_chunk, (y + 1) *
// rows_per_chunk) of columns [32 x, 32 x + 32): partial[(2 y) * c + j] = Σ norm * dout (weight),
// partial[(2 y + 1) * c + j] = Σ dout (bias).
extern "C" __global__ void layernorm_param_grads_partial(float* partial, const bf16_t* dout,
                                                         const bf16_t* inp, const float* mean,
                                                         const float* rstd, u32 rows, u32 c,
                                                         u32 rows_per_chunk) {
    __shared__ float weight_sums[8][WARP + 1];
    __shared__ float bias_sums[8][WARP + 1];
    u32 column = blockIdx.x * WARP + threadIdx.x;
    u32 first = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, first + rows_per_chunk);
    float dweight = 0.0f, dbias = 0.0f;
    if (column < c) {
        for (u32 row = first + threadIdx.y; row < end; row += 8) {
            i64 at = (i64)row * c + column;
            float dy = load1(dout + at);
            dweight += (load1(inp + at) - mean[row]) * rstd[row] * dy;
            dbias += dy;
        }
    }
    weight_sums[threadIdx.y][threadIdx.x] = dweight;
    bias_sums[threadIdx.y][threadIdx.x] = dbias;
    __syncthreads();
    if (threadIdx.y == 0 && column < c) {
        float total_weight = 0.0f, total_bias = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) {
            total_weight += weight_sums[y][threadIdx.x];
            total_bias += bias_sums[y][threadIdx.x];
        }
        partial[(2 * (i64)blockIdx.y) * c + column] = total_weight;
        partial[(2 * (i64)blockIdx.y + 1) * c + column] = total_bias;
    }
}
