//! The real release binary in tmux (send-keys / capture-pane): launch on the bundled model, run
//! a held-out bank task in shadow mode with Private Rehearsal, approve the irreversible call in
//! the dialog, open the new session in the debugger, step, quit. Assertions are on the captured
//! screen text. tmux is a test fixture: when it is missing the test fails, it never skips.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

struct Tmux {
    socket: String,
    session: String,
}

impl Tmux {
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]);
        c
    }
    fn send(&self, keys: &[&str]) {
        let st = self
            .cmd()
            .args(["send-keys", "-t", &self.session])
            .args(keys)
            .status()
            .unwrap();
        assert!(st.success());
    }
    fn capture(&self) -> String {
        let out = self
            .cmd()
            .args(["capture-pane", "-p", "-t", &self.session])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
    /// Wait until the screen contains `text`; panics with the screen after `secs`.
    fn wait_for(&self, text: &str, secs: u64) -> String {
        self.wait_for_all(&[text], secs)
    }
    /// Wait until one capture contains every one of `texts`. A capture can land while the
    /// terminal is halfway through drawing a frame (the header of the new screen over the body
    /// of the old one), so what a step asserts together is waited for together.
    fn wait_for_all(&self, texts: &[&str], secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.capture();
            if texts.iter().all(|t| s.contains(t)) {
                return s;
            }
            if t0.elapsed() > Duration::from_secs(secs) {
                panic!("waited {secs}s for all of {texts:?}; screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    /// Approve every further approval dialog until the screen contains `done` (the model may
    /// retry an irreversible call after an error, or the task's follow-up turn may make one).
    fn approve_until(&self, done: &str, secs: u64) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.capture();
            if s.contains(done) {
                return s;
            }
            if s.contains("Approval needed") {
                self.send(&["a"]);
                std::thread::sleep(Duration::from_millis(800));
                continue;
            }
            if t0.elapsed() > Duration::from_secs(secs) {
                panic!("waited {secs}s for {done:?}; screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").status();
    }
}

fn tmux_available() -> bool {
    Command::new("tmux")
        .arg("-V")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn shadow_run_with_rehearsal_approval_and_debugger_in_the_real_binary() {
    assert!(
        tmux_available(),
        "tmux is a fixture of this test (scripts/fetch-fixtures installs it): not found on PATH"
    );
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let bin = env!("CARGO_BIN_EXE_envace");
    let home = tempfile::tempdir().unwrap();
    let data = home.path().join("data");
    let config = home.path().join("config");
    let t = Tmux {
        socket: format!("envace-test-{}", std::process::id()),
        session: "e2e".into(),
    };
    let shell = format!(
        "cd {} && XDG_DATA_HOME={} XDG_CONFIG_HOME={} TERM=xterm-256color {} tui; echo ENVACE-EXITED $?; sleep 60",
        root.display(),
        data.display(),
        config.display(),
        bin
    );
    let st = t
        .cmd()
        .args([
            "new-session",
            "-d",
            "-s",
            &t.session,
            "-x",
            "140",
            "-y",
            "45",
            &shell,
        ])
        .status()
        .unwrap();
    assert!(st.success());

    // Launch on the bundled model.
    t.wait_for_all(
        &[
            "model loaded",
            "1 Run",
            "task: bank-test-0007",
            "mode: shadow",
            "rehearsals N: 2",
        ],
        60,
    );

    // Run: Private Rehearsal, then the irreversible card payment asks for approval.
    t.send(&["r"]);
    // The branch pane keeps the latest rehearsal's header (its verdict, "· parallel · n=2") in
    // view, however long the rehearsal: the dialog asks about it.
    t.wait_for_all(
        &[
            "Approval needed",
            "irreversible",
            "Private Rehearsal:",
            "card_pay",
            "· parallel · n=2",
        ],
        120,
    );
    t.send(&["a"]);
    std::thread::sleep(Duration::from_millis(800));
    let s = t.approve_until("episode finished", 180);
    assert!(s.contains("Real vs simulated"), "{s}");
    assert!(!s.contains("Approval needed"), "{s}");

    // The session was written under the data directory.
    let sessions = data.join("envace").join("sessions");
    let files: Vec<_> = std::fs::read_dir(&sessions).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "{}", sessions.display());
    let text = std::fs::read_to_string(files[0].path()).unwrap();
    assert!(text.contains("\"type\":\"approval\""), "approval recorded");
    assert!(text.contains("\"type\":\"rehearsal_start\""));

    // Open it in the debugger and step.
    // Wait for the tab itself: the Run tab also shows the task id and the session path.
    t.send(&["2"]);
    t.wait_for_all(&["Sessions in", "bank-test-0007"], 30);
    t.send(&["Enter"]);
    t.wait_for_all(&["Steps (main line)", "step 1/"], 30);
    t.send(&["n", "n"]);
    t.wait_for_all(&["step 3/", "user: Pay 147"], 10);
    t.send(&["x"]);
    t.wait_for_all(&["approval_requested", "\"irreversible\": true"], 10);

    // Fork at the approval request and re-run with the current model: the call is asked again.
    t.send(&["f"]);
    t.wait_for_all(&["Approval needed", "fork of"], 120);
    t.send(&["a"]);
    std::thread::sleep(Duration::from_millis(800));
    // The Run tab's state line reads "done, reward …" only once the fork has finished.
    t.approve_until("done, reward", 180);
    let fork = std::fs::read_dir(&sessions)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(".fork-1."))
        .expect("the fork is saved beside the original");
    let text = std::fs::read_to_string(&fork).unwrap();
    assert!(
        text.lines().next().unwrap().contains("\"forked_from\""),
        "{text}"
    );

    // Open the fork (newest first) and diff it against its original.
    t.send(&["2"]);
    t.wait_for_all(&["Sessions in", ".fork-1.jsonl"], 30);
    t.send(&["g", "Enter"]);
    t.wait_for_all(&["forked from", "Steps (main line)"], 30);
    t.send(&["D"]);
    t.wait_for_all(
        &["Step-aligned diff", ".fork-1.jsonl ↔ ", "episode start"],
        30,
    );

    // Quit restores the terminal and exits 0.
    t.send(&["q"]);
    let s = t.wait_for("ENVACE-EXITED", 20);
    assert!(s.contains("ENVACE-EXITED 0"), "{s}");
    save_capture(&root, &s);
}

/// Keep the last screen for inspection (git-ignored).
fn save_capture(root: &Path, s: &str) {
    let dir = root.join("target").join("tmux-e2e");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("last-screen.txt"), s);
}
