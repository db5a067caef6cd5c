//! Under chaos (random delays before every device operation) the engine's results are bit-identical
//! to the chaos-free run: every hand-off between streams is ordered by an event.

use zeroflow_engine::{LossScaler, Stage};

use crate::harness::{Setup, train};

#[test]
fn chaos_runs_are_bit_identical_to_the_calm_run() {
    let setups = [
        Setup { steps: 40, ..Setup::new(Stage::Zero2, 2, 4, true) },
        Setup { steps: 40, ..Setup::new(Stage::Zero2, 4, 1, false) },
        Setup { steps: 40, ..Setup::new(Stage::Zero1, 2, 2, true) },
        Setup { steps: 40, ..Setup::new(Stage::Zero0, 2, 2, false) },
        Setup { steps: 40, ..Setup::new(Stage::Zero1, 1, 4, true) },
    ];
    let mut steps = 0;
    for setup in &setups {
        let calm = train::<f32>(setup, LossScaler::None, None);
        for seed in 1..=5 {
            let chaotic =
                train::<f32>(&Setup { chaos: Some(seed), ..setup.clone() }, LossScaler::None, None);
            assert_eq!(chaotic.weights, calm.weights, "{setup:?} chaos seed {seed}");
            steps += setup.steps;
        }
    }
    assert!(steps >= 1000);
}
