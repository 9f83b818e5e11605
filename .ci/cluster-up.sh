#!/usr/bin/env bash
# A Slurm cluster of four hosts on this machine, for the multi-host tests: a login host and
# three compute hosts, each a network namespace (grain-login, grain-node1..3) with a
# hostname of its own (login, node1..3) and an address on one bridged network
# (10.77.0.0/24, its bridge in a namespace of its own, grain-switch). The login host also
# has a "public" interface the nodes cannot reach (eth0, 10.77.1.1: no route to it from a
# node), listed first, as on many clusters. The filesystem is this machine's: shared, as on a
# cluster. `.ci/on-host NAME CMD...` runs CMD on a host.
#
# Slurm across them: slurmctld on the login host, one slurmd on each node (its own spool
# directory, pid file and log), the machine's munged and key, partition `batch` of the
# three nodes. It lives beside the machine's single-node Slurm of .ci/slurm-up.sh: its own
# SLURM_CONF (/etc/grain-cluster/slurm.conf), ClusterName, ports, state, spool, log and pid
# files, and its daemons run as slurmctld-grain and slurmd-grain (symlinks to Debian's
# binaries), so that `pgrep -x slurmctld` / `pkill -x slurmd` (a test restarting the
# machine's controller, an older slurm-up.sh) neither see nor stop them.
#
# Root. Idempotent: what is up and right is left alone; a changed slurm.conf restarts the
# cluster's daemons, and a host whose network is not as below is made again (its daemon
# restarted). Run before or after slurm-up.sh, as often as you like. Logs: /var/log/grain-cluster.
# To take it all down: kill the pids in /run/grain-cluster/*.pid, then
# `ip netns del grain-switch grain-login grain-node1 ...` (one each), and remove the block
# of /etc/hosts between the grain-cluster lines.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
here=$(cd "$(dirname "$0")" && pwd)
[ "$(id -u)" = 0 ] || { echo "cluster-up: needs root (namespaces, daemons)" >&2; exit 1; }
exec 9>/run/grain-cluster.lock  # one run at a time
flock 9

need=""
command -v slurmctld >/dev/null 2>&1 || need="$need slurm-wlm"
command -v munged >/dev/null 2>&1 || need="$need munge"
command -v ip >/dev/null 2>&1 || need="$need iproute2"
{ command -v nsenter && command -v unshare; } >/dev/null 2>&1 || need="$need util-linux"
if [ -n "$need" ]; then
  apt-get install -y -qq $need >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq $need >/dev/null; }
fi

etc=/etc/grain-cluster          # slurm.conf (SLURM_CONF), and nothing else of the machine's
run=/run/grain-cluster          # pid files
spool=/var/spool/grain-cluster  # ctld/ (StateSaveLocation), nodeN/ (each slurmd's spool)
logs=/var/log/grain-cluster     # slurmctld.log, slurmd-nodeN.log
bin=/usr/local/lib/grain-cluster  # slurmctld-grain, slurmd-grain
export SLURM_CONF=$etc/slurm.conf
net=10.77.0 pub=10.77.1
nodes="node1 node2 node3"
addr() { case "$1" in login) echo $net.1 ;; node*) echo $net.1${1#node} ;; esac; }

mkdir -p $etc $run $spool/ctld $logs $bin /run/munge
for n in $nodes; do mkdir -p $spool/$n; done   # (slurmd does not make its spool directory)
for d in slurmctld slurmd; do
  [ "$(readlink $bin/$d-grain 2>/dev/null)" = "$(command -v $d)" ] \
    || ln -sfn "$(command -v $d)" $bin/$d-grain
done

# --- Names: every host (and the machine) resolves login and node1..3 ---------------------
block="# grain-cluster begin (.ci/cluster-up.sh)
$(addr login) login
$(for n in $nodes; do echo "$(addr $n) $n"; done)
# grain-cluster end"
hosts_now=$(cat /etc/hosts)
hosts_want=$(printf '%s\n' "$hosts_now" | sed '/^# grain-cluster begin/,/^# grain-cluster end/d')
hosts_want=$(printf '%s\n%s' "$hosts_want" "$block")
[ "$hosts_now" = "$hosts_want" ] || printf '%s\n' "$hosts_want" > /etc/hosts

# --- Network -----------------------------------------------------------------------------
# The machine itself is outside the cluster: its names resolve (/etc/hosts) but nothing of
# 10.77.0.0/23 may leave by its default route. Enter a host with .ci/on-host.
for n in $net.0/24 $pub.0/24; do
  ip route show type unreachable | grep -q "^unreachable $n" || ip route replace unreachable $n
done
inode() { stat -L -c %i "$1" 2>/dev/null || echo none; }
# A host's network is right when its interfaces, addresses and order are exactly these
# (`ip -br -4 addr`, ifindex order): the login host's public interface first.
want_net() {
  echo "lo 127.0.0.1/8"
  if [ "$1" = login ]; then echo "eth0 $pub.1/24"; echo "eth1 $(addr login)/24"
  else echo "eth0 $(addr "$1")/24"; fi
}
have_net() {
  ip -n "grain-$1" -br -4 addr 2>/dev/null \
    | awk '$2 ~ /^(UP|UNKNOWN)$/ {sub(/@.*/, "", $1); print $1, $3}' || true
}
host_if() { [ "$1" = login ] && echo eth1 || echo eth0; }
stop_daemon() {  # pid file: stop the process it names, if it is ours
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  if [ -n "$pid" ] && grep -qx "$2" /proc/"$pid"/comm 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do [ -d /proc/"$pid" ] || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

if ! ip netns list | grep -qw grain-switch || \
   [ "$(ip -n grain-switch -br link show br0 2>/dev/null | awk '{print $2}')" != UP ]; then
  ip netns del grain-switch 2>/dev/null || true
  ip netns add grain-switch
  ip -n grain-switch link set lo up
  ip -n grain-switch link add br0 type bridge
  ip -n grain-switch link set br0 up
  for h in login $nodes; do ip netns del grain-$h 2>/dev/null || true; done  # (their veths went)
fi
for h in login $nodes; do
  if [ "$(have_net $h)" = "$(want_net $h)" ] \
     && ip -n grain-switch link show "v-$h" 2>/dev/null | grep -q "master br0"; then
    continue
  fi
  if [ "$h" = login ]; then stop_daemon $run/slurmctld.pid slurmctld-grain
  else stop_daemon $run/slurmd-$h.pid slurmd-grain; fi
  ip netns del grain-$h 2>/dev/null || true
  ip -n grain-switch link del "v-$h" 2>/dev/null || true
  ip netns add grain-$h
  ip -n grain-$h link set lo up
  if [ "$h" = login ]; then  # made before the cluster's: the first address hostname -I shows
    # (a veth, its other end in the switch's namespace on no bridge: this kernel has no
    # dummy interfaces)
    ip -n grain-switch link del o-login 2>/dev/null || true
    ip -n grain-switch link add o-login type veth peer name eth0 netns grain-login
    ip -n grain-switch link set o-login up
    ip -n grain-login addr add $pub.1/24 dev eth0
    ip -n grain-login link set eth0 up
  fi
  ip -n grain-switch link add "v-$h" type veth peer name "$(host_if $h)" netns grain-$h
  ip -n grain-switch link set "v-$h" master br0 up
  ip -n grain-$h addr add "$(addr $h)/24" dev "$(host_if $h)"
  ip -n grain-$h link set "$(host_if $h)" up
done

# --- Cores: each node has cores of its own, as far as this machine has enough -------------
# A node gets max(1, cores/3) of the cores this script may use, taken in turn (on a 2-core
# machine: node1 core 0, node2 core 1, node3 core 0 again). on-host runs everything on a
# node, slurmd and so its jobs too, pinned to that node's cores (taskset), so a process
# there sees the node's cores in its affinity, as on a real node, and slurm.conf says
# CPUs=that many.
allowed=($(sed -n 's/^Cpus_allowed_list:\s*//p' /proc/self/status | tr ',' '\n' \
  | awk -F- '{for (i = $1; i <= ($2 == "" ? $1 : $2); i++) print i}'))
per=$(( ${#allowed[@]} / 3 > 0 ? ${#allowed[@]} / 3 : 1 ))
cores_of() {  # node: its cores, a comma list
  local i=$(( ${1#node} - 1 )) j out=""
  for (( j = 0; j < per; j++ )); do
    out="$out,${allowed[$(( (i * per + j) % ${#allowed[@]} ))]}"
  done
  echo "${out#,}"
}
cores=$(for n in $nodes; do echo "$n $(cores_of $n)"; done)

# --- Slurm -------------------------------------------------------------------------------
# Each node's RealMemory: 2 GB, or a quarter of a smaller machine's (slurmd drains a node
# that has less than slurm.conf says).
mem_mb=$(awk '/^MemTotal:/ {m = int($2 / 4096); print (m < 2048 ? m : 2048)}' /proc/meminfo)
conf=$(cat <<CONF
ClusterName=graincluster
SlurmctldHost=login($(addr login))
SlurmctldPort=7817
SlurmdPort=7818
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmUser=root
ReturnToService=2
StateSaveLocation=$spool/ctld
SlurmdSpoolDir=$spool/%n
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd-%n.pid
SlurmctldLogFile=$logs/slurmctld.log
SlurmdLogFile=$logs/slurmd-%n.log
MinJobAge=300
$(for n in $nodes; do
  echo "# $n runs on this machine's cores $(cores_of $n) (.ci/on-host pins it there: $etc/cores)"
  echo "NodeName=$n NodeAddr=$(addr $n) NodeHostname=$n CPUs=$per RealMemory=$mem_mb State=UNKNOWN"
done)
PartitionName=batch Nodes=node[1-3] Default=YES MaxTime=INFINITE State=UP
CONF
)
if [ "$(cat $SLURM_CONF 2>/dev/null)" != "$conf" ]; then
  stop_daemon $run/slurmctld.pid slurmctld-grain
  for n in $nodes; do stop_daemon $run/slurmd-$n.pid slurmd-grain; done
  echo "$cores" > $etc/cores
  echo "$conf" > $SLURM_CONF
fi
[ "$(cat $etc/cores 2>/dev/null)" = "$cores" ] || echo "$cores" > $etc/cores

# The machine's munged (one key, /etc/munge/munge.key) serves every namespace: its socket
# is a path. Started here unless it answers (slurm-up.sh starts it the same way).
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  chown munge:munge /run/munge 2>/dev/null || true
  pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged
fi

# Up: its pid file names a live process of that name in that host's network namespace.
up() {  # pidfile name host
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  [ -n "$pid" ] && grep -qx "$2" /proc/"$pid"/comm 2>/dev/null \
    && [ "$(inode /proc/"$pid"/ns/net)" = "$(inode /var/run/netns/grain-$3)" ]
}
fresh=""  # the nodes whose slurmd starts now: up once it has registered since
since=$(date +%s)
start() {  # pidfile name host
  up "$@" && return 0
  stop_daemon "$1" "$2"
  [ "$3" = login ] || fresh="$fresh $3"
  "$here/on-host" "$3" $bin/"$2" </dev/null >>$logs/start.log 2>&1 \
    || { echo "cluster-up: $2 on $3 did not start:" >&2; tail -n 20 $logs/start.log >&2; exit 1; }
}
start $run/slurmctld.pid slurmctld-grain login
for n in $nodes; do start $run/slurmd-$n.pid slurmd-grain $n; done

for _ in $(seq 1 60); do
  states=$("$here/on-host" login sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
  registered=1
  for n in $fresh; do  # (its state may be the controller's memory of a slurmd just stopped)
    t=$("$here/on-host" login scontrol show node "$n" -o 2>/dev/null \
      | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
    [ "$(date -d "$t" +%s 2>/dev/null || echo 0)" -ge "$since" ] || registered=""
  done
  if [ -n "$registered" ] && [ "$(echo "$states" | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l)" = 3 ]; then
    echo "cluster is up: slurmctld on login ($(addr login)), partition batch:" $states
    exit 0
  fi
  for n in $(echo "$states" | awk '$2 ~ /^(down|drain)/ {print $1}'); do
    "$here/on-host" login scontrol update nodename="$n" state=resume 2>/dev/null || true
  done
  sleep 0.5
done
echo "the cluster did not come up; sinfo says: $("$here/on-host" login sinfo -N 2>&1)" >&2
tail -n 20 $logs/*.log >&2 || true
exit 1
