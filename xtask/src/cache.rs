//! What set-up keeps outside the work tree, so fresh clones and CI runs on
//! one machine reuse it: the cache root, pinned Python virtualenvs, and the
//! step runner every install uses.
//!
//! The root is `cache_root.rs`'s. A virtualenv holds a marker file with the
//! pins it was made with; other pins (or none) mean it is made again, under
//! a `<venv>.lock` flock so two runs never install into one folder.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

pub use crate::cache_root::root;

/// Runs a set-up step; its failure names it.
pub fn step(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| what.to_string())?;
    if !status.success() {
        bail!("{what} failed: {status}");
    }
    Ok(())
}

/// A virtualenv at a path with pinned wheels from PyPI (binary wheels only).
pub struct Venv<'a> {
    pub path: PathBuf,
    pub pins: &'a [&'a str],
    /// What set-up calls it in its messages.
    pub what: &'a str,
    /// Whether what the venv is for works (beyond its Python existing).
    pub usable: fn(&Path) -> bool,
}

const MARKER: &str = ".prefix-router-ready";

impl Venv<'_> {
    fn pins(&self) -> String {
        self.pins.join(" ")
    }

    fn ready(&self) -> bool {
        self.path.join("bin/python").is_file()
            && std::fs::read_to_string(self.path.join(MARKER)).is_ok_and(|s| s == self.pins())
            && (self.usable)(&self.path)
    }

    /// Makes the virtualenv when it is missing or holds other pins; says
    /// either way where it is. Returns its Python.
    pub fn ensure(&self) -> anyhow::Result<PathBuf> {
        let (venv, pins, what) = (&self.path, self.pins(), self.what);
        let python = venv.join("bin/python");
        if self.ready() {
            eprintln!("setup: {what} ({pins}) cached in {}", venv.display());
            return Ok(python);
        }
        let parent = venv
            .parent()
            .context("a virtualenv needs a parent folder")?;
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
        let lock_path = venv.with_extension("lock");
        let lock = File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
        lock.lock()
            .with_context(|| format!("lock {}", lock_path.display()))?;
        if self.ready() {
            eprintln!(
                "setup: {what} ({pins}) cached in {} (by another run)",
                venv.display()
            );
            return Ok(python);
        }
        let started = Instant::now();
        eprintln!(
            "setup: {what} ({pins}) into {}, cached there for later runs",
            venv.display()
        );
        let _ = std::fs::remove_dir_all(venv);
        step(
            Command::new("python3").arg("-m").arg("venv").arg(venv),
            "python3 -m venv (Debian: apt-get install python3-venv)",
        )?;
        step(
            Command::new(&python)
                .args(["-m", "pip", "install", "-q", "--only-binary", ":all:"])
                .args(self.pins),
            &format!("pip install {pins}"),
        )?;
        if !(self.usable)(venv) {
            bail!(
                "{what}: installed {pins} into {}, but it does not run",
                venv.display()
            );
        }
        std::fs::write(venv.join(MARKER), &pins)?;
        eprintln!(
            "setup: {what} installed in {:.0}s",
            started.elapsed().as_secs_f64()
        );
        drop(lock);
        Ok(python)
    }
}
