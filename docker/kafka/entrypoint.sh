#!/bin/sh
# Broker entrypoint of the locally built image. Like the official apache/kafka image, every
# KAFKA_* environment variable becomes a server property: KAFKA_LOG_DIRS -> log.dirs
# ("___" stands for "-", "__" for "_"), so the same container settings work with both images.
set -eu
conf=/opt/kafka/config/server.properties
: > "$conf"
env | while IFS='=' read -r name value; do
  case "$name" in
    KAFKA_HEAP_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_OPTS) ;;
    KAFKA_*)
      key=$(printf '%s' "${name#KAFKA_}" | tr 'A-Z' 'a-z' | sed -e 's/___/-/g' -e 's/__/#/g' -e 's/_/./g' -e 's/#/_/g')
      printf '%s=%s\n' "$key" "$value" >> "$conf" ;;
  esac
done
grep -q '^log.dirs=' "$conf" || echo "log.dirs=/var/lib/kafka/data" >> "$conf"
log_dir=$(sed -n 's/^log.dirs=//p' "$conf" | cut -d, -f1)
cp_libs='/opt/kafka/libs/*'
if [ ! -f "$log_dir/meta.properties" ]; then
  java -cp "$cp_libs" kafka.tools.StorageTool format --ignore-formatted \
    -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$conf"
fi
# KAFKA_HEAP_OPTS and KAFKA_JVM_PERFORMANCE_OPTS as Kafka's own start scripts read them.
exec java ${KAFKA_HEAP_OPTS:--Xmx512m} ${KAFKA_JVM_PERFORMANCE_OPTS:-} -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp "$cp_libs" kafka.Kafka "$conf"
