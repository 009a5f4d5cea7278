#!/usr/bin/env bash
# The property tests at length (CI runs a few dozen cases of each): `wire::h1`'s answer
# parsing and chunk decoding against hyper's client. PROPTEST_CASES overrides the count.
set -euo pipefail
cd "$(dirname "$0")/.."
PROPTEST_CASES="${PROPTEST_CASES:-20000}" cargo test --all-features --lib -- \
  wire::h1::tests::answers_are_read_as_hyper_reads_them "$@"
