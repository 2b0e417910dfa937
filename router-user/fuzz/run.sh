#!/usr/bin/env bash
# Runs every fuzz target of prefix-router for a bounded time (CI's fuzz step).
#
#   router-user/fuzz/run.sh [SECONDS_PER_TARGET]     (default 20)
#
# Installs cargo-fuzz if it is missing and uses the nightly toolchain (cargo-fuzz
# needs -Zsanitizer). Each target starts from its committed seed corpus in
# corpus/<target>/ (new inputs go to a scratch copy, so the tree stays clean).
# Exits non-zero if a target crashes; the crashing input is in
# artifacts/<target>/ and `cargo +nightly fuzz run <target> <file>` replays it.
set -euo pipefail

SECS="${1:-20}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TARGETS=(request_head chunked extract apis)
cd "$HERE"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: installing the nightly toolchain"
    rustup toolchain install nightly --profile minimal
fi

# The fuzz targets do not need the XDP object; skip its nightly eBPF build.
export AYA_BUILD_SKIP=1
# A target dir of its own, so sanitizer builds never invalidate the main ones.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$HERE/target}"

cargo +nightly fuzz build --release

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failed=()
for t in "${TARGETS[@]}"; do
    mkdir -p "$scratch/$t" "artifacts/$t"
    echo "fuzz: $t for ${SECS}s"
    if ! cargo +nightly fuzz run --release "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$SECS" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 2>"$scratch/$t.log"; then
        tail -n 60 "$scratch/$t.log"
        failed+=("$t")
    else
        grep -E "^(stat::number_of_executed_units|Done)" "$scratch/$t.log" || true
    fi
done
if ((${#failed[@]})); then
    echo "fuzz: FAILED: ${failed[*]} (inputs in $HERE/artifacts/)" >&2
    exit 1
fi
echo "fuzz: all targets ran ${SECS}s without a crash"
# A clean CI clone never reuses the sanitizer build: give its disk back.
if [[ -n "${CI:-}" && -z "${FUZZ_TARGET_DIR:-}" ]]; then
    rm -rf "$CARGO_TARGET_DIR"
fi
