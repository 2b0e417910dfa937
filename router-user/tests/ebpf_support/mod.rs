//! Shared by the `ebpf_*` tests: when privileged tests run, skip or fail.

#![allow(dead_code)]

use prefix_router::control::ebpf;

/// True when the test may go on. Not root, or no eBPF object in this build:
/// prints why and skips outside CI, but FAILS when `CI` is set, so CI cannot
/// pass by silently skipping.
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: CI is set but this process is not root; CI runs privileged tests as root"
        );
        eprintln!("skipping {test}: needs root to load XDP (CI runs it as root)");
        return false;
    }
    if !ebpf::has_object() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: CI is set but this build has no eBPF object; \
             run `cargo xtask setup` (bpf-linker, nightly rust-src) and rebuild"
        );
        eprintln!("skipping {test}: this build has no eBPF object (run `cargo xtask setup`)");
        return false;
    }
    true
}
