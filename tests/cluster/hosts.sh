#!/usr/bin/env bash
# Test "hosts" on this machine: Linux network namespaces joined by a private bridge, so that
# multi-node runs (two torchrun agents, a two-node SLURM cluster) talk over a real network with
# real host names instead of sharing 127.0.0.1. Root only.
#
#   tests/cluster/hosts.sh up [N]        create N hosts (2 or 3; default $DTRAIN_TEST_HOSTS or 2)
#   tests/cluster/hosts.sh down          remove everything `up` created (and stop what runs there)
#   tests/cluster/hosts.sh status        one line per host; exit 1 unless at least 2 are up
#   tests/cluster/hosts.sh exec HOST CMD [ARG ...]
#                                        run CMD on HOST: in its network namespace, with its
#                                        /etc/hosts, in a UTS namespace of its own named HOST
#
# Host dtnI is the network namespace dtnI with address 10.213.7.(10+I)/24 on eth0, a veth whose
# other end (dtvI) is a port of the bridge dtbr0; the root namespace has 10.213.7.1 on the
# bridge, so that slurmctld and the tests reach the hosts. No default route, no NAT, no
# forwarding: nothing leaves the machine. /etc/netns/dtnI/hosts (bind-mounted over /etc/hosts by
# `exec`, as `ip netns exec` would) names every test host and localhost, so each host name
# resolves to its own address on every host; `exec` also gives each process the host name, which
# torchrun's c10d rendezvous (who hosts the store) and gloo (which interface) go by.
#
# `up` is idempotent and repairs a half-made host. Everything it creates is marked (the links'
# alias, a marker line in the hosts files, /run/dtrain-test-hosts/): `down` removes only marked
# things. When namespaces cannot be made here (not root, no `ip netns`, no CAP_NET_ADMIN), `up`
# exits 1 with one line saying why.
set -euo pipefail

PREFIX=10.213.7
NET=$PREFIX.0/24
GATEWAY=$PREFIX.1
BRIDGE=dtbr0
ALIAS=dtrain-test-hosts
STATE=/run/dtrain-test-hosts
MARK="# Written by tests/cluster/hosts.sh"
MAX_HOSTS=3

die() {
    echo "hosts.sh: $*" >&2
    exit 1
}

host_ip() { echo "$PREFIX.$((10 + ${1#dtn}))"; }

known_hosts() {  # the hosts `up` made, in order
    local i
    for i in $(seq "$MAX_HOSTS"); do
        [ -e "$STATE/dtn$i" ] && echo "dtn$i"
    done
    return 0
}

ns_exists() { [ -e "/run/netns/$1" ]; }

first_line() { head -n 1 | tr -s '[:space:]' ' ' | sed 's/ $//'; }

check_can_make_namespaces() {
    [ "$(id -u)" = 0 ] || die "cannot make test hosts: needs root (network namespaces; run it with sudo)"
    command -v ip >/dev/null || die "cannot make test hosts: no 'ip' command (install iproute2)"
    command -v unshare >/dev/null || die "cannot make test hosts: no 'unshare' command (install util-linux)"
    ip netns list >/dev/null 2>&1 || die "cannot make test hosts: this 'ip' has no 'netns' command"
    local probe=dtprobe$$ err
    if ! err=$(ip netns add "$probe" 2>&1); then
        die "cannot make test hosts: 'ip netns add' failed: $(echo "$err" | first_line)"
    fi
    if ! err=$(ip link add "dtp$$" type veth peer name "dtq$$" 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        die "cannot make test hosts: 'ip link add ... type veth' failed (no CAP_NET_ADMIN?): $(echo "$err" | first_line)"
    fi
    ip link del "dtp$$" 2>/dev/null || true
    if ! err=$(unshare --mount --propagation slave --uts -- nsenter --net="/run/netns/$probe" -- true 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        die "cannot make test hosts: 'unshare --mount --uts' + 'nsenter --net' failed: $(echo "$err" | first_line)"
    fi
    ip netns del "$probe"
}

check_subnet_free() {
    # Our own bridge may hold the gateway address already; any other use of the /24 is a conflict.
    local used
    used=$( { ip -4 -o addr show; ip -4 route show; } | grep -F "$PREFIX." | grep -vw "$BRIDGE" || true)
    [ -z "$used" ] || die "cannot make test hosts: $NET is already used on this machine: $(echo "$used" | first_line)"
}

link_is_ours() { ip -o link show "$1" 2>/dev/null | grep -q "alias $ALIAS"; }

make_bridge() {
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        link_is_ours "$BRIDGE" || die "cannot make test hosts: a link named $BRIDGE exists and was not made by this script"
    else
        ip link add "$BRIDGE" type bridge
        ip link set "$BRIDGE" alias "$ALIAS"
    fi
    ip -4 addr show dev "$BRIDGE" | grep -qF "inet $GATEWAY/24" || ip addr add "$GATEWAY/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

write_hosts_file() {  # /etc/netns/<ns>/hosts: localhost and every test host
    local ns=$1 count=$2 i tmp
    install -d -m 0755 "/etc/netns/$ns"
    tmp=$(mktemp)
    {
        echo "$MARK: the test host $ns."
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        for i in $(seq "$count"); do echo "$(host_ip "dtn$i") dtn$i"; done
    } >"$tmp"
    chmod 0644 "$tmp"
    mv "$tmp" "/etc/netns/$ns/hosts"
}

make_host() {
    local ns=$1 ip veth peer
    ip=$(host_ip "$ns")
    veth=dtv${ns#dtn}
    peer=dtv${ns#dtn}p
    mkdir -p "$STATE"
    if ! ns_exists "$ns"; then
        ip netns add "$ns"
    fi
    touch "$STATE/$ns"
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        # A root end left from a half-made host goes first (deleting it deletes its peer).
        if ip link show "$veth" >/dev/null 2>&1; then
            link_is_ours "$veth" || die "cannot make test hosts: a link named $veth exists and was not made by this script"
            ip link del "$veth"
        fi
        ip link add "$veth" type veth peer name "$peer"
        ip link set "$veth" alias "$ALIAS"
        ip link set "$peer" netns "$ns"
        ip -n "$ns" link set "$peer" name eth0
    fi
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
    ip -n "$ns" -4 addr show dev eth0 | grep -qF "inet $ip/24" || ip -n "$ns" addr add "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
}

check_connectivity() {  # a TCP connection from the last host to the first, through the bridge
    local first=$1 last=$2 port=29999 listener
    command -v python3 >/dev/null || return 0
    in_host "$first" python3 -c '
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
s.settimeout(15)
c, _ = s.accept()
c.sendall(socket.gethostname().encode())
' "$port" &
    listener=$!
    local answer="" _
    for _ in $(seq 100); do
        answer=$(in_host "$last" timeout 2 bash -c "exec 3<>/dev/tcp/$(host_ip "$first")/$port && cat <&3" 2>/dev/null) && break
        sleep 0.1
    done
    wait "$listener" 2>/dev/null || true
    [ "$answer" = "$first" ] ||
        die "the test hosts are up but $last cannot reach $first at $(host_ip "$first"):$port (got '${answer}')"
}

# CMD on HOST: a mount namespace of its own (mounts from outside still reach it, its own do not
# leak out) where HOST's hosts file is /etc/hosts, a UTS namespace named HOST, HOST's network
# namespace. Not `ip netns exec`: that also mounts a fresh /sys without /sys/fs/cgroup, which
# slurmd needs. Every step execs, so the caller's process becomes CMD (same pid, for signals).
# shellcheck disable=SC2016 # expanded by the inner sh
HOST_EXEC='mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec nsenter --net="/run/netns/$0" -- "$@"'

in_host() {  # in_host HOST CMD...
    local ns=$1
    shift
    ns_exists "$ns" || die "no test host $ns (run: $0 up)"
    unshare --mount --propagation slave --uts -- sh -c "$HOST_EXEC" "$ns" "$@"
}

up() {
    local count=${1:-${DTRAIN_TEST_HOSTS:-2}} i
    case "$count" in 2 | 3) ;; *) die "up: 2 or 3 hosts, not '$count'" ;; esac
    check_can_make_namespaces
    check_subnet_free
    make_bridge
    for i in $(seq "$count"); do
        make_host "dtn$i"
    done
    # Every host's hosts file names every host (also one made by an earlier `up 3`).
    local all
    all=$(known_hosts | wc -l)
    for i in $(seq "$all"); do write_hosts_file "dtn$i" "$all"; done
    check_connectivity dtn1 "dtn$count"
    echo "hosts.sh: up: $(for h in $(known_hosts); do printf '%s %s, ' "$h" "$(host_ip "$h")"; done)bridge $BRIDGE $GATEWAY"
}

down() {
    [ "$(id -u)" = 0 ] || die "down needs root"
    local ns pids
    for ns in $(known_hosts); do
        if ns_exists "$ns"; then
            # A host going away takes its processes with it (as when a machine is switched off).
            pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
            if [ -n "${pids// /}" ]; then
                echo "hosts.sh: stopping what still runs on $ns: $pids"
                # shellcheck disable=SC2086
                kill $pids 2>/dev/null || true
                for _ in $(seq 50); do
                    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
                    sleep 0.1
                done
                pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
                # shellcheck disable=SC2086
                [ -z "${pids// /}" ] || kill -9 $pids 2>/dev/null || true
            fi
        fi
        # The veth first (its peer goes with it); a namespace's links vanish only some time after
        # the namespace is deleted.
        local veth=dtv${ns#dtn}
        if link_is_ours "$veth"; then ip link del "$veth" 2>/dev/null || ! ip link show "$veth" >/dev/null 2>&1; fi
        if ns_exists "$ns"; then ip netns del "$ns"; fi
        if [ -f "/etc/netns/$ns/hosts" ] && head -n 1 "/etc/netns/$ns/hosts" | grep -qF "$MARK"; then
            rm -f "/etc/netns/$ns/hosts"
            rmdir "/etc/netns/$ns" 2>/dev/null || true
        fi
        rm -f "$STATE/$ns"
    done
    rmdir /etc/netns 2>/dev/null || true
    if link_is_ours "$BRIDGE"; then ip link del "$BRIDGE"; fi
    rmdir "$STATE" 2>/dev/null || true
    echo "hosts.sh: down"
}

status() {
    local ns up_count=0 ip
    for ns in $(known_hosts); do
        ip=$(host_ip "$ns")
        if ns_exists "$ns" && ip -n "$ns" -4 addr show dev eth0 2>/dev/null | grep -qF "inet $ip/24"; then
            echo "$ns $ip up"
            up_count=$((up_count + 1))
        else
            echo "$ns $ip down"
        fi
    done
    if [ "$up_count" -lt 2 ] || ! link_is_ours "$BRIDGE"; then
        echo "hosts.sh: down (run: $0 up)"
        return 1
    fi
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    status) status ;;
    exec)
        [ $# -ge 3 ] || die "usage: $0 exec HOST CMD [ARG ...]"
        shift
        host=$1
        shift
        [ "$(id -u)" = 0 ] || die "exec needs root"
        ns_exists "$host" || die "no test host $host (run: $0 up)"
        exec unshare --mount --propagation slave --uts -- sh -c "$HOST_EXEC" "$host" "$@"
        ;;
    *) echo "usage: $0 up [2|3] | down | status | exec HOST CMD [ARG ...]" >&2; exit 2 ;;
esac
