#!/usr/bin/env bash
# Site wrapper around mpiexec for kerasdist jobs.
#
#   scripts/mpirun.sh -np 4 python train.py
#   scripts/mpirun.sh -np 8 -hosts node1:4,node2:4 python train.py     (MPICH / Intel MPI)
#   scripts/mpirun.sh -np 8 -H node1:4,node2:4 python train.py         (Open MPI)
#
# Every argument goes to mpiexec unchanged, after the site options below; the wrapper then
# becomes mpiexec (exec), so exit status and signals are mpiexec's own.
#
# Infrastructure engineers: edit the "site settings" section once for your cluster (network
# interface, transport, process binding). Users then never type those flags. Everything there
# is commented out: the defaults suit one machine, and a setting for the wrong MPI is ignored
# or, worse, an error.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The mpiexec of the MPI kerasdist was built with: KERASDIST_MPIEXEC if set, else the venv's
# (PyPI mpich), else the mpiexec on PATH.
if [[ -n ${KERASDIST_MPIEXEC:-} ]]; then
    mpiexec=$KERASDIST_MPIEXEC
elif [[ -x $repo_root/.venv/bin/mpiexec ]]; then
    mpiexec=$repo_root/.venv/bin/mpiexec
else
    mpiexec=mpiexec
fi

site_options=()

# ---- site settings -------------------------------------------------------------------------
# Environment variables exported here reach every rank: hydra (MPICH, Intel MPI) passes the
# whole environment; Open MPI forwards OMPI_MCA_* itself, anything else needs `-x NAME`.

# MPICH (PyPI mpich is built with both the libfabric "ofi" and the UCX network modules).
# export MPIR_CVAR_CH4_NETMOD=ofi          # or ucx
# export FI_PROVIDER=tcp                   # libfabric provider, e.g. tcp, verbs, efa
# export FI_TCP_IFACE=eth0                 # NIC for the tcp provider
# export UCX_NET_DEVICES=mlx5_0:1          # with MPIR_CVAR_CH4_NETMOD=ucx: device[:port] to use
# export HYDRA_IFACE=eth0                  # NIC hydra's own control traffic uses (same as -iface)
# site_options+=(-bind-to core)            # pin each rank to cores (hydra: -bind-to, -map-by)

# Open MPI
# export OMPI_MCA_btl_tcp_if_include=eth0  # NIC for MPI traffic over TCP
# export OMPI_MCA_oob_tcp_if_include=eth0  # NIC for the runtime's own traffic
# export OMPI_MCA_pml=ucx                  # InfiniBand / RoCE through UCX
# site_options+=(--bind-to core)

# Intel MPI
# export I_MPI_FABRICS=shm:ofi             # shared memory inside a node, libfabric between nodes
# export I_MPI_HYDRA_IFACE=eth0            # NIC hydra's control traffic uses
# export FI_PROVIDER=verbs                 # libfabric provider, as for MPICH
# export I_MPI_PIN_DOMAIN=socket           # one pinning domain per rank

# One math thread per core a rank owns avoids oversubscribing a node; set it to cores / ranks.
# export OMP_NUM_THREADS=4
# ---------------------------------------------------------------------------------------------

# "${arr[@]+...}" keeps `set -u` quiet about an empty array in bash < 4.4.
exec "$mpiexec" ${site_options[@]+"${site_options[@]}"} "$@"
