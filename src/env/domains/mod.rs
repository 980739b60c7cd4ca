//! The built-in domains: small, deterministic, in-memory worlds (bank, retail, travel) whose
//! tasks can be checked without a judge. Each domain is one file holding its state type, its
//! tools, its tool semantics and its task generator; this module holds what they share: the
//! [`Domain`] handle, argument parsing that answers bad calls with JSON errors (never a panic),
//! and the name/value pools that keep the `train` and `test` splits disjoint.
//!
//! Domain state travels as JSON (`serde_json::Value`) between calls so that tasks, snapshots and
//! hashes all speak one format; each call parses it into the domain's typed state, applies the
//! tool and writes it back only when the call succeeded, so a failed call never changes state.

pub mod bank;
pub mod retail;
pub mod travel;

use std::sync::OnceLock;

use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value, json};

use crate::env::tasks::{Split, TaskDraft};
use crate::env::{EnvError, ToolAnnotations, ToolResponse, ToolSpec};
use crate::message::ToolCall;

/// One of the built-in domains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Domain {
    Bank,
    Retail,
    Travel,
}

impl Domain {
    pub const ALL: [Domain; 3] = [Domain::Bank, Domain::Retail, Domain::Travel];

    pub fn name(self) -> &'static str {
        match self {
            Domain::Bank => "bank",
            Domain::Retail => "retail",
            Domain::Travel => "travel",
        }
    }

    /// A one-line description for `envace env list`.
    pub fn description(self) -> &'static str {
        match self {
            Domain::Bank => "accounts, balances, transfers, limits, card payments and freezes",
            Domain::Retail => "orders, cancellations, returns, exchanges, refunds, address changes",
            Domain::Travel => "flight search, booking, changes and cancellations",
        }
    }

    pub fn from_name(name: &str) -> Result<Domain, EnvError> {
        Domain::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| EnvError::UnknownDomain(name.to_string(), Domain::known_names()))
    }

    pub fn known_names() -> String {
        Domain::ALL.map(|d| d.name()).join(", ")
    }

    /// The tools of this domain, with JSON-Schema inputs and annotations.
    pub fn tools(self) -> Vec<ToolSpec> {
        match self {
            Domain::Bank => bank::tools(),
            Domain::Retail => retail::tools(),
            Domain::Travel => travel::tools(),
        }
    }

    /// Check that `state` is a valid state of this domain (used when loading task files).
    pub fn validate_state(self, state: &Value) -> Result<(), String> {
        match self {
            Domain::Bank => parse_state::<bank::Bank>(state).map(|_| ()),
            Domain::Retail => parse_state::<retail::Shop>(state).map(|_| ()),
            Domain::Travel => parse_state::<travel::Desk>(state).map(|_| ()),
        }
    }

    /// Execute one call against `state`. The state changes only when the call succeeds.
    /// `Err` only when `state` itself is not a state of this domain.
    pub fn apply(self, state: &mut Value, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        if !self.tools().iter().any(|t| t.name == call.name) {
            let known: Vec<String> = self.tools().into_iter().map(|t| t.name).collect();
            return Ok(fail(
                "unknown_tool",
                format!("no tool `{}`; tools: {}", call.name, known.join(", ")),
            ));
        }
        match self {
            Domain::Bank => apply_typed::<bank::Bank>(self, state, call, bank::exec),
            Domain::Retail => apply_typed::<retail::Shop>(self, state, call, retail::exec),
            Domain::Travel => apply_typed::<travel::Desk>(self, state, call, travel::exec),
        }
    }

    /// Generate the `index`-th task of a split (deterministic: same inputs, same task).
    pub(crate) fn generate(self, split: Split, index: usize) -> TaskDraft {
        let mut rng = Rng::for_task(self.name(), split, index);
        let pools = Pools::new(split);
        match self {
            Domain::Bank => bank::generate(&mut rng, &pools, index),
            Domain::Retail => retail::generate(&mut rng, &pools, index),
            Domain::Travel => travel::generate(&mut rng, &pools, index),
        }
    }
}

impl std::fmt::Display for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn parse_state<S: DeserializeOwned>(state: &Value) -> Result<S, String> {
    serde_json::from_value(state.clone()).map_err(|e| e.to_string())
}

type CallFn<S> = fn(&mut S, &str, &Args<'_>) -> Result<Value, Fail>;

fn apply_typed<S: Serialize + DeserializeOwned>(
    domain: Domain,
    state: &mut Value,
    call: &ToolCall,
    f: CallFn<S>,
) -> Result<ToolResponse, EnvError> {
    let mut world: S =
        parse_state(state).map_err(|e| EnvError::Other(format!("invalid {domain} state: {e}")))?;
    let schema = domain
        .tools()
        .into_iter()
        .find(|t| t.name == call.name)
        .map(|t| t.input_schema)
        .unwrap_or(Value::Null);
    let args = match Args::new(&call.arguments, &schema) {
        Ok(a) => a,
        Err(e) => return Ok(e.into_response()),
    };
    match f(&mut world, &call.name, &args) {
        Ok(value) => {
            *state = serde_json::to_value(&world)
                .map_err(|e| EnvError::Other(format!("cannot serialize {domain} state: {e}")))?;
            Ok(ToolResponse::Success { value })
        }
        Err(e) => Ok(e.into_response()),
    }
}

/// A tool error before it becomes a [`ToolResponse::Error`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Fail {
    pub code: &'static str,
    pub message: String,
}

impl Fail {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn not_found(what: &str, id: &str) -> Self {
        Self::new("not_found", format!("{what} {id} not found"))
    }
    fn into_response(self) -> ToolResponse {
        fail(self.code, self.message)
    }
}

fn fail(code: &str, message: String) -> ToolResponse {
    ToolResponse::Error {
        code: code.to_string(),
        message,
    }
}

/// Checked access to a call's arguments: an object whose keys are all in the schema.
pub(crate) struct Args<'a> {
    obj: &'a Map<String, Value>,
}

impl<'a> Args<'a> {
    fn new(arguments: &'a Value, schema: &Value) -> Result<Self, Fail> {
        let obj = arguments
            .as_object()
            .ok_or_else(|| Fail::new("invalid_arguments", "arguments must be a JSON object"))?;
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(props) = props
            && let Some(k) = obj.keys().find(|k| !props.contains_key(*k))
        {
            return Err(Fail::new(
                "invalid_arguments",
                format!("unknown argument `{k}`"),
            ));
        }
        Ok(Self { obj })
    }

    fn get(&self, key: &str) -> Result<&'a Value, Fail> {
        self.obj
            .get(key)
            .ok_or_else(|| Fail::new("invalid_arguments", format!("missing argument `{key}`")))
    }

    /// A required string argument.
    pub fn str(&self, key: &str) -> Result<&'a str, Fail> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| Fail::new("invalid_arguments", format!("`{key}` must be a string")))
    }

    /// An optional string argument.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, Fail> {
        match self.obj.get(key) {
            None => Ok(None),
            Some(_) => self.str(key).map(Some),
        }
    }

    /// A required integer argument.
    pub fn int(&self, key: &str) -> Result<i64, Fail> {
        self.get(key)?
            .as_i64()
            .ok_or_else(|| Fail::new("invalid_arguments", format!("`{key}` must be an integer")))
    }
}

/// Build a tool spec. `params`: (name, JSON type, description, required).
pub(crate) fn tool(
    name: &str,
    description: &str,
    params: &[(&str, &str, &str, bool)],
    kind: ToolKind,
) -> ToolSpec {
    let mut props = Map::new();
    let mut required = Vec::new();
    for (p, ty, desc, req) in params {
        props.insert((*p).to_string(), json!({"type": ty, "description": desc}));
        if *req {
            required.push(Value::from(*p));
        }
    }
    let annotations = match kind {
        ToolKind::Read => ToolAnnotations {
            read_only: true,
            destructive: false,
            idempotent: true,
            open_world: false,
        },
        ToolKind::Update => ToolAnnotations {
            read_only: false,
            destructive: false,
            idempotent: true,
            open_world: false,
        },
        ToolKind::Irreversible => ToolAnnotations {
            read_only: false,
            destructive: true,
            idempotent: false,
            open_world: false,
        },
    };
    ToolSpec {
        name: name.to_string(),
        description: description.to_string(),
        input_schema: json!({
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": false,
        }),
        annotations,
    }
}

/// How a tool changes the world.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ToolKind {
    /// Reads only.
    Read,
    /// Writes, but can be undone and repeating it changes nothing more.
    Update,
    /// Writes that cannot be undone (money moves, cancellations): destructive, not read-only.
    Irreversible,
}

/// A tiny deterministic generator (SplitMix64). Hand-written so that the built-in task sets stay
/// byte-identical whatever version of `rand` the crate resolves to.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn for_task(domain: &str, split: Split, index: usize) -> Self {
        // FNV-1a over the task's coordinates, then SplitMix64 from there.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let key = format!("{domain}/{}/{index}", split.name());
        for b in key.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Self::new(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (returns `lo` when `hi < lo`).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        if hi <= lo {
            return lo;
        }
        let span = (hi - lo + 1) as u64;
        lo + (self.next_u64() % span) as i64
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// `n` distinct elements of `items` (all of them when `n >= items.len()`).
    pub fn distinct<T: Clone>(&mut self, items: &[T], n: usize) -> Vec<T> {
        let mut idx: Vec<usize> = (0..items.len()).collect();
        let mut out = Vec::new();
        while out.len() < n && !idx.is_empty() {
            let i = self.below(idx.len());
            out.push(items[idx.swap_remove(i)].clone());
        }
        out
    }
}

/// Hand-picked training names; [`train_names`] adds generated ones so that a model has to copy
/// names from the request instead of memorising a short list.
const TRAIN_NAMES: &[&str] = &[
    "Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gina", "Hugo", "Ida", "Jon", "Kim", "Leo", "Mia",
    "Ned", "Olga", "Paul", "Rita", "Sam", "Tess", "Uma", "Vic", "Wes", "Yara", "Zoe", "Alma",
    "Bruno", "Cleo", "Dora", "Emil", "Flora", "Gus", "Hana",
];
const TEST_NAMES: &[&str] = &[
    "Iris", "Jack", "Kurt", "Lena", "Milo", "Nina", "Otto", "Pia", "Rosa", "Sven", "Theo", "Vera",
    "Wanda", "Xena", "Yves", "Zane",
];
const TRAIN_CITIES: &[&str] = &[
    "Oslo", "Rome", "Paris", "Lima", "Cairo", "Dublin", "Madrid", "Lisbon", "Vienna", "Prague",
    "Berlin", "Athens", "Tokyo", "Seoul", "Bern", "Porto", "Milan", "Nice", "Lyon", "Turin",
    "Genoa", "Bonn", "Malmo", "Bergen", "Tallinn", "Vilnius", "Minsk", "Krakow", "Gdansk", "Split",
    "Sevilla", "Bilbao", "Valencia", "Naples", "Palermo", "Dakar", "Accra", "Lagos", "Nairobi",
    "Delhi", "Dhaka", "Manila", "Jakarta", "Perth", "Denver", "Austin", "Boston", "Havana",
];
const TEST_CITIES: &[&str] = &[
    "Quito", "Riga", "Sofia", "Tunis", "Zagreb", "Kyiv", "Hanoi", "Bogota",
];
const TRAIN_PAYEES: &[&str] = &[
    "grocer", "cafe", "gym", "pharmacy", "bakery", "cinema", "butcher", "bookshop", "laundry",
    "museum", "zoo", "theatre", "market", "bistro", "hotel", "library", "barber", "dairy", "kiosk",
    "vet", "optician", "plumber", "taxi", "pizzeria", "gallery", "chemist", "printer", "stable",
    "spa", "arcade",
];
const TEST_PAYEES: &[&str] = &["florist", "garage", "dentist", "tailor"];
const TRAIN_ITEMS: &[&str] = &[
    "lamp", "mug", "desk", "chair", "kettle", "rug", "clock", "vase", "fan", "pan", "bowl", "cup",
    "plate", "towel", "pillow", "bench", "basket", "jar", "tray", "radio", "heater", "candle",
    "frame", "drill", "ladder", "bucket", "broom", "hammer", "helmet", "tent", "scarf", "boots",
];
const TEST_ITEMS: &[&str] = &["sofa", "stool", "mirror", "shelf", "toaster", "blender"];

/// How many generated names join [`TRAIN_NAMES`].
const GENERATED_NAMES: usize = 400;

/// The training names: the hand-picked ones plus [`GENERATED_NAMES`] syllable names
/// (deterministic; none equals a test name).
fn train_names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| {
        const ONSETS: &[&str] = &[
            "B", "C", "D", "F", "G", "H", "J", "K", "L", "M", "N", "P", "R", "S", "T", "V", "W",
            "Z", "Br", "Ch", "Cl", "Dr", "Fl", "Gr", "Kr", "Pr", "Sh", "St", "Tr", "El", "Ar",
            "Os",
        ];
        const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ea", "ia", "io", "y"];
        const MIDDLES: &[&str] = &[
            "l", "n", "r", "m", "s", "t", "v", "d", "k", "b", "nn", "ll", "rd", "st", "nd", "x",
        ];
        const ENDS: &[&str] = &[
            "a", "o", "e", "i", "us", "an", "en", "el", "in", "on", "", "ia",
        ];
        let mut rng = Rng::new(0x6e61_6d65);
        let mut out: Vec<&'static str> = TRAIN_NAMES.to_vec();
        let mut seen: std::collections::HashSet<String> =
            out.iter().map(|s| (*s).to_string()).collect();
        while out.len() < TRAIN_NAMES.len() + GENERATED_NAMES {
            let name = format!(
                "{}{}{}{}",
                rng.pick(ONSETS),
                rng.pick(VOWELS),
                rng.pick(MIDDLES),
                rng.pick(ENDS)
            );
            if name.len() > 8 || TEST_NAMES.contains(&name.as_str()) || !seen.insert(name.clone()) {
                continue;
            }
            out.push(Box::leak(name.into_boxed_str()));
        }
        out
    })
}

/// Whether a number (an id's digits, an amount, a day) is held out for the test split. Train and
/// test draw from the same ranges but from disjoint sets of values (about one value in four is
/// test-only), so no test id or amount ever appears in training, yet every digit pattern does.
pub(crate) fn held_out(v: i64) -> bool {
    let mut z = (v as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).is_multiple_of(4)
}

/// The names and value ranges of a split. Train and test pools share nothing, so a test task
/// never mentions a name, id or amount seen in training.
#[derive(Debug, Clone)]
pub(crate) struct Pools {
    pub split: Split,
    pub names: &'static [&'static str],
    pub cities: &'static [&'static str],
    pub payees: &'static [&'static str],
    pub items: &'static [&'static str],
    /// Inclusive range of id numbers (`acc_N`, `ord_N`, ...); a split uses its part of it.
    pub id_lo: i64,
    pub id_hi: i64,
    /// Inclusive range of the amounts that appear in instructions.
    pub amt_lo: i64,
    pub amt_hi: i64,
    /// Inclusive range of days (travel).
    pub day_lo: i64,
    pub day_hi: i64,
}

impl Pools {
    pub fn new(split: Split) -> Self {
        let (names, cities, payees, items) = match split {
            Split::Train => (train_names(), TRAIN_CITIES, TRAIN_PAYEES, TRAIN_ITEMS),
            Split::Test => (TEST_NAMES, TEST_CITIES, TEST_PAYEES, TEST_ITEMS),
        };
        Self {
            split,
            names,
            cities,
            payees,
            items,
            id_lo: 100,
            id_hi: 999,
            amt_lo: 20,
            amt_hi: 790,
            day_lo: 1,
            day_hi: 28,
        }
    }

    /// Whether `v` belongs to this split's part of a range.
    fn owns(&self, v: i64) -> bool {
        held_out(v) == (self.split == Split::Test)
    }

    /// A value of `lo..=hi` that belongs to this split.
    pub fn value(&self, rng: &mut Rng, lo: i64, hi: i64) -> i64 {
        for _ in 0..1000 {
            let v = rng.range(lo, hi);
            if self.owns(v) {
                return v;
            }
        }
        rng.range(lo, hi)
    }

    pub fn amount(&self, rng: &mut Rng) -> i64 {
        self.value(rng, self.amt_lo, self.amt_hi)
    }

    pub fn day(&self, rng: &mut Rng) -> i64 {
        self.value(rng, self.day_lo, self.day_hi)
    }

    /// `n` distinct ids `prefix_N` with N from this split's part of the id range.
    pub fn ids(&self, rng: &mut Rng, prefix: &str, n: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        while out.len() < n {
            let id = format!("{prefix}_{}", self.value(rng, self.id_lo, self.id_hi));
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}

/// `n` entity strings of a split as tasks mention them (ids such as `acc_471`, names, amounts,
/// days, cities, payees, items), seeded: material for the pretraining corpus's copy drills.
pub fn sample_entities(split: Split, seed: u64, n: usize) -> Vec<String> {
    let pools = Pools::new(split);
    let mut rng = Rng::new(seed);
    const PREFIXES: &[&str] = &["acc", "card", "ord", "sku", "fl", "bk"];
    (0..n)
        .map(|_| match rng.below(7) {
            0 | 1 => {
                let prefix = *rng.pick(PREFIXES);
                pools.ids(&mut rng, prefix, 1).remove(0)
            }
            2 => (*rng.pick(pools.names)).to_string(),
            3 => pools.amount(&mut rng).to_string(),
            4 => (*rng.pick(pools.cities)).to_string(),
            5 => (*rng.pick(pools.payees)).to_string(),
            _ => (*rng.pick(pools.items)).to_string(),
        })
        .collect()
}

/// Whether `s` is one of the test split's held-out names, places, payees or items (random
/// strings made for training are kept out of them).
pub fn in_test_pools(s: &str) -> bool {
    [TEST_NAMES, TEST_CITIES, TEST_PAYEES, TEST_ITEMS]
        .iter()
        .any(|pool| pool.contains(&s))
}

/// Every train-split name, place, payee and item (the values a task's text is built from).
pub fn train_pool_values() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = train_names().to_vec();
    v.extend_from_slice(TRAIN_CITIES);
    v.extend_from_slice(TRAIN_PAYEES);
    v.extend_from_slice(TRAIN_ITEMS);
    v
}

/// Shorthand for a gold call.
pub(crate) fn call(name: &str, arguments: Value) -> ToolCall {
    ToolCall {
        name: name.to_string(),
        arguments,
    }
}

/// Serialize a typed state (types in this module always serialize).
pub(crate) fn to_state<S: Serialize>(s: &S) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}
