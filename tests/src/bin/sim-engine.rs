//! `sim-engine`: a simulated vLLM server. See `sim-engine --help`.

use clap::Parser;
use testkit::engine::{EngineArgs, serve};

fn main() -> anyhow::Result<()> {
    let args = EngineArgs::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()?
    };
    rt.block_on(serve(args))
}
