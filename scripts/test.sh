#!/usr/bin/env bash
# The project's test command (README "Quick start"; CI calls it through .ci/run).
# Sets up what the tests need on a fresh machine (Debian's Chromium and the pinned
# playwright-core driver for the console test, a Python venv with the pinned webhook
# reference libraries of tests/requirements.txt, the pinned MCP Python and TypeScript SDKs
# for tests/mcp.rs), then the lint gates, then every test:
# unit, integration (real binary, real redb, SIGKILL), PostgreSQL store tests against the
# real server, the crash matrix (failpoints feature) and the console in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  echo "[test] installing Debian's chromium for the console test" >&2
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium
fi
if ! command -v faketime >/dev/null 2>&1; then
  # tests/pg_faults.rs runs proxy instances with skewed wall clocks under libfaketime.
  echo "[test] installing Debian's faketime for the clock-skew test" >&2
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends faketime
fi
if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
  # tests/webhooks.rs signs deliveries with the providers' reference libraries (PyPI).
  echo "[test] installing Debian's python3 and python3-venv for the webhook signature tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends python3 python3-venv
fi
# Pinned Python test dependencies (tests/requirements.txt) in a venv of their own.
if [ ! -x target/test-venv/bin/python ]; then
  python3 -m venv target/test-venv
fi
target/test-venv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
export IDEMPROXY_TEST_PYTHON="$PWD/target/test-venv/bin/python"
# tests/mcp.rs runs the official MCP Python SDK (server and client) from this venv; the
# stamp makes a changed pin reinstall.
MCP_VENV=target/mcp-venv
if ! cmp -s fixtures/mcp/requirements.txt "$MCP_VENV/.requirements" 2>/dev/null; then
  echo "[test] installing the pinned MCP Python SDK into $MCP_VENV" >&2
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends python3 python3-venv
  fi
  rm -rf "$MCP_VENV"
  python3 -m venv "$MCP_VENV"
  "$MCP_VENV/bin/pip" install -q --disable-pip-version-check -r fixtures/mcp/requirements.txt
  cp fixtures/mcp/requirements.txt "$MCP_VENV/.requirements"
fi
if [ ! -d fixtures/mcp/ts/node_modules ]; then
  (cd fixtures/mcp/ts && npm ci --no-audit --no-fund --silent)
fi
if [ ! -d tests/browser/node_modules ]; then
  (cd tests/browser && npm ci --no-audit --no-fund --silent)
fi

# PostgreSQL store tests read this; on the dev/CI machine PostgreSQL runs locally with
# trust auth. Tests fail loudly (never skip) when the server is unreachable.
export IDEMPROXY_TEST_POSTGRES_URL="${IDEMPROXY_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"

cargo fmt --check
cargo clippy --all-targets --all-features -- -D warnings
# One build with the failpoints feature runs every suite, the crash matrix included.
# Failpoints only act when IDEMPROXY_FAILPOINT is set by a test.
cargo test --all-features -- --test-threads="${IDEMPROXY_TEST_THREADS:-4}"
