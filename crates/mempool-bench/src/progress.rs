//! A progress bar on stderr for long runs; silent when stderr is not a terminal (logs, CI, pipes) or
//! with `--quiet`.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Counts steps of a run and redraws one line on stderr at most ten times a second.
#[derive(Debug)]
pub(crate) struct Progress {
    total: u64,
    done: u64,
    label: String,
    enabled: bool,
    start: Instant,
    last: Option<Instant>,
}

impl Progress {
    /// A bar of `total` steps; drawn only when `quiet` is false and stderr is a terminal.
    pub(crate) fn new(total: u64, quiet: bool) -> Progress {
        Progress {
            total: total.max(1),
            done: 0,
            label: String::new(),
            enabled: !quiet && std::io::stderr().is_terminal(),
            start: Instant::now(),
            last: None,
        }
    }

    /// What is running now.
    pub(crate) fn set_label(&mut self, label: impl Into<String>) {
        self.label = label.into();
        self.draw(true);
    }

    /// One step done.
    pub(crate) fn inc(&mut self) {
        self.done = (self.done + 1).min(self.total);
        self.draw(false);
    }

    /// The bar as it would be drawn (without the terminal control characters).
    pub(crate) fn line(&self) -> String {
        const WIDTH: u64 = 30;
        let filled = (self.done * WIDTH / self.total) as usize;
        format!(
            "[{}{}] {}/{} {:>5.1}s {}",
            "#".repeat(filled),
            ".".repeat(WIDTH as usize - filled),
            self.done,
            self.total,
            self.start.elapsed().as_secs_f64(),
            self.label
        )
    }

    fn draw(&mut self, force: bool) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if !force && self.done < self.total && self.last.is_some_and(|t| now - t < Duration::from_millis(100)) {
            return;
        }
        self.last = Some(now);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{}", self.line());
        let _ = err.flush();
    }

    /// Clears the line.
    pub(crate) fn finish(&mut self) {
        if self.enabled {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.enabled = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
