//! `plugin.toml`: the manifest that sits next to each plugin library.
//!
//! ```toml
//! name = "gemma3"
//! version = "0.1.0"
//! api = "^0.2"                     # semver requirement on plugin-api
//! architectures = ["gemma3"]       # general.architecture values served
//! library = "libpulsar_arch_gemma3.so"
//! ```
//! The manifest is read before the library is opened, so an incompatible
//! plugin is reported without running any of its code.

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub const MANIFEST_FILE: &str = "plugin.toml";

/// A manifest is five short keys; anything larger is refused before it is
/// read (a 1 GiB `plugin.toml` used to cost 21 s and 4 GB at discovery).
pub const MANIFEST_MAX_BYTES: u64 = 64 << 10;

#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub version: semver::Version,
    pub api: semver::VersionReq,
    pub architectures: Vec<String>,
    /// Absolute path of the library (resolved against the manifest's folder).
    pub library: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    name: String,
    version: String,
    api: String,
    architectures: Vec<String>,
    library: String,
}

/// Why a manifest could not be used; one line each.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ManifestError {
    #[error("cannot read: {0}")]
    Read(String),
    #[error("does not parse: {0}")]
    Parse(String),
    #[error("`{field}` is invalid: {why}")]
    Field { field: &'static str, why: String },
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        use std::io::Read;
        let file = std::fs::File::open(path).map_err(|e| ManifestError::Read(e.to_string()))?;
        // Read at most one byte past the cap, whatever the metadata says (a FIFO, a growing file).
        let mut text = String::new();
        file.take(MANIFEST_MAX_BYTES + 1).read_to_string(&mut text).map_err(|e| ManifestError::Read(e.to_string()))?;
        if text.len() as u64 > MANIFEST_MAX_BYTES {
            return Err(ManifestError::Read(format!("larger than {} KiB: not a plugin manifest", MANIFEST_MAX_BYTES >> 10)));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        Manifest::parse(&text, dir)
    }

    pub fn parse(text: &str, dir: &Path) -> Result<Manifest, ManifestError> {
        let raw: RawManifest = toml::from_str(text).map_err(|e| ManifestError::Parse(first_line(&e.to_string())))?;
        let field = |field: &'static str, why: String| ManifestError::Field { field, why };
        if raw.name.trim().is_empty() {
            return Err(field("name", "empty".into()));
        }
        let version = semver::Version::parse(&raw.version).map_err(|e| field("version", e.to_string()))?;
        let api = semver::VersionReq::parse(&raw.api).map_err(|e| field("api", e.to_string()))?;
        if raw.architectures.is_empty() || raw.architectures.iter().any(|a| a.trim().is_empty()) {
            return Err(field("architectures", "must list at least one non-empty name".into()));
        }
        let lib = Path::new(&raw.library);
        if raw.library.is_empty() || lib.components().count() != 1 {
            return Err(field("library", format!("{:?} must be a file name in the manifest's folder", raw.library)));
        }
        Ok(Manifest { name: raw.name, version, api, architectures: raw.architectures, library: dir.join(lib) })
    }
}

/// The first line of a possibly long message.
pub(crate) fn first_line(s: &str) -> String {
    let line = s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("");
    let mut out: String = line.chars().take(200).collect();
    if line.chars().count() > 200 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "gemma3"
version = "0.1.0"
api = "^0.1"
architectures = ["gemma3"]
library = "libpulsar_arch_gemma3.so"
"#;

    #[test]
    fn parses_a_good_manifest() {
        let m = Manifest::parse(GOOD, Path::new("/p")).unwrap();
        assert_eq!(m.name, "gemma3");
        assert_eq!(m.library, Path::new("/p/libpulsar_arch_gemma3.so"));
        assert!(m.api.matches(&semver::Version::new(0, 1, 7)));
        assert!(!m.api.matches(&semver::Version::new(0, 2, 0)));
    }

    #[test]
    fn an_oversized_manifest_is_refused_without_reading_it_all() {
        let dir = std::env::temp_dir().join(format!("pulsar-manifest-big-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(MANIFEST_FILE);
        let mut big = GOOD.to_string();
        big.push_str(&"# pad\n".repeat((MANIFEST_MAX_BYTES as usize) / 6 + 1));
        std::fs::write(&p, &big).unwrap();
        let e = Manifest::load(&p).unwrap_err();
        assert!(e.to_string().contains("larger than 64 KiB"), "{e}");
        std::fs::write(&p, GOOD).unwrap();
        assert!(Manifest::load(&p).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rejects_bad_fields_naming_them() {
        let bad = GOOD.replace("^0.1", "not a req");
        assert!(matches!(Manifest::parse(&bad, Path::new("/")), Err(ManifestError::Field { field: "api", .. })));
        let bad = GOOD.replace("libpulsar_arch_gemma3.so", "../../etc/evil.so");
        assert!(matches!(Manifest::parse(&bad, Path::new("/")), Err(ManifestError::Field { field: "library", .. })));
        let bad = GOOD.replace(r#"["gemma3"]"#, "[]");
        assert!(matches!(Manifest::parse(&bad, Path::new("/")), Err(ManifestError::Field { field: "architectures", .. })));
        let e = Manifest::parse("name = ", Path::new("/")).unwrap_err();
        assert!(matches!(e, ManifestError::Parse(_)));
        assert!(!e.to_string().contains('\n'));
        let extra = format!("{GOOD}\nsurprise = 1\n");
        assert!(matches!(Manifest::parse(&extra, Path::new("/")), Err(ManifestError::Parse(_))));
    }
}
