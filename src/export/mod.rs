//! Training data for other trainers: `envace export --format verl` writes the parquet (and JSON)
//! rows that verl and the EnvACE reference code read ([`verl`]). Why a module of its own: these
//! files follow someone else's format, so their columns are named and nested as that code reads
//! them, not as envace stores sessions, and a format change there is made here alone.
//!
//! Below the verl rows lies a small nested-parquet writer: a schema tree (`Node`), row values
//! (`Cell`), the record shredding that turns lists and structs into repetition/definition
//! levels (Dremel), and the `parquet` crate's low-level column writers. Every field is optional
//! and every list is the standard three-level LIST (`<name> (LIST) { repeated group list {
//! optional element } }`), as pyarrow writes them, so pyarrow, pandas and HF datasets read the
//! columns back as lists of dicts. This module never writes a file in place: it writes
//! `<path>.tmp` and renames it, so a reader sees the old file or the whole new one.

pub mod verl;

pub use verl::{
    ChecklistStandard, Evidence, ExtraInfo, GenerationInfo, InteractionKwargs, RewardModel,
    TokenIds, VerlFunction, VerlMessage, VerlRow, VerlToolCall, reference_checklist, row_from_task,
    rows_from_sessions, rows_from_tasks, write_json, write_parquet,
};

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::{Compression, LogicalType, Repetition, Type as PhysicalType};
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, DoubleType, FloatType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::{Type, TypePtr};
use serde_json::Value;

/// Errors of an export; each names the file and, where it applies, the row and the field.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: writing parquet: {source}")]
    Parquet {
        path: String,
        #[source]
        source: parquet::errors::ParquetError,
    },
    #[error("{path}: row {row}: field `{field}`: {message}")]
    Field {
        path: String,
        row: usize,
        field: String,
        message: String,
    },
    #[error("{path}: cannot read session: {source}")]
    Session {
        path: String,
        #[source]
        source: crate::session::SessionError,
    },
    #[error("{path}: event {seq}: field `{field}`: {message}")]
    SessionField {
        path: String,
        seq: u64,
        field: String,
        message: String,
    },
    #[error("task {task}: {source}")]
    Task {
        task: String,
        #[source]
        source: crate::env::EnvError,
    },
    #[error("writing JSON to {path}: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The physical type of a leaf column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaf {
    /// UTF-8 string (BYTE_ARRAY, logical STRING).
    Str,
    I64,
    F64,
    F32,
    Bool,
}

/// A node of a parquet schema: every node is optional (nullable), as pyarrow writes them.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Leaf(&'static str, Leaf),
    Struct(&'static str, Vec<Node>),
    /// A three-level LIST; the item's own name is replaced by `element`.
    List(&'static str, Box<Node>),
}

impl Node {
    fn name(&self) -> &'static str {
        match self {
            Node::Leaf(n, _) | Node::Struct(n, _) | Node::List(n, _) => n,
        }
    }
    /// What a value of this node must be (as [`Cell::kind`] names it).
    fn kind(&self) -> &'static str {
        match self {
            Node::Leaf(_, Leaf::Str) => "string",
            Node::Leaf(_, Leaf::I64) => "int64",
            Node::Leaf(_, Leaf::F64) => "double",
            Node::Leaf(_, Leaf::F32) => "float",
            Node::Leaf(_, Leaf::Bool) => "bool",
            Node::Struct(..) => "struct",
            Node::List(..) => "list",
        }
    }
}

/// One value of a row, shaped like its [`Node`].
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Null,
    Str(String),
    I64(i64),
    F64(f64),
    F32(f32),
    Bool(bool),
    List(Vec<Cell>),
    Struct(Vec<Cell>),
}

impl Cell {
    fn str(s: impl Into<String>) -> Self {
        Cell::Str(s.into())
    }
    fn opt_str(s: Option<&str>) -> Self {
        s.map_or(Cell::Null, Cell::str)
    }
    fn kind(&self) -> &'static str {
        match self {
            Cell::Null => "null",
            Cell::Str(_) => "string",
            Cell::I64(_) => "int64",
            Cell::F64(_) => "double",
            Cell::F32(_) => "float",
            Cell::Bool(_) => "bool",
            Cell::List(_) => "list",
            Cell::Struct(_) => "struct",
        }
    }
}

/// The parquet type of a node (the list item renamed `element`).
fn parquet_type(node: &Node, name: &str) -> parquet::errors::Result<TypePtr> {
    let t = match node {
        Node::Leaf(_, leaf) => {
            let (physical, logical) = match leaf {
                Leaf::Str => (PhysicalType::BYTE_ARRAY, Some(LogicalType::String)),
                Leaf::I64 => (PhysicalType::INT64, None),
                Leaf::F64 => (PhysicalType::DOUBLE, None),
                Leaf::F32 => (PhysicalType::FLOAT, None),
                Leaf::Bool => (PhysicalType::BOOLEAN, None),
            };
            Type::primitive_type_builder(name, physical)
                .with_repetition(Repetition::OPTIONAL)
                .with_logical_type(logical)
                .build()?
        }
        Node::Struct(_, fields) => Type::group_type_builder(name)
            .with_repetition(Repetition::OPTIONAL)
            .with_fields(
                fields
                    .iter()
                    .map(|f| parquet_type(f, f.name()))
                    .collect::<parquet::errors::Result<_>>()?,
            )
            .build()?,
        Node::List(_, item) => {
            let list = Type::group_type_builder("list")
                .with_repetition(Repetition::REPEATED)
                .with_fields(vec![parquet_type(item, "element")?])
                .build()?;
            Type::group_type_builder(name)
                .with_repetition(Repetition::OPTIONAL)
                .with_logical_type(Some(LogicalType::List))
                .with_fields(vec![Arc::new(list)])
                .build()?
        }
    };
    Ok(Arc::new(t))
}

/// A schema node with the range of leaf columns under it (leaves in depth-first order, which is
/// parquet's column order).
struct Compiled<'a> {
    node: &'a Node,
    first: usize,
    leaves: usize,
    children: Vec<Compiled<'a>>,
}

fn compile<'a>(
    node: &'a Node,
    first: usize,
    leaves_out: &mut Vec<(Leaf, bool)>,
    repeated: bool,
) -> Compiled<'a> {
    match node {
        Node::Leaf(_, leaf) => {
            leaves_out.push((*leaf, repeated));
            Compiled {
                node,
                first,
                leaves: 1,
                children: Vec::new(),
            }
        }
        Node::Struct(_, fields) => {
            let mut children = Vec::with_capacity(fields.len());
            let mut next = first;
            for f in fields {
                let c = compile(f, next, leaves_out, repeated);
                next += c.leaves;
                children.push(c);
            }
            Compiled {
                node,
                first,
                leaves: next - first,
                children,
            }
        }
        Node::List(_, item) => {
            let c = compile(item, first, leaves_out, true);
            Compiled {
                node,
                first,
                leaves: c.leaves,
                children: vec![c],
            }
        }
    }
}

/// The shredded values of one leaf column: non-null values plus definition and repetition
/// levels for every slot (null slots included).
struct Column {
    values: Values,
    def: Vec<i16>,
    rep: Vec<i16>,
    repeated: bool,
}

enum Values {
    Str(Vec<ByteArray>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
}

impl Column {
    fn new(leaf: Leaf, repeated: bool) -> Self {
        let values = match leaf {
            Leaf::Str => Values::Str(Vec::new()),
            Leaf::I64 => Values::I64(Vec::new()),
            Leaf::F64 => Values::F64(Vec::new()),
            Leaf::F32 => Values::F32(Vec::new()),
            Leaf::Bool => Values::Bool(Vec::new()),
        };
        Self {
            values,
            def: Vec::new(),
            rep: Vec::new(),
            repeated,
        }
    }

    fn push_null(&mut self, def: i16, rep: i16) {
        self.def.push(def);
        self.rep.push(rep);
    }

    /// Push a present value (its definition level is `def`); a type mismatch is an error.
    fn push(&mut self, cell: &Cell, def: i16, rep: i16) -> Result<(), String> {
        match (&mut self.values, cell) {
            (Values::Str(v), Cell::Str(s)) => v.push(ByteArray::from(s.as_bytes().to_vec())),
            (Values::I64(v), Cell::I64(x)) => v.push(*x),
            (Values::F64(v), Cell::F64(x)) => v.push(*x),
            (Values::F32(v), Cell::F32(x)) => v.push(*x),
            (Values::Bool(v), Cell::Bool(x)) => v.push(*x),
            (values, cell) => {
                let want = match values {
                    Values::Str(_) => "string",
                    Values::I64(_) => "int64",
                    Values::F64(_) => "double",
                    Values::F32(_) => "float",
                    Values::Bool(_) => "bool",
                };
                return Err(format!("expected {want}, got {}", cell.kind()));
            }
        }
        self.def.push(def);
        self.rep.push(rep);
        Ok(())
    }
}

/// A shredding error: the message and the field path, innermost name first.
#[derive(Debug)]
struct ShredError {
    path: Vec<&'static str>,
    message: String,
}

impl ShredError {
    fn at(mut self, name: &'static str) -> Self {
        self.path.push(name);
        self
    }
    fn field(&self) -> String {
        let mut p = self.path.clone();
        p.reverse();
        p.join(".")
    }
}

/// Null in every leaf under `c` at definition level `def`.
fn nulls(c: &Compiled, def: i16, rep: i16, cols: &mut [Column]) {
    for col in &mut cols[c.first..c.first + c.leaves] {
        col.push_null(def, rep);
    }
}

/// Shred one value of node `c`: `def` is the definition level of its parent (a present optional
/// node adds one), `rep` the repetition level of its first slot, `depth` the number of lists
/// above it (an item after a list's first repeats at `depth + 1`).
fn shred(
    c: &Compiled,
    cell: &Cell,
    rep: i16,
    def: i16,
    depth: i16,
    cols: &mut [Column],
) -> Result<(), ShredError> {
    let fail = |message: String| ShredError {
        path: Vec::new(),
        message,
    };
    match (c.node, cell) {
        (_, Cell::Null) => nulls(c, def, rep, cols),
        (Node::Leaf(..), v) => cols[c.first].push(v, def + 1, rep).map_err(fail)?,
        (Node::Struct(_, fields), Cell::Struct(values)) => {
            if values.len() != fields.len() {
                return Err(fail(format!(
                    "struct of {} fields given {} values",
                    fields.len(),
                    values.len()
                )));
            }
            for (child, v) in c.children.iter().zip(values) {
                shred(child, v, rep, def + 1, depth, cols).map_err(|e| e.at(child.node.name()))?;
            }
        }
        (Node::List(..), Cell::List(items)) => {
            if items.is_empty() {
                nulls(c, def + 1, rep, cols);
            }
            let item = &c.children[0];
            for (j, v) in items.iter().enumerate() {
                let r = if j == 0 { rep } else { depth + 1 };
                shred(item, v, r, def + 2, depth + 1, cols).map_err(|e| e.at("element"))?;
            }
        }
        (node, cell) => {
            return Err(fail(format!(
                "expected {}, got {}",
                node.kind(),
                cell.kind()
            )));
        }
    }
    Ok(())
}

/// Rows per row group: bounds the shredded columns held in memory.
const ROW_GROUP_ROWS: usize = 1024;

/// `<path>.tmp`: where a file is written before it is renamed into place.
fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Write `write` to `<path>.tmp` (parent directories created), then rename it to `path`; the
/// temporary file is removed on failure.
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&Path, File) -> Result<(), ExportError>,
) -> Result<(), ExportError> {
    let io = |p: &Path, source| ExportError::Io {
        path: p.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let tmp = tmp_path(path);
    let file = File::create(&tmp).map_err(|e| io(&tmp, e))?;
    let result =
        write(path, file).and_then(|()| std::fs::rename(&tmp, path).map_err(|e| io(path, e)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Write rows (each a `Cell` per top-level field of `schema`) as one parquet file, atomically.
fn write_rows_parquet(path: &Path, schema: &[Node], rows: &[Vec<Cell>]) -> Result<(), ExportError> {
    write_atomically(path, |path, file| {
        let pq = |source| ExportError::Parquet {
            path: path.display().to_string(),
            source,
        };
        let root = Type::group_type_builder("schema")
            .with_fields(
                schema
                    .iter()
                    .map(|n| parquet_type(n, n.name()))
                    .collect::<parquet::errors::Result<_>>()
                    .map_err(pq)?,
            )
            .build()
            .map_err(pq)?;
        let mut leaves = Vec::new();
        let mut compiled = Vec::with_capacity(schema.len());
        for n in schema {
            let c = compile(n, leaves.len(), &mut leaves, false);
            compiled.push(c);
        }
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_created_by(format!("envace {}", env!("CARGO_PKG_VERSION")))
            .build();
        let mut writer =
            SerializedFileWriter::new(BufWriter::new(file), Arc::new(root), Arc::new(props))
                .map_err(pq)?;
        for (g, group) in rows.chunks(ROW_GROUP_ROWS).enumerate() {
            let mut cols: Vec<Column> = leaves.iter().map(|&(l, r)| Column::new(l, r)).collect();
            for (i, row) in group.iter().enumerate() {
                let row_index = g * ROW_GROUP_ROWS + i;
                let field_error = |field: String, message: String| ExportError::Field {
                    path: path.display().to_string(),
                    row: row_index,
                    field,
                    message,
                };
                if row.len() != compiled.len() {
                    return Err(field_error(
                        "-".into(),
                        format!("{} values for {} columns", row.len(), compiled.len()),
                    ));
                }
                for (c, cell) in compiled.iter().zip(row) {
                    shred(c, cell, 0, 0, 0, &mut cols).map_err(|e| {
                        let e = e.at(c.node.name());
                        field_error(e.field(), e.message)
                    })?;
                }
            }
            let mut rg = writer.next_row_group().map_err(pq)?;
            for col in &cols {
                let mut cw = rg.next_column().map_err(pq)?.ok_or_else(|| {
                    pq(parquet::errors::ParquetError::General(
                        "the schema has fewer columns than its leaves".into(),
                    ))
                })?;
                let def = Some(col.def.as_slice());
                let rep = col.repeated.then_some(col.rep.as_slice());
                match &col.values {
                    Values::Str(v) => cw.typed::<ByteArrayType>().write_batch(v, def, rep),
                    Values::I64(v) => cw.typed::<Int64Type>().write_batch(v, def, rep),
                    Values::F64(v) => cw.typed::<DoubleType>().write_batch(v, def, rep),
                    Values::F32(v) => cw.typed::<FloatType>().write_batch(v, def, rep),
                    Values::Bool(v) => cw.typed::<BoolType>().write_batch(v, def, rep),
                }
                .map_err(pq)?;
                cw.close().map_err(pq)?;
            }
            rg.close().map_err(pq)?;
        }
        let mut out = writer.into_inner().map_err(pq)?;
        out.flush().map_err(|source| ExportError::Io {
            path: path.display().to_string(),
            source,
        })
    })
}

/// A row as JSON: structs become objects keyed by the schema's names, lists arrays.
fn cells_to_json(schema: &[Node], row: &[Cell]) -> Result<Value, ShredError> {
    if row.len() != schema.len() {
        return Err(ShredError {
            path: Vec::new(),
            message: format!("{} values for {} fields", row.len(), schema.len()),
        });
    }
    let mut o = serde_json::Map::new();
    for (n, c) in schema.iter().zip(row) {
        o.insert(
            n.name().to_string(),
            cell_to_json(n, c).map_err(|e| e.at(n.name()))?,
        );
    }
    Ok(Value::Object(o))
}

/// A value as JSON; a value not of its node's shape is the same error the parquet writer gives.
fn cell_to_json(node: &Node, cell: &Cell) -> Result<Value, ShredError> {
    Ok(match (node, cell) {
        (_, Cell::Null) => Value::Null,
        (Node::Leaf(_, Leaf::Str), Cell::Str(s)) => Value::from(s.as_str()),
        (Node::Leaf(_, Leaf::I64), Cell::I64(x)) => Value::from(*x),
        (Node::Leaf(_, Leaf::F64), Cell::F64(x)) => Value::from(*x),
        (Node::Leaf(_, Leaf::F32), Cell::F32(x)) => Value::from(*x),
        (Node::Leaf(_, Leaf::Bool), Cell::Bool(x)) => Value::from(*x),
        (Node::List(_, item), Cell::List(items)) => Value::Array(
            items
                .iter()
                .map(|c| cell_to_json(item, c).map_err(|e| e.at("element")))
                .collect::<Result<_, _>>()?,
        ),
        (Node::Struct(_, fields), Cell::Struct(values)) => cells_to_json(fields, values)?,
        (node, cell) => {
            return Err(ShredError {
                path: Vec::new(),
                message: format!("expected {}, got {}", node.kind(), cell.kind()),
            });
        }
    })
}

/// Write rows as one JSON array (the shape of the parquet rows), atomically.
fn write_rows_json(path: &Path, schema: &[Node], rows: &[Vec<Cell>]) -> Result<(), ExportError> {
    write_atomically(path, |path, file| {
        let values = rows
            .iter()
            .enumerate()
            .map(|(row, r)| {
                cells_to_json(schema, r).map_err(|e| ExportError::Field {
                    path: path.display().to_string(),
                    row,
                    field: e.field(),
                    message: e.message,
                })
            })
            .collect::<Result<Vec<Value>, _>>()?;
        let mut out = BufWriter::new(file);
        serde_json::to_writer(&mut out, &values).map_err(|source| ExportError::Json {
            path: path.display().to_string(),
            source,
        })?;
        out.flush().map_err(|source| ExportError::Io {
            path: path.display().to_string(),
            source,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;

    fn field_json(f: &Field) -> Value {
        match f {
            Field::Null => Value::Null,
            Field::Bool(b) => Value::from(*b),
            Field::Long(x) => Value::from(*x),
            Field::Double(x) => Value::from(*x),
            Field::Float(x) => Value::from(*x),
            Field::Str(s) => Value::from(s.as_str()),
            Field::ListInternal(l) => Value::Array(l.elements().iter().map(field_json).collect()),
            Field::Group(r) => {
                let mut o = serde_json::Map::new();
                for (k, v) in r.get_column_iter() {
                    o.insert(k.clone(), field_json(v));
                }
                Value::Object(o)
            }
            other => panic!("unexpected field {other:?}"),
        }
    }

    fn read_back(path: &Path) -> Vec<Value> {
        let r = SerializedFileReader::new(File::open(path).unwrap()).unwrap();
        r.get_row_iter(None)
            .unwrap()
            .map(|row| {
                let row = row.unwrap();
                let mut o = serde_json::Map::new();
                for (k, v) in row.get_column_iter() {
                    o.insert(k.clone(), field_json(v));
                }
                Value::Object(o)
            })
            .collect()
    }

    fn schema() -> Vec<Node> {
        vec![
            Node::Leaf("id", Leaf::I64),
            Node::List(
                "msgs",
                Box::new(Node::Struct(
                    "m",
                    vec![
                        Node::Leaf("role", Leaf::Str),
                        Node::List("tags", Box::new(Node::Leaf("t", Leaf::Str))),
                    ],
                )),
            ),
            Node::List(
                "grid",
                Box::new(Node::List("row", Box::new(Node::Leaf("x", Leaf::F64)))),
            ),
            Node::Struct(
                "info",
                vec![Node::Leaf("ok", Leaf::Bool), Node::Leaf("p", Leaf::F32)],
            ),
        ]
    }

    fn msg(role: &str, tags: &[&str]) -> Cell {
        Cell::Struct(vec![
            Cell::str(role),
            Cell::List(tags.iter().map(|t| Cell::str(*t)).collect()),
        ])
    }

    #[test]
    fn nested_lists_structs_and_nulls_read_back_as_written() {
        let rows = vec![
            vec![
                Cell::I64(1),
                Cell::List(vec![msg("user", &["a", "b"]), msg("tool", &[]), Cell::Null]),
                Cell::List(vec![
                    Cell::List(vec![Cell::F64(1.5), Cell::Null]),
                    Cell::List(vec![]),
                    Cell::Null,
                    Cell::List(vec![Cell::F64(-2.0)]),
                ]),
                Cell::Struct(vec![Cell::Bool(true), Cell::F32(0.5)]),
            ],
            vec![
                Cell::Null,
                Cell::List(vec![]),
                Cell::Null,
                Cell::Struct(vec![Cell::Null, Cell::Null]),
            ],
            vec![
                Cell::I64(3),
                Cell::Null,
                Cell::List(vec![Cell::List(vec![Cell::F64(7.0)])]),
                Cell::Null,
            ],
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        write_rows_parquet(&path, &schema(), &rows).unwrap();
        assert!(!tmp_path(&path).exists());
        let back = read_back(&path);
        let want: Vec<Value> = rows
            .iter()
            .map(|r| cells_to_json(&schema(), r).unwrap())
            .collect();
        assert_eq!(back, want);
        assert_eq!(back[0]["msgs"][1]["tags"], serde_json::json!([]));
        assert_eq!(back[0]["grid"][2], Value::Null);
    }

    #[test]
    fn many_rows_span_row_groups() {
        let rows: Vec<Vec<Cell>> = (0..(ROW_GROUP_ROWS as i64 * 2 + 5))
            .map(|i| {
                vec![
                    Cell::I64(i),
                    Cell::List(vec![msg("user", &["x"]); (i % 3) as usize]),
                    Cell::Null,
                    Cell::Null,
                ]
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.parquet");
        write_rows_parquet(&path, &schema(), &rows).unwrap();
        let r = SerializedFileReader::new(File::open(&path).unwrap()).unwrap();
        assert_eq!(r.metadata().num_row_groups(), 3);
        let back = read_back(&path);
        assert_eq!(back.len(), rows.len());
        assert_eq!(back[2050]["id"], 2050);
        assert_eq!(back[2050]["msgs"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn a_value_of_the_wrong_type_names_the_row_and_field_and_leaves_no_file() {
        let mut bad = vec![
            Cell::I64(1),
            Cell::List(vec![msg("user", &[])]),
            Cell::Null,
            Cell::Null,
        ];
        let good = bad.clone();
        bad[1] = Cell::List(vec![Cell::Struct(vec![Cell::I64(5), Cell::List(vec![])])]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.parquet");
        let e = write_rows_parquet(&path, &schema(), &[good, bad]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("bad.parquet"), "{msg}");
        assert!(msg.contains("row 1"), "{msg}");
        assert!(msg.contains("`msgs.element.role`"), "{msg}");
        assert!(msg.contains("expected string, got int64"), "{msg}");
        assert!(!path.exists());
        assert!(!tmp_path(&path).exists());
    }

    #[test]
    fn the_json_copy_rejects_the_same_misshapen_value() {
        let bad = vec![
            Cell::I64(1),
            Cell::List(vec![]),
            Cell::List(vec![Cell::List(vec![Cell::str("x")])]),
            Cell::Null,
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        let e = write_rows_json(&path, &schema(), &[bad]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("row 0"), "{msg}");
        assert!(msg.contains("`grid.element.element`"), "{msg}");
        assert!(msg.contains("expected double, got string"), "{msg}");
        assert!(!path.exists());
    }
}
