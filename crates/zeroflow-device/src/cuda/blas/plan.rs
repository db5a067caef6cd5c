//! cuBLASLt objects owned by Rust values (the handle, descriptors, layouts), and the plan of one
//! problem: its descriptor, four layouts and the algorithm the heuristic chose, built once and
//! reused by every call with the same problem.

use std::ffi::c_void;
use std::fmt;
use std::sync::Mutex;

use cudarc::cublaslt::sys;
use cudarc::driver::sys as cu_sys;

use super::{BlasType, Epilogue, Matmul, blas_error};
use crate::error::{DeviceError, Result};

/// Turns a cuBLASLt status into a result naming the call.
fn check(status: sys::cublasStatus_t, call: &str) -> Result<()> {
    if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(blas_error(call, format!("{status:?}")))
    }
}

/// Like [`check`], for a call that sets `attribute` (named only on failure: no allocation on the
/// path every matmul takes).
fn check_set(status: sys::cublasStatus_t, call: &str, attribute: impl fmt::Debug) -> Result<()> {
    if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(blas_error(&format!("{call}({attribute:?})"), format!("{status:?}")))
    }
}

/// A cuBLASLt handle, destroyed on drop.
pub(super) struct Handle(sys::cublasLtHandle_t);

impl Handle {
    /// Creates a handle. libcublasLt must be loadable (checked by the caller) and the device's
    /// context current.
    pub(super) fn new() -> Result<Self> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is loaded; the pointer is valid for a write.
        check(unsafe { sys::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(Handle(handle))
    }

    pub(super) fn raw(&self) -> sys::cublasLtHandle_t {
        self.0
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from cublasLtCreate and is destroyed once, here. The owning
        // `Blas` drops it after its workspace, whose drop waited for every stream, so no queued
        // matmul uses it any more.
        let status = unsafe { sys::cublasLtDestroy(self.0) };
        if let Err(error) = check(status, "cublasLtDestroy") {
            tracing::warn!(%error, "destroying the cuBLASLt handle failed");
        }
    }
}

// SAFETY: a cuBLASLt handle may be used from any thread (cuBLASLt's documentation: the handle is
// thread safe for cublasLtMatmul; it has no thread affinity), and `Handle` only hands out the
// pointer value.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new() -> Result<Self> {
        let mut desc = std::ptr::null_mut();
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let scale = sys::cudaDataType::CUDA_R_32F;
        // SAFETY: the pointer is valid for a write; the types are valid enumerators.
        let status = unsafe { sys::cublasLtMatmulDescCreate(&mut desc, compute, scale) };
        check(status, "cublasLtMatmulDescCreate")?;
        Ok(Desc(desc))
    }

    /// Sets one attribute to `value`, whose type must be the one cuBLASLt documents for it.
    fn set<T: Copy>(&self, attribute: sys::cublasLtMatmulDescAttributes_t, value: T) -> Result<()> {
        // SAFETY: the descriptor is alive; `value` is a live `T` and cuBLASLt copies
        // `size_of::<T>()` bytes from it, checking that size against the attribute's.
        let status = unsafe {
            sys::cublasLtMatmulDescSetAttribute(
                self.0,
                attribute,
                std::ptr::from_ref(&value).cast::<c_void>(),
                size_of::<T>(),
            )
        };
        check_set(status, "cublasLtMatmulDescSetAttribute", attribute)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate, destroyed once, here.
        let _ = unsafe { sys::cublasLtMatmulDescDestroy(self.0) };
    }
}

/// A matrix layout, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// A column-major `rows × cols` layout with leading dimension `ld`, `batch` matrices `stride`
    /// elements apart.
    fn new(
        ty: BlasType,
        rows: usize,
        cols: usize,
        ld: usize,
        batch: usize,
        stride: i64,
    ) -> Result<Self> {
        let mut layout = std::ptr::null_mut();
        let ty = match ty {
            BlasType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            BlasType::F32 => sys::cudaDataType::CUDA_R_32F,
        };
        // SAFETY: the pointer is valid for a write; sizes are plain numbers cuBLASLt validates.
        let status = unsafe {
            sys::cublasLtMatrixLayoutCreate(&mut layout, ty, rows as u64, cols as u64, ld as i64)
        };
        check(status, "cublasLtMatrixLayoutCreate")?;
        let layout = Layout(layout);
        if batch > 1 {
            use sys::cublasLtMatrixLayoutAttribute_t as Attr;
            layout.set(Attr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, batch as i32)?;
            layout.set(Attr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride)?;
        }
        Ok(layout)
    }

    fn set<T: Copy>(
        &self,
        attribute: sys::cublasLtMatrixLayoutAttribute_t,
        value: T,
    ) -> Result<()> {
        // SAFETY: as in `Desc::set`.
        let status = unsafe {
            sys::cublasLtMatrixLayoutSetAttribute(
                self.0,
                attribute,
                std::ptr::from_ref(&value).cast::<c_void>(),
                size_of::<T>(),
            )
        };
        check_set(status, "cublasLtMatrixLayoutSetAttribute", attribute)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate, destroyed once, here.
        let _ = unsafe { sys::cublasLtMatrixLayoutDestroy(self.0) };
    }
}

/// Heuristic search preferences, destroyed on drop.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    fn new() -> Result<Self> {
        let mut preference = std::ptr::null_mut();
        // SAFETY: the pointer is valid for a write.
        let status = unsafe { sys::cublasLtMatmulPreferenceCreate(&mut preference) };
        check(status, "cublasLtMatmulPreferenceCreate")?;
        Ok(Preference(preference))
    }

    fn set<T: Copy>(
        &self,
        attribute: sys::cublasLtMatmulPreferenceAttributes_t,
        value: T,
    ) -> Result<()> {
        // SAFETY: as in `Desc::set`.
        let status = unsafe {
            sys::cublasLtMatmulPreferenceSetAttribute(
                self.0,
                attribute,
                std::ptr::from_ref(&value).cast::<c_void>(),
                size_of::<T>(),
            )
        };
        check_set(status, "cublasLtMatmulPreferenceSetAttribute", attribute)
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once, here.
        let _ = unsafe { sys::cublasLtMatmulPreferenceDestroy(self.0) };
    }
}

/// Everything that decides a plan: the whole problem (alpha and beta by their bits) and the
/// alignment of A, B, C and D, which limits the algorithms that may run (cuBLASLt assumes
/// 256-byte aligned operands unless told otherwise; the preferences of a plan tell it the truth).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    trans: (bool, bool),
    ld: [usize; 3],
    batch: usize,
    strides: [i64; 3],
    types: (BlasType, BlasType),
    epilogue: Epilogue,
    aux_ld: usize,
    scalars: (u32, u32),
    /// Alignment of the A, B, C and D matrices in bytes (a power of two, at most 256).
    alignment: [u32; 4],
}

impl PlanKey {
    pub(super) fn new(problem: &Matmul, addresses: [cu_sys::CUdeviceptr; 4]) -> Self {
        let p = problem;
        PlanKey {
            m: p.m,
            n: p.n,
            k: p.k,
            trans: (p.trans_a, p.trans_b),
            ld: [p.lda, p.ldb, p.ldc],
            batch: p.batch,
            strides: if p.batch > 1 { [p.stride_a, p.stride_b, p.stride_c] } else { [0; 3] },
            types: (p.ab_type, p.c_type),
            epilogue: p.epilogue,
            aux_ld: if p.epilogue.uses_aux() { p.aux_ld } else { 0 },
            scalars: (p.alpha.to_bits(), p.beta.to_bits()),
            alignment: operand_alignments(p, addresses),
        }
    }
}

/// The alignment in bytes that every matrix of A, B, C and D has: that of its address and, in a
/// batch, of its stride (matrix `i` starts `i · stride` elements after the first).
fn operand_alignments(p: &Matmul, addresses: [cu_sys::CUdeviceptr; 4]) -> [u32; 4] {
    let sizes = [p.ab_type.size(), p.ab_type.size(), p.c_type.size(), p.c_type.size()];
    let strides = [p.stride_a, p.stride_b, p.stride_c, p.stride_c];
    std::array::from_fn(|i| {
        let mut bits = addresses[i];
        if p.batch > 1 {
            bits |= (strides[i] as u64).wrapping_mul(sizes[i] as u64);
        }
        alignment(bits)
    })
}

/// The largest power of two, at most 256, that divides `bits` (256 for 0).
fn alignment(bits: u64) -> u32 {
    1 << bits.trailing_zeros().min(8)
}

/// The raw addresses of one call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Addresses {
    pub a: cu_sys::CUdeviceptr,
    pub b: cu_sys::CUdeviceptr,
    pub c: cu_sys::CUdeviceptr,
    pub d: cu_sys::CUdeviceptr,
    pub bias: Option<cu_sys::CUdeviceptr>,
    pub aux: Option<cu_sys::CUdeviceptr>,
}

/// The descriptor, layouts and algorithm of one problem.
pub(super) struct Plan {
    /// Locked while a call sets its bias and aux pointers and enqueues (cublasLtMatmul reads the
    /// descriptor when it enqueues, not later).
    desc: Mutex<Desc>,
    /// A, B, C, D.
    layouts: [Layout; 4],
    algo: sys::cublasLtMatmulAlgo_t,
    alpha: f32,
    beta: f32,
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Plan")
    }
}

// SAFETY: the descriptor and layouts are plain host-side objects that cuBLASLt lets any thread use
// (not concurrently: the descriptor, the only one written after creation, is behind a mutex; the
// layouts are only read after creation).
unsafe impl Send for Plan {}
// SAFETY: as above.
unsafe impl Sync for Plan {}

fn epilogue_code(epilogue: Epilogue) -> sys::cublasLtEpilogue_t {
    use sys::cublasLtEpilogue_t as E;
    match epilogue {
        Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::Gelu => E::CUBLASLT_EPILOGUE_GELU,
        Epilogue::BiasGelu => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        Epilogue::DGelu => E::CUBLASLT_EPILOGUE_DGELU,
        Epilogue::DGeluBGrad => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
        Epilogue::BGradA => E::CUBLASLT_EPILOGUE_BGRADA,
        Epilogue::BGradB => E::CUBLASLT_EPILOGUE_BGRADB,
    }
}

fn data_type(ty: BlasType) -> sys::cudaDataType {
    match ty {
        BlasType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        BlasType::F32 => sys::cudaDataType::CUDA_R_32F,
    }
}

impl Plan {
    /// Builds the descriptor and layouts of a (validated) `problem` and asks the heuristic for
    /// the best algorithm that fits `workspace_bytes` and the alignments in `key`. The pointers
    /// of the first call are set before the query, as in every later call.
    pub(super) fn new(
        handle: &Handle,
        problem: &Matmul,
        key: &PlanKey,
        addresses: &Addresses,
        workspace_bytes: usize,
    ) -> Result<Self> {
        let desc = descriptor(problem, addresses)?;
        let layouts = layouts(problem)?;
        let algo =
            best_algorithm(handle, &desc, &layouts, key, workspace_bytes).map_err(|e| match e {
                DeviceError::Library { library, reason } => DeviceError::Library {
                    library,
                    reason: format!("{reason} (problem {problem:?})"),
                },
                other => other,
            })?;
        Ok(Plan { desc: Mutex::new(desc), layouts, algo, alpha: problem.alpha, beta: problem.beta })
    }

    /// Enqueues the product on `stream`.
    ///
    /// # Safety
    /// The context of `stream` must be current. Every address must point to device memory that
    /// holds the operand as the plan's problem describes it (validated by `Blas::matmul`), that
    /// nothing else writes until the stream has run the product, and the `workspace_bytes` at
    /// `workspace` must be used by nothing else in that time.
    pub(super) unsafe fn enqueue(
        &self,
        handle: &Handle,
        epilogue: Epilogue,
        addresses: &Addresses,
        workspace: cu_sys::CUdeviceptr,
        workspace_bytes: usize,
        stream: cu_sys::CUstream,
    ) -> Result<()> {
        let desc = self.desc.lock().unwrap_or_else(|e| e.into_inner());
        set_pointers(&desc, epilogue, addresses)?;
        let pointer = |address: cu_sys::CUdeviceptr| address as *const c_void;
        // SAFETY: the descriptor, layouts and handle are alive; alpha and beta are f32 host
        // values as the scale type says; the caller vouches for the addresses, the workspace and
        // the stream. cublasLtMatmul reads the descriptor before it returns (the lock is held
        // until then).
        let status = unsafe {
            sys::cublasLtMatmul(
                handle.raw(),
                desc.0,
                std::ptr::from_ref(&self.alpha).cast(),
                pointer(addresses.a),
                self.layouts[0].0,
                pointer(addresses.b),
                self.layouts[1].0,
                std::ptr::from_ref(&self.beta).cast(),
                pointer(addresses.c),
                self.layouts[2].0,
                addresses.d as *mut c_void,
                self.layouts[3].0,
                &self.algo,
                workspace as *mut c_void,
                workspace_bytes,
                stream.cast(),
            )
        };
        check(status, "cublasLtMatmul")
    }
}

/// Sets the epilogue's bias and aux pointers of one call on the descriptor.
fn set_pointers(desc: &Desc, epilogue: Epilogue, addresses: &Addresses) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    if let Some(bias) = addresses.bias.filter(|_| epilogue.uses_bias()) {
        desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias as *const c_void)?;
    }
    if let Some(aux) = addresses.aux.filter(|_| epilogue.uses_aux()) {
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux as *const c_void)?;
    }
    Ok(())
}

/// The matmul descriptor of `p`: transposes, epilogue, and the epilogue's types, leading
/// dimension and pointers.
fn descriptor(p: &Matmul, addresses: &Addresses) -> Result<Desc> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    let desc = Desc::new()?;
    desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, i32::from(p.trans_a))?;
    desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, i32::from(p.trans_b))?;
    desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue_code(p.epilogue))?;
    if p.epilogue.uses_bias() {
        // The bias (or bias gradient) has the type of D (module documentation).
        desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, data_type(p.c_type))?;
    }
    if p.epilogue.uses_aux() {
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.aux_ld as i64)?;
    }
    set_pointers(&desc, p.epilogue, addresses)?;
    Ok(desc)
}

/// The layouts of A, B, C and D (C and D alike: C is D, or laid out like it).
fn layouts(p: &Matmul) -> Result<[Layout; 4]> {
    let (a_rows, a_cols) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
    let (b_rows, b_cols) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
    Ok([
        Layout::new(p.ab_type, a_rows, a_cols, p.lda, p.batch, p.stride_a)?,
        Layout::new(p.ab_type, b_rows, b_cols, p.ldb, p.batch, p.stride_b)?,
        Layout::new(p.c_type, p.m, p.n, p.ldc, p.batch, p.stride_c)?,
        Layout::new(p.c_type, p.m, p.n, p.ldc, p.batch, p.stride_c)?,
    ])
}

/// The heuristic's first choice of algorithm for the descriptor and layouts, among those that
/// fit the workspace and the operands' alignments.
fn best_algorithm(
    handle: &Handle,
    desc: &Desc,
    layouts: &[Layout; 4],
    key: &PlanKey,
    workspace_bytes: usize,
) -> Result<sys::cublasLtMatmulAlgo_t> {
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let preference = Preference::new()?;
    preference.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes as u64)?;
    let [a, b, c, d] = key.alignment;
    preference.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a)?;
    preference.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b)?;
    preference.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c)?;
    preference.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d)?;

    // SAFETY: an all-zero heuristic result is a valid value of this plain C struct (the status
    // field's zero is CUBLAS_STATUS_SUCCESS); it is overwritten below.
    let mut heuristic: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
    let mut found = 0;
    // SAFETY: every handle is alive; the result pointer has room for the one result asked for,
    // and `found` is valid for a write.
    let status = unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle.raw(),
            desc.0,
            layouts[0].0,
            layouts[1].0,
            layouts[2].0,
            layouts[3].0,
            preference.0,
            1,
            &mut heuristic,
            &mut found,
        )
    };
    check(status, "cublasLtMatmulAlgoGetHeuristic")?;
    if found == 0 {
        return Err(blas_error(
            "cublasLtMatmulAlgoGetHeuristic",
            format!(
                "no algorithm for operand alignments {:?} bytes and a {workspace_bytes}-byte \
                 workspace: this combination of types, layouts and epilogue is not supported by \
                 this cuBLASLt on this GPU",
                key.alignment
            ),
        ));
    }
    check(heuristic.state, "cublasLtMatmulAlgoGetHeuristic (result state)")?;
    Ok(heuristic.algo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_dividing_address_and_batch_stride() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        let single = Matmul::col_major(8, 8, 8, false, false);
        assert_eq!(
            operand_alignments(&single, [0x1000, 0x1010, 0x1100, 0x1100]),
            [256, 16, 256, 256]
        );
        // bf16 matrices 77·77 elements apart are only 2-byte aligned after the first.
        let batched = single.batched(4, 64, 77 * 77, 77 * 77);
        assert_eq!(operand_alignments(&batched, [0x1000, 0x1000, 0x1000, 0x1000]), [128, 2, 2, 2]);
    }
}
