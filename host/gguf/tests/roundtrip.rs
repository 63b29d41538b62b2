//! Write-then-read round trips of random metadata and tensor sets, plain and
//! split, through files and through memory.

use proptest::prelude::*;
use pulsar_gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};

/// Bitwise equality (NaN payloads included), which `PartialEq` on floats is not.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(x), Value::Array(y)) => same_array(x, y),
        _ => a == b,
    }
}

fn same_array(a: &Array, b: &Array) -> bool {
    match (a, b) {
        (Array::F32(x), Array::F32(y)) => x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())),
        (Array::F64(x), Array::F64(y)) => x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits())),
        (Array::Array(x), Array::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_array(p, q)),
        _ => a == b,
    }
}

fn flat_array() -> impl Strategy<Value = Array> {
    let n = 0..12usize;
    prop_oneof![
        prop::collection::vec(any::<u8>(), n.clone()).prop_map(Array::U8),
        prop::collection::vec(any::<i8>(), n.clone()).prop_map(Array::I8),
        prop::collection::vec(any::<u16>(), n.clone()).prop_map(Array::U16),
        prop::collection::vec(any::<i16>(), n.clone()).prop_map(Array::I16),
        prop::collection::vec(any::<u32>(), n.clone()).prop_map(Array::U32),
        prop::collection::vec(any::<i32>(), n.clone()).prop_map(Array::I32),
        prop::collection::vec(any::<u64>(), n.clone()).prop_map(Array::U64),
        prop::collection::vec(any::<i64>(), n.clone()).prop_map(Array::I64),
        prop::collection::vec(any::<u32>().prop_map(f32::from_bits), n.clone()).prop_map(Array::F32),
        prop::collection::vec(any::<u64>().prop_map(f64::from_bits), n.clone()).prop_map(Array::F64),
        prop::collection::vec(any::<bool>(), n.clone()).prop_map(Array::Bool),
        prop::collection::vec(".{0,12}", n).prop_map(Array::String),
    ]
}

fn array() -> impl Strategy<Value = Array> {
    flat_array().prop_recursive(3, 24, 4, |inner| prop::collection::vec(inner, 0..4).prop_map(Array::Array))
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<u32>().prop_map(|b| Value::F32(f32::from_bits(b))),
        any::<u64>().prop_map(|b| Value::F64(f64::from_bits(b))),
        any::<bool>().prop_map(Value::Bool),
        ".{0,40}".prop_map(Value::String),
        array().prop_map(Value::Array),
    ]
}

const TYPES: [GgmlType; 9] = [
    GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q5_0,
    GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::IQ2_XXS, GgmlType::MXFP4,
];

#[derive(Clone, Debug)]
struct TensorSpec {
    dims: Vec<u64>,
    ty: GgmlType,
    seed: u8,
}

fn tensor() -> impl Strategy<Value = TensorSpec> {
    (prop::sample::select(&TYPES[..]), 1..4u64, prop::collection::vec(1..4u64, 0..4), any::<u8>())
        .prop_map(|(ty, blocks, rest, seed)| {
            let mut dims = vec![blocks * ty.block_elems()];
            dims.extend(rest);
            TensorSpec { dims, ty, seed }
        })
}

fn pattern(seed: u8, n: u64) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[derive(Clone, Debug)]
struct Model {
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
    alignment: Option<u32>,
    max_shard: Option<u64>,
}

fn model() -> impl Strategy<Value = Model> {
    (
        prop::collection::vec(("[a-z]{1,6}(\\.[a-z_]{1,8}){0,2}", value()), 0..10),
        prop::collection::vec(tensor(), 0..8),
        prop::option::of(prop::sample::select(&[1u32, 8, 64, 4096][..])),
        prop::option::of(0..3000u64),
    )
        .prop_map(|(mut kvs, tensors, alignment, max_shard)| {
            let mut seen = std::collections::HashSet::new();
            kvs.retain(|(k, _)| k != "general.alignment" && seen.insert(k.clone()));
            Model { kvs, tensors, alignment, max_shard }
        })
}

fn build(m: &Model) -> GgufWriter {
    let mut w = GgufWriter::new();
    if let Some(a) = m.alignment {
        w.add_kv("general.alignment", a).unwrap();
    }
    for (k, v) in &m.kvs {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    for (i, t) in m.tensors.iter().enumerate() {
        w.add_tensor(format!("blk.{i}.w"), &t.dims, t.ty).unwrap();
    }
    if let Some(n) = m.max_shard {
        w.set_max_shard_bytes(n);
    }
    w.set_chunk_bytes(100);
    w
}

fn check(m: &Model, f: &GgufFile) -> Result<(), TestCaseError> {
    let user: Vec<_> = f.metadata().iter().filter(|(k, _)| !k.starts_with("split.")).collect();
    let offset = usize::from(m.alignment.is_some());
    prop_assert_eq!(user.len(), m.kvs.len() + offset);
    if let Some(a) = m.alignment {
        prop_assert_eq!(f.metadata().require_u32("general.alignment").unwrap(), a);
        prop_assert_eq!(f.alignment(), u64::from(a));
    }
    for ((k, v), (k2, v2)) in m.kvs.iter().zip(&user[offset..]) {
        prop_assert_eq!(k, k2);
        prop_assert!(same_value(v, v2), "{}: wrote {:?}, read {:?}", k, v, v2);
    }
    prop_assert_eq!(f.tensors().len(), m.tensors.len());
    let align = u64::from(m.alignment.unwrap_or(32));
    for (i, t) in m.tensors.iter().enumerate() {
        let got = f.tensor(&format!("blk.{i}.w")).unwrap();
        prop_assert_eq!(&got.dims, &t.dims);
        prop_assert_eq!(got.ty, t.ty);
        prop_assert_eq!(got.offset % align, 0);
        prop_assert_eq!(f.data(got), &pattern(t.seed, got.n_bytes)[..]);
    }
    Ok(())
}

fn write_data<S: pulsar_gguf::WriteAt>(m: &Model, mut d: pulsar_gguf::TensorDataWriter<S>) -> Vec<S> {
    for (i, t) in m.tensors.iter().enumerate() {
        let name = format!("blk.{i}.w");
        let n = d.tensors()[i].n_bytes;
        let bytes = pattern(t.seed, n);
        if i % 2 == 0 {
            d.write_tensor(&name, &bytes).unwrap();
        } else {
            d.write_tensor_with(&name, |at, buf| {
                buf.copy_from_slice(&bytes[at as usize..at as usize + buf.len()]);
                Ok(())
            })
            .unwrap();
        }
    }
    d.finish().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn in_memory_round_trip(m in model()) {
        let shards = write_data(&m, build(&m).in_memory().unwrap());
        let n = shards.len();
        let f = GgufFile::from_shard_bytes(shards).unwrap();
        prop_assert_eq!(f.n_shards(), n);
        prop_assert_eq!(f.version(), 3);
        check(&m, &f)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn file_round_trip_opening_any_shard(m in model(), pick in any::<prop::sample::Index>()) {
        let dir = tempfile::tempdir().unwrap();
        let d = build(&m).create(dir.path().join("m.gguf")).unwrap();
        let paths = d.shard_paths().to_vec();
        write_data(&m, d);
        let f = GgufFile::open(pick.get(&paths)).unwrap();
        prop_assert_eq!(f.shard_paths(), &paths[..]);
        check(&m, &f)?;
        if paths.len() > 1 {
            prop_assert_eq!(paths[0].file_name().unwrap().to_string_lossy(),
                format!("m-00001-of-{:05}.gguf", paths.len()));
            prop_assert_eq!(f.metadata().require_u32("split.count").unwrap() as usize, paths.len());
        }
        // The fingerprint is a function of the files, and changes with them.
        let again = GgufFile::open(&paths[0]).unwrap();
        prop_assert_eq!(f.fingerprint(), again.fingerprint());
    }
}

#[test]
fn splitting_actually_splits_and_fingerprints_differ() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test").unwrap();
    for i in 0..5 {
        w.add_tensor(format!("t{i}"), &[256], GgmlType::F32).unwrap(); // 1 KiB each
    }
    w.set_max_shard_bytes(2048);
    let dir = tempfile::tempdir().unwrap();
    let mut d = w.create(dir.path().join("x.gguf")).unwrap();
    for i in 0..5 {
        d.write_tensor(&format!("t{i}"), &[i as u8; 1024]).unwrap();
    }
    let paths = d.shard_paths().to_vec();
    d.finish().unwrap();
    let names: Vec<_> = paths.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["x-00001-of-00003.gguf", "x-00002-of-00003.gguf", "x-00003-of-00003.gguf"]);
    let f = GgufFile::open(&paths[2]).unwrap();
    assert_eq!(f.tensors().iter().map(|t| t.shard).collect::<Vec<_>>(), [0, 0, 1, 1, 2]);
    assert_eq!(f.architecture().unwrap(), "test");
    assert_eq!(f.data(f.tensor("t4").unwrap()), [4u8; 1024]);
    assert_eq!(f.metadata().require_i32("split.tensors.count").unwrap(), 5);

    // Same tensors unsplit: a different file set, a different fingerprint.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test").unwrap();
    for i in 0..5 {
        w.add_tensor(format!("t{i}"), &[256], GgmlType::F32).unwrap();
    }
    let mut d = w.in_memory().unwrap();
    for i in 0..5 {
        d.write_tensor(&format!("t{i}"), &[i as u8; 1024]).unwrap();
    }
    let g = GgufFile::from_shard_bytes(d.finish().unwrap()).unwrap();
    assert_eq!(g.n_shards(), 1);
    assert_ne!(f.fingerprint(), g.fingerprint());
}
