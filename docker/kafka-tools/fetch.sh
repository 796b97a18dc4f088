#!/usr/bin/env bash
# Fetches Kafka's command-line tools (TransactionsCommand, for the status page's open Kafka
# transactions) from Maven Central into docker/kafka-tools/target/libs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
libs="$here/target/libs"
if ls "$libs"/kafka-tools-[0-9]*.jar >/dev/null 2>&1; then exit 0; fi
command -v mvn >/dev/null || { echo "oncekit: no Maven: install it (apt-get install maven) to fetch Kafka's tools" >&2; exit 1; }
echo "fetching Kafka's tools from Maven Central"
mvn -q -B -f "$here/pom.xml" package > "$here/target.log" 2>&1 || {
  echo "oncekit: Kafka tools download failed (see docker/kafka-tools/target.log)" >&2; exit 1; }
rm -f "$here/target.log"
