//! Corpus tests: what each kind of text adds to a generated corpus, and the slips and
//! random-entity helpers they rest on.

use serde_json::{Value, json};

use super::episodes::corrupt_call;
use super::*;
use crate::engine::prompts::actor::MEMORY_HEADING;
use crate::env::tasks::randomize::{find_word, is_word_char, replace_words};
use crate::message::{Role, ToolCall};

fn cfg(memory_fraction: f64) -> CorpusConfig {
    CorpusConfig {
        tasks_per_domain: 30,
        sim_per_task: 1,
        memory_fraction,
        slip_fraction: 0.0,
        slip_values: SlipValues::Any,
        copy_per_task: 0.0,
        recorded_fraction: 0.0,
        random_copy_fraction: 0.0,
        random_entity_fraction: 0.0,
        random_entity_style: EntityStyle::Letters,
        tool_drills_per_task: 0.0,
        tool_drill_style: Default::default(),
        calc_drills_per_task: 0.0,
        spell_drills_per_task: 0.0,
        price_steps: None,
        template: CorpusTemplate::Compact,
        kind_weights: BTreeMap::new(),
        seed: 7,
    }
}

/// The bank domain's train-split corpus in the compact profile.
fn bank_train(c: &CorpusConfig) -> Vec<Segmented> {
    corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), c).unwrap()
}

/// (prompt, trained result JSON) of every simulator text.
fn sim_pairs(texts: &[Segmented]) -> Vec<(String, String)> {
    texts
        .iter()
        .filter(|t| t.role == Role::Tool)
        .map(|t| {
            let (p, r) = (&t.segments[0].0, &t.segments[1].0);
            let json = r
                .trim_start_matches("<execution_result>")
                .split("</execution_result>")
                .next()
                .unwrap_or_default()
                .to_string();
            (p.clone(), json)
        })
        .collect()
}

#[test]
fn recorded_runs_put_the_simulated_call_and_its_response_in_the_pool() {
    let mut c = cfg(0.0);
    c.sim_per_task = 0;
    let plain = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
    c.recorded_fraction = 1.0;
    c.slip_fraction = 1.0;
    let recorded = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
    let pairs = sim_pairs(&recorded);
    assert!(pairs.len() > 90, "{} simulator texts", pairs.len());
    // Gold calls: the target is in the prompt (the recorded run holds it).
    let copied = pairs.iter().filter(|(p, r)| p.contains(r.as_str())).count();
    // Slips (one per task here) answer with the real error, which the pool does not hold.
    let errors = pairs
        .iter()
        .filter(|(_, r)| r.contains("\"error\""))
        .count();
    assert!(
        copied + errors >= pairs.len(),
        "{copied} copied, {errors} errors of {}",
        pairs.len()
    );
    assert!(copied * 2 > pairs.len(), "{copied} of {}", pairs.len());
    // Without it, the pool never holds the call being simulated.
    let plain_pairs = sim_pairs(&plain);
    let leaked = plain_pairs
        .iter()
        .filter(|(p, r)| p.contains(r.as_str()))
        .count();
    assert!(
        leaked * 5 < plain_pairs.len(),
        "{leaked} of {}",
        plain_pairs.len()
    );
}

#[test]
fn generated_corpus_has_one_actor_and_one_simulator_text_per_task() {
    let texts = corpus(
        &[Domain::Bank],
        Split::Train,
        &PromptProfile::compact(),
        &cfg(0.0),
    )
    .unwrap();
    let actor = texts.iter().filter(|t| t.role == Role::Assistant).count();
    let sim = texts.iter().filter(|t| t.role == Role::Tool).count();
    assert_eq!((actor, sim), (30, 30));
    assert!(!texts.iter().any(|t| t.text().contains(MEMORY_HEADING)));
}

#[test]
fn memory_examples_train_only_the_gold_call_after_the_memory() {
    let texts = corpus(
        &Domain::ALL,
        Split::Train,
        &PromptProfile::compact(),
        &cfg(1.0),
    )
    .unwrap();
    let memories: Vec<&Segmented> = texts
        .iter()
        .filter(|t| t.text().contains(MEMORY_HEADING))
        .collect();
    assert!(
        memories.len() >= 20,
        "only {} memory examples",
        memories.len()
    );
    let mut slips = 0;
    for m in memories {
        let trained: Vec<&(String, bool)> = m.segments.iter().filter(|s| s.1).collect();
        assert_eq!(trained.len(), 1, "one trained turn");
        let target = &trained[0].0;
        assert!(target.starts_with("<tool_call>"), "{target}");
        assert!(target.ends_with(END));
        // The memory comes before the trained turn, never after it.
        let text = m.text();
        assert!(text.find(MEMORY_HEADING).unwrap() < text.find(target.as_str()).unwrap());
        // Branch lines: the gold call or a slip of it with the slip's real response.
        let note = &text[text.find(MEMORY_HEADING).unwrap()..];
        let call_json = &target["<tool_call>".len()..target.find("</tool_call>").unwrap()];
        let gold: Value = serde_json::from_str(call_json).unwrap();
        let gold_compact = serde_json::to_string(&gold).unwrap();
        for line in note
            .lines()
            .skip(1)
            .take_while(|l| !l.contains("<|im_end|>"))
        {
            if !line.contains(&gold_compact) {
                slips += 1;
                assert!(line.contains("predicted"), "{line}");
            }
        }
    }
    assert!(slips > 0, "no branch with a slip");
}

#[test]
fn slips_teach_the_simulator_real_errors_and_the_actor_to_recover() {
    let c = CorpusConfig {
        slip_fraction: 1.0,
        ..cfg(0.0)
    };
    let plain = corpus(
        &Domain::ALL,
        Split::Train,
        &PromptProfile::compact(),
        &cfg(0.0),
    )
    .unwrap();
    let texts = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
    let extra = texts.len() - plain.len();
    assert!(extra >= 90, "{extra} slip examples for 90 tasks");
    let target = |t: &Segmented| {
        t.segments
            .iter()
            .filter(|s| s.1)
            .map(|s| s.0.clone())
            .collect::<String>()
    };
    let sim_errors = texts
        .iter()
        .filter(|t| t.role == Role::Tool && target(t).contains("\"not_found\""))
        .count();
    let plain_errors = plain
        .iter()
        .filter(|t| t.role == Role::Tool && target(t).contains("\"not_found\""))
        .count();
    assert!(
        sim_errors >= plain_errors + 30,
        "not_found targets: {plain_errors} -> {sim_errors}"
    );
    // Recovery examples: an error in the prompt, one trained turn, a tool call.
    let recoveries: Vec<&Segmented> = texts
        .iter()
        .filter(|t| {
            t.role == Role::Assistant
                && t.segments.iter().filter(|s| s.1).count() == 1
                && !t.text().contains(MEMORY_HEADING)
        })
        .collect();
    assert!(recoveries.len() >= 30, "{} recoveries", recoveries.len());
    for r in recoveries {
        let t = target(r);
        assert!(t.starts_with("<tool_call>"), "{t}");
        let before = &r.text()[..r.text().find(t.as_str()).unwrap()];
        assert!(before.contains("{\"error\""), "no error before the retry");
    }
}

#[test]
fn copy_drills_echo_train_split_entities() {
    let c = CorpusConfig {
        copy_per_task: 1.0,
        ..cfg(0.0)
    };
    let texts = corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), &c).unwrap();
    let drills: Vec<&Segmented> = texts
        .iter()
        .filter(|t| t.text().contains(COPY_SYSTEM))
        .collect();
    assert_eq!(drills.len(), 30);
    let c3 = CorpusConfig {
        copy_per_task: 3.0,
        ..c.clone()
    };
    let t3 = corpus(
        &[Domain::Bank],
        Split::Train,
        &PromptProfile::compact(),
        &c3,
    )
    .unwrap();
    let n3 = t3.iter().filter(|t| t.text().contains(COPY_SYSTEM)).count();
    assert_eq!(n3, 90, "three whole drills per task");
    for d in drills {
        let trained: Vec<&(String, bool)> = d.segments.iter().filter(|s| s.1).collect();
        assert_eq!(trained.len(), 1);
        let reply = trained[0].0.trim_end_matches(END);
        let user = d.text();
        let user = user
            .split("<|im_start|>user\n")
            .nth(1)
            .and_then(|u| u.split(END).next())
            .unwrap()
            .to_string();
        assert_eq!(reply, user);
        for item in reply.split(", ") {
            if let Some(n) = item.rsplit('_').next().and_then(|n| n.parse::<i64>().ok()) {
                assert!(!crate::env::domains::held_out(n), "{item} is a test value");
            }
        }
    }
}

#[test]
fn tool_drills_add_mcp_style_actor_and_simulator_texts_in_the_chosen_template() {
    let plain = bank_train(&cfg(0.0));
    let c = CorpusConfig {
        tool_drills_per_task: 1.0,
        template: CorpusTemplate::CompactV2,
        ..cfg(0.0)
    };
    let texts = bank_train(&c);
    // One actor drill per task (its system prompt names the made-up `mcp:` server), and a
    // simulator text (whose prompt has no system message) for about half of those with a
    // call.
    let drills: Vec<&Segmented> = texts.iter().filter(|t| t.text().contains("mcp:")).collect();
    assert!(drills.iter().all(|t| t.role == Role::Assistant));
    assert_eq!(drills.len(), 30);
    let sims = texts.len() - plain.len() - drills.len();
    assert!((5..=25).contains(&sims), "{sims} simulator drill texts");
    assert_eq!(
        texts.iter().filter(|t| t.role == Role::Tool).count(),
        plain.iter().filter(|t| t.role == Role::Tool).count() + sims
    );
    // The v2 tool list marks optional parameters, and the trained part holds calls.
    assert!(
        drills
            .iter()
            .any(|t| t.text().contains("?)") || t.text().contains("?,"))
    );
    assert!(drills.iter().any(|t| {
        t.segments
            .iter()
            .any(|s| s.1 && s.0.contains("<tool_call>"))
    }));
}

#[test]
fn calc_drills_add_actor_texts_and_declining_twins() {
    let plain = bank_train(&cfg(0.0));
    let c = CorpusConfig {
        calc_drills_per_task: 2.0,
        template: CorpusTemplate::CompactV2,
        ..cfg(0.0)
    };
    let texts = bank_train(&c);
    let is_calc = |t: &Segmented| {
        let x = t.text();
        x.contains("None of the available functions") || x.contains("{\"result\":")
    };
    assert_eq!(plain.iter().filter(|t| is_calc(t)).count(), 0);
    // Two per task, each one actor text, and a declining twin for about half of those that
    // call one function.
    let calc: Vec<&Segmented> = texts.iter().filter(|t| is_calc(t)).collect();
    assert_eq!(texts.len(), plain.len() + calc.len());
    let twins = calc.len() - 60;
    assert!((10..=40).contains(&twins), "{twins}");
    assert!(calc.iter().all(|t| t.role == Role::Assistant));
    // Some decline (a trained reply without a call), the others call.
    let trained = |t: &Segmented| -> String {
        t.segments
            .iter()
            .filter(|s| s.1)
            .map(|s| s.0.as_str())
            .collect()
    };
    let declines = calc
        .iter()
        .filter(|t| trained(t).starts_with("None of the available functions"))
        .count();
    let calls = calc
        .iter()
        .filter(|t| trained(t).contains("<tool_call>"))
        .count();
    assert!(
        declines >= twins + 2 && declines <= twins + 20,
        "{declines}"
    );
    assert_eq!(declines + calls, calc.len());
}

#[test]
fn random_copy_drills_echo_strings_outside_every_pool() {
    let c = CorpusConfig {
        copy_per_task: 1.0,
        random_copy_fraction: 1.0,
        ..cfg(0.0)
    };
    let texts = corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), &c).unwrap();
    let mut items = 0;
    for d in texts.iter().filter(|t| t.text().contains(COPY_SYSTEM)) {
        let trained: Vec<&(String, bool)> = d.segments.iter().filter(|s| s.1).collect();
        let reply = trained[0].0.trim_end_matches(END);
        assert!(d.text().contains(&format!("user\n{reply}")), "{}", d.text());
        for item in reply.split(", ") {
            items += 1;
            assert!((3..=8).contains(&item.len()), "{item}");
            assert!(item.chars().all(|ch| ch.is_ascii_alphabetic()), "{item}");
            assert!(!crate::env::domains::in_test_pools(item), "{item}");
        }
    }
    assert!(items >= 30 * 4, "{items} items");
}

#[test]
fn random_entities_replace_every_occurrence_and_keep_the_conversation_consistent() {
    let c = CorpusConfig {
        random_entity_fraction: 1.0,
        ..cfg(0.0)
    };
    let texts = corpus(
        &[Domain::Travel],
        Split::Train,
        &PromptProfile::compact(),
        &c,
    )
    .unwrap();
    let base = corpus(
        &[Domain::Travel],
        Split::Train,
        &PromptProfile::compact(),
        &cfg(0.0),
    )
    .unwrap();
    // One extra actor text per task.
    assert_eq!(texts.len(), base.len() + 30);
    let pools = crate::env::domains::train_pool_values();
    let actor: Vec<String> = texts
        .iter()
        .filter(|t| t.role != Role::Tool)
        .map(Segmented::text)
        .collect();
    let mut changed = 0;
    for pair in actor.chunks(2) {
        let (orig, sub) = (&pair[0], &pair[1]);
        let present: Vec<&&str> = pools
            .iter()
            .filter(|v| find_word(orig, v).is_some() && find_word(sub, v).is_none())
            .collect();
        if !present.is_empty() {
            changed += 1;
        }
        // Ids, amounts and days are untouched.
        for id in orig
            .split(|c: char| !is_word_char(c))
            .filter(|w| w.contains('_'))
        {
            assert!(sub.contains(id), "{id} lost");
        }
    }
    assert!(changed >= 25, "only {changed} of 30 conversations changed");
    assert_eq!(
        replace_words("Ann met Anna; Ann_x, Ann.", "Ann", "Qo"),
        "Qo met Anna; Ann_x, Qo."
    );
}

/// The train-split corpus of `domains` with every task's entities randomized, as letter strings
/// and in `style`: the same draws, so the two lists pair text by text.
fn letters_and(style: EntityStyle, domains: &[Domain]) -> (Vec<Segmented>, Vec<Segmented>) {
    let letters = CorpusConfig {
        random_entity_fraction: 1.0,
        ..cfg(0.0)
    };
    let styled = CorpusConfig {
        random_entity_style: style,
        ..letters.clone()
    };
    let texts =
        |c: &CorpusConfig| corpus(domains, Split::Train, &PromptProfile::compact(), c).unwrap();
    (texts(&letters), texts(&styled))
}

/// The value of the first `"payee": "…"` in `text`.
fn quoted_payee(text: &str) -> Option<&str> {
    let key = "\"payee\": \"";
    let rest = &text[text.find(key)? + key.len()..];
    rest.find('"').map(|end| &rest[..end])
}

#[test]
fn word_entities_put_real_nouns_for_payees_and_items_and_letters_for_names() {
    use crate::env::tasks::randomize::{ITEM_NOUNS, PAYEE_NOUNS};
    let pools = crate::env::domains::train_pool_values();
    let all: Vec<&str> = PAYEE_NOUNS.iter().chain(ITEM_NOUNS).copied().collect();
    for w in &all {
        assert!(!pools.contains(w), "{w} is a train-pool value");
        assert!(
            !crate::env::domains::in_test_pools(w),
            "{w} is a test-pool value"
        );
        assert!(w.chars().all(|c| c.is_ascii_lowercase() || c == ' '), "{w}");
    }
    let mut sorted = all.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), all.len(), "a noun is listed twice");
    let (a, b) = letters_and(EntityStyle::Words, &[Domain::Bank, Domain::Retail]);
    assert_ne!(a, b);
    // The same draws: the same texts in the same order, only the replacements differ.
    assert_eq!(a.len(), b.len());
    let mut nouns_seen = 0;
    let mut payments = 0;
    for (x, y) in a.iter().zip(&b) {
        let (x, y) = (x.text(), y.text());
        if x == y {
            continue;
        }
        // A card payment's payee: the same noun in the request and in the call.
        // The system prompt is kept (`desk` there is not the item).
        assert!(
            !y.contains("You are the bank") || y.contains("You are the bank desk"),
            "{y}"
        );
        if let Some(payee) = quoted_payee(&y) {
            payments += 1;
            assert!(PAYEE_NOUNS.contains(&payee), "payee {payee} in {y}");
            assert!(y.contains(&format!("to the {payee}")), "{y}");
        }
        nouns_seen += all.iter().filter(|w| find_word(&y, w).is_some()).count();
        // The letters copy replaced the same values: the texts differ only in replacements.
        assert_ne!(x, y);
    }
    assert!(payments >= 3, "{payments} randomized payments");
    let items = b
        .iter()
        .filter(|t| ITEM_NOUNS.iter().any(|w| find_word(&t.text(), w).is_some()))
        .count();
    assert!(items >= 5, "{items} texts with an item noun");
    assert!(nouns_seen >= 10, "{nouns_seen} nouns");
    // Letters never put a noun for a payee.
    assert!(
        a.iter()
            .all(|t| !t.text().contains("\"payee\": \"carpenter\""))
    );
}

#[test]
fn vocab_entities_draw_every_value_from_the_word_list_and_hold_out_the_probe_nouns() {
    use crate::env::tasks::randomize::entity_words;
    let words = entity_words();
    assert!(words.len() > 10_000, "{} words", words.len());
    let pools = crate::env::domains::train_pool_values();
    let probe: Vec<&str> = include_str!("../../../../assets/copy-probe-nouns.txt")
        .lines()
        .filter(|l| !l.is_empty())
        .collect();
    assert!(probe.len() > 200);
    for w in words {
        assert!((4..=11).contains(&w.len()), "{w}");
        assert!(w.chars().all(|c| c.is_ascii_lowercase()), "{w}");
        assert!(!probe.contains(w), "{w} is a held-out probe noun");
        assert!(!pools.contains(w), "{w} is a train-pool value");
        // Capitalised, a word may be a generated train name (`Basin`): the draw skips those.
        let cap = crate::env::tasks::randomize::capitalised(w);
        for v in [*w, cap.as_str()] {
            assert!(
                !crate::env::domains::in_test_pools(v),
                "{v} is a test-pool value"
            );
        }
    }
    let (a, b) = letters_and(
        EntityStyle::Vocab,
        &[Domain::Bank, Domain::Retail, Domain::Travel],
    );
    // The same draws: the same texts in the same order, only the replacements differ.
    assert_eq!(a.len(), b.len());
    let (mut payees, mut capitals) = (0, 0);
    for (x, y) in a.iter().zip(&b) {
        let (x, y) = (x.text(), y.text());
        if x == y {
            continue;
        }
        assert!(
            !y.contains("You are the bank") || y.contains("You are the bank desk"),
            "the system prompt is kept: {y}"
        );
        // A payee is a word of the list, the same in the request and in the call.
        if let Some(payee) = quoted_payee(&y) {
            assert!(words.contains(&payee), "payee {payee} in {y}");
            assert!(y.contains(&format!("to the {payee}")), "{y}");
            payees += 1;
        }
        // Names and places: capitalised words of the list, wherever a value is quoted.
        capitals += y
            .split('"')
            .filter(|v| v.chars().next().is_some_and(char::is_uppercase))
            .filter(|v| words.contains(&v.to_lowercase().as_str()))
            .count();
    }
    assert!(payees >= 3, "{payees} randomized payments");
    assert!(
        capitals >= 10,
        "{capitals} capitalised list words as names or places"
    );
}

#[test]
fn spelling_drills_copy_each_listed_word_into_one_call() {
    use crate::env::tasks::randomize::entity_words;
    let words = entity_words();
    let t = ChatTemplate::new(CorpusTemplate::CompactV2.source(), "", END).unwrap();
    let mut articles = 0;
    for seed in 0..40 {
        let text = super::drills::spell_drill(&t, seed).unwrap();
        let all = text.text();
        let trained: String = text
            .segments
            .iter()
            .filter(|s| s.1)
            .map(|s| s.0.as_str())
            .collect();
        // The trained part is the calls; the request is not trained.
        let values: Vec<&str> = trained
            .split("\"arguments\": {\"")
            .skip(1)
            .map(|rest| {
                let v = &rest[rest.find(": \"").unwrap() + 3..];
                &v[..v.find('"').unwrap()]
            })
            .collect();
        assert!((3..=8).contains(&values.len()), "{trained}");
        assert!(!all.contains("citys"), "{all}");
        for v in &values {
            assert!(
                words.contains(&v.to_lowercase().as_str()),
                "{v} in {trained}"
            );
            let request = &all[..all.find(trained.as_str()).unwrap()];
            assert!(find_word(request, v).is_some(), "{v} not in the request");
            if request.contains(&format!("the {v}")) {
                articles += 1;
            }
        }
    }
    assert!(articles > 20, "{articles} words after `the`");
    // Per task, drawn after every other drill.
    let c = |f: f64| {
        corpus(
            &[Domain::Bank],
            Split::Train,
            &PromptProfile::compact(),
            &CorpusConfig {
                spell_drills_per_task: f,
                ..cfg(0.0)
            },
        )
        .unwrap()
    };
    let (none, two) = (c(0.0), c(2.0));
    let drills = |v: &[Segmented]| v.iter().filter(|t| t.text().contains("add_")).count();
    assert_eq!(drills(&none), 0);
    assert_eq!(two.len() - none.len(), drills(&two));
    assert_eq!(drills(&two), 2 * 30);
}

/// The id numbers (`acc_471` → 471, 100..=999) in a corpus's texts that are test-split values.
fn test_split_ids(texts: &[Segmented]) -> Vec<String> {
    let mut out = Vec::new();
    for t in texts {
        let text = t.text();
        for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if let Some((_, n)) = w.rsplit_once('_')
                && let Ok(n) = n.parse::<i64>()
                && (100..=999).contains(&n)
                && crate::env::domains::held_out(n)
            {
                out.push(w.to_string());
            }
        }
    }
    out
}

#[test]
fn slips_draw_the_splits_own_ids_and_amounts_unless_told_any() {
    // A train-split corpus made of slips and rehearsal memories (whose wrong branches are slips).
    let c = CorpusConfig {
        slip_fraction: 1.0,
        memory_fraction: 1.0,
        ..cfg(0.0)
    };
    let any = bank_train(&c);
    let leaked = test_split_ids(&any);
    assert!(
        leaked.len() > 10,
        "the whole range leaks test ids: {leaked:?}"
    );
    let split = bank_train(&CorpusConfig {
        slip_values: SlipValues::Split,
        ..c
    });
    assert!(split.len() > 100);
    assert_eq!(test_split_ids(&split), Vec::<String>::new());

    // Amounts too: without ids in the call, the changed integer is a train-split value.
    let mut rng = StdRng::seed_from_u64(3);
    let pay = ToolCall {
        name: "pay".into(),
        arguments: json!({"amount": 300}),
    };
    let mut any_test_value = false;
    for _ in 0..200 {
        let m = corrupt_call(&pay, &mut rng, Some(Split::Train))
            .unwrap()
            .arguments["amount"]
            .as_i64()
            .unwrap();
        assert!(m != 300 && !crate::env::domains::held_out(m), "{m}");
        let m = corrupt_call(&pay, &mut rng, Some(Split::Test))
            .unwrap()
            .arguments["amount"]
            .as_i64()
            .unwrap();
        assert!(crate::env::domains::held_out(m), "{m}");
        let m = corrupt_call(&pay, &mut rng, None).unwrap().arguments["amount"]
            .as_i64()
            .unwrap();
        any_test_value |= crate::env::domains::held_out(m);
    }
    assert!(any_test_value);
}

#[test]
fn a_slip_changes_exactly_one_argument() {
    let mut rng = StdRng::seed_from_u64(1);
    let call = ToolCall {
        name: "transfer".into(),
        arguments: json!({"src": "acc_120", "dst": "acc_450", "amount": 75}),
    };
    for _ in 0..50 {
        let bad = corrupt_call(&call, &mut rng, None).unwrap();
        let (a, b) = (
            call.arguments.as_object().unwrap(),
            bad.arguments.as_object().unwrap(),
        );
        let changed = a.iter().filter(|(k, v)| b[k.as_str()] != **v).count();
        assert_eq!(changed, 1, "{bad:?}");
        assert_eq!(b["amount"], json!(75), "ids are slipped before amounts");
    }
    let no_args = ToolCall {
        name: "x".into(),
        arguments: json!({"note": "hi"}),
    };
    assert!(corrupt_call(&no_args, &mut rng, None).is_none());
}

#[test]
fn kind_weights_add_fresh_train_tasks_of_those_kinds_only() {
    let c = CorpusConfig {
        tasks_per_domain: 48,
        ..cfg(0.0)
    };
    let base = corpus_tasks(Domain::Bank, Split::Train, &c);
    let count = |ts: &[Task], k: &str| ts.iter().filter(|t| t.kind == k).count();
    let mut w = c.clone();
    w.kind_weights.insert("pay_if_enough".into(), 3.0);
    w.kind_weights.insert("named_transfer".into(), 1.5);
    let more = corpus_tasks(Domain::Bank, Split::Train, &w);
    assert_eq!(
        more[..base.len()],
        base[..],
        "the first tasks stay the same"
    );
    let (p, n) = (
        count(&base, "pay_if_enough"),
        count(&base, "named_transfer"),
    );
    assert!(p > 0 && n > 0);
    // (W − 1)× as many more, at most one short where the kinds' cycle rounds down.
    let (p3, n15) = (
        count(&more, "pay_if_enough"),
        count(&more, "named_transfer"),
    );
    assert!(p3 <= 3 * p && p3 + 1 >= 3 * p, "{p3} vs 3 × {p}");
    let n_want = (1.5 * n as f64).round() as usize;
    assert!(n15 <= n_want && n15 + 1 >= n_want, "{n15} vs {n_want}");
    assert_eq!(more.len(), base.len() + (p3 - p) + (n15 - n));
    assert!(
        more[base.len()..]
            .iter()
            .all(|t| t.kind == "pay_if_enough" || t.kind == "named_transfer")
    );
    let ids: std::collections::BTreeSet<&str> = more.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids.len(), more.len(), "no task twice");
    assert!(more.iter().all(|t| t.split == Some(Split::Train)));
    // More texts, from the added tasks.
    assert!(bank_train(&w).len() > bank_train(&c).len());
    assert_eq!(unknown_kinds(&[Domain::Bank], &w), Vec::<String>::new());
    w.kind_weights.insert("pay_if_enugh".into(), 2.0);
    assert_eq!(unknown_kinds(&[Domain::Bank], &w), ["pay_if_enugh"]);
    // The built-in set (`tasks_per_domain` 0) is weighted the same way, never silently not.
    let builtin = CorpusConfig {
        tasks_per_domain: 0,
        kind_weights: [("pay_if_enough".to_string(), 2.0)].into(),
        ..cfg(0.0)
    };
    let base = list_tasks(Domain::Bank, Some(Split::Train));
    let more = corpus_tasks(Domain::Bank, Split::Train, &builtin);
    let p = base.iter().filter(|t| t.kind == "pay_if_enough").count();
    assert!(p > 0);
    let p2 = count(&more, "pay_if_enough");
    assert!(p2 <= 2 * p && p2 + 1 >= 2 * p, "{p2} vs 2 × {p}");
    assert_eq!(more.len(), base.len() + p2 - p);
    // The test split is never weighted.
    assert_eq!(
        corpus_tasks(Domain::Bank, Split::Test, &builtin).len(),
        list_tasks(Domain::Bank, Some(Split::Test)).len()
    );
}

/// The travel corpus's texts with `steps` as its price steps.
fn travel_texts(steps: Option<PriceStepStyle>) -> Vec<Segmented> {
    let c = CorpusConfig {
        tasks_per_domain: 90,
        price_steps: steps,
        ..cfg(0.0)
    };
    corpus(
        &[Domain::Travel],
        Split::Train,
        &PromptProfile::compact(),
        &c,
    )
    .unwrap()
}

/// Every segment of `texts` with a `book` or `change` call after steps from which `chosen`
/// reads a flight: that segment is trained, and its call takes that flight. Returns how many.
fn calls_take_the_chosen_flight(
    texts: &[Segmented],
    chosen: impl Fn(&str) -> Option<&str>,
) -> usize {
    let mut booked = 0;
    for t in texts {
        for (seg, trained) in &t.segments {
            let Some(at) = ["book", "change"]
                .iter()
                .find_map(|n| seg.find(&format!("<tool_call>{{\"name\": \"{n}\"")))
            else {
                continue;
            };
            let Some(flight) = chosen(&seg[..at]) else {
                continue;
            };
            assert!(*trained, "the steps are trained with the call: {seg}");
            assert!(
                seg[at..].contains(&format!("\"flight\": \"{flight}\"")),
                "the call takes the chosen flight {flight}: {seg}"
            );
            booked += 1;
        }
    }
    booked
}

/// `--price-steps`: the travel corpus's actor turns after a flight list carry the comparison, the
/// last winner is the cheapest free flight the gold `book`/`change` takes, the steps are
/// trained; off by default, left out of the recorded config then, and recorded as `true`.
#[test]
fn price_steps_write_the_comparison_before_the_call_that_uses_it() {
    let (a, b) = (
        travel_texts(None),
        travel_texts(Some(PriceStepStyle::Pairs)),
    );
    assert_eq!(a.len(), b.len(), "the same texts, some of them longer");
    assert!(a.iter().all(|t| !t.text().contains(" or fl_")));
    let booked = calls_take_the_chosen_flight(&b, |steps| {
        let last = steps.rfind(": fl_")?;
        Some(steps[last + 2..].trim_end_matches('.'))
    });
    assert!(
        booked >= 10,
        "{booked} bookings and changes after a comparison"
    );
}

/// `--price-steps prices`: the steps compare prices only and close with `Cheapest: ID.`, and the
/// call that follows books that flight.
#[test]
fn price_steps_in_the_prices_style_name_the_flight_the_call_takes() {
    let texts = travel_texts(Some(PriceStepStyle::Prices));
    let booked = calls_take_the_chosen_flight(&texts, |steps| {
        let mark = steps.rfind("Cheapest: ")?;
        assert!(!steps[..mark].contains(" or fl_"), "prices only: {steps}");
        Some(steps[mark + 10..].trim().trim_end_matches('.'))
    });
    assert!(
        booked >= 10,
        "{booked} bookings and changes after the steps"
    );
}

/// `price_steps` as recorded: absent when off, `true` for pairs (so stage 15's `pretrain.json`
/// reads back as it was written), `"prices"`; `false` reads as off, and anything else is refused
/// naming the field and the values it takes.
#[test]
fn price_steps_are_recorded_as_stage_15_wrote_them() {
    let with = |steps| CorpusConfig {
        price_steps: steps,
        ..cfg(0.0)
    };
    for (steps, recorded) in [
        (None, None),
        (Some(PriceStepStyle::Pairs), Some(json!(true))),
        (Some(PriceStepStyle::Prices), Some(json!("prices"))),
    ] {
        let v = serde_json::to_value(with(steps)).unwrap();
        assert_eq!(v.get("price_steps"), recorded.as_ref());
        let back: CorpusConfig = serde_json::from_value(v).unwrap();
        assert_eq!(back.price_steps, steps);
    }
    let mut v = serde_json::to_value(with(None)).unwrap();
    v["price_steps"] = json!(false);
    assert_eq!(
        serde_json::from_value::<CorpusConfig>(v.clone())
            .unwrap()
            .price_steps,
        None
    );
    v["price_steps"] = json!("cheap");
    let e = serde_json::from_value::<CorpusConfig>(v)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("price_steps") && e.contains("cheap") && e.contains("\"prices\""),
        "{e}"
    );
}
