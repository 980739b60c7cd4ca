//! The Run tab's state: the episode settings (a form), the episode being watched (an
//! [`EpisodeView`] fed by the driver's events), pane focus and scrolling, and the selected call
//! for the real-vs-simulated diff.

use std::path::{Path, PathBuf};

use ratatui::layout::Rect;

use super::app::{EditTarget, Level};
use super::command::{TabCommand, TabContext};
use super::debugger::ForkSpec;
use super::episode::EpisodeView;
use super::form::{Field, Form};
use super::keymap::Action;
use crate::engine::driver::{ApprovalPolicy, DriverEvent};
use crate::engine::episode::{EpisodeConfig, ModeChoice, parse_value};
use crate::engine::types::{ApprovalGate, PrivateRehearsal};
use crate::env::ToolSpec;
use crate::env::domains::Domain;
use crate::env::tasks::{Split, list_tasks};
use crate::session::{EventBody, session_file_name};

/// Who approves real calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Autonomy {
    /// Every real call opens the approval dialog.
    AskAlways,
    /// Irreversible calls open the dialog (the default).
    AskIrreversible,
    /// Nothing is asked; every call runs.
    Never,
}

pub const AUTONOMY: [&str; 3] = ["ask irreversible", "ask always", "never ask"];
/// How tool-call names are decoded: as the model writes them, or constrained to the listed
/// tools (`--constrain-tools`).
pub const TOOL_NAMES: [&str; 2] = ["free", "listed"];

/// Where the episode runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnv {
    Domain(String),
    /// An MCP server command line (`envace tui --mcp 'CMD'`).
    Mcp(String),
}

/// Everything the driver needs to run an episode.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRequest {
    pub env: RunEnv,
    pub task_id: Option<String>,
    /// A typed instruction (replaces the task's user turn; the episode is then unscored).
    pub instruction: Option<String>,
    pub config: EpisodeConfig,
    pub autonomy: Autonomy,
    pub session: PathBuf,
}

/// The panes that take focus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pane {
    Settings,
    Actor,
    Simulated,
    Branches,
    Diff,
}

impl Pane {
    const ORDER: [Pane; 5] = [
        Pane::Settings,
        Pane::Actor,
        Pane::Simulated,
        Pane::Branches,
        Pane::Diff,
    ];
    fn index(self) -> usize {
        Self::ORDER.iter().position(|p| *p == self).unwrap_or(0)
    }
}

/// Where the run stands.
#[derive(Debug, Clone, PartialEq)]
pub enum RunPhase {
    Idle,
    Running {
        label: String,
    },
    Done {
        session: PathBuf,
        result: Result<f64, String>,
    },
}

/// The Run tab.
#[derive(Debug, Clone)]
pub struct RunTab {
    pub form: Form,
    pub instruction: String,
    pub mcp: Option<String>,
    pub phase: RunPhase,
    pub view: EpisodeView,
    pub tools: Vec<ToolSpec>,
    pub focus: Pane,
    /// Scroll offsets of actor, simulated, branches, diff.
    pub scroll: [u16; 4],
    /// Selected call for the diff (index into `view.calls`); `None` follows the latest.
    pub selected_call: Option<usize>,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
    pub awaiting_approval: bool,
}

fn task_options(env: &str) -> Vec<String> {
    match Domain::from_name(env) {
        Ok(d) => list_tasks(d, Some(Split::Test))
            .into_iter()
            .chain(list_tasks(d, Some(Split::Train)))
            .map(|t| t.id.clone())
            .collect(),
        Err(_) => vec!["(type an instruction)".into()],
    }
}

impl RunTab {
    pub fn new(domain: Option<&str>, mcp: Option<String>) -> Self {
        let mut envs: Vec<String> = Domain::ALL.iter().map(|d| d.name().to_string()).collect();
        if mcp.is_some() {
            envs.push("mcp".into());
        }
        let env = match (&mcp, domain) {
            (Some(_), None) => "mcp".to_string(),
            (_, Some(d)) => d.to_string(),
            (None, None) => "bank".to_string(),
        };
        let env_refs: Vec<&str> = envs.iter().map(String::as_str).collect();
        let env_idx = envs.iter().position(|e| *e == env).unwrap_or(0);
        let tasks = task_options(&env);
        let task_refs: Vec<&str> = tasks.iter().map(String::as_str).collect();
        let default_task = tasks
            .iter()
            .position(|t| t == "bank-test-0007")
            .unwrap_or(0);
        let form = Form::new(vec![
            Field::choice("env", "env", &env_refs, env_idx),
            Field::choice("task", "task", &task_refs, default_task),
            Field::choice("mode", "mode", &["shadow", "real", "rehearse"], 0),
            Field::number("n", "rehearsals N", 2.0, (1.0, 0.0, 16.0), 0),
            Field::choice("strategy", "strategy", &["parallel", "sequential"], 0),
            Field::choice("trigger", "rehearse on", &["irreversible", "every"], 0),
            Field::choice("autonomy", "approval", &AUTONOMY, 0),
            Field::number("seed", "seed", 0.0, (1.0, 0.0, 1e9), 0),
            Field::number("turns", "max turns", 8.0, (1.0, 1.0, 64.0), 0),
            Field::choice("names", "tool names", &TOOL_NAMES, 0),
        ]);
        Self {
            form,
            instruction: String::new(),
            mcp,
            phase: RunPhase::Idle,
            view: EpisodeView::default(),
            tools: Vec::new(),
            focus: Pane::Settings,
            scroll: [0; 4],
            selected_call: None,
            tokens_per_s: 0.0,
            elapsed_s: 0.0,
            awaiting_approval: false,
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self.phase, RunPhase::Running { .. })
    }

    pub fn autonomy(&self) -> Autonomy {
        match self.form.choice("autonomy").as_str() {
            "ask always" => Autonomy::AskAlways,
            "never ask" => Autonomy::Never,
            _ => Autonomy::AskIrreversible,
        }
    }

    /// The episode configuration the form describes. The choices are the command line's value
    /// names and parse with the same rule (`envace run --mode … --rehearsal-mode … --rehearse-on
    /// …`); what does not parse or validate is an error, never a default.
    pub fn config(&self) -> Result<EpisodeConfig, String> {
        let e = |e: crate::engine::episode::ConfigError| e.to_string();
        let mode: ModeChoice = parse_value("mode", &self.form.choice("mode")).map_err(e)?;
        let n = self.form.number("n") as usize;
        let rehearsal = if n == 0 {
            None
        } else {
            Some(PrivateRehearsal {
                branches: n,
                strategy: parse_value("strategy", &self.form.choice("strategy")).map_err(e)?,
                trigger: parse_value("rehearse on", &self.form.choice("trigger")).map_err(e)?,
                ..PrivateRehearsal::default()
            })
        };
        let gate = match self.autonomy() {
            Autonomy::AskAlways => ApprovalGate::EveryCall,
            // "never ask": calls still pass the hook (recorded as approved) so the session
            // shows the gate.
            Autonomy::AskIrreversible | Autonomy::Never => ApprovalGate::Irreversible,
        };
        let config = EpisodeConfig {
            approve: ApprovalPolicy::Always,
            seed: self.form.number("seed") as u64,
            max_turns: self.form.number("turns") as u32,
            constrain_tool_names: self.form.choice("names") == TOOL_NAMES[1],
            ..EpisodeConfig::new(mode)
        }
        .with_gate(gate)
        .with_rehearsal(rehearsal)
        .map_err(|err| match err {
            crate::engine::episode::ConfigError::RehearsalWithoutEnvironment => {
                "Private Rehearsal needs a real environment: set N to 0 for rehearse mode, or use shadow/real"
                    .to_string()
            }
            other => other.to_string(),
        })?;
        config.validate().map_err(e)?;
        Ok(config)
    }

    /// Build the run request, or say what is missing.
    pub fn request(&self, sessions_dir: &Path) -> Result<RunRequest, String> {
        let config = self.config()?;
        let env_name = self.form.choice("env");
        let instruction = (!self.instruction.trim().is_empty()).then(|| self.instruction.clone());
        let (env, task_id) = if env_name == "mcp" {
            let cmd = self.mcp.clone().ok_or("no MCP server was given (--mcp)")?;
            if instruction.is_none() {
                return Err(
                    "an MCP server has no built-in tasks: press i and type an instruction".into(),
                );
            }
            (RunEnv::Mcp(cmd), None)
        } else {
            (
                RunEnv::Domain(env_name.clone()),
                Some(self.form.choice("task")),
            )
        };
        let file = session_file_name(
            &env_name,
            if instruction.is_some() {
                Some("instruction")
            } else {
                task_id.as_deref()
            },
            config.seed,
        );
        Ok(RunRequest {
            env,
            task_id,
            instruction,
            config,
            autonomy: self.autonomy(),
            session: sessions_dir.join(file),
        })
    }

    fn reset_view(&mut self, label: String) {
        self.view = EpisodeView::default();
        self.tools.clear();
        self.scroll = [0; 4];
        self.selected_call = None;
        self.tokens_per_s = 0.0;
        self.elapsed_s = 0.0;
        self.awaiting_approval = false;
        self.phase = RunPhase::Running { label };
    }

    pub fn started(&mut self, req: &RunRequest) {
        let label = match (&req.instruction, &req.task_id) {
            (Some(i), _) => format!("instruction: {i}"),
            (None, Some(t)) => t.clone(),
            (None, None) => "episode".into(),
        };
        self.reset_view(label);
    }

    fn forking(&mut self, spec: &ForkSpec) {
        self.reset_view(format!("fork of {} at {}", spec.file_name(), spec.at_event));
    }

    /// Take on a fork asked for elsewhere (the debugger): the options it re-runs with, from
    /// this tab's form, and the view reset to watch it; or why the form does not validate.
    pub fn begin_fork(&mut self, spec: &ForkSpec) -> Result<(EpisodeConfig, Autonomy), String> {
        let config = self.config()?;
        let autonomy = self.autonomy();
        self.forking(spec);
        Ok((config, autonomy))
    }

    /// Handle an action while this tab is in front.
    pub fn handle(&mut self, a: Action, ctx: &TabContext) -> Vec<TabCommand> {
        match a {
            Action::StartRun => self.start(ctx),
            Action::EditInstruction => vec![self.edit_instruction()],
            Action::ClearInstruction => {
                self.instruction.clear();
                Vec::new()
            }
            Action::Confirm if self.form.current().map(|f| f.key) == Some("instruction") => {
                vec![self.edit_instruction()]
            }
            Action::Confirm => Vec::new(),
            _ => {
                self.nav(a);
                Vec::new()
            }
        }
    }

    fn edit_instruction(&self) -> TabCommand {
        TabCommand::Edit {
            target: EditTarget::Instruction,
            text: self.instruction.clone(),
        }
    }

    fn start(&mut self, ctx: &TabContext) -> Vec<TabCommand> {
        if self.is_running() {
            return vec![TabCommand::notify(
                Level::Warn,
                "an episode is already running (Ctrl-C cancels it)",
            )];
        }
        if !ctx.model_ready {
            return vec![TabCommand::notify(
                Level::Warn,
                "the model is not loaded yet",
            )];
        }
        match self.request(&ctx.sessions_dir) {
            Ok(req) => {
                self.started(&req);
                vec![TabCommand::StartRun(req)]
            }
            Err(e) => vec![TabCommand::Notify(Level::Warn, e)],
        }
    }

    pub fn finished(&mut self, session: PathBuf, result: Result<f64, String>) {
        self.awaiting_approval = false;
        self.phase = RunPhase::Done { session, result };
    }

    pub fn tool_spec(&self, name: &str) -> Option<ToolSpec> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    pub fn on_driver(&mut self, event: DriverEvent, at_s: f64) {
        self.elapsed_s = at_s;
        match event {
            DriverEvent::Text {
                role,
                branch,
                index,
                text,
                ..
            } => self.view.stream(role, branch, index, &text),
            DriverEvent::Persisted(rec) => {
                if let EventBody::EpisodeStart { tools, .. } = &rec.event {
                    self.tools = tools.clone();
                }
                if matches!(rec.event, EventBody::Approval { .. }) {
                    self.awaiting_approval = false;
                }
                self.view.apply(&rec);
                if at_s > 0.0 {
                    self.tokens_per_s = self.view.generated_tokens as f64 / at_s;
                }
            }
            DriverEvent::AwaitingApproval(_) => self.awaiting_approval = true,
            DriverEvent::Finished(_) => {}
        }
    }

    /// The call the diff pane shows.
    pub fn diff_call(&self) -> Option<usize> {
        match self.selected_call {
            Some(i) if i < self.view.calls.len() => Some(i),
            _ => self
                .view
                .calls
                .iter()
                .rposition(|c| c.real.is_some() || c.simulated.is_some()),
        }
    }

    /// Keys other than the tab's own actions.
    pub fn nav(&mut self, a: Action) {
        if a == Action::FocusNext {
            self.focus = Pane::ORDER[(self.focus.index() + 1) % Pane::ORDER.len()];
            return;
        }
        if a == Action::Back {
            self.focus = Pane::Settings;
            return;
        }
        match self.focus {
            Pane::Settings => match a {
                Action::Left => self.form.up(),
                Action::Right => self.form.down(),
                Action::Up => self.nudge(1),
                Action::Down => self.nudge(-1),
                Action::PageUp => self.nudge(10),
                Action::PageDown => self.nudge(-10),
                _ => {}
            },
            Pane::Diff if matches!(a, Action::Left | Action::Right) => {
                let n = self.view.calls.len();
                if n == 0 {
                    return;
                }
                let cur = self.diff_call().unwrap_or(0);
                self.selected_call = Some(if a == Action::Left {
                    cur.saturating_sub(1)
                } else {
                    (cur + 1).min(n - 1)
                });
                self.scroll[3] = 0;
            }
            p => {
                let i = p.index() - 1;
                let s = &mut self.scroll[i];
                match a {
                    Action::Down => *s = s.saturating_add(1),
                    Action::Up => *s = s.saturating_sub(1),
                    Action::PageDown => *s = s.saturating_add(10),
                    Action::PageUp => *s = s.saturating_sub(10),
                    Action::Top => *s = 0,
                    Action::Bottom => *s = u16::MAX / 2,
                    _ => {}
                }
            }
        }
    }

    fn nudge(&mut self, delta: i32) {
        let key = self.form.current().map(|f| f.key);
        if key == Some("task") && delta.abs() > 1 {
            for _ in 0..delta.abs() {
                self.form.nudge(delta.signum());
            }
        } else {
            self.form.nudge(delta.signum());
        }
        if key == Some("env") {
            let env = self.form.choice("env");
            self.form.set_options("task", task_options(&env));
        }
    }

    /// Focus the pane under a click.
    pub fn click(&mut self, body: Rect, x: u16, y: u16) {
        let l = super::ui::run::layout(body);
        let hit = |r: Rect| x >= r.x && x < r.x + r.width && y >= r.y && y < r.y + r.height;
        for (r, p) in [
            (l.settings, Pane::Settings),
            (l.actor, Pane::Actor),
            (l.simulated, Pane::Simulated),
            (l.branches, Pane::Branches),
            (l.diff, Pane::Diff),
        ] {
            if hit(r) {
                self.focus = p;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_waits_for_the_model_and_starts_once() {
        let mut t = RunTab::new(None, None);
        let loading = TabContext {
            model_ready: false,
            ..TabContext::ready()
        };
        assert!(matches!(
            t.handle(Action::StartRun, &loading).as_slice(),
            [TabCommand::Notify(Level::Warn, m)] if m.contains("not loaded")
        ));
        assert!(!t.is_running());
        match t.handle(Action::StartRun, &TabContext::ready()).as_slice() {
            [TabCommand::StartRun(r)] => assert!(r.session.starts_with("sessions")),
            other => panic!("{other:?}"),
        }
        assert!(t.is_running());
        assert!(matches!(
            t.handle(Action::StartRun, &TabContext::ready()).as_slice(),
            [TabCommand::Notify(Level::Warn, m)] if m.contains("already running")
        ));
    }

    #[test]
    fn env_change_refreshes_tasks_and_request_validates() {
        let mut t = RunTab::new(None, None);
        assert_eq!(t.form.choice("task"), "bank-test-0007");
        t.nudge(1); // env: bank → retail
        assert_eq!(t.form.choice("env"), "retail");
        assert!(t.form.choice("task").starts_with("retail-"));
        let r = t.request(Path::new("/tmp/s")).unwrap();
        assert_eq!(r.env, RunEnv::Domain("retail".into()));
        assert!(r.session.starts_with("/tmp/s"));
        t.form.select("mode", "rehearse");
        assert!(t.request(Path::new("/tmp")).unwrap_err().contains("N to 0"));
    }

    #[test]
    fn tool_names_listed_constrains_the_episode() {
        let mut t = RunTab::new(None, None);
        assert!(!t.config().unwrap().constrain_tool_names);
        assert!(t.form.select("names", "listed"));
        assert!(t.config().unwrap().constrain_tool_names);
        assert!(
            t.request(Path::new("/tmp"))
                .unwrap()
                .config
                .constrain_tool_names
        );
    }

    #[test]
    fn mcp_needs_an_instruction() {
        let mut t = RunTab::new(None, Some("node server.js".into()));
        assert_eq!(t.form.choice("env"), "mcp");
        assert!(t.request(Path::new("/tmp")).is_err());
        t.instruction = "list the files".into();
        let r = t.request(Path::new("/tmp")).unwrap();
        assert_eq!(r.env, RunEnv::Mcp("node server.js".into()));
    }
}
