#!/usr/bin/env bash
# start-local-slurm.sh - a real Slurm cluster on this one machine, for Nereus's tests and CI.
#
# Installs the Debian packages if missing (slurmctld slurmd slurm-client munge), writes a
# configuration, and starts munged + slurmctld + N slurmd, each slurmd one emulated node with
# its own port, its own loopback address (127.0.0.(10+i), added to /etc/hosts) and fake GPUs
# (symlinks to /dev/null, so `--gres=gpu:N` sets CUDA_VISIBLE_DEVICES). Idempotent: when the
# cluster described by the settings is already up it only checks it. Needs root.
#
# Prints the environment to use it:   eval "$(scripts/slurm/start-local-slurm.sh)"
# Stop it with:                        scripts/slurm/stop-local-slurm.sh [--purge]
#
# Settings (environment, all optional):
#   NEREUS_SLURM_DIR     state/config/log directory                     [/tmp/nereus-slurm]
#   NEREUS_SLURM_NODES   emulated nodes, named ${PREFIX}1..${PREFIX}N   [3]
#   NEREUS_SLURM_PREFIX  node name prefix                               [nrs]
#   NEREUS_SLURM_CPUS    CPUs per node (pretended; oversubscribes)      [4]
#   NEREUS_SLURM_GPUS    fake GPUs per node                             [4]
#   NEREUS_SLURM_PORT    slurmctld port; slurmd of node i: PORT+i       [17817]
#   NEREUS_SLURM_WAIT    seconds to wait for every node to be idle      [60]
#
# Settings that matter (learned the hard way, kept here next to the code):
#   - munged must run as the munge user with a private socket (AuthInfo=socket=...).
#   - SlurmdParameters=config_overrides: pretend CPUs/GPUs the machine does not have.
#   - ReturnToService=1: a node set DOWN by hand stays DOWN until RESUME (tests resume it).
#   - JobRequeue=0, batch_sched_delay=0, KillWait=2, SlurmdTimeout=6: fast, deterministic tests.
#   - Every emulated node has the same hostname: jobs must use SLURMD_NODENAME / SLURM_NODEID.
#   - proctrack/cgroup (v1 freezer) so that scancel also ends double-forked processes;
#     proctrack/linuxproc when no writable freezer exists (then they may survive).
#   - Stop slurmctld before the slurmds, or it waits on RPCs to dead nodes.
set -euo pipefail
DIR=${NEREUS_SLURM_DIR:-/tmp/nereus-slurm}
NNODES=${NEREUS_SLURM_NODES:-3}
PREFIX=${NEREUS_SLURM_PREFIX:-nrs}
CPUS=${NEREUS_SLURM_CPUS:-4}
GPUS=${NEREUS_SLURM_GPUS:-4}
PORT=${NEREUS_SLURM_PORT:-17817}
WAIT=${NEREUS_SLURM_WAIT:-60}
HOST=$(hostname -s)
TAG="# nereus-slurm:$DIR"
log() { echo "[nereus-slurm] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (it starts munged and slurm daemons)"
trap '' PIPE

# ---------------------------------------------------------------- install
missing=()
for p in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  log "installing ${missing[*]}"
  policy=0   # keep the packages' postinst from starting the stock services
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d; policy=1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-cache show slurmctld >/dev/null 2>&1 || apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi

alive() { # pidfile program: the pid runs that program
  local p; p=$(cat "$1" 2>/dev/null) || return 1
  [[ "$p" =~ ^[0-9]+$ ]] && [ -r "/proc/$p/cmdline" ] || return 1
  [ "$(awk '{print $3}' "/proc/$p/stat")" != Z ] || return 1
  [[ "$(basename "$(tr '\0' ' ' <"/proc/$p/cmdline" | awk '{print $1}')")" == "$2"* ]]
}

# ---------------------------------------------------------------- config
NODES=(); for i in $(seq 1 "$NNODES"); do NODES+=("$PREFIX$i"); done
mkdir -p "$DIR"/{etc,log,run,state,spool,munge,fakegpu}
PROCTRACK=linuxproc
if [ -w /sys/fs/cgroup/freezer/tasks ] && [ "$(stat -f -c %T /sys/fs/cgroup/freezer)" = cgroupfs ]; then
  PROCTRACK=cgroup
fi
CONF=$DIR/etc/slurm.conf
{
  echo "# written by scripts/slurm/start-local-slurm.sh (rewritten at every start)"
  echo "ClusterName=nereus-local"
  echo "SlurmctldHost=$HOST(127.0.0.1)"
  echo "SlurmctldPort=$PORT"
  echo "SlurmdPort=$((PORT + 1))"
  echo "SlurmUser=root"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  echo "AuthInfo=socket=$DIR/munge/munge.socket.2"
  echo "StateSaveLocation=$DIR/state"
  echo "SlurmdSpoolDir=$DIR/spool/slurmd-%n"
  echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
  echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
  echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
  echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
  echo "MailProg=/bin/true"
  echo "ProctrackType=proctrack/$PROCTRACK"
  echo "TaskPlugin=task/none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core"
  echo "SchedulerParameters=batch_sched_delay=0"
  echo "MpiDefault=none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "ReturnToService=1"
  echo "SlurmdParameters=config_overrides"
  echo "SlurmdTimeout=6"
  echo "SlurmctldTimeout=10"
  echo "MessageTimeout=5"
  echo "KillWait=2"
  echo "JobRequeue=0"
  echo "GresTypes=gpu"
  i=0
  for n in "${NODES[@]}"; do
    i=$((i + 1))
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.$((10 + i)) Port=$((PORT + i)) CPUs=$CPUS" \
         "Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 Gres=gpu:$GPUS State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"$CONF.new"
{
  echo "AutoDetect=off"
  for n in "${NODES[@]}"; do   # a GPU File= must be a device; /dev/null symlinks are accepted
    mkdir -p "$DIR/fakegpu/$n"
    for g in $(seq 0 $((GPUS - 1))); do ln -sfn /dev/null "$DIR/fakegpu/$n/nvidia$g"; done
    echo "NodeName=$n Name=gpu File=$DIR/fakegpu/$n/nvidia[0-$((GPUS - 1))]"
  done
} >"$DIR/etc/gres.conf.new"
printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' \
  >"$DIR/etc/cgroup.conf.new"

changed=0
for f in slurm.conf gres.conf cgroup.conf; do cmp -s "$DIR/etc/$f.new" "$DIR/etc/$f" || changed=1; done
if [ "$changed" = 1 ] && alive "$DIR/run/slurmctld.pid" slurmctld; then
  log "configuration changed: restarting the slurm daemons of $DIR"
  NEREUS_SLURM_DIR=$DIR "$(dirname "$0")/stop-local-slurm.sh" --keep-munge >&2 || true
fi
for f in slurm.conf gres.conf cgroup.conf; do mv -f "$DIR/etc/$f.new" "$DIR/etc/$f"; done
touch "$DIR/run/.nereus-slurm"
export SLURM_CONF=$CONF

# ---------------------------------------------------------------- /etc/hosts
want=""; i=0
getent hosts "$HOST" >/dev/null 2>&1 || want="127.0.0.1 $HOST $TAG"$'\n'
for n in "${NODES[@]}"; do i=$((i + 1)); want+="127.0.0.$((10 + i)) $n $TAG"$'\n'; done
have=$(grep -F "$TAG" /etc/hosts || true)
if [ "$have" != "${want%$'\n'}" ]; then   # rewrite in place: /etc/hosts may be a bind mount
  { grep -vF "$TAG" /etc/hosts || true; printf '%s' "$want"; } >"$DIR/run/hosts"
  cat "$DIR/run/hosts" >/etc/hosts
fi

# ---------------------------------------------------------------- daemons
SOCK=$DIR/munge/munge.socket.2
if ! alive "$DIR/munge/munged.pid" munged; then
  chown munge:munge "$DIR/munge"; chmod 755 "$DIR/munge"
  [ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chown munge:munge "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"
  rm -f "$SOCK" "$SOCK.lock"
  runuser -u munge -- munged --socket="$SOCK" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die "munged failed: $(tail -3 "$DIR/munge/munged.log" 2>/dev/null)"
fi
for _ in $(seq 50); do munge -S "$SOCK" -n 2>/dev/null | unmunge -S "$SOCK" >/dev/null 2>&1 && break; sleep 0.1; done
if ! alive "$DIR/run/slurmctld.pid" slurmctld; then
  slurmctld -f "$CONF" -c || die "slurmctld failed: $(tail -5 "$DIR/log/slurmctld.log")"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
scontrol ping | grep -q 'is UP' || die "slurmctld does not answer: $(tail -5 "$DIR/log/slurmctld.log")"
for n in "${NODES[@]}"; do
  if ! alive "$DIR/run/slurmd-$n.pid" slurmd; then
    mkdir -p "$DIR/spool/slurmd-$n"
    slurmd -f "$CONF" -N "$n" || die "slurmd $n failed: $(tail -5 "$DIR/log/slurmd-$n.log")"
  fi
done

# ---------------------------------------------------------------- wait until idle
deadline=$(($(date +%s) + WAIT))
while :; do
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u)
  ready=$(awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated"' <<<"$states" | wc -l)
  [ "$ready" -ge "${#NODES[@]}" ] && break
  for n in $(awk '$2 ~ /^(down|drained|draining|drain)$/ {print $1}' <<<"$states"); do
    scontrol update NodeName="$n" State=RESUME 2>/dev/null || true   # left DOWN by an earlier test
  done
  [ "$(date +%s)" -lt "$deadline" ] || { echo "$states" >&2; die "nodes not idle after ${WAIT}s; see $DIR/log"; }
  sleep 0.2
done
log "cluster up: ${NODES[*]} (proctrack/$PROCTRACK)"
printf 'export SLURM_CONF=%q\nexport NEREUS_SLURM_DIR=%q\n' "$CONF" "$DIR" | tee "$DIR/env.sh"
