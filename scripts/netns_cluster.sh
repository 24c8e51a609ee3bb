#!/usr/bin/env bash
# A test cluster on one machine: N emulated hosts, each a network namespace with its own
# hostname, joined by a bridge, optionally shaped to a link rate. Needs root and iproute2.
#
#   scripts/netns_cluster.sh check                      can clusters be made here? (why not)
#   scripts/netns_cluster.sh up [--hosts N] [--slots S] [--rate RATE] [--cpus-per-host K]
#                               [--owner PID]
#                                                       prints the cluster's directory
#   scripts/netns_cluster.sh shape DIR RATE|none        change the link rate of every host
#   scripts/netns_cluster.sh down DIR|ID                remove one cluster
#   scripts/netns_cluster.sh down --stale               remove clusters whose owner has died
#   scripts/netns_cluster.sh list                       the clusters that exist
#   scripts/netns_cluster.sh run [up options] -- COMMAND...
#                                                       up, COMMAND with NETNS_CLUSTER_* set, down
#
# Every cluster has a random id: its namespaces are kd-ID-h0.., its interfaces kdID (the bridge
# here, and the host's end of its link in each namespace: the same name everywhere, as a real
# cluster's network interface would be) and kdIDh0.. (the other ends, here), and it takes a /24
# in 10.200.0.0/13 that no route here uses. So two clusters never collide.
#
# DIR (/run/kerasdist-netns/ID) holds:
#   env        NETNS_CLUSTER_* lines (sh syntax): DIR, ID, HOSTS (comma-separated), HOSTS_SLOTS
#              (host:slots,...), IFACE, LAUNCHER, HOSTFILE, SUBNET, HEAD_ADDRESS, RATE
#   ssh        the launcher program: `ssh [options] HOST COMMAND...` runs COMMAND with /bin/sh
#              inside HOST's namespace (hydra: -launcher ssh -launcher-exec DIR/ssh; Open MPI:
#              --mca plm_rsh_agent DIR/ssh). Like ssh, it starts COMMAND with a clean
#              environment: the MPI launcher must carry the variables the ranks need.
#   hostfile   one `host:slots` line per host (MPICH / Intel MPI format)
# and each namespace sees /etc/netns/kd-ID-hI/hosts as its /etc/hosts (every host's name).
#
# --cpus-per-host K runs each host's commands on K CPUs of its own (taskset; host i takes the
# next K of the CPUs this script may use, wrapping round when there are too few), so that one
# host's busy threads cannot take another host's CPU, as on real hosts. Default 0: every host
# shares all of them.
#
# MPI traffic between the hosts crosses the links only if the MPI library is told to use TCP:
# between namespaces of one kernel, UCX otherwise picks shared memory. PyPI's MPICH: set
# UCX_TLS=tcp on every rank (or MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp).
#
# `up` and `run` remove what they made if they fail or get SIGINT / SIGTERM; a cluster made with
# --owner PID, and one whose `up` was killed (SIGKILL) half-way, is removed by the next `up` or
# `down --stale` once that process has died.
set -euo pipefail

STATE_ROOT=/run/kerasdist-netns
LOCK_FILE=$STATE_ROOT/.lock
SUBNET_PREFIX=10   # clusters take 10.S.T.0/24 with S in 200..207
MAX_HOSTS=64
CLEAN_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { printf '%s\n' "netns_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

# ---- what the machine must offer -------------------------------------------------------------

# Prints why clusters cannot be made here, or nothing.
why_not_possible() {
    if [[ $(id -u) != 0 ]]; then echo "needs root (network namespaces, veths, bridges)"; return; fi
    local tool
    for tool in ip nsenter unshare; do
        if ! command -v "$tool" >/dev/null; then echo "no '$tool' command (iproute2 / util-linux)"; return; fi
    done
    local error
    if ! error=$(unshare --net --uts true 2>&1); then echo "cannot make namespaces: $error"; return; fi
    # Inside a throwaway namespace: whatever the probe makes goes with it, even if this is killed.
    if ! error=$(unshare --net ip link add kdprobe type bridge 2>&1); then echo "cannot make a bridge: $error"; return; fi
}

# ---- names, derived from the id alone, so that `down` finds what a half-made `up` left -------

namespace_of() { echo "kd-$1-h$2"; }
bridge_of() { echo "kd$1"; }
outer_veth_of() { echo "kd$1h$2"; }

# Namespaces of cluster $1, whether or not its state directory exists.
namespaces_of() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^kd-$1-h[0-9]+$" || true; }

# ---- teardown --------------------------------------------------------------------------------

teardown() {
    local id=$1 ns dir=$STATE_ROOT/$1 pids link
    # What a script built on the cluster started outside its namespaces (slurm_cluster.sh).
    if [[ -x $dir/on_teardown ]]; then "$dir/on_teardown" || true; fi
    for ns in $(namespaces_of "$id"); do
        # Processes left in a namespace would keep it, and its link, alive.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            kill -TERM $pids 2>/dev/null || true
            sleep 0.5
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    rmdir /etc/netns 2>/dev/null || true   # only if no other namespace keeps files there
    # A veth whose namespace end was never moved (an interrupted `up`) outlives the namespace.
    for link in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^kd${id}(h[0-9]+)?$" || true); do
        ip link del "$link" 2>/dev/null || true
    done
    if [[ -d $dir ]]; then
        local uts
        for uts in "$dir"/uts/*; do
            [[ -e $uts ]] || continue
            umount "$uts" 2>/dev/null || true
        done
        rm -rf "$dir"
    fi
}

# Clusters whose recorded owner process is gone, and half-made ones whose `up` was killed.
stale_ids() {
    local process_file pid start
    for process_file in "$STATE_ROOT"/*/owner "$STATE_ROOT"/*/maker; do
        [[ -e $process_file ]] || continue
        read -r pid start <"$process_file"
        if [[ $(process_start_time "$pid") != "$start" ]]; then
            basename "$(dirname "$process_file")"
        fi
    done | sort -u
}

# The start time of process $1 in clock ticks since boot (tells a pid from its reuse), or nothing.
process_start_time() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    # Field 22; the command name (field 2) may hold spaces, so count from its closing parenthesis.
    echo "${stat##*) }" | awk '{print $20}'
}

reap_stale() {
    local id
    for id in $(stale_ids); do
        say "removing cluster $id: the process that made or owns it has exited"
        teardown "$id"
    done
}

# ---- shaping ---------------------------------------------------------------------------------

# Shapes one interface's egress to $2 (a tc rate such as 1gbit), or removes shaping ("none").
shape_interface() {
    local netns_args=() dev=$1 rate=$2
    if [[ $# -ge 3 ]]; then netns_args=(-n "$3"); fi
    tc "${netns_args[@]}" qdisc del dev "$dev" root 2>/dev/null || true
    [[ $rate == none ]] && return 0
    # A burst of 64 KiB lets htb keep a multi-gigabit rate with the kernel's timer granularity.
    tc "${netns_args[@]}" qdisc add dev "$dev" root handle 1: htb default 1
    tc "${netns_args[@]}" class add dev "$dev" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" \
        burst 64k cburst 64k quantum 60000
}

# Both directions of every host's link: what leaves the host (inside its namespace) and what
# the bridge sends to it (the outer end), as a NIC of that rate would.
shape_cluster() {
    local dir=$1 rate=$2 id hosts i
    id=$(basename "$dir")
    hosts=$(cat "$dir/host_count")
    command -v tc >/dev/null || die "no 'tc' command (iproute2): cannot shape links"
    for ((i = 0; i < hosts; i++)); do
        shape_interface "$(outer_veth_of "$id" "$i")" "$rate"
        shape_interface "$(bridge_of "$id")" "$rate" "$(namespace_of "$id" "$i")"
    done
    sed -i "s/^NETNS_CLUSTER_RATE=.*/NETNS_CLUSTER_RATE=$([[ $rate == none ]] || echo "$rate")/" "$dir/env"
}

# ---- up --------------------------------------------------------------------------------------

# Picks a /24 no route here touches; the caller holds the lock until the bridge has its address.
free_subnet() {
    local attempt second third net
    for attempt in $(seq 1 200); do
        second=$((200 + RANDOM % 8))
        third=$((RANDOM % 256))
        net=$SUBNET_PREFIX.$second.$third.0/24
        if [[ -z $(ip -4 route show root "$net") && -z $(ip -4 route show match "$net" | grep -v '^default') ]]; then
            echo "$SUBNET_PREFIX.$second.$third"
            return
        fi
    done
    die "no free /24 in $SUBNET_PREFIX.200.0.0/13"
}

new_id() {
    local id
    while true; do
        id=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
        [[ -e $STATE_ROOT/$id || -n $(namespaces_of "$id") ]] || { echo "$id"; return; }
    done
}

# The CPUs this process may run on, one per line (Cpus_allowed_list: "0-3,6").
allowed_cpus() {
    local range
    for range in $(sed -n 's/^Cpus_allowed_list:\s*//p' /proc/self/status | tr ',' ' '); do
        seq "${range%-*}" "${range#*-}"
    done
}

write_launcher() {
    local dir=$1 id=$2 hosts=$3 net=$4 cpus_per_host=$5 i j host_cpus cases=""
    local -a cpus
    mapfile -t cpus < <(allowed_cpus)
    for ((i = 0; i < hosts; i++)); do
        host_cpus=""  # host i's share, comma-separated; none when cpus_per_host is 0
        for ((j = 0; j < cpus_per_host; j++)); do
            host_cpus+="${host_cpus:+,}${cpus[(i * cpus_per_host + j) % ${#cpus[@]}]}"
        done
        cases+="    $(namespace_of "$id" "$i")|$net.$((i + 11))) ns=$(namespace_of "$id" "$i") cpus=$host_cpus;;"$'\n'
    done
    cat >"$dir/ssh" <<EOF
#!/usr/bin/env bash
# Launcher program of test cluster $id, called as ssh would be: [options] HOST COMMAND...
# Runs COMMAND with /bin/sh inside HOST's network and hostname namespaces, in a clean
# environment (as ssh would: the MPI launcher must carry what the ranks need). Generated by
# scripts/netns_cluster.sh.
set -euo pipefail
while [[ \$# -gt 0 && \$1 == -* ]]; do
    case \$1 in
        -[bcDEeFIiJLlmOopQRSWw]) shift 2;;   # ssh options that take a value
        *) shift;;
    esac
done
[[ \$# -ge 2 ]] || { echo "usage: \$0 [ssh options] HOST COMMAND..." >&2; exit 255; }
host=\${1##*@}
shift
case \$host in
$cases    *) echo "\$0: no host \$host in test cluster $id" >&2; exit 255;;
esac
# ip netns exec also mounts the namespace's own /sys (UCX reads its interfaces there) and
# /etc/netns/\$ns/hosts as /etc/hosts; taskset keeps the host on its own CPUs, if it has some.
exec env -i PATH=$CLEAN_PATH HOME="\${HOME:-/root}" \\
    \${cpus:+taskset -c "\$cpus"} nsenter --uts="$dir/uts/\$ns" -- ip netns exec "\$ns" /bin/sh -c "\$*"
EOF
    chmod +x "$dir/ssh"
}

make_cluster() {
    local hosts=$1 slots=$2 rate=$3 owner=$4 cpus_per_host=$5 id dir net bridge i ns outer names="" hosts_slots=""
    mkdir -p "$STATE_ROOT"
    id=$(new_id)
    dir=$STATE_ROOT/$id
    CURRENT_ID=$id   # for the cleanup trap
    mkdir -p "$dir/uts"
    echo "$$ $(process_start_time $$)" >"$dir/maker"   # removed once the cluster is complete
    bridge=$(bridge_of "$id")
    if [[ -n $owner ]]; then
        [[ -d /proc/$owner ]] || die "--owner $owner: no such process"
        echo "$owner $(process_start_time "$owner")" >"$dir/owner"
    fi

    exec 9>"$LOCK_FILE"
    flock 9
    net=$(free_subnet)
    ip link add "$bridge" type bridge
    ip addr add "$net.1/24" dev "$bridge"
    flock -u 9
    exec 9>&-
    ip link set "$bridge" up

    for ((i = 0; i < hosts; i++)); do
        ns=$(namespace_of "$id" "$i")
        outer=$(outer_veth_of "$id" "$i")
        ip netns add "$ns"
        touch "$dir/uts/$ns"
        nsenter --net="/run/netns/$ns" unshare --uts="$dir/uts/$ns" hostname "$ns"
        ip link add "$outer" type veth peer name "$bridge" netns "$ns"
        ip link set "$outer" master "$bridge"
        ip link set "$outer" up
        ip -n "$ns" addr add "$net.$((i + 11))/24" dev "$bridge"
        ip -n "$ns" link set "$bridge" up
        ip -n "$ns" link set lo up
        names+="${names:+,}$ns"
        hosts_slots+="${hosts_slots:+,}$ns:$slots"
    done

    for ((i = 0; i < hosts; i++)); do
        ns=$(namespace_of "$id" "$i")
        mkdir -p "/etc/netns/$ns"
        {
            printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
            printf '%s\t%s\n' "$net.1" "kd-$id-head"
            local j
            for ((j = 0; j < hosts; j++)); do printf '%s\t%s\n' "$net.$((j + 11))" "$(namespace_of "$id" "$j")"; done
        } >"/etc/netns/$ns/hosts"
    done
    tr ',' '\n' <<<"$hosts_slots" >"$dir/hostfile"
    echo "$hosts" >"$dir/host_count"
    write_launcher "$dir" "$id" "$hosts" "$net" "$cpus_per_host"
    cat >"$dir/env" <<EOF
NETNS_CLUSTER_DIR=$dir
NETNS_CLUSTER_ID=$id
NETNS_CLUSTER_HOSTS=$names
NETNS_CLUSTER_HOSTS_SLOTS=$hosts_slots
NETNS_CLUSTER_IFACE=$bridge
NETNS_CLUSTER_LAUNCHER=$dir/ssh
NETNS_CLUSTER_HOSTFILE=$dir/hostfile
NETNS_CLUSTER_SUBNET=$net.0/24
NETNS_CLUSTER_HEAD_ADDRESS=$net.1
NETNS_CLUSTER_RATE=
NETNS_CLUSTER_CPUS_PER_HOST=$cpus_per_host
EOF
    if [[ -n $rate ]]; then shape_cluster "$dir" "$rate"; fi
    rm "$dir/maker"
    CLUSTER_DIR=$dir
}

# Sets HOSTS SLOTS RATE CPUS_PER_HOST OWNER from up's options; REST holds what follows `--`.
parse_up_options() {
    HOSTS=2 SLOTS=1 RATE="" CPUS_PER_HOST=0 OWNER="" REST=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --hosts) HOSTS=${2:?--hosts needs a number}; shift 2;;
            --slots) SLOTS=${2:?--slots needs a number}; shift 2;;
            --rate) RATE=${2:?--rate needs a tc rate, e.g. 1gbit}; shift 2;;
            --cpus-per-host) CPUS_PER_HOST=${2:?--cpus-per-host needs a number}; shift 2;;
            --owner) OWNER=${2:?--owner needs a pid}; shift 2;;
            --) shift; REST=("$@"); return;;
            *) die "unknown option $1 (see $0 --help)";;
        esac
    done
    [[ $HOSTS =~ ^[0-9]+$ ]] && ((HOSTS >= 1 && HOSTS <= MAX_HOSTS)) || die "--hosts must be 1..$MAX_HOSTS"
    [[ $SLOTS =~ ^[0-9]+$ ]] && ((SLOTS >= 1)) || die "--slots must be >= 1"
    [[ $CPUS_PER_HOST =~ ^[0-9]+$ ]] || die "--cpus-per-host must be a number >= 0"
    [[ -z $OWNER || $OWNER =~ ^[0-9]+$ ]] || die "--owner must be a pid"
}

# Makes a cluster in this shell (sets CURRENT_ID as soon as there is something to remove, and
# CLUSTER_DIR); the caller's traps remove it on failure or on a signal.
make_checked_cluster() {
    local reason
    reason=$(why_not_possible)
    [[ -z $reason ]] || die "$reason"
    reap_stale
    make_cluster "$HOSTS" "$SLOTS" "$RATE" "$OWNER" "$CPUS_PER_HOST"
}

up() {
    CURRENT_ID=""
    trap 'status=$?; if ((status != 0)) && [[ -n $CURRENT_ID ]]; then say "removing the half-made cluster $CURRENT_ID"; teardown "$CURRENT_ID"; fi' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    make_checked_cluster
    trap - EXIT INT TERM
    echo "$CLUSTER_DIR"
}

# Resolves DIR or ID to an id of an existing cluster.
cluster_id() {
    local id
    id=$(basename "$1")
    [[ $id =~ ^[0-9a-f]{6}$ ]] || die "$1 is not a cluster directory or id"
    echo "$id"
}

# For run's traps: end the command run started (if it has, which $! tells: it differs from
# $2, $! before the command), then exit with $1.
stop_command_then_exit() {
    local status=$1 before_command=$2
    if [[ ${!:-} != "$before_command" ]]; then
        kill -TERM "$!" 2>/dev/null
        wait "$!" || true
    fi
    exit "$status"
}

run() {
    local child status
    CURRENT_ID=""
    trap 'if [[ -n $CURRENT_ID ]]; then teardown "$CURRENT_ID"; fi' EXIT
    trap 'exit 130' INT   # exit runs the EXIT trap
    trap 'exit 143' TERM
    make_checked_cluster
    say "cluster $CLUSTER_DIR is up"
    set -a
    # shellcheck disable=SC1091
    source "$CLUSTER_DIR/env"
    set +a
    # In the background so that a signal reaches this shell's traps at once; the command gets
    # SIGTERM (a background command ignores SIGINT), and the cluster goes after it. The traps
    # go in before the command starts, and find it by $!, which bash sets before any trap can
    # run: a signal in between would otherwise tear the cluster down under a command left running.
    local before_command=${!:-}
    trap 'stop_command_then_exit 130 "$before_command"' INT
    trap 'stop_command_then_exit 143 "$before_command"' TERM
    "${REST[@]}" &
    child=$!
    status=0
    wait $child || status=$?
    exit "$status"
}

main() {
    [[ $# -ge 1 ]] || usage
    local command=$1
    shift
    case $command in
        check)
            local reason
            reason=$(why_not_possible)
            if [[ -n $reason ]]; then echo "$reason"; exit 1; fi
            echo "ok";;
        up)
            parse_up_options "$@"
            ((${#REST[@]} == 0)) || die "up takes no command (did you mean run?)"
            up;;
        run)
            parse_up_options "$@"
            ((${#REST[@]} > 0)) || die "run needs a command after --"
            run;;
        shape)
            [[ $# -eq 2 ]] || die "usage: $0 shape DIR RATE|none"
            local id
            id=$(cluster_id "$1")
            [[ -d $STATE_ROOT/$id ]] || die "no cluster $id"
            shape_cluster "$STATE_ROOT/$id" "$2";;
        down)
            [[ $# -eq 1 ]] || die "usage: $0 down DIR|ID|--stale"
            if [[ $1 == --stale ]]; then
                reap_stale
            else
                teardown "$(cluster_id "$1")"
            fi;;
        list)
            local dir
            for dir in "$STATE_ROOT"/*/; do
                [[ -e $dir/env ]] && grep -E '^NETNS_CLUSTER_(DIR|HOSTS|SUBNET|RATE)=' "$dir/env" | tr '\n' ' ' && echo
            done
            true;;
        -h|--help|help) usage;;
        *) die "unknown command $command (see $0 --help)";;
    esac
}

main "$@"
