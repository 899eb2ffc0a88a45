#!/usr/bin/env bash
# Build and run the repository's Dockerfile with podman on a machine without an image registry
# (what `make image` and tests/test_image.py use). Everything specific to this kind of host lives here,
# never in the Dockerfile:
#   - the base image is a local Debian (mmdebstrap + `podman import`) passed as BASE_IMAGE;
#   - pip inside the build uses the host's pip configuration, the local package folders it names and the CA
#     bundle, mounted read-only into the RUN steps (the image keeps none of them);
#   - podman runs with runc, cgroupfs and no default ulimits (crun and the default RLIMIT_NOFILE fail here);
#   - podman's storage (base, layers, volumes) lives in $HFSDP_IMAGE_CACHE (default $HFSDP_CACHE_DIR/image): a
#     kept cache makes a rebuild redo only the layers whose inputs changed, on any machine.
#
#   scripts/image.sh build            build localhost/hfsdp:local, print build time and image size
#   scripts/image.sh podman ARGS...   podman with the same settings and storage, e.g.
#                                     `scripts/image.sh podman run --rm localhost/hfsdp:local hfsdp --version`
#
# Needs root and the Debian packages podman, buildah, runc, mmdebstrap.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE="localhost/hfsdp:local"
BASE="localhost/hfsdp-base:bookworm"
CACHE="${HFSDP_IMAGE_CACHE:-${HFSDP_CACHE_DIR:-$HOME/.cache/hfsdp}/image}"
# Run-time state (locks, mount counts) stays on this machine, one folder per storage.
RUNROOT="/run/hfsdp-image/$(printf '%s' "$CACHE" | sha256sum | cut -c1-16)"

podman_() {
    local rc=0
    mkdir -p "$CACHE"
    printf '[containers]\ndefault_ulimits = []\n' > "$CACHE/containers.conf"
    CONTAINERS_CONF="$CACHE/containers.conf" podman --root "$CACHE/storage" --runroot "$RUNROOT" \
        --tmpdir "$RUNROOT/libpod" --runtime runc --cgroup-manager cgroupfs "$@" || rc=$?
    # podman leaves its overlay folder bind-mounted; release it so that the cache folder can be deleted
    # (best effort: a container's cleanup process may have released it already).
    umount "$CACHE/storage/overlay" 2> /dev/null || true
    return $rc
}

# `-v SRC:SRC:ro` for every pip configuration file that exists and every local path its settings name
# (find-links and file:// index folders, constraint files, the CA bundle's folder).
pip_mounts() {
    python3 - <<'EOF'
import os, re, subprocess, sys
from urllib.parse import urlparse

def pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=True).stdout

paths = set()
for line in pip("config", "debug").splitlines():
    m = re.match(r"\s+(/\S+), exists: True$", line)
    if m:
        paths.add(m.group(1))
for line in pip("config", "list").splitlines():
    key, _, value = line.partition("=")
    for item in value.strip("'\"").split():
        path = urlparse(item).path if item.startswith("file:") else item
        if not os.path.isabs(path) or not os.path.exists(path):
            continue
        if key.endswith(".cert"):
            path = os.path.dirname(path)
        elif "index-url" in key:
            path = os.path.dirname(path.rstrip("/"))  # file:///opt/pypi/simple -> /opt/pypi
        paths.add(path)
for path in sorted(paths):
    print(f"-v={path}:{path}:ro")
EOF
}

base_image() {
    local tar="$CACHE/base-rootfs.tar"
    if podman_ image exists "$BASE"; then
        return
    fi
    echo "making the Debian base $BASE with mmdebstrap (once per cache)"
    mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$tar"
    podman_ import --quiet "$tar" "$BASE" > /dev/null
    rm "$tar"
}

build() {
    local start seconds size
    base_image
    start=$SECONDS
    # shellcheck disable=SC2046  # one word per mount
    podman_ build --format docker --pull=never --network host $(pip_mounts) --build-arg BASE_IMAGE="$BASE" \
        -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT"
    seconds=$((SECONDS - start))
    podman_ image prune --force > /dev/null  # layers of earlier builds that no tag uses any more
    size="$(podman_ image inspect --format '{{.Size}}' "$IMAGE")"
    echo "built $IMAGE in ${seconds} s (base $BASE), image size $((size / 1000000)) MB"
}

if [ "$(id -u)" != 0 ]; then
    echo "$0: run as root (rootful podman; mmdebstrap and the pip mounts are set up for it)" >&2
    exit 2
fi
case "${1:-}" in
    build) build ;;
    podman) shift; podman_ "$@" ;;
    *) echo "usage: $0 build | podman ARGS..." >&2; exit 2 ;;
esac
