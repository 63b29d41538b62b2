//! Fused ops against their composed references, on the CPU backend: a
//! test-only family computes each fused op (`glu`, `rms_norm`, `attention`
//! with GQA, a sliding window and soft-capping) and the same maths built
//! from primitives side by side, and returns both as its "logits".
//!
//! `glu` must match bit for bit (one definition of each activation); the
//! norm and attention sum in another order, so they match within 2e-6.

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RResult, RStr, RString};
use pulsar_gguf::{GgmlType, GgufFile, GgufWriter};
use pulsar_host::cpu::{CpuBackend, MappedExperts};
use pulsar_host::engine::Engine;
use pulsar_host::model::Model;
use pulsar_plugin_api::{
    sdk, Act, Attention, Dim, FamilyBox, FamilyPlugin, Graph, ModelViewRef, OpenCx, PluginError, PluginInfo, PluginMod, PluginModRef,
    Role, Unary, Val, Wt,
};

const ARCH: &str = "opcheck";
/// Vocabulary, width, query heads, KV heads, head dim, window, soft cap.
const V: usize = 24;
const E: usize = 16;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const WINDOW: u32 = 5;
const CAP: f32 = 3.0;
const EPS: f32 = 1e-5;
/// The parts of the output: (fused, composed) pairs of these widths.
const PARTS: [(&str, usize); 3] = [("glu", E), ("rms_norm", E), ("attention", H * D)];

struct OpCheck {
    embd: Wt,
    w1: Wt,
    w2: Wt,
    norm: Wt,
    eps: Wt,
    wq: Wt,
    wk: Wt,
    wv: Wt,
    kv: u32,
    k_rows: u32,
    v_rows: u32,
}

impl FamilyPlugin for OpCheck {
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError> {
        let (e, hd) = (E as u64, D as u64);
        let s = OpCheck {
            embd: cx.weight_shaped("token_embd.weight", Role::Embedding, None, &[e, V as u64])?,
            w1: cx.weight_shaped("w1.weight", Role::Dense, None, &[e, e])?,
            w2: cx.weight_shaped("w2.weight", Role::Dense, None, &[e, e])?,
            norm: cx.weight_shaped("norm.weight", Role::Norm, None, &[e])?,
            eps: cx.weight_shaped("eps.weight", Role::Other, None, &[1])?,
            wq: cx.weight_shaped("q.weight", Role::Attention, None, &[e, H as u64 * hd])?,
            wk: cx.weight_shaped("k.weight", Role::Attention, None, &[e, HKV as u64 * hd])?,
            wv: cx.weight_shaped("v.weight", Role::Attention, None, &[e, HKV as u64 * hd])?,
            kv: cx.kv_cache(0, HKV as u32, D as u32, D as u32, WINDOW),
            k_rows: cx.rows_state(0, (HKV * D) as u32),
            v_rows: cx.rows_state(0, (HKV * D) as u32),
        };
        let width = 2 * PARTS.iter().map(|p| p.1).sum::<usize>();
        cx.set_dims(1, E as u32, width as u32, 64);
        Ok(s)
    }

    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError> {
        let ids = g.tokens()?;
        let x = g.embed(self.embd, ids, 1.0)?;
        // glu = silu(gate) * up.
        let gate = g.linear(self.w1, x)?;
        let up = g.linear(self.w2, x)?;
        let glu = g.glu(gate, up, Act::Silu)?;
        let s = g.silu(gate)?;
        let glu_ref = g.mul(s, up)?;
        // rms_norm = x * rsqrt(mean(x^2) + eps) * w.
        let norm = g.rms_norm(x, Some(self.norm), EPS)?;
        let sq = g.unary(x, Unary::Square)?;
        let ms = g.mean(sq, -1)?;
        let eps = g.weight(self.eps)?;
        let ms = g.add(ms, eps)?;
        let r = g.unary(ms, Unary::Rsqrt)?;
        let n = g.mul(x, r)?;
        let w = g.weight(self.norm)?;
        let norm_ref = g.mul(n, w)?;
        // Attention (GQA, window, soft cap) over the KV state, and composed
        // over two rows states with the host's mask.
        let q = g.linear(self.wq, x)?;
        let k = g.linear(self.wk, x)?;
        let v = g.linear(self.wv, x)?;
        let scale = 1.0 / (D as f32).sqrt();
        let (qh, kh, vh) = (g.split_heads(q, H as u32, D as u32)?, g.split_heads(k, HKV as u32, D as u32)?, g.split_heads(v, HKV as u32, D as u32)?);
        let att = g.attention(qh, kh, vh, Attention { state: self.kv, scale, window: WINDOW, softcap: CAP })?;
        let att = g.merge_heads(att)?;
        let kc = g.state_rows(self.k_rows, k)?; // [C, HKV*D]
        let vc = g.state_rows(self.v_rows, v)?;
        let group = (H / HKV) as u64;
        // q [T, HKV, G, D] -> [HKV, G, T, D]; k [C, HKV, D] -> [HKV, 1, D, C].
        let q4 = g.reshape(q, &[Dim::T, Dim::N(HKV as u64), Dim::N(group), Dim::N(D as u64)])?;
        let q4 = g.permute(q4, &[1, 2, 0, 3])?;
        let k4 = g.reshape(kc, &[Dim::C, Dim::N(HKV as u64), Dim::N(1), Dim::N(D as u64)])?;
        let kt = g.permute(k4, &[1, 2, 3, 0])?;
        let sc = g.matmul(q4, kt)?; // [HKV, G, T, C]
        let sc = g.scale(sc, scale)?;
        let sc = g.scale(sc, 1.0 / CAP)?;
        let sc = g.tanh(sc)?;
        let sc = g.scale(sc, CAP)?;
        let m = g.mask(WINDOW)?;
        let sc = g.add(sc, m)?;
        let p = g.softmax(sc, -1)?;
        let v4 = g.reshape(vc, &[Dim::C, Dim::N(HKV as u64), Dim::N(1), Dim::N(D as u64)])?;
        let v4 = g.permute(v4, &[1, 2, 0, 3])?; // [HKV, 1, C, D]
        let o = g.matmul(p, v4)?; // [HKV, G, T, D]
        let o = g.permute(o, &[2, 0, 1, 3])?; // [T, HKV, G, D]
        let att_ref = g.merge_heads(o)?;
        let out = g.concat(&[glu, glu_ref, norm, norm_ref, att, att_ref], -1)?;
        g.output_rows(out)
    }
}

extern "C" fn describe() -> RResult<PluginInfo, RString> {
    RResult::ROk(sdk::plugin_info(ARCH, "0.0.1", &[ARCH]))
}

extern "C" fn open(arch: RStr<'_>, model: ModelViewRef<'_>) -> RResult<FamilyBox, RString> {
    sdk::open_family::<OpCheck>(ARCH, arch, model)
}

fn module() -> PluginModRef {
    PluginMod { describe, open }.leak_into_prefix()
}

fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn write_model(path: &std::path::Path) {
    let (e, hd) = (E as u64, D as u64);
    let ts: Vec<(&str, Vec<u64>, Vec<f32>)> = vec![
        ("token_embd.weight", vec![e, V as u64], values(1, E * V, 2.0)),
        ("w1.weight", vec![e, e], values(2, E * E, 0.6)),
        ("w2.weight", vec![e, e], values(3, E * E, 0.6)),
        ("norm.weight", vec![e], values(4, E, 0.3).into_iter().map(|x| 1.0 + x).collect()),
        ("eps.weight", vec![1], vec![EPS]),
        ("q.weight", vec![e, H as u64 * hd], values(5, E * H * D, 0.8)),
        ("k.weight", vec![e, HKV as u64 * hd], values(6, E * HKV * D, 0.8)),
        ("v.weight", vec![e, HKV as u64 * hd], values(7, E * HKV * D, 0.8)),
    ];
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", ARCH.to_string()).unwrap();
    for (name, dims, _) in &ts {
        w.add_tensor(*name, dims, GgmlType::F32).unwrap();
    }
    let mut out = w.create(path).unwrap();
    for (name, _, v) in &ts {
        out.write_tensor(name, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    }
    out.finish().unwrap();
}

/// Per row, per part: the largest |fused - composed| relative to the part's largest |value|.
fn errors(rows: &[Vec<f32>]) -> Vec<[f32; 3]> {
    rows.iter()
        .map(|r| {
            let mut at = 0;
            let mut e = [0f32; 3];
            for (i, (_, w)) in PARTS.iter().enumerate() {
                let (f, c) = (&r[at..at + w], &r[at + w..at + 2 * w]);
                let m = f.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
                e[i] = f.iter().zip(c).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / m;
                at += 2 * w;
            }
            e
        })
        .collect()
}

#[test]
fn fused_ops_match_their_composed_references_in_prefill_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opcheck.gguf");
    write_model(&path);
    let model = Model::from_file(GgufFile::open(&path).unwrap(), ARCH, module()).unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    let mut eng = Engine::new(&model, &cpu, &MappedExperts, 32);
    // A prefill longer than the window, then decodes past it.
    let prompt: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % V as u32).collect();
    let mut rows = eng.forward(&prompt, true).unwrap();
    for t in [4u32, 19, 2, 11] {
        rows.extend(eng.forward(&[t], true).unwrap());
    }
    assert_eq!(rows.len(), 13);
    for (i, e) in errors(&rows).iter().enumerate() {
        assert_eq!(e[0], 0.0, "row {i}: glu differs from silu(gate) * up");
        assert!(e[1] < 2e-6, "row {i}: rms_norm off its composed reference by {}", e[1]);
        assert!(e[2] < 2e-6, "row {i}: attention off its composed reference by {}", e[2]);
    }
}
