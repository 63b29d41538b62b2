//! `pulsar-host opcheck`: the Ops harness on a GPU ([`crate::opcheck`]).

use std::process::ExitCode;

use anyhow::Context;

use super::Ctx;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Draws of each registered op test (random shapes and inputs; seeds 0..N).
    #[arg(long, default_value_t = 8)]
    pub seeds: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Also write the table (Markdown) here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Print every row (default: one row per test, its worst draw, and every failure).
    #[arg(long)]
    pub all: bool,
}

pub fn main(_ctx: &Ctx, args: Args) -> anyhow::Result<ExitCode> {
    let dev = pulsar_cuda::CudaDevice::open(args.gpu).context("opcheck runs the CUDA primitives against the CPU: it needs a GPU")?;
    let rows = crate::cuda::opcheck::run_all(&dev, args.seeds);
    let failed = rows.iter().filter(|r| !r.pass).count();
    let shown: Vec<crate::opcheck::Row> = if args.all {
        rows.clone()
    } else {
        // Per test: its failures, else its largest error.
        let mut out: Vec<crate::opcheck::Row> = Vec::new();
        for r in &rows {
            match out.iter_mut().find(|o| o.name == r.name) {
                Some(o) if o.pass && (!r.pass || r.err > o.err) => *o = r.clone(),
                Some(_) if !r.pass => out.push(r.clone()),
                Some(_) => {}
                None => out.push(r.clone()),
            }
        }
        out
    };
    let table = crate::opcheck::markdown(&shown);
    print!("{table}");
    println!("{} draws of {} tests: {failed} failed", rows.len(), crate::opcheck::tests().len());
    if let Some(p) = &args.out {
        std::fs::write(p, &table).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
