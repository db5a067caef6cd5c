//! Causal multi-head attention on the GPU as FlashAttention-2: one fused kernel for forward and
//! one (between two small ones) for backward, with the tiles of q, k and v read straight from
//! `qkv` and the attention matrix never stored. The algorithm, the tiles and the layouts are in
//! the header of `kernels/flash_attention.cu`; the maths is that of
//! [`crate::kernels::attention`] and of [`CudaAttention`](super::attention::CudaAttention): `qkv
//! [B, T, 3C]` holds `[q | k | v]` with head `h` at columns `h·hs ..`, `out [B, T, C]`, scale
//! `1/sqrt(hs)`, bf16 storage, f32 softmax and accumulators.
//!
//! Memory. [`CudaAttention`](super::attention::CudaAttention) holds five head-major `[B, T, C]`
//! bf16 tensors and a `[B, NH, T, T]` bf16 scores tensor as scratch, and its caller keeps the
//! `[B, NH, T, T]` weights `att` of every layer from forward to backward. This keeps, per forward,
//! only the log-sum-exp of each query row, `lse [B, NH, T]` f32, and its scratch is `delta [B, NH,
//! T]` f32 and `dq_accum [B, T, C]` f32 ([`scratch_bytes`](FlashAttention::scratch_bytes)). At
//! gpt-1.3b's shapes (B 8, T 1024, C 2048, 16 heads) that is 512 KiB of lse per layer instead of
//! 256 MiB of att, and 65 MiB of scratch instead of 416 MiB.
//!
//! Two differences from `CudaAttention` matter to a caller. `lse` lives in this value, so
//! [`backward`](FlashAttention::backward) pairs with the last [`forward`](FlashAttention::forward):
//! a model of many layers needs an lse per layer. And dq is summed with f32 atomics, so its low
//! bits depend on the order in which the GPU runs the blocks: backward is not bit-reproducible.

use cudarc::driver::sys::CUdeviceptr;
use zeroflow_device::cuda::{CudaBuffer, CudaFunction, CudaStream, Dim3, KernelParams};
use zeroflow_device::{CudaDevice, Device, DeviceError};

/// The CUDA source of the kernels: the shared header, then `flash_attention.cu`.
pub const SOURCE: &str = concat!(
    include_str!("../../kernels/common.cuh"),
    include_str!("../../kernels/flash_attention.cu")
);

/// The head sizes the tile kernels are compiled for (`flash_forward_{hs}`, `flash_backward_{hs}`).
pub const HEAD_SIZES: [usize; 2] = [64, 128];

/// Threads per block of the tile kernels (four warps) and of the preprocess kernel.
const TILE_THREADS: u32 = 128;
/// Query rows and keys per tile (`BR = BC` in the source).
const TILE: usize = 64;
/// bf16 of padding after each shared-memory row of a tile (`PAD` in the source).
const PAD: usize = 8;
/// Threads per block, and at most so many blocks, of the grid-stride dq conversion.
const CONVERT_THREADS: u32 = 256;
const CONVERT_MAX_BLOCKS: usize = 8192;
/// The alignment, in bytes, of every tensor the kernels take (they move 16-byte vectors).
const ALIGNMENT: u64 = 16;

/// Causal multi-head self-attention for one (batch, seq, channels, heads) shape, FlashAttention-2
/// style, with its scratch allocated once.
#[derive(Debug)]
pub struct FlashAttention {
    device: CudaDevice,
    shape: Shape,
    kernels: Kernels,
    /// `[B, NH, T]`: `log Σ_k exp(scale · q·k)` of each query row of the last forward.
    lse: CudaBuffer<f32>,
    /// `[B, NH, T]`: `Σ_d dout · out` of each query row (backward).
    delta: CudaBuffer<f32>,
    /// `[B, T, C]`: dq summed over the key blocks (backward).
    dq_accum: CudaBuffer<f32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    batch: usize,
    seq: usize,
    c: usize,
    n_head: usize,
    head_size: usize,
}

impl Shape {
    /// The shape, or an error saying which size the kernels cannot take.
    fn new(batch: usize, seq: usize, c: usize, n_head: usize) -> Result<Self, DeviceError> {
        if batch == 0 || seq == 0 || n_head == 0 || c == 0 || !c.is_multiple_of(n_head) {
            return Err(invalid(format!(
                "batch {batch}, seq {seq}, channels {c}, heads {n_head}: every size must be \
                 positive and the channels a multiple of the heads"
            )));
        }
        let head_size = c / n_head;
        if !HEAD_SIZES.contains(&head_size) {
            return Err(invalid(format!(
                "head size {head_size} (channels {c} / heads {n_head}) has no flash kernel: they \
                 are compiled for head sizes {HEAD_SIZES:?} (CudaAttention takes any)"
            )));
        }
        // The kernels index with 32-bit sizes and 64-bit offsets; batch and heads are grid axes.
        to_u32(batch * seq, "batch · seq")?;
        to_u32(3 * c, "3 · channels")?;
        if batch > usize::from(u16::MAX) || n_head > usize::from(u16::MAX) {
            return Err(invalid(format!(
                "batch {batch} and heads {n_head} must each be at most 65535 (grid axes)"
            )));
        }
        Ok(Shape { batch, seq, c, n_head, head_size })
    }

    /// Elements of `lse` and of `delta`, `[B, NH, T]`.
    fn rows_len(&self) -> usize {
        self.batch * self.n_head * self.seq
    }

    /// Elements of `out` and of `dq_accum`, `[B, T, C]`.
    fn out_len(&self) -> usize {
        self.batch * self.seq * self.c
    }

    /// `1 / sqrt(head_size)`, the scale of the scores.
    fn scale(&self) -> f32 {
        1.0 / (self.head_size as f32).sqrt()
    }

    /// One tile kernel's block per (64-row block of the sequence, head, sequence).
    fn tile_grid(&self) -> Dim3 {
        let blocks = self.seq.div_ceil(TILE);
        Dim3::from((blocks as u32, self.n_head as u32, self.batch as u32))
    }
}

/// Dynamic shared memory of `flash_forward_{hs}`: the Q, K and V tiles.
fn forward_shared_bytes(head_size: usize) -> usize {
    3 * TILE * (head_size + PAD) * size_of::<u16>()
}

/// Dynamic shared memory of `flash_backward_{hs}`: the K, V, Q and dO tiles, the dSᵀ tile, and
/// the lse and delta of the query block.
fn backward_shared_bytes(head_size: usize) -> usize {
    (4 * TILE * (head_size + PAD) + TILE * (TILE + PAD)) * size_of::<u16>()
        + 2 * TILE * size_of::<f32>()
}

/// The kernels of [`SOURCE`] for one head size.
#[derive(Debug)]
struct Kernels {
    forward: CudaFunction,
    backward: CudaFunction,
    preprocess: CudaFunction,
    dq_to_bf16: CudaFunction,
}

impl Kernels {
    fn load(device: &CudaDevice, head_size: usize) -> Result<Self, DeviceError> {
        let module = device.load_module("flash_attention", SOURCE)?;
        let forward = module.function(&tile_kernel_name("flash_forward", head_size))?;
        let backward = module.function(&tile_kernel_name("flash_backward", head_size))?;
        // Both may need more than the 48 KiB of shared memory a kernel gets by default.
        device
            .context()
            .bind_to_thread()
            .map_err(|e| invalid(format!("binding the context: {e}")))?;
        forward.set_max_dynamic_shared(forward_shared_bytes(head_size) as u32)?;
        backward.set_max_dynamic_shared(backward_shared_bytes(head_size) as u32)?;
        Ok(Kernels {
            forward,
            backward,
            preprocess: module.function("flash_backward_preprocess")?,
            dq_to_bf16: module.function("flash_dq_to_bf16")?,
        })
    }
}

fn tile_kernel_name(kernel: &str, head_size: usize) -> String {
    format!("{kernel}_{head_size}")
}

/// Every kernel name [`FlashAttention`] may load from [`SOURCE`] (every head size).
pub fn kernel_names() -> Vec<String> {
    let tile_kernels = HEAD_SIZES.iter().flat_map(|&head_size| {
        ["flash_forward", "flash_backward"].map(|kernel| tile_kernel_name(kernel, head_size))
    });
    tile_kernels
        .chain(["flash_backward_preprocess", "flash_dq_to_bf16"].map(String::from))
        .collect()
}

fn invalid(reason: String) -> DeviceError {
    DeviceError::Kernel { kernel: "flash attention", reason }
}

/// `value` as a kernel's `u32` argument, or an error naming what is too large.
fn to_u32(value: usize, what: &str) -> Result<u32, DeviceError> {
    u32::try_from(value)
        .map_err(|_| invalid(format!("{what} = {value} does not fit the kernels' 32-bit sizes")))
}

/// An error unless every named address is [`ALIGNMENT`]-byte aligned.
fn check_aligned(addresses: &[(&str, CUdeviceptr)]) -> Result<(), DeviceError> {
    match addresses.iter().find(|(_, address)| !address.is_multiple_of(ALIGNMENT)) {
        None => Ok(()),
        Some((what, address)) => Err(invalid(format!(
            "{what} at {address:#x} is not {ALIGNMENT}-byte aligned: the kernels move 16-byte \
             vectors (CudaAttention takes any alignment)"
        ))),
    }
}

impl FlashAttention {
    /// Loads the kernels and allocates the lse and the scratch
    /// ([`scratch_bytes`](Self::scratch_bytes)) for inputs of `batch` sequences of `seq` tokens,
    /// `c` channels and `n_head` heads. The head size `c / n_head` must be one of [`HEAD_SIZES`].
    pub fn new(
        device: &CudaDevice,
        batch: usize,
        seq: usize,
        c: usize,
        n_head: usize,
    ) -> Result<Self, DeviceError> {
        let shape = Shape::new(batch, seq, c, n_head)?;
        Ok(FlashAttention {
            kernels: Kernels::load(device, shape.head_size)?,
            lse: device.alloc(shape.rows_len())?,
            delta: device.alloc(shape.rows_len())?,
            dq_accum: device.alloc(shape.out_len())?,
            device: device.clone(),
            shape,
        })
    }

    /// Bytes of GPU memory this attention holds: the lse kept from forward and the scratch of
    /// backward (see the module documentation for how that compares with `CudaAttention`).
    pub fn scratch_bytes(&self) -> usize {
        (2 * self.shape.rows_len() + self.shape.out_len()) * size_of::<f32>()
    }

    /// `[B, NH, T]`: the log-sum-exp `log Σ_k exp(scale · q·k)` of each query row of the last
    /// forward, which backward reads (for tests and diagnostics).
    pub fn lse(&self) -> &CudaBuffer<f32> {
        &self.lse
    }

    /// `out = attention(qkv)`, keeping the log-sum-exp of each query row in [`lse`](Self::lse)
    /// for the next [`backward`](Self::backward).
    ///
    /// `qkv [B, T, 3C]` and `out [B, T, C]` are 16-byte aligned bf16 device addresses of this GPU
    /// holding at least those many elements; `out` overlaps nothing else. Ordering them against
    /// other streams is the caller's (the device contract).
    pub fn forward(
        &self,
        stream: &CudaStream,
        qkv: CUdeviceptr,
        out: CUdeviceptr,
    ) -> Result<(), DeviceError> {
        check_aligned(&[("qkv", qkv), ("out", out)])?;
        let Shape { seq, n_head, head_size, .. } = self.shape;
        let params = KernelParams::new()
            .raw_ptr(out)
            .ptr(&self.lse, 0)
            .raw_ptr(qkv)
            .u32(seq as u32)
            .u32(n_head as u32)
            .f32(self.shape.scale());
        // SAFETY: the parameters match `flash_forward_{hs}(bf16_t*, float*, const bf16_t*, u32,
        // u32, float)` with `hs` the head size the function was loaded for. Block (i, h, b) reads
        // rows 64i .. 64i+63 below `T` of sequence `b` of qkv (head h's columns of each third; the
        // caller vouches for `B·T·3C` elements), writes the same rows of out (`B·T·C`, the
        // caller's) and of our lse (`B·NH·T`). Every address is 16-byte aligned (checked above;
        // ours are 256-byte aligned) and `C` is a multiple of 8, so every 16-byte access is too.
        // The shared memory asked for is what the kernel's tiles take, allowed in `Kernels::load`.
        unsafe {
            self.device.launch(
                stream,
                &self.kernels.forward,
                self.shape.tile_grid(),
                TILE_THREADS,
                forward_shared_bytes(head_size) as u32,
                &params,
            )
        }
    }

    /// Overwrites `dqkv [B, T, 3C]` with d(loss)/d(qkv), given `dout [B, T, C]` = d(loss)/d(out)
    /// and the `qkv` and `out` of the last [`forward`](Self::forward) (whose lse it reads).
    ///
    /// The same address requirements as [`forward`](Self::forward); `dqkv` overlaps nothing else.
    pub fn backward(
        &self,
        stream: &CudaStream,
        qkv: CUdeviceptr,
        out: CUdeviceptr,
        dout: CUdeviceptr,
        dqkv: CUdeviceptr,
    ) -> Result<(), DeviceError> {
        check_aligned(&[("qkv", qkv), ("out", out), ("dout", dout), ("dqkv", dqkv)])?;
        self.preprocess(stream, out, dout)?;
        self.backward_tiles(stream, qkv, dout, dqkv)?;
        self.dq_to_bf16(stream, dqkv)
    }

    /// `delta = rowsum(dout ∘ out)` per head, and `dq_accum = 0`.
    fn preprocess(
        &self,
        stream: &CudaStream,
        out: CUdeviceptr,
        dout: CUdeviceptr,
    ) -> Result<(), DeviceError> {
        let Shape { batch, seq, n_head, head_size, .. } = self.shape;
        let params = KernelParams::new()
            .ptr(&self.delta, 0)
            .ptr(&self.dq_accum, 0)
            .raw_ptr(out)
            .raw_ptr(dout)
            .u32(seq as u32)
            .u32(n_head as u32)
            .u32(head_size as u32);
        // SAFETY: the parameters match `flash_backward_preprocess(float*, float*, const bf16_t*,
        // const bf16_t*, u32, u32, u32)`. Block `r` (one per token row `b·T + t`) reads row `r`
        // of out and dout (`C` elements each; the caller vouches for `B·T·C`), writes
        // `delta[b, ·, t]` (ours, `B·NH·T`) and row `r` of our dq_accum (`B·T·C`). The addresses
        // are 16-byte aligned and `hs` even, so the kernel's 4-byte loads are aligned.
        unsafe {
            let rows = (batch * seq) as u32;
            self.device.launch(stream, &self.kernels.preprocess, rows, TILE_THREADS, 0, &params)
        }
    }

    /// dk and dv into their thirds of `dqkv`, and dq summed into `dq_accum`.
    fn backward_tiles(
        &self,
        stream: &CudaStream,
        qkv: CUdeviceptr,
        dout: CUdeviceptr,
        dqkv: CUdeviceptr,
    ) -> Result<(), DeviceError> {
        let Shape { seq, n_head, head_size, .. } = self.shape;
        let params = KernelParams::new()
            .raw_ptr(dqkv)
            .ptr(&self.dq_accum, 0)
            .raw_ptr(qkv)
            .raw_ptr(dout)
            .ptr(&self.lse, 0)
            .ptr(&self.delta, 0)
            .u32(seq as u32)
            .u32(n_head as u32)
            .f32(self.shape.scale());
        // SAFETY: the parameters match `flash_backward_{hs}(bf16_t*, float*, const bf16_t*, const
        // bf16_t*, const float*, const float*, u32, u32, float)`. Block (j, h, b) reads rows below
        // `T` of sequence `b` of qkv and dout (head h's columns; the caller vouches for `B·T·3C`
        // and `B·T·C` elements) and of our lse and delta (`B·NH·T`); it adds into those rows of
        // our dq_accum (`B·T·C`, with atomics: blocks of other key blocks add to the same rows)
        // and writes rows 64j .. 64j+63 below `T` of the k and v thirds of dqkv (`B·T·3C`, the
        // caller's), which no other block writes. Alignment and shared memory as in `forward`.
        unsafe {
            self.device.launch(
                stream,
                &self.kernels.backward,
                self.shape.tile_grid(),
                TILE_THREADS,
                backward_shared_bytes(head_size) as u32,
                &params,
            )
        }
    }

    /// The q third of `dqkv` = `dq_accum` rounded to bf16.
    fn dq_to_bf16(&self, stream: &CudaStream, dqkv: CUdeviceptr) -> Result<(), DeviceError> {
        let Shape { batch, seq, c, .. } = self.shape;
        let pairs = self.shape.out_len() / 2;
        let blocks = pairs.div_ceil(CONVERT_THREADS as usize).min(CONVERT_MAX_BLOCKS) as u32;
        let params = KernelParams::new()
            .raw_ptr(dqkv)
            .ptr(&self.dq_accum, 0)
            .u32((batch * seq) as u32)
            .u32(c as u32);
        // SAFETY: the parameters match `flash_dq_to_bf16(bf16_t*, const float*, u32, u32)`. The
        // grid-stride loop reads our dq_accum (`B·T·C` elements) and writes columns `0..C` of each
        // of the `B·T` rows of dqkv (row stride `3C`; the caller vouches for `B·T·3C`), two
        // elements at a time at even columns of a 16-byte aligned tensor.
        unsafe {
            self.device.launch(
                stream,
                &self.kernels.dq_to_bf16,
                blocks,
                CONVERT_THREADS,
                0,
                &params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HEAD_SIZES, Shape, backward_shared_bytes, check_aligned, forward_shared_bytes};

    #[test]
    fn only_the_compiled_head_sizes_and_sizes_that_fit_the_kernels_are_accepted() {
        assert_eq!(Shape::new(2, 37, 128, 2).unwrap().head_size, 64);
        assert_eq!(Shape::new(8, 1024, 2048, 16).unwrap().head_size, 128);
        let refused = [(1, 8, 96, 2), (1, 8, 768, 3), (0, 8, 128, 2), (1, 8, 130, 2)];
        for (batch, seq, c, n_head) in refused {
            assert!(Shape::new(batch, seq, c, n_head).is_err(), "{batch} {seq} {c} {n_head}");
        }
        let message = Shape::new(1, 8, 96, 2).unwrap_err().to_string();
        assert!(message.contains("head size 48"), "{message}");
        assert!(Shape::new(1 << 16, 1, 128, 2).is_err(), "batch beyond the grid's z axis");
        assert!(Shape::new(1, 1 << 32, 128, 2).is_err(), "sequence beyond 32 bits");
    }

    #[test]
    fn tensors_must_be_16_byte_aligned() {
        assert!(check_aligned(&[("qkv", 0x1000), ("out", 0x2010)]).is_ok());
        let message = check_aligned(&[("qkv", 0x1000), ("out", 0x2008)]).unwrap_err().to_string();
        assert!(message.contains("out at 0x2008"), "{message}");
    }

    /// An H100/H200 SM offers 227 KiB of shared memory to one block, an A100's 163 KiB.
    #[test]
    fn the_tiles_fit_the_shared_memory_of_an_sm80_block() {
        for head_size in HEAD_SIZES {
            assert!(forward_shared_bytes(head_size) <= 163 * 1024);
            assert!(backward_shared_bytes(head_size) <= 163 * 1024);
        }
        assert_eq!(forward_shared_bytes(128), 52_224);
        assert_eq!(backward_shared_bytes(128), 79_360);
    }
}
