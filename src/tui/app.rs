//! The app's state and its one `update(msg) -> effects` function. Everything the user can do
//! arrives here as a [`Msg`] (keys, mouse, resize, ticks, and the events of the episode,
//! loader and trainer the driver runs); `update` changes state and returns [`Effect`]s for the
//! driver to perform. No IO happens here, so the whole app is testable by feeding messages and
//! rendering to a `TestBackend`.

use std::path::PathBuf;

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind};
use ratatui::layout::Rect;
use ratatui_textarea::TextArea;

use super::command::{TabCommand, TabContext};
use super::debugger::DebuggerTab;
use super::keymap::{Action, Key, Keymap, Scope};
use super::models_tab::{ModelEntry, ModelsTab};
use super::run_tab::{Autonomy, RunRequest, RunTab};
use super::sessions_tab::SessionsTab;
use super::theme::Theme;
use super::train_tab::{TrainRequest, TrainTab};
use crate::engine::driver::DriverEvent;
use crate::engine::fsm::ApprovalRequest;
use crate::engine::types::Decision;
use crate::env::ToolSpec;
use crate::runtime::ModelInfo;
use crate::session::Session;
use crate::session::index::SessionSummary;
use crate::train::metrics::StepMetrics;

/// The smallest terminal the layout supports.
pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 24;

/// The tabs, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    Run,
    Sessions,
    Debugger,
    Train,
    Models,
}

impl Tab {
    pub const ALL: [Tab; 5] = [
        Tab::Run,
        Tab::Sessions,
        Tab::Debugger,
        Tab::Train,
        Tab::Models,
    ];
    pub fn title(self) -> &'static str {
        match self {
            Tab::Run => "Run",
            Tab::Sessions => "Sessions",
            Tab::Debugger => "Debugger",
            Tab::Train => "Train",
            Tab::Models => "Models",
        }
    }
    fn scope(self) -> Scope {
        match self {
            Tab::Run => Scope::Run,
            Tab::Sessions => Scope::Sessions,
            Tab::Debugger => Scope::Debugger,
            Tab::Train => Scope::Train,
            Tab::Models => Scope::Models,
        }
    }
    fn index(self) -> usize {
        Tab::ALL.iter().position(|t| *t == self).unwrap_or(0)
    }
}

/// What a text editor is editing.
#[derive(Debug, Clone, PartialEq)]
pub enum EditTarget {
    Instruction,
    /// The arguments of the call waiting for approval.
    ApprovalArgs,
    /// A rejection reason.
    RejectReason,
    /// A tool result or actor message in the debugger, before forking.
    ForkContent {
        event_id: String,
        tool: bool,
    },
    SessionFilter,
    /// A text field of the Train form.
    TrainField(&'static str),
}

impl EditTarget {
    /// Single-line editors submit on Enter; multi-line ones on Ctrl-S.
    fn single_line(&self) -> bool {
        matches!(
            self,
            EditTarget::Instruction
                | EditTarget::RejectReason
                | EditTarget::SessionFilter
                | EditTarget::TrainField(_)
        )
    }
    pub fn title(&self) -> &'static str {
        match self {
            EditTarget::Instruction => "Instruction (Enter: done, Esc: cancel)",
            EditTarget::ApprovalArgs => "Edit arguments — JSON (Ctrl-S: send, Esc: back)",
            EditTarget::RejectReason => "Reason for the actor (Enter: reject, Esc: back)",
            EditTarget::ForkContent { tool: true, .. } => {
                "Counterfactual tool result (Ctrl-S: fork and re-run, Esc: cancel)"
            }
            EditTarget::ForkContent { tool: false, .. } => {
                "Edited actor message (Ctrl-S: fork and re-run, Esc: cancel)"
            }
            EditTarget::SessionFilter => "Filter (Enter: apply, Esc: clear)",
            EditTarget::TrainField(_) => "Value (Enter: set, Esc: cancel)",
        }
    }
}

/// An open text editor.
#[derive(Debug, Clone)]
pub struct Editor {
    pub target: EditTarget,
    pub area: TextArea<'static>,
    pub error: Option<String>,
}

impl Editor {
    pub fn new(target: EditTarget, text: &str) -> Self {
        let mut area = TextArea::new(text.lines().map(str::to_string).collect());
        area.move_cursor(ratatui_textarea::CursorMove::Bottom);
        area.move_cursor(ratatui_textarea::CursorMove::End);
        Self {
            target,
            area,
            error: None,
        }
    }
    pub fn text(&self) -> String {
        self.area.lines().join("\n")
    }
}

/// The approval dialog.
#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalDialog {
    pub request: ApprovalRequest,
    pub tool: Option<ToolSpec>,
}

/// Something drawn over the tabs.
#[derive(Debug, Clone, PartialEq)]
pub enum Overlay {
    Help { scroll: u16 },
    Palette { query: String, selected: usize },
    Approval(Box<ApprovalDialog>),
    ConfirmDelete(PathBuf),
}

/// Severity of a status-line notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// The loaded model.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelState {
    Loading(PathBuf),
    Ready(ModelInfo),
    Failed { path: PathBuf, error: String },
}

/// Which debugger slot a loaded session fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Primary,
    Other,
}

/// Every input `update` understands.
#[derive(Debug)]
pub enum Msg {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Resize(u16, u16),
    Tick,
    /// An event of the running episode, `at_s` seconds after it started.
    Driver {
        event: DriverEvent,
        at_s: f64,
    },
    /// The approval hook is waiting for the user.
    ApprovalAsked(ApprovalRequest),
    RunFinished {
        session: PathBuf,
        result: Result<f64, String>,
    },
    SessionsScanned {
        sessions: Vec<SessionSummary>,
        errors: Vec<String>,
    },
    LoadProgress {
        path: PathBuf,
        done: u64,
        total: u64,
    },
    SessionLoaded {
        path: PathBuf,
        slot: Slot,
        result: Result<Box<Session>, String>,
    },
    TokensDecoded {
        event: usize,
        tokens: Vec<String>,
    },
    /// A model load finished: `requested` is the path or spec as asked for (a remote spec keeps
    /// its `&tokenizer=` and options, which the model's display path drops).
    ModelLoaded {
        requested: PathBuf,
        result: Result<ModelInfo, String>,
    },
    ModelsScanned(Vec<ModelEntry>),
    Memory {
        rss_mb: f64,
    },
    TrainMetrics(StepMetrics),
    TrainLog(String),
    Checkpoints(Vec<PathBuf>),
    TrainFinished(Result<String, String>),
    Notice(Level, String),
}

/// Work for the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    StartRun(RunRequest),
    Decide(Decision),
    CancelRun,
    ScanSessions,
    LoadSession {
        path: PathBuf,
        slot: Slot,
    },
    CancelLoad,
    DeleteSession(PathBuf),
    DecodeTokens {
        event: usize,
        ids: Vec<u32>,
    },
    /// Fork a session and re-run from there with the current model and the Run tab's options.
    Fork {
        spec: super::debugger::ForkSpec,
        config: crate::engine::episode::EpisodeConfig,
        autonomy: Autonomy,
    },
    LoadModel(PathBuf),
    ScanModels,
    StartTraining(Box<TrainRequest>),
    StopTraining,
    ScanCheckpoints(PathBuf),
    Quit,
}

/// Start-up settings.
#[derive(Debug, Clone)]
pub struct AppConfig {
    pub model: PathBuf,
    pub domain: Option<String>,
    /// `envace tui --mcp 'CMD'`: the MCP server offered as an environment.
    pub mcp: Option<String>,
    pub sessions_dir: PathBuf,
    /// Default parent of training output directories.
    pub runs_dir: PathBuf,
    pub themes: Vec<Theme>,
    pub theme: usize,
    pub keymap: Keymap,
}

/// The whole app.
#[derive(Debug)]
pub struct App {
    pub tab: Tab,
    pub overlay: Option<Overlay>,
    pub editor: Option<Editor>,
    pub themes: Vec<Theme>,
    pub theme: usize,
    pub keymap: Keymap,
    pub area: Rect,
    pub model: ModelState,
    pub model_path: PathBuf,
    pub sessions_dir: PathBuf,
    pub run: RunTab,
    pub sessions: SessionsTab,
    pub debugger: DebuggerTab,
    pub train: TrainTab,
    pub models: ModelsTab,
    pub notice: Option<(Level, String)>,
    pub ticks: u64,
    pub quit: bool,
}

impl App {
    pub fn new(cfg: AppConfig) -> Self {
        let themes = if cfg.themes.is_empty() {
            vec![Theme::fallback()]
        } else {
            cfg.themes
        };
        Self {
            tab: Tab::Run,
            overlay: None,
            editor: None,
            theme: cfg.theme.min(themes.len() - 1),
            themes,
            keymap: cfg.keymap,
            area: Rect::new(0, 0, 120, 40),
            model: ModelState::Loading(cfg.model.clone()),
            run: RunTab::new(cfg.domain.as_deref(), cfg.mcp.clone()),
            train: TrainTab::new(&cfg.runs_dir),
            model_path: cfg.model,
            sessions_dir: cfg.sessions_dir,
            sessions: SessionsTab::default(),
            debugger: DebuggerTab::default(),
            models: ModelsTab::default(),
            notice: None,
            ticks: 0,
            quit: false,
        }
    }

    /// The effects to run at start-up.
    pub fn init(&self) -> Vec<Effect> {
        vec![
            Effect::LoadModel(self.model_path.clone()),
            Effect::ScanSessions,
            Effect::ScanModels,
        ]
    }

    pub fn theme(&self) -> &Theme {
        &self.themes[self.theme.min(self.themes.len() - 1)]
    }

    pub fn too_small(&self) -> bool {
        self.area.width < MIN_WIDTH || self.area.height < MIN_HEIGHT
    }

    /// The scope keys are looked up in now.
    pub fn scope(&self) -> Scope {
        match &self.overlay {
            Some(Overlay::Approval(_)) => Scope::Approval,
            _ => self.tab.scope(),
        }
    }

    fn notify(&mut self, level: Level, text: impl Into<String>) {
        self.notice = Some((level, text.into()));
    }

    /// Apply one message.
    pub fn update(&mut self, msg: Msg) -> Vec<Effect> {
        match msg {
            Msg::Key(k) => self.on_key(k),
            Msg::Mouse(m) => self.on_mouse(m),
            Msg::Resize(w, h) => {
                self.area = Rect::new(0, 0, w, h);
                Vec::new()
            }
            Msg::Tick => {
                self.ticks += 1;
                Vec::new()
            }
            Msg::Driver { event, at_s } => {
                self.run.on_driver(event, at_s);
                Vec::new()
            }
            Msg::ApprovalAsked(request) => {
                let tool = self.run.tool_spec(&request.call.name);
                self.overlay = Some(Overlay::Approval(Box::new(ApprovalDialog {
                    request,
                    tool,
                })));
                self.editor = None;
                self.tab = Tab::Run;
                Vec::new()
            }
            Msg::RunFinished { session, result } => {
                match &result {
                    Ok(r) => self.notify(
                        Level::Info,
                        format!("episode finished, reward {r:.2}: {}", session.display()),
                    ),
                    Err(e) => self.notify(Level::Error, format!("run failed: {e}")),
                }
                self.run.finished(session, result);
                if matches!(self.overlay, Some(Overlay::Approval(_))) {
                    self.overlay = None;
                }
                vec![Effect::ScanSessions]
            }
            Msg::SessionsScanned { sessions, errors } => {
                if let Some(e) = errors.first() {
                    self.notify(
                        Level::Warn,
                        format!("{} unreadable session file(s): {e}", errors.len()),
                    );
                }
                self.sessions.set(sessions);
                Vec::new()
            }
            Msg::LoadProgress { path, done, total } => {
                self.debugger.progress(path, done, total);
                Vec::new()
            }
            Msg::SessionLoaded { path, slot, result } => match result {
                Ok(s) => {
                    for w in &s.warnings {
                        self.notice = Some((Level::Warn, format!("{}: {w}", path.display())));
                    }
                    self.debugger.loaded(path, slot, *s);
                    self.tab = Tab::Debugger;
                    Vec::new()
                }
                Err(e) => {
                    self.debugger.load_failed();
                    self.notify(Level::Error, e);
                    Vec::new()
                }
            },
            Msg::TokensDecoded { event, tokens } => {
                self.debugger.decoded.insert(event, tokens);
                Vec::new()
            }
            Msg::ModelLoaded { requested, result } => {
                match result {
                    Ok(info) => {
                        self.notify(Level::Info, format!("model loaded: {}", info.path));
                        self.model_path = requested;
                        self.model = ModelState::Ready(info);
                    }
                    Err(error) => {
                        self.notify(Level::Error, format!("{}: {error}", requested.display()));
                        self.model = ModelState::Failed {
                            path: requested,
                            error,
                        };
                    }
                }
                Vec::new()
            }
            Msg::ModelsScanned(v) => {
                self.models.entries = v;
                Vec::new()
            }
            Msg::Memory { rss_mb } => {
                self.models.rss_mb = Some(rss_mb);
                Vec::new()
            }
            Msg::TrainMetrics(m) => {
                self.train.on_metrics(m);
                Vec::new()
            }
            Msg::TrainLog(l) => {
                self.train.log(l);
                Vec::new()
            }
            Msg::Checkpoints(v) => {
                self.train.checkpoints = v;
                Vec::new()
            }
            Msg::TrainFinished(r) => {
                match &r {
                    Ok(s) => self.notify(Level::Info, format!("training finished: {s}")),
                    Err(e) => self.notify(Level::Error, format!("training failed: {e}")),
                }
                self.train.finished(r);
                vec![Effect::ScanCheckpoints(self.train.out_dir())]
            }
            Msg::Notice(level, text) => {
                self.notify(level, text);
                Vec::new()
            }
        }
    }

    fn on_key(&mut self, k: KeyEvent) -> Vec<Effect> {
        if k.kind == crossterm::event::KeyEventKind::Release {
            return Vec::new();
        }
        let key = Key::from_event(&k);
        // Ctrl-C always cancels, whatever has focus.
        if self.keymap.lookup(Scope::Global, key) == Some(Action::Cancel) && self.editor.is_none() {
            return self.action(Action::Cancel);
        }
        if self.editor.is_some() {
            return self.on_editor_key(k);
        }
        if let Some(Overlay::Palette { .. }) = self.overlay {
            return self.on_palette_key(k);
        }
        match self.keymap.lookup(self.scope(), key) {
            Some(a) => self.action(a),
            None => Vec::new(),
        }
    }

    fn on_editor_key(&mut self, k: KeyEvent) -> Vec<Effect> {
        let Some(ed) = self.editor.as_mut() else {
            return Vec::new();
        };
        let submit = match k.code {
            KeyCode::Esc => {
                let target = ed.target.clone();
                self.editor = None;
                if target == EditTarget::SessionFilter {
                    self.sessions.filter.clear();
                }
                return Vec::new();
            }
            KeyCode::Enter if ed.target.single_line() => true,
            KeyCode::Char('s') if k.modifiers.contains(KeyModifiers::CONTROL) => true,
            _ => {
                ed.area.input(k);
                if ed.target == EditTarget::SessionFilter {
                    self.sessions.set_filter(ed.text());
                }
                return Vec::new();
            }
        };
        if !submit {
            return Vec::new();
        }
        let text = ed.text();
        let target = ed.target.clone();
        match target {
            EditTarget::Instruction => {
                self.run.instruction = text.trim().to_string();
                self.editor = None;
                Vec::new()
            }
            EditTarget::SessionFilter => {
                self.sessions.set_filter(text);
                self.editor = None;
                Vec::new()
            }
            EditTarget::TrainField(key) => {
                self.train.form.set_text(key, text.trim());
                self.editor = None;
                Vec::new()
            }
            EditTarget::RejectReason => {
                self.editor = None;
                self.overlay = None;
                let reason = if text.trim().is_empty() {
                    "rejected by the user".to_string()
                } else {
                    text.trim().to_string()
                };
                vec![Effect::Decide(Decision::Reject { reason })]
            }
            EditTarget::ApprovalArgs => {
                let schema = match &self.overlay {
                    Some(Overlay::Approval(d)) => d.tool.as_ref().map(|t| t.input_schema.clone()),
                    _ => None,
                };
                match serde_json::from_str::<serde_json::Value>(&text) {
                    Err(e) => {
                        if let Some(ed) = self.editor.as_mut() {
                            ed.error = Some(format!("not JSON: {e}"));
                        }
                        Vec::new()
                    }
                    Ok(arguments) => {
                        let problems = schema
                            .map(|s| super::schema_check::check(&arguments, &s))
                            .unwrap_or_default();
                        if problems.is_empty() {
                            self.editor = None;
                            self.overlay = None;
                            vec![Effect::Decide(Decision::ApproveEdited { arguments })]
                        } else {
                            if let Some(ed) = self.editor.as_mut() {
                                ed.error = Some(problems.join("; "));
                            }
                            Vec::new()
                        }
                    }
                }
            }
            EditTarget::ForkContent { event_id, tool } => {
                self.editor = None;
                let ctx = self.context();
                let commands = self.debugger.fork(Some((event_id, tool, text)), &ctx);
                self.apply_all(commands)
            }
        }
    }

    fn on_palette_key(&mut self, k: KeyEvent) -> Vec<Effect> {
        let Some(Overlay::Palette { query, selected }) = self.overlay.as_mut() else {
            return Vec::new();
        };
        match k.code {
            KeyCode::Esc => self.overlay = None,
            KeyCode::Up => *selected = selected.saturating_sub(1),
            KeyCode::Down => *selected += 1,
            KeyCode::Backspace => {
                query.pop();
                *selected = 0;
            }
            KeyCode::Enter => {
                let matches = palette_matches(query);
                let chosen = matches.get(*selected).or(matches.last()).copied();
                self.overlay = None;
                if let Some(a) = chosen {
                    return self.action(a);
                }
            }
            KeyCode::Char(c) if !k.modifiers.contains(KeyModifiers::CONTROL) => {
                query.push(c);
                *selected = 0;
            }
            _ => {}
        }
        Vec::new()
    }

    fn on_mouse(&mut self, m: MouseEvent) -> Vec<Effect> {
        if self.overlay.is_some() || self.editor.is_some() {
            return Vec::new();
        }
        match m.kind {
            MouseEventKind::ScrollDown | MouseEventKind::ScrollUp => {
                let a = if m.kind == MouseEventKind::ScrollDown {
                    Action::Down
                } else {
                    Action::Up
                };
                // The Run tab scrolls the pane under the pointer (never the settings values).
                if self.tab == Tab::Run {
                    self.run
                        .click(super::ui::body_area(self.area), m.column, m.row);
                    if self.run.focus == super::run_tab::Pane::Settings {
                        return Vec::new();
                    }
                }
                self.action(a)
            }
            MouseEventKind::Down(MouseButton::Left) => {
                if m.row == 0 {
                    // Tab bar: " Run │ Sessions │ …" — find the title under the click.
                    let mut x = 1u16;
                    for (i, t) in Tab::ALL.iter().enumerate() {
                        let w = (t.title().len() + 4) as u16;
                        if m.column >= x && m.column < x + w {
                            self.tab = Tab::ALL[i];
                            return self.on_tab_enter();
                        }
                        x += w + 1;
                    }
                } else {
                    let body = super::ui::body_area(self.area);
                    match self.tab {
                        Tab::Run => self.run.click(body, m.column, m.row),
                        Tab::Sessions => {
                            self.sessions.click(body, m.row);
                        }
                        Tab::Debugger => self.debugger.click(body, m.column, m.row),
                        Tab::Train | Tab::Models => {}
                    }
                }
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    fn on_tab_enter(&mut self) -> Vec<Effect> {
        match self.tab {
            Tab::Sessions => vec![Effect::ScanSessions],
            Tab::Models => vec![Effect::ScanModels],
            Tab::Train => vec![Effect::ScanCheckpoints(self.train.out_dir())],
            _ => Vec::new(),
        }
    }

    fn switch(&mut self, tab: Tab) -> Vec<Effect> {
        self.tab = tab;
        self.overlay = None;
        self.on_tab_enter()
    }

    /// Perform an action (from a key, the palette or a click).
    pub fn action(&mut self, a: Action) -> Vec<Effect> {
        // Overlays first.
        match (&self.overlay, a) {
            (Some(Overlay::Help { .. }), Action::Help | Action::Back | Action::Quit) => {
                self.overlay = None;
                return Vec::new();
            }
            (Some(Overlay::Help { scroll }), Action::Down | Action::PageDown) => {
                self.overlay = Some(Overlay::Help {
                    scroll: scroll.saturating_add(if a == Action::Down { 1 } else { 10 }),
                });
                return Vec::new();
            }
            (Some(Overlay::Help { scroll }), Action::Up | Action::PageUp) => {
                self.overlay = Some(Overlay::Help {
                    scroll: scroll.saturating_sub(if a == Action::Up { 1 } else { 10 }),
                });
                return Vec::new();
            }
            (Some(Overlay::Help { .. }), Action::Cancel) => {}
            (Some(Overlay::Help { .. }), _) => return Vec::new(),
            (Some(Overlay::ConfirmDelete(p)), Action::Confirm | Action::Approve) => {
                let p = p.clone();
                self.overlay = None;
                self.notify(Level::Info, format!("deleted {}", p.display()));
                return vec![Effect::DeleteSession(p), Effect::ScanSessions];
            }
            (Some(Overlay::ConfirmDelete(_)), Action::Cancel) => {}
            (Some(Overlay::ConfirmDelete(_)), _) => {
                self.overlay = None;
                return Vec::new();
            }
            (Some(Overlay::Approval(d)), _) => {
                let d = (**d).clone();
                return self.approval_action(d, a);
            }
            _ => {}
        }
        match a {
            Action::Quit => {
                self.quit = true;
                let mut v = Vec::new();
                if self.run.is_running() {
                    v.push(Effect::CancelRun);
                }
                if self.train.is_running() {
                    v.push(Effect::StopTraining);
                }
                v.push(Effect::Quit);
                v
            }
            Action::Cancel => {
                if self.run.is_running() {
                    self.notify(Level::Warn, "cancelling the running generation…");
                    vec![Effect::CancelRun]
                } else if self.debugger.loading.is_some() {
                    vec![Effect::CancelLoad]
                } else if self.train.is_running() && self.tab == Tab::Train {
                    self.notify(Level::Warn, "stopping training after this step…");
                    vec![Effect::StopTraining]
                } else {
                    self.notify(Level::Info, "nothing to cancel (q quits)");
                    Vec::new()
                }
            }
            Action::Help => {
                self.overlay = Some(Overlay::Help { scroll: 0 });
                Vec::new()
            }
            Action::Palette => {
                self.overlay = Some(Overlay::Palette {
                    query: String::new(),
                    selected: 0,
                });
                Vec::new()
            }
            Action::NextTab => self.switch(Tab::ALL[(self.tab.index() + 1) % Tab::ALL.len()]),
            Action::PrevTab => {
                self.switch(Tab::ALL[(self.tab.index() + Tab::ALL.len() - 1) % Tab::ALL.len()])
            }
            Action::TabRun => self.switch(Tab::Run),
            Action::TabSessions => self.switch(Tab::Sessions),
            Action::TabDebugger => self.switch(Tab::Debugger),
            Action::TabTrain => self.switch(Tab::Train),
            Action::TabModels => self.switch(Tab::Models),
            Action::NextTheme => {
                self.theme = (self.theme + 1) % self.themes.len();
                let name = self.theme().name.clone();
                self.notify(Level::Info, format!("theme: {name}"));
                Vec::new()
            }
            _ => self.tab_action(a),
        }
    }

    fn approval_action(&mut self, d: ApprovalDialog, a: Action) -> Vec<Effect> {
        match a {
            Action::Approve => {
                self.overlay = None;
                vec![Effect::Decide(Decision::Approve)]
            }
            Action::EditCall => {
                let text = serde_json::to_string_pretty(&d.request.call.arguments)
                    .unwrap_or_else(|_| d.request.call.arguments.to_string());
                self.editor = Some(Editor::new(EditTarget::ApprovalArgs, &text));
                Vec::new()
            }
            Action::Reject => {
                self.editor = Some(Editor::new(EditTarget::RejectReason, ""));
                Vec::new()
            }
            Action::Terminate => {
                self.overlay = None;
                vec![Effect::Decide(Decision::Terminate)]
            }
            Action::Cancel => {
                self.overlay = None;
                vec![Effect::Decide(Decision::Terminate), Effect::CancelRun]
            }
            Action::Help => {
                // Help over the dialog would hide it; show the keys in the notice instead.
                self.notify(Level::Info, "a approve · e edit · r reject · t terminate");
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// A key for the tab in front: the tab handles it on its own state, and what reaches
    /// beyond the tab comes back as commands for [`App::apply`].
    fn tab_action(&mut self, a: Action) -> Vec<Effect> {
        let ctx = self.context();
        let commands = match self.tab {
            Tab::Run => self.run.handle(a, &ctx),
            Tab::Sessions => self.sessions.handle(a, &ctx),
            Tab::Debugger => self.debugger.handle(a, &ctx),
            Tab::Train => self.train.handle(a, &ctx),
            Tab::Models => self.models.handle(a, &ctx),
        };
        self.apply_all(commands)
    }

    /// What the tabs may know of the rest of the app while they handle a key.
    fn context(&self) -> TabContext {
        TabContext {
            model_ready: matches!(self.model, ModelState::Ready(_)),
            model_path: self.model_path.clone(),
            sessions_dir: self.sessions_dir.clone(),
            run_busy: self.run.is_running(),
            train_busy: self.train.is_running(),
        }
    }

    fn apply_all(&mut self, commands: Vec<TabCommand>) -> Vec<Effect> {
        commands.into_iter().flat_map(|c| self.apply(c)).collect()
    }

    /// Carry out one command of a tab: the one place where a tab's wish touches the rest of
    /// the app.
    fn apply(&mut self, command: TabCommand) -> Vec<Effect> {
        match command {
            TabCommand::Edit { target, text } => {
                self.editor = Some(Editor::new(target, &text));
                Vec::new()
            }
            TabCommand::Overlay(o) => {
                self.overlay = Some(o);
                Vec::new()
            }
            TabCommand::SetDiff(on) => {
                self.debugger.diff = on;
                Vec::new()
            }
            TabCommand::ShowTab(tab) => {
                self.tab = tab;
                Vec::new()
            }
            TabCommand::LoadModel(path) => {
                self.model = ModelState::Loading(path.clone());
                vec![Effect::LoadModel(path)]
            }
            TabCommand::StartRun(req) => {
                self.notice = None;
                vec![Effect::StartRun(req)]
            }
            TabCommand::Fork(spec) => match self.run.begin_fork(&spec) {
                Ok((config, autonomy)) => {
                    self.notice = None;
                    self.tab = Tab::Run;
                    vec![Effect::Fork {
                        spec,
                        config,
                        autonomy,
                    }]
                }
                Err(e) => {
                    self.notify(Level::Warn, e);
                    Vec::new()
                }
            },
            TabCommand::Effect(e) => vec![e],
            TabCommand::Notify(level, text) => {
                self.notify(level, text);
                Vec::new()
            }
        }
    }

    /// The autonomy setting, for the driver's approval hook.
    pub fn autonomy(&self) -> Autonomy {
        self.run.autonomy()
    }
}

/// Palette entries matching `query` (substring over name and help).
pub fn palette_matches(query: &str) -> Vec<Action> {
    let q = query.to_lowercase();
    Action::ALL
        .iter()
        .copied()
        .filter(|a| q.is_empty() || a.name().contains(&q) || a.help().to_lowercase().contains(&q))
        .collect()
}
