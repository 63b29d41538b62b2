//! The FFI-safe surface: the root module every plugin exports, the view the
//! host lends to a plugin, the step graphs a family builds and the family
//! object a plugin returns.
//!
//! Everything here is `#[repr(C)]` + `StableAbi`, so abi_stable can compare the
//! layout the host was built with against the one inside a plugin at load time.
//! Rules for changing it (see docs/plugin-api.md):
//! - new methods go after the current `#[sabi(last_prefix_field)]` one and the
//!   marker moves to the new last method only in a new minor version;
//! - existing structs and enums are never changed; ops and state kinds are
//!   codes (`graph::op::code`, `STATE_*`), so the vocabulary grows without
//!   changing a layout.

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RStr, RString, RVec},
    RRef, StableAbi,
};

/// The name abi_stable uses for the root module. The library file name is not
/// derived from it (the manifest names the file).
pub const ROOT_MODULE_NAME: &str = "pulsar_plugin";

/// A metadata value as the host shows it to a plugin. Integers are widened,
/// arrays are typed (a nested array is shown by its length only).
#[repr(C, u8)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub enum MetaValue {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(RString),
    U64s(RVec<u64>),
    I64s(RVec<i64>),
    F64s(RVec<f64>),
    Bools(RVec<bool>),
    Strs(RVec<RString>),
    /// An array of arrays: only its length crosses the boundary.
    Nested(u64),
}

/// One entry of the model's tensor directory.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TensorDesc {
    pub name: RString,
    /// ggml order: `dims[0]` is the contiguous row length.
    pub dims: RVec<u64>,
    /// The GGUF `ggml_type` id.
    pub dtype: u32,
    pub bytes: u64,
}

/// What a weight is for; the host places and budgets memory by role before the
/// first token (routed experts stream, everything else stays resident).
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Embedding,
    Norm,
    Attention,
    Dense,
    Router,
    RoutedExpert,
    SharedExpert,
    Output,
    Other,
}

/// A weight the plugin declared at open time (index into the plan's weights).
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Wt(pub u32);

/// A value of a step graph (the index of the node that makes it).
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Val(pub u32);

#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct WeightReq {
    pub name: RString,
    pub role: Role,
    /// The block index, or -1 for weights outside the blocks.
    pub layer: i32,
}

/// Per-sequence state a family declares; the host owns it (allocates it per
/// sequence, snapshots, rolls back and truncates it). Kinds are codes so new
/// kinds never change this layout; `dims` means what the kind says.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct StateSpec {
    /// [`STATE_KV`], ...
    pub kind: u32,
    /// The block it belongs to (-1: none), for reports and memory plans.
    pub layer: i32,
    pub dims: RVec<u64>,
}

/// A KV cache: `dims = [n_kv_head, head_dim_k, head_dim_v, window]` (window
/// 0 = full attention; the host may keep only a window's worth of rows).
pub const STATE_KV: u32 = 0;
/// One row per position (a latent cache: MLA's compressed KV and rope part):
/// `dims = [width]`.
pub const STATE_ROWS: u32 = 1;
/// A fixed-size recurrent state per sequence: `dims` is its shape.
pub const STATE_RECURRENT: u32 = 2;

impl StateSpec {
    pub fn kv(layer: u32, n_kv_head: u32, head_dim_k: u32, head_dim_v: u32, window: u32) -> StateSpec {
        StateSpec { kind: STATE_KV, layer: layer as i32, dims: RVec::from(vec![n_kv_head as u64, head_dim_k as u64, head_dim_v as u64, window as u64]) }
    }

    /// A cache of one `width`-wide row per position.
    pub fn rows(layer: u32, width: u32) -> StateSpec {
        StateSpec { kind: STATE_ROWS, layer: layer as i32, dims: RVec::from(vec![width as u64]) }
    }

    /// A recurrent state of shape `dims`, zero at the start of a sequence.
    pub fn recurrent(layer: u32, dims: &[u64]) -> StateSpec {
        StateSpec { kind: STATE_RECURRENT, layer: layer as i32, dims: dims.iter().copied().collect() }
    }

    /// Bytes per sequence: per position for KV and rows states, in all for a
    /// recurrent one (f32).
    pub fn bytes(&self) -> (u64, u64) {
        match (self.kind, self.dims.as_slice()) {
            (STATE_KV, [h, k, v, _]) => (4 * h * (k + v), 0),
            (STATE_ROWS, [w]) => (4 * w, 0),
            (STATE_RECURRENT, d) => (0, 4 * d.iter().product::<u64>()),
            _ => (0, 0),
        }
    }

    /// A KV cache's (n_kv_head, head_dim_k, head_dim_v, window).
    pub fn as_kv(&self) -> Option<(u32, u32, u32, u32)> {
        match (self.kind, self.dims.as_slice()) {
            (STATE_KV, [h, k, v, w]) => Some((*h as u32, *k as u32, *v as u32, *w as u32)),
            _ => None,
        }
    }
}

/// Everything the host needs to know before reading a weight.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct ModelPlan {
    pub n_layers: u32,
    pub n_embd: u32,
    pub n_vocab: u32,
    /// Training context length (the default `--ctx` cap).
    pub n_ctx_train: u32,
    pub weights: RVec<WeightReq>,
    /// Per-sequence state, indexed by the ops that use it.
    pub states: RVec<StateSpec>,
}

/// Which step a graph is built for. A graph is built once per kind and
/// serves every step of it: the step's token count is the symbol `T`.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// One new token per sequence.
    Decode,
    /// A chunk of prompt tokens.
    Prefill,
}

/// One op of a step graph, as it crosses the boundary: the opcode and its
/// attributes (`graph::Op` decodes them), the values it reads (indices of
/// earlier nodes), and an optional name for dumps.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Node {
    pub op: u32,
    pub inputs: RVec<u32>,
    pub ints: RVec<i64>,
    pub floats: RVec<f32>,
    /// `attn_out`, `l_out`, ... (empty: unnamed).
    pub label: RString,
    /// The block the label belongs to (-1: none).
    pub layer: i32,
}

/// A step as a graph: node `i` makes value `i`; `output` is the logits.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct StepGraph {
    pub nodes: RVec<Node>,
    pub output: u32,
}

/// Chat conventions the plugin knows for its family.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct ChatSpec {
    /// A Jinja template used when the GGUF carries no `tokenizer.chat_template`.
    pub fallback_template: ROption<RString>,
    /// Texts of tokens that end a turn besides the vocabulary's EOS.
    pub stop_markers: RVec<RString>,
    /// Opening and closing marker of a thinking section, if the family has one.
    pub thinking: ROption<ThinkingMarkers>,
}

#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ThinkingMarkers {
    pub open: RString,
    pub close: RString,
}

/// What `pulsar-host archs` shows for a plugin.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct PluginInfo {
    pub name: RString,
    pub version: RString,
    /// `general.architecture` values it serves.
    pub archs: RVec<RString>,
    /// The plugin-api version it was built against.
    pub api_version: RString,
}

/// The host's view of the model file, lent to a plugin while it opens.
#[sabi_trait]
pub trait ModelView {
    fn meta(&self, key: RStr<'_>) -> ROption<MetaValue>;
    fn meta_keys(&self) -> RVec<RString>;
    fn tensor(&self, name: RStr<'_>) -> ROption<TensorDesc>;
    #[sabi(last_prefix_field)]
    fn tensor_names(&self) -> RVec<RString>;
}

/// An opened model family: its plan, its step graphs and its chat conventions.
#[sabi_trait]
pub trait Family: Send + Sync {
    fn plan(&self) -> ModelPlan;
    /// The step graph for `kind` (built once per kind; the host validates it).
    fn build(&self, kind: StepKind) -> RResult<StepGraph, RString>;
    #[sabi(last_prefix_field)]
    fn chat(&self) -> ChatSpec;
}

pub type ModelViewRef<'a> = ModelView_TO<'a, RRef<'a, ()>>;
pub type FamilyBox = Family_TO<'static, RBox<()>>;

/// The root module every plugin library exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    pub describe: extern "C" fn() -> RResult<PluginInfo, RString>,
    /// Open `arch` on a model; the plugin validates every key and tensor it needs.
    #[sabi(last_prefix_field)]
    pub open: extern "C" fn(arch: RStr<'_>, model: ModelViewRef<'_>) -> RResult<FamilyBox, RString>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = ROOT_MODULE_NAME;
    const NAME: &'static str = ROOT_MODULE_NAME;
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
