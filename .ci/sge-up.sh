#!/usr/bin/env bash
# A real single-node Son of Grid Engine (Debian's gridengine-* 8.1.9 packages) on this
# machine, for the end-to-end tests: qmaster and execd here, this host an admin, submit and
# exec host, queue all.q with `nproc` slots, parallel environment smp. Idempotent.
#
# apt cannot install Grid Engine beside Slurm's qsub: slurm-wlm-torque (slurm-up.sh's)
# declares Conflicts: gridengine-client, and both own /usr/bin/qsub, qstat, qdel. So the
# four .debs are unpacked at their Debian paths but for their /usr/bin links, and what
# their maintainer scripts would do (sgeadmin, bootstrap, act_qmaster, init_cluster) is
# done here: no debconf question is asked. Grid Engine's q* are Debian's wrapper (it reads
# SGE_ROOT and SGE_CELL from /etc/default/gridengine) linked in /opt/gridengine/bin, and
# /usr/bin/q* stay Slurm's. For Grid Engine: . /opt/gridengine/env.sh (puts it first in PATH)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
bin=/opt/gridengine/bin
export PATH=$bin:$PATH
host=$(hostname)
cpus=$(nproc)
common=$SGE_ROOT/$SGE_CELL/common
spool=/var/spool/gridengine
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -x /usr/lib/gridengine/sge_qmaster ] || [ ! -x /usr/lib/gridengine/sge_execd ]; then
  debs="gridengine-common gridengine-client gridengine-master gridengine-exec"
  chown _apt "$tmp" 2>/dev/null || true  # so that apt-get download need not warn
  # (libjemalloc2 and tcsh, their /bin/csh, are the dependencies Slurm's did not bring.)
  get() { apt-get install -y -qq libjemalloc2 tcsh >/dev/null 2>&1 \
    && (cd "$tmp" && apt-get download -qq $debs 2>/dev/null); }
  get || { apt-get update -qq && get; }
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  cp -a "$tmp"/root/usr/lib/gridengine /usr/lib/
  cp -a "$tmp"/root/usr/share/gridengine /usr/share/
  cp -a "$tmp"/root/var/lib/gridengine /var/lib/
  cp -a "$tmp"/root/usr/sbin/sge_* /usr/sbin/
fi
mkdir -p "$bin"
for cmd in qacct qalter qconf qdel qhold qhost qmod qping qquota qrls qrsh qselect qstat qsub; do
  [ -L "$bin/$cmd" ] || ln -s /usr/share/gridengine/gridengine-wrapper "$bin/$cmd"
done
env="export SGE_ROOT=$SGE_ROOT SGE_CELL=$SGE_CELL PATH=$bin:\$PATH"
[ "$(cat /opt/gridengine/env.sh 2>/dev/null)" = "$env" ] || echo "$env" > /opt/gridengine/env.sh

# What gridengine-common's, -client's and -master's postinst scripts would do.
id sgeadmin >/dev/null 2>&1 || adduser --system --no-create-home --quiet --disabled-password \
  --disabled-login --shell /bin/false --group --home "$SGE_ROOT" sgeadmin
[ -f /etc/default/gridengine ] || sed "s@^SGE_CELL=.*@SGE_CELL=$SGE_CELL@" \
  /usr/share/gridengine/templates/gridengine.default > /etc/default/gridengine
mkdir -p "$common" $spool/qmaster/job_scripts $spool/spooldb $spool/execd
[ -f "$common/bootstrap" ] || cp /usr/share/gridengine/default-bootstrap "$common/bootstrap"
[ "$(cat "$common/act_qmaster" 2>/dev/null)" = "$host" ] || echo "$host" > "$common/act_qmaster"
# Grid Engine names a host by its address's first name. Here $host is 127.0.0.1, whose first
# name in /etc/hosts is localhost, so the qmaster would take itself for localhost and not
# for $host. Its host_aliases file makes localhost a name of $host instead of editing
# /etc/hosts, which Slurm uses too.
if getent hosts "$host" | grep -q '^127\.'; then
  [ -f "$common/host_aliases" ] || echo "$host localhost" > "$common/host_aliases"
fi
chown sgeadmin:sgeadmin "$SGE_ROOT" "$SGE_ROOT/$SGE_CELL" "$common" "$common"/* $spool/* \
  $spool/qmaster/job_scripts
[ -e $spool/spooldb/sge ] || su -s /bin/sh -c "/usr/share/gridengine/scripts/init_cluster \
  $SGE_ROOT $SGE_CELL $spool/spooldb sgeadmin" sgeadmin >/dev/null

quiet() { local out; out=$("$@" 2>&1) || { echo "sge-up: $* failed: $out" >&2; exit 1; }; }
running() { pgrep -x -r R,S,D "$1" >/dev/null; }  # not a zombie just dead
running sge_qmaster || sge_qmaster
for _ in $(seq 1 30); do qconf -sh >/dev/null 2>&1 && break; sleep 1; done

# This host as admin, submit and exec host (root is a manager: it may qconf).
qconf -sh 2>/dev/null | grep -qx "$host" || quiet qconf -ah "$host"
qconf -ss 2>/dev/null | grep -qx "$host" || quiet qconf -as "$host"
if ! qconf -se "$host" >/dev/null 2>&1; then
  { echo "hostname $host"; for k in load_scaling complex_values user_lists xuser_lists \
    projects xprojects usage_scaling report_variables; do echo "$k NONE"; done; } > "$tmp/host"
  quiet qconf -Ae "$tmp/host"
fi

# Debian's configuration refuses jobs of users below uid and gid 1000 ("job rejected: your
# user id 0 is lower than minimum user id 1000 of cluster configuration"); the tests submit
# as root, so min_uid and min_gid are 0.
if qconf -sconf global | grep -qE '^min_(uid|gid) +[1-9]'; then
  qconf -sconf global | sed '/^#/d; s/^\(min_[ug]id\) .*/\1 0/' > "$tmp/global"
  quiet qconf -Mconf "$tmp/global"  # the file's name says which configuration
fi
# The scheduler runs every 2 s, and a second after a job is submitted or ends (not 15 s).
if ! qconf -ssconf | grep -qE '^schedule_interval +0:0:2$'; then
  qconf -ssconf | sed -e 's/^\(schedule_interval\) .*/\1 0:0:2/' \
    -e 's/^\(flush_[a-z]*_sec\) .*/\1 1/' > "$tmp/sched"
  quiet qconf -Msconf "$tmp/sched"
fi

# Parallel environment smp as Debian ships it (slots 999, allocation_rule $pe_slots), and
# queue all.q here: a slot a CPU, pe smp, and no load threshold (a busy CI machine would
# otherwise put it in alarm state, where it takes no job).
qconf -sp smp >/dev/null 2>&1 || quiet qconf -Ap /usr/share/gridengine/util/resources/pe/smp
q() { qconf -sq all.q 2>/dev/null | awk -v k="$1" '$1 == k {print $2}'; }
if [ "$(q hostlist) $(q slots) $(q pe_list) $(q load_thresholds)" != "$host $cpus smp NONE" ]; then
  cat > "$tmp/edit" <<ED  # qconf's "editor": sets these lines of the queue's definition
#!/bin/sh
sed -i -e 's/^hostlist .*/hostlist $host/' -e 's/^slots .*/slots $cpus/' \
  -e 's/^pe_list .*/pe_list smp/' -e 's/^load_thresholds .*/load_thresholds NONE/' "\$1"
ED
  chmod +x "$tmp/edit"
  if [ -n "$(q qname)" ]; then EDITOR=$tmp/edit quiet qconf -mq all.q
  else EDITOR=$tmp/edit quiet qconf -aq all.q; fi
fi

running sge_execd || sge_execd
for _ in $(seq 1 90); do  # up when all.q@$host has a load and no state (a, u, E, d...)
  line=$(qstat -f -q "all.q@$host" 2>/dev/null | awk -v q="all.q@$host" '$1 == q' || true)
  state=$(echo "$line" | awk '{print $6}')
  if [ -n "$line" ] && [ -z "$state" ]; then
    echo "sge is up: all.q@$host has $cpus slots, pe smp; use PATH=$bin:\$PATH"
    exit 0
  fi
  case "$state" in *E*) qmod -c "all.q@$host" >/dev/null 2>&1 || true ;;
    *d*) qmod -e "all.q@$host" >/dev/null 2>&1 || true ;; esac
  sleep 1
done
echo "sge did not come up; qstat -f says: $(qstat -f 2>&1)" >&2
tail -n 20 $spool/qmaster/messages $spool/execd/*/messages >&2 2>/dev/null || true
exit 1
