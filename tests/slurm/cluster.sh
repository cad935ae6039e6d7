#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests marked `slurm` (Debian's slurm-wlm and
# munge, run as root):
#
#   tests/slurm/cluster.sh start    install if needed, then start munged, slurmctld and slurmd
#   tests/slurm/cluster.sh stop     stop them
#   tests/slurm/cluster.sh status   say whether the cluster answers
#   tests/slurm/cluster.sh munge    install if needed, then start munged only (shared with the
#                                   two-node cluster of tests/cluster/slurm2.sh)
#
# `start` is idempotent: what already runs is left running (unless this script rewrote
# slurm.conf, which restarts the SLURM daemons). The node declares more CPUs than the
# machine may have (SlurmdParameters=config_overrides) so that 2-4 one-CPU tasks fit anywhere.
# An /etc/slurm/slurm.conf that this script did not write is never touched: a machine with a
# real cluster keeps its own. What it shares with tests/cluster/slurm2.sh is in common.sh (sourced)
# and common.conf (copied into the conf).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
NAME=cluster.sh
CONF=/etc/slurm/slurm.conf
MARK="# Written by tests/slurm/cluster.sh"
LOG_DIR=/var/log/slurm
NODE_CPUS=${DTRAIN_TEST_SLURM_CPUS:-4}
CONF_CHANGED=0
MUNGE_STARTED=/run/dtrain-test-cluster.munged
# This cluster's daemons by their pid files (named in the conf written below): other slurmd or
# slurmctld processes on this machine (the two-node test cluster) are not ours.
PID_FILES=(/run/slurmctld.pid /run/slurmd.pid)
# shellcheck source=common.sh
. "$HERE/common.sh"

show_logs() {
    tail_logs "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log
}

install_packages() {
    if command -v sinfo >/dev/null && command -v slurmctld >/dev/null &&
        command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    need_root "installing slurm-wlm and munge"
    command -v apt-get >/dev/null || die "slurm-wlm is not installed and there is no apt-get to install it"
    echo "cluster.sh: installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update once, only when the install fails.
    apt-get install -y --no-install-recommends slurm-wlm munge >/tmp/cluster-apt.log 2>&1 ||
        { apt-get update >>/tmp/cluster-apt.log 2>&1 &&
          apt-get install -y --no-install-recommends slurm-wlm munge >>/tmp/cluster-apt.log 2>&1; } ||
        { tail -n 20 /tmp/cluster-apt.log >&2; die "apt-get install slurm-wlm munge failed"; }
}

start_munge() {
    munge_works && return 0
    need_root "starting munged"
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    if [ ! -s /etc/munge/munge.key ]; then
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key ||
            die "could not create /etc/munge/munge.key"
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged || { show_logs; die "munged did not start"; }
    touch "$MUNGE_STARTED"  # so that `stop` stops only the munged this script started
    for _ in $(seq 50); do munge_works && return 0; sleep 0.2; done
    show_logs
    die "munged started but munge -n | unmunge fails"
}

write_conf() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        echo "cluster.sh: $CONF was not written by this script; using that cluster as it is"
        return 1
    fi
    local node
    node=$(hostname -s)
    install -d /etc/slurm "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
    local tmp
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
$MARK: a one-node test cluster.
# Delete this file to let the script write a fresh one.
ClusterName=dtraintest
SlurmctldHost=$node(127.0.0.1)
EOF
    cat "$HERE/common.conf" >>"$tmp"
    cat >>"$tmp" <<EOF
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    install_conf "$tmp" "node $node, $NODE_CPUS CPUs"
}

start_daemons() {
    restart_for_new_conf
    start_slurmctld
    if ! pid_alive /run/slurmd.pid; then
        need_root "starting slurmd"
        slurmd || { show_logs; die "slurmd did not start"; }
    fi
    wait_for_nodes "$(hostname -s)"
}

start() {
    install_packages
    start_munge
    if write_conf; then
        start_daemons
    else
        ctld_up || die "the configured cluster does not answer scontrol ping"
    fi
    echo "cluster.sh: cluster up: $(sinfo -h -N -o '%N %T, %c CPUs' | head -n 1)"
}

stop() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF was not written by this script; not stopping that cluster"
    fi
    stop_daemons
    if [ -f "$MUNGE_STARTED" ] && [ -f /run/munge/munged.pid ] &&
        kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        kill "$(cat /run/munge/munged.pid)"
    fi
    rm -f "$MUNGE_STARTED"
    echo "cluster.sh: stopped"
}

status() {
    if ctld_up; then
        echo "cluster.sh: up: $(sinfo -h -N -o '%N %T, %c CPUs' | head -n 1)"
    else
        echo "cluster.sh: down"
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    munge) install_packages; start_munge ;;
    *) echo "usage: $0 start|stop|status|munge" >&2; exit 2 ;;
esac
