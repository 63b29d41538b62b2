//! `pulsar-host serve` end to end over loopback, in process, on a tiny
//! synthetic qwen3moe: the OpenAI routes with and without streaming, 64
//! concurrent streaming clients against a sequential run (also on the
//! qwen35moe fixture, a delta-net hybrid), a long prompt beside 16 decoding
//! streams, a client that disconnects mid-stream, bad requests, and
//! graceful shutdown.

#[path = "server/common.rs"]
mod common;
#[path = "server/http.rs"]
mod http;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use http::{content, Client};
use pulsar_host::cpu::{CpuBackend, MappedExperts};
use pulsar_host::model::Model;
use pulsar_host::server::{Backend, ServeOptions, Server, ShutdownHook, TierStats};
use serde_json::{json, Value};

const KEY: &str = "test-key";

fn start(parallel: usize, n_ctx: usize, hook: Option<ShutdownHook>) -> Server {
    start_with(parallel, n_ctx, hook, None)
}

fn start_with(parallel: usize, n_ctx: usize, hook: Option<ShutdownHook>, tier_stats: Option<TierStats>) -> Server {
    start_opts(parallel, n_ctx, hook, tier_stats, Duration::from_secs(1))
}

fn start_opts(parallel: usize, n_ctx: usize, hook: Option<ShutdownHook>, tier_stats: Option<TierStats>, grace: Duration) -> Server {
    start_model(common::tiny_model(), parallel, n_ctx, hook, tier_stats, grace)
}

fn start_model(model: Model, parallel: usize, n_ctx: usize, hook: Option<ShutdownHook>, tier_stats: Option<TierStats>, grace: Duration) -> Server {
    let backend = Backend { tier_stats, ..Backend::cpu(Arc::new(model), Arc::new(CpuBackend::new(2).unwrap()), Arc::new(MappedExperts)) };
    let opts = ServeOptions {
        port: 0,
        api_key: Some(KEY.into()),
        n_ctx,
        parallel,
        grace,
        model_id: "tiny".into(),
        ..ServeOptions::default()
    };
    Server::start(backend, opts, hook).unwrap()
}

fn chat_body(user: &str, stream: bool, max_tokens: usize, temperature: f64, seed: u64) -> Value {
    json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}],
        "stream": stream,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    })
}

fn metrics(c: &Client) -> Value {
    let r = c.get("/metrics?format=json");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn routes_streaming_and_not() {
    let srv = start(4, 512, None);
    let c = Client::new(srv.addr(), Some(KEY));
    let m = c.get("/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "tiny");
    assert_eq!(c.get("/v1/models/tiny").status, 200);
    assert_eq!(c.get("/v1/models/other").status, 404);

    // Chat: whole and streamed agree (greedy), usage and finish reason included.
    let r = c.post("/v1/chat/completions", &chat_body("Hello!", false, 12, 0.0, 1));
    let j = r.json();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    let (text, finish, usage) = content(&r, false);
    assert!(finish == "length" || finish == "stop", "{finish}");
    let n_prompt = usage["prompt_tokens"].as_u64().unwrap();
    let n_gen = usage["completion_tokens"].as_u64().unwrap();
    assert!(n_prompt > 10 && (1..=12).contains(&n_gen), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), n_prompt + n_gen);
    let s = c.post("/v1/chat/completions", &chat_body("Hello!", true, 12, 0.0, 1));
    assert!(s.header("content-type").unwrap().starts_with("text/event-stream"));
    let data = s.sse();
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (stext, sfinish, susage) = content(&s, true);
    assert_eq!((stext.as_str(), sfinish.as_str()), (text.as_str(), finish.as_str()));
    assert_eq!(susage["completion_tokens"], usage["completion_tokens"]);

    // Completions, both ways.
    let body = |stream| json!({"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "stream": stream});
    let r = c.post("/v1/completions", &body(false));
    assert_eq!(r.json()["object"], "text_completion");
    let (ctext, cfinish, _) = content(&r, false);
    let (stext, sfinish, _) = content(&c.post("/v1/completions", &body(true)), true);
    assert_eq!((ctext.as_str(), cfinish.as_str()), (stext.as_str(), sfinish.as_str()));

    // Seeded sampling repeats; top_k 1 is greedy whatever the temperature.
    let hot = |seed| content(&c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 16, "temperature": 1.5, "seed": seed})), false).0;
    assert_eq!(hot(7), hot(7));
    let greedy = content(&c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 16, "temperature": 0})), false).0;
    let top1 = content(&c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 16, "temperature": 1.5, "top_k": 1, "seed": 3})), false).0;
    assert_eq!(greedy, top1);

    // A stop string cuts the text before its first occurrence.
    let long = content(&c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 40, "temperature": 0})), false).0;
    let chars: Vec<char> = long.chars().collect();
    assert!(chars.len() > 4, "{long:?}");
    let stop = chars[3].to_string();
    let cut = &long[..long.find(&stop).unwrap()];
    for stream in [false, true] {
        let r = c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 40, "temperature": 0, "stop": [stop], "stream": stream}));
        let (t, f, _) = content(&r, stream);
        assert_eq!((t.as_str(), f.as_str()), (cut, "stop"), "stream {stream}");
    }

    // max_tokens is clamped to the context.
    let r = c.post("/v1/completions", &json!({"prompt": "abc", "max_tokens": 1_000_000, "temperature": 0}));
    let (_, _, usage) = content(&r, false);
    assert!(usage["total_tokens"].as_u64().unwrap() <= 512, "{usage}");

    // A continuing conversation reuses its cached prefix.
    let first = c.post("/v1/chat/completions", &chat_body("Tell me a story.", false, 8, 0.0, 1));
    let (reply, _, u1) = content(&first, false);
    let body = json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"}],
        "max_tokens": 4, "temperature": 0});
    let (_, _, u2) = content(&c.post("/v1/chat/completions", &body), false);
    let cached = u2["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= u1["prompt_tokens"].as_u64().unwrap(), "first turn {u1}, second {u2}");

    let m = metrics(&c);
    assert!(m["completion_tokens_total"].as_u64().unwrap() > 0 && m["prompt_tokens_cached_total"].as_u64().unwrap() >= cached, "{m}");
    assert!(m["expert_tier_hit_rates"].is_null());
    let prom = c.get("/metrics");
    assert!(prom.text().contains("pulsar_active_sequences 0") && prom.text().contains("pulsar_queue_depth 0"), "{}", prom.text());
    // The chat page is served.
    let ui = c.get("/");
    assert_eq!(ui.status, 200);
    assert!(ui.text().contains("/v1/chat/completions") && ui.header("content-type").unwrap().starts_with("text/html"));
    srv.shutdown().unwrap();
}

#[test]
fn sixty_four_concurrent_streams_match_a_sequential_run() {
    sixty_four_streams_against_sequential(start(8, 256, None));
}

/// The same on the qwen35moe fixture: every slot carries a recurrent and a
/// conv state besides its KV cache, and sequences that share a step must not
/// share (or leak into) each other's state.
#[test]
fn sixty_four_concurrent_streams_on_a_delta_net_hybrid_match_a_sequential_run() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/parity/qwen35moe/model-f32.gguf");
    let (name, module) = common::plugin("qwen35moe");
    let model = Model::open(&p, &name, module).unwrap();
    sixty_four_streams_against_sequential(start_model(model, 8, 256, None, None, Duration::from_secs(1)));
}

fn sixty_four_streams_against_sequential(srv: Server) {
    let c = Client::new(srv.addr(), Some(KEY));
    // Greedy for even clients, seeded temperature sampling for odd ones.
    let body = |i: usize, stream: bool| {
        let t = if i.is_multiple_of(2) { 0.0 } else { 0.9 };
        chat_body(&format!("Client {i} asks: what is {} times 7?", i * 3), stream, 32 + i % 5, t, 1000 + i as u64)
    };
    let t0 = Instant::now();
    let reference: Vec<(String, String)> = (0..64).map(|i| {
        let (t, f, _) = content(&c.post("/v1/chat/completions", &body(i, false)), false);
        (t, f)
    }).collect();
    let seq_secs = t0.elapsed().as_secs_f64();
    let m0 = metrics(&c);
    let steps_before = m0["steps_total"].as_u64().unwrap();
    let barrier = Arc::new(Barrier::new(64));
    let t1 = Instant::now();
    let threads: Vec<_> = (0..64)
        .map(|i| {
            let (addr, barrier, b) = (srv.addr(), barrier.clone(), body(i, true));
            std::thread::spawn(move || {
                let c = Client::new(addr, Some(KEY));
                barrier.wait();
                let r = c.post("/v1/chat/completions", &b);
                let (t, f, _) = content(&r, true);
                (t, f)
            })
        })
        .collect();
    let got: Vec<(String, String)> = threads.into_iter().map(|t| t.join().expect("client thread")).collect();
    let par_secs = t1.elapsed().as_secs_f64();
    for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
        assert_eq!(g, r, "client {i}: concurrent stream differs from the sequential run");
    }
    let m = metrics(&c);
    let steps = m["steps_total"].as_u64().unwrap() - steps_before;
    let tokens = m["completion_tokens_total"].as_u64().unwrap() - m0["completion_tokens_total"].as_u64().unwrap();
    println!("64 clients: sequential {seq_secs:.2} s, concurrent {par_secs:.2} s, {steps} batched steps for {tokens} tokens, {m}");
    // Sharing steps: on average at least 3 sequences per step (8 slots).
    assert!(steps * 3 < tokens, "{steps} steps for {tokens} tokens: sequences did not share steps");
    assert_eq!(m["active_sequences"], 0);
    assert_eq!(m["queue_depth"], 0);
    srv.shutdown().unwrap();
}

/// A long prompt arriving while 16 streams decode does not stop them: its
/// prefill is cut into chunks that share each step with the decodes, so
/// every stream keeps getting tokens while it runs. Counted in tokens, not
/// seconds (a loaded machine slows both alike): with a 48-row prompt share
/// per step (ubatch 64, 16 decodes), its ~1800 tokens take ~38 steps, and a
/// stream stalled behind a whole-prompt step would get none in that window.
#[test]
fn a_long_prompt_does_not_stall_sixteen_decoding_streams() {
    let backend = Backend::cpu(Arc::new(common::tiny_model()), Arc::new(CpuBackend::new(2).unwrap()), Arc::new(MappedExperts));
    let opts = ServeOptions { port: 0, api_key: Some(KEY.into()), n_ctx: 2048, parallel: 17, ubatch: 64, model_id: "tiny".into(), ..ServeOptions::default() };
    let srv = Server::start(backend, opts, None).unwrap();
    let c = Client::new(srv.addr(), Some(KEY));
    let stop = Arc::new(AtomicBool::new(false));
    // Each stream's token arrival times.
    let streams: Vec<_> = (0..16)
        .map(|i| {
            let (addr, stop) = (srv.addr(), stop.clone());
            std::thread::spawn(move || {
                use std::io::Read;
                let body = json!({"prompt": format!("Stream {i} says"), "max_tokens": 1500, "temperature": 0, "stream": true, "ignore_eos": true});
                let mut s = Client::new(addr, Some(KEY)).open_stream("/v1/completions", &body);
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let (mut raw, mut buf, mut times) = (Vec::new(), [0u8; 4096], Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let k = s.read(&mut buf).expect("read");
                    assert!(k > 0, "stream {i} ended before the test did");
                    raw.extend_from_slice(&buf[..k]);
                    let n = raw.windows(2).filter(|w| w == b"\n\n").count();
                    times.extend(std::iter::repeat_n(Instant::now(), n - times.len().min(n)));
                }
                times
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics(&c)["active_sequences"] != 16 || metrics(&c)["completion_tokens_total"].as_u64().unwrap() < 16 * 4 {
        assert!(Instant::now() < deadline, "the 16 streams never all started: {}", metrics(&c));
        std::thread::sleep(Duration::from_millis(5));
    }
    let prompt: String = (0..180).map(|k| format!("item {k:04}.")).collect();
    let t_submit = Instant::now();
    let mut long = c.open_stream("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": true}));
    http::read_events(&mut long, 1);
    let t_first = Instant::now();
    stop.store(true, Ordering::Relaxed);
    for (i, t) in streams.into_iter().enumerate() {
        let times = t.join().expect("stream thread");
        let during = times.iter().filter(|&&x| x > t_submit && x < t_first).count();
        // ~38 steps of prefill, one token a step each; half of that is a safe floor.
        assert!(during >= 15, "stream {i} got {during} tokens while the long prompt prefilled ({:?})", t_first - t_submit);
    }
    drop(long);
    srv.shutdown().unwrap();
}

/// Four sequences that together need more KV blocks than the pool holds
/// (each ~110 positions, the pool 304): the newest pauses when the pool runs
/// out and goes on once another finishes, and every one gives the text it
/// gives alone.
#[test]
fn a_kv_pool_smaller_than_every_slot_pauses_and_resumes_sequences() {
    let backend = Backend::cpu(Arc::new(common::tiny_model()), Arc::new(CpuBackend::new(2).unwrap()), Arc::new(MappedExperts));
    let opts = ServeOptions { port: 0, api_key: Some(KEY.into()), n_ctx: 256, parallel: 4, kv_pool: Some(304), model_id: "tiny".into(), ..ServeOptions::default() };
    let srv = Server::start(backend, opts, None).unwrap();
    let c = Client::new(srv.addr(), Some(KEY));
    let deadline = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let m = metrics(&c);
        if m["kv_blocks_total"] != 0 || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!((m["kv_blocks_total"].as_u64(), m["kv_block_positions"].as_u64()), (Some(19), Some(16)), "{m}");
    let body = |i: usize| json!({"prompt": format!("Client {i} counts"), "max_tokens": 100, "temperature": 0, "ignore_eos": true});
    let text = |r: &http::Resp| {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let alone: Vec<String> = (0..4).map(|i| text(&c.post("/v1/completions", &body(i)))).collect();
    assert_eq!(metrics(&c)["sequences_preempted"], 0, "one at a time fits");
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (addr, barrier, b) = (srv.addr(), barrier.clone(), body(i));
            std::thread::spawn(move || {
                let c = Client::new(addr, Some(KEY));
                barrier.wait();
                c.post("/v1/completions", &b)
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        assert_eq!(text(&t.join().unwrap()), alone[i], "client {i}: a paused and resumed sequence differs from its run alone");
    }
    let m = metrics(&c);
    assert!(m["sequences_preempted"].as_u64().unwrap() > 0, "the pool never ran out: {m}");
    assert_eq!((m["kv_blocks_used"].as_u64(), m["sequences_waiting_for_kv"].as_u64()), (Some(0), Some(0)), "{m}");
    assert!(m["kv_blocks_cached"].as_u64().unwrap() <= 19, "{m}");
    srv.shutdown().unwrap();
}

#[test]
fn a_client_that_disconnects_mid_stream_does_not_disturb_the_others() {
    let srv = start(2, 2048, None);
    let c = Client::new(srv.addr(), Some(KEY));
    let short = |i: u64, stream| chat_body(&format!("short request {i}"), stream, 16, 0.0, i);
    let refs: Vec<_> = (0..2).map(|i| content(&c.post("/v1/chat/completions", &short(i, false)), false)).collect();
    // A long generation (a prompt whose greedy reply does not stop early),
    // abandoned after a few events.
    let long = long_prompt(&c, 1500);
    let long = json!({"prompt": long, "max_tokens": 100_000, "temperature": 0, "stream": true});
    let before = metrics(&c)["completion_tokens_total"].as_u64().unwrap();
    let mut s = c.open_stream("/v1/completions", &long);
    http::read_events(&mut s, 3);
    let n0 = metrics(&c)["requests_total"].as_u64().unwrap();
    let wait_requests = |c: &Client, k: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while metrics(c)["requests_total"].as_u64().unwrap() < n0 + k {
            assert!(Instant::now() < deadline, "request {k} never reached the engine");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // B runs beside A; C waits for a slot (parallel 2) and gets A's once A is
    // gone. Each leaves once the one before is on the engine, and A is
    // dropped at once after: no sleeps that a fast machine could outrun.
    let (addr, b) = (srv.addr(), short(0, true));
    let tb = std::thread::spawn(move || content(&Client::new(addr, Some(KEY)).post("/v1/chat/completions", &b), true));
    wait_requests(&c, 1);
    let tc = {
        let b = short(1, true);
        std::thread::spawn(move || content(&Client::new(addr, Some(KEY)).post("/v1/chat/completions", &b), true))
    };
    wait_requests(&c, 2);
    drop(s);
    let (rb, rc) = (tb.join().unwrap(), tc.join().unwrap());
    assert_eq!((&rb.0, &rb.1), (&refs[0].0, &refs[0].1));
    assert_eq!((&rc.0, &rc.1), (&refs[1].0, &refs[1].1));
    // The abandoned generation stopped and freed its slot.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = metrics(&c);
        if m["requests_cancelled"] == 1 && m["active_sequences"] == 0 && m["kv_blocks_used"] == 0 {
            // B and C made 32 tokens at most; A would run to the context (~2040) if not stopped.
            let a_tokens = m["completion_tokens_total"].as_u64().unwrap() - before - 32;
            assert!(a_tokens < 1500, "the abandoned generation ran on: {m}");
            break;
        }
        assert!(Instant::now() < deadline, "slot or KV blocks not freed after the disconnect: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(content(&c.post("/v1/chat/completions", &short(0, false)), false).0, refs[0].0);
    // A non-streaming client that hangs up is noticed too.
    let whole = json!({"prompt": long_prompt_text(&long), "max_tokens": 100_000, "temperature": 0});
    let s = c.open_stream("/v1/completions", &whole);
    let deadline = Instant::now() + Duration::from_secs(20);
    while metrics(&c)["active_sequences"] != 1 {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = metrics(&c);
        if m["requests_cancelled"] == 2 && m["active_sequences"] == 0 && m["kv_blocks_used"] == 0 {
            // What the cancelled sequences wrote stays only as free slots' cached prefixes.
            assert!(m["kv_blocks_cached"].as_u64().unwrap() > 0, "{m}");
            break;
        }
        assert!(Instant::now() < deadline, "a non-streaming request kept running after its client left: {m}");
        std::thread::sleep(Duration::from_millis(50));
    }
    srv.shutdown().unwrap();
}

fn long_prompt_text(body: &Value) -> String {
    body["prompt"].as_str().unwrap().to_string()
}

/// A prompt whose greedy completion runs `n` tokens without a stop token
/// (the synthetic model's text is noise: some prompts end early).
fn long_prompt(c: &Client, n: usize) -> String {
    long_prompts(c, n, 1).remove(0)
}

fn long_prompts(c: &Client, n: usize, count: usize) -> Vec<String> {
    let mut out = Vec::new();
    for k in 0..60 {
        let p = format!("Story number {k}:");
        let (_, finish, usage) = content(&c.post("/v1/completions", &json!({"prompt": p, "max_tokens": n, "temperature": 0})), false);
        if finish == "length" && usage["completion_tokens"] == n {
            out.push(p);
            if out.len() == count {
                return out;
            }
        }
    }
    panic!("fewer than {count} of 60 prompts run {n} tokens");
}

fn error_of(r: &http::Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let j = r.json();
    let e = &j["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()) && e["type"].is_string() && e.get("code").is_some(), "not an OpenAI error object: {j}");
    e.clone()
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_stays_up() {
    let tiers: TierStats = Arc::new(|| json!({"vram": 0.25, "host": 0.5}));
    let srv = start_with(2, 128, None, Some(tiers));
    let c = Client::new(srv.addr(), Some(KEY));
    let anon = Client::new(srv.addr(), None);
    let wrong = Client::new(srv.addr(), Some("nope"));
    // Authentication: every route but /health (and the static page).
    let e = error_of(&anon.post("/v1/chat/completions", &chat_body("hi", false, 4, 0.0, 1)), 401);
    assert_eq!(e["type"], "authentication_error");
    error_of(&wrong.get("/v1/models"), 401);
    error_of(&anon.get("/metrics"), 401);
    assert_eq!(anon.get("/health").status, 200);
    // Malformed JSON, missing fields, wrong types, bad values.
    let post = |body: &str| c.raw("POST", "/v1/chat/completions", &[], body.as_bytes());
    let e = error_of(&post("{\"messages\": [}"), 400);
    assert_eq!(e["type"], "invalid_request_error");
    error_of(&post(""), 400);
    error_of(&post("{\"model\": \"x\"}"), 400);
    error_of(&post("{\"messages\": \"hi\"}"), 400);
    error_of(&post("{\"messages\": []}"), 400);
    error_of(&post("{\"messages\": [{\"role\": \"wizard\", \"content\": \"hi\"}]}"), 400);
    error_of(&c.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -1})), 400);
    error_of(&c.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "top_p": 0})), 400);
    error_of(&c.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "n": 2})), 400);
    error_of(&c.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 0})), 400);
    error_of(&c.post("/v1/completions", &json!({"prompt": ["a", "b"]})), 400);
    let e = error_of(&c.post("/v1/completions", &json!({"prompt": "x".repeat(200)})), 400);
    assert_eq!(e["code"], "context_length_exceeded");
    // Oversized body: 413 with the error object.
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(9 << 20));
    let e = error_of(&c.raw("POST", "/v1/completions", &[], big.as_bytes()), 413);
    assert_eq!(e["code"], "request_too_large");
    // DNS rebinding: foreign Host or Origin.
    error_of(&c.raw("GET", "/v1/models", &[("Host", "evil.example")], b""), 403);
    error_of(&c.raw("GET", "/v1/models", &[("Origin", "http://evil.example")], b""), 403);
    assert_eq!(c.raw("GET", "/v1/models", &[("Origin", "http://localhost:11435")], b"").status, 200);
    error_of(&c.get("/v2/nothing"), 404);
    error_of(&c.get("/v1/chat/completions"), 405);
    // Still serving.
    assert_eq!(anon.get("/health").json()["status"], "ok");
    let (t, _, u) = content(&c.post("/v1/chat/completions", &chat_body("hi", false, 4, 0.0, 1)), false);
    assert!(u["completion_tokens"].as_u64().unwrap() >= 1 || t.is_empty());
    let m = metrics(&c);
    assert!(m["requests_rejected"].as_u64().unwrap() >= 3, "{m}");
    // Tier hit rates come from the store's callback, in both formats.
    assert_eq!(m["expert_tier_hit_rates"]["host"], 0.5);
    assert!(c.get("/metrics").text().contains("pulsar_expert_tier_hit_rate{tier=\"vram\"} 0.25"));
    srv.shutdown().unwrap();
}

#[test]
fn shutdown_ends_running_streams_and_runs_the_hook() {
    let called = Arc::new(AtomicBool::new(false));
    let flag = called.clone();
    // No grace: the running stream is cancelled at once (a fast machine could
    // otherwise finish it within any grace period).
    let srv = start_opts(2, 4096, Some(Box::new(move || flag.store(true, Ordering::SeqCst))), None, Duration::ZERO);
    let addr = srv.addr();
    let c = Client::new(addr, Some(KEY));
    // Runs ~4000 tokens (several seconds) unless stopped.
    let p = long_prompt(&c, 3000);
    let mut s = c.open_stream("/v1/completions", &json!({"prompt": p, "max_tokens": 100_000, "temperature": 0, "stream": true}));
    http::read_events(&mut s, 2);
    let t0 = Instant::now();
    srv.shutdown().unwrap();
    // The stream is cancelled; the server is gone.
    assert!(t0.elapsed() < Duration::from_secs(10), "shutdown took {:?}", t0.elapsed());
    assert!(called.load(Ordering::SeqCst), "on_shutdown was not called");
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("shut down") && text.contains("[DONE]"), "the running stream should end with an error and [DONE]: {text}");
    assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err(), "still accepting after shutdown");
}

#[test]
fn queued_requests_are_served_in_arrival_order() {
    let srv = start(1, 2048, None);
    let c = Client::new(srv.addr(), Some(KEY));
    // Each runs long enough (~100 ms and more) that finishing order is
    // serving order, not a race between clients reading their responses.
    let p = long_prompts(&c, 600, 4);
    let base = metrics(&c)["requests_total"].as_u64().unwrap() as usize;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut threads = Vec::new();
    for (i, (prompt, n)) in [(&p[0], 600), (&p[1], 600), (&p[2], 600), (&p[3], 600)].into_iter().enumerate() {
        let (addr, order, body) = (srv.addr(), order.clone(), json!({"prompt": prompt, "max_tokens": n, "temperature": 0}));
        threads.push(std::thread::spawn(move || {
            let r = Client::new(addr, Some(KEY)).post("/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            order.lock().unwrap().push((i, r.json()["timings"]["queue_ms"].as_f64().unwrap()));
        }));
        // The next one leaves only once this one is queued on the engine.
        let deadline = Instant::now() + Duration::from_secs(20);
        while metrics(&c)["requests_total"].as_u64().unwrap() < (base + i + 1) as u64 {
            assert!(Instant::now() < deadline, "request {i} never arrived");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    threads.into_iter().for_each(|t| t.join().unwrap());
    let order = order.lock().unwrap();
    assert_eq!(order.iter().map(|o| o.0).collect::<Vec<_>>(), vec![0, 1, 2, 3], "{order:?}");
    // Each later one waited for the slot (600 tokens of the one before).
    assert!(order[1..].iter().all(|o| o.1 > 1.0), "queue times {order:?}");
    srv.shutdown().unwrap();
}

#[test]
fn a_queued_request_whose_client_leaves_is_dropped_from_the_queue() {
    let srv = start(1, 2048, None);
    let c = Client::new(srv.addr(), Some(KEY));
    let p = long_prompt(&c, 1500);
    let n0 = metrics(&c)["requests_total"].as_u64().unwrap();
    let mut a = c.open_stream("/v1/completions", &json!({"prompt": p, "max_tokens": 100_000, "temperature": 0, "stream": true}));
    http::read_events(&mut a, 2);
    let b = c.open_stream("/v1/completions", &json!({"prompt": "queued", "max_tokens": 8}));
    let poll = |what: &str, ok: &dyn Fn(&Value) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let m = metrics(&c);
            if ok(&m) {
                return m;
            }
            assert!(Instant::now() < deadline, "{what}: {m}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    poll("B never queued", &|m| m["requests_total"] == n0 + 2 && m["queue_depth"] == 1);
    drop(b);
    let m = poll("B stayed in the queue", &|m| m["queue_depth"] == 0 && m["requests_cancelled"] == 1);
    assert_eq!(m["active_sequences"], 1, "A must still be running: {m}");
    drop(a);
    poll("A kept its slot", &|m| m["active_sequences"] == 0 && m["requests_cancelled"] == 2);
    srv.shutdown().unwrap();
}

/// #24's server half: llama-server's /props, /tokenize, /detokenize and
/// /apply-template; the sampling defaults a request gets; an unknown model
/// is a 404 and an unimplemented field a 400 naming it.
#[test]
fn llama_server_routes_defaults_and_refusals() {
    let backend = Backend::cpu(Arc::new(common::tiny_model()), Arc::new(CpuBackend::new(2).unwrap()), Arc::new(MappedExperts));
    let mut sampling = pulsar_host::sample::SamplerConfig::llama_server();
    sampling.temperature = 0.0;
    sampling.top_k = 7;
    let opts = ServeOptions { port: 0, api_key: Some(KEY.into()), n_ctx: 256, parallel: 2, model_id: "tiny".into(), sampling, ..ServeOptions::default() };
    let srv = Server::start(backend, opts, None).unwrap();
    let c = Client::new(srv.addr(), Some(KEY));

    let p = c.get("/props").json();
    let d = &p["default_generation_settings"];
    assert_eq!((d["n_ctx"].as_u64(), d["params"]["top_k"].as_u64(), d["params"]["temperature"].as_f64()), (Some(256), Some(7), Some(0.0)), "{p}");
    assert!((d["params"]["top_p"].as_f64().unwrap() - 0.95).abs() < 1e-6 && p["total_slots"] == 2 && p["model_alias"] == "tiny", "{p}");
    assert!(p["chat_template"].as_str().is_some_and(|t| !t.is_empty()), "{p}");

    // Tokenize and back.
    let t = c.post("/tokenize", &json!({"content": "Once upon a time"})).json();
    let ids: Vec<u64> = t["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(!ids.is_empty(), "{t}");
    let back = c.post("/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(back["content"], "Once upon a time");
    let pieces = c.post("/tokenize", &json!({"content": "Once upon a time", "with_pieces": true})).json();
    let joined: String = pieces["tokens"].as_array().unwrap().iter().map(|p| p["piece"].as_str().unwrap().to_string()).collect();
    assert_eq!(joined, "Once upon a time", "{pieces}");
    assert_eq!(pieces["tokens"][0]["id"].as_u64(), Some(ids[0]));
    let bad = c.post("/detokenize", &json!({"tokens": [1, 99999999]}));
    assert!(bad.status == 400 && bad.text().contains("99999999"), "{}", bad.text());

    // apply-template gives the prompt a chat request runs: the same token count.
    let msgs = json!([{"role": "user", "content": "Hello!"}]);
    let prompt = c.post("/apply-template", &json!({"messages": msgs})).json()["prompt"].as_str().unwrap().to_string();
    assert!(prompt.contains("Hello!"), "{prompt}");
    let n_tpl = c.post("/tokenize", &json!({"content": prompt})).json()["tokens"].as_array().unwrap().len() as u64;
    let r = c.post("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 2})).json();
    assert_eq!(r["usage"]["prompt_tokens"].as_u64(), Some(n_tpl), "{r}");

    // Defaults: temperature 0 from the server, so a request without sampling fields is greedy.
    let plain = |body: Value| content(&c.post("/v1/completions", &body), false).0;
    let greedy = plain(json!({"prompt": "abc", "max_tokens": 12, "temperature": 0}));
    assert_eq!(plain(json!({"prompt": "abc", "max_tokens": 12})), greedy);

    // An unknown model: 404 in OpenAI's shape. The served one and none pass.
    let r = c.post("/v1/chat/completions", &json!({"model": "gpt-4o", "messages": msgs, "max_tokens": 1}));
    assert_eq!(r.status, 404, "{}", r.text());
    let e = r.json();
    assert!(e["error"]["code"] == "model_not_found" && e["error"]["message"].as_str().unwrap().contains("gpt-4o"), "{e}");
    assert_eq!(c.post("/v1/completions", &json!({"model": "tiny", "prompt": "a", "max_tokens": 1})).status, 200);
    // Unimplemented fields asking for something: a 400 naming the field.
    for (body, field) in [
        (json!({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}), "tools"),
        (json!({"messages": msgs, "response_format": {"type": "json_object"}}), "response_format"),
        (json!({"prompt": "a", "logprobs": 5}), "logprobs"),
    ] {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let r = c.post(path, &body);
        let e = r.json();
        assert!(r.status == 400 && e["error"]["param"] == field, "{field}: {e}");
    }
    // Harmless values of the same fields pass.
    let ok = c.post("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 1, "tools": [], "logprobs": false, "response_format": {"type": "text"}}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    // /metrics: time to first token and the latest step's rows.
    let mt = metrics(&c);
    assert!(mt["mean_time_to_first_token_ms"].as_f64().unwrap() > 0.0 && mt["last_step_rows"].as_u64().unwrap() >= 1, "{mt}");
    let prom = c.get("/metrics").text();
    assert!(prom.contains("pulsar_time_to_first_token_ms ") && prom.contains("pulsar_last_step_rows "), "{prom}");
    srv.shutdown().unwrap();
}
