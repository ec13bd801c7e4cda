#!/usr/bin/env bash
# A real Slurm cluster of three nodes on one host, for tests/test_launchers_slurm.py and
# tests/test_localize_slurm.py (CI runs this as root).
#
# Debian's munge + slurmctld + slurmd; three slurmd (`slurmd -N n1`, `-N n2`, `-N n3`) on 127.0.0.1 with their own ports,
# spool dirs and logs, so srun/sbatch place tasks on two distinct Slurm nodes (SLURMD_NODENAME differs; the
# kernel and the hostname are the same). No GPUs (no gres), no cgroups (proctrack/linuxproc, task/none): it
# works inside a container.
#
# Partitions: `debug` (the default) is n[1-2], what the launcher tests place jobs on; `trio` is n[1-3], for the
# localization tests (a slow link is told from a slow node only with a third node).
#
# Idempotent: a second run finds every node up and returns in about a second. A node another test drained on
# purpose (scontrol ... state=drain, e.g. the health-check mode's tests) counts as up and is left drained: this
# script resumes only nodes Slurm itself marked down or drained (a slurmd that stopped answering). It refuses to overwrite a
# slurm.conf it did not write. `slurm-cluster.sh stop` stops the daemons it started (by their pid files).
#
# Env: SLURM_CLUSTER_WAIT_S (default 60) how long to wait for both nodes to be idle;
#      SLURM_CLUSTER_PORT_BASE (default 6817): slurmctld on BASE, slurmd n1/n2/n3 on BASE+1..BASE+3;
#      SLURM_CONF (default /etc/slurm/slurm.conf) and SLURM_CLUSTER_NAME (default stackproof): a second,
#      separate cluster on the same host (its own conf, state, pid and log dirs) takes both plus its own ports;
#      Slurm's commands find it through the same SLURM_CONF.
#      SLURM_CLUSTER_EXTRA_CONF: lines appended to that slurm.conf (tests/test_act_slurm.py gives its own
#      cluster a HealthCheckProgram and a Prolog this way); a change restarts the daemons.
set -euo pipefail

WAIT_S="${SLURM_CLUSTER_WAIT_S:-60}"
PORT_BASE="${SLURM_CLUSTER_PORT_BASE:-6817}"
CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
NAME="${SLURM_CLUSTER_NAME:-stackproof}"
MARK="# written by stackproof scripts/ci/slurm-cluster.sh"
STATE="/var/lib/$NAME-slurm"
RUN="/run/$NAME-slurm"
LOGS="/var/log/$NAME-slurm"
export SLURM_CONF="$CONF"  # the daemons and sinfo/scontrol below read this cluster's conf
NODES=(n1 n2 n3)

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

all_up() {
    # Every node's slurmd answers: idle, mixed or allocated, or drained on purpose by someone (not by Slurm).
    local states
    # sort -u: sinfo --Node prints a node once per partition it is in (n1, n2 are in debug and trio).
    states="$(timeout 10 sinfo --Node --noheader --nodes='n[1-3]' --format='%N %t' 2>/dev/null | sort -u)" || return 1
    [ "$(grep -cE '^n[123] (idle|mix|alloc|drain|drng|drained)$' <<<"$states")" = "${#NODES[@]}" ] && [ -z "$(lost)" ]
}

# Nodes Slurm took out itself (down, or drained because their slurmd stopped answering or a task could not be
# killed): these come back once their slurmd answers. A drain with any other reason is someone's decision.
lost() {
    timeout 10 sinfo --Node --noheader --nodes='n[1-3]' --format='%N|%t|%E' 2>/dev/null |
        awk -F'|' '$2 ~ /^(down|fail)/ || ($2 ~ /^drain/ && $3 ~ /^(Not responding|Kill task failed|Node unexpectedly rebooted)/) {print $1}' |
        paste -sd, -
}

start=$SECONDS
if command -v sinfo >/dev/null 2>&1 && grep -qsF "$MARK" "$CONF" && running "$RUN/slurmctld.pid" && all_up; then
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
install -d -m 0755 "$(dirname "$CONF")" "$STATE/ctld" "$STATE/d" "$RUN" "$LOGS"
host="$(hostname -s)"
# Each emulated node offers at least 4 CPUs (config_overrides: slurmd takes the configured count, not the
# host's), so a job can run 4 ranks per node (8 in all) on a 2-core machine, as a small fleet would.
cpus="$(nproc)"
[ "$cpus" -ge 4 ] || cpus=4
cat >"$CONF.new" <<CONF
$MARK
# Two emulated nodes on one host: a real multi-node cluster for the launcher tests. Not for production.
ClusterName=$NAME
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
NodeName=n3 NodeAddr=127.0.0.1 NodeHostname=$host Port=$((PORT_BASE + 3)) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=60 State=UP OverSubscribe=YES
PartitionName=trio Nodes=n[1-3] MaxTime=60 State=UP OverSubscribe=YES
${SLURM_CLUSTER_EXTRA_CONF:-}
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

# --- wait for every node up -------------------------------------------------------------------------------
deadline=$((SECONDS + WAIT_S))
until all_up; do
    for pidfile in "$RUN/slurmctld.pid" "$RUN"/slurmd-n[123].pid; do
        running "$pidfile" || die "$(basename "$pidfile" .pid) is not running; its log: $(tail -n 3 "$LOGS/$(basename "$pidfile" .pid).log" 2>/dev/null)"
    done
    if [ "$SECONDS" -ge "$deadline" ]; then
        sinfo --Node --noheader --format='%N %t %E' >&2 || true
        die "nodes ${NODES[*]} not up after ${WAIT_S}s; logs: $LOGS/"
    fi
    # A node left down by an earlier run (a killed slurmd) comes back once its slurmd answers.
    down="$(lost)" || true
    [ -z "$down" ] || scontrol update nodename="$down" state=resume >/dev/null 2>&1 || true
    sleep 1
done
log "cluster up in $((SECONDS - start))s: $(sinfo --noheader --format='%P %D %t %N' | tr '\n' ' ')"
