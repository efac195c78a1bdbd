//! With the `cuda` feature: compiles every `kernels/*.cu` to an sm_90a cubin with nvcc 13.0 and
//! writes `$OUT_DIR/cubins.rs` (one `(name, bytes)` entry per kernel file, embedded with
//! `include_bytes!`). nvcc comes from `$NVCC`, else the workspace's `.cuda-toolchain` (installed from
//! PyPI by `.ci/run`), else `PATH`. Without the feature it does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=LILY_REQUIRE_NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let nvcc = find_nvcc(&manifest);
    // No nvcc: a binary without kernels (it says so at run time and stays on the CPU), unless
    // LILY_REQUIRE_NVCC is set (CI: a missing toolkit must fail the build).
    if Command::new(&nvcc).arg("--version").output().map(|o| !o.status.success()).unwrap_or(true) {
        if std::env::var_os("LILY_REQUIRE_NVCC").is_some() {
            panic!("LILY_REQUIRE_NVCC is set but nvcc ({}) does not run", nvcc.display());
        }
        println!(
            "cargo::warning=no nvcc found ({}): this build carries no GPU kernels and runs on the CPU only. \
             Install the CUDA 13 toolkit (or run tools/install-cuda-toolchain.sh) and rebuild for the GPU.",
            nvcc.display()
        );
        std::fs::write(out.join("cubins.rs"), "/// Built without nvcc: no kernels.\npub static CUBINS: &[(&str, &[u8])] = &[];\n").unwrap();
        return;
    }
    let include_cccl = nvcc.parent().and_then(Path::parent).map(|p| p.join("include/cccl"));

    let mut kernels: Vec<PathBuf> = std::fs::read_dir(manifest.join("kernels"))
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "cu")).collect())
        .unwrap_or_default();
    kernels.sort();

    let mut rs = String::from("/// Embedded sm_90a cubins: (kernel file stem, bytes).\npub static CUBINS: &[(&str, &[u8])] = &[\n");
    let mut log = String::new();
    for src in &kernels {
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        let cubin = out.join(format!("{stem}.sm_90a.cubin"));
        let mut cmd = Command::new(&nvcc);
        cmd.args(["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v"])
            .arg(format!("-I{}", manifest.join("kernels").display()));
        if let Some(cccl) = include_cccl.as_ref().filter(|p| p.exists()) {
            cmd.arg(format!("-I{}", cccl.display()));
        }
        let o = cmd.arg("-o").arg(&cubin).arg(src).output().unwrap_or_else(|e| {
            panic!("could not run nvcc at {}: {e}\nSet NVCC, or install the toolkit with .ci/run's pip line.", nvcc.display())
        });
        log.push_str(&String::from_utf8_lossy(&o.stderr));
        if !o.status.success() {
            panic!("nvcc failed on {}:\n{}", src.display(), String::from_utf8_lossy(&o.stderr));
        }
        rs.push_str(&format!("    ({stem:?}, include_bytes!({:?})),\n", cubin.display().to_string()));
    }
    rs.push_str("];\n");
    std::fs::write(out.join("cubins.rs"), rs).unwrap();
    std::fs::write(out.join("ptxas.log"), &log).unwrap();
    let listed = std::fs::read_to_string(manifest.join("kernels/mma_serialised.txt")).unwrap_or_default();
    let unlisted = unlisted_serialised(&log, &listed);
    if !unlisted.is_empty() {
        panic!(
            "ptxas serialises the MMAs of kernels not listed in kernels/mma_serialised.txt (fix them, or list them with why):\n{}",
            unlisted.join("\n")
        );
    }
}

/// The kernels whose MMAs ptxas says it serialises (C7512, C7515, C7519: `... in the function 'NAME'`)
/// that `listed` (a name first on each line; `#` comments) does not name, with the code.
fn unlisted_serialised(log: &str, listed: &str) -> Vec<String> {
    let names: std::collections::HashSet<&str> =
        listed.lines().filter(|l| !l.trim_start().starts_with('#')).filter_map(|l| l.split_whitespace().next()).collect();
    let mut out: Vec<String> = log
        .lines()
        .filter(|l| ["(C7512)", "(C7515)", "(C7519)"].iter().any(|c| l.contains(c)))
        .filter_map(|l| {
            let code = &l[l.find("(C75")? + 1..][..5];
            let name = l.rsplit("function '").next()?.split('\'').next()?;
            (!names.contains(name)).then(|| format!("{name} ({code})"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn find_nvcc(manifest: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for dir in manifest.ancestors() {
        let p = dir.join(".cuda-toolchain/nvidia/cu13/bin/nvcc");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("nvcc")
}
