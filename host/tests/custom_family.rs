//! A family that exists only in this test, written the way a third party
//! would write one (the public plugin API, no host change), with mechanisms
//! no shipped family has: a latent cache (a rows state) attended by a
//! composed attention (matmul, mask, softmax), a recurrent state driven by a
//! linear scan, and a custom router (sigmoid scores, a selection-only bias
//! read as a weight value, scaled weights, no renormalisation).
//!
//! It runs on the CPU backend and is checked against a plain-loops
//! reference of the same maths, for prefill against decode, and for
//! snapshot / restore of its state.

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RResult, RStr, RString};
use pulsar_gguf::{GgmlType, GgufFile, GgufWriter};
use pulsar_host::cpu::{CpuBackend, MappedExperts};
use pulsar_host::engine::Engine;
use pulsar_host::model::Model;
use pulsar_plugin_api::{
    sdk, Act, Experts, FamilyBox, FamilyPlugin, Graph, ModelViewRef, OpenCx, PluginError, PluginInfo, PluginMod, PluginModRef,
    Role, Val, Wt,
};

const ARCH: &str = "toyhybrid";
/// Vocabulary, width, heads, latent width, recurrent width, experts, experts
/// a token, expert FFN width, layers.
const V: usize = 32;
const E: usize = 16;
const H: usize = 2;
const R: usize = 8;
const D: usize = 12;
const NE: usize = 6;
const K: usize = 2;
const FF: usize = 8;
const L: usize = 2;
const EPS: f32 = 1e-5;
const ROUTE_SCALE: f32 = 2.0;

struct Layer {
    attn_norm: Wt,
    wkv: Wt,
    wq: Wt,
    wo: Wt,
    wg: Wt,
    wu: Wt,
    wy: Wt,
    ffn_norm: Wt,
    router: Wt,
    bias: Wt,
    gate: Wt,
    up: Wt,
    down: Wt,
    latent: u32,
    rec: u32,
}

struct ToyHybrid {
    embd: Wt,
    norm: Wt,
    out: Wt,
    layers: Vec<Layer>,
}

impl FamilyPlugin for ToyHybrid {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let n_layers = cx.u32(&cx.key("block_count"))?;
        let (e, r, d, nx, ff) = (E as u64, R as u64, D as u64, NE as u64, FF as u64);
        let embd = cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, V as u64])?;
        let norm = cx.weight_shaped("output_norm.weight", Role::Norm, None, &[e])?;
        let out = cx.weight_shaped("output.weight", Role::Output, None, &[e, V as u64])?;
        let mut layers = Vec::new();
        for l in 0..n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let mut w = |s: &str, role: Role, dims: &[u64]| cx.weight_shaped(&n(s), role, Some(l), dims);
            layers.push(Layer {
                attn_norm: w("attn_norm.weight", Role::Norm, &[e])?,
                wkv: w("attn_kv.weight", Role::Attention, &[e, r])?,
                wq: w("attn_q.weight", Role::Attention, &[e, H as u64 * r])?,
                wo: w("attn_output.weight", Role::Attention, &[H as u64 * r, e])?,
                wg: w("rec_gate.weight", Role::Dense, &[e, d])?,
                wu: w("rec_in.weight", Role::Dense, &[e, d])?,
                wy: w("rec_out.weight", Role::Dense, &[d, e])?,
                ffn_norm: w("ffn_norm.weight", Role::Norm, &[e])?,
                router: w("ffn_gate_inp.weight", Role::Router, &[e, nx])?,
                bias: w("exp_probs_b.bias", Role::Router, &[nx])?,
                gate: w("ffn_gate_exps.weight", Role::RoutedExpert, &[e, ff, nx])?,
                up: w("ffn_up_exps.weight", Role::RoutedExpert, &[e, ff, nx])?,
                down: w("ffn_down_exps.weight", Role::RoutedExpert, &[ff, e, nx])?,
                latent: cx.rows_state(l, R as u32),
                rec: cx.recurrent_state(l, &[d]),
            });
        }
        cx.set_dims(n_layers, E as u32, V as u32, 64);
        Ok(ToyHybrid { embd, norm, out, layers })
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let ids = g.tokens()?;
        let mut x = g.embed(self.embd, ids, 1.0)?;
        for (l, w) in self.layers.iter().enumerate() {
            let l = l as u32;
            let h = g.rms_norm(x, Some(w.attn_norm), EPS)?;
            // Latent attention: every head attends over the same cached rows.
            let c = g.linear(w.wkv, h)?;
            let cache = g.state_rows(w.latent, c)?; // [C, R]
            let q = g.linear(w.wq, h)?;
            let q = g.split_heads(q, H as u32, R as u32)?;
            let q = g.permute(q, &[1, 0, 2])?; // [H, T, R]
            let kt = g.permute(cache, &[1, 0])?; // [R, C]
            let s = g.matmul(q, kt)?; // [H, T, C]
            let s = g.scale(s, 1.0 / (R as f32).sqrt())?;
            let m = g.mask(0)?;
            let s = g.add(s, m)?;
            let p = g.softmax(s, -1)?;
            let o = g.matmul(p, cache)?; // [H, T, R]
            let o = g.permute(o, &[1, 0, 2])?;
            let o = g.merge_heads(o)?;
            let o = g.linear(w.wo, o)?;
            x = g.add(x, o)?;
            // Gated linear recurrence: S_t = sigmoid(g_t) * S_{t-1} + u_t.
            let a = g.linear(w.wg, h)?;
            let a = g.sigmoid(a)?;
            let u = g.linear(w.wu, h)?;
            let st = g.scan(w.rec, a, u)?;
            let y = g.linear(w.wy, st)?;
            x = g.add(x, y)?;
            // Sigmoid router; the bias only chooses, the weights are unbiased.
            let h = g.rms_norm(x, Some(w.ffn_norm), EPS)?;
            let logits = g.linear(w.router, h)?;
            let scores = g.sigmoid(logits)?;
            let bias = g.weight(w.bias)?;
            let choice = g.add(scores, bias)?;
            let sel = g.top_k(choice, K as u32)?;
            let sw = g.take_along(scores, sel)?;
            let sw = g.scale(sw, ROUTE_SCALE)?;
            let f = g.experts(h, sel, sw, Experts { layer: l, gate: w.gate, up: w.up, down: w.down, act: Act::Silu })?;
            x = g.add(x, f)?;
            x = g.name(x, "l_out", Some(l));
        }
        let x = g.output_rows(x)?;
        let x = g.rms_norm(x, Some(self.norm), EPS)?;
        g.linear(self.out, x)
    }
}

extern "C" fn describe() -> RResult<PluginInfo, RString> {
    RResult::ROk(sdk::plugin_info(ARCH, "0.0.1", &[ARCH]))
}

extern "C" fn open(arch: RStr<'_>, model: ModelViewRef<'_>) -> RResult<FamilyBox, RString> {
    sdk::open_family::<ToyHybrid>(ARCH, arch, model)
}

fn module() -> PluginModRef {
    PluginMod { describe, open }.leak_into_prefix()
}

/// Deterministic values in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Every tensor of the toy model: name, ggml dims, values.
fn tensors() -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let mut t = Vec::new();
    let mut add = |name: String, dims: &[u64], scale: f32| {
        let n = dims.iter().product::<u64>() as usize;
        let seed = t.len() as u64 + 7;
        let v = if name.ends_with("norm.weight") { values(seed, n, 0.2).into_iter().map(|x| 1.0 + x).collect() } else { values(seed, n, scale) };
        t.push((name, dims.to_vec(), v));
    };
    let (e, r, d, nx, ff) = (E as u64, R as u64, D as u64, NE as u64, FF as u64);
    add("token_embd.weight".into(), &[e, V as u64], 1.0);
    add("output_norm.weight".into(), &[e], 0.0);
    add("output.weight".into(), &[e, V as u64], 0.5);
    for l in 0..L {
        let n = |s: &str| format!("blk.{l}.{s}");
        add(n("attn_norm.weight"), &[e], 0.0);
        add(n("attn_kv.weight"), &[e, r], 0.5);
        add(n("attn_q.weight"), &[e, H as u64 * r], 0.5);
        add(n("attn_output.weight"), &[H as u64 * r, e], 0.3);
        add(n("rec_gate.weight"), &[e, d], 0.5);
        add(n("rec_in.weight"), &[e, d], 0.3);
        add(n("rec_out.weight"), &[d, e], 0.3);
        add(n("ffn_norm.weight"), &[e], 0.0);
        add(n("ffn_gate_inp.weight"), &[e, nx], 0.7);
        add(n("exp_probs_b.bias"), &[nx], 0.3);
        add(n("ffn_gate_exps.weight"), &[e, ff, nx], 0.5);
        add(n("ffn_up_exps.weight"), &[e, ff, nx], 0.5);
        add(n("ffn_down_exps.weight"), &[ff, e, nx], 0.3);
    }
    t
}

fn write_model(path: &std::path::Path) {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", ARCH.to_string()).unwrap();
    w.add_kv(format!("{ARCH}.block_count"), L as u32).unwrap();
    let ts = tensors();
    for (name, dims, _) in &ts {
        w.add_tensor(name.clone(), dims, GgmlType::F32).unwrap();
    }
    let mut out = w.create(path).unwrap();
    for (name, _, v) in &ts {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        out.write_tensor(name, &bytes).unwrap();
    }
    out.finish().unwrap();
}

// ---- the reference: the same maths in plain loops, over a whole sequence ----

struct Weights(std::collections::HashMap<String, (Vec<u64>, Vec<f32>)>);

impl Weights {
    fn get(&self, name: &str) -> &[f32] {
        &self.0[name].1
    }
    /// `x [n, n_in] · Wᵀ` for a ggml `[n_in, n_out]` weight (row o holds W[o, :]).
    fn linear(&self, name: &str, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let (dims, w) = &self.0[name];
        let (n_in, n_out) = (dims[0] as usize, dims[1] as usize);
        x.iter().map(|row| (0..n_out).map(|o| (0..n_in).map(|i| w[o * n_in + i] as f64 * row[i] as f64).sum::<f64>() as f32).collect()).collect()
    }
    /// Expert `e`'s slice of a `*_exps` weight as a `[n_in, n_out]` matrix.
    fn expert(&self, name: &str, e: usize, x: &[f32]) -> Vec<f32> {
        let (dims, w) = &self.0[name];
        let (n_in, n_out) = (dims[0] as usize, dims[1] as usize);
        let w = &w[e * n_in * n_out..(e + 1) * n_in * n_out];
        (0..n_out).map(|o| (0..n_in).map(|i| w[o * n_in + i] as f64 * x[i] as f64).sum::<f64>() as f32).collect()
    }
}

fn norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + EPS as f64).sqrt();
    x.iter().zip(w).map(|(v, g)| (*v as f64 * r) as f32 * g).collect()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn reference(tokens: &[u32]) -> Vec<Vec<f32>> {
    let w = Weights(tensors().into_iter().map(|(n, d, v)| (n, (d, v))).collect());
    let emb = w.get("token_embd.weight");
    let mut x: Vec<Vec<f32>> = tokens.iter().map(|&t| emb[t as usize * E..(t as usize + 1) * E].to_vec()).collect();
    let n = tokens.len();
    for l in 0..L {
        let nm = |s: &str| format!("blk.{l}.{s}");
        let h: Vec<Vec<f32>> = x.iter().map(|r| norm(r, w.get(&nm("attn_norm.weight")))).collect();
        let cache = w.linear(&nm("attn_kv.weight"), &h);
        let q = w.linear(&nm("attn_q.weight"), &h);
        let mut o = vec![vec![0f32; H * R]; n];
        for t in 0..n {
            for hd in 0..H {
                let qh = &q[t][hd * R..(hd + 1) * R];
                let s: Vec<f64> = (0..=t).map(|j| (0..R).map(|i| qh[i] as f64 * cache[j][i] as f64).sum::<f64>() / (R as f64).sqrt()).collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let p = (sj - m).exp() / z;
                    for i in 0..R {
                        o[t][hd * R + i] += (p * cache[j][i] as f64) as f32;
                    }
                }
            }
        }
        let o = w.linear(&nm("attn_output.weight"), &o);
        x.iter_mut().zip(&o).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(u, v)| *u += v));
        let a = w.linear(&nm("rec_gate.weight"), &h);
        let u = w.linear(&nm("rec_in.weight"), &h);
        let mut s = vec![0f32; D];
        let mut states = Vec::new();
        for t in 0..n {
            for i in 0..D {
                s[i] = sigmoid(a[t][i]) * s[i] + u[t][i];
            }
            states.push(s.clone());
        }
        let y = w.linear(&nm("rec_out.weight"), &states);
        x.iter_mut().zip(&y).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(u, v)| *u += v));
        let h: Vec<Vec<f32>> = x.iter().map(|r| norm(r, w.get(&nm("ffn_norm.weight")))).collect();
        let logits = w.linear(&nm("ffn_gate_inp.weight"), &h);
        let bias = w.get(&nm("exp_probs_b.bias"));
        for t in 0..n {
            let scores: Vec<f32> = logits[t].iter().map(|&v| sigmoid(v)).collect();
            let mut order: Vec<usize> = (0..NE).collect();
            order.sort_by(|&i, &j| (scores[j] + bias[j]).partial_cmp(&(scores[i] + bias[i])).unwrap().then(i.cmp(&j)));
            for &e in &order[..K] {
                let g = w.expert(&nm("ffn_gate_exps.weight"), e, &h[t]);
                let up = w.expert(&nm("ffn_up_exps.weight"), e, &h[t]);
                let act: Vec<f32> = g.iter().zip(&up).map(|(g, u)| g * sigmoid(*g) * u).collect();
                let down = w.expert(&nm("ffn_down_exps.weight"), e, &act);
                for i in 0..E {
                    x[t][i] += ROUTE_SCALE * scores[e] * down[i];
                }
            }
        }
    }
    let xs: Vec<Vec<f32>> = x.iter().map(|r| norm(r, w.get("output_norm.weight"))).collect();
    w.linear("output.weight", &xs)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let m = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / m
}

struct Fixture {
    _dir: tempfile::TempDir,
    model: Model,
    cpu: CpuBackend,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toy.gguf");
    write_model(&path);
    let model = Model::from_file(GgufFile::open(&path).unwrap(), ARCH, module()).unwrap();
    Fixture { _dir: dir, model, cpu: CpuBackend::new(2).unwrap() }
}

const TOKENS: [u32; 7] = [3, 17, 5, 5, 30, 1, 12];

#[test]
fn a_test_only_family_runs_on_the_cpu_and_matches_its_reference() {
    let f = fixture();
    assert_eq!(f.model.plan.states.len(), 2 * L);
    let mut eng = Engine::new(&f.model, &f.cpu, &MappedExperts, 32);
    let got = eng.forward(&TOKENS, true).unwrap();
    let want = reference(&TOKENS);
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        let e = max_rel(g, w);
        assert!(e < 1e-4, "position {t}: max rel err {e}");
    }
}

#[test]
fn prefill_and_decode_agree_and_a_snapshot_rolls_the_state_back() {
    let f = fixture();
    let mut a = Engine::new(&f.model, &f.cpu, &MappedExperts, 32);
    let prefill = a.forward(&TOKENS, true).unwrap();
    let mut b = Engine::new(&f.model, &f.cpu, &MappedExperts, 32);
    let mut decoded = Vec::new();
    for (i, &t) in TOKENS.iter().enumerate() {
        decoded.push(b.forward(&[t], false).unwrap().remove(0));
        if i == 3 {
            // Speculate two tokens, then go back and take the real ones.
            let snap = b.snapshot();
            b.forward(&[9, 9], false).unwrap();
            b.restore(&snap).unwrap();
        }
    }
    assert_eq!(prefill, decoded, "prefill and decode (with a rollback in the middle) give the same bits");
    // Going back without a snapshot cannot keep a recurrent state: a restart.
    assert_eq!(b.truncate(3), 0);
    let again = b.forward(&TOKENS, true).unwrap();
    assert_eq!(again, prefill);
    // A snapshot ahead of the sequence is refused; so is a step that does
    // not follow the recurrent state (never a silently wrong answer).
    let snap = b.snapshot();
    b.n_past = 2;
    assert!(b.restore(&snap).is_err());
    let e = b.forward(&[1], false).unwrap_err().to_string();
    assert!(e.contains("recurrent state") && e.contains("restore a snapshot"), "{e}");
}

/// On a machine with a GPU (else it says so and passes: CI has none; the GPU
/// machine runs this binary), the same family through the CUDA backend: its
/// rows state, scan and custom router on the device equal the CPU's logits
/// bit for bit, prefill and decode alike; a snapshot restored on the device
/// continues as a sequence that never advanced.
#[test]
fn on_a_gpu_the_test_family_equals_the_cpu_bit_for_bit() {
    let Ok(dev) = pulsar_cuda::CudaDevice::open(0) else {
        eprintln!("no CUDA device: the CUDA half of the test family's check is skipped");
        return;
    };
    let f = fixture();
    pulsar_host::cuda::lowers(&f.model).expect("the test family lowers onto CUDA");
    let opts = pulsar_host::cuda::LoadOptions { kv_bytes: pulsar_host::cuda::CudaKv::bytes_for(&f.model, 32), lane_threads: Some(0), ..Default::default() };
    let cm = pulsar_host::cuda::CudaModel::load(dev, &f.model, &opts).unwrap();
    let mut cpu = Engine::new(&f.model, &f.cpu, &MappedExperts, 32);
    let want = cpu.forward(&TOKENS, true).unwrap();
    let mut gpu = pulsar_host::cuda::CudaEngine::new(&f.model, &cm, 32).unwrap();
    let got = gpu.forward(&TOKENS, true).unwrap();
    assert_eq!(got, want, "prefill: CUDA logits differ from the CPU's");
    // Token by token: the recurrent state and the latent cache carry over.
    let mut dec = pulsar_host::cuda::CudaEngine::new(&f.model, &cm, 32).unwrap();
    for (t, &tok) in TOKENS.iter().enumerate() {
        let row = dec.forward(&[tok], false).unwrap().remove(0);
        assert_eq!(row, want[t], "decode position {t}: CUDA logits differ from the CPU prefill's");
    }
    // A rollback on the device: tokens run after a snapshot leave no trace
    // once it is restored (the recurrent state comes back from the host copy).
    let mut rb = pulsar_host::cuda::CudaEngine::new(&f.model, &cm, 32).unwrap();
    rb.forward(&TOKENS[..3], false).unwrap();
    let snap = rb.snapshot().unwrap();
    rb.forward(&[30, 30], false).unwrap();
    rb.restore(&snap).unwrap();
    assert_eq!(rb.history, TOKENS[..3]);
    let mut straight = pulsar_host::cuda::CudaEngine::new(&f.model, &cm, 32).unwrap();
    straight.forward(&TOKENS[..3], false).unwrap();
    assert_eq!(rb.forward(&TOKENS[3..], true).unwrap(), straight.forward(&TOKENS[3..], true).unwrap(), "a restored CUDA sequence differs from one that never advanced");
}
