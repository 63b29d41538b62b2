//! Writes the fuzz seed `fuzz/seeds/parse/small.gguf`: a small valid file
//! with every value type, a nested array and 3-D expert tensors.
use pulsar_gguf::{Array, GgmlType, GgufWriter, Value};

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "host/gguf/fuzz/seeds/parse/small.gguf".into());
    let mut w = GgufWriter::new();
    let kvs: Vec<(&str, Value)> = vec![
        ("general.architecture", "test".into()),
        ("t.u8", 1u8.into()), ("t.i8", (-1i8).into()), ("t.u16", 2u16.into()), ("t.i16", (-2i16).into()),
        ("t.u32", 3u32.into()), ("t.i32", (-3i32).into()), ("t.u64", 4u64.into()), ("t.i64", (-4i64).into()),
        ("t.f32", 0.5f32.into()), ("t.f64", 0.25f64.into()), ("t.bool", true.into()),
        ("tokenizer.ggml.tokens", vec!["<pad>", "<eos>", "a"].into()),
        ("tokenizer.ggml.scores", vec![0f32, -1.0, -2.0].into()),
        ("t.nested", vec![Array::U16(vec![1, 2]), Array::Array(vec![Array::Bool(vec![false])])].into()),
    ];
    for (k, v) in kvs {
        w.add_kv(k, v).unwrap();
    }
    w.add_tensor("blk.0.ffn_down_exps.weight", &[96, 2, 3], GgmlType::Q8_0).unwrap();
    w.add_tensor("blk.0.ffn_gate_up_exps.weight", &[256, 2, 2], GgmlType::Q4_K).unwrap();
    w.add_tensor("output_norm.weight", &[4], GgmlType::F32).unwrap();
    let mut d = w.create(&out).unwrap();
    for t in d.tensors().to_vec() {
        d.write_tensor(&t.name, &vec![0x11; t.n_bytes as usize]).unwrap();
    }
    d.finish().unwrap();
    println!("{out}");
}
