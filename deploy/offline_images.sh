#!/usr/bin/env bash
# What `make compose-test` needs on a Docker host that reaches Debian's archive and PyPI but no
# container registry: a bookworm base image with Python (instead of python:3.11-slim-bookworm),
# a Redis image on it (instead of redis:7.4-alpine) and a wheel index holding the CPU build of
# torch (instead of download.pytorch.org). Run as root (debootstrap); then export what it prints.
#
#   deploy/offline_images.sh [WORK_DIR]      # default /var/tmp/llmd-offline
set -euo pipefail

WORK_DIR=${1:-/var/tmp/llmd-offline}
ENGINE=${CONTAINER_ENGINE:-docker}
BASE_IMAGE=${BASE_IMAGE:-llmd-base:bookworm}
REDIS_IMAGE=${REDIS_IMAGE:-llmd-redis:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The torch of the Dockerfile, for bookworm's Python 3.11. The CPU build comes only where this
# host's pip finds one (a local wheel through find-links, say); otherwise PyPI's CUDA build
# and its CUDA libraries come, several GB.
TORCH=${TORCH:-torch==2.13.0}

for tool in debootstrap "$ENGINE" python3; do
  command -v "$tool" >/dev/null || { echo "offline_images.sh: '$tool' is not installed" >&2; exit 1; }
done
mkdir -p "$WORK_DIR"

rootfs="$WORK_DIR/rootfs"
if [[ ! -x "$rootfs/usr/bin/python3" ]]; then
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" "$MIRROR"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
fi
# The image trusts what this host trusts: where the registries are reached through a proxy that
# signs with a local CA, pip and apt in the build need it too. pip reads PIP_CERT, not the system store.
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$rootfs" -c . | "$ENGINE" import \
  -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' -c 'CMD ["python3"]' - "$BASE_IMAGE"

# Debian's redis-server starts in protected mode without a config file and would refuse the
# other containers; the official image's entrypoint turns it off the same way.
"$ENGINE" build -t "$REDIS_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" - <<'EOF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
USER redis
ENTRYPOINT ["/bin/sh", "-c", "exec \"$@\" --protected-mode no", "--"]
CMD ["redis-server"]
EOF

# A PEP 503 index is one folder per normalised project name; python's http.server lists each
# folder's wheels as the links pip reads.
wheels="$WORK_DIR/wheels"
python3 -m pip download --quiet --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 --dest "$wheels" "$TORCH"
index="$WORK_DIR/torch-index"
rm -rf "$index"
for wheel in "$wheels"/*.whl; do
  file=$(basename "$wheel")
  project=$(echo "${file%%-*}" | tr 'A-Z_.' 'a-z--')
  mkdir -p "$index/$project"
  ln -f "$wheel" "$index/$project/$file"
done

cat <<EOF
export BASE_IMAGE=$BASE_IMAGE REDIS_IMAGE=$REDIS_IMAGE TORCH_WHEELS=$index
EOF
