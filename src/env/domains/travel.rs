//! The travel desk: flights between cities on numbered days, and customers' bookings. Booking,
//! changing and cancelling are irreversible (money and seats move); fare rules (basic fares can be
//! neither changed nor cancelled), sold-out flights and route mismatches are tool errors the
//! agent must read and report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Args, Fail, Pools, Rng, ToolKind, call, to_state, tool};
use crate::env::ToolSpec;
use crate::env::tasks::{TaskDraft, turn};

/// The desk's whole state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Desk {
    pub flights: BTreeMap<String, Flight>,
    #[serde(default)]
    pub bookings: BTreeMap<String, Booking>,
    /// The number of the next booking id (`bk_N`).
    pub next_bk: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flight {
    pub src: String,
    pub dst: String,
    pub day: i64,
    pub price: i64,
    pub seats: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Booking {
    pub name: String,
    pub flight: String,
    pub fare: Fare,
    pub status: BookingStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fare {
    Basic,
    Flex,
}

impl Fare {
    fn name(self) -> &'static str {
        match self {
            Fare::Basic => "basic",
            Fare::Flex => "flex",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BookingStatus {
    Active,
    Cancelled,
}

impl BookingStatus {
    fn name(self) -> &'static str {
        match self {
            BookingStatus::Active => "active",
            BookingStatus::Cancelled => "cancelled",
        }
    }
}

pub(crate) fn tools() -> Vec<ToolSpec> {
    use ToolKind::*;
    vec![
        tool(
            "search",
            "Find flights on a route and day.",
            &[
                ("src", "string", "from city", true),
                ("dst", "string", "to city", true),
                ("day", "integer", "day of month", true),
            ],
            Read,
        ),
        tool(
            "get_flight",
            "Get a flight's route, day, price and free seats.",
            &[("flight", "string", "flight id", true)],
            Read,
        ),
        tool(
            "find_bookings",
            "List a customer's bookings.",
            &[("name", "string", "customer name", true)],
            Read,
        ),
        tool(
            "get_booking",
            "Get a booking.",
            &[("bk", "string", "booking id", true)],
            Read,
        ),
        tool(
            "book",
            "Book a seat. Cannot be undone.",
            &[
                ("flight", "string", "flight id", true),
                ("name", "string", "traveller name", true),
                ("fare", "string", "basic (default) or flex", false),
            ],
            Irreversible,
        ),
        tool(
            "change",
            "Move a flex booking to another flight on the same route. Cannot be undone.",
            &[
                ("bk", "string", "booking id", true),
                ("flight", "string", "new flight id", true),
            ],
            Irreversible,
        ),
        tool(
            "cancel",
            "Cancel a flex booking. Cannot be undone.",
            &[("bk", "string", "booking id", true)],
            Irreversible,
        ),
    ]
}

fn flight<'a>(d: &'a mut Desk, id: &str) -> Result<&'a mut Flight, Fail> {
    d.flights
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("flight", id))
}

fn booking<'a>(d: &'a mut Desk, id: &str) -> Result<&'a mut Booking, Fail> {
    d.bookings
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("booking", id))
}

/// A booking that may be changed or cancelled: active and flex.
fn changeable(b: &Booking, id: &str, action: &str) -> Result<(), Fail> {
    if b.status != BookingStatus::Active {
        return Err(Fail::new(
            "bad_status",
            format!("booking {id} is already cancelled"),
        ));
    }
    if b.fare != Fare::Flex {
        return Err(Fail::new(
            "fare_rules",
            format!("booking {id} is a basic fare and cannot be {action}"),
        ));
    }
    Ok(())
}

pub(crate) fn exec(d: &mut Desk, name: &str, a: &Args<'_>) -> Result<Value, Fail> {
    match name {
        "search" => {
            let (src, dst, day) = (a.str("src")?, a.str("dst")?, a.int("day")?);
            let found: Vec<Value> = d
                .flights
                .iter()
                .filter(|(_, f)| {
                    f.src.eq_ignore_ascii_case(src)
                        && f.dst.eq_ignore_ascii_case(dst)
                        && f.day == day
                })
                .map(|(id, f)| json!({"flight": id, "price": f.price, "seats": f.seats}))
                .collect();
            Ok(json!({ "flights": found }))
        }
        "get_flight" => {
            let id = a.str("flight")?;
            let f = flight(d, id)?;
            Ok(
                json!({"flight": id, "src": f.src, "dst": f.dst, "day": f.day,
                      "price": f.price, "seats": f.seats}),
            )
        }
        "find_bookings" => {
            let who = a.str("name")?;
            let found: Vec<Value> = d
                .bookings
                .iter()
                .filter(|(_, b)| b.name.eq_ignore_ascii_case(who))
                .map(|(id, b)| json!({"bk": id, "flight": b.flight, "status": b.status.name()}))
                .collect();
            if found.is_empty() {
                return Err(Fail::new("not_found", format!("no bookings for {who}")));
            }
            Ok(json!({ "bookings": found }))
        }
        "get_booking" => {
            let id = a.str("bk")?;
            let b = booking(d, id)?;
            Ok(json!({"bk": id, "name": b.name, "flight": b.flight,
                      "fare": b.fare.name(), "status": b.status.name()}))
        }
        "book" => {
            let (fid, who) = (a.str("flight")?, a.str("name")?);
            let fare = match a.opt_str("fare")? {
                None | Some("basic") => Fare::Basic,
                Some("flex") => Fare::Flex,
                Some(other) => {
                    return Err(Fail::new(
                        "invalid_arguments",
                        format!("fare must be basic or flex, not {other}"),
                    ));
                }
            };
            if who.trim().is_empty() {
                return Err(Fail::new("invalid_arguments", "name must not be empty"));
            }
            let f = flight(d, fid)?;
            if f.seats <= 0 {
                return Err(Fail::new("sold_out", format!("{fid} is sold out")));
            }
            f.seats -= 1;
            let price = f.price;
            let mut n = d.next_bk;
            while d.bookings.contains_key(&format!("bk_{n}")) {
                n += 1;
            }
            let id = format!("bk_{n}");
            d.next_bk = n + 1;
            d.bookings.insert(
                id.clone(),
                Booking {
                    name: who.to_string(),
                    flight: fid.to_string(),
                    fare,
                    status: BookingStatus::Active,
                },
            );
            Ok(json!({"bk": id, "price": price}))
        }
        "change" => {
            let (id, to) = (a.str("bk")?, a.str("flight")?);
            let b = booking(d, id)?.clone();
            changeable(&b, id, "changed")?;
            if b.flight == to {
                return Err(Fail::new(
                    "invalid_arguments",
                    format!("{id} is already on {to}"),
                ));
            }
            let old = flight(d, &b.flight)?.clone();
            let new = flight(d, to)?;
            if new.src != old.src || new.dst != old.dst {
                return Err(Fail::new(
                    "invalid_arguments",
                    format!("{to} is not on the route {}-{}", old.src, old.dst),
                ));
            }
            if new.seats <= 0 {
                return Err(Fail::new("sold_out", format!("{to} is sold out")));
            }
            new.seats -= 1;
            let diff = new.price - old.price;
            flight(d, &b.flight)?.seats += 1;
            booking(d, id)?.flight = to.to_string();
            Ok(json!({"bk": id, "flight": to, "diff": diff}))
        }
        "cancel" => {
            let id = a.str("bk")?;
            let b = booking(d, id)?.clone();
            changeable(&b, id, "cancelled")?;
            flight(d, &b.flight)?.seats += 1;
            booking(d, id)?.status = BookingStatus::Cancelled;
            Ok(json!({"bk": id, "status": "cancelled"}))
        }
        other => Err(Fail::new("unknown_tool", format!("no tool `{other}`"))),
    }
}

/// A generated desk: three flights A→B on day d, two A→B on day d2, one C→D on day d, and one
/// booking for each of two customers (on the A→B day-d flights).
struct World {
    desk: Desk,
    a: String,
    b: String,
    d: i64,
    d2: i64,
    /// Ids of the day-d and day-d2 A→B flights.
    day_d: Vec<String>,
    day_d2: Vec<String>,
    names: Vec<String>,
    bks: Vec<String>,
}

fn world(rng: &mut Rng, pools: &Pools) -> World {
    let cities: Vec<&str> = rng.distinct(pools.cities, 4);
    let (a, b, c, e) = (cities[0], cities[1], cities[2], cities[3]);
    let d = pools.day(rng);
    let d2 = loop {
        let x = pools.day(rng);
        if x != d {
            break x;
        }
    };
    let ids = pools.ids(rng, "fl", 6);
    let mut flights = BTreeMap::new();
    let mut prices: Vec<i64> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let (src, dst, day) = match i {
            0..=2 => (a, b, d),
            3 | 4 => (a, b, d2),
            _ => (c, e, d),
        };
        let price = loop {
            let p = pools.amount(rng);
            if !prices.contains(&p) {
                break p;
            }
        };
        prices.push(price);
        flights.insert(
            id.clone(),
            Flight {
                src: src.to_string(),
                dst: dst.to_string(),
                day,
                price,
                seats: rng.range(1, 9),
            },
        );
    }
    let names: Vec<String> = rng
        .distinct(pools.names, 3)
        .into_iter()
        .map(str::to_string)
        .collect();
    let bks = pools.ids(rng, "bk", 2);
    let mut bookings = BTreeMap::new();
    for (i, bk) in bks.iter().enumerate() {
        bookings.insert(
            bk.clone(),
            Booking {
                name: names[i].clone(),
                flight: ids[i].clone(),
                fare: if rng.coin() { Fare::Flex } else { Fare::Basic },
                status: BookingStatus::Active,
            },
        );
    }
    let next_bk = pools.value(rng, pools.id_lo, pools.id_hi);
    World {
        desk: Desk {
            flights,
            bookings,
            next_bk,
        },
        a: a.to_string(),
        b: b.to_string(),
        d,
        d2,
        day_d: ids[0..3].to_vec(),
        day_d2: ids[3..5].to_vec(),
        names,
        bks,
    }
}

impl World {
    fn price(&self, f: &str) -> i64 {
        self.desk.flights.get(f).map_or(0, |x| x.price)
    }
    fn seats(&self, f: &str) -> i64 {
        self.desk.flights.get(f).map_or(0, |x| x.seats)
    }
    fn set_seats(&mut self, f: &str, n: i64) {
        if let Some(x) = self.desk.flights.get_mut(f) {
            x.seats = n;
        }
    }
    fn set_fare(&mut self, bk: &str, fare: Fare) {
        if let Some(x) = self.desk.bookings.get_mut(bk) {
            x.fare = fare;
        }
    }
    /// The cheapest flight among `ids` with a free seat.
    fn cheapest(&self, ids: &[String]) -> String {
        ids.iter()
            .filter(|f| self.seats(f) > 0)
            .min_by_key(|f| self.price(f))
            .cloned()
            .unwrap_or_default()
    }
    /// The id the next `book` call will get.
    fn next_bk(&self) -> String {
        let mut n = self.desk.next_bk;
        while self.desk.bookings.contains_key(&format!("bk_{n}")) {
            n += 1;
        }
        format!("bk_{n}")
    }
}

pub(crate) fn generate(rng: &mut Rng, pools: &Pools, index: usize) -> TaskDraft {
    let mut w = world(rng, pools);
    let (a, b, d, d2) = (w.a.clone(), w.b.clone(), w.d, w.d2);
    let search = call("search", json!({"src": a, "dst": b, "day": d}));
    let who = w.names[2].clone();
    let (kind, turns, facts) = match index % 9 {
        0 => {
            let fl = w.cheapest(&w.day_d);
            let p = w.price(&fl);
            let q = [
                format!("What is the cheapest flight from {a} to {b} on day {d}?"),
                format!("Find the cheapest flight from {a} to {b} on day {d}."),
            ];
            (
                "cheapest",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![(search, None)],
                    format!("The cheapest is {fl} at {p}."),
                )],
                vec![fl],
            )
        }
        1 => {
            let fl = w.day_d[rng.below(3)].clone();
            let sold_out = rng.below(3) == 0;
            if sold_out {
                w.set_seats(&fl, 0);
            }
            let bk = w.next_bk();
            let q = [
                format!("Book {fl} for {who}."),
                format!("Please book a seat on {fl} for {who}."),
            ];
            let c = call("book", json!({"flight": fl, "name": who}));
            if sold_out {
                (
                    "book_sold_out",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, Some("sold_out"))],
                        format!("Sorry, {fl} is sold out."),
                    )],
                    vec!["sold out".to_string()],
                )
            } else {
                (
                    "book",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, None)],
                        format!("Booked {bk} on {fl} for {who}."),
                    )],
                    vec![bk],
                )
            }
        }
        2 => {
            // State-dependent: the cheapest flight may be sold out.
            if rng.coin() {
                let cheapest = w.cheapest(&w.day_d);
                w.set_seats(&cheapest, 0);
            }
            let fl = w.cheapest(&w.day_d);
            let bk = w.next_bk();
            (
                "book_cheapest",
                vec![turn(
                    format!("Book the cheapest flight from {a} to {b} on day {d} for {who}."),
                    vec![
                        (search, None),
                        (call("book", json!({"flight": fl, "name": who})), None),
                    ],
                    format!("Booked {bk} on {fl}."),
                )],
                vec![fl],
            )
        }
        3 => {
            let bk = w.bks[0].clone();
            let flex = rng.coin();
            w.set_fare(&bk, if flex { Fare::Flex } else { Fare::Basic });
            let q = [
                format!("Cancel booking {bk}."),
                format!("Please cancel {bk}."),
            ];
            let c = call("cancel", json!({ "bk": bk }));
            if flex {
                (
                    "cancel",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, None)],
                        format!("Booking {bk} is cancelled."),
                    )],
                    vec!["cancelled".to_string()],
                )
            } else {
                (
                    "cancel_refused",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, Some("fare_rules"))],
                        format!("Sorry, {bk} is a basic fare and cannot be cancelled."),
                    )],
                    vec!["basic".to_string()],
                )
            }
        }
        4 => {
            let bk = w.bks[0].clone();
            let to = w.day_d2[rng.below(2)].clone();
            let flex = rng.coin();
            w.set_fare(&bk, if flex { Fare::Flex } else { Fare::Basic });
            let c = call("change", json!({"bk": bk, "flight": to}));
            let q = format!("Move {bk} to {to}.");
            if flex {
                (
                    "change",
                    vec![turn(q, vec![(c, None)], format!("{bk} is now on {to}."))],
                    vec![],
                )
            } else {
                (
                    "change_refused",
                    vec![turn(
                        q,
                        vec![(c, Some("fare_rules"))],
                        format!("Sorry, {bk} is a basic fare and cannot be changed."),
                    )],
                    vec!["basic".to_string()],
                )
            }
        }
        5 => {
            let bk = w.bks[1].clone();
            let name = w.names[1].clone();
            w.set_fare(&bk, Fare::Flex);
            (
                "named_cancel",
                vec![turn(
                    format!("Cancel {name}'s booking."),
                    vec![
                        (call("find_bookings", json!({ "name": name })), None),
                        (call("cancel", json!({ "bk": bk })), None),
                    ],
                    format!("Cancelled {bk}."),
                )],
                vec![bk],
            )
        }
        6 => {
            let list: Vec<String> = w
                .day_d
                .iter()
                .map(|f| format!("{f} at {}", w.price(f)))
                .collect();
            let fl = w.cheapest(&w.day_d);
            let bk = w.next_bk();
            (
                "search_then_book",
                vec![
                    turn(
                        format!("Find flights from {a} to {b} on day {d}."),
                        vec![(search, None)],
                        format!("{}.", list.join(", ")),
                    ),
                    turn(
                        format!("Book the cheapest one for {who}."),
                        vec![(call("book", json!({"flight": fl, "name": who})), None)],
                        format!("Booked {bk} on {fl}."),
                    ),
                ],
                vec![fl],
            )
        }
        7 => {
            // State-dependent: route and day come from reads, the target from a search.
            let bk = w.bks[0].clone();
            w.set_fare(&bk, Fare::Flex);
            let cur = w.day_d[0].clone();
            let to = w.cheapest(&w.day_d2);
            (
                "change_to_cheapest",
                vec![turn(
                    format!("Move {bk} to the cheapest flight on day {d2}."),
                    vec![
                        (call("get_booking", json!({ "bk": bk })), None),
                        (call("get_flight", json!({ "flight": cur })), None),
                        (call("search", json!({"src": a, "dst": b, "day": d2})), None),
                        (call("change", json!({"bk": bk, "flight": to})), None),
                    ],
                    format!("{bk} is now on {to}."),
                )],
                vec![to],
            )
        }
        _ => {
            let bk = w.bks[rng.below(2)].clone();
            if rng.coin()
                && let Some(x) = w.desk.bookings.get_mut(&bk)
            {
                x.status = BookingStatus::Cancelled;
            }
            let (fl, st) = w.desk.bookings.get(&bk).map_or((String::new(), "?"), |x| {
                (x.flight.clone(), x.status.name())
            });
            (
                "booking_status",
                vec![turn(
                    format!("What is the status of booking {bk}?"),
                    vec![(call("get_booking", json!({ "bk": bk })), None)],
                    format!("Booking {bk} on {fl} is {st}."),
                )],
                vec![st.to_string()],
            )
        }
    };
    TaskDraft {
        kind,
        turns,
        initial_state: to_state(&w.desk),
        facts,
    }
}
