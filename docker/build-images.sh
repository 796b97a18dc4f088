#!/usr/bin/env bash
# Builds the Kafka and PostgreSQL images locally with Podman, for machines that cannot pull
# images: a Debian root filesystem from debootstrap (from the mirror in the machine's own apt
# sources), a JRE plus the official Kafka broker jars fetched from Maven Central by
# docker/kafka/pom.xml, and PostgreSQL 15 from Debian. Does nothing for an image that exists.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
state="$root/.oncekit"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/podman/containers.conf}"
kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")
# The tag follows what goes into the images, so a changed entrypoint or pom builds anew.
recipe=$(cat "$0" "$here"/kafka/pom.xml "$here"/kafka/entrypoint.sh "$here"/kafka/log4j2.properties \
  "$here"/postgres/entrypoint.sh | sha256sum | cut -c1-10)
kafka_image="localhost/oncekit-kafka:$kafka_version-$recipe"
postgres_image="localhost/oncekit-postgres:15-$recipe"
mkdir -p "$state"
echo "$kafka_image" > "$state/kafka-image"
echo "$postgres_image" > "$state/postgres-image"

if podman image exists "$kafka_image" && podman image exists "$postgres_image"; then
  echo "images present: $kafka_image $postgres_image"
  exit 0
fi

"$here/fetch-kafka.sh"

mirror() {
  # The first Debian (non-security) mirror of the machine's apt sources, deb822 or one-line.
  local m
  m=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$m" ] || { echo "oncekit: image build failed: no Debian mirror in the apt sources" >&2; exit 1; }
  echo "$m"
}

base="$state/build/rootfs"
if [ ! -x "$base/usr/lib/postgresql/15/bin/postgres" ] || [ ! -x "$base/usr/bin/java" ]; then
  rm -rf "$base"; mkdir -p "$base"
  echo "debootstrap: Debian bookworm with a JRE and PostgreSQL 15 (about a minute)"
  debootstrap --variant=minbase --include=openjdk-17-jre-headless,postgresql-15 \
    bookworm "$base" "$(mirror)" > "$state/build/debootstrap.log" 2>&1 || {
      echo "oncekit: image build failed: debootstrap (see $state/build/debootstrap.log)" >&2; exit 1; }
fi
rm -rf "$base/var/lib/postgresql/15" "$base/etc/postgresql/15" "$base/opt/kafka"
mkdir -p "$base/opt/kafka/config" "$base/opt/kafka/libs" "$base/var/lib/kafka/data"
cp "$here"/kafka/target/libs/*.jar "$base/opt/kafka/libs/"
cp "$here/kafka/log4j2.properties" "$base/opt/kafka/config/"
install -m 0755 "$here/kafka/entrypoint.sh" "$base/usr/local/bin/kafka-entrypoint"
install -m 0755 "$here/postgres/entrypoint.sh" "$base/usr/local/bin/postgres-entrypoint"

echo "podman import: oncekit base image"
tar -C "$base" -c . | podman import - localhost/oncekit-base:latest >/dev/null
podman build -q -t "$kafka_image" -f - "$state/build" >/dev/null <<DOCKERFILE
FROM localhost/oncekit-base:latest
EXPOSE 9092
ENTRYPOINT ["/usr/local/bin/kafka-entrypoint"]
DOCKERFILE
podman build -q -t "$postgres_image" -f - "$state/build" >/dev/null <<DOCKERFILE
FROM localhost/oncekit-base:latest
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint"]
CMD ["postgres"]
DOCKERFILE
echo "images built: $kafka_image $postgres_image"
