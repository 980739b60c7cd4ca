//! The bank domain: customers with a checking and a savings account, debit cards, transfers
//! under a per-account transfer limit, card payments, card freezes. Money moves (`transfer`,
//! `card_pay`) are irreversible; policy violations (insufficient funds, over the limit, frozen
//! card) come back as tool errors the agent must read and report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Args, Fail, Pools, Rng, ToolKind, call, to_state, tool};
use crate::env::ToolSpec;
use crate::env::tasks::{TaskDraft, turn};

/// The bank's whole state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bank {
    pub accounts: BTreeMap<String, Account>,
    #[serde(default)]
    pub cards: BTreeMap<String, Card>,
    /// Transfers and card payments, in order.
    #[serde(default)]
    pub ledger: Vec<Entry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Account {
    pub owner: String,
    #[serde(rename = "type")]
    pub kind: AccountKind,
    pub balance: i64,
    /// The largest single transfer allowed out of this account.
    pub limit: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccountKind {
    Checking,
    Savings,
}

impl AccountKind {
    fn name(self) -> &'static str {
        match self {
            AccountKind::Checking => "checking",
            AccountKind::Savings => "savings",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Card {
    pub acc: String,
    pub frozen: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub tx: String,
    pub src: String,
    pub dst: String,
    pub amount: i64,
}

pub(crate) fn tools() -> Vec<ToolSpec> {
    use ToolKind::*;
    vec![
        tool(
            "find_accounts",
            "List a customer's accounts.",
            &[("name", "string", "customer name", true)],
            Read,
        ),
        tool(
            "get_balance",
            "Get an account's balance.",
            &[("acc", "string", "account id", true)],
            Read,
        ),
        tool(
            "get_cards",
            "List the cards of an account.",
            &[("acc", "string", "account id", true)],
            Read,
        ),
        tool(
            "transfer",
            "Move money between accounts. Cannot be undone.",
            &[
                ("src", "string", "source account id", true),
                ("dst", "string", "destination account id", true),
                ("amount", "integer", "amount", true),
            ],
            Irreversible,
        ),
        tool(
            "card_pay",
            "Pay a merchant with a card. Cannot be undone.",
            &[
                ("card", "string", "card id", true),
                ("payee", "string", "merchant", true),
                ("amount", "integer", "amount", true),
            ],
            Irreversible,
        ),
        tool(
            "freeze_card",
            "Freeze a card.",
            &[("card", "string", "card id", true)],
            Update,
        ),
        tool(
            "unfreeze_card",
            "Unfreeze a card.",
            &[("card", "string", "card id", true)],
            Update,
        ),
        tool(
            "set_limit",
            "Set an account's transfer limit (0 to 5000).",
            &[
                ("acc", "string", "account id", true),
                ("limit", "integer", "new limit", true),
            ],
            Update,
        ),
    ]
}

fn account<'a>(b: &'a mut Bank, id: &str) -> Result<&'a mut Account, Fail> {
    b.accounts
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("account", id))
}

fn card<'a>(b: &'a mut Bank, id: &str) -> Result<&'a mut Card, Fail> {
    b.cards
        .get_mut(id)
        .ok_or_else(|| Fail::not_found("card", id))
}

fn positive(amount: i64) -> Result<i64, Fail> {
    if amount <= 0 {
        Err(Fail::new("invalid_amount", "amount must be positive"))
    } else {
        Ok(amount)
    }
}

pub(crate) fn exec(b: &mut Bank, name: &str, a: &Args<'_>) -> Result<Value, Fail> {
    match name {
        "find_accounts" => {
            let who = a.str("name")?;
            let accs: Vec<Value> = b
                .accounts
                .iter()
                .filter(|(_, x)| x.owner.eq_ignore_ascii_case(who))
                .map(|(id, x)| json!({"acc": id, "type": x.kind.name()}))
                .collect();
            if accs.is_empty() {
                return Err(Fail::new("not_found", format!("no customer named {who}")));
            }
            Ok(json!({ "accounts": accs }))
        }
        "get_balance" => {
            let id = a.str("acc")?;
            let acc = account(b, id)?;
            Ok(json!({"acc": id, "balance": acc.balance}))
        }
        "get_cards" => {
            let id = a.str("acc")?;
            account(b, id)?;
            let cards: Vec<Value> = b
                .cards
                .iter()
                .filter(|(_, c)| c.acc == id)
                .map(|(cid, c)| json!({"card": cid, "frozen": c.frozen}))
                .collect();
            Ok(json!({ "cards": cards }))
        }
        "transfer" => {
            let (src, dst) = (a.str("src")?, a.str("dst")?);
            let amount = positive(a.int("amount")?)?;
            if src == dst {
                return Err(Fail::new("invalid_arguments", "src and dst are the same"));
            }
            account(b, dst)?;
            let from = account(b, src)?;
            if amount > from.limit {
                return Err(Fail::new(
                    "limit_exceeded",
                    format!(
                        "{amount} is over the transfer limit {} of {src}",
                        from.limit
                    ),
                ));
            }
            if from.balance < amount {
                return Err(Fail::new(
                    "insufficient_funds",
                    format!("{src} has insufficient funds"),
                ));
            }
            from.balance -= amount;
            let left = from.balance;
            account(b, dst)?.balance += amount;
            let tx = format!("tx_{}", b.ledger.len() + 1);
            b.ledger.push(Entry {
                tx: tx.clone(),
                src: src.to_string(),
                dst: dst.to_string(),
                amount,
            });
            Ok(json!({"tx": tx, "balance": left}))
        }
        "card_pay" => {
            let (cid, payee) = (a.str("card")?, a.str("payee")?);
            let amount = positive(a.int("amount")?)?;
            let c = card(b, cid)?.clone();
            if c.frozen {
                return Err(Fail::new("card_frozen", format!("card {cid} is frozen")));
            }
            let acc = account(b, &c.acc)?;
            if acc.balance < amount {
                return Err(Fail::new(
                    "insufficient_funds",
                    format!("{} has insufficient funds", c.acc),
                ));
            }
            acc.balance -= amount;
            let left = acc.balance;
            let tx = format!("tx_{}", b.ledger.len() + 1);
            b.ledger.push(Entry {
                tx: tx.clone(),
                src: c.acc.clone(),
                dst: payee.to_string(),
                amount,
            });
            Ok(json!({"tx": tx, "balance": left}))
        }
        "freeze_card" | "unfreeze_card" => {
            let cid = a.str("card")?;
            let c = card(b, cid)?;
            c.frozen = name == "freeze_card";
            Ok(json!({"card": cid, "frozen": c.frozen}))
        }
        "set_limit" => {
            let id = a.str("acc")?;
            let limit = a.int("limit")?;
            if !(0..=5000).contains(&limit) {
                return Err(Fail::new("invalid_amount", "limit must be 0 to 5000"));
            }
            account(b, id)?.limit = limit;
            Ok(json!({"acc": id, "limit": limit}))
        }
        other => Err(Fail::new("unknown_tool", format!("no tool `{other}`"))),
    }
}

/// A customer in a generated world.
struct Person {
    name: String,
    chk: String,
    sav: String,
    card: String,
}

fn world(rng: &mut Rng, pools: &Pools, n: usize) -> (Bank, Vec<Person>) {
    let names: Vec<&str> = rng.distinct(pools.names, n);
    let accs = pools.ids(rng, "acc", 2 * n);
    let cards = pools.ids(rng, "card", n + 1);
    let mut bank = Bank {
        accounts: BTreeMap::new(),
        cards: BTreeMap::new(),
        ledger: Vec::new(),
    };
    let mut people = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (chk, sav) = (accs[2 * i].clone(), accs[2 * i + 1].clone());
        for (id, kind) in [(&chk, AccountKind::Checking), (&sav, AccountKind::Savings)] {
            bank.accounts.insert(
                id.clone(),
                Account {
                    owner: (*name).to_string(),
                    kind,
                    balance: rng.range(pools.amt_hi, pools.amt_hi * 3),
                    limit: 2000,
                },
            );
        }
        bank.cards.insert(
            cards[i].clone(),
            Card {
                acc: chk.clone(),
                frozen: false,
            },
        );
        people.push(Person {
            name: (*name).to_string(),
            chk,
            sav,
            card: cards[i].clone(),
        });
    }
    // One spare card id, unused unless a task gives someone a second card.
    let spare = cards[n].clone();
    people.push(Person {
        name: String::new(),
        chk: String::new(),
        sav: String::new(),
        card: spare,
    });
    (bank, people)
}

fn acc_mut<'a>(b: &'a mut Bank, id: &str) -> Option<&'a mut Account> {
    b.accounts.get_mut(id)
}

pub(crate) fn generate(rng: &mut Rng, pools: &Pools, index: usize) -> TaskDraft {
    let (mut bank, people) = world(rng, pools, 3);
    let (p0, p1) = (&people[0], &people[1]);
    let amt = pools.amount(rng);
    let payee = *rng.pick(pools.payees);
    let transfer_phrase = |rng: &mut Rng, amt: i64, a: &str, b: &str| {
        let t = [
            format!("Transfer {amt} from {a} to {b}."),
            format!("Send {amt} from {a} to {b}."),
            format!("Move {amt} from {a} to {b}."),
        ];
        rng.pick(&t).clone()
    };
    let tr = |src: &str, dst: &str, amount: i64| {
        call(
            "transfer",
            json!({"src": src, "dst": dst, "amount": amount}),
        )
    };
    let (kind, turns, facts) = match index % 12 {
        0 => {
            let acc = if rng.coin() { &p0.chk } else { &p0.sav };
            let bal = bank.accounts.get(acc).map_or(0, |x| x.balance);
            let q = [
                format!("What is the balance of {acc}?"),
                format!("How much money is in {acc}?"),
                format!("Show me the balance of {acc}."),
            ];
            (
                "balance",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![(call("get_balance", json!({ "acc": acc })), None)],
                    format!("The balance of {acc} is {bal}."),
                )],
                vec![bal.to_string()],
            )
        }
        1 => {
            let (a, b) = (&p0.chk, if rng.coin() { &p1.chk } else { &p0.sav });
            (
                "transfer",
                vec![turn(
                    transfer_phrase(rng, amt, a, b),
                    vec![(tr(a, b, amt), None)],
                    format!("Done. Sent {amt} from {a} to {b}."),
                )],
                vec![],
            )
        }
        2 => {
            let c = &p0.card;
            let q = [
                format!("Freeze card {c}."),
                format!("Please block card {c}."),
                format!("I lost card {c}. Freeze it."),
            ];
            (
                "freeze",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![(call("freeze_card", json!({ "card": c })), None)],
                    format!("Card {c} is now frozen."),
                )],
                vec![],
            )
        }
        3 => {
            let k1 = if rng.coin() { "checking" } else { "savings" };
            let k2 = if rng.coin() { "checking" } else { "savings" };
            let src = if k1 == "checking" { &p0.chk } else { &p0.sav };
            let dst = if k2 == "checking" { &p1.chk } else { &p1.sav };
            let q = [
                format!("Send {amt} from {}'s {k1} to {}'s {k2}.", p0.name, p1.name),
                format!("Move {amt} from {}'s {k1} to {}'s {k2}.", p0.name, p1.name),
            ];
            (
                "named_transfer",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![
                        (call("find_accounts", json!({"name": p0.name})), None),
                        (call("find_accounts", json!({"name": p1.name})), None),
                        (tr(src, dst, amt), None),
                    ],
                    format!("Done. Sent {amt} to {}.", p1.name),
                )],
                vec![],
            )
        }
        4 => {
            // State-dependent: the balance read decides the source account.
            let enough = rng.coin();
            let chk_bal = if enough {
                rng.range(amt, amt + pools.amt_hi)
            } else {
                rng.range(0, amt - 1)
            };
            if let Some(x) = acc_mut(&mut bank, &p0.chk) {
                x.balance = chk_bal;
            }
            let dst = &p1.chk;
            let (src, which) = if enough {
                (&p0.chk, "checking")
            } else {
                (&p0.sav, "savings")
            };
            let q = [
                format!(
                    "Pay {amt} to {dst} from {}'s checking if it has enough, else from savings.",
                    p0.name
                ),
                format!(
                    "Send {amt} to {dst} from {}'s checking, or from savings if checking is short.",
                    p0.name
                ),
            ];
            (
                "pay_if_enough",
                vec![turn(
                    rng.pick(&q).clone(),
                    vec![
                        (call("find_accounts", json!({"name": p0.name})), None),
                        (call("get_balance", json!({"acc": p0.chk})), None),
                        (tr(src, dst, amt), None),
                    ],
                    format!("Paid {amt} to {dst} from {which}."),
                )],
                vec![which.to_string()],
            )
        }
        5 => {
            let (a, b) = (&p0.chk, &p1.sav);
            let bal = rng.range(0, amt - 1);
            if let Some(x) = acc_mut(&mut bank, a) {
                x.balance = bal;
            }
            (
                "insufficient_funds",
                vec![turn(
                    transfer_phrase(rng, amt, a, b),
                    vec![(tr(a, b, amt), Some("insufficient_funds"))],
                    format!("Sorry, {a} has insufficient funds for {amt}."),
                )],
                vec!["insufficient".to_string()],
            )
        }
        6 => {
            let (a, b) = (&p0.sav, &p1.chk);
            let limit = rng.range(amt / 2, amt - 1);
            if let Some(x) = acc_mut(&mut bank, a) {
                x.limit = limit;
            }
            (
                "over_limit",
                vec![turn(
                    transfer_phrase(rng, amt, a, b),
                    vec![(tr(a, b, amt), Some("limit_exceeded"))],
                    format!("Sorry, {amt} is over the transfer limit of {a}."),
                )],
                vec!["limit".to_string()],
            )
        }
        7 => {
            let c = &p0.card;
            if let Some(x) = bank.cards.get_mut(c) {
                x.frozen = true;
            }
            let pay = call(
                "card_pay",
                json!({"card": c, "payee": payee, "amount": amt}),
            );
            (
                "frozen_card_retry",
                vec![
                    turn(
                        format!("Pay {amt} to the {payee} with card {c}."),
                        vec![(pay.clone(), Some("card_frozen"))],
                        format!("Card {c} is frozen, so the payment failed."),
                    ),
                    turn(
                        "Unfreeze it and pay again.".to_string(),
                        vec![
                            (call("unfreeze_card", json!({ "card": c })), None),
                            (pay, None),
                        ],
                        format!("Done. Paid {amt} to the {payee}."),
                    ),
                ],
                vec!["frozen".to_string()],
            )
        }
        8 => {
            let (a, b) = (&p0.chk, &p1.chk);
            let bal = bank.accounts.get(a).map_or(0, |x| x.balance);
            let part = amt.min(bal);
            (
                "balance_then_move",
                vec![
                    turn(
                        format!("What is the balance of {a}?"),
                        vec![(call("get_balance", json!({ "acc": a })), None)],
                        format!("The balance of {a} is {bal}."),
                    ),
                    turn(
                        format!("Move {part} of it to {b}."),
                        vec![(tr(a, b, part), None)],
                        format!("Done. Sent {part} to {b}."),
                    ),
                ],
                vec![bal.to_string()],
            )
        }
        9 => {
            let (a, b) = (&p0.chk, &p1.sav);
            let old = rng.range(amt / 2, amt - 1);
            let new = pools.value(rng, amt + 1, amt + 150);
            if let Some(x) = acc_mut(&mut bank, a) {
                x.limit = old;
            }
            (
                "raise_limit_then_send",
                vec![turn(
                    format!("Raise the limit of {a} to {new}, then send {amt} to {b}."),
                    vec![
                        (call("set_limit", json!({"acc": a, "limit": new})), None),
                        (tr(a, b, amt), None),
                    ],
                    format!("Done. The limit is {new} and {amt} went to {b}."),
                )],
                vec![],
            )
        }
        10 => {
            // State-dependent: only the cards that are not frozen yet get frozen.
            let a = &p0.chk;
            let second = &people[3].card;
            bank.cards.insert(
                second.clone(),
                Card {
                    acc: a.clone(),
                    frozen: false,
                },
            );
            let mut ids = [p0.card.clone(), second.clone()];
            ids.sort();
            let already = rng.below(3); // 0, 1: that card is frozen already; 2: none
            if already < 2
                && let Some(x) = bank.cards.get_mut(&ids[already])
            {
                x.frozen = true;
            }
            let mut actions = vec![(call("get_cards", json!({ "acc": a })), None)];
            for (i, c) in ids.iter().enumerate() {
                if i != already {
                    actions.push((call("freeze_card", json!({ "card": c })), None));
                }
            }
            (
                "freeze_all_cards",
                vec![turn(
                    format!("Freeze all cards of {a}."),
                    actions,
                    format!("All cards of {a} are frozen."),
                )],
                vec![],
            )
        }
        _ => {
            let c = &p0.card;
            let short = rng.below(3) == 0;
            if short {
                let bal = rng.range(0, amt - 1);
                if let Some(x) = acc_mut(&mut bank, &p0.chk) {
                    x.balance = bal;
                }
            }
            let pay = call(
                "card_pay",
                json!({"card": c, "payee": payee, "amount": amt}),
            );
            let q = [
                format!("Pay {amt} to the {payee} with card {c}."),
                format!("Use card {c} to pay {amt} to the {payee}."),
            ];
            let (err, reply, facts) = if short {
                (
                    Some("insufficient_funds"),
                    format!("Sorry, the account of card {c} has insufficient funds."),
                    vec!["insufficient".to_string()],
                )
            } else {
                (None, format!("Paid {amt} to the {payee}."), vec![])
            };
            (
                "card_pay",
                vec![turn(rng.pick(&q).clone(), vec![(pay, err)], reply)],
                facts,
            )
        }
    };
    TaskDraft {
        kind,
        turns,
        initial_state: to_state(&bank),
        facts,
    }
}
