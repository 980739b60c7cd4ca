//! Renders a checkpoint's own Jinja chat template the way HF `apply_chat_template` does
//! (minijinja + pycompat, `trim_blocks`/`lstrip_blocks`, HF's `tojson`, `raise_exception`),
//! passing `messages`, `tools`, `add_generation_prompt` and `enable_thinking`. Models without a
//! template get ChatML with a Hermes-style tools section (the format our parsers read).

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::Value;

use super::backend::RuntimeError;
use crate::message::Message;

/// ChatML with Qwen2.5-style tool instructions; used when a model ships no template and by the
/// models this project trains.
pub const CHATML_TOOLS_TEMPLATE: &str = r##"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}
{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\n' + message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

/// ChatML for small models trained by this project: tools are listed by name and parameter
/// names only (a tiny model learns the schemas from its training data; long schemas would
/// dominate its short context), calls are Hermes-style `<tool_call>` blocks on one line, tool
/// results get their own `tool` turn.
pub const COMPACT_TOOLS_TEMPLATE: &str = r##"{%- set sys = messages[0].content if messages[0].role == 'system' else '' %}
{%- if sys or tools %}
{{- '<|im_start|>system\n' + sys }}
{%- if tools %}
{{- '\ntools:' }}
{%- for tool in tools %}
{%- set f = tool.function if tool.function is defined else tool %}
{{- ' ' + f.name + '(' + ((f.parameters.properties | list) if f.parameters is defined and f.parameters.properties is defined else []) | join(',') + ')' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}
{%- set c = tool_call.function if tool_call.function is defined else tool_call %}
{{- '<tool_call>{"name": "' + c.name + '", "arguments": ' + (c.arguments | tojson) + '}</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"##;

/// A compiled chat template plus the special tokens it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
    /// True when the model had no template and ChatML is used.
    pub is_fallback: bool,
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False)` in insertion order, optional `indent`.
fn tojson(value: &JValue, kwargs: Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let v: Value = serde_json::to_value(value)
        .map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let s = match indent {
        Some(n) => {
            let ind = " ".repeat(n);
            let fmt = serde_json::ser::PrettyFormatter::with_indent(ind.as_bytes());
            let mut buf = Vec::new();
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            serde::Serialize::serialize(&v, &mut ser)
                .map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
            String::from_utf8_lossy(&buf).into_owned()
        }
        None => python_json(&v),
    };
    Ok(JValue::from_safe_string(s))
}

/// `json.dumps` default separators: `", "` and `": "`.
pub fn python_json(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let parts: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_json(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
        Value::Array(a) => {
            let parts: Vec<String> = a.iter().map(python_json).collect();
            format!("[{}]", parts.join(", "))
        }
        other => other.to_string(),
    }
}

impl ChatTemplate {
    /// Compile a template source.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, RuntimeError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| RuntimeError::Template(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, JError> {
            Err(JError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            chrono::Local::now().format(&fmt).to_string()
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| RuntimeError::Template(format!("does not compile: {e}")))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            is_fallback: false,
        })
    }

    /// The ChatML fallback.
    pub fn chatml() -> Self {
        let mut t =
            Self::new(CHATML_TOOLS_TEMPLATE, "", "<|im_end|>").unwrap_or_else(unreachable_template);
        t.is_fallback = true;
        t
    }

    /// Render a conversation.
    pub fn render(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, RuntimeError> {
        let msgs =
            serde_json::to_value(messages).map_err(|e| RuntimeError::Template(e.to_string()))?;
        let tools_v = if tools.is_empty() {
            JValue::from(())
        } else {
            JValue::from(minijinja::value::Serde(tools))
        };
        let ctx = minijinja::context! {
            messages => JValue::from(minijinja::value::Serde(&msgs)),
            tools => tools_v,
            add_generation_prompt => add_generation_prompt,
            enable_thinking => enable_thinking,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        };
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(ctx).map_err(|e| {
            let mut msg = format!("render failed: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            RuntimeError::Template(msg)
        })
    }
}

#[allow(clippy::panic)]
fn unreachable_template(e: RuntimeError) -> ChatTemplate {
    // The built-in template is a compile-time constant covered by tests.
    panic!("built-in ChatML template failed to compile: {e}")
}

/// Read `chat_template` (string, or list of named templates: `default` / `tool_use`) and the
/// special tokens from a `tokenizer_config.json` value.
pub fn from_tokenizer_config(v: &Value) -> Option<(String, String, String)> {
    let tok = |k: &str| -> String {
        match v.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            _ => String::new(),
        }
    };
    let src = match v.get("chat_template")? {
        Value::String(s) => s.clone(),
        Value::Array(list) => {
            let find = |name: &str| {
                list.iter().find_map(|e| {
                    (e.get("name").and_then(Value::as_str) == Some(name))
                        .then(|| {
                            e.get("template")
                                .and_then(Value::as_str)
                                .map(str::to_string)
                        })
                        .flatten()
                })
            };
            find("tool_use").or_else(|| find("default"))?
        }
        _ => return None,
    };
    Some((src, tok("bos_token"), tok("eos_token")))
}
