//! The Models tab's state: model directories and GGUF files found under `models/` and the
//! user's data directory, remote (OpenAI-compatible) backends from `remotes.toml` in the config
//! directory with their health, the selection, and the process's memory use.

use std::path::{Path, PathBuf};

use super::app::Level;
use super::command::{TabCommand, TabContext};
use super::keymap::Action;

/// A model found on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEntry {
    pub path: PathBuf,
    /// `hf` (config.json + safetensors), `gguf`, or `remote` (`path` is then the model spec).
    pub format: &'static str,
    pub bytes: u64,
    /// A one-line description from config.json (architecture, size) when readable.
    pub detail: String,
}

/// The Models tab.
#[derive(Debug, Clone, Default)]
pub struct ModelsTab {
    pub entries: Vec<ModelEntry>,
    pub selected: usize,
    pub rss_mb: Option<f64>,
}

impl ModelsTab {
    pub fn selected_path(&self) -> Option<PathBuf> {
        self.entries.get(self.selected).map(|e| e.path.clone())
    }
    /// Handle an action while this tab is in front.
    pub fn handle(&mut self, a: Action, ctx: &TabContext) -> Vec<TabCommand> {
        match a {
            Action::LoadModel | Action::Confirm => match self.selected_path() {
                // The model does not change under a running episode or training.
                Some(_) if ctx.run_busy || ctx.train_busy => vec![TabCommand::notify(
                    Level::Warn,
                    "wait for the running episode / training",
                )],
                Some(p) => vec![TabCommand::LoadModel(p)],
                None => Vec::new(),
            },
            _ => {
                self.nav(a);
                Vec::new()
            }
        }
    }

    pub fn nav(&mut self, a: Action) {
        let n = self.entries.len();
        match a {
            Action::Down => self.selected = (self.selected + 1).min(n.saturating_sub(1)),
            Action::Up => self.selected = self.selected.saturating_sub(1),
            Action::Top => self.selected = 0,
            Action::Bottom => self.selected = n.saturating_sub(1),
            _ => {}
        }
    }
}

fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

fn describe(dir: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return String::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return "config.json does not parse".into();
    };
    let get = |k: &str| {
        v.get(k)
            .map(|x| x.to_string())
            .unwrap_or_else(|| "?".into())
    };
    format!(
        "{} · hidden {} · layers {} · vocab {}",
        v.get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .unwrap_or("?"),
        get("hidden_size"),
        get("num_hidden_layers"),
        get("vocab_size")
    )
}

/// Models under each root: directories with `config.json` and safetensors weights (also one
/// level down, e.g. `runs/grpo/final`), and `*.gguf` files.
pub fn scan_models(roots: &[PathBuf]) -> Vec<ModelEntry> {
    let mut out = Vec::new();
    let mut visit = |p: &Path| {
        if p.is_dir()
            && p.join("config.json").is_file()
            && (p.join("model.safetensors").is_file()
                || p.join("model.safetensors.index.json").is_file())
        {
            out.push(ModelEntry {
                path: p.to_path_buf(),
                format: "hf",
                bytes: dir_size(p),
                detail: describe(p),
            });
        } else if p.extension().is_some_and(|x| x == "gguf") {
            out.push(ModelEntry {
                path: p.to_path_buf(),
                format: "gguf",
                bytes: std::fs::metadata(p).map(|m| m.len()).unwrap_or(0),
                detail: "quantized GGUF (inference only)".into(),
            });
        }
    };
    for root in roots {
        let mut level1: Vec<PathBuf> = std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        level1.sort();
        for p in level1 {
            visit(&p);
            if p.is_dir() {
                let mut level2: Vec<PathBuf> = std::fs::read_dir(&p)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .collect();
                level2.sort();
                for q in level2 {
                    visit(&q);
                }
            }
        }
    }
    out
}

/// The remote backends file's name, in the config directory:
/// ```toml
/// [[remote]]
/// name = "llama-server"                     # shown in the list
/// model = "openai:http://127.0.0.1:8080/v1#smollm2&tokenizer=/models/smollm2.gguf"
/// ```
pub const REMOTES_FILE: &str = "remotes.toml";

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RemotesFile {
    #[serde(default)]
    remote: Vec<RemoteConfig>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoteConfig {
    name: String,
    model: String,
}

/// The remote backends of `file` (none when it does not exist), each checked: the spec parses
/// and the server answers `GET /v1/models` within a few seconds. Errors name the file and entry.
pub fn remote_entries(file: &Path) -> Result<Vec<ModelEntry>, String> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    let parsed: RemotesFile =
        toml::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut out = Vec::new();
    for (i, r) in parsed.remote.into_iter().enumerate() {
        if let Err(e) = crate::runtime::openai::RemoteSpec::parse(&r.model) {
            return Err(format!("{}: remote[{i}] ({}): {e}", file.display(), r.name));
        }
        // A short, single-try health check: the list must not wait on a dead server.
        let probe = format!("{}&timeout=3&retries=0", with_fragment(&r.model));
        let detail = match crate::runtime::openai::RemoteModel::served_models(&probe) {
            Ok(models) => format!("{} · up · serves {}", r.name, models.join(", ")),
            Err(e) => format!("{} · down · {e}", r.name),
        };
        out.push(ModelEntry {
            path: PathBuf::from(r.model),
            format: "remote",
            bytes: 0,
            detail,
        });
    }
    Ok(out)
}

/// `spec` with a `#` fragment, so that `&key=value` options can be appended.
fn with_fragment(spec: &str) -> String {
    if spec.contains('#') {
        spec.to_string()
    } else {
        format!("{spec}#")
    }
}

/// Whether a list entry is the loaded model (a remote entry's spec carries options the loaded
/// model's recorded path leaves out).
pub fn is_loaded(entry: &ModelEntry, loaded_path: &str) -> bool {
    if entry.format == "remote" {
        let spec = entry.path.to_string_lossy();
        return spec == loaded_path
            || spec
                .strip_prefix(loaded_path)
                .is_some_and(|rest| rest.starts_with('&'));
    }
    entry.path == Path::new(loaded_path)
}

/// Resident memory of this process in MiB (Linux `/proc`; `None` elsewhere).
pub fn rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_model_loads_while_an_episode_or_training_runs() {
        let mut t = ModelsTab {
            entries: vec![ModelEntry {
                path: PathBuf::from("models/other"),
                format: "hf",
                bytes: 0,
                detail: String::new(),
            }],
            ..ModelsTab::default()
        };
        for busy in [
            TabContext {
                run_busy: true,
                ..TabContext::ready()
            },
            TabContext {
                train_busy: true,
                ..TabContext::ready()
            },
        ] {
            assert!(matches!(
                t.handle(Action::LoadModel, &busy).as_slice(),
                [TabCommand::Notify(Level::Warn, _)]
            ));
        }
        assert_eq!(
            t.handle(Action::Confirm, &TabContext::ready()),
            vec![TabCommand::LoadModel(PathBuf::from("models/other"))]
        );
    }

    #[test]
    fn remotes_file_lists_backends_with_their_health() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join(REMOTES_FILE);
        assert_eq!(remote_entries(&f).unwrap(), vec![]);
        std::fs::write(
            &f,
            "[[remote]]\nname = \"down\"\nmodel = \"openai:http://127.0.0.1:9/v1#m\"\n",
        )
        .unwrap();
        let v = remote_entries(&f).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].format, "remote");
        assert!(
            v[0].detail
                .starts_with("down · down · http://127.0.0.1:9/v1/models"),
            "{}",
            v[0].detail
        );
        assert!(is_loaded(&v[0], "openai:http://127.0.0.1:9/v1#m"));
        std::fs::write(
            &f,
            "[[remote]]\nname = \"x\"\nmodel = \"openai:ftp://h#m\"\n",
        )
        .unwrap();
        let e = remote_entries(&f).unwrap_err();
        assert!(e.contains("remote[0] (x)") && e.contains("url"), "{e}");
        std::fs::write(&f, "[[remote]]\nname = \"x\"\nurl = \"y\"\n").unwrap();
        assert!(remote_entries(&f).unwrap_err().contains(REMOTES_FILE));
    }

    #[test]
    fn finds_the_bundled_model() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
        let v = scan_models(&[root]);
        let tiny = v.iter().find(|e| e.path.ends_with("envace-tiny")).unwrap();
        assert_eq!(tiny.format, "hf");
        assert!(tiny.detail.contains("layers"), "{}", tiny.detail);
        assert!(tiny.bytes > 1_000_000);
    }
}
