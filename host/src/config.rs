//! One configuration, resolved once at start-up: command-line flag >
//! `PULSAR_*` environment variable > config file > measured default.
//! `--print-config` shows every value and where it came from.

use std::fmt;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::ArgMatches;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Source {
    Flag,
    Env,
    File,
    /// The model file's own recommendation (e.g. `general.sampling.*`).
    Model,
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Flag => "flag",
            Source::Env => "env",
            Source::File => "config file",
            Source::Model => "model file",
            Source::Default => "default",
        })
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Setting<T> {
    pub value: T,
    pub source: Source,
}

/// Keys a config file may set (TOML, every key optional); docs/config.md
/// lists them with their flags and defaults.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub threads: Option<usize>,
    pub ctx: Option<usize>,
    pub plugin_dirs: Option<Vec<PathBuf>>,
    pub host_cache_gb: Option<f64>,
    pub device: Option<crate::session::DeviceChoice>,
    pub vram_budget_gb: Option<f64>,
    #[serde(default, deserialize_with = "kv_type")]
    pub kv_type: Option<pulsar_kernels::ops::KvType>,
    pub temp: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<usize>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

/// The keys, for error messages.
pub const FILE_KEYS: &str = "threads, ctx, plugin_dirs, host_cache_gb, device, vram_budget_gb, kv_type, temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty";

/// `kv_type = "f16"`: parsed as `--kv-type` parses it.
fn kv_type<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<pulsar_kernels::ops::KvType>, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    s.parse().map(Some).map_err(serde::de::Error::custom)
}

/// One line for a config file's parse error: where, the line itself (so the
/// key is named), and what is wrong.
fn describe_toml_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim_end();
    let Some(at) = e.span().map(|s| s.start.min(text.len())) else { return msg.to_string() };
    let line_no = text[..at].matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
    let keys = if msg.contains("expected one of") { String::new() } else { format!("; the keys are {FILE_KEYS}") };
    format!("line {line_no} `{line}`: {msg}{keys}")
}

impl FileConfig {
    pub fn load(path: &Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("config file {}: {}", path.display(), describe_toml_error(&text, &e)))
    }

    /// `$XDG_CONFIG_HOME/pulsar/config.toml` or `~/.config/pulsar/config.toml`.
    pub fn default_path() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CONFIG_HOME")
            .filter(|x| !x.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
        Some(base.join("pulsar").join("config.toml"))
    }
}

/// Where a clap argument's value came from, if it was given at all.
fn given(m: &ArgMatches, id: &str) -> Option<Source> {
    match m.try_contains_id(id).ok().and_then(|has| has.then(|| m.value_source(id)).flatten()) {
        Some(ValueSource::CommandLine) => Some(Source::Flag),
        Some(ValueSource::EnvVariable) => Some(Source::Env),
        _ => None,
    }
}

/// Resolve one setting from the CLI/env value, the file value and a default.
pub fn resolve<T: Clone>(m: &ArgMatches, id: &str, cli: Option<T>, file: Option<T>, default: impl FnOnce() -> T) -> Setting<T> {
    if let (Some(src), Some(v)) = (given(m, id), cli) {
        return Setting { value: v, source: src };
    }
    if let Some(v) = file {
        return Setting { value: v, source: Source::File };
    }
    Setting { value: default(), source: Source::Default }
}

/// The settings every subcommand shares.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Config {
    pub threads: Setting<usize>,
    /// `None` = the model's training context, capped at 4096.
    pub ctx: Setting<Option<usize>>,
    pub plugin_dirs: Setting<Vec<PathBuf>>,
    pub plugin_path_env: Option<String>,
    pub config_file: Option<PathBuf>,
    /// The subcommand's own settings, as resolved (name, value, source).
    pub rows: Vec<(String, String, Source)>,
}

impl Config {
    pub fn print(&self) -> String {
        let mut s = String::new();
        let row = |s: &mut String, k: &str, v: String, src: Source| s.push_str(&format!("{k:<14} {v:<40} ({src})\n"));
        row(&mut s, "threads", self.threads.value.to_string(), self.threads.source);
        row(&mut s, "ctx", self.ctx.value.map_or("model default (<= 4096)".into(), |c| c.to_string()), self.ctx.source);
        let dirs: Vec<String> = self.plugin_dirs.value.iter().map(|d| d.display().to_string()).collect();
        row(&mut s, "plugin_dirs", if dirs.is_empty() { "(none)".into() } else { dirs.join(":") }, self.plugin_dirs.source);
        s.push_str(&format!("{:<14} {}\n", "plugin_path", self.plugin_path_env.as_deref().unwrap_or("(PULSAR_PLUGIN_PATH unset)")));
        s.push_str(&format!(
            "{:<14} {}\n",
            "config_file",
            self.config_file.as_ref().map_or("(none)".into(), |p| p.display().to_string())
        ));
        for (k, v, src) in &self.rows {
            row(&mut s, k, v.clone(), *src);
        }
        s
    }

    /// Resolve one of the subcommand's settings (flag or env > file >
    /// the flag's default), record it for `--print-config`, return it.
    pub fn settle<T: Clone + fmt::Display>(&mut self, m: &ArgMatches, id: &str, key: &str, cli: T, file: Option<T>) -> T {
        let s = resolve(m, id, Some(cli.clone()), file, || cli);
        self.rows.push((key.to_string(), s.value.to_string(), s.source));
        s.value
    }

    /// `settle` for a setting that may be unset (`None` prints as `unset`).
    pub fn settle_opt<T: Clone + fmt::Display>(&mut self, m: &ArgMatches, id: &str, key: &str, cli: Option<T>, file: Option<T>) -> Option<T> {
        let s = resolve(m, id, cli.map(Some), file.map(Some), || None);
        self.rows.push((key.to_string(), s.value.as_ref().map_or("unset".into(), |v| v.to_string()), s.source));
        s.value
    }
}

pub fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// More compute threads than this many per core only oversubscribe the
/// machine (and 100000 of them used to hang the start).
pub const MAX_THREADS_PER_CORE: usize = 4;

/// `--threads` (or its env or file value) is 1 to 4 per core: one line
/// naming the setting and where it came from otherwise.
pub fn check_threads(t: &Setting<usize>) -> Result<(), String> {
    let max = default_threads() * MAX_THREADS_PER_CORE;
    if t.value == 0 || t.value > max {
        return Err(format!(
            "--threads {} (from {}): give 1 to {max} ({MAX_THREADS_PER_CORE} per core on this machine's {})",
            t.value,
            t.source,
            default_threads()
        ));
    }
    Ok(())
}
