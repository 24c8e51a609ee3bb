#!/usr/bin/env bash
# A real Slurm on the emulated hosts of scripts/netns_cluster.sh: slurmctld here (the root
# namespace, on the bridge address), one slurmd per host namespace, and a munged of the cluster's
# own for their authentication. Needs root, iproute2 and Debian's slurm-wlm and munge
# (scripts/cluster_packages.sh install). Nothing of the system's Slurm or munge is used or
# touched (no /etc/slurm, /etc/munge, systemd unit): all of it lives in the cluster's directory.
#
#   scripts/slurm_cluster.sh check                        can it run here? (why not)
#   scripts/slurm_cluster.sh up [--hosts N] [--slots S] [--cpus C] [--owner PID]
#                                                         prints the cluster's directory
#   scripts/slurm_cluster.sh down DIR|ID                  remove one cluster
#   scripts/slurm_cluster.sh down --stale                 remove clusters whose owner has died
#   scripts/slurm_cluster.sh start-slurmd DIR HOST        start HOST's slurmd again (a test that
#                                                         killed it, as a lost node, brings it back)
#   scripts/slurm_cluster.sh run [up options] -- COMMAND...
#                                                         up, COMMAND with SLURM_CONF and
#                                                         NETNS_CLUSTER_* set, down
#
# The hosts are those of `netns_cluster.sh up --hosts N --slots S` (DIR is that cluster's
# directory, and `netns_cluster.sh down` removes the Slurm too). Slurm's node names are the hosts'
# names (kd-ID-h0, ...), all in one partition "kd" (the default); each node has C CPUs (default
# S), whatever the machine has (SlurmdParameters=config_overrides), so that a job script written
# for real nodes can be tried here. Ports are picked free per cluster, so clusters never collide.
#
# DIR/env gains SLURM_CONF=DIR/slurm/slurm.conf, which srun, sbatch, salloc, squeue, scancel and
# scontrol read, and SLURM_CLUSTER_HEAD (the controller's host name on the bridge). DIR/slurm
# holds slurm.conf, munge/ (key, socket, log), state/, spool/, log/ (slurmctld.log,
# slurmd-HOST.log).
#
# How a slurmd is put in its host: `ip netns exec` would remount /sys for the namespace, and
# slurmd then fails ("No filesystem mounted on /sys/fs/cgroup"). Here each slurmd gets a mount
# namespace of its own where /sys is the host namespace's sysfs (so UCX sees the host's own
# interfaces, as under `ip netns exec`), /sys/fs/cgroup is the machine's cgroup tree bound back in,
# /etc/hosts is the cluster's host list, and /dev/shm is the host's own (MPICH names its shared
# memory after the job and step ids, which every test cluster numbers from 1: shared, two
# clusters' jobs collided); its tasks inherit all four. So jobs run as in
# tests/multihost: UCX_TLS=tcp (or MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp) carries MPI's bytes
# over the links. ProctrackType=proctrack/pgid and TaskPlugin=task/none: no cgroup is made.
#
# `up` and `run` remove what they made if they fail or get SIGINT / SIGTERM. The daemons of this
# root namespace (slurmctld, munged) are ended by DIR/on_teardown, which netns_cluster.sh's
# teardown runs, so `down`, `down --stale` and the reaping of a dead owner's cluster by any later
# `up` of either script end them too.
set -euo pipefail

SCRIPTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS_CLUSTER=$SCRIPTS_DIR/netns_cluster.sh
READY_TIMEOUT_S=${READY_TIMEOUT_S:-60}

say() { printf '%s\n' "slurm_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

# Prints why a Slurm cluster cannot be made here, or nothing.
why_not_possible() {
    local reason missing program
    if ! reason=$("$NETNS_CLUSTER" check 2>&1); then echo "$reason"; return; fi
    missing=$("$SCRIPTS_DIR/cluster_packages.sh" missing | grep -E '^(slurm-wlm|munge)$' | tr '\n' ' ' || true)
    if [[ -n $missing ]]; then
        echo "packages missing: ${missing% } (scripts/cluster_packages.sh install)"
        return
    fi
    for program in munged mungekey slurmctld slurmd srun sbatch salloc scontrol; do
        command -v "$program" >/dev/null || { echo "no '$program' command"; return; }
    done
}

# A TCP port nothing here listens on, in a range Linux does not hand out as ephemeral ports.
free_port() {
    local port attempt
    for attempt in $(seq 1 100); do
        port=$((20000 + RANDOM % 12000))
        if ! ss -Htln "sport = :$port" | grep -q .; then echo "$port"; return; fi
    done
    die "no free TCP port in 20000-31999"
}

write_slurm_conf() {
    local dir=$1 cpus=$2 slurm=$1/slurm hosts head_address head_name node_lines="" host address i=0
    # shellcheck disable=SC1091
    source "$dir/env"
    head_address=$NETNS_CLUSTER_HEAD_ADDRESS
    # slurmctld only starts on the host SlurmctldHost names: this machine, by its own name.
    head_name=$(hostname -s)
    IFS=, read -r -a hosts <<<"$NETNS_CLUSTER_HOSTS"
    for host in "${hosts[@]}"; do
        address=${head_address%.*}.$((i + 11))
        node_lines+="NodeName=$host NodeAddr=$address NodeHostname=$host CPUs=$cpus State=UNKNOWN"$'\n'
        i=$((i + 1))
    done
    cat >"$slurm/slurm.conf" <<EOF
# Slurm of test cluster $NETNS_CLUSTER_ID, written by scripts/slurm_cluster.sh.
ClusterName=kd$NETNS_CLUSTER_ID
SlurmctldHost=$head_name($head_address)
SlurmctldPort=$(free_port)
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$slurm/munge/munge.socket.2
StateSaveLocation=$slurm/state
SlurmdSpoolDir=$slurm/spool/%n
SlurmctldPidFile=$slurm/slurmctld.pid
SlurmdPidFile=$slurm/slurmd-%n.pid
SlurmctldLogFile=$slurm/log/slurmctld.log
SlurmdLogFile=$slurm/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
$node_lines
PartitionName=kd Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    {
        echo "SLURM_CONF=$slurm/slurm.conf"
        echo "SLURM_CLUSTER_HEAD=$head_name"
    } >>"$dir/env"
}

start_munge() {
    local munge=$1/slurm/munge
    mkdir -p "$munge"
    chmod 700 "$munge"
    mungekey --create --keyfile="$munge/munge.key" 2>/dev/null
    chmod 400 "$munge/munge.key"
    munged --force --socket="$munge/munge.socket.2" --key-file="$munge/munge.key" \
        --pid-file="$munge/munged.pid" --log-file="$munge/munged.log" --seed-file="$munge/munged.seed"
}

# slurmd of host $2, in its namespace (see the header for why a mount namespace of its own).
start_slurmd() {
    local dir=$1 host=$2 slurm=$1/slurm
    mkdir -p "$slurm/spool/$host" "$slurm/mnt/$host"
    nsenter --net="/run/netns/$host" --uts="$dir/uts/$host" -- \
        unshare --mount --propagation private -- /bin/sh -euc '
            mount --rbind /sys/fs/cgroup "$1"
            mount -t sysfs sysfs /sys
            mount --rbind "$1" /sys/fs/cgroup
            umount -l "$1"
            mount --bind "/etc/netns/$2/hosts" /etc/hosts
            mount -t tmpfs -o mode=1777 kd-shm /dev/shm
            exec slurmd -N "$2" -f "$3"' sh "$slurm/mnt/$host" "$host" "$slurm/slurm.conf"
}

wait_until_ready() {
    local dir=$1 host_count=$2 deadline idle
    deadline=$((SECONDS + READY_TIMEOUT_S))
    while true; do
        idle=$(SLURM_CONF=$dir/slurm/slurm.conf sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | grep -c . || true)
        ((idle == host_count)) && return
        if ((SECONDS >= deadline)); then
            # The cluster and its logs are removed next: show their ends.
            tail -n 5 "$dir"/slurm/log/*.log "$dir/slurm/munge/munged.log" >&2 || true
            die "only $idle of $host_count nodes idle after ${READY_TIMEOUT_S}s"
        fi
        sleep 0.3
    done
}

# Ends this cluster's slurmctld and munged; netns_cluster.sh's teardown calls it (DIR/on_teardown)
# before it ends what runs in the namespaces (the slurmds and their jobs) and removes DIR.
write_on_teardown() {
    local slurm=$1/slurm
    cat >"$1/on_teardown" <<EOF
#!/usr/bin/env bash
# Written by scripts/slurm_cluster.sh: ends the Slurm controller and munged of this cluster.
for pid_file in $slurm/slurmctld.pid $slurm/munge/munged.pid; do
    pid=\$(cat "\$pid_file" 2>/dev/null) || continue
    # Only the daemon this cluster started: a reused pid runs something else.
    grep -qF -- "$slurm" "/proc/\$pid/cmdline" 2>/dev/null || continue
    kill -TERM "\$pid" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do [[ -d /proc/\$pid ]] || break; sleep 0.2; done
    kill -KILL "\$pid" 2>/dev/null || true
done
EOF
    chmod +x "$1/on_teardown"
}

make_slurm() {
    local dir=$1 cpus=$2 host_count host
    local -a hosts
    mkdir -p "$dir/slurm/state" "$dir/slurm/log"
    write_on_teardown "$dir"
    start_munge "$dir"
    write_slurm_conf "$dir" "$cpus"
    slurmctld -f "$dir/slurm/slurm.conf"
    IFS=, read -r -a hosts <<<"$(sed -n 's/^NETNS_CLUSTER_HOSTS=//p' "$dir/env")"
    for host in "${hosts[@]}"; do start_slurmd "$dir" "$host"; done
    host_count=${#hosts[@]}
    wait_until_ready "$dir" "$host_count"
}

# Sets HOSTS SLOTS CPUS OWNER from up's options; REST holds what follows `--`.
parse_up_options() {
    HOSTS=2 SLOTS=1 CPUS="" OWNER="" REST=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --hosts) HOSTS=${2:?--hosts needs a number}; shift 2;;
            --slots) SLOTS=${2:?--slots needs a number}; shift 2;;
            --cpus) CPUS=${2:?--cpus needs a number}; shift 2;;
            --owner) OWNER=${2:?--owner needs a pid}; shift 2;;
            --) shift; REST=("$@"); break;;
            *) die "unknown option $1 (see $0 --help)";;
        esac
    done
    CPUS=${CPUS:-$SLOTS}
    [[ $CPUS =~ ^[0-9]+$ ]] && ((CPUS >= 1)) || die "--cpus must be >= 1"
}

# Makes hosts and Slurm on them (CLUSTER_DIR set as soon as there is something to remove).
make_checked_cluster() {
    local reason owner_option=()
    reason=$(why_not_possible)
    [[ -z $reason ]] || die "$reason"
    [[ -z $OWNER ]] || owner_option=(--owner "$OWNER")
    # `down --stale` first: a stale cluster's on_teardown ends its daemons.
    "$NETNS_CLUSTER" down --stale
    CLUSTER_DIR=$("$NETNS_CLUSTER" up --hosts "$HOSTS" --slots "$SLOTS" "${owner_option[@]}")
    # As netns_cluster.sh does while it makes hosts: if this is killed (SIGKILL) before Slurm is
    # up, `down --stale` finds this process gone and removes the cluster.
    echo "$$ $(stat=$(cat /proc/$$/stat) && echo "${stat##*) }" | awk '{print $20}')" >"$CLUSTER_DIR/maker"
    make_slurm "$CLUSTER_DIR" "$CPUS"
    rm "$CLUSTER_DIR/maker"
}

up() {
    CLUSTER_DIR=""
    trap 'status=$?; if ((status != 0)) && [[ -n $CLUSTER_DIR ]]; then say "removing the half-made cluster $CLUSTER_DIR"; "$NETNS_CLUSTER" down "$CLUSTER_DIR"; fi' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    make_checked_cluster
    trap - EXIT INT TERM
    echo "$CLUSTER_DIR"
}

run() {
    local child status
    CLUSTER_DIR=""
    trap 'if [[ -n $CLUSTER_DIR ]]; then "$NETNS_CLUSTER" down "$CLUSTER_DIR"; fi' EXIT
    trap 'exit 130' INT   # exit runs the EXIT trap
    trap 'exit 143' TERM
    make_checked_cluster
    say "Slurm cluster $CLUSTER_DIR is up"
    set -a
    # shellcheck disable=SC1091
    source "$CLUSTER_DIR/env"
    set +a
    # In the background so that a signal reaches this shell's traps at once.
    "${REST[@]}" &
    child=$!
    trap 'kill -TERM $child 2>/dev/null; wait $child || true; exit 130' INT
    trap 'kill -TERM $child 2>/dev/null; wait $child || true; exit 143' TERM
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
        down)
            [[ $# -eq 1 ]] || die "usage: $0 down DIR|ID|--stale"
            "$NETNS_CLUSTER" down "$1";;
        start-slurmd)
            [[ $# -eq 2 ]] || die "usage: $0 start-slurmd DIR HOST"
            start_slurmd "$1" "$2";;
        -h|--help|help) usage;;
        *) die "unknown command $command (see $0 --help)";;
    esac
}

main "$@"
