//! The tokio driver: runs the pure engine's effects and feeds the results back. Generations go
//! to the `LanguageModel` on a blocking thread (the runtime is blocking by design), real calls
//! to the `Environment`, approvals to an [`ApprovalHook`], persisted events to an
//! [`EventSink`] (a session file, or memory for rollouts); streamed text and persisted events
//! are also sent to an optional UI channel.
//!
//! The environment is passed as [`EnvAccess`]: real and shadow modes get the live environment;
//! rehearse mode gets only a *verifier* (a fresh copy) that is touched after the episode, to
//! replay the committed actions and score them, and never feeds anything back. A rehearse-mode
//! driver therefore holds no live environment at all.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use super::fsm::{
    ApprovalRequest, Effect, Engine, EpisodeOutcome, Event, GenerateRequest, RequestId,
};
use super::types::{Decision, GenRole, Mode, ScoredBy};
use crate::env::{Environment, EpisodeTrace, Score};
use crate::runtime::{CancelToken, ChatPrompt, Generation, LanguageModel};
use crate::session::{EventRecord, EventSink, SessionError};

/// A model shared between the driver and its blocking generation threads.
pub type SharedModel = Arc<Mutex<Box<dyn LanguageModel>>>;

/// Wrap a model for the driver.
pub fn share_model(model: Box<dyn LanguageModel>) -> SharedModel {
    Arc::new(Mutex::new(model))
}

/// Which environment the driver may touch.
pub enum EnvAccess<'a> {
    /// Real and shadow modes: the live environment, already reset to the task.
    Live(&'a mut dyn Environment),
    /// Rehearse mode: a fresh verifier copy, used only after the episode (reset to `task_id`,
    /// replay the committed actions, score).
    VerifyAfter {
        verifier: &'a mut dyn Environment,
        task_id: Option<String>,
    },
    /// Rehearse mode with nothing to verify on (an MCP server has no fresh copy; replaying
    /// there would execute the calls): the episode ends without a score.
    Unscored,
}

/// Answers approval requests for irreversible real calls (the TUI implements it too).
#[async_trait]
pub trait ApprovalHook: Send {
    async fn decide(&mut self, request: &ApprovalRequest) -> Decision;
}

/// Headless approval policies (`--approve always|never|auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalPolicy {
    /// Approve every gated call.
    Always,
    /// Reject every gated call (the actor is told, and continues).
    Never,
    /// Approve reversible calls; approve an irreversible call only when Private Rehearsal ran
    /// before it and fewer than half of its branches predicted failure; otherwise reject.
    Auto,
}

/// An [`ApprovalHook`] that applies an [`ApprovalPolicy`] without asking anyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyApprover(pub ApprovalPolicy);

impl PolicyApprover {
    /// The decision the policy takes (pure, for tests and the TUI's default button).
    pub fn decision(&self, request: &ApprovalRequest) -> Decision {
        match self.0 {
            ApprovalPolicy::Always => Decision::Approve,
            ApprovalPolicy::Never => Decision::Reject {
                reason: "approval policy is `never`".into(),
            },
            ApprovalPolicy::Auto => {
                if !request.irreversible {
                    return Decision::Approve;
                }
                match request.rehearsal {
                    Some(v) if v.predicted_failure * 2 < v.branches => Decision::Approve,
                    Some(_) => Decision::Reject {
                        reason: "rehearsal predicted this irreversible call would fail".into(),
                    },
                    None => Decision::Reject {
                        reason: "irreversible call without a rehearsal (approval policy `auto`)"
                            .into(),
                    },
                }
            }
        }
    }
}

#[async_trait]
impl ApprovalHook for PolicyApprover {
    async fn decide(&mut self, request: &ApprovalRequest) -> Decision {
        self.decision(request)
    }
}

/// What the driver tells a UI while it runs.
#[derive(Debug, Clone, PartialEq)]
pub enum DriverEvent {
    /// New text of a running generation (`index` = which of its `n` continuations).
    Text {
        request: RequestId,
        role: GenRole,
        branch: Option<usize>,
        index: usize,
        text: String,
    },
    /// An event was persisted.
    Persisted(EventRecord),
    /// The approval hook is being asked.
    AwaitingApproval(ApprovalRequest),
    Finished(EpisodeOutcome),
}

/// Failures of the driver itself (model and environment failures end the episode instead, as
/// `EndReason::Failed`, and are recorded).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("mode `{mode}` needs {needs}")]
    ModeMismatch { mode: String, needs: &'static str },
    #[error("writing the session: {0}")]
    Session(#[from] SessionError),
    #[error("internal: the engine asked for a real call without a live environment")]
    RealCallWithoutEnvironment,
    #[error("internal: the engine stopped without finishing the episode")]
    Stalled,
}

/// Runs one engine's effects.
pub struct Driver<'a> {
    pub model: SharedModel,
    pub env: EnvAccess<'a>,
    pub approver: &'a mut dyn ApprovalHook,
    pub sink: &'a mut dyn EventSink,
    pub ui: Option<UnboundedSender<DriverEvent>>,
    pub cancel: CancelToken,
}

impl Driver<'_> {
    /// Run the episode to its end. Cancelling `self.cancel` ends it as `Cancelled` (the
    /// running generation is cancelled through the same token).
    pub async fn run(&mut self, engine: &mut Engine) -> Result<EpisodeOutcome, DriverError> {
        self.check_mode(&engine.config().mode)?;
        let mut queue: VecDeque<Effect> = engine.handle(Event::Start).into();
        let mut cancel_fed = false;
        while let Some(effect) = queue.pop_front() {
            let acts = !matches!(effect, Effect::Persist(_) | Effect::Finish(_));
            if acts && !cancel_fed && self.cancel.is_cancelled() {
                cancel_fed = true;
                queue.retain(|e| matches!(e, Effect::Persist(_)));
                queue.extend(engine.handle(Event::Cancel));
                continue;
            }
            let event = match effect {
                Effect::Persist(ev) => {
                    let rec = self.sink.persist(ev)?;
                    self.send(DriverEvent::Persisted(rec));
                    continue;
                }
                Effect::Finish(outcome) => {
                    self.send(DriverEvent::Finished(outcome.clone()));
                    return Ok(outcome);
                }
                Effect::Generate(req) => self.generate(req).await,
                Effect::ExecuteReal { id, call, .. } => match &mut self.env {
                    EnvAccess::Live(env) => match env.call(&call).await {
                        Ok(response) => Event::RealResult { id, response },
                        Err(e) => Event::Error {
                            id: Some(id),
                            message: format!("environment: {e}"),
                        },
                    },
                    EnvAccess::VerifyAfter { .. } | EnvAccess::Unscored => {
                        return Err(DriverError::RealCallWithoutEnvironment);
                    }
                },
                Effect::AskApproval(req) => {
                    self.send(DriverEvent::AwaitingApproval(req.clone()));
                    let decision = self.approver.decide(&req).await;
                    Event::ApprovalDecision {
                        id: req.id,
                        decision,
                    }
                }
                Effect::Score { id, trace, by } => match self.score(&trace, by).await {
                    Ok(score) => Event::Scored { id, score },
                    Err(message) => Event::Error {
                        id: Some(id),
                        message,
                    },
                },
            };
            queue.extend(engine.handle(event));
        }
        Err(DriverError::Stalled)
    }

    fn check_mode(&self, mode: &Mode) -> Result<(), DriverError> {
        match (mode, &self.env) {
            (Mode::Rehearse, EnvAccess::VerifyAfter { .. } | EnvAccess::Unscored) => Ok(()),
            (Mode::Real(_) | Mode::Shadow(_), EnvAccess::Live(_)) => Ok(()),
            (Mode::Rehearse, EnvAccess::Live(_)) => Err(DriverError::ModeMismatch {
                mode: mode.name().into(),
                needs: "a verifier environment (EnvAccess::VerifyAfter), never the live one",
            }),
            (_, EnvAccess::VerifyAfter { .. } | EnvAccess::Unscored) => {
                Err(DriverError::ModeMismatch {
                    mode: mode.name().into(),
                    needs: "the live environment (EnvAccess::Live)",
                })
            }
        }
    }

    fn send(&self, event: DriverEvent) {
        if let Some(tx) = &self.ui {
            // A closed UI channel must not stop the episode.
            let _ = tx.send(event);
        }
    }

    async fn generate(&self, req: GenerateRequest) -> Event {
        let id = req.id;
        let model = Arc::clone(&self.model);
        let cancel = self.cancel.clone();
        let ui = self.ui.clone();
        let result = tokio::task::spawn_blocking(move || run_generation(&model, &req, ui, &cancel))
            .await
            .unwrap_or_else(|e| Err(format!("generation thread failed: {e}")));
        match result {
            Ok(_) if self.cancel.is_cancelled() => Event::Cancel,
            Ok(generations) => Event::GenerationDone { id, generations },
            Err(message) => Event::Error {
                id: Some(id),
                message,
            },
        }
    }

    async fn score(&mut self, trace: &EpisodeTrace, by: ScoredBy) -> Result<Score, String> {
        match (&mut self.env, by) {
            (EnvAccess::Live(env), ScoredBy::Environment) => {
                env.score(trace).await.map_err(|e| format!("scoring: {e}"))
            }
            (EnvAccess::VerifyAfter { verifier, task_id }, ScoredBy::Verifier) => {
                verifier
                    .reset(task_id.as_deref())
                    .await
                    .map_err(|e| format!("verifier reset: {e}"))?;
                for action in &trace.actions {
                    // Responses are discarded: nothing flows back into the episode.
                    verifier
                        .call(action)
                        .await
                        .map_err(|e| format!("verifier replay of `{}`: {e}", action.name))?;
                }
                verifier
                    .score(trace)
                    .await
                    .map_err(|e| format!("verifier scoring: {e}"))
            }
            (EnvAccess::Unscored, _) => {
                Err("not scored: rehearse mode without a verifier environment".into())
            }
            (_, by) => Err(format!(
                "internal: cannot score by {by:?} with this environment access"
            )),
        }
    }
}

/// Generate on the calling (blocking) thread (a local model renders and encodes the chat; a
/// chat-completions server gets the messages).
fn run_generation(
    model: &SharedModel,
    req: &GenerateRequest,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: &CancelToken,
) -> Result<Vec<Generation>, String> {
    let mut m = model
        .lock()
        .map_err(|_| "the model lock is poisoned (an earlier generation panicked)".to_string())?;
    let chat = ChatPrompt {
        messages: &req.messages,
        tools: &req.tools,
        enable_thinking: req.enable_thinking,
    };
    let (request, role, branch) = (req.id, req.role, req.branch);
    let mut stream = |index: usize, text: &str| {
        if let Some(tx) = &ui {
            let _ = tx.send(DriverEvent::Text {
                request,
                role,
                branch,
                index,
                text: text.to_string(),
            });
        }
    };
    m.generate_chat(&chat, req.n, &req.sampling, Some(&mut stream), cancel)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
