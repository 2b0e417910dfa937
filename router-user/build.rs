//! Builds the XDP object (`router-ebpf`) with aya-build and puts it at
//! `$OUT_DIR/router-ebpf`, where `prefix_router::ebpf` embeds it.
//!
//! - `PREFIX_ROUTER_EBPF_OBJ=/path/router-ebpf.o`: reuse that prebuilt object;
//!   nothing is compiled (saves the ~30 s cold eBPF build per cargo profile).
//! - `AYA_BUILD_SKIP=1`: build the router without the object.
//! - bpf-linker or nightly `rust-src` missing: a `cargo:warning` names
//!   `cargo xtask setup`, and the router is built without the object.
//!
//! Without the object the `ebpf` module reports "this build has no eBPF object"
//! at start (mode `auto` warns once and carries on; `required` refuses to start).
//! A failing compile of the eBPF crate itself fails the build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// cfg set when `$OUT_DIR/router-ebpf` holds the object.
const HAS_OBJ_CFG: &str = "prefix_router_ebpf_obj";
const PREBUILT_ENV: &str = "PREFIX_ROUTER_EBPF_OBJ";

fn main() {
    println!("cargo::rustc-check-cfg=cfg({HAS_OBJ_CFG})");
    println!("cargo:rerun-if-env-changed={PREBUILT_ENV}");
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dst = out_dir.join("router-ebpf");
    let _ = std::fs::remove_file(&dst);

    if let Some(prebuilt) = env::var_os(PREBUILT_ENV).filter(|v| !v.is_empty()) {
        let prebuilt = PathBuf::from(prebuilt);
        println!("cargo:rerun-if-changed={}", prebuilt.display());
        if let Err(e) = std::fs::copy(&prebuilt, &dst) {
            panic!("{PREBUILT_ENV}={}: cannot copy: {e}", prebuilt.display());
        }
        println!("cargo:rustc-cfg={HAS_OBJ_CFG}");
        return;
    }

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let workspace = manifest
        .parent()
        .expect("router-user sits in the workspace");
    let ebpf_dir = workspace.join("router-ebpf");
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("common").display()
    );

    if let Some(missing) = missing_tool() {
        println!(
            "cargo:warning=building prefix-router WITHOUT its eBPF object: {missing}; \
             run `cargo xtask setup` to install it (or set {PREBUILT_ENV}=/path/router-ebpf.o)"
        );
        return;
    }

    // aya-build runs `cargo build --package router-ebpf` in the current directory;
    // router-ebpf is excluded from the workspace, so run it from its own folder.
    env::set_current_dir(&ebpf_dir).expect("router-ebpf folder exists");
    let root_dir = ebpf_dir.to_str().expect("UTF-8 path");
    let package = aya_build::Package {
        name: "router-ebpf",
        root_dir,
        ..Default::default()
    };
    let log = out_dir.join("aya-build.log");
    if let Err(e) = quietly(&log, || {
        aya_build::build_ebpf([package], aya_build::Toolchain::Nightly)
    }) {
        panic!("building router-ebpf failed: {e:#}");
    }
    if dst.is_file() {
        println!("cargo:rustc-cfg={HAS_OBJ_CFG}");
    }
}

/// Runs `build` with this script's stdout sent to `log`, then replays the
/// directives cargo needs. aya-build turns every line of the nested cargo's
/// progress ("Compiling ...") into a `cargo:warning`, which cargo would show on
/// every later build; only real diagnostics are kept (everything on failure).
fn quietly(log: &Path, build: impl FnOnce() -> aya_build::Result<()>) -> aya_build::Result<()> {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;

    let file = std::fs::File::create(log)?;
    std::io::stdout().flush()?;
    // SAFETY: dup/dup2/close act on file descriptors this process owns: fd 1
    // and `file`, which outlives the redirection; the saved copy of fd 1 is
    // restored and closed below on every path.
    let saved = unsafe { libc::dup(1) };
    if saved < 0 || unsafe { libc::dup2(file.as_raw_fd(), 1) } < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let result = build();
    let _ = std::io::stdout().flush();
    // SAFETY: as above; `saved` is a valid descriptor from `dup`.
    unsafe {
        libc::dup2(saved, 1);
        libc::close(saved);
    }
    let progress = [
        "Compiling",
        "Finished",
        "Fresh",
        "Locking",
        "Updating",
        "Downloading",
        "Downloaded",
        "Blocking",
        "Adding",
        "Checking",
    ];
    for line in std::fs::read_to_string(log)?.lines() {
        let text = line.strip_prefix("cargo:warning=").map(str::trim_start);
        let noise = text.is_some_and(|t| t.is_empty() || progress.iter().any(|p| t.starts_with(p)));
        if result.is_err() || !noise {
            println!("{line}");
        }
    }
    result
}

/// What the eBPF build needs and is not there, if anything. Also tells cargo to
/// run this script again when the tools may have been installed since.
fn missing_tool() -> Option<String> {
    let linker_ok = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !linker_ok {
        // `cargo install` puts it there: look again when that folder changes.
        let home = env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
        if let Some(bin) = home.map(|h| h.join("bin")) {
            println!("cargo:rerun-if-changed={}", bin.display());
        }
        return Some("bpf-linker is not installed".into());
    }
    let sysroot = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let Some(sysroot) = sysroot else {
        return Some("the nightly toolchain is not installed".into());
    };
    let rustlib = sysroot.join("lib/rustlib");
    if !rustlib.join("src/rust/library/core").is_dir() {
        println!("cargo:rerun-if-changed={}", rustlib.display());
        return Some("nightly's rust-src component is not installed".into());
    }
    None
}
