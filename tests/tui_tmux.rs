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
        let t0 = Instant::now();
        loop {
            let s = self.capture();
            if s.contains(text) {
                return s;
            }
            if t0.elapsed() > Duration::from_secs(secs) {
                panic!("waited {secs}s for {text:?}; screen:\n{s}");
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
    let s = t.wait_for("model loaded", 60);
    assert!(
        s.contains("1 Run") && s.contains("task: bank-test-0007"),
        "{s}"
    );
    assert!(
        s.contains("mode: shadow") && s.contains("rehearsals N: 2"),
        "{s}"
    );

    // Run: Private Rehearsal, then the irreversible card payment asks for approval.
    t.send(&["r"]);
    let s = t.wait_for("Approval needed", 120);
    assert!(s.contains("irreversible"), "{s}");
    assert!(s.contains("Private Rehearsal:"), "{s}");
    assert!(s.contains("card_pay"), "{s}");
    // The branch pane keeps the latest rehearsal's header (its verdict) in view, however long
    // the rehearsal: the dialog asks about it.
    assert!(
        s.contains("· parallel · n=2"),
        "the branch pane shows the rehearsal's header:\n{s}"
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
    t.wait_for("Sessions in", 30);
    let s = t.wait_for("bank-test-0007", 30);
    assert!(s.contains("Sessions in"), "{s}");
    t.send(&["Enter"]);
    let s = t.wait_for("Steps (main line)", 30);
    assert!(s.contains("step 1/"), "{s}");
    t.send(&["n", "n"]);
    let s = t.wait_for("step 3/", 10);
    assert!(s.contains("user: Pay 147"), "{s}");
    t.send(&["x"]);
    let s = t.wait_for("approval_requested", 10);
    assert!(s.contains("\"irreversible\": true"), "{s}");

    // Fork at the approval request and re-run with the current model: the call is asked again.
    t.send(&["f"]);
    let s = t.wait_for("Approval needed", 120);
    assert!(s.contains("fork of"), "{s}");
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
    t.wait_for("Sessions in", 30);
    let s = t.wait_for(".fork-1.jsonl", 30);
    assert!(s.contains("Sessions in"), "{s}");
    t.send(&["g", "Enter"]);
    let s = t.wait_for("forked from", 30);
    assert!(s.contains("Steps (main line)"), "{s}");
    t.send(&["D"]);
    let s = t.wait_for("Step-aligned diff", 30);
    assert!(
        s.contains(".fork-1.jsonl ↔ ") && s.contains("episode start"),
        "{s}"
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
