//! CPU tests of the conventions: the row-major constructors compute what llm.c computes.

use super::*;

/// An operand naming host matrix `tag` (the tests below run on the CPU).
fn tagged(tag: u64) -> Operand<'static> {
    Operand { address: tag, available: 0, dtype: DType::F32, device: 0, _buffer: PhantomData }
}

/// What cuBLASLt computes for `p` (column-major, no epilogue), with the matrices the operands
/// name taken from `host`.
fn col_major_product(p: &Matmul, o: &MatmulOperands<'_>, host: &[Vec<f64>]) -> Vec<f64> {
    let (a, b) = (&host[o.a.address as usize], &host[o.b.address as usize]);
    let mut d = host[o.d.address as usize].clone();
    for batch in 0..p.batch {
        let (sa, sb, sc) =
            (batch * p.stride_a as usize, batch * p.stride_b as usize, batch * p.stride_c as usize);
        for j in 0..p.n {
            for i in 0..p.m {
                d[sc + i + j * p.ldc] = (0..p.k)
                    .map(|l| {
                        let a =
                            if p.trans_a { a[sa + l + i * p.lda] } else { a[sa + i + l * p.lda] };
                        let b =
                            if p.trans_b { b[sb + j + l * p.ldb] } else { b[sb + l + j * p.ldb] };
                        a * b
                    })
                    .sum();
            }
        }
    }
    d
}

fn values(len: usize, seed: usize) -> Vec<f64> {
    (0..len).map(|i| ((i * 7 + seed * 13) % 17) as f64 - 8.0).collect()
}

/// Row-major `x[r, c]`.
fn at(x: &[f64], cols: usize, r: usize, c: usize) -> f64 {
    x[r * cols + c]
}

#[test]
fn linear_layer_constructors_compute_llm_c_row_major_products() {
    let (rows, inf, outf) = (5, 3, 4);
    let operands = MatmulOperands::row_major(tagged(0), tagged(1), tagged(2));
    let (x, w) = (values(rows * inf, 1), values(outf * inf, 2));
    // out[r, o] = Σ_c inp[r, c] · weight[o, c]
    let p = Matmul::linear_forward(rows, inf, outf);
    let out = col_major_product(&p, &operands, &[x.clone(), w.clone(), vec![0.0; rows * outf]]);
    for (r, o) in (0..rows).flat_map(|r| (0..outf).map(move |o| (r, o))) {
        let want: f64 = (0..inf).map(|c| at(&x, inf, r, c) * at(&w, inf, o, c)).sum();
        assert_eq!(at(&out, outf, r, o), want);
    }
    // dinp[r, c] = Σ_o dout[r, o] · weight[o, c]
    let dout = values(rows * outf, 3);
    let p = Matmul::linear_backward_input(rows, inf, outf);
    let dinp = col_major_product(&p, &operands, &[dout.clone(), w.clone(), vec![0.0; rows * inf]]);
    for (r, c) in (0..rows).flat_map(|r| (0..inf).map(move |c| (r, c))) {
        let want: f64 = (0..outf).map(|o| at(&dout, outf, r, o) * at(&w, inf, o, c)).sum();
        assert_eq!(at(&dinp, inf, r, c), want);
    }
    // dweight[o, c] = Σ_r dout[r, o] · inp[r, c]
    let p = Matmul::linear_backward_weight(rows, inf, outf);
    let dw = col_major_product(&p, &operands, &[dout.clone(), x.clone(), vec![0.0; outf * inf]]);
    for (o, c) in (0..outf).flat_map(|o| (0..inf).map(move |c| (o, c))) {
        let want: f64 = (0..rows).map(|r| at(&dout, outf, r, o) * at(&x, inf, r, c)).sum();
        assert_eq!(at(&dw, inf, o, c), want);
    }
}

#[test]
fn batched_row_major_strides_follow_their_operands() {
    // att[h] = q[h] · k[h]ᵀ, then out[h] = att[h] · v[h]; q, k, v [T, hs], att [T, T].
    let (heads, t, hs) = (3, 4, 2);
    let (q, k) = (values(heads * t * hs, 4), values(heads * t * hs, 5));
    let operands = MatmulOperands::row_major(tagged(0), tagged(1), tagged(2));
    let (th, tt) = ((t * hs) as i64, (t * t) as i64);
    let p = Matmul::row_major(t, t, hs, false, true).batched_row_major(heads, th, th, tt);
    let att = col_major_product(&p, &operands, &[q.clone(), k.clone(), vec![0.0; heads * t * t]]);
    for h in 0..heads {
        for (i, j) in (0..t).flat_map(|i| (0..t).map(move |j| (i, j))) {
            let want: f64 =
                (0..hs).map(|c| q[h * t * hs + i * hs + c] * k[h * t * hs + j * hs + c]).sum();
            assert_eq!(att[h * t * t + i * t + j], want);
        }
    }
    let v = values(heads * t * hs, 6);
    let p = Matmul::row_major(t, hs, t, false, false).batched_row_major(heads, tt, th, th);
    let out =
        col_major_product(&p, &operands, &[att.clone(), v.clone(), vec![0.0; heads * t * hs]]);
    for h in 0..heads {
        for (i, c) in (0..t).flat_map(|i| (0..hs).map(move |c| (i, c))) {
            let want: f64 =
                (0..t).map(|j| att[h * t * t + i * t + j] * v[h * t * hs + j * hs + c]).sum();
            assert_eq!(out[h * t * hs + i * hs + c], want);
        }
    }
}

#[test]
fn blas_may_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Blas>();
    shareable::<Matmul>();
}

#[test]
fn epilogues_say_which_operands_they_use() {
    assert!(!Epilogue::None.uses_bias() && !Epilogue::None.uses_aux());
    assert!(Epilogue::BiasGelu.uses_bias() && Epilogue::BiasGelu.uses_aux());
    assert!(Epilogue::DGelu.uses_aux() && !Epilogue::DGelu.uses_bias());
    assert_eq!(Epilogue::BGradB.bias_len(3, 5), 5);
    assert_eq!(Epilogue::BGradA.bias_len(3, 5), 3);
    assert_eq!(Epilogue::DGeluBGrad.bias_len(3, 5), 3);
}
