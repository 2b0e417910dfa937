//! Layouts shared by `router-ebpf` (the XDP program) and `router-user`.
#![no_std]
