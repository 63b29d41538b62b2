//! `pulsar-host archs`: every plugin found and its status.

use std::process::ExitCode;

use super::Ctx;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct Row {
    name: String,
    version: Option<String>,
    architectures: Vec<String>,
    api: Option<String>,
    status: String,
    reason: Option<String>,
    path: String,
}

pub fn main(ctx: &Ctx, args: Args) -> anyhow::Result<ExitCode> {
    if ctx.print_config {
        eprint!("{}", ctx.cfg.print());
    }
    let reg = ctx.registry();
    let rows: Vec<Row> = reg
        .plugins
        .iter()
        .map(|p| Row {
            name: p.name(),
            version: p.version(),
            architectures: p.architectures(),
            api: p.api_requirement(),
            status: p.status.label().to_string(),
            reason: p.status.reason().map(str::to_string),
            path: p.path.display().to_string(),
        })
        .collect();
    if args.json {
        let searched: Vec<serde_json::Value> =
            reg.searched.iter().map(|(d, e)| serde_json::json!({"dir": d.display().to_string(), "exists": e})).collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"plugins": rows, "searched": searched}))?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!("no plugins found; searched:");
        for (d, e) in &reg.searched {
            println!("  {} {}", d.display(), if *e { "" } else { "(missing)" });
        }
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<16} {:<9} {:<24} {:<8} STATUS", "NAME", "VERSION", "ARCHITECTURES", "API");
    for (r, p) in rows.iter().zip(&reg.plugins) {
        let status = match &r.reason {
            None => r.status.clone(),
            Some(why) => format!("{}: {why} ({})", r.status, r.path),
        };
        println!(
            "{:<16} {:<9} {:<24} {:<8} {status}",
            r.name,
            r.version.as_deref().unwrap_or("-"),
            if r.architectures.is_empty() { "-".into() } else { r.architectures.join(",") },
            r.api.as_deref().unwrap_or("-"),
        );
        if ctx.verbose > 0 {
            if let Some(d) = &p.detail {
                println!("    {}", d.replace('\n', "\n    "));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
