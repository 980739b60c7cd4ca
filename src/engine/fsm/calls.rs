//! The episode's main line: its start, the actor's turns, and the pipeline each proposed call
//! goes through (recall or simulate, approval gate, real execution, tool message) before the
//! actor is asked again. Rehearsal branches reuse its queue and simulator parsing but never
//! its gate or real execution.

use serde_json::{Value, json};

use super::history::pending_calls;
use super::{
    ApprovalRequest, Effect, Engine, Pending, Phase, REJECTED_BY_USER, RealCallPermit,
    RehearsalVerdict, RequestId,
};
use crate::engine::fidelity::fidelity;
use crate::engine::parse::{
    ActorAction, ActorTurn, FormatEvent, SimOutput, parse_actor, parse_simulator,
};
use crate::engine::prompts::simulator::{SimulatorPromptInput, example_from_real};
use crate::engine::prompts::{
    actor_prompt, assistant_message, initial_conversation, simulator_prompt, tool_message,
};
use crate::engine::types::{
    ApprovalGate, Decision, EndReason, GenRole, Mode, RehearsalTrigger, SimFailurePolicy,
    SimulatedOutcome,
};
use crate::env::ToolResponse;
use crate::message::{Message, Role, ToolCall};
use crate::runtime::Generation;
use crate::session::schema::EventBody;

#[derive(Debug, Clone)]
pub(super) struct QueuedCall {
    pub(super) id: String,
    pub(super) call: ToolCall,
    pub(super) irreversible: bool,
}

#[derive(Debug, Clone)]
pub(super) struct CallsState {
    pub(super) calls: Vec<QueuedCall>,
    pub(super) next: usize,
    pub(super) verdict: Option<RehearsalVerdict>,
}

#[derive(Debug, Clone)]
pub(super) enum CallStep {
    /// Waiting for the simulator (rehearse: the answer; shadow: the prediction).
    Simulating { req: Pending },
    AwaitingApproval {
        id: RequestId,
        prediction: Option<SimulatedOutcome>,
    },
    Executing {
        id: RequestId,
        prediction: Option<SimulatedOutcome>,
    },
}

impl Engine {
    pub(super) fn start(&mut self) {
        self.persist(EventBody::EpisodeStart {
            task_id: self.spec.task_id.clone(),
            mode: self.cfg.mode.name().to_string(),
            tools: self.spec.tools.clone(),
            user_turns: self.spec.user_turns.clone(),
        });
        self.conv = initial_conversation(&self.spec);
        for m in self.conv.clone() {
            self.persist(EventBody::Message { message: m });
        }
        self.next_user = 1;
        let history = std::mem::take(&mut self.history);
        self.absorb_history(&history);
        match history.last() {
            Some(last) if last.role == Role::Assistant && last.tool_calls.is_empty() => {
                self.after_answer()
            }
            _ => {
                let calls: Vec<QueuedCall> = pending_calls(&history)
                    .into_iter()
                    .map(|(id, call)| QueuedCall {
                        irreversible: self.is_irreversible(&call.name),
                        id,
                        call,
                    })
                    .collect();
                if calls.is_empty() {
                    self.actor_turn(None)
                } else {
                    self.next_call(CallsState {
                        calls,
                        next: 0,
                        verdict: None,
                    })
                }
            }
        }
    }

    /// After a final answer: the next scripted user turn, or the end of the episode.
    fn after_answer(&mut self) {
        if let Some(next) = self.spec.user_turns.get(self.next_user).cloned() {
            self.next_user += 1;
            let msg = Message::user(next);
            self.persist(EventBody::Message {
                message: msg.clone(),
            });
            self.conv.push(msg);
            self.actor_turn(None);
        } else {
            self.end(EndReason::Answered);
        }
    }

    /// Ask the actor for its next turn; `commit` carries a rehearsal memory and verdict.
    pub(super) fn actor_turn(&mut self, commit: Option<(String, RehearsalVerdict)>) {
        if commit.is_none() {
            if self.turns >= self.cfg.max_turns {
                return self.end(EndReason::TurnLimit);
            }
            self.turns += 1;
        }
        let prompt = actor_prompt(
            &self.conv,
            commit.as_ref().map(|c| c.0.as_str()),
            self.placement(),
        );
        let sampling = self.cfg.actor_sampling.clone();
        let req = self.generate(GenRole::Actor, None, None, prompt, sampling, 1);
        self.phase = Phase::Actor {
            req,
            commit: commit.map(|c| c.1),
        };
    }

    /// Record a parsed actor turn (generation, parse, format events) on the main line.
    fn record_actor(&mut self, req: &Pending, g: &Generation) -> (ActorTurn, Vec<String>) {
        self.count_generation(GenRole::Actor, g);
        self.persist(Self::generation_body(GenRole::Actor, req, 0, g));
        let turn = parse_actor(&g.text);
        let ids = self.new_call_ids(turn.calls().len());
        self.persist(EventBody::ActorParsed {
            turn: turn.clone(),
            call_ids: ids.clone(),
        });
        self.stats.actor_turns += 1;
        let failed =
            turn.events.iter().any(|e| e.is_failure()) || turn.action == ActorAction::Malformed;
        if failed {
            self.stats.actor_turns_failed += 1;
        } else if !turn.events.is_empty() {
            self.stats.actor_turns_repaired += 1;
        }
        for e in &turn.events {
            self.persist(EventBody::Format {
                format: FormatEvent::Actor(e.clone()),
            });
        }
        (turn, ids)
    }

    pub(super) fn on_actor(
        &mut self,
        req: Pending,
        commit: Option<RehearsalVerdict>,
        generations: Vec<Generation>,
    ) {
        let Some(g) = generations.into_iter().next() else {
            return self.end(EndReason::Failed {
                message: "the model returned no generation".into(),
            });
        };
        let (turn, ids) = self.record_actor(&req, &g);
        match &turn.action {
            ActorAction::Answer => {
                let msg = assistant_message(&turn, &[]);
                self.persist(EventBody::Message {
                    message: msg.clone(),
                });
                self.conv.push(msg);
                self.trace.agent_messages.push(turn.content.clone());
                self.trace.turn_ends.push(self.trace.actions.len());
                self.after_answer();
            }
            ActorAction::Malformed => self.end(EndReason::ActorFormatError),
            ActorAction::Calls { .. } => {
                let calls = self.queue(&turn, &ids);
                if commit.is_none() && self.should_rehearse(&calls) {
                    return self.start_rehearsal(turn, ids);
                }
                let msg = assistant_message(&turn, &ids);
                self.persist(EventBody::Message {
                    message: msg.clone(),
                });
                self.conv.push(msg);
                self.next_call(CallsState {
                    calls,
                    next: 0,
                    verdict: commit,
                });
            }
        }
    }

    fn should_rehearse(&self, calls: &[QueuedCall]) -> bool {
        match self.rehearsal_cfg() {
            None => false,
            Some(pr) => match pr.trigger {
                RehearsalTrigger::EveryCall => true,
                RehearsalTrigger::Irreversible => calls.iter().any(|c| c.irreversible),
            },
        }
    }

    pub(super) fn next_call(&mut self, st: CallsState) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        if matches!(self.cfg.mode, Mode::Rehearse)
            && self.cfg.recall_recorded
            && let Some(value) = self.recorded_response(&q.call)
        {
            self.stats.recalled_calls += 1;
            let outcome = SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            };
            self.persist(EventBody::Simulated {
                call_id: q.id.clone(),
                call: q.call.clone(),
                outcome: outcome.clone(),
                think: None,
                recalled: true,
            });
            return self.after_main_simulation(st, q, outcome);
        }
        match self.cfg.mode {
            Mode::Rehearse | Mode::Shadow(_) => {
                let prompt = simulator_prompt(
                    &SimulatorPromptInput {
                        tools: &self.spec.tools,
                        examples: &self.examples,
                        conversation: &self.conv,
                        call: &q.call,
                    },
                    &self.cfg.sim_prompt,
                );
                let sampling = self.cfg.simulator_sampling.clone();
                let req = self.generate(
                    GenRole::Simulator,
                    None,
                    Some(q.id.clone()),
                    prompt,
                    sampling,
                    1,
                );
                self.phase = Phase::Calls(st, CallStep::Simulating { req });
            }
            Mode::Real(_) => self.gate(st, None),
        }
    }

    /// Parse a simulator generation into an outcome, recording format failures.
    pub(super) fn simulated_outcome(
        &mut self,
        g: &Generation,
        parent: Option<String>,
    ) -> (SimulatedOutcome, Option<String>, Option<String>) {
        let mut tip = parent;
        match parse_simulator(&g.text) {
            Ok(t) => {
                if matches!(t.output, SimOutput::Rejected { .. }) {
                    self.stats.simulator_rejections += 1;
                }
                (SimulatedOutcome::Parsed { output: t.output }, t.think, tip)
            }
            Err(error) => {
                self.stats.simulator_format_failures += 1;
                tip = Some(self.emit(
                    tip,
                    EventBody::Format {
                        format: FormatEvent::Simulator(error.clone()),
                    },
                ));
                (SimulatedOutcome::Unparseable { error }, None, tip)
            }
        }
    }

    pub(super) fn on_main_simulation(
        &mut self,
        st: CallsState,
        req: Pending,
        generations: Vec<Generation>,
    ) {
        let Some(g) = generations.into_iter().next() else {
            return self.end(EndReason::Failed {
                message: "the model returned no generation".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.count_generation(GenRole::Simulator, &g);
        self.persist(Self::generation_body(GenRole::Simulator, &req, 0, &g));
        let (outcome, think, tip) = self.simulated_outcome(&g, self.tip.clone());
        self.tip = tip;
        self.persist(EventBody::Simulated {
            call_id: q.id.clone(),
            call: q.call.clone(),
            outcome: outcome.clone(),
            think,
            recalled: false,
        });
        self.after_main_simulation(st, q, outcome);
    }

    /// The response of the recorded example whose call is exactly `call` (rehearse mode's
    /// `recall_recorded`).
    fn recorded_response(&self, call: &ToolCall) -> Option<Value> {
        self.examples
            .iter()
            .find(|e| e.name == call.name && e.arguments == call.arguments)
            .map(|e| e.response.clone())
    }

    /// Go on from a main-line simulated outcome: the gate (shadow mode) or the actor sees it.
    fn after_main_simulation(
        &mut self,
        mut st: CallsState,
        q: QueuedCall,
        outcome: SimulatedOutcome,
    ) {
        match self.cfg.mode {
            Mode::Shadow(_) => self.gate(st, Some(outcome)),
            Mode::Real(_) => self.end(EndReason::Failed {
                message: "internal: simulation in real mode".into(),
            }),
            Mode::Rehearse => {
                self.stats.simulated_calls += 1;
                self.trace.actions.push(q.call.clone());
                let policy = self.cfg.sim_failure;
                let shown = match outcome {
                    SimulatedOutcome::Parsed {
                        output: SimOutput::Result { value },
                    } => value,
                    SimulatedOutcome::Parsed {
                        output: SimOutput::Rejected { code, message },
                    } => match policy {
                        SimFailurePolicy::EndWithZeroReward => {
                            return self.end(EndReason::SimulatorRejected { code, message });
                        }
                        SimFailurePolicy::ShowErrorToActor => {
                            json!({"error": {"code": code, "message": message}})
                        }
                    },
                    SimulatedOutcome::Unparseable { error } => match policy {
                        SimFailurePolicy::EndWithZeroReward => {
                            return self.end(EndReason::SimulatorFormatError { error });
                        }
                        SimFailurePolicy::ShowErrorToActor => {
                            json!({"error": {"code": "simulator_format_error", "message": error.to_string()}})
                        }
                    },
                };
                self.tool_result(&q, &shown);
                st.next += 1;
                self.next_call(st);
            }
        }
    }

    fn tool_result(&mut self, q: &QueuedCall, value: &Value) {
        let msg = tool_message(&q.id, &q.call.name, value);
        self.persist(EventBody::Message {
            message: msg.clone(),
        });
        self.conv.push(msg);
    }

    /// The approval gate before a real call.
    fn gate(&mut self, st: CallsState, prediction: Option<SimulatedOutcome>) {
        let Some(live) = self.cfg.mode.live() else {
            return self.end(EndReason::Failed {
                message: "internal: approval gate in rehearse mode".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        let needs = match live.approval {
            ApprovalGate::Irreversible => q.irreversible,
            ApprovalGate::EveryCall => true,
            ApprovalGate::Off => false,
        };
        if !needs {
            return self.execute(st, prediction);
        }
        let id = self.new_request();
        self.persist(EventBody::ApprovalRequested {
            call_id: q.id.clone(),
            call: q.call.clone(),
            irreversible: q.irreversible,
        });
        self.out.push(Effect::AskApproval(ApprovalRequest {
            id,
            call_id: q.id.clone(),
            call: q.call.clone(),
            irreversible: q.irreversible,
            rehearsal: st.verdict,
            predicted: prediction.clone(),
        }));
        self.phase = Phase::Calls(st, CallStep::AwaitingApproval { id, prediction });
    }

    fn execute(&mut self, st: CallsState, prediction: Option<SimulatedOutcome>) {
        let Some(permit) = RealCallPermit::for_mode(&self.cfg.mode) else {
            return self.end(EndReason::Failed {
                message: "internal: real call in rehearse mode".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        let id = self.new_request();
        self.out.push(Effect::ExecuteReal {
            id,
            call_id: q.id,
            call: q.call,
            permit,
        });
        self.phase = Phase::Calls(st, CallStep::Executing { id, prediction });
    }

    pub(super) fn on_decision(
        &mut self,
        mut st: CallsState,
        prediction: Option<SimulatedOutcome>,
        decision: Decision,
    ) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.persist(EventBody::Approval {
            call_id: q.id.clone(),
            decision: decision.clone(),
        });
        match decision {
            Decision::Approve => self.execute(st, prediction),
            Decision::ApproveEdited { arguments } => {
                if let Some(c) = st.calls.get_mut(st.next) {
                    c.call.arguments = arguments.clone();
                }
                // Keep the conversation consistent with what actually ran.
                for m in self.conv.iter_mut().rev() {
                    if let Some(tc) = m.tool_calls.iter_mut().find(|tc| tc.id == q.id) {
                        tc.function.arguments = arguments;
                        break;
                    }
                }
                self.execute(st, prediction)
            }
            Decision::Reject { reason } => {
                self.tool_result(
                    &q,
                    &json!({"error": {"code": REJECTED_BY_USER, "message": reason}}),
                );
                st.next += 1;
                self.next_call(st);
            }
            Decision::Terminate => self.end(EndReason::Terminated),
        }
    }

    pub(super) fn on_real(
        &mut self,
        mut st: CallsState,
        prediction: Option<SimulatedOutcome>,
        response: ToolResponse,
    ) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.stats.real_calls += 1;
        self.persist(EventBody::Real {
            call_id: q.id.clone(),
            call: q.call.clone(),
            response: response.clone(),
        });
        let real = response.to_json();
        if let Some(pred) = prediction {
            let f = fidelity(pred.value().as_ref(), &real);
            self.stats.fidelity.add(&q.call.name, &f);
            self.persist(EventBody::Fidelity {
                call_id: q.id.clone(),
                tool: q.call.name.clone(),
                fidelity: f,
            });
        }
        self.trace.actions.push(q.call.clone());
        if self.cfg.learn_examples_from_real {
            self.examples.push(example_from_real(&q.call, &real));
        }
        self.observe_real(&q.call, q.irreversible, &real);
        self.tool_result(&q, &real);
        st.next += 1;
        self.next_call(st);
    }
}
