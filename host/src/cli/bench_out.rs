//! `bench` output in llama-bench's formats (`-o md|csv|json|jsonl`): its
//! columns first, with its names, then Pulsar's (which run, and the expert
//! traffic of each tier that moved bytes), so its tools read ours.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::bench::{Rate, Report, Test, Traffic};
use crate::model::Model;
use pulsar_gguf::GgmlType;
use pulsar_plugin_api::Role;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Md,
    Csv,
    Json,
    Jsonl,
}

/// llama.cpp's name of a `general.file_type` (`llama_ftype`).
fn ftype_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "all F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K - Medium",
        11 => "Q3_K - Small",
        12 => "Q3_K - Medium",
        13 => "Q3_K - Large",
        14 => "Q4_K - Small",
        15 => "Q4_K - Medium",
        16 => "Q5_K - Small",
        17 => "Q5_K - Medium",
        18 => "Q6_K",
        19 => "IQ2_XXS - 2.0625 bpw",
        20 => "IQ2_XS - 2.3125 bpw",
        21 => "Q2_K - Small",
        22 => "IQ3_XS - 3.3 bpw",
        23 => "IQ3_XXS - 3.0625 bpw",
        24 => "IQ1_S - 1.5625 bpw",
        25 => "IQ4_NL - 4.5 bpw",
        26 => "IQ3_S - 3.4375 bpw",
        27 => "IQ3_S mix - 3.66 bpw",
        28 => "IQ2_S - 2.5 bpw",
        29 => "IQ2_M - 2.7 bpw",
        30 => "IQ4_XS - 4.25 bpw",
        31 => "IQ1_M - 1.75 bpw",
        32 => "BF16",
        36 => "TQ1_0 - 1.69 bpw ternary",
        37 => "TQ2_0 - 2.06 bpw ternary",
        38 => "MXFP4 MoE",
        _ => return None,
    })
}

/// `235B`, `30B`, `4.5B`, `270M`.
fn count_label(n: f64) -> String {
    if n >= 10e9 {
        format!("{:.0}B", n / 1e9)
    } else if n >= 1e9 {
        let s = format!("{:.1}", n / 1e9);
        format!("{}B", s.trim_end_matches(".0"))
    } else if n >= 1e6 {
        format!("{:.0}M", n / 1e6)
    } else {
        format!("{:.0}K", n / 1e3)
    }
}

/// llama-bench's model column: `qwen3moe 235B.A22B Q2_K - Medium`. The
/// size is counted from the tensors (active parameters for an MoE: the
/// routed experts scaled by used / total); without `general.file_type` the
/// type is the one most bytes have, marked "(guessed)" as llama.cpp does.
pub fn model_type(model: &Model) -> String {
    let tensors = model.file.tensors();
    let total: u64 = tensors.iter().map(|t| t.n_elements()).sum();
    let experts: u64 = model.weights.iter().filter(|w| w.role == Role::RoutedExpert).map(|w| tensors[w.tensor].n_elements()).sum();
    let meta = model.file.metadata();
    let key = |k: &str| meta.get_u32(&format!("{}.{k}", model.arch)).ok().flatten();
    let mut size = count_label(total as f64);
    if let (true, Some(n), Some(k)) = (experts > 0, key("expert_count"), key("expert_used_count")) {
        if n > 0 {
            let active = (total - experts) as f64 + experts as f64 * k as f64 / n as f64;
            size = format!("{size}.A{}", count_label(active));
        }
    }
    let ftype = match meta.get_u32("general.file_type").ok().flatten().and_then(ftype_name) {
        Some(f) => f.to_string(),
        None => {
            let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
            for t in tensors.iter().filter(|t| t.dims.len() >= 2) {
                match by_type.iter_mut().find(|(ty, _)| *ty == t.ty) {
                    Some((_, b)) => *b += t.n_bytes,
                    None => by_type.push((t.ty, t.n_bytes)),
                }
            }
            by_type.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
            by_type.first().map_or("unknown".into(), |(ty, _)| format!("{} (guessed)", ty.name().to_uppercase()))
        }
    };
    format!("{} {size} {ftype}", model.arch)
}

/// The tier columns: JSON name, column title, the per-token bytes.
const TIERS: &[(&str, &str, fn(&Traffic) -> f64)] = &[
    ("vram_upload_bytes_per_token", "uploaded MiB/t", |t| t.vram_upload_bytes_per_token),
    ("vram_zero_copy_bytes_per_token", "zero-copy MiB/t", |t| t.vram_zero_copy_bytes_per_token),
    ("vram_cpu_lane_bytes_per_token", "CPU lane MiB/t", |t| t.vram_cpu_lane_bytes_per_token),
    ("disk_bytes_per_token", "disk MiB/t", |t| t.disk_bytes_per_token),
    ("host_bytes_per_token", "host cache MiB/t", |t| t.host_bytes_per_token),
    ("mapped_bytes_per_token", "mapped MiB/t", |t| t.mapped_bytes_per_token),
];

/// The tiers some test of the report moved bytes through.
fn moved(r: &Report) -> Vec<usize> {
    (0..TIERS.len()).filter(|&i| tests(r).any(|(_, t)| t.traffic.as_ref().is_some_and(|x| TIERS[i].2(x) > 0.0))).collect()
}

fn tests(r: &Report) -> impl Iterator<Item = (&str, &Test)> {
    r.runs.iter().flat_map(|run| run.tests.iter().map(move |t| (run.name.as_str(), t)))
}

pub fn render(r: &Report, f: Format) -> anyhow::Result<String> {
    Ok(match f {
        Format::Md => markdown(r),
        Format::Csv => csv(r),
        Format::Json => {
            let rows: Vec<String> = tests(r).map(|(run, t)| object(&record(r, run, t), "\n    ", "\n  ")).collect();
            format!("[\n  {}\n]\n", rows.join(",\n  "))
        }
        Format::Jsonl => {
            let mut s = String::new();
            for (run, t) in tests(r) {
                writeln!(s, "{}", object(&record(r, run, t), "", ""))?;
            }
            s
        }
    })
}

fn mib(b: f64) -> String {
    format!("{:.2}", b / 1048576.0)
}

fn markdown(r: &Report) -> String {
    let gib = r.file_bytes as f64 / (1u64 << 30) as f64;
    let tiers = moved(r);
    let has_floor = tests(r).any(|(_, t)| t.floor_tg_tok_s.is_some());
    let mut head = "| model | size | params | backend | threads | test | t/s | run |".to_string();
    let mut rule = "|---|---:|---:|---|---:|---|---:|---|".to_string();
    for &i in &tiers {
        head += &format!(" {} |", TIERS[i].1);
        rule += "---:|";
    }
    if has_floor {
        head += " floor t/s |";
        rule += "---:|";
    }
    let mut s = format!("{head}\n{rule}\n");
    for (run, t) in tests(r) {
        let _ = write!(
            s,
            "| {} | {gib:.2} GiB | {:.2} B | {} | {} | {} | {:.2} ± {:.2} | {run} |",
            r.model_type,
            r.params as f64 / 1e9,
            r.backend,
            r.threads,
            t.test,
            t.rate.mean,
            t.rate.sd
        );
        for &i in &tiers {
            let _ = write!(s, " {} |", t.traffic.as_ref().map_or(String::new(), |x| mib(TIERS[i].2(x))));
        }
        if has_floor {
            let _ = write!(s, " {} |", t.floor_tg_tok_s.map_or(String::new(), |f| format!("{f:.1}")));
        }
        s.push('\n');
    }
    // The rates behind the columns, only for tests that moved expert bytes.
    for (run, t) in tests(r) {
        let Some(x) = &t.traffic else { continue };
        let mut parts = Vec::new();
        if x.vram_upload_bytes_per_token + x.vram_zero_copy_bytes_per_token + x.vram_cpu_lane_bytes_per_token > 0.0 {
            parts.push(format!("VRAM pool hit rate {:.1}% ({:.1} GB/s uploads)", 100.0 * x.vram_hit_rate, x.h2d_gbps));
            parts.push(format!("prefetch precision {:.0}%", 100.0 * x.vram_prefetch_precision));
        }
        if x.vram_cpu_lane_bytes_per_token > 0.0 {
            parts.push(format!("CPU lane {:.1} GB/s, {:.2} ms/t", x.cpu_lane_gbps, x.cpu_lane_ms_per_token));
        }
        if x.link_wait_ms_per_token + x.route_wait_ms_per_token > 0.0 {
            parts.push(format!("host waits {:.2} ms link / {:.2} ms routing", x.link_wait_ms_per_token, x.route_wait_ms_per_token));
        }
        if x.disk_bytes_per_token + x.host_bytes_per_token > 0.0 {
            parts.push(format!("host cache hit rate {:.1}%, disk {:.2} GB/s, store prefetch precision {:.0}%", 100.0 * x.host_hit_rate, x.disk_gbps, 100.0 * x.prefetch_precision));
        }
        if !parts.is_empty() {
            let _ = write!(s, "\n{run} {} tiers: {}", t.test, parts.join(", "));
            if let Some(f) = t.floor_tg_tok_s {
                let _ = write!(s, "; floor {f:.1} tok/s");
            }
        }
    }
    for run in &r.runs {
        if let Some(c) = run.cold_cost.as_ref().filter(|c| !c.cpu_dot_gbs.is_empty()) {
            let _ = write!(s, "\n{} cold-path model after the run:\n{}", run.name, c.summary());
        }
    }
    let mut links = vec![format!("host copy {:.1} GB/s", r.links.host_copy_gbps)];
    if let Some(g) = r.links.disk_read_gbps {
        links.insert(0, format!("disk {g:.2} GB/s"));
    }
    if let Some(g) = r.links.h2d_pinned_gbps {
        links.push(format!("pinned host-to-device {g:.1} GB/s"));
    }
    let _ = writeln!(s, "\nlinks: {}", links.join(", "));
    s
}

/// ns per run from tokens per second.
fn ns(tokens: usize, ts: f64) -> f64 {
    if ts > 0.0 {
        tokens as f64 / ts * 1e9
    } else {
        0.0
    }
}

/// A record as one JSON object, its fields in order (serde_json's map sorts them).
fn object(rec: &[(&'static str, Value)], indent: &str, close: &str) -> String {
    let sep = if indent.is_empty() { ", " } else { "," };
    let fields: Vec<String> = rec.iter().map(|(k, v)| format!("{indent}\"{k}\": {v}")).collect();
    format!("{{{}{close}}}", fields.join(sep))
}

/// One test as llama-bench's record (its field names and order), then ours.
fn record(r: &Report, run: &str, t: &Test) -> Vec<(&'static str, Value)> {
    let tokens = t.n_prompt + t.n_gen;
    let samples_ns: Vec<f64> = t.rate.samples.iter().map(|&ts| ns(tokens, ts)).collect();
    let ns_rate = Rate::of(samples_ns.clone());
    let (avg_ns, sd_ns) = (ns_rate.mean, ns_rate.sd);
    let mut m = Vec::new();
    let mut put = |k: &'static str, v: Value| m.push((k, v));
    put("build_commit", json!(concat!("pulsar-", env!("CARGO_PKG_VERSION"))));
    put("build_number", json!(0));
    put("cpu_info", json!(r.cpu_info));
    put("gpu_info", json!(r.gpu_info));
    put("backends", json!(if r.gpu_info.is_empty() { "CPU" } else { "CUDA" }));
    put("model_filename", json!(r.model));
    put("model_type", json!(r.model_type));
    put("model_size", json!(r.file_bytes));
    put("model_n_params", json!(r.params));
    put("n_batch", json!(r.ubatch));
    put("n_ubatch", json!(r.ubatch));
    put("n_threads", json!(r.threads));
    put("n_prompt", json!(t.n_prompt));
    put("n_gen", json!(t.n_gen));
    put("n_depth", json!(t.n_depth));
    put("test_time", json!(t.test_time));
    put("avg_ns", json!(avg_ns.round() as u64));
    put("stddev_ns", json!(sd_ns.round() as u64));
    put("avg_ts", json!(t.rate.mean));
    put("stddev_ts", json!(t.rate.sd));
    put("samples_ns", json!(samples_ns.iter().map(|x| x.round() as u64).collect::<Vec<_>>()));
    put("samples_ts", json!(t.rate.samples));
    put("run", json!(run));
    if let Some(x) = &t.traffic {
        for &i in &moved(r) {
            put(TIERS[i].0, json!(TIERS[i].2(x)));
        }
        put("floor_tg_tok_s", json!(t.floor_tg_tok_s));
    }
    m
}

/// RFC 4180 quoting, as llama-bench quotes every field.
fn quote(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn csv(r: &Report) -> String {
    let rows: Vec<Vec<(&'static str, Value)>> = tests(r).map(|(run, t)| record(r, run, t)).collect();
    // One header for every row: the samples stay in JSON (llama-bench's CSV
    // has none either); tier columns where any row has them.
    let mut cols: Vec<&'static str> = Vec::new();
    for row in &rows {
        for (k, _) in row {
            if !k.starts_with("samples_") && !cols.contains(k) {
                cols.push(k);
            }
        }
    }
    let mut s = format!("{}\n", cols.join(","));
    for row in &rows {
        let cell = |c: &str| row.iter().find(|(k, _)| *k == c).map_or(Value::Null, |(_, v)| v.clone());
        let line: Vec<String> = cols.iter().map(|c| quote(&cell(c))).collect();
        let _ = writeln!(s, "{}", line.join(","));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_llama_cpp() {
        assert_eq!(count_label(235.09e9), "235B");
        assert_eq!(count_label(22.2e9), "22B");
        assert_eq!(count_label(4.02e9), "4B");
        assert_eq!(count_label(4.46e9), "4.5B");
        assert_eq!(count_label(268.1e6), "268M");
        assert_eq!(count_label(81.9e3), "82K");
        assert_eq!(ftype_name(10), Some("Q2_K - Medium"));
        assert_eq!(ftype_name(15), Some("Q4_K - Medium"));
        assert_eq!(ftype_name(99), None);
    }

    #[test]
    fn csv_quotes_like_rfc_4180() {
        assert_eq!(quote(&json!("a \"b\", c")), "\"a \"\"b\"\", c\"");
        assert_eq!(quote(&json!(3)), "\"3\"");
        assert_eq!(quote(&Value::Null), "\"\"");
    }
}
