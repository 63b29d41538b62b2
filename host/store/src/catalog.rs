//! The catalogue: which slabs exist and where their bytes lie.
//!
//! Built from plain entries so it does not depend on the GGUF reader's file
//! API; an adapter turns a `GgufFile` into `(SlabId, SlabLoc)` pairs.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use pulsar_gguf::GgmlType;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// Which `*_exps` tensor a slab is cut from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum SlabKind {
    Gate,
    Up,
    Down,
    /// Fused gate and up projection (`ffn_gate_up_exps`).
    GateUp,
}

impl SlabKind {
    /// The llama.cpp tensor-name stem (`blk.N.<stem>`).
    pub fn tensor_stem(self) -> &'static str {
        match self {
            SlabKind::Gate => "ffn_gate_exps",
            SlabKind::Up => "ffn_up_exps",
            SlabKind::Down => "ffn_down_exps",
            SlabKind::GateUp => "ffn_gate_up_exps",
        }
    }
}

/// One expert's slice of one expert tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SlabId {
    pub layer: u32,
    pub kind: SlabKind,
    pub expert: u32,
}

impl SlabId {
    pub fn new(layer: u32, kind: SlabKind, expert: u32) -> SlabId {
        SlabId { layer, kind, expert }
    }
}

impl fmt::Display for SlabId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blk.{}.{}[{}]", self.layer, self.kind.tensor_stem(), self.expert)
    }
}

/// Where a slab's bytes are: a byte range of one shard file, plus its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlabLoc {
    /// Index into [`Catalog::files`].
    pub file: u16,
    /// Absolute byte offset in that file.
    pub offset: u64,
    pub bytes: u64,
    #[serde(with = "ggml_type_serde")]
    pub ty: GgmlType,
    pub rows: u64,
    /// Weights per row.
    pub cols: u64,
}

mod ggml_type_serde {
    use pulsar_gguf::GgmlType;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(t: &GgmlType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(t.id())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<GgmlType, D::Error> {
        let id = u32::deserialize(d)?;
        GgmlType::from_id(id).ok_or_else(|| serde::de::Error::custom(format!("unknown ggml type id {id}")))
    }
}

/// How one expert's FFN weights are split into slabs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TripleLayout {
    /// gate, up, down
    Separate,
    /// gate_up, down
    Fused,
}

impl TripleLayout {
    pub fn kinds(self) -> &'static [SlabKind] {
        match self {
            TripleLayout::Separate => &[SlabKind::Gate, SlabKind::Up, SlabKind::Down],
            TripleLayout::Fused => &[SlabKind::GateUp, SlabKind::Down],
        }
    }
}

/// One expert of one layer: the slabs that are always needed together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Triple {
    pub layer: u32,
    pub expert: u32,
    pub layout: TripleLayout,
}

impl Triple {
    pub fn slabs(self) -> impl Iterator<Item = SlabId> {
        self.layout.kinds().iter().map(move |&kind| SlabId { layer: self.layer, kind, expert: self.expert })
    }
}

#[derive(Debug, Default)]
struct LayerInfo {
    /// Sorted expert ids with their layout.
    experts: BTreeMap<u32, TripleLayout>,
    bytes: u64,
}

/// Every routed-expert slab of a model and where it lives.
#[derive(Debug)]
pub struct Catalog {
    files: Vec<PathBuf>,
    /// Sorted by id.
    slabs: Vec<(SlabId, SlabLoc)>,
    index: HashMap<SlabId, usize>,
    layers: BTreeMap<u32, LayerInfo>,
    total: u64,
}

impl Catalog {
    /// Validate and index the entries. Checked: shard indices, duplicates,
    /// byte counts against the shape and type, range overflow, and that every
    /// (layer, expert) has a complete gate/up/down or gate_up/down set.
    pub fn new(files: Vec<PathBuf>, mut entries: Vec<(SlabId, SlabLoc)>) -> Result<Catalog> {
        entries.sort_by_key(|e| e.0);
        let mut index = HashMap::with_capacity(entries.len());
        let mut kinds: BTreeMap<(u32, u32), Vec<SlabKind>> = BTreeMap::new();
        let mut layers: BTreeMap<u32, LayerInfo> = BTreeMap::new();
        let mut total = 0u64;
        for (i, (id, loc)) in entries.iter().enumerate() {
            if index.insert(*id, i).is_some() {
                return Err(StoreError::DuplicateSlab { slab: *id });
            }
            if usize::from(loc.file) >= files.len() {
                return Err(StoreError::BadFileIndex { slab: *id, file: loc.file, n_files: files.len() });
            }
            let expected = loc.ty.row_bytes(loc.cols).and_then(|r| r.checked_mul(loc.rows));
            if expected != Some(loc.bytes) {
                let expected = match expected {
                    Some(e) => format!("{e} bytes"),
                    None => format!("an invalid size ({} is not a whole number of {}-weight blocks, or overflows)", loc.cols, loc.ty.block_elems()),
                };
                return Err(StoreError::SizeMismatch { slab: *id, bytes: loc.bytes, rows: loc.rows, cols: loc.cols, ty: loc.ty, expected });
            }
            if loc.offset.checked_add(loc.bytes).is_none() || loc.bytes == 0 {
                return Err(StoreError::RangeOverflow { slab: *id, offset: loc.offset, bytes: loc.bytes });
            }
            kinds.entry((id.layer, id.expert)).or_default().push(id.kind);
            let l = layers.entry(id.layer).or_default();
            l.bytes += loc.bytes;
            total += loc.bytes;
        }
        for (&(layer, expert), ks) in &kinds {
            let has = |k| ks.contains(&k);
            let layout = match (has(SlabKind::Gate), has(SlabKind::Up), has(SlabKind::GateUp), has(SlabKind::Down)) {
                (_, _, _, false) => return Err(StoreError::IncompleteTriple { layer, expert, reason: "no down projection" }),
                (true, true, false, true) => TripleLayout::Separate,
                (false, false, true, true) => TripleLayout::Fused,
                (_, _, true, true) => return Err(StoreError::IncompleteTriple { layer, expert, reason: "both fused gate_up and separate gate/up" }),
                _ => return Err(StoreError::IncompleteTriple { layer, expert, reason: "gate without up, or up without gate" }),
            };
            layers.get_mut(&layer).expect("layer recorded above").experts.insert(expert, layout);
        }
        Ok(Catalog { files, slabs: entries, index, layers, total })
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    pub fn file(&self, index: u16) -> Option<&Path> {
        self.files.get(usize::from(index)).map(PathBuf::as_path)
    }

    pub fn get(&self, id: SlabId) -> Option<&SlabLoc> {
        self.index.get(&id).map(|&i| &self.slabs[i].1)
    }

    /// Like [`Catalog::get`] but an error naming the slab.
    pub fn loc(&self, id: SlabId) -> Result<&SlabLoc> {
        self.get(id).ok_or(StoreError::UnknownSlab { slab: id })
    }

    /// A dense index in `0..len()`, stable for this catalogue (sorted order).
    pub fn slab_index(&self, id: SlabId) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// All slabs in id order.
    pub fn slabs(&self) -> &[(SlabId, SlabLoc)] {
        &self.slabs
    }

    pub fn len(&self) -> usize {
        self.slabs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slabs.is_empty()
    }

    pub fn triple(&self, layer: u32, expert: u32) -> Option<Triple> {
        let layout = *self.layers.get(&layer)?.experts.get(&expert)?;
        Some(Triple { layer, expert, layout })
    }

    /// Every triple in (layer, expert) order.
    pub fn triples(&self) -> impl Iterator<Item = Triple> + '_ {
        self.layers.iter().flat_map(|(&layer, l)| l.experts.iter().map(move |(&expert, &layout)| Triple { layer, expert, layout }))
    }

    /// Bytes of all slabs of one triple.
    pub fn triple_bytes(&self, t: Triple) -> u64 {
        t.slabs().filter_map(|id| self.get(id)).map(|l| l.bytes).sum()
    }

    /// MoE layers with at least one slab, ascending.
    pub fn layers(&self) -> impl Iterator<Item = u32> + '_ {
        self.layers.keys().copied()
    }

    /// Expert ids of one layer, ascending (empty for an unknown layer).
    pub fn experts(&self, layer: u32) -> impl Iterator<Item = u32> + '_ {
        self.layers.get(&layer).into_iter().flat_map(|l| l.experts.keys().copied())
    }

    pub fn layer_bytes(&self, layer: u32) -> u64 {
        self.layers.get(&layer).map_or(0, |l| l.bytes)
    }

    pub fn total_bytes(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(file: u16, offset: u64) -> SlabLoc {
        // 4 rows of 32 q8_0 weights: 4 * 34 bytes.
        SlabLoc { file, offset, bytes: 136, ty: GgmlType::Q8_0, rows: 4, cols: 32 }
    }

    fn separate(layer: u32, expert: u32, base: u64) -> Vec<(SlabId, SlabLoc)> {
        [SlabKind::Gate, SlabKind::Up, SlabKind::Down]
            .iter()
            .enumerate()
            .map(|(i, &k)| (SlabId::new(layer, k, expert), loc(0, base + i as u64 * 136)))
            .collect()
    }

    #[test]
    fn lookups_triples_and_totals() {
        let mut e = separate(1, 0, 0);
        e.extend(separate(1, 5, 1000));
        e.push((SlabId::new(3, SlabKind::GateUp, 2), SlabLoc { rows: 8, bytes: 272, ..loc(0, 5000) }));
        e.push((SlabId::new(3, SlabKind::Down, 2), loc(0, 6000)));
        let c = Catalog::new(vec!["a.gguf".into()], e).unwrap();
        assert_eq!(c.len(), 8);
        assert_eq!(c.get(SlabId::new(1, SlabKind::Up, 5)).unwrap().offset, 1136);
        assert!(c.get(SlabId::new(1, SlabKind::Up, 4)).is_none());
        assert!(matches!(c.loc(SlabId::new(9, SlabKind::Up, 0)), Err(StoreError::UnknownSlab { .. })));
        assert_eq!(c.layers().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(c.experts(1).collect::<Vec<_>>(), vec![0, 5]);
        assert_eq!(c.layer_bytes(1), 6 * 136);
        assert_eq!(c.layer_bytes(3), 272 + 136);
        assert_eq!(c.total_bytes(), 6 * 136 + 272 + 136);
        let t = c.triple(3, 2).unwrap();
        assert_eq!(t.layout, TripleLayout::Fused);
        assert_eq!(t.slabs().collect::<Vec<_>>(), vec![SlabId::new(3, SlabKind::GateUp, 2), SlabId::new(3, SlabKind::Down, 2)]);
        assert_eq!(c.triple_bytes(t), 408);
        assert_eq!(c.triples().count(), 3);
        assert_eq!(c.triple(1, 5).unwrap().slabs().count(), 3);
        assert_eq!(SlabId::new(3, SlabKind::GateUp, 2).to_string(), "blk.3.ffn_gate_up_exps[2]");
    }

    #[test]
    fn rejects_bad_entries_naming_the_slab() {
        let files = || vec![PathBuf::from("a.gguf")];
        let mut dup = separate(0, 0, 0);
        dup.push(dup[0]);
        assert!(matches!(Catalog::new(files(), dup), Err(StoreError::DuplicateSlab { .. })));

        let mut bad_file = separate(0, 0, 0);
        bad_file[1].1.file = 1;
        let err = Catalog::new(files(), bad_file).unwrap_err();
        assert!(err.to_string().contains("blk.0.ffn_up_exps[0]"), "{err}");

        let mut bad_size = separate(0, 0, 0);
        bad_size[2].1.bytes = 135;
        assert!(matches!(Catalog::new(files(), bad_size), Err(StoreError::SizeMismatch { .. })));

        let mut bad_cols = separate(0, 0, 0);
        bad_cols[0].1.cols = 33;
        assert!(matches!(Catalog::new(files(), bad_cols), Err(StoreError::SizeMismatch { .. })));

        let mut overflow = separate(0, 0, 0);
        overflow[0].1.offset = u64::MAX - 10;
        assert!(matches!(Catalog::new(files(), overflow), Err(StoreError::RangeOverflow { .. })));

        let mut no_up = separate(0, 0, 0);
        no_up.remove(1);
        assert!(matches!(Catalog::new(files(), no_up), Err(StoreError::IncompleteTriple { .. })));

        let mut mixed = separate(0, 0, 0);
        mixed.push((SlabId::new(0, SlabKind::GateUp, 0), SlabLoc { rows: 8, bytes: 272, ..loc(0, 9000) }));
        assert!(matches!(Catalog::new(files(), mixed), Err(StoreError::IncompleteTriple { .. })));
    }
}
