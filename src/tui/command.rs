//! What a tab asks of the app. A tab handles its own keys (`handle(action, ctx)` on each tab's
//! state) and changes only its own state; whatever reaches beyond it (another tab, the editor
//! and overlays the app owns, the loaded model, the driver) it returns as [`TabCommand`]s,
//! which `App::apply` carries out in one place. A tab must never reach into a sibling: if it
//! needs to, that is a new command here. What a tab may know of the rest of the app comes in
//! a read-only [`TabContext`].

use std::path::PathBuf;

use super::app::{EditTarget, Effect, Level, Overlay, Tab};
use super::debugger::ForkSpec;
use super::run_tab::RunRequest;

/// One thing a tab asks the app to do.
#[derive(Debug, Clone, PartialEq)]
pub enum TabCommand {
    /// Open a text editor over the tabs; what is typed goes back to the tab the target names.
    Edit { target: EditTarget, text: String },
    /// Draw an overlay (a confirmation) over the tabs.
    Overlay(Overlay),
    /// Set the debugger's diff mode; sent before the loads it governs, since a session loaded
    /// into the primary slot outside diff mode drops the other one.
    SetDiff(bool),
    /// Bring a tab to the front, without the rescans that switching by key starts.
    ShowTab(Tab),
    /// Load a model: the loaded model belongs to the app, not to a tab.
    LoadModel(PathBuf),
    /// Run the episode the Run tab has prepared (its view is already reset for it).
    StartRun(RunRequest),
    /// Fork a session and re-run it with the Run tab's options, watched in the Run tab.
    Fork(ForkSpec),
    /// Work for the driver that changes nothing else (scans, loads, decoding, training).
    Effect(Effect),
    /// A status-line notice.
    Notify(Level, String),
}

impl TabCommand {
    pub fn notify(level: Level, text: impl Into<String>) -> Self {
        TabCommand::Notify(level, text.into())
    }
}

/// What a tab may read about the rest of the app while it handles a key: a snapshot the app
/// takes, never a handle to change anything.
#[derive(Debug, Clone, PartialEq)]
pub struct TabContext {
    /// A model is loaded and ready to generate.
    pub model_ready: bool,
    /// The model that is (or is being) loaded.
    pub model_path: PathBuf,
    /// Where new sessions are written.
    pub sessions_dir: PathBuf,
    /// An episode (a run or a fork) is running.
    pub run_busy: bool,
    /// Training is running.
    pub train_busy: bool,
}

#[cfg(test)]
impl TabContext {
    /// The bundled model loaded, nothing running.
    pub fn ready() -> Self {
        Self {
            model_ready: true,
            model_path: PathBuf::from("models/envace-tiny"),
            sessions_dir: PathBuf::from("sessions"),
            run_busy: false,
            train_busy: false,
        }
    }
}
