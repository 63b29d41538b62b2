//! The `run --chat` prompt: line editing and history (rustyline), multi-line
//! input, slash commands, and Ctrl-C that stops a reply instead of the chat.
//!
//! While a line is read the terminal is in raw mode and rustyline sees Ctrl-C
//! as a key; while a reply is generated the terminal is cooked and Ctrl-C is a
//! SIGINT, which [`StopOnCtrlC`] turns into a flag the generation loop polls.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use rustyline::error::ReadlineError;
use rustyline::history::FileHistory;
use rustyline::{Config, Editor};

/// What the person typed.
#[derive(Debug, PartialEq, Eq)]
pub enum Input {
    /// A message for the model (multi-line input joined with newlines).
    Message(String),
    /// `/clear`: forget the conversation.
    Clear,
    /// `/help` or `/?`.
    Help,
    /// `/bye`, `/exit`, `/quit`, Ctrl-D or the end of input.
    Bye,
    /// `/something` we do not know.
    Unknown(String),
}

pub const HELP: &str = "\
  /clear   forget the conversation (the system prompt stays)
  /bye     leave (also /exit, /quit, Ctrl-D)
  /help    this list
  Ctrl-C   stop the reply being written (at the prompt: clear the line)
  A line ending in \\ continues on the next line; \"\"\" starts and ends a block.";

pub struct Repl {
    ed: Editor<(), FileHistory>,
    history: Option<PathBuf>,
}

/// Where the chat history is kept between runs (None: not kept).
fn history_path() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_STATE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))?;
    Some(base.join("pulsar").join("chat_history"))
}

impl Repl {
    pub fn new() -> anyhow::Result<Repl> {
        let cfg = Config::builder().auto_add_history(false).max_history_size(1000)?.build();
        let mut ed: Editor<(), FileHistory> = Editor::with_config(cfg)?;
        let history = history_path();
        if let Some(p) = &history {
            // A first run has no history yet.
            let _ = ed.load_history(p);
        }
        Ok(Repl { ed, history })
    }

    /// Read one input: a message (possibly several lines), or a command.
    pub fn read(&mut self) -> anyhow::Result<Input> {
        let mut lines: Vec<String> = Vec::new();
        let mut block = false;
        loop {
            let prompt = if lines.is_empty() && !block { "> " } else { "… " };
            let line = match self.ed.readline(prompt) {
                Ok(l) => l,
                // Ctrl-C at the prompt drops what was typed, as in a shell.
                Err(ReadlineError::Interrupted) => {
                    lines.clear();
                    block = false;
                    continue;
                }
                Err(ReadlineError::Eof) if lines.is_empty() => return Ok(Input::Bye),
                Err(ReadlineError::Eof) => break,
                Err(e) => return Err(e.into()),
            };
            if lines.is_empty() && !block {
                let t = line.trim();
                if t.is_empty() {
                    continue;
                }
                if let Some(cmd) = t.strip_prefix('/') {
                    let _ = self.ed.add_history_entry(t);
                    return Ok(match cmd {
                        "clear" => Input::Clear,
                        "help" | "?" => Input::Help,
                        "bye" | "exit" | "quit" => Input::Bye,
                        other => Input::Unknown(format!("/{other}")),
                    });
                }
                if let Some(rest) = t.strip_prefix("\"\"\"") {
                    // `"""text"""` on one line is a one-line block.
                    if let Some(one) = rest.strip_suffix("\"\"\"") {
                        lines.push(one.to_string());
                        break;
                    }
                    block = true;
                    if !rest.is_empty() {
                        lines.push(rest.to_string());
                    }
                    continue;
                }
            }
            if block {
                if let Some(last) = line.trim_end().strip_suffix("\"\"\"") {
                    if !last.is_empty() {
                        lines.push(last.to_string());
                    }
                    break;
                }
                lines.push(line);
                continue;
            }
            match line.strip_suffix('\\') {
                Some(head) => lines.push(head.to_string()),
                None => {
                    lines.push(line);
                    break;
                }
            }
        }
        let text = lines.join("\n");
        let _ = self.ed.add_history_entry(text.as_str());
        if let Some(p) = &self.history {
            if let Some(dir) = p.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Err(e) = self.ed.append_history(p) {
                tracing::debug!("chat history not saved to {}: {e}", p.display());
            }
        }
        Ok(Input::Message(text))
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// While alive, SIGINT (Ctrl-C) sets a flag instead of killing the process;
/// dropping it puts the previous handler back.
pub struct StopOnCtrlC {
    old: libc::sigaction,
}

impl StopOnCtrlC {
    pub fn install() -> StopOnCtrlC {
        STOP.store(false, Ordering::Relaxed);
        // SAFETY: the handler only stores to an atomic (async-signal-safe);
        // both sigaction structs are plain data, zeroed then filled.
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
            new.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut new.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGINT, &new, &mut old);
            StopOnCtrlC { old }
        }
    }

    /// Was Ctrl-C pressed since the last call? (Clears the flag.)
    pub fn take(&self) -> bool {
        STOP.swap(false, Ordering::Relaxed)
    }
}

impl Drop for StopOnCtrlC {
    fn drop(&mut self) {
        // SAFETY: restores the action saved at install.
        unsafe {
            libc::sigaction(libc::SIGINT, &self.old, std::ptr::null_mut());
        }
    }
}
