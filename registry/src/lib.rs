//! pulsar-registry: finds, validates, loads and lists model-family plugins.
//!
//! A plugin is a folder (or a file pair) holding `plugin.toml` and the library
//! it names. Search order, first wins on conflicts: `--plugin-dir` folders,
//! `PULSAR_PLUGIN_PATH` (':'-separated), `<exe dir>/plugins`, the user data
//! dir (`$XDG_DATA_HOME/pulsar/plugins` or `~/.local/share/pulsar/plugins`).
//! Each search folder is scanned one level deep. A missing folder is not an
//! error.
//!
//! Loading checks, in order: the manifest parses; its `api` requirement
//! accepts this host's plugin-api version (semver; no plugin code runs before
//! this); abi_stable's version and layout checks; the library's own
//! description agrees with its manifest. Every failure is one line naming the
//! file; abi_stable's full report is kept in [`Plugin::detail`] for `--verbose`.

mod elf;
mod manifest;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use abi_stable::library::{lib_header_from_path, LibraryError};
use pulsar_plugin_api::{PluginInfo, PluginModRef, API_VERSION};

pub use manifest::{Manifest, ManifestError, MANIFEST_FILE};

/// Where to look for plugins.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    pub dirs: Vec<PathBuf>,
}

impl SearchPath {
    /// The standard order: explicit folders, then `env_path` (the value of
    /// `PULSAR_PLUGIN_PATH`, read once by the caller), `<exe dir>/plugins`, the
    /// user data dir.
    pub fn standard(explicit: &[PathBuf], env_path: Option<&str>) -> SearchPath {
        let mut dirs: Vec<PathBuf> = explicit.to_vec();
        if let Some(p) = env_path {
            dirs.extend(std::env::split_paths(p).filter(|d| !d.as_os_str().is_empty()));
        }
        if let Some(exe_dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
            dirs.push(exe_dir.join("plugins"));
        }
        if let Some(data) = user_data_dir() {
            dirs.push(data.join("pulsar").join("plugins"));
        }
        SearchPath { dirs }
    }

    pub fn only(dirs: &[PathBuf]) -> SearchPath {
        SearchPath { dirs: dirs.to_vec() }
    }
}

fn user_data_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local").join("share"))
}

/// The state of one plugin found on the search path.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Ok,
    /// Built for another API: the reason, one line.
    Incompatible(String),
    /// Broken: the reason, one line.
    Failed(String),
}

impl Status {
    pub fn label(&self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Incompatible(_) => "incompatible",
            Status::Failed(_) => "failed",
        }
    }
    pub fn reason(&self) -> Option<&str> {
        match self {
            Status::Ok => None,
            Status::Incompatible(r) | Status::Failed(r) => Some(r),
        }
    }
}

/// One plugin (or one broken file) found on the search path.
#[derive(Debug, Clone)]
pub struct Plugin {
    /// The manifest or library file this entry is about.
    pub path: PathBuf,
    /// Position of its folder in the search path (lower wins).
    pub rank: usize,
    pub manifest: Option<Manifest>,
    pub info: Option<PluginInfo>,
    pub status: Status,
    /// Full diagnostic text (abi_stable's report), for `--verbose`.
    pub detail: Option<String>,
    module: Option<Module>,
}

/// The loaded root module; libraries are never unloaded, so it lives for the
/// rest of the process.
#[derive(Clone, Copy)]
struct Module(PluginModRef);

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<plugin module>")
    }
}

impl Plugin {
    pub fn name(&self) -> String {
        self.manifest
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_else(|| self.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default())
    }
    pub fn version(&self) -> Option<String> {
        self.manifest.as_ref().map(|m| m.version.to_string())
    }
    pub fn architectures(&self) -> Vec<String> {
        self.manifest.as_ref().map(|m| m.architectures.clone()).unwrap_or_default()
    }
    pub fn api_requirement(&self) -> Option<String> {
        self.manifest.as_ref().map(|m| m.api.to_string())
    }
    /// The loaded root module (status ok only).
    pub fn module(&self) -> Option<PluginModRef> {
        self.module.map(|m| m.0)
    }
    /// A one-line summary: `name: status: reason`.
    pub fn line(&self) -> String {
        match self.status.reason() {
            None => format!("{}: ok", self.name()),
            Some(r) => format!("{}: {}: {} ({})", self.name(), self.status.label(), r, self.path.display()),
        }
    }
}

/// Why no plugin could be selected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SelectError {
    #[error("no plugin named `{0}` was found (try `pulsar-host archs`)")]
    NoSuchPlugin(String),
    #[error("plugin `{name}` cannot be used: {why}")]
    Unusable { name: String, why: String },
    #[error("plugin `{plugin}` does not serve architecture `{arch}`")]
    WrongArch { plugin: String, arch: String },
    #[error("no plugin serves architecture `{arch}`{hint}")]
    NoPluginForArch { arch: String, hint: String },
}

/// All plugins found on a search path.
#[derive(Debug, Default)]
pub struct Registry {
    pub plugins: Vec<Plugin>,
    /// Folders searched, in order, and whether each existed.
    pub searched: Vec<(PathBuf, bool)>,
}

impl Registry {
    /// Scan every folder and load every plugin found. Never fails: problems are
    /// recorded per entry.
    pub fn discover(search: &SearchPath) -> Registry {
        let mut reg = Registry::default();
        let mut seen = BTreeSet::new();
        for (rank, dir) in search.dirs.iter().enumerate() {
            let exists = dir.is_dir();
            reg.searched.push((dir.clone(), exists));
            if !exists {
                continue;
            }
            for manifest_or_lib in scan_dir(dir) {
                let key = std::fs::canonicalize(&manifest_or_lib).unwrap_or(manifest_or_lib.clone());
                if !seen.insert(key) {
                    continue;
                }
                reg.plugins.push(load_entry(&manifest_or_lib, rank));
            }
        }
        reg
    }

    pub fn ok(&self) -> impl Iterator<Item = &Plugin> {
        self.plugins.iter().filter(|p| p.status == Status::Ok)
    }

    /// Pick the plugin for `arch`, or the one named by `--arch-plugin NAME`.
    /// When several usable plugins claim the architecture, the earliest search
    /// folder wins, then the highest version, then the name; the returned
    /// warning names the ones passed over.
    pub fn select(&self, arch: &str, by_name: Option<&str>) -> Result<(&Plugin, Option<String>), SelectError> {
        if let Some(name) = by_name {
            let p = self
                .plugins
                .iter()
                .filter(|p| p.name() == name)
                .min_by_key(|p| (p.status != Status::Ok, p.rank))
                .ok_or_else(|| SelectError::NoSuchPlugin(name.to_string()))?;
            if let Some(why) = p.status.reason() {
                return Err(SelectError::Unusable { name: name.into(), why: why.into() });
            }
            if !p.architectures().iter().any(|a| a == arch) {
                return Err(SelectError::WrongArch { plugin: name.into(), arch: arch.into() });
            }
            return Ok((p, None));
        }
        let mut claims: Vec<&Plugin> = self.ok().filter(|p| p.architectures().iter().any(|a| a == arch)).collect();
        claims.sort_by(|a, b| {
            a.rank
                .cmp(&b.rank)
                .then_with(|| b.manifest.as_ref().map(|m| &m.version).cmp(&a.manifest.as_ref().map(|m| &m.version)))
                .then_with(|| a.name().cmp(&b.name()))
        });
        let Some(first) = claims.first().copied() else {
            let broken: Vec<String> =
                self.plugins.iter().filter(|p| p.architectures().iter().any(|a| a == arch)).map(|p| p.line()).collect();
            let hint = if broken.is_empty() {
                let mut served: Vec<String> = self.ok().flat_map(|p| p.architectures()).collect();
                served.sort();
                served.dedup();
                let served = if served.is_empty() { "none".to_string() } else { served.join(", ") };
                let dirs: Vec<String> = self.searched.iter().filter(|(_, found)| *found).map(|(d, _)| d.display().to_string()).collect();
                let dirs = if dirs.is_empty() { "no plugin folder was found".to_string() } else { format!("searched {}", dirs.join(", ")) };
                format!(" (installed: {served}; {dirs}); `pulsar-host archs` lists the plugins, `--plugin-dir DIR` adds a folder")
            } else {
                format!("; found but unusable: {}", broken.join("; "))
            };
            return Err(SelectError::NoPluginForArch { arch: arch.into(), hint });
        };
        let warning = (claims.len() > 1).then(|| {
            let others: Vec<String> = claims[1..].iter().map(|p| format!("{} ({})", p.name(), p.path.display())).collect();
            format!(
                "{} plugins claim architecture `{arch}`; using {} ({}), ignoring {}",
                claims.len(),
                first.name(),
                first.path.display(),
                others.join(", ")
            )
        });
        Ok((first, warning))
    }
}

/// Manifests in `dir` and its immediate subfolders, plus libraries there that
/// no manifest names (reported as failed), in a stable order.
fn scan_dir(dir: &Path) -> Vec<PathBuf> {
    let mut folders = vec![dir.to_path_buf()];
    folders.extend(sorted_entries(dir).into_iter().filter(|p| p.is_dir()));
    let mut out = Vec::new();
    for folder in folders {
        let manifest = folder.join(MANIFEST_FILE);
        let named: Option<PathBuf> = if manifest.is_file() {
            out.push(manifest.clone());
            Manifest::load(&manifest).ok().map(|m| m.library)
        } else {
            None
        };
        for f in sorted_entries(&folder) {
            if is_library(&f) && named.as_deref() != Some(f.as_path()) {
                out.push(f);
            }
        }
    }
    out
}

fn sorted_entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

fn is_library(p: &Path) -> bool {
    p.is_file() && matches!(p.extension().and_then(|e| e.to_str()), Some("so" | "dylib" | "dll"))
}

fn entry(path: &Path, rank: usize, manifest: Option<Manifest>, status: Status, detail: Option<String>) -> Plugin {
    Plugin { path: path.to_path_buf(), rank, manifest, info: None, status, detail, module: None }
}

fn load_entry(path: &Path, rank: usize) -> Plugin {
    if path.file_name().and_then(|f| f.to_str()) != Some(MANIFEST_FILE) {
        return entry(path, rank, None, Status::Failed(format!("no {MANIFEST_FILE} names this library")), None);
    }
    let manifest = match Manifest::load(path) {
        Ok(m) => m,
        Err(e) => return entry(path, rank, None, Status::Failed(format!("manifest {e}")), None),
    };
    let host_api = semver::Version::parse(API_VERSION).expect("plugin-api version is semver");
    if !manifest.api.matches(&host_api) {
        let why = format!("requires plugin-api {}, this host provides {host_api}", manifest.api);
        return entry(path, rank, Some(manifest), Status::Incompatible(why), None);
    }
    let lib = manifest.library.clone();
    if !lib.is_file() {
        let why = format!("library {} not found", lib.display());
        return entry(path, rank, Some(manifest), Status::Failed(why), None);
    }
    match open_module(&lib) {
        Err((status, detail)) => entry(&lib, rank, Some(manifest), status, Some(detail)),
        Ok((module, info)) => {
            if info.name.as_str() != manifest.name {
                let why = format!("manifest says `{}` but the library is `{}`", manifest.name, info.name);
                return entry(&lib, rank, Some(manifest), Status::Failed(why), None);
            }
            let lib_archs: BTreeSet<&str> = info.archs.iter().map(|a| a.as_str()).collect();
            if let Some(a) = manifest.architectures.iter().find(|a| !lib_archs.contains(a.as_str())) {
                let why = format!("manifest lists architecture `{a}` the library does not serve");
                return entry(&lib, rank, Some(manifest), Status::Failed(why), None);
            }
            Plugin { path: lib, rank, manifest: Some(manifest), info: Some(info), status: Status::Ok, detail: None, module: Some(Module(module)) }
        }
    }
}

/// dlopen + abi_stable checks + `describe`.
fn open_module(lib: &Path) -> Result<(PluginModRef, PluginInfo), (Status, String)> {
    elf::check_shared_object(lib).map_err(|why| (Status::Failed(format!("cannot load library: {why}")), why.clone()))?;
    let header = lib_header_from_path(lib).map_err(|e| classify(&e))?;
    let module = header.init_root_module::<PluginModRef>().map_err(|e| classify(&e))?;
    let describe = module.describe();
    match describe() {
        abi_stable::std_types::RResult::ROk(info) => Ok((module, info)),
        abi_stable::std_types::RResult::RErr(e) => Err((Status::Failed(format!("describe failed: {e}")), e.into_string())),
    }
}

/// One line for each abi_stable failure; the full report goes to the detail.
fn classify(e: &LibraryError) -> (Status, String) {
    let detail = e.to_string();
    let status = match e {
        LibraryError::OpenError { err, .. } => Status::Failed(format!("cannot load library: {}", manifest::first_line(&err.to_string()))),
        LibraryError::GetSymbolError { .. } => Status::Failed("not a Pulsar plugin: the library exports no root module".into()),
        LibraryError::IncompatibleVersionNumber { expected_version, actual_version, .. } => Status::Incompatible(format!(
            "built against plugin-api {actual_version}, this host provides {expected_version}"
        )),
        LibraryError::AbiInstability(_) => {
            Status::Incompatible("its plugin ABI layout differs from this host's (details with --verbose)".into())
        }
        LibraryError::InvalidAbiHeader(_) | LibraryError::InvalidCAbi { .. } => {
            Status::Incompatible("built with an incompatible abi_stable".into())
        }
        LibraryError::RootModule { .. } => Status::Failed(format!("root module failed: {}", manifest::first_line(&detail))),
        LibraryError::ParseVersionError(_) => Status::Failed(format!("bad version string: {}", manifest::first_line(&detail))),
        LibraryError::Many(list) => return list.iter().next().map(classify).unwrap_or((Status::Failed("unknown load error".into()), detail)),
        #[allow(unreachable_patterns)]
        _ => Status::Failed(manifest::first_line(&detail)),
    };
    (status, detail)
}
