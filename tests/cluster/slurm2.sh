#!/usr/bin/env bash
# A two-node SLURM cluster on the test hosts of tests/cluster/hosts.sh, for the tests marked
# `cluster` (Debian's slurm-wlm and munge, run as root):
#
#   tests/cluster/slurm2.sh start    make the hosts, start munged (shared), slurmctld, 2 slurmd
#   tests/cluster/slurm2.sh stop     cancel its jobs, stop its daemons (the hosts stay; munged
#                                    too, unless `start` started it and the one-node cluster is down)
#   tests/cluster/slurm2.sh status   say whether both nodes answer
#   tests/cluster/slurm2.sh env      print the line that points SLURM's commands at it:
#                                      eval "$(tests/cluster/slurm2.sh env)"; sinfo -N
#
# It lives beside the one-node cluster of tests/slurm/cluster.sh (/etc/slurm/slurm.conf, ports
# 6817/6818) and never touches it: its own conf $CONF (clients find it through SLURM_CONF,
# the daemons through -f), ClusterName, ports, state and spool directories, pid and log files.
# slurmctld runs in the root namespace on the bridge address 10.213.7.1; slurmd runs on each of
# the hosts dtn1 and dtn2 (its network namespace, its /etc/hosts, its host name), as
# NodeName=dtnI NodeAddr=10.213.7.(10+I). munged is shared (tests/slurm/cluster.sh munge).
# `start` is idempotent; when something does not come up it shows the daemons' logs.
# The shell code both clusters share is tests/slurm/common.sh (sourced).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
NAME=slurm2.sh
HOSTS_SH=$HERE/hosts.sh
ONE_NODE_SH=$HERE/../slurm/cluster.sh
CONF_DIR=/etc/slurm-dtrain2
CONF=$CONF_DIR/slurm.conf
MARK="# Written by tests/cluster/slurm2.sh"
CLUSTER=dtrain2
NODES=(dtn1 dtn2)
GATEWAY=10.213.7.1
CTLD_PORT=6827
SLURMD_PORT=6828
LOG_DIR=/var/log/slurm-dtrain2
STATE_DIR=/var/spool/slurmctld-dtrain2
SPOOL_DIR=/var/spool/slurmd-dtrain2
CTLD_PID=/run/slurmctld-dtrain2.pid
NODE_CPUS=${DTRAIN_TEST_SLURM_CPUS:-4}
CONF_CHANGED=0
MUNGE_STARTED=/run/dtrain-test-cluster2.munged
export SLURM_CONF=$CONF

node_ip() { echo "10.213.7.$((10 + ${1#dtn}))"; }
slurmd_pid_file() { echo "/run/slurmd-dtrain2-$1.pid"; }

PID_FILES=("$CTLD_PID")
for node in "${NODES[@]}"; do PID_FILES+=("$(slurmd_pid_file "$node")"); done
# shellcheck source=../slurm/common.sh
. "$HERE/../slurm/common.sh"

show_logs() {
    local node
    tail_logs "$LOG_DIR/slurmctld.log" $(for node in "${NODES[@]}"; do echo "$LOG_DIR/slurmd-$node.log"; done)
}

write_conf() {
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF was not written by this script; not touching it"
    fi
    local ctl_host nodes node tmp
    ctl_host=$(hostname -s)
    install -d "$CONF_DIR" "$LOG_DIR" "$STATE_DIR"
    for node in "${NODES[@]}"; do install -d "$SPOOL_DIR/$node"; done
    nodes=$(IFS=,; echo "${NODES[*]}")
    tmp=$(mktemp)
    {
        cat <<CONF
$MARK: a two-node test cluster on the hosts of
# tests/cluster/hosts.sh. Delete this file to let the script write a fresh one.
ClusterName=$CLUSTER
# slurmctld runs in the root namespace (this machine's host name), reached on the bridge.
SlurmctldHost=$ctl_host($GATEWAY)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
CONF
        cat "$HERE/../slurm/common.conf"
        cat <<CONF
StateSaveLocation=$STATE_DIR
# %n: the node's name, so that the two slurmd on this one machine keep apart.
SlurmdSpoolDir=$SPOOL_DIR/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/slurmd-dtrain2-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
CONF
        for node in "${NODES[@]}"; do
            echo "NodeName=$node NodeAddr=$(node_ip "$node") CPUs=$NODE_CPUS RealMemory=4000 State=UNKNOWN"
        done
        echo "PartitionName=two Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
    } >"$tmp"
    install_conf "$tmp" "nodes $nodes, $NODE_CPUS CPUs each"
}

cancel_jobs() {
    # Before the daemons stop: the jobs' steps run on the hosts and would outlive them.
    ctld_up || return 0
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    [ -n "${jobs// /}" ] || return 0
    echo "slurm2.sh: cancelling jobs $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 100); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
    done
}

start_daemons() {
    local node
    if [ "$CONF_CHANGED" = 1 ]; then cancel_jobs; fi
    restart_for_new_conf
    start_slurmctld -f "$CONF"
    for node in "${NODES[@]}"; do
        if ! pid_alive "$(slurmd_pid_file "$node")"; then
            "$HOSTS_SH" exec "$node" slurmd -f "$CONF" -N "$node" ||
                { show_logs; die "slurmd did not start on $node"; }
        fi
    done
    wait_for_nodes "${NODES[@]}"
}

start() {
    need_root "starting the two-node cluster"
    "$HOSTS_SH" up >/dev/null || die "the test hosts could not be made (see above)"
    if ! munge_works; then
        "$ONE_NODE_SH" munge || die "munged could not be started (tests/slurm/cluster.sh munge)"
        touch "$MUNGE_STARTED"  # so that `stop` stops it again, unless the one-node cluster uses it
    fi
    write_conf
    start_daemons
    echo "slurm2.sh: cluster $CLUSTER up: $(sinfo -h -N -o '%N %T, %c CPUs' | tr '\n' ';' | sed 's/;$//; s/;/; /g') (SLURM_CONF=$CONF)"
}

stop() {
    need_root "stopping the two-node cluster"
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF was not written by this script; not stopping that cluster"
    fi
    [ -f "$CONF" ] || { echo "slurm2.sh: stopped (never configured)"; return 0; }
    cancel_jobs
    stop_daemons
    if [ -f "$MUNGE_STARTED" ]; then
        rm -f "$MUNGE_STARTED"
        if SLURM_CONF=/etc/slurm/slurm.conf scontrol ping 2>/dev/null | grep -q UP; then
            echo "slurm2.sh: leaving munged running for the one-node cluster"
        elif [ -f /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
            kill "$(cat /run/munge/munged.pid)"
            rm -f /run/dtrain-test-cluster.munged  # tests/slurm/cluster.sh's mark of the same munged
        fi
    fi
    echo "slurm2.sh: stopped"
}

status() {
    if ! ctld_up; then
        echo "slurm2.sh: down (slurmctld of $CONF does not answer)"
        return 1
    fi
    local states
    states=$(node_states)
    nodes_ready "$states" "${NODES[@]}" ||
        { echo "slurm2.sh: not ready: nodes ${states:-unknown}"; return 1; }
    echo "slurm2.sh: up: $states(SLURM_CONF=$CONF)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
