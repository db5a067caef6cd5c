//! Validation of a [`Matmul`] and its operands before anything reaches cuBLASLt: shapes, types,
//! alignment, bounds and aliasing. What passes here is what the `unsafe` enqueue relies on.

use super::{BlasType, Epilogue, Matmul, MatmulOperands, OPERAND_ALIGNMENT, Operand};
use crate::error::{DeviceError, Result};

/// The operands in the order errors (and `AliasedArguments`) number them.
const NAMES: [&str; 6] = ["a", "b", "c", "d", "bias", "aux"];

fn invalid(reason: String) -> DeviceError {
    DeviceError::Kernel { kernel: "matmul", reason }
}

/// The elements a column-major `rows × cols` matrix with leading dimension `ld` spans, over
/// `batch` matrices `stride` elements apart: from its first element to one past its last.
fn span(rows: usize, cols: usize, ld: usize, batch: usize, stride: i64) -> Option<usize> {
    let one = (cols - 1).checked_mul(ld)?.checked_add(rows)?;
    if batch == 1 {
        return Some(one);
    }
    let stride = usize::try_from(stride).ok()?;
    (batch - 1).checked_mul(stride)?.checked_add(one)
}

/// Checks everything `Blas::matmul` needs: the problem is well formed, each operand has the
/// element type the problem gives it, belongs to `device`, is aligned, holds its whole extent,
/// and no operand the product writes overlaps another (C may be D exactly).
pub(super) fn validate(p: &Matmul, o: &MatmulOperands<'_>, device: usize) -> Result<()> {
    check_problem(p)?;
    let (a_rows, a_cols) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
    let (b_rows, b_cols) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
    let overflow = |what: &str| invalid(format!("the extent of {what} overflows: {p:?}"));
    let a = span(a_rows, a_cols, p.lda, p.batch, p.stride_a).ok_or_else(|| overflow("a"))?;
    let b = span(b_rows, b_cols, p.ldb, p.batch, p.stride_b).ok_or_else(|| overflow("b"))?;
    let c = span(p.m, p.n, p.ldc, p.batch, p.stride_c).ok_or_else(|| overflow("c"))?;
    let bias = p.epilogue.bias_len(p.m, p.n);
    let aux = span(p.m, p.n, p.aux_ld, 1, 0).ok_or_else(|| overflow("aux"))?;

    let slots: [(Option<&Operand<'_>>, BlasType, usize, bool); 6] = [
        (Some(&o.a), p.ab_type, a, false),
        (Some(&o.b), p.ab_type, b, false),
        (Some(&o.c), p.c_type, c, false),
        (Some(&o.d), p.c_type, c, true),
        (o.bias.as_ref(), p.c_type, bias, writes_bias(p.epilogue)),
        (o.aux.as_ref(), p.c_type, aux, p.epilogue == Epilogue::BiasGelu),
    ];
    let wanted = [true, true, true, true, p.epilogue.uses_bias(), p.epilogue.uses_aux()];
    for (index, ((operand, ty, len, _), wanted)) in slots.iter().zip(wanted).enumerate() {
        let name = NAMES[index];
        match (operand, wanted) {
            (None, false) => {}
            (None, true) => {
                return Err(invalid(format!("epilogue {:?} needs the {name} operand", p.epilogue)));
            }
            (Some(_), false) => {
                return Err(invalid(format!(
                    "the {name} operand is given but epilogue {:?} does not use it",
                    p.epilogue
                )));
            }
            (Some(operand), true) => check_operand(name, operand, *ty, *len, device)?,
        }
    }

    // Written operands must not overlap any other operand, except C = D exactly.
    let bytes = slots.map(|(operand, ty, len, written)| {
        operand.map(|o| (o.address..o.address + (len * ty.size()) as u64, written))
    });
    for (index, (range, written)) in
        bytes.iter().enumerate().filter_map(|(i, b)| Some((i, b.clone()?)))
    {
        for (other, other_range) in
            bytes.iter().enumerate().filter_map(|(i, b)| Some((i, b.clone()?.0)))
        {
            let c_is_d = index == 3 && other == 2 && range == other_range;
            if !written || index == other || c_is_d {
                continue;
            }
            if range.start < other_range.end && other_range.start < range.end {
                return Err(DeviceError::AliasedArguments { kernel: "matmul", arg: index, other });
            }
        }
    }
    Ok(())
}

/// Whether the epilogue writes the bias operand (a bias gradient) rather than reading it.
fn writes_bias(epilogue: Epilogue) -> bool {
    matches!(epilogue, Epilogue::DGeluBGrad | Epilogue::BGradA | Epilogue::BGradB)
}

fn check_problem(p: &Matmul) -> Result<()> {
    if p.m == 0 || p.n == 0 || p.k == 0 || p.batch == 0 {
        return Err(invalid(format!("m, n, k and batch must be at least 1: {p:?}")));
    }
    let supported = matches!(
        (p.ab_type, p.c_type),
        (BlasType::Bf16, BlasType::Bf16)
            | (BlasType::Bf16, BlasType::F32)
            | (BlasType::F32, BlasType::F32)
    );
    if !supported {
        return Err(invalid(format!(
            "{:?} inputs with {:?} output are not supported (bf16→bf16, bf16→f32, f32→f32 are)",
            p.ab_type, p.c_type
        )));
    }
    let (a_rows, b_rows) = (if p.trans_a { p.k } else { p.m }, if p.trans_b { p.n } else { p.k });
    if p.lda < a_rows || p.ldb < b_rows || p.ldc < p.m {
        return Err(invalid(format!(
            "a leading dimension is smaller than the rows of its stored matrix (lda ≥ {a_rows}, \
             ldb ≥ {b_rows}, ldc ≥ {}): {p:?}",
            p.m
        )));
    }
    if p.batch > 1 {
        if p.epilogue != Epilogue::None {
            return Err(invalid(format!(
                "epilogue {:?} with batch {}: epilogues are for single products",
                p.epilogue, p.batch
            )));
        }
        if p.batch > i32::MAX as usize {
            return Err(invalid(format!("batch {} is too large", p.batch)));
        }
        let one_output = (p.n - 1) as i64 * p.ldc as i64 + p.m as i64;
        if p.stride_a < 0 || p.stride_b < 0 || p.stride_c < one_output {
            return Err(invalid(format!(
                "batch strides must be non-negative and the outputs must not overlap \
                 (stride_c ≥ {one_output}): {p:?}"
            )));
        }
    }
    if p.epilogue.uses_aux() && (p.aux_ld < p.m || !p.aux_ld.is_multiple_of(8)) {
        return Err(invalid(format!(
            "aux_ld must be a multiple of 8 and at least m = {} (cuBLASLt's rule for GELU \
             auxiliary buffers): {p:?}",
            p.m
        )));
    }
    Ok(())
}

fn check_operand(
    name: &str,
    operand: &Operand<'_>,
    ty: BlasType,
    len: usize,
    device: usize,
) -> Result<()> {
    let what = match name {
        "a" => "matmul operand a",
        "b" => "matmul operand b",
        "c" => "matmul operand c",
        "d" => "matmul operand d",
        "bias" => "matmul bias",
        _ => "matmul aux",
    };
    if operand.dtype != ty.dtype() {
        return Err(DeviceError::DTypeMismatch {
            what,
            expected: ty.dtype(),
            found: operand.dtype,
        });
    }
    if operand.device != device {
        return Err(invalid(format!(
            "operand {name} is a buffer of another CudaDevice (open each GPU once and share \
             clones of its CudaDevice)"
        )));
    }
    if !operand.address.is_multiple_of(OPERAND_ALIGNMENT) {
        return Err(invalid(format!(
            "operand {name} at {:#x} is not {OPERAND_ALIGNMENT}-byte aligned (offsets into a \
             buffer must be multiples of {} {ty:?} elements)",
            operand.address,
            OPERAND_ALIGNMENT as usize / ty.size()
        )));
    }
    if len > operand.available {
        return Err(DeviceError::OutOfBounds { what, range: 0..len, len: operand.available });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::span;

    #[test]
    fn span_counts_from_the_first_element_to_one_past_the_last() {
        // A 3×2 matrix with ld 5: elements 0..3 and 5..8.
        assert_eq!(span(3, 2, 5, 1, 0), Some(8));
        // Two of them 16 apart: the second ends at 16 + 8.
        assert_eq!(span(3, 2, 5, 2, 16), Some(24));
        assert_eq!(span(3, 2, usize::MAX, 1, 0), None);
        assert_eq!(span(3, 2, 5, 2, -1), None);
        assert_eq!(span(3, 2, 5, 1, -1), Some(8));
    }
}
