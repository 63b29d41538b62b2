//! `pulsar-host hotlist -m FILE`: the hottest (layer, expert) pairs of a
//! model's census sidecar, in the hotlist format the store reads.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use super::Ctx;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF model whose `<model>.gguf.warm` census to read.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// How many (layer, expert) pairs to keep.
    #[arg(long, default_value_t = 256)]
    pub top: usize,
}

pub fn main(_ctx: &Ctx, a: Args) -> anyhow::Result<ExitCode> {
    let f = pulsar_gguf::GgufFile::open(&a.model).with_context(|| format!("cannot open {}", a.model.display()))?;
    // A dense model never gets a census: say so rather than "run it once".
    if !f.tensors().iter().any(|t| t.n_experts().is_some() && t.name.contains("_exps")) {
        anyhow::bail!("{} has no routed experts (a dense model): there is no hotlist to make", a.model.display());
    }
    let side = pulsar_store::sidecar_path(&a.model);
    let census = match pulsar_store::load_sidecar(&side, &f.fingerprint()) {
        pulsar_store::SidecarLoad::Loaded(c) => c,
        pulsar_store::SidecarLoad::Missing => anyhow::bail!("{} has no census yet (run the model once)", side.display()),
        pulsar_store::SidecarLoad::Ignored(reason) => anyhow::bail!("{}: {reason}", side.display()),
    };
    let mut h = pulsar_store::hotlist_from_census(&census, a.top);
    h.family = f.architecture()?.to_string();
    print!("{}", h.to_text());
    Ok(ExitCode::SUCCESS)
}
