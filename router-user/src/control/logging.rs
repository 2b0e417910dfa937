//! Logs with `tracing`: the level from the config unless `RUST_LOG` is set,
//! text or one JSON object per line.

use tracing_subscriber::EnvFilter;

use crate::config::Log;

pub fn init(cfg: &Log) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let res = if cfg.json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if let Err(e) = res {
        eprintln!("logging already initialised: {e}");
    }
}
