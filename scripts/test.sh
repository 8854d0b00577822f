#!/usr/bin/env bash
# Installs what the tests need (Debian packages listed in .ci/apt/*.txt, Python
# packages in .ci/pip.txt, cargo subcommands in .ci/cargo.txt), then runs
# every test of the workspace. Safe to run again: installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_root() { [ "$(id -u)" = 0 ] || { echo "scripts/test.sh: installing $1 needs root" >&2; exit 1; }; }

pkgs=$(cat .ci/apt/*.txt 2>/dev/null | sed 's/#.*//' | tr -s ' \t' '\n' | sed '/^$/d' | sort -u)
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  need_root "Debian packages:$missing"
  echo "== installing Debian packages:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

if [ -s .ci/pip.txt ]; then
  pip_missing=""
  for p in $(sed 's/#.*//' .ci/pip.txt); do
    python3 -c "import importlib.metadata as m; m.version('$p')" 2>/dev/null || pip_missing="$pip_missing $p"
  done
  if [ -n "$pip_missing" ]; then
    echo "== installing Python packages:$pip_missing"
    # Debian's python3 is "externally managed" (PEP 668): a CI machine is
    # ours to change, so pip may install next to the system packages.
    python3 -m pip install -q $pip_missing 2>/dev/null ||
      python3 -m pip install -q --break-system-packages $pip_missing
  fi
fi

command -v cargo >/dev/null || { echo "scripts/test.sh: needs a stable Rust toolchain (cargo) on PATH" >&2; exit 1; }

# Cargo subcommands (.ci/cargo.txt), e.g. cargo-deb for the package test.
for t in $(sed 's/#.*//' .ci/cargo.txt 2>/dev/null); do
  if ! cargo "${t#cargo-}" --version >/dev/null 2>&1; then
    echo "== installing $t (cargo install --locked)"
    cargo install --locked -q "$t"
  fi
done

# Under CI=true (.ci/run sets it) a test that finds a peer missing fails
# instead of printing SKIPPED: and passing (testkit::missing).
echo "== cargo test --workspace${CI:+ (CI=$CI)}"
cargo test --workspace --no-fail-fast "$@"
