// An AdamW-like pass over fp32 state (weights, two moments) that lives in page-locked host memory,
// run by the GPU: its kernel reading and writing the state over the bus in place (mode 0,
// "zero-copy", mapped memory), or the state staged through device buffers by copies (mode 1).
// The gradients are f32 in device memory and the bf16 weights go to device memory, so 24 bytes
// per element cross the bus and are read or written in host memory.
//
//   nvcc -O3 -arch=sm_90 -o zero_copy_adamw zero_copy_adamw.cu
//   ./zero_copy_adamw ELEMENTS BLOCKS SECONDS MODE [trace]
//
// Prints one JSON line (seconds per pass, host GB/s); with `trace`, a line per pass first
// ("pass <unix time> <seconds> <GB/s>"), for rates while something else runs. run.sh uses it.
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void adamw(float4* p, float4* m, float4* v, const float4* g, __nv_bfloat162* out, size_t n4) {
  const float b1 = 0.9f, b2 = 0.95f, lr = 1e-4f, eps = 1e-8f, wd = 0.99999f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
    float4 pp = p[i], mm = m[i], vv = v[i], gg = g[i];
    float* P = &pp.x; float* M = &mm.x; float* V = &vv.x; float* G = &gg.x;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      M[k] = b1 * M[k] + (1 - b1) * G[k];
      V[k] = b2 * V[k] + (1 - b2) * G[k] * G[k];
      P[k] = P[k] * wd - lr * M[k] / (sqrtf(V[k]) + eps);
    }
    p[i] = pp; m[i] = mm; v[i] = vv;
    out[2 * i] = __floats2bfloat162_rn(pp.x, pp.y);
    out[2 * i + 1] = __floats2bfloat162_rn(pp.z, pp.w);
  }
}

int main(int argc, char** argv) {
  size_t n = (size_t)atof(argv[1]);
  int blocks = atoi(argv[2]);
  double seconds = atof(argv[3]);
  int mode = atoi(argv[4]);  // 0 zero-copy, 1 staged copies through device buffers
  size_t n4 = n / 4;
  float *hp, *hm, *hv;
  CK(cudaHostAlloc(&hp, n * 4, cudaHostAllocMapped));
  CK(cudaHostAlloc(&hm, n * 4, cudaHostAllocMapped));
  CK(cudaHostAlloc(&hv, n * 4, cudaHostAllocMapped));
  for (size_t i = 0; i < n; i++) { hp[i] = 1.0f; hm[i] = 0; hv[i] = 0; }
  float* dg; __nv_bfloat162* dout;
  CK(cudaMalloc(&dg, n * 4)); CK(cudaMemset(dg, 0, n * 4));
  CK(cudaMalloc(&dout, n * 2));
  cudaStream_t s[3];
  for (int i = 0; i < 3; i++) CK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
  size_t chunk = 1 << 24;  // staged: elements per piece
  float *dp[2], *dm[2], *dv[2];
  for (int b = 0; b < 2; b++) { CK(cudaMalloc(&dp[b], chunk * 4)); CK(cudaMalloc(&dm[b], chunk * 4)); CK(cudaMalloc(&dv[b], chunk * 4)); }
  auto t0 = std::chrono::steady_clock::now();
  double passes = 0, elapsed = 0;
  while (elapsed < seconds) {
    if (mode == 0) {
      float *p, *m, *v;
      CK(cudaHostGetDevicePointer((void**)&p, hp, 0));
      CK(cudaHostGetDevicePointer((void**)&m, hm, 0));
      CK(cudaHostGetDevicePointer((void**)&v, hv, 0));
      adamw<<<blocks, 256, 0, s[0]>>>((float4*)p, (float4*)m, (float4*)v, (float4*)dg, dout, n4);
      CK(cudaStreamSynchronize(s[0]));
    } else {
      cudaEvent_t up[2], done[2];
      for (int b = 0; b < 2; b++) { cudaEventCreateWithFlags(&up[b], cudaEventDisableTiming); cudaEventCreateWithFlags(&done[b], cudaEventDisableTiming); }
      bool used[2] = {false, false};
      for (size_t at = 0, k = 0; at < n; at += chunk, k++) {
        int b = k % 2; size_t len = (n - at < chunk) ? n - at : chunk;
        if (used[b]) CK(cudaStreamWaitEvent(s[0], done[b], 0));  // h2d waits for the d2h of this buffer
        CK(cudaMemcpyAsync(dp[b], hp + at, len * 4, cudaMemcpyHostToDevice, s[0]));
        CK(cudaMemcpyAsync(dm[b], hm + at, len * 4, cudaMemcpyHostToDevice, s[0]));
        CK(cudaMemcpyAsync(dv[b], hv + at, len * 4, cudaMemcpyHostToDevice, s[0]));
        CK(cudaEventRecord(up[b], s[0]));
        CK(cudaStreamWaitEvent(s[1], up[b], 0));
        adamw<<<264, 256, 0, s[1]>>>((float4*)dp[b], (float4*)dm[b], (float4*)dv[b], (float4*)(dg + at), dout + at / 2, len / 4);
        CK(cudaMemcpyAsync(hp + at, dp[b], len * 4, cudaMemcpyDeviceToHost, s[1]));
        CK(cudaMemcpyAsync(hm + at, dm[b], len * 4, cudaMemcpyDeviceToHost, s[1]));
        CK(cudaMemcpyAsync(hv + at, dv[b], len * 4, cudaMemcpyDeviceToHost, s[1]));
        CK(cudaEventRecord(done[b], s[1]));
        used[b] = true;
      }
      CK(cudaDeviceSynchronize());
      for (int b = 0; b < 2; b++) { cudaEventDestroy(up[b]); cudaEventDestroy(done[b]); }
    }
    passes += 1;
    double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double wall = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (argc > 5) printf("pass %.3f %.4f %.1f\n", wall, now - elapsed, 24.0 * n / (now - elapsed) / 1e9);
    fflush(stdout);
    elapsed = now;
  }
  double per = elapsed / passes;
  printf("{\"mode\": \"%s\", \"elements\": %zu, \"blocks\": %d, \"s_per_pass\": %.4f, \"host_GBps\": %.1f, \"elements_per_s\": %.3e, \"passes\": %.0f}\n",
         mode == 0 ? "zero-copy" : "staged", n, blocks, per, 24.0 * n / per / 1e9, n / per, passes);
  return 0;
}
