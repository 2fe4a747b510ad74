#!/bin/bash
# Two parties in separate network namespaces joined by a veth pair, optional tbf shaping.
# usage (root): bash scripts/netns_2pc.sh RATE(e.g. 100mbit|none) OUTDIR [BURST]
set -e
RATE=$1; OUT=$2; BURST=${3:-256kb}; cd "$(dirname "$0")/.."
cleanup() { ip netns del h6a 2>/dev/null || true; ip netns del h6b 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add h6a; ip netns add h6b
ip link add h6va type veth peer name h6vb
ip link set h6va netns h6a; ip link set h6vb netns h6b
ip -n h6a addr add 10.66.0.1/24 dev h6va; ip -n h6b addr add 10.66.0.2/24 dev h6vb
for ns in h6a h6b; do ip -n $ns link set lo up; done
ip -n h6a link set h6va up; ip -n h6b link set h6vb up
if [ "$RATE" != none ]; then
  ip netns exec h6a tc qdisc add dev h6va root tbf rate $RATE burst $BURST latency 100ms
  ip netns exec h6b tc qdisc add dev h6vb root tbf rate $RATE burst $BURST latency 100ms
fi
ip netns exec h6a ping -c 3 -q 10.66.0.2 | tail -1
mkdir -p $OUT
python3 - "$OUT" <<'PY'
import json, sys
raw = json.load(open("experiments/nodes/2pc_semi2k.json"))
raw["nodes"] = {"node:0": "10.66.0.1:61330", "node:1": "10.66.0.2:61331"}
raw["job"].update({"policy": "full", "seq_len": 128, "max_new_tokens": 2})
json.dump(raw, open(sys.argv[1] + "/node_config.json", "w"), indent=1)
PY
ip netns exec h6a .venv/bin/mpcache party --node_config=$OUT/node_config.json --party=node:0 --output_dir=$OUT > $OUT/party_node_0.log 2>&1 &
A=$!
ip netns exec h6b .venv/bin/mpcache party --node_config=$OUT/node_config.json --party=node:1 --output_dir=$OUT > $OUT/party_node_1.log 2>&1 &
B=$!
wait $A; echo "node:0 exit $?"; wait $B; echo "node:1 exit $?"
