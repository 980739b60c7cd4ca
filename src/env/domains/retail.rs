//! The retail domain: a shop's catalogue and customers' orders. Cancellations, returns and
//! exchanges move money and are irreversible; the order's status decides what is allowed
//! (only pending orders can be cancelled or re-addressed, only delivered ones returned), and
//! breaking that policy is a tool error the agent must read and report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Args, Fail, Pools, Rng, ToolKind, call, to_state, tool};
use crate::env::ToolSpec;
use crate::env::tasks::{TaskDraft, turn};

/// The shop's whole state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shop {
    pub products: BTreeMap<String, Product>,
    pub orders: BTreeMap<String, Order>,
    /// Money back to customers (negative: charged for an exchange), in order.
    #[serde(default)]
    pub refunds: Vec<Refund>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Product {
    pub item: String,
    pub price: i64,
    pub stock: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Order {
    pub name: String,
    pub status: Status,
    /// Product ids (skus).
    pub items: Vec<String>,
    pub city: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pending,
    Shipped,
    Delivered,
    Cancelled,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Shipped => "shipped",
            Status::Delivered => "delivered",
            Status::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Refund {
    pub order: String,
    pub amount: i64,
}

pub(crate) fn tools() -> Vec<ToolSpec> {
    use ToolKind::*;
    vec![
        tool(
            "find_orders",
            "List a customer's orders.",
            &[("name", "string", "customer name", true)],
            Read,
        ),
        tool(
            "get_order",
            "Get an order's status, city and items.",
            &[("order", "string", "order id", true)],
            Read,
        ),
        tool(
            "get_product",
            "Get a product's price and stock.",
            &[("sku", "string", "product id", true)],
            Read,
        ),
        tool(
            "cancel_order",
            "Cancel a pending order and refund it. Cannot be undone.",
            &[("order", "string", "order id", true)],
            Irreversible,
        ),
        tool(
            "return_item",
            "Return an item of a delivered order for a refund. Cannot be undone.",
            &[
                ("order", "string", "order id", true),
                ("sku", "string", "product id of the item", true),
            ],
            Irreversible,
        ),
        tool(
            "exchange_item",
            "Swap an item of a delivered order for another product. Cannot be undone.",
            &[
                ("order", "string", "order id", true),
                ("sku", "string", "product id of the item", true),
                ("new_sku", "string", "product id wanted", true),
            ],
            Irreversible,
        ),
        tool(
            "change_address",
            "Change the delivery city of a pending order.",
            &[
                ("order", "string", "order id", true),
                ("city", "string", "new city", true),
            ],
            Update,
        ),
    ]
}

fn order<'a>(s: &'a mut Shop, id: &str) -> Result<&'a mut Order, Fail> {
    s.orders
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("order", id))
}

fn product<'a>(s: &'a mut Shop, id: &str) -> Result<&'a mut Product, Fail> {
    s.products
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("product", id))
}

fn require(o: &Order, id: &str, want: Status, action: &str) -> Result<(), Fail> {
    if o.status == want {
        Ok(())
    } else {
        Err(Fail::new(
            "bad_status",
            format!(
                "order {id} is {}; only {} orders can be {action}",
                o.status.name(),
                want.name()
            ),
        ))
    }
}

fn price_of(s: &Shop, sku: &str) -> i64 {
    s.products.get(sku).map_or(0, |p| p.price)
}

pub(crate) fn exec(s: &mut Shop, name: &str, a: &Args<'_>) -> Result<Value, Fail> {
    match name {
        "find_orders" => {
            let who = a.str("name")?;
            let found: Vec<Value> = s
                .orders
                .iter()
                .filter(|(_, o)| o.name.eq_ignore_ascii_case(who))
                .map(|(id, o)| json!({"order": id, "status": o.status.name()}))
                .collect();
            if found.is_empty() {
                return Err(Fail::new("not_found", format!("no orders for {who}")));
            }
            Ok(json!({ "orders": found }))
        }
        "get_order" => {
            let id = a.str("order")?;
            let o = order(s, id)?.clone();
            let items: Vec<Value> = o
                .items
                .iter()
                .map(|sku| {
                    let item = s.products.get(sku).map_or("?", |p| p.item.as_str());
                    json!({"sku": sku, "item": item, "price": price_of(s, sku)})
                })
                .collect();
            Ok(json!({"order": id, "status": o.status.name(), "city": o.city, "items": items}))
        }
        "get_product" => {
            let sku = a.str("sku")?;
            let p = product(s, sku)?;
            Ok(json!({"sku": sku, "item": p.item, "price": p.price, "stock": p.stock}))
        }
        "cancel_order" => {
            let id = a.str("order")?;
            let o = order(s, id)?;
            require(o, id, Status::Pending, "cancelled")?;
            o.status = Status::Cancelled;
            let items = o.items.clone();
            let total: i64 = items.iter().map(|k| price_of(s, k)).sum();
            for k in &items {
                if let Some(p) = s.products.get_mut(k) {
                    p.stock += 1;
                }
            }
            s.refunds.push(Refund {
                order: id.to_string(),
                amount: total,
            });
            Ok(json!({"order": id, "status": "cancelled", "refund": total}))
        }
        "return_item" => {
            let (id, sku) = (a.str("order")?, a.str("sku")?);
            let o = order(s, id)?;
            require(o, id, Status::Delivered, "returned")?;
            let pos =
                o.items.iter().position(|k| k == sku).ok_or_else(|| {
                    Fail::new("not_in_order", format!("{sku} is not in order {id}"))
                })?;
            o.items.remove(pos);
            let refund = price_of(s, sku);
            product(s, sku)?.stock += 1;
            s.refunds.push(Refund {
                order: id.to_string(),
                amount: refund,
            });
            Ok(json!({"order": id, "refund": refund}))
        }
        "exchange_item" => {
            let (id, sku, new_sku) = (a.str("order")?, a.str("sku")?, a.str("new_sku")?);
            let o = order(s, id)?;
            require(o, id, Status::Delivered, "exchanged")?;
            let pos =
                o.items.iter().position(|k| k == sku).ok_or_else(|| {
                    Fail::new("not_in_order", format!("{sku} is not in order {id}"))
                })?;
            if sku == new_sku {
                return Err(Fail::new(
                    "invalid_arguments",
                    "sku and new_sku are the same",
                ));
            }
            let wanted = product(s, new_sku)?;
            if wanted.stock <= 0 {
                return Err(Fail::new(
                    "out_of_stock",
                    format!("{new_sku} is out of stock"),
                ));
            }
            wanted.stock -= 1;
            product(s, sku)?.stock += 1;
            order(s, id)?.items[pos] = new_sku.to_string();
            let diff = price_of(s, new_sku) - price_of(s, sku);
            s.refunds.push(Refund {
                order: id.to_string(),
                amount: -diff,
            });
            Ok(json!({"order": id, "diff": diff}))
        }
        "change_address" => {
            let (id, city) = (a.str("order")?, a.str("city")?);
            if city.trim().is_empty() {
                return Err(Fail::new("invalid_arguments", "city must not be empty"));
            }
            let o = order(s, id)?;
            require(o, id, Status::Pending, "re-addressed")?;
            o.city = city.to_string();
            Ok(json!({"order": id, "city": city}))
        }
        other => Err(Fail::new("unknown_tool", format!("no tool `{other}`"))),
    }
}

/// A generated shop: four products, one order per customer (three customers).
struct World {
    shop: Shop,
    skus: Vec<String>,
    names: Vec<String>,
    orders: Vec<String>,
}

fn world(rng: &mut Rng, pools: &Pools) -> World {
    let items: Vec<&str> = rng.distinct(pools.items, 4);
    let skus = pools.ids(rng, "sku", 4);
    let mut products = BTreeMap::new();
    for (sku, item) in skus.iter().zip(&items) {
        products.insert(
            sku.clone(),
            Product {
                item: (*item).to_string(),
                price: pools.amount(rng),
                stock: rng.range(1, 9),
            },
        );
    }
    let names: Vec<String> = rng
        .distinct(pools.names, 3)
        .into_iter()
        .map(str::to_string)
        .collect();
    let ids = pools.ids(rng, "ord", 4);
    let mut orders = BTreeMap::new();
    let statuses = [Status::Pending, Status::Shipped, Status::Delivered];
    for (i, name) in names.iter().enumerate() {
        let first = skus[rng.below(4)].clone();
        let mut its = vec![first.clone()];
        if rng.coin() {
            let other = skus[rng.below(4)].clone();
            if other != first {
                its.push(other);
            }
        }
        orders.insert(
            ids[i].clone(),
            Order {
                name: name.clone(),
                status: *rng.pick(&statuses),
                items: its,
                city: (*rng.pick(pools.cities)).to_string(),
            },
        );
    }
    World {
        shop: Shop {
            products,
            orders,
            refunds: Vec::new(),
        },
        skus,
        names,
        orders: ids,
    }
}

impl World {
    fn set_status(&mut self, o: &str, st: Status) {
        if let Some(x) = self.shop.orders.get_mut(o) {
            x.status = st;
        }
    }
    fn order(&self, o: &str) -> Option<&Order> {
        self.shop.orders.get(o)
    }
    fn item(&self, sku: &str) -> String {
        self.shop
            .products
            .get(sku)
            .map_or_else(String::new, |p| p.item.clone())
    }
    fn price(&self, sku: &str) -> i64 {
        price_of(&self.shop, sku)
    }
    fn total(&self, o: &str) -> i64 {
        self.order(o)
            .map_or(0, |x| x.items.iter().map(|k| self.price(k)).sum())
    }
    fn first_sku(&self, o: &str) -> String {
        self.order(o)
            .and_then(|x| x.items.first().cloned())
            .unwrap_or_default()
    }
}

pub(crate) fn generate(rng: &mut Rng, pools: &Pools, index: usize) -> TaskDraft {
    let mut w = world(rng, pools);
    let o = w.orders[0].clone();
    let get = call("get_order", json!({ "order": o }));
    let (kind, turns, facts) = match index % 10 {
        0 => {
            let st = w.order(&o).map_or("?", |x| x.status.name());
            let q = [
                format!("What is the status of {o}?"),
                format!("Where is my order {o}?"),
            ];
            (
                "status",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![(get, None)],
                    format!("Order {o} is {st}."),
                )],
                vec![st.to_string()],
            )
        }
        1 | 2 => {
            let ok = index % 10 == 1;
            let st = if ok {
                Status::Pending
            } else if rng.coin() {
                Status::Shipped
            } else {
                Status::Delivered
            };
            w.set_status(&o, st);
            let total = w.total(&o);
            let q = [format!("Cancel order {o}."), format!("Please cancel {o}.")];
            let c = call("cancel_order", json!({ "order": o }));
            if ok {
                (
                    "cancel",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, None)],
                        format!("Order {o} is cancelled. Refund: {total}."),
                    )],
                    vec![total.to_string()],
                )
            } else {
                (
                    "cancel_refused",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, Some("bad_status"))],
                        format!("Order {o} is {} and cannot be cancelled.", st.name()),
                    )],
                    vec![st.name().to_string()],
                )
            }
        }
        3 => {
            w.set_status(&o, Status::Delivered);
            let sku = w.first_sku(&o);
            let (item, price) = (w.item(&sku), w.price(&sku));
            let q = [
                format!("Return the {item} from {o}."),
                format!("I want to return the {item} in order {o}."),
            ];
            (
                "return",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![
                        (get, None),
                        (call("return_item", json!({"order": o, "sku": sku})), None),
                    ],
                    format!("Returned the {item}. Refund: {price}."),
                )],
                vec![price.to_string()],
            )
        }
        4 => {
            let ok = rng.coin();
            let st = if ok { Status::Pending } else { Status::Shipped };
            w.set_status(&o, st);
            let cur = w.order(&o).map_or(String::new(), |x| x.city.clone());
            let city = loop {
                let c = *rng.pick(pools.cities);
                if c != cur {
                    break c;
                }
            };
            let q = [
                format!("Ship {o} to {city} instead."),
                format!("Change the city of {o} to {city}."),
            ];
            let c = call("change_address", json!({"order": o, "city": city}));
            if ok {
                (
                    "change_address",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, None)],
                        format!("Order {o} will go to {city}."),
                    )],
                    vec![],
                )
            } else {
                (
                    "change_address_refused",
                    vec![turn(
                        rng.pick(&q).clone(),
                        vec![(c, Some("bad_status"))],
                        format!("Order {o} is already shipped, so the city cannot change."),
                    )],
                    vec!["shipped".to_string()],
                )
            }
        }
        5 => {
            // The customer has a second, delivered order; only the pending one is cancelled.
            let name = w.names[0].clone();
            let extra = w.orders[3].clone();
            w.set_status(&o, Status::Pending);
            let sku = w.skus[rng.below(4)].clone();
            w.shop.orders.insert(
                extra,
                Order {
                    name: name.clone(),
                    status: Status::Delivered,
                    items: vec![sku],
                    city: (*rng.pick(pools.cities)).to_string(),
                },
            );
            let total = w.total(&o);
            (
                "named_cancel",
                vec![turn(
                    format!("Cancel {name}'s pending order."),
                    vec![
                        (call("find_orders", json!({ "name": name })), None),
                        (call("cancel_order", json!({ "order": o })), None),
                    ],
                    format!("Cancelled {o}. Refund: {total}."),
                )],
                vec![o.clone(), total.to_string()],
            )
        }
        6 => {
            // State-dependent: the status read decides between cancel and return.
            let pending = rng.coin();
            w.set_status(
                &o,
                if pending {
                    Status::Pending
                } else {
                    Status::Delivered
                },
            );
            let sku = w.first_sku(&o);
            let item = w.item(&sku);
            let (act, reply, fact) = if pending {
                let total = w.total(&o);
                (
                    call("cancel_order", json!({ "order": o })),
                    format!("{o} was pending, so I cancelled it. Refund: {total}."),
                    total,
                )
            } else {
                let price = w.price(&sku);
                (
                    call("return_item", json!({"order": o, "sku": sku})),
                    format!("{o} was delivered, so I returned the {item}. Refund: {price}."),
                    price,
                )
            };
            (
                "cancel_or_return",
                vec![turn(
                    format!("If {o} is still pending, cancel it; otherwise return the {item}."),
                    vec![(get, None), (act, None)],
                    reply,
                )],
                vec![fact.to_string()],
            )
        }
        7 => {
            w.set_status(&o, Status::Delivered);
            let sku = w.first_sku(&o);
            let item = w.item(&sku);
            let new_sku = w
                .skus
                .iter()
                .find(|k| **k != sku)
                .cloned()
                .unwrap_or_default();
            let out = rng.below(3) == 0;
            if out && let Some(p) = w.shop.products.get_mut(&new_sku) {
                p.stock = 0;
            }
            let diff = w.price(&new_sku) - w.price(&sku);
            let c = call(
                "exchange_item",
                json!({"order": o, "sku": sku, "new_sku": new_sku}),
            );
            let q = format!("Exchange the {item} in {o} for {new_sku}.");
            if out {
                (
                    "exchange_refused",
                    vec![turn(
                        q,
                        vec![(get, None), (c, Some("out_of_stock"))],
                        format!("Sorry, {new_sku} is out of stock."),
                    )],
                    vec!["out of stock".to_string()],
                )
            } else {
                (
                    "exchange",
                    vec![turn(
                        q,
                        vec![(get, None), (c, None)],
                        format!("Exchanged. Price difference: {diff}."),
                    )],
                    vec![diff.to_string()],
                )
            }
        }
        8 => {
            w.set_status(&o, Status::Delivered);
            let sku = w.first_sku(&o);
            let (item, price) = (w.item(&sku), w.price(&sku));
            (
                "price_then_return",
                vec![
                    turn(
                        format!("How much was the {item} in {o}?"),
                        vec![(get, None)],
                        format!("The {item} cost {price}."),
                    ),
                    turn(
                        "Please return it.".to_string(),
                        vec![(call("return_item", json!({"order": o, "sku": sku})), None)],
                        format!("Returned. Refund: {price}."),
                    ),
                ],
                vec![price.to_string()],
            )
        }
        _ => {
            let sku = w.skus[rng.below(4)].clone();
            let out = rng.below(3) == 0;
            if out && let Some(p) = w.shop.products.get_mut(&sku) {
                p.stock = 0;
            }
            let stock = w.shop.products.get(&sku).map_or(0, |p| p.stock);
            let (reply, fact) = if out {
                (
                    format!("{sku} is out of stock."),
                    "out of stock".to_string(),
                )
            } else {
                (
                    format!("{sku} has {stock} in stock."),
                    format!("{stock} in stock"),
                )
            };
            (
                "stock",
                vec![turn(
                    format!("Is {sku} in stock?"),
                    vec![(call("get_product", json!({ "sku": sku })), None)],
                    reply,
                )],
                vec![fact],
            )
        }
    };
    TaskDraft {
        kind,
        turns,
        initial_state: to_state(&w.shop),
        facts,
    }
}
