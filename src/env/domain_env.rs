//! [`DomainEnv`]: a built-in domain behind the [`Environment`] trait. It holds one live state
//! (reset from a task), executes calls on it, and scores episodes by replaying on fresh copies,
//! so scoring never disturbs the live state the episode observed.

use async_trait::async_trait;
use serde_json::Value;

use crate::env::domains::Domain;
use crate::env::reward::{score_task, state_hash};
use crate::env::tasks::{GoldTurnTrace, Task, builtin_tasks};
use crate::env::{EnvError, Environment, EpisodeTrace, Score, ToolResponse, ToolSpec};
use crate::message::ToolCall;

/// A built-in domain as an environment.
#[derive(Debug, Clone)]
pub struct DomainEnv {
    domain: Domain,
    /// User-supplied tasks; `None`: the built-in ones.
    tasks: Option<Vec<Task>>,
    task: Option<Task>,
    state: Value,
}

impl DomainEnv {
    /// A domain with its built-in tasks, reset to a demo state (the first train task's).
    pub fn new(domain: Domain) -> Self {
        Self {
            domain,
            tasks: None,
            task: None,
            state: demo_state(domain),
        }
    }

    /// A domain with the given tasks instead of the built-in ones.
    pub fn with_tasks(domain: Domain, tasks: Vec<Task>) -> Self {
        Self {
            tasks: Some(tasks),
            ..Self::new(domain)
        }
    }

    pub fn domain(&self) -> Domain {
        self.domain
    }

    /// The task the environment was last reset to.
    pub fn task(&self) -> Option<&Task> {
        self.task.as_ref()
    }

    /// The tasks this environment can be reset to.
    pub fn tasks(&self) -> &[Task] {
        match &self.tasks {
            Some(t) => t,
            None => builtin_tasks(self.domain),
        }
    }

    /// Reset to a task given by value (it need not be in [`Self::tasks`]).
    pub fn reset_to(&mut self, task: Task) -> Result<(), EnvError> {
        if task.domain != self.domain.name() {
            return Err(EnvError::Other(format!(
                "task {} is for domain {}, not {}",
                task.id, task.domain, self.domain
            )));
        }
        self.state = task.initial_state.clone();
        self.task = Some(task);
        Ok(())
    }

    /// Synchronous call (the domains never wait on anything).
    pub fn call_sync(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        self.domain.apply(&mut self.state, call)
    }

    pub fn state(&self) -> &Value {
        &self.state
    }
}

fn demo_state(domain: Domain) -> Value {
    builtin_tasks(domain)
        .first()
        .map_or(Value::Null, |t| t.initial_state.clone())
}

#[async_trait]
impl Environment for DomainEnv {
    fn name(&self) -> String {
        self.domain.name().to_string()
    }

    async fn tools(&mut self) -> Result<Vec<ToolSpec>, EnvError> {
        Ok(self.domain.tools())
    }

    async fn reset(&mut self, task_id: Option<&str>) -> Result<(), EnvError> {
        match task_id {
            None => {
                self.task = None;
                self.state = demo_state(self.domain);
                Ok(())
            }
            Some(id) => {
                let task = self
                    .tasks()
                    .iter()
                    .find(|t| t.id == id)
                    .cloned()
                    .ok_or_else(|| EnvError::UnknownTask(id.to_string()))?;
                self.reset_to(task)
            }
        }
    }

    async fn call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        self.call_sync(call)
    }

    async fn snapshot(&mut self) -> Result<Value, EnvError> {
        Ok(self.state.clone())
    }

    async fn state_hash(&mut self) -> Result<String, EnvError> {
        Ok(state_hash(&self.state))
    }

    async fn score(&mut self, trace: &EpisodeTrace) -> Result<Score, EnvError> {
        let task = self
            .task
            .as_ref()
            .ok_or_else(|| EnvError::Other("no task: reset to a task before scoring".into()))?;
        score_task(task, trace)
    }

    fn user_turns(&self) -> Vec<String> {
        self.task.as_ref().map(Task::user_turns).unwrap_or_default()
    }

    fn gold_trajectory(&self) -> Result<Option<Vec<GoldTurnTrace>>, EnvError> {
        match &self.task {
            Some(t) => t.gold_trajectory().map(Some),
            None => Ok(None),
        }
    }
}
