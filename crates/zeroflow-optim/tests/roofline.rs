//! The roofline pass does the traffic it claims: every weight, moment and copy is written.

use zeroflow_optim::roofline::{self, RooflineVariant, bytes_per_param};
use zeroflow_optim::{AdamState, CpuAdam, Grads, Output, SimdLevel, bf16};

/// With every combination of ordinary and streaming stores, for buffers at every alignment of their start (so that
/// the streaming path's head, body and tail all run, and its fallback for unequally aligned
/// buffers too), one pass adds `c g` to the weights and both moments and writes the new weights'
/// upper halves to the copy, for f32 and bf16 gradients.
#[test]
fn a_roofline_pass_updates_every_element_with_either_kind_of_store() {
    let adam = CpuAdam::new(3, SimdLevel::detect()).unwrap();
    let len = 200_003;
    for stores in RooflineVariant::candidates(true) {
        for (offset_p, offset_m, offset_c) in [(0, 0, 0), (3, 3, 5), (1, 2, 0), (7, 7, 7)] {
            let mut p = vec![1.0f32; len + 16];
            let mut m = vec![2.0f32; len + 16];
            let mut v = vec![3.0f32; len + 16];
            let mut copy = vec![bf16::ZERO; len + 16];
            let grads: Vec<f32> = (0..len).map(|i| (i % 5) as f32).collect();
            let grads_bf16: Vec<bf16> = grads.iter().map(|&g| bf16::from_f32(g)).collect();
            for grads in [Grads::F32(&grads), Grads::Bf16(&grads_bf16)] {
                p.fill(1.0);
                let state = AdamState {
                    params: &mut p[offset_p..offset_p + len],
                    exp_avg: &mut m[offset_m..offset_m + len],
                    exp_avg_sq: &mut v[offset_m..offset_m + len],
                };
                let out = Output::AlsoBf16(&mut copy[offset_c..offset_c + len]);
                roofline::pass(&adam, state, grads, out, 0.5, stores).unwrap();
                for i in 0..len {
                    let expected = 1.0 + 0.5 * (i % 5) as f32;
                    let p_i = p[offset_p + i];
                    assert_eq!(p_i, expected, "{stores:?} weight {i}");
                    assert_eq!(copy[offset_c + i].to_bits(), (p_i.to_bits() >> 16) as u16);
                }
            }
            let twice = |i: usize, base: f32| base + 2.0 * 0.5 * (i % 5) as f32;
            assert!((0..len).all(|i| m[offset_m + i] == twice(i, 2.0)), "{stores:?} exp_avg");
            assert!((0..len).all(|i| v[offset_m + i] == twice(i, 3.0)), "{stores:?} exp_avg_sq");
        }
    }
}

/// The byte counts per parameter with f32 moments: 28 with f32 gradients, 26 with bf16, 2 more
/// with the copy.
#[test]
fn bytes_per_param_counts_every_stream() {
    assert_eq!(bytes_per_param(4, 4, false), 28);
    assert_eq!(bytes_per_param(2, 4, false), 26);
    assert_eq!(bytes_per_param(4, 4, true), 30);
}
