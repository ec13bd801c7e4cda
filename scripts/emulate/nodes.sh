#!/usr/bin/env bash
# TEST ONLY: emulate N nodes on this one machine, to run `stackproof validate` across "nodes" with real NCCL and
# real cross-node code paths where only one machine is at hand (docs/launchers.md, "Emulated nodes"). Each node is
# its own launcher (static rendezvous on 127.0.0.1) with its own node name (emu-0, emu-1, ...), its own reports
# folder, and its own NCCL_HOSTID: NCCL then takes the nodes for different hosts and connects them through its
# network transport, here TCP sockets over loopback (NET/Socket; NCCL_IB_DISABLE=1). The nodes share the
# machine's GPUs: node i gets GPU i mod G of EMULATE_GPUS; ranks on one GPU are expected there (--emulated-nodes
# is passed: per-GPU figures are measured once per GPU, and no bar comes from NICs the links do not cross).
# --graph-max 0 unless given: a CUDA graph's all_reduce over sockets on one time-sliced GPU takes 13 ms at 8 B
# (measured on one H200, 3 nodes), so the graph sweep would time the time-slicing for minutes, not a link.
#
#   scripts/emulate/nodes.sh 3 --reports /tmp/emu -k "not compile"
#
# Env: EMULATE_GPUS (default 0: the GPU indices to hand out, comma-separated; empty: CPU ranks), EMULATE_PORT
# (default 29533), STACKPROOF_PYTHON (default python3). Prints each node's output to <reports>/emu-<i>.log; the
# report is rank 0's, in <reports>/emu-0/. Exit code: node 0's validate's.
set -euo pipefail

nodes="${1:?usage: scripts/emulate/nodes.sh NODES [validate args...] (--reports DIR among them, default ./reports)}"
shift
reports=reports
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --reports) reports="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/../../stackproof/__init__.py" ]; then
    repo="$(cd "$here/../.." && pwd)"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
IFS=, read -r -a gpus <<< "${EMULATE_GPUS-0}"
mkdir -p "$reports"
pids=()
for ((i = 0; i < nodes; i++)); do
    visible=()
    [ "${#gpus[@]}" -gt 0 ] && visible=(CUDA_VISIBLE_DEVICES="${gpus[i % ${#gpus[@]}]}")
    [ "${#gpus[@]}" -eq 0 ] && visible=(CUDA_VISIBLE_DEVICES="")
    env "${visible[@]}" NCCL_HOSTID="stackproof-emulated-node-$i" STACKPROOF_NODE_NAME="emu-$i" \
        NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo STACKPROOF_EMULATED_NODES=1 \
        "${STACKPROOF_PYTHON:-python3}" -m stackproof validate --nnodes "$nodes" --node-rank "$i" \
        --master-addr 127.0.0.1 --master-port "${EMULATE_PORT:-29533}" --reports "$reports/emu-$i" \
        --graph-max 0 "${args[@]}" \
        >"$reports/emu-$i.log" 2>&1 &
    pids+=($!)
done
status=0
for ((i = 0; i < nodes; i++)); do
    rc=0
    wait "${pids[i]}" || rc=$?
    [ "$i" = 0 ] && status=$rc
done
cat "$reports/emu-0.log"
exit "$status"
