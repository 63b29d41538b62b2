//! `pulsar-host synth`: write a synthetic model.

use std::path::PathBuf;
use std::process::ExitCode;

use pulsar_gguf::GgmlType;

use super::Ctx;
use crate::synth;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Family: qwen3moe, deepseek2, hy_v3, minimax-m2, qwen35moe or qwen35 (a check: the preset names it).
    #[arg(long)]
    pub arch: Option<String>,
    /// Geometry of a real model: tiny, qwen3-30b-a3b, qwen3-235b-a22b (qwen3moe);
    /// deepseek-v3-671b, kimi-k2-1t (deepseek2); hy3-295b (hy_v3); minimax-m2-230b
    /// (minimax-m2); qwen3.6-35b-a3b (qwen35moe); qwen3.6-27b (qwen35, dense); tiny-deepseek2,
    /// tiny-kimi-k2, tiny-hy3, tiny-minimax-m2, tiny-qwen35moe, tiny-qwen35 (small twins).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Keep only the first N layers (to fit a disk; MTP blocks stay after them).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Expert weight type (q4_K, q2_K, q8_0, q4_0, iq2_xxs, ...).
    #[arg(long)]
    pub expert_type: Option<String>,
    /// Attention/embedding/output weight type.
    #[arg(long)]
    pub dense_type: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Routing skew: expert popularity roughly Zipf with this exponent (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    pub skew: f32,
    /// Output file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
}

fn ty(name: &str) -> anyhow::Result<GgmlType> {
    let t = GgmlType::from_name(name).ok_or_else(|| anyhow::anyhow!("unknown tensor type `{name}`"))?;
    if !pulsar_kernels::quant::can_quantize(t) {
        anyhow::bail!("cannot quantize to `{name}` yet");
    }
    Ok(t)
}

pub fn main(_ctx: &Ctx, a: Args) -> anyhow::Result<ExitCode> {
    let mut s = synth::preset(&a.preset)?;
    if let Some(arch) = &a.arch {
        if !synth::FAMILIES.contains(&arch.as_str()) {
            anyhow::bail!("synth writes {} (got --arch `{arch}`)", synth::FAMILIES.join(", "));
        }
        if *arch != s.arch {
            anyhow::bail!("preset `{}` is a {} model, not {arch}", a.preset, s.arch);
        }
    }
    if let Some(l) = a.layers {
        if l == 0 || l > s.n_layers {
            anyhow::bail!("--layers must be in 1..={}", s.n_layers);
        }
        s.n_layers = l;
    }
    if let Some(t) = &a.expert_type {
        s.expert_type = ty(t)?;
    }
    if let Some(t) = &a.dense_type {
        s.dense_type = ty(t)?;
    }
    s.seed = a.seed;
    if !(a.skew >= 0.0 && a.skew.is_finite()) {
        anyhow::bail!("--skew must be >= 0");
    }
    s.skew = a.skew;
    let bytes = synth::tensor_bytes(&s);
    eprintln!("writing {} ({:.2} GiB of tensors)", a.output.display(), bytes as f64 / (1u64 << 30) as f64);
    let t0 = std::time::Instant::now();
    synth::write(&s, &a.output, true)?;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("done in {secs:.1} s ({:.2} GB/s)", bytes as f64 / secs / 1e9);
    Ok(ExitCode::SUCCESS)
}
