//! `lily serve`: binds the port first (a port in use fails at once, before a model loads), opens the
//! model, and serves until Ctrl-C or SIGTERM. The first signal stops accepting and ends the answers
//! in flight (a stream gets its final chunk and `[DONE]`), and lily exits within a few seconds; a
//! second one exits at once.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lily_model::Backend;

use crate::{open_chat, LoadArgs};

/// `max_tokens` of a request that sets none, with the built-in demo model (its output is noise).
pub const DEMO_DEFAULT_MAX_TOKENS: usize = 256;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Checkpoint directory (MLX 4-bit or Hugging Face bf16).
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Address to listen on. Anything but a loopback address (127.0.0.1, ::1) is reachable from
    /// other machines: set --api-key then.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics.
    #[arg(long, env = "LILY_API_KEY")]
    api_key: Option<String>,
    /// Context length in tokens: prompt plus answer. Default: the model's maximum, capped at 32768.
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// `max_tokens` for requests that set none; -1: the rest of the context (as OpenAI's API).
    /// Default: -1, or 256 with the built-in demo model (its random weights ramble without end).
    #[arg(short = 'n', long = "n-predict", visible_alias = "max-tokens", value_name = "N", allow_negative_numbers = true)]
    n_predict: Option<i64>,
    /// Requests allowed to wait for the engine (at least 1); beyond that, 429 with Retry-After.
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
    /// Seconds a request may wait in the queue before a 503.
    #[arg(long, default_value_t = 600)]
    queue_timeout: u64,
    /// Memory for the prefix cache's state snapshots, in MiB.
    #[arg(long, default_value_t = 4096)]
    cache_mb: usize,
    /// Name the model is served under, in /v1/models and responses (default: the directory name,
    /// or "lily-demo").
    #[arg(short = 'a', long, visible_alias = "model-id")]
    alias: Option<String>,
    /// Do not print a line per request on stderr.
    #[arg(long)]
    no_request_log: bool,
    #[command(flatten)]
    load: LoadArgs,
}

/// Binds `host:port` now, with an error a user can act on.
fn bind(host: &str, port: u16) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs().with_context(|| format!("`{host}` is not an address or a known host name"))?.collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((a, e)),
        }
    }
    let Some((a, e)) = last else { bail!("`{host}` resolves to no address") };
    match e.kind() {
        std::io::ErrorKind::AddrInUse => bail!("cannot listen on {a}: the port is already in use (another lily or server?). Stop it, or choose another --port"),
        std::io::ErrorKind::PermissionDenied => bail!("cannot listen on {a}: permission denied (ports below 1024 need privileges; choose another --port)"),
        std::io::ErrorKind::AddrNotAvailable => bail!("cannot listen on {a}: this machine has no such address (--host)"),
        _ => bail!("cannot listen on {a}: {e}"),
    }
}

/// The default `max_tokens` from `-n` (None: the rest of the context).
fn default_max_tokens(n: Option<i64>, demo: bool) -> Result<Option<usize>> {
    match n {
        None if demo => Ok(Some(DEMO_DEFAULT_MAX_TOKENS)),
        None | Some(-1) => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => bail!("-n/--n-predict {n}: expected a number of tokens (at least 1), or -1 for the rest of the context"),
    }
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let listener = bind(&a.host, a.port)?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() && a.api_key.is_none() {
        eprintln!(
            "warning: listening on {local}, which other machines can reach, with no --api-key: anyone who reaches it can use it. \
             Set --api-key (or LILY_API_KEY), or listen on 127.0.0.1."
        );
    }
    let mut m = open_chat(a.model.as_deref(), &a.load)?;
    let max_pos = m.model.config().max_position_embeddings;
    let ctx = a.ctx_size.unwrap_or(max_pos.min(32768));
    if ctx > max_pos || ctx < 2 {
        bail!("--ctx-size {ctx} must be between 2 and the model's maximum ({max_pos})");
    }
    let default_max = default_max_tokens(a.n_predict, m.demo)?;
    // One session of the whole context, sized now: what each request's reserve asks for at most,
    // and a clear error at start (not at the first long request) when it does not fit.
    let mut probe = m.model.new_state();
    m.model
        .reserve(&mut probe, ctx)
        .with_context(|| format!("a session of --ctx-size {ctx} tokens does not fit on the {} backend", m.model.name()))?;
    eprintln!(
        "a session of the full context ({ctx} tokens) holds {:.2} GB (KV caches and recurrent states; sized per request for its prompt and max_tokens)",
        m.model.state_bytes(&probe) as f64 / 1e9
    );
    drop(probe);
    let id = a.alias.unwrap_or_else(|| {
        if m.demo {
            "lily-demo".to_string()
        } else {
            m.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "lily".into())
        }
    });
    let cfg = lily_server::ServerConfig {
        model_id: id.clone(),
        demo: m.demo,
        api_key: a.api_key,
        ctx_size: ctx,
        max_queue: a.max_queue,
        queue_timeout: Duration::from_secs(a.queue_timeout),
        max_body_bytes: 32 << 20,
        cache_bytes: a.cache_mb << 20,
        default_max_tokens: default_max,
        body_timeout: Duration::from_secs(60),
        log: (!a.no_request_log).then(lily_server::RequestLog::stderr),
    };
    let demo = m.demo;
    let served = lily_server::ServedModel { backend: m.model, tokenizer: m.tokenizer, template: m.template, defaults: m.defaults, stop_ids: m.stop_ids };
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async move {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let app = lily_server::build(served, &cfg);
        // The structured-outputs vocabulary (a second or two), ready before the first request.
        app.grammars.warm_in_background();
        // Listening from now on (before the banner says lily is ready), so that no Ctrl-C kills it
        // uncleanly and a second one is never missed between the two waits.
        let mut signals = Signals::new()?;
        let max = match default_max {
            Some(n) => format!("{n} tokens"),
            None => "the rest of the context".into(),
        };
        eprintln!(
            "lily serving `{id}`{} on http://{local} (backend {}, context {ctx} tokens, {max} per answer unless a request says otherwise{}). Ctrl-C stops.",
            if demo { " (the built-in DEMO model: random weights, meaningless output)" } else { "" },
            app.backend,
            if cfg.api_key.is_some() { ", API key required" } else { "" },
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            signals.next().await;
            eprintln!("lily: stopping: no new requests; ending the answers in flight (Ctrl-C again quits at once)");
            let _ = stop.send(());
            signals.next().await;
            eprintln!("lily: quitting at once");
            std::process::exit(130);
        });
        lily_server::serve_until(app, listener, lily_server::HttpLimits::default(), async {
            let _ = stopped.await;
        })
        .await?;
        eprintln!("lily: stopped");
        anyhow::Ok(())
    });
    // The engine thread, or a prompt being tokenised, may still be busy: do not wait for them.
    rt.shutdown_background();
    result
}

/// Ctrl-C (SIGINT) and SIGTERM.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Signals { int: signal(SignalKind::interrupt())?, term: signal(SignalKind::terminate())? })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next Ctrl-C or SIGTERM (one that came since the last call counts).
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
