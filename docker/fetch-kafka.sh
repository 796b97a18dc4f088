#!/usr/bin/env bash
# Fetches the official Kafka broker jars from Maven Central into docker/kafka/target/libs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
libs="$here/kafka/target/libs"
if ls "$libs"/kafka_2.13-*.jar >/dev/null 2>&1; then exit 0; fi
command -v java >/dev/null || { echo "oncekit: no Java: install a JRE 17 (apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
command -v mvn >/dev/null || { echo "oncekit: no Maven: install it (apt-get install maven) to fetch the Kafka broker" >&2; exit 1; }
echo "fetching the Kafka broker jars from Maven Central"
mvn -q -B -f "$here/kafka/pom.xml" package > "$here/kafka/target.log" 2>&1 || {
  echo "oncekit: Kafka broker download failed (see docker/kafka/target.log)" >&2; exit 1; }
rm -f "$here/kafka/target.log"
