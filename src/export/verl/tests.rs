//! The rows against verl's and the reference's readers: tool schemas, checklists, messages.

use super::*;
use crate::env::tasks::builtin_tasks;
use crate::session::export::openai_message;

/// verl's `OpenAIFunctionToolSchema` (verl/tools/schemas.py), which EnvACE's
/// `ChecklistDataset._filter_invalid_tool_schemas` applies: a row whose tools fail it is
/// silently dropped from training.
fn valid_verl_tool(t: &Value) -> Result<(), String> {
    let s = |v: &Value, what: &str| {
        v.as_str()
            .map(|_| ())
            .ok_or_else(|| format!("{what} is not a string"))
    };
    s(&t["type"], "type")?;
    let f = &t["function"];
    s(&f["name"], "function.name")?;
    s(&f["description"], "function.description")?;
    let p = &f["parameters"];
    s(&p["type"], "parameters.type")?;
    let props = p["properties"]
        .as_object()
        .ok_or("parameters.properties is not an object")?;
    for (k, prop) in props {
        s(&prop["type"], &format!("property {k}: type"))?;
        if !prop["description"].is_null() {
            s(&prop["description"], &format!("property {k}: description"))?;
        }
        if let Some(e) = prop.get("enum").filter(|e| !e.is_null()) {
            let ok = e.as_array().is_some_and(|a| a.iter().all(Value::is_string));
            if !ok {
                return Err(format!("property {k}: enum is not a list of strings"));
            }
        }
    }
    let req = p["required"]
        .as_array()
        .ok_or("parameters.required is not a list")?;
    if !req.iter().all(Value::is_string) {
        return Err("parameters.required holds a non-string".into());
    }
    Ok(())
}

#[test]
fn every_builtin_tool_passes_verls_tool_schema_so_no_row_is_dropped() {
    for d in Domain::ALL {
        for t in tools_json(&d.tools()) {
            valid_verl_tool(&t).unwrap_or_else(|e| panic!("{} tool {t}: {e}", d.name()));
        }
    }
}

#[test]
fn checklist_weights_sum_to_one_per_turn_and_cover_every_gold_call() {
    for d in Domain::ALL {
        for task in builtin_tasks(d).iter().step_by(7) {
            let c = reference_checklist(task);
            assert_eq!(c.len(), task.turns.len(), "{}", task.id);
            for (t, turn) in c.iter().enumerate() {
                let sum: f64 = turn.iter().map(|s| s.weight).sum();
                assert!((sum - 1.0).abs() < 1e-9, "{} turn {t}: {sum}", task.id);
                let calls = turn
                    .iter()
                    .filter(|s| s.focus_on == "assistant.tool_calls")
                    .count();
                assert_eq!(calls, task.turns[t].actions.len(), "{} turn {t}", task.id);
                let ids: Vec<String> = (0..turn.len()).map(|i| format!("C{i}")).collect();
                let got: Vec<String> = turn.iter().map(|s| s.id.clone()).collect();
                assert_eq!(got, ids);
                assert!(
                    turn.last()
                        .is_some_and(|s| s.evidence[0].snippet == task.turns[t].reply)
                );
            }
        }
    }
}

#[test]
fn call_standard_snippet_is_the_reference_shape() {
    let s = call_standard(
        "transfer",
        &serde_json::json!({"src": "acc_1", "amount": 5}),
        Some("insufficient_funds"),
        Some((1, 2)),
    );
    assert_eq!(
        s.evidence[0].snippet,
        r#""name": "transfer", "arguments": "{\"src\":\"acc_1\",\"amount\":5}""#
    );
    assert_eq!((s.evidence[0].turn, s.evidence[0].step), (1, 5));
    assert!(s.pass_condition.contains("insufficient_funds"));
    assert!(s.required_for_next_turn);
}

#[test]
fn message_tool_calls_carry_arguments_as_json_strings() {
    let task = &builtin_tasks(Domain::Bank)[0];
    let (gold, _) = gold_conversation(task).unwrap();
    let m = gold.iter().find(|m| !m.tool_calls.is_empty()).unwrap();
    let v = VerlMessage::from(m);
    assert_eq!(v.role, "assistant");
    let parsed: Value = serde_json::from_str(&v.tool_calls[0].function.arguments).unwrap();
    assert_eq!(parsed, m.tool_calls[0].function.arguments);
    assert_eq!(v.tool_calls[0].kind, "function");
}

#[test]
fn messages_match_the_openai_export_shape() {
    for task in builtin_tasks(Domain::Retail).iter().take(20) {
        let (gold, _) = gold_conversation(task).unwrap();
        for m in &gold {
            let via_export = VerlMessage::from_openai(&openai_message(m)).unwrap();
            assert_eq!(VerlMessage::from(m), via_export);
        }
    }
}
