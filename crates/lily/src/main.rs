//! `lily`: the command-line entry point. Each subcommand is one job; errors from the libraries are
//! explained here, at the edge, and never panic.

mod converse;
mod profile;
mod info;
mod serve;

use std::io::{IsTerminal, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use converse::GenArgs;
use lily_model::Backend;
use lily_engine::{open, BackendKind, ChatModel, OpenOptions, PrefixCache};
use lily_model::affine::AffineParams;
use lily_model::weights::HfWeights;
use lily_model::LoadOptions;

#[derive(Parser)]
#[command(name = "lily", version, about = "lily runs Qwen3.6-35B-A3B (and tiny models of its family) fast, for one user at a time.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The OpenAI-compatible server: POST /v1/chat/completions and /v1/completions (streamed with
    /// "stream": true), GET /v1/models, /v1/models/{id}, /health, /metrics. Without --model it
    /// serves the built-in demo model (random weights, the real tokenizer and chat template) and
    /// says so. A line per request goes to stderr. Ctrl-C (or SIGTERM) ends the answers in flight
    /// and stops; a second Ctrl-C quits at once.
    Serve(serve::ServeArgs),
    /// Teacher-forced scoring: prints {"positions", "perplexity", "token_logprobs", "argmax"} as JSON.
    ///
    /// Entry i of token_logprobs is the log-probability of token i+1 given tokens 0..=i (so
    /// positions = len - 1) and argmax[i] is the most likely token there;
    /// perplexity = exp(-mean(token_logprobs)).
    Score {
        /// Checkpoint directory (config.json + safetensors; MLX 4-bit or Hugging Face bf16).
        #[arg(short = 'm', long)]
        model: PathBuf,
        /// A JSON file holding an array of token ids (at least 2).
        #[arg(long)]
        tokens: PathBuf,
        #[command(flatten)]
        load: LoadArgs,
        /// Prefill chunk size: tokens per forward call, as serving prefills a prompt.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
    },
    /// Writes a random checkpoint in the MLX 4-bit layout (config, tokenizer, safetensors shards).
    ///
    /// For speed tests and parity tests between engines: MLX-LM loads what it writes. Random routing
    /// is more even than a trained router's, so expert-load-dependent speed differs from real weights.
    Synth {
        /// A built-in name (qwen3.6-35b-a3b, qwen3.6-tiny) or a config.json in the Hugging Face form.
        #[arg(long)]
        config: String,
        /// Output directory (created; must be empty or absent).
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Bits per weight of the quantised matrices (router gates are always 8).
        #[arg(long, default_value_t = 4)]
        bits: u32,
        #[arg(long, default_value_t = 64)]
        group_size: usize,
        /// Skew the routers, as trained routers are skewed: the most favoured expert of each layer
        /// gets router logits (1 + S)× as spread as the least favoured, and is chosen several times
        /// as often (5× at S = 7 with 16 experts, top 4). 0: even, as random routers are.
        #[arg(long, default_value_t = 0.0, value_name = "S")]
        router_skew: f32,
    },
    /// One answer to one prompt, streamed: reasoning (dimmed) to stderr, the answer to stdout.
    /// The prompt is the argument, or -p/--prompt; `-` reads it from stdin.
    Run {
        /// Checkpoint directory; without it, the built-in demo model (random weights).
        #[arg(short = 'm', long)]
        model: Option<PathBuf>,
        /// The user's message (`-`: read it from stdin).
        #[arg(value_name = "PROMPT", conflicts_with = "prompt")]
        text: Option<String>,
        /// The user's message (`-`: read it from stdin).
        #[arg(short = 'p', long)]
        prompt: Option<String>,
        #[command(flatten)]
        load: LoadArgs,
        #[command(flatten)]
        gen: GenArgs,
    },
    /// Interactive chat in the terminal: history, /reset, Ctrl-C stops an answer, Ctrl-D quits.
    Chat {
        /// Checkpoint directory; without it, the built-in demo model (random weights).
        #[arg(short = 'm', long)]
        model: Option<PathBuf>,
        #[command(flatten)]
        load: LoadArgs,
        #[command(flatten)]
        gen: GenArgs,
    },
    /// Text on stdin to token ids (a JSON array on stdout); with --decode, ids on stdin to text.
    Tokenize {
        /// Checkpoint directory (its tokenizer.json).
        #[arg(short = 'm', long)]
        model: PathBuf,
        #[arg(long)]
        decode: bool,
        /// With --decode: leave out control tokens such as <|im_end|>.
        #[arg(long)]
        skip_special: bool,
    },
    /// Prints the exact prompt text the checkpoint's chat template makes of an OpenAI-style chat
    /// request body (messages, tools, chat_template_kwargs, add_generation_prompt).
    Render {
        /// Checkpoint directory (tokenizer_config.json's chat_template or chat_template.jinja;
        /// the built-in Qwen3.6 template when it has none).
        #[arg(short = 'm', long)]
        model: PathBuf,
        /// The request body, as JSON (`-` for stdin).
        #[arg(long)]
        request: PathBuf,
    },
    /// Prefill and decode throughput over a sweep of lengths: for each length, prefill a fresh
    /// session with that many random token ids (chunked as serving does), then decode greedily from
    /// it; medians of --repeats runs after a warm-up. A table on stdout; --json writes the rows.
    Bench {
        /// Checkpoint directory (e.g. one written by `lily synth --config qwen3.6-35b-a3b`).
        #[arg(short = 'm', long)]
        model: PathBuf,
        /// Prompt and context lengths, comma-separated (K suffix allowed: 4K = 4096).
        #[arg(long, value_delimiter = ',', default_value = "256,512,1K,2K,4K,8K,16K,32K,64K,128K", value_parser = parse_length)]
        lengths: Vec<usize>,
        /// Tokens generated per decode measurement.
        #[arg(long, default_value_t = 64)]
        decode_tokens: usize,
        /// Timed runs per figure (the median is reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Also write the rows as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        #[command(flatten)]
        load: LoadArgs,
    },
    /// The decode and prefill ledgers (CUDA): one decode step at each --context, op by op (time,
    /// bytes, share of the measured copy bandwidth) against the step's replayed graph, then each op's
    /// marginal cost in that graph (the step replayed without the op's kernels); and the
    /// prefill of each --prompt, phase by phase (time, TFLOP/s). Markdown tables on stdout.
    Profile {
        /// Checkpoint directory (e.g. one written by `lily synth --config qwen3.6-35b-a3b`).
        #[arg(long)]
        model: PathBuf,
        /// Context lengths for the decode ledger, comma-separated (K suffix allowed).
        #[arg(long, value_delimiter = ',', default_value = "4K", value_parser = parse_length)]
        context: Vec<usize>,
        /// Prompt lengths for the prefill ledger, comma-separated (none by default).
        #[arg(long, value_delimiter = ',', value_parser = parse_length)]
        prompt: Vec<usize>,
        /// Decode steps profiled (the median per op is reported).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Also write every op of every layer as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        #[command(flatten)]
        load: LoadArgs,
    },
    /// Describes a checkpoint: its configuration, format and size.
    Info {
        #[arg(short = 'm', long)]
        model: PathBuf,
        #[command(flatten)]
        load: LoadArgs,
    },
}

#[derive(clap::Args)]
struct LoadArgs {
    /// Backend: auto (CUDA when available, else CPU), cpu or cuda.
    #[arg(long, default_value = "auto")]
    backend: BackendKind,
    /// For a Hugging Face bf16 checkpoint: keep the weights in bf16 instead of quantising them at
    /// load (to 4 bits, group 64, exactly as mlx_lm.convert would).
    #[arg(long)]
    keep_bf16: bool,
    /// CUDA: load kernels from DIR/<name>.sm_90a.cubin where such a file exists, instead of the ones
    /// built into this binary (for trying a kernel rebuilt on the GPU machine).
    #[arg(long, value_name = "DIR")]
    kernel_dir: Option<PathBuf>,
    /// CUDA: the most prompt tokens one forward pass runs at once (bigger is faster and uses more
    /// memory: ~3.5 GB of activations at 8192 on the 35B model, 1.74 GB at 4096).
    #[arg(long, default_value_t = lily_engine::DEFAULT_MAX_CHUNK)]
    max_chunk: usize,
}

impl LoadArgs {
    fn options(&self) -> OpenOptions {
        OpenOptions {
            load: LoadOptions {
                hf: if self.keep_bf16 { HfWeights::KeepBf16 } else { HfWeights::Quantize(AffineParams { bits: 4, group_size: 64 }) },
            },
            kernel_dir: self.kernel_dir.clone(),
            max_chunk: self.max_chunk,
            progress: true,
        }
    }
}

/// `4096`, `4K` or `4k` (× 1024).
fn parse_length(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1024),
        None => (t, 1),
    };
    match num.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n * mul),
        _ => Err(format!("`{s}` is not a length (e.g. 512 or 4K)")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", explain(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Score { model, tokens, load, chunk } => {
            check_model_dir(&model)?;
            let text = std::fs::read_to_string(&tokens).with_context(|| format!("reading {}", tokens.display()))?;
            let ids: Vec<u32> = serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON array of token ids", tokens.display()))?;
            if ids.len() < 2 {
                bail!("{}: scoring needs at least 2 tokens, got {}", tokens.display(), ids.len());
            }
            if chunk == 0 {
                bail!("--chunk must be at least 1");
            }
            let mut loaded = open(&model, load.backend, &load.options())?;
            let result = lily_engine::score(&mut loaded, &ids, chunk)?;
            println!("{}", serde_json::to_string(&result)?);
        }
        Command::Synth { config, out, seed, bits, group_size, router_skew } => {
            let cfg = match lily_model::synth::builtin_config(&config) {
                Some(c) => c,
                None => {
                    let p = PathBuf::from(&config);
                    if !p.exists() {
                        bail!(
                            "`{config}` is neither a built-in config ({}) nor a file",
                            lily_model::synth::builtin_names().join(", ")
                        );
                    }
                    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
                    serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", p.display()))?
                }
            };
            if out.exists() && std::fs::read_dir(&out).map(|mut d| d.next().is_some()).unwrap_or(true) {
                bail!("{}: exists and is not empty; choose a new directory", out.display());
            }
            let opts = lily_model::synth::SynthOptions { config: cfg, out: out.clone(), seed, bits, group_size, max_shard_bytes: 5 << 30, router_skew };
            let bar = progress_bar();
            let t = std::time::Instant::now();
            let report = lily_model::synth::synthesize(&opts, &bar)?;
            bar.finish_and_clear();
            eprintln!(
                "wrote {} in {:.1} s: {} parameters in {} tensors ({bits}-bit, groups of {group_size}; the router gates 8-bit), {} in {} files; tokenizer: {}.",
                out.display(),
                t.elapsed().as_secs_f64(),
                info::count(report.parameters),
                report.tensors,
                info::bytes(report.bytes),
                report.files.len(),
                report.tokenizer
            );
        }
        Command::Serve(args) => serve::serve(args)?,
        Command::Run { model, text, prompt, load, gen } => {
            let prompt = match text.or(prompt) {
                Some(p) if p == "-" => {
                    let mut s = String::new();
                    std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
                    s
                }
                Some(p) => p,
                None => bail!("no prompt: give it as an argument (lily run \"Hello\"), with -p, or `-` to read it from stdin"),
            };
            if prompt.trim().is_empty() {
                bail!("the prompt is empty");
            }
            let mut m = open_chat(model.as_deref(), &load)?;
            let mut messages = Vec::new();
            if let Some(sys) = &gen.system {
                messages.push(serde_json::json!({"role": "system", "content": sys}));
            }
            messages.push(serde_json::json!({"role": "user", "content": prompt}));
            let p = converse::render(&m, &messages, &gen.kwargs())?;
            let mut spec = gen.spec(&m);
            if let Some(st) = gen.structured(&m)? {
                st.constrain(&mut spec, &p)?;
            }
            let stop = install_ctrl_c();
            let mut cache = PrefixCache::new(0);
            let (_, outcome, cached) = converse::answer(&mut m, &mut cache, &p, &spec, &stop)?;
            println!();
            eprintln!("{}", converse::dim(std::io::stderr().is_terminal(), &converse::speed_line(&outcome, cached)));
        }
        Command::Chat { model, load, gen } => chat(open_chat(model.as_deref(), &load)?, gen)?,
        Command::Tokenize { model, decode, skip_special } => {
            check_model_dir(&model)?;
            let tok = lily_tokenizer::Tokenizer::from_dir(&model)?;
            let mut input = String::new();
            std::io::stdin().read_to_string(&mut input).context("reading stdin")?;
            if decode {
                let ids: Vec<u32> = serde_json::from_str(&input).context("stdin: expected a JSON array of token ids")?;
                print!("{}", tok.decode(&ids, skip_special)?);
            } else {
                println!("{}", serde_json::to_string(&tok.encode(&input)?)?);
            }
        }
        Command::Render { model, request } => {
            check_model_dir(&model)?;
            let template = lily_template::ChatTemplate::from_dir(&model)?;
            let text = if request.as_os_str() == "-" {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s).context("reading stdin")?;
                s
            } else {
                std::fs::read_to_string(&request).with_context(|| format!("reading {}", request.display()))?
            };
            let name = if request.as_os_str() == "-" { "stdin".to_string() } else { request.display().to_string() };
            let body: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{name}: not valid JSON"))?;
            print!("{}", template.render_request(&body)?);
        }
        Command::Bench { model, lengths, decode_tokens, repeats, json, load } => {
            check_model_dir(&model)?;
            if decode_tokens == 0 {
                bail!("--decode-tokens must be at least 1");
            }
            let mut m = open(&model, load.backend, &load.options())?;
            let max_pos = m.config().max_position_embeddings;
            if let Some(&l) = lengths.iter().find(|&&l| l + decode_tokens + 1 > max_pos) {
                bail!("length {l} + {decode_tokens} decoded tokens exceeds the model's {max_pos} positions");
            }
            let spec = lily_engine::bench::BenchSpec { lengths, decode_tokens, repeats, seed: 0 };
            eprintln!(
                "lily bench: {} on {} (random token ids: a trained router spreads tokens less evenly), {} repeats, median",
                model.display(),
                m.name(),
                spec.repeats
            );
            println!("| length | prefill tok/s | decode tok/s |");
            println!("|-------:|--------------:|-------------:|");
            let rows = lily_engine::bench::bench(&mut m, &spec, |r| {
                println!("| {} | {:.0} | {:.1} |", r.length, r.prefill_tok_s, r.decode_tok_s);
            })?;
            if let Some(path) = json {
                let doc = serde_json::json!({
                    "engine": "lily",
                    "version": env!("CARGO_PKG_VERSION"),
                    "backend": m.name(),
                    "model": model.display().to_string(),
                    "repeats": spec.repeats,
                    "rows": rows,
                });
                std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n").with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Command::Profile { model, context, prompt, repeats, json, load } => {
            let mut m = open(&model, load.backend, &load.options())?;
            profile::run(&mut m, &model, &context, &prompt, repeats, json.as_deref())?;
        }
        Command::Info { model, load } => {
            check_model_dir(&model)?;
            let w = lily_model::ModelWeights::load(&model, &load.options().load)?;
            info::print(&model, &w)?;
        }
    }
    Ok(())
}

/// A --model that is not a directory, said once and plainly (before any file in it is opened).
fn check_model_dir(dir: &std::path::Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => bail!("{}: not a directory (--model takes a checkpoint directory)", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!("{}: no such directory", dir.display()),
        Err(e) => bail!("{}: {}", dir.display(), plain_io(&e)),
    }
}

/// An OS error without Rust's "(os error N)".
fn plain_io(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// An error and its causes in one line, each said once (many errors already include their cause's
/// text, which the chain would repeat).
fn explain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if out.contains(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    out
}

/// A checkpoint for conversations, or the demo model (and a line saying so).
fn open_chat(model: Option<&std::path::Path>, load: &LoadArgs) -> Result<ChatModel> {
    match model {
        Some(dir) => {
            check_model_dir(dir)?;
            Ok(ChatModel::open(dir, load.backend, &load.options())?)
        }
        None => {
            eprintln!(
                "No --model given: using the built-in demo model (random weights of the real architecture, \
                 the real tokenizer; it talks nonsense) at {}.",
                lily_engine::chat::demo_dir().display()
            );
            Ok(ChatModel::open_demo(load.backend, &load.options())?)
        }
    }
}

/// Ctrl-C sets the returned flag (and stops the answer being generated) instead of killing lily.
fn install_ctrl_c() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&flag);
    // A second install (never happens in one process run) would fail; then Ctrl-C keeps its default.
    let _ = ctrlc::set_handler(move || f.store(true, Ordering::SeqCst));
    flag
}

fn chat(mut m: ChatModel, gen: GenArgs) -> Result<()> {
    use rustyline::error::ReadlineError;
    let tty = std::io::stderr().is_terminal();
    eprintln!(
        "lily chat: {} on {}. /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer.",
        if m.demo { "the demo model".to_string() } else { m.dir.display().to_string() },
        m.model.name()
    );
    let stop = install_ctrl_c();
    let mut editor = rustyline::DefaultEditor::new()?;
    let base: Vec<serde_json::Value> = gen.system.iter().map(|s| serde_json::json!({"role": "system", "content": s})).collect();
    let mut messages = base.clone();
    let mut spec = gen.spec(&m);
    let structured = gen.structured(&m)?;
    let mut cache = PrefixCache::new(2 << 30);
    loop {
        let line = match editor.readline(">>> ") {
            Ok(l) => l,
            // Ctrl-C at the prompt: nothing to stop; say how to leave.
            Err(ReadlineError::Interrupted) => {
                eprintln!("{}", converse::dim(tty, "(Ctrl-C stops an answer; /exit or Ctrl-D quits)"));
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line);
        match line {
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = base.clone();
                cache.clear();
                eprintln!("{}", converse::dim(tty, "(history cleared)"));
                continue;
            }
            "/help" => {
                eprintln!("/reset clears the history; /exit or Ctrl-D quits; Ctrl-C stops an answer.");
                continue;
            }
            _ => {}
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        stop.store(false, Ordering::SeqCst);
        let prompt = converse::render(&m, &messages, &gen.kwargs())?;
        if let Some(st) = &structured {
            st.constrain(&mut spec, &prompt)?;
        }
        let (msg, outcome, cached) = converse::answer(&mut m, &mut cache, &prompt, &spec, &stop)?;
        println!();
        eprintln!("{}", converse::dim(tty, &converse::speed_line(&outcome, cached)));
        let mut reply = serde_json::json!({"role": "assistant", "content": msg.content.unwrap_or_default()});
        if let Some(r) = msg.reasoning {
            reply["reasoning_content"] = serde_json::Value::String(r);
        }
        messages.push(reply);
    }
    Ok(())
}

fn progress_bar() -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})")
            .unwrap()
            .progress_chars("=> "),
    );
    bar
}
