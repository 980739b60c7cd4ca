//! The verl rows as files: the parquet schema (nested lists and structs, in the column order
//! verl and the EnvACE reference read) and each row's cells, written through the parquet and
//! JSON writers of [`crate::export`].

use std::path::Path;

use serde_json::Value;

use super::{ChecklistStandard, TokenIds, VerlMessage, VerlRow};
use crate::export::{Cell, ExportError, Leaf, Node, write_rows_json, write_rows_parquet};
use crate::session::format::GenRole;

/// Write the rows as a parquet file (snappy), atomically (`<path>.tmp`, then renamed).
pub fn write_parquet(rows: &[VerlRow], path: &Path) -> Result<(), ExportError> {
    let cells: Vec<Vec<Cell>> = rows.iter().map(VerlRow::to_cells).collect();
    write_rows_parquet(path, &schema(), &cells)
}

/// Write the same rows as one JSON array, atomically: the reference's tool simulator loads
/// this file (`TOOL_DATASET_PATH`, `env.checklist.dataset_path`) to find each row's tools and
/// recorded tool responses by `extra_info.original_index`, so it must hold the rows of every
/// split trained or validated on.
pub fn write_json(rows: &[VerlRow], path: &Path) -> Result<(), ExportError> {
    let cells: Vec<Vec<Cell>> = rows.iter().map(VerlRow::to_cells).collect();
    write_rows_json(path, &schema(), &cells)
}

fn str_leaf(name: &'static str) -> Node {
    Node::Leaf(name, Leaf::Str)
}

fn list(name: &'static str, item: Node) -> Node {
    Node::List(name, Box::new(item))
}

fn message_node(name: &'static str) -> Node {
    let function = Node::Struct("function", vec![str_leaf("name"), str_leaf("arguments")]);
    let call = Node::Struct("element", vec![str_leaf("id"), str_leaf("type"), function]);
    list(
        name,
        Node::Struct(
            "element",
            vec![
                str_leaf("role"),
                str_leaf("content"),
                list("tool_calls", call),
                str_leaf("tool_call_id"),
            ],
        ),
    )
}

fn checklists_node(name: &'static str) -> Node {
    let evidence = Node::Struct(
        "element",
        vec![
            Node::Leaf("turn", Leaf::I64),
            Node::Leaf("step", Leaf::I64),
            str_leaf("from"),
            str_leaf("snippet"),
        ],
    );
    let standard = Node::Struct(
        "element",
        vec![
            str_leaf("id"),
            list("evidence", evidence),
            str_leaf("focus_on"),
            str_leaf("question"),
            str_leaf("pass_condition"),
            list("failure_examples", str_leaf("element")),
            Node::Leaf("required_for_next_turn", Leaf::Bool),
            list("dependence", str_leaf("element")),
            Node::Leaf("weight", Leaf::F64),
        ],
    );
    list(name, list("element", list("element", standard)))
}

/// The file's schema (see [`VerlRow`] for the columns; every field nullable).
fn schema() -> Vec<Node> {
    let ids = |name| list(name, Node::Leaf("element", Leaf::I64));
    vec![
        str_leaf("data_source"),
        message_node("prompt"),
        str_leaf("ability"),
        Node::Struct(
            "reward_model",
            vec![str_leaf("style"), str_leaf("ground_truth")],
        ),
        Node::Struct(
            "extra_info",
            vec![
                Node::Leaf("index", Leaf::I64),
                str_leaf("split"),
                str_leaf("original_index"),
                str_leaf("role"),
                Node::Leaf("need_tools_kwargs", Leaf::Bool),
                str_leaf("tools"),
                message_node("messages"),
                Node::Struct(
                    "interaction_kwargs",
                    vec![str_leaf("name"), checklists_node("checklist_list")],
                ),
                str_leaf("task_id"),
                Node::Leaf("reward", Leaf::F64),
                str_leaf("session"),
                Node::Leaf("seq", Leaf::I64),
                str_leaf("call_id"),
                str_leaf("response"),
                ids("prompt_ids"),
                ids("response_ids"),
                ids("loss_mask"),
                list("logprobs", Node::Leaf("element", Leaf::F32)),
            ],
        ),
        str_leaf("uuid"),
        message_node("messages"),
        checklists_node("checklists"),
    ]
}

fn messages_cell(ms: &[VerlMessage]) -> Cell {
    Cell::List(
        ms.iter()
            .map(|m| {
                Cell::Struct(vec![
                    Cell::str(m.role.as_str()),
                    Cell::str(m.content.as_str()),
                    Cell::List(
                        m.tool_calls
                            .iter()
                            .map(|c| {
                                Cell::Struct(vec![
                                    Cell::str(c.id.as_str()),
                                    Cell::str(c.kind.as_str()),
                                    Cell::Struct(vec![
                                        Cell::str(c.function.name.as_str()),
                                        Cell::str(c.function.arguments.as_str()),
                                    ]),
                                ])
                            })
                            .collect(),
                    ),
                    Cell::opt_str(m.tool_call_id.as_deref()),
                ])
            })
            .collect(),
    )
}

fn strings_cell(v: &[String]) -> Cell {
    Cell::List(v.iter().map(|s| Cell::str(s.as_str())).collect())
}

fn checklists_cell(list: &[Vec<Vec<ChecklistStandard>>]) -> Cell {
    let standard = |s: &ChecklistStandard| {
        Cell::Struct(vec![
            Cell::str(s.id.as_str()),
            Cell::List(
                s.evidence
                    .iter()
                    .map(|e| {
                        Cell::Struct(vec![
                            Cell::I64(e.turn),
                            Cell::I64(e.step),
                            Cell::str(e.from.as_str()),
                            Cell::str(e.snippet.as_str()),
                        ])
                    })
                    .collect(),
            ),
            Cell::str(s.focus_on.as_str()),
            Cell::str(s.question.as_str()),
            Cell::str(s.pass_condition.as_str()),
            strings_cell(&s.failure_examples),
            Cell::Bool(s.required_for_next_turn),
            strings_cell(&s.dependence),
            Cell::F64(s.weight),
        ])
    };
    Cell::List(
        list.iter()
            .map(|checklist| {
                Cell::List(
                    checklist
                        .iter()
                        .map(|turn| Cell::List(turn.iter().map(standard).collect()))
                        .collect(),
                )
            })
            .collect(),
    )
}

fn role_name(role: GenRole) -> &'static str {
    match role {
        GenRole::Actor => "actor",
        GenRole::Simulator => "simulator",
    }
}

impl VerlRow {
    /// The row's values in [`schema`] order.
    fn to_cells(&self) -> Vec<Cell> {
        let x = &self.extra_info;
        let g = x.generation.as_ref();
        let tokens = g.and_then(|g| g.tokens.as_ref());
        let ids = |f: fn(&TokenIds) -> Vec<i64>| {
            tokens.map_or(Cell::Null, |t| {
                Cell::List(f(t).into_iter().map(Cell::I64).collect())
            })
        };
        let prompt = messages_cell(&self.prompt);
        let checklists = checklists_cell(&x.interaction_kwargs.checklist_list);
        let extra_info = Cell::Struct(vec![
            Cell::I64(x.index),
            Cell::opt_str(x.split.as_deref()),
            Cell::str(x.original_index.as_str()),
            Cell::str(role_name(x.role)),
            Cell::Bool(x.need_tools_kwargs),
            Cell::Str(Value::Array(x.tools.clone()).to_string()),
            messages_cell(&x.messages),
            Cell::Struct(vec![
                Cell::str(x.interaction_kwargs.name.as_str()),
                checklists.clone(),
            ]),
            Cell::opt_str(x.task_id.as_deref()),
            x.reward.map_or(Cell::Null, Cell::F64),
            Cell::opt_str(g.map(|g| g.session.as_str())),
            g.map_or(Cell::Null, |g| Cell::I64(g.seq as i64)),
            Cell::opt_str(g.and_then(|g| g.call_id.as_deref())),
            Cell::opt_str(g.map(|g| g.response.as_str())),
            ids(|t| t.prompt_ids.iter().map(|&i| i64::from(i)).collect()),
            ids(|t| t.response_ids.iter().map(|&i| i64::from(i)).collect()),
            ids(|t| t.loss_mask.iter().map(|&m| i64::from(m)).collect()),
            tokens.map_or(Cell::Null, |t| {
                Cell::List(t.logprobs.iter().map(|&p| Cell::F32(p)).collect())
            }),
        ]);
        vec![
            Cell::str(self.data_source.as_str()),
            prompt.clone(),
            Cell::str(self.ability.as_str()),
            Cell::Struct(vec![
                Cell::str(self.reward_model.style.as_str()),
                Cell::opt_str(self.reward_model.ground_truth.as_deref()),
            ]),
            extra_info,
            Cell::str(x.original_index.as_str()),
            prompt,
            checklists,
        ]
    }
}
