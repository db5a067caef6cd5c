//! The model on the CpuDevice (f32 kernels on the compute stream) against the pure f64 path.

use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::{CpuGpt, GptConfig, HostGpt};

use crate::support::{perturbed_params, random_batch, relative_error};

/// Width 20 (not a multiple of 8), 4 heads of 5, odd sequence length 7, vocabulary 37 padded to 64.
const TAILS: GptConfig =
    GptConfig { n_layer: 2, n_head: 4, d_model: 20, vocab_size: 37, context: 11 };

/// The device's f32 loss equals the f64 loss to 1e-6 relative, and every gradient tensor matches
/// to 1e-5 relative (norm-wise). Measured: loss 1e-8, worst gradient tensor 3e-7; the bounds leave
/// room for f32 rounding at other sizes and thread counts.
#[test]
fn device_f32_loss_and_gradients_match_the_f64_path() {
    let (batch, seq) = (3, 7);
    let (layout, params64) = perturbed_params(&TAILS, 11);
    let (inputs, targets) = random_batch(TAILS.vocab_size, batch * seq, 12);

    let mut host = HostGpt::<f64>::new(&TAILS, &layout, batch, seq).unwrap();
    let loss64 = host.forward(&params64, &inputs, &targets).unwrap();
    let mut grads64 = vec![0.0; layout.padded_len()];
    host.backward(&params64, &mut grads64, 1.0, |_, _| {}).unwrap();

    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
    let mut model = CpuGpt::new(&device, &TAILS, &layout, batch, seq).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    model.forward(&params).unwrap();
    let loss32 = model.loss().unwrap();
    model.backward(&params, &grads, 1.0, |_| {}).unwrap();
    let grads32: Vec<f64> =
        device.download(&grads).unwrap().iter().map(|&g| f64::from(g)).collect();

    let loss_error = (f64::from(loss32) - loss64).abs() / loss64;
    assert!(loss_error <= 1e-6, "loss {loss32} vs {loss64}");
    let mut worst = 0.0f64;
    for view in layout.params() {
        let error = relative_error(&grads32[view.flat_range()], &grads64[view.flat_range()]);
        assert!(error <= 1e-5, "{}: relative error {error:e}", view.name);
        worst = worst.max(error);
    }
    println!("f32 device vs f64: loss relative error {loss_error:e}, worst gradient {worst:e}");
}

/// A token id outside the vocabulary is a kernel error reported by the device, not a crash.
#[test]
fn a_token_outside_the_vocabulary_is_a_kernel_error() {
    let (layout, params64) = perturbed_params(&TAILS, 1);
    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let mut model = CpuGpt::new(&device, &TAILS, &layout, 1, 3).unwrap();
    model.set_batch(&[1, 2, 37], &[1, 2, 3]).unwrap();
    model.forward(&params).unwrap();
    let error = device.synchronize().unwrap_err().to_string();
    assert!(error.contains("encoder_forward") && error.contains("token id 37"), "{error}");
}

/// Under chaos (random delays before every operation on every stream) the device gives bit for
/// bit the result of the calm device: the model's launches are ordered on one stream and the
/// checker admits every one of them.
#[test]
fn chaos_mode_changes_nothing() {
    use zeroflow_device::Chaos;
    let (batch, seq) = (2, 7);
    let (layout, params64) = perturbed_params(&TAILS, 21);
    let (inputs, targets) = random_batch(TAILS.vocab_size, batch * seq, 22);
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let run = |device: CpuDevice| {
        let params = device.upload(&params32).unwrap();
        let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        let mut model = CpuGpt::new(&device, &TAILS, &layout, batch, seq).unwrap();
        model.set_batch(&inputs, &targets).unwrap();
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        let loss = model.loss().unwrap();
        (loss, device.download(&grads).unwrap())
    };
    let calm = run(CpuDevice::new().unwrap());
    let chaotic = run(CpuDevice::with_chaos(Chaos::new(5)).unwrap());
    assert_eq!(calm, chaotic);
}

/// Shapes that do not fit are typed errors: a sequence longer than the context, a batch of the
/// wrong length, a buffer of the wrong length, a layout without the model's parameters.
#[test]
fn misfitting_shapes_are_typed_errors() {
    use zeroflow_core::layout::{Alignment, FlatLayout, ParamSpec};
    use zeroflow_gpt::GptError;
    let (layout, _) = perturbed_params(&TAILS, 1);
    let device = CpuDevice::new().unwrap();
    let too_long = CpuGpt::new(&device, &TAILS, &layout, 1, TAILS.context + 1).unwrap_err();
    assert!(matches!(too_long, GptError::Batch(_)), "{too_long}");
    let mut model = CpuGpt::new(&device, &TAILS, &layout, 2, 3).unwrap();
    let short = model.set_batch(&[1, 2, 3], &[1, 2, 3]).unwrap_err();
    assert!(matches!(short, GptError::Length { what: "inputs", expected: 6, found: 3 }), "{short}");
    let small = device.alloc::<f32>(10).unwrap();
    assert!(matches!(model.forward(&small), Err(GptError::Length { .. })));
    let other = FlatLayout::new(&[ParamSpec::new("w", [3])], 1, Alignment::default()).unwrap();
    let missing = CpuGpt::new(&device, &TAILS, &other, 1, 3).unwrap_err();
    assert!(missing.to_string().contains("transformer.wte.weight"), "{missing}");
}

/// The kernels split work into fixed blocks, so the result does not depend on the number of
/// threads: one thread and three give the same bits (at sizes with several blocks per kernel:
/// 132 rows, 76 and 304 columns).
#[test]
fn results_do_not_depend_on_the_thread_count() {
    const WIDE: GptConfig =
        GptConfig { n_layer: 1, n_head: 4, d_model: 76, vocab_size: 37, context: 11 };
    let (batch, seq) = (12, 11);
    let (layout, params64) = perturbed_params(&WIDE, 31);
    let (inputs, targets) = random_batch(WIDE.vocab_size, batch * seq, 32);
    let params: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut model = HostGpt::<f32>::new(&WIDE, &layout, batch, seq).unwrap();
            let loss = model.forward(&params, &inputs, &targets).unwrap();
            let mut grads = vec![0.0f32; layout.padded_len()];
            model.backward(&params, &mut grads, 1.0, |_, _| {}).unwrap();
            (loss, grads)
        })
    };
    assert_eq!(run(1), run(3));
}
