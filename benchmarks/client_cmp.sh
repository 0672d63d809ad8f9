#!/bin/bash
# Server CPU per token, ours vs the original, local echo_full at 10 ms and 256 streams, with one of the
# load generator's clients; the two servers alternate twice, 10 s each (docs/performance.md).
#   benchmarks/client_cmp.sh raw|aiohttp   (from the repository root; PY=<python> if not .venv/bin/python;
#   the original binary first: .venv/bin/python -m benchmarks.fetch_original)
set -u
cl=$1
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
for impl in original ours original ours; do
  port=$((18300 + RANDOM % 500))
  if [ $impl = original ]; then
    DYN_TOKEN_ECHO_DELAY_MS=10 benchmarks/.original/dynamo-run in=http out=echo_full --http-port $port --model-name m > $OUT/client_cmp-$impl.log 2>&1 &
  else
    DYN_TOKEN_ECHO_DELAY_MS=10 PYTHONPATH=src $PY -m dynamo.cli in=http out=echo_full --http-port $port --model-name m > $OUT/client_cmp-$impl.log 2>&1 &
  fi
  pid=$!
  for i in $(seq 50); do curl -s localhost:$port/v1/models >/dev/null && break; sleep 0.2; done
  $PY -m benchmarks.loadgen --url http://127.0.0.1:$port --model m -c 256 -d 10 --client $cl --pid $pid 2>&1 | grep -E "tokens/s|CPU s" | tr '\n' ' ' | sed "s/^/$cl $impl: /"; echo
  kill -INT $pid; wait $pid 2>/dev/null
done
