//! The FFI-safe surface: the root module every plugin exports, the views the
//! host lends to a plugin, the op vocabulary the host implements and the family
//! object a plugin returns.
//!
//! Everything here is `#[repr(C)]` + `StableAbi`, so abi_stable can compare the
//! layout the host was built with against the one inside a plugin at load time.
//! Rules for changing it (see docs/plugin-api.md):
//! - new methods go after the current `#[sabi(last_prefix_field)]` one and the
//!   marker moves to the new last method only in a new minor version;
//! - existing structs and enums are never changed; a richer op gets a new
//!   method taking a new spec struct.

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RStr, RString, RVec},
    RMut, RRef, StableAbi,
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

/// An activation produced during one forward step. Every activation is a
/// row-major matrix with one row per token of the step.
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

/// The KV cache one attention layer needs.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct KvSpec {
    pub layer: u32,
    pub n_kv_head: u32,
    pub head_dim_k: u32,
    pub head_dim_v: u32,
    /// Sliding window in tokens; 0 = full attention (the host may keep only
    /// the window's worth of rows for sliding layers).
    pub window: u32,
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
    pub kv: RVec<KvSpec>,
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

#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Silu,
    /// GELU with the tanh approximation (gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact (erf) GELU.
    Gelu,
}

#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Rotate pairs (x[i], x[i + n_rot/2]) — GPT-NeoX / HF `rotate_half`.
    Neox,
    /// Rotate adjacent pairs (x[2i], x[2i+1]) — original llama / GPT-J.
    Interleaved,
}

/// Rotary position embedding on `[n_tok, n_head * head_dim]`, at the host's
/// positions for this step.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct RopeSpec {
    pub head_dim: u32,
    /// Rotated dimensions per head (the rest pass through); = head_dim for full rotary.
    pub n_rot: u32,
    pub base: f32,
    /// Linear position scaling: position is multiplied by 1/factor (1 = none).
    pub linear_factor: f32,
    pub mode: RopeMode,
}

/// Attention over the layer's cache. q is `[n_tok, n_head*head_dim_k]`, k
/// `[n_tok, n_kv_head*head_dim_k]`, v `[n_tok, n_kv_head*head_dim_v]`; the host
/// appends k and v to the cache at this step's positions first. Causal.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct AttnSpec {
    pub layer: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim_k: u32,
    pub head_dim_v: u32,
    /// Multiplier on q·k.
    pub scale: f32,
    /// 0 = full; else each query sees the last `window` positions (itself included).
    pub window: u32,
    /// 0 = none; else scores become `cap * tanh(score / cap)`.
    pub softcap: f32,
}

#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A routed-expert FFN block: router, top-k, expert FFNs resolved through the
/// host's expert store, weighted sum.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    pub layer: u32,
    /// `[n_embd] -> [n_expert]` router weight.
    pub router: Wt,
    /// `*_exps` tensors `[n_embd, n_ff, n_expert]` / `[n_ff, n_embd, n_expert]`.
    pub gate_exps: Wt,
    pub up_exps: Wt,
    pub down_exps: Wt,
    pub n_expert: u32,
    pub top_k: u32,
    pub gating: Gating,
    /// Renormalise the selected weights to sum to 1.
    pub norm_topk: bool,
    /// Multiplier on the selected weights after normalisation.
    pub weights_scale: f32,
    pub act: Act,
}

/// A forward-step error crossing the boundary: one line.
pub type OpResult = RResult<Val, RString>;

/// The op vocabulary. The host implements it; a plugin calls it from `forward`.
/// Handles are valid for the current step only.
#[sabi_trait]
pub trait Ops {
    /// Tokens in this step.
    fn n_tokens(&self) -> u32;
    /// Shape of an activation as (rows, cols).
    fn shape(&self, x: Val) -> RResult<RVec<u64>, RString>;
    /// Rows of `table` for this step's token ids, times `scale`.
    fn embed(&mut self, table: Wt, scale: f32) -> OpResult;
    /// `x · wᵀ` for a `[n_in] -> [n_out]` weight in any supported format.
    fn linear(&mut self, w: Wt, x: Val) -> OpResult;
    /// RMS norm over groups of `group` columns (= width for a plain norm, = head
    /// dim for per-head q/k norms), times the weight if given.
    fn rms_norm(&mut self, x: Val, w: ROption<Wt>, eps: f32, group: u32) -> OpResult;
    fn add(&mut self, a: Val, b: Val) -> OpResult;
    fn mul(&mut self, a: Val, b: Val) -> OpResult;
    fn scale(&mut self, x: Val, s: f32) -> OpResult;
    fn act(&mut self, x: Val, act: Act) -> OpResult;
    /// `act(gate) * up`.
    fn glu(&mut self, gate: Val, up: Val, act: Act) -> OpResult;
    fn rope(&mut self, x: Val, spec: RopeSpec) -> OpResult;
    fn attention(&mut self, q: Val, k: Val, v: Val, spec: AttnSpec) -> OpResult;
    fn moe(&mut self, x: Val, spec: MoeSpec) -> OpResult;
    /// Keep only the rows whose logits the host wants (e.g. the last token of a
    /// prefill chunk); call before the final norm so the output head runs once.
    fn output_rows(&mut self, x: Val) -> OpResult;
    /// Name an intermediate (`attn_out`, layer 3) so the host can dump and diff it.
    #[sabi(last_prefix_field)]
    fn name(&mut self, x: Val, name: RStr<'_>, layer: i32);
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

/// An opened model family: its plan, its forward step and its chat conventions.
#[sabi_trait]
pub trait Family: Send + Sync {
    fn plan(&self) -> ModelPlan;
    fn forward(&self, ops: OpsRef<'_>) -> OpResult;
    #[sabi(last_prefix_field)]
    fn chat(&self) -> ChatSpec;
}

pub type OpsRef<'a> = Ops_TO<'a, RMut<'a, ()>>;
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
