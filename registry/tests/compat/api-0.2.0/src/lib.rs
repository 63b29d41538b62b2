//! The stable ABI between the Pulsar host and its model-family plugins.
//!
//! - [`abi`]: the FFI-safe types (root module, model view, step graphs,
//!   family object);
//! - [`graph`]: the op vocabulary, shapes and the graph check (plain Rust,
//!   shared by the SDK and the host);
//! - [`sdk`]: what a family author uses: [`sdk::FamilyPlugin`], the
//!   [`sdk::Graph`] builder and [`export_plugin!`];
//! - [`testing`]: an in-process fake host for plugin tests.
//!
//! The crate version is the ABI version; see `docs/plugin-api.md`.

#[allow(non_local_definitions)] // abi_stable 0.11's sabi_trait expansion
pub mod abi;
pub mod graph;
pub mod sdk;
pub mod testing;

pub use abi::*;
pub use graph::{Act, Attention, Binary, Dim, Experts, Reduce, Rope, RopeMode, Unary};
pub use sdk::{FamilyPlugin, Graph, OpenCx, PluginError};

/// The plugin-api version this crate is (and a plugin was built against).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Items the [`export_plugin!`] macro expands to, so plugin crates need no
/// direct abi_stable dependency.
#[doc(hidden)]
pub mod reexports {
    pub use abi_stable::export_root_module;
    pub use abi_stable::std_types::{RResult, RStr, RString};
    pub use abi_stable::prefix_type::PrefixTypeTrait;
}
