#!/usr/bin/env bash
# A real single-node Son of Grid Engine (Debian's gridengine-* 8.1.9 packages) on this
# machine, for the end-to-end tests: qmaster and execd here, queue all.q with `nproc`
# slots, parallel environment smp. Idempotent: run it as often as you like.
#
# Debian's gridengine-client cannot be installed with apt here: slurm-wlm-torque (Slurm's
# qsub, which slurm-up.sh needs) declares Conflicts: gridengine-client, and both own
# /usr/bin/qsub, qstat, qdel. So the four .debs are downloaded and unpacked at their
# Debian paths (/usr/lib/gridengine, /usr/share/gridengine, /var/lib/gridengine,
# /usr/sbin/sge_*) except their /usr/bin links, and what their maintainer scripts would do
# (sgeadmin, bootstrap, act_qmaster, init_cluster) is done below, so there is no debconf
# to preseed. Grid Engine's q* commands are links in $bin, and Slurm's stay in /usr/bin:
# put $bin first in PATH (`. /opt/gridengine/env.sh`) to talk to Grid Engine.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
export SGE_ROOT=/var/lib/gridengine SGE_CELL=default
bin=/opt/gridengine/bin
export PATH=$bin:$PATH
host=$(hostname)
cpus=$(nproc)
common=$SGE_ROOT/$SGE_CELL/common
spool=/var/spool/gridengine

if [ ! -x /usr/lib/gridengine/sge_execd ] || [ ! -x /usr/lib/gridengine/sge_qmaster ]; then
  if ! dpkg -s libjemalloc2 tcsh >/dev/null 2>&1; then  # the libraries not already here
    apt-get install -y -qq libjemalloc2 tcsh >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libjemalloc2 tcsh >/dev/null; }
  fi
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  chown _apt "$work" 2>/dev/null || true
  (cd "$work" && apt-get download -qq gridengine-common gridengine-client \
    gridengine-master gridengine-exec 2>/dev/null)
  for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
  cp -a "$work"/root/usr/lib/gridengine /usr/lib/
  cp -a "$work"/root/usr/share/gridengine /usr/share/
  cp -a "$work"/root/var/lib/gridengine /var/lib/
  cp -a "$work"/root/usr/sbin/sge_* /usr/sbin/
fi
mkdir -p "$bin"
for cmd in qacct qalter qconf qdel qhold qhost qmod qping qquota qrls qrsh qselect qstat qsub; do
  ln -sfn /usr/share/gridengine/gridengine-wrapper "$bin/$cmd"
done
printf 'export SGE_ROOT=%s SGE_CELL=%s PATH=%s:$PATH\n' "$SGE_ROOT" "$SGE_CELL" "$bin" \
  > /opt/gridengine/env.sh

# As gridengine-common's, -client's and -master's postinst scripts would.
id sgeadmin >/dev/null 2>&1 || adduser --system --no-create-home --quiet --disabled-password \
  --disabled-login --shell /bin/false --group --home "$SGE_ROOT" sgeadmin
[ -f /etc/default/gridengine ] || sed "s@^SGE_CELL=.*@SGE_CELL=$SGE_CELL@" \
  /usr/share/gridengine/templates/gridengine.default > /etc/default/gridengine
mkdir -p "$common" $spool/qmaster/job_scripts $spool/spooldb $spool/execd /run/gridengine
chown sgeadmin:sgeadmin "$SGE_ROOT" "$SGE_ROOT/$SGE_CELL" "$common" $spool/* \
  $spool/qmaster/job_scripts /run/gridengine
[ -f "$common/bootstrap" ] || install -m0644 -o sgeadmin -g sgeadmin \
  /usr/share/gridengine/default-bootstrap "$common/bootstrap"
[ "$(cat "$common/act_qmaster" 2>/dev/null)" = "$host" ] || echo "$host" > "$common/act_qmaster"
[ -e $spool/spooldb/sge ] || su -s /bin/sh -c "/usr/share/gridengine/scripts/init_cluster \
  $SGE_ROOT $SGE_CELL $spool/spooldb sgeadmin" sgeadmin >/dev/null

pgrep -x sge_qmaster >/dev/null || sge_qmaster
for _ in $(seq 1 30); do qconf -sh >/dev/null 2>&1 && break; sleep 1; done
echo ok
