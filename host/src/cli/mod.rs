//! The `pulsar-host` subcommands.

pub mod archs;
pub mod bench;
mod bench_out;
pub mod hotlist;
pub mod inspect;
pub mod opcheck;
mod repl;
pub mod run;
pub mod serve;
pub mod synth;

use std::path::Path;

use anyhow::Context;
use pulsar_registry::{Registry, SearchPath};

use crate::config::{Config, FileConfig};
use crate::model::Model;

/// Where and how a run places the model on a GPU: shared by `run` and `bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuArgs {
    /// cpu, cuda, cuda:N, or auto (CUDA when a GPU is there).
    #[arg(long, env = "PULSAR_DEVICE", default_value = "auto", help_heading = "Memory and streaming")]
    pub device: crate::session::DeviceChoice,
    /// The KV cache's format: f32, f16 (half the memory and the bandwidth
    /// long-context decode spends on it), q8_0 (about a quarter) or q4_0
    /// (an eighth; both blocks of 32 values with an f16 scale, as
    /// llama.cpp's), bf16, or fp8 (e4m3, a byte a value). The CPU and
    /// CUDA store and read every format alike, bit for bit. Rows are
    /// rounded once, as they are written.
    #[arg(long, env = "PULSAR_KV", default_value = "f32", value_name = "TYPE", help_heading = "Memory and streaming")]
    pub kv_type: pulsar_kernels::ops::KvType,
    /// Cap the VRAM the model may use, in GiB (emulates a smaller card); experts beyond it stream.
    #[arg(long, env = "PULSAR_VRAM_GB", value_name = "GB", help_heading = "Memory and streaming")]
    pub vram_budget: Option<f64>,
    /// How cold experts (not in VRAM) are served in decode: upload them, let
    /// the kernels read them in place from page-locked memory (zerocopy),
    /// compute them on the CPU (cpu), or auto (split between the link and the
    /// CPU lane by cost, measured at load and refined as it runs).
    #[arg(long, env = "PULSAR_COLD_PATH", default_value = "auto", help_heading = "Memory and streaming")]
    pub cold_path: crate::cold::ColdPolicy,
    /// CPU lane threads for cold experts (default: half the cores; 0: none).
    #[arg(long, value_name = "N", help_heading = "Advanced GPU")]
    pub cpu_lane_threads: Option<usize>,
    /// Run the CPU lane's decode jobs on the host thread, which waits for
    /// each (by default the GPU waits for the lane on a host flag while the
    /// host goes on; this is for measuring the difference).
    #[arg(long, help_heading = "Advanced GPU")]
    pub cpu_lane_sync: bool,
    /// Never page-lock the model file in host memory (uploads go pageable).
    #[arg(long, help_heading = "Advanced GPU")]
    pub no_pin: bool,
    /// Do not copy the next layer's predicted experts ahead during decode.
    #[arg(long, help_heading = "Advanced GPU")]
    pub no_prefetch: bool,
    /// Launch every decode step kernel by kernel instead of replaying a
    /// captured CUDA graph (graphs are used when the experts are resident).
    #[arg(long, help_heading = "Advanced GPU")]
    pub no_cuda_graphs: bool,
    /// Launch each kernel only after the previous one has finished (no
    /// programmatic dependent launch; it is used on sm_90+ GPUs)
    #[arg(long, help_heading = "Advanced GPU")]
    pub no_pdl: bool,
    /// Stream experts on this GPU (default: the fastest measured link).
    #[arg(long, env = "PULSAR_GPU", value_name = "N", help_heading = "Memory and streaming")]
    pub gpu: Option<usize>,
    /// Put attention and KV on this GPU (planned; default: measured).
    #[arg(long, env = "PULSAR_ATTN_GPU", value_name = "N", help_heading = "Advanced GPU")]
    pub attn_gpu: Option<usize>,
    /// Resident expert tiers on spare GPUs (planned).
    #[arg(long, env = "PULSAR_TIERS", default_value = "on", value_parser = ["on", "off"], help_heading = "Advanced GPU")]
    pub tiers: String,
}

impl GpuArgs {
    /// Resolve the settings a config file may also give (`device`,
    /// `vram_budget_gb`) and record them for `--print-config`.
    pub fn settle(&mut self, cfg: &mut Config, m: &clap::ArgMatches, file: &FileConfig) {
        self.device = cfg.settle(m, "device", "device", self.device, file.device);
        self.kv_type = cfg.settle(m, "kv_type", "kv_type", self.kv_type, file.kv_type);
        self.vram_budget = cfg.settle_opt(m, "vram_budget", "vram_budget_gb", self.vram_budget, file.vram_budget_gb);
        self.cold_path = cfg.settle(m, "cold_path", "cold_path", self.cold_path, None);
    }

    /// The device to run on, and the role plan for the visible GPUs: measured
    /// when there are several (or `print` asks for it). One GPU, or no plan
    /// wanted: the choice as given, nothing probed.
    pub fn resolve_device(&self, model: &Model, print: bool) -> anyhow::Result<crate::session::DeviceChoice> {
        use crate::cuda::roles;
        use crate::session::DeviceChoice;
        if self.device == DeviceChoice::Cpu || !pulsar_cuda::CudaDevice::available() {
            return Ok(self.device);
        }
        let count = cudarc::driver::result::device::get_count().map(|n| n as usize).unwrap_or(0);
        if count <= 1 && !print {
            return Ok(match self.gpu {
                Some(n) => DeviceChoice::Cuda(n),
                None => self.device,
            });
        }
        let gpus = roles::probe_all().map_err(|e| anyhow::anyhow!("measuring the GPUs: {e}"))?;
        let mem = model.memory_plan();
        let needs = roles::ModelNeeds { mla: roles::is_mla_family(&model.arch), attention_bytes: mem.resident_bytes };
        let ov = roles::RoleOverrides { stream_gpu: self.gpu, attn_gpu: self.attn_gpu, no_tiers: self.tiers == "off" };
        let plan = roles::plan_roles(&gpus, &needs, &ov, 2 << 30)?;
        if print {
            eprint!("{plan}");
        }
        // An explicit cuda:N keeps its card; auto and plain cuda take the plan's.
        Ok(match (self.device, self.gpu) {
            (_, Some(n)) => DeviceChoice::Cuda(n),
            (DeviceChoice::Cuda(n), None) if n != 0 => DeviceChoice::Cuda(n),
            _ => DeviceChoice::Cuda(plan.stream),
        })
    }

    pub fn vram_budget_bytes(&self) -> Option<u64> {
        self.vram_budget.map(|g| (g * (1u64 << 30) as f64) as u64)
    }

    /// The CUDA load options; `cached_store`: experts come through a budgeted
    /// host cache, which is then the pinned source (pinning the whole file
    /// mapping would defeat its budget).
    pub fn load_options(&self, kv_bytes: u64, census: Option<pulsar_store::Census>, cached_store: bool) -> crate::cuda::LoadOptions {
        crate::cuda::LoadOptions {
            vram_budget: self.vram_budget_bytes(),
            kv_bytes,
            census,
            cold: self.cold_path,
            lane_threads: self.cpu_lane_threads,
            lane_sync: self.cpu_lane_sync,
            no_pin: self.no_pin || cached_store,
            no_prefetch: self.no_prefetch,
            no_graphs: self.no_cuda_graphs,
            no_pdl: self.no_pdl,
        }
    }
}

/// Save the expert census beside the model once nothing runs it: the GPU
/// pool's when the model ran on one, else the host store's.
pub fn save_census(cuda: Option<&crate::cuda::CudaModel>, store: Option<&crate::experts::StoreExperts>, path: &std::path::Path, model: &Model) {
    let saved = match (cuda, store) {
        (Some(cm), _) => cm.save_census(path, model),
        (None, Some(st)) => st.save_census(path, model).map(Some),
        (None, None) => Ok(None),
    };
    match saved {
        Ok(Some(p)) => tracing::info!("census saved to {}", p.display()),
        Ok(None) => {}
        Err(e) => tracing::warn!("could not save the census: {e:#}"),
    }
}

/// A context longer than the model was trained on runs, but the positions
/// past it are out of distribution (text degrades): say so once.
pub fn warn_past_trained_ctx(model: &Model, n_ctx: usize) {
    let trained = model.plan.n_ctx_train as usize;
    if trained > 0 && n_ctx > trained {
        tracing::warn!("--ctx {n_ctx} is beyond the {trained} positions {} was trained on: text past them degrades", model.arch);
    }
}

/// llama.cpp flags that mean something else here: the one-line hint for
/// each (flags that mean the same are aliases on the subcommands instead).
const LLAMA_CPP_HINTS: &[(&[&str], &str)] = &[
    (
        &["-ngl", "--n-gpu-layers", "--gpu-layers"],
        "pulsar places the layers itself (everything on the GPU when it fits, experts streaming when not): cap its VRAM with --vram-budget GB, or run on the CPU with --device cpu",
    ),
    (&["-hf", "-hfr", "--hf-repo", "-hff", "--hf-file"], "pulsar reads local GGUF files: download the GGUF first (e.g. `huggingface-cli download REPO FILE.gguf`), then pass -m FILE.gguf"),
    (&["-fa", "--flash-attn"], "attention is always fused here: drop the flag"),
    (&["-cnv"], "use --chat (or --conversation)"),
    (&["-np"], "use --parallel N"),
    (&["-b", "--batch-size", "-ub"], "use --ubatch N (the largest prefill chunk)"),
    (&["--mlock", "--no-mmap"], "pulsar maps the file and pages experts itself: drop the flag (--host-cache GB bounds the RAM it keeps)"),
];

/// The hint for the first llama.cpp-only flag among the arguments (before a `--`).
pub fn llama_cpp_hint(args: &[std::ffi::OsString]) -> Option<String> {
    for a in args.iter().skip(1).take_while(|a| *a != "--") {
        let a = a.to_str()?;
        let flag = a.split('=').next().unwrap_or(a);
        for (names, hint) in LLAMA_CPP_HINTS {
            if names.contains(&flag) {
                return Some(format!("{flag} is a llama.cpp flag: {hint}"));
            }
        }
    }
    None
}

pub struct Ctx {
    pub cfg: Config,
    pub file: FileConfig,
    pub verbose: u8,
    pub print_config: bool,
    /// The subcommand's own matches (to tell flags from defaults).
    pub sub: clap::ArgMatches,
}

impl Ctx {
    pub fn registry(&self) -> Registry {
        let search = SearchPath::standard(&self.cfg.plugin_dirs.value, self.cfg.plugin_path_env.as_deref());
        Registry::discover(&search)
    }

    /// Open a model with the plugin its `general.architecture` selects (or
    /// the one `--arch-plugin` names).
    pub fn open_model(&self, path: &Path, arch_plugin: Option<&str>) -> anyhow::Result<Model> {
        let file = pulsar_gguf::GgufFile::open(path).context("cannot open the model (-m)")?;
        let arch = file.architecture().with_context(|| format!("{}", path.display()))?.to_string();
        let reg = self.registry();
        for p in reg.plugins.iter().filter(|p| p.status != pulsar_registry::Status::Ok) {
            tracing::info!("plugin {}", p.line());
        }
        let (plugin, warning) = reg.select(&arch, arch_plugin)?;
        if let Some(w) = warning {
            tracing::warn!("{w}");
        }
        let module = plugin.module().expect("selected plugins are loaded");
        Ok(Model::from_file(file, &plugin.name(), module)?)
    }
}
