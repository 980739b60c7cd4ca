//! Tool drills: short episodes with made-up tools, for the supervised corpus of a model that
//! must act on tools it was never trained on (an MCP server's, BFCL's).
//!
//! The built-in domains have 8–10 fixed tools each; a model fine-tuned on them alone learns those
//! names and argument shapes, not how to read a tool list: on the filesystem MCP server it called
//! `read_file` with both optional line limits set (every parameter it saw listed), and never
//! `list_directory`. Each drill draws a fresh set of 3–6 tools (`verb_object` names from a small
//! vocabulary, a key parameter, extra required parameters, optional ones), a request that names
//! the target tool's action and every value to pass (optional parameters only when the request
//! mentions them), the gold call or calls (two in parallel when the request names two objects),
//! a response (an MCP-style `{"content": …}` text, a JSON object, or an error) and an answer that
//! copies from the response. Some requests need no tool at all (nothing listed fits): the answer
//! says so without a call. Everything is seeded: the same seed gives the same drill.
//!
//! It must never draw values from the test split's held-out pools (random letter strings are
//! checked against them, as the copy drills' are).

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::env::{ToolAnnotations, ToolSpec};
use crate::message::{Message, MessageToolCall, ToolCall};

/// One drill: the conversation (system, user, assistant with calls, tool results, answer — or
/// system, user, answer when no tool fits), its tools, and the gold calls with their responses.
#[derive(Debug, Clone, PartialEq)]
pub struct Drill {
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    /// (call, response) in the order the assistant made them; empty when no tool fits.
    pub calls: Vec<(ToolCall, Value)>,
}

/// Objects a tool acts on, with the name of their key parameter.
const OBJECTS: &[(&str, &str)] = &[
    ("file", "path"),
    ("note", "title"),
    ("ticket", "ticket_id"),
    ("order", "order_id"),
    ("user", "username"),
    ("event", "event_id"),
    ("contact", "name"),
    ("task", "task_id"),
    ("song", "title"),
    ("playlist", "name"),
    ("device", "device_id"),
    ("message", "message_id"),
    ("invoice", "invoice_id"),
    ("report", "name"),
    ("booking", "booking_id"),
    ("repo", "repo"),
    ("branch", "branch"),
    ("folder", "path"),
    ("issue", "issue_id"),
    ("project", "project"),
];

/// Verbs that read (`read_only`) and verbs that change state (`destructive`).
const READ_VERBS: &[&str] = &["get", "read", "show", "find", "check", "describe"];
const WRITE_VERBS: &[&str] = &[
    "create", "delete", "update", "rename", "archive", "cancel", "send", "add", "move", "close",
];

/// How a drill names its tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DrillStyle {
    /// `verb_object`, the verb the request uses (3–6 tools): the name can be read off the
    /// request.
    #[default]
    Named,
    /// 5–14 tools named with a synonym of the request's verb (`write_file` for "create the
    /// file"), sometimes with a suffix (`fetch_note_info`), at most one read tool per object:
    /// the name must be looked up in the tool list, as on a real MCP server.
    Listed,
}

/// Synonyms a listed-style tool name uses for the request's verb (disjoint sets, so that two
/// tools never answer the same request).
const ALIASES: &[(&str, &[&str])] = &[
    (
        "read",
        &[
            "get", "read", "fetch", "view", "show", "lookup", "inspect", "describe",
        ],
    ),
    ("create", &["create", "write", "make", "new"]),
    ("add", &["add", "attach", "append", "insert"]),
    ("delete", &["delete", "remove", "drop", "erase"]),
    ("update", &["update", "edit", "modify", "patch"]),
    ("rename", &["rename", "relabel", "retitle"]),
    ("move", &["move", "relocate", "transfer"]),
    ("archive", &["archive", "store", "stash"]),
    ("cancel", &["cancel", "abort", "void"]),
    ("send", &["send", "deliver", "dispatch", "post"]),
    ("close", &["close", "resolve", "finish", "complete"]),
];

/// Suffixes a listed-style tool name may carry after its object.
const SUFFIXES: &[&str] = &["_info", "_details", "_entry", "_record", "_v2"];

/// A listed-style name for a tool whose request verb is `verb`.
fn alias_name(verb: &str, object: &str, rng: &mut StdRng) -> String {
    let group = if READ_VERBS.contains(&verb) {
        "read"
    } else {
        verb
    };
    let alias = ALIASES
        .iter()
        .find(|(g, _)| *g == group)
        .and_then(|(_, a)| a.choose(rng).copied())
        .unwrap_or(verb);
    let suffix = if rng.random::<f64>() < 0.3 {
        *SUFFIXES.choose(rng).unwrap_or(&"")
    } else {
        ""
    };
    format!("{alias}_{object}{suffix}")
}

/// Extra parameters: name, JSON type, how the request mentions the value.
struct Extra {
    name: &'static str,
    kind: Kind,
    phrase: &'static str,
}

#[derive(Clone, Copy)]
enum Kind {
    Words,
    Word,
    Int,
    Date,
    Path,
    Email,
    Level,
}

const EXTRAS: &[Extra] = &[
    Extra {
        name: "content",
        kind: Kind::Words,
        phrase: "with the content: {}",
    },
    Extra {
        name: "amount",
        kind: Kind::Int,
        phrase: "for {}",
    },
    Extra {
        name: "date",
        kind: Kind::Date,
        phrase: "on {}",
    },
    Extra {
        name: "priority",
        kind: Kind::Level,
        phrase: "with {} priority",
    },
    Extra {
        name: "city",
        kind: Kind::Word,
        phrase: "in {}",
    },
    Extra {
        name: "new_name",
        kind: Kind::Word,
        phrase: "as {}",
    },
    Extra {
        name: "destination",
        kind: Kind::Path,
        phrase: "to {}",
    },
    Extra {
        name: "recipient",
        kind: Kind::Email,
        phrase: "to {}",
    },
    Extra {
        name: "owner",
        kind: Kind::Word,
        phrase: "owned by {}",
    },
    Extra {
        name: "quantity",
        kind: Kind::Int,
        phrase: "times {}",
    },
];

const OPTIONALS: &[Extra] = &[
    Extra {
        name: "limit",
        kind: Kind::Int,
        phrase: "(at most {} results)",
    },
    Extra {
        name: "tail",
        kind: Kind::Int,
        phrase: "(only the last {} lines)",
    },
    Extra {
        name: "head",
        kind: Kind::Int,
        phrase: "(only the first {} lines)",
    },
    Extra {
        name: "note",
        kind: Kind::Words,
        phrase: "with the note: {}",
    },
    Extra {
        name: "dry_run",
        kind: Kind::Level,
        phrase: "as a dry run",
    },
    Extra {
        name: "tag",
        kind: Kind::Word,
        phrase: "tagged {}",
    },
];

/// Response fields a read tool returns beside the key.
const FIELDS: &[&str] = &[
    "status", "owner", "size", "created", "color", "city", "score",
];

/// A random letter string (3–8 letters) outside the test pools: the copy drills' generator.
fn word(rng: &mut StdRng, capital: bool) -> String {
    crate::env::tasks::randomize::random_word_styled(rng, capital)
}

/// A value for a key parameter.
fn key_value(key: &str, rng: &mut StdRng) -> Value {
    let v = match key {
        "path" => match rng.random_range(0..3) {
            0 => format!("{}.txt", word(rng, false)),
            1 => format!("{}/{}.md", word(rng, false), word(rng, false)),
            _ => format!("{}.json", word(rng, false)),
        },
        "repo" => format!("{}/{}", word(rng, false), word(rng, false)),
        "username" | "branch" | "project" => word(rng, false),
        "title" | "name" => word(rng, true),
        id => {
            let prefix = id.trim_end_matches("_id");
            format!(
                "{}_{}",
                &prefix[..prefix.len().min(3)],
                rng.random_range(100..1000)
            )
        }
    };
    Value::String(v)
}

fn value_of(kind: Kind, rng: &mut StdRng) -> Value {
    match kind {
        Kind::Words => {
            let n = rng.random_range(2..=4);
            Value::String(
                (0..n)
                    .map(|_| word(rng, false))
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        }
        Kind::Word => Value::String(word(rng, true)),
        Kind::Int => json!(rng.random_range(1..=500)),
        Kind::Date => Value::String(format!(
            "2026-{:02}-{:02}",
            rng.random_range(1..=12),
            rng.random_range(1..=28)
        )),
        Kind::Path => Value::String(format!("{}/{}.txt", word(rng, false), word(rng, false))),
        Kind::Email => Value::String(format!("{}@{}.com", word(rng, false), word(rng, false))),
        Kind::Level => Value::String(["low", "normal", "high"][rng.random_range(0..3)].into()),
    }
}

fn json_type(kind: Kind) -> &'static str {
    match kind {
        Kind::Int => "integer",
        _ => "string",
    }
}

/// The text a value takes in a request: strings bare, numbers as JSON writes them, lists as
/// `3, 9 and 12`.
pub(super) fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(shown).collect();
            match items.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
                _ => items.join(""),
            }
        }
        other => other.to_string(),
    }
}

/// A made-up tool: its spec, and the extras / optionals it takes.
struct Tool {
    spec: ToolSpec,
    verb: &'static str,
    object: &'static str,
    key: &'static str,
    extras: Vec<&'static Extra>,
    optionals: Vec<&'static Extra>,
    read: bool,
}

fn make_tool(verb: &'static str, object: (&'static str, &'static str), rng: &mut StdRng) -> Tool {
    let read = READ_VERBS.contains(&verb);
    let (object, key) = object;
    let n_extra = if read {
        rng.random_range(0..=1)
    } else {
        rng.random_range(0..=2)
    };
    let mut extras: Vec<&Extra> = EXTRAS.choose_multiple(rng, n_extra).collect();
    extras.retain(|e| e.name != key);
    let n_opt = rng.random_range(0..=2);
    let optionals: Vec<&Extra> = OPTIONALS.choose_multiple(rng, n_opt).collect();
    let mut props = Map::new();
    props.insert(
        key.into(),
        json!({"type": "string", "description": format!("The {object}'s {}", key.replace('_', " "))}),
    );
    for e in &extras {
        props.insert(e.name.into(), json!({"type": json_type(e.kind)}));
    }
    for o in &optionals {
        let t = if o.name == "dry_run" {
            "boolean"
        } else {
            json_type(o.kind)
        };
        props.insert(
            o.name.into(),
            json!({"type": t, "description": "Optional."}),
        );
    }
    let mut required = vec![key.to_string()];
    required.extend(extras.iter().map(|e| e.name.to_string()));
    let name = format!("{verb}_{object}");
    let description = if read {
        format!(
            "{} a {object} by its {}.",
            capitalise(verb),
            key.replace('_', " ")
        )
    } else {
        format!("{} a {object}.", capitalise(verb))
    };
    Tool {
        spec: ToolSpec {
            name,
            description,
            input_schema: json!({"type": "object", "properties": props, "required": required}),
            annotations: ToolAnnotations {
                read_only: read,
                destructive: !read,
                idempotent: read,
                open_world: false,
            },
        },
        verb,
        object,
        key,
        extras,
        optionals,
        read,
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

/// The request for one call of `tool` with key value `key_v`, and that call's arguments.
fn request_and_args(
    tool: &Tool,
    key_vals: &[Value],
    rng: &mut StdRng,
) -> (String, Vec<Map<String, Value>>) {
    let mut phrases = Vec::new();
    let mut shared = Map::new();
    for e in &tool.extras {
        let v = value_of(e.kind, rng);
        phrases.push(e.phrase.replace("{}", &shown(&v)));
        shared.insert(e.name.into(), v);
    }
    for o in &tool.optionals {
        if rng.random::<f64>() < 0.35 {
            let v = if o.name == "dry_run" {
                json!(true)
            } else {
                value_of(o.kind, rng)
            };
            phrases.push(o.phrase.replace("{}", &shown(&v)));
            shared.insert(o.name.into(), v);
        }
    }
    let keys: Vec<String> = key_vals.iter().map(shown).collect();
    let objects = if keys.len() == 1 {
        format!("the {} {}", tool.object, keys[0])
    } else {
        format!("the {}s {} and {}", tool.object, keys[0], keys[1])
    };
    let opener = *["", "Please ", "Can you ", "I need you to "]
        .choose(rng)
        .unwrap_or(&"");
    let verb = if opener.is_empty() {
        capitalise(tool.verb)
    } else {
        tool.verb.to_string()
    };
    let mut text = format!("{opener}{verb} {objects}");
    for p in phrases {
        text.push(' ');
        text.push_str(&p);
    }
    text.push(if opener.starts_with("Can") { '?' } else { '.' });
    let args = key_vals
        .iter()
        .map(|k| {
            let mut m = Map::new();
            m.insert(tool.key.into(), k.clone());
            for (n, v) in &shared {
                m.insert(n.clone(), v.clone());
            }
            m
        })
        .collect();
    (text, args)
}

/// The response to one call, and the sentence of the answer that reports it.
fn respond(tool: &Tool, args: &Map<String, Value>, rng: &mut StdRng) -> (Value, String) {
    let key = args.get(tool.key).map(shown).unwrap_or_default();
    if rng.random::<f64>() < 0.15 {
        let code = *["not_found", "tool_error"]
            .choose(rng)
            .unwrap_or(&"not_found");
        return (
            json!({"error": {"code": code, "message": format!("{} {key} not found", tool.object)}}),
            format!("Sorry, the {} {key} was not found.", tool.object),
        );
    }
    if tool.read {
        let field = *FIELDS.choose(rng).unwrap_or(&"status");
        let value = if rng.random::<bool>() {
            json!(rng.random_range(1..10_000))
        } else {
            let capital = rng.random::<bool>();
            Value::String(word(rng, capital))
        };
        let response = if rng.random::<bool>() {
            json!({"content": format!("{}: {key}\n{field}: {}", tool.key, shown(&value))})
        } else {
            let mut m = Map::new();
            m.insert(tool.key.into(), Value::String(key.clone()));
            m.insert(field.into(), value.clone());
            Value::Object(m)
        };
        (
            response,
            format!("The {field} of {} {key} is {}.", tool.object, shown(&value)),
        )
    } else {
        let past = match tool.verb {
            "send" => "sent".to_string(),
            "add" => "added".to_string(),
            v if v.ends_with('e') => format!("{v}d"),
            v => format!("{v}ed"),
        };
        let response = if rng.random::<bool>() {
            json!({"content": format!("Successfully {past} {} {key}", tool.object)})
        } else {
            json!({"ok": true, tool.key: key})
        };
        (
            response,
            format!("Done: the {} {key} was {past}.", tool.object),
        )
    }
}

/// The drill of `seed` (see the module header). `system` is the system prompt the engine gives
/// an MCP server's tools.
pub fn tool_drill(seed: u64, system: &str) -> Drill {
    tool_drill_styled(seed, system, DrillStyle::Named)
}

/// The drill of `seed` in `style` ([`DrillStyle::Named`] is [`tool_drill`]).
pub fn tool_drill_styled(seed: u64, system: &str, style: DrillStyle) -> Drill {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x746f_6f6c);
    let n_tools = match style {
        DrillStyle::Named => rng.random_range(3..=6),
        DrillStyle::Listed => rng.random_range(5..=14),
    };
    let mut tools: Vec<Tool> = Vec::with_capacity(n_tools);
    let mut used: Vec<String> = Vec::new();
    let mut attempts = 0;
    while tools.len() < n_tools && attempts < 1000 {
        attempts += 1;
        let read = rng.random::<bool>();
        let verb = *if read { READ_VERBS } else { WRITE_VERBS }
            .choose(&mut rng)
            .unwrap_or(&"get");
        // Hard negatives: tools often share the object or the verb of another.
        let object = match tools.first() {
            Some(t0) if rng.random::<f64>() < 0.4 => OBJECTS
                .iter()
                .find(|o| o.0 == t0.object)
                .copied()
                .unwrap_or(OBJECTS[0]),
            _ => *OBJECTS.choose(&mut rng).unwrap_or(&OBJECTS[0]),
        };
        let name = format!("{verb}_{}", object.0);
        if used.contains(&name) {
            continue;
        }
        if style == DrillStyle::Listed {
            // One read tool per object, and no two tools for one request.
            let clash = tools
                .iter()
                .any(|t| t.object == object.0 && ((read && t.read) || t.verb == verb));
            if clash {
                continue;
            }
        }
        used.push(name);
        let mut tool = make_tool(verb, object, &mut rng);
        if style == DrillStyle::Listed {
            let alias = alias_name(verb, object.0, &mut rng);
            if tools.iter().any(|t| t.spec.name == alias) {
                continue;
            }
            tool.spec.name = alias;
        }
        tools.push(tool);
    }
    let specs: Vec<ToolSpec> = tools.iter().map(|t| t.spec.clone()).collect();
    let mut messages = vec![Message::system(system)];
    // No tool fits: a request about an object none of the tools handles.
    if rng.random::<f64>() < 0.1 {
        let missing = OBJECTS
            .iter()
            .filter(|o| !tools.iter().any(|t| t.object == o.0))
            .collect::<Vec<_>>();
        if let Some(&&(object, key)) = missing.choose(&mut rng) {
            let v = shown(&key_value(key, &mut rng));
            let verb = *WRITE_VERBS.choose(&mut rng).unwrap_or(&"create");
            messages.push(Message::user(format!(
                "{} the {object} {v}.",
                capitalise(verb)
            )));
            messages.push(Message::assistant(format!(
                "I can't {verb} a {object}: none of my tools handles {object}s."
            )));
            return Drill {
                messages,
                tools: specs,
                calls: Vec::new(),
            };
        }
    }
    let target = &tools[rng.random_range(0..tools.len())];
    let parallel = rng.random::<f64>() < 0.15;
    let keys: Vec<Value> = (0..if parallel { 2 } else { 1 })
        .map(|_| key_value(target.key, &mut rng))
        .collect();
    let (request, args) = request_and_args(target, &keys, &mut rng);
    messages.push(Message::user(request));
    let ids: Vec<String> = (0..args.len()).map(|i| format!("call_{i}")).collect();
    let calls: Vec<ToolCall> = args
        .into_iter()
        .map(|a| ToolCall {
            name: target.spec.name.clone(),
            arguments: Value::Object(a),
        })
        .collect();
    messages.push(Message {
        tool_calls: calls
            .iter()
            .zip(&ids)
            .map(|(c, id)| MessageToolCall {
                id: id.clone(),
                kind: "function".into(),
                function: c.clone(),
            })
            .collect(),
        ..Message::assistant("")
    });
    let mut out = Vec::with_capacity(calls.len());
    let mut sentences = Vec::new();
    for (c, id) in calls.iter().zip(&ids) {
        let args = c.arguments.as_object().cloned().unwrap_or_default();
        let (response, sentence) = respond(target, &args, &mut rng);
        messages.push(Message::tool(
            id.clone(),
            c.name.clone(),
            response.to_string(),
        ));
        out.push((c.clone(), response));
        sentences.push(sentence);
    }
    messages.push(Message::assistant(sentences.join(" ")));
    Drill {
        messages,
        tools: specs,
        calls: out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    #[test]
    fn drills_are_seeded_and_varied() {
        let a = tool_drill(7, "S");
        assert_eq!(a, tool_drill(7, "S"));
        let names: std::collections::HashSet<String> = (0..50)
            .flat_map(|s| tool_drill(s, "S").tools.into_iter().map(|t| t.name))
            .collect();
        assert!(names.len() > 60, "{}", names.len());
    }

    #[test]
    fn listed_drills_name_tools_that_must_be_looked_up() {
        let mut renamed = 0;
        let mut calls = 0;
        for seed in 0..300 {
            let d = tool_drill_styled(seed, "S", DrillStyle::Listed);
            assert_eq!(d, tool_drill_styled(seed, "S", DrillStyle::Listed));
            assert!((5..=14).contains(&d.tools.len()), "{}", d.tools.len());
            let mut names: Vec<&str> = d.tools.iter().map(|t| t.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), d.tools.len(), "unique names");
            // At most one read tool per object: a read request has one answer.
            for t in d.tools.iter().filter(|t| t.annotations.read_only) {
                let object = t.description.split(' ').nth(2).unwrap_or_default();
                let same = d
                    .tools
                    .iter()
                    .filter(|u| {
                        u.annotations.read_only && u.description.split(' ').nth(2) == Some(object)
                    })
                    .count();
                assert_eq!(same, 1, "{:?}", d.tools);
            }
            let user = d.messages[1].content.to_lowercase();
            for (call, _) in &d.calls {
                calls += 1;
                assert!(d.tools.iter().any(|t| t.name == call.name));
                // The request's own verb_object is not the tool's name.
                let verb = user
                    .trim_start_matches("please ")
                    .trim_start_matches("can you ")
                    .trim_start_matches("i need you to ")
                    .split(' ')
                    .next()
                    .unwrap_or_default()
                    .to_string();
                renamed += usize::from(!call.name.starts_with(&format!("{verb}_")));
            }
        }
        assert!(calls > 200, "{calls}");
        assert!(renamed * 2 > calls, "{renamed} of {calls} calls renamed");
        // The named style is unchanged by the listed one.
        assert_eq!(
            tool_drill(3, "S"),
            tool_drill_styled(3, "S", DrillStyle::Named)
        );
    }

    #[test]
    fn every_call_names_a_listed_tool_with_its_required_arguments_and_only_known_ones() {
        let mut no_call = 0;
        let mut parallel = 0;
        let mut optional_used = 0;
        for seed in 0..400 {
            let d = tool_drill(seed, "S");
            if d.calls.is_empty() {
                no_call += 1;
                assert_eq!(d.messages.len(), 3);
                continue;
            }
            parallel += usize::from(d.calls.len() == 2);
            let user = &d.messages[1].content;
            for (call, _) in &d.calls {
                let tool = d
                    .tools
                    .iter()
                    .find(|t| t.name == call.name)
                    .expect("listed");
                let props = tool.input_schema["properties"].as_object().unwrap();
                let required: Vec<&str> = tool.input_schema["required"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap())
                    .collect();
                let args = call.arguments.as_object().unwrap();
                for r in &required {
                    assert!(args.contains_key(*r), "{seed}: {r} missing");
                }
                for (k, v) in args {
                    assert!(props.contains_key(k), "{seed}: unknown {k}");
                    // Every value passed is in the request (copied, never invented), except
                    // a dry-run flag.
                    if k != "dry_run" {
                        assert!(user.contains(&shown(v)), "{seed}: {v} not in {user}");
                    }
                    optional_used += usize::from(!required.contains(&k.as_str()));
                }
            }
            let last = d.messages.last().unwrap();
            assert_eq!(last.role, Role::Assistant);
            assert!(!last.content.is_empty());
        }
        assert!((20..=70).contains(&no_call), "{no_call}");
        assert!(parallel > 20, "{parallel}");
        assert!(optional_used > 20, "{optional_used}");
    }

    #[test]
    fn no_value_comes_from_the_test_pools() {
        for seed in 0..200 {
            let d = tool_drill(seed, "S");
            let text = serde_json::to_string(&d.messages).unwrap();
            for w in text.split(|c: char| !c.is_alphanumeric()) {
                assert!(!crate::env::domains::in_test_pools(w) || w.len() < 3, "{w}");
            }
        }
    }
}
