//! Private Rehearsal: before a triggering call runs, imagined branches (actor and simulator
//! only, never the real environment) play the episode forward; their summaries become a
//! memory the actor sees, and a commit rule may take a proposal without asking again.

use std::collections::VecDeque;

use super::calls::{CallsState, QueuedCall};
use super::{Engine, Pending, Phase, RehearsalVerdict, RequestId};
use crate::engine::parse::{ActorAction, ActorTurn, FormatEvent, SimOutput, parse_actor};
use crate::engine::prompts::simulator::SimulatorPromptInput;
use crate::engine::prompts::{
    actor_prompt, assistant_message, render_memory, simulator_prompt, tool_message,
};
use crate::engine::types::{
    BranchEnd, BranchStep, BranchSummary, CommitRule, EndReason, GenRole, Prediction,
    PrivateRehearsal, RehearsalDepth, RehearsalStrategy, SimulatedOutcome,
};
use crate::message::Message;
use crate::runtime::{Generation, SamplingParams};
use crate::session::schema::EventBody;

/// A rehearsal in progress (the data that stays fixed while branches run).
#[derive(Debug, Clone)]
pub(super) struct Rehearsal {
    cfg: PrivateRehearsal,
    start_id: String,
    /// The actor's proposed turn: the first step of branch 0.
    proposal: Option<(ActorTurn, Vec<String>)>,
    /// The same proposal, kept for [`CommitRule::DraftUnlessFailure`].
    draft: (ActorTurn, Vec<String>),
    /// Parallel mode: pre-generated first steps of branches 1…N-1.
    first_steps: VecDeque<(Pending, usize, Generation)>,
    /// Each branch's first actor turn, by branch index (for [`CommitRule::BestBranch`]).
    first_turns: Vec<(usize, ActorTurn, Vec<String>)>,
    done: Vec<BranchSummary>,
}

#[derive(Debug, Clone)]
pub(super) struct Branch {
    index: usize,
    tip: String,
    conv: Vec<Message>,
    next_user: usize,
    depth: u32,
    steps: Vec<BranchStep>,
    calls: Vec<QueuedCall>,
    next_call: usize,
    tool_errors: usize,
}

#[derive(Debug, Clone)]
pub(super) enum BranchWait {
    Actor { req: Pending },
    Simulator { req: Pending },
}

#[derive(Debug, Clone)]
pub(super) enum RehearsalWait {
    FirstSteps { req: Pending },
    Branch(Box<Branch>, BranchWait),
}

impl Engine {
    pub(super) fn start_rehearsal(&mut self, proposal: ActorTurn, ids: Vec<String>) {
        let Some(cfg) = self.rehearsal_cfg().cloned() else {
            return self.end(EndReason::Failed {
                message: "internal: rehearsal without configuration".into(),
            });
        };
        self.stats.rehearsals += 1;
        let n = cfg.branches.max(1);
        self.persist(EventBody::RehearsalStart {
            branches: n,
            strategy: cfg.strategy,
            trigger: cfg.trigger,
            depth: cfg.depth,
            proposed: proposal.calls().to_vec(),
        });
        let start_id = self.tip.clone().unwrap_or_default();
        let parallel_batch = cfg.strategy == RehearsalStrategy::Parallel && n > 1;
        let r = Box::new(Rehearsal {
            cfg,
            start_id,
            draft: (proposal.clone(), ids.clone()),
            proposal: Some((proposal, ids)),
            first_steps: VecDeque::new(),
            first_turns: Vec::new(),
            done: Vec::new(),
        });
        if parallel_batch {
            let prompt = actor_prompt(&self.conv, None, self.placement());
            let sampling = first_step_sampling(&r.cfg);
            let req = self.generate(GenRole::Actor, Some(1), None, prompt, sampling, n - 1);
            self.phase = Phase::Rehearsing(r, RehearsalWait::FirstSteps { req });
        } else {
            self.begin_branch(r, 0);
        }
    }

    fn memory_for(&self, r: &Rehearsal) -> Option<String> {
        (r.cfg.strategy == RehearsalStrategy::Sequential && !r.done.is_empty())
            .then(|| render_memory(&r.done, &r.cfg.memory))
    }

    fn begin_branch(&mut self, mut r: Box<Rehearsal>, index: usize) {
        let tip = self.emit(Some(r.start_id.clone()), EventBody::BranchStart { index });
        let mut b = Box::new(Branch {
            index,
            tip,
            conv: self.conv.clone(),
            next_user: self.next_user,
            depth: 0,
            steps: Vec::new(),
            calls: Vec::new(),
            next_call: 0,
            tool_errors: 0,
        });
        if index == 0
            && let Some((turn, ids)) = r.proposal.take()
        {
            return self.branch_step(r, b, turn, ids);
        }
        if r.cfg.strategy == RehearsalStrategy::Parallel {
            if let Some((req, i, g)) = r.first_steps.pop_front() {
                let (turn, ids) = self.record_branch_actor(&mut b, &req, i, &g);
                return self.branch_step(r, b, turn, ids);
            }
            // Fewer first steps came back than asked for: stop here.
            return self.finish_rehearsal(r);
        }
        self.branch_actor(r, b);
    }

    /// Ask for the branch's next actor turn.
    fn branch_actor(&mut self, r: Box<Rehearsal>, b: Box<Branch>) {
        let memory = self.memory_for(&r);
        let prompt = actor_prompt(&b.conv, memory.as_deref(), self.placement());
        let sampling = if b.depth == 0 {
            first_step_sampling(&r.cfg)
        } else {
            r.cfg.sampling.clone()
        };
        let req = self.generate(GenRole::Actor, Some(b.index), None, prompt, sampling, 1);
        self.phase = Phase::Rehearsing(r, RehearsalWait::Branch(b, BranchWait::Actor { req }));
    }

    fn record_branch_actor(
        &mut self,
        b: &mut Branch,
        req: &Pending,
        index: usize,
        g: &Generation,
    ) -> (ActorTurn, Vec<String>) {
        self.count_generation(GenRole::Actor, g);
        let mut body = Self::generation_body(GenRole::Actor, req, index, g);
        if let EventBody::Generation(rec) = &mut body {
            rec.branch = Some(b.index);
        }
        b.tip = self.emit(Some(b.tip.clone()), body);
        let turn = parse_actor(&g.text);
        let ids = self.new_call_ids(turn.calls().len());
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::ActorParsed {
                turn: turn.clone(),
                call_ids: ids.clone(),
            },
        );
        for e in &turn.events {
            b.tip = self.emit(
                Some(b.tip.clone()),
                EventBody::Format {
                    format: FormatEvent::Actor(e.clone()),
                },
            );
        }
        (turn, ids)
    }

    fn branch_message(&mut self, b: &mut Branch, message: Message) {
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::Message {
                message: message.clone(),
            },
        );
        b.conv.push(message);
    }

    /// May the branch take another actor turn?
    fn branch_may_continue(&self, r: &Rehearsal, b: &Branch) -> Option<BranchEnd> {
        if let RehearsalDepth::Turns(d) = r.cfg.depth
            && b.depth >= d
        {
            return Some(BranchEnd::DepthReached);
        }
        // The proposal already counted as a main-line turn.
        let used = self.turns.saturating_sub(1) + b.depth;
        (used >= self.cfg.max_turns).then_some(BranchEnd::TurnLimit)
    }

    fn branch_step(
        &mut self,
        mut r: Box<Rehearsal>,
        mut b: Box<Branch>,
        turn: ActorTurn,
        ids: Vec<String>,
    ) {
        if b.depth == 0 && r.cfg.memory.commit == CommitRule::BestBranch {
            r.first_turns.push((b.index, turn.clone(), ids.clone()));
        }
        b.depth += 1;
        match &turn.action {
            ActorAction::Malformed => self.end_branch(r, &b, BranchEnd::ActorFormatError),
            ActorAction::Answer => {
                self.branch_message(&mut b, assistant_message(&turn, &[]));
                match self.spec.user_turns.get(b.next_user).cloned() {
                    None => self.end_branch(
                        r,
                        &b,
                        BranchEnd::Answered {
                            text: turn.content.clone(),
                        },
                    ),
                    Some(next) => {
                        if let Some(end) = self.branch_may_continue(&r, &b) {
                            return self.end_branch(r, &b, end);
                        }
                        b.next_user += 1;
                        self.branch_message(&mut b, Message::user(next));
                        self.branch_actor(r, b);
                    }
                }
            }
            ActorAction::Calls { .. } => {
                let calls = self.queue(&turn, &ids);
                self.branch_message(&mut b, assistant_message(&turn, &ids));
                b.calls = calls;
                b.next_call = 0;
                self.branch_next_call(r, b);
            }
        }
    }

    fn branch_next_call(&mut self, r: Box<Rehearsal>, b: Box<Branch>) {
        let Some(q) = b.calls.get(b.next_call).cloned() else {
            if let Some(end) = self.branch_may_continue(&r, &b) {
                return self.end_branch(r, &b, end);
            }
            return self.branch_actor(r, b);
        };
        if r.cfg.recall_errors
            && let Some(value) = self.recalled_error(&q.call)
        {
            self.stats.rehearsal_recalls += 1;
            let outcome = SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            };
            return self.branch_outcome(r, b, q, outcome, None, true);
        }
        let prompt = simulator_prompt(
            &SimulatorPromptInput {
                tools: &self.spec.tools,
                examples: &self.examples,
                conversation: &b.conv,
                call: &q.call,
            },
            &self.cfg.sim_prompt,
        );
        let sampling = r.cfg.sampling.clone();
        let req = self.generate(
            GenRole::Simulator,
            Some(b.index),
            Some(q.id.clone()),
            prompt,
            sampling,
            1,
        );
        self.phase = Phase::Rehearsing(r, RehearsalWait::Branch(b, BranchWait::Simulator { req }));
    }

    pub(super) fn on_rehearsal_generation(
        &mut self,
        mut r: Box<Rehearsal>,
        wait: RehearsalWait,
        generations: Vec<Generation>,
    ) {
        match wait {
            RehearsalWait::FirstSteps { req } => {
                for (i, g) in generations.into_iter().enumerate() {
                    r.first_steps.push_back((req.clone(), i, g));
                }
                self.begin_branch(r, 0);
            }
            RehearsalWait::Branch(mut b, BranchWait::Actor { req }) => {
                let Some(g) = generations.into_iter().next() else {
                    return self.end(EndReason::Failed {
                        message: "the model returned no generation".into(),
                    });
                };
                let (turn, ids) = self.record_branch_actor(&mut b, &req, 0, &g);
                self.branch_step(r, b, turn, ids);
            }
            RehearsalWait::Branch(mut b, BranchWait::Simulator { req }) => {
                let Some(g) = generations.into_iter().next() else {
                    return self.end(EndReason::Failed {
                        message: "the model returned no generation".into(),
                    });
                };
                let Some(q) = b.calls.get(b.next_call).cloned() else {
                    return self.branch_actor(r, b);
                };
                self.count_generation(GenRole::Simulator, &g);
                b.tip = self.emit(
                    Some(b.tip.clone()),
                    Self::generation_body(GenRole::Simulator, &req, 0, &g),
                );
                let (outcome, think, tip) = self.simulated_outcome(&g, Some(b.tip.clone()));
                b.tip = tip.unwrap_or_default();
                self.branch_outcome(r, b, q, outcome, think, false);
            }
        }
    }

    /// Record a branch call's simulated (or recalled) outcome and go on.
    fn branch_outcome(
        &mut self,
        r: Box<Rehearsal>,
        mut b: Box<Branch>,
        q: QueuedCall,
        outcome: SimulatedOutcome,
        think: Option<String>,
        recalled: bool,
    ) {
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::Simulated {
                call_id: q.id.clone(),
                call: q.call.clone(),
                outcome: outcome.clone(),
                think,
                recalled,
            },
        );
        b.steps.push(BranchStep {
            call: q.call.clone(),
            outcome: outcome.clone(),
        });
        match outcome {
            SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            } => {
                if value.get("error").is_some() {
                    b.tool_errors += 1;
                }
                self.branch_message(&mut b, tool_message(&q.id, &q.call.name, &value));
                b.next_call += 1;
                self.branch_next_call(r, b);
            }
            SimulatedOutcome::Parsed {
                output: SimOutput::Rejected { code, message },
            } => self.end_branch(r, &b, BranchEnd::Rejected { code, message }),
            SimulatedOutcome::Unparseable { .. } => {
                self.end_branch(r, &b, BranchEnd::SimulatorFormatError)
            }
        }
    }

    fn end_branch(&mut self, mut r: Box<Rehearsal>, b: &Branch, end: BranchEnd) {
        let errors = b.tool_errors > 0;
        let prediction = match &end {
            BranchEnd::Answered { .. } if !errors => Prediction::Success,
            BranchEnd::DepthReached | BranchEnd::TurnLimit if !errors => Prediction::Unknown,
            BranchEnd::Answered { .. } | BranchEnd::DepthReached | BranchEnd::TurnLimit => {
                Prediction::Failure {
                    reason: "a tool returned an error".into(),
                }
            }
            BranchEnd::Rejected { code, .. } => Prediction::Failure {
                reason: format!("call rejected: {code}"),
            },
            BranchEnd::SimulatorFormatError => Prediction::Unknown,
            BranchEnd::ActorFormatError => Prediction::Failure {
                reason: "unparseable call".into(),
            },
        };
        let summary = BranchSummary {
            index: b.index,
            steps: b.steps.clone(),
            end,
            prediction,
        };
        self.emit(
            Some(b.tip.clone()),
            EventBody::BranchEnd {
                summary: summary.clone(),
            },
        );
        self.stats.rehearsal_branches += 1;
        r.done.push(summary);
        let next = b.index + 1;
        if next < r.cfg.branches {
            self.begin_branch(r, next)
        } else {
            self.finish_rehearsal(r)
        }
    }

    fn finish_rehearsal(&mut self, r: Box<Rehearsal>) {
        let text = render_memory(&r.done, &r.cfg.memory);
        let verdict = RehearsalVerdict {
            branches: r.done.len(),
            predicted_success: r
                .done
                .iter()
                .filter(|b| b.prediction == Prediction::Success)
                .count(),
            predicted_failure: r
                .done
                .iter()
                .filter(|b| matches!(b.prediction, Prediction::Failure { .. }))
                .count(),
        };
        let id = self.emit(
            Some(r.start_id.clone()),
            EventBody::RehearsalMemory {
                text: text.clone(),
                branches: r.done.iter().map(|b| b.index).collect(),
            },
        );
        self.tip = Some(id);
        let draft_failed = r
            .done
            .iter()
            .find(|b| b.index == 0)
            .is_none_or(|b| matches!(b.prediction, Prediction::Failure { .. }));
        let commit = match r.cfg.memory.commit {
            CommitRule::Reprompt => None,
            CommitRule::DraftUnlessFailure => (!draft_failed).then_some(r.draft),
            CommitRule::BestBranch if !draft_failed => Some(r.draft),
            CommitRule::BestBranch => {
                let draft_calls = r.draft.0.calls().to_vec();
                let succeeded = |i: usize| {
                    r.done
                        .iter()
                        .any(|b| b.index == i && b.prediction == Prediction::Success)
                };
                let alternative = r.first_turns.iter().find(|(i, turn, _)| {
                    *i != 0
                        && succeeded(*i)
                        && matches!(turn.action, ActorAction::Calls { .. })
                        && turn.calls() != draft_calls.as_slice()
                });
                Some(match alternative {
                    Some((_, turn, ids)) => (turn.clone(), ids.clone()),
                    None => r.draft,
                })
            }
        };
        if let Some((turn, ids)) = commit {
            // Commit without asking the actor again: the memory is on record.
            let calls = self.queue(&turn, &ids);
            let msg = assistant_message(&turn, &ids);
            self.persist(EventBody::Message {
                message: msg.clone(),
            });
            self.conv.push(msg);
            return self.next_call(CallsState {
                calls,
                next: 0,
                verdict: Some(verdict),
            });
        }
        self.actor_turn(Some((text, verdict)));
    }
}

/// Sampling of a branch's first imagined step (branches 1…N−1; branch 0 starts from the draft).
fn first_step_sampling(cfg: &PrivateRehearsal) -> SamplingParams {
    match cfg.explore_temperature {
        Some(temperature) => SamplingParams {
            temperature,
            ..cfg.sampling.clone()
        },
        None => cfg.sampling.clone(),
    }
}

pub(super) fn rehearsal_pending(w: &RehearsalWait) -> Option<RequestId> {
    match w {
        RehearsalWait::FirstSteps { req } => Some(req.id),
        RehearsalWait::Branch(_, BranchWait::Actor { req })
        | RehearsalWait::Branch(_, BranchWait::Simulator { req }) => Some(req.id),
    }
}
