//! What `pulsar-host inspect FILE` prints, and the same facts as a
//! serialisable [`Summary`] (for `--json`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::file::{GgufFile, ShardInfo};
use crate::tensor::TensorInfo;
use crate::value::{Array, Value};
use crate::GgmlType;

/// Arrays longer than this are summarised by their first elements.
const ARRAY_FULL: usize = 8;
/// Elements shown of a summarised array.
const ARRAY_HEAD: usize = 3;
/// Strings longer than this (in chars) are cut.
const STR_MAX: usize = 80;

/// One metadata entry, rendered.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KvSummary {
    pub key: String,
    /// `u32`, `string`, `array of f32`, ...
    pub ty: String,
    /// Rendered value, long arrays and strings summarised.
    pub value: String,
}

/// Count and bytes of the tensors of one type.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TypeTotal {
    pub ty: String,
    pub count: usize,
    pub bytes: u64,
}

/// The routed-expert tensors (`blk.N.ffn_*_exps*`) of one layer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExpertLayer {
    pub layer: u64,
    /// Expert count (the last dimension of the layer's expert tensors).
    pub n_expert: u64,
    pub n_tensors: usize,
    /// Bytes of all the layer's expert tensors.
    pub bytes: u64,
    /// Bytes of one expert across those tensors (its slabs summed).
    pub bytes_per_expert: u64,
}

/// Everything the inspect report shows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    pub version: u32,
    pub alignment: u64,
    pub n_shards: usize,
    pub file_bytes: u64,
    pub shards: Vec<ShardInfo>,
    pub metadata: Vec<KvSummary>,
    pub tensors: Vec<TensorInfo>,
    pub types: Vec<TypeTotal>,
    pub tensor_bytes: u64,
    pub expert_layers: Vec<ExpertLayer>,
}

fn cut(s: &str) -> String {
    let n = s.chars().count();
    if n <= STR_MAX {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(STR_MAX).collect();
        format!("{head:?}... ({n} chars)")
    }
}

fn render_array(a: &Array) -> String {
    let n = a.len();
    let shown = if n > ARRAY_FULL { ARRAY_HEAD } else { n };
    let items: Vec<String> = (0..shown)
        .map(|i| match a {
            Array::String(v) => cut(&v[i]),
            a => a.display_at(i).unwrap_or_default(),
        })
        .collect();
    let more = if shown < n { ", ..." } else { "" };
    format!("[{n} x {}] {}{more}", a.elem_type(), items.join(", "))
}

/// Renders one value as the report shows it.
pub fn render_value(v: &Value) -> String {
    match v {
        Value::String(s) => cut(s),
        Value::Array(a) => render_array(a),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(x) => x.to_string(),
        v => v.as_i128().map(|i| i.to_string()).unwrap_or_default(),
    }
}

/// The layer number of a routed-expert tensor name `blk.N.ffn_*_exps*`.
pub fn expert_layer_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    let layer = n.parse().ok()?;
    (rest.starts_with("ffn_") && rest.contains("_exps")).then_some(layer)
}

impl Summary {
    /// Gathers the summary of an open file.
    pub fn of(f: &GgufFile) -> Summary {
        let metadata = f
            .metadata()
            .iter()
            .map(|(k, v)| KvSummary { key: k.to_string(), ty: v.type_description(), value: render_value(v) })
            .collect();
        let mut by_type: BTreeMap<GgmlType, (usize, u64)> = BTreeMap::new();
        let mut layers: BTreeMap<u64, ExpertLayer> = BTreeMap::new();
        for t in f.tensors() {
            let e = by_type.entry(t.ty).or_default();
            e.0 += 1;
            e.1 += t.n_bytes;
            if let Some(layer) = expert_layer_of(&t.name) {
                let n_expert = t.dims.last().copied().unwrap_or(1);
                let l = layers.entry(layer).or_insert(ExpertLayer {
                    layer,
                    n_expert,
                    n_tensors: 0,
                    bytes: 0,
                    bytes_per_expert: 0,
                });
                l.n_tensors += 1;
                l.bytes += t.n_bytes;
                l.bytes_per_expert += t.n_bytes / n_expert;
            }
        }
        let types: Vec<TypeTotal> = by_type
            .into_iter()
            .map(|(ty, (count, bytes))| TypeTotal { ty: ty.name().to_string(), count, bytes })
            .collect();
        Summary {
            version: f.version(),
            alignment: f.alignment(),
            n_shards: f.n_shards(),
            file_bytes: f.total_bytes(),
            shards: f.shard_infos().cloned().collect(),
            metadata,
            tensors: f.tensors().to_vec(),
            tensor_bytes: types.iter().map(|t| t.bytes).sum(),
            types,
            expert_layers: layers.into_values().collect(),
        }
    }

    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut s);
        s
    }

    fn write_text(&self, s: &mut String) -> std::fmt::Result {
        writeln!(
            s,
            "GGUF v{}, alignment {}, {} shard{}, {} bytes ({})",
            self.version,
            self.alignment,
            self.n_shards,
            if self.n_shards == 1 { "" } else { "s" },
            self.file_bytes,
            human(self.file_bytes)
        )?;
        for (i, sh) in self.shards.iter().enumerate() {
            let path = sh.path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "<memory>".into());
            writeln!(
                s,
                "  shard {i}: {path}: {} bytes, v{}, header {} bytes, data at {}, {} tensors",
                sh.len, sh.version, sh.header_len, sh.data_offset, sh.n_tensors
            )?;
        }
        writeln!(s, "\nmetadata ({} keys):", self.metadata.len())?;
        let kw = self.metadata.iter().map(|k| k.key.len()).max().unwrap_or(0);
        for kv in &self.metadata {
            writeln!(s, "  {:kw$}  {:<16}  {}", kv.key, kv.ty, kv.value)?;
        }
        writeln!(s, "\ntensors ({}):", self.tensors.len())?;
        let nw = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
        writeln!(s, "  {:nw$}  {:<24}  {:<7}  {:>14}  {:>14}  shard", "name", "shape", "type", "bytes", "offset")?;
        for t in &self.tensors {
            let shape = format!("{:?}", t.dims);
            writeln!(
                s,
                "  {:nw$}  {:<24}  {:<7}  {:>14}  {:>14}  {}",
                t.name, shape, t.ty.name(), t.n_bytes, t.offset, t.shard
            )?;
        }
        writeln!(s, "\ntotals by type:")?;
        for t in &self.types {
            writeln!(s, "  {:<7}  {:>6} tensors  {:>14} bytes  ({})", t.ty, t.count, t.bytes, human(t.bytes))?;
        }
        writeln!(
            s,
            "  {:<7}  {:>6} tensors  {:>14} bytes  ({})",
            "all",
            self.tensors.len(),
            self.tensor_bytes,
            human(self.tensor_bytes)
        )?;
        if !self.expert_layers.is_empty() {
            writeln!(s, "\nexpert bytes per layer (blk.N.ffn_*_exps*):")?;
            let mut total = 0u64;
            for l in &self.expert_layers {
                total += l.bytes;
                writeln!(
                    s,
                    "  blk.{:<4} {:>4} experts  {} tensors  {:>14} bytes ({})  {:>12} bytes per expert ({})",
                    l.layer,
                    l.n_expert,
                    l.n_tensors,
                    l.bytes,
                    human(l.bytes),
                    l.bytes_per_expert,
                    human(l.bytes_per_expert)
                )?;
            }
            writeln!(s, "  all expert tensors: {total} bytes ({})", human(total))?;
        }
        Ok(())
    }
}

/// The text of `pulsar-host inspect`.
pub fn report(f: &GgufFile) -> String {
    Summary::of(f).to_text()
}

/// Bytes with a binary unit, e.g. `1.50 GiB`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_and_strings_are_summarised() {
        let toks: Vec<String> = ["<pad>", "<eos>", "<bos>"].iter().map(|s| s.to_string())
            .chain((0..262141).map(|i| format!("t{i}")))
            .collect();
        let v = Value::from(toks);
        assert_eq!(render_value(&v), r#"[262144 x string] "<pad>", "<eos>", "<bos>", ..."#);
        assert_eq!(render_value(&Value::from(vec![1u32, 2])), "[2 x u32] 1, 2");
        let long = "x".repeat(100);
        assert!(render_value(&Value::from(long.as_str())).ends_with("... (100 chars)"));
        assert_eq!(human(3 << 30), "3.00 GiB");
        assert_eq!(human(5), "5 B");
    }

    #[test]
    fn expert_layer_names() {
        assert_eq!(expert_layer_of("blk.12.ffn_gate_up_exps.weight"), Some(12));
        assert_eq!(expert_layer_of("blk.3.ffn_down_exps.bias"), Some(3));
        assert_eq!(expert_layer_of("blk.3.ffn_down_shexp.weight"), None);
        assert_eq!(expert_layer_of("blk.x.ffn_down_exps.weight"), None);
        assert_eq!(expert_layer_of("token_embd.weight"), None);
    }
}
