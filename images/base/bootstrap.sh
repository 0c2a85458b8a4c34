#!/usr/bin/env bash
# Build the cyclebox base image without any container registry.
#
# A minimal Debian bookworm root filesystem is bootstrapped from Debian's
# package mirror with debootstrap and imported as a local image. The tag is a
# hash of this script's inputs (the script itself, suite, package list and
# mirror), so an existing tag is reused and an unchanged rebuild does nothing.
#
#   images/base/bootstrap.sh            # prints the image reference on stdout
#   BASE_IMAGE=python:3.11-slim ...     # skip the bootstrap (users with a registry)
#
# Needs root (debootstrap), a running Docker engine and Debian's debootstrap.
set -euo pipefail

if [[ -n "${BASE_IMAGE:-}" ]]; then
    if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "BASE_IMAGE=$BASE_IMAGE is not present locally; pull it first (docker pull $BASE_IMAGE)" >&2
        exit 1
    fi
    echo "$BASE_IMAGE"
    exit 0
fi

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
INCLUDE=python3,python3-venv,git,ca-certificates
here=$(cd "$(dirname "$0")" && pwd)
input_hash=$( { cat "$0"; echo "$SUITE $MIRROR $INCLUDE"; } | sha256sum | cut -c1-16)
tag="cyclebox/base:$input_hash"

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "building the base image needs root for debootstrap; run as root or set BASE_IMAGE=python:3.11-slim" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/cyclebox-rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "bootstrapping $SUITE into $work (about a minute)" >&2
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
# Trim what a runtime image never needs: apt caches, docs, man pages, locales.
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
       "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* "$work"/rootfs/usr/share/info/*
tar --numeric-owner -C "$work/rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "cyclebox base: debootstrap $SUITE minbase + $INCLUDE" - "$tag" >/dev/null
echo "$tag"
