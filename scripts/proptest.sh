#!/usr/bin/env bash
# The property tests at length (CI runs a few dozen or hundred cases of each): `wire::h1`'s
# answer parsing and chunk decoding against hyper's client, and the fast path's answer
# heads parsed back. PROPTEST_CASES overrides the count.
set -euo pipefail
cd "$(dirname "$0")/.."
PROPTEST_CASES="${PROPTEST_CASES:-20000}" cargo test --all-features --lib -- \
  wire::h1::tests::answers_are_read_as_hyper_reads_them \
  wire::fast::tests::written_heads_parse_back_with_one_framing "$@"
