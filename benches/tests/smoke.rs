//! A tiny demo and a tiny bench, end to end, so neither can rot: real
//! engines, the real router, nginx when present (required under CI).

use std::path::PathBuf;
use std::process::Command;

fn bin_dir() -> PathBuf {
    let router = testkit::bin_path("prefix-router");
    let engine = testkit::bin_path("sim-engine");
    assert_eq!(router.parent(), engine.parent());
    router.parent().expect("bin folder").to_path_buf()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("prefix-bench-smoke-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// One run of prefix-bench that succeeded, and the folder it wrote.
struct Run {
    /// What `--out` named: a fresh folder of the test's own.
    out: PathBuf,
    /// What it printed.
    stdout: String,
}

impl Run {
    /// Runs `prefix-bench --out <fresh folder named after name> args…`;
    /// panics, with what it printed, unless it succeeds.
    fn new(name: &str, args: &[&str]) -> Run {
        let out = tmp(name);
        let args = [&["--out", out.to_str().unwrap()], args].concat();
        let o = Command::new(env!("CARGO_BIN_EXE_prefix-bench"))
            .arg("--bin-dir")
            .arg(bin_dir())
            .args(&args)
            .output()
            .expect("run prefix-bench");
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "prefix-bench {args:?} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        Run { out, stdout }
    }

    /// Its `results.json`.
    fn results(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.out.join("results.json")).unwrap()).unwrap()
    }

    /// Its `report.md`.
    fn report(&self) -> String {
        std::fs::read_to_string(self.out.join("report.md")).unwrap()
    }

    /// Removes its folder; a failing test keeps it, to be looked at.
    fn remove(self) {
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

#[test]
fn tiny_demo_writes_a_report_with_charts() {
    let run = Run::new(
        "demo",
        &[
            "demo",
            "--engines",
            "2",
            "--users",
            "4",
            "--duration",
            "2",
            // The peer routers never run under `cargo xtask test`.
            "--peers",
            "off",
        ],
    );
    let (out, stdout) = (&run.out, &run.stdout);
    assert!(stdout.contains("report: "), "{stdout}");
    for f in [
        "report.md",
        "ttft.svg",
        "load.svg",
        "hit-rate.svg",
        "cost.svg",
        "results.json",
    ] {
        assert!(out.join(f).exists(), "{f} missing in {}", out.display());
    }
    let r = run.results();
    let policies = r["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 3);
    for p in policies {
        let ok = p["summary"]["ok"].as_u64().unwrap();
        assert!(ok > 0, "{p}");
        assert_eq!(p["summary"]["errors"].as_u64(), Some(0), "{p}");
        let pooled = p["pooled"].as_f64().unwrap_or_else(|| panic!("{p}"));
        assert!(
            pooled > 0.0 && pooled <= p["summary"]["ceiling_hit_rate"].as_f64().unwrap() + 0.01
        );
        // Every engine named by its own count, none left unattributed.
        let per = p["summary"]["per_instance"].as_object().unwrap();
        let names: Vec<&str> = per.keys().map(String::as_str).collect();
        assert_eq!(names, ["engine-0", "engine-1"], "{p}");
        let counted: u64 = per.values().map(|v| v.as_u64().unwrap()).sum();
        assert_eq!(
            counted, ok,
            "the engines completed what the client got: {p}"
        );
        let cost = &p["cost"];
        for k in ["conversations", "computed_tokens", "busy_s", "prefill_s"] {
            let v = cost[k].as_f64().unwrap_or_else(|| panic!("{k}: {p}"));
            assert!(v > 0.0, "{k}: {p}");
        }
        assert!(cost["prefill_s"].as_f64() < cost["busy_s"].as_f64(), "{p}");
    }
    let load = std::fs::read_to_string(out.join("load.svg")).unwrap();
    let panels = load_chart_series(&load);
    let names: Vec<&str> = panels.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(
        names,
        ["prefix", "round-robin", "least-request"],
        "a load panel per policy"
    );
    for (policy, engines, lines) in &panels {
        assert_eq!(engines, &["engine-0", "engine-1"], "{policy}'s load panel");
        assert!(*lines >= 2, "{policy}'s load panel draws {lines} lines");
    }
    let md = run.report();
    assert!(md.contains("| pooled |"), "{md}");
    // The cost per conversation: first in the report, then its table with
    // every policy set against round-robin.
    let first = md.lines().nth(2).unwrap_or_default();
    assert!(
        first.starts_with("**What a conversation cost.**")
            && first.contains("Under prefix: ")
            && first.contains(" prompt computation and ")
            && first.contains("TTFT p50 "),
        "{md}"
    );
    assert!(
        md.contains("| policy | conversations | prompt tok computed / conv | saving vs RR | engine GPU s / conv | saving vs RR | TTFT p50 vs RR | TTFT p90 vs RR |"),
        "{md}"
    );
    for policy in ["prefix", "round-robin", "least-request"] {
        let line = cost_line(&md, &[policy], 9);
        let cells: Vec<&str> = line.split(" | ").collect();
        assert!(cells[3].ends_with('%') && cells[5].ends_with('%'), "{line}");
    }
    assert!(md.contains("![against round-robin](cost.svg)"), "{md}");
    assert!(
        md.contains("| policy | engine-0 | engine-1 | max/mean |"),
        "requests per engine:\n{md}"
    );
    run.remove();
}

/// The line of the report's cost table whose first cells are `first` and
/// that has `cells` cells in all (split at `" | "`); panics without one.
fn cost_line<'a>(md: &'a str, first: &[&str], cells: usize) -> &'a str {
    let start = format!("| {} | ", first.join(" | "));
    md.lines()
        .filter(|l| l.starts_with(&start))
        .find(|l| l.split(" | ").count() == cells)
        .unwrap_or_else(|| panic!("no cost line for {}:\n{md}", first.join(" / ")))
}

/// Each panel of a load chart: its policy, the engines its legend names,
/// and how many lines of data (coloured, more than two points) it draws.
fn load_chart_series(svg: &str) -> Vec<(String, Vec<String>, usize)> {
    const CAPTION: &str = ": requests in flight per engine";
    let texts = |s: &str| -> Vec<String> {
        s.split("</text>")
            .filter_map(|t| t.rsplit('>').next())
            .map(|t| t.trim().to_string())
            .collect()
    };
    let mut panels = Vec::new();
    let mut parts = svg.split(CAPTION);
    let mut policy = parts
        .next()
        .and_then(|head| head.rsplit('>').next())
        .map(|t| t.trim().to_string());
    for panel in parts {
        let mut engines: Vec<String> = texts(panel)
            .into_iter()
            .filter(|t| t.starts_with("engine-") || t == "unknown")
            .collect();
        engines.sort();
        engines.dedup();
        let lines = panel
            .split("<polyline")
            .skip(1)
            .filter_map(|l| l.split("/>").next())
            .filter(|l| !l.contains("stroke=\"#000000\""))
            .filter_map(|l| l.split("points=\"").nth(1)?.split('"').next())
            .filter(|pts| pts.split_whitespace().count() > 2)
            .count();
        panels.push((policy.take().unwrap_or_default(), engines, lines));
        // The next panel's caption ends this one.
        policy = panel.rsplit('>').next().map(|t| t.trim().to_string());
    }
    panels
}

#[test]
fn tiny_bench_measures_every_target() {
    let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    let mode = match (nginx, std::env::var_os("CI").is_some()) {
        (true, _) => "require",
        (false, true) => "require", // fails below: CI must have nginx
        (false, false) => {
            eprintln!(
                "nginx is not installed: skipping the nginx part (cargo xtask setup installs it)"
            );
            "off"
        }
    };
    let root = tmp("bench-root");
    let run = Run::new(
        "bench",
        &[
            "--results-root",
            root.to_str().unwrap(),
            "bench",
            "--quick",
            "--nginx",
            mode,
            "--baseline",
            "none",
        ],
    );
    let r = run.results();
    let rows = r["overhead"]["rows"].as_array().unwrap();
    let mut want = vec!["direct", "prefix-router"];
    if mode == "require" {
        want.push("nginx");
    }
    // Envoy round-robin and Envoy with the picker, when setup installed
    // Envoy (required under CI).
    if testkit::envoy_proc::binary().is_ok() || std::env::var_os("CI").is_some() {
        want.extend(["envoy", "envoy+epp"]);
        let picked = rows
            .iter()
            .find(|x| x["target"] == "envoy+epp" && x["phase"] == "tiny")
            .expect("an envoy+epp row");
        assert!(
            picked["picker_cpu_us_per_req"]
                .as_f64()
                .is_some_and(|c| c > 0.0),
            "{picked}"
        );
    }
    for t in want {
        let row = rows
            .iter()
            .find(|x| x["target"] == t && x["phase"] == "tiny")
            .unwrap_or_else(|| panic!("no tiny row for {t}"));
        assert!(row["rps"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["errors"].as_u64(), Some(0), "{row}");
        // What the engines and the load generator spent per request
        // behind this target: real work, under a millisecond each.
        for k in ["engines_cpu_us_per_req", "loadgen_cpu_us_per_req"] {
            let v = row[k].as_f64().unwrap();
            assert!(v > 0.0 && v < 1_000.0, "{k}: {row}");
        }
    }
    assert!(rows.iter().any(|x| x["phase"] == "stream"));
    let q = r["quality_rows"].as_array().unwrap();
    assert!(!q.is_empty() && q.iter().all(|x| x["requests"].as_u64().unwrap() > 0));
    // Every row has its pooled-cache reference, and a bounded cache hits
    // no more than the unbounded one of the same trace; and its cost per
    // conversation, from the engines' own counters.
    for x in q {
        let pooled = x["pooled"].as_f64().unwrap_or_else(|| panic!("{x}"));
        let ceiling = x["ceiling"].as_f64().unwrap();
        assert!(pooled > 0.0 && pooled <= ceiling + 0.01, "{x}");
        for k in ["conversations", "computed_tokens", "busy_s"] {
            let v = x["cost"][k].as_f64().unwrap_or_else(|| panic!("{k}: {x}"));
            assert!(v > 0.0, "{k}: {x}");
        }
    }
    let md = run.report();
    assert!(md.contains("## Targets"), "{md}");
    assert!(md.contains("### Cost per conversation"), "{md}");
    // Every scenario states its saving against round-robin.
    for x in q {
        let (sc, policy) = (
            x["scenario"].as_str().unwrap(),
            x["policy"].as_str().unwrap(),
        );
        let line = cost_line(&md, &[sc, policy], 10);
        let cells: Vec<&str> = line.split(" | ").collect();
        assert!(cells[4].ends_with('%') && cells[6].ends_with('%'), "{line}");
    }
    run.remove();
}

#[test]
fn tiny_replicas_run_reports_each_replica_count() {
    let run = Run::new(
        "replicas",
        &[
            "quality",
            "--scenario",
            "templated-batch",
            "--replicas",
            "1,2",
            "--policies",
            "prefix,prefix@alone",
            "--duration",
            "2",
            "--peers",
            "off",
        ],
    );
    let r = run.results();
    let rows = r["quality_rows"].as_array().unwrap();
    let counts: Vec<u64> = rows
        .iter()
        .map(|x| x["replicas"].as_u64().unwrap())
        .collect();
    // The sharing front at 1 and 2 replicas; alone at 2 only (one replica
    // alone is the sharing front's single one).
    let fronts: Vec<(&str, u64)> = rows
        .iter()
        .map(|x| x["policy"].as_str().unwrap())
        .zip(counts)
        .collect();
    assert_eq!(
        fronts,
        [("prefix", 1), ("prefix", 2), ("prefix@alone", 2)],
        "{rows:?}"
    );
    for x in rows {
        assert!(x["requests"].as_u64().unwrap() > 0, "{x}");
        assert_eq!(x["errors"].as_u64(), Some(0), "{x}");
        let kept = x["kept"].as_f64().unwrap_or_else(|| panic!("{x}"));
        assert!(kept > 0.0, "{x}");
    }
    let md = run.report();
    assert!(md.contains("### Router replicas"), "{md}");
    for n in [1, 2] {
        assert!(
            md.contains(&format!("| templated-batch | {n} | ")),
            "no line for {n} replicas:\n{md}"
        );
    }
    run.remove();
}

#[test]
fn tiny_restart_measures_the_restarted_replica_and_each_stream() {
    let run = Run::new(
        "restart",
        &[
            "quality",
            "--scenario",
            "templated-batch",
            "--replicas",
            "2",
            "--policies",
            "prefix",
            "--duration",
            "3",
            "--restart-replica",
            "1",
            "--peers",
            "off",
        ],
    );
    let r = run.results();
    let row = &r["quality_rows"][0];
    let restart = &row["restarts"][0];
    let ready = restart["ready_after_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("{row}"));
    assert!(ready > 0.0 && ready < 30.0, "{restart}");
    assert!(restart["killed_at_s"].as_f64().unwrap() >= 1.0, "{restart}");
    assert!(
        restart["others"]["requests"].as_u64().unwrap() > 0,
        "{restart}"
    );
    // Both replicas' streams, the restarted one's from its restart.
    let bw = row["bandwidth"].as_array().unwrap();
    assert_eq!(bw.len(), 2, "{row}");
    for b in bw {
        assert!(b["bytes"].as_u64().unwrap() > 0, "{b}");
        assert!(b["messages"].as_u64().unwrap() > 0, "{b}");
    }
    assert_eq!(bw[1]["restarted"].as_bool(), Some(true), "{row}");
    let checks = r["checks"].as_array().unwrap();
    assert!(
        checks
            .iter()
            .any(|c| c["target"].as_str().unwrap().contains("restarted")),
        "{checks:?}"
    );
    let md = run.report();
    for line in [
        "### A replica killed and restarted",
        "### Replica stream bandwidth",
        "| templated-batch | 2 | ",
        "| templated-batch | prefix | 2 | 1 | ",
    ] {
        assert!(md.contains(line), "no {line:?} in:\n{md}");
    }
    run.remove();
}

#[test]
fn tiny_replicas_bandwidth_reports_each_replica_s_stream() {
    let run = Run::new(
        "bandwidth",
        &["replicas-bandwidth", "--rate", "50", "--duration", "2"],
    );
    let stdout = &run.stdout;
    assert!(stdout.contains("Achieved: **"), "{stdout}");
    assert!(
        stdout.contains("| replica | requests/s served |"),
        "{stdout}"
    );
    let r = run.results();
    assert!(r["requests"].as_u64().unwrap() > 0, "{r}");
    let replicas = r["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{r}");
    for b in replicas {
        assert!(b["bytes"].as_u64().unwrap() > 0, "{b}");
        assert!(b["requests"].as_u64().unwrap() > 0, "{b}");
    }
    run.remove();
}
