//! The engine's guarantee against a real MCP server (`@modelcontextprotocol/server-filesystem`
//! over a temp dir): 100 rehearsed `write_file` calls leave the directory byte-identical; in
//! shadow mode the same calls do write. The policy here is a scripted stand-in for a model (it
//! only supplies the calls); the engine, driver, MCP client and server are all real.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use envace::engine::driver::{ApprovalPolicy, PolicyApprover, share_model};
use envace::engine::runner::{
    Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, ModeChoice, Policy, launch,
};
use envace::engine::types::EpisodeSpec;
use envace::env::Environment;
use envace::env::mcp_client::{McpEnv, McpServerConfig};
use envace::message::Message;
use envace::runtime::{
    CancelToken, FinishReason, Generation, LanguageModel, ModelInfo, RuntimeError, SamplingParams,
    StreamSink,
};
use envace::session::writer::MemorySink;

/// Emits 10 `write_file` calls per actor turn for 10 turns, then answers; as simulator, answers
/// every call with a plausible success.
struct ScriptedPolicy {
    dir: PathBuf,
    turn: usize,
}

impl LanguageModel for ScriptedPolicy {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            path: "scripted".into(),
            hash: "0".into(),
            architecture: "script".into(),
            device: "cpu".into(),
            dtype: "none".into(),
            parameters: 0,
            tool_rendering: envace::runtime::tool_format::ToolRendering::Template,
        }
    }
    fn render_chat(
        &self,
        messages: &[Message],
        _tools: &[serde_json::Value],
        _g: bool,
        _t: bool,
    ) -> Result<String, RuntimeError> {
        Ok(serde_json::to_string(messages).unwrap())
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        Ok(ids.iter().map(|&b| b as u8 as char).collect())
    }
    fn generate(
        &mut self,
        prompt: &[u32],
        n: usize,
        _p: &SamplingParams,
        _s: Option<StreamSink<'_>>,
        _c: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        let text = self.decode(prompt)?;
        let out = if text.contains("execution_result") {
            "<execution_result>{\"content\":[{\"type\":\"text\",\"text\":\"Successfully wrote\"}]}</execution_result>".to_string()
        } else if self.turn < 10 {
            let base = self.turn * 10;
            self.turn += 1;
            (0..10)
                .map(|i| {
                    let p = self.dir.join(format!("f{:03}.txt", base + i));
                    format!(
                        "<tool_call>{{\"name\": \"write_file\", \"arguments\": {{\"path\": {:?}, \"content\": \"v{}\"}}}}</tool_call>",
                        p.to_string_lossy(),
                        base + i
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            "All files written.".to_string()
        };
        Ok((0..n.max(1))
            .map(|_| Generation {
                prompt_ids: prompt.to_vec(),
                response_ids: out.bytes().map(u32::from).collect(),
                logprobs: vec![-0.1; out.len()],
                text: out.clone(),
                finish: FinishReason::Eos,
            })
            .collect())
    }
}

fn npm_server(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!(
        ".cache/mcp/node_modules/@modelcontextprotocol/server-{name}/dist/index.js"
    ));
    assert!(
        p.is_file(),
        "missing fixture {}: run scripts/fetch-fixtures",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        out.insert(
            e.file_name().to_string_lossy().into_owned(),
            std::fs::read(e.path()).unwrap(),
        );
    }
    out
}

async fn episode(mode: ModeChoice, dir: &Path) -> envace::engine::EpisodeOutcome {
    let cfg = McpServerConfig::stdio(
        "node",
        vec![npm_server("filesystem"), dir.to_string_lossy().into()],
    );
    let mut env = McpEnv::connect(cfg).await.unwrap();
    let tools = env.tools().await.unwrap();
    let spec = EpisodeSpec {
        task_id: None,
        system: "Write the files.".into(),
        user_turns: vec!["Write 100 files.".into()],
        tools,
        examples: Vec::new(),
    };
    let config = EpisodeConfig {
        max_turns: 12,
        approve: ApprovalPolicy::Always,
        ..EpisodeConfig::new(mode)
    };
    let model = share_model(Box::new(ScriptedPolicy {
        dir: dir.to_path_buf(),
        turn: 0,
    }));
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let mut sink = MemorySink::default();
    let io = EpisodeIo {
        env: EpisodeEnv::External(&mut env),
        sink: &mut sink,
        approver: &mut approver,
        ui: None,
        cancel: CancelToken::new(),
    };
    let policy = Policy {
        model: &model,
        profile: None,
    };
    let o = launch(policy, Episode::new(spec, None), &config, io)
        .await
        .unwrap();
    env.close().await.unwrap();
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rehearsed_writes_never_touch_the_directory_and_shadow_writes_do() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().canonicalize().unwrap();
    std::fs::write(d.join("keep.txt"), b"original").unwrap();
    let before = snapshot(&d);

    let o = episode(ModeChoice::Rehearse, &d).await;
    assert_eq!(
        o.trace.actions.len(),
        100,
        "the policy committed 100 calls: {:?}",
        o.end
    );
    assert!(o.trace.actions.iter().all(|a| a.name == "write_file"));
    assert!(
        o.score.is_none(),
        "an external server is never replayed to score a rehearsal"
    );
    assert_eq!(
        snapshot(&d),
        before,
        "a rehearsed call reached the real filesystem"
    );

    let o = episode(ModeChoice::Shadow, &d).await;
    assert_eq!(o.trace.actions.len(), 100);
    let after = snapshot(&d);
    assert_eq!(after.len(), 101);
    assert_eq!(after["f042.txt"], b"v42");
    assert_eq!(after["keep.txt"], b"original");
}
