#!/usr/bin/env bash
# stop-local-slurm.sh - stop the cluster started by start-local-slurm.sh.
# Cancels the jobs through Slurm first (so their steps end), then stops slurmctld, the slurmds
# and munged -- only the daemons recorded in $NEREUS_SLURM_DIR's pid files, each checked to
# still run the expected program. Idempotent.
#   --keep-munge   leave munged running (start-local-slurm.sh uses it on a config change)
#   --purge        also delete $NEREUS_SLURM_DIR and the /etc/hosts lines
set -uo pipefail
DIR=${NEREUS_SLURM_DIR:-/tmp/nereus-slurm}
KEEP_MUNGE=0; PURGE=0
for a in "$@"; do
  case $a in --keep-munge) KEEP_MUNGE=1 ;; --purge) PURGE=1 ;; *) echo "unknown argument $a" >&2; exit 2 ;; esac
done
log() { echo "[nereus-slurm-stop] $*" >&2; }
trap '' PIPE
running() { # pid -> it exists and has not exited (a zombie waiting for its parent has)
  [ -d "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_of() { # pidfile program -> pid when it still runs that program
  local p; p=$(cat "$1" 2>/dev/null) || return 1
  [[ "$p" =~ ^[0-9]+$ ]] && [ -r "/proc/$p/cmdline" ] && running "$p" || return 1
  [[ "$(basename "$(tr '\0' ' ' <"/proc/$p/cmdline" | awk '{print $1}')")" == "$2"* ]] && echo "$p"
}
stop() { # pidfile program
  local p
  if p=$(pid_of "$1" "$2"); then
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq 150); do running "$p" || break; sleep 0.1; done
    if running "$p"; then log "$2 ($p) ignored SIGTERM: SIGKILL"; kill -KILL "$p" 2>/dev/null; fi
    log "stopped $2 ($p)"
  fi
  rm -f "$1"
}
if [ -f "$DIR/etc/slurm.conf" ] && pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
  export SLURM_CONF=$DIR/etc/slurm.conf
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
stop "$DIR/run/slurmctld.pid" slurmctld
for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop "$f" slurmd; done
[ "$KEEP_MUNGE" = 1 ] || stop "$DIR/munge/munged.pid" munged
if [ -f "$DIR/etc/slurm.conf" ]; then   # empty per-node cgroups of proctrack/cgroup
  for n in $(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$DIR/etc/slurm.conf"); do
    for c in /sys/fs/cgroup/*/slurm_"$n"; do [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null; done
  done
fi
if [ "$PURGE" = 1 ] && [ -f "$DIR/run/.nereus-slurm" ]; then
  TAG="# nereus-slurm:$DIR"
  if grep -qF "$TAG" /etc/hosts; then grep -vF "$TAG" /etc/hosts >"$DIR/hosts"; cat "$DIR/hosts" >/etc/hosts; fi
  rm -rf "$DIR"; log "purged $DIR"
fi
exit 0
