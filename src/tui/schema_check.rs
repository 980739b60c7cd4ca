//! Checks edited call arguments against the tool's JSON Schema before the approval dialog lets
//! them through: the subset tool schemas use (object properties, `required`, unknown keys when
//! `additionalProperties` is false or absent in a closed schema, primitive `type`s, `enum`,
//! nested objects and arrays). Messages name the path (`arguments.amount`).

use serde_json::Value;

/// Validate `args` against `schema`; every problem found, each naming its path.
pub fn check(args: &Value, schema: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    walk(args, schema, "arguments", &mut errs);
    errs
}

fn type_ok(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.as_i64().is_some() || v.as_u64().is_some(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    }
}

fn walk(v: &Value, schema: &Value, path: &str, errs: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        return;
    };
    match s.get("type") {
        Some(Value::String(t)) if !type_ok(v, t) => {
            errs.push(format!("{path}: expected {t}, got {}", kind(v)));
            return;
        }
        Some(Value::Array(ts)) if !ts.iter().filter_map(Value::as_str).any(|t| type_ok(v, t)) => {
            errs.push(format!("{path}: expected one of {ts:?}, got {}", kind(v)));
            return;
        }
        _ => {}
    }
    if let Some(Value::Array(options)) = s.get("enum")
        && !options.contains(v)
    {
        errs.push(format!(
            "{path}: {v} is not one of {}",
            Value::Array(options.clone())
        ));
    }
    if let Some(obj) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(req)) = s.get("required") {
            for r in req.iter().filter_map(Value::as_str) {
                if !obj.contains_key(r) {
                    errs.push(format!("{path}.{r}: required"));
                }
            }
        }
        let closed = s.get("additionalProperties") == Some(&Value::Bool(false));
        for (k, val) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(sub) => walk(val, sub, &format!("{path}.{k}"), errs),
                None if closed => errs.push(format!("{path}.{k}: not in the schema")),
                None => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            walk(x, items, &format!("{path}[{i}]"), errs);
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_every_problem_by_path() {
        let schema = json!({"type": "object", "additionalProperties": false,
            "properties": {"amount": {"type": "number"}, "to": {"type": "string"},
                           "mode": {"enum": ["fast", "slow"]}},
            "required": ["amount", "to"]});
        assert!(check(&json!({"amount": 5, "to": "acc_1"}), &schema).is_empty());
        let e = check(&json!({"amount": "5", "mode": "warp", "x": 1}), &schema);
        assert!(
            e.iter()
                .any(|m| m == "arguments.amount: expected number, got string"),
            "{e:?}"
        );
        assert!(e.iter().any(|m| m == "arguments.to: required"), "{e:?}");
        assert!(e.iter().any(|m| m.starts_with("arguments.mode:")), "{e:?}");
        assert!(
            e.iter().any(|m| m == "arguments.x: not in the schema"),
            "{e:?}"
        );
        assert_eq!(
            check(&json!([1]), &schema),
            vec!["arguments: expected object, got array"]
        );
    }
}
