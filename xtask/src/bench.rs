//! `cargo xtask bench`: criterion micro-benchmarks of the hot structures,
//! then router overhead against direct and nginx and routing quality, all
//! into one results folder (`results/bench-<unix time>/`: `report.md` and
//! `results.json`), compared with the previous one. The logic is in
//! `benches/src/`. The peer routers (sglang-router, vllm-router, smg) run
//! beside prefix-router's policies: installed into `target/peers-venv` on
//! the first run (pip, from PyPI), the quality runs inside a network
//! namespace with only loopback (root); `--no-peers` leaves them out.

use crate::harness;

#[derive(clap::Args)]
pub struct Args {
    /// Small sizes: seconds instead of minutes (what the smoke test runs).
    #[arg(long)]
    quick: bool,
    /// Skip the criterion micro-benchmarks.
    #[arg(long)]
    skip_micro: bool,
    /// Skip `cargo xtask setup`.
    #[arg(long)]
    no_setup: bool,
    /// Leave the peer routers out (they are installed and run otherwise,
    /// or skipped with a note when that is impossible).
    #[arg(long)]
    no_peers: bool,
    /// More `prefix-bench bench` flags (see `prefix-bench bench --help`),
    /// e.g. `-- --nginx require --baseline results/bench-1/results.json`.
    #[arg(last = true)]
    rest: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.no_setup {
        crate::setup::run()?;
    }
    let bins = harness::build_release()?;
    let mut command = String::from("cargo xtask bench");
    if a.quick {
        command.push_str(" --quick");
    }
    let mut args = vec!["bench".to_string()];
    if !a.skip_micro {
        let (warm, measure) = if a.quick { (0.2, 0.3) } else { (1.0, 3.0) };
        let dir = harness::criterion(warm, measure)?;
        args.push("--criterion-dir".into());
        args.push(dir.display().to_string());
    } else {
        command.push_str(" --skip-micro");
    }
    if a.quick {
        args.push("--quick".into());
    }
    if a.no_peers {
        command.push_str(" --no-peers");
    } else {
        args.push("--peers=auto".into());
    }
    if !a.rest.is_empty() {
        command.push_str(" -- ");
        command.push_str(&a.rest.join(" "));
    }
    args.push("--command".into());
    args.push(command);
    args.extend(a.rest);
    harness::prefix_bench(&bins, &args)
}
