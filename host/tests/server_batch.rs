//! Multi-sequence batching: rows of several sequences in one forward step give
//! the same logits, bit for bit, as each sequence run alone; slots, prefix
//! reuse and misuse errors of the sequence pool.

#[path = "server/common.rs"]
mod common;

use pulsar_host::cpu::{CpuBackend, MappedExperts};
use pulsar_host::cuda::{CudaEngine, CudaKv, CudaModel, CudaSeqs, LoadOptions};
use pulsar_host::engine::{BatchEngine, BatchItem, Engine, EngineError, SeqBackend, SeqId};
use pulsar_host::model::Model;
use pulsar_host::sample::argmax;

/// Logits of every step of one sequence run alone: the prompt's last row, then
/// one row per greedy decode.
fn solo(model: &Model, cpu: &CpuBackend, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut eng = Engine::new(model, cpu, &MappedExperts, 256);
    let mut rows = vec![eng.forward(prompt, false).unwrap().pop().unwrap()];
    let mut toks = Vec::new();
    for _ in 0..n {
        let t = argmax(rows.last().unwrap());
        toks.push(t);
        rows.push(eng.forward(&[t], false).unwrap().pop().unwrap());
    }
    (toks, rows)
}

/// Two sequences, staggered: B's prompt prefills in the same step as A's
/// first decode, then both decode together (fed the solo runs' greedy
/// tokens `ta` / `tb`). Returns every row each sequence got.
fn batched<B: SeqBackend>(be: &mut BatchEngine<B>, a: &[u32], b: &[u32], ta: &[u32], tb: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let n = ta.len();
    let (sa, ca) = be.alloc(a).unwrap();
    assert_eq!(ca, 0);
    // Step 1: A's prompt alone.
    let mut got_a = vec![be.step(&[BatchItem { seq: sa, tokens: a }]).unwrap().pop().unwrap()];
    // B's prompt may share a prefix with A's (gemma's BOS): that much is
    // copied from A's cache, the rest runs.
    let (sb, cb) = be.alloc(b).unwrap();
    assert_ne!(sa, sb);
    // Step 2: A decodes one token while B's prompt prefills (B first in the batch).
    let out = be.step(&[BatchItem { seq: sb, tokens: &b[cb..] }, BatchItem { seq: sa, tokens: &ta[..1] }]).unwrap();
    assert_eq!(out.len(), 2);
    let mut got_b = vec![out[0].clone()];
    got_a.push(out[1].clone());
    // Then both decode together.
    for i in 0..n {
        let mut items = vec![BatchItem { seq: sb, tokens: std::slice::from_ref(&tb[i]) }];
        if i + 1 < n {
            items.push(BatchItem { seq: sa, tokens: std::slice::from_ref(&ta[i + 1]) });
        }
        let out = be.step(&items).unwrap();
        got_b.push(out[0].clone());
        if i + 1 < n {
            got_a.push(out[1].clone());
        }
    }
    assert_eq!(be.n_past(sa).unwrap(), a.len() + n);
    assert_eq!(be.n_past(sb).unwrap(), b.len() + n);
    (got_a, got_b)
}

fn assert_rows_equal(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(x == y, "{what} step {i}: batched logits differ from solo (max |d| {})", max_diff(x, y));
    }
}

/// Every row of the staggered batch must equal the solo run's.
fn check_batched_equals_solo(model: &Model, a: &[u32], b: &[u32]) {
    let cpu = CpuBackend::new(2).unwrap();
    let n = 6;
    let (ta, ra) = solo(model, &cpu, a, n);
    let (tb, rb) = solo(model, &cpu, b, n);
    let mut be = BatchEngine::new(model, &cpu, &MappedExperts, 256, 3);
    let (got_a, got_b) = batched(&mut be, a, b, &ta, &tb);
    assert_rows_equal("sequence A", &got_a, &ra);
    assert_rows_equal("sequence B", &got_b, &rb);
}

/// On a machine with a GPU (else it says so and passes: CI has none; the GPU
/// machine runs this binary): the same staggered batch through the CUDA
/// backend's sequence pool (rows of both sequences in one CUDA step, each
/// attending over its own cache) equals, bit for bit, each sequence run
/// alone on the CPU and alone on the GPU.
fn check_cuda_batched_equals_solo(model: &Model, a: &[u32], b: &[u32]) {
    let Ok(dev) = pulsar_cuda::CudaDevice::open(0) else {
        eprintln!("no CUDA device: the CUDA batch check is skipped");
        return;
    };
    let cpu = CpuBackend::new(2).unwrap();
    let n = 6;
    let (ta, ra) = solo(model, &cpu, a, n);
    let (tb, rb) = solo(model, &cpu, b, n);
    let opts = LoadOptions { kv_bytes: 4 * CudaKv::bytes_for(model, 256), lane_threads: Some(0), ..Default::default() };
    let cm = CudaModel::load(dev, model, &opts).unwrap();
    // Alone on the GPU, as the CLI runs it.
    let mut one = CudaEngine::new(model, &cm, 256).unwrap();
    let mut alone = vec![one.forward(a, false).unwrap().pop().unwrap()];
    for &t in &ta {
        alone.push(one.forward(&[t], false).unwrap().pop().unwrap());
    }
    assert_rows_equal("sequence A alone on CUDA vs the CPU", &alone, &ra);
    let seqs = CudaSeqs::new(model, &cm, None).unwrap();
    assert!(seqs.batches(), "this family's steps should batch on CUDA");
    let mut be = BatchEngine::with_backend(seqs, 256, 3).unwrap();
    let (got_a, got_b) = batched(&mut be, a, b, &ta, &tb);
    assert_rows_equal("sequence A (CUDA batch)", &got_a, &ra);
    assert_rows_equal("sequence B (CUDA batch)", &got_b, &rb);
    // Three at once, one of them prefilling: the slot B left runs a new prompt.
    let c: Vec<u32> = b.iter().rev().copied().collect();
    let (tc, rc) = solo(model, &cpu, &c, 2);
    let mut be = BatchEngine::with_backend(CudaSeqs::new(model, &cm, None).unwrap(), 256, 3).unwrap();
    let (sa, _) = be.alloc(a).unwrap();
    // Nothing cached yet to share: both prompts run whole.
    let (sb, cb) = be.alloc(b).unwrap();
    assert_eq!(cb, 0);
    let out = be.step(&[BatchItem { seq: sa, tokens: a }, BatchItem { seq: sb, tokens: b }]).unwrap();
    assert_rows_equal("two prompts in one CUDA step", &out, &[ra[0].clone(), rb[0].clone()]);
    let (sc, cc) = be.alloc(&c).unwrap();
    let out = be.step(&[BatchItem { seq: sa, tokens: &ta[..1] }, BatchItem { seq: sc, tokens: &c[cc..] }, BatchItem { seq: sb, tokens: &tb[..1] }]).unwrap();
    assert_rows_equal("two decodes around a prompt in one CUDA step", &out, &[ra[1].clone(), rc[0].clone(), rb[1].clone()]);
    let out = be.step(&[BatchItem { seq: sc, tokens: &tc[..1] }]).unwrap();
    assert_rows_equal("a decode alone after the batch", &out, &rc[1..2]);
    drop(be);
    // Paged caches (every one, however small) drawing on a pool of one
    // context and a half: the same bits, and memory only while cached.
    let mut be = BatchEngine::with_backend(CudaSeqs::new(model, &cm, None).unwrap().paged_from(0), 256, 3).unwrap().with_kv_pool(384);
    assert_eq!(be.kv_bytes(), 0, "paged caches hold no memory before they are used");
    let (got_a, got_b) = batched(&mut be, a, b, &ta, &tb);
    assert_rows_equal("sequence A (paged CUDA batch)", &got_a, &ra);
    assert_rows_equal("sequence B (paged CUDA batch)", &got_b, &rb);
    assert!(be.kv_bytes() > 0);
    be.forget_free();
    assert!(be.kv_bytes() > 0, "running sequences keep their pages");
    for s in 0..3 {
        be.free(SeqId(s));
    }
    be.forget_free();
    assert_eq!(be.kv_bytes(), 0, "evicted caches give their pages back");
    assert_eq!(be.kv_usage().used + be.kv_usage().cached, 0);
    // And again after the pages went back: the same bits.
    let (got_a, _) = batched(&mut be, a, b, &ta, &tb);
    assert_rows_equal("sequence A (paged, pages mapped again)", &got_a, &ra);
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn qwen3moe_batched_step_equals_each_sequence_alone() {
    let model = common::tiny_model();
    let a: Vec<u32> = "Hello there, how are you?".bytes().map(u32::from).collect();
    let b: Vec<u32> = "Two".bytes().map(u32::from).collect();
    check_batched_equals_solo(&model, &a, &b);
}

#[test]
fn on_a_gpu_qwen3moe_batched_cuda_steps_equal_each_sequence_alone() {
    let model = common::tiny_model();
    let a: Vec<u32> = "Hello there, how are you?".bytes().map(u32::from).collect();
    let b: Vec<u32> = "Two".bytes().map(u32::from).collect();
    check_cuda_batched_equals_solo(&model, &a, &b);
}

#[test]
fn gemma3_batched_step_equals_each_sequence_alone() {
    let p = std::env::var_os("PULSAR_GEMMA_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf"));
    assert!(p.is_file(), "{} is missing: run scripts/fetch-gemma.sh", p.display());
    let model = Model::open(&p, "gemma3", pulsar_arch_gemma3::plugin_module()).unwrap();
    check_batched_equals_solo(&model, &[2, 818, 5279, 529, 7001, 563], &[2, 9259, 236764]);
}

/// gemma3 (the parity fixture: sliding-window and full layers, soft-capping,
/// a 7-layer stack) through the CUDA batch.
#[test]
fn on_a_gpu_gemma3_batched_cuda_steps_equal_each_sequence_alone() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/parity/gemma3/model-f32.gguf");
    let model = Model::open(&p, "gemma3", pulsar_arch_gemma3::plugin_module()).unwrap();
    check_cuda_batched_equals_solo(&model, &[2, 81, 52, 29, 70, 56, 300, 12, 9], &[2, 92, 236]);
}

/// Two requests sharing a system prompt, the second arriving while the
/// first still runs: the second's slot copies the first's cached rows of the
/// shared prefix instead of computing them, and its logits are a solo run's.
fn check_shared_prefix_copied<B: SeqBackend>(model: &Model, mut be: BatchEngine<B>) {
    let cpu = CpuBackend::new(2).unwrap();
    let system: Vec<u32> = "You are terse. Answer in one word.".bytes().map(u32::from).collect();
    let (mut p1, mut p2) = (system.clone(), system.clone());
    p1.extend("Hi?".bytes().map(u32::from));
    p2.extend("Why?".bytes().map(u32::from));
    let (s1, c1) = be.alloc(&p1).unwrap();
    assert_eq!(c1, 0);
    be.step(&[BatchItem { seq: s1, tokens: &p1 }]).unwrap();
    be.step(&[BatchItem { seq: s1, tokens: &[7] }]).unwrap();
    let (s2, c2) = be.alloc(&p2).unwrap();
    assert_ne!(s1, s2);
    assert_eq!(c2, system.len(), "the shared system prompt was not taken from the running sequence");
    // The copy's rows and the donor's continue together, each as if alone.
    let out = be.step(&[BatchItem { seq: s2, tokens: &p2[c2..] }, BatchItem { seq: s1, tokens: &[8] }]).unwrap();
    let (_, r2) = solo(model, &cpu, &p2, 0);
    let mut alone = Engine::new(model, &cpu, &MappedExperts, 256);
    alone.forward(&p1, false).unwrap();
    alone.forward(&[7], false).unwrap();
    let r1 = alone.forward(&[8], false).unwrap().pop().unwrap();
    assert_rows_equal("shared-prefix copies", &out, &[r2[0].clone(), r1]);
}

#[test]
fn a_running_sequences_prefix_is_copied_for_a_request_that_shares_it() {
    let model = common::tiny_model();
    let cpu = CpuBackend::new(2).unwrap();
    check_shared_prefix_copied(&model, BatchEngine::new(&model, &cpu, &MappedExperts, 256, 3));
}

#[test]
fn on_a_gpu_a_running_sequences_prefix_is_copied_on_the_device() {
    let Ok(dev) = pulsar_cuda::CudaDevice::open(0) else {
        eprintln!("no CUDA device: the CUDA prefix copy check is skipped");
        return;
    };
    let model = common::tiny_model();
    let opts = LoadOptions { kv_bytes: 3 * CudaKv::bytes_for(&model, 256), lane_threads: Some(0), ..Default::default() };
    let cm = CudaModel::load(dev, &model, &opts).unwrap();
    check_shared_prefix_copied(&model, BatchEngine::with_backend(CudaSeqs::new(&model, &cm, None).unwrap(), 256, 3).unwrap());
}

#[test]
fn slots_prefix_reuse_and_errors() {
    let model = common::tiny_model();
    let cpu = CpuBackend::new(1).unwrap();
    let mut be = BatchEngine::new(&model, &cpu, &MappedExperts, 32, 2);
    let conv: Vec<u32> = (10..20).collect();
    let (s0, c0) = be.alloc(&conv).unwrap();
    assert_eq!(c0, 0);
    let solo_last = be.step(&[BatchItem { seq: s0, tokens: &conv }]).unwrap().pop().unwrap();
    be.free(s0);
    // The same conversation continued reuses the cached prefix of the free slot.
    let mut longer = conv.clone();
    longer.extend([30, 31, 32]);
    let (s1, c1) = be.alloc(&longer).unwrap();
    assert_eq!((s1, c1), (s0, conv.len()));
    // Asking again for the exact same prompt keeps all but its last token.
    be.free(s1);
    let (s2, c2) = be.alloc(&conv).unwrap();
    assert_eq!((s2, c2), (s0, conv.len() - 1));
    let again = be.step(&[BatchItem { seq: s2, tokens: &conv[c2..] }]).unwrap().pop().unwrap();
    assert_eq!(again, solo_last, "logits after prefix reuse differ from the cold run");
    // Pool exhausted, double use in one step, unknown slot, context overflow.
    let (s3, _) = be.alloc(&[1, 2]).unwrap();
    assert!(be.alloc(&[1]).is_none());
    assert!(matches!(be.step(&[BatchItem { seq: s3, tokens: &[1] }, BatchItem { seq: s3, tokens: &[2] }]), Err(EngineError::DuplicateSeq(_))));
    assert!(matches!(be.step(&[BatchItem { seq: SeqId(7), tokens: &[1] }]), Err(EngineError::NoSuchSeq(7))));
    let long: Vec<u32> = (0..33).collect();
    assert!(matches!(be.step(&[BatchItem { seq: s3, tokens: &long }]), Err(EngineError::ContextFull { .. })));
    be.free(s3);
    assert!(matches!(be.step(&[BatchItem { seq: s3, tokens: &[1] }]), Err(EngineError::NoSuchSeq(_))));
}

/// Prefix reuse on a delta-net hybrid (qwen35moe fixture): a slot's state can
/// go back only to its checkpoint (the end of its last prompt) or stay at the
/// history's end. A conversation that goes on reuses all of it; a next turn
/// whose render of the reply differs goes back to the checkpoint; a prompt
/// sharing less than that recomputes from the start: never a wrong state.
/// Each gives the logits of a run that never shared a slot.
#[test]
fn hybrid_prefix_reuse_only_from_a_state_checkpoint() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/parity/qwen35moe/model-f32.gguf");
    let (name, module) = common::plugin("qwen35moe");
    let model = Model::open(&p, &name, module).unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    check_hybrid_reuse(&model, &cpu, BatchEngine::new(&model, &cpu, &MappedExperts, 64, 2));
}

/// On a GPU (else skipped): the same through the CUDA sequence pool, whose
/// checkpoints are device states copied to the host and back; every step
/// equals the CPU run alone bit for bit (the hybrid runs one sequence a step).
#[test]
fn on_a_gpu_hybrid_prefix_reuse_only_from_a_state_checkpoint() {
    let Ok(dev) = pulsar_cuda::CudaDevice::open(0) else {
        eprintln!("no CUDA device: the CUDA hybrid reuse check is skipped");
        return;
    };
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/parity/qwen35moe/model-f32.gguf");
    let (name, module) = common::plugin("qwen35moe");
    let model = Model::open(&p, &name, module).unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    let opts = LoadOptions { kv_bytes: 2 * CudaKv::bytes_for(&model, 64), lane_threads: Some(0), ..Default::default() };
    let cm = CudaModel::load(dev, &model, &opts).unwrap();
    let seqs = CudaSeqs::new(&model, &cm, None).unwrap();
    assert!(!seqs.batches(), "a recurrent family runs one sequence a step on CUDA");
    check_hybrid_reuse(&model, &cpu, BatchEngine::with_backend(seqs, 64, 2).unwrap());
}

fn check_hybrid_reuse<B: SeqBackend>(model: &Model, cpu: &CpuBackend, mut be: BatchEngine<B>) {
    // A run alone on the CPU, its tokens fed in the given pieces (the same
    // steps, so the same order of sums as the batched engine's).
    let alone = |pieces: &[&[u32]]| {
        let mut e = Engine::new(model, cpu, &MappedExperts, 64);
        let mut last = Vec::new();
        for p in pieces {
            last = e.forward(p, false).unwrap().pop().unwrap();
        }
        last
    };
    let conv: Vec<u32> = (10..20).collect();
    let (s0, c0) = be.alloc(&conv).unwrap();
    assert_eq!(c0, 0);
    be.step(&[BatchItem { seq: s0, tokens: &conv }]).unwrap();
    be.free(s0);
    // The conversation goes on: the whole history is reused.
    let mut longer = conv.clone();
    longer.extend([30, 31, 32]);
    let (s1, c1) = be.alloc(&longer).unwrap();
    assert_eq!((s1, c1), (s0, conv.len()));
    let got = be.step(&[BatchItem { seq: s1, tokens: &longer[c1..] }]).unwrap().pop().unwrap();
    assert!(got == alone(&[&conv, &longer[c1..]]), "continuing a reused hybrid history differs from a run alone");
    // A two-token reply, decoded one by one.
    for t in [5u32, 6] {
        be.step(&[BatchItem { seq: s1, tokens: &[t] }]).unwrap();
    }
    be.free(s1);
    // The next turn renders the reply otherwise: back to the prompt's end.
    let mut next = longer.clone();
    next.extend([70, 71]);
    let (s2, c2) = be.alloc(&next).unwrap();
    assert_eq!((s2, c2), (s0, longer.len()), "the slot did not go back to its checkpoint");
    let got = be.step(&[BatchItem { seq: s2, tokens: &next[c2..] }]).unwrap().pop().unwrap();
    assert!(got == alone(&[&conv, &longer[conv.len()..], &next[c2..]]), "a turn resumed from a checkpoint differs from a run alone");
    be.free(s2);
    // A prompt sharing only the first five tokens: nothing is reused.
    let mut other = conv[..5].to_vec();
    other.extend([40, 41]);
    let (s3, c3) = be.alloc(&other).unwrap();
    assert_eq!(c3, 0, "a recurrent state was kept past the point the prompts diverge");
    let got = be.step(&[BatchItem { seq: s3, tokens: &other }]).unwrap().pop().unwrap();
    assert!(got == alone(&[&other]), "a recomputed hybrid prompt differs from a run alone");
}


/// A graph that reads a sequence's whole cache (qwen4exp: QSA attention
/// composed over the cache, PLE's token history) cannot batch several
/// sequences in one step: the engine runs them one a step, and each gets
/// the logits of a run alone, prompts and decodes alike.
#[test]
fn several_sequences_of_a_whole_cache_graph_step_together() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/parity/qwen4exp/model-f32.gguf");
    let (name, module) = common::plugin("qwen4exp");
    let model = Model::open(&p, &name, module).unwrap();
    let cpu = CpuBackend::new(2).unwrap();
    let alone = |pieces: &[&[u32]]| {
        let mut e = Engine::new(&model, &cpu, &MappedExperts, 64);
        pieces.iter().map(|p| e.forward(p, false).unwrap().pop().unwrap()).collect::<Vec<_>>()
    };
    let (a, b): (Vec<u32>, Vec<u32>) = ((10..19).collect(), vec![381, 7, 8, 381, 9]);
    let mut be = BatchEngine::new(&model, &cpu, &MappedExperts, 64, 2);
    let (sa, _) = be.alloc(&a).unwrap();
    let (sb, _) = be.alloc(&b).unwrap();
    let first = be.step(&[BatchItem { seq: sa, tokens: &a }, BatchItem { seq: sb, tokens: &b }]).unwrap();
    let next = be.step(&[BatchItem { seq: sa, tokens: &[5] }, BatchItem { seq: sb, tokens: &[6] }]).unwrap();
    let (ra, rb) = (alone(&[&a, &[5]]), alone(&[&b, &[6]]));
    assert!(first[0] == ra[0] && first[1] == rb[0], "batched prompts differ from runs alone");
    assert!(next[0] == ra[1] && next[1] == rb[1], "batched decodes differ from runs alone");
}
