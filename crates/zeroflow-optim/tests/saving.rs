//! The saving step (`CpuAdam::step_range_saving`): the step's bits are the plain step's, and
//! what it saves is the state from before it, whatever the level, the stores, the moments'
//! type, the threads, the runs without weight decay and the blocks the threads save in.

use zeroflow_optim::{
    AdamState, AdamWStep, CpuAdam, MomentElem, NoDecay, OptimError, Output, Saved, SimdLevel,
    Stores, WeightDecayMode, bf16,
};

use crate::support::{GradType, State, StepGrads, rng, test_config};

/// Long enough for several tasks on 3 threads and several of each task's save blocks (8192
/// elements), with a tail off every SIMD width.
const LEN: usize = 4 * 65536 + 3 * 8192 + 77;

/// Weights and moments of type `M`, owned by a test.
#[derive(Clone, Debug, PartialEq)]
struct Owned<M> {
    params: Vec<f32>,
    exp_avg: Vec<M>,
    exp_avg_sq: Vec<M>,
}

impl<M: MomentElem> Owned<M> {
    fn view(&mut self) -> AdamState<'_, M> {
        AdamState {
            params: &mut self.params,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
        }
    }

    /// The state of elements `range`, as f32 bit patterns (a bf16 moment widened).
    fn bits(&self, range: std::ops::Range<usize>) -> Vec<[u32; 3]> {
        range
            .map(|i| {
                let (m, v) = (self.exp_avg[i].to_f32(), self.exp_avg_sq[i].to_f32());
                [self.params[i].to_bits(), m.to_bits(), v.to_bits()]
            })
            .collect()
    }
}

/// Steps elements `range` of `start` once with `step_range` and once with `step_range_saving`
/// and checks the two agree bit for bit (state and bf16 copy) and that the saved state is
/// `start`'s.
fn check<M: MomentElem>(adam: &CpuAdam, start: &Owned<M>, what: &str) {
    let mut rng = rng(3);
    let range = 1001..LEN - 5;
    let grads = StepGrads::random(&mut rng, LEN, GradType::Bf16);
    let step = AdamWStep::new(&test_config(WeightDecayMode::Decoupled, true), 4, 0.5).unwrap();

    let mut plain = start.clone();
    let mut plain_copy = vec![bf16::ZERO; range.len()];
    let out = Output::AlsoBf16(&mut plain_copy);
    let g = grads.range(range.clone());
    adam.step_range(&step, plain.view(), range.clone(), g, out).unwrap();

    let mut saving = start.clone();
    let mut copy = vec![bf16::ZERO; range.len()];
    let [mut params, mut exp_avg, mut exp_avg_sq] = [0, 1, 2].map(|_| vec![f32::NAN; range.len()]);
    let saved = Saved { params: &mut params, exp_avg: &mut exp_avg, exp_avg_sq: &mut exp_avg_sq };
    let out = Output::AlsoBf16(&mut copy);
    let g = grads.range(range.clone());
    adam.step_range_saving(&step, saving.view(), range.clone(), g, out, Some(saved)).unwrap();

    assert!(
        saving.bits(0..LEN) == plain.bits(0..LEN),
        "{what}: the saving step's state differs from the plain step's"
    );
    assert!(copy == plain_copy, "{what}: the saving step's bf16 copy differs");
    let saved: Vec<[u32; 3]> = (0..range.len())
        .map(|i| [params[i].to_bits(), exp_avg[i].to_bits(), exp_avg_sq[i].to_bits()])
        .collect();
    assert!(saved == start.bits(range.clone()), "{what}: the saved state is not the state before");
    assert!(saving.bits(range) != start.bits(1001..LEN - 5), "{what}: the step changed nothing");
}

#[test]
fn the_saving_step_is_the_step_and_saves_the_state_before_it() {
    let no_decay = NoDecay::new(vec![0..3, 5000..9000, 70_000..70_001, 200_000..LEN]);
    let f32_start = {
        let State { params, exp_avg, exp_avg_sq } = State::random(&mut rng(7), LEN);
        Owned { params, exp_avg, exp_avg_sq }
    };
    let widen = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let bf16_start = Owned {
        params: f32_start.params.clone(),
        exp_avg: widen(&f32_start.exp_avg),
        exp_avg_sq: widen(&f32_start.exp_avg_sq),
    };
    for level in SimdLevel::available() {
        for stores in Stores::ALL {
            for threads in [1, 3] {
                let adam = CpuAdam::new(threads, level)
                    .unwrap()
                    .with_copy_stores(stores)
                    .with_no_decay(no_decay.clone());
                let what = format!("{level}, {stores:?} stores, {threads} threads");
                check(&adam, &f32_start, &format!("{what}, f32 moments"));
                check(&adam, &bf16_start, &format!("{what}, bf16 moments"));
            }
        }
    }
}

#[test]
fn a_saved_buffer_of_another_length_is_refused() {
    let adam = CpuAdam::new(1, SimdLevel::Scalar).unwrap();
    let State { mut params, mut exp_avg, mut exp_avg_sq } = State::random(&mut rng(1), 100);
    let state =
        AdamState { params: &mut params, exp_avg: &mut exp_avg, exp_avg_sq: &mut exp_avg_sq };
    let step = AdamWStep::new(&test_config(WeightDecayMode::Decoupled, true), 1, 1.0).unwrap();
    let grads = vec![bf16::ONE; 10];
    let [mut a, mut b, mut c] = [vec![0.0; 10], vec![0.0; 9], vec![0.0; 10]];
    let saved = Saved { params: &mut a, exp_avg: &mut b, exp_avg_sq: &mut c };
    let grads = zeroflow_optim::Grads::Bf16(&grads);
    let result =
        adam.step_range_saving(&step, state, 20..30, grads, Output::MasterOnly, Some(saved));
    assert!(
        matches!(
            result,
            Err(OptimError::LengthMismatch { what: "saved exp_avg", actual: 9, expected: 10 })
        ),
        "{result:?}"
    );
}
