//! A small SVG writer for the reports' charts: grouped bars on a linear y axis with each value printed on
//! its bar, or lines on a linear or logarithmic y axis; a legend. Hand-written so the harness needs no
//! plotting or font crates; text is left to the viewer's fonts.

use std::fmt::Write as _;

use crate::chart::{Chart, ChartKind};

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 520.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 64.0;
const BOTTOM: f64 = 90.0;
/// Tableau 10: distinguishable, and readable for most forms of colour blindness.
/// The font size of the values printed on bars.
const VALUE_FONT: f64 = 10.0;
const COLORS: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
];

/// Escapes text for SVG.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn nice_step(range: f64) -> f64 {
    let raw = range / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1e6 || v.abs() < 1e-3 {
        format!("{v:.0e}")
    } else if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// A value printed on its bar: three or four significant digits, no exponent (`68118`, `162.8`, `2.50`).
fn fmt_value(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Width of `text` at `size` px in a sans-serif font, roughly (for layout only).
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.6
}

/// Draws `chart`, with `subtitle` (device, driver, date) under the title. Bars are always drawn on a
/// linear axis, so that their lengths compare; `log_y` applies to lines.
pub(crate) fn render(chart: &Chart, subtitle: &str) -> String {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let log_y = chart.log_y && chart.kind == ChartKind::Lines;
    let values: Vec<f64> = chart
        .series
        .iter()
        .flat_map(|s| s.values.iter().flatten().copied())
        .filter(|v| v.is_finite() && (!log_y || *v > 0.0))
        .collect();
    let n_cat = chart.categories.len().max(1);
    let group_w = plot_w / n_cat as f64;
    let n_series = chart.series.len().max(1);
    let bar_w = group_w * 0.8 / n_series as f64;
    // Bars carry their values above them, turned upright when wider than the bar: leave room for them.
    let label_room = if chart.kind == ChartKind::Bars {
        let widest = values
            .iter()
            .map(|v| text_width(&fmt_value(*v), VALUE_FONT))
            .fold(0.0, f64::max);
        6.0 + if widest > bar_w { widest } else { VALUE_FONT }
    } else {
        0.0
    };
    let max = values.iter().copied().fold(f64::NAN, f64::max);
    let min = values.iter().copied().fold(f64::NAN, f64::min);
    // The y scale: value -> pixel, and the ticks.
    let (lo, hi, ticks): (f64, f64, Vec<f64>) = if values.is_empty() {
        (0.0, 1.0, vec![0.0, 1.0])
    } else if log_y {
        let lo = 10f64.powf(min.log10().floor());
        let hi = 10f64.powf(max.log10().ceil().max(min.log10().floor() + 1.0));
        let decades = (hi / lo).log10().round() as i32;
        // Few decades: ticks at 1, 2 and 5 of each, so the axis still reads.
        let steps: &[f64] = if decades <= 2 { &[1.0, 2.0, 5.0] } else { &[1.0] };
        let mut t = Vec::new();
        let mut v = lo;
        while v <= hi * 1.0001 {
            for m in steps {
                if v * m <= hi * 1.0001 {
                    t.push(v * m);
                }
            }
            v *= 10.0;
        }
        (lo, hi, t)
    } else {
        // The tallest bar leaves `label_room` pixels free above it.
        let hi = if max > 0.0 {
            max * (1.08f64).max(plot_h / (plot_h - label_room).max(plot_h / 2.0))
        } else {
            1.0
        };
        let step = nice_step(hi);
        let hi = (hi / step).ceil() * step;
        let t = (0..=((hi / step).round() as usize)).map(|i| i as f64 * step).collect();
        (0.0, hi, t)
    };
    let y_of = |v: f64| -> f64 {
        let f = if log_y {
            (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10())
        } else {
            (v - lo) / (hi - lo)
        };
        TOP + plot_h * (1.0 - f.clamp(0.0, 1.0))
    };

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="26" font-size="17" font-weight="bold" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(&chart.title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="46" font-size="12" fill="#555" text-anchor="middle">{}</text>"##,
        LEFT + plot_w / 2.0,
        escape(subtitle)
    );
    // Grid and y ticks.
    for t in &ticks {
        let y = y_of(*t);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0,
            fmt_tick(*t)
        );
    }
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{}" stroke="black"/><line x1="{LEFT}" x2="{}" y1="{}" y2="{}" stroke="black"/>"#,
        TOP + plot_h,
        LEFT + plot_w,
        TOP + plot_h,
        TOP + plot_h
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20,{:.1}) rotate(-90)" font-size="13" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        escape(&format!("{}{}", chart.y_label, if log_y { " (log scale)" } else { "" }))
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{}" font-size="13" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 14.0,
        escape(&chart.x_label)
    );

    for (i, c) in chart.categories.iter().enumerate() {
        let x = LEFT + group_w * (i as f64 + 0.5);
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            TOP + plot_h + 18.0,
            escape(c)
        );
    }
    match chart.kind {
        ChartKind::Bars => {
            let base = y_of(0.0);
            for (si, series) in chart.series.iter().enumerate() {
                let color = COLORS[si % COLORS.len()];
                for (ci, v) in series.values.iter().enumerate() {
                    let Some(v) = v.filter(|v| v.is_finite()) else { continue };
                    let x = LEFT + group_w * ci as f64 + group_w * 0.1 + bar_w * si as f64;
                    let y = y_of(v);
                    let label = fmt_value(v);
                    let _ = writeln!(
                        s,
                        r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}: {label}</title></rect>"#,
                        (bar_w - 1.0).max(1.0),
                        (base - y).max(0.0),
                        escape(&series.name),
                    );
                    // The value above its bar; upright when it is wider than the bar.
                    let cx = x + bar_w / 2.0;
                    if text_width(&label, VALUE_FONT) <= bar_w {
                        let _ = writeln!(
                            s,
                            r#"<text x="{cx:.1}" y="{:.1}" font-size="{VALUE_FONT}" text-anchor="middle">{label}</text>"#,
                            y - 4.0
                        );
                    } else {
                        let _ = writeln!(
                            s,
                            r#"<text transform="translate({:.1},{:.1}) rotate(-90)" font-size="{VALUE_FONT}">{label}</text>"#,
                            cx + VALUE_FONT / 3.0,
                            y - 4.0
                        );
                    }
                }
            }
        }
        ChartKind::Lines => {
            for (si, series) in chart.series.iter().enumerate() {
                let color = COLORS[si % COLORS.len()];
                let points: Vec<(f64, f64, f64)> = series
                    .values
                    .iter()
                    .enumerate()
                    .filter_map(|(ci, v)| {
                        v.filter(|v| v.is_finite())
                            .map(|v| (LEFT + group_w * (ci as f64 + 0.5), y_of(v), v))
                    })
                    .collect();
                let path: Vec<String> = points.iter().map(|(x, y, _)| format!("{x:.1},{y:.1}")).collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                    path.join(" ")
                );
                for (x, y, v) in points {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{color}"><title>{}: {}</title></circle>"#,
                        escape(&series.name),
                        fmt_tick(v)
                    );
                }
            }
        }
    }
    // Legend.
    for (si, series) in chart.series.iter().enumerate() {
        let y = TOP + 8.0 + 20.0 * si as f64;
        let x = WIDTH - RIGHT + 16.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{}" y="{:.1}" font-size="12">{}</text>"#,
            y - 10.0,
            COLORS[si % COLORS.len()],
            x + 18.0,
            y,
            escape(&series.name)
        );
    }
    s.push_str("</svg>\n");
    s
}
