//! Benchmark harness for prefix-router.
