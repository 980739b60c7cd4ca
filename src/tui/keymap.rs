//! One keymap table: every binding the app knows, by scope. Keys become [`Action`]s here and
//! nowhere else; the `?` help overlay is generated from the same table; a user file
//! (`<config>/keymap.toml`) replaces the keys of any (scope, action) it names.
//!
//! ```toml
//! [global]
//! quit = ["q", "ctrl-q"]
//! [debugger]
//! next_step = ["n", "right"]
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use serde::Deserialize;

/// Where a binding applies. Lookups try the focused scope first, then `Global`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Global,
    Run,
    Sessions,
    Debugger,
    Train,
    Models,
    Approval,
}

impl Scope {
    pub const ALL: [Scope; 7] = [
        Scope::Global,
        Scope::Run,
        Scope::Sessions,
        Scope::Debugger,
        Scope::Train,
        Scope::Models,
        Scope::Approval,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Run => "run",
            Scope::Sessions => "sessions",
            Scope::Debugger => "debugger",
            Scope::Train => "train",
            Scope::Models => "models",
            Scope::Approval => "approval",
        }
    }
}

macro_rules! actions {
    ($($variant:ident => $name:literal, $help:literal;)*) => {
        /// Everything a key can do.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Action { $($variant,)* }

        impl Action {
            pub const ALL: &'static [Action] = &[$(Action::$variant,)*];
            /// The name used in keymap files and the command palette.
            pub fn name(self) -> &'static str {
                match self { $(Action::$variant => $name,)* }
            }
            pub fn help(self) -> &'static str {
                match self { $(Action::$variant => $help,)* }
            }
            pub fn from_name(s: &str) -> Option<Action> {
                match s { $($name => Some(Action::$variant),)* _ => None }
            }
        }
    };
}

actions! {
    Quit => "quit", "quit envace";
    Cancel => "cancel", "cancel the running generation / training step";
    Help => "help", "show or hide this help";
    Palette => "palette", "command palette";
    NextTab => "next_tab", "next tab";
    PrevTab => "prev_tab", "previous tab";
    TabRun => "tab_run", "Run tab";
    TabSessions => "tab_sessions", "Sessions tab";
    TabDebugger => "tab_debugger", "Debugger tab";
    TabTrain => "tab_train", "Train tab";
    TabModels => "tab_models", "Models tab";
    NextTheme => "next_theme", "switch to the next theme";
    Up => "up", "move up";
    Down => "down", "move down";
    Left => "left", "previous value / scroll left";
    Right => "right", "next value / scroll right";
    PageUp => "page_up", "page up";
    PageDown => "page_down", "page down";
    Top => "top", "first item";
    Bottom => "bottom", "last item";
    Confirm => "confirm", "open / select / edit field";
    Back => "back", "close / leave";
    FocusNext => "focus_next", "focus the next pane";
    StartRun => "start_run", "run the episode";
    EditInstruction => "edit_instruction", "type your own instruction";
    ClearInstruction => "clear_instruction", "clear the instruction (use the task's)";
    Filter => "filter", "filter";
    SortNext => "sort_next", "sort by the next column";
    SortReverse => "sort_reverse", "reverse the sort";
    Delete => "delete", "delete (asks first)";
    Refresh => "refresh", "rescan";
    MarkDiff => "mark_diff", "mark for diff / diff with the marked session";
    NextStep => "next_step", "next step";
    PrevStep => "prev_step", "previous step";
    NextError => "next_error", "jump to the next error";
    NextDivergence => "next_divergence", "jump to the next simulated/real divergence";
    NextIrreversible => "next_irreversible", "jump to the next irreversible call";
    ToggleRaw => "toggle_raw", "raw / pretty JSON";
    ToggleTokens => "toggle_tokens", "token view with log-probabilities";
    Fork => "fork", "fork from this step and re-run with the current model";
    EditFork => "edit_fork", "edit this tool result / actor message, then fork";
    ToggleDiff => "toggle_diff", "step-aligned diff with the other branch";
    StartTraining => "start_training", "start training";
    StopTraining => "stop_training", "stop training (checkpoint kept)";
    ResumeTraining => "resume_training", "resume from the selected checkpoint";
    LoadCheckpoint => "load_checkpoint", "load the selected checkpoint into the Run tab";
    LoadModel => "load_model", "load the selected model";
    Approve => "approve", "approve the call";
    EditCall => "edit_call", "edit the arguments (JSON, checked against the schema)";
    Reject => "reject", "reject (the reason goes back to the actor)";
    Terminate => "terminate", "terminate the episode";
}

/// A key with modifiers, parsed from `"ctrl-c"`, `"shift-tab"`, `"G"`, `"f1"`, `"pgdn"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub code: KeyCode,
    pub mods: KeyModifiers,
}

impl Key {
    pub fn from_event(e: &KeyEvent) -> Self {
        // Shift is part of the character for printable keys ('G' arrives as SHIFT + 'G').
        let mut mods = e.modifiers & (KeyModifiers::CONTROL | KeyModifiers::ALT);
        if !matches!(e.code, KeyCode::Char(_)) {
            mods |= e.modifiers & KeyModifiers::SHIFT;
        }
        let code = match e.code {
            KeyCode::BackTab => {
                mods |= KeyModifiers::SHIFT;
                KeyCode::Tab
            }
            c => c,
        };
        Self { code, mods }
    }

    pub fn parse(s: &str) -> Option<Self> {
        let mut mods = KeyModifiers::NONE;
        let mut rest = s;
        loop {
            if let Some(r) = rest.strip_prefix("ctrl-") {
                mods |= KeyModifiers::CONTROL;
                rest = r;
            } else if let Some(r) = rest.strip_prefix("alt-") {
                mods |= KeyModifiers::ALT;
                rest = r;
            } else if let Some(r) = rest.strip_prefix("shift-") {
                mods |= KeyModifiers::SHIFT;
                rest = r;
            } else {
                break;
            }
        }
        let code = match rest {
            "enter" => KeyCode::Enter,
            "esc" => KeyCode::Esc,
            "tab" => KeyCode::Tab,
            "space" => KeyCode::Char(' '),
            "up" => KeyCode::Up,
            "down" => KeyCode::Down,
            "left" => KeyCode::Left,
            "right" => KeyCode::Right,
            "pgup" => KeyCode::PageUp,
            "pgdn" => KeyCode::PageDown,
            "home" => KeyCode::Home,
            "end" => KeyCode::End,
            "backspace" => KeyCode::Backspace,
            "delete" => KeyCode::Delete,
            f if f.starts_with('f') && f.len() > 1 => KeyCode::F(f[1..].parse().ok()?),
            c => {
                let mut chars = c.chars();
                let ch = chars.next()?;
                if chars.next().is_some() {
                    return None;
                }
                KeyCode::Char(ch)
            }
        };
        Some(Self { code, mods })
    }

    pub fn label(&self) -> String {
        let mut s = String::new();
        if self.mods.contains(KeyModifiers::CONTROL) {
            s.push_str("ctrl-");
        }
        if self.mods.contains(KeyModifiers::ALT) {
            s.push_str("alt-");
        }
        if self.mods.contains(KeyModifiers::SHIFT) {
            s.push_str("shift-");
        }
        match self.code {
            KeyCode::Char(' ') => s.push_str("space"),
            KeyCode::Char(c) => s.push(c),
            KeyCode::Enter => s.push_str("enter"),
            KeyCode::Esc => s.push_str("esc"),
            KeyCode::Tab => s.push_str("tab"),
            KeyCode::Up => s.push('↑'),
            KeyCode::Down => s.push('↓'),
            KeyCode::Left => s.push('←'),
            KeyCode::Right => s.push('→'),
            KeyCode::PageUp => s.push_str("pgup"),
            KeyCode::PageDown => s.push_str("pgdn"),
            KeyCode::Home => s.push_str("home"),
            KeyCode::End => s.push_str("end"),
            KeyCode::F(n) => s.push_str(&format!("f{n}")),
            other => s.push_str(&format!("{other:?}")),
        }
        s
    }
}

/// One binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub scope: Scope,
    pub action: Action,
    pub keys: Vec<Key>,
}

/// The compiled-in defaults: (scope, action, keys).
const DEFAULTS: &[(Scope, Action, &[&str])] = {
    use Action::*;
    use Scope::*;
    &[
        (Global, Quit, &["q"]),
        (Global, Cancel, &["ctrl-c"]),
        (Global, Help, &["?", "f1"]),
        (Global, Palette, &["ctrl-p", ":"]),
        (Global, NextTab, &["tab"]),
        (Global, PrevTab, &["shift-tab"]),
        (Global, TabRun, &["1"]),
        (Global, TabSessions, &["2"]),
        (Global, TabDebugger, &["3"]),
        (Global, TabTrain, &["4"]),
        (Global, TabModels, &["5"]),
        (Global, NextTheme, &["ctrl-t"]),
        (Global, Up, &["k", "up"]),
        (Global, Down, &["j", "down"]),
        (Global, Left, &["h", "left"]),
        (Global, Right, &["l", "right"]),
        (Global, PageUp, &["pgup", "ctrl-u"]),
        (Global, PageDown, &["pgdn", "ctrl-d"]),
        (Global, Top, &["g", "home"]),
        (Global, Bottom, &["G", "end"]),
        (Global, Confirm, &["enter"]),
        (Global, Back, &["esc"]),
        (Global, FocusNext, &["w"]),
        (Run, StartRun, &["r", "f5"]),
        (Run, EditInstruction, &["i"]),
        (Run, ClearInstruction, &["c"]),
        (Sessions, Filter, &["/"]),
        (Sessions, SortNext, &["s"]),
        (Sessions, SortReverse, &["S"]),
        (Sessions, Delete, &["d", "delete"]),
        (Sessions, Refresh, &["R"]),
        (Sessions, MarkDiff, &["m"]),
        (Debugger, NextStep, &["n", "l", "right"]),
        (Debugger, PrevStep, &["p", "h", "left"]),
        (Debugger, NextError, &["e"]),
        (Debugger, NextDivergence, &["v"]),
        (Debugger, NextIrreversible, &["x"]),
        (Debugger, ToggleRaw, &["J"]),
        (Debugger, ToggleTokens, &["t"]),
        (Debugger, Fork, &["f"]),
        (Debugger, EditFork, &["E"]),
        (Debugger, ToggleDiff, &["D"]),
        (Train, StartTraining, &["s"]),
        (Train, StopTraining, &["x"]),
        (Train, ResumeTraining, &["R"]),
        (Train, LoadCheckpoint, &["L"]),
        (Models, LoadModel, &["enter", "L"]),
        (Approval, Approve, &["a", "y"]),
        (Approval, EditCall, &["e"]),
        (Approval, Reject, &["r", "n"]),
        (Approval, Terminate, &["t"]),
    ]
};

/// Failures reading a keymap file.
#[derive(Debug, thiserror::Error)]
pub enum KeymapError {
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: [{scope}] {action}: {message}")]
    Entry {
        path: String,
        scope: String,
        action: String,
        message: String,
    },
}

/// The keymap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keymap {
    pub bindings: Vec<Binding>,
}

impl Default for Keymap {
    fn default() -> Self {
        let bindings = DEFAULTS
            .iter()
            .map(|(scope, action, keys)| Binding {
                scope: *scope,
                action: *action,
                keys: keys.iter().filter_map(|k| Key::parse(k)).collect(),
            })
            .collect();
        Self { bindings }
    }
}

impl Keymap {
    /// The action bound to `key` in `scope` (then globally).
    pub fn lookup(&self, scope: Scope, key: Key) -> Option<Action> {
        let find = |s: Scope| {
            self.bindings
                .iter()
                .find(|b| b.scope == s && b.keys.contains(&key))
                .map(|b| b.action)
        };
        find(scope).or_else(|| find(Scope::Global))
    }

    /// The first key bound to `action` in `scope`, for hints ("press r to run").
    pub fn key_for(&self, scope: Scope, action: Action) -> String {
        self.bindings
            .iter()
            .find(|b| b.scope == scope && b.action == action)
            .and_then(|b| b.keys.first())
            .map(Key::label)
            .unwrap_or_else(|| "(unbound)".into())
    }

    /// Apply a user TOML override (`[scope] action = ["key", …]`).
    pub fn apply_toml(&mut self, text: &str, origin: &str) -> Result<(), KeymapError> {
        let table: BTreeMap<String, BTreeMap<String, Vec<String>>> =
            toml::from_str(text).map_err(|e| KeymapError::Parse {
                path: origin.to_string(),
                message: e.to_string(),
            })?;
        for (scope_name, actions) in table {
            let entry_err = |action: &str, message: String| KeymapError::Entry {
                path: origin.to_string(),
                scope: scope_name.clone(),
                action: action.to_string(),
                message,
            };
            let scope = Scope::ALL
                .into_iter()
                .find(|s| s.name() == scope_name)
                .ok_or_else(|| entry_err("-", "unknown scope".into()))?;
            for (action_name, keys) in actions {
                let action = Action::from_name(&action_name)
                    .ok_or_else(|| entry_err(&action_name, "unknown action".into()))?;
                let parsed = keys
                    .iter()
                    .map(|k| {
                        Key::parse(k)
                            .ok_or_else(|| entry_err(&action_name, format!("bad key {k:?}")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                match self
                    .bindings
                    .iter_mut()
                    .find(|b| b.scope == scope && b.action == action)
                {
                    Some(b) => b.keys = parsed,
                    None => self.bindings.push(Binding {
                        scope,
                        action,
                        keys: parsed,
                    }),
                }
            }
        }
        Ok(())
    }

    /// Defaults plus `<dir>/keymap.toml` if present.
    pub fn load(config_dir: Option<&Path>) -> Result<Self, KeymapError> {
        let mut k = Self::default();
        if let Some(p) = config_dir.map(|d| d.join("keymap.toml"))
            && p.is_file()
        {
            let text = std::fs::read_to_string(&p).map_err(|e| KeymapError::Parse {
                path: p.display().to_string(),
                message: e.to_string(),
            })?;
            k.apply_toml(&text, &p.display().to_string())?;
        }
        Ok(k)
    }

    /// Help rows per scope: (keys, description).
    pub fn help(&self) -> Vec<(Scope, Vec<(String, &'static str)>)> {
        Scope::ALL
            .into_iter()
            .map(|s| {
                let rows = self
                    .bindings
                    .iter()
                    .filter(|b| b.scope == s && !b.keys.is_empty())
                    .map(|b| {
                        let keys: Vec<String> = b.keys.iter().map(Key::label).collect();
                        (keys.join(" "), b.action.help())
                    })
                    .collect();
                (s, rows)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(code: KeyCode, mods: KeyModifiers) -> Key {
        Key::from_event(&KeyEvent::new(code, mods))
    }

    #[test]
    fn every_default_key_parses_and_scopes_do_not_collide() {
        for (scope, action, keys) in DEFAULTS {
            for k in *keys {
                assert!(Key::parse(k).is_some(), "{k}");
            }
            let n = DEFAULTS
                .iter()
                .filter(|(s, a, _)| s == scope && a == action)
                .count();
            assert_eq!(n, 1, "{action:?} twice in {scope:?}");
        }
        let km = Keymap::default();
        for s in Scope::ALL {
            let mut seen = std::collections::HashSet::new();
            for b in km.bindings.iter().filter(|b| b.scope == s) {
                for k in &b.keys {
                    assert!(seen.insert(*k), "{s:?}: {} bound twice", k.label());
                }
            }
        }
    }

    #[test]
    fn scope_first_then_global() {
        let km = Keymap::default();
        let s = ev(KeyCode::Char('s'), KeyModifiers::NONE);
        assert_eq!(km.lookup(Scope::Train, s), Some(Action::StartTraining));
        assert_eq!(km.lookup(Scope::Sessions, s), Some(Action::SortNext));
        assert_eq!(km.lookup(Scope::Run, s), None);
        let q = ev(KeyCode::Char('q'), KeyModifiers::NONE);
        assert_eq!(km.lookup(Scope::Debugger, q), Some(Action::Quit));
        let g = ev(KeyCode::Char('G'), KeyModifiers::SHIFT);
        assert_eq!(km.lookup(Scope::Sessions, g), Some(Action::Bottom));
        let bt = ev(KeyCode::BackTab, KeyModifiers::SHIFT);
        assert_eq!(km.lookup(Scope::Run, bt), Some(Action::PrevTab));
    }

    #[test]
    fn user_file_overrides_and_errors_name_the_entry() {
        let mut km = Keymap::default();
        km.apply_toml("[global]\nquit = [\"ctrl-q\"]\n", "k.toml")
            .unwrap();
        let q = ev(KeyCode::Char('q'), KeyModifiers::NONE);
        assert_eq!(km.lookup(Scope::Run, q), None);
        let cq = ev(KeyCode::Char('q'), KeyModifiers::CONTROL);
        assert_eq!(km.lookup(Scope::Run, cq), Some(Action::Quit));
        let e = km
            .apply_toml("[debugger]\nfly = [\"z\"]\n", "k.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("k.toml") && e.contains("fly"), "{e}");
        let e = km
            .apply_toml("[run]\nstart_run = [\"ctrl-\"]\n", "k.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad key"), "{e}");
    }

    #[test]
    fn help_is_generated_from_the_table() {
        let km = Keymap::default();
        let help = km.help();
        let global = &help[0].1;
        assert!(global.iter().any(|(k, h)| k == "q" && *h == "quit envace"));
    }
}
