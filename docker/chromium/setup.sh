#!/usr/bin/env bash
# Debian's chromium for the status page's browser test: Playwright drives /usr/bin/chromium
# (no browser download; 'playwright install' is never run).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "oncekit: no /usr/bin/chromium for the browser test: install it (apt-get install chromium)" >&2
  exit 1
fi
echo "installing chromium from Debian's packages"
apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
