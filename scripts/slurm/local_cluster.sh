#!/usr/bin/env bash
# A private one-node Slurm cluster on this machine, for trying the job scripts without a cluster
# and for the tests: starts munged, slurmctld and slurmd with their state, logs and sockets in DIR,
# runs COMMAND with SLURM_CONF pointing at the cluster (sbatch, srun, squeue, scontrol, scancel
# then talk to it alone), stops the daemons and exits with COMMAND's status.
#
#   scripts/slurm/local_cluster.sh DIR COMMAND [ARGS...]
#   CPUS=N   the CPUs the node offers (default 8, whatever the machine has: tasks share cores)
#
# Needs Debian's slurmctld, slurmd, slurm-client and munge (make deps installs them). Exit 77
# (CTest's "skipped") when they are missing. Requeued jobs start again after about 5 s (the
# credential lifetime, cred_expire, and a scheduler pass every second) instead of a cluster's
# two minutes.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 DIR COMMAND [ARGS...]" >&2; exit 2; }
for t in munged slurmctld slurmd sbatch srun scontrol sinfo; do
  command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || {
    echo "local_cluster: $t not found (Debian: apt-get install slurmctld slurmd slurm-client munge)"; exit 77; }
done
export PATH="$PATH:/usr/sbin"
mkdir -p "$1"
D=$(cd "$1" && pwd)
shift
rm -rf "$D/state" "$D/spool" "$D/munge" && mkdir -p "$D/state" "$D/spool" "$D/munge" "$D/log"
chmod 700 "$D/munge"
user=$(id -un)
host=$(hostname -s)
# Two free TCP ports for slurmctld and slurmd.
read -r ctld_port slurmd_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')

# munge: its own key, socket and files, so a machine's own munged (if any) is left alone.
head -c 1024 /dev/urandom >"$D/munge/munge.key"
chmod 400 "$D/munge/munge.key"
munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/munge.sock" --pid-file="$D/munge/munged.pid" \
  --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed" ||
  { echo "local_cluster: munged did not start"; exit 1; }

cat >"$D/slurm.conf" <<EOF
ClusterName=mpigpt-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.sock,cred_expire=5
CredType=cred/munge
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
NodeName=$host NodeAddr=127.0.0.1 CPUs=${CPUS:-8} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$D/slurm.conf

stop() {
  local f
  for f in "$D/slurmd.pid" "$D/slurmctld.pid" "$D/munge/munged.pid"; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 0.5
  for f in "$D/slurmd.pid" "$D/slurmctld.pid" "$D/munge/munged.pid"; do
    [ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null
  done
  return 0
}
trap stop EXIT
slurmctld -f "$SLURM_CONF" -i || { echo "local_cluster: slurmctld did not start"; cat "$D/log/slurmctld.log"; exit 1; }
slurmd -f "$SLURM_CONF" || { echo "local_cluster: slurmd did not start"; cat "$D/log/slurmd.log"; exit 1; }
for _ in $(seq 100); do
  sinfo -h -o %t 2>/dev/null | grep -qx idle && break
  sleep 0.2
done
sinfo -h -o %t 2>/dev/null | grep -qx idle || {
  echo "local_cluster: the node did not come up"; tail -n 20 "$D/log/slurmctld.log" "$D/log/slurmd.log"; exit 1; }
"$@"
