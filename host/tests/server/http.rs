//! A minimal blocking HTTP/1.1 client for the server tests (loopback only):
//! whole responses, chunked bodies, and SSE streams read as they arrive.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("status {}: body is not JSON ({e}): {}", self.status, self.text()))
    }
    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        sse_data(&self.text())
    }
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n").flat_map(|ev| ev.lines().filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")).map(str::to_string)).collect::<Vec<_>>()).collect()
}

pub struct Client {
    pub addr: SocketAddr,
    pub key: Option<String>,
}

fn find(h: &[u8], pat: &[u8]) -> Option<usize> {
    h.windows(pat.len()).position(|w| w == pat)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = find(b, b"\r\n") {
        let size_line = std::str::from_utf8(&b[..eol]).unwrap_or("0");
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("0").trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        if b.len() < start + size {
            out.extend_from_slice(&b[start..]);
            break;
        }
        out.extend_from_slice(&b[start..start + size]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

pub fn parse(raw: &[u8]) -> Resp {
    let end = find(raw, b"\r\n\r\n").unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status line");
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let body = &raw[end + 4..];
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked { dechunk(body) } else { body.to_vec() };
    Resp { status, headers, body }
}

impl Client {
    pub fn new(addr: SocketAddr, key: Option<&str>) -> Client {
        Client { addr, key: key.map(str::to_string) }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s
    }

    pub fn head(&self, method: &str, path: &str, extra: &[(&str, &str)], body_len: usize) -> String {
        let mut h = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
        if !extra.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            h.push_str(&format!("Host: {}\r\n", self.addr));
        }
        if let Some(k) = &self.key {
            h.push_str(&format!("Authorization: Bearer {k}\r\n"));
        }
        for (k, v) in extra {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        if method == "POST" {
            h.push_str(&format!("Content-Type: application/json\r\nContent-Length: {body_len}\r\n"));
        }
        h.push_str("\r\n");
        h
    }

    /// Send a request, read the whole response.
    pub fn raw(&self, method: &str, path: &str, extra: &[(&str, &str)], body: &[u8]) -> Resp {
        let mut s = self.connect();
        let head = self.head(method, path, extra, body.len());
        s.write_all(head.as_bytes()).unwrap();
        // The server may answer (413) and close before reading everything.
        let _ = s.write_all(body);
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        parse(&raw)
    }

    pub fn get(&self, path: &str) -> Resp {
        self.raw("GET", path, &[], b"")
    }

    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.raw("POST", path, &[], body.to_string().as_bytes())
    }

    /// Start a streaming POST; returns the socket to read events from.
    pub fn open_stream(&self, path: &str, body: &Value) -> TcpStream {
        let mut s = self.connect();
        let b = body.to_string();
        s.write_all(self.head("POST", path, &[], b.len()).as_bytes()).unwrap();
        s.write_all(b.as_bytes()).unwrap();
        s
    }
}

/// Read from a stream until `n` SSE events (blank-line separated) arrived.
pub fn read_events(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while raw.windows(2).filter(|w| w == b"\n\n").count() < n {
        let k = s.read(&mut buf).expect("read");
        assert!(k > 0, "stream ended early: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..k]);
    }
    raw
}

/// The text and finish reason of a chat or completion response, streamed or not.
pub fn content(r: &Resp, stream: bool) -> (String, String, Value) {
    assert_eq!(r.status, 200, "{}", r.text());
    if !stream {
        let j = r.json();
        let c = &j["choices"][0];
        let text = c["message"]["content"].as_str().or_else(|| c["text"].as_str()).expect("text").to_string();
        return (text, c["finish_reason"].as_str().expect("finish_reason").to_string(), j["usage"].clone());
    }
    let data = r.sse();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]: {data:?}");
    let (mut text, mut finish, mut usage) = (String::new(), String::new(), Value::Null);
    for d in &data[..data.len() - 1] {
        let j: Value = serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {d}"));
        assert!(j.get("error").is_none(), "error in stream: {d}");
        if !j["usage"].is_null() {
            usage = j["usage"].clone();
        }
        if let Some(c) = j["choices"].get(0) {
            if let Some(t) = c["delta"]["content"].as_str().or_else(|| c["text"].as_str()) {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, finish, usage)
}
