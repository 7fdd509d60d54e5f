//! The data of a report's chart, drawn by the SVG writer and serialized with the report.

use serde::Serialize;

/// How a chart draws its series.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ChartKind {
    /// Grouped bars: one group per category, one bar per series, on a linear axis, each value printed
    /// on its bar.
    Bars,
    /// One line per series over the categories (evenly spaced).
    Lines,
}

/// A series of a chart: one value per category (`None`: missing).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Series {
    /// The legend entry.
    pub name: String,
    /// The values.
    pub values: Vec<Option<f64>>,
}

/// A chart of a report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Chart {
    /// The title (the subtitle names the device and date).
    pub title: String,
    /// Bars or lines.
    pub kind: ChartKind,
    /// The x axis' label.
    pub x_label: String,
    /// The y axis' label.
    pub y_label: String,
    /// The x positions' labels.
    pub categories: Vec<String>,
    /// The series.
    pub series: Vec<Series>,
    /// A logarithmic y axis, for lines only: bars are always drawn on a linear axis (a bar's length is
    /// its value), with each value printed on its bar.
    pub log_y: bool,
}
