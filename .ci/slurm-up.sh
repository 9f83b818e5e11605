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
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
)
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
  echo "$want" > "$conf"
  pkill -x slurmctld 2>/dev/null || true
  pkill -x slurmd 2>/dev/null || true
  sleep 1
fi

pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

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
