#!/usr/bin/env bash
# Pack a device call's result folder into one tarball under $OUT (the device returns at most 8 files per call and
# refuses large ones): every file of DIR except traces over MAX_MB (default 5; eager traces run 8-22 MB).
#   bash bench/gpu_pack.sh /tmp/work "$OUT/results.tgz" [MAX_MB]
set -euo pipefail
dir=$1 out=$2 max_mb=${3:-5}
cd "$dir"
find . -type f ! \( -name '*.trace.json.gz' -size +"${max_mb}"M \) -print0 | tar czf "$out" --null -T -
find . -type f -name '*.trace.json.gz' -size +"${max_mb}"M | while read -r f; do
  echo "left out (over ${max_mb} MB): $f"
done
