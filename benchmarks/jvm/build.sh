#!/usr/bin/env bash
# Builds a JVM peer of make bench (kafka-streams or flink) with Maven from Maven Central: its
# classes into benchmarks/jvm/<peer>/target/classes, its dependencies into target/libs. Skipped
# when the build is newer than the peer's pom and sources.
set -euo pipefail
peer=${1:?usage: benchmarks/jvm/build.sh kafka-streams|flink}
here=$(cd "$(dirname "$0")" && pwd)
project="$here/$peer"
stamp="$project/target/.built"
if [ -f "$stamp" ] && [ -z "$(find "$project/pom.xml" "$project/src" -newer "$stamp" -print -quit)" ]; then exit 0; fi
command -v mvn >/dev/null || { echo "oncekit: no Maven: install it (apt-get install maven) to build the $peer peer" >&2; exit 1; }
echo "building the $peer peer with Maven" >&2
mvn -q -B -f "$project/pom.xml" package > "$project/target.log" 2>&1 || {
  echo "oncekit: building the $peer peer failed (see benchmarks/jvm/$peer/target.log)" >&2; exit 1; }
rm -f "$project/target.log"
touch "$stamp"
