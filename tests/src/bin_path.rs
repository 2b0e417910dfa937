//! Locating the workspace's binaries from a test.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Binaries already built by [`bin_path`] in this process.
static BUILT: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The cargo profile directory (`target/<profile>`) of the running executable.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("exe has a parent").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir
    }
}

/// Path of workspace binary `name` (`sim-engine`, `workload`,
/// `prefix-router`) in the target directory of the running test (honoring
/// `CARGO_TARGET_DIR`, since that is where the test itself was built). If it
/// is missing, runs `cargo build --bin NAME` with the same profile once.
///
/// # Panics
/// If the binary is missing and cannot be built.
pub fn bin_path(name: &str) -> PathBuf {
    let dir = profile_dir();
    let path = dir.join(name);
    if path.exists() {
        return path;
    }
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let built = built.get_or_insert_with(HashSet::new);
    if !built.contains(name) {
        build(name, &dir);
        built.insert(name.to_string());
    }
    assert!(
        path.exists(),
        "{} missing after `cargo build --bin {name}`",
        path.display()
    );
    path
}

fn build(name: &str, profile_dir: &Path) {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let target_dir = profile_dir.parent().expect("target dir");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--bin", name])
        .env("CARGO_TARGET_DIR", target_dir);
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    eprintln!(
        "testkit: building {name} ({profile}) in {}",
        target_dir.display()
    );
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {name}: {e}"));
    assert!(
        status.success(),
        "`cargo build --bin {name}` failed ({status}); build it first"
    );
}
