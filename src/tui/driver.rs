//! The TUI's driver: owns the terminal, merges terminal events, ticks and background results
//! into one channel of [`Msg`]s, feeds them to the pure [`App::update`], and performs the
//! [`Effect`]s it returns. Every slow thing (model loading, generation, tool calls, session
//! loading, training) runs off the UI task and reports back through the channel, so the screen
//! keeps redrawing. Logs go to a file (`<data dir>/envace.log`), never to the screen.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use crossterm::event::{DisableMouseCapture, EnableMouseCapture, Event as TermEvent, EventStream};
use futures::StreamExt;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::app::{App, AppConfig, Effect, Level, Msg, Slot};
use super::debugger::ForkSpec;
use super::keymap::Keymap;
use super::run_tab::{Autonomy, RunEnv, RunRequest};
use super::theme;
use super::train_tab::{TrainRequest, scan_checkpoints};
use crate::engine::driver::{ApprovalHook, DriverEvent, SharedModel, share_model};
use crate::engine::fork::{ForkEdit, ForkRequest, fork_path};
use crate::engine::fsm::ApprovalRequest;
use crate::engine::profile::PromptProfile;
use crate::engine::runner::{
    Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, Policy, RunError, header, launch,
    recorded_config, run_fork,
};
use crate::engine::spec::{domain_system, task_spec};
use crate::engine::types::{Decision, EpisodeSpec};
use crate::env::Environment;
use crate::env::domain_env::DomainEnv;
use crate::env::domains::Domain;
use crate::env::mcp_client::{McpEnv, McpServerConfig};
use crate::env::tasks::find_builtin;
use crate::runtime::openai::open_model;
use crate::runtime::{CancelToken, DeviceChoice};
use crate::session::SessionWriter;
use crate::train::metrics::{MetricsSink, StepMetrics};

/// Failures of the TUI itself.
#[derive(Debug, thiserror::Error)]
pub enum TuiError {
    #[error("terminal: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Config(String),
}

/// `envace tui` options.
#[derive(Debug, Clone)]
pub struct TuiOptions {
    pub model: PathBuf,
    pub env: Option<String>,
    pub mcp: Option<McpServerConfig>,
    pub session: Option<PathBuf>,
    pub sessions_dir: Option<PathBuf>,
    pub theme: Option<String>,
    pub device: DeviceChoice,
}

/// The user's config and data directories.
pub fn project_dirs() -> Option<directories::ProjectDirs> {
    directories::ProjectDirs::from("dev", "envace", "envace")
}

/// Build the app's configuration: themes and keymap from the config directory.
pub fn app_config(opts: &TuiOptions) -> Result<AppConfig, TuiError> {
    let dirs = project_dirs();
    let config_dir = dirs.as_ref().map(|d| d.config_dir().to_path_buf());
    let (themes, errors) =
        theme::available(config_dir.as_ref().map(|d| d.join("themes")).as_deref());
    for e in errors {
        tracing::warn!("theme skipped: {e}");
    }
    let keymap =
        Keymap::load(config_dir.as_deref()).map_err(|e| TuiError::Config(e.to_string()))?;
    let theme = match &opts.theme {
        Some(name) => themes.iter().position(|t| t.name == *name).ok_or_else(|| {
            let names: Vec<&str> = themes.iter().map(|t| t.name.as_str()).collect();
            TuiError::Config(format!("no theme `{name}` (have: {})", names.join(", ")))
        })?,
        None => 0,
    };
    let sessions_dir = opts
        .sessions_dir
        .clone()
        .or_else(crate::session::default_sessions_dir)
        .unwrap_or_else(|| PathBuf::from("sessions"));
    Ok(AppConfig {
        model: opts.model.clone(),
        domain: opts.env.clone(),
        mcp: opts.mcp.as_ref().map(|c| c.name.clone()),
        runs_dir: dirs
            .as_ref()
            .map(|d| d.data_dir().join("runs"))
            .unwrap_or_else(|| PathBuf::from("runs")),
        sessions_dir,
        themes,
        theme,
        keymap,
    })
}

fn init_logging() {
    let Some(dir) = project_dirs().map(|d| d.data_dir().to_path_buf()) else {
        return;
    };
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let Ok(file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("envace.log"))
    else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ENVACE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
}

/// Run the TUI until the user quits.
pub fn run(opts: TuiOptions) -> Result<(), TuiError> {
    init_logging();
    let cfg = app_config(&opts)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // ratatui::init installs a panic hook that restores the terminal before printing.
    let mut terminal = ratatui::init();
    let _ = crossterm::execute!(std::io::stdout(), EnableMouseCapture);
    let result = rt.block_on(event_loop(&mut terminal, cfg, opts));
    let _ = crossterm::execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    let _ = std::io::stdout().flush();
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

/// The loaded model and its prompt profile, filled by a background load.
type ModelSlot = Arc<Mutex<Option<(SharedModel, Option<PromptProfile>)>>>;

/// What the driver holds besides the app.
struct Ctx {
    tx: UnboundedSender<Msg>,
    model: ModelSlot,
    device: DeviceChoice,
    sessions_dir: PathBuf,
    mcp: Option<McpServerConfig>,
    run_cancel: CancelToken,
    decisions: Option<UnboundedSender<Decision>>,
    load_cancel: CancelToken,
    train_cancel: CancelToken,
}

async fn event_loop(
    terminal: &mut ratatui::DefaultTerminal,
    cfg: AppConfig,
    opts: TuiOptions,
) -> Result<(), TuiError> {
    let (tx, mut rx) = unbounded_channel::<Msg>();
    let mut ctx = Ctx {
        tx: tx.clone(),
        model: Arc::new(Mutex::new(None)),
        device: opts.device,
        sessions_dir: cfg.sessions_dir.clone(),
        mcp: opts.mcp.clone(),
        run_cancel: CancelToken::new(),
        decisions: None,
        load_cancel: CancelToken::new(),
        train_cancel: CancelToken::new(),
    };
    let mut app = App::new(cfg);
    let size = terminal.size()?;
    app.update(Msg::Resize(size.width, size.height));
    let mut effects = app.init();
    if let Some(s) = &opts.session {
        effects.push(Effect::LoadSession {
            path: s.clone(),
            slot: Slot::Primary,
        });
    }
    for e in effects {
        perform(&mut ctx, e);
    }
    let mut events = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        terminal.draw(|f| super::ui::draw(&app, f))?;
        let msg = tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(TermEvent::Key(k))) => Msg::Key(k),
                Some(Ok(TermEvent::Mouse(m))) => Msg::Mouse(m),
                Some(Ok(TermEvent::Resize(w, h))) => Msg::Resize(w, h),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(e.into()),
                None => break,
            },
            Some(m) = rx.recv() => m,
            _ = tick.tick() => Msg::Tick,
        };
        let mut effects = app.update(msg);
        // Coalesce a burst (streamed tokens) into one redraw.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(15) {
            match rx.try_recv() {
                Ok(m) => effects.extend(app.update(m)),
                Err(_) => break,
            }
        }
        let mut quit = false;
        for e in effects {
            quit |= e == Effect::Quit;
            perform(&mut ctx, e);
        }
        if quit || app.quit {
            break;
        }
    }
    Ok(())
}

fn send(tx: &UnboundedSender<Msg>, m: Msg) {
    // The UI may be gone (quitting); nothing to do then.
    let _ = tx.send(m);
}

fn perform(ctx: &mut Ctx, e: Effect) {
    let tx = ctx.tx.clone();
    match e {
        Effect::Quit => {
            ctx.run_cancel.cancel();
            ctx.train_cancel.cancel();
            ctx.load_cancel.cancel();
        }
        Effect::LoadModel(path) => {
            let slot = Arc::clone(&ctx.model);
            let device = ctx.device;
            tokio::task::spawn_blocking(move || {
                let r = open_model(&path, device)
                    .map_err(|e| e.to_string())
                    .and_then(|m| {
                        let p = PromptProfile::for_model(&path).map_err(|e| e.to_string())?;
                        Ok((m, p))
                    });
                match r {
                    Ok((m, p)) => {
                        let info = m.info();
                        if let Ok(mut s) = slot.lock() {
                            *s = Some((share_model(m), p));
                        }
                        send(
                            &tx,
                            Msg::ModelLoaded {
                                requested: path,
                                result: Ok(info),
                            },
                        );
                    }
                    Err(e) => {
                        tracing::error!(path = %path.display(), error = %e, "model load failed");
                        send(
                            &tx,
                            Msg::ModelLoaded {
                                requested: path,
                                result: Err(e),
                            },
                        )
                    }
                }
                if let Some(r) = super::models_tab::rss_mb() {
                    send(&tx, Msg::Memory { rss_mb: r });
                }
            });
        }
        Effect::ScanSessions => {
            let dir = ctx.sessions_dir.clone();
            tokio::task::spawn_blocking(move || {
                let (sessions, errors) = crate::session::index::scan_dir(&dir);
                let errors = errors
                    .into_iter()
                    .map(|(p, e)| format!("{}: {e}", p.display()))
                    .collect();
                send(&tx, Msg::SessionsScanned { sessions, errors });
            });
        }
        Effect::LoadSession { path, slot } => {
            ctx.load_cancel = CancelToken::new();
            let cancel = ctx.load_cancel.clone();
            tokio::task::spawn_blocking(move || {
                let mut last = Instant::now();
                let p2 = path.clone();
                let tx2 = tx.clone();
                let mut progress = move |done: u64, total: u64| {
                    if last.elapsed() > Duration::from_millis(50) {
                        last = Instant::now();
                        send(
                            &tx2,
                            Msg::LoadProgress {
                                path: p2.clone(),
                                done,
                                total,
                            },
                        );
                    }
                };
                let result = crate::session::reader::read_session_with_progress(
                    &path,
                    &mut progress,
                    &cancel,
                )
                .map(Box::new)
                .map_err(|e| e.to_string());
                send(&tx, Msg::SessionLoaded { path, slot, result });
            });
        }
        Effect::CancelLoad => ctx.load_cancel.cancel(),
        Effect::DeleteSession(p) => {
            tracing::info!(path = %p.display(), "delete session");
            if let Err(e) = std::fs::remove_file(&p) {
                send(
                    &tx,
                    Msg::Notice(Level::Error, format!("{}: {e}", p.display())),
                );
            }
        }
        Effect::DecodeTokens { event, ids } => {
            let slot = Arc::clone(&ctx.model);
            tokio::task::spawn_blocking(move || {
                let model = slot
                    .lock()
                    .ok()
                    .and_then(|s| s.as_ref().map(|m| m.0.clone()));
                let Some(model) = model else {
                    send(
                        &tx,
                        Msg::Notice(Level::Warn, "no model loaded to decode tokens".into()),
                    );
                    return;
                };
                let Ok(m) = model.lock() else { return };
                let tokens = ids
                    .iter()
                    .map(|id| m.decode(&[*id]).unwrap_or_else(|_| format!("<{id}>")))
                    .collect();
                send(&tx, Msg::TokensDecoded { event, tokens });
            });
        }
        Effect::StartRun(req) => {
            tracing::info!(?req, "run");
            start_run(ctx, Job::Run(req))
        }
        Effect::Fork {
            spec,
            config,
            autonomy,
        } => start_run(
            ctx,
            Job::Fork(ForkJob {
                spec,
                config,
                autonomy,
            }),
        ),
        Effect::Decide(d) => {
            if let Some(s) = &ctx.decisions {
                let _ = s.send(d);
            }
        }
        Effect::CancelRun => ctx.run_cancel.cancel(),
        Effect::ScanModels => {
            let mut roots = vec![PathBuf::from("models")];
            let mut remotes = None;
            if let Some(d) = project_dirs() {
                roots.push(d.data_dir().join("models"));
                remotes = Some(d.config_dir().join(super::models_tab::REMOTES_FILE));
            }
            tokio::task::spawn_blocking(move || {
                let mut entries = super::models_tab::scan_models(&roots);
                match remotes.as_deref().map(super::models_tab::remote_entries) {
                    Some(Ok(r)) => entries.extend(r),
                    Some(Err(e)) => send(&tx, Msg::Notice(Level::Error, e)),
                    None => {}
                }
                send(&tx, Msg::ModelsScanned(entries));
                if let Some(r) = super::models_tab::rss_mb() {
                    send(&tx, Msg::Memory { rss_mb: r });
                }
            });
        }
        Effect::StartTraining(req) => {
            ctx.train_cancel = CancelToken::new();
            let cancel = ctx.train_cancel.clone();
            tracing::info!(?req, "training");
            std::thread::spawn(move || {
                let out = req.out.clone();
                let r = train(&req, &tx, &cancel);
                tracing::info!(?r, "training ended");
                send(&tx, Msg::Checkpoints(scan_checkpoints(&out)));
                send(&tx, Msg::TrainFinished(r));
            });
        }
        Effect::StopTraining => ctx.train_cancel.cancel(),
        Effect::ScanCheckpoints(dir) => {
            tokio::task::spawn_blocking(move || {
                send(&tx, Msg::Checkpoints(scan_checkpoints(&dir)))
            });
        }
    }
}

/// The trainer's metrics, forwarded to the UI.
struct ChannelSink {
    tx: UnboundedSender<Msg>,
    out: PathBuf,
}

impl MetricsSink for ChannelSink {
    fn record(&mut self, m: &StepMetrics) {
        let v = |k: &str| m.get(k).unwrap_or(f64::NAN);
        send(
            &self.tx,
            Msg::TrainLog(format!(
                "step {}: reward {:.3} (actor {:.3}, simulator {:.3}) loss {:.4} rows {} · {:.0} tok/s · {:.1} s",
                m.step,
                v("reward"),
                v("reward_actor"),
                v("reward_simulator"),
                v("loss"),
                v("rows"),
                v("tokens_per_s"),
                v("seconds")
            )),
        );
        send(&self.tx, Msg::TrainMetrics(m.clone()));
        send(&self.tx, Msg::Checkpoints(scan_checkpoints(&self.out)));
    }
    fn log(&mut self, line: &str) {
        send(&self.tx, Msg::TrainLog(line.to_string()));
    }
}

fn train(
    req: &TrainRequest,
    tx: &UnboundedSender<Msg>,
    cancel: &CancelToken,
) -> Result<String, String> {
    use crate::train::grpo::{GrpoRun, run_grpo};
    use crate::train::model::TrainableModel;
    let device = candle_core::Device::Cpu;
    // A run directory resumes from its latest complete checkpoint.
    let resume = match &req.resume {
        Some(p) => {
            Some(crate::train::checkpoint::resolve_checkpoint(p).map_err(|e| e.to_string())?)
        }
        None => None,
    };
    let from = resume.clone().unwrap_or_else(|| req.model.clone());
    let model = match (&req.resume, req.lora) {
        // A checkpoint (full or LoRA) continues as it was trained.
        (Some(_), _) | (None, 0) => TrainableModel::load(&from, &device),
        (None, r) => {
            let cfg = crate::train::lora::LoraConfig::new(r, None, "", req.cfg.seed)
                .map_err(|e| e.to_string())?;
            TrainableModel::load_lora(&from, &cfg, &device)
        }
    }
    .map_err(|e| e.to_string())?;
    let resume = match &resume {
        Some(dir) => Some(
            crate::train::checkpoint::load_for_resume(dir, &device).map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    std::fs::create_dir_all(&req.out).map_err(|e| format!("{}: {e}", req.out.display()))?;
    let mut sink = ChannelSink {
        tx: tx.clone(),
        out: req.out.clone(),
    };
    send(
        tx,
        Msg::TrainLog(format!("loaded {}; rollouts are running…", from.display())),
    );
    let report = run_grpo(
        &req.cfg,
        GrpoRun {
            model: &model,
            model_dir: &from,
            out: Some(&req.out),
            resume: resume.as_ref(),
            sink: &mut sink,
            cancel,
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(format!(
        "{} steps; checkpoints in {}",
        report.steps,
        req.out.display()
    ))
}

/// Answers approval requests from the dialog, according to the autonomy setting.
struct DialogApprover {
    autonomy: Autonomy,
    tx: UnboundedSender<Msg>,
    rx: UnboundedReceiver<Decision>,
    cancel: CancelToken,
}

#[async_trait]
impl ApprovalHook for DialogApprover {
    async fn decide(&mut self, request: &ApprovalRequest) -> Decision {
        let ask = match self.autonomy {
            Autonomy::Never => false,
            Autonomy::AskIrreversible => request.irreversible,
            Autonomy::AskAlways => true,
        };
        if !ask {
            return Decision::Approve;
        }
        send(&self.tx, Msg::ApprovalAsked(request.clone()));
        loop {
            tokio::select! {
                d = self.rx.recv() => return d.unwrap_or(Decision::Terminate),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    if self.cancel.is_cancelled() {
                        return Decision::Terminate;
                    }
                }
            }
        }
    }
}

enum Job {
    Run(RunRequest),
    Fork(ForkJob),
}

struct ForkJob {
    spec: ForkSpec,
    /// The Run tab's configuration: its approval gate applies; the rest is the original's
    /// (the fork re-runs what the original ran).
    config: EpisodeConfig,
    autonomy: Autonomy,
}

fn start_run(ctx: &mut Ctx, job: Job) {
    let tx = ctx.tx.clone();
    let loaded = ctx.model.lock().ok().and_then(|s| s.clone());
    let Some((model, profile)) = loaded else {
        send(&tx, Msg::Notice(Level::Warn, "no model loaded".into()));
        return;
    };
    ctx.run_cancel = CancelToken::new();
    let cancel = ctx.run_cancel.clone();
    let (dtx, drx) = unbounded_channel();
    ctx.decisions = Some(dtx);
    let mcp = ctx.mcp.clone();
    let sessions_dir = ctx.sessions_dir.clone();
    // The engine's driver future is not `Send` (it borrows trait objects across awaits), so
    // each episode runs on its own thread with a current-thread runtime; its UI events are
    // forwarded through the main runtime.
    let handle = tokio::runtime::Handle::current();
    let (uitx, mut uirx) = unbounded_channel::<DriverEvent>();
    let t0 = Instant::now();
    let fwd_tx = tx.clone();
    let forward = handle.spawn(async move {
        while let Some(event) = uirx.recv().await {
            send(
                &fwd_tx,
                Msg::Driver {
                    event,
                    at_s: t0.elapsed().as_secs_f64(),
                },
            );
        }
    });
    std::thread::spawn(move || {
        let (autonomy, session) = match &job {
            Job::Run(r) => (r.autonomy, r.session.clone()),
            Job::Fork(f) => (f.autonomy, fork_path(&f.spec.session)),
        };
        let mut approver = DialogApprover {
            autonomy,
            tx: tx.clone(),
            rx: drx,
            cancel: cancel.clone(),
        };
        let _ = std::fs::create_dir_all(&sessions_dir);
        let out = session.clone();
        let episode = async {
            match job {
                Job::Run(req) => {
                    run_request(
                        &model,
                        profile.as_ref(),
                        req,
                        mcp,
                        &mut approver,
                        uitx,
                        cancel,
                    )
                    .await
                }
                Job::Fork(f) => {
                    let req = ForkRequest {
                        session: f.spec.session.clone(),
                        at_event: f.spec.at_event.clone(),
                        edit: f.spec.edit.map(|(event_id, tool, content)| {
                            if tool {
                                ForkEdit::ToolResult { event_id, content }
                            } else {
                                ForkEdit::ActorMessage { event_id, content }
                            }
                        }),
                    };
                    let config = match crate::session::read_session(&req.session) {
                        Ok(original) => fork_config(&original.header, &f.config)
                            .map_err(|e| format!("{}: line 1: {e}", req.session.display()))?,
                        Err(e) => return Err(e.to_string()),
                    };
                    let policy = Policy {
                        model: &model,
                        profile: profile.as_ref(),
                    };
                    run_fork(
                        policy,
                        &req,
                        &config,
                        &out,
                        &mut approver,
                        Some(uitx),
                        cancel,
                    )
                    .await
                    .map(|o| o.reward())
                    .map_err(|e| e.to_string())
                }
            }
        };
        let result = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(episode),
            Err(e) => {
                drop(episode);
                Err(format!("starting the episode runtime: {e}"))
            }
        };
        // Deliver every streamed event before the result.
        let _ = handle.block_on(forward);
        match &result {
            Ok(r) => tracing::info!(session = %session.display(), reward = r, "episode finished"),
            Err(e) => tracing::error!(session = %session.display(), error = %e, "episode failed"),
        }
        send(&tx, Msg::RunFinished { session, result });
    });
}

/// A fork's configuration: the original's recorded one, with the Run tab's approval gate
/// (who is asked is the person at the TUI, not the original's headless policy).
fn fork_config(
    original: &crate::session::SessionHeader,
    tab: &EpisodeConfig,
) -> Result<EpisodeConfig, crate::engine::episode::ConfigError> {
    let gate = tab.mode.live().map(|l| l.approval).unwrap_or_default();
    let mut config = recorded_config(original, tab)?.with_gate(gate);
    config.approve = tab.approve;
    Ok(config)
}

async fn run_request(
    model: &SharedModel,
    profile: Option<&PromptProfile>,
    req: RunRequest,
    mcp: Option<McpServerConfig>,
    approver: &mut DialogApprover,
    ui: UnboundedSender<DriverEvent>,
    cancel: CancelToken,
) -> Result<f64, String> {
    let e = |e: RunError| e.to_string();
    let policy = Policy { model, profile };
    let config = &req.config;
    match &req.env {
        RunEnv::Domain(name) => {
            let domain = Domain::from_name(name).map_err(|e| e.to_string())?;
            let (spec, task_id, mut env) = match (&req.instruction, &req.task_id) {
                (Some(instr), _) => (
                    EpisodeSpec {
                        task_id: None,
                        system: domain_system(domain),
                        user_turns: vec![instr.clone()],
                        tools: domain.tools(),
                        examples: Vec::new(),
                    },
                    None,
                    DomainEnv::new(domain),
                ),
                (None, Some(id)) => {
                    let task = find_builtin(id).ok_or_else(|| format!("unknown task `{id}`"))?;
                    (
                        task_spec(task, false).map_err(|e| e.to_string())?,
                        Some(task.id.clone()),
                        DomainEnv::with_tasks(domain, vec![task.clone()]),
                    )
                }
                (None, None) => return Err("choose a task or type an instruction".into()),
            };
            let head = header(policy, domain.name(), task_id.clone(), config)
                .map_err(|e| e.to_string())?;
            let mut writer =
                SessionWriter::create(&req.session, &head).map_err(|e| e.to_string())?;
            let io = EpisodeIo {
                env: EpisodeEnv::Domain(&mut env),
                sink: &mut writer,
                approver,
                ui: Some(ui),
                cancel,
            };
            let o = launch(policy, Episode::new(spec, task_id), config, io)
                .await
                .map_err(e)?;
            Ok(o.reward())
        }
        RunEnv::Mcp(_) => {
            let cfg_mcp = mcp.ok_or("no MCP server configured")?;
            let instr = req.instruction.clone().ok_or("type an instruction first")?;
            let mut env = McpEnv::connect(cfg_mcp).await.map_err(|e| e.to_string())?;
            let tools = env.tools().await.map_err(|e| e.to_string())?;
            let name = env.name();
            let spec = EpisodeSpec {
                task_id: None,
                system: crate::engine::spec::mcp_system(&name),
                user_turns: vec![instr],
                tools,
                examples: Vec::new(),
            };
            let head = header(policy, &name, None, config).map_err(|e| e.to_string())?;
            let mut writer =
                SessionWriter::create(&req.session, &head).map_err(|e| e.to_string())?;
            let io = EpisodeIo {
                env: EpisodeEnv::External(&mut env),
                sink: &mut writer,
                approver,
                ui: Some(ui),
                cancel,
            };
            let o = launch(policy, Episode::new(spec, None), config, io)
                .await
                .map_err(e);
            let _ = env.close().await;
            Ok(o?.reward())
        }
    }
}
