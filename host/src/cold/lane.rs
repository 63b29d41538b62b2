//! The CPU lane: routed-expert FFNs computed on the CPU from host-cache bytes
//! while the GPU serves the rest of the step.
//!
//! It calls exactly what the CPU backend's MoE op calls (activation row
//! quantized by `Activations`, `Kernels::dot_rows` over row chunks,
//! `ops::glu_rows`), so an expert gives the same bits on either. Each output
//! value is exactly its row's `Kernels::dot`, computed on one thread, so
//! tiling and thread count never change the result.

use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::{self, Activation};
use pulsar_kernels::quant::row_bytes;
use pulsar_kernels::{ActFormat, ActRow, Activations, Kernels, QuantError};
use std::sync::Mutex;

use super::spin::SpinPool;

/// Fewest weight bytes one task walks: below this, scheduling costs more than it spreads.
const MIN_TASK_BYTES: usize = 32 * 1024;
/// Tasks per thread, so uneven rows still balance.
const TASKS_PER_THREAD: usize = 4;

/// One weight slab: raw GGUF bytes, rows laid end to end.
#[derive(Clone, Copy, Debug)]
pub struct Slab<'a> {
    pub ty: GgmlType,
    pub bytes: &'a [u8],
}

/// The gate and up projections of an expert, `[ff, d_model]` each.
#[derive(Clone, Copy, Debug)]
pub enum GateUp<'a> {
    Split { gate: Slab<'a>, up: Slab<'a> },
    /// One `[2 * ff, d_model]` slab: the first `ff` rows are gate.
    Fused(Slab<'a>),
}

/// One (token row, expert) of a job.
#[derive(Clone, Copy, Debug)]
pub struct LanePair<'a> {
    /// For error messages only.
    pub expert: u32,
    /// The token's input row, `d_model` values.
    pub x: &'a [f32],
    pub gate_up: GateUp<'a>,
    /// `[d_model, ff]`.
    pub down: Slab<'a>,
}

/// Work for one call of [`CpuLane::run`]: every pair shares the FFN shape.
#[derive(Clone, Debug)]
pub struct LaneJob<'a> {
    pub d_model: usize,
    pub ff: usize,
    pub act: Activation,
    pub pairs: Vec<LanePair<'a>>,
}

impl LaneJob<'_> {
    /// Weight bytes the job reads (each pair's slabs once).
    pub fn weight_bytes(&self) -> u64 {
        self.pairs
            .iter()
            .map(|p| {
                let gu = match p.gate_up {
                    GateUp::Split { gate, up } => gate.bytes.len() + up.bytes.len(),
                    GateUp::Fused(s) => s.bytes.len(),
                };
                (gu + p.down.bytes.len()) as u64
            })
            .sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    #[error("cpu lane: cannot start {threads} threads: {source}")]
    Pool {
        threads: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("cpu lane: {0}")]
    Job(#[from] super::spin::PoolError),
    #[error("cpu lane pair {pair} (expert {expert}): {rows} head rows of an ff of {ff}")]
    HeadRows { pair: usize, expert: u32, rows: usize, ff: usize },
    #[error("cpu lane job: d_model {d_model} and ff {ff} must both be non-zero")]
    EmptyShape { d_model: usize, ff: usize },
    #[error("cpu lane pair {pair} (expert {expert}): x has {got} values, d_model is {d_model}")]
    InputWidth { pair: usize, expert: u32, got: usize, d_model: usize },
    #[error("cpu lane pair {pair} (expert {expert}): {slab} slab type {ty} has no CPU dot")]
    Unsupported { pair: usize, expert: u32, slab: &'static str, ty: GgmlType },
    #[error("cpu lane pair {pair} (expert {expert}): {slab} slab type {ty}: rows of {cols} values are not whole {block}-value blocks")]
    NotWholeBlocks { pair: usize, expert: u32, slab: &'static str, ty: GgmlType, cols: usize, block: u64 },
    #[error("cpu lane pair {pair} (expert {expert}): {slab} slab is {got} bytes, but {ty} [{rows} x {cols}] is {expected}")]
    SlabSize {
        pair: usize,
        expert: u32,
        slab: &'static str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        expected: u128,
        got: usize,
    },
    #[error("cpu lane pair {pair} (expert {expert}): {slab}: {source}")]
    Kernel {
        pair: usize,
        expert: u32,
        slab: &'static str,
        #[source]
        source: QuantError,
    },
}

/// A checked view of `rows` rows of a slab, starting at row `first`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    ty: GgmlType,
    bytes: &'a [u8],
    first: usize,
    row_bytes: usize,
}

impl<'a> Rows<'a> {
    /// Rows `r..r + n`, end to end.
    fn rows(&self, r: usize, n: usize) -> &'a [u8] {
        let at = (self.first + r) * self.row_bytes;
        &self.bytes[at..at + n * self.row_bytes]
    }
}

/// One pair after validation.
struct Checked<'a> {
    gate: Rows<'a>,
    up: Rows<'a>,
    down: Rows<'a>,
}

struct Ctx {
    pair: usize,
    expert: u32,
}

impl Ctx {
    fn kernel(&self, slab: &'static str) -> impl Fn(QuantError) -> LaneError + '_ {
        move |source| LaneError::Kernel { pair: self.pair, expert: self.expert, slab, source }
    }

    /// `slab` as `rows` (whole slab `total_rows`) rows of `cols` values of its type.
    fn rows<'a>(&self, name: &'static str, s: Slab<'a>, total_rows: usize, cols: usize) -> Result<Rows<'a>, LaneError> {
        let (pair, expert, ty) = (self.pair, self.expert, s.ty);
        if ActFormat::for_weight(ty).is_none() {
            return Err(LaneError::Unsupported { pair, expert, slab: name, ty });
        }
        let rb = row_bytes(ty, cols).map_err(|_| LaneError::NotWholeBlocks {
            pair,
            expert,
            slab: name,
            ty,
            cols,
            block: ty.block_elems(),
        })?;
        let expected = total_rows as u128 * rb as u128;
        if s.bytes.len() as u128 != expected {
            return Err(LaneError::SlabSize { pair, expert, slab: name, ty, rows: total_rows, cols, expected, got: s.bytes.len() });
        }
        Ok(Rows { ty, bytes: s.bytes, first: 0, row_bytes: rb })
    }

    fn check<'a>(&self, p: &LanePair<'a>, d_model: usize, ff: usize) -> Result<Checked<'a>, LaneError> {
        let (gate, up) = self.check_gate_up(p.x, p.gate_up, d_model, ff)?;
        let down = self.rows("down", p.down, d_model, ff)?;
        Ok(Checked { gate, up, down })
    }

    fn check_gate_up<'a>(&self, x: &[f32], g: GateUp<'a>, d_model: usize, ff: usize) -> Result<(Rows<'a>, Rows<'a>), LaneError> {
        if x.len() != d_model {
            return Err(LaneError::InputWidth { pair: self.pair, expert: self.expert, got: x.len(), d_model });
        }
        Ok(match g {
            GateUp::Split { gate, up } => (self.rows("gate", gate, ff, d_model)?, self.rows("up", up, ff, d_model)?),
            GateUp::Fused(s) => {
                let both = self.rows("gate_up", s, ff.saturating_mul(2), d_model)?;
                (both, Rows { first: ff, ..both })
            }
        })
    }
}

/// `x` quantized for `ty` weights; `None` when `have` already is in that format.
fn acts_for(ty: GgmlType, x: &[f32], have: Option<&Activations>) -> Result<Option<Activations>, QuantError> {
    match have {
        Some(a) if Some(a.format()) == ActFormat::for_weight(ty) => Ok(None),
        _ => Activations::for_weight(ty, x, x.len()).map(Some),
    }
}

fn row0(a: &Activations) -> Result<ActRow<'_>, QuantError> {
    a.row(0).ok_or(QuantError::LengthMismatch { what: "activation rows", expected: 1, got: 0 })
}

/// Rows per task for `rows`-row matrices of `row_bytes` each, over `n_mats` of
/// them: whole groups of `dot_rows` rows where there are enough.
fn chunk_rows(rows: usize, row_bytes: usize, n_mats: usize, threads: usize) -> usize {
    let by_balance = (rows * n_mats).div_ceil(TASKS_PER_THREAD * threads.max(1));
    let by_size = MIN_TASK_BYTES.div_ceil(row_bytes.max(1));
    by_balance.max(by_size).next_multiple_of(Kernels::DOT_ROWS_GROUP).clamp(1, rows.max(1))
}

/// The CPU lane: its own threads, so it never queues behind the host's other
/// work, and spinning ones ([`SpinPool`]), so a layer's job starts at once.
pub struct CpuLane {
    /// Runs jobs beside the host thread (the pool's caller then). Declared
    /// first so it drops first: its last job may still use the pool.
    driver: super::driver::Driver,
    kernels: Kernels,
    pool: SpinPool,
}

/// The gate and up rows `0..rows` of one (token row, expert) pair: the head
/// of a split expert, whose other rows the GPU computes.
#[derive(Clone, Copy, Debug)]
pub struct LaneHead<'a> {
    /// For error messages only.
    pub expert: u32,
    pub x: &'a [f32],
    pub gate_up: GateUp<'a>,
    pub rows: usize,
}

/// Work for one call of [`CpuLane::heads`].
#[derive(Clone, Debug)]
pub struct LaneHeadJob<'a> {
    pub d_model: usize,
    pub ff: usize,
    pub act: Activation,
    pub pairs: Vec<LaneHead<'a>>,
}

/// One pair's gate/up work, checked: rows `0..rows` into `h`.
struct GateUpItem<'a> {
    gate: Rows<'a>,
    up: Rows<'a>,
    x: &'a [f32],
    rows: usize,
}

/// Tasks over disjoint chunks of one output, each taken once by one thread.
type Chunks<'a> = Vec<Mutex<Option<(usize, usize, &'a mut [f32])>>>;

/// (item, first row, output chunk) tasks over `out`, laid out as `lens`
/// consecutive runs, `chunk` rows each.
fn chunk_tasks<'a>(out: &'a mut [f32], lens: &[usize], chunk: usize) -> Chunks<'a> {
    let mut tasks = Vec::new();
    let mut rest = out;
    for (p, &len) in lens.iter().enumerate() {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        for (i, c) in mine.chunks_mut(chunk.max(1)).enumerate() {
            tasks.push(Mutex::new(Some((p, i * chunk, c))));
        }
    }
    tasks
}

impl CpuLane {
    /// A lane of `threads` threads (at least one) at the best SIMD level.
    pub fn new(threads: usize) -> Result<CpuLane, LaneError> {
        CpuLane::with_kernels(Kernels::detect(), threads)
    }

    /// A lane at a given SIMD level (tests pin it to the backend's).
    pub fn with_kernels(kernels: Kernels, threads: usize) -> Result<CpuLane, LaneError> {
        let threads = threads.max(1);
        let pool = SpinPool::new(threads, "pulsar-lane").map_err(|source| LaneError::Pool { threads, source })?;
        let driver = super::driver::Driver::new("pulsar-lane-driver").map_err(|source| LaneError::Pool { threads, source })?;
        Ok(CpuLane { kernels, pool, driver })
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The thread that runs jobs while the host goes on (see [`super::driver`]).
    pub fn driver(&self) -> &super::driver::Driver {
        &self.driver
    }

    /// Run `f` once per task on the lane's threads; the first error wins.
    fn for_each<T: Send>(&self, tasks: &[Mutex<Option<T>>], f: impl Fn(T) -> Result<(), LaneError> + Sync) -> Result<(), LaneError> {
        let first_err: Mutex<Option<LaneError>> = Mutex::new(None);
        self.pool
            .run(tasks.len(), &|i| {
                let Some(t) = tasks[i].lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
                if let Err(e) = f(t) {
                    first_err.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                }
            })
            .map_err(LaneError::Job)?;
        match first_err.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `h = act(gate x) * (up x)` over each item's rows `0..rows`, the items'
    /// rows end to end in the result.
    fn gate_up(&self, items: &[GateUpItem<'_>], ctxs: &[Ctx], act: Activation) -> Result<Vec<f32>, LaneError> {
        // Each distinct input quantized once (a decode token's pairs share it).
        let mut acts: Vec<(Activations, Option<Activations>)> = Vec::new();
        let mut xs: Vec<usize> = Vec::with_capacity(items.len());
        for (i, (k, c)) in items.iter().zip(ctxs).enumerate() {
            let same = |j: usize| {
                let o = &items[j];
                std::ptr::eq(o.x, k.x) && o.gate.ty == k.gate.ty && o.up.ty == k.up.ty
            };
            if let Some(j) = (0..i).find(|&j| same(j)) {
                xs.push(xs[j]);
                continue;
            }
            let xg = Activations::for_weight(k.gate.ty, k.x, k.x.len()).map_err(c.kernel("gate"))?;
            let xu = acts_for(k.up.ty, k.x, Some(&xg)).map_err(c.kernel("up"))?;
            xs.push(acts.len());
            acts.push((xg, xu));
        }
        let lens: Vec<usize> = items.iter().map(|k| k.rows).collect();
        let mut h = vec![0f32; lens.iter().sum()];
        let Some(k0) = items.first() else { return Ok(h) };
        let longest = lens.iter().copied().max().unwrap_or(0);
        let chunk = chunk_rows(longest, k0.gate.row_bytes + k0.up.row_bytes, items.len(), self.threads());
        let tasks = chunk_tasks(&mut h, &lens, chunk);
        self.for_each(&tasks, |(p, r0, out)| {
            let (k, c, (xg, xu)) = (&items[p], &ctxs[p], &acts[xs[p]]);
            let gx = row0(xg).map_err(c.kernel("gate"))?;
            let ux = row0(xu.as_ref().unwrap_or(xg)).map_err(c.kernel("up"))?;
            let n = out.len();
            let mut up = vec![0f32; n];
            self.kernels.dot_rows(k.gate.ty, k.gate.rows(r0, n), n, gx, out).map_err(c.kernel("gate"))?;
            self.kernels.dot_rows(k.up.ty, k.up.rows(r0, n), n, ux, &mut up).map_err(c.kernel("up"))?;
            // Elementwise, so a chunk gives the same bits as the whole row.
            ops::glu_rows(out, &up, act);
            Ok(())
        })?;
        Ok(h)
    }

    /// `down · (act(gate · x) * (up · x))` for every pair: `[pairs, d_model]`, in job order.
    pub fn run(&self, job: &LaneJob<'_>) -> Result<Vec<f32>, LaneError> {
        let (d, ff, n) = (job.d_model, job.ff, job.pairs.len());
        if n == 0 {
            return Ok(Vec::new());
        }
        if d == 0 || ff == 0 {
            return Err(LaneError::EmptyShape { d_model: d, ff });
        }
        // Validate everything before allocating or starting threads.
        let ctxs: Vec<Ctx> = job.pairs.iter().enumerate().map(|(pair, p)| Ctx { pair, expert: p.expert }).collect();
        let checked = job.pairs.iter().zip(&ctxs).map(|(p, c)| c.check(p, d, ff)).collect::<Result<Vec<_>, _>>()?;

        // Phase 1: h = act(gate x) * (up x), tasks over (pair, ff rows).
        let items: Vec<GateUpItem> = checked.iter().zip(&job.pairs).map(|(k, p)| GateUpItem { gate: k.gate, up: k.up, x: p.x, rows: ff }).collect();
        let h = self.gate_up(&items, &ctxs, job.act)?;

        // Phase 2: out = down h, tasks over (pair, d_model rows).
        let hs = h
            .chunks(ff)
            .zip(&checked)
            .zip(&ctxs)
            .map(|((hp, k), c)| Activations::for_weight(k.down.ty, hp, ff).map_err(c.kernel("down")))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = vec![0f32; n * d];
        let c2 = chunk_rows(d, checked[0].down.row_bytes, n, self.threads());
        let tasks = chunk_tasks(&mut out, &vec![d; n], c2);
        self.for_each(&tasks, |(p, r0, dst)| {
            let (k, c) = (&checked[p], &ctxs[p]);
            let hx = row0(&hs[p]).map_err(c.kernel("down"))?;
            let n = dst.len();
            self.kernels.dot_rows(k.down.ty, k.down.rows(r0, n), n, hx, dst).map_err(c.kernel("down"))?;
            Ok(())
        })?;
        Ok(out)
    }

    /// The heads of split experts: for each pair, `act(gate · x) * (up · x)`
    /// over its gate/up rows `0..rows`, the pairs' rows end to end. Each value
    /// is the one [`run`](Self::run) computes for that row.
    pub fn heads(&self, job: &LaneHeadJob<'_>) -> Result<Vec<f32>, LaneError> {
        let (d, ff) = (job.d_model, job.ff);
        if job.pairs.is_empty() {
            return Ok(Vec::new());
        }
        if d == 0 || ff == 0 {
            return Err(LaneError::EmptyShape { d_model: d, ff });
        }
        let ctxs: Vec<Ctx> = job.pairs.iter().enumerate().map(|(pair, p)| Ctx { pair, expert: p.expert }).collect();
        let items = job
            .pairs
            .iter()
            .zip(&ctxs)
            .map(|(p, c)| {
                if p.rows > ff {
                    return Err(LaneError::HeadRows { pair: c.pair, expert: c.expert, rows: p.rows, ff });
                }
                let (gate, up) = c.check_gate_up(p.x, p.gate_up, d, ff)?;
                Ok(GateUpItem { gate, up, x: p.x, rows: p.rows })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.gate_up(&items, &ctxs, job.act)
    }
}

impl LaneHeadJob<'_> {
    /// Weight bytes the job reads: each pair's gate and up rows.
    pub fn weight_bytes(&self) -> u64 {
        let rows_bytes = |g: GateUp<'_>, rows: usize| -> u64 {
            let (a, b) = match g {
                GateUp::Split { gate, up } => (gate.bytes.len(), up.bytes.len()),
                GateUp::Fused(s) => (s.bytes.len() / 2, s.bytes.len() / 2),
            };
            ((a + b) as u64 * rows as u64).checked_div(self.ff as u64).unwrap_or(0)
        };
        self.pairs.iter().map(|p| rows_bytes(p.gate_up, p.rows)).sum()
    }
}

/// A `[rows, cols]` slab of random valid blocks whose values have RMS near
/// `rms` (finite, so benchmarks and tests see realistic magnitudes).
pub fn random_slab(ty: GgmlType, rows: usize, cols: usize, seed: u64, rms: f32) -> Result<Vec<u8>, QuantError> {
    use pulsar_kernels::quant::{random_blocks, random_blocks_scaled};
    row_bytes(ty, cols)?; // whole blocks per row
    let be = ty.block_elems() as usize;
    let n_blocks = rows * (cols / be);
    // Values are linear in the scale: measure the spread at 1 and rescale.
    let probe = 16;
    let Ok(b) = random_blocks_scaled(ty, probe, 0x5eed, 1.0) else {
        return random_blocks(ty, n_blocks, seed);
    };
    let mut y = vec![0f32; probe * be];
    pulsar_kernels::dequantize(ty, &b, &mut y)?;
    let got = (y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / y.len() as f64).sqrt() as f32;
    let scale = if got > 0.0 && got.is_finite() { rms / got } else { 1.0 };
    random_blocks_scaled(ty, n_blocks, seed, scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;
    use pulsar_kernels::quant::random_values;
    use pulsar_kernels::WeightMatrix;

    const D: usize = 512;
    const FF: usize = 256;

    struct Expert {
        gate: Vec<u8>,
        up: Vec<u8>,
        down: Vec<u8>,
    }

    fn expert(ty: GgmlType, seed: u64) -> Expert {
        Expert {
            gate: random_slab(ty, FF, D, seed, 0.05).unwrap(),
            up: random_slab(ty, FF, D, seed + 1, 0.05).unwrap(),
            down: random_slab(ty, D, FF, seed + 2, 0.05).unwrap(),
        }
    }

    /// The CPU backend's expert FFN (cpu/moe.rs): matmuls over all rows routed to the expert.
    fn reference(cpu: &CpuBackend, ty: GgmlType, e: &Expert, x: &[f32], act: Activation) -> Vec<f32> {
        let mm = |bytes: &[u8], n_out: usize, n_in: usize, x: &[f32]| {
            let wm = WeightMatrix::new(ty, bytes, n_out, n_in).unwrap();
            let a = Activations::for_weight(ty, x, n_in).unwrap();
            let mut y = vec![0f32; x.len() / n_in * n_out];
            cpu.kernels.matmul(&cpu.pool, &wm, &a, &mut y).unwrap();
            y
        };
        let mut h = mm(&e.gate, FF, D, x);
        let up = mm(&e.up, FF, D, x);
        ops::glu_rows(&mut h, &up, act);
        mm(&e.down, D, FF, &h)
    }

    /// The same FFN for one token from one `Kernels::dot` per output value:
    /// the definition `dot_rows` must reproduce.
    fn reference_by_dots(k: Kernels, ty: GgmlType, e: &Expert, x: &[f32], act: Activation) -> Vec<f32> {
        let dots = |bytes: &[u8], n_out: usize, n_in: usize, x: &[f32]| {
            let a = Activations::for_weight(ty, x, n_in).unwrap();
            let rb = bytes.len() / n_out;
            (0..n_out).map(|r| k.dot(ty, &bytes[r * rb..(r + 1) * rb], a.row(0).unwrap()).unwrap()).collect::<Vec<f32>>()
        };
        let mut h = dots(&e.gate, FF, D, x);
        ops::glu_rows(&mut h, &dots(&e.up, FF, D, x), act);
        dots(&e.down, D, FF, &h)
    }

    fn split<'a>(ty: GgmlType, e: &'a Expert, x: &'a [f32], id: u32) -> LanePair<'a> {
        LanePair {
            expert: id,
            x,
            gate_up: GateUp::Split { gate: Slab { ty, bytes: &e.gate }, up: Slab { ty, bytes: &e.up } },
            down: Slab { ty, bytes: &e.down },
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn equals_the_cpu_backend_bit_for_bit() {
        let cpu = CpuBackend::new(2).unwrap();
        let lane = CpuLane::with_kernels(cpu.kernels, 3).unwrap();
        let xs = random_values(2 * D, 7);
        // Every format the cold-path issue names for the lane, plus q8_0.
        let types = [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::IQ2_XXS, GgmlType::IQ2_XS, GgmlType::IQ3_XXS];
        for (i, ty) in types.into_iter().enumerate() {
            let (e0, e1) = (expert(ty, 100 * i as u64), expert(ty, 100 * i as u64 + 50));
            let act = if i % 2 == 0 { Activation::Silu } else { Activation::GeluTanh };
            // Both tokens through e0 in one batch (as the backend groups them), token 1 through e1.
            let r0 = reference(&cpu, ty, &e0, &xs, act);
            let r1 = reference(&cpu, ty, &e1, &xs[D..], act);
            let (x0, x1) = (&xs[..D], &xs[D..]);
            let job = LaneJob { d_model: D, ff: FF, act, pairs: vec![split(ty, &e0, x0, 0), split(ty, &e1, x1, 1), split(ty, &e0, x1, 0)] };
            let out = lane.run(&job).unwrap();
            assert!(out.iter().all(|v| v.is_finite()), "{ty}: non-finite output");
            assert!(out.iter().any(|v| *v != 0.0), "{ty}: all zero");
            assert!(same_bits(&out[..D], &r0[..D]), "{ty}: token 0 expert 0");
            assert!(same_bits(&out[D..2 * D], &r1), "{ty}: token 1 expert 1");
            assert!(same_bits(&out[2 * D..], &r0[D..]), "{ty}: token 1 expert 0");
            assert!(same_bits(&out[D..2 * D], &reference_by_dots(cpu.kernels, ty, &e1, x1, act)), "{ty}: per-value dots");
            assert!(same_bits(&out[..D], &reference_by_dots(Kernels::scalar(), ty, &e0, x0, act)), "{ty}: scalar dots");
        }
    }

    #[test]
    fn heads_are_the_first_rows_of_h() {
        let k = Kernels::detect();
        let lane = CpuLane::with_kernels(k, 3).unwrap();
        let x = random_values(2 * D, 11);
        for ty in [GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::Q8_0] {
            let (e0, e1) = (expert(ty, 3), expert(ty, 4));
            // h by one dot per value, the definition.
            let h_of = |e: &Expert, x: &[f32]| {
                let a = Activations::for_weight(ty, x, D).unwrap();
                let rb = e.gate.len() / FF;
                let dots = |b: &[u8]| (0..FF).map(|r| k.dot(ty, &b[r * rb..(r + 1) * rb], a.row(0).unwrap()).unwrap()).collect::<Vec<f32>>();
                let mut h = dots(&e.gate);
                ops::glu_rows(&mut h, &dots(&e.up), Activation::Silu);
                h
            };
            let (x0, x1) = (&x[..D], &x[D..]);
            let (h0, h1) = (h_of(&e0, x0), h_of(&e1, x1));
            for (r0, r1) in [(0usize, FF), (1, 37), (FF, 0), (64, 200)] {
                let pairs = vec![
                    LaneHead { expert: 0, x: x0, gate_up: GateUp::Split { gate: Slab { ty, bytes: &e0.gate }, up: Slab { ty, bytes: &e0.up } }, rows: r0 },
                    LaneHead { expert: 1, x: x1, gate_up: GateUp::Split { gate: Slab { ty, bytes: &e1.gate }, up: Slab { ty, bytes: &e1.up } }, rows: r1 },
                ];
                let job = LaneHeadJob { d_model: D, ff: FF, act: Activation::Silu, pairs };
                let got = lane.heads(&job).unwrap();
                assert_eq!(got.len(), r0 + r1);
                assert!(same_bits(&got[..r0], &h0[..r0]) && same_bits(&got[r0..], &h1[..r1]), "{ty} rows {r0}/{r1}");
                let rb = (e0.gate.len() + e0.up.len()) / FF;
                assert_eq!(job.weight_bytes(), ((r0 + r1) * rb) as u64);
            }
            let bad = LaneHeadJob {
                d_model: D,
                ff: FF,
                act: Activation::Silu,
                pairs: vec![LaneHead { expert: 9, x: x0, gate_up: GateUp::Split { gate: Slab { ty, bytes: &e0.gate }, up: Slab { ty, bytes: &e0.up } }, rows: FF + 1 }],
            };
            assert!(matches!(lane.heads(&bad).unwrap_err(), LaneError::HeadRows { expert: 9, rows, .. } if rows == FF + 1));
        }
    }

    #[test]
    fn fused_gate_up_and_mixed_types() {
        let lane = CpuLane::new(2).unwrap();
        let x = random_values(D, 3);
        let e = expert(GgmlType::Q4_K, 9);
        let plain = lane.run(&LaneJob { d_model: D, ff: FF, act: Activation::Silu, pairs: vec![split(GgmlType::Q4_K, &e, &x, 4)] }).unwrap();
        let fused_bytes = [e.gate.as_slice(), e.up.as_slice()].concat();
        let fused = LanePair {
            expert: 4,
            x: &x,
            gate_up: GateUp::Fused(Slab { ty: GgmlType::Q4_K, bytes: &fused_bytes }),
            down: Slab { ty: GgmlType::Q4_K, bytes: &e.down },
        };
        let job = LaneJob { d_model: D, ff: FF, act: Activation::Silu, pairs: vec![fused] };
        assert!(same_bits(&lane.run(&job).unwrap(), &plain));
        // Gate and down in formats with different activation formats.
        let (g8, d6) = (random_slab(GgmlType::Q8_0, FF, D, 1, 0.05).unwrap(), random_slab(GgmlType::Q6_K, D, FF, 2, 0.05).unwrap());
        let mixed = LanePair {
            expert: 5,
            x: &x,
            gate_up: GateUp::Split { gate: Slab { ty: GgmlType::Q8_0, bytes: &g8 }, up: Slab { ty: GgmlType::Q4_K, bytes: &e.up } },
            down: Slab { ty: GgmlType::Q6_K, bytes: &d6 },
        };
        let out = lane.run(&LaneJob { pairs: vec![mixed], ..job }).unwrap();
        assert!(out.len() == D && out.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn bad_input_is_an_error() {
        let lane = CpuLane::new(2).unwrap();
        let ty = GgmlType::Q4_K;
        let e = expert(ty, 1);
        let x = random_values(D, 1);
        let job = |p| LaneJob { d_model: D, ff: FF, act: Activation::Silu, pairs: vec![split(ty, &e, &x, 0), p] };

        let short = &e.up[..e.up.len() - 1];
        let mut p = split(ty, &e, &x, 7);
        p.gate_up = GateUp::Split { gate: Slab { ty, bytes: &e.gate }, up: Slab { ty, bytes: short } };
        let err = lane.run(&job(p)).unwrap_err();
        assert!(matches!(err, LaneError::SlabSize { pair: 1, expert: 7, slab: "up", .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("up slab") && msg.contains(&short.len().to_string()) && msg.contains("q4_K"), "{msg}");

        let mut p = split(ty, &e, &x, 7);
        p.down = Slab { ty: GgmlType::Q8_0, bytes: &e.down };
        assert!(matches!(lane.run(&job(p)).unwrap_err(), LaneError::SlabSize { slab: "down", .. }));

        let mut p = split(ty, &e, &x, 7);
        p.gate_up = GateUp::Fused(Slab { ty, bytes: &e.gate });
        assert!(matches!(lane.run(&job(p)).unwrap_err(), LaneError::SlabSize { slab: "gate_up", .. }));

        let mut p = split(ty, &e, &x, 7);
        p.down = Slab { ty: GgmlType::IQ1_S, bytes: &e.down };
        assert!(matches!(lane.run(&job(p)).unwrap_err(), LaneError::Unsupported { slab: "down", .. }));

        let p = split(ty, &e, &x[..D - 1], 7);
        assert!(matches!(lane.run(&job(p)).unwrap_err(), LaneError::InputWidth { got: 511, .. }));

        // ff not a whole number of q4_K blocks for down's rows.
        let bad = LaneJob { d_model: D, ff: 100, act: Activation::Silu, pairs: vec![split(ty, &e, &x, 0)] };
        assert!(lane.run(&bad).is_err());
        let zero = LaneJob { d_model: D, ff: 0, ..bad.clone() };
        assert!(matches!(lane.run(&zero).unwrap_err(), LaneError::EmptyShape { .. }));
        assert!(lane.run(&LaneJob { pairs: vec![], ..bad }).unwrap().is_empty());
    }

    #[test]
    fn random_slab_is_finite_and_scaled() {
        for ty in [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::F16] {
            let b = random_slab(ty, 4, 256, 1, 0.05).unwrap();
            let mut y = vec![0f32; 4 * 256];
            pulsar_kernels::dequantize(ty, &b, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()));
            let rms = (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt();
            if ty != GgmlType::F16 {
                assert!(rms > 0.02 && rms < 0.1, "{ty}: rms {rms}");
            }
        }
    }
}
