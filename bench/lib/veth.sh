# Sourced by bench/fs.sh, bench/fs-path.sh and bench/fs-xdp.sh: two network
# namespaces joined by a veth pair (AF_XDP on a veth runs in copy mode), and
# their teardown.

# veth_pair NS_A NS_B DEV_A DEV_B [ADDR_A/PREFIX ADDR_B/PREFIX]: creates
# both namespaces (loopback up), the pair DEV_A in NS_A and DEV_B in NS_B,
# up, with the addresses when given, both ends at MTU $VETH_MTU when set.
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
    if [ -n "${VETH_MTU:-}" ]; then
        ip -n "$a" link set "$va" mtu "$VETH_MTU"
        ip -n "$b" link set "$vb" mtu "$VETH_MTU"
    fi
    ip -n "$a" link set "$va" up
    ip -n "$b" link set "$vb" up
}

# veth_del NS...: deletes the namespaces (the pair goes with them).
veth_del() {
    local ns
    for ns in "$@"; do ip netns del "$ns" 2>/dev/null || true; done
}

# xdp_mtu_param: the fs_export JSON member that sets an xdp export's MTU
# to $VETH_MTU (nothing for the default 1500, which older builds take).
xdp_mtu_param() {
    if [ -n "${VETH_MTU:-}" ] && [ "$VETH_MTU" != 1500 ]; then printf ',"mtu":%s' "$VETH_MTU"; fi
}
