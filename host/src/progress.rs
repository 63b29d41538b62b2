//! Progress bars on what a person waits for (synth, model upload). They
//! draw on stderr only when it is a terminal (indicatif hides them otherwise).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `total` bytes, labelled `msg`.
pub fn bytes_bar(total: u64, msg: String) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}
