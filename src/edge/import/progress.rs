//! How far an import is, for whoever runs it.

use std::time::{Duration, Instant};

use super::Report;

/// A progress bar on a terminal; a line every few seconds otherwise.
pub(super) struct ImportProgress {
    bar: Option<indicatif::ProgressBar>,
    bytes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    started: Instant,
    last_line: std::sync::Mutex<Instant>,
}

impl ImportProgress {
    pub(super) fn new(total_bytes: Option<u64>) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = match total_bytes {
                Some(total) => indicatif::ProgressBar::new(total),
                None => indicatif::ProgressBar::new_spinner(),
            };
            let style = indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {percent}% ETA {eta} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Self {
            bar,
            bytes: Default::default(),
            started: Instant::now(),
            last_line: std::sync::Mutex::new(Instant::now()),
        }
    }

    pub(super) fn bytes_handle(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.bytes.clone()
    }

    pub(super) fn rate(&self, report: &Report) -> f64 {
        (report.imported + report.rejected) as f64 / self.started.elapsed().as_secs_f64().max(0.001)
    }

    pub(super) fn update(&self, report: &Report) {
        let rate = self.rate(report);
        match &self.bar {
            Some(bar) => {
                bar.set_position(self.bytes.load(std::sync::atomic::Ordering::Relaxed));
                bar.set_message(format!(
                    "{} documents ({} replayed), {} rejected, {rate:.0}/s",
                    report.imported, report.replayed, report.rejected
                ));
            }
            None => {
                let mut last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
                if last.elapsed() >= Duration::from_secs(5) {
                    *last = Instant::now();
                    eprintln!(
                        "idpool import: {} documents ({} replayed), {} rejected, {rate:.0}/s",
                        report.imported, report.replayed, report.rejected
                    );
                }
            }
        }
    }

    pub(super) fn finish(&self, report: &Report) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        eprintln!(
            "idpool import: done in {:.1} s: {} documents ({} replayed), {} rejected, {:.0}/s",
            self.started.elapsed().as_secs_f64(),
            report.imported,
            report.replayed,
            report.rejected,
            self.rate(report)
        );
    }
}
