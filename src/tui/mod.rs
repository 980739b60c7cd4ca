//! The workbench TUI (ratatui): watch an EnvACE policy act and rehearse, approve irreversible
//! calls, step through sessions like a debugger, fork and diff runs, train, and switch models.
//!
//! Shape: [`app`] holds the state and the one pure `update(msg) -> effects`; [`ui`] draws it
//! (read-only); [`driver`] owns the terminal and runs the effects (engine, trainer, loaders)
//! off the UI task. Themes ([`theme`]) and keys ([`keymap`]) are data. The TUI computes
//! nothing itself: episodes are `engine::runner`, sessions are `session`, training is
//! `train::grpo`.

pub mod app;
pub mod debugger;
pub mod diff;
pub mod driver;
pub mod episode;
pub mod form;
pub mod highlight;
pub mod keymap;
pub mod models_tab;
pub mod run_tab;
pub mod schema_check;
pub mod sessions_tab;
pub mod theme;
pub mod train_tab;
pub mod ui;

pub use app::{App, AppConfig, Effect, Msg};
pub use driver::{TuiOptions, run};
