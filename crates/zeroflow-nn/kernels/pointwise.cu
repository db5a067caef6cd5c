// Kernels shared by the model families: the residual sum and its gradient, and the column sums of
// bias (and norm) gradients. The element-wise ones take `n` elements and a `vec` flag (all
// pointers 16-byte aligned): the first n / 8 * 8 elements go in 16-byte vectors, the rest one by
// one. Gradient kernels take an `accumulate` flag per output: 1 adds to it (`+=`), 0 overwrites it
// (the first launch of backward that writes that gradient).

// out = a + b.
extern "C" __global__ void residual_forward(bf16_t* out, const bf16_t* a, const bf16_t* b, u64 n,
                                            u32 vec) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float x[8], y[8];
            load8(a + v * 8, x);
            load8(b + v * 8, y);
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] += y[k];
            store8(out + v * 8, x);
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        store1(out + i, load1(a + i) + load1(b + i));
    }
}

// da (+)= dout; db (+)= dout.
extern "C" __global__ void residual_backward(bf16_t* da, bf16_t* db, const bf16_t* dout, u64 n,
                                             u32 vec, u32 accumulate_a, u32 accumulate_b) {
    u64 done = 0;
    if (vec) {
        u64 vectors = n / 8;
        FOR_EACH_INDEX(v, vectors) {
            float d[8], x[8];
            load8(dout + v * 8, d);
            if (accumulate_a) {
                load8(da + v * 8, x);
#pragma unroll
                for (int k = 0; k < 8; k++) x[k] += d[k];
                store8(da + v * 8, x);
            } else {
                store8(da + v * 8, d);
            }
            if (accumulate_b) {
                load8(db + v * 8, x);
#pragma unroll
                for (int k = 0; k < 8; k++) x[k] += d[k];
                store8(db + v * 8, x);
            } else {
                store8(db + v * 8, d);
            }
        }
        done = vectors * 8;
    }
    FOR_EACH_INDEX(j, n - done) {
        i64 i = (i64)done + j;
        float d = load1(dout + i);
        store1(da + i, accumulate_a ? load1(da + i) + d : d);
        store1(db + i, accumulate_b ? load1(db + i) + d : d);
    }
}

// Column sums, in two deterministic steps. Step one: block (32, 8), grid (ceil(cols / 32),
// chunks); block (x, y) sums rows [y * rows_per_chunk, (y + 1) * rows_per_chunk) of columns
// [32 x, 32 x + 32) of `dout` [rows, cols] into partial[y * cols + column] (f32).
extern "C" __global__ void column_sum_partial(float* partial, const bf16_t* dout, u32 rows,
                                              u32 cols, u32 rows_per_chunk) {
    __shared__ float sums[8][WARP + 1];
    u32 column = blockIdx.x * WARP + threadIdx.x;
    u32 first = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, first + rows_per_chunk);
    float sum = 0.0f;
    if (column < cols) {
        for (u32 row = first + threadIdx.y; row < end; row += 8) {
            sum += load1(dout + (i64)row * cols + column);
        }
    }
    sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && column < cols) {
        float total = 0.0f;
#pragma unroll
        for (int y = 0; y < 8; y++) total += sums[y][threadIdx.x];
        partial[(i64)blockIdx.y * cols + column] = total;
    }
}

// Step two: out[j] += Σ_chunk partial[chunk * chunk_stride + j] for j < cols, in chunk order
// (`out` is a bf16 gradient; the sum is rounded once).
extern "C" __global__ void column_sum_finish(bf16_t* out, const float* partial, u32 chunks,
                                             u32 chunk_stride, u32 cols) {
    FOR_EACH_INDEX(j, cols) {
        float total = 0.0f;
        for (u32 chunk = 0; chunk < chunks; chunk++) total += partial[(i64)chunk * chunk_stride + j];
        store1(out + j, load1(out + j) + total);
    }
}
