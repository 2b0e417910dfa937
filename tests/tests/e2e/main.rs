//! The end-to-end tests in one binary (one link instead of one per file):
//! real processes, real sockets, one module per surface. cargo-nextest
//! runs each test in a process of its own (`.config/nextest.toml`).

mod engine_api;
mod engine_apis;
mod engine_cache;
mod engine_faults;
mod engine_llamacpp;
mod engine_peer_api;
mod engine_timing;
mod precise_events;
mod precise_tokenizer;
mod router_apis;
mod router_classes;
mod router_classes_callers;
mod router_discovery;
mod router_ebpf_load;
mod router_engine_priority;
mod router_epp;
mod router_faults;
mod router_feedback;
mod router_fleet;
mod router_hardening;
mod router_hardening_control;
mod router_hardening_precise;
mod router_http;
mod router_limits;
mod router_load;
mod router_models;
mod router_ops;
mod router_replicas;
mod router_routing;
mod router_smuggling;
mod router_tls;
mod router_tls_rotation;
mod workload_chat;
