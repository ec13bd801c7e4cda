#!/usr/bin/env bash
# Real links between "nodes" on one machine, for the CI: network namespaces <prefix>0..N-1, each with its own
# address (10.77.0.(i+1)/24 on eth0, a veth pair) and a bridge joining them in a namespace of its own
# (<prefix>-switch), so nothing is added to the host's own namespace. No default route anywhere: the nodes reach
# each other and nothing else. Then one node's link is degraded, both ways: a rate limit (tc tbf on its eth0 and
# on its bridge port) or random packet loss (iptables -m statistic, on its INPUT and OUTPUT); this kernel has no
# netem, so no added delay. tests/test_netns.py runs a multi-node validate across them.
#
#   scripts/ci/netns.sh up 3            # the namespaces, their links and the bridge (replaces any left over)
#   scripts/ci/netns.sh slow 1 50mbit   # node 1's link rate-limited
#   scripts/ci/netns.sh lossy 1 0.05    # node 1 drops 5% of its packets each way
#   scripts/ci/netns.sh clean 1         # node 1's link as it was
#   scripts/ci/netns.sh exec 0 CMD...   # CMD inside node 0's namespace
#   scripts/ci/netns.sh down            # every namespace of the prefix, gone
#
# Env: NETNS_PREFIX (default spnode). Needs root, ip (iproute2), tc, iptables, ping, ethtool (`deps` installs them).
set -euo pipefail

prefix="${NETNS_PREFIX:-spnode}"
switch="$prefix-switch"
subnet=10.77.0

address() { echo "$subnet.$(($1 + 1))"; }

down() {
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$prefix([0-9]+|-switch)$" || true); do
        ip netns del "$ns"  # its interfaces go with it, and their veth peers
    done
}

up() {
    local nodes="${1:-3}" i
    down
    ip netns add "$switch"
    ip -n "$switch" link add br0 type bridge
    ip -n "$switch" link set br0 up
    ip -n "$switch" link set lo up
    for ((i = 0; i < nodes; i++)); do
        ip netns add "$prefix$i"
        # Created inside the node's namespace, the peer moved to the switch's: never in the host's namespace.
        ip -n "$prefix$i" link add eth0 type veth peer name "p$i" netns "$switch"
        ip -n "$prefix$i" addr add "$(address "$i")/24" dev eth0
        ip -n "$prefix$i" link set eth0 up
        ip -n "$prefix$i" link set lo up
        ip -n "$switch" link set "p$i" master br0
        ip -n "$switch" link set "p$i" up
    done
    for ((i = 0; i < nodes; i++)); do  # every node reaches every other before anything runs on them
        ip netns exec "$prefix$i" ping -c 1 -W 2 "$(address $(((i + 1) % nodes)))" >/dev/null
    done
}

clean() {
    local node="$1"
    ip netns exec "$prefix$node" tc qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$switch" tc qdisc del dev "p$node" root 2>/dev/null || true
    ip netns exec "$prefix$node" iptables -F INPUT
    ip netns exec "$prefix$node" iptables -F OUTPUT
    ip netns exec "$prefix$node" ethtool -K eth0 tso on gso on >/dev/null
}

slow() {
    local node="$1" rate="${2:-50mbit}"
    clean "$node"
    # tbf shapes what leaves an interface: the node's eth0 (its sends) and its bridge port (what it receives).
    ip netns exec "$prefix$node" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kb latency 200ms
    ip netns exec "$switch" tc qdisc add dev "p$node" root tbf rate "$rate" burst 64kb latency 200ms
}

lossy() {
    local node="$1" probability="${2:-0.05}"
    clean "$node"
    # Per wire packet, as on a real lossy link: with segmentation offload a "packet" here is a 64 KiB burst.
    ip netns exec "$prefix$node" ethtool -K eth0 tso off gso off >/dev/null
    ip netns exec "$prefix$node" iptables -A INPUT -i eth0 -m statistic --mode random --probability "$probability" \
        -j DROP
    ip netns exec "$prefix$node" iptables -A OUTPUT -o eth0 -m statistic --mode random --probability "$probability" \
        -j DROP
}

deps() {
    local tool
    for tool in ip tc iptables ping ethtool; do
        command -v "$tool" >/dev/null || {
            apt-get install -y -qq --no-install-recommends iproute2 iptables iputils-ping ethtool >/dev/null
            return
        }
    done
}

command="${1:?usage: scripts/ci/netns.sh up [N] | slow NODE [RATE] | lossy NODE [P] | clean NODE | exec NODE CMD... | down | deps}"
shift
case "$command" in
    up | down | slow | lossy | clean | deps) "$command" "$@" ;;
    exec) node="$1"; shift; exec ip netns exec "$prefix$node" "$@" ;;
    *) echo "scripts/ci/netns.sh: unknown command $command" >&2; exit 2 ;;
esac
