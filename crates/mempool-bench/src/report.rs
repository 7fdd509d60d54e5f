//! Reports: one table per run with the environment and parameters it was measured under, written as an
//! aligned terminal table, JSON, CSV, and an SVG chart.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

pub use crate::chart::{Chart, ChartKind, Series};
use crate::env::Environment;
use crate::error::{Error, Result};

/// One value of a table.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Cell {
    /// Text.
    Text(String),
    /// A whole number.
    Int(i64),
    /// A measurement, shown with its column's precision.
    Float(f64),
    /// Nothing (shown `-`, `null` in JSON, empty in CSV).
    Empty,
}

impl From<&str> for Cell {
    fn from(s: &str) -> Cell {
        Cell::Text(s.to_owned())
    }
}
impl From<String> for Cell {
    fn from(s: String) -> Cell {
        Cell::Text(s)
    }
}
impl From<f64> for Cell {
    fn from(v: f64) -> Cell {
        if v.is_finite() {
            Cell::Float(v)
        } else {
            Cell::Empty
        }
    }
}
impl From<u64> for Cell {
    fn from(v: u64) -> Cell {
        Cell::Int(v.try_into().unwrap_or(i64::MAX))
    }
}
impl From<usize> for Cell {
    fn from(v: usize) -> Cell {
        Cell::from(v as u64)
    }
}
impl<T: Into<Cell>> From<Option<T>> for Cell {
    fn from(v: Option<T>) -> Cell {
        v.map_or(Cell::Empty, Into::into)
    }
}

/// A column: its name and how its floats are shown in the terminal table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Column {
    /// The header.
    pub(crate) name: String,
    /// Digits after the point for floats in the terminal table (JSON and CSV keep full precision).
    pub(crate) precision: usize,
}

impl Column {
    /// A column with `precision` digits.
    pub fn new(name: &str, precision: usize) -> Column {
        Column {
            name: name.to_owned(),
            precision,
        }
    }
}

/// A measured run: what was run, where, with which parameters, and the results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The workload (`random`, `query`, ...).
    pub(crate) workload: String,
    /// A one-line title.
    pub(crate) title: String,
    /// Device, driver, date, command.
    pub(crate) environment: Environment,
    /// The workload's exact parameters, in order.
    pub(crate) parameters: Vec<(String, String)>,
    /// The table's columns.
    pub columns: Vec<Column>,
    /// The table's rows.
    pub rows: Vec<Vec<Cell>>,
    /// Findings and caveats (targets met or missed, checks), one line each.
    pub notes: Vec<String>,
    /// The chart `--plot` draws.
    pub chart: Option<Chart>,
}

impl Report {
    /// An empty report for `workload`.
    pub fn new(workload: &str, title: &str, environment: Environment) -> Report {
        Report {
            workload: workload.to_owned(),
            title: title.to_owned(),
            environment,
            parameters: Vec::new(),
            columns: Vec::new(),
            rows: Vec::new(),
            notes: Vec::new(),
            chart: None,
        }
    }

    /// Adds a parameter.
    pub fn param(&mut self, key: &str, value: impl ToString) {
        self.parameters.push((key.to_owned(), value.to_string()));
    }

    /// Adds a row (as many cells as columns).
    pub fn row(&mut self, cells: Vec<Cell>) {
        debug_assert_eq!(cells.len(), self.columns.len(), "row width");
        self.rows.push(cells);
    }

    fn cell_text(&self, col: usize, cell: &Cell) -> String {
        match cell {
            Cell::Text(s) => s.clone(),
            Cell::Int(v) => v.to_string(),
            Cell::Float(v) => format!("{v:.*}", self.columns.get(col).map_or(3, |c| c.precision)),
            Cell::Empty => "-".into(),
        }
    }

    /// The aligned table alone: text left-aligned, numbers right-aligned.
    pub fn table_text(&self) -> String {
        let texts: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| r.iter().enumerate().map(|(i, c)| self.cell_text(i, c)).collect())
            .collect();
        let widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                texts
                    .iter()
                    .filter_map(|r| r.get(i))
                    .map(|t| t.chars().count())
                    .chain([c.name.chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let numeric: Vec<bool> = (0..self.columns.len())
            .map(|i| self.rows.iter().all(|r| !matches!(r.get(i), Some(Cell::Text(_)))))
            .collect();
        let mut out = String::new();
        let line = |cells: &[String], out: &mut String| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let w = widths[i];
                    if numeric[i] {
                        format!("{t:>w$}")
                    } else {
                        format!("{t:<w$}")
                    }
                })
                .collect();
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        let header: Vec<String> = self.columns.iter().map(|c| c.name.clone()).collect();
        line(&header, &mut out);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        line(&rule, &mut out);
        for r in &texts {
            line(r, &mut out);
        }
        out
    }

    /// The whole report for a terminal: title, environment, parameters, table, notes.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "mempool-bench {}: {}", self.workload, self.title);
        let _ = writeln!(out, "{}", self.environment.summary());
        let _ = writeln!(out, "command: {}", self.environment.command);
        let params: Vec<String> = self.parameters.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "parameters: {}", params.join(", "));
        out.push('\n');
        out.push_str(&self.table_text());
        if !self.notes.is_empty() {
            out.push('\n');
            for n in &self.notes {
                let _ = writeln!(out, "{n}");
            }
        }
        out
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        let mut v = serde_json::to_value(self).expect("a report serializes");
        // Rows as objects keyed by column name read better than bare arrays.
        if let Some(rows) = v.get_mut("rows") {
            let names: Vec<String> = self.columns.iter().map(|c| c.name.clone()).collect();
            let objs: Vec<serde_json::Value> = self
                .rows
                .iter()
                .map(|r| {
                    let mut m = serde_json::Map::new();
                    for (name, cell) in names.iter().zip(r) {
                        m.insert(name.clone(), serde_json::to_value(cell).expect("a cell serializes"));
                    }
                    serde_json::Value::Object(m)
                })
                .collect();
            *rows = serde_json::Value::Array(objs);
        }
        if let Some(params) = v.get_mut("parameters") {
            let m: serde_json::Map<String, serde_json::Value> = self
                .parameters
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            *params = serde_json::Value::Object(m);
        }
        serde_json::to_string_pretty(&v).expect("JSON text")
    }

    /// The table as CSV (RFC 4180 quoting), header first. The environment and parameters go to the JSON
    /// file; CSV stays a plain table for spreadsheets.
    pub fn to_csv(&self) -> String {
        fn field(s: &str) -> String {
            if s.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", s.replace('"', "\"\""))
            } else {
                s.to_owned()
            }
        }
        let mut out = String::new();
        let header: Vec<String> = self.columns.iter().map(|c| field(&c.name)).collect();
        out.push_str(&header.join(","));
        out.push('\n');
        for r in &self.rows {
            let cells: Vec<String> = r
                .iter()
                .map(|c| match c {
                    Cell::Text(s) => field(s),
                    Cell::Int(v) => v.to_string(),
                    Cell::Float(v) => v.to_string(),
                    Cell::Empty => String::new(),
                })
                .collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
        out
    }

    /// The chart as an SVG document, or `None` when the report has no chart.
    pub fn to_svg(&self) -> Option<String> {
        let chart = self.chart.as_ref()?;
        Some(crate::svg::render(chart, &self.environment.subtitle()))
    }

    /// Writes the files asked for: JSON, CSV, SVG (an error if an SVG is asked for and there is no chart).
    pub fn write_files(&self, json: Option<&Path>, csv: Option<&Path>, svg: Option<&Path>) -> Result<()> {
        let write = |path: &Path, text: String| {
            std::fs::write(path, text).map_err(|source| Error::Io {
                path: path.display().to_string(),
                source,
            })
        };
        if let Some(p) = json {
            write(p, self.to_json() + "\n")?;
        }
        if let Some(p) = csv {
            write(p, self.to_csv())?;
        }
        if let Some(p) = svg {
            let text = self
                .to_svg()
                .ok_or_else(|| Error::Usage(format!("the {} report has no chart to plot", self.workload)))?;
            write(p, text)?;
        }
        Ok(())
    }
}

/// The geometric mean of positive values (`None` when there are none).
pub fn geomean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in values {
        if v > 0.0 && v.is_finite() {
            sum += v.ln();
            n += 1;
        }
    }
    (n > 0).then(|| (sum / n as f64).exp())
}

/// The median (the upper one for an even count); `None` for no values.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}
