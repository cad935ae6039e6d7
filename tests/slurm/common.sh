# Shell code shared by the test clusters' scripts (tests/slurm/cluster.sh, one node, and
# tests/cluster/slurm2.sh, two nodes), sourced by both. Each script sets, before calling these:
#
#   NAME        its name in messages ("cluster.sh")
#   CONF        the slurm.conf it writes (clients find it through SLURM_CONF or its default place)
#   PID_FILES   an array: the pid files of its slurmctld and slurmd(s)
#   CONF_CHANGED=0, set to 1 by install_conf when the conf is new
#
# and a function show_logs that prints the last lines of its daemons' logs (tail_logs helps).

die() {
    echo "$NAME: $*" >&2
    exit 1
}

need_root() {
    [ "$(id -u)" = 0 ] || die "$1 needs root (run it with sudo)"
}

tail_logs() {  # tail_logs FILE...: the last lines of those that exist, on stderr
    local f
    for f in "$@"; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

munge_works() {
    command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

any_daemon_runs() {
    local pid_file
    for pid_file in "${PID_FILES[@]}"; do pid_alive "$pid_file" && return 0; done
    return 1
}

ctld_up() {
    scontrol ping 2>/dev/null | grep -q "UP"
}

# install_conf TMP WHAT: TMP becomes $CONF unless it says the same (then a restart is not needed).
install_conf() {
    if [ -f "$CONF" ] && cmp -s "$1" "$CONF"; then
        rm -f "$1"
    else
        mv "$1" "$CONF"
        chmod 0644 "$CONF"
        echo "$NAME: wrote $CONF ($2)"
        CONF_CHANGED=1
    fi
}

stop_daemons() {
    # scontrol shutdown stops the cluster's slurmctld and every slurmd it knows; what is left
    # after 10 s gets a SIGTERM.
    if ctld_up; then
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    for _ in $(seq 50); do
        any_daemon_runs || break
        sleep 0.2
    done
    local pid_file
    for pid_file in "${PID_FILES[@]}"; do
        if pid_alive "$pid_file"; then
            kill "$(cat "$pid_file")"
        fi
    done
}

restart_for_new_conf() {
    if [ "$CONF_CHANGED" = 1 ] && { ctld_up || any_daemon_runs; }; then
        echo "$NAME: restarting the daemons for the new $CONF"
        stop_daemons
    fi
}

start_slurmctld() {  # start_slurmctld [ARG...]: unless one answers already
    ctld_up && return 0
    need_root "starting slurmctld"
    slurmctld "$@" || { show_logs; die "slurmctld did not start"; }
    for _ in $(seq 50); do ctld_up && break; sleep 0.2; done
    ctld_up || { show_logs; die "slurmctld started but 'scontrol ping' does not answer"; }
}

node_states() {  # "dtn1 idle dtn2 idle "
    sinfo -h -N -o "%N %T" 2>/dev/null | tr '\n' ' '
}

nodes_ready() {  # nodes_ready STATES NODE...: every NODE is idle, mixed or allocated in STATES
    local states=$1 node
    shift
    for node in "$@"; do
        case " $states" in
            *" $node idle"* | *" $node mixed"* | *" $node allocated"*) ;;
            *) return 1 ;;
        esac
    done
}

wait_for_nodes() {  # wait_for_nodes NODE...: until all take jobs (30 s at most)
    local states="" node
    for _ in $(seq 100); do
        states=$(node_states)
        nodes_ready "$states" "$@" && return 0
        for node in "$@"; do
            case " $states" in
                *" $node down"* | *" $node drain"*)
                    # A node left down by an earlier, unclean stop: bring it back.
                    scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
            esac
        done
        sleep 0.3
    done
    show_logs
    sinfo -N -l >&2 || true
    die "the nodes did not become idle (states: ${states:-unknown})"
}
