//! `pulsar-host`: run giant MoE models from GGUF files through family plugins.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use pulsar_host::cli;
use pulsar_host::config::{self, Config, FileConfig};

#[derive(Parser, Debug)]
#[command(name = "pulsar-host", version, about = "Run Mixture-of-Experts GGUF models through model-family plugins", long_about = None)]
struct Cli {
    /// Extra plugin folder, searched first (repeatable).
    #[arg(long = "plugin-dir", global = true, value_name = "DIR", env = "PULSAR_PLUGIN_DIR", help_heading = "Global")]
    plugin_dir: Vec<PathBuf>,
    /// Compute threads (default: the number of cores).
    #[arg(long, short = 't', global = true, env = "PULSAR_THREADS", help_heading = "Global")]
    threads: Option<usize>,
    /// Config file (TOML; default ~/.config/pulsar/config.toml when it exists).
    #[arg(long, global = true, env = "PULSAR_CONFIG", value_name = "FILE", help_heading = "Global")]
    config: Option<PathBuf>,
    /// Print the resolved configuration and where each value came from, then continue.
    #[arg(long, global = true, help_heading = "Global")]
    print_config: bool,
    /// More logging (-v info, -vv debug) and full diagnostics.
    #[arg(long, short = 'v', global = true, action = clap::ArgAction::Count, help_heading = "Global")]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List every plugin found, with version, architectures, API requirement and status.
    Archs(cli::archs::Args),
    /// Show a GGUF file: header, metadata, tensors, totals per type, expert bytes per layer.
    Inspect(cli::inspect::Args),
    /// Generate text, chat, or check a model (teacher forcing, decode consistency).
    Run(Box<cli::run::Args>),
    /// Write a synthetic model of a real family's geometry with random weights.
    Synth(cli::synth::Args),
    /// Measure prompt processing and generation like llama-bench, cold then warm, with per-tier traffic.
    Bench(Box<cli::bench::Args>),
    /// Print a hotlist (the hottest (layer, expert) pairs) from a model's census sidecar.
    Hotlist(cli::hotlist::Args),
    /// Serve a model over an OpenAI-compatible HTTP API, with a web chat page.
    Serve(Box<cli::serve::Args>),
    /// Check every CUDA primitive against the CPU on random shapes (needs a GPU).
    Opcheck(cli::opcheck::Args),
}

fn main() -> ExitCode {
    // llama.cpp habits first: `-hf` would parse as `-h -f` and print the help.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(hint) = cli::llama_cpp_hint(&args) {
        eprintln!("error: {hint}");
        return ExitCode::from(2);
    }
    let matches = Cli::command().get_matches_from(args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("PULSAR_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();

    let result = (|| -> anyhow::Result<ExitCode> {
        let config_file = cli.config.clone().or_else(|| FileConfig::default_path().filter(|p| p.is_file()));
        let file = match &config_file {
            Some(p) => FileConfig::load(p)?,
            None => FileConfig::default(),
        };
        let cfg = Config {
            threads: config::resolve(&matches, "threads", cli.threads, file.threads, config::default_threads),
            ctx: config::Setting { value: None, source: config::Source::Default },
            plugin_dirs: config::resolve(&matches, "plugin_dir", Some(cli.plugin_dir.clone()), file.plugin_dirs.clone(), Vec::new),
            plugin_path_env: std::env::var("PULSAR_PLUGIN_PATH").ok(),
            config_file,
            rows: Vec::new(),
        };
        config::check_threads(&cfg.threads).map_err(anyhow::Error::msg)?;
        let sub = matches.subcommand().map(|(_, m)| m.clone()).unwrap_or_default();
        let mut ctx = cli::Ctx { cfg, file, verbose: cli.verbose, print_config: cli.print_config, sub };
        match cli.cmd {
            Cmd::Archs(a) => cli::archs::main(&ctx, a),
            Cmd::Inspect(a) => cli::inspect::main(&ctx, a),
            Cmd::Run(a) => cli::run::main(ctx, *a),
            Cmd::Synth(a) => cli::synth::main(&ctx, a),
            Cmd::Bench(a) => cli::bench::main(&mut ctx, *a),
            Cmd::Hotlist(a) => cli::hotlist::main(&ctx, a),
            Cmd::Serve(a) => cli::serve::main(ctx, *a),
            Cmd::Opcheck(a) => cli::opcheck::main(&ctx, a),
        }
    })();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
