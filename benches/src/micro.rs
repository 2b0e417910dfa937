//! Criterion's figures, read back from its output folder
//! (`<target>/criterion/**/new/{benchmark,estimates}.json`).

use serde::{Deserialize, Serialize};
use std::path::Path;

/// One micro-benchmark's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MicroRow {
    /// `group/function/value`, e.g. `hash/blocks/64KB`.
    pub id: String,
    /// Mean time per iteration.
    pub mean_ns: f64,
    /// Bytes per iteration when the bench declares them.
    pub bytes: Option<u64>,
    /// Elements (blocks, decisions) per iteration when declared.
    pub elements: Option<u64>,
}

impl MicroRow {
    pub fn gb_per_s(&self) -> Option<f64> {
        self.bytes.map(|b| b as f64 / self.mean_ns)
    }

    pub fn ns_per_element(&self) -> Option<f64> {
        self.elements.map(|e| self.mean_ns / e.max(1) as f64)
    }
}

#[derive(Deserialize)]
struct Bench {
    full_id: String,
    throughput: Option<serde_json::Value>,
}

/// Every benchmark under `dir` whose id starts with one of `groups`, sorted by id.
pub fn read(dir: &Path, groups: &[&str]) -> Vec<MicroRow> {
    let mut out = Vec::new();
    walk(dir, 0, &mut |p| {
        if !(p.ends_with("new/benchmark.json")) {
            return;
        }
        let Ok(b) = std::fs::read(p).map(|d| serde_json::from_slice::<Bench>(&d)) else {
            return;
        };
        let Ok(b) = b else { return };
        if !groups
            .iter()
            .any(|g| b.full_id.starts_with(&format!("{g}/")))
        {
            return;
        }
        let est = p.with_file_name("estimates.json");
        let Ok(Ok(e)) =
            std::fs::read(&est).map(|d| serde_json::from_slice::<serde_json::Value>(&d))
        else {
            return;
        };
        let Some(mean_ns) = e["mean"]["point_estimate"].as_f64() else {
            return;
        };
        let t = b.throughput.unwrap_or_default();
        out.push(MicroRow {
            id: b.full_id,
            mean_ns,
            bytes: t["Bytes"].as_u64().or(t["BytesDecimal"].as_u64()),
            elements: t["Elements"].as_u64(),
        });
    });
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

fn walk(dir: &Path, depth: usize, f: &mut dyn FnMut(&Path)) {
    if depth > 6 {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, depth + 1, f);
        } else {
            f(&p);
        }
    }
}
