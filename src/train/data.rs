//! Training data from collected session files (`envace train sft --sessions GLOB`).
//!
//! Every generation a session recorded is a row with its exact prompt ids, response ids and
//! loss mask (`session::training_rows`); this module picks the rows worth imitating:
//! - main-line rows only: Private Rehearsal branches are imagined futures, never executed;
//! - actor rows of episodes whose reward is at least `min_reward` (unscored episodes never);
//! - simulator rows whose call also reached the real environment (shadow mode) are relabelled
//!   with the real response, rendered as the simulator writes it
//!   (`<execution_result>JSON</execution_result>` + `<|im_end|>`, as in pretraining), and kept
//!   whatever the episode's reward: the environment's answer is right even when the actor
//!   failed. Other simulator rows (rehearse mode: no real answer) follow the reward filter.
//!
//! A glob that matches nothing and a session that cannot be read are errors naming the pattern
//! or the file.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::TrainError;
use super::model::Example;
use crate::engine::types::GenRole;
use crate::runtime::tokenizer::Tokenizer;
use crate::session::{EventBody, read_session, training_rows};

/// Which rows to train on.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionDataOptions {
    pub roles: Vec<GenRole>,
    pub min_reward: f64,
}

impl Default for SessionDataOptions {
    fn default() -> Self {
        Self {
            roles: vec![GenRole::Actor, GenRole::Simulator],
            min_reward: 1.0,
        }
    }
}

/// Parse `actor,simulator`.
pub fn parse_roles(s: &str) -> Result<Vec<GenRole>, TrainError> {
    let mut out = Vec::new();
    for r in s.split(',').map(str::trim).filter(|r| !r.is_empty()) {
        let role = match r {
            "actor" => GenRole::Actor,
            "simulator" => GenRole::Simulator,
            other => {
                return Err(TrainError::Data(format!(
                    "--roles: `{other}` (expected actor and/or simulator)"
                )));
            }
        };
        if !out.contains(&role) {
            out.push(role);
        }
    }
    if out.is_empty() {
        return Err(TrainError::Data("--roles: no role given".into()));
    }
    Ok(out)
}

/// What was read and kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SessionDataStats {
    pub files: usize,
    /// Episodes whose reward passed `min_reward`.
    pub episodes_passing: usize,
    pub actor_rows: usize,
    pub simulator_rows: usize,
    /// Simulator rows whose target is the real environment's response.
    pub simulator_relabelled: usize,
    pub skipped_branch_rows: usize,
    pub skipped_low_reward_rows: usize,
    pub skipped_role_rows: usize,
    pub trained_tokens: usize,
}

/// The examples and how they were chosen.
#[derive(Debug, Clone)]
pub struct SessionData {
    pub examples: Vec<Example>,
    pub stats: SessionDataStats,
}

/// Build SFT examples from session files (see the module docs for the selection). `tok` is
/// the trained model's tokenizer (only used to render relabelled simulator targets).
pub fn session_examples(
    files: &[PathBuf],
    opts: &SessionDataOptions,
    tok: &Tokenizer,
) -> Result<SessionData, TrainError> {
    let mut stats = SessionDataStats {
        files: files.len(),
        ..Default::default()
    };
    let mut examples = Vec::new();
    let end = tok.token_to_id("<|im_end|>");
    for f in files {
        let s = read_session(f)
            .map_err(|e| TrainError::Data(format!("{}: cannot read session: {e}", f.display())))?;
        let real: HashMap<&str, serde_json::Value> = s
            .events
            .iter()
            .filter_map(|e| match &e.event {
                EventBody::Real {
                    call_id, response, ..
                } => Some((call_id.as_str(), response.to_json())),
                _ => None,
            })
            .collect();
        // Generations with their call ids, in the order training_rows lists them.
        let call_ids: Vec<Option<&str>> = s
            .events
            .iter()
            .filter_map(|e| match &e.event {
                EventBody::Generation(g) => Some(g.call_id.as_deref()),
                _ => None,
            })
            .collect();
        let rows = training_rows(&s.events);
        let passing = rows
            .first()
            .and_then(|r| r.reward)
            .is_some_and(|r| r >= opts.min_reward);
        if passing {
            stats.episodes_passing += 1;
        }
        for (row, call_id) in rows.into_iter().zip(call_ids) {
            if row.branch.is_some() {
                stats.skipped_branch_rows += 1;
                continue;
            }
            if !opts.roles.contains(&row.role) {
                stats.skipped_role_rows += 1;
                continue;
            }
            let relabel = match (row.role, call_id) {
                (GenRole::Simulator, Some(c)) => real.get(c),
                _ => None,
            };
            let (response, mask): (Vec<u32>, Vec<f32>) = match relabel {
                Some(v) => {
                    let mut ids = tok.encode(&crate::engine::parse::execution_result(v))?;
                    ids.extend(end);
                    let n = ids.len();
                    stats.simulator_relabelled += 1;
                    (ids, vec![1.0; n])
                }
                None if passing => (
                    row.response_ids.clone(),
                    row.loss_mask.iter().map(|&m| f32::from(m)).collect(),
                ),
                None => {
                    stats.skipped_low_reward_rows += 1;
                    continue;
                }
            };
            match row.role {
                GenRole::Actor => stats.actor_rows += 1,
                GenRole::Simulator => stats.simulator_rows += 1,
            }
            let mut ids = row.prompt_ids.clone();
            let mut m = vec![0.0; ids.len()];
            ids.extend(response);
            m.extend(mask);
            let ex = Example { ids, mask: m };
            stats.trained_tokens += ex.trained_tokens();
            if ex.trained_tokens() > 0 {
                examples.push(ex);
            }
        }
    }
    Ok(SessionData { examples, stats })
}

fn has_wildcard(s: &str) -> bool {
    s.contains(['*', '?'])
}

/// `*` (any run of characters) and `?` (one character) against a file name.
fn wildcard_match(pattern: &[char], name: &[char]) -> bool {
    let (mut p, mut n) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while n < name.len() {
        if p < pattern.len() && (pattern[p] == '?' || pattern[p] == name[n]) {
            p += 1;
            n += 1;
        } else if p < pattern.len() && pattern[p] == '*' {
            star = Some(p);
            mark = n;
            p += 1;
        } else if let Some(s) = star {
            p = s + 1;
            mark += 1;
            n = mark;
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// Session files named by `pattern`: a file; a directory (its `*.jsonl` files); or a glob with
/// `*` and `?` in any path component (hidden entries only when the component starts with `.`).
/// Sorted. Matching nothing is an error naming the pattern.
pub fn expand_glob(pattern: &str) -> Result<Vec<PathBuf>, TrainError> {
    let none = || TrainError::Data(format!("--sessions `{pattern}` matches no session files"));
    let path = Path::new(pattern);
    if !has_wildcard(pattern) {
        if path.is_file() {
            return Ok(vec![path.to_path_buf()]);
        }
        if path.is_dir() {
            let rd = std::fs::read_dir(path)
                .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
            let mut out: Vec<PathBuf> = rd
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "jsonl"))
                .collect();
            out.sort();
            return if out.is_empty() { Err(none()) } else { Ok(out) };
        }
        return Err(none());
    }
    let mut current: Vec<PathBuf> = vec![PathBuf::new()];
    for comp in path.components() {
        let part = comp.as_os_str().to_string_lossy().to_string();
        let wild = matches!(comp, Component::Normal(_)) && has_wildcard(&part);
        if !wild {
            for c in current.iter_mut() {
                c.push(&part);
            }
            continue;
        }
        let pat: Vec<char> = part.chars().collect();
        let mut next = Vec::new();
        for dir in &current {
            let rd = if dir.as_os_str().is_empty() {
                std::fs::read_dir(".")
            } else {
                std::fs::read_dir(dir)
            };
            let Ok(rd) = rd else { continue };
            let mut names: Vec<String> = rd
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.') || part.starts_with('.'))
                .filter(|n| wildcard_match(&pat, &n.chars().collect::<Vec<_>>()))
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        current = next;
    }
    let mut out: Vec<PathBuf> = current.into_iter().filter(|p| p.is_file()).collect();
    out.sort();
    out.dedup();
    if out.is_empty() { Err(none()) } else { Ok(out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, n: &str) -> bool {
        wildcard_match(
            &p.chars().collect::<Vec<_>>(),
            &n.chars().collect::<Vec<_>>(),
        )
    }

    #[test]
    fn wildcards_match_like_a_shell() {
        assert!(m("*.jsonl", "bank-success.jsonl"));
        assert!(m("bank-*.jsonl", "bank-a.jsonl"));
        assert!(m("b?nk*", "bank"));
        assert!(!m("*.jsonl", "README.md"));
        assert!(!m("bank-*.jsonl", "retail-a.jsonl"));
        assert!(m("*", ""));
        assert!(m("a*b*c", "axxbyyc"));
        assert!(!m("a*b*c", "axxbyy"));
    }

    #[test]
    fn roles_parse_and_reject_unknown_names() {
        assert_eq!(
            parse_roles("simulator, actor").ok(),
            Some(vec![GenRole::Simulator, GenRole::Actor])
        );
        assert!(parse_roles("critic").is_err());
        assert!(parse_roles("").is_err());
    }
}
