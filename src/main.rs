//! The `idemproxy` binary: argument parsing, logging setup and exit codes only; every
//! command is a function of [`idemproxy::app`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// mimalloc instead of glibc malloc: hyper, http and tokio allocate and free small buffers
/// on every request on each worker thread. With 1,000 connections glibc's per-thread arenas
/// peaked at 89 MiB where mimalloc (built without transparent huge pages) stays lower, and
/// allocation was about a tenth of the pass-through profile (docs/PERFORMANCE.md).
/// mimalloc's v2 line (the `v2` feature), not the crate's default v3: under v3 a replay
/// spent 7.7% of the proxy's CPU in the allocator, most of it taking fresh pages and
/// reading the clock, and 2.0% under v2 (docs/PERFORMANCE.md, "Threads and build").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod demo;
use idemproxy::config::{Config, StoreBackend, DEFAULT_PATH};
use idemproxy::policy::state::State;

#[derive(Parser)]
#[command(
    name = "idemproxy",
    version,
    about = "Forward idempotency proxy for AI agents calling real APIs"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "IDEMPROXY_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, default_value = DEFAULT_PATH)]
        config: PathBuf,
        /// Allow creating a new redb store in place of an empty (0-byte) store file, which
        /// is otherwise refused: a store that existed must never silently start over.
        #[arg(long)]
        init_store: bool,
    },
    /// Validate a config and print the route table (exit 0 valid, 2 invalid).
    Check {
        #[arg(long, default_value = DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Inspect stored executions.
    Records {
        #[arg(long, default_value = DEFAULT_PATH, global = true)]
        config: PathBuf,
        #[command(subcommand)]
        command: RecordsCommand,
    },
    /// Operator decision for an `outcome_unknown` record.
    Resolve {
        id: String,
        #[arg(long = "as", value_enum)]
        outcome: Outcome,
        /// JSON file with the result to store when resolving as committed:
        /// {"status":200,"headers":[["content-type","application/json"]],"body":{...}}.
        #[arg(long)]
        result: Option<PathBuf>,
        #[arg(long, default_value = DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Self-contained demo: proxy + fake downstream + a retrying client through two crashes.
    Demo,
    /// Remove records past retention.
    Gc {
        #[arg(long, default_value = DEFAULT_PATH)]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum RecordsCommand {
    List {
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    Show {
        id: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Outcome {
    Committed,
    NotCommitted,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` and `demo` narrate at info; the one-shot commands print their answer on
    // stdout and log only warnings, so the two never interleave on a terminal.
    let quiet = !matches!(cli.command, Command::Serve { .. } | Command::Demo);
    init_logging(cli.log_format, if quiet { "warn" } else { "info" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(cli.command))
}

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("{e}");
        if !path.exists() {
            let cwd = std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|_| ".".into());
            eprintln!(
                "hint: idemproxy read the config from {} (relative to {cwd}); pass \
                 `--config PATH` to name another file, or run it from the repository, \
                 whose config/idemproxy.yaml is the default",
                path.display()
            );
        }
        ExitCode::from(2)
    })
}

/// Print to stdout; a reader that went away (`idemproxy records show ID | head`) ends the
/// output quietly instead of panicking, as `println!` would.
fn out(text: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_fmt(text)
        .and_then(|()| stdout.write_all(b"\n"));
}

async fn run(cmd: Command) -> ExitCode {
    let result = match cmd {
        Command::Check { config } => {
            return match load(&config) {
                Ok(cfg) => {
                    out(format_args!("{}", cfg.describe().trim_end()));
                    out(format_args!("{}: ok", config.display()));
                    ExitCode::SUCCESS
                }
                Err(code) => code,
            };
        }
        Command::Serve { config, init_store } => match load(&config) {
            Ok(cfg) => {
                idemproxy::app::serve_with(cfg, idemproxy::app::ServeOptions { init_store }).await
            }
            Err(code) => return code,
        },
        Command::Records { config, command } => {
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            match command {
                RecordsCommand::List { status, limit } => {
                    let status = match status.map(|s| s.parse::<State>()).transpose() {
                        Ok(s) => s,
                        Err(e) => {
                            eprintln!("error: --status: {e}");
                            return ExitCode::from(2);
                        }
                    };
                    idemproxy::app::records_list(&cfg, status, limit)
                        .await
                        .map(|records| print_records(&records))
                }
                RecordsCommand::Show { id } => {
                    // What the admin API shows: the stored answer decoded (JSON as
                    // JSON, text as text, anything else base64), not raw byte arrays.
                    idemproxy::app::records_show(&cfg, &id).await.and_then(|r| {
                        let view = idemproxy::admin::view::Detail::of(&r);
                        out(format_args!("{}", serde_json::to_string_pretty(&view)?));
                        Ok(())
                    })
                }
            }
        }
        Command::Resolve {
            id,
            outcome,
            result,
            config,
        } => {
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let stored = match result.map(|p| read_result(&p)).transpose() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: --result: {e}");
                    return ExitCode::from(2);
                }
            };
            async {
                let store = idemproxy::app::open_store(&cfg).await?;
                // What `serve` does on start: a redb file we could open has no running
                // owner, so its `executing` records are stale; a shared store only
                // gives up expired leases. Either way they become `outcome_unknown`.
                let exclusive = matches!(cfg.store.backend, StoreBackend::Redb { .. });
                let before = if exclusive {
                    i64::MAX
                } else {
                    idemproxy::store::now_ms()
                };
                let moved =
                    idemproxy::proxy::recovery::recover_stale(store.as_ref(), before).await?;
                if moved > 0 {
                    eprintln!("{moved} execution(s) left executing by a stopped proxy are now outcome_unknown");
                }
                let by = std::env::var("USER").unwrap_or_else(|_| "operator".into());
                let r = idemproxy::app::resolve(
                    store.as_ref(),
                    &id,
                    matches!(outcome, Outcome::Committed),
                    stored,
                    &format!("cli:{by}"),
                )
                .await?;
                out(format_args!("{} is now {}", r.id, r.state()));
                Ok(())
            }
            .await
        }
        Command::Demo => demo::run().await,
        Command::Gc { config } => match load(&config) {
            Ok(cfg) => idemproxy::app::gc(&cfg)
                .await
                .map(|n| out(format_args!("removed {n} records past retention"))),
            Err(code) => return code,
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // redb allows one process per file: the running proxy has it.
            if format!("{e:#}").contains("already open") {
                eprintln!(
                    "hint: a running idemproxy holds this store; ask it through its admin API \
                     (GET /v1/executions, POST /v1/executions/ID/resolve; docs/OPERATIONS.md), \
                     or stop it first"
                );
            }
            // A missing or unusable admin token is a configuration error, like a bad file.
            if e.downcast_ref::<idemproxy::admin::TokenError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// `records list`: one row per record, each column as wide as its widest value.
fn print_records(records: &[idemproxy::store::Record]) {
    let rows: Vec<[String; 5]> = records
        .iter()
        .map(|r| {
            [
                r.id.to_string(),
                r.state().to_string(),
                format!("{}/{}", r.upstream, r.route),
                r.attempts.to_string(),
                r.response
                    .as_ref()
                    .map(|s| s.status.to_string())
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let header = ["EXECUTION_ID", "STATE", "UPSTREAM/ROUTE", "TRY", "STATUS"].map(String::from);
    let mut width = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        out(format_args!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {:>w4$}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            w0 = width[0],
            w1 = width[1],
            w2 = width[2],
            w3 = width[3],
            w4 = width[4],
        ));
    }
}

/// `--result` file: status, headers as pairs, body as any JSON value (stored as its text);
/// the same shape as the admin API's `result`.
fn read_result(path: &std::path::Path) -> anyhow::Result<idemproxy::store::StoredResponse> {
    let text = std::fs::read_to_string(path)?;
    let spec: idemproxy::admin::actions::ResultSpec = serde_json::from_str(&text)?;
    spec.into_stored().map_err(anyhow::Error::msg)
}

fn init_logging(format: LogFormat, default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("IDEMPROXY_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // Colours only for a person at a terminal: a log file or a pipe gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
