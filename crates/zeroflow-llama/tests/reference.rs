//! The model's logits against a reference written out the slow way from `transformers`'
//! `modeling_llama.py` (and Qwen2's biases, Qwen3's q/k norm), one token and one head at a time,
//! from the parameters under their Hugging Face names.

use zeroflow_core::layout::FlatLayout;
use zeroflow_llama::{AttentionKind, HostLlama, LlamaConfig};

use crate::support::{models, perturbed_params, random_batch};

/// `W x (+ b)` for an `nn.Linear` weight `[out, in]`.
fn linear(weight: &[f64], bias: Option<&[f64]>, x: &[f64]) -> Vec<f64> {
    let out: Vec<f64> =
        weight.chunks(x.len()).map(|row| row.iter().zip(x).map(|(w, v)| w * v).sum()).collect();
    match bias {
        Some(bias) => out.iter().zip(bias).map(|(o, b)| o + b).collect(),
        None => out,
    }
}

/// `LlamaRMSNorm`: `weight · x / sqrt(mean(x²) + eps)`.
fn rmsnorm(x: &[f64], weight: &[f64], eps: f64) -> Vec<f64> {
    let variance = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    x.iter().zip(weight).map(|(v, w)| w * (v / (variance + eps).sqrt())).collect()
}

/// `_compute_default_rope_parameters`, then `_compute_llama3_parameters` where configured.
fn inv_freq(config: &LlamaConfig) -> Vec<f64> {
    let d = config.head_dim;
    let base: Vec<f64> =
        (0..d / 2).map(|i| 1.0 / config.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
    let Some(s) = &config.rope_scaling else { return base };
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let llama = if wavelen > low_wavelen { f / s.factor } else { f };
            let smooth =
                (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium { (1.0 - smooth) * llama / s.factor + smooth * llama } else { llama }
        })
        .collect()
}

/// `q·cos + rotate_half(q)·sin` on one head at position `p`.
fn rope(x: &[f64], p: usize, inv_freq: &[f64]) -> Vec<f64> {
    let half = x.len() / 2;
    (0..x.len())
        .map(|i| {
            let angle = p as f64 * inv_freq[i % half];
            let rotated = if i < half { -x[i + half] } else { x[i - half] };
            x[i] * angle.cos() + rotated * angle.sin()
        })
        .collect()
}

/// The logits `[seq, vocab]` of one sequence.
fn reference_logits(
    config: &LlamaConfig,
    layout: &FlatLayout,
    params: &[f64],
    tokens: &[u32],
) -> Vec<f64> {
    let tensor = |name: &str| layout.param(name).map(|view| &params[view.flat_range()]);
    let get = |name: &str| tensor(name).unwrap_or_else(|| panic!("{name}"));
    let (d, hd, eps) = (config.hidden_size, config.head_dim, config.rms_norm_eps);
    let (nh, nkv) = (config.num_attention_heads, config.num_key_value_heads);
    let freqs = inv_freq(config);
    let embed = get("model.embed_tokens.weight");
    let mut h: Vec<Vec<f64>> =
        tokens.iter().map(|&t| embed[t as usize * d..][..d].to_vec()).collect();
    for layer in 0..config.num_hidden_layers {
        let name = |s: &str| format!("model.layers.{layer}.{s}");
        let proj = |m: &str, x: &[f64]| {
            linear(get(&name(&format!("{m}.weight"))), tensor(&name(&format!("{m}.bias"))), x)
        };
        let heads = |v: Vec<f64>, norm: &str, p: usize| -> Vec<Vec<f64>> {
            v.chunks(hd)
                .map(|head| match tensor(&name(norm)) {
                    Some(w) => rope(&rmsnorm(head, w, eps), p, &freqs),
                    None => rope(head, p, &freqs),
                })
                .collect()
        };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (p, x) in h.iter().enumerate() {
            let x = rmsnorm(x, get(&name("input_layernorm.weight")), eps);
            qs.push(heads(proj("self_attn.q_proj", &x), "self_attn.q_norm.weight", p));
            ks.push(heads(proj("self_attn.k_proj", &x), "self_attn.k_norm.weight", p));
            vs.push(
                proj("self_attn.v_proj", &x).chunks(hd).map(<[f64]>::to_vec).collect::<Vec<_>>(),
            );
        }
        for (t1, residual) in h.iter_mut().enumerate() {
            let mut attn = vec![0.0; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let scores: Vec<f64> = (0..=t1)
                    .map(|t2| {
                        let dot: f64 =
                            qs[t1][head].iter().zip(&ks[t2][g]).map(|(a, b)| a * b).sum();
                        dot / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (t2, s) in scores.iter().enumerate() {
                    for i in 0..hd {
                        attn[head * hd + i] += (s - max).exp() / sum * vs[t2][g][i];
                    }
                }
            }
            let out = proj("self_attn.o_proj", &attn);
            residual.iter_mut().zip(&out).for_each(|(r, o)| *r += o);
            let y = rmsnorm(residual, get(&name("post_attention_layernorm.weight")), eps);
            let (gate, up) = (proj("mlp.gate_proj", &y), proj("mlp.up_proj", &y));
            let act: Vec<f64> =
                gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = proj("mlp.down_proj", &act);
            residual.iter_mut().zip(&down).for_each(|(r, o)| *r += o);
        }
    }
    let head = tensor("lm_head.weight").unwrap_or(embed);
    h.iter().flat_map(|x| linear(head, None, &rmsnorm(x, get("model.norm.weight"), eps))).collect()
}

/// For every tiny model (two sequences of 6 tokens, both attention forms), the plan's logits
/// equal the slow reference's to 1e-10.
#[test]
fn logits_match_the_reference_written_from_transformers() {
    let (batch, seq) = (2, 6);
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, params) = perturbed_params(&config, 90 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 100 + seed as u64);
        let expected: Vec<f64> = inputs
            .chunks(seq)
            .flat_map(|tokens| reference_logits(&config, &layout, &params, tokens))
            .collect();
        for attention in [AttentionKind::Gemm, AttentionKind::Flash] {
            let mut model = HostLlama::<f64>::new(&config, &layout, batch, seq, attention).unwrap();
            model.forward(&params, &inputs, &targets).unwrap();
            let error = model
                .logits()
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(error < 1e-10, "{what} {attention:?}: max |logit difference| {error:e}");
        }
    }
}
