//! The token embedding without position embeddings (rotary positions are applied to the queries
//! and keys instead): `out[row] = wte[tokens[row]]`.

use rayon::prelude::*;
use zeroflow_nn::Float;
use zeroflow_nn::kernels::encoder::check_tokens;

/// `out[row, :] = wte[tokens[row], :]` for rows of width `c`; every token must be below `vocab`.
pub fn embedding_forward<F: Float>(
    out: &mut [F],
    tokens: &[u32],
    wte: &[F],
    c: usize,
    vocab: usize,
) -> Result<(), String> {
    check_tokens(tokens, vocab)?;
    out.par_chunks_mut(c).zip(tokens.par_iter()).for_each(|(out, &token)| {
        out.copy_from_slice(&wte[token as usize * c..][..c]);
    });
    Ok(())
}

/// Adds the embedding's gradient: `dwte[tokens[row]] += dout[row]`, rows in order.
pub fn embedding_backward<F: Float>(dwte: &mut [F], dout: &[F], tokens: &[u32], c: usize) {
    for (dout, &token) in dout.chunks(c).zip(tokens) {
        let dword = &mut dwte[token as usize * c..][..c];
        dword.iter_mut().zip(dout).for_each(|(g, &d)| *g += d);
    }
}
