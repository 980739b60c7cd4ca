//! TUI responsiveness (`cargo bench --bench tui_frame`): frame render time with a
//! 10,000-event session open (debugger at the start, middle and end, the step-aligned diff, and
//! the Run tab showing the whole episode), and the worst frame while a 100 MB session loads on a
//! background thread (as the driver does) and the UI keeps drawing its progress.
//! Prints one JSON object per measurement. Set `ENVACE_BENCH_MB` to change the large file size.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use envace::engine::driver::DriverEvent;
use envace::runtime::{CancelToken, ModelInfo};
use envace::session::{read_session, reader::read_session_with_progress, synth::synthesize};
use envace::tui::app::{App, AppConfig, Msg, Slot};
use envace::tui::keymap::Keymap;
use ratatui::Terminal;
use ratatui::backend::TestBackend;

fn new_app() -> App {
    let mut app = App::new(AppConfig {
        model: PathBuf::from("models/envace-tiny"),
        domain: None,
        mcp: None,
        sessions_dir: PathBuf::from("sessions"),
        runs_dir: PathBuf::from("runs"),
        themes: envace::tui::theme::available(None).0,
        theme: 0,
        keymap: Keymap::default(),
    });
    app.update(Msg::Resize(200, 60));
    app.update(Msg::ModelLoaded {
        requested: PathBuf::from("models/envace-tiny"),
        result: Ok(ModelInfo {
            path: "models/envace-tiny".into(),
            hash: String::new(),
            architecture: "llama".into(),
            device: "cpu".into(),
            dtype: "f32".into(),
            parameters: 0,
            tool_rendering: envace::runtime::tool_format::ToolRendering::Template,
        }),
    });
    app
}

fn stats(name: &str, mut ms: Vec<f64>) {
    ms.sort_by(f64::total_cmp);
    let n = ms.len();
    let mean = ms.iter().sum::<f64>() / n as f64;
    println!(
        "{{\"bench\":\"{name}\",\"frames\":{n},\"mean_ms\":{mean:.3},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3}}}",
        ms[n / 2],
        ms[(n * 99 / 100).min(n - 1)],
        ms[n - 1]
    );
}

fn frames(
    app: &mut App,
    term: &mut Terminal<TestBackend>,
    n: usize,
    step: impl Fn(&mut App, usize),
) -> Vec<f64> {
    (0..n)
        .map(|i| {
            step(app, i);
            let t = Instant::now();
            term.draw(|f| envace::tui::ui::draw(app, f)).expect("draw");
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let template = read_session(root.join("sessions/bank-shadow-rehearsal.jsonl")).expect("sample");
    let dir = tempfile::tempdir().expect("tempdir");

    // 10,000 events.
    let per_event = std::fs::metadata(root.join("sessions/bank-shadow-rehearsal.jsonl"))
        .expect("sample size")
        .len()
        / template.events.len() as u64;
    let big = dir.path().join("10k.jsonl");
    synthesize(&template, per_event * 10_050, &big).expect("synthesize");
    let session = read_session(&big).expect("read 10k");
    let events = session.events.len();
    assert!(events >= 10_000, "{events}");
    let mut app = new_app();
    app.update(Msg::SessionLoaded {
        path: big.clone(),
        slot: Slot::Primary,
        result: Ok(Box::new(session.clone())),
    });
    let mut term = Terminal::new(TestBackend::new(200, 60)).expect("terminal");
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let key = |app: &mut App, c: KeyCode| {
        app.update(Msg::Key(KeyEvent::new(c, KeyModifiers::NONE)));
    };
    println!("{{\"session_events\":{events}}}");
    stats(
        "debugger_step_through_10k",
        frames(&mut app, &mut term, 300, |a, _| key(a, KeyCode::Char('n'))),
    );
    key(&mut app, KeyCode::Char('G'));
    stats(
        "debugger_end_10k",
        frames(&mut app, &mut term, 100, |a, _| key(a, KeyCode::Char('p'))),
    );
    stats(
        "debugger_jump_errors_10k",
        frames(&mut app, &mut term, 100, |a, _| key(a, KeyCode::Char('e'))),
    );
    app.update(Msg::SessionLoaded {
        path: big.clone(),
        slot: Slot::Other,
        result: Ok(Box::new(session.clone())),
    });
    app.debugger.diff = true;
    stats(
        "diff_view_10k_vs_10k",
        frames(&mut app, &mut term, 30, |a, _| key(a, KeyCode::Char('n'))),
    );

    // The Run tab after a 10,000-event episode streamed in.
    let mut run = new_app();
    for (i, e) in session.events.iter().enumerate() {
        run.update(Msg::Driver {
            event: DriverEvent::Persisted(e.clone()),
            at_s: i as f64,
        });
    }
    stats(
        "run_tab_10k_events",
        frames(&mut run, &mut term, 100, |_, _| {}),
    );

    // A 100 MB file loading in the background while the UI draws.
    let mb: u64 = std::env::var("ENVACE_BENCH_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let huge = dir.path().join("huge.jsonl");
    let size = synthesize(&template, mb * 1_000_000, &huge).expect("synthesize huge");
    let mut app = new_app();
    let (tx, rx) = mpsc::channel::<Msg>();
    let path = huge.clone();
    let t0 = Instant::now();
    let loader = std::thread::spawn(move || {
        let p2 = path.clone();
        let tx2 = tx.clone();
        let mut progress = move |done, total| {
            let _ = tx2.send(Msg::LoadProgress {
                path: p2.clone(),
                done,
                total,
            });
        };
        let r = read_session_with_progress(&path, &mut progress, &CancelToken::new())
            .map(Box::new)
            .map_err(|e| e.to_string());
        let _ = tx.send(Msg::SessionLoaded {
            path,
            slot: Slot::Primary,
            result: r,
        });
    });
    let mut frame_ms = Vec::new();
    let mut progress_msgs = 0usize;
    loop {
        let mut done = false;
        while let Ok(m) = rx.try_recv() {
            match &m {
                Msg::LoadProgress { .. } => progress_msgs += 1,
                Msg::SessionLoaded { .. } => done = true,
                _ => {}
            }
            app.update(m);
        }
        let t = Instant::now();
        term.draw(|f| envace::tui::ui::draw(&app, f)).expect("draw");
        frame_ms.push(t.elapsed().as_secs_f64() * 1e3);
        if done {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(16));
    }
    let load_s = t0.elapsed().as_secs_f64();
    loader.join().expect("loader");
    println!(
        "{{\"bench\":\"load_{mb}mb_in_background\",\"bytes\":{size},\"load_s\":{load_s:.2},\"mb_per_s\":{:.1},\"progress_updates\":{progress_msgs},\"events\":{}}}",
        size as f64 / 1e6 / load_s,
        app.debugger
            .primary
            .as_ref()
            .map_or(0, |p| p.session.events.len())
    );
    stats("frames_while_loading", frame_ms);
}
