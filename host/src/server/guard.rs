//! Request guards: Host and Origin checks against DNS rebinding, and the
//! Bearer API key.
//!
//! A DNS-rebinding page reaches a loopback server under the attacker's domain
//! name, so its requests carry that name in `Host` (and its page's origin in
//! `Origin`). Only names we know are accepted: localhost, 127.0.0.1, [::1],
//! the bound host and `--allow-host` names; when bound to every interface
//! (0.0.0.0 / ::) any IP literal is accepted too (an IP literal cannot be
//! rebound).

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, HOST, ORIGIN};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;
use super::AppState;

/// Which Host/Origin names are ours.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    names: Vec<String>,
    any_ip: bool,
}

/// `host[:port]` → the host part, lower-cased, IPv6 kept in brackets.
fn host_part(authority: &str) -> Option<String> {
    let a = authority.trim();
    if a.is_empty() || a.contains(['/', '@', ' ']) {
        return None;
    }
    let host = if let Some(rest) = a.strip_prefix('[') {
        let end = rest.find(']')?;
        let after = &rest[end + 1..];
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(|p| p.chars().all(|c| c.is_ascii_digit()))) {
            return None;
        }
        format!("[{}]", &rest[..end])
    } else {
        match a.rsplit_once(':') {
            Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.contains(':') => h.to_string(),
            Some(_) => return None,
            None => a.to_string(),
        }
    };
    Some(host.to_ascii_lowercase())
}

fn is_ip_literal(h: &str) -> bool {
    let inner = h.strip_prefix('[').and_then(|x| x.strip_suffix(']')).unwrap_or(h);
    inner.parse::<IpAddr>().is_ok()
}

impl HostPolicy {
    pub fn new(bound: &str, extra: &[String]) -> HostPolicy {
        let mut names: Vec<String> = ["localhost", "127.0.0.1", "[::1]"].iter().map(|s| s.to_string()).collect();
        let bound_ip = bound.trim_matches(['[', ']']).parse::<IpAddr>().ok();
        let any_ip = bound_ip.is_some_and(|ip| ip.is_unspecified());
        let b = match bound_ip {
            Some(IpAddr::V6(v6)) => format!("[{v6}]"),
            _ => bound.to_ascii_lowercase(),
        };
        names.push(b);
        names.extend(extra.iter().filter_map(|e| host_part(e)));
        names.sort();
        names.dedup();
        HostPolicy { names, any_ip }
    }

    /// Is a `Host` header value (`name[:port]`) ours?
    pub fn host_ok(&self, authority: &str) -> bool {
        match host_part(authority) {
            Some(h) => self.names.contains(&h) || (self.any_ip && is_ip_literal(&h)),
            None => false,
        }
    }

    /// Is an `Origin` header value (`scheme://name[:port]`) ours?
    pub fn origin_ok(&self, origin: &str) -> bool {
        match origin.split_once("://") {
            Some(("http" | "https", rest)) => self.host_ok(rest),
            _ => false,
        }
    }
}

/// Byte comparison whose time does not depend on where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Paths that need no API key: the health probe, and the static chat page
/// (it holds no data; it asks for the key and sends it on every API call).
fn public(path: &str) -> bool {
    matches!(path, "/health" | "/")
}

pub async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    // A second Host or Origin could smuggle a foreign name past a check of the first.
    for name in [HOST, ORIGIN] {
        if headers.get_all(&name).iter().nth(1).is_some() {
            return ApiError::invalid(format!("more than one `{name}` header: send one")).into_response();
        }
    }
    if let Some(h) = headers.get(HOST) {
        if !h.to_str().is_ok_and(|h| st.hosts.host_ok(h)) {
            let shown = String::from_utf8_lossy(h.as_bytes()).into_owned();
            return ApiError::forbidden(format!("Host `{shown}` is not allowed (DNS rebinding guard; add it with --allow-host)")).into_response();
        }
    }
    if let Some(o) = headers.get(ORIGIN) {
        if !o.to_str().is_ok_and(|o| st.hosts.origin_ok(o)) {
            let shown = String::from_utf8_lossy(o.as_bytes()).into_owned();
            return ApiError::forbidden(format!("Origin `{shown}` is not allowed (cross-origin requests are refused)")).into_response();
        }
    }
    if let Some(key) = &st.api_key {
        if !public(req.uri().path()) {
            let given = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
            match given {
                None => return ApiError::unauthorized("missing API key: send `Authorization: Bearer KEY`").into_response(),
                Some(g) if !same(g.as_bytes(), key.as_bytes()) => return ApiError::unauthorized("invalid API key").into_response(),
                Some(_) => {}
            }
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        let p = HostPolicy::new("127.0.0.1", &[]);
        for ok in ["localhost", "localhost:11435", "127.0.0.1:80", "[::1]:8080", "LOCALHOST"] {
            assert!(p.host_ok(ok), "{ok}");
        }
        for bad in ["evil.example", "evil.example:11435", "10.0.0.1", "localhost.evil.example", "127.0.0.1:80:1", "", "a@localhost"] {
            assert!(!p.host_ok(bad), "{bad}");
        }
        assert!(p.origin_ok("http://localhost:11435"));
        assert!(!p.origin_ok("http://evil.example"));
        assert!(!p.origin_ok("null"));
        let any = HostPolicy::new("0.0.0.0", &["box.lan".into()]);
        assert!(any.host_ok("10.0.0.1:11435") && any.host_ok("box.lan:1") && !any.host_ok("evil.example"));
        let v6 = HostPolicy::new("::1", &[]);
        assert!(v6.host_ok("[::1]:9"));
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"abc", b"ab"));
    }
}
