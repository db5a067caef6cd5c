//! Random programs on the CPU device's four streams: with the events a correct program needs, the
//! result equals running the operations one after another, under chaos; with one needed wait left
//! out, the device either refuses the operation as a race or the wait was truly redundant and the
//! result is still right.

use std::ops::Range;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_device::cpu::{CpuBuffer, KernelArgs};
use zeroflow_device::{Chaos, CpuDevice, Device, DeviceError, HostMemory, StreamKind};

const BUFFERS: usize = 4;
const LEN: usize = 48;

#[derive(Clone, Debug)]
enum Op {
    Fill {
        buf: usize,
        range: Range<usize>,
        value: u32,
    },
    Copy {
        src: usize,
        range: Range<usize>,
        dst: usize,
        offset: usize,
    },
    /// In place: `x = 3x + 1` (wrapping), so the order of operations matters.
    Step {
        buf: usize,
        range: Range<usize>,
    },
}

impl Op {
    /// (buffer, range, writes) for each argument.
    fn touches(&self) -> Vec<(usize, Range<usize>, bool)> {
        match self {
            Op::Fill { buf, range, .. } | Op::Step { buf, range } => {
                vec![(*buf, range.clone(), true)]
            }
            Op::Copy { src, range, dst, offset } => {
                vec![(*src, range.clone(), false), (*dst, *offset..*offset + range.len(), true)]
            }
        }
    }

    fn apply(&self, model: &mut [Vec<u32>]) {
        match self {
            Op::Fill { buf, range, value } => model[*buf][range.clone()].fill(*value),
            Op::Copy { src, range, dst, offset } => {
                let data = model[*src][range.clone()].to_vec();
                model[*dst][*offset..*offset + data.len()].copy_from_slice(&data);
            }
            Op::Step { buf, range } => model[*buf][range.clone()]
                .iter_mut()
                .for_each(|x| *x = x.wrapping_mul(3).wrapping_add(1)),
        }
    }
}

fn random_range(rng: &mut ChaCha8Rng) -> Range<usize> {
    let start = rng.random_range(0..LEN);
    start..rng.random_range(start + 1..=LEN)
}

fn random_op(rng: &mut ChaCha8Rng) -> Op {
    match rng.random_range(0..3) {
        0 => Op::Fill {
            buf: rng.random_range(0..BUFFERS),
            range: random_range(rng),
            value: rng.random(),
        },
        1 => {
            let range = random_range(rng);
            let (src, mut dst) = (rng.random_range(0..BUFFERS), rng.random_range(0..BUFFERS));
            if dst == src {
                dst = (dst + 1) % BUFFERS;
            }
            Op::Copy { src, dst, offset: rng.random_range(0..=LEN - range.len()), range }
        }
        _ => Op::Step { buf: rng.random_range(0..BUFFERS), range: random_range(rng) },
    }
}

/// `pending[t][s][buffer]`: what stream `t` did to `buffer` since stream `s` last waited on it.
type Pending = Vec<Vec<Vec<Vec<(Range<usize>, bool)>>>>;

fn conflicts(a: &[(Range<usize>, bool)], b: &(usize, Range<usize>, bool)) -> bool {
    a.iter().any(|(r, w)| (*w || b.2) && r.start < b.1.end && b.1.start < r.end)
}

/// Runs `ops`, each on a random stream, waiting on an event of every other stream whose earlier
/// accesses conflict with it, except that the `skip`-th such wait is left out.
fn run(
    dev: &CpuDevice,
    ops: &[(Op, usize)],
    skip: Option<usize>,
) -> Result<Vec<Vec<u32>>, DeviceError> {
    let buffers: Vec<CpuBuffer<u32>> = (0..BUFFERS).map(|_| dev.alloc(LEN).unwrap()).collect();
    let mut pending: Pending = vec![vec![vec![Vec::new(); BUFFERS]; 4]; 4];
    let mut waits = 0;
    for (op, s) in ops {
        let stream = dev.stream(StreamKind::ALL[*s]);
        for t in (0..4).filter(|t| t != s) {
            let needed =
                op.touches().iter().any(|touch| conflicts(&pending[t][*s][touch.0], touch));
            if needed {
                let skipped = skip == Some(waits);
                waits += 1;
                if !skipped {
                    let mut event = dev.new_event()?;
                    dev.record(&mut event, dev.stream(StreamKind::ALL[t]))?;
                    dev.wait_event(stream, &event)?;
                    pending[t][*s].iter_mut().for_each(Vec::clear);
                }
            }
        }
        match op {
            Op::Fill { buf, range, value } => {
                dev.fill(stream, &buffers[*buf], range.clone(), *value)?
            }
            Op::Copy { src, range, dst, offset } => {
                dev.copy_d2d(stream, &buffers[*src], range.clone(), &buffers[*dst], *offset)?
            }
            Op::Step { buf, range } => {
                let args = KernelArgs::new().in_out(&buffers[*buf], range.clone());
                dev.launch(stream, "step", args, |ctx| {
                    for x in ctx.output::<u32>(0) {
                        *x = x.wrapping_mul(3).wrapping_add(1);
                    }
                    Ok(())
                })?
            }
        }
        for touch in op.touches() {
            for other in pending[*s].iter_mut() {
                other[touch.0].push((touch.1.clone(), touch.2));
            }
        }
    }
    let mut out = Vec::new();
    for buffer in &buffers {
        let mut host = dev.alloc_host::<u32>(LEN, HostMemory::Pinned)?;
        dev.synchronize()?;
        let filled =
            dev.copy_d2h(dev.stream(StreamKind::D2h), buffer, 0..LEN, &mut host, 0)?.wait()?;
        out.push(filled.to_vec());
    }
    Ok(out)
}

fn program(seed: u64, len: usize) -> (Vec<(Op, usize)>, Vec<Vec<u32>>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ops: Vec<(Op, usize)> =
        (0..len).map(|_| (random_op(&mut rng), rng.random_range(0..4))).collect();
    let mut model = vec![vec![0u32; LEN]; BUFFERS];
    ops.iter().for_each(|(op, _)| op.apply(&mut model));
    (ops, model)
}

fn chaos(seed: u64) -> Chaos {
    Chaos { seed, max_delay: Duration::from_micros(40), percent_delayed: 50 }
}

#[test]
fn event_ordered_random_programs_match_sequential_execution_under_chaos() {
    for seed in 0..1500 {
        let dev = CpuDevice::with_chaos(chaos(seed)).unwrap();
        let (ops, model) = program(seed, 24);
        let out = run(&dev, &ops, None).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(out, model, "seed {seed}");
    }
}

#[test]
fn leaving_out_a_needed_wait_is_refused_as_a_race_or_was_redundant() {
    let (mut refused, mut redundant) = (0, 0);
    for seed in 0..600 {
        let (ops, model) = program(seed, 24);
        let dev = CpuDevice::with_chaos(chaos(seed)).unwrap();
        match run(&dev, &ops, Some((seed % 5) as usize)) {
            Err(DeviceError::Race(_)) => refused += 1,
            Err(other) => panic!("seed {seed}: unexpected {other}"),
            Ok(out) => {
                // Admitted: another event already ordered the two operations.
                assert_eq!(out, model, "seed {seed}: a racing operation was admitted");
                redundant += 1;
            }
        }
    }
    assert!(refused > 300, "refused {refused}, redundant {redundant}");
}
