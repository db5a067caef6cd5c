//! Results do not depend on how the work is cut: thread counts, chunking, ranges, tails.

use zeroflow_optim::{
    AdamState, AdamWStep, CHUNK_ALIGN, CpuAdam, Grads, Output, SimdLevel, Stores, WeightDecayMode,
    bf16,
};

use crate::support::{GradType, State, StepGrads, rng, test_config};

/// Long enough that 7 threads all get a chunk of at least the executor's minimum size (65536).
const LONG: usize = 8 * 65536 + 13;
/// Odd lengths around the SIMD widths and chunk alignment, and one that spans many chunks.
const LENGTHS: [usize; 8] = [1, 7, 15, 17, 63, 65, 1001, LONG];

/// Bit patterns of the state and of the bf16 copy after two steps of `adam`.
fn two_steps(adam: &CpuAdam, len: usize, grads: GradType, seed: u64) -> (Vec<[u32; 3]>, Vec<u16>) {
    let mut rng = rng(seed);
    let mut state = State::random(&mut rng, len);
    let mut copy = vec![bf16::ZERO; len];
    let config = test_config(WeightDecayMode::Decoupled, true);
    for t in 1..=2 {
        let step_grads = StepGrads::random(&mut rng, len, grads);
        let step = AdamWStep::new(&config, t, 0.5).expect("valid");
        let out = Output::AlsoBf16(&mut copy);
        adam.step(&step, state.view(), step_grads.as_grads(), out).expect("lengths match");
    }
    (state.bits(), copy.iter().map(|c| c.to_bits()).collect())
}

/// For every SIMD level, 1, 2, 3 and 7 threads (with 1, 4 or 8 chunks per thread, ordinary or
/// streaming stores for the bf16 copy) give bit-identical weights, moments and bf16 copies, for
/// odd lengths and f32 and bf16 gradients.
#[test]
fn results_are_bit_identical_for_1_2_3_and_7_threads() {
    let configurations = [
        (2, 1, Stores::Normal),
        (3, 4, Stores::NonTemporal),
        (7, 8, Stores::NonTemporal),
        (7, 1, Stores::Normal),
    ];
    for level in SimdLevel::available() {
        let single = CpuAdam::new(1, level).expect("available");
        let executors: Vec<CpuAdam> = configurations
            .into_iter()
            .map(|(threads, tasks, copy_stores)| {
                CpuAdam::new(threads, level)
                    .expect("available")
                    .with_tasks_per_thread(tasks)
                    .with_copy_stores(copy_stores)
            })
            .collect();
        for len in LENGTHS {
            for grads in [GradType::F32, GradType::Bf16] {
                let expected = two_steps(&single, len, grads, len as u64);
                for adam in &executors {
                    let actual = two_steps(adam, len, grads, len as u64);
                    assert!(
                        actual == expected,
                        "{level}, {} threads × {} chunks, {len} elements, {grads:?} gradients: \
                         results differ from one thread",
                        adam.threads(),
                        adam.tasks_per_thread()
                    );
                }
            }
        }
    }
}

/// Stepping a partition bucket by bucket with `step_range` (uneven buckets, boundaries not on
/// SIMD widths, range-local gradients and bf16 buffers written with ordinary or streaming
/// stores) gives exactly the bits of one whole step.
#[test]
fn stepping_ranges_bucket_by_bucket_equals_one_whole_step() {
    let len = 100_003;
    let bounds = [0, 1, 5000, 5003, 40_000, 99_990, len];
    let levels = SimdLevel::available();
    for (level, copy_stores) in levels.flat_map(|l| Stores::ALL.map(|s| (l, s))) {
        let adam = CpuAdam::new(3, level).expect("available").with_copy_stores(copy_stores);
        let mut rng = rng(11);
        let start = State::random(&mut rng, len);
        let grads = StepGrads::random(&mut rng, len, GradType::Bf16);
        let step = AdamWStep::new(&test_config(WeightDecayMode::L2, true), 9, 0.25).expect("valid");

        let mut whole = start.clone();
        let mut whole_copy = vec![bf16::ZERO; len];
        let out = Output::AlsoBf16(&mut whole_copy);
        adam.step(&step, whole.view(), grads.as_grads(), out).expect("lengths match");

        let mut bucketed = start.clone();
        let mut bucketed_copy = vec![bf16::ZERO; len];
        for range in bounds.windows(2).map(|w| w[0]..w[1]) {
            // Range-local staging and upload buffers, as the engine has them.
            let staged: Vec<bf16> = grads.bf16[range.clone()].to_vec();
            let mut upload = vec![bf16::ZERO; range.len()];
            let out = Output::AlsoBf16(&mut upload);
            adam.step_range(&step, bucketed.view(), range.clone(), Grads::Bf16(&staged), out)
                .expect("lengths match");
            bucketed_copy[range].copy_from_slice(&upload);
        }
        assert!(bucketed.bits() == whole.bits(), "{level} {copy_stores:?}: state differs");
        assert!(bucketed_copy == whole_copy, "{level} {copy_stores:?}: bf16 copy differs");
    }
}

/// The AVX2 and AVX-512 kernels perform the same fused operations per element, so they give the
/// same bits (where the CPU has both).
#[test]
fn avx2_and_avx512_give_the_same_bits() {
    if !SimdLevel::Avx512.is_available() {
        eprintln!("skipped: this CPU has no AVX-512F");
        return;
    }
    for len in [17, 100_003] {
        for grads in [GradType::F32, GradType::Bf16] {
            let avx2 = two_steps(&CpuAdam::new(2, SimdLevel::Avx2).unwrap(), len, grads, 3);
            let avx512 = two_steps(&CpuAdam::new(2, SimdLevel::Avx512).unwrap(), len, grads, 3);
            assert!(avx2 == avx512, "{len} elements, {grads:?} gradients");
        }
    }
}

/// Chunks handed to threads start on multiples of `CHUNK_ALIGN` (counted from the partition's
/// start) and cover the data exactly once.
#[test]
fn chunks_start_on_aligned_offsets_and_cover_everything_once() {
    let adam = CpuAdam::new(3, SimdLevel::Scalar).unwrap().with_tasks_per_thread(4);
    let len = 12 * 65536 + 5; // enough for 12 chunks of the minimum size
    let mut data = vec![0u32; len];
    let starts = std::sync::Mutex::new(Vec::new());
    adam.for_each_chunk_mut(&mut data, |offset, chunk| {
        starts.lock().unwrap().push(offset);
        chunk.iter_mut().for_each(|x| *x += 1);
    });
    let mut starts = starts.into_inner().unwrap();
    starts.sort();
    assert_eq!(starts.len(), 12, "3 threads × 4 chunks per thread");
    assert!(starts.iter().all(|s| s % CHUNK_ALIGN == 0), "chunk starts {starts:?}");
    assert!(data.iter().all(|&x| x == 1), "every element visited exactly once");
}

/// An empty partition is a valid no-op.
#[test]
fn an_empty_partition_steps_without_error() {
    let adam = CpuAdam::new(2, SimdLevel::detect()).unwrap();
    let step = AdamWStep::new(&test_config(WeightDecayMode::Decoupled, true), 1, 1.0).unwrap();
    let state: AdamState<'_> = AdamState { params: &mut [], exp_avg: &mut [], exp_avg_sq: &mut [] };
    adam.step(&step, state, Grads::F32(&[]), Output::MasterOnly).expect("empty is fine");
}
