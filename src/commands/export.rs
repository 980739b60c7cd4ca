//! `envace export`: sessions as OpenAI chat records, sessions or built-in tasks as verl
//! parquet rows (`envace::session::export`, `envace::export::verl`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::cli::ExportArgs;
use envace::env::domains::Domain;
use envace::env::tasks::Split;

pub fn export(a: ExportArgs) -> Result<()> {
    match a.format.as_str() {
        "openai" => export_openai(a),
        "verl" => export_verl(a),
        other => bail!("--format `{other}`: `openai` or `verl`"),
    }
}

/// `envace export --format verl`: built-in tasks (`--tasks`) or sessions, as parquet rows.
fn export_verl(a: ExportArgs) -> Result<()> {
    use envace::export::verl;
    let out = a
        .out
        .as_deref()
        .context("--format verl writes a parquet file: --out FILE.parquet")?;
    let rows = if a.tasks.is_empty() {
        if a.files.is_empty() {
            bail!("--format verl: give session files or directories, or --tasks DOMAINS");
        }
        let mut paths = Vec::new();
        for f in &a.files {
            if f.is_dir() {
                let mut v: Vec<PathBuf> = std::fs::read_dir(f)
                    .with_context(|| format!("reading {}", f.display()))?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                    .collect();
                v.sort();
                paths.extend(v);
            } else {
                paths.push(f.clone());
            }
        }
        verl::rows_from_sessions(&paths, a.include_simulator)?
    } else {
        if !a.files.is_empty() {
            bail!("--tasks exports built-in tasks: give no session files with it");
        }
        let splits: &[Split] = match a.split.as_str() {
            "train" => &[Split::Train],
            "test" => &[Split::Test],
            "all" => &[Split::Train, Split::Test],
            other => bail!("--split: `{other}` (train, test or all)"),
        };
        let mut rows = Vec::new();
        for d in &a.tasks {
            let domain = Domain::from_name(d).with_context(|| format!("--tasks: `{d}`"))?;
            for &split in splits {
                rows.extend(verl::rows_from_tasks(domain, split, a.limit)?);
            }
        }
        // One index across domains and splits (the task id stays in `original_index`).
        for (i, r) in rows.iter_mut().enumerate() {
            r.extra_info.index = i as i64;
        }
        rows
    };
    verl::write_parquet(&rows, out)?;
    if let Some(j) = &a.json {
        verl::write_json(&rows, j)?;
    }
    eprintln!("{} rows → {}", rows.len(), out.display());
    Ok(())
}

fn export_openai(a: ExportArgs) -> Result<()> {
    let [file] = a.files.as_slice() else {
        bail!(
            "--format openai exports one session file (got {})",
            a.files.len()
        );
    };
    let opts = envace::session::export::ExportOptions {
        include_simulator: a.include_simulator,
        ..Default::default()
    };
    let n = match &a.out {
        Some(p) => {
            let mut f =
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
            envace::session::export_openai(file, &mut f, &opts)?
        }
        None => envace::session::export_openai(file, &mut std::io::stdout(), &opts)?,
    };
    eprintln!("{n} records");
    Ok(())
}
