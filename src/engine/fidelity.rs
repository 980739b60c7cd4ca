//! World-model fidelity: how well a simulated tool response matches the real one (shadow mode).
//! Three measures per call: exact JSON match, key-level F1 over leaf paths, and value agreement
//! (the share of the real response's leaf paths that the prediction reproduces with the same
//! value). Aggregated per tool in [`FidelityTable`], so a report can split tools whose results
//! the context determines from tools that read hidden state.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::session::format::Fidelity;

/// Compare a predicted response with the real one. `None` predicted (the simulator output did
/// not parse) scores zero on every measure.
pub fn fidelity(predicted: Option<&Value>, real: &Value) -> Fidelity {
    let Some(predicted) = predicted else {
        return Fidelity {
            exact: false,
            key_f1: 0.0,
            value_agreement: 0.0,
        };
    };
    let p = leaves(predicted);
    let r = leaves(real);
    let pk: BTreeSet<&String> = p.keys().collect();
    let rk: BTreeSet<&String> = r.keys().collect();
    let common = pk.intersection(&rk).count() as f64;
    let key_f1 = if pk.is_empty() && rk.is_empty() {
        1.0
    } else if common == 0.0 {
        0.0
    } else {
        let precision = common / pk.len() as f64;
        let recall = common / rk.len() as f64;
        2.0 * precision * recall / (precision + recall)
    };
    let agree = r
        .iter()
        .filter(|(k, v)| p.get(*k).is_some_and(|pv| json_eq(pv, v)))
        .count() as f64;
    let value_agreement = if r.is_empty() {
        if p.is_empty() { 1.0 } else { 0.0 }
    } else {
        agree / r.len() as f64
    };
    Fidelity {
        exact: json_eq(predicted, real),
        key_f1,
        value_agreement,
    }
}

/// JSON equality with numbers compared as f64 when they differ in representation.
pub fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_eq(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// Leaf values by path. Empty objects and arrays are leaves themselves.
fn leaves(v: &Value) -> BTreeMap<String, &Value> {
    let mut out = BTreeMap::new();
    walk(v, String::new(), &mut out);
    out
}

fn walk<'a>(v: &'a Value, path: String, out: &mut BTreeMap<String, &'a Value>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Object(o) if !o.is_empty() => {
            for (k, x) in o {
                walk(x, join(k), out);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                walk(x, join(&i.to_string()), out);
            }
        }
        _ => {
            out.insert(path, v);
        }
    }
}

/// Running totals for one tool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolFidelity {
    pub calls: usize,
    pub exact: usize,
    pub key_f1_sum: f64,
    pub value_agreement_sum: f64,
}

impl ToolFidelity {
    pub fn exact_rate(&self) -> f64 {
        ratio(self.exact as f64, self.calls)
    }
    pub fn mean_key_f1(&self) -> f64 {
        ratio(self.key_f1_sum, self.calls)
    }
    pub fn mean_value_agreement(&self) -> f64 {
        ratio(self.value_agreement_sum, self.calls)
    }
}

fn ratio(x: f64, n: usize) -> f64 {
    if n == 0 { 0.0 } else { x / n as f64 }
}

/// Fidelity per tool name, plus the overall totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FidelityTable {
    pub per_tool: BTreeMap<String, ToolFidelity>,
}

impl FidelityTable {
    pub fn add(&mut self, tool: &str, f: &Fidelity) {
        let t = self.per_tool.entry(tool.to_string()).or_default();
        t.calls += 1;
        t.exact += usize::from(f.exact);
        t.key_f1_sum += f.key_f1;
        t.value_agreement_sum += f.value_agreement;
    }
    pub fn merge(&mut self, other: &FidelityTable) {
        for (k, v) in &other.per_tool {
            let t = self.per_tool.entry(k.clone()).or_default();
            t.calls += v.calls;
            t.exact += v.exact;
            t.key_f1_sum += v.key_f1_sum;
            t.value_agreement_sum += v.value_agreement_sum;
        }
    }
    pub fn total(&self) -> ToolFidelity {
        let mut t = ToolFidelity::default();
        for v in self.per_tool.values() {
            t.calls += v.calls;
            t.exact += v.exact;
            t.key_f1_sum += v.key_f1_sum;
            t.value_agreement_sum += v.value_agreement_sum;
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn identical_responses_score_one_everywhere() {
        let v = json!({"balance": 5, "history": [{"id": 1}]});
        let f = fidelity(Some(&v), &v);
        assert!(f.exact);
        assert_eq!(f.key_f1, 1.0);
        assert_eq!(f.value_agreement, 1.0);
    }

    #[test]
    fn integer_and_float_of_same_value_match_exactly() {
        let f = fidelity(Some(&json!({"a": 1})), &json!({"a": 1.0}));
        assert!(f.exact);
    }

    #[test]
    fn same_keys_different_values_have_full_key_f1_and_partial_agreement() {
        let f = fidelity(Some(&json!({"a": 1, "b": 2})), &json!({"a": 1, "b": 3}));
        assert!(!f.exact);
        assert_eq!(f.key_f1, 1.0);
        assert_eq!(f.value_agreement, 0.5);
    }

    #[test]
    fn key_f1_counts_missing_and_extra_leaves() {
        // predicted {a, c}, real {a, b}: precision 1/2, recall 1/2.
        let f = fidelity(Some(&json!({"a": 1, "c": 2})), &json!({"a": 1, "b": 2}));
        assert!((f.key_f1 - 0.5).abs() < 1e-12);
        assert_eq!(f.value_agreement, 0.5);
    }

    #[test]
    fn nested_paths_are_compared() {
        let f = fidelity(
            Some(&json!({"acct": {"id": "x", "bal": 1}})),
            &json!({"acct": {"id": "x", "bal": 2}}),
        );
        assert_eq!(f.key_f1, 1.0);
        assert_eq!(f.value_agreement, 0.5);
    }

    #[test]
    fn unparsed_prediction_scores_zero() {
        let f = fidelity(None, &json!({"a": 1}));
        assert_eq!(
            f,
            Fidelity {
                exact: false,
                key_f1: 0.0,
                value_agreement: 0.0
            }
        );
    }

    #[test]
    fn table_aggregates_per_tool() {
        let mut t = FidelityTable::default();
        t.add("get", &fidelity(Some(&json!({"a": 1})), &json!({"a": 1})));
        t.add("get", &fidelity(Some(&json!({"a": 2})), &json!({"a": 1})));
        t.add("put", &fidelity(None, &json!({"ok": true})));
        assert_eq!(t.per_tool["get"].calls, 2);
        assert_eq!(t.per_tool["get"].exact_rate(), 0.5);
        assert_eq!(t.total().calls, 3);
        assert!((t.total().exact_rate() - 1.0 / 3.0).abs() < 1e-12);
    }
}
