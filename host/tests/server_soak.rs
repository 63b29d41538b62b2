//! A soak of `pulsar-host serve` (the real binary, over loopback, on the
//! tiny synthetic qwen3moe with the expert store): for a fixed time, normal
//! clients (streamed and not) beside malformed, slow and disconnecting ones
//! and a `/health` prober. Afterwards: every normal request got the greedy
//! answer a quiet server gives, `/health` stayed under its bound, the
//! process holds no more descriptors or memory than the bounds below, and
//! after SIGTERM the census sidecar on disk decodes.
//!
//! Sized for the 2-core CI box: `SOAK` seconds, seven client threads.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const SOAK: Duration = Duration::from_secs(12);
const KEY: &str = "soak-key";
/// `/health` must answer within this at every probe.
const HEALTH_BOUND: Duration = Duration::from_millis(1000);
/// Open descriptors after the soak, beyond those after the warm-up.
const FD_SLACK: usize = 8;
/// Resident memory after the soak, beyond that after the warm-up.
const RSS_SLACK_KIB: u64 = 64 << 10;

const PROMPTS: [&str; 4] = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,", "Hello, world"];

fn staged_plugins() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_pulsar-host"));
    let dir = exe.parent().unwrap().join("plugins");
    assert!(dir.is_dir(), "{} is missing: run scripts/stage-plugins.sh (scripts/test.sh does)", dir.display());
    dir
}

struct Serve {
    child: Child,
    addr: String,
    log: Arc<Mutex<Vec<String>>>,
}

fn spawn(model: &Path) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pulsar-host"))
        .args(["serve", "-m"])
        .arg(model)
        .args(["--port", "0", "--parallel", "2", "--api-key", KEY, "--header-timeout", "2", "--body-timeout", "2", "--write-timeout", "5"])
        .args(["--max-connections", "64", "--plugin-dir"])
        .arg(staged_plugins())
        .env_remove("PULSAR_CTX")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited before listening");
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            sink.lock().unwrap().push(l);
        }
    });
    Serve { child, addr, log }
}

/// One request; (status, body). `None` when the connection failed.
fn request(addr: &str, method: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    Some((status, body))
}

/// The generated text of a completion, streamed (chunked SSE) or whole.
fn completion(addr: &str, prompt: &str, stream: bool) -> Result<String, String> {
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}).to_string();
    let (status, text) = request(addr, "POST", "/v1/completions", body.as_bytes()).ok_or("connection failed")?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    if !stream {
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        return Ok(v["choices"][0]["text"].as_str().ok_or("no text")?.to_string());
    }
    let mut out = String::new();
    for l in text.lines() {
        let Some(d) = l.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            return Ok(out);
        }
        let v: Value = serde_json::from_str(d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d.to_string());
        }
        out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    Err(format!("stream without [DONE]: {text}"))
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

#[cfg(target_os = "linux")]
#[test]
fn a_mixed_crowd_of_clients_leaves_the_server_correct_and_lean() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("soak.gguf");
    let spec = pulsar_host::synth::SynthSpec { n_layers: 2, ..pulsar_host::synth::preset("tiny").unwrap() };
    pulsar_host::synth::write(&spec, &model, false).unwrap();
    let mut srv = spawn(&model);
    let addr = srv.addr.clone();
    let pid = srv.child.id();
    // The answers of a quiet server, and a warm-up of every path.
    let gold: Vec<String> = PROMPTS.iter().map(|p| completion(&addr, p, false).unwrap()).collect();
    for (p, g) in PROMPTS.iter().zip(&gold) {
        assert_eq!(&completion(&addr, p, true).unwrap(), g, "streamed and whole answers differ");
    }
    std::thread::sleep(Duration::from_millis(300));
    let (fd0, rss0) = (fds(pid), rss_kib(pid));

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let wrong = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut threads = Vec::new();
    for c in 0..3 {
        let (addr, stop, served, wrong, gold) = (addr.clone(), stop.clone(), served.clone(), wrong.clone(), gold.clone());
        threads.push(std::thread::spawn(move || {
            let mut i = c;
            while !stop.load(Relaxed) {
                let k = i % PROMPTS.len();
                match completion(&addr, PROMPTS[k], i % 2 == 0) {
                    Ok(t) if t == gold[k] => {
                        served.fetch_add(1, Relaxed);
                    }
                    Ok(t) => wrong.lock().unwrap().push(format!("{:?}: got {t:?}, want {:?}", PROMPTS[k], gold[k])),
                    Err(e) => wrong.lock().unwrap().push(format!("{:?}: {e}", PROMPTS[k])),
                }
                i += 1;
            }
        }));
    }
    // Malformed: every answer a 4xx, never a 5xx or a dropped connection.
    let bad_answers = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let (addr, stop, bad) = (addr.clone(), stop.clone(), bad_answers.clone());
        threads.push(std::thread::spawn(move || {
            let bodies: [&[u8]; 6] = [b"{", b"[]", b"{\"prompt\": 5}", b"{\"prompt\": \"x\", \"max_tokens\": -1}", b"\xff\xfe", b"{\"messages\": []}"];
            let mut i = 0;
            while !stop.load(Relaxed) {
                let path = if i % 2 == 0 { "/v1/completions" } else { "/v1/chat/completions" };
                match request(&addr, "POST", path, bodies[i % bodies.len()]) {
                    Some((s, _)) if (400..500).contains(&s) => {}
                    other => bad.lock().unwrap().push(format!("{path} {:?}: {other:?}", String::from_utf8_lossy(bodies[i % bodies.len()]))),
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    // Slow: half a head, or a head and half a body, then silence.
    {
        let (addr, stop) = (addr.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(Relaxed) {
                if let Ok(mut s) = TcpStream::connect(&addr) {
                    let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n");
                    held.push(s);
                }
                if let Ok(mut s) = TcpStream::connect(&addr) {
                    let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"pro");
                    held.push(s);
                }
                held.truncate(16);
                std::thread::sleep(Duration::from_millis(250));
            }
        }));
    }
    // Disconnecting: start a long stream, read a little, hang up.
    {
        let (addr, stop) = (addr.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                if let Ok(mut s) = TcpStream::connect(&addr) {
                    let body = json!({"prompt": "Tell a long story", "max_tokens": 500, "stream": true}).to_string();
                    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n", body.len());
                    let _ = s.write_all(head.as_bytes());
                    let _ = s.write_all(body.as_bytes());
                    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut buf = [0u8; 512];
                    let _ = s.read(&mut buf);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }
    // The prober.
    let worst = Arc::new(Mutex::new(Duration::ZERO));
    let probes = Arc::new(AtomicU64::new(0));
    {
        let (addr, stop, worst, probes) = (addr.clone(), stop.clone(), worst.clone(), probes.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let t = Instant::now();
                let r = request(&addr, "GET", "/health", b"");
                let dt = t.elapsed();
                assert_eq!(r.map(|r| r.0), Some(200), "/health failed during the soak");
                let mut w = worst.lock().unwrap();
                *w = (*w).max(dt);
                probes.fetch_add(1, Relaxed);
                drop(w);
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    std::thread::sleep(SOAK);
    stop.store(true, Relaxed);
    for t in threads {
        t.join().unwrap();
    }

    // Let the timeouts reap the slow sockets and the cancelled sequences go.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = request(&addr, "GET", "/metrics?format=json", b"").map(|r| r.1).unwrap_or_default();
        let m: Value = serde_json::from_str(&m).unwrap_or(Value::Null);
        if m["active_sequences"] == 0 && m["queue_depth"] == 0 && fds(pid) <= fd0 + FD_SLACK {
            break;
        }
        assert!(Instant::now() < deadline, "the server did not settle: {m}, {} descriptors (was {fd0})", fds(pid));
        std::thread::sleep(Duration::from_millis(200));
    }
    let (fd1, rss1) = (fds(pid), rss_kib(pid));
    let (worst, probes, served) = (*worst.lock().unwrap(), probes.load(Relaxed), served.load(Relaxed));
    eprintln!("soak: {served} normal requests served, {probes} health probes (worst {worst:?}), descriptors {fd0} -> {fd1}, RSS {rss0} -> {rss1} KiB");
    let wrong = wrong.lock().unwrap();
    assert!(wrong.is_empty(), "{} normal requests went wrong, e.g. {:?}", wrong.len(), &wrong[..wrong.len().min(3)]);
    assert!(served >= 10, "only {served} normal requests in {SOAK:?}");
    let bad = bad_answers.lock().unwrap();
    assert!(bad.is_empty(), "malformed requests got {:?}", &bad[..bad.len().min(3)]);
    assert!(worst < HEALTH_BOUND, "/health took {worst:?} at worst");
    assert!(rss1 <= rss0 + RSS_SLACK_KIB, "RSS grew from {rss0} to {rss1} KiB");

    Command::new("kill").arg("-TERM").arg(pid.to_string()).status().unwrap();
    let st = srv.child.wait().unwrap();
    assert!(st.success(), "serve exited with {st}: {:?}", srv.log.lock().unwrap());
    let fingerprint = pulsar_gguf::GgufFile::open(&model).unwrap().fingerprint();
    let side = pulsar_store::sidecar_path(&model);
    match pulsar_store::load_sidecar(&side, &fingerprint) {
        pulsar_store::SidecarLoad::Loaded(c) => assert!(!c.is_empty(), "the census is empty after {served} requests"),
        other => panic!("the census on disk is not intact: {other:?}"),
    }
}
