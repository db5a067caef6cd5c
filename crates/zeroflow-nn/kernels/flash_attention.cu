// FlashAttention-2 (Dao, 2023) for causal self-attention, multi-head or grouped-query: forward
// and backward without the [B, NH, T, T] attention matrix, its products on the tensor cores (bf16
// `mma.sync`, fp32 accumulators). Compiled after common.cuh (see `src/cuda/flash.rs`).
//
// Layouts (those of attention.cu and of the CPU reference `kernels::attention`), `hs` the head
// size, `scale = 1/sqrt(hs)`, NH query heads and NKV key/value heads (NKV divides NH; query head h
// attends with key/value head h / (NH / NKV); NKV = NH is multi-head attention), C = NH·hs,
// KV = NKV·hs, W = C + 2·KV:
//
//   qkv      [B, T, W]   bf16  rows `[q | k | v]`: query head h at columns h·hs ..; key/value head
//                              j at C + j·hs .. (k) and C + KV + j·hs .. (v)
//   out      [B, T, C]   bf16  head h at columns h·hs ..
//   lse      [B, NH, T]  f32   log Σ_keys exp(scale · q·k) of each query: forward writes it into
//                              the caller's buffer, backward reads it from there
//   delta    [B, NH, T]  f32   Σ_d dout·out of each query (backward's first kernel)
//   dqkv     [B, T, W]   bf16  every element overwritten: dq, dk, dv in qkv's head layout
//
// The tile kernels read q, k, v and dout in place (no head-major copies) with 16-byte loads, so
// those tensors must be 16-byte aligned (the host checks). Scores are kept in base 2,
// `x = log2(e)·scale·q·k`, so that each exponential is one exp2f.
//
// Tiles: BR = 64 query rows and BC = 64 keys; 128 threads (4 warps), each warp owning 16 rows of
// the tile (queries in forward and in the dq kernel, keys in the dk/dv kernel), so the softmax
// statistics and the dQ, dK and dV accumulators never leave their warp. The head size HS (64 or 128) is a template parameter.
// Shared-memory rows are padded by 8 bf16 so the eight rows one `ldmatrix` reads fall in distinct
// banks.
//
// Forward, one CTA per (query block i, head h, sequence b), the longest rows first:
//
//   Q tile → shared → A fragments in registers
//   for key block j = 0 ..= i (the blocks above the diagonal are skipped):
//       K, V tiles → shared (rows ≥ T zero)
//       S = Q·Kᵀ (each warp 16 × 64), masked where key > query on the diagonal block j = i
//       m' = max(m, rowmax S);  P = 2^(S − m');  l = l·2^(m − m') + rowsum P
//       O = O·2^(m − m') + P·V  (P rounded to bf16 straight from the accumulators of S)
//   out = O / l;  lse = (m + log2 l)·ln 2
//
// Backward, three kernels, none with atomics: every output element is written once by one
// thread, after sums in a fixed order, so forward and backward repeat bit for bit. P and dP are
// computed twice (once per kernel below), the price of dq without atomics.
//
//   flash_backward_preprocess: delta (one CTA per token row).
//   flash_backward_dq, one CTA per (query block i, query head h, sequence b), the longest rows
//   first (K, V those of h's key/value head):
//       Q, dO tiles → shared;  lse, delta of this lane's two rows → registers;  dQ = 0
//       for key block j = 0 ..= i:
//           K, V tiles → shared
//           P = 2^(Q·Kᵀ·log2(e)·scale − lse·log2(e))   (each warp 16 queries × 64 keys; masked
//                entries, key > query on the diagonal block, zero)
//           dS = P ∘ (dO·Vᵀ − delta);  dQ += dS·K
//       the q part of dqkv = scale · dQ (bf16)
//   flash_backward_dkdv, one CTA per (key block j, key/value head, sequence b), the most work
//   first:
//       K, V tiles → shared;  dK = dV = 0 in registers (each warp its 16 keys × HS)
//       for each query head h of the key/value head's group, in order (one with multi-head):
//         for query block i = j .. (the blocks before the diagonal see none of these keys):
//           Q, dO tiles, lse and delta of the block (head h) → shared
//           Pᵀ = 2^(K·Qᵀ·log2(e)·scale − lse·log2(e))   (each warp 16 keys × 64 queries;
//                masked entries, key > query or query ≥ T, zero)
//           dV += Pᵀ·dO;  dPᵀ = V·dOᵀ;  dSᵀ = scale · Pᵀ ∘ (dPᵀ − delta);  dK += dSᵀ·Q
//       dK, dV → their parts of dqkv (bf16)
//
// Masking: a key block holds keys above some query only on the diagonal (BR = BC, aligned), and
// rows at or past T only in the last block, so the tile kernels test the mask only there. Rows past
// T are loaded as zeros and never stored; in forward every row of every visited block keeps at
// least one key (key 64·j ≤ query), so m is finite after the first block.
//
// Packed rows (`PACKED`, the `_packed` kernels): several documents per row, `positions [B, T]`
// u32 holding each token's position in its document, and query t attends only the keys
// `t − positions[t] ..= t` (its document's first token, `document_start`, up to itself). As
// positions restart at 0 at each document and grow by one otherwise (checked on the host), a
// document's first token never decreases along the row, so the earliest key a query block attends
// is its first row's document start: forward and the dq kernel begin at that key block (the
// blocks wholly before it are skipped), and the dk/dv kernel stops at the first query block whose
// first row's document starts after its last key. Inside the blocks they visit, every kernel
// masks `key < document_start(query)` too, in any block (a document may start anywhere). With
// `PACKED` false the kernels are those of before packing, and the plain kernels pass no positions.
//
// The GPU test (`tests/cuda/flash.rs`) checks out and the three parts of dqkv against the CPU
// reference in f64 and against `CudaAttention`, at head sizes 64 and 128 and T = 1, 37, 64, 65,
// 128 and 200 with B, NH > 1, multi-head and grouped-query (NH/NKV 6/2, 8/1), between NaN
// guards; and that a second run repeats the first bit for bit.

static constexpr int BR = 64;
static constexpr int BC = 64;
static constexpr int THREADS = 128;
static constexpr int PAD = 8;
static constexpr float LOG2E = 1.4426950408889634f;
static constexpr float LN2 = 0.6931471805599453f;

// The dynamic shared memory of the three tile kernels, 16-byte aligned (tiles move in 16-byte
// vectors). Its size is the host's `forward_shared_bytes` / `backward_dq_shared_bytes` /
// `backward_dkdv_shared_bytes`.
extern __shared__ U32x4 flash_smem[];

// ---------------------------------------------------------------------------------------------
// Tensor-core and shared-memory primitives (inline PTX, sm_80 and later).
//
// Fragments of `mma.m16n8k16` (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4·g + t,
// each register two bf16 (the lower column in the low half) or one f32:
//   A 16×16 (row, col):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16×8  (k, n):      b0 (2t..2t+1, g)  b1 (2t+8.., g)
//   C 16×8  (row, col):  c0, c1 (g, 2t..2t+1)  c2, c3 (g+8, 2t..2t+1)
// `ldmatrix.x4` reads four 8×8 matrices, lanes 8i .. 8i+7 giving the addresses of matrix i's rows;
// register i of lane 4·g + t receives row g, columns 2t..2t+1 of matrix i, or with `.trans`
// rows 2t..2t+1 of column g.

static __device__ __forceinline__ void ldmatrix_x4(u32 r[4], const bf16_t* row) {
    const u32 address = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

static __device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const bf16_t* row) {
    const u32 address = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// d += a·b for one 16×8 tile over 16 of the inner dimension.
static __device__ __forceinline__ void mma_16816(float d[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two f32 rounded to nearest-even bf16 in one register, `lo` in the low half.
static __device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// ---------------------------------------------------------------------------------------------
// Fragments from shared-memory tiles (row-major, STRIDE elements per row).

static __device__ __forceinline__ int lane_id() { return threadIdx.x % 32; }

// The A fragment of rows m..m+15, columns k..k+15 of `tile`.
template <int STRIDE>
static __device__ __forceinline__ void load_a(u32 a[4], const bf16_t* tile, int m, int k) {
    const int lane = lane_id();
    ldmatrix_x4(a, tile + (m + lane % 8 + lane / 8 % 2 * 8) * STRIDE + k + lane / 16 * 8);
}

// The B fragments of columns n..n+7 (b[0..2)) and n+8..n+15 (b[2..4)), rows k..k+15, of
// B = `tile`ᵀ (tile[n][k]): the keys of S = Q·Kᵀ, for example.
template <int STRIDE>
static __device__ __forceinline__ void load_b_pair(u32 b[4], const bf16_t* tile, int n, int k) {
    const int lane = lane_id();
    ldmatrix_x4(b, tile + (n + lane % 8 + lane / 16 * 8) * STRIDE + k + lane / 8 % 2 * 8);
}

// The same fragments of B = `tile` (tile[k][n]): the values of O = P·V, for example.
template <int STRIDE>
static __device__ __forceinline__ void load_b_pair_trans(u32 b[4], const bf16_t* tile, int k,
                                                         int n) {
    const int lane = lane_id();
    ldmatrix_x4_trans(b, tile + (k + lane % 8 + lane / 8 % 2 * 8) * STRIDE + n + lane / 16 * 8);
}

// The A fragment of columns 16s..16s+15 of a 16-row matrix a warp holds as C fragments of 8-column
// blocks, rounded to bf16: the C layout of blocks 2s and 2s+1 is the A layout of that k-step.
template <int N>
static __device__ __forceinline__ void c_to_a(u32 a[4], const float (&c)[N][4], int s) {
    a[0] = pack_bf16x2(c[2 * s][0], c[2 * s][1]);
    a[1] = pack_bf16x2(c[2 * s][2], c[2 * s][3]);
    a[2] = pack_bf16x2(c[2 * s + 1][0], c[2 * s + 1][1]);
    a[3] = pack_bf16x2(c[2 * s + 1][2], c[2 * s + 1][3]);
}

// acc[N][4] (a warp's 16 × 8N block) += A (16 × 16·K_STEPS, C fragments of `a_c`, k-step s) ·
// B (rows 16s.., tile[k][n] with n = 0 .. 8N): the P·V of forward, the dS·K of the dq kernel and
// the Pᵀ·dO, dSᵀ·Q of the dk/dv kernel.
template <int N, int K, int STRIDE>
static __device__ __forceinline__ void accumulate_c_times_tile(float (&acc)[N][4],
                                                               const float (&a_c)[K][4],
                                                               const bf16_t* tile) {
#pragma unroll
    for (int s = 0; s < K / 2; s++) {
        u32 a[4];
        c_to_a(a, a_c, s);
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            u32 b[4];
            load_b_pair_trans<STRIDE>(b, tile, 16 * s, 8 * n);
            mma_16816(acc[n], a, b);
            mma_16816(acc[n + 1], a, b + 2);
        }
    }
}

// acc[N][4] = rows m..m+15 of `a_tile` · `b_tile`ᵀ (both [rows][HS]), N·8 rows of b_tile: the
// scores Q·Kᵀ (the dk/dv kernel: K·Qᵀ), dO·Vᵀ and V·dOᵀ.
template <int N, int HS, int STRIDE>
static __device__ __forceinline__ void tile_times_tile_t(float (&acc)[N][4], const bf16_t* a_tile,
                                                         int m, const bf16_t* b_tile) {
#pragma unroll
    for (int n = 0; n < N; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < HS; k += 16) {
        u32 a[4];
        load_a<STRIDE>(a, a_tile, m, k);
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            u32 b[4];
            load_b_pair<STRIDE>(b, b_tile, 8 * n, k);
            mma_16816(acc[n], a, b);
            mma_16816(acc[n + 1], a, b + 2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tiles between global and shared memory.

// Rows row0 .. row0+63 of one head (`src`: its first column in row 0; rows `stride` elements
// apart) into a 64 × HS tile; rows at or past `seq` become zeros, so no read leaves the tensor and
// the padding rows add nothing to any product.
template <int HS>
static __device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* src, i64 stride,
                                                 u32 row0, u32 seq) {
    constexpr int CHUNKS = HS / 8;  // 16-byte chunks per row
    constexpr int STRIDE = HS + PAD;
#pragma unroll
    for (int i = 0; i < 64 * CHUNKS / THREADS; i++) {
        const int chunk = i * THREADS + threadIdx.x;
        const int r = chunk / CHUNKS, col = chunk % CHUNKS * 8;
        U32x4 v = {0u, 0u, 0u, 0u};
        if (row0 + r < seq) v = *reinterpret_cast<const U32x4*>(src + (row0 + r) * stride + col);
        *reinterpret_cast<U32x4*>(tile + r * STRIDE + col) = v;
    }
}

// Query head h of sequence b in qkv [B, T, W]: c = n_head · HS, kv = n_kv_head · HS, the row
// stride W = c + 2·kv, the query head's first element and those of the key and value of its
// key/value head h / (n_head / n_kv_head). (The kernels point into lse and delta themselves: the
// same through a helper costs their loads the read-only cache, ld.global.nc, in the backward
// kernels.)
struct HeadQkv {
    u32 c;
    u32 kv;
    i64 qkv_stride;
    const bf16_t* q;
    const bf16_t* k;
    const bf16_t* v;
};

template <int HS>
static __device__ __forceinline__ HeadQkv head_qkv(const bf16_t* qkv, u32 b, u32 h, u32 seq,
                                                   u32 n_head, u32 n_kv_head) {
    const u32 c = n_head * HS, kv = n_kv_head * HS;
    const i64 qkv_stride = (i64)c + 2 * (i64)kv;
    const bf16_t* row = qkv + (i64)b * seq * qkv_stride;
    const bf16_t* k = row + c + h / (n_head / n_kv_head) * HS;
    return {c, kv, qkv_stride, row + h * HS, k, k + kv};
}

// The K and V tiles of keys row0 .. row0+63 (`load_tile`, rows `stride` apart).
template <int HS>
static __device__ __forceinline__ void load_kv_tiles(bf16_t* k_tile, bf16_t* v_tile,
                                                     const bf16_t* k, const bf16_t* v, i64 stride,
                                                     u32 row0, u32 seq) {
    load_tile<HS>(k_tile, k, stride, row0, seq);
    load_tile<HS>(v_tile, v, stride, row0, seq);
}

// Stores a warp's 16 × HS block of C fragments (rows `row` and `row + 8` of this lane, `row`
// counted from `dst`'s row 0, rows `stride` apart) as bf16, times `factor`; rows at or past `seq`
// are skipped.
template <int N>
static __device__ __forceinline__ void store_rows(bf16_t* dst, i64 stride, const float (&c)[N][4],
                                                  u32 row, u32 seq, float factor_lo,
                                                  float factor_hi) {
    const int col = 2 * (lane_id() % 4);
#pragma unroll
    for (int n = 0; n < N; n++) {
        if (row < seq) {
            *reinterpret_cast<u32*>(dst + row * stride + 8 * n + col) =
                pack_bf16x2(c[n][0] * factor_lo, c[n][1] * factor_lo);
        }
        if (row + 8 < seq) {
            *reinterpret_cast<u32*>(dst + (row + 8) * stride + 8 * n + col) =
                pack_bf16x2(c[n][2] * factor_hi, c[n][3] * factor_hi);
        }
    }
}

// The max (or sum) over the four lanes of a quad, which hold one row of a C fragment together.
static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The first token of the document of token `t` of a row (`positions` the row's): `t −
// positions[t]`, a position past `t` counting as `t` (the CPU twin's saturating subtraction); 0
// for a padding row past the sequence (`t ≥ seq`: loaded as zeros, never stored).
static __device__ __forceinline__ u32 document_start(const u32* positions, u32 t, u32 seq) {
    return t < seq ? t - min(positions[t], t) : 0u;
}

// ---------------------------------------------------------------------------------------------
// Forward.

// One warp's online softmax over one key block: `s` (its 16 × 64 scores, already in base 2 and
// masked) becomes P = 2^(s − m'), the running max `m` becomes m', and `l` and `o` are rescaled by
// 2^(m − m') and `l` gains P's row sums (this lane's part of them; the quad adds them at the end).
template <int HS>
static __device__ __forceinline__ void online_softmax(float (&s)[BC / 8][4], float m[2], float l[2],
                                                      float (&o)[HS / 8][4]) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float block_max = m[half];
#pragma unroll
        for (int n = 0; n < BC / 8; n++) {
            block_max = fmaxf(block_max, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
        }
        const float new_max = quad_max(block_max);
        // A row with every score masked so far keeps m = −∞; subtracting 0 instead keeps its P and
        // its rescaling zero rather than NaN.
        const float base = new_max == NEG_INF ? 0.0f : new_max;
        const float rescale = exp2f(m[half] - base);
        m[half] = new_max;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < BC / 8; n++) {
            s[n][2 * half] = exp2f(s[n][2 * half] - base);
            s[n][2 * half + 1] = exp2f(s[n][2 * half + 1] - base);
            sum += s[n][2 * half] + s[n][2 * half + 1];
        }
        l[half] = l[half] * rescale + sum;
#pragma unroll
        for (int n = 0; n < HS / 8; n++) {
            o[n][2 * half] *= rescale;
            o[n][2 * half + 1] *= rescale;
        }
    }
}

template <int HS, bool PACKED>
static __device__ void flash_forward(bf16_t* __restrict__ out, float* __restrict__ lse,
                                     const bf16_t* __restrict__ qkv,
                                     const u32* __restrict__ positions, u32 seq, u32 n_head,
                                     u32 n_kv_head, float scale) {
    constexpr int STRIDE = HS + PAD;
    bf16_t* q_tile = reinterpret_cast<bf16_t*>(flash_smem);
    bf16_t* k_tile = q_tile + BR * STRIDE;
    bf16_t* v_tile = k_tile + BC * STRIDE;

    const u32 block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const auto [c, kv, qkv_stride, q, k, v] = head_qkv<HS>(qkv, b, h, seq, n_head, n_kv_head);
    const int warp = threadIdx.x / 32, lane = lane_id();
    // This lane's two query rows (those of its C fragments), and its first key in each block of 8.
    const u32 row_lo = block * BR + warp * 16 + lane / 4, row_hi = row_lo + 8;
    const u32 key_col = 2 * (lane % 4);
    const float to_base2 = scale * LOG2E;
    // Packed rows: where the documents of this lane's two rows start, and the first key block any
    // row of the query block attends.
    u32 first_lo = 0, first_hi = 0, first_key_block = 0;
    if (PACKED) {
        const u32* row_positions = positions + (i64)b * seq;
        first_lo = document_start(row_positions, row_lo, seq);
        first_hi = document_start(row_positions, row_hi, seq);
        first_key_block = document_start(row_positions, block * BR, seq) / BC;
    }

    load_tile<HS>(q_tile, q, qkv_stride, block * BR, seq);
    __syncthreads();
    u32 q_frag[HS / 16][4];
#pragma unroll
    for (int k_step = 0; k_step < HS / 16; k_step++) {
        load_a<STRIDE>(q_frag[k_step], q_tile, warp * 16, 16 * k_step);
    }

    float o[HS / 8][4] = {};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    for (u32 key_block = first_key_block; key_block <= block; key_block++) {
        __syncthreads();  // every warp is done with the last K and V tiles
        load_kv_tiles<HS>(k_tile, v_tile, k, v, qkv_stride, key_block * BC, seq);
        __syncthreads();

        float s[BC / 8][4] = {};
#pragma unroll
        for (int k_step = 0; k_step < HS / 16; k_step++) {
#pragma unroll
            for (int n = 0; n < BC / 8; n += 2) {
                u32 b[4];
                load_b_pair<STRIDE>(b, k_tile, 8 * n, 16 * k_step);
                mma_16816(s[n], q_frag[k_step], b);
                mma_16816(s[n + 1], q_frag[k_step], b + 2);
            }
        }
        const bool diagonal = key_block == block;
#pragma unroll
        for (int n = 0; n < BC / 8; n++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 key = key_block * BC + 8 * n + key_col + i % 2;
                const u32 row = i < 2 ? row_lo : row_hi;
                // On the diagonal block; keys ≥ T lie only there and above every real query. With
                // packed rows, also the keys before the row's document, in any block.
                const bool masked = (diagonal && key > row) ||
                                    (PACKED && key < (i < 2 ? first_lo : first_hi));
                s[n][i] = masked ? NEG_INF : s[n][i] * to_base2;
            }
        }
        online_softmax<HS>(s, m, l, o);
        accumulate_c_times_tile<HS / 8, BC / 8, STRIDE>(o, s, v_tile);
    }

    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    store_rows<HS / 8>(out + (i64)b * seq * c + h * HS, c, o, row_lo, seq, 1.0f / l[0],
                       1.0f / l[1]);
    if (lane % 4 == 0) {
        float* lse_head = lse + ((i64)b * n_head + h) * seq;
        if (row_lo < seq) lse_head[row_lo] = (m[0] + log2f(l[0])) * LN2;
        if (row_hi < seq) lse_head[row_hi] = (m[1] + log2f(l[1])) * LN2;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// delta[b, h, t] = Σ_d dout[b, t, h·hs + d] · out[b, t, h·hs + d] in f32. One CTA per token row,
// a warp per head at a time, two elements per lane (`head_size` even; the pointers 4-byte
// aligned); the warp's sum is a fixed butterfly, so delta repeats bit for bit.
extern "C" __global__ void flash_backward_preprocess(float* __restrict__ delta,
                                                     const bf16_t* __restrict__ out,
                                                     const bf16_t* __restrict__ dout, u32 seq,
                                                     u32 n_head, u32 head_size) {
    const u32 row = blockIdx.x, b = row / seq, t = row % seq;
    const u32 c = n_head * head_size;
    const int warp = threadIdx.x / 32, lane = lane_id(), warps = blockDim.x / 32;
    const u32* out_pairs = reinterpret_cast<const u32*>(out + (i64)row * c);
    const u32* dout_pairs = reinterpret_cast<const u32*>(dout + (i64)row * c);
    for (u32 h = warp; h < n_head; h += warps) {
        float sum = 0.0f;
        for (u32 pair = h * head_size / 2 + lane; pair < (h + 1) * head_size / 2; pair += 32) {
            const u32 o = out_pairs[pair], d = dout_pairs[pair];
            sum += __uint_as_float(o << 16) * __uint_as_float(d << 16) +
                   __uint_as_float(o & 0xffff0000u) * __uint_as_float(d & 0xffff0000u);
        }
        sum = warp_sum(sum);
        if (lane == 0) delta[((i64)b * n_head + h) * seq + t] = sum;
    }
}

// dQ of one query block: one CTA per (query block i, head h, sequence b), the longest rows first,
// each warp its 16 queries. dq accumulates in registers over key blocks 0 ..= i in that order and
// is stored once, so it repeats bit for bit.
template <int HS, bool PACKED>
static __device__ void flash_backward_dq(bf16_t* __restrict__ dqkv, const bf16_t* __restrict__ qkv,
                                         const bf16_t* __restrict__ dout,
                                         const float* __restrict__ lse,
                                         const float* __restrict__ delta,
                                         const u32* __restrict__ positions, u32 seq, u32 n_head,
                                         u32 n_kv_head, float scale) {
    constexpr int STRIDE = HS + PAD;
    bf16_t* q_tile = reinterpret_cast<bf16_t*>(flash_smem);
    bf16_t* dout_tile = q_tile + BR * STRIDE;
    bf16_t* k_tile = dout_tile + BR * STRIDE;
    bf16_t* v_tile = k_tile + BC * STRIDE;

    const u32 block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const auto [c, kv, qkv_stride, q, k, v] = head_qkv<HS>(qkv, b, h, seq, n_head, n_kv_head);
    const bf16_t* dout_head = dout + (i64)b * seq * c + h * HS;
    const float* lse_head = lse + ((i64)b * n_head + h) * seq;
    const float* delta_head = delta + ((i64)b * n_head + h) * seq;
    const int warp = threadIdx.x / 32, lane = lane_id();
    // This lane's two query rows (those of its C fragments), and its first key in each block of 8.
    const u32 row_lo = block * BR + warp * 16 + lane / 4, row_hi = row_lo + 8;
    const u32 key_col = 2 * (lane % 4);
    const float to_base2 = scale * LOG2E;
    // The rows' lse in base 2 and delta. Rows past T take zeros: their Q and dO rows are zeros too,
    // so their dS is 0 (finite) and their dq, never stored, harms nothing.
    const float lse_lo = row_lo < seq ? lse_head[row_lo] * LOG2E : 0.0f;
    const float lse_hi = row_hi < seq ? lse_head[row_hi] * LOG2E : 0.0f;
    const float delta_lo = row_lo < seq ? delta_head[row_lo] : 0.0f;
    const float delta_hi = row_hi < seq ? delta_head[row_hi] : 0.0f;
    // Packed rows: as in forward.
    u32 first_lo = 0, first_hi = 0, first_key_block = 0;
    if (PACKED) {
        const u32* row_positions = positions + (i64)b * seq;
        first_lo = document_start(row_positions, row_lo, seq);
        first_hi = document_start(row_positions, row_hi, seq);
        first_key_block = document_start(row_positions, block * BR, seq) / BC;
    }

    load_tile<HS>(q_tile, q, qkv_stride, block * BR, seq);
    load_tile<HS>(dout_tile, dout_head, c, block * BR, seq);
    float dq[HS / 8][4] = {};
    for (u32 key_block = first_key_block; key_block <= block; key_block++) {
        __syncthreads();  // Q and dO are in; every warp is done with the last K and V tiles
        load_kv_tiles<HS>(k_tile, v_tile, k, v, qkv_stride, key_block * BC, seq);
        __syncthreads();

        // 32 keys at a time (fewer live registers): P for the warp's 16 queries × those keys,
        // masked (zero) where key > query on the diagonal block, where the keys ≥ T lie too; then
        // dS = P ∘ (dO·Vᵀ − delta) over dP's registers, and dQ += dS·K (the scale comes at the end).
        const bool diagonal = key_block == block;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            constexpr int N = BC / 16;  // blocks of 8 keys per half
            const int first = 32 * half;
            float p[N][4];
            tile_times_tile_t<N, HS, STRIDE>(p, q_tile, warp * 16, k_tile + first * STRIDE);
#pragma unroll
            for (int n = 0; n < N; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const u32 key = key_block * BC + first + 8 * n + key_col + i % 2;
                    const u32 row = i < 2 ? row_lo : row_hi;
                    const bool masked = (diagonal && key > row) ||
                                        (PACKED && key < (i < 2 ? first_lo : first_hi));
                    const float lse_row = i < 2 ? lse_lo : lse_hi;
                    p[n][i] = masked ? 0.0f : exp2f(p[n][i] * to_base2 - lse_row);
                }
            }
            float ds[N][4];
            tile_times_tile_t<N, HS, STRIDE>(ds, dout_tile, warp * 16, v_tile + first * STRIDE);
#pragma unroll
            for (int n = 0; n < N; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    ds[n][i] = p[n][i] * (ds[n][i] - (i < 2 ? delta_lo : delta_hi));
                }
            }
            accumulate_c_times_tile<HS / 8, N, STRIDE>(dq, ds, k_tile + first * STRIDE);
        }
    }
    store_rows<HS / 8>(dqkv + (i64)b * seq * qkv_stride + h * HS, qkv_stride, dq, row_lo, seq,
                       scale, scale);
}

// dK and dV of one key block: one CTA per (key block j, key/value head, sequence b), the most work
// first, each warp its 16 keys. Both accumulate in registers over the query heads of the key/value
// head's group and, for each, over query blocks j .., in that order: the group's sum needs no
// atomics, and with multi-head attention the group is the one head of the same index.
template <int HS, bool PACKED>
static __device__ void flash_backward_dkdv(bf16_t* __restrict__ dqkv,
                                           const bf16_t* __restrict__ qkv,
                                           const bf16_t* __restrict__ dout,
                                           const float* __restrict__ lse,
                                           const float* __restrict__ delta,
                                           const u32* __restrict__ positions, u32 seq, u32 n_head,
                                           u32 n_kv_head, float scale) {
    constexpr int STRIDE = HS + PAD;
    bf16_t* k_tile = reinterpret_cast<bf16_t*>(flash_smem);
    bf16_t* v_tile = k_tile + BC * STRIDE;
    bf16_t* q_tile = v_tile + BC * STRIDE;
    bf16_t* dout_tile = q_tile + BR * STRIDE;
    float* lse_tile = reinterpret_cast<float*>(dout_tile + BR * STRIDE);
    float* delta_tile = lse_tile + BR;
    // Packed rows only: where each query's document starts (its first key).
    u32* first_tile = reinterpret_cast<u32*>(delta_tile + BR);

    const u32 key_block = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
    const u32 query_blocks = (seq + BR - 1) / BR;
    const u32 group = n_head / n_kv_head, first_head = kv_head * group;
    // k and v are the key/value head's; q is the group's first query head's (the next are HS on).
    const auto [c, kv, qkv_stride, q_first, k, v] =
        head_qkv<HS>(qkv, b, first_head, seq, n_head, n_kv_head);
    const int warp = threadIdx.x / 32, lane = lane_id();
    // This lane's two keys (the rows of its C fragments of Sᵀ), and its first query column.
    const u32 key_lo = key_block * BC + warp * 16 + lane / 4, key_hi = key_lo + 8;
    const int query_col = 2 * (lane % 4);
    const float to_base2 = scale * LOG2E;
    const u32* row_positions = PACKED ? positions + (i64)b * seq : nullptr;

    load_kv_tiles<HS>(k_tile, v_tile, k, v, qkv_stride, key_block * BC, seq);
    float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
    for (u32 h = first_head; h < first_head + group; h++) {
        const bf16_t* q = q_first + (h - first_head) * HS;
        const bf16_t* dout_head = dout + (i64)b * seq * c + h * HS;
        const float* lse_head = lse + ((i64)b * n_head + h) * seq;
        const float* delta_head = delta + ((i64)b * n_head + h) * seq;
        for (u32 query_block = key_block; query_block < query_blocks; query_block++) {
            const u32 q0 = query_block * BR;
            // Packed rows: no query of this block or of a later one attends a key of this block
            // once the block's first row's document starts after the key block's last key.
            if (PACKED && document_start(row_positions, q0, seq) >= (key_block + 1) * BC) break;
            __syncthreads();  // every warp is done with the last Q, dO, lse and delta
            load_tile<HS>(q_tile, q, qkv_stride, q0, seq);
            load_tile<HS>(dout_tile, dout_head, c, q0, seq);
            for (int r = threadIdx.x; r < BR; r += THREADS) {
                const bool real = q0 + r < seq;
                lse_tile[r] = real ? lse_head[q0 + r] * LOG2E : 0.0f;
                delta_tile[r] = real ? delta_head[q0 + r] : 0.0f;
                if (PACKED) first_tile[r] = document_start(row_positions, q0 + r, seq);
            }
            __syncthreads();

            // Pᵀ for the warp's 16 keys × the block's 64 queries.
            float p[BR / 8][4];
            tile_times_tile_t<BR / 8, HS, STRIDE>(p, k_tile, warp * 16, q_tile);
            const bool edge = query_block == key_block || query_block == query_blocks - 1;
#pragma unroll
            for (int n = 0; n < BR / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int column = 8 * n + query_col + i % 2;
                    const u32 query = q0 + column, key = i < 2 ? key_lo : key_hi;
                    const bool masked = (edge && (key > query || query >= seq)) ||
                                        (PACKED && key < first_tile[column]);
                    p[n][i] = masked ? 0.0f : exp2f(p[n][i] * to_base2 - lse_tile[column]);
                }
            }
            accumulate_c_times_tile<HS / 8, BR / 8, STRIDE>(dv, p, dout_tile);

            // dSᵀ = scale · Pᵀ ∘ (V·dOᵀ − delta) and dK += dSᵀ·Q, 32 queries at a time: half of
            // dPᵀ live beside dK, dV and Pᵀ rather than all of it (fewer registers, no spills at
            // HS 128).
#pragma unroll
            for (int half = 0; half < 2; half++) {
                constexpr int N = BR / 16;  // blocks of 8 queries per half
                float ds[N][4];
                const bf16_t* dout_half = dout_tile + 32 * half * STRIDE;
                tile_times_tile_t<N, HS, STRIDE>(ds, v_tile, warp * 16, dout_half);
#pragma unroll
                for (int n = 0; n < N; n++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float d = delta_tile[32 * half + 8 * n + query_col + i % 2];
                        ds[n][i] = scale * p[N * half + n][i] * (ds[n][i] - d);
                    }
                }
                accumulate_c_times_tile<HS / 8, N, STRIDE>(dk, ds, q_tile + 32 * half * STRIDE);
            }
        }
    }
    bf16_t* dk_head = dqkv + (i64)b * seq * qkv_stride + c + kv_head * HS;
    store_rows<HS / 8>(dk_head, qkv_stride, dk, key_lo, seq, 1.0f, 1.0f);
    store_rows<HS / 8>(dk_head + kv, qkv_stride, dv, key_lo, seq, 1.0f, 1.0f);
}

#define FLASH_KERNELS(HS)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                         \
        flash_forward_##HS(bf16_t* out, float* lse, const bf16_t* qkv, u32 seq, u32 n_head,       \
                           u32 n_kv_head, float scale) {                                          \
        flash_forward<HS, false>(out, lse, qkv, nullptr, seq, n_head, n_kv_head, scale);          \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dq_##HS(                 \
        bf16_t* dqkv, const bf16_t* qkv, const bf16_t* dout, const float* lse,                    \
        const float* delta, u32 seq, u32 n_head, u32 n_kv_head, float scale) {                    \
        flash_backward_dq<HS, false>(dqkv, qkv, dout, lse, delta, nullptr, seq, n_head,           \
                                     n_kv_head, scale);                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dkdv_##HS(               \
        bf16_t* dqkv, const bf16_t* qkv, const bf16_t* dout, const float* lse,                    \
        const float* delta, u32 seq, u32 n_head, u32 n_kv_head, float scale) {                    \
        flash_backward_dkdv<HS, false>(dqkv, qkv, dout, lse, delta, nullptr, seq, n_head,         \
                                       n_kv_head, scale);                                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_forward_packed_##HS(              \
        bf16_t* out, float* lse, const bf16_t* qkv, const u32* positions, u32 seq, u32 n_head,    \
        u32 n_kv_head, float scale) {                                                             \
        flash_forward<HS, true>(out, lse, qkv, positions, seq, n_head, n_kv_head, scale);         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dq_packed_##HS(          \
        bf16_t* dqkv, const bf16_t* qkv, const bf16_t* dout, const float* lse,                    \
        const float* delta, const u32* positions, u32 seq, u32 n_head, u32 n_kv_head,             \
        float scale) {                                                                            \
        flash_backward_dq<HS, true>(dqkv, qkv, dout, lse, delta, positions, seq, n_head,          \
                                    n_kv_head, scale);                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_backward_dkdv_packed_##HS(        \
        bf16_t* dqkv, const bf16_t* qkv, const bf16_t* dout, const float* lse,                    \
        const float* delta, const u32* positions, u32 seq, u32 n_head, u32 n_kv_head,             \
        float scale) {                                                                            \
        flash_backward_dkdv<HS, true>(dqkv, qkv, dout, lse, delta, positions, seq, n_head,        \
                                      n_kv_head, scale);                                          \
    }

FLASH_KERNELS(64)
FLASH_KERNELS(128)
