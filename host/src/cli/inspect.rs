//! `pulsar-host inspect FILE`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use super::Ctx;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file (the first shard of a split set opens all of it).
    pub file: PathBuf,
    /// Machine-readable summary.
    #[arg(long)]
    pub json: bool,
}

pub fn main(_ctx: &Ctx, args: Args) -> anyhow::Result<ExitCode> {
    let f = pulsar_gguf::GgufFile::open(&args.file).with_context(|| format!("cannot open {}", args.file.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&pulsar_gguf::report::Summary::of(&f))?);
    } else {
        print!("{}", pulsar_gguf::report::report(&f));
    }
    Ok(ExitCode::SUCCESS)
}
