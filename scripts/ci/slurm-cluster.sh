#!/usr/bin/env bash
# A real two-node Slurm cluster on one host, for tests/test_launchers_slurm.py (CI runs this as root).
#
# Debian's munge + slurmctld + slurmd; two slurmd (`slurmd -N n1`, `-N n2`) on 127.0.0.1 with their own ports,
# spool dirs and logs, so srun/sbatch place tasks on two distinct Slurm nodes (SLURMD_NODENAME differs; the
# kernel and the hostname are the same). No GPUs (no gres), no cgroups (proctrack/linuxproc, task/none): it
# works inside a container.
#
# Idempotent: a second run finds both nodes idle and returns in about a second. It refuses to overwrite a
# slurm.conf it did not write. `slurm-cluster.sh stop` stops the daemons it started (by their pid files).
#
# Env: SLURM_CLUSTER_WAIT_S (default 60) how long to wait for both nodes to be idle;
#      SLURM_CLUSTER_PORT_BASE (default 6817): slurmctld on BASE, slurmd n1/n2 on BASE+1/BASE+2.
set -euo pipefail

WAIT_S="${SLURM_CLUSTER_WAIT_S:-60}"
PORT_BASE="${SLURM_CLUSTER_PORT_BASE:-6817}"
CONF=/etc/slurm/slurm.conf
MARK="# written by stackproof scripts/ci/slurm-cluster.sh"
STATE=/var/lib/stackproof-slurm
RUN=/run/stackproof-slurm
LOGS=/var/log/stackproof-slurm
NODES=(n1 n2)

log() { printf 'slurm-cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (installs packages, writes /etc/slurm/slurm.conf, starts daemons)"

# Alive and not a zombie (a daemon whose parent has not reaped it yet is gone for our purposes).
alive() { [ -n "$1" ] && [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status"; }
running() { [ -f "$1" ] && alive "$(cat "$1")"; }

stop_all() {
    local pidfile pid
    for pidfile in "$RUN"/slurmd-*.pid "$RUN"/slurmctld.pid; do
        [ -f "$pidfile" ] || continue
        pid="$(cat "$pidfile")"
        if alive "$pid"; then
            log "stopping $(basename "$pidfile" .pid) (pid $pid)"
            kill "$pid" 2>/dev/null || true
            # Wait until it is gone (it frees its port), then make sure.
            for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
            ! alive "$pid" || kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

if [ "${1:-}" = stop ]; then
    stop_all
    exit 0
fi

both_idle() {
    # Both nodes answer and are idle (or mixed/allocated: up and usable), none down/drained.
    local states
    states="$(timeout 10 sinfo --Node --noheader --nodes='n[1-2]' --format='%N %t' 2>/dev/null)" || return 1
    [ "$(grep -cE '^n[12] (idle|mix|alloc)$' <<<"$states")" = 2 ]
}

start=$SECONDS
if command -v sinfo >/dev/null 2>&1 && grep -qsF "$MARK" "$CONF" && running "$RUN/slurmctld.pid" && both_idle; then
    log "cluster already up: $(sinfo --noheader --format='%P %D %t %N' | tr '\n' ' ')"
    exit 0
fi

# --- packages -----------------------------------------------------------------------------------------------
missing=()
for pkg_bin in munge:munged slurmctld:slurmctld slurmd:slurmd slurm-client:sinfo; do
    command -v "${pkg_bin#*:}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pkg_bin#*:}" ] || missing+=("${pkg_bin%%:*}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]} from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: no systemd units pulling in mailers or a database.
    apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client >/dev/null
fi

# --- node names resolve (as on a real cluster, where MASTER_ADDR is the first node's name) ------------------
for node in "${NODES[@]}"; do
    if ! getent hosts "$node" >/dev/null; then
        log "adding '127.0.0.1 $node' to /etc/hosts"
        printf '127.0.0.1 %s %s\n' "$node" "# stackproof slurm-cluster.sh" >>/etc/hosts
    fi
done

# --- munge --------------------------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 0700 /etc/munge
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ---------------------------------------------------------------------------------------------
if [ -e "$CONF" ] && ! grep -qsF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away to run the test cluster here"
fi
install -d -m 0755 /etc/slurm "$STATE/ctld" "$STATE/d" "$RUN" "$LOGS"
host="$(hostname -s)"
# Each emulated node offers at least 4 CPUs (config_overrides: slurmd takes the configured count, not the
# host's), so a job can run 4 ranks per node (8 in all) on a 2-core machine, as a small fleet would.
cpus="$(nproc)"
[ "$cpus" -ge 4 ] || cpus=4
cat >"$CONF.new" <<CONF
$MARK
# Two emulated nodes on one host: a real multi-node cluster for the launcher tests. Not for production.
ClusterName=stackproof
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT_BASE
SlurmdPort=$((PORT_BASE + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
# No cgroups inside a container: track processes through /proc, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Fast to notice a dead node or a finished job, so tests do not wait on defaults meant for big clusters.
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=20
InactiveLimit=0
MinJobAge=600
KillWait=5
Waittime=0
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=$host Port=$((PORT_BASE + 1)) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=$host Port=$((PORT_BASE + 2)) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=60 State=UP OverSubscribe=YES
CONF
changed=1
if [ -f "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then changed=0; fi
mv "$CONF.new" "$CONF"
chmod 0644 "$CONF"

if [ "$changed" = 1 ]; then
    log "wrote $CONF; (re)starting the daemons"
    stop_all
    sleep 1
fi

# --- daemons ------------------------------------------------------------------------------------------------
if ! running "$RUN/slurmctld.pid"; then
    log "starting slurmctld"
    # -i: ignore state files a previous (differently configured) run may have left.
    slurmctld -i
fi
for node in "${NODES[@]}"; do
    if ! running "$RUN/slurmd-$node.pid"; then
        log "starting slurmd -N $node"
        slurmd -N "$node"
    fi
done

# --- wait for both nodes idle -------------------------------------------------------------------------------
deadline=$((SECONDS + WAIT_S))
until both_idle; do
    for pidfile in "$RUN/slurmctld.pid" "$RUN"/slurmd-n[12].pid; do
        running "$pidfile" || die "$(basename "$pidfile" .pid) is not running; its log: $(tail -n 3 "$LOGS/$(basename "$pidfile" .pid).log" 2>/dev/null)"
    done
    if [ "$SECONDS" -ge "$deadline" ]; then
        sinfo --Node --noheader --format='%N %t %E' >&2 || true
        die "nodes n1, n2 not idle after ${WAIT_S}s; logs: $LOGS/"
    fi
    # A node left down or drained by an earlier run (a killed slurmd) comes back once its slurmd answers.
    down="$(sinfo --Node --noheader --nodes='n[1-2]' --format='%N %t' 2>/dev/null |
            awk '$2 ~ /^(down|drain|drng|fail)/ {print $1}' | paste -sd, -)" || true
    [ -z "$down" ] || scontrol update nodename="$down" state=resume >/dev/null 2>&1 || true
    sleep 1
done
log "cluster up in $((SECONDS - start))s: $(sinfo --noheader --format='%P %D %t %N' | tr '\n' ' ')"
