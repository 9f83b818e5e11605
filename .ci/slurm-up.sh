#!/usr/bin/env bash
# A real single-node Slurm (Debian's slurm-wlm, with its torque wrappers for qsub) on this
# machine, for the end-to-end tests. Idempotent: run it as often as you like.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v qsub >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq slurm-wlm slurm-wlm-torque munge >/dev/null
fi

host=$(hostname)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge 2>/dev/null || true

# Four stand-in GPUs as a generic resource: character devices like /dev/null. Slurm gives
# a job with --gres=gpu:N N of them and says which in CUDA_VISIBLE_DEVICES, as on a GPU
# node; nothing here uses a real GPU.
gres=""
mkdir -p /dev/grainfake
for i in 0 1 2 3; do
  [ -e /dev/grainfake/gpu$i ] || mknod /dev/grainfake/gpu$i c 1 3 2>/dev/null || true
done
if [ -c /dev/grainfake/gpu3 ]; then
  gres=" Gres=gpu:4"
  gres_conf="Name=gpu File=/dev/grainfake/gpu[0-3]"
  if [ ! -f /etc/slurm/gres.conf ] || [ "$(cat /etc/slurm/gres.conf)" != "$gres_conf" ]; then
    echo "$gres_conf" > /etc/slurm/gres.conf
    rm -f /etc/slurm/slurm.conf  # written again below: the daemons restart
  fi
fi

conf=/etc/slurm/slurm.conf
want=$(cat <<CONF
ClusterName=grainci
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmUser=root
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MinJobAge=300
GresTypes=gpu
NodeName=$host CPUs=$cpus RealMemory=$mem_mb$gres State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
)
# This Slurm's daemons are found by their pid files (Slurm's defaults), never by name: the
# cluster of .ci/cluster-up.sh runs its own slurmctld and slurmd beside them.
ctld_pid=/run/slurmctld.pid slurmd_pid=/run/slurmd.pid
ours() {  # pid file, name: the live process it names, if it is that daemon
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  [ -n "$pid" ] && grep -qx "$2" /proc/"$pid"/comm 2>/dev/null && echo "$pid"
}
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
  echo "$want" > "$conf"
  pids="$(ours $ctld_pid slurmctld || true) $(ours $slurmd_pid slurmd || true)"
  kill $pids 2>/dev/null || true
  for _ in $(seq 1 30); do  # gone before they start again with the new config
    alive=""
    for pid in $pids; do [ -d /proc/"$pid" ] && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.5
  done
fi

# (munged serves this Slurm and the cluster's alike: started if it does not answer.)
munge -n 2>/dev/null | unmunge >/dev/null 2>&1 || pgrep -x munged >/dev/null \
  || su -s /bin/sh munge -c munged
export SLURM_CONF=$conf  # (this machine's, whatever the caller's environment says)
ours $ctld_pid slurmctld >/dev/null || slurmctld
ours $slurmd_pid slurmd >/dev/null || slurmd

for _ in $(seq 1 60); do
  state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1 || true)
  case "$state" in
    idle*|mix*|alloc*) echo "slurm is up: node $host is $state"; exit 0 ;;
    down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "slurm did not come up; sinfo says: $(sinfo 2>&1)" >&2
tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
