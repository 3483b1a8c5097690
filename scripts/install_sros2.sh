#!/usr/bin/env bash
# Installs what running the node under SROS2 with security enforced needs, beside the venv that
# scripts/setup.sh made, for test/ros_tools/test_sros2.py (it skips, saying so, without it):
#   - sros2 (`ros2 security ...`: keystores, enclaves, permissions from a policy), from its source;
#   - DDS-Security plugins: the Jazzy Fast DDS wheel is built without them (SECURITY=OFF: no
#     builtin.PKI-DH / Access-Permissions / AES-GCM-GMAC in libfastrtps), so the security runs on
#     Cyclone DDS (Debian's cyclonedds packages ship libdds_security_{auth,ac,crypto}) through
#     rmw_cyclonedds_cpp built from its source against the venv's ROS wheels.
# Neither source is on a package registry: SRC is a folder or a .tar.gz holding sros2/ (the sros2
# repository, 0.13 for Jazzy) and rmw_cyclonedds/ (the jazzy branch). Nothing here is copied into
# the project.
#
# The wheels' librcl links librmw_fastrtps_cpp.so itself (there is no rmw_implementation layer to
# choose another rmw with RMW_IMPLEMENTATION), so a process opts in by preloading a copy of
# librmw_cyclonedds_cpp.so that carries that soname: $OPT/env lists the variables (KEY=VALUE lines).
#
#   scripts/install_sros2.sh SRC [VENV]      (default VENV: <repo>/.venv); ~1.5 min on 2 cores
#
# Needs root for apt-get (cyclonedds-dev, liblttng-ust-dev for the wheels' tracetools, patchelf).
# Idempotent: a second run with the same sources checks a stamp.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${1:?usage: install_sros2.sh SRC [VENV]}"
VENV="$(cd "${2:-$ROOT/.venv}" && pwd)"
OPT="$VENV/opt/sros2"
PY="$VENV/bin/python"
log() { printf '[sros2] %s\n' "$*"; }

[ -x "$PY" ] && "$PY" -c "import rclpy, ros2cli" 2>/dev/null ||
  { log "$VENV needs the ROS 2 wheels (scripts/setup.sh) and ros2cli (ros2-tools) first" >&2; exit 1; }
key="$( (if [ -d "$SRC" ]; then find "$SRC" -type f -print0 | sort -z | xargs -0 sha1sum; else sha1sum "$SRC"; fi
         cat "$0") | sha1sum | cut -c1-12)"
if [ -f "$OPT/.stamp" ] && [ "$(cat "$OPT/.stamp")" = "$key" ]; then
  log "up to date in $OPT"; exit 0
fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
if [ -d "$SRC" ]; then cp -r "$SRC"/. "$work/"; else tar -xzf "$SRC" -C "$work"; fi
for tree in sros2/sros2 rmw_cyclonedds/rmw_cyclonedds_cpp; do
  [ -d "$work/$tree" ] || { log "$SRC holds no $tree" >&2; exit 1; }
done

log "Debian packages: Cyclone DDS with its security plugins, lttng-ust, patchelf"
export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s cyclonedds-dev liblttng-ust-dev patchelf > /dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq cyclonedds-dev liblttng-ust-dev patchelf > /dev/null
fi
plugins="$(dirname "$(dpkg -L libddsc0debian | grep -m1 'libdds_security_auth\.so$')")"

rm -rf "$OPT"; mkdir -p "$OPT/preload"
log "building rmw_cyclonedds_cpp"
(
  export CMAKE_PREFIX_PATH="$VENV:/usr" AMENT_PREFIX_PATH="$VENV" PATH="$VENV/bin:$PATH"
  cmake -S "$work/rmw_cyclonedds/rmw_cyclonedds_cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$OPT/rmw" -DPython3_EXECUTABLE="$PY" -DBUILD_TESTING=OFF > "$work/rmw.log" 2>&1 &&
  cmake --build "$work/build" -j "$(nproc)" >> "$work/rmw.log" 2>&1 &&
  cmake --install "$work/build" >> "$work/rmw.log" 2>&1
) || { log "rmw_cyclonedds_cpp build failed:"; tail -30 "$work/rmw.log"; exit 1; }
cp "$OPT/rmw/lib/librmw_cyclonedds_cpp.so" "$OPT/preload/librmw_fastrtps_cpp.so"
patchelf --set-soname librmw_fastrtps_cpp.so "$OPT/preload/librmw_fastrtps_cpp.so"

log "sros2 and its Python dependencies (into $OPT/site, outside the venv's own site-packages)"
# cryptography 41 (Ubuntu 24.04's, Jazzy's platform): sros2 0.13 passes curve classes, which
# cryptography >= 42 refuses
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --target "$OPT/site" "cryptography==41.0.7" lxml argcomplete
"${PIP[@]}" install --target "$OPT/site" --no-deps --no-build-isolation "$work/sros2/sros2"

site_libs="$(ls -d "$VENV"/lib/python3*/site-packages/ros_*.libs | tr '\n' ':')"
cat > "$OPT/env" <<EOF
PYTHONPATH=$OPT/site
AMENT_PREFIX_PATH=$OPT/site:$VENV
LD_PRELOAD=$OPT/preload/librmw_fastrtps_cpp.so
LD_LIBRARY_PATH=$VENV/lib:${site_libs}$plugins
RMW_IMPLEMENTATION=rmw_cyclonedds_cpp
EOF
(set -a; . "$OPT/env"; cd "$work" && "$PY" -c "
import rclpy.utilities, sros2.api
assert rclpy.utilities.get_rmw_implementation_identifier() == 'rmw_cyclonedds_cpp'")
echo "$key" > "$OPT/.stamp"
log "installed into $OPT (variables in $OPT/env)"
