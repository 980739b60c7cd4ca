//! The Train tab's state: the GRPO configuration as a form, the live metric series the
//! trainer reports through its `MetricsSink`, the log tail, and the checkpoints on disk.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use super::app::{EditTarget, Effect, Level, Tab};
use super::command::{TabCommand, TabContext};
use super::form::{Field, Form, Value};
use super::keymap::Action;
use crate::engine::episode::{ModeChoice, parse_value};
use crate::engine::types::GenRole;
use crate::train::grpo::GrpoConfig;
use crate::train::metrics::StepMetrics;

/// Lines of log kept.
pub const LOG_LINES: usize = 500;

/// What the driver needs to train.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainRequest {
    pub model: PathBuf,
    /// LoRA rank (0 = full fine-tuning).
    pub lora: usize,
    pub resume: Option<PathBuf>,
    pub out: PathBuf,
    pub cfg: GrpoConfig,
}

/// Where training stands.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainPhase {
    Idle,
    Running,
    Done(Result<String, String>),
}

/// Which list has focus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainFocus {
    Form,
    Checkpoints,
}

/// The Train tab.
#[derive(Debug, Clone)]
pub struct TrainTab {
    pub form: Form,
    pub phase: TrainPhase,
    /// metric name → (step, value) points.
    pub series: BTreeMap<String, Vec<(f64, f64)>>,
    pub last: Option<StepMetrics>,
    pub logs: VecDeque<String>,
    pub checkpoints: Vec<PathBuf>,
    pub selected_checkpoint: usize,
    pub focus: TrainFocus,
}

impl TrainTab {
    /// `runs` is where training output goes by default (`<runs>/grpo`).
    pub fn new(runs: &Path) -> Self {
        let out = runs.join("grpo");
        let form = Form::new(vec![
            Field::choice(
                "env",
                "domains",
                &["bank", "retail", "travel", "bank,retail,travel"],
                0,
            ),
            Field::choice("mode", "rollout mode", &["rehearse", "shadow", "real"], 0),
            Field::number("steps", "steps", 20.0, (1.0, 1.0, 100000.0), 0),
            Field::number("batch", "tasks / step", 4.0, (1.0, 1.0, 64.0), 0),
            Field::number("group", "episodes / task", 4.0, (1.0, 2.0, 32.0), 0),
            Field::choice("lora", "LoRA rank", &["full", "4", "8", "16", "32"], 0),
            Field::number("lr", "learning rate", 2e-5, (0.0, 1e-7, 1e-2), 6),
            Field::number("temperature", "temperature", 1.0, (0.1, 0.1, 2.0), 1),
            Field::number(
                "sim_temperature",
                "sim temperature",
                0.3,
                (0.1, 0.0, 2.0),
                1,
            ),
            // Joint training of both roles (EnvACE) or one role only (the ablation).
            Field::choice(
                "roles",
                "trained roles",
                &["actor,simulator", "actor", "simulator"],
                0,
            ),
            Field::number("kl", "KL coef", 0.0, (0.01, 0.0, 1.0), 2),
            Field::number("seed", "seed", 0.0, (1.0, 0.0, 1e9), 0),
            Field::number("every", "checkpoint every", 5.0, (1.0, 0.0, 1000.0), 0),
            Field::text("out", "output dir", &out.display().to_string()),
        ]);
        Self {
            form,
            phase: TrainPhase::Idle,
            series: BTreeMap::new(),
            last: None,
            logs: VecDeque::new(),
            checkpoints: Vec::new(),
            selected_checkpoint: 0,
            focus: TrainFocus::Form,
        }
    }

    pub fn is_running(&self) -> bool {
        self.phase == TrainPhase::Running
    }

    pub fn out_dir(&self) -> PathBuf {
        PathBuf::from(self.form.text("out"))
    }

    /// The configuration the form describes; a choice that does not parse is an error, never a
    /// default.
    pub fn config(&self) -> Result<GrpoConfig, String> {
        Ok(GrpoConfig {
            domains: self
                .form
                .choice("env")
                .split(',')
                .map(str::to_string)
                .collect(),
            mode: parse_value::<ModeChoice>("mode", &self.form.choice("mode"))
                .map_err(|e| e.to_string())?,
            steps: self.form.number("steps") as usize,
            batch: self.form.number("batch") as usize,
            group: self.form.number("group") as usize,
            lr: self.form.number("lr"),
            temperature: self.form.number("temperature"),
            sim_temperature: self.form.number("sim_temperature"),
            roles: match self.form.choice("roles").as_str() {
                "actor" => vec![GenRole::Actor],
                "simulator" => vec![GenRole::Simulator],
                "actor,simulator" => vec![GenRole::Actor, GenRole::Simulator],
                other => {
                    return Err(format!(
                        "roles: unknown value `{other}` (actor,simulator, actor, simulator)"
                    ));
                }
            },
            kl_coef: self.form.number("kl"),
            seed: self.form.number("seed") as u64,
            checkpoint_every: self.form.number("every") as usize,
            ..GrpoConfig::default()
        })
    }

    /// A request to start (or resume from the selected checkpoint).
    pub fn request(&self, model: &Path, resume: bool) -> Result<TrainRequest, String> {
        let out = self.out_dir();
        if out.as_os_str().is_empty() {
            return Err("set an output directory".into());
        }
        let resume = if resume {
            Some(
                self.selected_checkpoint()
                    .ok_or("no checkpoint selected to resume from")?,
            )
        } else {
            None
        };
        Ok(TrainRequest {
            model: model.to_path_buf(),
            lora: match self.form.choice("lora").as_str() {
                "full" => 0,
                r => r
                    .parse()
                    .map_err(|_| format!("lora: `{r}` is not a rank (full or a number)"))?,
            },
            resume,
            out,
            cfg: self.config()?,
        })
    }

    pub fn started(&mut self) {
        self.phase = TrainPhase::Running;
        self.series.clear();
        self.last = None;
        self.log("training started".into());
    }

    pub fn finished(&mut self, r: Result<String, String>) {
        self.log(match &r {
            Ok(s) => format!("finished: {s}"),
            Err(e) => format!("failed: {e}"),
        });
        self.phase = TrainPhase::Done(r);
    }

    pub fn on_metrics(&mut self, m: StepMetrics) {
        let x = m.step as f64;
        for (k, v) in &m.values {
            if let Some(v) = v.as_f64()
                && v.is_finite()
            {
                self.series.entry(k.clone()).or_default().push((x, v));
            }
        }
        self.last = Some(m);
    }

    pub fn log(&mut self, line: String) {
        if self.logs.len() == LOG_LINES {
            self.logs.pop_front();
        }
        self.logs.push_back(line);
    }

    pub fn selected_checkpoint(&self) -> Option<PathBuf> {
        self.checkpoints.get(self.selected_checkpoint).cloned()
    }

    /// Handle an action while this tab is in front.
    pub fn handle(&mut self, a: Action, ctx: &TabContext) -> Vec<TabCommand> {
        match a {
            Action::StartTraining | Action::ResumeTraining => {
                if self.is_running() {
                    return vec![TabCommand::notify(
                        Level::Warn,
                        "training is already running",
                    )];
                }
                if crate::runtime::openai::is_remote(&ctx.model_path.to_string_lossy()) {
                    return vec![TabCommand::notify(
                        Level::Warn,
                        "a remote model is not trainable here: load a local model (Models tab) to train",
                    )];
                }
                match self.request(&ctx.model_path, a == Action::ResumeTraining) {
                    Ok(r) => {
                        self.started();
                        vec![TabCommand::Effect(Effect::StartTraining(Box::new(r)))]
                    }
                    Err(e) => vec![TabCommand::Notify(Level::Warn, e)],
                }
            }
            Action::StopTraining if self.is_running() => {
                vec![TabCommand::Effect(Effect::StopTraining)]
            }
            Action::StopTraining => Vec::new(),
            // The checkpoint becomes the app's model; the Run tab is where it is used.
            Action::LoadCheckpoint => match self.selected_checkpoint() {
                Some(p) => vec![TabCommand::LoadModel(p), TabCommand::ShowTab(Tab::Run)],
                None => Vec::new(),
            },
            Action::Confirm => match self.form.current() {
                Some(f) => match &f.value {
                    Value::Text(t) => vec![TabCommand::Edit {
                        target: EditTarget::TrainField(f.key),
                        text: t.clone(),
                    }],
                    _ => Vec::new(),
                },
                None => Vec::new(),
            },
            _ => {
                self.nav(a);
                Vec::new()
            }
        }
    }

    pub fn nav(&mut self, a: Action) {
        match (self.focus, a) {
            (_, Action::FocusNext) => {
                self.focus = match self.focus {
                    TrainFocus::Form => TrainFocus::Checkpoints,
                    TrainFocus::Checkpoints => TrainFocus::Form,
                }
            }
            (TrainFocus::Form, Action::Up) => self.form.up(),
            (TrainFocus::Form, Action::Down) => self.form.down(),
            (TrainFocus::Form, Action::Left) => self.form.nudge(-1),
            (TrainFocus::Form, Action::Right) => self.form.nudge(1),
            (TrainFocus::Checkpoints, Action::Up) => {
                self.selected_checkpoint = self.selected_checkpoint.saturating_sub(1)
            }
            (TrainFocus::Checkpoints, Action::Down) => {
                self.selected_checkpoint =
                    (self.selected_checkpoint + 1).min(self.checkpoints.len().saturating_sub(1))
            }
            _ => {}
        }
    }
}

/// Checkpoint directories under `out` (`checkpoint-N`, `final`; full or LoRA adapter), newest
/// step last.
pub fn scan_checkpoints(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.join("model.safetensors").is_file() || p.join("adapter_model.safetensors").is_file()
        })
        .map(|p| {
            let name = p
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            let step = name
                .strip_prefix("checkpoint-")
                .and_then(|s| s.parse().ok())
                .unwrap_or(u64::MAX);
            (step, p)
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loaded_checkpoint_becomes_the_model_and_shows_the_run_tab() {
        let ctx = TabContext::ready();
        let mut t = TrainTab::new(Path::new("runs"));
        assert!(t.handle(Action::LoadCheckpoint, &ctx).is_empty());
        let p = PathBuf::from("runs/grpo/checkpoint-5");
        t.checkpoints = vec![p.clone()];
        assert_eq!(
            t.handle(Action::LoadCheckpoint, &ctx),
            vec![TabCommand::LoadModel(p), TabCommand::ShowTab(Tab::Run)]
        );
    }

    #[test]
    fn training_starts_once_with_the_apps_model() {
        let ctx = TabContext::ready();
        let mut t = TrainTab::new(Path::new("runs"));
        assert!(t.handle(Action::StopTraining, &ctx).is_empty());
        match t.handle(Action::StartTraining, &ctx).as_slice() {
            [TabCommand::Effect(Effect::StartTraining(r))] => assert_eq!(r.model, ctx.model_path),
            other => panic!("{other:?}"),
        }
        assert!(t.is_running());
        assert!(matches!(
            t.handle(Action::StartTraining, &ctx).as_slice(),
            [TabCommand::Notify(Level::Warn, m)] if m.contains("already running")
        ));
        assert_eq!(
            t.handle(Action::StopTraining, &ctx),
            vec![TabCommand::Effect(Effect::StopTraining)]
        );
    }

    #[test]
    fn a_remote_model_is_not_trainable() {
        let ctx = TabContext {
            model_path: PathBuf::from("openai:http://127.0.0.1:8080/v1#smollm2"),
            ..TabContext::ready()
        };
        let mut t = TrainTab::new(Path::new("runs"));
        assert!(matches!(
            t.handle(Action::StartTraining, &ctx).as_slice(),
            [TabCommand::Notify(Level::Warn, m)] if m.contains("not trainable")
        ));
        assert!(!t.is_running());
    }

    #[test]
    fn form_becomes_a_grpo_config() {
        let mut t = TrainTab::new(Path::new("runs"));
        t.form.cursor = 2;
        t.form.nudge(1);
        let c = t.config().unwrap();
        assert_eq!(c.steps, 21);
        assert_eq!(c.domains, vec!["bank"]);
        assert_eq!(c.mode, ModeChoice::Rehearse);
        assert_eq!(c.roles, vec![GenRole::Actor, GenRole::Simulator]);
        assert!((c.sim_temperature - 0.3).abs() < 1e-9);
        // The roles field trains one role only when asked.
        t.form.cursor = t.form.fields.iter().position(|f| f.key == "roles").unwrap();
        t.form.nudge(1);
        assert_eq!(t.config().unwrap().roles, vec![GenRole::Actor]);
        assert!(t.request(Path::new("m"), true).is_err());
        let r = t.request(Path::new("m"), false).unwrap();
        assert_eq!(r.out, PathBuf::from("runs/grpo"));
    }
}
