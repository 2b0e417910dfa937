//! The timing model: TTFT grows with uncached prompt tokens and with
//! queueing, as on a GPU. Only ratios and lower bounds are asserted (the
//! engine never answers before the simulated time has passed).

use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use testkit::engine_proc::SimEngine;
use testkit::http::request_chunks;

/// Streams a completion of `ids`; returns the time to the first event.
fn ttft(addr: SocketAddr, ids: &[u32], max_tokens: u32) -> Duration {
    let body = json!({"prompt": ids, "max_tokens": max_tokens, "stream": true}).to_string();
    let start = Instant::now();
    let (r, chunks) =
        request_chunks(addr, "POST", "/v1/completions", &[], body.as_bytes()).unwrap();
    assert_eq!(r.status, 200);
    chunks[0].at - start
}

fn ids(first: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| first * 100_000 + i).collect()
}

#[test]
fn ttft_grows_with_uncached_tokens() {
    // 10k tokens/s prefill, 15 ms steps, 10x faster than real time.
    let e = SimEngine::spawn(&["--time-scale", "0.1"]);
    let short = ttft(e.addr, &ids(1, 100), 1); // 15 + 10 ms simulated
    let long = ttft(e.addr, &ids(2, 8000), 1); // 15 + 800 ms simulated
    let cached = ttft(e.addr, &ids(2, 8000), 1); // only the last block computed
    assert!(
        long >= Duration::from_millis(75),
        "long prefill took {long:?}"
    );
    assert!(long > short * 3, "long {long:?} vs short {short:?}");
    assert!(long > cached * 3, "uncached {long:?} vs cached {cached:?}");
}

#[test]
fn ttft_grows_with_queueing() {
    // One sequence at a time: each request waits for the previous ones'
    // 20 decode steps (20 x 15.1 ms simulated, x0.1).
    let e = SimEngine::spawn(&["--time-scale", "0.1", "--max-num-seqs", "1"]);
    let addr = e.addr;
    let handles: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5 * i));
                ttft(addr, &ids(10 + i as u32, 50), 20)
            })
        })
        .collect();
    let mut t: Vec<Duration> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    t.sort();
    assert!(
        t[3] >= Duration::from_millis(60),
        "last in queue waited only {:?}",
        t[3]
    );
    assert!(t[3] > t[0] * 4, "queued TTFTs {t:?}");
    let m = testkit::http::request(addr, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    assert!(
        m.contains("vllm:time_to_first_token_seconds_count{model_name=\"sim-llama-8b\"} 4"),
        "{m}"
    );
}

#[test]
fn tokens_are_streamed_at_decode_step_times() {
    let e = SimEngine::spawn(&[
        "--time-scale",
        "1",
        "--decode-step-ms",
        "25",
        "--prefill-tps",
        "0",
    ]);
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": true});
    let start = Instant::now();
    let (r, chunks) = request_chunks(
        e.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let content: Vec<_> = chunks
        .iter()
        .filter(|c| c.data.windows(9).any(|w| w == b"\"content\""))
        .collect();
    assert!(content.len() >= 6);
    let spread = content.last().unwrap().at - content[0].at;
    assert!(
        spread >= Duration::from_millis(100),
        "6 tokens 25 ms apart arrived within {spread:?}"
    );
    assert!(start.elapsed() >= Duration::from_millis(150));
}

#[test]
fn zero_cost_mode_answers_at_once() {
    let e = SimEngine::spawn(&[
        "--prefill-tps",
        "0",
        "--decode-step-ms",
        "0",
        "--decode-step-per-seq-ms",
        "0",
    ]);
    let start = Instant::now();
    for i in 0..50 {
        assert!(ttft(e.addr, &ids(i, 2000), 100) < Duration::from_secs(1));
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}
