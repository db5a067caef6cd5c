//! Token + position embedding.

use rayon::prelude::*;

use crate::float::Float;

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]` for sequences of length `t`.
pub fn encoder_forward<F: Float>(
    out: &mut [F],
    tokens: &[u32],
    wte: &[F],
    wpe: &[F],
    t: usize,
    c: usize,
    vocab: usize,
) -> Result<(), String> {
    encoder_forward_at(out, tokens, wte, wpe, c, vocab, |row| row % t)
}

/// `out[row, :] = wte[tokens[row], :] + wpe[position(row), :]`: [`encoder_forward`] with each
/// row's position given (the rows of a key/value-cached step, or of packed rows: each token's
/// position in its document).
pub fn encoder_forward_at<F: Float>(
    out: &mut [F],
    tokens: &[u32],
    wte: &[F],
    wpe: &[F],
    c: usize,
    vocab: usize,
    position: impl Fn(usize) -> usize + Sync,
) -> Result<(), String> {
    check_tokens(tokens, vocab)?;
    out.par_chunks_mut(c).zip(tokens.par_iter()).enumerate().for_each(|(row, (out, &token))| {
        let word = &wte[token as usize * c..][..c];
        let position = &wpe[position(row) * c..][..c];
        for ((o, &w), &p) in out.iter_mut().zip(word).zip(position) {
            *o = w + p;
        }
    });
    Ok(())
}

/// Adds the encoder's gradients: `dwte[token] += dout`, `dwpe[t] += dout`.
pub fn encoder_backward<F: Float>(
    dwte: &mut [F],
    dwpe: &mut [F],
    dout: &[F],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    encoder_backward_at(dwte, dwpe, dout, tokens, c, |row| row % t);
}

/// [`encoder_backward`] with each row's position given (packed rows: its position in its
/// document): `dwpe[position(row)] += dout[row]`.
pub fn encoder_backward_at<F: Float>(
    dwte: &mut [F],
    dwpe: &mut [F],
    dout: &[F],
    tokens: &[u32],
    c: usize,
    position: impl Fn(usize) -> usize,
) {
    for (row, (dout, &token)) in dout.chunks(c).zip(tokens).enumerate() {
        let dword = &mut dwte[token as usize * c..][..c];
        dword.iter_mut().zip(dout).for_each(|(g, &d)| *g += d);
        let dposition = &mut dwpe[position(row) * c..][..c];
        dposition.iter_mut().zip(dout).for_each(|(g, &d)| *g += d);
    }
}

/// Every token id must index a real (not padded) row of the embedding.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<(), String> {
    match tokens.iter().position(|&token| token as usize >= vocab) {
        Some(i) => Err(format!(
            "token id {} at position {i} is not below the vocabulary size {vocab}",
            tokens[i]
        )),
        None => Ok(()),
    }
}
