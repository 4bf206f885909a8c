#!/usr/bin/env bash
# Installs the Debian packages dflash needs and builds it into build/.
# Usage: bash scripts/setup.sh [extra cmake options]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config libgtest-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libutf8proc-dev
          libcpp-httplib-dev python3 python3-jinja2)
# Node.js runs the server tests with the official OpenAI client; Debian's when the machine has none.
command -v node > /dev/null && command -v npm > /dev/null || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# The OpenAI Node SDK for the server tests (versions pinned by tests/server/package-lock.json).
npm ci --prefix tests/server --no-audit --no-fund --loglevel=error

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j "$(nproc)"
