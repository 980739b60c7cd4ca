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

/// The steps for a list: sold-out flights named as such, then the free ones compared two at a
/// time, the running winner against the next (`fl_375 357 or fl_817 122: fl_817.`); a tie
/// keeps the earlier flight, as the domain's own choice does. `None` when no seat is free.
pub(crate) fn price_steps(content: &str) -> Option<String> {
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
        parts.push(format!(
            "{} {} or {} {}: {}.",
            best.id, best.price, f.id, f.price, winner.id
        ));
        best = winner;
    }
    if parts.is_empty() {
        // One free flight and nothing sold out: nothing to compare.
        return None;
    }
    Some(parts.join(" "))
}

/// `msgs` with the steps written at the start of every assistant turn that directly follows a
/// tool response listing flights (the message count and every call stay as they were).
pub(crate) fn with_price_steps(msgs: &[Message]) -> Vec<Message> {
    let mut out = msgs.to_vec();
    for i in 1..out.len() {
        if out[i].role != Role::Assistant || out[i - 1].role != Role::Tool {
            continue;
        }
        if let Some(steps) = price_steps(&out[i - 1].content) {
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
            price_steps(THREE).as_deref(),
            Some("fl_375 357 or fl_817 122: fl_817. fl_817 122 or fl_822 595: fl_817.")
        );
    }

    #[test]
    fn sold_out_flights_are_named_and_left_out_of_the_comparison() {
        let sold = THREE.replace(r#""price":122,"seats":1"#, r#""price":122,"seats":0"#);
        assert_eq!(
            price_steps(&sold).as_deref(),
            Some("fl_817 sold out. fl_375 357 or fl_822 595: fl_375.")
        );
        let none = r#"{"flights":[{"flight":"fl_1","price":5,"seats":0},{"flight":"fl_2","price":6,"seats":0}]}"#;
        assert_eq!(price_steps(none), None);
    }

    #[test]
    fn a_tie_keeps_the_earlier_flight() {
        let tie = r#"{"flights":[{"flight":"fl_2","price":100,"seats":1},{"flight":"fl_1","price":100,"seats":1}]}"#;
        assert_eq!(
            price_steps(tie).as_deref(),
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
            assert_eq!(price_steps(text), None, "{text}");
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
        let out = with_price_steps(&msgs);
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
        let answer = with_price_steps(&[
            Message::tool("call_0", "search", THREE),
            Message::assistant("The cheapest is fl_817 at 122."),
        ]);
        assert!(
            answer[1]
                .content
                .ends_with(": fl_817. The cheapest is fl_817 at 122.")
        );
    }
}
