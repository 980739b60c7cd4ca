//! The command line: clap types only; each command is a thin call into the library.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use envace::engine::driver::ApprovalPolicy;
use envace::engine::runner::ModeChoice;
use envace::engine::types::{
    CommitRule, MemoryFormat, MemoryPlacement, MemorySelection, RehearsalDepth, RehearsalStrategy,
    RehearsalTrigger,
};
use envace::env::cli::{BfclEvalArgs, EnvCommand, McpArgs, TasksArgs};
use envace::runtime::DeviceChoice;

#[derive(Debug, Parser)]
#[command(
    name = "envace",
    version,
    about = "Train and inspect tool-using LLM agents the EnvACE way"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The workbench TUI (also what `envace` with no arguments opens).
    Tui(TuiArgs),
    /// Generate text with a local model (HF checkpoint directory or .gguf file).
    Generate(GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Headless demo of the bundled model: a held-out bank task in shadow mode with Private Rehearsal.
    Demo(DemoArgs),
    /// Train the bundled model from scratch on the built-in domains (tokenizer + SFT).
    Pretrain(PretrainArgs),
    /// Role-wise GRPO (EnvACE world rehearsal) on a domain's train split, or `train sft` on
    /// collected sessions; full fine-tuning or LoRA (`--lora R`).
    Train(TrainArgs),
    /// Fold a LoRA adapter into its base model (HF or GGUF): writes a plain HF checkpoint.
    Merge(MergeArgs),
    /// Task environments: built-in domains and MCP servers.
    Env {
        #[command(subcommand)]
        command: EnvCommand,
    },
    /// List the tasks of a built-in domain.
    Tasks(TasksArgs),
    /// Evaluate a model on a domain split (or `eval bfcl` for BFCL-v4 single-turn accuracy).
    Eval(EvalArgs),
    /// Run one episode: a built-in task or an MCP task.
    Run(RunArgs),
    /// Print a session step by step.
    Replay { file: PathBuf },
    /// Export a session (OpenAI chat JSONL).
    Export(ExportArgs),
    /// List sessions (the TUI's Sessions tab, headless).
    Sessions(SessionsArgs),
    /// Re-run a saved session from one of its events, optionally after editing a tool result or
    /// an actor message (the TUI debugger's fork, headless). Writes a new session beside it.
    Fork(ForkArgs),
    /// Step-aligned diff of two sessions (the TUI debugger's diff, headless).
    Diff(DiffArgs),
}

#[derive(Debug, Args)]
pub struct SessionsArgs {
    /// Sessions directory (default: the user's data directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// date, env, task, mode, steps or reward.
    #[arg(long, default_value = "date")]
    pub sort: String,
    /// Ascending order (default: descending).
    #[arg(long)]
    pub asc: bool,
    /// Case-insensitive substring over environment, task, mode, model and file name.
    #[arg(long, default_value = "")]
    pub filter: String,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The session to fork.
    pub session: PathBuf,
    /// Event id (e.g. `e12`) on the main line to fork at (`envace replay` and the debugger show ids).
    #[arg(long)]
    pub at: String,
    /// Replace a tool result before re-running: EVENT_ID=CONTENT (CONTENT `@file` reads a file).
    #[arg(long, conflicts_with = "edit_actor")]
    pub edit_tool: Option<String>,
    /// Replace an actor message before re-running: EVENT_ID=CONTENT.
    #[arg(long)]
    pub edit_actor: Option<String>,
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// Output session (default: `<stem>.fork-N.jsonl` beside the original).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The fork re-runs the original's recorded episode configuration; this answers its
    /// approval gate headless (not recorded in version-1 sessions).
    #[arg(long, value_enum, default_value = "always")]
    pub approve: ApprovalPolicy,
    /// Another seed for the same configuration (default: the original's).
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    pub a: PathBuf,
    pub b: PathBuf,
    #[arg(long)]
    pub json: bool,
}

/// The episode flags shared by `run` and `eval`: parsed into the one `EpisodeConfig`
/// (`commands::episode_config`), with the value names the TUI's Run form uses.
#[derive(Debug, Args, Clone)]
pub struct ModeArgs {
    #[arg(long, value_enum, default_value = "real")]
    pub mode: ModeChoice,
    /// Private Rehearsal branches before a gated call (0 = off).
    #[arg(long, default_value_t = 0)]
    pub rehearsals: usize,
    #[arg(long, value_enum, default_value = "parallel")]
    pub rehearsal_mode: RehearsalStrategy,
    #[arg(long, value_enum, default_value = "irreversible")]
    pub rehearse_on: RehearsalTrigger,
    /// How a headless run answers the approval gate for irreversible real calls:
    /// always approve, never approve, or auto (approve when Private Rehearsal predicted success).
    #[arg(long, value_enum, default_value = "always")]
    pub approve: ApprovalPolicy,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 8)]
    pub max_turns: u32,
    /// Actor temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Constrain every tool call's name to the tools the environment lists (token by token,
    /// local models only).
    #[arg(long)]
    pub constrain_tools: bool,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Private Rehearsal memory: compact (one line per branch), full (every step), json.
    #[arg(long, value_enum, default_value = "compact")]
    pub memory_format: MemoryFormat,
    /// Which branches the memory keeps: all, success-first:K, failures-only:K.
    #[arg(long, default_value = "all")]
    pub memory_select: MemorySelection,
    /// Where the memory goes: user (a note after the conversation) or system (prompt suffix).
    #[arg(long, value_enum, default_value = "user")]
    pub memory_placement: MemoryPlacement,
    /// How far an imagined branch runs: a number of actor turns, or `end`.
    #[arg(long, default_value = "2")]
    pub rehearsal_depth: RehearsalDepth,
    /// Sampling temperature of the imagined turns and simulations.
    #[arg(long, default_value_t = 0.3)]
    pub rehearsal_temperature: f64,
    /// What the actor commits after rehearsal: best-branch (keep the draft unless it failed
    /// where another branch's different first call succeeded, then commit that call; never ask
    /// again), draft-unless-failure (keep the draft unless its own branch predicted a failure,
    /// else ask again with the memory) or reprompt (always ask again with the memory).
    #[arg(long, value_enum, default_value = "best-branch")]
    pub rehearsal_commit: CommitRule,
    /// Sampling temperature of the other branches' first imagined step (default: the
    /// rehearsal temperature). Higher gives best-branch different calls to choose from.
    #[arg(long, value_name = "T")]
    pub rehearsal_explore: Option<f64>,
    /// Answer an imagined call with the real error already observed for the identical call
    /// (until an irreversible call succeeds) instead of asking the simulator.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub rehearsal_recall: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// A built-in domain (bank, retail, travel).
    #[arg(long, conflicts_with = "mcp")]
    pub env: Option<String>,
    /// Task id (built-in domains) or id inside --task-file (MCP).
    #[arg(long)]
    pub task: Option<String>,
    #[command(flatten)]
    pub mcp: McpArgs,
    #[command(flatten)]
    pub headers: envace::env::cli::McpHeaderArgs,
    /// MCP task file (see docs/TASKS.md); its `server` section is used when --mcp/--mcp-url
    /// are not given.
    #[arg(long)]
    pub task_file: Option<PathBuf>,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Session file (default: the user's data directory).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: Option<EvalCommand>,
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// A built-in domain to evaluate on (BFCL: `envace eval bfcl`).
    #[arg(long, required = true)]
    pub env: Option<String>,
    #[arg(long, default_value = "test")]
    pub split: String,
    #[arg(long)]
    pub limit: Option<usize>,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Where to write one session per task (default: the user's data directory).
    #[arg(long)]
    pub sessions: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Session files or directories (their *.jsonl). `openai`: exactly one file.
    pub files: Vec<PathBuf>,
    /// `openai` (JSONL conversations) or `verl` (parquet rows for verl and the EnvACE reference).
    #[arg(long, default_value = "openai")]
    pub format: String,
    /// Output file (default: stdout; `verl`: required, a .parquet file).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also export the simulator's generations as their own conversations / rows.
    #[arg(long)]
    pub include_simulator: bool,
    /// `verl`: export built-in tasks instead of sessions (comma-separated domains).
    #[arg(long, value_delimiter = ',')]
    pub tasks: Vec<String>,
    /// `verl` with --tasks: `train`, `test` or `all`.
    #[arg(long, default_value = "train")]
    pub split: String,
    /// `verl` with --tasks: at most N tasks per domain and split.
    #[arg(long)]
    pub limit: Option<usize>,
    /// `verl`: also write the rows as JSON (the reference's tool simulator loads this copy; give
    /// it the rows of every split, e.g. a second export with --split all).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum EvalCommand {
    /// BFCL-v4 single-turn accuracy: score recorded calls (`--responses`), or let a local model
    /// answer every entry (`--model`, through its chat template or tool rendering).
    Bfcl(BfclEvalArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub prompt: String,
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Number of branches sampled from the one prefilled prompt.
    #[arg(long, default_value_t = 1)]
    pub branches: usize,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Render the prompt raw instead of through the chat template.
    #[arg(long)]
    pub raw: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefill / decode throughput and branch cost.
    Generate(BenchGenerateArgs),
    /// Training throughput (forward + backward + AdamW) and peak memory, full or LoRA.
    Train(BenchTrainArgs),
    /// The competing process of `bench generate --contend`: keeps `--threads` threads busy
    /// until its standard input closes.
    #[command(hide = true)]
    Spin {
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
        threads: u16,
    },
}

#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// HF model directory (default: the bundled model unless --shape is given).
    #[arg(long, conflicts_with = "shape")]
    pub model: Option<PathBuf>,
    /// A named shape with seeded weights: tiny-256x6 or smollm2-135m.
    #[arg(long)]
    pub shape: Option<String>,
    /// Train LoRA adapters of this rank (q/k/v/o) instead of every weight.
    #[arg(long)]
    pub lora: Option<usize>,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchGenerateArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Context depths of the `decode_tok_s_at` decodes (comma-separated; depth 0 is a
    /// one-token prompt), as llama-bench's `-d`.
    #[arg(long, value_delimiter = ',', default_value = "0,128,512")]
    pub depths: Vec<usize>,
    /// Built-in task whose first Private Rehearsal (N=4 parallel, depth 2, real mode) gives
    /// `rehearsal_ms`; `none` skips it.
    #[arg(long, default_value = "bank-test-0007")]
    pub rehearsal_task: String,
    /// Busy threads of a competing process (a child `envace bench spin`) during the
    /// `decode_tok_s_contended` decode, as when another program shares the cores; 0 skips it
    /// (at most 256).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub contend: u16,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct PretrainArgs {
    /// Output model directory.
    #[arg(long, default_value = "models/envace-tiny")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Maximum optimizer steps.
    #[arg(long, default_value_t = 3000)]
    pub steps: usize,
    /// Wall-clock budget in minutes (training stops early, keeping what it learned).
    #[arg(long, default_value_t = 15.0)]
    pub minutes: f64,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 768)]
    pub vocab: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 6)]
    pub layers: usize,
    /// Metrics JSONL (one object per step).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Continue from an existing model directory (its tokenizer and weights) with a fresh
    /// schedule, instead of starting from scratch.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Full fine-tuning from a LoRA adapter `--init`: fold it into its base and train every
    /// weight (the output is a plain checkpoint). Without it an adapter `--init` trains on as
    /// an adapter.
    #[arg(long, requires = "init", conflicts_with = "lora")]
    pub full: bool,
    /// Train-split tasks generated per domain for the corpus (0 = the 500 built-in ones).
    #[arg(long, default_value_t = 4000)]
    pub tasks_per_domain: usize,
    /// Simulator examples per task (0 = one per gold call).
    #[arg(long, default_value_t = 1)]
    pub sim_per_task: usize,
    /// Fraction of tasks that add an actor example with a rehearsal memory in its prompt.
    #[arg(long, default_value_t = 0.4)]
    pub memory_fraction: f64,
    /// Fraction of tasks that add a slipped call with its real (usually error) response: a
    /// simulator example, and an actor example that recovers with the gold call.
    #[arg(long, default_value_t = 0.3)]
    pub slip_fraction: f64,
    /// Where a slip's new id or amount comes from: `split` (the train split's own values, so
    /// no test-split value enters the corpus) or `any` (the whole range, a quarter of it the
    /// test split's: how the bundled models were trained; their commands pass it).
    #[arg(long, value_enum, default_value_t = envace::train::pretrain::SlipValues::Split)]
    pub slip_values: envace::train::pretrain::SlipValues,
    /// Copy drills per task (short conversations that echo train-split entities exactly; a
    /// fraction is a probability: 2.5 = two drills, and a third half the time).
    #[arg(long, default_value_t = 1.0, value_parser = parse_per_task)]
    pub copy_per_task: f64,
    /// Fraction of simulator examples whose few-shot pool is the task's whole recorded gold run
    /// (the call being simulated included), as in rehearse-mode training: the simulator learns
    /// to answer a recorded call with its recorded response and a slipped one with its error.
    #[arg(long, default_value_t = 0.0)]
    pub recorded_fraction: f64,
    /// Fraction of copy-drill items that are random letter strings instead of train-split
    /// entities (which are short fixed lists a model memorises): practice in copying what it
    /// has never seen, as the test split's held-out names and places demand.
    #[arg(long, default_value_t = 0.0)]
    pub random_copy: f64,
    /// Fraction of tasks that add an actor conversation whose names, places, payees and items
    /// are all replaced by random letter strings (copying unseen values inside real tasks).
    #[arg(long, default_value_t = 0.0)]
    pub random_entities: f64,
    /// What --random-entities puts in: letters (random letter strings), words (payees and
    /// items become real nouns, which a tokenizer splits differently inside a JSON string than
    /// after a space; names and places stay letter strings) or vocab (every value a word of
    /// assets/entity-words.txt, ~11,000 English words, capitalised for names and places).
    #[arg(long, value_enum, default_value = "letters")]
    pub entity_style: envace::train::pretrain::EntityStyle,
    /// Write a checkpoint every N steps into `<out>.work/` (0 = only at the end).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,
    /// Tool drills per task: episodes with made-up tools (reading a tool list, optional
    /// parameters, parallel calls, requests no tool fits), half with a simulator example.
    #[arg(long, default_value_t = 0.0, value_parser = parse_per_task)]
    pub tool_drills: f64,
    /// How tool drills name their tools: named (the request's verb_object) or listed (5-14
    /// tools named with synonyms, looked up in the list as on a real MCP server).
    #[arg(long, value_enum, default_value = "named")]
    pub tool_drill_style: envace::train::tool_drill::DrillStyle,
    /// Calculation drills per task: calculator-style functions, one or two calls, or a request
    /// no listed function fits (the reply declines without a call); half of the one-function
    /// drills also give their declining twin (the same request, that function unlisted).
    #[arg(long, default_value_t = 0.0, value_parser = parse_per_task)]
    pub calc_drills: f64,
    /// Spelling drills per task: a request lists 3-8 English words (assets/entity-words.txt,
    /// `the arena, the clerk and the seamstress`) and the reply makes one call per word with
    /// the word as a JSON string value, where a tokenizer splits it in other pieces.
    #[arg(long, default_value_t = 0.0, value_parser = parse_per_task)]
    pub spell_drills: f64,
    /// Actor turns after a list of flights first compare the prices two at a time in their own
    /// text, then call or answer: `--price-steps` or `--price-steps pairs` writes flights and
    /// prices with the winner's id (`fl_375 357 or fl_817 122: fl_817.`), `--price-steps prices`
    /// the prices alone, then the cheapest flight's id once (`357 or 122: 122. … Cheapest:
    /// fl_817.`).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "pairs")]
    pub price_steps: Option<envace::train::pretrain::PriceStepStyle>,
    /// The compact chat template to train (and ship) with: compact (the bundled model's) or
    /// compact-v2 (optional parameters marked `name(req,opt?)`).
    #[arg(long, value_enum, default_value = "compact")]
    pub template: envace::train::pretrain::CorpusTemplate,
    /// More train-split tasks of a kind: KIND=W (repeatable; `pay_if_enough=3` gives three
    /// times as many, at most one short, the extra ones fresh instances). Kinds are the second
    /// column of `envace tasks DOMAIN --split train`.
    #[arg(long = "kind-weight", value_name = "KIND=W", value_parser = parse_kind_weight)]
    pub kind_weights: Vec<(String, f64)>,
    /// Stop before this step, the learning-rate schedule still spanning --steps: reproduces a
    /// run that its --minutes budget ended (its trainer_state.json says at which step).
    #[arg(long)]
    pub stop_at: Option<usize>,
    /// Learning-rate warmup steps (linear), before the cosine decay.
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    /// Print corpus statistics and samples, train nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
    /// With `--init`: train a LoRA adapter instead of every weight.
    #[command(flatten)]
    pub lora: LoraArgs,
}

/// LoRA flags shared by `train` and `train sft`.
#[derive(Debug, Args, Clone)]
pub struct LoraArgs {
    /// Train a LoRA adapter of this rank instead of every weight (the base stays frozen).
    #[arg(long, value_name = "R")]
    pub lora: Option<usize>,
    /// LoRA alpha (the update is scaled by alpha/r); default 2·r.
    #[arg(long, requires = "lora")]
    pub lora_alpha: Option<f64>,
    /// Adapted projections (comma-separated): q_proj, k_proj, v_proj, o_proj, gate_proj,
    /// up_proj, down_proj.
    #[arg(long, default_value = "q_proj,k_proj,v_proj,o_proj", requires = "lora")]
    pub lora_targets: String,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct TrainArgs {
    #[command(subcommand)]
    pub command: Option<TrainCommand>,
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// Domains to train on (comma-separated).
    #[arg(long, default_value = "bank")]
    pub env: String,
    #[arg(long, default_value = "grpo")]
    pub algo: String,
    /// rehearse = EnvACE (the simulator answers; a verifier scores afterwards); real = the
    /// actor-only baseline against the real environment.
    #[arg(long, value_enum, default_value = "rehearse")]
    pub mode: ModeChoice,
    #[arg(long, default_value_t = 4)]
    pub group: usize,
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Tasks per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Learning rate (default 2e-5; 1e-3 with --lora).
    #[arg(long)]
    pub lr: Option<f64>,
    /// The actor's sampling temperature in rollouts.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// The simulator's sampling temperature in rollouts (low: a broken JSON response ends its
    /// episode with reward 0).
    #[arg(long, default_value_t = 0.3)]
    pub sim_temperature: f64,
    #[arg(long, default_value_t = 0.0)]
    pub kl: f64,
    #[arg(long, default_value_t = 0.0)]
    pub entropy: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,
    /// Grounding loss weight (0 = off): also teach the simulator the real responses recorded
    /// in shadow-mode sessions (--grounding-sessions).
    #[arg(long, default_value_t = 0.0)]
    pub grounding: f64,
    /// Shadow-mode session files for the grounding loss: a file, a directory or a glob.
    #[arg(long)]
    pub grounding_sessions: Option<String>,
    /// Wall-clock budget in minutes.
    #[arg(long)]
    pub minutes: Option<f64>,
    /// Stop when the mean reward of the last N steps falls below a quarter of the first N
    /// steps' (0 = never).
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub collapse_patience: usize,
    /// Also write every rollout episode as a session file under DIR (step-NNNN/TASK-gG.jsonl).
    #[arg(long, value_name = "DIR")]
    pub rollouts: Option<PathBuf>,
    /// Optimisation passes over each step's rollouts (clipped surrogate from the second on).
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Full fine-tuning: keep parameters whose name contains one of these (comma-separated)
    /// fixed, e.g. `embed_tokens`.
    #[arg(long, value_delimiter = ',')]
    pub freeze: Vec<String>,
    /// Fraction F of each step's tasks played with every train-split name, place, payee and
    /// item replaced by a random string (request, state, gold run and checklist alike), so the
    /// reward depends on copying values that cannot be recalled (0 = off).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub random_entities: f64,
    /// What --random-entities puts in: letters (random letter strings), words (payees and
    /// items become real nouns; names and places stay letter strings) or vocab (every value a
    /// word of assets/entity-words.txt, capitalised for names and places).
    #[arg(long, value_enum, default_value = "letters")]
    pub entity_style: envace::train::pretrain::EntityStyle,
    /// Scale of negative advantages in the policy loss (1 = GRPO as specified, 0 = learn from
    /// better-than-baseline rows only).
    #[arg(long, default_value_t = 1.0, value_name = "W")]
    pub negative_weight: f64,
    /// Self-imitation: every row of a successful episode also carries this much positive
    /// advantage (0 = off), so tasks every episode of a group solves are reinforced too.
    #[arg(long, default_value_t = 0.0, value_name = "W")]
    pub imitation: f64,
    /// Rehearse mode: a call that exactly matches one of the task's recorded gold calls gets
    /// the recorded response; the simulator answers (and is trained on) the others.
    #[arg(long)]
    pub sim_recall: bool,
    /// The roles whose rows GRPO trains (comma-separated): actor, simulator.
    #[arg(long, default_value = "actor,simulator")]
    pub roles: String,
    /// Leave the tokens of values copied from the conversation (a status from a tool response,
    /// an id from the request) out of the policy term: RL trains the decisions.
    #[arg(long)]
    pub mask_copies: bool,
    /// Padded tokens per forward/backward micro-batch (the gradient is accumulated over them):
    /// activation memory grows with it and with the model (a SmolLM2-135M LoRA step, group 8:
    /// 10.9 GB peak at 4096, 4.7 GB at 1024, same loss and gradient, 1.3× the tokens/s).
    /// Default: sized from the model for ~3 GB of activations (the bundled model 4096,
    /// SmolLM2-135M 1024).
    #[arg(long, value_name = "N")]
    pub micro_batch_tokens: Option<usize>,
    /// Train on the first N train tasks of each domain only.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Train on these train-split tasks only (comma-separated ids, e.g. `bank-train-0003`).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub tasks: Vec<String>,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[arg(long, required = true)]
    pub out: Option<PathBuf>,
    /// Continue from a checkpoint directory written by this command (a LoRA run's checkpoint
    /// continues the LoRA run). Pass the flags the run started with: only --steps, --minutes,
    /// --checkpoint-every and --rollouts may differ (others are refused, naming them).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum TrainCommand {
    /// Supervised fine-tuning on collected session files.
    Sft(Box<SftArgs>),
}

/// `envace train sft`.
#[derive(Debug, Args)]
pub struct SftArgs {
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// Session files: a file, a directory (its *.jsonl) or a glob such as 'sessions/*.jsonl'.
    #[arg(long)]
    pub sessions: String,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Learning rate (default 1e-4; 1e-3 with --lora).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Rows per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Which generations to imitate (comma-separated): actor, simulator.
    #[arg(long, default_value = "actor,simulator")]
    pub roles: String,
    /// Keep rows of episodes whose reward is at least this. Simulator rows whose call reached
    /// the real environment (shadow mode) are relabelled with the real response and kept
    /// whatever the reward; rehearsal-branch rows are never used.
    #[arg(long, default_value_t = 1.0)]
    pub min_reward: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Continue from a checkpoint directory written by this command.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// `envace merge`.
#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The base: an HF checkpoint directory or a GGUF file (default: the base the adapter's
    /// config names; its recorded hash is checked either way).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Output: an HF checkpoint directory, or a `.gguf` file (a GGUF base only; the adapted
    /// projections quantized, every other tensor as the base stores it). Written atomically.
    #[arg(long)]
    pub out: PathBuf,
    /// Store the weights as this type. An HF directory takes f32, bf16 or f16 (default: the
    /// base's; f32 for a GGUF base); a .gguf file also the GGUF quantizations (default q8_0).
    #[arg(long, value_enum)]
    pub dtype: Option<MergeDtype>,
}

/// `envace merge --dtype`: the dense types an HF directory stores, and the GGUF quantizations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MergeDtype {
    F32,
    Bf16,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q5_0")]
    Q5_0,
    #[value(name = "q5_1")]
    Q5_1,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q5_k")]
    Q5K,
    #[value(name = "q6_k")]
    Q6K,
}

impl MergeDtype {
    /// The type as a GGUF tensor type.
    pub fn ggml(self) -> candle_core::quantized::GgmlDType {
        use candle_core::quantized::GgmlDType as G;
        match self {
            Self::F32 => G::F32,
            Self::Bf16 => G::BF16,
            Self::F16 => G::F16,
            Self::Q8_0 => G::Q8_0,
            Self::Q4_0 => G::Q4_0,
            Self::Q4_1 => G::Q4_1,
            Self::Q5_0 => G::Q5_0,
            Self::Q5_1 => G::Q5_1,
            Self::Q4K => G::Q4K,
            Self::Q5K => G::Q5K,
            Self::Q6K => G::Q6K,
        }
    }

    /// The type as a dense tensor type (what safetensors in an HF directory hold), if it is one.
    pub fn dense(self) -> Option<candle_core::DType> {
        match self {
            Self::F32 => Some(candle_core::DType::F32),
            Self::Bf16 => Some(candle_core::DType::BF16),
            Self::F16 => Some(candle_core::DType::F16),
            _ => None,
        }
    }
}

/// `envace tui`.
#[derive(Debug, Args, Clone)]
pub struct TuiArgs {
    /// Model directory (HF) or .gguf file.
    #[arg(long, default_value = "models/envace-tiny")]
    pub model: PathBuf,
    /// Built-in domain selected in the Run tab (bank, retail, travel).
    #[arg(long)]
    pub env: Option<String>,
    #[command(flatten)]
    pub mcp: envace::env::cli::McpArgs,
    #[command(flatten)]
    pub headers: envace::env::cli::McpHeaderArgs,
    /// Open this session in the debugger at start.
    #[arg(long)]
    pub session: Option<PathBuf>,
    /// Sessions directory (default: the user's data directory).
    #[arg(long)]
    pub sessions_dir: Option<PathBuf>,
    /// Theme name (dark, light, high-contrast, or one from <config>/themes).
    #[arg(long)]
    pub theme: Option<String>,
    /// auto, cpu, cuda or metal.
    #[arg(long, default_value = "auto")]
    pub device: envace::runtime::DeviceChoice,
}

impl Default for TuiArgs {
    fn default() -> Self {
        Self {
            model: PathBuf::from("models/envace-tiny"),
            env: None,
            mcp: envace::env::cli::McpArgs {
                mcp: None,
                mcp_url: None,
                mcp_env: Vec::new(),
                mcp_cwd: None,
                timeout: 30.0,
            },
            headers: Default::default(),
            session: None,
            sessions_dir: None,
            theme: None,
            device: envace::runtime::DeviceChoice::default(),
        }
    }
}

/// A number of drills per task: finite and ≥ 0 (a fraction is a probability).
fn parse_per_task(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!(
            "`{s}`: expected a number of drills per task ≥ 0, e.g. 0.5"
        )),
    }
}

/// `KIND=W` with W ≥ 0 (`--kind-weight`).
fn parse_kind_weight(s: &str) -> Result<(String, f64), String> {
    let (k, w) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KIND=WEIGHT, e.g. pay_if_enough=3"))?;
    let w: f64 = w
        .parse()
        .map_err(|_| format!("`{s}`: `{w}` is not a number"))?;
    if k.is_empty() || !w.is_finite() || w < 0.0 {
        return Err(format!("`{s}`: expected a kind and a weight ≥ 0"));
    }
    Ok((k.to_string(), w))
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use envace::train::pretrain::PriceStepStyle;

    use super::{Cli, Command};

    fn price_steps(extra: &[&str]) -> Result<Option<PriceStepStyle>, clap::Error> {
        let argv = ["envace", "pretrain", "--out", "m"].iter().chain(extra);
        match Cli::try_parse_from(argv)?.command {
            Some(Command::Pretrain(a)) => Ok(a.price_steps),
            other => panic!("not pretrain: {other:?}"),
        }
    }

    /// `--price-steps` alone is the pairs style (stage 15's commands), a value picks the style,
    /// the flag takes no value from the next flag, and a wrong style is refused naming the values.
    #[test]
    fn price_steps_takes_an_optional_style() {
        assert_eq!(price_steps(&[]).unwrap(), None);
        assert_eq!(
            price_steps(&["--price-steps"]).unwrap(),
            Some(PriceStepStyle::Pairs)
        );
        assert_eq!(
            price_steps(&["--price-steps", "prices"]).unwrap(),
            Some(PriceStepStyle::Prices)
        );
        assert_eq!(
            price_steps(&["--price-steps", "--seed", "3"]).unwrap(),
            Some(PriceStepStyle::Pairs)
        );
        let e = price_steps(&["--price-steps", "cheap"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cheap") && e.contains("prices"), "{e}");
    }
}
