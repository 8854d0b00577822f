# ganesha_up NAME BIND_ADDR [netns]: starts an nfs-ganesha (NFSv3 over TCP
# on BIND_ADDR, fixed NFS and MOUNT ports, no NLM, VFS FSAL) exporting
# $W/NAME-data, in the network namespace netns when given. ganesha must
# register with rpcbind: it runs in a private mount namespace whose /run
# holds a stand-in (bench/lib/fake_rpcbind.py). Sets NFS_URL (libnfs),
# NFS_PORT and MNT_PORT; appends the server's PID to PIDS.
# The caller provides W (a work directory), PIDS and free_port.
ganesha_up() {
    local n=$1 bind=$2 ns=${3:-}
    NFS_PORT=$(free_port)
    MNT_PORT=$(free_port)
    mkdir -p "$W/$n-data"
    cat > "$W/$n.conf" <<CONF
NFS_CORE_PARAM {
    Protocols = 3; NFS_Port = $NFS_PORT; MNT_Port = $MNT_PORT; Bind_addr = $bind;
    Enable_NLM = false; Enable_RQUOTA = false; Enable_UDP = false;
}
EXPORT {
    Export_Id = 1; Path = $W/$n-data; Pseudo = /data; Protocols = 3;
    Transports = TCP; Access_Type = RW; Squash = No_Root_Squash;
    FSAL { Name = VFS; }
}
LOG { Default_Log_Level = WARN; }
CONF
    cat > "$W/$n.sh" <<SH
mount -t tmpfs none /run
python3 bench/lib/fake_rpcbind.py /run/rpcbind.sock &
for i in \$(seq 50); do [ -S /run/rpcbind.sock ] && break; sleep 0.1; done
exec ganesha.nfsd -F -f $W/$n.conf -L $W/$n.log -p /run/ganesha.pid
SH
    ${ns:+ip netns exec "$ns"} unshare -m --propagation private sh "$W/$n.sh" >"$W/$n.out" 2>&1 &
    PIDS+=($!)
    NFS_URL="nfs://$bind$W/$n-data?nfsport=$NFS_PORT&mountport=$MNT_PORT"
}
