//! `cargo run --release -p lily-model --example synth -- NAME_OR_CONFIG_JSON OUT_DIR [SEED [BITS [GROUP]]]`:
//! writes a random MLX-layout checkpoint (the library side of `lily synth`), printing the time taken.

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!(
            "usage: synth NAME_OR_CONFIG_JSON OUT_DIR [SEED [BITS [GROUP]]]   (built-ins: {})",
            lily_model::synth::builtin_names().join(", ")
        );
        std::process::exit(2);
    }
    let config = lily_model::synth::builtin_config(&args[1]).unwrap_or_else(|| {
        let text = std::fs::read_to_string(&args[1]).expect("read config");
        serde_json::from_str(&text).expect("config JSON")
    });
    let mut opts = lily_model::synth::SynthOptions::new(config, &args[2]);
    opts.seed = args.get(3).map(|s| s.parse().expect("seed")).unwrap_or(0);
    opts.bits = args.get(4).map(|s| s.parse().expect("bits")).unwrap_or(4);
    opts.group_size = args.get(5).map(|s| s.parse().expect("group size")).unwrap_or(64);
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}").unwrap(),
    );
    let t = Instant::now();
    match lily_model::synth::synthesize(&opts, &bar) {
        Ok(r) => {
            bar.finish_and_clear();
            eprintln!(
                "wrote {} in {:.1}s: {} tensors, {} parameters, {:.3} GB ({} files)",
                args[2],
                t.elapsed().as_secs_f64(),
                r.tensors,
                r.parameters,
                r.bytes as f64 / 1e9,
                r.files.len()
            );
        }
        Err(e) => {
            bar.finish_and_clear();
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
