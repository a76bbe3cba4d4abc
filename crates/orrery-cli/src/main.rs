//! The `orrery` command-line tool. The only crate that prints.
use anyhow::Result;
use clap::{Parser, Subcommand};
use orrery_spec::{load_job_spec, preset_job_text, presets, Job};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "orrery",
    version,
    about = "Predict, emulate and optimize LLM training at scale"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Predict one training step: time, MFU, breakdown, per-stage memory.
    Predict(PredictArgs),
    /// Predict every published measurement in the validation set and print the errors.
    Validate,
}

#[derive(clap::Args, Debug)]
struct PredictArgs {
    /// A job TOML file; without it a built-in job runs (see --preset).
    job: Option<std::path::PathBuf>,
    #[arg(long)]
    preset: Option<String>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Predict(a) => {
            let text = match &a.job {
                Some(p) => std::fs::read_to_string(p)?,
                None => preset_job_text(a.preset.as_deref().unwrap_or(presets::DEFAULT_JOB))?
                    .to_string(),
            };
            let spec = load_job_spec(&text, &a.set)?;
            let job = match Job::from_spec(&spec) {
                Ok(j) => j,
                Err(e) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            let t = std::time::Instant::now();
            let out = orrery_predict::predict(&job)?;
            let p = &out.prediction;
            if a.json {
                println!("{}", serde_json::to_string_pretty(p)?);
            } else {
                println!(
                    "{} step {} mfu {:.3} tflops {:.1}",
                    p.job, p.step_time, p.mfu, p.tflops_per_gpu
                );
                println!("{:#?}", p.breakdown);
                for m in &p.memory {
                    println!(
                        "stage {} peak {} usable {} fits {}",
                        m.stage, m.peak, m.usable, m.fits
                    );
                }
                println!(
                    "ops {} events {} wall {:?}",
                    p.graph_ops,
                    p.replay_events,
                    t.elapsed()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Validate => {
            let r = orrery_predict::validation::validate(|_, _| {})?;
            for c in &r.step_times {
                println!(
                    "{:28} {:6} {:10} meas {:7.2} pred {:7.2} err {:+6.1}% mfu {:.3}",
                    c.source,
                    c.model,
                    c.recompute,
                    c.measured_s,
                    c.predicted_s,
                    c.error * 100.0,
                    c.predicted_mfu
                );
            }
            println!(
                "MAPE {:.1}%  memory max err {:.2}%",
                r.step_time_mape * 100.0,
                r.memory_max_error * 100.0
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
