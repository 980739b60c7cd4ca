//! HTTP for the remote backend on one background thread with its own tokio runtime
//! (`LanguageModel` is blocking and may be called, and dropped, from async contexts, where a
//! nested runtime would panic): jobs in, server-sent events out, retries with backoff before the
//! first streamed byte, idle timeouts, and errors with their causes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use serde_json::Value;

/// A message from a request's task.
#[derive(Debug)]
pub(super) enum Reply {
    /// One server-sent event's JSON (or the whole JSON body of a non-streamed answer).
    Data(Value),
    /// `[DONE]` (or the end of a non-streamed body).
    End,
    Failed(String),
}

pub(super) struct Job {
    pub(super) url: String,
    /// `None`: GET.
    pub(super) body: Option<Vec<u8>>,
    pub(super) tag: usize,
    pub(super) out: mpsc::Sender<(usize, Reply)>,
    /// Set by the caller when it wants no more (stop string, cancel, another branch failed).
    pub(super) stop: Arc<AtomicBool>,
}

pub(super) struct Http {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    timeout: Duration,
    retries: u32,
}

impl Http {
    pub(super) fn start(
        key: Option<String>,
        timeout: Duration,
        retries: u32,
    ) -> Result<Self, String> {
        let (jobs, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let limits = Limits { timeout, retries };
        std::thread::Builder::new()
            .name("envace-openai".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot start the HTTP runtime: {e}")));
                        return;
                    }
                };
                // reqwest is built without a bundled crypto provider (see Cargo.toml).
                let _ = rustls::crypto::ring::default_provider().install_default();
                let client = match reqwest::Client::builder()
                    .connect_timeout(timeout.min(Duration::from_secs(30)))
                    .build()
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot build the HTTP client: {e}")));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                rt.block_on(async move {
                    while let Some(job) = rx.recv().await {
                        tokio::spawn(run_job(client.clone(), key.clone(), limits, job));
                    }
                });
            })
            .map_err(|e| format!("cannot start the HTTP thread: {e}"))?;
        ready_rx
            .recv()
            .map_err(|_| "the HTTP thread stopped at start".to_string())??;
        Ok(Self { jobs })
    }

    pub(super) fn submit(&self, job: Job) -> Result<(), String> {
        self.jobs
            .send(job)
            .map_err(|_| "the HTTP worker stopped".to_string())
    }
}

enum Attempt {
    /// Worth another try (nothing was streamed yet).
    Retry(String),
    Fatal(String),
}

async fn run_job(client: reqwest::Client, key: Option<String>, limits: Limits, job: Job) {
    let mut attempt = 0;
    loop {
        let message = match attempt_once(&client, key.as_deref(), limits, &job).await {
            Ok(()) => return,
            Err(Attempt::Retry(m)) if attempt < limits.retries => {
                attempt += 1;
                // 0.5 s, 1 s, 2 s, … capped at 8 s.
                let wait = Duration::from_millis(500 << (attempt - 1).min(4));
                tracing::warn!(url = %job.url, attempt, "retrying after: {m}");
                tokio::time::sleep(wait).await;
                if job.stop.load(Ordering::Relaxed) {
                    return;
                }
                continue;
            }
            Err(Attempt::Retry(m)) if limits.retries > 0 => {
                format!("{m} (after {} retries)", limits.retries)
            }
            Err(Attempt::Retry(m)) | Err(Attempt::Fatal(m)) => m,
        };
        let _ = job.out.send((job.tag, Reply::Failed(message)));
        return;
    }
}

async fn attempt_once(
    client: &reqwest::Client,
    key: Option<&str>,
    limits: Limits,
    job: &Job,
) -> Result<(), Attempt> {
    let secs = limits.timeout.as_secs_f64();
    let mut req = match &job.body {
        Some(body) => client
            .post(&job.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "text/event-stream, application/json",
            )
            .body(body.clone()),
        None => client.get(&job.url),
    };
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let mut resp = match tokio::time::timeout(limits.timeout, req.send()).await {
        Err(_) => return Err(Attempt::Retry(format!("no response within {secs} s"))),
        Ok(Err(e)) => return Err(Attempt::Retry(format!("cannot connect: {}", chain(&e)))),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    if !status.is_success() {
        let body = tokio::time::timeout(limits.timeout, resp.text())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let message = format!("HTTP {status}: {}", short(body.trim()));
        return Err(
            if status.as_u16() == 429 || status.as_u16() == 408 || status.is_server_error() {
                Attempt::Retry(message)
            } else {
                Attempt::Fatal(message)
            },
        );
    }
    let sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let send = |reply: Reply| job.out.send((job.tag, reply)).is_ok();
    if !sse {
        let body = match tokio::time::timeout(limits.timeout, resp.bytes()).await {
            Err(_) => return Err(Attempt::Retry(format!("no body within {secs} s"))),
            Ok(Err(e)) => return Err(Attempt::Retry(format!("body: {}", chain(&e)))),
            Ok(Ok(b)) => b,
        };
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            Attempt::Fatal(format!(
                "malformed JSON: {e}: {}",
                short(&String::from_utf8_lossy(&body))
            ))
        })?;
        if let Some(err) = v.get("error") {
            return Err(Attempt::Fatal(format!(
                "server error: {}",
                short(&err.to_string())
            )));
        }
        if send(Reply::Data(v)) {
            send(Reply::End);
        }
        return Ok(());
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut streamed = false;
    let after = |streamed: bool, m: String| {
        if streamed {
            Attempt::Fatal(m)
        } else {
            Attempt::Retry(m)
        }
    };
    loop {
        if job.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let chunk = match tokio::time::timeout(limits.timeout, resp.chunk()).await {
            Err(_) => {
                return Err(after(
                    streamed,
                    format!("the stream stalled: nothing for {secs} s"),
                ));
            }
            Ok(Err(e)) => {
                return Err(after(streamed, format!("the stream broke: {}", chain(&e))));
            }
            Ok(Ok(None)) => {
                return Err(after(
                    streamed,
                    "the server closed the stream before [DONE]".into(),
                ));
            }
            Ok(Ok(Some(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let raw: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&raw);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue; // blank separators, comments, `event:` / `id:` fields
            };
            let data = data.trim();
            if data == "[DONE]" {
                send(Reply::End);
                return Ok(());
            }
            let v: Value = serde_json::from_str(data).map_err(|e| {
                Attempt::Fatal(format!(
                    "malformed JSON in the stream: {e}: {}",
                    short(data)
                ))
            })?;
            if let Some(err) = v.get("error") {
                return Err(Attempt::Fatal(format!(
                    "server error: {}",
                    short(&err.to_string())
                )));
            }
            if job.stop.load(Ordering::Relaxed) || !send(Reply::Data(v)) {
                return Ok(()); // the caller wants no more: dropping the response closes it
            }
            streamed = true;
        }
    }
}

/// An error with its causes (reqwest's top-level message alone says little).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// At most 300 characters of a server's text, for error messages.
pub(super) fn short(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
