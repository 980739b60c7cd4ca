//! The workbench TUI (ratatui): watch an EnvACE policy act and rehearse, approve irreversible
//! calls, step through sessions like a debugger, fork and diff runs, train, and switch models.
//!
//! Shape: [`app`] holds the state and the one pure `update(msg) -> effects`; each tab's state
//! (`run_tab`, `sessions_tab`, `debugger`, `train_tab`, `models_tab`) handles its own keys and
//! asks for anything beyond itself with a [`command`] that the app applies; [`ui`] draws it
//! (read-only); [`driver`] owns the terminal and runs the effects (engine, trainer, loaders)
//! off the UI task. Themes ([`theme`]) and keys ([`keymap`]) are data. The TUI computes
//! nothing itself: episodes are `engine::runner`, sessions are `session`, training is
//! `train::grpo`.

pub mod app;
pub mod command;
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
