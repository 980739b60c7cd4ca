//! The `openai:` model spec: the server's URL, the served model's name and the `&key=value`
//! options (tokenizer, API, key variable, timeouts, retries, tool rendering, prompt cache), parsed
//! once with errors naming the option.

use std::path::PathBuf;
use std::time::Duration;

use super::SCHEME;
use crate::runtime::backend::RuntimeError;
use crate::runtime::tool_format::ToolRendering;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`: the server renders the chat.
    Chat,
    /// `/v1/completions` with token ids rendered and encoded here.
    Completions,
}

/// A parsed `openai:` model spec.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSpec {
    /// The API root, e.g. `http://127.0.0.1:8080/v1` (no trailing slash).
    pub base_url: String,
    /// The served model's name; `None` takes the first one `/v1/models` lists.
    pub model_name: Option<String>,
    /// A local `.gguf`, HF or adapter directory whose tokenizer and chat template render prompts.
    pub tokenizer: Option<PathBuf>,
    pub api: Api,
    /// The environment variable holding the API key.
    pub key_env: String,
    /// Whether `key_env` was named explicitly (then it must be set).
    pub key_required: bool,
    /// Longest wait for the response headers, or between two streamed chunks.
    pub timeout: Duration,
    /// Retries of a request that failed before it streamed anything.
    pub retries: u32,
    /// Chat API only: render the tools into the system message in this format instead of
    /// passing `tools` (for servers whose template drops them, e.g. SmolLM2's).
    pub tool_rendering: Option<ToolRendering>,
    /// llama.cpp's `cache_prompt` (`None`: the server's default, on). Off, every prompt is
    /// processed whole, so greedy results do not depend on what the slot held before (with the
    /// cache, llama.cpp's server can answer the same prompt differently on a second request).
    pub cache_prompt: Option<bool>,
}

impl RemoteSpec {
    /// Parse `openai:URL[#MODEL_NAME][&key=value…]`. Options: `tokenizer=PATH`,
    /// `api=completions|chat`, `key_env=VAR`, `timeout=SECONDS`, `retries=N`,
    /// `tools=hermes|smollm2|server` (chat API), `cache_prompt=true|false` (llama.cpp). Errors
    /// name the option.
    pub fn parse(spec: &str) -> Result<Self, RuntimeError> {
        let err = |field: &str, message: String| RuntimeError::Field {
            path: spec.to_string(),
            field: field.to_string(),
            message,
        };
        let rest = spec.strip_prefix(SCHEME).ok_or_else(|| {
            err(
                "scheme",
                format!("a remote model spec starts with `{SCHEME}`"),
            )
        })?;
        let (url, fragment) = match rest.split_once('#') {
            Some((u, f)) => (u, Some(f)),
            None => (rest, None),
        };
        let base_url = url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base_url)
            .map_err(|e| err("url", format!("`{base_url}` is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(err(
                "url",
                format!("`{base_url}`: expected http:// or https://"),
            ));
        }
        let mut out = Self {
            base_url,
            model_name: None,
            tokenizer: None,
            api: Api::Chat,
            key_env: "OPENAI_API_KEY".into(),
            key_required: false,
            timeout: Duration::from_secs(120),
            retries: 3,
            tool_rendering: None,
            cache_prompt: None,
        };
        let mut api = None;
        if let Some(fragment) = fragment {
            let mut parts = fragment.split('&');
            let name = parts.next().unwrap_or_default();
            if !name.is_empty() {
                out.model_name = Some(name.to_string());
            }
            for part in parts.filter(|p| !p.is_empty()) {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| err(part, "expected key=value".into()))?;
                match k {
                    "tokenizer" => out.tokenizer = Some(PathBuf::from(v)),
                    "api" => {
                        api = Some(match v {
                            "chat" => Api::Chat,
                            "completions" => Api::Completions,
                            _ => {
                                return Err(err(
                                    k,
                                    format!("`{v}` (expected chat or completions)"),
                                ));
                            }
                        })
                    }
                    "key_env" => {
                        out.key_env = v.to_string();
                        out.key_required = true;
                    }
                    "timeout" => {
                        let s: f64 = v
                            .parse()
                            .ok()
                            .filter(|s: &f64| *s > 0.0 && s.is_finite())
                            .ok_or_else(|| err(k, format!("`{v}` (expected seconds > 0)")))?;
                        out.timeout = Duration::from_secs_f64(s);
                    }
                    "retries" => {
                        out.retries = v
                            .parse()
                            .map_err(|_| err(k, format!("`{v}` (expected a count)")))?
                    }
                    "tools" => {
                        out.tool_rendering = match v {
                            "hermes" | "system-hermes" => Some(ToolRendering::SystemHermes),
                            "smollm2" | "system-smollm2" => Some(ToolRendering::SystemSmolLM2),
                            "server" | "template" => None,
                            _ => {
                                return Err(err(
                                    k,
                                    format!("`{v}` (expected hermes, smollm2 or server)"),
                                ));
                            }
                        }
                    }
                    "cache_prompt" => {
                        out.cache_prompt = Some(match v {
                            "true" => true,
                            "false" => false,
                            _ => return Err(err(k, format!("`{v}` (expected true or false)"))),
                        })
                    }
                    _ => {
                        return Err(err(
                            k,
                            "unknown option (known: tokenizer, api, key_env, timeout, retries, tools, cache_prompt)"
                                .into(),
                        ));
                    }
                }
            }
        }
        out.api = match (api, &out.tokenizer) {
            (Some(Api::Completions), None) => {
                return Err(err(
                    "api",
                    "completions renders prompts locally: add &tokenizer=PATH (a .gguf, HF or adapter directory)".into(),
                ));
            }
            (Some(a), _) => a,
            (None, Some(_)) => Api::Completions,
            (None, None) => Api::Chat,
        };
        if out.api == Api::Completions && out.tool_rendering.is_some() {
            return Err(err(
                "tools",
                "only for api=chat (with a tokenizer, the local template decides)".into(),
            ));
        }
        Ok(out)
    }

    /// The spec as recorded in sessions: URL and model name, no options that hold paths or keys.
    pub fn display(&self, model_name: &str) -> String {
        format!("{SCHEME}{}#{model_name}", self.base_url)
    }

    pub(super) fn endpoint(&self, path: &str) -> String {
        format!("{}/{path}", self.base_url)
    }
}

#[cfg(test)]
mod tests {
    // Tests may unwrap: a panic is the failure report.
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::path::Path;

    #[test]
    fn spec_parses_url_name_and_options() {
        let s = RemoteSpec::parse("openai:http://127.0.0.1:8080/v1/#smollm2&retries=1&timeout=2.5")
            .unwrap();
        assert_eq!(s.base_url, "http://127.0.0.1:8080/v1");
        assert_eq!(s.model_name.as_deref(), Some("smollm2"));
        assert_eq!(s.api, Api::Chat);
        assert_eq!(s.retries, 1);
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert_eq!(
            s.display("smollm2"),
            "openai:http://127.0.0.1:8080/v1#smollm2"
        );
        let s = RemoteSpec::parse("openai:https://h/v1#m&tokenizer=models/x.gguf").unwrap();
        assert_eq!(s.api, Api::Completions);
        assert_eq!(s.tokenizer.as_deref(), Some(Path::new("models/x.gguf")));
        let s = RemoteSpec::parse("openai:http://h:1/v1").unwrap();
        assert_eq!(s.model_name, None);
    }

    #[test]
    fn spec_errors_name_the_option() {
        for (spec, field) in [
            ("openai:ftp://h/v1#m", "url"),
            ("openai:not a url#m", "url"),
            ("openai:http://h/v1#m&api=completions", "api"),
            ("openai:http://h/v1#m&api=rest", "api"),
            ("openai:http://h/v1#m&timeout=0", "timeout"),
            ("openai:http://h/v1#m&retries=x", "retries"),
            ("openai:http://h/v1#m&colour=red", "colour"),
            ("openai:http://h/v1#m&tools=xml", "tools"),
            ("openai:http://h/v1#m&cache_prompt=no", "cache_prompt"),
            (
                "openai:http://h/v1#m&tokenizer=t.gguf&tools=hermes",
                "tools",
            ),
        ] {
            match RemoteSpec::parse(spec) {
                Err(RuntimeError::Field { field: f, .. }) => assert_eq!(f, field, "{spec}"),
                other => panic!("{spec}: {other:?}"),
            }
        }
    }
}
