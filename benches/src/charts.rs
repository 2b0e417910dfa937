//! SVG charts of a demo or bench run (plotters, SVG backend: no fonts or
//! system libraries needed).

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

type Res = anyhow::Result<()>;

/// Where a chart draws: an SVG file, or one panel of it.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A chart with plain numbers on both axes.
type Chart<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Points of one engine's series, by engine id.
pub type Series = BTreeMap<String, Vec<(f64, f64)>>;

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("chart: {e}")
}

/// A white SVG canvas of `size` pixels, written to `path`.
fn canvas(path: &Path, size: (u32, u32)) -> anyhow::Result<Area<'_>> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    Ok(root)
}

/// A chart filling the whole canvas: `caption` in `font` points over axes
/// spanning `x` and `y`.
fn whole_chart<'a>(
    root: &Area<'a>,
    caption: &str,
    font: i32,
    x: Range<f64>,
    y: Range<f64>,
) -> anyhow::Result<Chart<'a>> {
    ChartBuilder::on(root)
        .caption(caption, ("sans-serif", font))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x, y)
        .map_err(err)
}

/// A bar chart filling the whole canvas, its mesh drawn: group `i` of
/// `labels` spans `i..i + 1` on x with its label under the middle, `y` is the
/// value axis with `y_desc` up the side.
fn group_chart<'a>(
    root: &Area<'a>,
    caption: &str,
    font: i32,
    labels: &[String],
    y: Range<f64>,
    y_desc: &str,
) -> anyhow::Result<Chart<'a>> {
    let n = labels.len().max(1);
    let mut chart = whole_chart(root, caption, font, 0.0..n as f64, y)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.26 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    Ok(chart)
}

/// The legend of the labelled series, boxed, at `position`.
fn legend(chart: &mut Chart<'_>, position: SeriesLabelPosition) -> Res {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// Cumulative distribution of TTFT per policy (x: ms, clipped at the largest p99).
pub fn ttft_cdf(path: &Path, series: &[(String, Vec<f64>)]) -> Res {
    let root = canvas(path, (900, 520))?;
    let p99 = |v: &Vec<f64>| {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        v.get(((v.len() as f64) * 0.99) as usize)
            .or(v.last())
            .copied()
            .unwrap_or(1.0)
    };
    let xmax = series.iter().map(|(_, v)| p99(v)).fold(1.0, f64::max) * 1.05;
    let mut chart = whole_chart(
        &root,
        "Time to first token, cumulative",
        22,
        0.0..xmax,
        0.0..1.0,
    )?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("share of requests")
        .draw()
        .map_err(err)?;
    for (i, (name, v)) in series.iter().enumerate() {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(k, &x)| (x.min(xmax), (k + 1) as f64 / n))
            .collect();
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present().map_err(err)
}

/// Requests in flight per engine over time, one panel per policy.
pub fn load_over_time(path: &Path, panels: &[(String, Series)]) -> Res {
    let h = 260 * panels.len().max(1) as u32;
    let root = canvas(path, (900, h))?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    let ymax = panels
        .iter()
        .flat_map(|(_, m)| m.values().flatten().map(|p| p.1))
        .fold(1.0, f64::max)
        * 1.1;
    let xmax = panels
        .iter()
        .flat_map(|(_, m)| m.values().flatten().map(|p| p.0))
        .fold(1.0, f64::max);
    for (area, (policy, series)) in areas.iter().zip(panels) {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{policy}: requests in flight per engine"),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..xmax, 0.0..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .draw()
            .map_err(err)?;
        for (i, (engine, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(1)))
                .map_err(err)?
                .label(engine.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    root.present().map_err(err)
}

/// Hit rate per policy (bars) against the trace's ceiling (outline).
pub fn hit_rate_bars(path: &Path, bars: &[(String, f64, f64)]) -> Res {
    let root = canvas(path, (900, 460))?;
    let names: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    let mut chart = group_chart(
        &root,
        "Prefix-cache hit rate (filled) and the trace's ceiling (outline)",
        20,
        &names,
        0.0..100.0,
        "% of prompt tokens",
    )?;
    for (i, (_, hit, ceiling)) in bars.iter().enumerate() {
        let x0 = i as f64 + 0.2;
        let x1 = i as f64 + 0.8;
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series([Rectangle::new(
                [(x0, 0.0), (x1, hit * 100.0)],
                color.filled(),
            )])
            .map_err(err)?;
        chart
            .draw_series([Rectangle::new(
                [(x0, 0.0), (x1, ceiling * 100.0)],
                BLACK.stroke_width(1),
            )])
            .map_err(err)?;
    }
    root.present().map_err(err)
}

/// Each router against round-robin: one group of bars per router, one bar
/// per figure (`names`), each the percent change against round-robin's
/// (below zero: cheaper or sooner), its value written on it.
pub fn versus_bars(path: &Path, names: &[&str], groups: &[(String, Vec<Option<f64>>)]) -> Res {
    let root = canvas(path, (900, 480))?;
    let values = groups.iter().flat_map(|(_, v)| v.iter().flatten());
    let lo = values.clone().fold(0.0_f64, |a, &v| a.min(v * 100.0));
    let hi = values.fold(0.0_f64, |a, &v| a.max(v * 100.0));
    let pad = ((hi - lo) * 0.15).max(5.0);
    // Room above the bars for the legend.
    let (lo, hi) = (lo - pad, hi + pad + (hi - lo + 2.0 * pad) * 0.4);
    let n = groups.len().max(1);
    let labels: Vec<String> = groups.iter().map(|g| g.0.clone()).collect();
    let mut chart = group_chart(
        &root,
        "Against round-robin: cost per conversation and TTFT (% change; below 0 is better)",
        18,
        &labels,
        lo..hi,
        "% against round-robin",
    )?;
    chart
        .draw_series(LineSeries::new([(0.0, 0.0), (n as f64, 0.0)], BLACK))
        .map_err(err)?;
    let k = names.len().max(1) as f64;
    let width = 0.8 / k;
    for (j, name) in names.iter().enumerate() {
        let color = Palette99::pick(j).to_rgba();
        let mut bars = Vec::new();
        let mut texts = Vec::new();
        for (i, (_, v)) in groups.iter().enumerate() {
            let Some(v) = v.get(j).copied().flatten() else {
                continue;
            };
            let x0 = i as f64 + 0.1 + j as f64 * width;
            let y = v * 100.0;
            bars.push(Rectangle::new(
                [(x0 + 0.01, 0.0), (x0 + width - 0.01, y)],
                color.filled(),
            ));
            // Written just past the bar's end: above it, or below it.
            let (at, v) = if y < 0.0 {
                (y - pad * 0.1, VPos::Top)
            } else {
                (y + pad * 0.1, VPos::Bottom)
            };
            let style = ("sans-serif", 13)
                .into_text_style(&root)
                .pos(Pos::new(HPos::Left, v));
            texts.push(Text::new(
                crate::table::signed(Some(y / 100.0)),
                (x0 + 0.01, at),
                style,
            ));
        }
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        chart.draw_series(texts).map_err(err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present().map_err(err)
}
