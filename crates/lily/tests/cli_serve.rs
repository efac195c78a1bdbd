//! `lily serve` as a user runs it, in a process of its own: Ctrl-C during a stream ends the stream
//! cleanly (a final chunk with a finish_reason, then `data: [DONE]`) and the process exits; a second
//! Ctrl-C exits at once, even while the engine is deep in a prefill; a port in use fails before any
//! model is loaded; a public address without an API key is warned about; a line per request.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Generous: these happen in well under a second (never a speed test).
const SOON: Duration = Duration::from_secs(60);

struct Served {
    child: Child,
    addr: String,
    lines: Receiver<String>,
    /// Every stderr line so far.
    seen: Vec<String>,
    _cache: tempfile::TempDir,
}

impl Served {
    /// `lily serve --port 0` on the demo model (written into a fresh cache), once it listens.
    fn start(extra: &[&str]) -> Served {
        let cache = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["serve", "--port", "0", "--backend", "cpu"])
            .args(extra)
            .env("LILY_CACHE", cache.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut s = Served { child, addr: String::new(), lines, seen: Vec::new(), _cache: cache };
        let banner = s.wait_line("lily serving");
        let at = banner.find("http://").expect("an address in the banner") + 7;
        s.addr = banner[at..].split_whitespace().next().unwrap().to_string();
        s
    }

    fn wait_line(&mut self, needle: &str) -> String {
        let t = Instant::now();
        while t.elapsed() < SOON {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(_) => break,
            }
        }
        panic!("no line with {needle:?} in {:#?}", self.seen);
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([sig, &self.child.id().to_string()]).status().unwrap().success();
        assert!(ok, "kill {sig}");
    }

    /// Waits for the process to exit; its exit code.
    fn exit_code(&mut self) -> Option<i32> {
        let t = Instant::now();
        while t.elapsed() < SOON {
            if let Some(st) = self.child.try_wait().unwrap() {
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        panic!("lily serve did not exit: {:#?}", self.seen);
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `data:` payloads of an SSE body read so far.
fn data_lines(r: &mut impl BufRead, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    while out.len() < n {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            out.push(d.to_string());
        }
    }
    out
}

#[test]
fn ctrl_c_ends_a_stream_cleanly_and_exits() {
    let mut s = Served::start(&["-n", "100000"]);
    let body = json!({"messages": [{"role": "user", "content": "Hello!"}], "stream": true});
    let http = reqwest::blocking::Client::builder().timeout(SOON).build().unwrap();
    let r = http.post(s.url("/v1/chat/completions")).json(&body).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut r = BufReader::new(r);
    assert_eq!(data_lines(&mut r, 5).len(), 5, "the stream has begun");
    s.signal("-INT");
    let rest = data_lines(&mut r, usize::MAX);
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    let last: Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    assert_eq!(s.exit_code(), Some(0), "{:#?}", s.seen);
    assert!(s.seen.iter().any(|l| l.contains("stopping")), "{:#?}", s.seen);
    assert!(s.seen.iter().any(|l| l.starts_with("POST /v1/chat/completions 200") && l.contains("shutting down")), "{:#?}", s.seen);
    assert!(s.seen.iter().any(|l| l == "lily: stopped"), "{:#?}", s.seen);
}

#[test]
fn sigterm_stops_too_and_a_second_signal_quits_at_once() {
    let mut s = Served::start(&[]);
    // A prompt whose prefill takes seconds: the engine cannot end it at its next token.
    let body = json!({"messages": [{"role": "user", "content": "word ".repeat(20_000)}], "stream": true, "max_tokens": 4});
    let (url, metrics) = (s.url("/v1/chat/completions"), s.url("/metrics"));
    std::thread::spawn(move || {
        let http = reqwest::blocking::Client::builder().timeout(SOON).build().unwrap();
        let _ = http.post(url).json(&body).send().and_then(|r| r.text());
    });
    let t = Instant::now();
    loop {
        let m = reqwest::blocking::get(&metrics).unwrap().text().unwrap();
        if m.lines().any(|l| l == "lily_engine_busy 1") {
            break;
        }
        assert!(t.elapsed() < SOON, "the engine never got busy");
        std::thread::sleep(Duration::from_millis(20));
    }
    // And a client still uploading its request: the shutdown waits a while for it too.
    let mut upload = std::net::TcpStream::connect(&s.addr).unwrap();
    upload.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{").unwrap();
    s.signal("-TERM");
    s.wait_line("stopping");
    s.signal("-INT");
    assert_eq!(s.exit_code(), Some(130), "{:#?}", s.seen);
    assert!(s.seen.iter().any(|l| l.contains("quitting at once")), "{:#?}", s.seen);
}

#[test]
fn a_port_in_use_fails_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let cache = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["serve", "--port", &port, "--backend", "cpu"])
        .env("LILY_CACHE", cache.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("already in use") && err.contains(&port), "{err}");
    assert!(!err.contains("demo model") && !err.contains("session"), "nothing was loaded first: {err}");
    // The demo model was never written.
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0);
    assert!(t.elapsed() < SOON);
}

#[test]
fn a_public_address_without_a_key_is_warned_about() {
    let mut s = Served::start(&["--host", "0.0.0.0", "-a", "my-model"]);
    assert!(s.seen.iter().any(|l| l.starts_with("warning:") && l.contains("--api-key")), "{:#?}", s.seen);
    // The alias is the served name.
    let port = s.addr.rsplit(':').next().unwrap().to_string();
    let v: Value = reqwest::blocking::get(format!("http://127.0.0.1:{port}/v1/models")).unwrap().json().unwrap();
    assert_eq!(v["data"][0]["id"], "my-model");
    let v: Value = reqwest::blocking::get(format!("http://127.0.0.1:{port}/v1/models/my-model")).unwrap().json().unwrap();
    assert_eq!(v["id"], "my-model");
    s.signal("-INT");
    assert_eq!(s.exit_code(), Some(0));
    let mut quiet = Served::start(&["--host", "127.0.0.1"]);
    assert!(!quiet.seen.iter().any(|l| l.starts_with("warning:")), "{:#?}", quiet.seen);
    quiet.signal("-INT");
    assert_eq!(quiet.exit_code(), Some(0));
}
