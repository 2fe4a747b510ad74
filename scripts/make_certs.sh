#!/usr/bin/env bash
# The certificate recipe of the multi-host runs (WORKSPACE.md, "Multi-host recipe"): a CA and
# one certificate per node by the TLS identity rule of runtime/distributed/config.py:
# CN = the node id (node:0, node:1, ...), subjectAltName = the node's host (IP or DNS name).
#
#   bash scripts/make_certs.sh DIR HOST0 HOST1 [HOST2 ...]     # DAYS=30 by default
#   bash scripts/make_certs.sh experiments/nodes/certs 10.0.0.1 10.0.0.2 10.0.0.3
#
# Writes DIR/ca.crt, DIR/ca.key (keep the CA key on the trusted machine) and, for node n,
# DIR/node_n.crt + DIR/node_n.key (give each host ca.crt and its own pair), the file names
# experiments/nodes/3pc_aby3_hosts_tls.json expects under experiments/nodes/certs/.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 DIR HOST0 HOST1 [HOST2 ...]  (one host per node, in node order)" >&2
  exit 2
fi
dir=$1; shift
days=${DAYS:-30}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days "$days" \
  -subj /CN=mpcache-ca 2>/dev/null
n=0
for host in "$@"; do
  if [[ $host =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then san="IP:$host"; else san="DNS:$host"; fi
  openssl req -newkey rsa:2048 -nodes -keyout "node_$n.key" -out "node_$n.csr" \
    -subj "/CN=node:$n" 2>/dev/null
  echo "subjectAltName=$san" > "node_$n.ext"
  openssl x509 -req -in "node_$n.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "node_$n.crt" -days "$days" -extfile "node_$n.ext" 2>/dev/null
  rm -f "node_$n.csr" "node_$n.ext"
  echo "node:$n  CN=node:$n  SAN $san  -> $dir/node_$n.crt"
  n=$((n + 1))
done
