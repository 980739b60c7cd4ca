//! Renders a checkpoint's own Jinja chat template the way HF `apply_chat_template` does
//! (minijinja + pycompat, `trim_blocks`/`lstrip_blocks`, HF's `tojson`, `raise_exception`),
//! passing `messages`, `tools`, `add_generation_prompt` and `enable_thinking`. Models without a
//! template get ChatML with a Hermes-style tools section (the format our parsers read). A template
//! without a tools section would silently drop tools, calls and tool results; for those the
//! conversation is first rewritten by [`tool_format`](super::tool_format) (see [`ToolRendering`]).

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::Value;

use super::backend::RuntimeError;
use super::tool_format::{self, ToolRendering};
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

/// The compact ChatML templates, which differ only in how one tool of the list is printed.
macro_rules! compact_tools_template {
    ($tool:literal) => {
        concat!(
            r##"{%- set sys = messages[0].content if messages[0].role == 'system' else '' %}
{%- if sys or tools %}
{{- '<|im_start|>system\n' + sys }}
{%- if tools %}
{{- '\ntools:' }}
{%- for tool in tools %}
{%- set f = tool.function if tool.function is defined else tool %}
"##,
            $tool,
            r##"{%- endfor %}
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
"##
        )
    };
}

/// ChatML for small models trained by this project: tools are listed by name and parameter
/// names only (a tiny model learns the schemas from its training data; long schemas would
/// dominate its short context), calls are Hermes-style `<tool_call>` blocks on one line, tool
/// results get their own `tool` turn.
pub const COMPACT_TOOLS_TEMPLATE: &str = compact_tools_template!(
    r##"{{- ' ' + f.name + '(' + ((f.parameters.properties | list) if f.parameters is defined and f.parameters.properties is defined else []) | join(',') + ')' }}
"##
);

/// [`COMPACT_TOOLS_TEMPLATE`] with optional parameters marked: `read_file(path,tail?,head?)`.
/// For models fine-tuned here to act on tools they never saw (an MCP server's), which must
/// tell the arguments they have to give from the ones they may leave out.
pub const COMPACT_TOOLS_TEMPLATE_V2: &str = compact_tools_template!(
    r##"{%- set props = (f.parameters.properties | list) if f.parameters is defined and f.parameters.properties is defined else [] %}
{%- set req = f.parameters.required if f.parameters is defined and f.parameters.required is defined else [] %}
{{- ' ' + f.name + '(' }}
{%- for p in props %}
{{- (',' if not loop.first else '') + p + ('' if p in req else '?') }}
{%- endfor %}
{{- ')' }}
"##
);

/// A compiled chat template plus the special tokens it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
    /// True when the model had no template and ChatML is used.
    pub is_fallback: bool,
    /// How tools reach the model: through the template's own tools section, or written into
    /// the messages when the template has none. Detected by [`ChatTemplate::new`].
    pub tool_rendering: ToolRendering,
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
        let tool_rendering = detect_tool_rendering(&env, source)?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            is_fallback: false,
            tool_rendering,
        })
    }

    /// Override the detected [`ToolRendering`].
    pub fn with_tool_rendering(mut self, rendering: ToolRendering) -> Self {
        self.tool_rendering = rendering;
        self
    }

    /// The ChatML fallback.
    pub fn chatml() -> Self {
        let mut t =
            Self::new(CHATML_TOOLS_TEMPLATE, "", "<|im_end|>").unwrap_or_else(unreachable_template);
        t.is_fallback = true;
        t
    }

    /// Render a conversation. With [`ToolRendering::Template`] the template gets `tools`;
    /// otherwise the messages are rewritten (tools in the system message, calls in the assistant
    /// content, tool results as user turns) and rendered with no `tools`.
    pub fn render(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, RuntimeError> {
        match self.tool_rendering {
            ToolRendering::Template => {
                self.render_raw(messages, tools, add_generation_prompt, enable_thinking)
            }
            r => {
                let rewritten = tool_format::rewrite_messages(r, messages, tools);
                self.render_raw(&rewritten, &[], add_generation_prompt, enable_thinking)
            }
        }
    }

    /// Render exactly what the template is given.
    fn render_raw(
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

/// `Template` when the template reads the `tools` variable (static analysis; a word search when
/// the analysis finds no variable at all), else `SystemSmolLM2` for SmolLM templates, else
/// `SystemHermes`.
fn detect_tool_rendering(
    env: &Environment<'_>,
    source: &str,
) -> Result<ToolRendering, RuntimeError> {
    let tmpl = env
        .get_template("chat")
        .map_err(|e| RuntimeError::Template(e.to_string()))?;
    let vars = tmpl.undeclared_variables(true);
    let reads_tools = if vars.is_empty() {
        mentions_word(source, "tools")
    } else {
        vars.iter().any(|v| v == "tools" || v.starts_with("tools."))
    };
    Ok(if reads_tools {
        ToolRendering::Template
    } else if source.contains("SmolLM") {
        ToolRendering::SystemSmolLM2
    } else {
        ToolRendering::SystemHermes
    })
}

/// `word` in `text` with no identifier character on either side.
fn mentions_word(text: &str, word: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{MessageToolCall, ToolCall};
    use serde_json::json;

    /// SmolLM2-135M-Instruct's template, as its GGUF carries it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    /// ChatML with no tools section and no default system prompt.
    const PLAIN_CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather; answers <json> & more", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "list_files", "description": "List a directory", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]}}}),
        ]
    }

    fn conversation(system: bool) -> Vec<Message> {
        let call = |id: &str, name: &str, arguments: Value| MessageToolCall {
            id: id.into(),
            kind: "function".into(),
            function: ToolCall {
                name: name.into(),
                arguments,
            },
        };
        let mut a = Message::assistant("");
        a.tool_calls = vec![
            call("c1", "get_weather", json!({"city": "Zürich"})),
            call("c2", "list_files", json!({"path": "/tmp", "limit": 2})),
        ];
        let mut msgs = vec![
            Message::user("Weather in Zürich, and what is in /tmp?"),
            a,
            Message::tool("c1", "get_weather", "{\"temp_c\": 21}"),
            Message::tool("c2", "list_files", "[\"a.txt\", \"b.txt\"]"),
            Message::assistant("21 °C; /tmp holds a.txt and b.txt."),
            Message::user("Thanks. And Bern?"),
        ];
        let mut b = Message::assistant("Checking.");
        b.tool_calls = vec![call("c3", "get_weather", json!({"city": "Bern"}))];
        msgs.push(b);
        msgs.push(Message::tool("c3", "get_weather", "{\"temp_c\": 19}"));
        msgs.push(Message::assistant("19 °C."));
        if system {
            msgs.insert(0, Message::system("You are a careful assistant."));
        }
        msgs
    }

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, "", "<|im_end|>").unwrap()
    }

    #[test]
    fn builtin_templates_take_tools_through_the_template() {
        assert_eq!(
            template(CHATML_TOOLS_TEMPLATE).tool_rendering,
            ToolRendering::Template
        );
        assert_eq!(
            template(COMPACT_TOOLS_TEMPLATE).tool_rendering,
            ToolRendering::Template
        );
        assert_eq!(
            ChatTemplate::chatml().tool_rendering,
            ToolRendering::Template
        );
    }

    #[test]
    fn templates_without_tools_section_detect_a_system_rendering() {
        assert_eq!(
            template(SMOLLM2).tool_rendering,
            ToolRendering::SystemSmolLM2
        );
        assert_eq!(
            template(PLAIN_CHATML).tool_rendering,
            ToolRendering::SystemHermes
        );
        // `tools` only in text is not a read of the variable.
        let prose = "{{ 'no tools here' }}{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(template(prose).tool_rendering, ToolRendering::SystemHermes);
        let nested = "{% for t in tools.items %}{{ t }}{% endfor %}{{ messages }}";
        assert_eq!(template(nested).tool_rendering, ToolRendering::Template);
    }

    #[test]
    fn word_search_fallback_needs_a_whole_word() {
        assert!(mentions_word("{% if tools %}", "tools"));
        assert!(!mentions_word("{{ my_tools }} toolset", "tools"));
    }

    #[test]
    fn with_tool_rendering_overrides_detection() {
        let t = template(SMOLLM2).with_tool_rendering(ToolRendering::SystemHermes);
        assert_eq!(t.tool_rendering, ToolRendering::SystemHermes);
        let out = t.render(&conversation(true), &tools(), true, true).unwrap();
        assert!(out.contains("# Tools\n\nYou may call one or more functions"));
    }

    #[test]
    fn system_hermes_through_plain_chatml_matches_the_builtin_tools_template() {
        let builtin = template(CHATML_TOOLS_TEMPLATE);
        let plain = template(PLAIN_CHATML);
        assert_eq!(plain.tool_rendering, ToolRendering::SystemHermes);
        for system in [true, false] {
            let msgs = conversation(system);
            // From one message on: the built-in template reads `messages[0]`.
            for k in 1..=msgs.len() {
                for gen_prompt in [true, false] {
                    let want = builtin
                        .render(&msgs[..k], &tools(), gen_prompt, true)
                        .unwrap();
                    let got = plain
                        .render(&msgs[..k], &tools(), gen_prompt, true)
                        .unwrap();
                    assert_eq!(got, want, "system={system} k={k} gen={gen_prompt}");
                }
            }
        }
    }

    #[test]
    fn smollm2_prompt_shows_tools_calls_and_results_as_turns_it_knows() {
        let out = template(SMOLLM2)
            .render(&conversation(true), &tools(), false, true)
            .unwrap();
        assert!(out.starts_with("<|im_start|>system\nYou are a careful assistant.\n\nYou are an expert in composing functions."));
        assert!(out.contains("<tools>[{\"name\": \"get_weather\", \"description\": \"Current weather; answers <json> & more\""));
        assert!(out.contains("<|im_start|>assistant\n<tool_call>[\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}},\n{\"name\": \"list_files\", \"arguments\": {\"path\": \"/tmp\", \"limit\": 2}}\n]</tool_call><|im_end|>"));
        assert!(out.contains("<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\n[\"a.txt\", \"b.txt\"]\n</tool_response><|im_end|>"));
        assert!(out.contains("<|im_start|>assistant\nChecking.\n<tool_call>[\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n]</tool_call>"));
        assert!(!out.contains("<|im_start|>tool"));
        assert!(!out.contains("helpful AI assistant named SmolLM"));
    }

    #[test]
    fn conversations_without_tools_render_as_before() {
        let msgs = [
            Message::system("s"),
            Message::user("q"),
            Message::assistant("a"),
        ];
        for src in [SMOLLM2, PLAIN_CHATML] {
            let t = template(src);
            for r in ToolRendering::ALL {
                let t2 = template(src).with_tool_rendering(r);
                for k in 0..=msgs.len() {
                    assert_eq!(
                        t2.render(&msgs[..k], &[], true, true).unwrap(),
                        t.render_raw(&msgs[..k], &[], true, true).unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn every_rendering_is_prefix_stable_at_assistant_turns() {
        for r in ToolRendering::ALL {
            let src = if r == ToolRendering::Template {
                CHATML_TOOLS_TEMPLATE
            } else {
                SMOLLM2
            };
            let t = template(src).with_tool_rendering(r);
            for system in [true, false] {
                let msgs = conversation(system);
                let full = t.render(&msgs, &tools(), false, true).unwrap();
                for k in 0..msgs.len() {
                    // A tool result followed by another is merged into the same user turn by
                    // Hermes-style formats, so prefixes are only promised at assistant turns.
                    if msgs[k].role == crate::message::Role::Assistant {
                        let next = t.render(&msgs[..=k], &tools(), false, true).unwrap();
                        let later = t.render(&msgs[..=k], &tools(), true, true).unwrap();
                        let prompt = t.render(&msgs[..k], &tools(), true, true).unwrap();
                        assert!(next.starts_with(&prompt), "{r} system={system} k={k}");
                        assert!(later.starts_with(&prompt), "{r} system={system} k={k}");
                        assert!(full.starts_with(&prompt), "{r} system={system} k={k}");
                    }
                }
            }
        }
    }
}
