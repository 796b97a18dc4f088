#!/usr/bin/env bash
# Makes a Docker-compatible container engine answer for testcontainers, and writes the
# environment that points at it to .oncekit/engine.env (sourced by the Makefile).
#
# - A Docker engine that answers is used as it is, with the official images.
# - Otherwise Podman (Debian's package) serves the Docker API on a project-local socket, and
#   docker/build-images.sh builds the Kafka and PostgreSQL images locally, since this kind of
#   machine can pull no image.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
state="$root/.oncekit"
mkdir -p "$state"
env_file="$state/engine.env"

if docker info >/dev/null 2>&1; then
  echo "# a Docker engine answers; official images are pulled by testcontainers" > "$env_file"
  echo "container engine: docker"
  exit 0
fi

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "oncekit: no container engine: install podman, runc and debootstrap (apt-get install podman runc debootstrap)" >&2
    exit 1
  fi
  echo "installing podman, runc, debootstrap from Debian's packages"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
fi

export CONTAINERS_CONF="$root/docker/podman/containers.conf"
sock="$state/podman.sock"
if ! curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
  rm -f "$sock"
  nohup podman system service --time=0 "unix://$sock" > "$state/podman-service.log" 2>&1 &
  for _ in $(seq 1 100); do
    curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 || {
    echo "oncekit: podman system service did not answer on $sock (see $state/podman-service.log)" >&2
    exit 1
  }
fi

"$root/docker/build-images.sh"

cat > "$env_file" <<ENV
export CONTAINERS_CONF=$root/docker/podman/containers.conf
export DOCKER_HOST=unix://$sock
export TESTCONTAINERS_RYUK_DISABLED=true
export TESTCONTAINERS_CONNECTION_MODE=docker_host
export TESTCONTAINERS_HOST_OVERRIDE=127.0.0.1
export ONCEKIT_KAFKA_IMAGE=$(cat "$state/kafka-image")
export ONCEKIT_POSTGRES_IMAGE=$(cat "$state/postgres-image")
ENV
echo "container engine: podman at $sock"
