//! Calculation drills: requests for a computed quantity, with calculator-style functions
//! (`calculate_circle_area(radius)`), for the supervised corpus of a model that must decide
//! *whether* a listed function answers a request, not only which one and with what.
//!
//! The tool drills ([`super::tool_drill`]) teach reading a tool list of record-keeping tools;
//! their no-fit requests ("Create the note X." beside note-less tools) are rare and easy. On
//! BFCL's irrelevance category (a question, one function on a neighbouring topic: the area of a
//! triangle beside a BMI calculator) the policy fine-tuned on them called a function 24 times
//! in 25, inventing `calculate_triangle_area` when only `determine_body_mass_index` was listed.
//! Here some requests ask for a quantity no listed function computes (often one that shares a
//! parameter name with a listed one: a cylinder's volume beside a circle's area) or a question
//! no calculator answers, and the gold reply says so without a call. The rest call the listed
//! function with the request's numbers (two calls when the request gives two sets of values,
//! or asks for two quantities), get `{"result": …}` computed by the real formula, and answer
//! with it. A drill that calls one function has a declining twin ([`decline_twin`]): the same
//! request with that function unlisted. Without twins (a third of the drills declining, none
//! paired) a policy learned to decline calculations as such, fitting function or not (BFCL
//! simple_python 6 → 3 of 25): the pair differs only in the list, so only reading it tells
//! them apart. Everything is seeded; the vocabulary is fixed and no value is drawn from the
//! test split's pools.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};

use crate::env::{ToolAnnotations, ToolSpec};
use crate::message::{Message, MessageToolCall, ToolCall};

use super::tool_drill::{Drill, shown};

/// How a parameter's value is drawn and typed.
#[derive(Clone, Copy)]
enum Num {
    /// An integer in the range, JSON type `integer`.
    Int(i64, i64),
    /// A number with one decimal in the range, JSON type `number`.
    Dec(i64, i64),
    /// A list of 3–6 integers in the range, JSON type `array` of `integer`.
    List(i64, i64),
}

/// A parameter: name, value kind, how the request mentions it.
struct Param {
    name: &'static str,
    num: Num,
    phrase: &'static str,
}

/// A calculation: the stem of its function name, what it computes, its parameters and formula.
struct Calc {
    stem: &'static str,
    what: &'static str,
    params: &'static [Param],
    formula: fn(&[Value]) -> f64,
}

const fn p(name: &'static str, num: Num, phrase: &'static str) -> Param {
    Param { name, num, phrase }
}

fn f(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().unwrap_or(0.0),
        _ => 0.0,
    }
}

fn list(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().map(f).collect())
        .unwrap_or_default()
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

const CALCS: &[Calc] = &[
    Calc {
        stem: "circle_area",
        what: "area of a circle",
        params: &[p("radius", Num::Dec(1, 50), "with a radius of {}")],
        formula: |a| std::f64::consts::PI * f(&a[0]) * f(&a[0]),
    },
    Calc {
        stem: "triangle_area",
        what: "area of a triangle",
        params: &[
            p("base", Num::Int(1, 100), "with base {}"),
            p("height", Num::Int(1, 100), "and height {}"),
        ],
        formula: |a| 0.5 * f(&a[0]) * f(&a[1]),
    },
    Calc {
        stem: "rectangle_perimeter",
        what: "perimeter of a rectangle",
        params: &[
            p("length", Num::Int(1, 200), "of length {}"),
            p("width", Num::Int(1, 200), "and width {}"),
        ],
        formula: |a| 2.0 * (f(&a[0]) + f(&a[1])),
    },
    Calc {
        stem: "cylinder_volume",
        what: "volume of a cylinder",
        params: &[
            p("radius", Num::Dec(1, 30), "with a radius of {}"),
            p("height", Num::Dec(1, 60), "and a height of {}"),
        ],
        formula: |a| std::f64::consts::PI * f(&a[0]) * f(&a[0]) * f(&a[1]),
    },
    Calc {
        stem: "cube_volume",
        what: "volume of a cube",
        params: &[p("side", Num::Int(1, 40), "with side {}")],
        formula: |a| f(&a[0]).powi(3),
    },
    Calc {
        stem: "bmi",
        what: "body mass index",
        params: &[
            p("weight", Num::Int(40, 150), "for a weight of {} kg"),
            p("height", Num::Dec(1, 2), "and a height of {} m"),
        ],
        formula: |a| f(&a[0]) / (f(&a[1]) * f(&a[1])).max(0.01),
    },
    Calc {
        stem: "compound_interest",
        what: "compound interest",
        params: &[
            p("principal", Num::Int(100, 50_000), "on {} dollars"),
            p("rate", Num::Dec(1, 12), "at {} percent a year"),
            p("years", Num::Int(1, 30), "for {} years"),
        ],
        formula: |a| f(&a[0]) * ((1.0 + f(&a[1]) / 100.0).powf(f(&a[2])) - 1.0),
    },
    Calc {
        stem: "monthly_payment",
        what: "monthly payment of a loan",
        params: &[
            p("loan_amount", Num::Int(1_000, 400_000), "of {} dollars"),
            p("annual_rate", Num::Dec(1, 10), "at {} percent"),
            p("years", Num::Int(1, 30), "over {} years"),
        ],
        formula: |a| {
            let r = f(&a[1]) / 1200.0;
            let n = f(&a[2]) * 12.0;
            if r == 0.0 {
                f(&a[0]) / n.max(1.0)
            } else {
                f(&a[0]) * r / (1.0 - (1.0 + r).powf(-n))
            }
        },
    },
    Calc {
        stem: "tip",
        what: "tip",
        params: &[
            p("bill", Num::Dec(5, 400), "on a bill of {}"),
            p("percent", Num::Int(5, 30), "at {} percent"),
        ],
        formula: |a| f(&a[0]) * f(&a[1]) / 100.0,
    },
    Calc {
        stem: "travel_time",
        what: "travel time",
        params: &[
            p("distance", Num::Int(1, 2_000), "for {} km"),
            p("speed", Num::Int(5, 300), "at {} km/h"),
        ],
        formula: |a| f(&a[0]) / f(&a[1]).max(1.0),
    },
    Calc {
        stem: "average_speed",
        what: "average speed",
        params: &[
            p("distance", Num::Int(1, 2_000), "over {} km"),
            p("hours", Num::Dec(1, 24), "in {} hours"),
        ],
        formula: |a| f(&a[0]) / f(&a[1]).max(0.1),
    },
    Calc {
        stem: "kinetic_energy",
        what: "kinetic energy",
        params: &[
            p("mass", Num::Dec(1, 500), "of a {} kg object"),
            p("velocity", Num::Dec(1, 100), "moving at {} m/s"),
        ],
        formula: |a| 0.5 * f(&a[0]) * f(&a[1]) * f(&a[1]),
    },
    Calc {
        stem: "density",
        what: "density",
        params: &[
            p("mass", Num::Dec(1, 500), "of a {} kg object"),
            p(
                "volume",
                Num::Dec(1, 50),
                "with a volume of {} cubic meters",
            ),
        ],
        formula: |a| f(&a[0]) / f(&a[1]).max(0.1),
    },
    Calc {
        stem: "factorial",
        what: "factorial",
        params: &[p("number", Num::Int(1, 15), "of {}")],
        formula: |a| (1..=f(&a[0]) as i64).map(|x| x as f64).product(),
    },
    Calc {
        stem: "gcd",
        what: "greatest common divisor",
        params: &[
            p("a", Num::Int(2, 1_000), "of {}"),
            p("b", Num::Int(2, 1_000), "and {}"),
        ],
        formula: |a| gcd(f(&a[0]) as i64, f(&a[1]) as i64) as f64,
    },
    Calc {
        stem: "lcm",
        what: "least common multiple",
        params: &[
            p("a", Num::Int(2, 100), "of {}"),
            p("b", Num::Int(2, 100), "and {}"),
        ],
        formula: |a| {
            let (x, y) = (f(&a[0]) as i64, f(&a[1]) as i64);
            (x / gcd(x, y).max(1) * y) as f64
        },
    },
    Calc {
        stem: "square_root",
        what: "square root",
        params: &[p("number", Num::Int(1, 10_000), "of {}")],
        formula: |a| f(&a[0]).sqrt(),
    },
    Calc {
        stem: "fahrenheit",
        what: "temperature in Fahrenheit",
        params: &[p("celsius", Num::Dec(-40, 120), "for {} degrees Celsius")],
        formula: |a| f(&a[0]) * 1.8 + 32.0,
    },
    Calc {
        stem: "population_density",
        what: "population density",
        params: &[
            p(
                "population",
                Num::Int(1_000, 5_000_000),
                "for a population of {}",
            ),
            p("area", Num::Int(1, 10_000), "over {} square km"),
        ],
        formula: |a| f(&a[0]) / f(&a[1]).max(1.0),
    },
    Calc {
        stem: "sales_tax",
        what: "sales tax",
        params: &[
            p("amount", Num::Dec(1, 2_000), "on {} dollars"),
            p("rate", Num::Dec(1, 15), "at a rate of {} percent"),
        ],
        formula: |a| f(&a[0]) * f(&a[1]) / 100.0,
    },
    Calc {
        stem: "average",
        what: "average",
        params: &[p("numbers", Num::List(1, 100), "of the numbers {}")],
        formula: |a| {
            let v = list(&a[0]);
            v.iter().sum::<f64>() / (v.len().max(1) as f64)
        },
    },
    Calc {
        stem: "standard_deviation",
        what: "standard deviation",
        params: &[p("numbers", Num::List(1, 100), "of the numbers {}")],
        formula: |a| {
            let v = list(&a[0]);
            let n = v.len().max(1) as f64;
            let m = v.iter().sum::<f64>() / n;
            (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n).sqrt()
        },
    },
    Calc {
        stem: "max_height",
        what: "maximum height of a projectile",
        params: &[p(
            "initial_velocity",
            Num::Dec(1, 100),
            "launched straight up at {} m/s",
        )],
        formula: |a| f(&a[0]) * f(&a[0]) / (2.0 * 9.81),
    },
    Calc {
        stem: "calories_burned",
        what: "calories burned",
        params: &[
            p("minutes", Num::Int(5, 180), "in {} minutes of running"),
            p("weight", Num::Int(40, 150), "by a {} kg person"),
        ],
        formula: |a| f(&a[0]) * f(&a[1]) * 0.16,
    },
];

/// How a function name wraps its stem.
const PREFIXES: &[&str] = &[
    "calculate_",
    "compute_",
    "get_",
    "find_",
    "",
    "math.",
    "calc.",
];

/// A function name for `calc`: a prefix and its stem (`calculate_circle_area`), or a third of
/// the time the words of what it computes (`area_of_circle`).
fn name_of(calc: &Calc, rng: &mut StdRng) -> String {
    let prefix = *PREFIXES.choose(rng).unwrap_or(&"calculate_");
    if rng.random::<f64>() < 0.3 {
        let words: Vec<&str> = calc
            .what
            .split(' ')
            .filter(|w| !matches!(*w, "a" | "an" | "the"))
            .collect();
        format!("{prefix}{}", words.join("_").to_lowercase())
    } else {
        format!("{prefix}{}", calc.stem)
    }
}

/// Questions no calculator answers: about a place (`true`) or a subject, `{}` taking a word of
/// [`PLACES`] or [`SUBJECTS`].
const QUESTIONS: &[(&str, bool)] = &[
    ("What is the capital of {}?", true),
    ("Who won the last football match in {}?", true),
    ("What is the weather like in {} today?", true),
    ("What language do people speak in {}?", true),
    ("Tell me a joke about {}.", false),
    ("Recommend a good book about {}.", false),
    ("Write a short poem about {}.", false),
    ("Translate the word {} into French.", false),
];

/// Words for [`QUESTIONS`] (none of them in a test pool: checked by a test).
const PLACES: &[&str] = &[
    "Portugal", "Mongolia", "Peru", "Iceland", "Kenya", "Vietnam",
];
const SUBJECTS: &[&str] = &[
    "penguins",
    "the ocean",
    "chess",
    "autumn",
    "volcanoes",
    "gardening",
];

/// Request openers.
const OPENERS: &[&str] = &[
    "Calculate the",
    "What is the",
    "Find the",
    "I need the",
    "Compute the",
];

fn draw(num: Num, rng: &mut StdRng) -> Value {
    match num {
        Num::Int(lo, hi) => json!(rng.random_range(lo..=hi)),
        Num::Dec(lo, hi) => {
            let tenths = rng.random_range(lo * 10..=hi * 10);
            json!(tenths as f64 / 10.0)
        }
        Num::List(lo, hi) => {
            let n = rng.random_range(3..=6);
            Value::Array((0..n).map(|_| json!(rng.random_range(lo..=hi))).collect())
        }
    }
}

/// A function's description: what [`calc_of`] reads back.
fn description(calc: &Calc) -> String {
    format!("Calculate the {}.", calc.what)
}

/// The calculation a drill's function computes.
fn calc_of(tool: &ToolSpec) -> Option<&'static Calc> {
    CALCS.iter().find(|c| tool.description == description(c))
}

/// Whether what one computes names the other's (`population density` and `density`): a request
/// for one would be ambiguous beside the other.
fn overlaps(a: &Calc, b: &Calc) -> bool {
    a.what.contains(b.what) || b.what.contains(a.what)
}

fn spec(calc: &Calc, name: String) -> ToolSpec {
    let mut props = Map::new();
    for prm in calc.params {
        let schema = match prm.num {
            Num::Int(..) => json!({"type": "integer"}),
            Num::Dec(..) => json!({"type": "number"}),
            Num::List(..) => json!({"type": "array", "items": {"type": "integer"}}),
        };
        props.insert(prm.name.into(), schema);
    }
    let required: Vec<&str> = calc.params.iter().map(|p| p.name).collect();
    ToolSpec {
        name,
        description: description(calc),
        input_schema: json!({"type": "object", "properties": props, "required": required}),
        annotations: ToolAnnotations {
            read_only: true,
            destructive: false,
            idempotent: true,
            open_world: false,
        },
    }
}

/// One set of values for `calc`, and the words that give them.
fn values(calc: &Calc, rng: &mut StdRng) -> (Map<String, Value>, String) {
    let mut args = Map::new();
    let mut words = Vec::new();
    for prm in calc.params {
        let v = draw(prm.num, rng);
        words.push(prm.phrase.replace("{}", &shown(&v)));
        args.insert(prm.name.into(), v);
    }
    (args, words.join(" "))
}

/// A result as the response and the answer write it: integers plain, others to 2 decimals.
fn result_value(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        json!(x as i64)
    } else {
        json!((x * 100.0).round() / 100.0)
    }
}

/// The calculation drill of `seed`. `system`: the system prompt, or `None` for none (as BFCL
/// gives).
pub fn calc_drill(seed: u64, system: Option<&str>) -> Drill {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6361_6c63);
    let n_tools = rng.random_range(1..=4);
    let mut chosen: Vec<usize> = Vec::with_capacity(n_tools);
    while chosen.len() < n_tools {
        let i = rng.random_range(0..CALCS.len());
        if !chosen.contains(&i) {
            chosen.push(i);
        }
    }
    let names: Vec<String> = chosen
        .iter()
        .map(|&i| name_of(&CALCS[i], &mut rng))
        .collect();
    let tools: Vec<ToolSpec> = chosen
        .iter()
        .zip(&names)
        .map(|(&i, n)| spec(&CALCS[i], n.clone()))
        .collect();
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::system(s));
    }
    let roll = rng.random::<f64>();
    if roll < 0.15 {
        // No listed function fits: a quantity none computes (a neighbour when one shares a
        // parameter name), or a question no calculator answers.
        // Never one whose name contains a listed one's or the reverse (`population density`
        // beside `density`): that request would be ambiguous.
        let unlisted: Vec<usize> = (0..CALCS.len())
            .filter(|&i| chosen.iter().all(|&c| !overlaps(&CALCS[c], &CALCS[i])))
            .collect();
        let shares = |i: &usize| {
            CALCS[*i].params.iter().any(|q| {
                chosen
                    .iter()
                    .any(|&c| CALCS[c].params.iter().any(|r| r.name == q.name))
            })
        };
        let near: Vec<usize> = unlisted.iter().copied().filter(shares).collect();
        let pick = if !near.is_empty() && rng.random::<bool>() {
            near.choose(&mut rng).copied()
        } else {
            unlisted.choose(&mut rng).copied()
        };
        let (request, answer) = match pick {
            Some(i) if rng.random::<bool>() => {
                let calc = &CALCS[i];
                let opener = *OPENERS.choose(&mut rng).unwrap_or(&"Calculate the");
                let (_, words) = values(calc, &mut rng);
                let end = if opener.starts_with("What") { '?' } else { '.' };
                (
                    format!("{opener} {} {words}{end}", calc.what),
                    format!(
                        "None of the available functions computes the {}, so I can't do that with them.",
                        calc.what
                    ),
                )
            }
            _ => {
                let (q, place) = *QUESTIONS.choose(&mut rng).unwrap_or(&QUESTIONS[0]);
                let words = if place { PLACES } else { SUBJECTS };
                let topic = *words.choose(&mut rng).unwrap_or(&words[0]);
                (
                    q.replace("{}", topic),
                    "None of the available functions can answer that.".to_string(),
                )
            }
        };
        messages.push(Message::user(request));
        messages.push(Message::assistant(answer));
        return Drill {
            messages,
            tools,
            calls: Vec::new(),
        };
    }
    // One function with one or two sets of values, or two functions.
    let targets: Vec<usize> = if chosen.len() >= 2 && roll > 0.85 {
        vec![0, 1]
    } else if roll > 0.7 {
        vec![0, 0]
    } else {
        vec![0]
    };
    let mut calls = Vec::new();
    let mut parts = Vec::new();
    for (k, &t) in targets.iter().enumerate() {
        let calc = &CALCS[chosen[t]];
        let (args, words) = values(calc, &mut rng);
        parts.push(if k > 0 && targets[0] == t {
            format!("and also {words}")
        } else if k > 0 {
            format!("and the {} {words}", calc.what)
        } else {
            format!("{} {words}", calc.what)
        });
        calls.push((t, args));
    }
    let opener = *OPENERS.choose(&mut rng).unwrap_or(&"Calculate the");
    let end = if opener.starts_with("What") { '?' } else { '.' };
    messages.push(Message::user(format!("{opener} {}{end}", parts.join(", "))));
    let tool_calls: Vec<ToolCall> = calls
        .iter()
        .map(|(t, args)| ToolCall {
            name: names[*t].clone(),
            arguments: Value::Object(args.clone()),
        })
        .collect();
    messages.push(Message {
        tool_calls: tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| MessageToolCall {
                id: format!("call_{i}"),
                kind: "function".into(),
                function: c.clone(),
            })
            .collect(),
        ..Message::assistant("")
    });
    let mut out = Vec::new();
    let mut sentences = Vec::new();
    for (i, ((t, args), call)) in calls.iter().zip(&tool_calls).enumerate() {
        let calc = &CALCS[chosen[*t]];
        let ordered: Vec<Value> = calc
            .params
            .iter()
            .map(|q| args.get(q.name).cloned().unwrap_or(Value::Null))
            .collect();
        let result = result_value((calc.formula)(&ordered));
        let response = json!({ "result": result });
        messages.push(Message::tool(
            format!("call_{i}"),
            call.name.clone(),
            response.to_string(),
        ));
        sentences.push(format!("The {} is {result}.", calc.what));
        out.push((call.clone(), response));
    }
    messages.push(Message::assistant(sentences.join(" ")));
    Drill {
        messages,
        tools,
        calls: out,
    }
}

/// The declining twin of a drill that calls one function (once or twice): the same request,
/// the called function taken out of the list (another that does not fit put in its place when
/// the list would be empty, or with even odds), and a reply that declines without a call. Beside
/// its positive drill in a corpus, the two differ only in the tool list: the decision must come
/// from reading it. `None` for drills that make no call or call two functions.
pub fn decline_twin(d: &Drill, seed: u64) -> Option<Drill> {
    let name = &d.calls.first()?.0.name;
    if d.calls.iter().any(|(c, _)| &c.name != name) {
        return None;
    }
    let called = calc_of(d.tools.iter().find(|t| &t.name == name)?)?;
    let what = called.what;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7477_696e);
    let mut tools: Vec<ToolSpec> = d
        .tools
        .iter()
        .filter(|t| &t.name != name)
        .cloned()
        .collect();
    if tools.is_empty() || rng.random::<bool>() {
        let listed = |c: &Calc| {
            tools
                .iter()
                .any(|t| calc_of(t).is_some_and(|l| l.stem == c.stem))
        };
        let fits: Vec<&Calc> = CALCS
            .iter()
            .filter(|c| !overlaps(c, called) && !listed(c))
            .collect();
        let c = fits.choose(&mut rng)?;
        let at = rng.random_range(0..=tools.len());
        tools.insert(at, spec(c, name_of(c, &mut rng)));
    }
    let user = d
        .messages
        .iter()
        .position(|m| m.role == crate::message::Role::User)?;
    let mut messages = d.messages[..=user].to_vec();
    messages.push(Message::assistant(format!(
        "None of the available functions computes the {what}, so I can't do that with them."
    )));
    Some(Drill {
        messages,
        tools,
        calls: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    #[test]
    fn seeded_and_a_third_need_no_call() {
        assert_eq!(calc_drill(5, Some("S")), calc_drill(5, Some("S")));
        let mut none = 0;
        let (mut parallel, mut two_functions) = (0, 0);
        for seed in 0..600 {
            let d = calc_drill(seed, None);
            assert_eq!(d.messages[0].role, Role::User, "no system without one");
            if d.calls.is_empty() {
                none += 1;
                assert_eq!(d.messages.len(), 2);
                let answer = &d.messages[1].content;
                assert!(
                    answer.starts_with("None of the available functions"),
                    "{answer}"
                );
                // The quantity asked for is computed by no listed function.
                let user = &d.messages[0].content;
                for t in &d.tools {
                    let what = calc_of(t).expect("a calculation").what;
                    assert!(!user.contains(&format!(" {what} ")), "{user} / {what}");
                }
                continue;
            }
            parallel += usize::from(d.calls.len() == 2 && d.calls[0].0.name == d.calls[1].0.name);
            two_functions +=
                usize::from(d.calls.len() == 2 && d.calls[0].0.name != d.calls[1].0.name);
        }
        assert!((60..=130).contains(&none), "{none}");
        assert!(parallel > 40, "{parallel}");
        assert!(two_functions > 30, "{two_functions}");
    }

    #[test]
    fn calls_copy_the_request_and_results_follow_the_formula() {
        for seed in 0..400 {
            let d = calc_drill(seed, Some("S"));
            let user = &d.messages[1].content;
            for (call, response) in &d.calls {
                let tool = d
                    .tools
                    .iter()
                    .find(|t| t.name == call.name)
                    .expect("listed");
                let required = tool.input_schema["required"].as_array().unwrap();
                let args = call.arguments.as_object().unwrap();
                assert_eq!(args.len(), required.len());
                for (k, v) in args {
                    assert!(required.iter().any(|r| r == k), "{k}");
                    assert!(user.contains(&shown(v)), "{seed}: {v} not in {user}");
                    let ty = tool.input_schema["properties"][k]["type"].as_str().unwrap();
                    match ty {
                        "integer" => assert!(v.is_i64(), "{v}"),
                        "number" => assert!(v.is_number(), "{v}"),
                        _ => assert!(v.is_array(), "{v}"),
                    }
                }
                let answer = &d.messages.last().unwrap().content;
                assert!(answer.contains(&response["result"].to_string()), "{answer}");
            }
        }
        // A known one: the area of a circle of radius 2 is 12.57.
        let area = (CALCS[0].formula)(&[json!(2.0)]);
        assert_eq!(result_value(area), json!(12.57));
        assert_eq!(result_value(120.0), json!(120));
    }

    #[test]
    fn twins_differ_only_in_the_list_and_decline() {
        let mut twins = 0;
        for seed in 0..300 {
            let d = calc_drill(seed, Some("S"));
            let Some(t) = decline_twin(&d, seed) else {
                assert!(
                    d.calls.is_empty() || d.calls[0].0.name != d.calls[1].0.name,
                    "{seed}"
                );
                continue;
            };
            twins += 1;
            assert_eq!(t, decline_twin(&d, seed).unwrap(), "seeded");
            assert_eq!(t.messages[..2], d.messages[..2], "same system and request");
            assert_eq!(t.messages.len(), 3);
            assert!(t.calls.is_empty());
            let called = &d.calls[0].0.name;
            assert!(!t.tools.iter().any(|x| &x.name == called), "{seed}");
            assert!(!t.tools.is_empty());
            // Every other listed function is still there.
            for x in d.tools.iter().filter(|x| &x.name != called) {
                assert!(t.tools.contains(x));
            }
            assert!(
                t.messages[2]
                    .content
                    .starts_with("None of the available functions")
            );
        }
        assert!(twins > 150, "{twins}");
    }

    #[test]
    fn no_word_comes_from_the_test_pools() {
        for t in PLACES.iter().chain(SUBJECTS) {
            for w in t.split(' ') {
                assert!(!crate::env::domains::in_test_pools(w), "{w}");
            }
        }
        for seed in 0..200 {
            let d = calc_drill(seed, None);
            let text = serde_json::to_string(&d.messages).unwrap();
            for w in text.split(|c: char| !c.is_alphanumeric()) {
                assert!(!crate::env::domains::in_test_pools(w) || w.len() < 3, "{w}");
            }
        }
    }
}
