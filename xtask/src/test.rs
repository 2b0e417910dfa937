//! `cargo xtask test`: the README's test command, and what `.ci/run` calls.
//!
//! Two tiers, each ending with its wall time and one line counting what
//! passed and failed (`tests: N passed, N failed`, which CI reads):
//!
//! - the full tier (the default, what CI runs): set-up (with the llama.cpp
//!   build the `engine_llamacpp` tests need: about 12 minutes once per
//!   machine, cached after; under `CI=true` a failed build fails here),
//!   `cargo fmt --check` and `cargo clippy --all-targets -D warnings`, a
//!   build of every binary (the end-to-end tests start them as real
//!   processes), the fuzz targets for a bounded time, then every test;
//! - `--fast`: every crate's library and binary unit tests (property tests
//!   included), the layout test and the eBPF fixtures, then the doc-tests;
//!   no set-up beyond the test runner, no real-process end-to-end test, no
//!   fuzzing.
//!
//! Tests run under cargo-nextest (`.config/nextest.toml`): each in a
//! process of its own with a time budget, so a hung test is killed and
//! fails by name. nextest does not run doc-tests; `cargo test --doc` does,
//! as a step of its own.

use std::io::{BufRead, BufReader, IsTerminal};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Seconds each fuzz target runs in the test command.
const FUZZ_SECONDS: u32 = 20;

/// The fast tier's test targets, as cargo selects them: every library's
/// and binary's own tests, and the integration tests that start no
/// process of the project's (`router-user/tests/layout.rs` reads sources,
/// `ebpf_fixtures.rs` runs the XDP program on synthetic frames).
const FAST_TARGETS: &[&str] = &[
    "--lib",
    "--bins",
    "--test",
    "layout",
    "--test",
    "ebpf_fixtures",
];

#[derive(clap::Args)]
pub struct Args {
    /// The fast tier: unit, property and layout tests, no set-up, no
    /// end-to-end tests, no fuzzing (about a minute warm).
    #[arg(long)]
    fast: bool,
    /// Skip the fuzz targets (they need a sanitizer build: minutes when cold).
    #[arg(long)]
    no_fuzz: bool,
    /// Extra arguments passed to `cargo nextest run` (after `--workspace`),
    /// such as a filter: `cargo xtask test -- router_http`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    if args.fast {
        crate::setup::ensure_nextest()?;
    } else {
        crate::setup::run()?;
        // Unformatted code or a clippy warning fails the test command.
        cargo(&["fmt", "--all", "--check"])?;
        cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])?;
        cargo(&["build", "--workspace", "--bins"])?;
        if !args.no_fuzz {
            let secs = FUZZ_SECONDS.to_string();
            run_cmd(
                Command::new("bash").args(["router-user/fuzz/run.sh", &secs]),
                "fuzzing",
            )?;
        }
    }
    let mut nextest = vec!["nextest", "run", "--workspace"];
    if args.fast {
        nextest.extend(FAST_TARGETS);
    }
    // CI gets the `ci` profile: the default one plus a JUnit report.
    if std::env::var_os("CI").is_some() {
        nextest.extend(["--profile", "ci"]);
    }
    if std::io::stderr().is_terminal() {
        // Its output is piped through here; keep the colours on a terminal.
        nextest.extend(["--color", "always"]);
    }
    nextest.extend(args.rest.iter().map(String::as_str));
    let tests = cargo_nextest(&nextest)?;
    // A filter given to nextest does not apply to doc-tests: they run only
    // when the whole tier does.
    let docs = if args.rest.is_empty() {
        cargo_test_doc(&["test", "--doc", "--workspace"])?
    } else {
        // Not run is not failed.
        Counts {
            ok: true,
            ..Counts::default()
        }
    };
    let tier = if args.fast { "fast" } else { "full" };
    println!(
        "{tier} tier: {} wall ({} skipped)",
        wall(started.elapsed()),
        tests.skipped
    );
    let (passed, failed) = (tests.passed + docs.passed, tests.failed + docs.failed);
    println!("tests: {passed} passed, {failed} failed");
    if !tests.ok {
        bail!("cargo nextest run failed");
    }
    if !docs.ok {
        bail!("cargo test --doc failed");
    }
    Ok(())
}

/// What one test step counted, and whether it exited successfully.
#[derive(Debug, Default, PartialEq)]
struct Counts {
    passed: u64,
    failed: u64,
    skipped: u64,
    ok: bool,
}

/// Runs `cargo nextest run`, echoing its output, and reads its closing
/// `Summary` line (nextest reports on stderr).
fn cargo_nextest(args: &[&str]) -> anyhow::Result<Counts> {
    eprintln!("+ cargo {}", args.join(" "));
    let mut child = cargo_cmd()
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .context("running cargo nextest")?;
    let err = child.stderr.take().context("cargo nextest stderr")?;
    let mut summary = None;
    for line in BufReader::new(err).lines() {
        let line = line?;
        eprintln!("{line}");
        if let Some(c) = nextest_summary(&line) {
            summary = Some(c);
        }
    }
    let ok = child.wait()?.success();
    match summary {
        Some(c) => Ok(Counts { ok, ..c }),
        // No summary: the build or the test listing failed.
        None if !ok => Ok(Counts {
            ok,
            failed: 1,
            ..Counts::default()
        }),
        None => bail!("cargo nextest run printed no summary"),
    }
}

/// The counts of nextest's closing line, as in
/// `Summary [  61.2s] 310 tests run: 308 passed (2 slow), 1 failed,
/// 1 timed out, 4 skipped`: a test that failed, could not start or ran out
/// of time counts as failed; `N/M tests run` when the run was cancelled.
fn nextest_summary(line: &str) -> Option<Counts> {
    let line = strip_ansi(line);
    let rest = line.trim_start().strip_prefix("Summary [")?;
    let (_, counts) = rest.split_once(" run: ")?;
    // Drop the parenthesised details ("(2 slow, 1 flaky)"): they split
    // counts already given, and hold commas of their own.
    let mut flat = String::new();
    let mut depth = 0u32;
    for ch in counts.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => flat.push(ch),
            _ => {}
        }
    }
    let mut c = Counts::default();
    for part in flat.split(',') {
        let part = part.trim();
        let Some((n, what)) = part.split_once(' ') else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what.trim() {
            "passed" => c.passed += n,
            "failed" | "exec failed" | "timed out" => c.failed += n,
            "skipped" => c.skipped += n,
            _ => {}
        }
    }
    Some(c)
}

/// `line` without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            // Skip to the sequence's final byte, a letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// Runs `cargo test --doc`, echoing its output, and sums its `test result:` lines.
fn cargo_test_doc(args: &[&str]) -> anyhow::Result<Counts> {
    eprintln!("+ cargo {}", args.join(" "));
    let mut child = cargo_cmd()
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test --doc")?;
    let mut c = Counts::default();
    let out = child.stdout.take().context("cargo test stdout")?;
    for line in BufReader::new(out).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            c.passed += count(rest, " passed");
            c.failed += count(rest, " failed");
        }
    }
    c.ok = child.wait()?.success();
    if !c.ok && c.failed == 0 {
        // Failed before running a test: a doc-test that did not compile.
        c.failed = 1;
    }
    Ok(c)
}

/// The number before `what` in `ok. 12 passed; 0 failed; ...`.
fn count(line: &str, what: &str) -> u64 {
    line.split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok. ")
                .trim_start_matches("FAILED. ")
                .strip_suffix(what.trim_start())
                .map(str::trim)
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// `1m 23s`, or `42s` under a minute.
fn wall(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// A `cargo` command; under `CI` without incremental state, which a clean
/// clone never reuses and which costs about 2 GB of disk on a cold build.
fn cargo_cmd() -> Command {
    let mut cmd = Command::new(cargo_bin());
    if std::env::var_os("CI").is_some() {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    cmd
}

pub fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run_cmd(cargo_cmd().args(args), &format!("cargo {}", args.join(" ")))
}

fn run_cmd(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    eprintln!("+ {what}");
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Counts, count, nextest_summary, strip_ansi, wall};
    use std::time::Duration;

    #[test]
    fn counts_cargo_test_result_lines() {
        let l = "ok. 12 passed; 3 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s";
        assert_eq!(count(l, " passed"), 12);
        assert_eq!(count(l, " failed"), 3);
        assert_eq!(count("FAILED. 2 passed; 1 failed; 0 ignored", " failed"), 1);
    }

    fn counts(passed: u64, failed: u64, skipped: u64) -> Option<Counts> {
        Some(Counts {
            passed,
            failed,
            skipped,
            ok: false,
        })
    }

    #[test]
    fn reads_nextest_summaries() {
        let all = "     Summary [  61.234s] 310 tests run: 310 passed, 0 skipped";
        assert_eq!(nextest_summary(all), counts(310, 0, 0));
        let mixed = "     Summary [ 200.000s] 310 tests run: 305 passed (2 slow, 1 flaky, 1 leaky), \
                     2 failed (1 due to being leaky), 1 exec failed, 2 timed out, 4 skipped";
        assert_eq!(nextest_summary(mixed), counts(305, 5, 4));
        let cancelled = "     Summary [   3.0s] 12/310 tests run: 11 passed, 1 failed, 298 skipped";
        assert_eq!(nextest_summary(cancelled), counts(11, 1, 298));
        assert_eq!(nextest_summary("        PASS [   0.1s] summary_test"), None);
    }

    #[test]
    fn reads_coloured_summaries() {
        let l = "\u{1b}[32;1m     Summary\u{1b}[0m [  1.0s] \u{1b}[1m3\u{1b}[0m tests run: \
                 \u{1b}[1m2\u{1b}[0m \u{1b}[32;1mpassed\u{1b}[0m, \u{1b}[1m1\u{1b}[0m \
                 \u{1b}[31;1mtimed out\u{1b}[0m, \u{1b}[1m0\u{1b}[0m skipped";
        assert_eq!(strip_ansi("\u{1b}[1mx\u{1b}[0m"), "x");
        assert_eq!(nextest_summary(l), counts(2, 1, 0));
    }

    #[test]
    fn wall_times_read_as_minutes_and_seconds() {
        assert_eq!(wall(Duration::from_millis(42_900)), "42s");
        assert_eq!(wall(Duration::from_secs(83)), "1m 23s");
    }
}
