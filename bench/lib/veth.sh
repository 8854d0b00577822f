# Sourced by bench/fs.sh, bench/fs-path.sh and bench/fs-xdp.sh: two network
# namespaces joined by a veth pair (AF_XDP on a veth runs in copy mode), and
# their teardown.

# veth_pair NS_A NS_B DEV_A DEV_B [ADDR_A/PREFIX ADDR_B/PREFIX]: creates
# both namespaces (loopback up), the pair DEV_A in NS_A and DEV_B in NS_B,
# up, with the addresses when given.
veth_pair() {
    local a=$1 b=$2 va=$3 vb=$4 ns
    ip netns add "$a"
    ip netns add "$b"
    ip link add "$va" netns "$a" type veth peer name "$vb" netns "$b"
    if [ -n "${5:-}" ]; then
        ip -n "$a" addr add "$5" dev "$va"
        ip -n "$b" addr add "$6" dev "$vb"
    fi
    for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set "$va" up
    ip -n "$b" link set "$vb" up
}

# veth_del NS...: deletes the namespaces (the pair goes with them).
veth_del() {
    local ns
    for ns in "$@"; do ip netns del "$ns" 2>/dev/null || true; done
}
