//! Screens by named state: the app is driven through its public input path (`App::update` with
//! keys and the same messages the driver sends) and rendered to a `TestBackend`; the buffer is
//! snapshotted with insta. Episode states come from the recorded sample sessions, so they are
//! real engine output, not hand-made.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use envace::engine::driver::DriverEvent;
use envace::engine::fsm::{ApprovalRequest, RehearsalVerdict};
use envace::engine::types::GenRole;
use envace::runtime::ModelInfo;
use envace::session::{EventBody, Session, read_session};
use envace::train::metrics::StepMetrics;
use envace::tui::app::{App, AppConfig, Msg, Slot, Tab};
use envace::tui::keymap::Keymap;
use envace::tui::theme;
use ratatui::Terminal;
use ratatui::backend::TestBackend;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn sample(name: &str) -> (PathBuf, Session) {
    let p = root().join("sessions").join(name);
    let s = read_session(&p).unwrap();
    (PathBuf::from("sessions").join(name), s)
}

fn app() -> App {
    let (themes, errors) = theme::available(None);
    assert!(errors.is_empty());
    let mut app = App::new(AppConfig {
        model: PathBuf::from("models/envace-tiny"),
        domain: None,
        mcp: None,
        sessions_dir: PathBuf::from("sessions"),
        runs_dir: PathBuf::from("runs"),
        themes,
        theme: 0,
        keymap: Keymap::default(),
    });
    app.update(Msg::Resize(120, 40));
    app.update(Msg::ModelLoaded {
        requested: PathBuf::from("models/envace-tiny"),
        result: Ok(ModelInfo {
            path: "models/envace-tiny".into(),
            hash: "4bf199d766541e1b".into(),
            architecture: "llama".into(),
            device: "cpu".into(),
            dtype: "f32".into(),
            parameters: 4_600_000,
            tool_rendering: envace::runtime::tool_format::ToolRendering::Template,
        }),
    });
    app
}

fn key(app: &mut App, code: KeyCode) {
    let mods = match code {
        KeyCode::Char(c) if c.is_ascii_uppercase() => KeyModifiers::SHIFT,
        _ => KeyModifiers::NONE,
    };
    app.update(Msg::Key(KeyEvent::new(code, mods)));
}

fn keys(app: &mut App, s: &str) {
    for c in s.chars() {
        key(app, KeyCode::Char(c));
    }
}

fn render(app: &App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| envace::tui::ui::draw(app, f)).unwrap();
    t
}

fn screen(app: &App) -> String {
    render(app, 120, 40).backend().to_string()
}

/// Feed a recorded session's events as the driver would, one second apart.
fn play(app: &mut App, events: &[envace::session::EventRecord]) {
    for (i, e) in events.iter().enumerate() {
        app.update(Msg::Driver {
            event: DriverEvent::Persisted(e.clone()),
            at_s: (i + 1) as f64,
        });
    }
}

fn start_episode(app: &mut App) {
    // `r` starts a run; the driver would now stream events.
    key(app, KeyCode::Char('r'));
}

#[test]
fn empty_run_tab() {
    let app = app();
    insta::assert_snapshot!("empty_run_tab", screen(&app));
}

#[test]
fn streaming_actor_text() {
    let mut app = app();
    start_episode(&mut app);
    let (_, s) = sample("bank-shadow-rehearsal.jsonl");
    play(&mut app, &s.events[..3]);
    for piece in [
        "<tool_call>",
        "{\"name\": \"find_",
        "accounts\", \"arguments\": {\"name\": \"Ku",
    ] {
        app.update(Msg::Driver {
            event: DriverEvent::Text {
                request: 0,
                role: GenRole::Actor,
                branch: None,
                index: 0,
                text: piece.into(),
            },
            at_s: 4.0,
        });
    }
    let out = screen(&app);
    assert!(out.contains("actor ▍"), "{out}");
    assert!(out.contains("running"), "{out}");
    insta::assert_snapshot!("streaming", out);
}

#[test]
fn streaming_parallel_rehearsal_siblings() {
    let mut app = app();
    start_episode(&mut app);
    let (_, s) = sample("bank-shadow-rehearsal.jsonl");
    play(&mut app, &s.events[..3]);
    // One batched request generates branches 1-3; their tokens arrive interleaved.
    for piece in ["<tool_call>", "{\"name\": \"", "transfer"] {
        for index in 0..3 {
            app.update(Msg::Driver {
                event: DriverEvent::Text {
                    request: 7,
                    role: GenRole::Actor,
                    branch: Some(1),
                    index,
                    text: piece.into(),
                },
                at_s: 4.0,
            });
        }
    }
    let out = screen(&app);
    for b in 1..=3 {
        assert!(out.contains(&format!("actor (branch {b}) ▍")), "{out}");
    }
    assert_eq!(
        out.matches("<tool_call>{\"name\": \"transfer").count(),
        3,
        "{out}"
    );
    insta::assert_snapshot!("streaming_parallel_siblings", out);
}

#[test]
fn rehearsal_tree_and_real_vs_simulated_diff() {
    let mut app = app();
    start_episode(&mut app);
    let (p, s) = sample("bank-shadow-rehearsal.jsonl");
    let out = finished_with_branches_in_view(&mut app, p, &s);
    assert!(out.contains("rehearsal 1"), "{out}");
    assert!(out.contains("branch 0"), "{out}");
    insta::assert_snapshot!("rehearsal_tree", out);
    // The diff pane: step back to a call that was both simulated and real.
    key(&mut app, KeyCode::Char('w'));
    let with_both = app
        .run
        .view
        .calls
        .iter()
        .position(|c| c.simulated.is_some() && c.real.is_some())
        .unwrap();
    for _ in 0..app.run.view.calls.len() {
        key(&mut app, KeyCode::Left);
    }
    for _ in 0..with_both {
        key(&mut app, KeyCode::Right);
    }
    let out = screen(&app);
    assert!(out.contains("simulated") && out.contains("real"), "{out}");
    insta::assert_snapshot!("real_vs_simulated_diff", out);
}

#[test]
fn rehearsal_tree_marks_recalled_branch_calls() {
    let mut app = app();
    start_episode(&mut app);
    let (p, mut s) = sample("bank-shadow-rehearsal.jsonl");
    // Turn the first simulated branch call into a recalled real error (what Private
    // Rehearsal's recall records): the tree must say so instead of showing a simulation.
    let view = envace::tui::episode::EpisodeView::from_events(&s.events);
    let first = s
        .events
        .iter()
        .position(|e| view.in_branch(&e.id) && matches!(e.event, EventBody::Simulated { .. }))
        .expect("the sample has a simulated branch call");
    if let EventBody::Simulated {
        recalled, outcome, ..
    } = &mut s.events[first].event
    {
        *recalled = true;
        *outcome = serde_json::from_value(serde_json::json!({"status": "parsed",
            "output": {"kind": "result", "value": {"error": {"code": "not_found",
            "message": "no account holder named Gus"}}}}))
        .unwrap();
    }
    let out = finished_with_branches_in_view(&mut app, p, &s);
    assert_eq!(out.matches("⇒ recalled ").count(), 1, "{out}");
    insta::assert_snapshot!("rehearsal_tree_recalled", out);
}

/// Play `s` to its end in the Run tab, focus the rehearsal branches pane at its top, and
/// return the screen.
fn finished_with_branches_in_view(app: &mut App, path: PathBuf, s: &Session) -> String {
    play(app, &s.events);
    app.update(Msg::RunFinished {
        session: path,
        result: Ok(0.0),
    });
    keys(app, "www");
    key(app, KeyCode::Char('g'));
    screen(app)
}

fn approval_request(s: &Session) -> ApprovalRequest {
    let (call_id, call) = s
        .events
        .iter()
        .find_map(|e| match &e.event {
            EventBody::ApprovalRequested { call_id, call, .. } => {
                Some((call_id.clone(), call.clone()))
            }
            _ => None,
        })
        .unwrap();
    ApprovalRequest {
        id: 7,
        call_id,
        call,
        irreversible: true,
        rehearsal: Some(RehearsalVerdict {
            branches: 4,
            predicted_success: 3,
            predicted_failure: 1,
        }),
        predicted: None,
    }
}

#[test]
fn approval_dialog_edit_validates_against_the_schema() {
    let mut app = app();
    start_episode(&mut app);
    let (_, s) = sample("bank-success.jsonl");
    play(&mut app, &s.events[..6]);
    app.update(Msg::ApprovalAsked(approval_request(&s)));
    let out = screen(&app);
    assert!(
        out.contains("Approval needed") && out.contains("irreversible"),
        "{out}"
    );
    insta::assert_snapshot!("approval_dialog", out);

    // Edit: break the JSON → error; wrong type → schema error; fix → decision sent.
    key(&mut app, KeyCode::Char('e'));
    assert!(app.editor.is_some());
    for _ in 0..200 {
        key(&mut app, KeyCode::Backspace);
    }
    keys(
        &mut app,
        "{\"src\": \"acc_934\", \"dst\": \"acc_834\", \"amount\": \"581\"",
    );
    let ctrl_s = KeyEvent::new(KeyCode::Char('s'), KeyModifiers::CONTROL);
    assert!(app.update(Msg::Key(ctrl_s)).is_empty());
    assert!(
        app.editor
            .as_ref()
            .unwrap()
            .error
            .as_ref()
            .unwrap()
            .contains("not JSON")
    );
    keys(&mut app, "}");
    assert!(app.update(Msg::Key(ctrl_s)).is_empty());
    let err = app.editor.as_ref().unwrap().error.clone().unwrap();
    assert!(err.contains("arguments.amount"), "{err}");
    insta::assert_snapshot!("approval_edit_schema_error", screen(&app));
    for _ in 0..6 {
        key(&mut app, KeyCode::Backspace);
    }
    keys(&mut app, "581}");
    let effects = app.update(Msg::Key(ctrl_s));
    assert_eq!(
        effects,
        vec![envace::tui::Effect::Decide(
            envace::engine::types::Decision::ApproveEdited {
                arguments: serde_json::json!({"src": "acc_934", "dst": "acc_834", "amount": 581})
            }
        )]
    );
    assert!(app.overlay.is_none());
}

#[test]
fn reject_sends_the_reason_to_the_actor() {
    let mut app = app();
    start_episode(&mut app);
    let (_, s) = sample("bank-success.jsonl");
    app.update(Msg::ApprovalAsked(approval_request(&s)));
    key(&mut app, KeyCode::Char('r'));
    keys(&mut app, "wrong account");
    let effects = app.update(Msg::Key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE)));
    assert_eq!(
        effects,
        vec![envace::tui::Effect::Decide(
            envace::engine::types::Decision::Reject {
                reason: "wrong account".into()
            }
        )]
    );
}

fn open_in_debugger(app: &mut App, name: &str, slot: Slot) {
    let (p, s) = sample(name);
    app.update(Msg::SessionLoaded {
        path: p,
        slot,
        result: Ok(Box::new(s)),
    });
}

#[test]
fn debugger_at_a_step() {
    let mut app = app();
    open_in_debugger(&mut app, "bank-shadow-rehearsal.jsonl", Slot::Primary);
    assert_eq!(app.tab, Tab::Debugger);
    keys(&mut app, "x"); // next irreversible call
    let out = screen(&app);
    assert!(out.contains("Steps (main line)"), "{out}");
    insta::assert_snapshot!("debugger_at_step", out);
    keys(&mut app, "J");
    insta::assert_snapshot!("debugger_raw_json", screen(&app));
}

#[test]
fn debugger_token_view_asks_for_decoding_once() {
    let mut app = app();
    open_in_debugger(&mut app, "bank-success.jsonl", Slot::Primary);
    let gen_step = app
        .debugger
        .primary
        .as_ref()
        .unwrap()
        .main
        .iter()
        .position(|&i| {
            matches!(
                app.debugger.primary.as_ref().unwrap().session.events[i].event,
                EventBody::Generation(_)
            )
        })
        .unwrap();
    for _ in 0..gen_step {
        keys(&mut app, "n");
    }
    let effects = app.update(Msg::Key(KeyEvent::new(
        KeyCode::Char('t'),
        KeyModifiers::NONE,
    )));
    let (event, n) = match effects.as_slice() {
        [envace::tui::Effect::DecodeTokens { event, ids }] => (*event, ids.len()),
        other => panic!("{other:?}"),
    };
    app.update(Msg::TokensDecoded {
        event,
        tokens: (0..n).map(|i| format!("t{i} ")).collect(),
    });
    let out = screen(&app);
    assert!(out.contains("log-prob"), "{out}");
    insta::assert_snapshot!("debugger_tokens", out);
}

#[test]
fn step_aligned_diff_of_two_sessions() {
    let mut app = app();
    open_in_debugger(&mut app, "bank-success.jsonl", Slot::Primary);
    open_in_debugger(&mut app, "bank-failure.jsonl", Slot::Other);
    keys(&mut app, "D");
    let out = screen(&app);
    assert!(out.contains("Step-aligned diff"), "{out}");
    insta::assert_snapshot!("diff_view", out);
}

#[test]
fn fork_and_edit_fork_from_the_debugger() {
    let mut app = app();
    open_in_debugger(&mut app, "bank-failure.jsonl", Slot::Primary);
    // Move to the first tool result and edit it.
    let p = app.debugger.primary.clone().unwrap();
    let tool_step = p
        .main
        .iter()
        .position(|&i| {
            matches!(&p.session.events[i].event, EventBody::Message { message } if message.role == envace::message::Role::Tool)
        })
        .unwrap();
    for _ in 0..tool_step {
        keys(&mut app, "n");
    }
    keys(&mut app, "E");
    assert!(app.editor.is_some());
    insta::assert_snapshot!("fork_edit", screen(&app));
    let effects = app.update(Msg::Key(KeyEvent::new(
        KeyCode::Char('s'),
        KeyModifiers::CONTROL,
    )));
    match effects.as_slice() {
        [envace::tui::Effect::Fork { spec, .. }] => {
            assert!(spec.edit.as_ref().unwrap().1, "a tool result edit");
            assert_eq!(spec.at_event, spec.edit.as_ref().unwrap().0);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(app.tab, Tab::Run);
    assert!(app.run.is_running());
}

#[test]
fn training_charts() {
    let mut app = app();
    keys(&mut app, "4");
    for step in 1..=12 {
        let x = step as f64;
        app.update(Msg::TrainMetrics(
            StepMetrics::new("grpo", step)
                .with("reward_actor", 0.1 + 0.03 * x)
                .with("reward_simulator", 0.05 + 0.02 * x)
                .with("loss", 1.0 / x)
                .with("kl", 0.001 * x)
                .with("sim_failure_rate", 0.5 - 0.02 * x)
                .with("tokens_per_s", 600.0 + 5.0 * x),
        ));
    }
    app.update(Msg::TrainLog("step 12: reward 0.46".into()));
    app.update(Msg::Checkpoints(vec![
        PathBuf::from("models/runs/grpo/checkpoint-5"),
        PathBuf::from("models/runs/grpo/checkpoint-10"),
    ]));
    let out = screen(&app);
    assert!(
        out.contains("Reward per role") && out.contains("checkpoint-10"),
        "{out}"
    );
    insta::assert_snapshot!("training_charts", out);
}

#[test]
fn help_overlay_lists_the_keymap() {
    let mut app = app();
    keys(&mut app, "?");
    let out = screen(&app);
    assert!(out.contains("quit envace"), "{out}");
    insta::assert_snapshot!("help_overlay", out);
    keys(&mut app, "?");
    assert!(app.overlay.is_none());
}

#[test]
fn command_palette_runs_an_action() {
    let mut app = app();
    keys(&mut app, ":");
    keys(&mut app, "tab_models");
    insta::assert_snapshot!("palette", screen(&app));
    let effects = app.update(Msg::Key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE)));
    assert_eq!(app.tab, Tab::Models);
    assert_eq!(effects, vec![envace::tui::Effect::ScanModels]);
}

/// A model whose template has no tools section (SmolLM2's GGUF): the status bar and the Models
/// tab say that the tools were rendered into the system message, and in which format.
#[test]
fn models_tab_names_the_tool_rendering() {
    let mut app = app();
    app.update(Msg::ModelLoaded {
        requested: PathBuf::from(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        result: Ok(ModelInfo {
            path: ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            hash: "b179c9523d0e6a0f".into(),
            architecture: "llama".into(),
            device: "cpu".into(),
            dtype: "f32".into(),
            parameters: 134_515_008,
            tool_rendering: envace::runtime::tool_format::ToolRendering::SystemSmolLM2,
        }),
    });
    keys(&mut app, ":");
    keys(&mut app, "tab_models");
    app.update(Msg::Key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE)));
    let out = screen(&app);
    assert!(out.contains("tools: system-smollm2"), "{out}");
    assert!(
        out.contains("system-smollm2 (tools in the system message)"),
        "{out}"
    );
    insta::assert_snapshot!("models_tab_tool_rendering", out);
}

#[test]
fn too_small_terminal() {
    let mut app = app();
    app.update(Msg::Resize(60, 20));
    let out = render(&app, 60, 20).backend().to_string();
    assert!(out.contains("terminal too small"), "{out}");
    insta::assert_snapshot!("too_small", out);
}

#[test]
fn sessions_table() {
    let mut app = app();
    let mut v: Vec<_> = [
        "bank-success.jsonl",
        "bank-failure.jsonl",
        "bank-shadow-rehearsal.jsonl",
    ]
    .iter()
    .map(|n| {
        let mut s = envace::session::index::summarize(&root().join("sessions").join(n)).unwrap();
        s.path = Path::new("sessions").join(n);
        s.modified = None;
        s.created = None;
        s
    })
    .collect();
    v.sort_by(|a, b| a.path.cmp(&b.path));
    app.update(Msg::SessionsScanned {
        sessions: v,
        errors: Vec::new(),
    });
    keys(&mut app, "2");
    keys(&mut app, "ss"); // sort by task
    let out = screen(&app);
    assert!(out.contains("bank-test-0018"), "{out}");
    insta::assert_snapshot!("sessions_table", out);
    keys(&mut app, "/");
    keys(&mut app, "rehearsal");
    assert_eq!(app.sessions.visible().len(), 1);
}

#[test]
fn every_theme_colours_the_approval_dialog() {
    for i in 0..theme::BUILTIN.len() {
        let mut app = app();
        app.theme = i;
        let (_, s) = sample("bank-success.jsonl");
        app.update(Msg::ApprovalAsked(approval_request(&s)));
        app.update(Msg::Resize(80, 24));
        let t = render(&app, 80, 24);
        let name = format!("theme_{}", app.theme().name);
        // Debug output lists the styles: a theme change shows up in the snapshot.
        insta::assert_snapshot!(name, format!("{:?}", t.backend().buffer()));
    }
}

#[test]
fn ctrl_c_cancels_a_run_and_q_quits() {
    let mut app = app();
    start_episode(&mut app);
    let e = app.update(Msg::Key(KeyEvent::new(
        KeyCode::Char('c'),
        KeyModifiers::CONTROL,
    )));
    assert_eq!(e, vec![envace::tui::Effect::CancelRun]);
    let e = app.update(Msg::Key(KeyEvent::new(
        KeyCode::Char('q'),
        KeyModifiers::NONE,
    )));
    assert!(e.contains(&envace::tui::Effect::Quit));
    assert!(app.quit);
}

#[test]
fn mouse_wheel_scrolls_the_pane_under_the_pointer_and_clicks_switch_tabs() {
    use crossterm::event::{MouseButton, MouseEvent, MouseEventKind};
    let mut app = app();
    let wheel = |app: &mut App, column, row| {
        app.update(Msg::Mouse(MouseEvent {
            kind: MouseEventKind::ScrollDown,
            column,
            row,
            modifiers: KeyModifiers::NONE,
        }));
    };
    let before = app.run.form.clone();
    wheel(&mut app, 10, 3); // the settings strip: values never change under the wheel
    assert_eq!(app.run.form, before);
    wheel(&mut app, 10, 12); // the actor pane
    assert_eq!(app.run.focus, envace::tui::run_tab::Pane::Actor);
    assert_eq!(app.run.scroll[0], 1);
    // Click on "2 Sessions" in the tab bar.
    app.update(Msg::Mouse(MouseEvent {
        kind: MouseEventKind::Down(MouseButton::Left),
        column: 12,
        row: 0,
        modifiers: KeyModifiers::NONE,
    }));
    assert_eq!(app.tab, Tab::Sessions);
}

/// A remote model's spec as requested (tokenizer and options included) stays the model path
/// after the load, which is what the Train tab and a reload read; the display path drops them.
#[test]
fn a_loaded_remote_model_keeps_its_requested_spec() {
    let mut app = app();
    let spec = "openai:http://127.0.0.1:8080/v1#smollm2&tokenizer=models/smollm2-envace";
    app.update(Msg::ModelLoaded {
        requested: PathBuf::from(spec),
        result: Ok(ModelInfo {
            path: "openai:http://127.0.0.1:8080/v1#smollm2".into(),
            hash: "remote".into(),
            architecture: "remote".into(),
            device: "server".into(),
            dtype: "-".into(),
            parameters: 0,
            tool_rendering: envace::runtime::tool_format::ToolRendering::Template,
        }),
    });
    assert_eq!(app.model_path, PathBuf::from(spec));
    app.update(Msg::ModelLoaded {
        requested: PathBuf::from("models/missing"),
        result: Err("not found".into()),
    });
    let out = screen(&app);
    assert!(out.contains("models/missing: not found"), "{out}");
}
