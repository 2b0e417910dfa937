//! Tokenizing off the traffic workers: a few threads of their own, fed
//! through a bounded queue, each request's prompt cut to the token budget
//! first (`keys::cut`), so no worker renders a chat template or runs a
//! model tokenizer, and no prompt costs more than its budget.
//!
//! A worker [`Offload::submit`]s a [`Job`] and waits, without blocking its
//! event loop, on the reading end of a socket pair whose writing end the
//! thread drops when the tokens are in the job's slot (a monoio task can
//! be woken from another thread only through the kernel). When every
//! thread is busy and the queue is full the job is refused at once and the
//! request routes on the approximate index: nothing queues without bound.
//! A worker that stops waiting (`tokenizer_wait_ms`) leaves its job
//! abandoned; a thread skips a job abandoned before it starts.
//!
//! Memory: a job holds its cut prompt (`tokenizer_max_tokens` x 4 bytes)
//! and its tokens; what the tokenizer allocates for it is freed when it
//! ends.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};

use super::keys::{EngineTokens, PromptText, TokenScratch, engine_tokens};
use super::tokenizer::{Choice, ModelTokenizer, TokenPool};
use crate::prompt::extract::Endpoint;

/// Default threads: two, so one long prompt never holds up the rest.
pub const DEFAULT_THREADS: usize = 2;

/// Default jobs waiting for a thread, beyond those running: a burst of
/// ordinary turns (tens of microseconds each) waits a little; past it the
/// approximate index routes.
pub const DEFAULT_QUEUE: usize = 16;

/// Default longest wait of a request for its tokens, in milliseconds: a
/// cold 64 KiB prompt takes about 30 ms, an ordinary turn well under one.
pub const DEFAULT_WAIT_MS: u64 = 50;

/// One request's tokenizing.
pub struct Job {
    pub tokenizer: Arc<ModelTokenizer>,
    pub endpoint: Endpoint,
    /// The canonical prompt, cut (`keys::cut`) when `cut`.
    pub canonical: Vec<u8>,
    pub cut: bool,
}

/// Where a job's tokens are left.
#[derive(Default)]
struct Slot {
    /// `Some(None)`: done, no tokens (the tokenizer failed).
    result: Mutex<Option<Option<EngineTokens>>>,
    /// The worker stopped waiting.
    abandoned: AtomicBool,
}

/// A job handed to the threads: the worker's end of its socket pair, and
/// its slot.
pub struct Pending {
    /// Reads end of stream once the job is done (or dropped).
    pub done: Option<UnixStream>,
    slot: Arc<Slot>,
}

impl Pending {
    /// The job's tokens: `None` while it is not done; `Some(None)` when it
    /// gave none.
    pub fn take(&self) -> Option<Option<EngineTokens>> {
        self.slot
            .result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.slot.abandoned.store(true, Relaxed);
    }
}

struct Queued {
    job: Job,
    slot: Arc<Slot>,
    /// Dropped when the job is done: the worker's read ends.
    _done: UnixStream,
}

/// Counters of the tokenizing threads (in `/metrics`).
#[derive(Default, Debug)]
pub struct OffloadStats {
    /// Jobs taken.
    pub submitted: AtomicU64,
    /// Jobs refused, every thread busy and the queue full: routed on the
    /// approximate index.
    pub busy: AtomicU64,
    /// Requests that stopped waiting before their tokens came
    /// (`tokenizer_wait_ms`): routed on the approximate index.
    pub late: AtomicU64,
    /// Jobs skipped, their request gone before a thread took them.
    pub abandoned: AtomicU64,
    /// Prompts cut to the token budget.
    pub cut: AtomicU64,
}

/// The tokenizing threads (none when no model tokenizer is loaded).
pub struct Offload {
    queue: Option<SyncSender<Queued>>,
    pub stats: Arc<OffloadStats>,
    pub threads: usize,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Offload {
    /// No threads: every job is refused.
    pub fn none() -> Offload {
        Offload {
            queue: None,
            stats: Arc::default(),
            threads: 0,
        }
    }

    /// `threads` threads (at least one) taking jobs from a queue of `queue`,
    /// their tokens at most `max_tokens`, pieces cached in `pool`. The
    /// threads end when the `Offload` is dropped.
    pub fn start(threads: usize, queue: usize, pool: Arc<TokenPool>, max_tokens: usize) -> Offload {
        let (tx, rx) = sync_channel::<Queued>(queue);
        let rx = Arc::new(Mutex::new(rx));
        let stats = Arc::new(OffloadStats::default());
        let mut started = 0;
        for i in 0..threads.max(1) {
            let (rx, pool, stats) = (rx.clone(), pool.clone(), stats.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("precise-tok-{i}"))
                .spawn(move || run(&rx, &pool, max_tokens, &stats));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "precise mode: a tokenizing thread did not start")
                }
            }
        }
        Offload {
            queue: (started > 0).then_some(tx),
            stats,
            threads: started,
        }
    }

    /// Hands `job` to the threads; `None` (counted) when they are all busy
    /// and the queue is full, or there are none.
    pub fn submit(&self, job: Job) -> Option<Pending> {
        let queue = self.queue.as_ref()?;
        let (ours, theirs) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "precise mode: no socket pair for a tokenizing job");
                self.stats.busy.fetch_add(1, Relaxed);
                return None;
            }
        };
        let slot = Arc::new(Slot::default());
        if job.cut {
            self.stats.cut.fetch_add(1, Relaxed);
        }
        let queued = Queued {
            job,
            slot: slot.clone(),
            _done: theirs,
        };
        match queue.try_send(queued) {
            Ok(()) => {
                self.stats.submitted.fetch_add(1, Relaxed);
                Some(Pending {
                    done: Some(ours),
                    slot,
                })
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.busy.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// Counts a request that stopped waiting.
    pub fn late(&self) {
        self.stats.late.fetch_add(1, Relaxed);
    }
}

/// One thread: takes jobs until the queue's sender is dropped.
fn run(rx: &Mutex<Receiver<Queued>>, pool: &TokenPool, max_tokens: usize, stats: &OffloadStats) {
    let mut scratch = TokenScratch::default();
    loop {
        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok(q) = next else {
            return;
        };
        if q.slot.abandoned.load(Relaxed) {
            stats.abandoned.fetch_add(1, Relaxed);
            continue;
        }
        let tokens = tokenize(&q.job, pool, max_tokens, &mut scratch);
        *q.slot.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(tokens);
        // `q._done` drops here: the worker's read returns.
    }
}

/// The tokens of one job, at most `max_tokens`.
pub fn tokenize(
    job: &Job,
    pool: &TokenPool,
    max_tokens: usize,
    scratch: &mut TokenScratch,
) -> Option<EngineTokens> {
    let prompt = PromptText {
        endpoint: job.endpoint,
        canonical: &job.canonical,
        token_ids: false,
        cut: job.cut,
    };
    let mut tokens = Vec::new();
    let choice = Choice::Model(job.tokenizer.clone());
    if !engine_tokens(&choice, pool, &prompt, scratch, &mut tokens) {
        return None;
    }
    let mut covered = job.canonical.len();
    let mut cut = job.cut;
    if tokens.len() > max_tokens {
        // Denser text than the cut assumed: the budget ends it, at about
        // its share of the text.
        covered = (covered as u64 * max_tokens as u64 / tokens.len() as u64) as usize;
        tokens.truncate(max_tokens);
        cut = true;
    }
    Some(EngineTokens {
        tokens,
        covered,
        cut,
    })
}
