// Token + position embedding and its gradients. Token ids were checked against the vocabulary on
// the host when the batch was set.

// out[r, :] = wte[tokens[r], :] + wpe[p, :] for n = rows × c elements, the position p = r % t, or
// with packed rows (`PACKED`) p = positions[r], each token's position in its document (checked on
// the host when the batch was set: below t). `vec`: pointers 16-byte aligned and c a multiple of 8.
template <bool PACKED>
static __device__ __forceinline__ void encoder_rows(bf16_t* out, const u32* tokens,
                                                    const bf16_t* wte, const bf16_t* wpe,
                                                    const u32* positions, u32 rows, u32 t, u32 c,
                                                    u32 vec) {
    if (vec) {
        u32 per_row = c / 8;
        FOR_EACH_INDEX(v, (i64)rows * per_row) {
            i64 row = v / per_row;
            i64 column = (v % per_row) * 8;
            float word[8], position[8];
            load8(wte + (i64)tokens[row] * c + column, word);
            load8(wpe + (PACKED ? (i64)positions[row] : row % t) * c + column, position);
#pragma unroll
            for (int k = 0; k < 8; k++) word[k] += position[k];
            store8(out + row * c + column, word);
        }
    } else {
        FOR_EACH_INDEX(i, (i64)rows * c) {
            i64 row = i / c, column = i % c;
            float word = load1(wte + (i64)tokens[row] * c + column);
            i64 p = PACKED ? (i64)positions[row] : row % t;
            store1(out + i, word + load1(wpe + p * c + column));
        }
    }
}

extern "C" __global__ void encoder_forward(bf16_t* out, const u32* tokens, const bf16_t* wte,
                                           const bf16_t* wpe, u32 rows, u32 t, u32 c, u32 vec) {
    encoder_rows<false>(out, tokens, wte, wpe, nullptr, rows, t, c, vec);
}

extern "C" __global__ void encoder_forward_packed(bf16_t* out, const u32* tokens,
                                                  const bf16_t* wte, const bf16_t* wpe,
                                                  const u32* positions, u32 rows, u32 c,
                                                  u32 vec) {
    encoder_rows<true>(out, tokens, wte, wpe, positions, rows, 1, c, vec);
}

// dwte[token, :] += Σ dout[r, :] over the rows r whose input is `token`, deterministically: the
// host sorted the rows by token (`order`), and bucket b holds the rows order[bucket_start[b] ..
// bucket_start[b + 1]] of token bucket_token[b]. Grid (buckets, ceil(c / blockDim.x)). With packed
// rows the position embedding's gradient is the same sum over buckets of equal positions.
extern "C" __global__ void encoder_backward_wte(bf16_t* dwte, const bf16_t* dout,
                                                const u32* order, const u32* bucket_token,
                                                const u32* bucket_start, u32 c) {
    u32 bucket = blockIdx.x;
    u32 column = blockIdx.y * blockDim.x + threadIdx.x;
    if (column >= c) return;
    float sum = 0.0f;
    for (u32 k = bucket_start[bucket]; k < bucket_start[bucket + 1]; k++) {
        sum += load1(dout + (i64)order[k] * c + column);
    }
    bf16_t* g = dwte + (i64)bucket_token[bucket] * c + column;
    store1(g, load1(g) + sum);
}

// dwpe[p, :] += Σ_b dout[b * t + p, :] for p < t (each element owned by one thread).
extern "C" __global__ void encoder_backward_wpe(bf16_t* dwpe, const bf16_t* dout, u32 batch, u32 t,
                                                u32 c) {
    FOR_EACH_INDEX(i, (i64)t * c) {
        float sum = 0.0f;
        for (u32 b = 0; b < batch; b++) sum += load1(dout + (i64)b * t * c + i);
        store1(dwpe + i, load1(dwpe + i) + sum);
    }
}
