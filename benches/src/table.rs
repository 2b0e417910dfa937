//! What every report is made of: tables printable as Markdown or aligned
//! text, percentages, medians, and the project's targets as checked
//! rows.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// The median of `v` (the upper one of an even count; 0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// A share in whole percent, never `-0`.
fn whole(v: f64) -> f64 {
    (v * 100.0).round() + 0.0
}

/// A share as a signed whole percent (`-42%`, `0%`), `-` when absent.
pub fn signed(x: Option<f64>) -> String {
    match x.map(whole) {
        None => "-".into(),
        Some(0.0) => "0%".into(),
        Some(v) => format!("{v:+.0}%"),
    }
}

/// A saving as a percent (`38%`, `-5%` when dearer), `-` when absent.
pub fn percent(x: Option<f64>) -> String {
    x.map(whole).map_or("-".into(), |v| format!("{v:.0}%"))
}

/// A saving in words: `38% less`, `5% more`.
pub fn less(x: Option<f64>) -> String {
    match x.map(whole) {
        None => "-".into(),
        Some(v) if v < 0.0 => format!("{:.0}% more", -v),
        Some(v) => format!("{v:.0}% less"),
    }
}

/// A table printable as aligned text or Markdown.
pub struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(head: &[&str]) -> Table {
        Table {
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, r: Vec<String>) {
        self.rows.push(r);
    }

    pub fn markdown(&self) -> String {
        let mut s = format!("| {} |\n", self.head.join(" | "));
        let _ = writeln!(s, "|{}", "---|".repeat(self.head.len()));
        for r in &self.rows {
            let _ = writeln!(s, "| {} |", r.join(" | "));
        }
        s
    }

    pub fn text(&self) -> String {
        let mut w: Vec<usize> = self.head.iter().map(|h| h.len()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if i < w.len() {
                    w[i] = w[i].max(c.len());
                }
            }
        }
        let line = |r: &[String]| {
            r.iter()
                .enumerate()
                .map(|(i, c)| format!("{:<w$}", c, w = w.get(i).copied().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join("  ")
        };
        let mut s = line(&self.head);
        s.push('\n');
        for r in &self.rows {
            s.push_str(&line(r));
            s.push('\n');
        }
        s
    }
}

/// One of the project's targets, checked.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Check {
    pub target: String,
    pub measured: String,
    pub met: bool,
    /// By how much it was missed (or the margin when met).
    pub margin: String,
}
