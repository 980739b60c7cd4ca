//! The one episode configuration: everything a person (or a trainer) chooses about how an
//! episode runs — how the world answers, Private Rehearsal, the approval gate and who answers
//! it headless, seed, turn limit, temperatures, what happens when the simulator fails.
//!
//! clap (`envace run/eval/fork`), the TUI's Run form and GRPO rollouts all build an
//! [`EpisodeConfig`] (the CLI and the form parse the same value names: an unknown value is an
//! error, never a default); [`EpisodeConfig::validate`] refuses what the engine cannot run,
//! naming the field; [`EpisodeConfig::engine_config`] is the single place where it becomes the
//! engine's [`EngineConfig`] (adding what the model's prompt profile decides). The session
//! header stores it whole (`episode`), so fork and replay re-run exactly what the original ran;
//! for version-1 files, which lack it, [`EpisodeConfig::from_engine`] recovers it from the
//! recorded engine configuration (all but the headless approval policy, which was not recorded).

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::driver::ApprovalPolicy;
use super::profile::PromptProfile;
use super::types::{
    ApprovalGate, EngineConfig, LiveOptions, MemorySelection, Mode, PrivateRehearsal,
    RehearsalDepth, SimFailurePolicy,
};

/// How the world answers (the mode's name, without its options).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ModeChoice {
    Real,
    Rehearse,
    Shadow,
}

impl ModeChoice {
    pub fn name(self) -> &'static str {
        match self {
            Self::Real => "real",
            Self::Rehearse => "rehearse",
            Self::Shadow => "shadow",
        }
    }
}

/// A configuration the engine cannot run; names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("private rehearsal needs a real environment: use --mode real or --mode shadow")]
    RehearsalWithoutEnvironment,
    #[error("{field}: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
    #[error("{field}: unknown value `{value}` (expected {expected})")]
    UnknownValue {
        field: &'static str,
        value: String,
        expected: String,
    },
}

fn invalid(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        problem: problem.into(),
    }
}

/// Parse a value of a [`clap::ValueEnum`] by its command-line name: the rule the CLI and the
/// TUI form share.
pub fn parse_value<T: clap::ValueEnum>(field: &'static str, s: &str) -> Result<T, ConfigError> {
    T::from_str(s, false).map_err(|_| ConfigError::UnknownValue {
        field,
        value: s.to_string(),
        expected: T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// How one episode runs. Serialised whole into the session header's `episode` field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeConfig {
    /// How the world answers; the live modes carry the approval gate and Private Rehearsal
    /// (which cannot exist in rehearse mode).
    pub mode: Mode,
    /// How a headless run answers the approval gate (the TUI asks a person instead).
    pub approve: ApprovalPolicy,
    /// Base seed of every sampler of the episode.
    pub seed: u64,
    /// Maximum actor turns on the main line.
    pub max_turns: u32,
    /// Actor sampling temperature (0 = greedy).
    pub actor_temperature: f64,
    /// Simulator sampling temperature (main-line simulations; Private Rehearsal has its own).
    pub simulator_temperature: f64,
    /// What happens when the simulator's output does not parse or it rejects the call.
    pub sim_failure: SimFailurePolicy,
    /// Rehearse mode: calls that exactly match a recorded example get the recorded response.
    pub recall_recorded: bool,
    /// The actor's tool-call names can only be listed tools (constrained decoding). Written
    /// only when on: a header without it is an episode that did not constrain.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub constrain_tool_names: bool,
}

impl Default for EpisodeConfig {
    fn default() -> Self {
        Self::new(ModeChoice::Real)
    }
}

impl EpisodeConfig {
    /// The defaults in `mode` (no Private Rehearsal, irreversible calls gated, approved headless).
    pub fn new(mode: ModeChoice) -> Self {
        let engine = EngineConfig::default();
        Self {
            mode: match mode {
                ModeChoice::Real => Mode::Real(LiveOptions::default()),
                ModeChoice::Shadow => Mode::Shadow(LiveOptions::default()),
                ModeChoice::Rehearse => Mode::Rehearse,
            },
            approve: ApprovalPolicy::Always,
            seed: 0,
            max_turns: 8,
            actor_temperature: engine.actor_sampling.temperature,
            simulator_temperature: engine.simulator_sampling.temperature,
            sim_failure: engine.sim_failure,
            recall_recorded: engine.recall_recorded,
            constrain_tool_names: engine.constrain_tool_names,
        }
    }

    pub fn mode_choice(&self) -> ModeChoice {
        match self.mode {
            Mode::Real(_) => ModeChoice::Real,
            Mode::Shadow(_) => ModeChoice::Shadow,
            Mode::Rehearse => ModeChoice::Rehearse,
        }
    }

    /// Private Rehearsal, if on.
    pub fn rehearsal(&self) -> Option<&PrivateRehearsal> {
        self.mode.live().and_then(|l| l.private_rehearsal.as_ref())
    }

    /// Turn Private Rehearsal on (`Some`) or off; refused in rehearse mode.
    pub fn with_rehearsal(mut self, pr: Option<PrivateRehearsal>) -> Result<Self, ConfigError> {
        match &mut self.mode {
            Mode::Real(l) | Mode::Shadow(l) => l.private_rehearsal = pr,
            Mode::Rehearse if pr.is_some() => return Err(ConfigError::RehearsalWithoutEnvironment),
            Mode::Rehearse => {}
        }
        Ok(self)
    }

    /// Which real calls pass the approval gate (live modes; rehearse mode has no real calls).
    pub fn with_gate(mut self, gate: ApprovalGate) -> Self {
        if let Mode::Real(l) | Mode::Shadow(l) = &mut self.mode {
            l.approval = gate;
        }
        self
    }

    /// Refuse what the engine cannot run, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let temp = |field: &'static str, t: f64| {
            if t.is_finite() && t >= 0.0 {
                Ok(())
            } else {
                Err(invalid(field, format!("{t} is not a temperature ≥ 0")))
            }
        };
        if self.max_turns == 0 {
            return Err(invalid("max_turns", "must be ≥ 1"));
        }
        temp("actor_temperature", self.actor_temperature)?;
        temp("simulator_temperature", self.simulator_temperature)?;
        if let Some(pr) = self.rehearsal() {
            if pr.branches == 0 {
                return Err(invalid(
                    "rehearsal.branches",
                    "must be ≥ 1 (no rehearsal: leave it off)",
                ));
            }
            if let RehearsalDepth::Turns(0) = pr.depth {
                return Err(invalid("rehearsal.depth", "must be ≥ 1 turn or `end`"));
            }
            temp("rehearsal.temperature", pr.sampling.temperature)?;
            if let Some(x) = pr.explore_temperature {
                temp("rehearsal.explore_temperature", x)?;
            }
            if let MemorySelection::SuccessFirst(0) | MemorySelection::FailuresOnly(0) =
                pr.memory.selection
            {
                return Err(invalid("rehearsal.memory.selection", "K must be ≥ 1"));
            }
        }
        Ok(())
    }

    /// The engine configuration: this episode's choices plus what the model's prompt profile
    /// decides (simulator prompt form, actor thinking), every sampler seeded from `seed`.
    pub fn engine_config(
        &self,
        profile: Option<&PromptProfile>,
    ) -> Result<EngineConfig, ConfigError> {
        self.validate()?;
        let mut cfg = EngineConfig {
            mode: self.mode.clone(),
            max_turns: self.max_turns,
            sim_failure: self.sim_failure,
            recall_recorded: self.recall_recorded,
            constrain_tool_names: self.constrain_tool_names,
            ..EngineConfig::default()
        };
        cfg.actor_sampling.temperature = self.actor_temperature;
        cfg.simulator_sampling.temperature = self.simulator_temperature;
        if let Some(p) = profile {
            cfg.sim_prompt = p.sim_prompt.clone();
            cfg.actor_thinking = p.actor_thinking;
        }
        Ok(cfg.with_seed(self.seed))
    }

    /// The episode configuration an engine configuration was built from (version-1 session
    /// headers recorded only the engine's): exact but for `approve`, which the engine does not
    /// know and which is taken from the caller.
    pub fn from_engine(cfg: &EngineConfig, approve: ApprovalPolicy) -> Self {
        Self {
            mode: cfg.mode.clone(),
            approve,
            seed: cfg.actor_sampling.seed,
            max_turns: cfg.max_turns,
            actor_temperature: cfg.actor_sampling.temperature,
            simulator_temperature: cfg.simulator_sampling.temperature,
            sim_failure: cfg.sim_failure,
            recall_recorded: cfg.recall_recorded,
            constrain_tool_names: cfg.constrain_tool_names,
        }
    }
}

/// `all`, `success-first:K` or `failures-only:K` (`--memory-select`).
impl FromStr for MemorySelection {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let k = |n: &str| {
            n.parse::<usize>()
                .ok()
                .filter(|k| *k > 0)
                .ok_or_else(|| invalid("memory selection", format!("`{n}` is not a count ≥ 1")))
        };
        match s.split_once(':') {
            None if s == "all" => Ok(Self::All),
            Some(("success-first", n)) => Ok(Self::SuccessFirst(k(n)?)),
            Some(("failures-only", n)) => Ok(Self::FailuresOnly(k(n)?)),
            _ => Err(ConfigError::UnknownValue {
                field: "memory selection",
                value: s.to_string(),
                expected: "all, success-first:K or failures-only:K".into(),
            }),
        }
    }
}

/// A number of imagined actor turns (≥ 1) or `end` (`--rehearsal-depth`).
impl FromStr for RehearsalDepth {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "end" => Ok(Self::ToEnd),
            n => n
                .parse::<u32>()
                .ok()
                .filter(|d| *d > 0)
                .map(Self::Turns)
                .ok_or_else(|| ConfigError::UnknownValue {
                    field: "rehearsal depth",
                    value: n.to_string(),
                    expected: "a number ≥ 1 or `end`".into(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::types::{RehearsalStrategy, RehearsalTrigger};

    #[test]
    fn unknown_values_are_errors_naming_the_field_and_the_choices() {
        let e = parse_value::<ModeChoice>("mode", "shdow").unwrap_err();
        assert_eq!(
            e.to_string(),
            "mode: unknown value `shdow` (expected real, rehearse, shadow)"
        );
        assert_eq!(
            parse_value::<RehearsalTrigger>("trigger", "every").unwrap(),
            RehearsalTrigger::EveryCall
        );
        assert!("success-first:0".parse::<MemorySelection>().is_err());
        assert_eq!(
            "failures-only:3".parse::<MemorySelection>().unwrap(),
            MemorySelection::FailuresOnly(3)
        );
        assert!("0".parse::<RehearsalDepth>().is_err());
        assert_eq!(
            "end".parse::<RehearsalDepth>().unwrap(),
            RehearsalDepth::ToEnd
        );
    }

    #[test]
    fn rehearsal_in_rehearse_mode_is_unrepresentable_through_the_builder() {
        let e = EpisodeConfig::new(ModeChoice::Rehearse)
            .with_rehearsal(Some(PrivateRehearsal::default()))
            .unwrap_err();
        assert_eq!(e, ConfigError::RehearsalWithoutEnvironment);
    }

    #[test]
    fn validate_names_the_field() {
        let mut c = EpisodeConfig::new(ModeChoice::Shadow)
            .with_rehearsal(Some(PrivateRehearsal {
                branches: 0,
                ..PrivateRehearsal::default()
            }))
            .unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("rehearsal.branches")
        );
        c = c.with_rehearsal(None).unwrap();
        c.actor_temperature = f64::NAN;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("actor_temperature")
        );
    }

    #[test]
    fn engine_config_round_trips_through_from_engine() {
        let c = EpisodeConfig {
            seed: 7,
            max_turns: 5,
            actor_temperature: 0.7,
            simulator_temperature: 0.4,
            sim_failure: SimFailurePolicy::ShowErrorToActor,
            recall_recorded: false,
            approve: ApprovalPolicy::Auto,
            ..EpisodeConfig::new(ModeChoice::Real)
        }
        .with_gate(ApprovalGate::EveryCall)
        .with_rehearsal(Some(PrivateRehearsal {
            branches: 3,
            strategy: RehearsalStrategy::Sequential,
            explore_temperature: Some(0.9),
            ..PrivateRehearsal::default()
        }))
        .unwrap();
        let engine = c.engine_config(None).unwrap();
        let mut back = EpisodeConfig::from_engine(&engine, ApprovalPolicy::Auto);
        // The engine seeds the rehearsal sampler too; the episode config does not carry it.
        if let Mode::Real(l) = &mut back.mode
            && let Some(pr) = &mut l.private_rehearsal
        {
            pr.sampling.seed = 0;
        }
        assert_eq!(back, c);
    }
}
