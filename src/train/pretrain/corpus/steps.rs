//! Written comparison steps (`pretrain --price-steps`): the actor turn that follows a list of
//! flights first compares their prices two at a time in its own text, then calls or answers.
//!
//! Why it exists: the SmolLM2 policy picks "the cheapest of three flights" about as often as a
//! blind pick would on the train split (docs/TRAINING.md, "the failures are decisions"). Its
//! call copies an id from the list but not the id that belongs to the lowest price, a comparison
//! it would have to make inside one forward pass. Written out, each step compares two numbers
//! that stand side by side and copies the winner's id, which a small model can learn; the last
//! winner is then the id to copy into the call. The steps are the actor's own content, so the
//! policy writes them at inference too, and they are in the conversation that later turns and
//! the simulator see.
//!
//! Two styles ([`PriceStepStyle`]). `pairs` (stage 15) writes both flights of each pair with their
//! prices and the winner's id; the model learnt to write the final winner's id in every step
//! without comparing the pair (29% of its steps named a winner not in the pair). `prices`
//! compares the prices alone, the running minimum against the next (`357 or 122: 122.`), then
//! names the flight with that price once (`Cheapest: fl_817.`): each step copies one of two
//! numbers that stand side by side, and the id is found by the price it was listed with; the
//! closing name marks where the comparison ends and the call or answer begins.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::{Message, Role};

/// One flight of a `flights` list: id, price, free seats.
struct Flight {
    id: String,
    price: i64,
    seats: i64,
}

/// The flights of a tool response's JSON text (`{"flights": [{"flight", "price", "seats"}]}`),
/// or `None` when it is not such a list of at least two.
fn flights(content: &str) -> Option<Vec<Flight>> {
    let v: Value = serde_json::from_str(content).ok()?;
    let list = v.get("flights")?.as_array()?;
    if list.len() < 2 {
        return None;
    }
    list.iter()
        .map(|f| {
            Some(Flight {
                id: f.get("flight")?.as_str()?.to_string(),
                price: f.get("price")?.as_i64()?,
                seats: f.get("seats")?.as_i64()?,
            })
        })
        .collect()
}

/// How the comparison is written (`pretrain --price-steps [pairs|prices]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PriceStepStyle {
    /// Flights with prices, the winner's id: `fl_375 357 or fl_817 122: fl_817.`
    Pairs,
    /// Prices alone, then the cheapest flight's id: `357 or 122: 122. … Cheapest: fl_817.`
    Prices,
}

/// The steps for a list in `style`: sold-out flights named as such, then the free ones compared
/// two at a time, the running winner against the next; a tie keeps the earlier flight, as the
/// domain's own choice does. `prices` closes with the cheapest flight's id, also when one free
/// flight left nothing to compare. `None` when no seat is free, or (pairs) nothing is to say.
pub(crate) fn price_steps(content: &str, style: PriceStepStyle) -> Option<String> {
    let list = flights(content)?;
    let mut parts: Vec<String> = list
        .iter()
        .filter(|f| f.seats <= 0)
        .map(|f| format!("{} sold out.", f.id))
        .collect();
    let mut free = list.iter().filter(|f| f.seats > 0);
    let mut best = free.next()?;
    for f in free {
        let winner = if f.price < best.price { f } else { best };
        parts.push(match style {
            PriceStepStyle::Pairs => format!(
                "{} {} or {} {}: {}.",
                best.id, best.price, f.id, f.price, winner.id
            ),
            PriceStepStyle::Prices => format!("{} or {}: {}.", best.price, f.price, winner.price),
        });
        best = winner;
    }
    match style {
        PriceStepStyle::Pairs if parts.is_empty() => return None,
        PriceStepStyle::Pairs => {}
        PriceStepStyle::Prices => parts.push(format!("Cheapest: {}.", best.id)),
    }
    Some(parts.join(" "))
}

/// `CorpusConfig::price_steps` as recorded: absent or `false` (off), `true` (pairs: the
/// configs of stage 15 and 16, written before there was a second style) or `"prices"`. Pairs
/// is still written `true`, so that those configs read and write back unchanged.
pub(super) mod recorded {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serialize, Serializer};

    use super::PriceStepStyle;

    pub fn serialize<S: Serializer>(v: &Option<PriceStepStyle>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_bool(false),
            Some(PriceStepStyle::Pairs) => s.serialize_bool(true),
            Some(style) => style.serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<PriceStepStyle>, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Option<PriceStepStyle>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#"price_steps: false, true (pairs), "pairs" or "prices""#)
            }
            fn visit_bool<E: de::Error>(self, on: bool) -> Result<Self::Value, E> {
                Ok(on.then_some(PriceStepStyle::Pairs))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                match s {
                    "pairs" => Ok(Some(PriceStepStyle::Pairs)),
                    "prices" => Ok(Some(PriceStepStyle::Prices)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(s), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `msgs` with the steps written at the start of every assistant turn that directly follows a
/// tool response listing flights (the message count and every call stay as they were).
pub(crate) fn with_price_steps(msgs: &[Message], style: PriceStepStyle) -> Vec<Message> {
    let mut out = msgs.to_vec();
    for i in 1..out.len() {
        if out[i].role != Role::Assistant || out[i - 1].role != Role::Tool {
            continue;
        }
        if let Some(steps) = price_steps(&out[i - 1].content, style) {
            let m = &mut out[i];
            m.content = if m.content.is_empty() {
                steps
            } else {
                format!("{steps} {}", m.content)
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: &str = r#"{"flights":[{"flight":"fl_375","price":357,"seats":7},{"flight":"fl_817","price":122,"seats":1},{"flight":"fl_822","price":595,"seats":5}]}"#;

    #[test]
    fn steps_compare_the_running_winner_with_the_next_flight() {
        assert_eq!(
            price_steps(THREE, PriceStepStyle::Pairs).as_deref(),
            Some("fl_375 357 or fl_817 122: fl_817. fl_817 122 or fl_822 595: fl_817.")
        );
    }

    #[test]
    fn sold_out_flights_are_named_and_left_out_of_the_comparison() {
        let sold = THREE.replace(r#""price":122,"seats":1"#, r#""price":122,"seats":0"#);
        assert_eq!(
            price_steps(&sold, PriceStepStyle::Pairs).as_deref(),
            Some("fl_817 sold out. fl_375 357 or fl_822 595: fl_375.")
        );
        let none = r#"{"flights":[{"flight":"fl_1","price":5,"seats":0},{"flight":"fl_2","price":6,"seats":0}]}"#;
        assert_eq!(price_steps(none, PriceStepStyle::Pairs), None);
    }

    #[test]
    fn a_tie_keeps_the_earlier_flight() {
        let tie = r#"{"flights":[{"flight":"fl_2","price":100,"seats":1},{"flight":"fl_1","price":100,"seats":1}]}"#;
        assert_eq!(
            price_steps(tie, PriceStepStyle::Pairs).as_deref(),
            Some("fl_2 100 or fl_1 100: fl_2.")
        );
    }

    #[test]
    fn other_responses_get_no_steps() {
        for text in [
            r#"{"flight":"fl_1","price":5,"seats":1}"#,
            r#"{"flights":[{"flight":"fl_1","price":5,"seats":1}]}"#,
            r#"{"accounts":[{"acc":"acc_1","type":"checking"}]}"#,
            "not json",
        ] {
            for style in [PriceStepStyle::Pairs, PriceStepStyle::Prices] {
                assert_eq!(price_steps(text, style), None, "{text}");
            }
        }
    }

    #[test]
    fn only_the_turn_after_a_flight_list_is_written_and_calls_stay() {
        let call = crate::message::MessageToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: crate::message::ToolCall {
                name: "book".into(),
                arguments: serde_json::json!({"flight": "fl_817", "name": "Lena"}),
            },
        };
        let mut booking = Message::assistant("");
        booking.tool_calls = vec![call];
        let msgs = vec![
            Message::user("Book the cheapest flight from Riga to Quito on day 9 for Lena."),
            Message::assistant(""),
            Message::tool("call_0", "search", THREE),
            booking.clone(),
            Message::tool("call_1", "book", r#"{"bk":"bk_1","price":122}"#),
            Message::assistant("Booked bk_1 on fl_817."),
        ];
        let out = with_price_steps(&msgs, PriceStepStyle::Pairs);
        assert_eq!(out.len(), msgs.len());
        assert_eq!(
            out[3].content,
            "fl_375 357 or fl_817 122: fl_817. fl_817 122 or fl_822 595: fl_817."
        );
        assert_eq!(out[3].tool_calls, booking.tool_calls);
        for i in [0, 1, 2, 4, 5] {
            assert_eq!(out[i], msgs[i], "message {i}");
        }
        // An answer keeps its text after the steps.
        let answer = with_price_steps(
            &[
                Message::tool("call_0", "search", THREE),
                Message::assistant("The cheapest is fl_817 at 122."),
            ],
            PriceStepStyle::Pairs,
        );
        assert!(
            answer[1]
                .content
                .ends_with(": fl_817. The cheapest is fl_817 at 122.")
        );
    }

    #[test]
    fn prices_style_compares_prices_then_names_the_cheapest_once() {
        let p = PriceStepStyle::Prices;
        assert_eq!(
            price_steps(THREE, p).as_deref(),
            Some("357 or 122: 122. 122 or 595: 122. Cheapest: fl_817.")
        );
        let sold = THREE.replace(r#""price":122,"seats":1"#, r#""price":122,"seats":0"#);
        assert_eq!(
            price_steps(&sold, p).as_deref(),
            Some("fl_817 sold out. 357 or 595: 357. Cheapest: fl_375.")
        );
        let tie = r#"{"flights":[{"flight":"fl_2","price":100,"seats":1},{"flight":"fl_1","price":100,"seats":1}]}"#;
        assert_eq!(
            price_steps(tie, p).as_deref(),
            Some("100 or 100: 100. Cheapest: fl_2.")
        );
        // One free flight: nothing to compare, its name still closes the steps.
        let one = r#"{"flights":[{"flight":"fl_1","price":5,"seats":0},{"flight":"fl_2","price":6,"seats":3}]}"#;
        assert_eq!(
            price_steps(one, p).as_deref(),
            Some("fl_1 sold out. Cheapest: fl_2.")
        );
        let none = r#"{"flights":[{"flight":"fl_1","price":5,"seats":0},{"flight":"fl_2","price":6,"seats":0}]}"#;
        assert_eq!(price_steps(none, p), None);
        // Only the cheapest free flight's id is written after the sold-out ones.
        let text = price_steps(THREE, p).unwrap_or_default();
        assert!(
            !text.contains("fl_375") && !text.contains("fl_822"),
            "{text}"
        );
    }
}
