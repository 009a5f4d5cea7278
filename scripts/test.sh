#!/usr/bin/env bash
# The project's test command (README "Quick start"; CI calls it through .ci/run).
# Lint gates first, then every test: unit, integration (real binary, real redb, SIGKILL),
# PostgreSQL store tests against the real server, the crash matrix (failpoints feature).
set -euo pipefail
cd "$(dirname "$0")/.."

# PostgreSQL store tests read this; on the dev/CI machine PostgreSQL runs locally with
# trust auth. Tests fail loudly (never skip) when the server is unreachable.
export IDEMPROXY_TEST_POSTGRES_URL="${IDEMPROXY_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"

cargo fmt --check
cargo clippy --all-targets --all-features -- -D warnings
# One build with the failpoints feature runs every suite, the crash matrix included.
# Failpoints only act when IDEMPROXY_FAILPOINT is set by a test.
cargo test --all-features -- --test-threads="${IDEMPROXY_TEST_THREADS:-4}"
