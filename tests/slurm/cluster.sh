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
# real cluster keeps its own.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CONF=/etc/slurm/slurm.conf
MARK="# Written by tests/slurm/cluster.sh"
LOG_DIR=/var/log/slurm
NODE_CPUS=${DTRAIN_TEST_SLURM_CPUS:-4}
CONF_CHANGED=0
MUNGE_STARTED=/run/dtrain-test-cluster.munged

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

show_logs() {
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

need_root() {
    [ "$(id -u)" = 0 ] || die "$1 needs root (run it with sudo)"
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

munge_works() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
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
    if [ -f "$CONF" ] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        mv "$tmp" "$CONF"
        chmod 0644 "$CONF"
        echo "cluster.sh: wrote $CONF (node $node, $NODE_CPUS CPUs)"
        CONF_CHANGED=1
    fi
}

ctld_up() {
    scontrol ping 2>/dev/null | grep -q "UP"
}

node_state() {
    sinfo -h -N -o "%T" 2>/dev/null | head -n 1
}

stop_daemons() {
    # scontrol shutdown stops slurmctld and every slurmd it knows.
    if ctld_up; then
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    for _ in $(seq 50); do
        daemon_runs slurmctld || daemon_runs slurmd || break
        sleep 0.2
    done
    for daemon in slurmd slurmctld; do
        if daemon_runs "$daemon"; then
            kill "$(cat "/run/$daemon.pid")"
        fi
    done
}

# This cluster's daemons by their pid files (named in the conf written below): other slurmd or
# slurmctld processes on this machine (the two-node test cluster) are not ours.
daemon_runs() {
    local pid_file=/run/$1.pid
    [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null
}

start_daemons() {
    if [ "$CONF_CHANGED" = 1 ] && { ctld_up || daemon_runs slurmd; }; then
        echo "cluster.sh: restarting the daemons for the new $CONF"
        stop_daemons
    fi
    if ! ctld_up; then
        need_root "starting slurmctld"
        slurmctld || { show_logs; die "slurmctld did not start"; }
        for _ in $(seq 50); do ctld_up && break; sleep 0.2; done
        ctld_up || { show_logs; die "slurmctld started but scontrol ping does not answer"; }
    fi
    if ! daemon_runs slurmd; then
        need_root "starting slurmd"
        slurmd || { show_logs; die "slurmd did not start"; }
    fi
    local state=""
    for _ in $(seq 100); do
        state=$(node_state)
        case "$state" in
            idle* | mixed* | allocated*) return 0 ;;
            down* | drain*)
                # A node left down by an earlier, unclean stop: bring it back once.
                scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true ;;
        esac
        sleep 0.3
    done
    show_logs
    sinfo -N -l >&2 || true
    die "the node did not become idle (state: ${state:-unknown})"
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
