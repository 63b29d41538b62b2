//! The `pulsar-host` subcommands.

pub mod archs;
pub mod bench;
pub mod hotlist;
pub mod inspect;
pub mod run;
pub mod serve;
pub mod synth;

use std::path::Path;

use anyhow::Context;
use pulsar_registry::{Registry, SearchPath};

use crate::config::{Config, FileConfig};
use crate::model::Model;

/// What every subcommand gets.
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
        let file = pulsar_gguf::GgufFile::open(path).with_context(|| format!("cannot open model {}", path.display()))?;
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
