//! The engine's part of `envace bench generate`: `rehearsal_ms`, the wall time of one Private
//! Rehearsal (N=4 parallel branches, depth 2) in a real episode of a built-in task, timed at
//! the event sink from the rehearsal's start to its memory (the branches are generated, and
//! their simulated calls answered, between the two). The runtime's bench cannot do this
//! itself: the engine sits above the runtime.

use std::time::Instant;

use crate::engine::driver::{ApprovalPolicy, PolicyApprover};
use crate::engine::episode::{EpisodeConfig, ModeChoice};
use crate::engine::runner::{Episode, EpisodeEnv, EpisodeIo, Policy, RunError, launch};
use crate::engine::spec::task_spec;
use crate::engine::types::PrivateRehearsal;
use crate::env::domain_env::DomainEnv;
use crate::env::tasks::Task;
use crate::runtime::CancelToken;
use crate::session::schema::{EventBody, EventRecord, NewEvent};
use crate::session::{EventSink, MemorySink, SessionError};

/// Keeps the episode's events in memory and times the first rehearsal.
#[derive(Default)]
struct RehearsalTimer {
    events: MemorySink,
    started: Option<Instant>,
    ms: Option<f64>,
}

impl EventSink for RehearsalTimer {
    fn persist(&mut self, event: NewEvent) -> Result<EventRecord, SessionError> {
        match (&event.event, self.started, self.ms) {
            (EventBody::RehearsalStart { .. }, None, None) => self.started = Some(Instant::now()),
            (EventBody::RehearsalMemory { .. }, Some(t), None) => {
                self.ms = Some(t.elapsed().as_secs_f64() * 1e3);
            }
            _ => {}
        }
        self.events.persist(event)
    }
}

/// Play `task` once in real mode with the default Private Rehearsal before irreversible calls
/// (greedy actor, `seed`) and return the first rehearsal's wall time in milliseconds; `None`
/// when the episode ended without rehearsing (the model never proposed an irreversible call).
pub async fn rehearsal_ms(
    policy: Policy<'_>,
    task: &Task,
    seed: u64,
) -> Result<Option<f64>, RunError> {
    let mut config =
        EpisodeConfig::new(ModeChoice::Real).with_rehearsal(Some(PrivateRehearsal::default()))?;
    config.seed = seed;
    config.approve = ApprovalPolicy::Always;
    let domain = task.domain()?;
    let mut env = DomainEnv::with_tasks(domain, vec![task.clone()]);
    let mut timer = RehearsalTimer::default();
    let mut approver = PolicyApprover(config.approve);
    let io = EpisodeIo {
        env: EpisodeEnv::Domain(&mut env),
        sink: &mut timer,
        approver: &mut approver,
        ui: None,
        cancel: CancelToken::new(),
    };
    launch(
        policy,
        Episode::new(task_spec(task, false)?, Some(task.id.clone())),
        &config,
        io,
    )
    .await?;
    Ok(timer.ms)
}
