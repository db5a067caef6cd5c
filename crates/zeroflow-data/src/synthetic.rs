//! The built-in synthetic corpus: a sparse Markov chain of order `order` over `vocab` symbols with
//! `k = successors.len()` successors per context, taken with the fixed probabilities `successors`.
//!
//! The chain is built so that a small transformer can learn it step by step: the last symbol `b`
//! fixes the *set* of `k` possible next symbols `S_b` (a bigram model learns it), and the older
//! symbols fix *which* of them gets which probability: every symbol `a` has a random class
//! `r(a) < k`, and the `j`-th probability goes to `S_b[(j + Σ r(older)) mod k]` (attention to the
//! previous tokens learns it). Because every context has the same probabilities, the entropy rate
//! is exactly their entropy, whatever the stationary distribution. The loss a model can reach on
//! windows of `seq` tokens is a little higher, because the first `order - 1` positions of a window
//! see less than a full context ([`loss_floor`], computed from the stationary distribution).
//!
//! [`loss_floor`]: SyntheticCorpus::loss_floor

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded sparse Markov chain with a known entropy rate.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticCorpus {
    pub vocab: usize,
    pub order: usize,
    /// Probabilities of a context's successors, in the order they were drawn; sum to 1.
    pub successors: Vec<f64>,
    /// Seed of the chain (which symbols follow which context).
    pub seed: u64,
    /// `table[context * k + j]`: the `j`-th successor of `context` (its symbols as a base-`vocab`
    /// number, oldest first).
    table: Vec<u32>,
}

impl Default for SyntheticCorpus {
    /// The corpus of `zeroflow train` on the CPU: order 2 over 64 symbols, 4 successors with
    /// probabilities 0.6, 0.2, 0.1, 0.1: entropy rate 1.0889 nats/token; a bigram model cannot get
    /// below ln 4 = 1.386.
    fn default() -> Self {
        SyntheticCorpus::new(64, 2, vec![0.6, 0.2, 0.1, 0.1], 1234)
    }
}

impl SyntheticCorpus {
    /// # Panics
    /// If the shape is unusable: `vocab` below the number of successors, `order` 0, more than
    /// 2^24 contexts, or probabilities that are not positive and summing to 1.
    pub fn new(vocab: usize, order: usize, successors: Vec<f64>, seed: u64) -> Self {
        let k = successors.len();
        assert!(k >= 1 && vocab >= k && order >= 1, "bad synthetic corpus shape");
        assert!(successors.iter().all(|&p| p > 0.0), "successor probabilities must be positive");
        assert!((successors.iter().sum::<f64>() - 1.0).abs() < 1e-9, "probabilities must sum to 1");
        let contexts = vocab.checked_pow(order as u32).filter(|&n| n <= 1 << 24);
        let contexts = contexts.expect("at most 2^24 contexts");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // The successor set of every last symbol: k distinct symbols (a partial Fisher–Yates
        // shuffle of the vocabulary).
        let sets: Vec<Vec<u32>> = (0..vocab)
            .map(|_| {
                let mut symbols: Vec<u32> = (0..vocab as u32).collect();
                for j in 0..k {
                    let pick = rng.random_range(j..vocab);
                    symbols.swap(j, pick);
                }
                symbols.truncate(k);
                symbols
            })
            .collect();
        let class: Vec<usize> = (0..vocab).map(|_| rng.random_range(0..k)).collect();
        let mut table = Vec::with_capacity(contexts * k);
        for context in 0..contexts {
            let last = context % vocab;
            let mut older = context / vocab;
            let mut rotation = 0;
            for _ in 1..order {
                rotation += class[older % vocab];
                older /= vocab;
            }
            table.extend((0..k).map(|j| sets[last][(j + rotation) % k]));
        }
        SyntheticCorpus { vocab, order, successors, seed, table }
    }

    fn contexts(&self) -> usize {
        self.table.len() / self.successors.len()
    }

    /// The entropy rate of the chain in nats per token: the loss of a model that knows the chain
    /// and sees a full context.
    pub fn entropy_rate(&self) -> f64 {
        self.successors.iter().map(|&p| -p * p.ln()).sum()
    }

    /// The successors of a context and their probabilities.
    pub fn next_distribution(&self, context: &[u32]) -> impl Iterator<Item = (u32, f64)> + '_ {
        let index = self.context_index(context);
        let k = self.successors.len();
        self.table[index * k..(index + 1) * k].iter().copied().zip(self.successors.iter().copied())
    }

    fn context_index(&self, context: &[u32]) -> usize {
        assert_eq!(context.len(), self.order, "a context has `order` symbols");
        context.iter().fold(0, |acc, &s| acc * self.vocab + s as usize)
    }

    /// `len` tokens of the chain from the stream `stream_seed` (training and validation use
    /// different streams), starting from a random context.
    pub fn sample(&self, stream_seed: u64, len: usize) -> Vec<u32> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ stream_seed.rotate_left(32));
        rng.set_stream(1);
        let mut tokens: Vec<u32> =
            (0..self.order.min(len)).map(|_| rng.random_range(0..self.vocab as u32)).collect();
        if len <= self.order {
            return tokens;
        }
        let k = self.successors.len();
        let mut context = self.context_index(&tokens);
        let modulus = self.vocab.pow(self.order as u32 - 1);
        while tokens.len() < len {
            let u: f64 = rng.random();
            let mut cumulative = 0.0;
            let mut j = k - 1;
            for (i, &p) in self.successors.iter().enumerate() {
                cumulative += p;
                if u < cumulative {
                    j = i;
                    break;
                }
            }
            let next = self.table[context * k + j];
            tokens.push(next);
            context = (context % modulus) * self.vocab + next as usize;
        }
        tokens
    }

    /// The chain's stationary distribution over contexts (power iteration from uniform).
    fn stationary(&self) -> Vec<f64> {
        let (n, k) = (self.contexts(), self.successors.len());
        let modulus = self.vocab.pow(self.order as u32 - 1);
        let mut pi = vec![1.0 / n as f64; n];
        let mut next = vec![0.0; n];
        for _ in 0..2000 {
            next.fill(0.0);
            for (context, &mass) in pi.iter().enumerate() {
                for (j, &p) in self.successors.iter().enumerate() {
                    let symbol = self.table[context * k + j] as usize;
                    next[(context % modulus) * self.vocab + symbol] += mass * p;
                }
            }
            let change: f64 = pi.iter().zip(&next).map(|(a, b)| (a - b).abs()).sum();
            // Average with the previous iterate, which damps the oscillation of a periodic chain.
            pi.iter_mut().zip(&next).for_each(|(a, &b)| *a = 0.5 * (*a + b));
            if change < 1e-13 {
                break;
            }
        }
        pi
    }

    /// The entropy of the next symbol given only the last `visible` symbols (`visible` ≤ order),
    /// under the stationary distribution.
    fn conditional_entropy(&self, pi: &[f64], visible: usize) -> f64 {
        if visible >= self.order {
            return self.entropy_rate();
        }
        let k = self.successors.len();
        let suffix_modulus = self.vocab.pow(visible as u32);
        let mut joint: HashMap<(usize, u32), f64> = HashMap::new();
        let mut marginal: HashMap<usize, f64> = HashMap::new();
        for (context, &mass) in pi.iter().enumerate() {
            let suffix = context % suffix_modulus;
            *marginal.entry(suffix).or_default() += mass;
            for (j, &p) in self.successors.iter().enumerate() {
                *joint.entry((suffix, self.table[context * k + j])).or_default() += mass * p;
            }
        }
        let entropy = |masses: &mut dyn Iterator<Item = f64>| -> f64 {
            masses.filter(|&m| m > 0.0).map(|m| -m * m.ln()).sum()
        };
        entropy(&mut joint.into_values()) - entropy(&mut marginal.into_values())
    }

    /// The lowest mean loss (nats/token) a model can reach on windows of `seq` predictions taken
    /// from the stationary chain: position `i` sees `i + 1` tokens, so the first `order - 1`
    /// positions see a partial context.
    pub fn loss_floor(&self, seq: usize) -> f64 {
        let pi = self.stationary();
        let total: f64 = (0..seq).map(|i| self.conditional_entropy(&pi, i + 1)).sum();
        total / seq as f64
    }
}
