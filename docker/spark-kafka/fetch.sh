#!/usr/bin/env bash
# Fetches Spark's Kafka connector for a Spark version (pass pyspark.__version__) from Maven
# Central into docker/spark-kafka/target/<version>/ and prints that folder.
# Where Maven Central has no connector of exactly that version, the newest release it had when
# this was written (SPARK_KAFKA_FALLBACK, default below) is taken instead: its jar's name says
# which, and the benchmark tables show it. A Maven version range cannot do this: resolving one
# reads the pom of every version in it, and Spark's parent pom names a mirror unreachable here.
set -euo pipefail
version=${1:?usage: docker/spark-kafka/fetch.sh <spark version, e.g. 4.3.0>}
fallback=${SPARK_KAFKA_FALLBACK:-4.2.0}
here=$(cd "$(dirname "$0")" && pwd)
libs="$here/target/$version"
log="$here/target.log"

fetch() {  # $1: the connector's version
  mvn -q -B -f "$here/pom.xml" -Dspark.version="$1" -Dlibs="$libs" package > "$log" 2>&1
}

if ! ls "$libs"/spark-sql-kafka-0-10_2.13-*.jar >/dev/null 2>&1; then
  command -v mvn >/dev/null || { echo "oncekit: no Maven: install it (apt-get install maven) to fetch Spark's Kafka connector" >&2; exit 1; }
  echo "fetching spark-sql-kafka-0-10_2.13 $version from Maven Central" >&2
  if ! fetch "$version"; then
    if [ "$version" = "$fallback" ] || ! grep -q "spark-sql-kafka-0-10_2.13:jar:$version" "$log"; then
      echo "oncekit: Spark Kafka connector download failed (see docker/spark-kafka/target.log)" >&2; exit 1
    fi
    echo "oncekit: Maven Central has no spark-sql-kafka-0-10_2.13 $version; taking $fallback" >&2
    fetch "$fallback" || { echo "oncekit: Spark Kafka connector download failed (see docker/spark-kafka/target.log)" >&2; exit 1; }
  fi
  rm -f "$log"
fi
echo "$libs"
