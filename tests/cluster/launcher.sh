#!/bin/sh
# Hydra's `-launcher ssh -launcher-exec` stand-in: run a command inside a simulated node's namespace.
# Hydra calls it as `launcher.sh [-x] HOST CMD...`, HOST being a node's name or address; the cluster's hosts
# file ($HPCGRAD_CLUSTER_HOSTS: "address hostname netns" per line, written by cluster.py) names
# the node's namespace and hostname. CMD runs in that network namespace under a fresh UTS
# namespace whose hostname is the node's (see Note [MPI across namespaces] in cluster.py).
# Open MPI's prterun calls it the same way (`--prtemca plm_ssh_agent launcher.sh`: HOST CMD).
set -eu
while [ $# -gt 0 ]; do
    case "$1" in
        -x|-q|-T) shift ;;
        -o|-p|-l) shift 2 ;;  # ssh options hydra may pass with a value
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "launcher.sh: expected [-x] HOST CMD..., got: $*" >&2
    exit 2
fi
host=$1
shift
hosts=${HPCGRAD_CLUSTER_HOSTS:-}
if [ -z "$hosts" ] || [ ! -r "$hosts" ]; then
    echo "launcher.sh: HPCGRAD_CLUSTER_HOSTS ('$hosts') is not a readable hosts file; run under tests/cluster/cluster.py" >&2
    exit 2
fi
line=$(awk -v h="$host" '$1 == h || $2 == h { print $2, $3; exit }' "$hosts")
if [ -z "$line" ]; then
    echo "launcher.sh: host '$host' is not in $hosts; known: $(awk '{ print $1 }' "$hosts" | tr '\n' ' ')" >&2
    exit 2
fi
name=${line% *}
netns=${line#* }
if [ -n "${HPCGRAD_CLUSTER_LAUNCH_LOG:-}" ]; then
    echo "$host $name $netns: $*" >> "$HPCGRAD_CLUSTER_LAUNCH_LOG"
fi
# ssh hands the remote shell one command line; hydra quotes for that, so run it through sh -c.
exec ip netns exec "$netns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$name" "$*"
